// The direct path, target side: this engine's registration table shared read-only with same-host
// initiators (table.hpp), the slots it grants them, the inbound statuses they leave in their
// slot's ring, and the epoch flip that lets deregistration wait for their copies.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "direct.hpp"
#include "log.hpp"
#include "sys.hpp"
#include "wire.hpp"

namespace mori::transfer {

// The shared registration table (table.hpp), sealed so that only this mapping can ever write it.
// Without it (no memfd, a kernel without F_SEAL_FUTURE_WRITE) the direct path is never granted.
void Engine::create_table() {
#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif
  auto no_table = [this](const char* what) {
    MORI_IO_LOG(20, "engine '%s': no shared registration table (same-host initiators use the socket): %s: %s",
                cfg_.key.c_str(), what, errno_text(errno).c_str());
  };
  Fd fd(int(::syscall(SYS_memfd_create, "mori-io-table", 1u /* MFD_CLOEXEC */ | 2u /* MFD_ALLOW_SEALING */)));
  if (!fd) return no_table("memfd_create");
  if (::ftruncate(fd.get(), off_t(kTableBytes)) != 0) return no_table("ftruncate");
  void* m = ::mmap(nullptr, kTableBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (m == MAP_FAILED) return no_table("mmap");
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL) != 0) {
    ::munmap(m, kTableBytes);
    return no_table("sealing it against other writers");
  }
  auto* h = static_cast<TableHeader*>(m);
  h->magic = kTableMagic;
  h->version = kTableVersion;
  h->entries = kTableEntries;
  h->slots = kTableSlots;
  h->ring_records = kRingRecords;
  h->entries_off = kEntriesOff;
  h->slot_bytes = kSlotBytes;
  h->total_bytes = kTableBytes;
  random_bytes(h->nonce, sizeof h->nonce);
  h->epoch.store(0);
  table_fd_ = std::move(fd);
  table_ = static_cast<uint8_t*>(m);
}

TableEntry* Engine::table_entry(uint64_t id) const {
  return reinterpret_cast<TableEntry*>(table_ + kEntriesOff) + id % kTableEntries;
}

int Engine::grant_slot(const std::string& key, const PeerCred& cred, DirectGrant* g, Fd* slot_fd) {
  if (!table_) return -1;
  std::lock_guard<std::mutex> lk(slot_mu_);
  for (uint32_t i = 0; i < kTableSlots; ++i) {
    SlotInfo& si = slots_[i];
    if (si.used) continue;
    // A released slot's memory stays mapped (its last holder still maps it too) until nothing is
    // in flight on it or its holder is gone; then it is unmapped and the index gets fresh memory.
    if (si.map) {
      if (!process_gone(si.pidfd.get()) && (si.map->busy[0].load(std::memory_order_seq_cst) != 0 ||
                                            si.map->busy[1].load(std::memory_order_seq_cst) != 0))
        continue;
      std::lock_guard<std::mutex> in(in_mu_);
      drain_slot_locked(i);  // what the last holder left
      ::munmap(si.map, kSlotBytes);
      si.map = nullptr;
      si.key.clear();
    }
    Fd fd(int(::syscall(SYS_memfd_create, "mori-io-slot", 1u /* MFD_CLOEXEC */)));
    if (!fd || ::ftruncate(fd.get(), off_t(kSlotBytes)) != 0) return -1;
    void* m = ::mmap(nullptr, kSlotBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    if (m == MAP_FAILED) return -1;
    auto* s = static_cast<TableSlot*>(m);  // zero-filled: head, tail, busy counters 0
    const uint64_t token = random_u64();
    s->owner.store(token, std::memory_order_seq_cst);
    {
      std::lock_guard<std::mutex> in(in_mu_);
      si.map = s;
      si.key = key;
    }
    si.pidfd.reset(::fcntl(cred.pidfd.get(), F_DUPFD_CLOEXEC, 0));
    si.used = true;
    std::memset(g, 0, sizeof *g);
    g->table_addr = reinterpret_cast<uint64_t>(table_);
    g->token = token;
    g->slot = i;
    std::memcpy(g->nonce, reinterpret_cast<TableHeader*>(table_)->nonce, 16);
    *slot_fd = std::move(fd);
    return int(i);
  }
  return -1;
}

// The connection that held the slot closed: its holder may not start anything new on it. The
// slot's memory and process handle go at once unless a copy is in flight (then at the next grant
// of this index): a holder increments busy before it reads the owner token, so once the token is
// cleared, a zero busy count here means no copy can still start.
void Engine::release_slot(int slot) {
  std::lock_guard<std::mutex> lk(slot_mu_);
  SlotInfo& si = slots_[size_t(slot)];
  si.used = false;
  if (!si.map) return;
  si.map->owner.store(0, std::memory_order_seq_cst);
  std::lock_guard<std::mutex> in(in_mu_);
  drain_slot_locked(uint32_t(slot));
  if (si.map->busy[0].load(std::memory_order_seq_cst) == 0 && si.map->busy[1].load(std::memory_order_seq_cst) == 0) {
    ::munmap(si.map, kSlotBytes);
    si.map = nullptr;
    si.key.clear();
    si.pidfd.reset();
  }
}

void Engine::drain_slot_locked(uint32_t i) {
  const SlotInfo& si = slots_[i];
  if (!si.map || si.key.empty()) return;
  TableSlot* s = si.map;
  uint64_t t = s->tail.load(std::memory_order_relaxed);
  uint64_t h = s->head.load(std::memory_order_acquire);
  if (h - t > kRingRecords) h = t + kRingRecords;  // never read past the ring, whatever the producer wrote
  for (; t != h; ++t) {
    NotifyRecord r = s->ring[t % kRingRecords];
    int code = r.code;
    if (code != SUCCESS && (code < ERR_INVALID_ARGS || code > ERR_GPU_OP)) code = ERR_BAD_STATE;
    record_inbound_locked(si.key, r.uid, std::max<uint32_t>(1, r.total_parts), code,
                          code == SUCCESS ? "" : "the initiator's direct copy failed (code " + std::to_string(code) + ")");
  }
  s->tail.store(t, std::memory_order_release);
}

void Engine::drain_slots() {
  if (!table_) return;
  std::lock_guard<std::mutex> in(in_mu_);
  for (uint32_t i = 0; i < kTableSlots; ++i) drain_slot_locked(i);
}

// Flips the epoch and waits until no copy that may have read the table before the flip is still
// running (table.hpp). False at the deadline (deadline < 0: none).
bool Engine::wait_copies(int64_t deadline) {
  if (!table_) return true;
  std::atomic_thread_fence(std::memory_order_seq_cst);
  std::lock_guard<std::mutex> g(dereg_mu_);
  auto* hdr = reinterpret_cast<TableHeader*>(table_);
  const uint64_t old = hdr->epoch.fetch_add(1, std::memory_order_seq_cst) & 1;
  for (int round = 0;; ++round) {
    bool idle = true;
    {
      std::lock_guard<std::mutex> lk(slot_mu_);
      for (uint32_t i = 0; i < kTableSlots && idle; ++i) {
        const SlotInfo& si = slots_[i];
        if (!si.map || si.map->busy[old].load(std::memory_order_seq_cst) == 0) continue;
        idle = process_gone(si.pidfd.get());  // a holder that died mid-copy copies nothing more
      }
    }
    if (idle) return true;
    if (deadline >= 0 && now_ms() > deadline) return false;
    if (round < 200)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

// Shutdown: nothing in the table stays reachable.
void Engine::retire_all() {
  if (!table_) return;
  {
    std::lock_guard<std::mutex> g(reg_mu_);
    for (auto& kv : regions_) {
      if (!kv.second->published) continue;
      table_write_entry(table_entry(kv.first), 0, EntryView{});
      kv.second->published = false;
    }
  }
  wait_copies(now_ms() + cfg_.cp_timeout_ms);
}

}  // namespace mori::transfer

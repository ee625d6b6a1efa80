// Direct: the initiator's view of a same-host peer's registration table (table.hpp), the fast
// path of engine.hpp ("Same-host peers, direct path").
#pragma once

#include <sys/mman.h>
#include <sys/types.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <ctime>
#include <memory>
#include <mutex>

#include "engine.hpp"
#include "sys.hpp"
#include "table.hpp"

namespace mori::transfer {

// Direct: the initiator's view of a same-host peer's registration table (table.hpp): the header
// and entries mapped read-only (the memfd is sealed: nothing else is possible), its own slot
// read-write, the peer's process (as the kernel named it for the Unix socket).

struct Direct {
  pid_t pid = 0;
  Fd pidfd;
  uint64_t token = 0;
  const uint8_t* table = nullptr;  // header + entries, PROT_READ
  uint8_t* slot_map = nullptr;     // the slot granted to this engine, PROT_READ | PROT_WRITE
  TableSlot* slot = nullptr;
  std::weak_ptr<Conn> conn0;  // carries the doorbell
  std::atomic<bool> ok{true};
  std::mutex ring_mu;
  uint64_t rung_at = 0;  // ring head when the doorbell last rang

  ~Direct() {
    if (table) ::munmap(const_cast<uint8_t*>(table), kTableBytes);
    if (slot_map) ::munmap(slot_map, kSlotBytes);
  }
  const TableHeader* header() const { return reinterpret_cast<const TableHeader*>(table); }
  const TableEntry* entry(uint64_t id) const {
    return reinterpret_cast<const TableEntry*>(table + kEntriesOff) + id % kTableEntries;
  }
  // Still the process that granted the slot (a pid is reused only after its process is gone).
  // Asked of the pidfd at most once a millisecond: the poll is a system call, ~7% of a post of
  // 128 blocks without copy. In between, a copy to a process that just died fails with ESRCH,
  // and the pid cannot have been reused yet: Linux hands out pids in turn, so reuse needs about
  // pid_max new processes (32768 by default, 4194304 on most 64-bit systems) since the check.
  bool alive() const {
    timespec ts;
    ::clock_gettime(CLOCK_MONOTONIC, &ts);
    const int64_t now = int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
    if (now - alive_at.load(std::memory_order_relaxed) < kAliveRecheckNs) return true;
    if (process_gone(pidfd.get())) return false;
    alive_at.store(now, std::memory_order_relaxed);
    return true;
  }
  static constexpr int64_t kAliveRecheckNs = 1000000;
  mutable std::atomic<int64_t> alive_at{INT64_MIN / 2};  // CLOCK_MONOTONIC ns of the last check that saw it alive
};

}  // namespace mori::transfer

// The registration table an engine publishes to same-host initiators, and the slots it grants them.
//
// Why: between two processes of one host an initiator can move bytes itself with cross-memory
// attach (process_vm_readv/writev), with no request and reply over the socket per transfer. The
// table keeps the owner in charge of what is reachable: the initiator checks every block against
// the entry the *owner* wrote (never against the descriptor it was handed), and the owner retires
// an entry before deregister_memory returns.
//
// Who gets them: only an authenticated initiator on this engine's Unix socket, whose process the
// kernel names (SO_PEERCRED); the descriptors travel over that socket (SCM_RIGHTS), nothing is
// opened through /proc. The initiator learns the owner's pid the same way, never from a message.
//
// Memory (memfds, owner-created):
//   table        TableHeader (a nonce, the epoch) and kTableEntries x TableEntry. The owner maps it
//                read-write, then seals it against every future writer (F_SEAL_FUTURE_WRITE): an
//                initiator can map it read-only and nothing else, so no initiator can rewrite an
//                entry, the epoch, or another initiator's view. Region id `id` lives at index
//                id % kTableEntries (ids are chosen so that index is free; when the table is full a
//                region is not published and transfers on it take the socket path).
//   slot         one TableSlot per grant, a memfd of its own, created for that grant and shared with
//                that initiator alone (the owner closes its descriptor once mapped): its busy
//                counters and its ring of inbound statuses. A slot's memory is never handed to a
//                second initiator; a released slot is unmapped once nothing is in flight on it.
//
// Entries: a seqlock per entry (odd `seq` while the owner rewrites it). Retired entries have id 0.
//
// In-flight copies (the deregistration protocol): an initiator reads the epoch, increments
// busy[epoch & 1] of its slot, then (after a full fence) reads the entry, checks the blocks,
// copies, and decrements the same counter. deregister_memory retires the entry, fences, flips the
// epoch and waits until busy[old & 1] of every slot is 0 (or its owner process is gone). Whichever
// of "initiator's increment" and "owner's check" comes first in the single total order of these
// seq_cst operations: either the owner waits for the copy, or the initiator sees the retired entry
// and moves no byte. So no byte of a region is touched after deregister_memory returns.
//
// Inbound statuses: the initiator appends {uid, parts, code} to its slot's ring (single producer:
// one engine, serialised by a mutex) *before* it completes its own status, so a target that pops
// after the initiator saw success finds it, as with the socket path. The target drains the ring
// when asked (pop_inbound_transfer_status, counters), every 200 ms from the connection's thread,
// and when the initiator rings the doorbell (a kNotify message once the ring is half full; a
// record that finds the ring full travels inside such a message), and credits every record to the
// key the slot's connection authenticated.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace mori::transfer {

constexpr uint64_t kTableMagic = 0x314c4254494f524dull;  // "MROITBL1"
constexpr uint32_t kTableVersion = 3;  // 3: slots in memfds of their own, passed over the Unix socket
constexpr uint32_t kTableEntries = 16384;
constexpr uint32_t kTableSlots = 128;
constexpr uint32_t kRingRecords = 4096;
constexpr size_t kTablePage = 4096;

// TableEntry::huge_lo/huge_hi: the part of the region [huge_lo, huge_hi) (absolute addresses, 2 MiB
// aligned; equal when none) that the owner backed with transparent huge pages at registration.
// process_vm_readv/writev pins the target's pages there 2 MiB at a time instead of one page-table
// lock per 4 KiB page, so the initiator may cut smaller transfers over several threads without
// their pinning contending on that lock. Only that part: the head and tail of a region not
// aligned to 2 MiB stay on 4 KiB pages, where cutting a transfer makes it slower. A hint for
// speed only (the kernel may split the pages later).
struct alignas(64) TableEntry {
  std::atomic<uint64_t> seq;
  std::atomic<uint64_t> id;  // 0: free or retired
  std::atomic<uint64_t> addr;
  std::atomic<uint64_t> size;
  std::atomic<uint64_t> huge_lo;
  std::atomic<uint64_t> huge_hi;
};

// One consistent read of an entry.
struct EntryView {
  uint64_t addr = 0, size = 0, huge_lo = 0, huge_hi = 0;
};

struct TableHeader {
  uint64_t magic;
  uint32_t version, entries, slots, ring_records;
  uint64_t entries_off, slot_bytes, total_bytes;
  uint8_t nonce[16];
  alignas(64) std::atomic<uint64_t> epoch;
};

#pragma pack(push, 1)
struct NotifyRecord {  // also the body of a kNotify message (any number of them)
  uint64_t uid;
  int32_t code;
  uint32_t total_parts;
};
#pragma pack(pop)
static_assert(sizeof(NotifyRecord) == 16, "notification record is 16 bytes");

struct TableSlot {
  alignas(64) std::atomic<uint64_t> owner;  // token of the initiator engine holding it; 0: released
  alignas(64) std::atomic<uint64_t> busy[2];
  alignas(64) std::atomic<uint64_t> head;   // written by the initiator
  alignas(64) std::atomic<uint64_t> tail;   // written by the owner
  alignas(64) NotifyRecord ring[kRingRecords];
};

constexpr size_t round_page(size_t n) { return (n + kTablePage - 1) / kTablePage * kTablePage; }
constexpr size_t kEntriesOff = kTablePage;
constexpr size_t kTableBytes = kEntriesOff + round_page(sizeof(TableEntry) * kTableEntries);
constexpr size_t kSlotBytes = round_page(sizeof(TableSlot));
static_assert(sizeof(TableHeader) <= kTablePage, "header fits in a page");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared atomics must be lock free");

#pragma pack(push, 1)
// What the owner grants in its HELLO answer (3rd string of a kHelloAck with kFlagDirect; the
// table's memfd and the slot's memfd travel with that message, in this order).
struct DirectGrant {
  uint64_t table_addr;  // where the owner maps the table (the initiator's attach probe reads the nonce there)
  uint64_t token;       // the slot's owner token
  uint32_t slot;
  uint32_t reserved;
  uint8_t nonce[16];    // the table's nonce (TableHeader::nonce)
};
#pragma pack(pop)
static_assert(sizeof(DirectGrant) == 40, "grant is 40 bytes");

// Owner side: rewrite an entry under its seqlock (callers serialise writers).
inline void table_write_entry(TableEntry* e, uint64_t id, const EntryView& v) {
  uint64_t s = e->seq.load(std::memory_order_relaxed);
  e->seq.store(s + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  e->id.store(id, std::memory_order_relaxed);
  e->addr.store(v.addr, std::memory_order_relaxed);
  e->size.store(v.size, std::memory_order_relaxed);
  e->huge_lo.store(v.huge_lo, std::memory_order_relaxed);
  e->huge_hi.store(v.huge_hi, std::memory_order_relaxed);
  e->seq.store(s + 2, std::memory_order_release);
}

// Initiator side: a consistent snapshot of entry `id`; false if the entry holds another id (not
// published, retired) or the owner kept rewriting it.
inline bool table_read_entry(const TableEntry* e, uint64_t id, EntryView* out) {
  for (int tries = 0; tries < 10000; ++tries) {
    uint64_t s1 = e->seq.load(std::memory_order_acquire);
    if (s1 & 1) continue;
    uint64_t eid = e->id.load(std::memory_order_relaxed);
    EntryView v;
    v.addr = e->addr.load(std::memory_order_relaxed);
    v.size = e->size.load(std::memory_order_relaxed);
    v.huge_lo = e->huge_lo.load(std::memory_order_relaxed);
    v.huge_hi = e->huge_hi.load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (e->seq.load(std::memory_order_relaxed) != s1) continue;
    if (eid != id || id == 0) return false;
    *out = v;
    return true;
  }
  return false;
}

}  // namespace mori::transfer

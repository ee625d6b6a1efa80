// The direct path, initiator side (engine.hpp, "Same-host peers, direct path"): the peer's granted
// table mapped and proven (open_direct), then each transfer checked against the entry the target
// wrote and copied by this process with process_vm_readv/writev, large ones in parallel pieces.
#include <sys/stat.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <system_error>
#include <thread>

#include "conn.hpp"
#include "copy_pool.hpp"
#include "direct.hpp"
#include "log.hpp"
#include "wire.hpp"

namespace mori::transfer {

namespace {
bool refused_errno(int e) { return e == EPERM || e == EACCES || e == ENOSYS; }
}  // namespace

// Maps the peer's table (read-only: it is sealed) and this engine's slot, checks they are the ones
// the peer granted, and proves attach works on the peer's process (reads the table's nonce through
// process_vm_readv). nullptr (with the reason) if anything is refused: the caller keeps the
// target-side path.
std::shared_ptr<Direct> Engine::open_direct(const DirectGrant& g, std::vector<Fd>& fds, PeerCred cred,
                                            const std::shared_ptr<Conn>& conn0, std::string* why) {
  if (test.refuse_direct) {
    *why = "test mode: attach refused";
    return nullptr;
  }
  if (fds.size() != 2) {
    *why = "the grant came without the table's and the slot's descriptors";
    return nullptr;
  }
  if (g.slot >= kTableSlots) {
    *why = "bad slot in the grant";
    return nullptr;
  }
  struct stat st1 {}, st2 {};
  if (::fstat(fds[0].get(), &st1) != 0 || uint64_t(st1.st_size) < kTableBytes || ::fstat(fds[1].get(), &st2) != 0 ||
      uint64_t(st2.st_size) < kSlotBytes) {
    *why = "the peer's table or slot has the wrong size";
    return nullptr;
  }
  auto d = std::make_shared<Direct>();
  d->pid = cred.pid;
  d->pidfd = std::move(cred.pidfd);
  d->token = g.token;
  void* ro = ::mmap(nullptr, kTableBytes, PROT_READ, MAP_SHARED, fds[0].get(), 0);
  if (ro != MAP_FAILED) d->table = static_cast<const uint8_t*>(ro);
  void* rw = ::mmap(nullptr, kSlotBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fds[1].get(), 0);
  if (rw != MAP_FAILED) d->slot_map = static_cast<uint8_t*>(rw);
  if (!d->table || !d->slot_map) {
    *why = "cannot map the peer's table or slot: " + errno_text(errno);
    return nullptr;
  }
  d->slot = reinterpret_cast<TableSlot*>(d->slot_map);
  const TableHeader* h = d->header();
  if (h->magic != kTableMagic || h->version != kTableVersion || h->entries != kTableEntries ||
      h->slots != kTableSlots || h->ring_records != kRingRecords || h->entries_off != kEntriesOff ||
      h->slot_bytes != kSlotBytes || std::memcmp(h->nonce, g.nonce, 16) != 0) {
    *why = "the table passed is not the one the peer granted";
    return nullptr;
  }
  const uint64_t nonce_off = uint64_t(reinterpret_cast<uintptr_t>(h->nonce) - reinterpret_cast<uintptr_t>(h));
  uint8_t got[16];
  iovec l{got, 16}, r{reinterpret_cast<void*>(g.table_addr + nonce_off), 16};
  ssize_t n = ::process_vm_readv(d->pid, &l, 1, &r, 1, 0);
  if (n != 16 || std::memcmp(got, g.nonce, 16) != 0) {
    *why = n < 0 ? "process_vm_readv: " + errno_text(errno) : "the peer's process does not map the table it granted";
    return nullptr;
  }
  if (d->slot->owner.load() != g.token) {
    *why = "the slot was not granted to this engine";
    return nullptr;
  }
  d->conn0 = conn0;
  return d;
}

namespace {
// Smallest piece worth a second thread (TcpConfig::cma_split_bytes, MORI_IO_CMA_SPLIT_BYTES, when
// set): a transfer is cut only into pieces at least this large, so it is cut from twice this size.
// Target memory on 4 KiB pages: 64 KiB. There one core copies at ~25 GB/s at best (the kernel pins
// and maps every 4 KiB page of the target on its own), the memcpy ceiling that a single-threaded
// copier (UCX's CMA) shares. `mori bench io --buffers pages` on this 2-vCPU VM, the same runs A/B,
// MORI_IO_CMA_SPLIT_BYTES 1 MiB (the old default) against a smaller piece: 128 KiB 7.7-8.9 ->
// 8.6-12.4 GB/s, 512 KiB 7.6-8.6 -> 8.6-12.4, 1 MiB 8.0-9.2 -> 9.0-12.8 (NIXL beside them 7.5-9);
// but 64 KiB cut in two 32 KiB pieces lost on a quiet machine (7.9 -> 6.5 GB/s: the hand-off costs
// about what the second half's copy saves), so pieces stay at 64 KiB or more. A C probe here
// (process_vm_writev into a 4 KiB-page process, one thread against two) found no page-table lock
// contention that outweighs the second core: 128 KiB 16.0 -> 20.4 GB/s, 512 KiB 9.1 -> 14.3,
// 1 MiB 9.1 -> 12.7. On huge pages: 256 KiB (measured here, 2 threads: 512 KiB 21.5 -> 14.6 us,
// 1 MiB 94 -> 24 us, each core's cache then holding its half of both buffers).
constexpr uint64_t kSplitMinDefault = 64u << 10;
constexpr uint64_t kSplitMinHuge = 256u << 10;

uint64_t split_min(bool huge, uint64_t configured) {
  return configured ? std::max<uint64_t>(configured, kSplitMinFloor) : huge ? kSplitMinHuge : kSplitMinDefault;
}

// The CPU count, at most 4, read once: std::thread::hardware_concurrency() opens and reads
// /sys/devices/system/cpu/online on every call (three system calls, ~2 us here).
int auto_copy_threads() {
  static const int v = int(std::min(4u, std::max(1u, std::thread::hardware_concurrency())));
  return v;
}
}  // namespace

// Copies matching iovec lists, cut into pieces of about equal size run in parallel (the calling
// thread copies the first) when the transfer is large. Returns 0 or the first errno.
int Engine::copy_parallel(bool pull, pid_t pid, std::vector<iovec>& local, std::vector<iovec>& remote,
                          uint64_t total, bool huge, int threads, uint64_t split_bytes) {
  const uint64_t k0 = total / split_min(huge, split_bytes);
  if (k0 <= 1) return cma_copy_in_place(pull, pid, local, remote);
  if (threads <= 0) threads = auto_copy_threads();
  threads = std::min(threads, kMaxCmaThreads);
  const uint64_t k = std::min<uint64_t>(uint64_t(threads), k0);
  if (k <= 1) return cma_copy_in_place(pull, pid, local, remote);
  std::shared_ptr<CopyPool> pool;  // held for this call: a pool replaced meanwhile stays alive until it returns
  {
    std::lock_guard<std::mutex> g(pool_mu_);
    if (shut_.load()) return cma_copy_in_place(pull, pid, local, remote);  // shut down: no new threads
    if (!pool_ || pool_->workers() < threads - 1) {
      pool_.reset();
      try {
        pool_ = std::make_shared<CopyPool>(threads - 1, cfg_.manners);
      } catch (const std::system_error&) {  // no threads to be had: copy on this one
        thread_failures.fetch_add(1);
        return cma_copy_in_place(pull, pid, local, remote);
      }
    }
    pool = pool_;
  }
  direct_split.fetch_add(1, std::memory_order_relaxed);
  struct Piece {
    std::vector<iovec> l, r;
  };
  std::vector<Piece> pieces(k);
  const uint64_t per = (total + k - 1) / k;
  size_t i = 0;
  uint64_t at = 0;  // bytes of local[i] already assigned
  for (uint64_t p = 0; p < k; ++p) {
    uint64_t want = p + 1 == k ? ~uint64_t(0) : per;
    while (want > 0 && i < local.size()) {
      uint64_t take = std::min<uint64_t>(want, local[i].iov_len - at);
      if (take) {
        pieces[p].l.push_back({static_cast<char*>(local[i].iov_base) + at, take});
        pieces[p].r.push_back({static_cast<char*>(remote[i].iov_base) + at, take});
      }
      at += take;
      want -= take;
      if (at == local[i].iov_len) {
        ++i;
        at = 0;
      }
    }
  }
  // Pieces are claimed, not assigned: the posting thread copies the first, then claims whatever
  // no worker has started yet, and waits only for pieces a worker is copying. A worker that the
  // scheduler does not run soon (other processes on every core) costs nothing but the split; and
  // no piece is started after this returns, so the caller's busy counter covers every copy.
  struct Job {
    std::vector<Piece> pieces;
    std::atomic<size_t> next{1};  // piece 0 is the poster's
    std::atomic<size_t> left{0};  // pieces not finished
    std::atomic<int> err{0};
    std::mutex mu;
    std::condition_variable cv;
    bool pull = false;
    pid_t pid = 0;
    void copy(size_t i) {
      int e = cma_copy(pull, pid, std::move(pieces[i].l), std::move(pieces[i].r));
      if (e) {
        int zero = 0;
        err.compare_exchange_strong(zero, e);
      }
      std::lock_guard<std::mutex> g(mu);
      if (left.fetch_sub(1) == 1) cv.notify_all();
    }
    void drain() {
      for (size_t i; (i = next.fetch_add(1)) < pieces.size();) copy(i);
    }
  };
  auto job = std::make_shared<Job>();
  job->pieces = std::move(pieces);
  job->left = job->pieces.size();
  job->pull = pull;
  job->pid = pid;
  for (uint64_t p = 1; p < k; ++p) pool->run([job] { job->drain(); });
  job->copy(0);
  job->drain();
  for (int spin = 0; spin < 2000 && job->left.load() > 0; ++spin) std::this_thread::yield();
  {
    std::unique_lock<std::mutex> g(job->mu);
    job->cv.wait(g, [&] { return job->left.load() == 0; });
  }
  return job->err.load();
}

namespace {
// Appends an inbound status to the slot's ring (the target reads it there), or sends it with the
// doorbell when the ring is full; rings the doorbell when the ring is half full.
void push_record(Direct& d, uint64_t uid, int code, std::shared_ptr<Conn>* bell, std::vector<uint8_t>* bell_body) {
  NotifyRecord rec{uid, code, 1};
  std::lock_guard<std::mutex> g(d.ring_mu);
  TableSlot* s = d.slot;
  uint64_t h = s->head.load(std::memory_order_relaxed), t = s->tail.load(std::memory_order_acquire);
  if (h - t >= kRingRecords) {
    const auto* p = reinterpret_cast<const uint8_t*>(&rec);
    bell_body->assign(p, p + sizeof rec);
    *bell = d.conn0.lock();
    return;
  }
  s->ring[h % kRingRecords] = rec;
  s->head.store(h + 1, std::memory_order_release);
  if (h + 1 - t >= kRingRecords / 2 && h + 1 - d.rung_at >= kRingRecords / 2) {
    d.rung_at = h + 1;
    *bell = d.conn0.lock();
  }
}
}  // namespace

bool Engine::direct_post(Direct& d, const std::string& peer_key, uint16_t op, uint64_t remote_id,
                         const std::vector<Seg>& segs, uint64_t uid, bool notify, const TcpConfig& tcp,
                         const StatusPtr& st) {
  if (!d.alive()) {
    d.ok = false;
    return false;  // the socket path reports the peer's state
  }
  // Announce the copy before reading the table (table.hpp: the deregistration protocol).
  const uint64_t e = d.header()->epoch.load(std::memory_order_seq_cst) & 1;
  d.slot->busy[e].fetch_add(1, std::memory_order_seq_cst);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  struct Busy {
    Direct& d;
    uint64_t e;
    ~Busy() { d.slot->busy[e].fetch_sub(1, std::memory_order_seq_cst); }
  };
  std::shared_ptr<Conn> bell;
  std::vector<uint8_t> bell_body;
  int code = SUCCESS;
  std::string msg;
  {
    Busy busy{d, e};
    if (d.slot->owner.load(std::memory_order_seq_cst) != d.token) {  // the target released the slot
      d.ok = false;
      return false;
    }
    EntryView ent;
    if (!table_read_entry(d.entry(remote_id), remote_id, &ent))
      return false;  // not published (GPU memory, unknown, retired, table full): the target decides
    const uint64_t raddr = ent.addr, rsize = ent.size;
    uint64_t total = 0, on_huge = 0;
    for (const Seg& s : segs) {
      if (s.off > rsize || s.len > rsize - s.off) {
        code = ERR_INVALID_ARGS;
        msg = "offset " + std::to_string(s.off) + " + size " + std::to_string(s.len) +
              " is outside memory region " + std::to_string(remote_id) + " of engine '" + peer_key + "' (" +
              std::to_string(rsize) + " bytes, per its own registration table)";
        break;
      }
      total += s.len;
      const uint64_t lo = std::max(raddr + s.off, ent.huge_lo), hi = std::min(raddr + s.off + s.len, ent.huge_hi);
      if (hi > lo) on_huge += hi - lo;
    }
    if (code == SUCCESS && test.direct_delay_ms > 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(int64_t(test.direct_delay_ms)));
    if (code == SUCCESS && total > 0) {
      // Per-thread lists: a post of a few blocks then allocates nothing (kept small, see below).
      static thread_local std::vector<iovec> mine, theirs;
      mine.clear();
      theirs.clear();
      for (const Seg& s : segs) {
        mine.push_back({reinterpret_cast<void*>(s.addr), s.len});
        theirs.push_back({reinterpret_cast<void*>(raddr + s.off), s.len});
      }
      // Pieces on huge pages when at most an eighth of the bytes lie on the region's 4 KiB head or tail.
      const bool huge = (total - on_huge) * 8 <= total;
      int err = copy_parallel(op == kRead, d.pid, mine, theirs, total, huge, tcp.cma_threads, tcp.cma_split_bytes);
      if (mine.capacity() > 4096) {  // a huge batch does not keep its lists for ever
        std::vector<iovec>().swap(mine);
        std::vector<iovec>().swap(theirs);
      }
      if (refused_errno(err)) {  // the OS said no after all: the target-side path takes over
        d.ok = false;
        direct_refused.fetch_add(1);
        MORI_IO_LOG(20, "peer '%s': direct attach refused (%s); the target moves the bytes", peer_key.c_str(),
                    errno_text(err).c_str());
        return false;
      }
      if (err == ESRCH) {
        code = ERR_BAD_STATE;
        msg = "peer '" + peer_key + "': its process is gone";
      } else if (err != 0) {
        code = ERR_INVALID_ARGS;
        msg = "cross-memory attach to '" + peer_key + "' failed: " + errno_text(err);
      }
    }
    if (code == SUCCESS) direct_copies.fetch_add(1, std::memory_order_relaxed);
    // The target learns of the transfer before the initiator does (as on the socket path).
    if (notify) push_record(d, uid, code, &bell, &bell_body);
  }
  st->complete(code, msg);
  if (bell) bell->oneway(std::move(bell_body));
  return true;
}

}  // namespace mori::transfer

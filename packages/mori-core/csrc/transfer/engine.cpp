// See engine.hpp for the design. Everything here runs without the GIL. The target side (listeners,
// handshake, serving requests) is in server.cpp, the wire helpers in wire.cpp.
#include "engine.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <stdexcept>
#include <system_error>

#include "auth.hpp"
#include "log.hpp"
#include "wire.hpp"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

namespace mori::transfer {

namespace {

// Engine threads may ask the scheduler for a short time slice (Manners::short_slice, off by default:
// Linux >= 6.12, EEVDF custom slices: sched_attr.sched_runtime on a SCHED_OTHER thread; no
// privilege needed). A thread with a short
// slice preempts a busy-polling neighbour when it wakes, instead of waiting out the neighbour's
// slice (a scheduler tick, ~4 ms): without it, one NIXL agent per process (its progress thread
// spins on a core) made every 4 KiB transfer on a 2-core machine take ~4 ms. Older kernels
// ignore the field or refuse the call; either way nothing else changes.
struct SchedAttr {
  uint32_t size;
  uint32_t sched_policy;
  uint64_t sched_flags;
  int32_t sched_nice;
  uint32_t sched_priority;
  uint64_t sched_runtime;
  uint64_t sched_deadline;
  uint64_t sched_period;
};

// Sets this thread's slice; returns the attributes to restore, or size 0 if nothing was changed
// (not a SCHED_OTHER thread, or a kernel without sched_setattr).
SchedAttr set_slice(uint64_t runtime_ns) {
  SchedAttr old{};
  if (::syscall(SYS_sched_getattr, 0, &old, sizeof old, 0) != 0 || old.sched_policy != 0) return SchedAttr{};
  SchedAttr attr = old;
  attr.size = sizeof attr;  // SCHED_ATTR_SIZE_VER0 (48 bytes)
  attr.sched_runtime = runtime_ns;
  if (::syscall(SYS_sched_setattr, 0, &attr, 0) != 0) return SchedAttr{};
  old.size = sizeof old;
  return old;
}

}  // namespace

void request_short_slice() { set_slice(100 * 1000); }  // 0.1 ms, the shortest the kernel accepts

bool move_off_cpu(pid_t tid, int cpu) {
  cpu_set_t allowed;
  if (cpu < 0 || cpu >= CPU_SETSIZE || ::sched_getaffinity(tid, sizeof allowed, &allowed) != 0) return false;
  cpu_set_t others = allowed;
  CPU_CLR(cpu, &others);
  // The thread leaves the CPU inside the first call; the second gives its mask back as it was.
  if (CPU_COUNT(&others) == 0 || ::sched_setaffinity(tid, sizeof others, &others) != 0) return false;
  ::sched_setaffinity(tid, sizeof allowed, &allowed);
  return true;
}

namespace {

int pidfd_open(pid_t pid) { return int(::syscall(SYS_pidfd_open, pid, 0)); }

// A pidfd becomes readable when its process has exited.
bool process_gone(int pidfd) {
  if (pidfd < 0) return false;
  pollfd p{pidfd, POLLIN, 0};
  return ::poll(&p, 1, 0) > 0;
}

uint64_t random_u64() {
  uint64_t v = 0;
  while (v == 0) random_bytes(&v, sizeof v);
  return v;
}

bool refused_errno(int e) { return e == EPERM || e == EACCES || e == ENOSYS; }


}  // namespace

// Device blocks -> one host buffer (to_host), or one host buffer -> device blocks (from_host).
int stage_out(const DeviceCopier& c, const std::vector<iovec>& dev, int device, uint8_t* buf) {
  uint64_t off = 0;
  for (const iovec& v : dev) {
    if (v.iov_len) {
      int rc = c.to_host(c.ctx, buf + off, reinterpret_cast<uintptr_t>(v.iov_base), v.iov_len, device);
      if (rc != 0) return rc;
    }
    off += v.iov_len;
  }
  return 0;
}

int stage_in(const DeviceCopier& c, const std::vector<iovec>& dev, int device, const uint8_t* buf) {
  uint64_t off = 0;
  for (const iovec& v : dev) {
    if (v.iov_len) {
      int rc = c.from_host(c.ctx, reinterpret_cast<uintptr_t>(v.iov_base), buf + off, v.iov_len, device);
      if (rc != 0) return rc;
    }
    off += v.iov_len;
  }
  return 0;
}

uint64_t iov_bytes(const std::vector<iovec>& v) {
  uint64_t n = 0;
  for (const iovec& x : v) n += x.iov_len;
  return n;
}

std::atomic<int> g_log_level{30};

void set_log_level(int level) { g_log_level.store(level); }
int log_level() { return g_log_level.load(); }

// ---------------------------------------------------------------------------------------------
// Status

std::string Status::message() {
  std::lock_guard<std::mutex> g(mu_);
  return msg_;
}

void Status::set_in_progress() {
  int expected = INIT;
  code_.compare_exchange_strong(expected, IN_PROGRESS);
}

bool Status::complete(int code, const std::string& message) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (done()) return false;
    msg_ = message;
    code_.store(code, std::memory_order_release);
  }
  cv_.notify_all();
  return true;
}

bool Status::wait_for(int64_t timeout_ms) {
  if (done()) return true;
  if (waiter_) return waiter_->wait(*this, timeout_ms);
  return wait_plain(timeout_ms);
}

bool Status::wait_plain(int64_t timeout_ms) {
  if (done()) return true;
  if (timeout_ms == 0) return false;
  // A short spin catches small transfers on loopback without a futex sleep.
  for (int i = 0; i < 200; ++i) {
    if (done()) return true;
    std::this_thread::yield();
  }
  std::unique_lock<std::mutex> g(mu_);
  if (timeout_ms < 0) {
    cv_.wait(g, [this] { return done(); });
    return true;
  }
  return cv_.wait_for(g, std::chrono::milliseconds(timeout_ms), [this] { return done(); });
}

int wait_all(const std::vector<StatusPtr>& statuses, int64_t timeout_ms) {
  int64_t deadline = timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
  int first_fail = SUCCESS;
  for (const auto& s : statuses) {
    int64_t left = deadline < 0 ? -1 : std::max<int64_t>(0, deadline - now_ms());
    if (!s->wait_for(left)) return IN_PROGRESS;
    if (s->code() != SUCCESS && first_fail == SUCCESS) first_fail = s->code();
  }
  return first_fail;
}

// ---------------------------------------------------------------------------------------------
// Transfer: the initiator's bookkeeping, shared by its parts; holds the local region pinned.

struct Transfer {
  Engine* eng = nullptr;
  StatusPtr st;
  RegionPtr local;
  std::shared_ptr<uint64_t> result;  // an atomic's old value, set before its part completes
  std::atomic<uint32_t> remaining{0};
  std::mutex mu;
  int fail_code = SUCCESS;
  std::string fail_msg;

  ~Transfer() {
    if (local) eng->unpin(local);
  }
  void part_done(int code, const std::string& msg) {
    if (code != SUCCESS) {
      std::lock_guard<std::mutex> g(mu);
      if (fail_code == SUCCESS) {
        fail_code = code;
        fail_msg = msg;
      }
    }
    if (remaining.fetch_sub(1) == 1) {
      std::lock_guard<std::mutex> g(mu);
      st->complete(fail_code, fail_msg);
    }
  }
};

// ---------------------------------------------------------------------------------------------
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

// A few threads that copy pieces of one large direct transfer while the posting thread copies
// the first piece. After a piece a worker spins briefly before sleeping: stop-and-wait transfers
// come back to back, and a futex wake-up costs more than the spin.
//
// A worker is of use only on another CPU than the poster's. The scheduler may wake it onto the
// poster's CPU (when the other CPUs were busy for that moment) and then leave both there: two
// threads that never sleep are "cache hot", the load balancer does not move them, and the worker
// waits for the poster's slice (milliseconds) before it runs at all. Seen on the 2-vCPU CI
// machine: whole repetitions of 256 transfers of 512 KiB in which the worker sat on the poster's
// CPU and copied no piece (28-32 GB/s), against 42-47 GB/s when it ran beside it. So a poster
// that finds a worker last seen on its own CPU may move it to another CPU it may run on
// (move_off_cpu), at most once a millisecond per pool: only when the user asked for it
// (Manners::move_copy_threads), since it rewrites a thread's affinity.
constexpr int64_t kPoolSpinUs = 200;  // waking an idle (v)CPU through a futex costs tens of microseconds
constexpr int64_t kPoolMoveEveryNs = 1000000;

class CopyPool {
 public:
  // Throws std::system_error if a thread cannot be created (the threads made so far are stopped).
  CopyPool(int workers, const Manners& manners) : move_(manners.move_copy_threads) {
    for (int i = 0; i < workers; ++i) workers_.push_back(std::make_unique<Worker>());
    const bool slice = manners.short_slice;
    try {
      for (auto& w : workers_)
        w->th = std::thread([this, w = w.get(), slice] {
          w->tid.store(pid_t(::syscall(SYS_gettid)), std::memory_order_release);
          if (slice) request_short_slice();
          loop(*w);
        });
    } catch (...) {
      stop_all();
      throw;
    }
  }
  ~CopyPool() { stop_all(); }
  int workers() const { return int(workers_.size()); }
  int64_t moves() const { return moves_.load(std::memory_order_relaxed); }
  void run(std::function<void()> f) {
    if (move_) move_workers_off(::sched_getcpu());
    {
      std::lock_guard<std::mutex> g(mu_);
      q_.push_back(std::move(f));
      queued_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_one();
  }

 private:
  struct Worker {
    std::thread th;
    std::atomic<pid_t> tid{0};
    std::atomic<int> cpu{-1};  // where it last ran
  };
  void stop_all() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& w : workers_)
      if (w->th.joinable()) w->th.join();
  }
  void move_workers_off(int cpu) {
    for (auto& w : workers_) {
      if (cpu < 0 || w->cpu.load(std::memory_order_relaxed) != cpu) continue;
      const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                              std::chrono::steady_clock::now().time_since_epoch())
                              .count();
      if (now < next_move_ns_.load(std::memory_order_relaxed)) return;
      next_move_ns_.store(now + kPoolMoveEveryNs, std::memory_order_relaxed);
      const pid_t tid = w->tid.load(std::memory_order_acquire);
      if (tid == 0) continue;  // not started yet (0 would name the poster itself)
      if (move_off_cpu(tid, cpu)) {
        w->cpu.store(-1, std::memory_order_relaxed);
        moves_.fetch_add(1, std::memory_order_relaxed);
      }
    }
  }
  void loop(Worker& w) {
    for (;;) {
      auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(kPoolSpinUs);
      while (queued_.load(std::memory_order_acquire) == 0 && !stop_.load() &&
             std::chrono::steady_clock::now() < spin_until) {
        w.cpu.store(::sched_getcpu(), std::memory_order_relaxed);
        std::this_thread::yield();
      }
      std::function<void()> f;
      {
        std::unique_lock<std::mutex> g(mu_);
        cv_.wait(g, [this] { return stop_.load() || !q_.empty(); });
        if (q_.empty()) return;  // stopping
        f = std::move(q_.front());
        q_.pop_front();
        queued_.fetch_sub(1, std::memory_order_relaxed);
      }
      w.cpu.store(::sched_getcpu(), std::memory_order_relaxed);
      f();
    }
  }
  const bool move_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::atomic<int64_t> next_move_ns_{0};
  std::atomic<int64_t> moves_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> q_;
  std::atomic<int> queued_{0};
  std::atomic<bool> stop_{false};
};

// ---------------------------------------------------------------------------------------------
// Conn: one outbound connection to a peer.

class Conn : public std::enable_shared_from_this<Conn> {
 public:
  Conn(Engine* eng, Peer* peer, Fd fd) : eng_(eng), peer_(peer), fd_(std::move(fd)) {
    last_progress_.store(now_ms());
    last_used_.store(now_ms());
  }
  ~Conn() { close(); }
  int fd() const { return fd_.get(); }

  // Starts the two threads; false (with the reason) if the system would not create them.
  bool start(std::string* why) {
    // An exception escaping a thread would terminate the process (std::bad_alloc of a staging
    // buffer, say): it breaks this connection instead.
    const bool slice = eng_->manners().short_slice;
    try {
      tx_ = std::thread([this, slice] {
        if (slice) request_short_slice();
        try {
          tx_loop();
        } catch (const std::exception& e) {
          fail(std::string("sender thread: ") + e.what());
        } catch (...) {
          fail("sender thread: unknown exception");
        }
      });
      rx_ = std::thread([this, slice] {
        if (slice) request_short_slice();
        try {
          rx_loop();
        } catch (const std::exception& e) {
          fail(std::string("receiver thread: ") + e.what());
        } catch (...) {
          fail("receiver thread: unknown exception");
        }
      });
    } catch (const std::system_error& e) {
      eng_->thread_failures.fetch_add(1);
      *why = std::string("cannot start the connection's threads: ") + e.what();
      fail(*why);
      return false;
    }
    return true;
  }
  bool broken() const { return broken_.load(); }
  // No request in flight or queued, and nothing carried for more than `ms` before `now`.
  bool idle_for(int64_t now, int64_t ms) {
    if (now - last_used_.load(std::memory_order_relaxed) <= ms) return false;
    {
      std::lock_guard<std::mutex> g(pmu_);
      if (!pending_.empty()) return false;
    }
    std::lock_guard<std::mutex> q(qmu_);
    return q_.empty();
  }

  void submit(const PartPtr& p) {
    last_used_.store(now_ms(), std::memory_order_relaxed);
    uint64_t id = eng_->next_req_id();
    {
      std::lock_guard<std::mutex> g(pmu_);
      if (broken_) {
        std::string why = why_;
        p->xfer->part_done(ERR_BAD_STATE, why);
        return;
      }
      pending_.emplace(id, p);
    }
    // Small messages go out from the caller when nobody else is sending: one wake-up less.
    if (p->bytes <= (64u << 10) || (p->flags & kFlagCma) || p->op == kRead || p->op == kAtomic) {
      std::unique_lock<std::mutex> s(send_mu_, std::try_to_lock);
      if (s.owns_lock()) {
        bool idle;
        {
          std::lock_guard<std::mutex> g(qmu_);
          idle = q_.empty();
        }
        if (idle && send_part(id, *p, /*nonblocking_start=*/true)) return;
      }
    }
    {
      std::lock_guard<std::mutex> g(qmu_);
      q_.emplace_back(id, p);
    }
    qcv_.notify_one();
  }

  // A one-way kNotify (the direct path's doorbell, with records that found the ring full): queued
  // for the sender thread, never sent from the caller, never answered.
  void oneway(std::vector<uint8_t> body, uint16_t op = kNotify) {
    auto p = std::make_shared<Part>();
    p->op = op;
    p->body = std::move(body);
    {
      std::lock_guard<std::mutex> g(qmu_);
      if (broken_ || stop_) return;
      q_.emplace_back(0, p);
    }
    qcv_.notify_one();
  }

  void fail(std::string why) {
    const std::string timed_out = kTimedOut;
    if (why.size() >= timed_out.size() && why.compare(why.size() - timed_out.size(), timed_out.size(), timed_out) == 0)
      why += ": no progress within MORI_IO_CP_TIMEOUT_MS=" + std::to_string(eng_->cp_timeout_ms()) + " ms";
    std::unordered_map<uint64_t, PartPtr> parts;
    {
      std::lock_guard<std::mutex> g(pmu_);
      if (!broken_) {
        broken_ = true;
        why_ = "peer '" + peer_->key + "' (" + peer_->host + ":" + std::to_string(peer_->port) + "): " + why;
        // Only worth a warning when transfers fail with it; an idle peer going away is normal.
        if (!stop_) MORI_IO_LOG(pending_.empty() ? 20 : 30, "%s", why_.c_str());
      }
      parts.swap(pending_);
    }
    ::shutdown(fd_.get(), SHUT_RDWR);
    qcv_.notify_all();
    for (auto& kv : parts) kv.second->xfer->part_done(ERR_BAD_STATE, why_);
  }

  void close() {
    if (closed_.exchange(true)) return;
    stop_ = true;
    fail("connection closed");
    qcv_.notify_all();
    if (tx_.joinable()) tx_.join();
    if (rx_.joinable()) rx_.join();
    fd_.reset();
  }

 private:
  // Returns false only with nonblocking_start when nothing could be sent without waiting.
  bool send_part(uint64_t id, const Part& p, bool nonblocking_start = false) {
    if (p.op == kNotify || p.op == kNotice || p.op == kAtomic) {
      Header n = make_header(p.op);
      n.body_len = uint32_t(p.body.size());
      if (p.op == kAtomic) {
        n.req_id = id;
        n.mem_id = p.mem_id;
        n.total_parts = 1;
      }
      std::string err = send_msg(fd_.get(), n, p.body.data(), nullptr, &last_progress_);
      if (!err.empty()) fail("send failed: " + err);
      return true;
    }
    Header h = make_header(p.op);
    h.flags = p.flags;
    h.req_id = id;
    h.uid = p.uid;
    h.mem_id = p.mem_id;
    h.nsegs = uint32_t(p.segs.size());
    h.body_len = uint32_t(p.segs.size() * sizeof(Seg));
    h.total_parts = p.total_parts;
    bool cma = p.flags & kFlagCma;
    std::vector<Seg> wire(p.segs);
    if (!cma)
      for (Seg& s : wire) s.addr = 0;  // the target needs our addresses only to attach
    std::vector<iovec> payload;
    if (p.op == kWrite && !cma) {
      h.payload_len = p.bytes;
      payload.reserve(p.segs.size());
      for (const Seg& s : p.segs) payload.push_back({reinterpret_cast<void*>(s.addr), s.len});
      if (p.local_loc != 1) {  // device memory: copy the blocks into one host buffer first
        const CopierRef copier = eng_->device_copier();
        uint8_t* buf = tx_stage_.get(copier, p.bytes);  // under send_mu_, as every send_part
        int rc = buf ? stage_out(copier.c, payload, p.local_device, buf) : -1;
        if (rc != 0) {
          if (PartPtr mine = take(id))
            mine->xfer->part_done(ERR_GPU_OP, buf ? "copying local device memory to host failed (code " +
                                                        std::to_string(rc) + ")"
                                                  : "no host staging buffer of " + std::to_string(p.bytes) +
                                                        " bytes for local device memory");
          return true;
        }
        eng_->staged_bytes.fetch_add(int64_t(p.bytes));
        payload.assign(1, iovec{buf, p.bytes});
      }
    }
    bool would_block = false;
    std::string err =
        send_msg(fd_.get(), h, wire.data(), &payload, &last_progress_, nonblocking_start ? &would_block : nullptr);
    if (!err.empty()) fail("send failed: " + err);
    return !would_block;
  }

  void tx_loop() {
    for (;;) {
      std::pair<uint64_t, PartPtr> item;
      {
        std::unique_lock<std::mutex> g(qmu_);
        qcv_.wait(g, [this] { return stop_ || broken_ || !q_.empty(); });
        if (stop_ || broken_) {
          q_.clear();
          return;
        }
        item = std::move(q_.front());
        q_.pop_front();
      }
      std::lock_guard<std::mutex> s(send_mu_);
      if (broken_) continue;
      send_part(item.first, *item.second);
    }
  }

  PartPtr take(uint64_t id) {
    std::lock_guard<std::mutex> g(pmu_);
    auto it = pending_.find(id);
    if (it == pending_.end()) return nullptr;
    PartPtr p = it->second;
    pending_.erase(it);
    return p;
  }

  void rx_loop() {
    Header h;
    std::vector<uint8_t> body;
    int64_t timeout = eng_->cp_timeout_ms();
    while (!broken_) {
      int r = wait_readable(fd_.get(), 100);
      if (r < 0 && errno != EINTR) {
        fail("poll failed: " + errno_text(errno));
        return;
      }
      if (r <= 0) {
        bool waiting;
        {
          std::lock_guard<std::mutex> g(pmu_);
          waiting = !pending_.empty();
        }
        if (!waiting) last_progress_.store(now_ms());
        if (waiting && now_ms() - last_progress_.load() > timeout) {
          fail("no answer within MORI_IO_CP_TIMEOUT_MS=" + std::to_string(timeout) + " ms");
          return;
        }
        continue;
      }
      std::string err = recv_msg(fd_.get(), &h, &body);
      if (!err.empty()) {
        fail(err);
        return;
      }
      last_progress_.store(now_ms());
      last_used_.store(now_ms(), std::memory_order_relaxed);
      if (h.type != kAck && h.type != kReadData && h.type != kAtomicAck) {
        fail("unexpected message type " + std::to_string(h.type));
        return;
      }
      PartPtr p = take(h.req_id);
      if (!p) {
        fail("answer to an unknown request");
        return;
      }
      if ((h.type == kAtomicAck) != (p->op == kAtomic)) {
        p->xfer->part_done(ERR_BAD_STATE, "answer does not match the request");
        fail("answer does not match the request");
        return;
      }
      if (h.type == kAtomicAck) {
        int code = h.status;
        if (code != SUCCESS && (code < ERR_INVALID_ARGS || code > ERR_GPU_OP)) code = ERR_BAD_STATE;
        if (code == SUCCESS && p->xfer->result) *p->xfer->result = h.mem_id;
        p->xfer->part_done(code, std::string(body.begin(), body.end()));
        continue;
      }
      std::string text(body.begin(), body.end());
      if (h.type == kReadData && h.status == SUCCESS) {
        if (p->op != kRead || h.payload_len != p->bytes) {
          p->xfer->part_done(ERR_BAD_STATE, "read answer does not match the request");
          fail("read answer does not match the request");
          return;
        }
        std::vector<iovec> iov;
        iov.reserve(p->segs.size());
        for (const Seg& s : p->segs) iov.push_back({reinterpret_cast<void*>(s.addr), s.len});
        CopierRef copier;
        uint8_t* buf = nullptr;
        if (p->local_loc == 1) {
          err = recv_iov(fd_.get(), iov, &last_progress_);
        } else {
          copier = eng_->device_copier();
          buf = rx_stage_.get(copier, p->bytes);  // this thread's own
          if (buf) {
            std::vector<iovec> host{{buf, p->bytes}};
            err = recv_iov(fd_.get(), host, &last_progress_);
          } else {
            err = drain(fd_.get(), p->bytes);
          }
        }
        if (!err.empty()) {
          p->xfer->part_done(ERR_BAD_STATE, "receiving read data: " + err);
          fail("receiving read data: " + err);
          return;
        }
        int rc = p->local_loc == 1 ? 0 : buf ? stage_in(copier.c, iov, p->local_device, buf) : -1;
        if (p->local_loc != 1) eng_->staged_bytes.fetch_add(int64_t(p->bytes));
        p->xfer->part_done(rc == 0 ? SUCCESS : ERR_GPU_OP,
                           rc == 0   ? ""
                           : buf     ? "copying read data to local device memory failed (code " + std::to_string(rc) + ")"
                                     : "no host staging buffer of " + std::to_string(p->bytes) + " bytes for read data");
      } else if (h.type == kAck && h.status == kCmaUnavailable) {
        // Failover: the target cannot attach to us; the same part goes over the socket.
        peer_->cma_ok = false;
        eng_->failovers.fetch_add(1);
        MORI_IO_LOG(20, "peer '%s': cross-memory attach refused (%s); using the socket", peer_->key.c_str(),
                    text.c_str());
        p->flags &= ~kFlagCma;
        std::lock_guard<std::mutex> q(qmu_);
        q_.emplace_back(eng_->next_req_id(), p);
        {
          std::lock_guard<std::mutex> g(pmu_);
          if (broken_) {
            q_.pop_back();
            p->xfer->part_done(ERR_BAD_STATE, why_);
            continue;
          }
          pending_.emplace(q_.back().first, p);
        }
        qcv_.notify_one();
      } else {
        if (h.status == SUCCESS && h.type == kAck && p->op == kRead && !(p->flags & kFlagCma)) {
          p->xfer->part_done(ERR_BAD_STATE, "protocol error: read answered without data");
          continue;
        }
        int code = h.status;
        if (code != SUCCESS && (code < ERR_INVALID_ARGS || code > ERR_GPU_OP)) code = ERR_BAD_STATE;
        p->xfer->part_done(code, text);
      }
    }
  }

  Engine* eng_;
  Peer* peer_;
  Fd fd_;
  std::thread tx_, rx_;
  std::mutex send_mu_;
  StageBuffer tx_stage_;  // GPU data to send (under send_mu_)
  StageBuffer rx_stage_;  // GPU read data received (the receiver thread's)
  std::mutex qmu_;
  std::condition_variable qcv_;
  std::deque<std::pair<uint64_t, PartPtr>> q_;
  std::mutex pmu_;
  std::unordered_map<uint64_t, PartPtr> pending_;
  std::atomic<bool> broken_{false}, stop_{false}, closed_{false};
  std::string why_;
  std::atomic<int64_t> last_progress_{0};
  std::atomic<int64_t> last_used_{0};
};


// ---------------------------------------------------------------------------------------------
// Engine

Engine::Engine(EngineConfig cfg) : cfg_(std::move(cfg)), inbound_(cfg_.limits.inbound) {
  if (!cfg_.token.empty()) {
    std::string why;
    if (!auth_available(&why))
      throw std::runtime_error("engine '" + cfg_.key + "' has a secret (MORI_IO_AUTH_TOKEN) but cannot prove it: " + why);
  }
  instance_ = random_string(16);
  slots_.resize(kTableSlots);
  listen_tcp();  // throws for a non-loopback address without a secret
  listen_unix();
  create_table();
  try {
    acceptor_ = std::thread([this] { accept_loop(); });
  } catch (const std::system_error& e) {
    throw std::runtime_error("engine '" + cfg_.key + "': cannot start its accept thread: " + e.what());
  }
}

Engine::~Engine() {
  shutdown();
  pool_.reset();
  for (auto& si : slots_)
    if (si.map) ::munmap(si.map, kSlotBytes);
  if (table_) ::munmap(table_, kTableBytes);
}

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

void Engine::shutdown() {
  if (shut_.exchange(true)) return;
  stop_ = true;
  retire_all();
  ::shutdown(listen_fd_.get(), SHUT_RDWR);
  if (unix_fd_) ::shutdown(unix_fd_.get(), SHUT_RDWR);
  if (acceptor_.joinable()) acceptor_.join();
  listen_fd_.reset();
  unix_fd_.reset();
  std::vector<PeerPtr> peers;
  {
    std::lock_guard<std::mutex> g(peer_mu_);
    for (auto& kv : peers_) peers.push_back(kv.second);
    peers_.clear();
  }
  for (auto& p : peers) {
    std::lock_guard<std::mutex> g(p->mu);
    close_conns(p->conns);
    p->direct.reset();
  }
  std::vector<Server> servers;
  {
    std::lock_guard<std::mutex> g(srv_mu_);
    servers.swap(servers_);
    for (auto& s : servers)
      if (s.s->fd) ::shutdown(s.s->fd.get(), SHUT_RDWR);
  }
  for (auto& s : servers) s.th.join();
}
void Engine::configure_tcp(const TcpConfig& c) {
  std::lock_guard<std::mutex> g(tcp_mu_);
  tcp_ = c;
}

void Engine::set_device_copier(const DeviceCopier& c, std::shared_ptr<void> owner) {
  std::lock_guard<std::mutex> g(tcp_mu_);
  copier_ = CopierRef{c, std::move(owner)};
}

bool Engine::has_device_copier() {
  std::lock_guard<std::mutex> g(tcp_mu_);
  return copier_.c.to_host != nullptr && copier_.c.from_host != nullptr;
}

CopierRef Engine::device_copier() {
  std::lock_guard<std::mutex> g(tcp_mu_);
  return copier_;
}

uint8_t* StageBuffer::get(const CopierRef& by, uint64_t n) {
  if (p_ && n <= cap_ && by.c.ctx == by_.c.ctx && by.c.host_alloc == by_.c.host_alloc) return p_;
  release();
  const uint64_t cap = std::max<uint64_t>(n, 1);
  if (by.c.host_alloc && by.c.host_free) {
    p_ = static_cast<uint8_t*>(by.c.host_alloc(by.c.ctx, cap));
  } else {
    p_ = static_cast<uint8_t*>(std::malloc(cap));
  }
  if (!p_) return nullptr;
  cap_ = cap;
  by_ = by;
  return p_;
}

void StageBuffer::release() {
  if (!p_) return;
  if (by_.c.host_alloc && by_.c.host_free)
    by_.c.host_free(by_.c.ctx, p_);
  else
    std::free(p_);
  p_ = nullptr;
  cap_ = 0;
  by_ = CopierRef{};
}

TcpConfig Engine::tcp_config() {
  std::lock_guard<std::mutex> g(tcp_mu_);
  return tcp_;
}

namespace {
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux >= 6.1
#endif
constexpr uintptr_t kHugePage = uintptr_t(2) << 20;

// Manners::thp (MORI_IO_THP=1, off by default: it changes the paging of the caller's memory).
// Backs the 2 MiB-aligned interior of registered CPU memory with transparent huge pages: the
// same-host path's process_vm_readv/writev pins the target's pages one page-table lock per 4 KiB
// page otherwise (measured here: 512 KiB in 24 us on 4 KiB pages, 16 us on huge pages), and two
// threads copying halves of one transfer contend on that lock (512 KiB cut in two: 53 us).
// MADV_HUGEPAGE marks the range (later faults get huge pages); MADV_COLLAPSE moves what is already
// there onto huge pages, up to Manners::thp_collapse_max bytes (it costs ~3 ms per MiB). Neither
// changes a byte of the contents. The kernel refuses both for mappings it cannot collapse (device
// mappings, pinned pages) and the range keeps its pages; so does a kernel without THP.
void back_with_huge_pages(uintptr_t lo, uintptr_t hi, uint64_t collapse_max) {
  const uint64_t n = hi - lo;
  if (::madvise(reinterpret_cast<void*>(lo), n, MADV_HUGEPAGE) != 0) return;
  if (n <= collapse_max) ::madvise(reinterpret_cast<void*>(lo), n, MADV_COLLAPSE);
}

// The 2 MiB-aligned interior of [addr, addr + size) if the kernel maps (nearly) all of it with
// 2 MiB pages now, else an empty range: the table's huge_lo/huge_hi, a speed hint for the
// initiator (table.hpp). Huge pages come from the caller (its allocator, MADV_HUGEPAGE, hugetlbfs)
// or from Manners::thp. Read from /proc/self/smaps (AnonHugePages, ShmemPmdMapped, FilePmdMapped,
// or a hugetlb KernelPageSize) of the mappings the interior overlaps; once per registration.
std::pair<uintptr_t, uintptr_t> huge_interior(uintptr_t addr, uint64_t size) {
  const uintptr_t lo = (addr + kHugePage - 1) & ~(kHugePage - 1), hi = (addr + size) & ~(kHugePage - 1);
  if (hi <= lo) return {0, 0};
  FILE* f = std::fopen("/proc/self/smaps", "re");
  if (!f) return {0, 0};
  char line[512];
  uint64_t overlap = 0, huge = 0, vma_overlap = 0;
  bool in = false, done = false;
  while (!done && std::fgets(line, sizeof line, f)) {
    unsigned long long a, b;
    char perms[8];
    if (std::sscanf(line, "%llx-%llx %7s", &a, &b, perms) == 3) {  // a mapping's first line
      if (a >= hi) done = true;
      in = !done && b > lo;
      vma_overlap = in ? std::min<uint64_t>(b, hi) - std::max<uint64_t>(a, lo) : 0;
      overlap += vma_overlap;
      continue;
    }
    if (!in) continue;
    unsigned long long kb;
    if (std::sscanf(line, "AnonHugePages: %llu kB", &kb) == 1 || std::sscanf(line, "ShmemPmdMapped: %llu kB", &kb) == 1 ||
        std::sscanf(line, "FilePmdMapped: %llu kB", &kb) == 1)
      huge += std::min<uint64_t>(kb << 10, vma_overlap);
    else if (std::sscanf(line, "KernelPageSize: %llu kB", &kb) == 1 && (kb << 10) >= kHugePage)
      huge += vma_overlap;  // hugetlbfs: every page of the mapping is huge
  }
  std::fclose(f);
  const uint64_t n = hi - lo;
  return overlap >= n && huge * 8 >= n * 7 ? std::make_pair(lo, hi) : std::make_pair(uintptr_t(0), uintptr_t(0));
}

// Whether [addr, addr + size) is mapped in this process: msync(MS_ASYNC) checks the range against
// the process's mappings (ENOMEM for a hole) and does nothing else (a no-op since Linux 2.6.19).
bool mapped(uintptr_t addr, uint64_t size) {
  const uintptr_t page = uintptr_t(::sysconf(_SC_PAGESIZE));
  const uintptr_t lo = addr & ~(page - 1);
  return ::msync(reinterpret_cast<void*>(lo), size_t(addr + size - lo), MS_ASYNC) == 0;
}
}  // namespace

uint64_t Engine::register_memory(uintptr_t addr, uint64_t size, int loc, int device) {
  if (size == 0) throw std::invalid_argument("size=0 is not allowed; expected at least one byte");
  if (addr == 0 || addr > UINTPTR_MAX - size)
    throw std::invalid_argument("addr=" + std::to_string(addr) + " + size=" + std::to_string(size) +
                                " is not a range of this address space (it wraps around or starts at 0)");
  if (loc == 1 && !mapped(addr, size))
    throw std::invalid_argument("addr=" + std::to_string(addr) + " + size=" + std::to_string(size) +
                                " is not mapped memory of this process (msync: " + errno_text(errno) + ")");
  // Before taking the lock: collapsing takes milliseconds per MiB, smaps a moment.
  std::pair<uintptr_t, uintptr_t> huge{0, 0};
  if (loc == 1 && table_ && size >= kHugePage) {
    if (cfg_.manners.thp) {
      const uintptr_t lo = (addr + kHugePage - 1) & ~(kHugePage - 1), hi = (addr + size) & ~(kHugePage - 1);
      if (hi > lo) back_with_huge_pages(lo, hi, cfg_.manners.thp_collapse_max);
    }
    huge = huge_interior(addr, size);
  }
  auto r = std::make_shared<Region>();
  r->addr = addr;
  r->size = size;
  r->loc = loc;
  r->device = device;
  std::lock_guard<std::mutex> g(reg_mu_);
  // Ids are random (a peer cannot guess the ids of regions it was not given) with their table
  // index in the low bits: a free index when there is one, so the region is published.
  const bool publish = table_ && loc == 1 && !shut_;
  uint64_t index = 0;
  bool have_index = false;
  if (publish) {
    const uint64_t start = random_u64() % kTableEntries;
    for (uint64_t k = 0; k < kTableEntries && !have_index; ++k) {
      index = (start + k) % kTableEntries;
      have_index = table_entry(index)->id.load(std::memory_order_relaxed) == 0;
    }
  }
  do {
    const uint64_t high = random_u64() >> 15;  // ids stay below 2**63 (a Python int, an int64 elsewhere)
    r->id = have_index ? (high / kTableEntries) * kTableEntries + index : high;
  } while (r->id == 0 || regions_.count(r->id));
  regions_[r->id] = r;
  if (have_index) {
    table_write_entry(table_entry(r->id), r->id, EntryView{addr, size, huge.first, huge.second});
    r->published = true;
  }
  return r->id;
}
bool Engine::deregister_memory(uint64_t id, int64_t timeout_ms) {
  const int64_t deadline = timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
  std::unique_lock<std::mutex> g(reg_mu_);
  auto it = regions_.find(id);
  if (it == regions_.end()) return true;
  RegionPtr r = it->second;
  r->alive = false;
  regions_.erase(it);
  const bool published = r->published;
  if (published) {  // retire the entry, then wait for initiators' copies that may have read it
    table_write_entry(table_entry(id), 0, EntryView{});
    r->published = false;
  }
  g.unlock();
  bool copies_done = !published || wait_copies(deadline);
  g.lock();
  auto idle = [&r] { return r->inflight == 0; };
  if (deadline < 0) {
    reg_cv_.wait(g, idle);
    return copies_done;
  }
  bool served = reg_cv_.wait_for(g, std::chrono::milliseconds(std::max<int64_t>(0, deadline - now_ms())), idle);
  return copies_done && served;
}

bool Engine::has_memory(uint64_t id) {
  std::lock_guard<std::mutex> g(reg_mu_);
  return regions_.count(id) != 0;
}

RegionPtr Engine::pin(uint64_t id, const Seg* segs, size_t n, std::string* err) {
  std::lock_guard<std::mutex> g(reg_mu_);
  auto it = regions_.find(id);
  if (it == regions_.end() || !it->second->alive) {
    *err = "memory region " + std::to_string(id) + " of engine '" + cfg_.key +
           "' is not registered (unknown or deregistered)";
    return nullptr;
  }
  const RegionPtr& r = it->second;
  for (size_t i = 0; i < n; ++i) {
    if (segs[i].off > r->size || segs[i].len > r->size - segs[i].off) {
      *err = "offset " + std::to_string(segs[i].off) + " + size " + std::to_string(segs[i].len) +
             " is outside memory region " + std::to_string(id) + " of engine '" + cfg_.key + "' (" +
             std::to_string(r->size) + " bytes)";
      return nullptr;
    }
  }
  ++r->inflight;
  return r;
}

void Engine::unpin(const RegionPtr& r) {
  bool wake;
  {
    std::lock_guard<std::mutex> g(reg_mu_);
    wake = --r->inflight == 0 && !r->alive;
  }
  if (wake) reg_cv_.notify_all();
}

void Engine::record_inbound(const std::string& key, uint64_t uid, uint32_t total, int code,
                            const std::string& msg) {
  std::lock_guard<std::mutex> g(in_mu_);
  record_inbound_locked(key, uid, total, code, msg);
}

void Engine::record_inbound_locked(const std::string& key, uint64_t uid, uint32_t total, int code,
                                   const std::string& msg) {
  inbound_.record(key, uid, total, code, msg);
}

std::optional<std::pair<int, std::string>> Engine::pop_inbound(const std::string& key, uint64_t uid) {
  drain_slots();
  std::lock_guard<std::mutex> g(in_mu_);
  return inbound_.pop(key, uid);
}

std::map<std::string, int64_t> Engine::counters() {
  std::map<std::string, int64_t> c;
  c["served_cma"] = served_cma.load();
  c["served_socket"] = served_socket.load();
  c["failovers"] = failovers.load();
  c["staged_bytes"] = staged_bytes.load();
  c["direct_copies"] = direct_copies.load();
  c["direct_refused"] = direct_refused.load();
  c["direct_split"] = direct_split.load();
  {
    std::lock_guard<std::mutex> g(pool_mu_);
    c["copy_thread_moves"] = pool_ ? pool_->moves() : 0;
  }
  drain_slots();
  {
    std::lock_guard<std::mutex> g(in_mu_);
    c["inbound_pending"] = int64_t(inbound_.size());
    c["inbound_dropped"] = inbound_.dropped();
  }
  {
    std::lock_guard<std::mutex> g(srv_mu_);
    int64_t live = 0;
    for (const Server& s : servers_) live += s.s->finished ? 0 : 1;
    c["inbound_connections"] = live;
  }
  c["connections_refused"] = connections_refused.load();
  c["handshakes_failed"] = handshakes_failed.load();
  c["auth_failures"] = auth_failures.load();
  c["accept_errors"] = accept_errors.load();
  c["idle_closed"] = idle_closed.load();
  c["protocol_errors"] = protocol_errors.load();
  c["thread_failures"] = thread_failures.load();
  c["torn_transfers"] = torn_transfers.load();
  {
    std::lock_guard<std::mutex> g(reg_mu_);
    c["regions"] = int64_t(regions_.size());
  }
  return c;
}

void Engine::add_peer(const std::string& key, const std::string& host, uint16_t port, bool same_node) {
  PeerPtr old;
  auto p = std::make_shared<Peer>();
  p->key = key;
  p->host = host;
  p->port = port;
  p->same_node = same_node;
  {
    std::lock_guard<std::mutex> g(peer_mu_);
    auto it = peers_.find(key);
    if (it != peers_.end()) {
      if (it->second->host == host && it->second->port == port) return;
      old = it->second;
    }
    peers_[key] = p;
  }
  if (old) {
    std::lock_guard<std::mutex> g(old->mu);
    close_conns(old->conns);
    old->direct.reset();
  }
}

void Engine::remove_peer(const std::string& key) {
  PeerPtr p;
  {
    std::lock_guard<std::mutex> g(peer_mu_);
    auto it = peers_.find(key);
    if (it == peers_.end()) return;
    p = it->second;
    peers_.erase(it);
  }
  std::lock_guard<std::mutex> g(p->mu);
  close_conns(p->conns);
  p->direct.reset();
}

bool Engine::peer_alive(const std::string& key) {
  PeerPtr p;
  {
    std::lock_guard<std::mutex> g(peer_mu_);
    auto it = peers_.find(key);
    if (it == peers_.end()) return false;
    p = it->second;
  }
  std::lock_guard<std::mutex> g(p->mu);
  if (!p->reachable) return false;
  for (auto& c : p->conns)
    if (c->broken()) return false;
  return true;
}

void Engine::close_conns(std::vector<std::shared_ptr<Conn>>& conns) {
  for (auto& c : conns) c->close();
  conns.clear();
}

namespace {

// The other end of a Unix socket as the kernel names it; pidfd from SO_PEERPIDFD (Linux >= 6.5:
// that very process, no pid reuse race) or else pidfd_open(pid).
PeerCred unix_peer(int fd) {
#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77
#endif
  PeerCred c;
  c.unix_socket = true;
  ucred u{};
  socklen_t len = sizeof u;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &u, &len) != 0) return c;
  c.pid = u.pid;
  c.uid = u.uid;
  int pfd = -1;
  len = sizeof pfd;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERPIDFD, &pfd, &len) == 0 && pfd >= 0)
    c.pidfd.reset(pfd);
  else if (c.pid > 0)
    c.pidfd.reset(pidfd_open(c.pid));
  return c;
}

bool unix_address(const std::string& name, sockaddr_un* a, socklen_t* len) {
  if (name.empty() || name.size() >= sizeof a->sun_path) return false;
  std::memset(a, 0, sizeof *a);
  a->sun_family = AF_UNIX;
  std::memcpy(a->sun_path + 1, name.data(), name.size());  // abstract: sun_path[0] == 0
  *len = socklen_t(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return true;
}

std::vector<Fd> own(const std::vector<int>& fds) {
  std::vector<Fd> out;
  for (int fd : fds) out.emplace_back(fd);
  return out;
}

}  // namespace

PeerCred peer_credentials(int fd) { return unix_peer(fd); }

std::string Engine::open_conn(const PeerPtr& p, const std::string& unix_name, bool direct, std::shared_ptr<Conn>* out,
                              AckParams* ack, std::string* unix_out, std::shared_ptr<Direct>* direct_out) {
  const TcpConfig tcp = tcp_config();
  const std::string where = unix_name.empty() ? p->host + ":" + std::to_string(p->port) : "its Unix socket";
  Fd fd;
  if (!unix_name.empty()) {
    sockaddr_un a;
    socklen_t alen;
    if (!unix_address(unix_name, &a, &alen)) return "bad Unix socket name from the peer";
    fd.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd) return "socket(AF_UNIX): " + errno_text(errno);
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&a), alen) != 0)
      return "cannot connect to " + where + ": " + errno_text(errno);
    tune_socket(fd.get(), tcp.socket_buffer_bytes);
  } else {
    addrinfo hints{}, *res = nullptr;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    const std::string port = std::to_string(p->port);
    int rc = ::getaddrinfo(p->host.c_str(), port.c_str(), &hints, &res);
    if (rc != 0) return "cannot resolve '" + p->host + "': " + gai_strerror(rc);
    std::unique_ptr<addrinfo, void (*)(addrinfo*)> guard(res, ::freeaddrinfo);
    std::string last = "no address";
    for (addrinfo* ai = res; ai && !fd; ai = ai->ai_next) {
      Fd s(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol));
      if (!s) continue;
      tune_socket(s.get(), tcp.socket_buffer_bytes);
      if (::connect(s.get(), ai->ai_addr, ai->ai_addrlen) != 0 && errno != EINPROGRESS) {
        last = errno_text(errno);
        continue;
      }
      pollfd pf{s.get(), POLLOUT, 0};
      int e = 0;
      socklen_t el = sizeof e;
      if (::poll(&pf, 1, int(cfg_.cp_timeout_ms)) != 1) {
        last = "connect timed out after MORI_IO_CP_TIMEOUT_MS=" + std::to_string(cfg_.cp_timeout_ms) + " ms";
        continue;
      }
      if (::getsockopt(s.get(), SOL_SOCKET, SO_ERROR, &e, &el) != 0 || e != 0) {
        last = errno_text(e);
        continue;
      }
      fd = std::move(s);
    }
    if (!fd) return "cannot connect to " + where + ": " + last;
    ::fcntl(fd.get(), F_SETFL, ::fcntl(fd.get(), F_GETFL) & ~O_NONBLOCK);
  }
  set_timeouts(fd.get(), cfg_.cp_timeout_ms);

  // The handshake (protocol.hpp): prove nothing to an engine that is not the one asked for.
  const int64_t deadline = now_ms() + cfg_.cp_timeout_ms;
  const std::string client_nonce = random_string(kNonceBytes);
  Header h = make_header(kHello);
  if (direct) h.flags |= kFlagDirect;
  std::vector<uint8_t> body;
  append_string(&body, cfg_.key);
  append_string(&body, cfg_.node_id);
  append_string(&body, client_nonce);
  append_string(&body, instance_);
  h.body_len = uint32_t(body.size());
  auto fail = [&](const std::string& why) { return "handshake with '" + p->key + "' at " + where + " failed: " + why; };
  std::string err = send_msg(fd.get(), h, body.data(), nullptr, nullptr);
  if (!err.empty()) return fail(err);
  Header c;
  std::vector<uint8_t> cb;
  err = recv_msg_until(fd.get(), &c, &cb, deadline);
  if (!err.empty()) return fail(err == kTimedOut ? "no answer within MORI_IO_CP_TIMEOUT_MS" : err);
  if (c.type == kHelloAck && c.status != 0) return fail(std::string(cb.begin(), cb.end()));
  if (c.type != kChallenge) return fail("unexpected answer to HELLO (message type " + std::to_string(c.type) + ")");
  std::vector<std::string> ch;
  err = parse_strings(cb.data(), cb.size(), 3, &ch);
  if (err.empty() && ch[1].size() != kNonceBytes) err = "bad server nonce";
  if (!err.empty()) return fail(err);
  if (ch[0] != p->key) return fail("the engine listening there is '" + ch[0] + "', not '" + p->key + "'");
  const bool required = c.flags & kFlagAuth;
  if (cfg_.token.empty() && required)
    return fail("engine '" + p->key + "' requires a shared secret: set MORI_IO_AUTH_TOKEN (the same on every engine)");
  if (!cfg_.token.empty() && !required)
    return fail("engine '" + p->key + "' has no MORI_IO_AUTH_TOKEN but this engine has one; set the same secret on both");
  std::string proof;
  if (required) {
    const Mac want = hmac_sha256(cfg_.token, transcript("target", client_nonce, ch[1], cfg_.key, p->key, instance_));
    if (!equal_ct(ch[2], std::string(want.begin(), want.end())))
      return fail("the engine did not prove it holds this engine's MORI_IO_AUTH_TOKEN");
    const Mac mine = hmac_sha256(cfg_.token, transcript("initiator", client_nonce, ch[1], cfg_.key, p->key, instance_));
    proof.assign(mine.begin(), mine.end());
  }
  Header au = make_header(kAuth);
  body.clear();
  append_string(&body, proof);
  au.body_len = uint32_t(body.size());
  err = send_msg(fd.get(), au, body.data(), nullptr, nullptr);
  if (!err.empty()) return fail(err);
  Header a;
  std::vector<uint8_t> ab;
  std::vector<int> raw_fds;
  const bool want_fds = direct && !unix_name.empty();
  err = recv_msg_until(fd.get(), &a, &ab, deadline, want_fds ? &raw_fds : nullptr, 2);
  std::vector<Fd> fds = own(raw_fds);
  if (!err.empty()) return fail(err == kTimedOut ? "no answer within MORI_IO_CP_TIMEOUT_MS" : err);
  if (a.type != kHelloAck) return fail("unexpected answer to AUTH (message type " + std::to_string(a.type) + ")");
  if (a.status != 0) return fail(std::string(ab.begin(), ab.end()));
  const bool granted = want_fds && (a.flags & kFlagDirect);
  std::vector<std::string> strs;
  err = parse_strings(ab.data(), ab.size(), granted ? 3 : 2, &strs);
  if (err.empty() && strs[0].size() != sizeof(AckParams)) err = "bad HELLO answer";
  if (err.empty() && granted && strs[2].size() != sizeof(DirectGrant)) err = "bad table grant";
  if (!err.empty()) return fail(err);
  std::memcpy(ack, strs[0].data(), sizeof *ack);
  *unix_out = strs[1];

  auto conn = std::make_shared<Conn>(this, p.get(), std::move(fd));
  if (!conn->start(&err)) return fail(err);
  if (granted && direct_out) {
    DirectGrant grant;
    std::memcpy(&grant, strs[2].data(), sizeof grant);
    PeerCred cred = unix_peer(conn->fd());
    std::string why;
    *direct_out = cred.pid > 0 ? open_direct(grant, fds, std::move(cred), conn, &why) : nullptr;
    if (cred.pid <= 0) why = "the target's process is not visible from here (another pid namespace)";
    if (!*direct_out) {
      direct_refused.fetch_add(1);
      MORI_IO_LOG(20, "peer '%s': no direct attach (%s); the target moves the bytes", p->key.c_str(), why.c_str());
    }
  }
  *out = std::move(conn);
  return "";
}

// A fresh set of connections: over the target's Unix socket when it is on this node and that
// socket is reachable (known from an earlier handshake, else learnt over TCP first), else TCP.
std::string Engine::connect_peer(const PeerPtr& p, std::vector<std::shared_ptr<Conn>>* out) {
  const TcpConfig tcp = tcp_config();
  const int n = std::max(1, tcp.conns_per_peer);
  const bool want_direct = tcp.enable_cma && p->same_node;
  std::shared_ptr<Conn> c;
  AckParams ack{};
  std::string unix_name;
  std::shared_ptr<Direct> d;
  p->local_ipc = false;
  if (p->same_node && !p->unix_name.empty()) {
    std::string err = open_conn(p, p->unix_name, want_direct, &c, &ack, &unix_name, &d);
    if (err.empty()) {
      p->local_ipc = true;
    } else {
      MORI_IO_LOG(20, "peer '%s': %s; asking over TCP again", p->key.c_str(), err.c_str());
      p->unix_name.clear();
      c.reset();
    }
  }
  if (!c) {
    std::string err = open_conn(p, "", false, &c, &ack, &unix_name, nullptr);
    if (!err.empty()) return err;
    if (p->same_node && !unix_name.empty()) {
      std::shared_ptr<Conn> u;
      std::string unused;
      err = open_conn(p, unix_name, want_direct, &u, &ack, &unused, &d);
      if (err.empty()) {
        c->close();
        c = std::move(u);
        p->local_ipc = true;
        p->unix_name = unix_name;
      } else {
        MORI_IO_LOG(20, "peer '%s': its Unix socket is not reachable from here (%s); staying on TCP", p->key.c_str(),
                    err.c_str());
      }
    }
  }
  p->idle_timeout_ms = int64_t(ack.idle_timeout_ms);
  p->direct = d;
  out->push_back(std::move(c));
  while (int(out->size()) < n) {
    std::string unused;
    AckParams more{};
    std::shared_ptr<Conn> next;
    std::string err = open_conn(p, p->local_ipc ? p->unix_name : "", false, &next, &more, &unused, nullptr);
    if (!err.empty()) return err;
    out->push_back(std::move(next));
  }
  return "";
}

std::string Engine::peer_conns(const PeerPtr& p, std::vector<std::shared_ptr<Conn>>* out,
                               std::shared_ptr<Direct>* direct) {
  std::lock_guard<std::mutex> g(p->mu);
  bool healthy = !p->conns.empty();
  for (auto& c : p->conns) healthy = healthy && !c->broken();
  // The target closes connections silent for its idle timeout: connections silent for half of
  // it are replaced before use (only when none of them has a request in flight).
  if (healthy && p->idle_timeout_ms > 0) {
    const int64_t now = now_ms(), limit = p->idle_timeout_ms / 2;
    bool all_idle = true;
    for (auto& c : p->conns) all_idle = all_idle && c->idle_for(now, limit);
    healthy = !all_idle;
  }
  if (!healthy) {
    close_conns(p->conns);
    p->direct.reset();  // the slot belonged to the old connection
    std::string err = connect_peer(p, &p->conns);
    p->reachable = err.empty();
    if (!err.empty()) {
      close_conns(p->conns);
      p->direct.reset();
      return err;
    }
  }
  if (out) *out = p->conns;
  *direct = p->direct;
  return "";
}

// Maps the peer's table (read-only: it is sealed) and this engine's slot, checks they are the ones
// the peer granted, and proves attach works on the peer's process (reads the table's nonce through
// process_vm_readv). nullptr (with the reason) if anything is refused: the caller keeps the
// target-side path.
std::shared_ptr<Direct> Engine::open_direct(const DirectGrant& g, std::vector<Fd>& fds, PeerCred cred,
                                            const std::shared_ptr<Conn>& conn0, std::string* why) {
  if (refuse_direct) {
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

std::string Engine::route_of(const std::string& peer_key, uint64_t local_id, bool remote_cpu) {
  PeerPtr p;
  {
    std::lock_guard<std::mutex> g(peer_mu_);
    auto it = peers_.find(peer_key);
    if (it == peers_.end()) return "";
    p = it->second;
  }
  RegionPtr r;
  {
    std::lock_guard<std::mutex> g(reg_mu_);
    auto it = regions_.find(local_id);
    if (it != regions_.end()) r = it->second;
  }
  bool connected;
  {
    std::lock_guard<std::mutex> g(p->mu);
    connected = !p->conns.empty();
  }
  // Before the first connection: what it will be if the target's Unix socket is reachable.
  const bool local = connected ? p->local_ipc.load() : p->same_node;
  bool cma = tcp_config().enable_cma && p->same_node && local && p->cma_ok && remote_cpu && r && r->loc == 1;
  return cma ? "tcp+cma" : "tcp";
}
namespace {
// post's block lists, kept per thread: a batch's lists are kilobytes, and glibc answers every
// allocation that large by first consolidating its free small chunks (~0.5 us a transfer at 128
// blocks, measured with perf). Capacity beyond kSegScratchKeep entries is freed after the call.
struct SegScratch {
  std::vector<Seg> a, b;
  bool busy = false;
};
constexpr size_t kSegScratchKeep = 1 << 14;
}  // namespace

StatusPtr Engine::post(uint16_t op, uint64_t local_id, const std::string& peer_key, uint64_t remote_id,
                       const std::vector<uint64_t>& loffs, const std::vector<uint64_t>& roffs,
                       const std::vector<uint64_t>& sizes, uint64_t uid, bool remote_cpu, uint64_t remote_size) {
  auto st = std::make_shared<Status>();
  const size_t n = sizes.size();
  if (loffs.size() != n || roffs.size() != n) {
    st->complete(ERR_INVALID_ARGS, "offset and size lists differ in length");
    return st;
  }
  // Per-thread scratch (see SegScratch); a nested call (none today) would get vectors of its own.
  static thread_local SegScratch scratch;
  std::vector<Seg> own_a, own_b;
  const bool mine = !scratch.busy;
  struct Release {
    SegScratch& s;
    bool mine;
    ~Release() {
      if (!mine) return;
      s.busy = false;
      if (s.a.capacity() > kSegScratchKeep) std::vector<Seg>().swap(s.a);
      if (s.b.capacity() > kSegScratchKeep) std::vector<Seg>().swap(s.b);
    }
  } release{scratch, mine};
  scratch.busy = true;
  std::vector<Seg>& local_segs = mine ? scratch.a : own_a;
  std::vector<Seg>& segs = mine ? scratch.b : own_b;
  local_segs.resize(n);
  for (size_t i = 0; i < n; ++i) {
    local_segs[i] = {loffs[i], sizes[i], 0};
    // The descriptor's size lets the initiator fail early; the target checks again on its side.
    if (roffs[i] > remote_size || sizes[i] > remote_size - roffs[i]) {
      st->complete(ERR_INVALID_ARGS, "remote offset " + std::to_string(roffs[i]) + " + size " +
                                         std::to_string(sizes[i]) + " is outside the remote region (" +
                                         std::to_string(remote_size) + " bytes)");
      return st;
    }
  }
  std::string err;
  RegionPtr local = pin(local_id, local_segs.data(), n, &err);
  if (!local) {
    st->complete(ERR_INVALID_ARGS, "local: " + err);
    return st;
  }
  // Holds the pin until the socket path's Transfer takes it over (or this call returns).
  struct Pin {
    Engine* e;
    RegionPtr r;
    ~Pin() {
      if (r) e->unpin(r);
    }
  } pin_guard{this, local};
  if (local->loc != 1 && !has_device_copier()) {
    st->complete(ERR_INVALID_ARGS,
                 "local memory is not CPU memory and no device copier is installed (GPU staging)");
    return st;
  }
  PeerPtr peer;
  {
    std::lock_guard<std::mutex> g(peer_mu_);
    auto it = peers_.find(peer_key);
    if (it != peers_.end()) peer = it->second;
  }
  if (!peer) {
    st->complete(ERR_NOT_FOUND, "remote engine '" + peer_key + "' is not registered");
    return st;
  }
  // The connections are copied out only for the socket path (a same-host copy needs none of them).
  std::vector<std::shared_ptr<Conn>> conns;
  std::shared_ptr<Direct> direct;
  err = peer_conns(peer, nullptr, &direct);
  if (!err.empty()) {
    st->complete(ERR_BAD_STATE, "remote engine '" + peer_key + "': " + err);
    return st;
  }
  TcpConfig tcp = tcp_config();
  uint32_t flags = tcp.enable_notification ? uint32_t(kFlagNotify) : 0u;
  if (tcp.enable_cma && peer->same_node && peer->local_ipc && peer->cma_ok && remote_cpu && local->loc == 1)
    flags |= kFlagCma;
  const uint64_t chunk = std::max<uint64_t>(tcp.chunk_bytes, 4096);

  // Merge blocks contiguous on both sides, then cut into parts of at most `chunk` bytes.
  segs.clear();
  for (size_t i = 0; i < n; ++i) {
    if (sizes[i] == 0) continue;
    uintptr_t addr = local->addr + loffs[i];
    if (!segs.empty() && segs.back().off + segs.back().len == roffs[i] &&
        segs.back().addr + segs.back().len == addr) {
      segs.back().len += sizes[i];
    } else {
      segs.push_back({roffs[i], sizes[i], addr});
    }
  }
  // Same-host CPU memory: the initiator copies itself, checked against the target's own table.
  if ((flags & kFlagCma) && direct && direct->ok.load(std::memory_order_relaxed) &&
      direct_post(*direct, peer_key, op, remote_id, segs, uid, tcp.enable_notification, tcp.cma_threads, st))
    return st;
  err = peer_conns(peer, &conns, &direct);
  if (!err.empty()) {
    st->complete(ERR_BAD_STATE, "remote engine '" + peer_key + "': " + err);
    return st;
  }
  auto xfer = std::make_shared<Transfer>();  // unpins the region after the last part
  xfer->eng = this;
  xfer->st = st;
  xfer->local = std::move(pin_guard.r);
  std::vector<PartPtr> parts;
  auto new_part = [&] {
    auto p = std::make_shared<Part>();
    p->xfer = xfer;
    p->op = op;
    p->flags = flags;
    p->local_loc = local->loc;
    p->local_device = local->device;
    p->uid = uid;
    p->mem_id = remote_id;
    parts.push_back(p);
    return p.get();
  };
  Part* cur = new_part();
  for (const Seg& s0 : segs) {
    Seg s = s0;
    while (s.len > 0) {
      if (cur->bytes >= chunk || cur->segs.size() >= kMaxSegs) cur = new_part();
      uint64_t take = std::min(s.len, chunk - cur->bytes);
      cur->segs.push_back({s.off, take, s.addr});
      cur->bytes += take;
      s.off += take;
      s.addr += take;
      s.len -= take;
    }
  }
  const uint32_t total = uint32_t(parts.size());
  xfer->remaining = total;
  st->set_in_progress();
  uint64_t base = peer->rr.fetch_add(total);
  for (size_t i = 0; i < parts.size(); ++i) {
    parts[i]->total_parts = total;
    conns[(base + i) % conns.size()]->submit(parts[i]);
  }
  return st;
}

std::string Engine::notice(const std::string& peer_key, uint64_t uid, uint32_t total_parts, int code) {
  PeerPtr peer;
  {
    std::lock_guard<std::mutex> g(peer_mu_);
    auto it = peers_.find(peer_key);
    if (it != peers_.end()) peer = it->second;
  }
  if (!peer) return "remote engine '" + peer_key + "' is not registered";
  std::vector<std::shared_ptr<Conn>> conns;
  std::shared_ptr<Direct> direct;
  std::string err = peer_conns(peer, &conns, &direct);
  if (!err.empty()) return err;
  NotifyRecord rec{uid, code, std::max<uint32_t>(1, total_parts)};
  const auto* b = reinterpret_cast<const uint8_t*>(&rec);
  conns[0]->oneway(std::vector<uint8_t>(b, b + sizeof rec), kNotice);
  return "";
}

StatusPtr Engine::post_atomic(const std::string& peer_key, uint64_t remote_id, uint64_t off, int op, int word,
                              uint64_t value, uint64_t compare, std::shared_ptr<uint64_t> old) {
  auto st = std::make_shared<Status>();
  PeerPtr peer;
  {
    std::lock_guard<std::mutex> g(peer_mu_);
    auto it = peers_.find(peer_key);
    if (it != peers_.end()) peer = it->second;
  }
  if (!peer) {
    st->complete(ERR_NOT_FOUND, "remote engine '" + peer_key + "' is not registered");
    return st;
  }
  std::vector<std::shared_ptr<Conn>> conns;
  std::shared_ptr<Direct> direct;
  std::string err = peer_conns(peer, &conns, &direct);
  if (!err.empty()) {
    st->complete(ERR_BAD_STATE, "remote engine '" + peer_key + "': " + err);
    return st;
  }
  auto xfer = std::make_shared<Transfer>();
  xfer->eng = this;
  xfer->st = st;
  xfer->result = std::move(old);
  xfer->remaining = 1;
  auto p = std::make_shared<Part>();
  p->xfer = xfer;
  p->op = kAtomic;
  p->mem_id = remote_id;
  AtomicReq req{off, uint32_t(op), uint32_t(word), value, compare};
  const auto* b = reinterpret_cast<const uint8_t*>(&req);
  p->body.assign(b, b + sizeof req);
  st->set_in_progress();
  conns[peer->rr.fetch_add(1) % conns.size()]->submit(p);
  return st;
}

// -- direct path (initiator side) ------------------------------------------------------------

namespace {
// Smallest piece worth a second thread. Target memory on 4 KiB pages: 1 MiB (smaller pieces lose,
// the threads' pinning contends on the target's page-table lock: 512 KiB cut in two ran at
// 9.6-11.8 GB/s against 27.8-28.1 uncut, in a C probe on this 2-vCPU VM). On huge pages: 256 KiB
// (measured here, 2 threads: 512 KiB 21.5 -> 14.6 us, 1 MiB 94 -> 24 us, each core's cache then
// holding its half of both buffers).
constexpr uint64_t kSplitMinDefault = 1u << 20;
constexpr uint64_t kSplitMinHuge = 256u << 10;

uint64_t split_min(bool huge) {
  static const uint64_t v = [] {
    const char* e = std::getenv("MORI_IO_CMA_SPLIT_BYTES");  // undocumented: for tuning
    uint64_t x = e ? std::strtoull(e, nullptr, 10) : 0;
    return x >= 4096 ? x : 0;
  }();
  return v ? v : huge ? kSplitMinHuge : kSplitMinDefault;
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
                          uint64_t total, bool huge, int threads) {
  const uint64_t k0 = total / split_min(huge);
  if (k0 <= 1) return cma_copy_in_place(pull, pid, local, remote);
  if (threads <= 0) threads = auto_copy_threads();
  const uint64_t k = std::min<uint64_t>(uint64_t(threads), k0);
  if (k <= 1) return cma_copy_in_place(pull, pid, local, remote);
  direct_split.fetch_add(1, std::memory_order_relaxed);
  CopyPool* pool;
  {
    std::lock_guard<std::mutex> g(pool_mu_);
    if (!pool_ || pool_->workers() < threads - 1) {
      pool_.reset();
      try {
        pool_ = std::make_unique<CopyPool>(threads - 1, cfg_.manners);
      } catch (const std::system_error&) {  // no threads to be had: copy on this one
        thread_failures.fetch_add(1);
        return cma_copy_in_place(pull, pid, local, remote);
      }
    }
    pool = pool_.get();
  }
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
                         const std::vector<Seg>& segs, uint64_t uid, bool notify, int cma_threads,
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
    if (code == SUCCESS && direct_delay_ms.load() > 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(direct_delay_ms.load()));
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
      int err = copy_parallel(op == kRead, d.pid, mine, theirs, total, huge, cma_threads);
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

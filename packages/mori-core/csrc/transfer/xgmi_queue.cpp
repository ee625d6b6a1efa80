// The XGMI backend's native data path; see xgmi_queue.hpp.
#include "xgmi_queue.hpp"

#include <algorithm>
#include <chrono>
#include <stdexcept>

namespace mori::transfer {

namespace {

using Clock = std::chrono::steady_clock;

int word_of(uint64_t acc) {
  for (int w : {8, 4, 2})
    if (acc % uint64_t(w) == 0) return w;
  return 1;
}

}  // namespace

// ---------------------------------------------------------------------------------------------

XgmiQueue::XgmiQueue(XgmiConfig cfg) : cfg_(std::move(cfg)), threshold_(cfg_.threshold) {
  if (cfg_.streams.empty()) throw std::invalid_argument("XgmiQueue: no streams");
  const GpuCalls& c = cfg_.calls;
  if (!c.memcpy_async || !c.event_record || !c.stream_wait_event || !c.event_query || !c.event_synchronize ||
      !c.event_create || !c.event_destroy || !c.get_context || !c.set_context)
    throw std::invalid_argument("XgmiQueue: a required driver function is missing");
}

XgmiQueue::~XgmiQueue() { close(); }

void XgmiQueue::start() {
  uint64_t prev = 0;
  int rc = make_current(&prev);
  if (rc) throw std::runtime_error(error("set_context", rc));
  std::vector<void*> made;
  void* order = nullptr;
  rc = cfg_.calls.event_create(&order, cfg_.calls.event_flags);
  for (int i = 0; rc == 0 && i < cfg_.num_events; ++i) {
    void* ev = nullptr;
    rc = cfg_.calls.event_create(&ev, cfg_.calls.event_flags);
    if (rc == 0) made.push_back(ev);
  }
  restore(prev);
  if (rc) {
    for (void* ev : made) cfg_.calls.event_destroy(ev);
    if (order) cfg_.calls.event_destroy(order);
    throw std::runtime_error(error("event_create", rc));
  }
  {
    std::lock_guard<std::mutex> g(mu_);
    order_event_ = order;
    free_events_ = made;
    all_events_ = made;
  }
  thread_ = std::thread([this] { complete_loop(); });
}

void XgmiQueue::set_kernel(int word, GpuKernel k) {
  std::lock_guard<std::mutex> g(mu_);
  kernels_[word] = k;
}

bool XgmiQueue::has_kernel(int word) {
  std::lock_guard<std::mutex> g(mu_);
  return kernels_.count(word) != 0;
}

// -- driver plumbing ---------------------------------------------------------------------------

std::string XgmiQueue::error(const std::string& op, int rc) { return gpu_error(cfg_.calls, op, rc); }

int XgmiQueue::make_current(uint64_t* prev) { return gpu_make_current(cfg_.calls, cfg_.context, prev); }

void XgmiQueue::restore(uint64_t prev) { gpu_restore(cfg_.calls, cfg_.context, prev); }

int XgmiQueue::memcpy(uint64_t dst, uint64_t src, uint64_t n, void* stream) {
  return gpu_memcpy(cfg_.calls, dst, src, n, stream);
}

void* XgmiQueue::stream_next() { return cfg_.streams[next_stream_++ % cfg_.streams.size()]; }

void* XgmiQueue::pooled_event() {
  if (!free_events_.empty()) {
    void* ev = free_events_.back();
    free_events_.pop_back();
    return ev;
  }
  void* ev = nullptr;
  last_rc_ = cfg_.calls.event_create(&ev, cfg_.calls.event_flags);
  if (last_rc_) return nullptr;
  all_events_.push_back(ev);
  return ev;
}

GpuTable* XgmiQueue::free_table() {
  // the ring in order: the next table, once the kernel that last read it is done (usually long
  // since; otherwise this post waits for it: at most tables.size() batches are in flight)
  auto& tables = cfg_.tables;
  for (size_t tries = 0; tries < tables.size(); ++tries) {
    GpuTable& t = tables[next_table_++ % tables.size()];
    if (!t.usable) continue;
    int rc = cfg_.calls.event_query(t.event);
    if (rc == cfg_.calls.not_ready) rc = cfg_.calls.event_synchronize(t.event);
    if (rc) {
      last_rc_ = rc;
      return nullptr;
    }
    return &t;
  }
  last_rc_ = -1;  // no usable table left
  return nullptr;
}

// -- posting -----------------------------------------------------------------------------------

StatusPtr XgmiQueue::post(bool write, uint64_t lbase, uint64_t lsize, uint64_t rbase, uint64_t rsize,
                          const std::vector<uint64_t>& loffs, const std::vector<uint64_t>& roffs,
                          const std::vector<uint64_t>& sizes, uint64_t uid, void* stream, bool kernel_ok,
                          const GpuTokenPtr& local, const GpuTokenPtr& remote, const std::string& peer) {
  const size_t n = sizes.size();
  std::string what = std::string("XGMI ") + (write ? "write" : "read") + " uid " + std::to_string(uid) + " (" +
                     std::to_string(n) + " blocks) with engine '" + peer + "'";
  if (loffs.size() != n || roffs.size() != n)
    return failed_status(ERR_INVALID_ARGS, what + ": offsets and sizes differ in length");
  // the target takes no part in a GPU copy: these checks are the only ones
  for (size_t i = 0; i < n; ++i) {
    if (loffs[i] > lsize || sizes[i] > lsize - loffs[i])
      return failed_status(ERR_INVALID_ARGS, what + ": " + block_outside("local", i, loffs[i], sizes[i], lsize));
    if (roffs[i] > rsize || sizes[i] > rsize - roffs[i])
      return failed_status(ERR_INVALID_ARGS, what + ": " + block_outside("remote", i, roffs[i], sizes[i], rsize));
  }
  // plan: blocks that continue the previous one on both sides are merged, empty ones dropped
  std::vector<Copy> copies;
  copies.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (!sizes[i]) continue;
    uint64_t l = lbase + loffs[i], r = rbase + roffs[i];
    Copy c{write ? r : l, write ? l : r, sizes[i]};
    if (!copies.empty()) {
      Copy& last = copies.back();
      if (last.dst + last.n == c.dst && last.src + last.n == c.src) {
        last.n += c.n;
        continue;
      }
    }
    copies.push_back(c);
  }
  std::vector<Copy> small, large;
  const uint64_t thr = threshold_.load(std::memory_order_relaxed);
  if (kernel_ok && thr > 0 && cfg_.calls.launch_kernel && !cfg_.tables.empty() && copies.size() >= thr) {
    for (const Copy& c : copies) (c.n <= kSgMaxBlock ? small : large).push_back(c);
    if (small.size() < thr) {
      small.clear();
      large = copies;
    }
  } else {
    large = std::move(copies);
  }
  uint64_t acc = 0, largest = 0;
  for (const Copy& c : small) {
    acc |= c.dst | c.src | c.n;
    largest = std::max(largest, c.n);
  }
  const int word = word_of(acc);

  auto st = std::make_shared<Status>();
  auto p = std::make_shared<GpuPending>();
  p->q = weak_from_this();
  p->status = st;
  p->local = local;
  p->remote = remote;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (closed_) return failed_status(ERR_BAD_STATE, what + ": the XGMI backend was removed");
    if (!local->valid.load() || !remote->valid.load())
      return failed_status(ERR_INVALID_ARGS, what + ": a region was deregistered");
    GpuKernel kernel;
    if (!small.empty()) {
      auto it = kernels_.find(word);
      if (it != kernels_.end()) {
        kernel = it->second;
      } else {  // not compiled for this word width: copy engines
        large.insert(large.end(), small.begin(), small.end());
        small.clear();
      }
    }
    uint64_t prev = 0;
    int rc = make_current(&prev);
    if (rc) return failed_status(ERR_GPU_OP, what + ": " + error("set_context", rc));
    std::vector<void*> used;
    std::string op;
    auto use = [&](void* s) -> int {
      if (std::find(used.begin(), used.end(), s) != used.end()) return 0;
      used.push_back(s);
      op = "stream_wait_event";
      return cfg_.calls.stream_wait_event(s, order_event_, 0);
    };
    op = "event_record";
    rc = cfg_.calls.event_record(order_event_, stream);
    // the kernel: one launch per table of blocks
    const uint64_t split = std::max<uint64_t>(1, std::min<uint64_t>(kSgMaxSplit, largest / kSgBytesPerProgram));
    for (size_t at = 0; rc == 0 && at < small.size();) {
      GpuTable* t = free_table();
      if (!t) {
        op = "event_synchronize";
        rc = last_rc_ ? last_rc_ : -1;
        break;
      }
      const size_t m = std::min<size_t>(small.size() - at, t->entries);
      for (size_t i = 0; i < m; ++i) {
        const Copy& c = small[at + i];
        t->host[i] = int64_t(c.dst);
        t->host[m + i] = int64_t(c.src);
        t->host[2 * m + i] = int64_t(c.n / uint64_t(word));
      }
      void* s = stream_next();
      if ((rc = use(s))) break;
      uint64_t table = t->device, trace = kernel.trace, scratch0 = 0, scratch1 = 0;
      int32_t blocks = int32_t(m), programs = int32_t(split);
      void* plain[] = {&table, &blocks, &programs, &scratch0, &scratch1};
      void* traced[] = {&table, &blocks, &programs, &trace, &scratch0, &scratch1};
      op = "launch_kernel";
      rc = cfg_.calls.launch_kernel(kernel.function, unsigned(m), unsigned(split), 1, kernel.threads, 1, 1,
                                    kernel.shared, s, trace ? traced : plain, nullptr);
      if (rc == 0) {
        op = "event_record";
        rc = cfg_.calls.event_record(t->event, s);
      }
      if (rc) {
        t->usable = false;  // the kernel may read it: never reused
        break;
      }
      kernel_launches_++;
      kernel_blocks_ += int64_t(m);
      at += m;
    }
    for (size_t i = 0; rc == 0 && i < large.size(); ++i) {
      void* s = stream_next();
      if ((rc = use(s))) break;
      op = "memcpy_async";
      rc = memcpy(large[i].dst, large[i].src, large[i].n, s);
      if (rc == 0) copies_++;
    }
    if (rc == 0 && used.empty()) rc = use(stream_next());  // nothing to copy: done after the caller's stream
    for (void* s : used) {  // even after a failure: the status completes only after what was queued
      void* ev = pooled_event();
      int rc2 = ev ? cfg_.calls.event_record(ev, s) : last_rc_;
      if (ev && rc2 == 0) {
        p->events.push_back(ev);
      } else {
        if (ev) free_events_.push_back(ev);
        if (rc == 0) {
          rc = rc2;
          op = ev ? "event_record" : "event_create";
        }
      }
    }
    restore(prev);
    if (rc) {
      // a driver call failed: the transfer fails once whatever it queued has run
      for (void* ev : p->events) cfg_.calls.event_synchronize(ev);
      free_events_.insert(free_events_.end(), p->events.begin(), p->events.end());
      std::string why = rc == -1 && op == "event_synchronize" ? "no usable descriptor table left" : error(op, rc);
      return failed_status(ERR_GPU_OP, what + ": " + why);
    }
    p->what = std::move(what);
    st->set_in_progress();
    st->set_waiter(p);
    local->inflight++;
    remote->inflight++;
    pending_++;
    transfers_++;
    queue_.push_back(p);
  }
  queue_cv_.notify_one();
  return st;
}

// -- completion --------------------------------------------------------------------------------

void XgmiQueue::finish(GpuPending& p, int code, const std::string& msg) {
  if (p.done.exchange(true)) return;
  {  // the events first: a thread that waited for this status may post again at once
    std::lock_guard<std::mutex> g(mu_);
    free_events_.insert(free_events_.end(), p.events.begin(), p.events.end());
  }
  // then the status: whoever waits for the region to go idle (retire, close) finds it complete
  if (auto s = p.status.lock()) s->complete(code, msg);
  {
    std::lock_guard<std::mutex> g(mu_);
    p.local->inflight--;
    p.remote->inflight--;
    pending_--;
  }
  idle_cv_.notify_all();
}

bool GpuPending::wait(Status& s, int64_t timeout_ms) {
  auto queue = q.lock();
  if (!queue) return s.wait_plain(timeout_ms);  // closed: every transfer was completed
  return queue->wait_pending(*this, timeout_ms) || s.done();
}

bool XgmiQueue::wait_pending(GpuPending& p, int64_t timeout_ms) {
  auto s = p.status.lock();
  if (!s) return true;
  if (p.done.load()) return s->wait_plain(timeout_ms);  // the other party is completing it
  const GpuCalls& c = cfg_.calls;
  uint64_t prev = 0;
  make_current(&prev);  // a failure shows in the calls below
  int code = SUCCESS;
  std::string msg;
  if (timeout_ms < 0) {
    for (void* ev : p.events) {
      int rc = c.event_synchronize(ev);
      if (rc && code == SUCCESS) {
        code = ERR_GPU_OP;
        msg = p.what + ": " + error("event_synchronize", rc);
      }
    }
  } else {
    // bounded: poll the events (no blocking driver call that could outlast the timeout), a short
    // spin, then sleeps backing off to 1 ms
    const auto start = Clock::now();
    const auto deadline = start + std::chrono::milliseconds(timeout_ms);
    auto pause = std::chrono::microseconds(0);
    for (;;) {
      if (p.done.load()) break;
      bool ready = true;
      for (void* ev : p.events) {
        int rc = c.event_query(ev);
        if (rc == c.not_ready) {
          ready = false;
          break;
        }
        if (rc && code == SUCCESS) {
          code = ERR_GPU_OP;
          msg = p.what + ": " + error("event_query", rc);
        }
      }
      if (ready) break;
      const auto now = Clock::now();
      if (now >= deadline) {
        restore(prev);
        return p.done.load() && s->wait_plain(1);
      }
      if (now - start >= std::chrono::microseconds(100)) {
        pause = std::min(std::max(2 * pause, std::chrono::microseconds(20)), std::chrono::microseconds(1000));
        std::this_thread::sleep_for(std::min<Clock::duration>(pause, deadline - now));
      }
    }
  }
  restore(prev);
  finish(p, code, msg);
  // completed here, or being completed by the other party (which has no GPU wait left to do)
  return s->wait_plain(timeout_ms < 0 ? -1 : std::max<int64_t>(timeout_ms, 1));
}

void XgmiQueue::complete_loop() {
  uint64_t prev = 0;
  make_current(&prev);  // kept current on this thread: each wait then costs no context switch
  for (;;) {
    GpuPendingPtr p;
    {
      std::unique_lock<std::mutex> g(mu_);
      queue_cv_.wait(g, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_
      p = std::move(queue_.front());
      queue_.pop_front();
    }
    if (p->done.load()) continue;
    // No exception leaves this thread (it would end the process): a failure here fails the transfer.
    try {
      int code = SUCCESS;
      std::string msg;
      for (void* ev : p->events) {
        int rc = cfg_.calls.event_synchronize(ev);
        if (rc && code == SUCCESS) {
          code = ERR_GPU_OP;
          msg = p->what + ": " + error("event_synchronize", rc);
        }
      }
      finish(*p, code, msg);
    } catch (const std::exception& e) {
      finish(*p, ERR_GPU_OP, std::string("completing the transfer failed: ") + e.what());
    }
  }
}

bool XgmiQueue::retire(const GpuTokenPtr& token, int64_t timeout_ms) {
  std::unique_lock<std::mutex> g(mu_);
  token->valid.store(false);  // under mu_: a post that saw it valid has queued its transfer already
  auto idle = [&] { return token->inflight == 0; };
  if (timeout_ms < 0) timeout_ms = cfg_.timeout_ms;
  return idle_cv_.wait_for(g, std::chrono::milliseconds(timeout_ms), idle);
}

void XgmiQueue::close() {
  {
    std::unique_lock<std::mutex> g(mu_);
    if (closed_) return;
    closed_ = true;
    idle_cv_.wait_for(g, std::chrono::milliseconds(cfg_.timeout_ms), [this] { return pending_ == 0; });
    stop_ = true;
  }
  queue_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  std::deque<GpuPendingPtr> left;
  {
    std::lock_guard<std::mutex> g(mu_);
    left.swap(queue_);
  }
  for (auto& p : left)  // still running after the timeout: fail them rather than hang
    finish(*p, ERR_GPU_OP, p->what + ": the XGMI backend was removed while the copies still ran");
  uint64_t prev = 0;
  make_current(&prev);
  std::lock_guard<std::mutex> g(mu_);
  for (void* ev : all_events_) cfg_.calls.event_destroy(ev);
  if (order_event_) cfg_.calls.event_destroy(order_event_);
  all_events_.clear();
  free_events_.clear();
  order_event_ = nullptr;
  restore(prev);
}

std::map<std::string, int64_t> XgmiQueue::counters() {
  std::lock_guard<std::mutex> g(mu_);
  return {{"copies", copies_.load()},
          {"kernel_launches", kernel_launches_.load()},
          {"kernel_blocks", kernel_blocks_.load()},
          {"transfers", transfers_.load()},
          {"pending", pending_},
          {"events", int64_t(all_events_.size())}};
}

}  // namespace mori::transfer

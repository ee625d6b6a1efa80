// See rma_queue.hpp.
#include "rma_queue.hpp"

#include <algorithm>
#include <chrono>

#include "wire.hpp"

namespace mori::transfer {

namespace {

std::string tp_message(const char* what, int rc, const mori_tp_error& e) {
  return std::string(what) + ": " + (e.message[0] ? e.message : "failed") + " (code " + std::to_string(rc) + ")";
}

}  // namespace

RmaQueue::RmaQueue(const mori_tp_ops* ops, mori_tp* tp, Engine* engine, bool notify, int64_t timeout_ms)
    : ops_(ops), tp_(tp), engine_(engine), notify_(notify), timeout_ms_(timeout_ms) {}

RmaQueue::~RmaQueue() { close(); }

void RmaQueue::start() {
  thread_ = std::thread([this] {
    try {
      complete_loop();
    } catch (const std::exception& e) {  // never std::terminate the host process: fail what is queued
      fail_queued(std::string("the RDMA backend's completion thread failed: ") + e.what());
    } catch (...) {
      fail_queued("the RDMA backend's completion thread failed");
    }
  });
}

// -- posting -----------------------------------------------------------------------------------

StatusPtr RmaQueue::post(bool write, const mori::Memory& lmem, const mori::Endpoint& ep, const mori::RemoteKey& rkey,
                         uint64_t rbase, uint64_t rsize, const std::vector<uint64_t>& loffs,
                         const std::vector<uint64_t>& roffs, const std::vector<uint64_t>& sizes, uint64_t uid,
                         const std::string& peer) {
  const size_t n = sizes.size();
  const uint64_t lsize = lmem.size;
  std::string what = std::string("RDMA ") + (write ? "write" : "read") + " uid " + std::to_string(uid) + " (" +
                     std::to_string(n) + " blocks) with engine '" + peer + "'";
  if (loffs.size() != n || roffs.size() != n)
    return failed_status(ERR_INVALID_ARGS, what + ": offsets and sizes differ in length");
  for (size_t i = 0; i < n; ++i) {
    if (loffs[i] > lsize || sizes[i] > lsize - loffs[i])
      return failed_status(ERR_INVALID_ARGS, what + ": " + block_outside("local", i, loffs[i], sizes[i], lsize));
    if (roffs[i] > rsize || sizes[i] > rsize - roffs[i])
      return failed_status(ERR_INVALID_ARGS, what + ": " + block_outside("remote", i, roffs[i], sizes[i], rsize));
  }
  auto st = std::make_shared<Status>();
  auto p = std::make_shared<RmaPending>();
  p->q = weak_from_this();
  p->status = st;
  p->peer = peer;
  p->uid = uid;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (closed_) return failed_status(ERR_BAD_STATE, what + ": " + closed_why_);
    pending_++;  // from here drain() waits for this transfer
  }
  // post: blocks that continue the previous one on both sides are merged, empty ones dropped
  const auto post_one = [&](uint64_t lo, uint64_t ro, uint64_t len) -> bool {
    mori_tp_error e{};
    mori_tp_req req = 0;
    int rc = write ? ops_->put(tp_, ep.ep, reinterpret_cast<const void*>(lmem.addr + lo), lmem.mem, rbase + ro,
                               rkey.rkey, len, &req, &e)
                   : ops_->get(tp_, ep.ep, reinterpret_cast<void*>(lmem.addr + lo), lmem.mem, rbase + ro, rkey.rkey,
                               len, &req, &e);
    if (rc != 0) {  // the ones posted still complete first; the status says what failed
      p->code = ERR_RDMA_OP;
      p->msg = tp_message(write ? "put" : "get", rc, e);
      return false;
    }
    operations_.fetch_add(1, std::memory_order_relaxed);
    if (req) p->reqs.push_back(req);
    return true;
  };
  bool any = false, ok = true;
  uint64_t cl = 0, cr = 0, cn = 0;
  for (size_t i = 0; i < n && ok; ++i) {
    if (!sizes[i]) continue;
    if (cn && cl + cn == loffs[i] && cr + cn == roffs[i]) {
      cn += sizes[i];
      continue;
    }
    if (cn) {
      ok = post_one(cl, cr, cn);
      any = any || ok;
    }
    cl = loffs[i], cr = roffs[i], cn = sizes[i];
  }
  if (ok && cn) any = post_one(cl, cr, cn) || any;
  if (write && any) {
    mori_tp_error e{};
    mori_tp_req req = 0;
    int rc = ops_->flush(tp_, ep.ep, &req, &e);
    if (rc != 0 && p->code == SUCCESS) {
      p->code = ERR_RDMA_OP;
      p->msg = tp_message("flush", rc, e);
    }
    p->flush = rc == 0 ? req : 0;
  }
  transfers_.fetch_add(1, std::memory_order_relaxed);
  p->what = std::move(what);
  p->deadline_ms = now_ms() + timeout_ms_;
  p->posted = std::chrono::steady_clock::now();
  st->set_in_progress();
  st->set_waiter(p);
  if (p->reqs.empty() && !p->flush) {  // nothing left to wait for (done at once, or failed)
    completed_at_post_.fetch_add(1, std::memory_order_relaxed);
    finish(*p);
    return st;
  }
  bool wake;
  {
    std::lock_guard<std::mutex> g(mu_);
    wake = queue_.empty();  // otherwise the thread is awake already, or waits for the head's grace
    queue_.push_back(p);
  }
  if (wake) queue_cv_.notify_one();
  return st;
}

// -- completion --------------------------------------------------------------------------------

bool RmaQueue::drive(RmaPending& p, int64_t budget_ms, bool waiter) {
  if (p.done.load()) return true;
  const int64_t start = now_ms();
  const auto left = [&]() -> int64_t {
    int64_t until = std::min(p.deadline_ms, budget_ms < 0 ? p.deadline_ms : start + budget_ms);
    return std::max<int64_t>(0, until - now_ms());
  };
  const auto one = [&](mori_tp_req req, const char* what) -> bool {  // false: still pending
    mori_tp_error e{};
    int rc = ops_->wait(tp_, req, left(), &e);
    if (rc == MORI_TP_ETIMEDOUT) {
      if (now_ms() < p.deadline_ms) return false;
      if (p.code == SUCCESS) {
        p.code = ERR_RDMA_OP;
        p.msg = p.what + ": " + tp_message(what, rc, e);
      }
      return true;  // given up: the transfer fails (its request stays in the transport's table)
    }
    if (rc < 0 && p.code == SUCCESS) {
      p.code = ERR_RDMA_OP;
      p.msg = p.what + ": " + tp_message(what, rc, e);
    }
    return true;
  };
  // the flush first (it completes after every put before it), then each request (then done)
  if (p.flush) {
    if (!one(p.flush, "flush")) return false;
    p.flush = 0;
  }
  for (; p.next < p.reqs.size(); ++p.next)
    if (!one(p.reqs[p.next], p.reqs.size() > 1 ? "operation" : "the operation")) return false;
  (waiter ? completed_by_waiter_ : completed_by_thread_).fetch_add(1, std::memory_order_relaxed);
  finish(p);
  return true;
}

void RmaQueue::finish(RmaPending& p) {
  if (p.done.exchange(true)) return;
  int code = p.code;
  std::string msg = p.code == SUCCESS ? std::string() : (p.msg.rfind(p.what, 0) == 0 ? p.msg : p.what + ": " + p.msg);
  if (notify_ && engine_) {
    std::string why = engine_->notice(p.peer, p.uid, 1, code);
    if (!why.empty() && code == SUCCESS) {
      code = ERR_BAD_STATE;
      msg = "the data arrived, but the target was not told: " + why;
    }
  }
  if (auto s = p.status.lock()) s->complete(code, msg);
  {
    std::lock_guard<std::mutex> g(mu_);
    pending_--;
  }
  idle_cv_.notify_all();
}

bool RmaPending::wait(Status& s, int64_t timeout_ms) {
  auto queue = q.lock();
  if (!queue || done.load()) return s.wait_plain(timeout_ms);
  std::unique_lock<std::timed_mutex> g(drive, std::defer_lock);
  if (timeout_ms < 0)
    g.lock();
  else if (!g.try_lock_for(std::chrono::milliseconds(timeout_ms)))
    return s.wait_plain(0);
  bool finished = queue->drive(*this, timeout_ms, true);
  g.unlock();
  return finished ? s.wait_plain(-1) : s.done();
}

void RmaQueue::complete_loop() {
  using Clock = std::chrono::steady_clock;
  std::unique_lock<std::mutex> g(mu_);
  for (;;) {
    while (!queue_.empty() && queue_.front()->done.load()) queue_.pop_front();
    if (queue_.empty()) {
      if (stop_) return;
      queue_cv_.wait(g);
      continue;
    }
    RmaPendingPtr p = queue_.front();
    // A waiter usually completes a transfer in its own thread: leave it a grace period first.
    const auto due = p->posted + kGrace;
    if (!stop_ && Clock::now() < due) {
      queue_cv_.wait_until(g, due);
      continue;
    }
    g.unlock();
    // Poll with a back-off; a waiter that holds the drive lock completes it sooner.
    auto pause = std::chrono::microseconds(20);
    while (!p->done.load()) {
      std::unique_lock<std::timed_mutex> d(p->drive, std::try_to_lock);
      if (d.owns_lock() && drive(*p, 0, false)) break;
      d = {};
      std::this_thread::sleep_for(pause);
      pause = std::min(2 * pause, std::chrono::microseconds(1000));
    }
    g.lock();
  }
}

bool RmaQueue::drain(int64_t timeout_ms) {
  std::unique_lock<std::mutex> g(mu_);
  if (timeout_ms < 0) timeout_ms = timeout_ms_;
  return idle_cv_.wait_for(g, std::chrono::milliseconds(timeout_ms), [this] { return pending_ == 0; });
}

void RmaQueue::close() {
  {
    std::unique_lock<std::mutex> g(mu_);
    if (closed_) return;
    closed_ = true;
    // the thread completes every transfer (each fails at its own deadline at the latest)
    idle_cv_.wait_for(g, std::chrono::milliseconds(timeout_ms_ + 1000), [this] { return pending_ == 0; });
    stop_ = true;
  }
  queue_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  fail_queued("the RDMA backend was removed while the transfer was pending");  // past every deadline
}

void RmaQueue::fail_queued(const std::string& why) {
  std::deque<RmaPendingPtr> left;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!closed_) closed_why_ = why;  // a dead thread: later posts say so
    closed_ = true;
    left.swap(queue_);
  }
  for (auto& p : left) {  // fail them rather than hang
    if (p->code == SUCCESS) {
      p->code = ERR_RDMA_OP;
      p->msg = why;
    }
    finish(*p);
  }
}

std::map<std::string, int64_t> RmaQueue::counters() {
  std::lock_guard<std::mutex> g(mu_);
  return {{"transfers", transfers_.load()},
          {"operations", operations_.load()},
          {"pending", pending_},
          {"completed_by_waiter", completed_by_waiter_.load()},
          {"completed_by_thread", completed_by_thread_.load()},
          {"completed_at_post", completed_at_post_.load()}};
}

}  // namespace mori::transfer

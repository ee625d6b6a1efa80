// CopyPool: the threads that copy pieces of one large direct transfer beside the posting thread.
#pragma once

#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "engine.hpp"
#include "sched.hpp"

namespace mori::transfer {

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
constexpr const char* kCopyThreadName = "mori-io-copy";  // what /proc/<pid>/task/<tid>/comm shows

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
          ::pthread_setname_np(::pthread_self(), kCopyThreadName);  // the engine's own thread: named so
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

}  // namespace mori::transfer

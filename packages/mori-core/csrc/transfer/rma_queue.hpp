// The RDMA backend's data path (mori.io.rdma): checks, merges and posts the blocks of a transfer
// on a network transport of the contract (mori/transport.h) and completes its status, with no
// Python per transfer.
//
// The Python backend keeps what happens once per region or peer (registration, connecting,
// unpacking remote keys, routing); per post it hands this queue the local registration, the
// endpoint, the remote key and the remote region's base and size (from its descriptor).
//
// One post: every block is checked against the local registration and the remote region (nothing
// is posted if one is outside; the transport then checks each operation against the remote key's
// own range), blocks contiguous on both sides are merged, each is one put or get, and a write ends
// with one flush of the endpoint (remote completion; a get is complete when its request is).
// Wait()/WaitFor() on the status drive the transport's requests in the calling thread and complete
// it there (no thread hand-off on the stop-and-wait path); a completion thread completes the
// statuses nobody waits for, polling with a back-off. Whoever holds the transfer's drive lock
// tests its requests (a request is released by the test that sees it done, so never two at once).
// With notifications the target is then told over the engine's authenticated connection.
//
// Lifetimes: the queue holds the transport instance and the engine as Python objects (released
// with the GIL); the Python backend calls drain() before it deregisters memory and close() before
// it drops the transport.
#pragma once

#include <pybind11/pybind11.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../transport_objects.hpp"
#include "engine.hpp"
#include "mori/transport.h"

namespace mori::transfer {

class RmaQueue;

// One posted transfer until it completes; its status's waiter (does not keep the queue alive).
struct RmaPending : Status::Waiter {
  std::weak_ptr<RmaQueue> q;
  std::weak_ptr<Status> status;
  std::vector<mori_tp_req> reqs;  // pending ones only (0 = done at once is never stored)
  size_t next = 0;                // reqs[0, next) are complete
  mori_tp_req flush = 0;          // the write's flush, 0 once complete (or none)
  int code = SUCCESS;             // the first failure seen
  std::string msg;
  std::string what, peer;
  uint64_t uid = 0;
  int64_t deadline_ms = 0;  // fails with ERR_RDMA_OP if still pending then
  std::timed_mutex drive;   // whoever holds it tests the requests
  std::atomic<bool> done{false};
  std::chrono::steady_clock::time_point posted;
  bool wait(Status& s, int64_t timeout_ms) override;
};
using RmaPendingPtr = std::shared_ptr<RmaPending>;

class RmaQueue : public std::enable_shared_from_this<RmaQueue> {
 public:
  // How long the completion thread leaves a new transfer to a waiter before it polls it itself.
  static constexpr std::chrono::microseconds kGrace{50};

  // `engine`: where notices go (nullptr: no notices). `timeout_ms`: how long a transfer may stay
  // pending before it fails.
  RmaQueue(const mori_tp_ops* ops, mori_tp* tp, Engine* engine, bool notify, int64_t timeout_ms);
  ~RmaQueue();  // close()
  RmaQueue(const RmaQueue&) = delete;
  RmaQueue& operator=(const RmaQueue&) = delete;

  void start();

  // One transfer between the local registration `lmem` (blocks at lmem->addr + offset, bounded by
  // its size) and the remote region at `rbase` (rsize bytes) through `ep` and `rkey`; write: local
  // -> remote. Call without the GIL.
  StatusPtr post(bool write, const mori::Memory& lmem, const mori::Endpoint& ep, const mori::RemoteKey& rkey,
                 uint64_t rbase, uint64_t rsize, const std::vector<uint64_t>& loffs,
                 const std::vector<uint64_t>& roffs, const std::vector<uint64_t>& sizes, uint64_t uid,
                 const std::string& peer);

  // Waits until no transfer is pending; false if some still were after timeout_ms (< 0: the
  // queue's timeout).
  bool drain(int64_t timeout_ms);
  // Completes (or, past the timeout, fails) every pending transfer and stops the thread.
  void close();
  std::map<std::string, int64_t> counters();

  // Test the requests of `p` (caller holds p.drive) for up to budget_ms (0: once); true once done.
  bool drive(RmaPending& p, int64_t budget_ms, bool waiter);

  // Python objects kept alive until close (released with the GIL).
  pybind11::object keep;

 private:
  void finish(RmaPending& p);
  void complete_loop();
  // Fails every queued transfer with `why` and refuses new posts with it (close, a dead thread).
  void fail_queued(const std::string& why);

  const mori_tp_ops* ops_;
  mori_tp* tp_;
  Engine* engine_;
  bool notify_;
  int64_t timeout_ms_;
  std::mutex mu_;
  std::condition_variable queue_cv_, idle_cv_;
  std::deque<RmaPendingPtr> queue_;
  int64_t pending_ = 0;
  bool closed_ = false, stop_ = false;
  std::string closed_why_ = "the RDMA backend was removed";  // what posts after closed_ say
  std::thread thread_;
  // counters
  std::atomic<int64_t> transfers_{0}, operations_{0}, completed_by_waiter_{0}, completed_by_thread_{0},
      completed_at_post_{0};
};

}  // namespace mori::transfer

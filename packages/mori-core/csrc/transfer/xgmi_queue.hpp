// The XGMI backend's data path (mori.io.xgmi): checks, plans and queues the copies of a transfer
// with the GPU driver's own functions and completes its status, with no Python per transfer.
//
// The Python backend keeps everything that happens once per region or peer (IPC export and
// mapping, routing, the compiled kernel); it hands this queue the driver's function addresses
// (GpuCalls), its streams and descriptor tables, and per post the two regions' base addresses.
//
// One post: every block is checked against both regions (nothing is queued if one is outside),
// blocks contiguous on both sides are merged, then, after an event recorded on the caller's
// stream (so the copies see the work queued before the post): a batch of at least `threshold`
// blocks of at most kSgMaxBlock bytes is one launch of the scatter-gather kernel per table of
// blocks (tables in pinned host memory, each reused once the event recorded after its kernel
// completed); every other block is one async copy on the next of the streams. An event is
// recorded on every stream used. Wait()/WaitFor() on the status synchronize those events in the
// calling thread and complete it there; a completion thread completes the statuses nobody waits
// for, in posting order. Whoever comes first completes (an atomic flag); the events go back to the
// pool then. An event may be recorded again while the other party still waits on it: that only
// makes the wait longer (events are destroyed only by close()).
//
// Regions are guarded by tokens: the backend invalidates a region's token before it unmaps or
// forgets the region and then drains it (waits until no transfer that uses it is pending); a post
// with an invalid token fails with ERR_INVALID_ARGS and moves nothing.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine.hpp"
#include "gpu_calls.hpp"

namespace mori::transfer {

// A pinned host table the scatter-gather kernel reads: int64 [3, entries] (dst, src, size in words).
struct GpuTable {
  int64_t* host = nullptr;
  uint64_t device = 0;  // the same memory's address for the GPU
  uint64_t entries = 0;
  void* event = nullptr;  // recorded after the kernel that last read the table
  bool usable = true;     // false after a failed launch (it may still be read): never reused
};

// One compiled variant of the scatter-gather kernel (per word width). `trace`: 0 for the untraced
// variant (parameters: table, blocks, programs, then Triton's two scratch pointers); else the device
// address of the mori.viz trace buffer that the traced variant records into, passed after
// `programs` (its `trace_ptr` argument).
struct GpuKernel {
  void* function = nullptr;
  unsigned threads = 0;
  unsigned shared = 0;
  uint64_t trace = 0;
};

// A region's validity and the transfers using it (see the header comment).
struct GpuToken {
  std::atomic<bool> valid{true};
  int64_t inflight = 0;  // under XgmiQueue::mu_
};
using GpuTokenPtr = std::shared_ptr<GpuToken>;

constexpr uint64_t kSgMaxBlock = 1 << 20;  // larger blocks go to the copy engines
constexpr uint64_t kSgBytesPerProgram = 64 << 10;
constexpr uint64_t kSgMaxSplit = 16;

class XgmiQueue;

// One posted transfer until it completes. Its status's waiter; it does not keep the queue alive
// (the queue's destructor completes every pending transfer first, so a waiter that finds the
// queue gone finds its status done).
struct GpuPending : Status::Waiter {
  std::weak_ptr<XgmiQueue> q;
  std::weak_ptr<Status> status;
  std::vector<void*> events;  // pooled, recorded after its copies, one per stream used
  GpuTokenPtr local, remote;
  std::string what;
  std::atomic<bool> done{false};
  bool wait(Status& s, int64_t timeout_ms) override;
};
using GpuPendingPtr = std::shared_ptr<GpuPending>;

struct XgmiConfig {
  GpuCalls calls;
  uint64_t context = 0;  // CUDA: the GPU's context; HIP: its device ordinal
  std::vector<void*> streams;
  std::vector<GpuTable> tables;
  int num_events = 64;  // events created up front (more are made when all are in use)
  uint64_t threshold = 8;  // blocks for a kernel launch; 0: never
  int64_t timeout_ms = 30000;  // drain() without a limit of its own
};

class XgmiQueue : public std::enable_shared_from_this<XgmiQueue> {
 public:
  explicit XgmiQueue(XgmiConfig cfg);
  ~XgmiQueue();  // close()
  XgmiQueue(const XgmiQueue&) = delete;
  XgmiQueue& operator=(const XgmiQueue&) = delete;

  // Throws std::runtime_error naming the driver call if the queue's events cannot be made.
  void start();
  void set_kernel(int word, GpuKernel k);
  bool has_kernel(int word);
  void set_threshold(uint64_t t) { threshold_.store(t); }
  uint64_t threshold() const { return threshold_.load(); }

  // One transfer: blocks [offsets, offsets + sizes) of the local region at `lbase` (lsize bytes)
  // and the remote region at `rbase` (rsize bytes); write: local -> remote. `stream`: the caller's
  // current stream, which the copies follow. `kernel_ok`: whether the kernel may touch both.
  StatusPtr post(bool write, uint64_t lbase, uint64_t lsize, uint64_t rbase, uint64_t rsize,
                 const std::vector<uint64_t>& loffs, const std::vector<uint64_t>& roffs,
                 const std::vector<uint64_t>& sizes, uint64_t uid, void* stream, bool kernel_ok,
                 const GpuTokenPtr& local, const GpuTokenPtr& remote, const std::string& peer);

  // Marks the token invalid (later posts with it fail) and waits until no pending transfer uses
  // it; false if some were still pending after timeout_ms (< 0: the queue's timeout).
  bool retire(const GpuTokenPtr& token, int64_t timeout_ms);
  // Completes every pending transfer (waiting for its events) and stops the completion thread.
  void close();
  std::map<std::string, int64_t> counters();

  // used by GpuPending
  bool wait_pending(GpuPending& p, int64_t timeout_ms);

 private:
  struct Copy {
    uint64_t dst, src, n;
  };
  void complete_loop();
  void finish(GpuPending& p, int code, const std::string& msg);
  std::string error(const std::string& op, int rc);
  int make_current(uint64_t* prev);  // 0 or a driver result
  void restore(uint64_t prev);
  void* stream_next();
  void* pooled_event();  // with mu_ held; nullptr + last_rc_ if none could be made
  int memcpy(uint64_t dst, uint64_t src, uint64_t n, void* stream);
  GpuTable* free_table();  // with mu_ held; nullptr + last_rc_ on a driver error

  XgmiConfig cfg_;
  std::atomic<uint64_t> threshold_;
  std::mutex mu_;  // streams, events, tables, kernels, tokens' inflight, pending_
  std::condition_variable idle_cv_;
  std::vector<void*> free_events_;
  std::vector<void*> all_events_;
  std::map<int, GpuKernel> kernels_;
  uint64_t next_stream_ = 0;
  size_t next_table_ = 0;
  void* order_event_ = nullptr;
  int last_rc_ = 0;
  std::deque<GpuPendingPtr> queue_;  // for the completion thread, posting order
  std::condition_variable queue_cv_;
  int64_t pending_ = 0;
  bool closed_ = false;
  bool stop_ = false;
  std::thread thread_;
  std::atomic<int64_t> copies_{0}, kernel_launches_{0}, kernel_blocks_{0}, transfers_{0};
};

}  // namespace mori::transfer

// The TCP backend's DeviceCopier (engine.hpp) on a GPU driver: copies between device memory and the
// engine's staging buffers with the driver's own functions (no Python, no GIL), and allocates those
// buffers pinned (page-locked, so the GPU's copy engines move them directly).
//
// Each copy makes the region's GPU current on the calling engine thread, queues one copy on that
// thread's stream for that GPU (made on first use, kept until the copier goes) and waits for it.
// The engine pipelines a large transfer by running its pieces on several connections at once.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "engine.hpp"
#include "gpu_calls.hpp"

namespace mori::transfer {

class GpuCopier {
 public:
  // contexts: device ordinal -> its context (CUDA: the primary context; HIP: the ordinal itself);
  // more are added as regions on other GPUs are registered (add_context).
  GpuCopier(GpuCalls calls, std::map<int, uint64_t> contexts);
  ~GpuCopier();  // destroys the streams it made
  GpuCopier(const GpuCopier&) = delete;
  GpuCopier& operator=(const GpuCopier&) = delete;

  // The C entry points, with this copier as their context (it must outlive their users).
  DeviceCopier entry_points();
  // 0, or the driver's result (-1: `device` has no context here).
  int copy(uint64_t dst, uint64_t src, uint64_t n, int device);
  void* alloc_host(uint64_t n);  // pinned; nullptr if the driver refused
  void free_host(void* p);
  int64_t copies() const { return copies_.load(); }
  void add_context(int device, uint64_t ctx);

 private:
  void* stream(int device, int* rc);  // this thread's stream on `device` (current already)
  bool context_of(int device, uint64_t* ctx);
  GpuCalls c_;
  std::mutex mu_;  // contexts_, streams_
  std::map<int, uint64_t> contexts_;
  std::map<std::pair<std::thread::id, int>, void*> streams_;
  std::atomic<int64_t> copies_{0};
};

}  // namespace mori::transfer

// The TCP backend's staging copier on a GPU driver; see gpu_copier.hpp.
#include "gpu_copier.hpp"

#include <stdexcept>

namespace mori::transfer {

namespace {

int c_to_host(void* ctx, void* host_dst, uintptr_t device_src, uint64_t n, int device) {
  return static_cast<GpuCopier*>(ctx)->copy(reinterpret_cast<uint64_t>(host_dst), device_src, n, device);
}
int c_from_host(void* ctx, uintptr_t device_dst, const void* host_src, uint64_t n, int device) {
  return static_cast<GpuCopier*>(ctx)->copy(device_dst, reinterpret_cast<uint64_t>(host_src), n, device);
}
void* c_alloc_host(void* ctx, uint64_t n) { return static_cast<GpuCopier*>(ctx)->alloc_host(n); }
void c_free_host(void* ctx, void* p) { static_cast<GpuCopier*>(ctx)->free_host(p); }

}  // namespace

GpuCopier::GpuCopier(GpuCalls calls, std::map<int, uint64_t> contexts)
    : c_(std::move(calls)), contexts_(std::move(contexts)) {
  if (!c_.memcpy_async || !c_.get_context || !c_.set_context || !c_.stream_create || !c_.stream_synchronize ||
      !c_.stream_destroy)
    throw std::invalid_argument("GpuCopier: a required driver function is missing");
  if (contexts_.empty()) throw std::invalid_argument("GpuCopier: no GPU");
}

GpuCopier::~GpuCopier() {
  std::lock_guard<std::mutex> g(mu_);
  for (auto& [key, s] : streams_) {
    uint64_t ctx = contexts_.at(key.second), prev = 0;
    if (gpu_make_current(c_, ctx, &prev) == 0) {
      c_.stream_destroy(s);
      gpu_restore(c_, ctx, prev);
    }
  }
}

DeviceCopier GpuCopier::entry_points() {
  DeviceCopier d;
  d.to_host = &c_to_host;
  d.from_host = &c_from_host;
  if (c_.host_alloc && c_.host_free) {
    d.host_alloc = &c_alloc_host;
    d.host_free = &c_free_host;
  }
  d.ctx = this;
  return d;
}

void GpuCopier::add_context(int device, uint64_t ctx) {
  std::lock_guard<std::mutex> g(mu_);
  contexts_[device] = ctx;
}

bool GpuCopier::context_of(int device, uint64_t* ctx) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = contexts_.find(device);
  if (it == contexts_.end()) return false;
  *ctx = it->second;
  return true;
}

void* GpuCopier::stream(int device, int* rc) {
  auto key = std::make_pair(std::this_thread::get_id(), device);
  std::lock_guard<std::mutex> g(mu_);
  auto it = streams_.find(key);
  if (it != streams_.end()) return it->second;
  void* s = nullptr;
  *rc = c_.stream_create(&s, c_.stream_flags);
  if (*rc) return nullptr;
  streams_[key] = s;
  return s;
}

int GpuCopier::copy(uint64_t dst, uint64_t src, uint64_t n, int device) {
  uint64_t ctx = 0, prev = 0;
  if (!context_of(device, &ctx)) return -1;
  int rc = gpu_make_current(c_, ctx, &prev);
  if (rc) return rc;
  void* s = stream(device, &rc);
  if (s) rc = gpu_memcpy(c_, dst, src, n, s);
  if (rc == 0) rc = c_.stream_synchronize(s);
  gpu_restore(c_, ctx, prev);
  if (rc == 0) copies_.fetch_add(1, std::memory_order_relaxed);
  return rc;
}

void* GpuCopier::alloc_host(uint64_t n) {
  uint64_t ctx = 0, prev = 0;
  {
    std::lock_guard<std::mutex> g(mu_);
    ctx = contexts_.begin()->second;  // portable: usable with every GPU's context
  }
  void* p = nullptr;
  if (gpu_make_current(c_, ctx, &prev) != 0) return nullptr;
  if (c_.host_alloc(&p, n, c_.host_alloc_flags) != 0) p = nullptr;
  gpu_restore(c_, ctx, prev);
  return p;
}

void GpuCopier::free_host(void* p) {
  uint64_t ctx = 0, prev = 0;
  {
    std::lock_guard<std::mutex> g(mu_);
    ctx = contexts_.begin()->second;
  }
  if (gpu_make_current(c_, ctx, &prev) != 0) return;
  c_.host_free(p);
  gpu_restore(c_, ctx, prev);
}

}  // namespace mori::transfer

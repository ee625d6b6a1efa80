// GPU memory over the socket path: device blocks staged through host buffers by the device
// copier a plugin installs (engine.hpp: DeviceCopier, StageBuffer).
#include <cstdlib>

#include "engine.hpp"

namespace mori::transfer {

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

}  // namespace mori::transfer

// The GPU driver's functions as native code calls them (the XGMI queue, the staging copier), and
// the few helpers whose calls differ between CUDA and HIP. No vendor header: the device plugin's
// ctypes binding hands the functions' addresses over (mori.core.gpu.driver.CtypesDriver.native_calls).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

namespace mori::transfer {

// Driver functions as the device plugin's binding resolved them (addresses of C functions: the real
// library's, or a test's). Where CUDA and HIP differ, the field says how.
struct GpuCalls {
  // CUDA cuMemcpyAsync(u64 dst, u64 src, size_t, stream); HIP hipMemcpyAsync(dst, src, size_t, kind, stream)
  void* memcpy_async = nullptr;
  int memcpy_kind = -1;  // -1: the CUDA form; otherwise HIP's `kind` argument (hipMemcpyDefault)
  int (*event_record)(void* event, void* stream) = nullptr;
  int (*stream_wait_event)(void* stream, void* event, unsigned flags) = nullptr;
  int (*event_query)(void* event) = nullptr;
  int (*event_synchronize)(void* event) = nullptr;
  int (*event_create)(void** event, unsigned flags) = nullptr;
  int (*event_destroy)(void* event) = nullptr;
  // cuLaunchKernel / hipModuleLaunchKernel (same arguments); null: no kernel launches
  int (*launch_kernel)(void* function, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                       unsigned shared, void* stream, void** params, void** extra) = nullptr;
  // CUDA cuCtxGetCurrent(void**) / cuCtxSetCurrent(void*); HIP hipGetDevice(int*) / hipSetDevice(int)
  void* get_context = nullptr;
  void* set_context = nullptr;
  bool context_is_device = false;
  // CUDA cuGetErrorName(int, const char**); HIP const char* hipGetErrorName(int); null: numbers only
  void* error_name = nullptr;
  bool error_name_returns_string = false;
  // the staging copier's (gpu_copier.hpp): CUDA cuStreamCreate / hipStreamCreateWithFlags(void**,
  // flags), cu/hipStreamSynchronize, cu/hipStreamDestroy, cuMemHostAlloc / hipHostMalloc(void**,
  // size_t, flags), cuMemFreeHost / hipHostFree; null where a user does not need them
  int (*stream_create)(void** stream, unsigned flags) = nullptr;
  int (*stream_synchronize)(void* stream) = nullptr;
  int (*stream_destroy)(void* stream) = nullptr;
  int (*host_alloc)(void** ptr, size_t bytes, unsigned flags) = nullptr;
  int (*host_free)(void* ptr) = nullptr;
  int not_ready = 600;
  unsigned event_flags = 2;  // disable timing (same value for CUDA and HIP)
  unsigned stream_flags = 1;  // non-blocking (same value for CUDA and HIP)
  unsigned host_alloc_flags = 3;  // portable | device-mapped
  std::map<std::string, std::string> names;  // operation -> C function name, for messages
};

// Makes `ctx` (CUDA: a context, HIP: a device ordinal) the calling thread's current GPU; *prev:
// what gpu_restore puts back. Returns 0 or the driver's result.
inline int gpu_make_current(const GpuCalls& c, uint64_t ctx, uint64_t* prev) {
  if (c.context_is_device) {
    int dev = -1;
    int rc = reinterpret_cast<int (*)(int*)>(c.get_context)(&dev);
    if (rc) return rc;
    *prev = uint64_t(dev);
    return uint64_t(dev) == ctx ? 0 : reinterpret_cast<int (*)(int)>(c.set_context)(int(ctx));
  }
  void* cur = nullptr;
  int rc = reinterpret_cast<int (*)(void**)>(c.get_context)(&cur);
  if (rc) return rc;
  *prev = reinterpret_cast<uint64_t>(cur);
  return *prev == ctx ? 0 : reinterpret_cast<int (*)(void*)>(c.set_context)(reinterpret_cast<void*>(ctx));
}

inline void gpu_restore(const GpuCalls& c, uint64_t ctx, uint64_t prev) {
  if (prev == ctx) return;
  if (c.context_is_device)
    reinterpret_cast<int (*)(int)>(c.set_context)(int(prev));
  else
    reinterpret_cast<int (*)(void*)>(c.set_context)(reinterpret_cast<void*>(prev));
}

// An async copy between any two unified addresses, in `stream` order.
inline int gpu_memcpy(const GpuCalls& c, uint64_t dst, uint64_t src, uint64_t n, void* stream) {
  if (c.memcpy_kind < 0)
    return reinterpret_cast<int (*)(uint64_t, uint64_t, size_t, void*)>(c.memcpy_async)(dst, src, n, stream);
  return reinterpret_cast<int (*)(void*, const void*, size_t, int, void*)>(c.memcpy_async)(
      reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n, c.memcpy_kind, stream);
}

// "cuMemcpyAsync failed: CUDA_ERROR_X (700)" for operation `op` (a key of GpuCalls::names).
inline std::string gpu_error(const GpuCalls& c, const std::string& op, int rc) {
  auto it = c.names.find(op);
  std::string call = it != c.names.end() ? it->second : op;
  const char* name = nullptr;
  if (c.error_name) {
    if (c.error_name_returns_string) {
      name = reinterpret_cast<const char* (*)(int)>(c.error_name)(rc);
    } else if (reinterpret_cast<int (*)(int, const char**)>(c.error_name)(rc, &name) != 0) {
      name = nullptr;
    }
  }
  return call + " failed: " + (name ? std::string(name) + " (" + std::to_string(rc) + ")" : "result " + std::to_string(rc));
}

}  // namespace mori::transfer

#include "ucx_api.hpp"

#include <dlfcn.h>
#include <signal.h>

#include <cstdlib>

#include <mutex>

namespace mori_ucx {

namespace {

std::mutex g_mu;
UcxApi g_api;
bool g_loaded = false;
std::vector<std::string> g_libraries;  // what the successful load opened
std::string g_error;                   // why the last load failed

std::string path_of(void* symbol) {
  Dl_info info{};
  if (symbol && dladdr(symbol, &info) && info.dli_fname) return info.dli_fname;
  return "?";
}

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : ", ") + s;
  return out;
}

// libucs installs signal handlers when it is loaded: SIGHUP for its debug mode (UCX_DEBUG_SIGNO)
// and, with UCX_HANDLE_ERRORS, the error signals. A library must not change the host's signal
// handling, so whatever changed across the dlopen is put back, unless the user asked UCX for it.
struct SignalGuard {
  struct sigaction saved[NSIG];
  bool keep = std::getenv("UCX_DEBUG_SIGNO") || std::getenv("UCX_ERROR_SIGNALS") || std::getenv("UCX_HANDLE_ERRORS");
  SignalGuard() {
    for (int s = 1; s < NSIG; ++s) sigaction(s, nullptr, &saved[s]);
  }
  ~SignalGuard() {
    if (keep) return;
    for (int s = 1; s < NSIG; ++s) {
      struct sigaction now {};
      if (sigaction(s, nullptr, &now) != 0) continue;
      if (now.sa_handler != saved[s].sa_handler || now.sa_flags != saved[s].sa_flags) sigaction(s, &saved[s], nullptr);
    }
  }
};

// libucs, when loaded, initialises UCX's memory hooks (UCM), which patch the process's mmap,
// munmap, brk, madvise, shmat... in libc's own code (binary instrumentation) to feed UCX's
// registration caches. A library must not rewrite its host's libc, so unless the user asked
// (UCX_MEM_EVENTS set), UCM is loaded with UCX_MEM_EVENTS=n: set only across the dlopen, then
// removed again. UCX then registers memory without those caches: correct, and what an explicit
// ucp_mem_map needs anyway.
struct MemEventsGuard {
  bool set = false;
  explicit MemEventsGuard(UcxApi& a) {
    if (std::getenv("UCX_MEM_EVENTS")) return;
    set = setenv("UCX_MEM_EVENTS", "n", 0) == 0;
    a.ucm_events_disabled = set;
  }
  ~MemEventsGuard() {
    if (set) unsetenv("UCX_MEM_EVENTS");
  }
};

std::string try_load(const std::vector<std::string>& libraries, UcxApi& a) {
  if (libraries.empty()) return "no UCX library to load was named";
  SignalGuard signals;
  MemEventsGuard mem_events(a);
  void* ucp = nullptr;
  for (const auto& lib : libraries) {
    // RTLD_LOCAL: UCX's symbols stay out of the global namespace, so another UCX in the process
    // (an MPI's, NIXL's) is not overridden by ours, nor ours by it.
    void* h = dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = dlerror();
      return "cannot load " + lib + ": " + (e ? e : "dlopen failed");
    }
    ucp = h;  // the last one is libucp; its dependencies are searched by dlsym too
  }
#define MORI_UCX_FN(name)                                                                \
  a.name = reinterpret_cast<decltype(&::name)>(dlsym(ucp, #name));                       \
  if (!a.name) return "the UCX library " + libraries.back() + " lacks " #name " (UCX older than 1.10?)";
#include "ucx_functions.inc"
#undef MORI_UCX_FN
  a.ucp_get_version(&a.major, &a.minor, &a.release);
  a.libucp_path = path_of(reinterpret_cast<void*>(a.ucp_put_nbx));
  a.libucs_path = path_of(reinterpret_cast<void*>(a.ucs_status_string));
  if (a.major != 1 || a.minor < 12)
    return "UCX " + std::to_string(a.major) + "." + std::to_string(a.minor) + "." + std::to_string(a.release) +
           " from " + a.libucp_path + " is too old: mori-backend-ucx needs UCX 1.12 or newer";
  return "";
}

}  // namespace

const UcxApi* api() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_loaded ? &g_api : nullptr;
}

std::string load(const std::vector<std::string>& libraries) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_loaded) {
    if (libraries == g_libraries) return "";
    return "UCX is already loaded in this process from " + join(g_libraries) + "; cannot switch to " +
           join(libraries);
  }
  UcxApi a;
  std::string err = try_load(libraries, a);
  if (!err.empty()) {
    g_error = err;
    return err;
  }
  g_api = a;
  g_libraries = libraries;
  g_loaded = true;
  return "";
}

const char* status_string(ucs_status_t status) {
  const UcxApi* a = api();
  return a ? a->ucs_status_string(status) : "UCX is not loaded";
}

}  // namespace mori_ucx

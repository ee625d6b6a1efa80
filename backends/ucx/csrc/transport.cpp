// The `ucx` transport: mori/transport.h on UCX's UCP API.
//
// One ucp context and one worker per instance (thread mode MULTI where this UCX build has it, our
// own lock around every UCX call where not). Requests are our own ids; UCX's request handles never
// leave this file. A completion callback only touches our Req (and the request table's mutex), so
// the lock order is always "UCX's worker lock, then ours", and no UCX function is ever called with
// one of our mutexes held.
//
// Every peer is untrusted: addresses and keys are wrapped in our own envelopes (magic, version,
// lengths, the packing instance's id, and for keys the registration's base and size), checked
// before UCX sees them; every operation is checked against the key's range on this side. What UCX
// itself enforces on the target is in README.md ("What the target enforces").
#include "transport.hpp"

#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cinttypes>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "options.hpp"
#include "ucx_api.hpp"

using mori_ucx::Options;
using mori_ucx::UcxApi;

namespace {

const UcxApi& U() { return *mori_ucx::api(); }

// ---------------------------------------------------------------------------------------------
// errors

int fail(mori_tp_error* err, int code, const std::string& msg) {
  if (err) {
    err->code = code;
    std::snprintf(err->message, sizeof(err->message), "%s", msg.c_str());
  }
  return code;
}

std::string hex(uint64_t v) {
  char b[32];
  std::snprintf(b, sizeof(b), "0x%" PRIx64, v);
  return b;
}

std::string st(ucs_status_t s) { return std::string(U().ucs_status_string(s)) + " (UCX status " + std::to_string(s) + ")"; }

int code_of(ucs_status_t s) {
  switch (s) {
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_EXCEEDS_LIMIT:
      return MORI_TP_ENOMEM;
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_CANCELED:
    case UCS_ERR_REJECTED:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_TIMED_OUT:
    case UCS_ERR_IO_ERROR:
    case UCS_ERR_NO_DEVICE:
      return MORI_TP_EUNREACH;
    case UCS_ERR_UNSUPPORTED:
      return MORI_TP_ENOTSUP;
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_INVALID_ADDR:
      return MORI_TP_EINVAL;
    default:
      return MORI_TP_EINTERNAL;
  }
}

// ---------------------------------------------------------------------------------------------
// wire envelopes (little-endian, fixed layout; both ends run this code)

constexpr char kAddrMagic[8] = {'M', 'O', 'R', 'I', 'U', 'C', 'X', 'A'};
constexpr char kKeyMagic[8] = {'M', 'O', 'R', 'I', 'U', 'C', 'X', 'K'};
constexpr uint32_t kWireVersion = 1;
constexpr uint32_t kMaxUcxBlob = 1 << 16;  // a worker address or packed key is a few hundred bytes

struct AddrHeader {
  char magic[8];
  uint32_t version;
  uint32_t ucx_len;
  uint64_t instance;
  // who the peer is on its host, so that a same-host peer that exits is noticed (README)
  uint32_t pid;
  uint32_t reserved;
  uint64_t start_time;  // /proc/<pid>/stat field 22: tells a reused pid apart
  uint64_t pid_ns;      // inode of /proc/self/ns/pid
  char boot_id[16];     // /proc/sys/kernel/random/boot_id, raw
};
struct KeyHeader {
  char magic[8];
  uint32_t version;
  uint32_t ucx_len;
  uint64_t instance;
  uint64_t base;
  uint64_t size;
  uint32_t mem_type;
  uint32_t reserved;
};
static_assert(sizeof(AddrHeader) == 64 && sizeof(KeyHeader) == 48, "wire layout");

// ---------------------------------------------------------------------------------------------
// process identity (for noticing a same-host peer that exited)

// The process's start time (/proc/<pid>/stat field 22), 0 if it is gone or a zombie.
uint64_t start_time_of(uint32_t pid) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%u/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (!f) return 0;
  char buf[1024];
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* p = std::strrchr(buf, ')');  // the command name may hold spaces
  if (!p || !p[1] || !p[2] || p[2] == 'Z' || p[2] == 'X') return 0;  // ") S ...": field 3 is the state
  // after ")": field 3 (state) ... field 22 (starttime)
  int field = 2;
  for (; *p && field < 22; ++p)
    if (*p == ' ') ++field;
  return std::strtoull(p, nullptr, 10);
}

void fill_identity(AddrHeader& h) {
  h.pid = static_cast<uint32_t>(::getpid());
  h.start_time = start_time_of(h.pid);
  struct stat sb {};
  h.pid_ns = ::stat("/proc/self/ns/pid", &sb) == 0 ? static_cast<uint64_t>(sb.st_ino) : 0;
  std::memset(h.boot_id, 0, sizeof(h.boot_id));
  FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r");
  if (f) {
    char text[64] = {0};
    if (std::fgets(text, sizeof(text), f)) {
      int j = 0;
      for (int i = 0; text[i] && j < 32; ++i) {
        char c = text[i];
        int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (v < 0) continue;
        h.boot_id[j / 2] = static_cast<char>(h.boot_id[j / 2] | (j % 2 ? v : v << 4));
        ++j;
      }
    }
    std::fclose(f);
  }
}

int copy_out(const std::string& bytes, void* buf, size_t* len, mori_tp_error* err, const char* what) {
  if (!len) return fail(err, MORI_TP_EINVAL, std::string(what) + ": len is NULL");
  size_t have = *len;
  *len = bytes.size();
  if (!buf || have < bytes.size())
    return fail(err, MORI_TP_EINVAL,
                std::string(what) + ": the buffer holds " + std::to_string(have) + " bytes, " +
                    std::to_string(bytes.size()) + " are needed");
  std::memcpy(buf, bytes.data(), bytes.size());
  return MORI_TP_OK;
}

const char* mem_type_name(int t) {
  return t == MORI_TP_MEM_HOST ? "host" : t == MORI_TP_MEM_CUDA ? "cuda" : t == MORI_TP_MEM_ROCM ? "rocm" : "?";
}

ucs_memory_type_t ucs_type_of(int t) {
  return t == MORI_TP_MEM_CUDA ? UCS_MEMORY_TYPE_CUDA : t == MORI_TP_MEM_ROCM ? UCS_MEMORY_TYPE_ROCM : UCS_MEMORY_TYPE_HOST;
}

std::string memory_types_text(uint64_t mask) {
  static const std::pair<ucs_memory_type_t, const char*> names[] = {
      {UCS_MEMORY_TYPE_HOST, "host"},           {UCS_MEMORY_TYPE_CUDA, "cuda"},
      {UCS_MEMORY_TYPE_CUDA_MANAGED, "cuda-managed"}, {UCS_MEMORY_TYPE_ROCM, "rocm"},
      {UCS_MEMORY_TYPE_ROCM_MANAGED, "rocm-managed"}, {UCS_MEMORY_TYPE_RDMA, "rdma"},
      {UCS_MEMORY_TYPE_ZE_HOST, "ze-host"},     {UCS_MEMORY_TYPE_ZE_DEVICE, "ze-device"},
      {UCS_MEMORY_TYPE_ZE_MANAGED, "ze-managed"}};
  std::string out;
  for (const auto& [t, n] : names)
    if (mask & (uint64_t{1} << t)) out += (out.empty() ? "" : ",") + std::string(n);
  return out.empty() ? "none" : out;
}

uint64_t random_u64() {
  std::random_device rd;
  uint64_t v = 0;
  while (v == 0) v = (uint64_t{rd()} << 32) ^ rd();
  return v;
}

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// ---------------------------------------------------------------------------------------------
// UCX context setup shared by create(), describe() and init_caps()

struct ConfigGuard {
  ucp_config_t* cfg = nullptr;
  ~ConfigGuard() {
    if (cfg) U().ucp_config_release(cfg);
  }
};

// A context with our settings applied. Returns "" or why not.
std::string make_context(const Options& o, bool wakeup, ucp_context_h* ctx) {
  ConfigGuard g;
  ucs_status_t s = U().ucp_config_read(nullptr, nullptr, &g.cfg);
  if (s != UCS_OK) return "reading UCX's configuration: " + st(s);
  auto modify = [&](const std::string& name, const std::string& value, const std::string& shown) -> std::string {
    ucs_status_t m = U().ucp_config_modify(g.cfg, name.c_str(), value.c_str());
    if (m != UCS_OK) return shown + ": UCX refused it: " + st(m);
    return "";
  };
  std::string e;
  if (!o.tls.empty() && !(e = modify("TLS", o.tls, "option tls='" + o.tls + "'")).empty()) return e;
  // Listening beyond loopback is opt-in (README: "Who can reach a worker").
  std::string devices = o.net_devices;
  if (devices.empty() && !std::getenv("UCX_NET_DEVICES")) devices = "lo";
  if (!devices.empty() && !(e = modify("NET_DEVICES", devices, "option net_devices='" + devices + "'")).empty())
    return e;
  if (o.keepalive_ms > 0 &&
      !(e = modify("KEEPALIVE_INTERVAL", std::to_string(o.keepalive_ms) + "ms",
                   "option keepalive_ms=" + std::to_string(o.keepalive_ms)))
           .empty())
    return e;
  // Atomics must be atomic with the target CPU's own atomics (MORI_TP_CAP_ATOMIC_NATIVE): SHMEM
  // mixes remote atomics with local ones on the same words.
  if (!(e = modify("ATOMIC_MODE", "cpu", "UCX_ATOMIC_MODE=cpu")).empty()) return e;
  for (const auto& [name, value] : o.ucx)
    if (!(e = modify(name, value, "option UCX_" + name + "='" + value + "'")).empty()) return e;

  ucp_params_t p{};
  p.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  p.features = UCP_FEATURE_RMA | UCP_FEATURE_AMO32 | UCP_FEATURE_AMO64 | (wakeup ? UCP_FEATURE_WAKEUP : 0);
  p.mt_workers_shared = 1;  // ucp_mem_map and friends may be called from any thread
  // Tell UCX the API version we were built for, or the library's own when it is older (the
  // structures we fill exist in every version we accept).
  unsigned major = UCP_API_MAJOR, minor = UCP_API_MINOR;
  if (U().minor < minor) minor = U().minor;
  s = U().ucp_init_version(major, minor, &p, g.cfg, ctx);
  if (s != UCS_OK) {
    const char* env_tls = std::getenv("UCX_TLS");
    std::string tls = o.tls.empty() ? std::string(env_tls ? env_tls : "all") : o.tls;
    std::string devs = devices.empty() ? std::string(std::getenv("UCX_NET_DEVICES")) : devices;
    std::string what = "ucp_init (tls=" + tls + ", net_devices=" + devs + "): " + st(s);
    // a choice of transports or devices that leaves UCX nothing is the caller's argument error
    if ((s == UCS_ERR_NO_DEVICE || s == UCS_ERR_NO_ELEM) && (!o.tls.empty() || !o.net_devices.empty()))
      return "option tls='" + tls + "' / net_devices='" + devs + "' leave UCX no usable transport: " + what;
    return what;
  }
  return "";
}

uint64_t context_memory_types(ucp_context_h ctx) {
  ucp_context_attr_t a{};
  a.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (U().ucp_context_query(ctx, &a) != UCS_OK) return uint64_t{1} << UCS_MEMORY_TYPE_HOST;
  return a.memory_types;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// the objects of the contract

struct mori_tp_ep {
  mori_tp* tp = nullptr;
  ucp_ep_h ep = nullptr;
  uint64_t peer = 0;                          // the peer instance's id (from its address)
  std::atomic<int> failed{UCS_OK};            // set by UCX's error handler
  std::atomic<int> pending{0};                // operations posted and not yet completed
  void* closing = nullptr;                    // ucp_ep_close_nbx's request while closing
  // a peer on this host (same boot id and pid namespace): its process can be watched
  bool same_host = false;
  uint32_t peer_pid = 0;
  uint64_t peer_start = 0;
  std::atomic<bool> peer_exited{false};
  std::atomic<int64_t> next_check_ms{0};
};

struct mori_tp_mem {
  ucp_mem_h memh = nullptr;
  uint64_t base = 0, size = 0;
  int mem_type = MORI_TP_MEM_HOST;
  std::string packed;  // our key envelope, made at registration
  std::atomic<int> pending{0};
};

struct mori_tp_rkey {
  ucp_rkey_h rkey = nullptr;
  mori_tp_ep* ep = nullptr;
  uint64_t base = 0, size = 0;
  int mem_type = MORI_TP_MEM_HOST;
  std::atomic<int> pending{0};
};

namespace {

enum ReqState : int { kPending = 0, kDone = 1, kFailed = 2 };

struct Req {
  uint64_t id = 0;
  mori_tp* tp = nullptr;
  std::atomic<int> state{kPending};
  ucs_status_t status = UCS_OK;
  bool deliver = false;   // an atomic: its old value goes to *old when the caller sees it done
  uint64_t* old = nullptr;
  int word = MORI_TP_WORD_UINT64;
  union {
    uint64_t u64;
    uint32_t u32;
  } operand{}, result{};
  mori_tp_ep* ep = nullptr;
  mori_tp_mem* mem = nullptr;
  mori_tp_rkey* rkey = nullptr;
  bool abandoned = false;  // given up on (its peer exited): UCX may still call back; freed at destroy
  char what[160] = {0};
};

}  // namespace

struct mori_tp {
  Options opt;
  ucp_context_h ctx = nullptr;
  ucp_worker_h worker = nullptr;
  bool multi = false;           // the worker is UCS_THREAD_MODE_MULTI: UCX locks itself
  std::recursive_mutex big;     // otherwise this serialises every UCX call
  uint64_t instance = 0;
  std::string address;          // our envelope around the worker address
  uint64_t mem_types = 0;       // UCS_BIT(ucs_memory_type_t) this context supports
  bool has_memh_param = false;  // UCP_OP_ATTR_FIELD_MEMH understood (UCX >= 1.15)

  std::mutex req_mu;  // guards reqs and next_id; never held across a UCX call
  std::unordered_map<uint64_t, Req*> reqs;
  uint64_t next_id = 1;
  std::vector<Req*> abandoned;
  AddrHeader self{};  // our identity, as peers see it

  std::mutex obj_mu;  // guards the sets below; never held across a UCX call
  std::unordered_set<mori_tp_ep*> eps;        // connected
  std::vector<mori_tp_ep*> closing;           // disconnected, waiting for UCX and their operations
  std::unordered_set<mori_tp_mem*> mems;      // registered, not yet deregistered
  std::unordered_set<mori_tp_rkey*> rkeys;    // unpacked, not yet released
  std::vector<mori_tp_mem*> dead_mems;        // deregistered while operations were pending
  std::vector<mori_tp_rkey*> dead_rkeys;      // released while operations were pending
  std::atomic<int> deferred{0};               // closing + dead_* sizes, read without the lock

  std::thread progress_thread;
  std::atomic<bool> stop{false};
  int efd = -1;
};

namespace {

// Serialises UCX calls where the worker is not thread-safe by itself.
struct UcxLock {
  std::unique_lock<std::recursive_mutex> l;
  explicit UcxLock(mori_tp* tp) {
    if (!tp->multi) l = std::unique_lock<std::recursive_mutex>(tp->big);
  }
};

unsigned progress_once(mori_tp* tp) {
  UcxLock l(tp);
  return U().ucp_worker_progress(tp->worker);
}

// Free what was released while operations were pending, once they completed. Never called from
// a UCX callback.
void sweep(mori_tp* tp) {
  if (tp->deferred.load(std::memory_order_acquire) == 0) return;
  std::vector<mori_tp_ep*> closing;
  std::vector<mori_tp_mem*> mems;
  std::vector<mori_tp_rkey*> rkeys;
  {
    std::lock_guard<std::mutex> g(tp->obj_mu);
    closing.swap(tp->closing);
    mems.swap(tp->dead_mems);
    rkeys.swap(tp->dead_rkeys);
  }
  std::vector<mori_tp_ep*> keep_eps;
  std::vector<mori_tp_mem*> keep_mems;
  std::vector<mori_tp_rkey*> keep_rkeys;
  for (auto* r : rkeys) {
    if (r->pending.load(std::memory_order_acquire) == 0) {
      {
        UcxLock l(tp);
        U().ucp_rkey_destroy(r->rkey);
      }
      delete r;
    } else {
      keep_rkeys.push_back(r);
    }
  }
  for (auto* m : mems) {
    if (m->pending.load(std::memory_order_acquire) == 0) {
      U().ucp_mem_unmap(tp->ctx, m->memh);
      delete m;
    } else {
      keep_mems.push_back(m);
    }
  }
  for (auto* e : closing) {
    bool closed = true;
    if (e->closing) {
      UcxLock l(tp);
      if (U().ucp_request_check_status(e->closing) == UCS_INPROGRESS) {
        closed = false;
      } else {
        U().ucp_request_free(e->closing);
        e->closing = nullptr;
      }
    }
    if (closed && e->pending.load(std::memory_order_acquire) == 0)
      delete e;
    else
      keep_eps.push_back(e);
  }
  std::lock_guard<std::mutex> g(tp->obj_mu);
  tp->closing.insert(tp->closing.end(), keep_eps.begin(), keep_eps.end());
  tp->dead_mems.insert(tp->dead_mems.end(), keep_mems.begin(), keep_mems.end());
  tp->dead_rkeys.insert(tp->dead_rkeys.end(), keep_rkeys.begin(), keep_rkeys.end());
  tp->deferred.store(static_cast<int>(tp->closing.size() + tp->dead_mems.size() + tp->dead_rkeys.size()),
                     std::memory_order_release);
}

void progress_loop(mori_tp* tp) {
  while (!tp->stop.load(std::memory_order_acquire)) {
    for (int i = 0; i < 64 && progress_once(tp); ++i) {
    }
    sweep(tp);
    ucs_status_t s;
    {
      UcxLock l(tp);
      s = U().ucp_worker_arm(tp->worker);
    }
    if (s == UCS_ERR_BUSY) continue;  // more events arrived: progress again
    // Sleep until UCX has an event (or 100 ms pass: keepalive and deferred frees need a turn).
    pollfd p{tp->efd, POLLIN, 0};
    if (s == UCS_OK) {
      ::poll(&p, 1, 100);
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// requests

int64_t sign_extend(const Req* r) {
  if (r->word == MORI_TP_WORD_INT32) return static_cast<int32_t>(r->result.u32);
  if (r->word == MORI_TP_WORD_UINT32) return static_cast<int64_t>(r->result.u32);
  return static_cast<int64_t>(r->result.u64);
}

void drop_refs(Req* r) {
  if (r->ep) r->ep->pending.fetch_sub(1, std::memory_order_acq_rel);
  if (r->mem) r->mem->pending.fetch_sub(1, std::memory_order_acq_rel);
  if (r->rkey) r->rkey->pending.fetch_sub(1, std::memory_order_acq_rel);
}

// A new request in the table (bounded by max_requests), holding references on what it uses.
Req* new_req(mori_tp* tp, mori_tp_ep* ep, mori_tp_mem* mem, mori_tp_rkey* rkey, mori_tp_error* err) {
  auto* r = new Req;
  r->tp = tp;
  {
    std::lock_guard<std::mutex> g(tp->req_mu);
    if (tp->reqs.size() >= tp->opt.max_requests) {
      size_t n = tp->reqs.size();
      delete r;
      fail(err, MORI_TP_ENOMEM,
           std::to_string(n) + " requests are pending or completed without being tested (max_requests=" +
               std::to_string(tp->opt.max_requests) + "): test or wait them, or raise max_requests");
      return nullptr;
    }
    r->id = tp->next_id++;
    tp->reqs.emplace(r->id, r);
  }
  r->ep = ep;
  r->mem = mem;
  r->rkey = rkey;
  if (ep) ep->pending.fetch_add(1, std::memory_order_acq_rel);
  if (mem) mem->pending.fetch_add(1, std::memory_order_acq_rel);
  if (rkey) rkey->pending.fetch_add(1, std::memory_order_acq_rel);
  return r;
}

void erase_req(Req* r) {
  std::lock_guard<std::mutex> g(r->tp->req_mu);
  r->tp->reqs.erase(r->id);
}

// UCX's completion callback (runs inside ucp_worker_progress, on any thread).
void on_complete(void* ucx_request, ucs_status_t status, void* user_data) {
  auto* r = static_cast<Req*>(user_data);
  U().ucp_request_free(ucx_request);
  drop_refs(r);
  std::unique_lock<std::mutex> g(r->tp->req_mu);
  if (!r->abandoned && status == UCS_OK && !r->deliver) {
    r->tp->reqs.erase(r->id);  // nothing for the caller to collect: an untested request costs no slot
    g.unlock();
    delete r;
    return;
  }
  r->status = status;
  r->state.store(status == UCS_OK ? kDone : kFailed, std::memory_order_release);
}

// After posting: `sp` is what UCX returned. Sets *req (0 when done at once) or fails.
int finish_post(Req* r, uint64_t id, ucs_status_ptr_t sp, mori_tp_req* req, mori_tp_error* err) {
  if (sp == nullptr) {  // completed at once, no callback will come
    drop_refs(r);
    if (r->deliver && r->old) *r->old = static_cast<uint64_t>(sign_extend(r));
    erase_req(r);
    delete r;
    *req = 0;
    return MORI_TP_OK;
  }
  if (UCS_PTR_IS_ERR(sp)) {
    ucs_status_t s = UCS_PTR_STATUS(sp);
    std::string what = r->what;
    drop_refs(r);
    erase_req(r);
    delete r;
    return fail(err, code_of(s), what + ": " + st(s));
  }
  *req = id;  // `r` may already be completed and freed by another thread's progress: not touched
  return MORI_TP_OK;
}

ucp_request_param_t param_for(Req* r) {
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send = on_complete;
  p.user_data = r;
  return p;
}

// ---------------------------------------------------------------------------------------------
// argument checks shared by put, get and atomics

int check_ep(mori_tp* tp, mori_tp_ep* ep, mori_tp_error* err) {
  if (!tp) return fail(err, MORI_TP_EINVAL, "tp is NULL");
  if (!ep) return fail(err, MORI_TP_EINVAL, "ep is NULL");
  if (ep->peer_exited.load(std::memory_order_acquire))
    return fail(err, MORI_TP_EUNREACH,
                "the peer (instance " + hex(ep->peer) + ", process " + std::to_string(ep->peer_pid) +
                    " on this host) exited");
  int f = ep->failed.load(std::memory_order_acquire);
  if (f != UCS_OK)
    return fail(err, MORI_TP_EUNREACH,
                "the peer (instance " + hex(ep->peer) + ") went away: " + st(static_cast<ucs_status_t>(f)));
  return MORI_TP_OK;
}

int check_remote(const char* what, mori_tp_ep* ep, mori_tp_rkey* rk, uint64_t raddr, uint64_t n, mori_tp_error* err) {
  if (!rk) return fail(err, MORI_TP_EINVAL, std::string(what) + ": rkey is NULL");
  if (rk->ep != ep)
    return fail(err, MORI_TP_EINVAL, std::string(what) + ": the remote key was unpacked on another endpoint");
  uint64_t end = raddr + n;
  if (end < raddr || raddr < rk->base || end > rk->base + rk->size)
    return fail(err, MORI_TP_EACCESS,
                std::string(what) + " of " + std::to_string(n) + " bytes at " + hex(raddr) +
                    " is outside the peer's registered memory [" + hex(rk->base) + ", " + hex(rk->base + rk->size) +
                    ")");
  return MORI_TP_OK;
}

int check_local(const char* what, mori_tp_mem* lmem, const void* addr, uint64_t n, mori_tp_error* err) {
  if (n && !addr) return fail(err, MORI_TP_EINVAL, std::string(what) + ": the local buffer is NULL");
  if (!lmem) return MORI_TP_OK;
  uint64_t a = reinterpret_cast<uint64_t>(addr), end = a + n;
  if (end < a || a < lmem->base || end > lmem->base + lmem->size)
    return fail(err, MORI_TP_EINVAL,
                std::string(what) + ": the local buffer [" + hex(a) + ", " + hex(end) +
                    ") is not inside local_memory [" + hex(lmem->base) + ", " + hex(lmem->base + lmem->size) + ")");
  return MORI_TP_OK;
}

void describe_rma(Req* r, const char* what, uint64_t n, uint64_t raddr, const mori_tp_ep* ep) {
  std::snprintf(r->what, sizeof(r->what), "%s of %" PRIu64 " bytes at 0x%" PRIx64 " on the peer (instance 0x%" PRIx64 ")",
                what, n, raddr, ep->peer);
}

// ---------------------------------------------------------------------------------------------
// the ops

mori_tp* tp_create(const char* options, mori_tp_error* err) {
  if (!mori_ucx::api()) {
    fail(err, MORI_TP_EINTERNAL, "UCX is not loaded: open the transport through mori_backend_ucx (it loads UCX first)");
    return nullptr;
  }
  Options o;
  std::string e;
  if (!mori_ucx::parse_options(options, o, e)) {
    fail(err, MORI_TP_EINVAL, e);
    return nullptr;
  }
  auto* tp = new mori_tp;
  tp->opt = o;
  tp->instance = random_u64();
  tp->has_memh_param = U().minor >= 15;
  auto abandon = [&](int code, const std::string& msg) -> mori_tp* {
    if (tp->worker) U().ucp_worker_destroy(tp->worker);
    if (tp->ctx) U().ucp_cleanup(tp->ctx);
    delete tp;
    fail(err, code, msg);
    return nullptr;
  };
  e = make_context(o, o.progress_thread, &tp->ctx);
  if (!e.empty()) return abandon(e.rfind("option", 0) == 0 ? MORI_TP_EINVAL : MORI_TP_EINTERNAL, e);
  tp->mem_types = context_memory_types(tp->ctx);

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_MULTI;
  ucs_status_t s = U().ucp_worker_create(tp->ctx, &wp, &tp->worker);
  if (s != UCS_OK) return abandon(MORI_TP_EINTERNAL, "ucp_worker_create: " + st(s));
  ucp_worker_attr_t wa{};
  wa.field_mask = UCP_WORKER_ATTR_FIELD_THREAD_MODE;
  tp->multi = U().ucp_worker_query(tp->worker, &wa) == UCS_OK && wa.thread_mode == UCS_THREAD_MODE_MULTI;

  ucp_address_t* addr = nullptr;
  size_t addr_len = 0;
  s = U().ucp_worker_get_address(tp->worker, &addr, &addr_len);
  if (s != UCS_OK) return abandon(MORI_TP_EINTERNAL, "ucp_worker_get_address: " + st(s));
  if (addr_len == 0 || addr_len > kMaxUcxBlob) {
    U().ucp_worker_release_address(tp->worker, addr);
    return abandon(MORI_TP_EINTERNAL, "UCX's worker address has " + std::to_string(addr_len) + " bytes");
  }
  AddrHeader h{};
  std::memcpy(h.magic, kAddrMagic, 8);
  h.version = kWireVersion;
  h.ucx_len = static_cast<uint32_t>(addr_len);
  h.instance = tp->instance;
  fill_identity(h);
  tp->self = h;
  tp->address.assign(reinterpret_cast<const char*>(&h), sizeof(h));
  tp->address.append(reinterpret_cast<const char*>(addr), addr_len);
  U().ucp_worker_release_address(tp->worker, addr);

  if (o.progress_thread) {
    s = U().ucp_worker_get_efd(tp->worker, &tp->efd);
    if (s != UCS_OK) return abandon(MORI_TP_EINTERNAL, "ucp_worker_get_efd: " + st(s));
    tp->progress_thread = std::thread(progress_loop, tp);
  }
  return tp;
}

void close_ep(mori_tp* tp, mori_tp_ep* ep, bool force) {
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t sp;
  {
    UcxLock l(tp);
    sp = U().ucp_ep_close_nbx(ep->ep, &p);
  }
  ep->closing = (sp && !UCS_PTR_IS_ERR(sp)) ? sp : nullptr;
  std::lock_guard<std::mutex> g(tp->obj_mu);
  tp->closing.push_back(ep);
  tp->deferred.fetch_add(1, std::memory_order_acq_rel);
}

void tp_destroy(mori_tp* tp) {
  if (!tp) return;
  if (tp->progress_thread.joinable()) {
    tp->stop.store(true, std::memory_order_release);
    {
      UcxLock l(tp);
      U().ucp_worker_signal(tp->worker);
    }
    tp->progress_thread.join();
  }
  std::vector<mori_tp_ep*> eps;
  {
    std::lock_guard<std::mutex> g(tp->obj_mu);
    eps.assign(tp->eps.begin(), tp->eps.end());
    tp->eps.clear();
  }
  for (auto* e : eps) close_ep(tp, e, true);  // pending operations complete with an error
  // Give UCX a bounded time to finish the closes and call back every pending operation.
  int64_t deadline = now_ms() + 2000;
  while (now_ms() < deadline) {
    progress_once(tp);
    sweep(tp);
    std::lock_guard<std::mutex> g(tp->obj_mu);
    if (tp->closing.empty() && tp->dead_mems.empty() && tp->dead_rkeys.empty()) break;
  }
  std::vector<mori_tp_ep*> closing;
  {
    std::lock_guard<std::mutex> g(tp->obj_mu);
    closing.swap(tp->closing);
  }
  for (auto* e : closing)
    if (e->closing) U().ucp_request_free(e->closing);
  {
    std::lock_guard<std::mutex> g(tp->obj_mu);
    for (auto* r : tp->rkeys) U().ucp_rkey_destroy(r->rkey);
    for (auto* r : tp->dead_rkeys) U().ucp_rkey_destroy(r->rkey);
  }
  U().ucp_worker_destroy(tp->worker);  // may still call back requests UCX had not finished
  {
    std::lock_guard<std::mutex> g(tp->obj_mu);
    for (auto* m : tp->mems) U().ucp_mem_unmap(tp->ctx, m->memh);
    for (auto* m : tp->dead_mems) U().ucp_mem_unmap(tp->ctx, m->memh);
  }
  U().ucp_cleanup(tp->ctx);
  for (auto& [id, r] : tp->reqs) delete r;
  for (auto* r : tp->abandoned) delete r;
  for (auto* r : tp->rkeys) delete r;
  for (auto* r : tp->dead_rkeys) delete r;
  for (auto* m : tp->mems) delete m;
  for (auto* m : tp->dead_mems) delete m;
  for (auto* e : closing) delete e;
  delete tp;
}

int tp_address(mori_tp* tp, void* buf, size_t* len, mori_tp_error* err) {
  if (!tp) return fail(err, MORI_TP_EINVAL, "tp is NULL");
  return copy_out(tp->address, buf, len, err, "address");
}

int tp_wait(mori_tp* tp, mori_tp_req req, int64_t timeout_ms, mori_tp_error* err);

mori_tp_ep* tp_connect(mori_tp* tp, const void* peer_address, size_t len, mori_tp_error* err) {
  if (!tp) {
    fail(err, MORI_TP_EINVAL, "tp is NULL");
    return nullptr;
  }
  AddrHeader h{};
  if (!peer_address || len < sizeof(h)) {
    fail(err, MORI_TP_EINVAL, "the peer address has " + std::to_string(len) + " bytes; a ucx address has at least " +
                                  std::to_string(sizeof(h)));
    return nullptr;
  }
  std::memcpy(&h, peer_address, sizeof(h));
  if (std::memcmp(h.magic, kAddrMagic, 8) != 0) {
    fail(err, MORI_TP_EINVAL, "the peer address is not a ucx transport address (bad magic)");
    return nullptr;
  }
  if (h.version != kWireVersion) {
    fail(err, MORI_TP_EINVAL, "the peer address has wire version " + std::to_string(h.version) + "; this build speaks " +
                                  std::to_string(kWireVersion));
    return nullptr;
  }
  if (h.ucx_len == 0 || h.ucx_len > kMaxUcxBlob || len != sizeof(h) + h.ucx_len) {
    fail(err, MORI_TP_EINVAL, "the peer address is " + std::to_string(len) + " bytes but says it holds a " +
                                  std::to_string(h.ucx_len) + "-byte UCX worker address after its " +
                                  std::to_string(sizeof(h)) + "-byte header");
    return nullptr;
  }
  {
    std::lock_guard<std::mutex> g(tp->obj_mu);
    if (tp->eps.size() >= tp->opt.max_endpoints) {
      fail(err, MORI_TP_ENOMEM, "this instance has " + std::to_string(tp->eps.size()) +
                                    " endpoints (max_endpoints=" + std::to_string(tp->opt.max_endpoints) +
                                    "): disconnect some, or raise max_endpoints");
      return nullptr;
    }
  }
  // UCX reads the address during ucp_ep_create only; copy it so it is aligned.
  std::string ucx_addr(static_cast<const char*>(peer_address) + sizeof(h), h.ucx_len);
  auto* e = new mori_tp_ep;
  e->tp = tp;
  e->peer = h.instance;
  e->same_host = h.pid != 0 && h.pid_ns == tp->self.pid_ns &&
                 std::memcmp(h.boot_id, tp->self.boot_id, sizeof(h.boot_id)) == 0 &&
                 std::memcmp(h.boot_id, std::string(16, '\0').data(), 16) != 0;
  e->peer_pid = h.pid;
  e->peer_start = h.start_time;
  ucp_ep_params_t p{};
  p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  p.address = reinterpret_cast<const ucp_address_t*>(ucx_addr.data());
  p.err_mode = tp->opt.peer_error_mode ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  p.err_handler.cb = [](void* arg, ucp_ep_h, ucs_status_t status) {
    static_cast<mori_tp_ep*>(arg)->failed.store(status, std::memory_order_release);
  };
  p.err_handler.arg = e;
  ucs_status_t s;
  {
    UcxLock l(tp);
    s = U().ucp_ep_create(tp->worker, &p, &e->ep);
  }
  if (s != UCS_OK) {
    delete e;
    fail(err, code_of(s) == MORI_TP_EINVAL ? MORI_TP_EINVAL : MORI_TP_EUNREACH,
         "connecting to the peer (instance " + hex(h.instance) + "): ucp_ep_create: " + st(s));
    return nullptr;
  }
  {
    std::lock_guard<std::mutex> g(tp->obj_mu);
    tp->eps.insert(e);
  }
  // Finish the wire-up now (bounded), so that an unreachable peer fails here, by name.
  Req* r = new_req(tp, e, nullptr, nullptr, err);
  int rc = MORI_TP_ENOMEM;
  mori_tp_req id = 0;
  if (r) {
    std::snprintf(r->what, sizeof(r->what), "connecting to the peer (instance 0x%" PRIx64 ")", h.instance);
    uint64_t rid = r->id;
    ucp_request_param_t fp = param_for(r);
    ucs_status_ptr_t sp;
    {
      UcxLock l(tp);
      sp = U().ucp_ep_flush_nbx(e->ep, &fp);
    }
    rc = finish_post(r, rid, sp, &id, err);
    if (rc == MORI_TP_OK && id) rc = tp_wait(tp, id, tp->opt.connect_timeout_ms, err);
    if (rc == 1) rc = MORI_TP_OK;
  }
  if (rc != MORI_TP_OK) {
    std::string why = err ? err->message : "";
    {
      std::lock_guard<std::mutex> g(tp->obj_mu);
      tp->eps.erase(e);
    }
    close_ep(tp, e, true);
    if (id) tp_wait(tp, id, 1000, nullptr);  // collect the cancelled flush
    if (rc == MORI_TP_ETIMEDOUT)
      fail(err, MORI_TP_ETIMEDOUT,
           "connecting to the peer (instance " + hex(h.instance) + "): no answer within connect_timeout_ms=" +
               std::to_string(tp->opt.connect_timeout_ms) + " (is its process alive and progressing?)");
    else
      fail(err, rc, why);
    return nullptr;
  }
  return e;
}

void tp_disconnect(mori_tp* tp, mori_tp_ep* ep) {
  if (!tp || !ep) return;
  {
    std::lock_guard<std::mutex> g(tp->obj_mu);
    if (!tp->eps.erase(ep)) return;  // not ours, or already disconnected
  }
  // A failed endpoint must be closed with FORCE; a live one flushes what is pending first.
  close_ep(tp, ep, ep->failed.load(std::memory_order_acquire) != UCS_OK);
}

mori_tp_mem* tp_reg(mori_tp* tp, void* addr, size_t len, int mem_type, int device, mori_tp_error* err) {
  if (!tp) {
    fail(err, MORI_TP_EINVAL, "tp is NULL");
    return nullptr;
  }
  if (!addr || len == 0) {
    fail(err, MORI_TP_EINVAL, "register: addr " + hex(reinterpret_cast<uint64_t>(addr)) + ", len " +
                                  std::to_string(len) + ": both must be non-zero");
    return nullptr;
  }
  if (reinterpret_cast<uint64_t>(addr) + len < reinterpret_cast<uint64_t>(addr)) {
    fail(err, MORI_TP_EINVAL, "register: [addr, addr + len) wraps around the address space");
    return nullptr;
  }
  if (mem_type != MORI_TP_MEM_HOST && mem_type != MORI_TP_MEM_CUDA && mem_type != MORI_TP_MEM_ROCM) {
    fail(err, MORI_TP_EINVAL, "register: mem_type " + std::to_string(mem_type) + " is not one of 0 (host), 1 (cuda), 2 (rocm)");
    return nullptr;
  }
  if (mem_type == MORI_TP_MEM_HOST && device != -1) {
    fail(err, MORI_TP_EINVAL, "register: device " + std::to_string(device) + " for host memory; host memory takes device -1");
    return nullptr;
  }
  if (mem_type != MORI_TP_MEM_HOST) {
    if (device < 0) {
      fail(err, MORI_TP_EINVAL, std::string("register: ") + mem_type_name(mem_type) + " memory needs a device ordinal >= 0, got " +
                                    std::to_string(device));
      return nullptr;
    }
    if (!(tp->mem_types & (uint64_t{1} << ucs_type_of(mem_type)))) {
      fail(err, MORI_TP_ENOTSUP,
           std::string("register: this UCX (") + std::to_string(U().major) + "." + std::to_string(U().minor) + "." +
               std::to_string(U().release) + " from " + U().libucp_path + ") cannot register " + mem_type_name(mem_type) +
               " memory: the memory types it supports here are " + memory_types_text(tp->mem_types) +
               (mem_type == MORI_TP_MEM_CUDA
                    ? " (CUDA needs a CUDA-enabled UCX build, its cuda module, and the NVIDIA driver libcuda.so.1)"
                    : " (the PyPI UCX wheels are built without ROCm; a system UCX built --with-rocm can, "
                      "MORI_UCX_LIBRARY=system)"));
      return nullptr;
    }
  }
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  mp.address = addr;
  mp.length = len;
  mp.memory_type = ucs_type_of(mem_type);
  auto* m = new mori_tp_mem;
  m->base = reinterpret_cast<uint64_t>(addr);
  m->size = len;
  m->mem_type = mem_type;
  ucs_status_t s = U().ucp_mem_map(tp->ctx, &mp, &m->memh);
  if (s != UCS_OK) {
    delete m;
    fail(err, code_of(s), "register [" + hex(reinterpret_cast<uint64_t>(addr)) + ", +" + std::to_string(len) +
                              ") as " + mem_type_name(mem_type) + " memory: ucp_mem_map: " + st(s));
    return nullptr;
  }
  void* rbuf = nullptr;
  size_t rlen = 0;
  s = U().ucp_rkey_pack(tp->ctx, m->memh, &rbuf, &rlen);
  if (s != UCS_OK || rlen == 0 || rlen > kMaxUcxBlob) {
    if (s == UCS_OK) U().ucp_rkey_buffer_release(rbuf);
    U().ucp_mem_unmap(tp->ctx, m->memh);
    delete m;
    fail(err, MORI_TP_EINTERNAL, "register: ucp_rkey_pack: " + (s == UCS_OK ? std::to_string(rlen) + " bytes" : st(s)));
    return nullptr;
  }
  KeyHeader h{};
  std::memcpy(h.magic, kKeyMagic, 8);
  h.version = kWireVersion;
  h.ucx_len = static_cast<uint32_t>(rlen);
  h.instance = tp->instance;
  h.base = m->base;
  h.size = m->size;
  h.mem_type = static_cast<uint32_t>(mem_type);
  m->packed.assign(reinterpret_cast<const char*>(&h), sizeof(h));
  m->packed.append(static_cast<const char*>(rbuf), rlen);
  U().ucp_rkey_buffer_release(rbuf);
  std::lock_guard<std::mutex> g(tp->obj_mu);
  tp->mems.insert(m);
  return m;
}

int tp_pack_rkey(mori_tp* tp, mori_tp_mem* mem, void* buf, size_t* len, mori_tp_error* err) {
  if (!tp || !mem) return fail(err, MORI_TP_EINVAL, "pack_rkey: tp or mem is NULL");
  return copy_out(mem->packed, buf, len, err, "pack_rkey");
}

void tp_dereg(mori_tp* tp, mori_tp_mem* mem) {
  if (!tp || !mem) return;
  {
    std::lock_guard<std::mutex> g(tp->obj_mu);
    if (!tp->mems.erase(mem)) return;
    if (mem->pending.load(std::memory_order_acquire) != 0) {  // the contract says it must be 0; be safe
      tp->dead_mems.push_back(mem);
      tp->deferred.fetch_add(1, std::memory_order_acq_rel);
      return;
    }
  }
  U().ucp_mem_unmap(tp->ctx, mem->memh);
  delete mem;
}

mori_tp_rkey* tp_unpack_rkey(mori_tp* tp, mori_tp_ep* ep, const void* buf, size_t len, mori_tp_error* err) {
  if (check_ep(tp, ep, err) != MORI_TP_OK) return nullptr;
  KeyHeader h{};
  if (!buf || len < sizeof(h)) {
    fail(err, MORI_TP_EINVAL, "unpack_rkey: the key has " + std::to_string(len) + " bytes; a ucx key has at least " +
                                  std::to_string(sizeof(h)));
    return nullptr;
  }
  std::memcpy(&h, buf, sizeof(h));
  if (std::memcmp(h.magic, kKeyMagic, 8) != 0) {
    fail(err, MORI_TP_EINVAL, "unpack_rkey: not a ucx transport key (bad magic)");
    return nullptr;
  }
  if (h.version != kWireVersion || h.ucx_len == 0 || h.ucx_len > kMaxUcxBlob || len != sizeof(h) + h.ucx_len) {
    fail(err, MORI_TP_EINVAL, "unpack_rkey: malformed key (version " + std::to_string(h.version) + ", " +
                                  std::to_string(len) + " bytes, says " + std::to_string(h.ucx_len) + " bytes of UCX key)");
    return nullptr;
  }
  if (h.size == 0 || h.base + h.size < h.base || h.mem_type > MORI_TP_MEM_ROCM) {
    fail(err, MORI_TP_EINVAL, "unpack_rkey: malformed key (range [" + hex(h.base) + ", +" + std::to_string(h.size) +
                                  "), memory type " + std::to_string(h.mem_type) + ")");
    return nullptr;
  }
  if (h.instance != ep->peer) {
    fail(err, MORI_TP_EACCESS, "unpack_rkey: the key was packed by transport instance " + hex(h.instance) +
                                   ", not by this endpoint's peer (instance " + hex(ep->peer) + ")");
    return nullptr;
  }
  std::string ucx_key(static_cast<const char*>(buf) + sizeof(h), h.ucx_len);
  auto* r = new mori_tp_rkey;
  r->ep = ep;
  r->base = h.base;
  r->size = h.size;
  r->mem_type = static_cast<int>(h.mem_type);
  ucs_status_t s;
  {
    UcxLock l(tp);
    s = U().ucp_ep_rkey_unpack(ep->ep, ucx_key.data(), &r->rkey);
  }
  if (s != UCS_OK) {
    delete r;
    fail(err, code_of(s) == MORI_TP_EINTERNAL ? MORI_TP_EINVAL : code_of(s), "unpack_rkey: ucp_ep_rkey_unpack: " + st(s));
    return nullptr;
  }
  std::lock_guard<std::mutex> g(tp->obj_mu);
  tp->rkeys.insert(r);
  return r;
}

void tp_release_rkey(mori_tp* tp, mori_tp_rkey* rkey) {
  if (!tp || !rkey) return;
  {
    std::lock_guard<std::mutex> g(tp->obj_mu);
    if (!tp->rkeys.erase(rkey)) return;
    if (rkey->pending.load(std::memory_order_acquire) != 0) {
      tp->dead_rkeys.push_back(rkey);
      tp->deferred.fetch_add(1, std::memory_order_acq_rel);
      return;
    }
  }
  {
    UcxLock l(tp);
    U().ucp_rkey_destroy(rkey->rkey);
  }
  delete rkey;
}

int rma(bool is_put, mori_tp* tp, mori_tp_ep* ep, void* local, mori_tp_mem* lmem, uint64_t raddr, mori_tp_rkey* rkey,
        size_t n, mori_tp_req* req, mori_tp_error* err) {
  const char* what = is_put ? "put" : "get";
  if (!req) return fail(err, MORI_TP_EINVAL, std::string(what) + ": req is NULL");
  *req = 0;
  int rc;
  if ((rc = check_ep(tp, ep, err)) || (rc = check_remote(what, ep, rkey, raddr, n, err)) ||
      (rc = check_local(what, lmem, local, n, err)))
    return rc;
  if (n == 0) return MORI_TP_OK;
  Req* r = new_req(tp, ep, lmem, rkey, err);
  if (!r) return MORI_TP_ENOMEM;
  describe_rma(r, what, n, raddr, ep);
  uint64_t id = r->id;
  ucp_request_param_t p = param_for(r);
  if (lmem) {
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    p.memory_type = ucs_type_of(lmem->mem_type);
    if (tp->has_memh_param) {
      p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      p.memh = lmem->memh;
    }
  }
  ucs_status_ptr_t sp;
  {
    UcxLock l(tp);
    sp = is_put ? U().ucp_put_nbx(ep->ep, local, n, raddr, rkey->rkey, &p)
                : U().ucp_get_nbx(ep->ep, local, n, raddr, rkey->rkey, &p);
  }
  return finish_post(r, id, sp, req, err);
}

int tp_put(mori_tp* tp, mori_tp_ep* ep, const void* src, mori_tp_mem* lmem, uint64_t raddr, mori_tp_rkey* rkey, size_t n,
           mori_tp_req* req, mori_tp_error* err) {
  return rma(true, tp, ep, const_cast<void*>(src), lmem, raddr, rkey, n, req, err);
}

int tp_get(mori_tp* tp, mori_tp_ep* ep, void* dst, mori_tp_mem* lmem, uint64_t raddr, mori_tp_rkey* rkey, size_t n,
           mori_tp_req* req, mori_tp_error* err) {
  return rma(false, tp, ep, dst, lmem, raddr, rkey, n, req, err);
}

const char* op_name(int op) {
  static const char* names[] = {"fetch", "set", "add", "swap", "and", "or", "xor", "compare-swap"};
  return op >= 0 && op <= MORI_TP_OP_CSWAP ? names[op] : "?";
}

// A 64-bit operand for a 32-bit word: the word's own range, or a sign-extended int32.
bool fits(int word, uint64_t v) {
  if (word == MORI_TP_WORD_UINT32) return v <= UINT32_MAX;
  if (word == MORI_TP_WORD_INT32) return v <= UINT32_MAX || v >= (uint64_t{0} - (uint64_t{1} << 31));
  return true;
}

int tp_atomic(mori_tp* tp, mori_tp_ep* ep, int op, int word, uint64_t value, uint64_t compare, uint64_t raddr,
              mori_tp_rkey* rkey, uint64_t* old, mori_tp_req* req, mori_tp_error* err) {
  if (!req) return fail(err, MORI_TP_EINVAL, "atomic: req is NULL");
  *req = 0;
  if (op < MORI_TP_OP_FETCH || op > MORI_TP_OP_CSWAP)
    return fail(err, MORI_TP_EINVAL, "atomic: op " + std::to_string(op) + " is not one of 0..7 (MORI_TP_OP_*)");
  if (word < MORI_TP_WORD_INT32 || word > MORI_TP_WORD_UINT64)
    return fail(err, MORI_TP_EINVAL, "atomic: word " + std::to_string(word) + " is not one of 0..3 (MORI_TP_WORD_*)");
  const size_t size = word <= MORI_TP_WORD_UINT32 ? 4 : 8;
  int rc;
  if ((rc = check_ep(tp, ep, err)) || (rc = check_remote("atomic", ep, rkey, raddr, size, err))) return rc;
  if (raddr % size)
    return fail(err, MORI_TP_EINVAL, "atomic: remote address " + hex(raddr) + " is not aligned to its " +
                                         std::to_string(size) + "-byte word");
  // UCX_ATOMIC_MODE=cpu (above): the target's CPU executes atomics, and a CPU access to GPU memory
  // kills the target (seen on an H200: SIGSEGV in ucp_atomic_req_handler). No MORI_TP_CAP_DEVICE_ATOMIC.
  if (rkey->mem_type != MORI_TP_MEM_HOST)
    return fail(err, MORI_TP_ENOTSUP, std::string("atomic ") + op_name(op) + " at " + hex(raddr) + ": the peer's memory is " +
                                          mem_type_name(rkey->mem_type) +
                                          " memory, and this transport's atomics run on the target's CPU (UCX_ATOMIC_MODE=cpu), "
                                          "which cannot reach device memory: no atomics on device memory (MORI_TP_CAP_DEVICE_ATOMIC)");
  if (!fits(word, value) || (op == MORI_TP_OP_CSWAP && !fits(word, compare)))
    return fail(err, MORI_TP_EINVAL, std::string("atomic ") + op_name(op) + ": operand " + hex(value) + " / compare " +
                                         hex(compare) + " does not fit a 32-bit word");
  ucp_atomic_op_t uop;
  uint64_t operand = value;
  bool fetch = old != nullptr;
  switch (op) {
    case MORI_TP_OP_FETCH: uop = UCP_ATOMIC_OP_ADD; operand = 0; fetch = true; break;
    case MORI_TP_OP_SET: uop = UCP_ATOMIC_OP_SWAP; fetch = true; break;  // swap needs a reply buffer
    case MORI_TP_OP_ADD: uop = UCP_ATOMIC_OP_ADD; break;
    case MORI_TP_OP_SWAP: uop = UCP_ATOMIC_OP_SWAP; fetch = true; break;
    case MORI_TP_OP_AND: uop = UCP_ATOMIC_OP_AND; break;
    case MORI_TP_OP_OR: uop = UCP_ATOMIC_OP_OR; break;
    case MORI_TP_OP_XOR: uop = UCP_ATOMIC_OP_XOR; break;
    default: uop = UCP_ATOMIC_OP_CSWAP; operand = compare; fetch = true; break;  // buffer = compare, reply = new
  }
  Req* r = new_req(tp, ep, nullptr, rkey, err);
  if (!r) return MORI_TP_ENOMEM;
  std::snprintf(r->what, sizeof(r->what), "atomic %s on the %zu-byte word at 0x%" PRIx64 " of the peer (instance 0x%" PRIx64 ")",
                op_name(op), size, raddr, ep->peer);
  uint64_t id = r->id;
  r->word = word;
  r->deliver = fetch && old != nullptr;
  r->old = old;
  if (size == 4) {
    r->operand.u32 = static_cast<uint32_t>(operand);
    r->result.u32 = static_cast<uint32_t>(value);  // CSWAP's new value; overwritten by the reply otherwise
  } else {
    r->operand.u64 = operand;
    r->result.u64 = value;
  }
  ucp_request_param_t p = param_for(r);
  p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
  p.datatype = ucp_dt_make_contig(size);
  if (fetch) {
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_REPLY_BUFFER;
    p.reply_buffer = &r->result;
  }
  ucs_status_ptr_t sp;
  {
    UcxLock l(tp);
    sp = U().ucp_atomic_op_nbx(ep->ep, uop, &r->operand, 1, raddr, rkey->rkey, &p);
  }
  return finish_post(r, id, sp, req, err);
}

int tp_fence(mori_tp* tp, mori_tp_ep* ep, mori_tp_error* err) {
  if (!tp) return fail(err, MORI_TP_EINVAL, "tp is NULL");
  if (ep) {
    int rc = check_ep(tp, ep, err);
    if (rc) return rc;
  }
  // UCP fences the worker: stronger than the contract's per-endpoint order, and non-blocking.
  ucs_status_t s;
  {
    UcxLock l(tp);
    s = U().ucp_worker_fence(tp->worker);
  }
  return s == UCS_OK ? MORI_TP_OK : fail(err, code_of(s), "fence: ucp_worker_fence: " + st(s));
}

int tp_flush(mori_tp* tp, mori_tp_ep* ep, mori_tp_req* req, mori_tp_error* err) {
  if (!tp) return fail(err, MORI_TP_EINVAL, "tp is NULL");
  if (!req) return fail(err, MORI_TP_EINVAL, "flush: req is NULL");
  *req = 0;
  if (ep) {
    int rc = check_ep(tp, ep, err);
    if (rc) return rc;
  }
  Req* r = new_req(tp, ep, nullptr, nullptr, err);
  if (!r) return MORI_TP_ENOMEM;
  if (ep)
    std::snprintf(r->what, sizeof(r->what), "flush to the peer (instance 0x%" PRIx64 ")", ep->peer);
  else
    std::snprintf(r->what, sizeof(r->what), "flush of every endpoint");
  uint64_t id = r->id;
  ucp_request_param_t p = param_for(r);
  ucs_status_ptr_t sp;
  {
    UcxLock l(tp);
    sp = ep ? U().ucp_ep_flush_nbx(ep->ep, &p) : U().ucp_worker_flush_nbx(tp->worker, &p);
  }
  return finish_post(r, id, sp, req, err);
}

// Whether a same-host peer's process is gone (checked at most every 100 ms per endpoint).
bool peer_exited(mori_tp_ep* ep) {
  if (ep->peer_exited.load(std::memory_order_acquire)) return true;
  if (!ep->same_host) return false;
  int64_t now = now_ms();
  if (now < ep->next_check_ms.load(std::memory_order_relaxed)) return false;
  ep->next_check_ms.store(now + 100, std::memory_order_relaxed);
  // gone: no such process, a zombie (exited, not yet reaped), or a new process with its pid
  bool gone = ::kill(static_cast<pid_t>(ep->peer_pid), 0) != 0 && errno == ESRCH;
  if (!gone && ep->peer_start) gone = start_time_of(ep->peer_pid) != ep->peer_start;
  if (gone) ep->peer_exited.store(true, std::memory_order_release);
  return gone;
}

int tp_test(mori_tp* tp, mori_tp_req req, mori_tp_error* err) {
  if (!tp) return fail(err, MORI_TP_EINVAL, "tp is NULL");
  if (req == 0) return 1;
  progress_once(tp);
  sweep(tp);
  Req* r;
  {
    std::lock_guard<std::mutex> g(tp->req_mu);
    auto it = tp->reqs.find(req);
    if (it == tp->reqs.end()) {
      if (req >= tp->next_id) return fail(err, MORI_TP_EINVAL, "request " + std::to_string(req) + " was never issued by this instance");
      return 1;  // completed, and either released by an earlier test or never needed one
    }
    r = it->second;
    if (r->state.load(std::memory_order_acquire) == kPending) {
      mori_tp_ep* ep = r->ep;  // alive while the request is pending
      if (!ep || !peer_exited(ep)) return 0;
      // UCX would wait for this peer forever (shared memory has no peer-failure detection):
      // give the request up; its struct stays until destroy in case UCX still calls back.
      r->abandoned = true;
      tp->reqs.erase(it);
      tp->abandoned.push_back(r);
      return fail(err, MORI_TP_EUNREACH,
                  std::string(r->what) + " failed: the peer process " + std::to_string(ep->peer_pid) +
                      " on this host exited");
    }
    tp->reqs.erase(it);
  }
  int rc = 1;
  if (r->state.load(std::memory_order_acquire) == kDone) {
    if (r->deliver && r->old) *r->old = static_cast<uint64_t>(sign_extend(r));
  } else {
    rc = fail(err, code_of(r->status), std::string(r->what) + " failed: " + st(r->status));
  }
  delete r;
  return rc;
}

int tp_wait(mori_tp* tp, mori_tp_req req, int64_t timeout_ms, mori_tp_error* err) {
  if (!tp) return fail(err, MORI_TP_EINVAL, "tp is NULL");
  const int64_t start = now_ms();
  for (uint64_t spin = 0;; ++spin) {
    int rc = tp_test(tp, req, err);
    if (rc != 0) return rc;
    if (timeout_ms >= 0 && now_ms() - start >= timeout_ms) {
      std::string what;
      {
        std::lock_guard<std::mutex> g(tp->req_mu);
        auto it = tp->reqs.find(req);
        if (it != tp->reqs.end()) what = it->second->what;
      }
      return fail(err, MORI_TP_ETIMEDOUT, "request " + std::to_string(req) + " (" + what + ") is still pending after " +
                                              std::to_string(timeout_ms) + " ms");
    }
    // Spin first (latency), then give the core away: on a small machine the peer's progress
    // thread may need it to answer.
    if (spin > 20000)
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    else if (spin > 2000)
      std::this_thread::yield();
  }
}

void tp_progress(mori_tp* tp) {
  if (!tp) return;
  progress_once(tp);
  sweep(tp);
}

mori_tp_ops g_ops = {
    MORI_TRANSPORT_ABI,
    sizeof(mori_tp_ops),
    "ucx",
    0,  // caps: init_caps()
    tp_create,
    tp_destroy,
    tp_address,
    tp_connect,
    tp_disconnect,
    tp_reg,
    tp_pack_rkey,
    tp_dereg,
    tp_unpack_rkey,
    tp_release_rkey,
    tp_put,
    tp_get,
    tp_atomic,
    tp_fence,
    tp_flush,
    tp_test,
    tp_wait,
    tp_progress,
};

}  // namespace

namespace mori_ucx {

mori_tp_ops* ops_table() { return &g_ops; }

std::string init_caps() {
  if (!api()) return "UCX is not loaded";
  Options o;
  ucp_context_h ctx = nullptr;
  std::string e = make_context(o, false, &ctx);
  if (!e.empty()) return e;
  uint64_t types = context_memory_types(ctx);
  U().ucp_cleanup(ctx);
  uint32_t caps = MORI_TP_CAP_RMA | MORI_TP_CAP_ATOMIC64 | MORI_TP_CAP_ATOMIC32 | MORI_TP_CAP_ATOMIC_NATIVE;
  if (types & (uint64_t{1} << UCS_MEMORY_TYPE_CUDA)) caps |= MORI_TP_CAP_CUDA_MEMORY;
  if (types & (uint64_t{1} << UCS_MEMORY_TYPE_ROCM)) caps |= MORI_TP_CAP_ROCM_MEMORY;
  g_ops.caps = caps;
  return "";
}

std::string describe(const char* options, std::string& error) {
  if (!api()) {
    error = "UCX is not loaded";
    return "";
  }
  Options o;
  if (!parse_options(options, o, error)) return "";
  ucp_context_h ctx = nullptr;
  error = make_context(o, false, &ctx);
  if (!error.empty()) return "";
  char* text = nullptr;
  size_t size = 0;
  FILE* f = open_memstream(&text, &size);
  if (f) {
    U().ucp_context_print_info(ctx, f);
    std::fclose(f);
  }
  std::string out = text ? std::string(text, size) : "";
  std::free(text);
  out += "memory_types: " + memory_types_text(context_memory_types(ctx)) + "\n";
  ucp_worker_h w = nullptr;
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_MULTI;
  if (U().ucp_worker_create(ctx, &wp, &w) == UCS_OK) {
    ucp_worker_attr_t wa{};
    wa.field_mask = UCP_WORKER_ATTR_FIELD_THREAD_MODE;
    bool multi = U().ucp_worker_query(w, &wa) == UCS_OK && wa.thread_mode == UCS_THREAD_MODE_MULTI;
    out += std::string("thread_mode: ") + (multi ? "multi" : "serialized") + "\n";
    U().ucp_worker_destroy(w);
  }
  U().ucp_cleanup(ctx);
  return out;
}

}  // namespace mori_ucx

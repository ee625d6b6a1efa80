// The `tcp` transport: the transport contract (mori/transport.h) on the TCP engine (engine.hpp), so
// features reach peers on other nodes with no extra install. Everything the engine checks still
// holds: authenticated connections (a shared secret proven by HMAC), every request checked against
// the target's own registration table, cross-memory attach between processes of one host.
//
// Options (key=value;...): host (bind address, default 127.0.0.1), port (0: any), key (this
// instance's name among its peers, default a random one), node_id (instances with equal node ids
// use the same-host paths; default none), token (the shared secret), allow_unauthenticated (0/1),
// timeout_ms (control-plane timeout, default 30000), conns (connections per peer, default 4),
// cma (0/1, cross-memory attach within a host, default 1).
//
// Ordering: one operation's pieces travel over several connections, so two operations on one
// endpoint may complete in any order; fence therefore waits for everything posted before it.
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "../registry.hpp"
#include "auth.hpp"
#include "engine.hpp"
#include "mori/transport.h"
#include "wire.hpp"

namespace py = pybind11;

namespace mori::transfer {

namespace {

struct TcpEp;

struct TcpTp {
  std::unique_ptr<Engine> eng;
  std::string key, host, node_id;
  uint16_t port = 0;
  int64_t timeout_ms = 30000;
  std::mutex mu;  // guards everything below
  uint64_t next_req = 1;
  struct Pending {
    StatusPtr st;                   // one operation, or
    std::vector<StatusPtr> all;     // a flush: everything outstanding when it was posted
    std::shared_ptr<uint64_t> old;  // an atomic's result
    uint64_t* out = nullptr;        // where the caller wants it
  };
  std::unordered_map<uint64_t, Pending> reqs;
  std::unordered_map<std::string, int> peer_refs;  // endpoints per peer key
  std::vector<TcpEp*> eps;
};

struct TcpEp {
  TcpTp* tp;
  std::string key;
  std::vector<StatusPtr> outstanding;  // guarded by tp->mu
};

struct TcpMem {
  uint64_t id, addr, size;
};

struct TcpRkey {
  uint64_t id, base, size;
};

TcpTp* T(mori_tp* p) { return reinterpret_cast<TcpTp*>(p); }
TcpEp* E(mori_tp_ep* p) { return reinterpret_cast<TcpEp*>(p); }
TcpMem* M(mori_tp_mem* p) { return reinterpret_cast<TcpMem*>(p); }
TcpRkey* R(mori_tp_rkey* p) { return reinterpret_cast<TcpRkey*>(p); }

int fail(mori_tp_error* err, int code, const std::string& msg) {
  if (err) {
    err->code = code;
    std::snprintf(err->message, sizeof err->message, "%s", msg.c_str());
  }
  return code;
}

int code_of(int status) {
  switch (status) {
    case ERR_INVALID_ARGS: return MORI_TP_EACCESS;
    case ERR_NOT_FOUND:
    case ERR_BAD_STATE: return MORI_TP_EUNREACH;
    default: return MORI_TP_EINTERNAL;
  }
}

// "k=v;k=v" -> map; false (with the reason) on a malformed pair.
bool parse_pairs(const std::string& text, std::unordered_map<std::string, std::string>* out, std::string* why) {
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find(';', pos);
    if (end == std::string::npos) end = text.size();
    std::string item = text.substr(pos, end - pos);
    pos = end + 1;
    if (item.empty()) continue;
    size_t eq = item.find('=');
    if (eq == std::string::npos || eq == 0) {
      *why = "'" + item + "' is not key=value";
      return false;
    }
    (*out)[item.substr(0, eq)] = item.substr(eq + 1);
  }
  return true;
}

bool to_u64(const std::string& s, uint64_t* v) {
  if (s.empty() || s.size() > 20) return false;
  char* end = nullptr;
  errno = 0;
  unsigned long long x = std::strtoull(s.c_str(), &end, 10);
  if (errno || *end) return false;
  *v = x;
  return true;
}

// Remembers `st` as outstanding on `ep` (for fence and flush), dropping finished ones now and then.
void track(TcpEp* ep, const StatusPtr& st) {
  auto& v = ep->outstanding;
  if (v.size() >= 64) {
    std::vector<StatusPtr> keep;
    for (auto& s : v)
      if (!s->done()) keep.push_back(s);
    v.swap(keep);
  }
  v.push_back(st);
}

int issue(TcpTp* tp, TcpEp* ep, StatusPtr st, std::shared_ptr<uint64_t> old, uint64_t* out, mori_tp_req* req,
          mori_tp_error* err) {
  if (st->done()) {  // the same-host direct path finishes inside post, and errors found at once
    if (st->code() != SUCCESS) return fail(err, code_of(st->code()), st->message());
    if (out && old) *out = *old;
    *req = 0;
    return 0;
  }
  std::lock_guard<std::mutex> g(tp->mu);
  track(ep, st);
  const uint64_t id = tp->next_req++;
  tp->reqs[id] = TcpTp::Pending{std::move(st), {}, std::move(old), out};
  *req = id;
  return 0;
}

mori_tp* tcp_create(const char* options, mori_tp_error* err) {
  std::unordered_map<std::string, std::string> kv;
  std::string why;
  if (!parse_pairs(options ? options : "", &kv, &why)) {
    fail(err, MORI_TP_EINVAL, "tcp transport options: " + why);
    return nullptr;
  }
  static const char* known[] = {"host", "port", "key", "node_id", "token", "allow_unauthenticated", "timeout_ms", "conns", "cma"};
  for (auto& [k, v] : kv) {
    bool ok = false;
    for (const char* n : known) ok = ok || k == n;
    if (!ok) {
      fail(err, MORI_TP_EINVAL,
           "tcp transport options: unknown key '" + k +
               "' (known: host, port, key, node_id, token, allow_unauthenticated, timeout_ms, conns, cma)");
      return nullptr;
    }
  }
  EngineConfig c;
  c.host = kv.count("host") ? kv["host"] : "127.0.0.1";
  uint64_t port = 0, timeout = 30000, conns = 4, cma = 1, open = 0;
  if ((kv.count("port") && (!to_u64(kv["port"], &port) || port > 65535)) ||
      (kv.count("timeout_ms") && (!to_u64(kv["timeout_ms"], &timeout) || timeout == 0)) ||
      (kv.count("conns") && (!to_u64(kv["conns"], &conns) || conns == 0 || conns > 64)) ||
      (kv.count("cma") && (!to_u64(kv["cma"], &cma) || cma > 1)) ||
      (kv.count("allow_unauthenticated") && (!to_u64(kv["allow_unauthenticated"], &open) || open > 1))) {
    fail(err, MORI_TP_EINVAL,
         "tcp transport options: port (0-65535), timeout_ms (> 0), conns (1-64), cma and allow_unauthenticated "
         "(0 or 1) must be whole numbers in range");
    return nullptr;
  }
  c.port = uint16_t(port);
  uint64_t r = 0;
  random_bytes(&r, sizeof r);
  c.key = kv.count("key") ? kv["key"] : "tp-" + std::to_string(r);
  c.node_id = kv.count("node_id") ? kv["node_id"] : "";
  c.token = kv.count("token") ? kv["token"] : "";
  c.cp_timeout_ms = int64_t(timeout);
  c.allow_unauthenticated = open == 1;
  auto tp = std::make_unique<TcpTp>();
  try {
    tp->eng = std::make_unique<Engine>(c);
  } catch (const std::exception& e) {
    fail(err, dynamic_cast<const std::invalid_argument*>(&e) ? MORI_TP_EINVAL : MORI_TP_EINTERNAL, e.what());
    return nullptr;
  }
  tp->eng->configure_tcp(TcpConfig{int(conns), 1 << 20, 0, cma == 1, /*enable_notification=*/false, 0});
  tp->key = c.key;
  tp->host = c.host;
  tp->node_id = c.node_id;
  tp->port = tp->eng->port();
  tp->timeout_ms = c.cp_timeout_ms;
  return reinterpret_cast<mori_tp*>(tp.release());
}

void tcp_destroy(mori_tp* p) {
  TcpTp* tp = T(p);
  tp->eng->shutdown();  // pending operations complete with ERR_BAD_STATE
  {
    std::lock_guard<std::mutex> g(tp->mu);
    for (TcpEp* ep : tp->eps) delete ep;
  }
  delete tp;
}

int tcp_address(mori_tp* p, void* buf, size_t* len, mori_tp_error* err) {
  TcpTp* tp = T(p);
  const std::string a =
      "key=" + tp->key + ";host=" + tp->host + ";port=" + std::to_string(tp->port) + ";node_id=" + tp->node_id;
  if (*len < a.size()) {
    *len = a.size();
    return fail(err, MORI_TP_EINVAL, "address buffer too small");
  }
  std::memcpy(buf, a.data(), a.size());
  *len = a.size();
  return 0;
}

mori_tp_ep* tcp_connect(mori_tp* p, const void* addr, size_t len, mori_tp_error* err) {
  TcpTp* tp = T(p);
  std::unordered_map<std::string, std::string> kv;
  std::string why;
  uint64_t port = 0;
  if (!parse_pairs(std::string(static_cast<const char*>(addr), len), &kv, &why) || !kv.count("key") ||
      !kv.count("host") || !kv.count("port") || !to_u64(kv["port"], &port) || port == 0 || port > 65535) {
    fail(err, MORI_TP_EINVAL, "not a tcp transport address (expected key=...;host=...;port=...;node_id=...)");
    return nullptr;
  }
  const bool same_node = !tp->node_id.empty() && kv["node_id"] == tp->node_id;
  tp->eng->add_peer(kv["key"], kv["host"], uint16_t(port), same_node);
  auto* ep = new TcpEp{tp, kv["key"], {}};
  std::lock_guard<std::mutex> g(tp->mu);
  tp->peer_refs[ep->key] += 1;
  tp->eps.push_back(ep);
  return reinterpret_cast<mori_tp_ep*>(ep);
}

void tcp_disconnect(mori_tp* p, mori_tp_ep* e) {
  TcpTp* tp = T(p);
  TcpEp* ep = E(e);
  bool last;
  {
    std::lock_guard<std::mutex> g(tp->mu);
    last = --tp->peer_refs[ep->key] == 0;
    if (last) tp->peer_refs.erase(ep->key);
    for (auto it = tp->eps.begin(); it != tp->eps.end(); ++it)
      if (*it == ep) {
        tp->eps.erase(it);
        break;
      }
  }
  if (last) tp->eng->remove_peer(ep->key);
  delete ep;
}

mori_tp_mem* tcp_reg(mori_tp* p, void* addr, size_t len, int mem_type, int device, mori_tp_error* err) {
  (void)device;
  if (mem_type != MORI_TP_MEM_HOST) {
    fail(err, MORI_TP_ENOTSUP, "the tcp transport moves host memory only (GPU memory: a transport with device support)");
    return nullptr;
  }
  try {
    const uint64_t id = T(p)->eng->register_memory(reinterpret_cast<uintptr_t>(addr), len, 1, -1);
    return reinterpret_cast<mori_tp_mem*>(new TcpMem{id, reinterpret_cast<uint64_t>(addr), len});
  } catch (const std::exception& e) {
    fail(err, MORI_TP_EINVAL, e.what());
    return nullptr;
  }
}

int tcp_pack_rkey(mori_tp*, mori_tp_mem* m, void* buf, size_t* len, mori_tp_error* err) {
  const TcpRkey k{M(m)->id, M(m)->addr, M(m)->size};
  if (*len < sizeof k) {
    *len = sizeof k;
    return fail(err, MORI_TP_EINVAL, "rkey buffer too small");
  }
  std::memcpy(buf, &k, sizeof k);
  *len = sizeof k;
  return 0;
}

void tcp_dereg(mori_tp* p, mori_tp_mem* m) {
  T(p)->eng->deregister_memory(M(m)->id, T(p)->timeout_ms);
  delete M(m);
}

mori_tp_rkey* tcp_unpack_rkey(mori_tp*, mori_tp_ep*, const void* buf, size_t len, mori_tp_error* err) {
  if (len != sizeof(TcpRkey)) {
    fail(err, MORI_TP_EINVAL, "not a tcp transport rkey (" + std::to_string(len) + " bytes, expected 24)");
    return nullptr;
  }
  auto* k = new TcpRkey;
  std::memcpy(k, buf, sizeof *k);
  return reinterpret_cast<mori_tp_rkey*>(k);
}

void tcp_release_rkey(mori_tp*, mori_tp_rkey* k) { delete R(k); }

// The peer's region offset of [raddr, raddr + n), or an error naming the range.
int remote_offset(const TcpRkey* k, uint64_t raddr, uint64_t n, uint64_t* off, mori_tp_error* err) {
  if (raddr < k->base || raddr - k->base > k->size || n > k->size - (raddr - k->base))
    return fail(err, MORI_TP_EACCESS,
                "remote range [" + std::to_string(raddr) + ", +" + std::to_string(n) + ") is outside the peer's "
                "registered memory [" + std::to_string(k->base) + ", +" + std::to_string(k->size) + ")");
  *off = raddr - k->base;
  return 0;
}

int rma(uint16_t op, mori_tp* p, mori_tp_ep* e, uint64_t local, mori_tp_mem* lm, uint64_t raddr, mori_tp_rkey* rk,
        size_t n, mori_tp_req* req, mori_tp_error* err) {
  if (!lm) return fail(err, MORI_TP_EINVAL, "the tcp transport needs the local buffer's registration (lmem)");
  const TcpMem* m = M(lm);
  if (local < m->addr || local - m->addr > m->size || n > m->size - (local - m->addr))
    return fail(err, MORI_TP_EINVAL, "the local buffer is not inside its registration");
  uint64_t off = 0;
  if (int rc = remote_offset(R(rk), raddr, n, &off, err)) return rc;
  TcpEp* ep = E(e);
  StatusPtr st = T(p)->eng->post(op, m->id, ep->key, R(rk)->id, {local - m->addr}, {off}, {n}, 0, true, R(rk)->size);
  return issue(T(p), ep, std::move(st), nullptr, nullptr, req, err);
}

int tcp_put(mori_tp* p, mori_tp_ep* e, const void* src, mori_tp_mem* lm, uint64_t raddr, mori_tp_rkey* rk, size_t n,
            mori_tp_req* req, mori_tp_error* err) {
  return rma(kWrite, p, e, reinterpret_cast<uint64_t>(src), lm, raddr, rk, n, req, err);
}

int tcp_get(mori_tp* p, mori_tp_ep* e, void* dst, mori_tp_mem* lm, uint64_t raddr, mori_tp_rkey* rk, size_t n,
            mori_tp_req* req, mori_tp_error* err) {
  return rma(kRead, p, e, reinterpret_cast<uint64_t>(dst), lm, raddr, rk, n, req, err);
}

int tcp_atomic(mori_tp* p, mori_tp_ep* e, int op, int word, uint64_t value, uint64_t compare, uint64_t raddr,
               mori_tp_rkey* rk, uint64_t* old, mori_tp_req* req, mori_tp_error* err) {
  if (op < MORI_TP_OP_FETCH || op > MORI_TP_OP_CSWAP || word < MORI_TP_WORD_INT32 || word > MORI_TP_WORD_UINT64)
    return fail(err, MORI_TP_EINVAL, "atomic op " + std::to_string(op) + " or word " + std::to_string(word) + " is unknown");
  uint64_t off = 0;
  if (int rc = remote_offset(R(rk), raddr, (word <= MORI_TP_WORD_UINT32) ? 4 : 8, &off, err)) return rc;
  auto result = std::make_shared<uint64_t>(0);
  TcpEp* ep = E(e);
  StatusPtr st = T(p)->eng->post_atomic(ep->key, R(rk)->id, off, op, word, value, compare, result);
  return issue(T(p), ep, std::move(st), result, old, req, err);
}

// Waits for every status in `all`; 1, or the first failure's error.
int wait_all_of(const std::vector<StatusPtr>& all, int64_t timeout_ms, mori_tp_error* err) {
  const int64_t deadline = timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
  for (const auto& st : all) {
    const int64_t left = deadline < 0 ? -1 : std::max<int64_t>(0, deadline - now_ms());
    if (!st->wait_for(left)) return fail(err, MORI_TP_ETIMEDOUT, "an operation did not complete in time");
  }
  for (const auto& st : all)
    if (st->code() != SUCCESS) return fail(err, code_of(st->code()), st->message());
  return 1;
}

int tcp_fence(mori_tp* p, mori_tp_ep* e, mori_tp_error* err) {
  std::vector<StatusPtr> all;
  {
    std::lock_guard<std::mutex> g(T(p)->mu);
    all.swap(E(e)->outstanding);
  }
  int rc = wait_all_of(all, T(p)->timeout_ms, err);
  return rc == 1 ? 0 : rc;
}

int tcp_flush(mori_tp* p, mori_tp_ep* e, mori_tp_req* req, mori_tp_error* err) {
  (void)err;
  TcpTp* tp = T(p);
  std::lock_guard<std::mutex> g(tp->mu);
  std::vector<StatusPtr> all;
  for (TcpEp* ep : tp->eps)
    if (!e || ep == E(e))
      for (auto& st : ep->outstanding)
        if (!st->done() || st->code() != SUCCESS) all.push_back(st);
  if (all.empty()) {
    *req = 0;
    return 0;
  }
  const uint64_t id = tp->next_req++;
  tp->reqs[id] = TcpTp::Pending{nullptr, std::move(all), nullptr, nullptr};
  *req = id;
  return 0;
}

// Takes request `id` out if it is done; 1 done, 0 pending, < 0 failed.
int settle(TcpTp* tp, mori_tp_req id, int64_t timeout_ms, mori_tp_error* err) {
  TcpTp::Pending pend;
  {
    std::lock_guard<std::mutex> g(tp->mu);
    auto it = tp->reqs.find(id);
    if (it == tp->reqs.end()) return fail(err, MORI_TP_EINVAL, "unknown or already completed request");
    pend = it->second;
  }
  std::vector<StatusPtr> all = pend.st ? std::vector<StatusPtr>{pend.st} : pend.all;
  if (timeout_ms == 0) {
    for (auto& st : all)
      if (!st->done()) return 0;
  }
  int rc = wait_all_of(all, timeout_ms, err);
  if (rc == MORI_TP_ETIMEDOUT) return rc;
  if (rc == 1 && pend.out && pend.old) *pend.out = *pend.old;
  std::lock_guard<std::mutex> g(tp->mu);
  tp->reqs.erase(id);
  return rc;
}

int tcp_test(mori_tp* p, mori_tp_req id, mori_tp_error* err) { return settle(T(p), id, 0, err); }

int tcp_wait(mori_tp* p, mori_tp_req id, int64_t timeout_ms, mori_tp_error* err) {
  return settle(T(p), id, timeout_ms, err);
}

void tcp_progress(mori_tp*) {}  // the engine's own threads make progress

const mori_tp_ops kTcpOps = {
    MORI_TRANSPORT_ABI,
    sizeof(mori_tp_ops),
    "tcp",
    MORI_TP_CAP_RMA | MORI_TP_CAP_ATOMIC64 | MORI_TP_CAP_ATOMIC32 | MORI_TP_CAP_ATOMIC_NATIVE,
    tcp_create,
    tcp_destroy,
    tcp_address,
    tcp_connect,
    tcp_disconnect,
    tcp_reg,
    tcp_pack_rkey,
    tcp_dereg,
    tcp_unpack_rkey,
    tcp_release_rkey,
    tcp_put,
    tcp_get,
    tcp_atomic,
    tcp_fence,
    tcp_flush,
    tcp_test,
    tcp_wait,
    tcp_progress,
};

}  // namespace

const mori_tp_ops* tcp_transport_ops() { return &kTcpOps; }

}  // namespace mori::transfer

namespace mori {
void register_tcp_transport(py::module_& m) {
  m.def(
      "tcp_transport_ops",
      [] { return py::capsule(static_cast<const void*>(transfer::tcp_transport_ops()), MORI_TRANSPORT_CAPSULE); },
      "The built-in tcp transport's ops table (a PyCapsule named 'mori.transport.v1').");
}
}  // namespace mori

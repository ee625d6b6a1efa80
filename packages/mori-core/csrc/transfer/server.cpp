// The target side of the engine: listeners, the accept loop, the handshake, and the progress thread
// that serves one connection's requests. See engine.hpp ("Trust") for what is checked and why.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <system_error>

#include "atomic_word.hpp"
#include "auth.hpp"
#include "engine.hpp"
#include "log.hpp"
#include "sched.hpp"
#include "wire.hpp"

namespace mori::transfer {

namespace {

constexpr uint64_t kStagePiece = 4u << 20;  // largest host staging buffer a request makes a thread hold
constexpr size_t kMaxKey = 1024, kMaxNodeId = 1024;

bool is_loopback(const sockaddr_storage& ss) {
  if (ss.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    return (ntohl(a->sin_addr.s_addr) >> 24) == 127;
  }
  if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    if (IN6_IS_ADDR_LOOPBACK(&a->sin6_addr)) return true;
    return IN6_IS_ADDR_V4MAPPED(&a->sin6_addr) && a->sin6_addr.s6_addr[12] == 127;
  }
  return false;
}

std::string address_text(const sockaddr_storage& ss) {
  char host[NI_MAXHOST] = "?";
  ::getnameinfo(reinterpret_cast<const sockaddr*>(&ss), sizeof ss, host, sizeof host, nullptr, 0, NI_NUMERICHOST);
  return host;
}

std::string hex(const std::string& bytes) {
  static const char* d = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out += d[c >> 4];
    out += d[c & 15];
  }
  return out;
}

// Bytes [off, off + n) of an iovec list, as an iovec list.
std::vector<iovec> window(const std::vector<iovec>& v, uint64_t off, uint64_t n) {
  std::vector<iovec> out;
  for (const iovec& x : v) {
    if (n == 0) break;
    if (off >= x.iov_len) {
      off -= x.iov_len;
      continue;
    }
    const uint64_t take = std::min<uint64_t>(x.iov_len - off, n);
    out.push_back({static_cast<char*>(x.iov_base) + off, take});
    n -= take;
    off = 0;
  }
  return out;
}

}  // namespace

// -- listeners ----------------------------------------------------------------------------------

void Engine::listen_tcp() {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  const std::string port = std::to_string(cfg_.port);
  int rc = ::getaddrinfo(cfg_.host.empty() ? nullptr : cfg_.host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0) throw std::runtime_error("cannot resolve host '" + cfg_.host + "': " + gai_strerror(rc));
  std::unique_ptr<addrinfo, void (*)(addrinfo*)> guard(res, ::freeaddrinfo);
  std::string last = "no address";
  for (addrinfo* ai = res; ai && !listen_fd_; ai = ai->ai_next) {
    Fd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    if (!fd) continue;
    int one = 1;
    setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
      last = errno_text(errno);
      continue;
    }
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len);
    if (!is_loopback(ss) && cfg_.token.empty() && !cfg_.allow_unauthenticated)
      throw std::invalid_argument(
          "engine '" + cfg_.key + "' would listen on " + address_text(ss) +
          " (beyond loopback) without a shared secret, so anyone who reaches the port could read and write "
          "its registered memory: set MORI_IO_AUTH_TOKEN (the same secret on every engine), listen on "
          "127.0.0.1, or allow it explicitly (IOEngineConfig(allow_unauthenticated=True) or "
          "MORI_IO_ALLOW_UNAUTHENTICATED=1)");
    if (::listen(fd.get(), 512) != 0) {
      last = errno_text(errno);
      continue;
    }
    port_ = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                           : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
    listen_fd_ = std::move(fd);
  }
  if (!listen_fd_)
    throw std::runtime_error("cannot listen on " + cfg_.host + ":" + std::to_string(cfg_.port) + ": " + last);
}

// An abstract Unix socket with a random name, told only to authenticated peers of this node: the
// kernel names the process at the other end (the attach paths need that), and nobody can take the
// name first. Without it (no AF_UNIX), peers of this node use TCP and never attach.
void Engine::listen_unix() {
  const std::string name = "mori-io/" + hex(random_string(16));
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::memcpy(a.sun_path + 1, name.data(), name.size());
  const auto len = socklen_t(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  Fd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd || ::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), len) != 0 || ::listen(fd.get(), 512) != 0) {
    MORI_IO_LOG(20, "engine '%s': no Unix socket (%s); peers of this node use TCP", cfg_.key.c_str(),
                errno_text(errno).c_str());
    return;
  }
  unix_fd_ = std::move(fd);
  unix_name_ = name;
}

// -- accepting ----------------------------------------------------------------------------------

void Engine::accept_loop() {
  int64_t backoff_ms = 0;
  while (!stop_) {
    if (backoff_ms > 0) {  // out of descriptors or memory: wait instead of spinning on accept
      for (int64_t waited = 0; waited < backoff_ms && !stop_; waited += 10)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      if (stop_) return;
    }
    pollfd p[2] = {{listen_fd_.get(), POLLIN, 0}, {unix_fd_.get(), POLLIN, 0}};
    const int n = unix_fd_ ? 2 : 1;
    int r = ::poll(p, nfds_t(n), 200);
    if (stop_) return;
    if (r <= 0) {
      if (r < 0 && errno != EINTR) backoff_ms = 100;
      continue;
    }
    try {
      for (int i = 0; i < n; ++i)
        if (p[i].revents & POLLIN) accept_one(p[i].fd, i == 1, &backoff_ms);
    } catch (const std::exception& e) {  // std::bad_alloc under memory pressure: never leave the loop
      thread_failures.fetch_add(1);
      backoff_ms = std::max<int64_t>(backoff_ms, 100);
      MORI_IO_LOG(30, "engine '%s': accepting a connection failed: %s", cfg_.key.c_str(), e.what());
    }
    {
      std::lock_guard<std::mutex> g(srv_mu_);
      reap_servers();
    }
  }
}

void Engine::reap_servers() {
  for (auto it = servers_.begin(); it != servers_.end();) {
    if (it->s->finished) {
      it->th.join();
      it = servers_.erase(it);
    } else {
      ++it;
    }
  }
}

void Engine::accept_one(int listen_fd, bool unix_socket, int64_t* backoff_ms) {
  Fd fd(::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC));
  if (!fd) {
    const int e = errno;
    if (e == EINTR || e == EAGAIN || e == EWOULDBLOCK || e == ECONNABORTED || e == EPROTO) return;
    // EMFILE, ENFILE, ENOBUFS, ENOMEM: the pending connection stays queued; try again later.
    accept_errors.fetch_add(1);
    *backoff_ms = std::min<int64_t>(1000, std::max<int64_t>(10, *backoff_ms * 2));
    if (*backoff_ms == 1000 || accept_errors.load() == 1)
      MORI_IO_LOG(30, "engine '%s': accept failed: %s; retrying in %lld ms", cfg_.key.c_str(), errno_text(e).c_str(),
                  static_cast<long long>(*backoff_ms));
    return;
  }
  *backoff_ms = 0;
  std::lock_guard<std::mutex> g(srv_mu_);
  reap_servers();  // so a churn of peers does not pile up threads
  const auto& lim = cfg_.limits;
  if (int(servers_.size()) >= lim.max_connections || handshaking_.load() >= lim.max_handshakes) {
    connections_refused.fetch_add(1);
    MORI_IO_LOG(20, "engine '%s': refused a connection: %zu connections (at most %d), %d in their handshake (at most %d)",
                cfg_.key.c_str(), servers_.size(), lim.max_connections, handshaking_.load(), lim.max_handshakes);
    return;  // closed here
  }
  PeerCred cred;
  if (unix_socket) cred = peer_credentials(fd.get());
  tune_socket(fd.get(), tcp_config().socket_buffer_bytes);
  set_timeouts(fd.get(), cfg_.cp_timeout_ms);
  auto served = std::make_shared<Served>();
  const int raw = fd.get();
  served->fd = std::move(fd);
  servers_.reserve(servers_.size() + 1);  // before the thread exists: push_back below cannot throw
  handshaking_.fetch_add(1);  // counted from here, so a burst of connections is bounded at once
  try {
    std::thread th([this, raw, cred = std::move(cred), served]() mutable {
      try {
        serve(raw, std::move(cred));
      } catch (const std::exception& e) {  // e.g. std::bad_alloc: drop the connection
        MORI_IO_LOG(40, "engine '%s': closing a connection: %s", cfg_.key.c_str(), e.what());
      } catch (...) {
        MORI_IO_LOG(40, "engine '%s': closing a connection: unknown exception", cfg_.key.c_str());
      }
      std::lock_guard<std::mutex> done(srv_mu_);
      served->fd.reset();  // the peer sees the connection close at once
      served->finished = true;
    });
    servers_.push_back({served, std::move(th)});
  } catch (const std::system_error& e) {  // no thread to be had (memory, limits): refuse, back off
    handshaking_.fetch_sub(1);
    thread_failures.fetch_add(1);
    *backoff_ms = std::max<int64_t>(*backoff_ms, 100);
    MORI_IO_LOG(30, "engine '%s': refused a connection: cannot start its thread: %s", cfg_.key.c_str(), e.what());
  }
}

// -- one connection -----------------------------------------------------------------------------

void Engine::serve(int fd, PeerCred cred) {
  if (cfg_.manners.short_slice) request_short_slice();
  std::string key, instance;
  int slot = -1;
  bool ok;
  {
    struct Count {  // handshaking_ was incremented at accept
      std::atomic<int>& n;
      ~Count() { n.fetch_sub(1); }
    } count{handshaking_};
    ok = handshake(fd, cred, &key, &instance, &slot);
  }
  if (!ok) {
    handshakes_failed.fetch_add(1);
    return;
  }
  struct Leave {  // however serving ends: the slot's holder can start nothing new, the key is free
    Engine* e;
    const std::string& key;
    int slot;
    ~Leave() {
      if (slot >= 0) e->release_slot(slot);
      e->unbind_key(key);
    }
  } leave{this, key, slot};
  serve_requests(fd, cred, key, slot);
}

bool Engine::bind_key(const std::string& key, const std::string& instance, std::string* why) {
  std::lock_guard<std::mutex> g(bind_mu_);
  Binding& b = bindings_[key];
  if (b.conns > 0 && b.instance != instance) {
    *why = "engine key '" + key + "' is already connected from another engine (keys must be unique among engines)";
    return false;
  }
  b.instance = instance;
  b.conns += 1;
  return true;
}

// The key's last connection closed: its transfers with parts still missing can never complete.
void Engine::unbind_key(const std::string& key) {
  bool last;
  {
    std::lock_guard<std::mutex> g(bind_mu_);
    auto it = bindings_.find(key);
    if (it == bindings_.end()) return;
    last = --it->second.conns == 0;
    if (last) bindings_.erase(it);
  }
  if (last) {
    drain_slots();
    std::lock_guard<std::mutex> in(in_mu_);
    inbound_.fail_incomplete(key, ERR_BAD_STATE, "every connection from '" + key + "' closed before the transfer completed");
  }
}

bool Engine::handshake(int fd, const PeerCred& cred, std::string* key, std::string* instance, int* slot) {
  const int64_t deadline = now_ms() + std::min(cfg_.limits.handshake_timeout_ms, cfg_.cp_timeout_ms);
  const std::string from = cred.unix_socket ? "a local process (pid " + std::to_string(cred.pid) + ")" : "a peer";
  // A connection that goes away or stays silent is routine (health checks, port scans, peers that
  // stopped): info. One that says something wrong is worth a warning.
  auto drop = [&](const std::string& why, int level = 20) {
    MORI_IO_LOG(level, "engine '%s': dropped a connection from %s: %s", cfg_.key.c_str(), from.c_str(), why.c_str());
    return false;
  };
  auto refuse = [&](const std::string& why) {
    Header a = make_header(kHelloAck);
    a.status = ERR_INVALID_ARGS;
    const std::string text = why.substr(0, kMaxText);
    a.body_len = uint32_t(text.size());
    send_msg(fd, a, text.data(), nullptr, nullptr);
    return drop(why, 30);
  };
  Header h;
  std::vector<uint8_t> body;
  std::string err = recv_msg_until(fd, &h, &body, deadline);
  if (!err.empty()) return drop(err == kTimedOut ? "no HELLO within the handshake timeout" : err);
  if (h.type != kHello) {
    protocol_errors.fetch_add(1);
    return refuse("the first message is not HELLO");
  }
  const bool wants_direct = h.flags & kFlagDirect;
  std::vector<std::string> hello;
  err = parse_strings(body.data(), body.size(), 4, &hello);
  if (err.empty() && (hello[0].empty() || hello[0].size() > kMaxKey)) err = "bad engine key";
  if (err.empty() && hello[1].size() > kMaxNodeId) err = "bad node id";
  if (err.empty() && (hello[2].size() != kNonceBytes || hello[3].size() != 16)) err = "bad nonce or instance id";
  if (!err.empty()) {
    protocol_errors.fetch_add(1);
    return refuse("bad HELLO: " + err);
  }
  const std::string& peer_key = hello[0];
  if (cred.unix_socket && cfg_.token.empty() && cred.uid != ::geteuid() && cred.uid != 0)
    return refuse("engine '" + cfg_.key + "' has no MORI_IO_AUTH_TOKEN, so only processes of its own user may "
                  "connect over its Unix socket (this one runs as uid " + std::to_string(cred.uid) + ")");
  const std::string server_nonce = random_string(kNonceBytes);
  const bool auth = !cfg_.token.empty();
  std::string proof;
  if (auth) {
    const Mac m = hmac_sha256(cfg_.token, transcript("target", hello[2], server_nonce, peer_key, cfg_.key, hello[3]));
    proof.assign(m.begin(), m.end());
  }
  Header c = make_header(kChallenge);
  if (auth) c.flags |= kFlagAuth;
  std::vector<uint8_t> cb;
  append_string(&cb, cfg_.key);
  append_string(&cb, server_nonce);
  append_string(&cb, proof);
  c.body_len = uint32_t(cb.size());
  if (!send_msg(fd, c, cb.data(), nullptr, nullptr).empty()) return drop("the peer went away");
  err = recv_msg_until(fd, &h, &body, deadline);
  if (!err.empty()) return drop(err == kTimedOut ? "no AUTH within the handshake timeout" : err);
  std::vector<std::string> au;
  if (h.type != kAuth || !parse_strings(body.data(), body.size(), 1, &au).empty()) {
    protocol_errors.fetch_add(1);
    return refuse("expected AUTH");
  }
  if (auth) {
    const Mac m = hmac_sha256(cfg_.token, transcript("initiator", hello[2], server_nonce, peer_key, cfg_.key, hello[3]));
    if (!equal_ct(au[0], std::string(m.begin(), m.end()))) {
      auth_failures.fetch_add(1);
      return refuse("engine '" + cfg_.key + "' refused '" + peer_key + "': wrong or missing MORI_IO_AUTH_TOKEN");
    }
  } else if (!au[0].empty()) {
    return refuse("engine '" + cfg_.key + "' has no MORI_IO_AUTH_TOKEN; set the same secret on both engines");
  }
  std::string why;
  if (!bind_key(peer_key, hello[3], &why)) {
    protocol_errors.fetch_add(1);
    return refuse(why);
  }
  // From here the connection counts for the key (unbound by serve's guard, or below on failure).
  Header a = make_header(kHelloAck);
  std::vector<uint8_t> ab;
  AckParams params{uint64_t(std::max<int64_t>(0, cfg_.limits.idle_timeout_ms)), 0};
  append_string(&ab, std::string(reinterpret_cast<const char*>(&params), sizeof params));
  // The Unix socket is for peers of this node; it is no secret, the handshake there is the same.
  append_string(&ab, hello[1] == cfg_.node_id ? unix_name_ : std::string());
  Fd slot_fd;
  std::vector<int> fds;
  *slot = -1;
  // Direct path: only for a process the kernel names, that can be told apart from others.
  if (wants_direct && cred.unix_socket && cred.pid > 0 && cred.pidfd && !test.refuse_cma && tcp_config().enable_cma) {
    DirectGrant grant;
    *slot = grant_slot(peer_key, cred, &grant, &slot_fd);
    if (*slot >= 0) {
      a.flags |= kFlagDirect;
      append_string(&ab, std::string(reinterpret_cast<const char*>(&grant), sizeof grant));
      fds = {table_fd_.get(), slot_fd.get()};
    }
  }
  a.body_len = uint32_t(ab.size());
  err = send_msg(fd, a, ab.data(), nullptr, nullptr, nullptr, fds.empty() ? nullptr : &fds);
  slot_fd.reset();  // the initiator has its own descriptor now; ours is not needed (the mapping stays)
  if (!err.empty()) {
    if (*slot >= 0) release_slot(*slot);
    *slot = -1;
    unbind_key(peer_key);
    return drop("the peer went away: " + err);
  }
  *key = peer_key;
  *instance = hello[3];
  return true;
}

void Engine::serve_requests(int fd, const PeerCred& cred, const std::string& peer_key, int slot) {
  StageBuffer stage_buf;  // GPU regions' bytes, through host memory (this thread's)
  Header h;
  std::vector<uint8_t> body;
  std::vector<Seg> segs;
  std::string err;
  // Attach with the peer's process: only a process the kernel named, only if attach is on here.
  const bool attach_possible = cred.unix_socket && cred.pid > 0;
  std::string cma_why = attach_possible ? "" : "the peer is not connected over this host's Unix socket";
  bool cma_refused = !attach_possible;
  const int64_t idle_ms = cfg_.limits.idle_timeout_ms;
  int64_t last_activity = now_ms();
  uint64_t ring_head = 0;
  while (!stop_) {
    int r = wait_readable(fd, 200);
    if (r < 0 && errno != EINTR) return;
    if (r <= 0) {
      if (slot >= 0) {  // inbound statuses of the direct path, when nobody asks for them
        std::lock_guard<std::mutex> in(in_mu_);
        const TableSlot* s = slots_[size_t(slot)].map;
        const uint64_t head = s ? s->head.load(std::memory_order_acquire) : 0;
        if (head != ring_head) last_activity = now_ms();  // the direct path is in use
        ring_head = head;
        drain_slot_locked(uint32_t(slot));
      }
      if (idle_ms > 0 && now_ms() - last_activity > idle_ms) {
        idle_closed.fetch_add(1);
        MORI_IO_LOG(20, "engine '%s': closing the connection from '%s': idle for %lld ms (MORI_IO_IDLE_TIMEOUT_MS)",
                    cfg_.key.c_str(), peer_key.c_str(), static_cast<long long>(idle_ms));
        return;
      }
      continue;
    }
    err = recv_msg(fd, &h, &body);
    if (!err.empty()) {
      if (err != "connection closed by peer")
        MORI_IO_LOG(30, "engine '%s': closing connection from '%s': %s", cfg_.key.c_str(), peer_key.c_str(),
                    err.c_str());
      return;
    }
    last_activity = now_ms();
    if (h.type == kNotify) {  // the doorbell of the direct path, maybe with records the ring had no room for
      if (slot < 0) {
        protocol_errors.fetch_add(1);
        MORI_IO_LOG(30, "engine '%s': closing connection from '%s': a notification on a connection that holds no slot",
                    cfg_.key.c_str(), peer_key.c_str());
        return;
      }
      std::lock_guard<std::mutex> in(in_mu_);
      drain_slot_locked(uint32_t(slot));
      for (size_t off = 0; off + sizeof(NotifyRecord) <= body.size(); off += sizeof(NotifyRecord)) {
        NotifyRecord rec;
        std::memcpy(&rec, body.data() + off, sizeof rec);
        int code = rec.code;
        if (code != SUCCESS && (code < ERR_INVALID_ARGS || code > ERR_GPU_OP)) code = ERR_BAD_STATE;
        record_inbound_locked(peer_key, rec.uid, std::max<uint32_t>(1, rec.total_parts), code,
                              code == SUCCESS ? "" : "the initiator's direct copy failed (code " + std::to_string(code) + ")");
      }
      continue;
    }
    if (h.type == kNotice) {  // statuses of transfers whose bytes took another path: this connection's own
      std::lock_guard<std::mutex> in(in_mu_);
      for (size_t off = 0; off + sizeof(NotifyRecord) <= body.size(); off += sizeof(NotifyRecord)) {
        NotifyRecord rec;
        std::memcpy(&rec, body.data() + off, sizeof rec);
        int code = rec.code;
        if (code != SUCCESS && (code < ERR_INVALID_ARGS || code > ERR_GPU_OP)) code = ERR_BAD_STATE;
        record_inbound_locked(peer_key, rec.uid, std::max<uint32_t>(1, rec.total_parts), code,
                              code == SUCCESS ? "" : "the transfer failed on the initiator (code " + std::to_string(code) + ")");
      }
      continue;
    }
    if (h.type == kAtomic) {  // one word of a region, by this thread's native atomics
      AtomicReq req;
      std::memcpy(&req, body.data(), sizeof req);
      const unsigned width = word_bytes(int(req.word));
      Header rep = make_header(kAtomicAck);
      rep.req_id = h.req_id;
      std::string msg;
      Seg seg{req.off, width, 0};
      RegionPtr region = width ? pin(h.mem_id, &seg, 1, &msg) : nullptr;
      struct Unpin {
        Engine* e;
        RegionPtr r;
        ~Unpin() {
          if (r) e->unpin(r);
        }
      } unpin_guard{this, region};
      uint64_t old = 0;
      if (!width) {
        msg = "unknown atomic word type " + std::to_string(req.word);
      } else if (region && region->loc != 1) {
        msg = "memory region " + std::to_string(h.mem_id) + " is not CPU memory: no atomics on it over TCP";
      } else if (region && (region->addr + req.off) % width != 0) {
        msg = "offset " + std::to_string(req.off) + " of memory region " + std::to_string(h.mem_id) +
              " is not aligned to the " + std::to_string(width) + "-byte word";
      } else if (region && !atomic_rmw_at(region->addr + req.off, int(req.op), int(req.word), req.value, req.compare, &old)) {
        msg = "unknown atomic operation " + std::to_string(req.op);
      }
      rep.status = msg.empty() ? SUCCESS : ERR_INVALID_ARGS;
      rep.mem_id = old;
      if (msg.size() > kMaxText) msg.resize(kMaxText);
      rep.body_len = uint32_t(msg.size());
      if (!send_msg(fd, rep, msg.data(), nullptr, nullptr).empty()) return;
      continue;
    }
    if (h.type != kWrite && h.type != kRead) {
      protocol_errors.fetch_add(1);
      MORI_IO_LOG(30, "engine '%s': unexpected message type %d from '%s'", cfg_.key.c_str(), int(h.type),
                  peer_key.c_str());
      return;
    }
    err = parse_segments(h, body.data(), &segs);
    if (!err.empty()) {
      protocol_errors.fetch_add(1);
      MORI_IO_LOG(30, "engine '%s': malformed request from '%s': %s", cfg_.key.c_str(), peer_key.c_str(),
                  err.c_str());
      return;
    }
    const bool cma = h.flags & kFlagCma;
    const bool notify = h.flags & kFlagNotify;
    int code = SUCCESS;
    std::string msg;
    RegionPtr region = pin(h.mem_id, segs.data(), segs.size(), &msg);
    struct Unpin {  // however this request ends (exceptions included), the region is released
      Engine* e;
      RegionPtr r;
      ~Unpin() {
        if (r) e->unpin(r);
      }
    } unpin_guard{this, region};
    if (!region) code = ERR_INVALID_ARGS;
    const bool staged = region && region->loc != 1;  // device memory: through a host buffer
    if (staged && cma) {
      code = ERR_INVALID_ARGS;
      msg = "memory region " + std::to_string(h.mem_id) + " is not CPU memory; it cannot be attached";
    } else if (staged && !has_device_copier()) {
      code = ERR_INVALID_ARGS;
      msg = "memory region " + std::to_string(h.mem_id) +
            " is not CPU memory and engine '" + cfg_.key + "' has no device copier for GPU staging";
    }
    std::vector<iovec> mine;
    if (code == SUCCESS) {
      mine.reserve(segs.size());
      for (const Seg& s : segs) mine.push_back({reinterpret_cast<void*>(region->addr + s.off), s.len});
    }
    if (cma && code == SUCCESS) {
      if (test.refuse_cma) {
        code = kCmaUnavailable;
        msg = "test mode: attach refused";
      } else if (!tcp_config().enable_cma) {
        code = kCmaUnavailable;
        msg = "cross-memory attach is off on engine '" + cfg_.key + "' (MORI_IO_TCP_CMA=0 or enable_cma=False)";
      } else if (cma_refused) {
        code = kCmaUnavailable;
        msg = cma_why;
      } else {
        std::vector<iovec> theirs;
        theirs.reserve(segs.size());
        for (const Seg& s : segs) theirs.push_back({reinterpret_cast<void*>(s.addr), s.len});
        int e = cma_copy(h.type == kWrite, cred.pid, mine, theirs);
        if (e == EPERM || e == EACCES || e == ENOSYS) {
          cma_refused = true;
          cma_why = errno_text(e);
          code = kCmaUnavailable;
          msg = cma_why;
        } else if (e != 0) {
          code = e == ESRCH ? ERR_BAD_STATE : ERR_INVALID_ARGS;
          msg = "cross-memory attach to '" + peer_key + "' failed: " + errno_text(e);
        } else {
          served_cma.fetch_add(1);
        }
      }
    }
    if (!cma && h.type == kWrite) {
      uint64_t got = 0;  // payload bytes read off the socket so far
      if (code == SUCCESS && staged) {
        // In pieces of at most kStagePiece: a peer's request never makes this thread hold more.
        const CopierRef copier = device_copier();
        while (got < h.payload_len && err.empty()) {
          const uint64_t n = std::min<uint64_t>(kStagePiece, h.payload_len - got);
          uint8_t* buf = code == SUCCESS ? stage_buf.get(copier, n) : nullptr;
          if (!buf) {
            if (code == SUCCESS) {
              code = ERR_GPU_OP;
              msg = "no host staging buffer of " + std::to_string(n) + " bytes";
            }
            err = drain(fd, h.payload_len - got);
            if (err.empty()) got = h.payload_len;
            break;
          }
          std::vector<iovec> host{{buf, n}};
          err = recv_iov(fd, host, nullptr);
          if (!err.empty()) break;
          int rc = stage_in(copier.c, window(mine, got, n), region->device, buf);
          staged_bytes.fetch_add(int64_t(n));
          got += n;
          if (rc != 0) {
            code = ERR_GPU_OP;
            msg = "copying into device memory failed (code " + std::to_string(rc) + ")";
          }
        }
      } else if (code == SUCCESS) {
        std::vector<iovec> left = mine;
        err = recv_iov(fd, left, nullptr);
        got = h.payload_len - iov_bytes(left);
      } else {
        err = drain(fd, h.payload_len);
        if (err.empty()) got = h.payload_len;
      }
      if (!err.empty()) {
        // A torn write: the target's bytes may be half written. Its status says so.
        torn_transfers.fetch_add(1);
        if (notify)
          record_inbound(peer_key, h.uid, h.total_parts, ERR_BAD_STATE,
                         "the connection from '" + peer_key + "' broke after " + std::to_string(got) + " of " +
                             std::to_string(h.payload_len) + " bytes of a write (" + err + ")");
        MORI_IO_LOG(30, "engine '%s': receiving write data from '%s': %s", cfg_.key.c_str(), peer_key.c_str(),
                    err.c_str());
        return;
      }
      if (code == SUCCESS) served_socket.fetch_add(1);
    }
    Header rep = make_header((!cma && h.type == kRead) ? kReadData : kAck);
    rep.req_id = h.req_id;
    rep.uid = h.uid;
    rep.status = code;
    if (msg.size() > kMaxText) msg.resize(kMaxText);
    rep.body_len = code == SUCCESS ? 0 : uint32_t(msg.size());
    const uint64_t total = iov_bytes(mine);
    std::vector<iovec> first;  // staged read data: the first piece, staged before answering
    const CopierRef copier = staged ? device_copier() : CopierRef{};
    if (rep.type == kReadData && code == SUCCESS && staged) {
      const uint64_t n = std::min<uint64_t>(kStagePiece, total);
      uint8_t* buf = stage_buf.get(copier, n);
      int rc = buf ? stage_out(copier.c, window(mine, 0, n), region->device, buf) : -1;
      staged_bytes.fetch_add(int64_t(n));
      if (rc != 0) {
        code = ERR_GPU_OP;
        msg = buf ? "copying device memory to host failed (code " + std::to_string(rc) + ")"
                  : "no host staging buffer of " + std::to_string(n) + " bytes";
        rep.status = code;
        rep.body_len = uint32_t(msg.size());
      } else {
        first.assign(1, iovec{buf, n});
      }
    }
    std::vector<iovec>* payload = nullptr;
    if (rep.type == kReadData && code == SUCCESS) {
      rep.payload_len = total;
      payload = staged ? &first : &mine;
      served_socket.fetch_add(1);
    }
    // Record before answering, so that the initiator seeing success implies the target knows.
    if (notify && code != kCmaUnavailable) record_inbound(peer_key, h.uid, h.total_parts, code, msg);
    err = send_msg(fd, rep, msg.data(), payload, nullptr);
    if (!err.empty()) return;
    if (payload && staged) {  // the rest of a large staged read, piece by piece
      for (uint64_t sent = first[0].iov_len; sent < total;) {
        const uint64_t n = std::min<uint64_t>(kStagePiece, total - sent);
        uint8_t* buf = stage_buf.get(copier, n);
        int rc = buf ? stage_out(copier.c, window(mine, sent, n), region->device, buf) : -1;
        if (rc != 0) {  // the answer already said success: only breaking the connection can say otherwise
          MORI_IO_LOG(30, "engine '%s': staging read data for '%s' failed (code %d); closing the connection",
                      cfg_.key.c_str(), peer_key.c_str(), rc);
          return;
        }
        staged_bytes.fetch_add(int64_t(n));
        std::vector<iovec> piece{{buf, n}};
        if (!send_iov(fd, piece, nullptr).empty()) return;
        sent += n;
      }
    }
  }
}

}  // namespace mori::transfer

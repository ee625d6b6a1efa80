// Peers and the initiator's connections to them: the peer table, connecting (TCP, or the target's
// Unix socket on this node) with the initiator's half of the handshake, reconnecting broken or
// idle connections, and which route bytes to a peer take.
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>

#include "auth.hpp"
#include "conn.hpp"
#include "direct.hpp"
#include "log.hpp"
#include "sys.hpp"
#include "wire.hpp"

namespace mori::transfer {

void Engine::add_peer(const std::string& key, const std::string& host, uint16_t port, bool same_node) {
  PeerPtr old;
  auto p = std::make_shared<Peer>();
  p->key = key;
  p->host = host;
  p->port = port;
  p->same_node = same_node;
  {
    std::lock_guard<std::mutex> g(peer_mu_);
    auto it = peers_.find(key);
    if (it != peers_.end()) {
      if (it->second->host == host && it->second->port == port) return;
      old = it->second;
    }
    peers_[key] = p;
  }
  if (old) {
    std::lock_guard<std::mutex> g(old->mu);
    close_conns(old->conns);
    old->direct.reset();
  }
}

void Engine::remove_peer(const std::string& key) {
  PeerPtr p;
  {
    std::lock_guard<std::mutex> g(peer_mu_);
    auto it = peers_.find(key);
    if (it == peers_.end()) return;
    p = it->second;
    peers_.erase(it);
  }
  std::lock_guard<std::mutex> g(p->mu);
  close_conns(p->conns);
  p->direct.reset();
}

bool Engine::peer_alive(const std::string& key) {
  PeerPtr p;
  {
    std::lock_guard<std::mutex> g(peer_mu_);
    auto it = peers_.find(key);
    if (it == peers_.end()) return false;
    p = it->second;
  }
  std::lock_guard<std::mutex> g(p->mu);
  if (!p->reachable) return false;
  for (auto& c : p->conns)
    if (c->broken()) return false;
  return true;
}

void Engine::close_conns(std::vector<std::shared_ptr<Conn>>& conns) {
  for (auto& c : conns) c->close();
  conns.clear();
}

namespace {

// The other end of a Unix socket as the kernel names it; pidfd from SO_PEERPIDFD (Linux >= 6.5:
// that very process, no pid reuse race) or else pidfd_open(pid).
PeerCred unix_peer(int fd) {
#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77
#endif
  PeerCred c;
  c.unix_socket = true;
  ucred u{};
  socklen_t len = sizeof u;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &u, &len) != 0) return c;
  c.pid = u.pid;
  c.uid = u.uid;
  int pfd = -1;
  len = sizeof pfd;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERPIDFD, &pfd, &len) == 0 && pfd >= 0)
    c.pidfd.reset(pfd);
  else if (c.pid > 0)
    c.pidfd.reset(pidfd_open(c.pid));
  return c;
}

bool unix_address(const std::string& name, sockaddr_un* a, socklen_t* len) {
  if (name.empty() || name.size() >= sizeof a->sun_path) return false;
  std::memset(a, 0, sizeof *a);
  a->sun_family = AF_UNIX;
  std::memcpy(a->sun_path + 1, name.data(), name.size());  // abstract: sun_path[0] == 0
  *len = socklen_t(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return true;
}

std::vector<Fd> own(const std::vector<int>& fds) {
  std::vector<Fd> out;
  for (int fd : fds) out.emplace_back(fd);
  return out;
}

}  // namespace

PeerCred peer_credentials(int fd) { return unix_peer(fd); }

std::string Engine::open_conn(const PeerPtr& p, const std::string& unix_name, bool direct, int64_t deadline_ms,
                              std::shared_ptr<Conn>* out, AckParams* ack, std::string* unix_out,
                              std::shared_ptr<Direct>* direct_out) {
  const TcpConfig tcp = tcp_config();
  const std::string where = unix_name.empty() ? p->host + ":" + std::to_string(p->port) : "its Unix socket";
  const std::string timed_out = "no answer within MORI_IO_CP_TIMEOUT_MS=" + std::to_string(cfg_.cp_timeout_ms) + " ms";
  // What is left of the deadline for one wait (at least 1 ms: 0 would mean "no timeout" to
  // SO_SNDTIMEO, and poll(0) would not wait for a connect already under way).
  auto left_ms = [&] { return std::max<int64_t>(1, deadline_ms - now_ms()); };
  Fd fd;
  if (!unix_name.empty()) {
    sockaddr_un a;
    socklen_t alen;
    if (!unix_address(unix_name, &a, &alen)) return "bad Unix socket name from the peer";
    fd.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd) return "socket(AF_UNIX): " + errno_text(errno);
    // A Unix connect waits while the target's backlog is full (a hung target stops accepting):
    // bounded by SO_SNDTIMEO, which has to be set before.
    set_timeouts(fd.get(), left_ms());
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&a), alen) != 0) {
      const int e = errno;
      return "cannot connect to " + where + ": " +
             (e == EAGAIN || e == EINPROGRESS ? "connect timed out, " + timed_out : errno_text(e));
    }
    tune_socket(fd.get(), tcp.socket_buffer_bytes);
  } else {
    addrinfo hints{}, *res = nullptr;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    const std::string port = std::to_string(p->port);
    int rc = ::getaddrinfo(p->host.c_str(), port.c_str(), &hints, &res);
    if (rc != 0) return "cannot resolve '" + p->host + "': " + gai_strerror(rc);
    std::unique_ptr<addrinfo, void (*)(addrinfo*)> guard(res, ::freeaddrinfo);
    std::string last = "no address";
    for (addrinfo* ai = res; ai && !fd; ai = ai->ai_next) {
      Fd s(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol));
      if (!s) continue;
      tune_socket(s.get(), tcp.socket_buffer_bytes);
      if (::connect(s.get(), ai->ai_addr, ai->ai_addrlen) != 0 && errno != EINPROGRESS) {
        last = errno_text(errno);
        continue;
      }
      pollfd pf{s.get(), POLLOUT, 0};
      int e = 0;
      socklen_t el = sizeof e;
      int r;
      do {
        r = ::poll(&pf, 1, int(std::min<int64_t>(left_ms(), 1 << 30)));
      } while (r < 0 && errno == EINTR && now_ms() < deadline_ms);
      if (r != 1) {
        last = "connect timed out, " + timed_out;
        continue;
      }
      if (::getsockopt(s.get(), SOL_SOCKET, SO_ERROR, &e, &el) != 0 || e != 0) {
        last = errno_text(e);
        continue;
      }
      fd = std::move(s);
    }
    if (!fd) return "cannot connect to " + where + ": " + last;
    ::fcntl(fd.get(), F_SETFL, ::fcntl(fd.get(), F_GETFL) & ~O_NONBLOCK);
  }
  // The connection's own send/receive timeout (Conn's "no progress" limit); the handshake's
  // messages are small enough never to wait for it, their answers wait until `deadline_ms`.
  set_timeouts(fd.get(), cfg_.cp_timeout_ms);

  // The handshake (protocol.hpp): prove nothing to an engine that is not the one asked for.
  const std::string client_nonce = random_string(kNonceBytes);
  Header h = make_header(kHello);
  if (direct) h.flags |= kFlagDirect;
  std::vector<uint8_t> body;
  append_string(&body, cfg_.key);
  append_string(&body, cfg_.node_id);
  append_string(&body, client_nonce);
  append_string(&body, instance_);
  h.body_len = uint32_t(body.size());
  auto fail = [&](const std::string& why) { return "handshake with '" + p->key + "' at " + where + " failed: " + why; };
  std::string err = send_msg(fd.get(), h, body.data(), nullptr, nullptr);
  if (!err.empty()) return fail(err);
  Header c;
  std::vector<uint8_t> cb;
  err = recv_msg_until(fd.get(), &c, &cb, deadline_ms);
  if (!err.empty()) return fail(err == kTimedOut ? timed_out : err);
  if (c.type == kHelloAck && c.status != 0) return fail(std::string(cb.begin(), cb.end()));
  if (c.type != kChallenge) return fail("unexpected answer to HELLO (message type " + std::to_string(c.type) + ")");
  std::vector<std::string> ch;
  err = parse_strings(cb.data(), cb.size(), 3, &ch);
  if (err.empty() && ch[1].size() != kNonceBytes) err = "bad server nonce";
  if (!err.empty()) return fail(err);
  if (ch[0] != p->key) return fail("the engine listening there is '" + ch[0] + "', not '" + p->key + "'");
  const bool required = c.flags & kFlagAuth;
  if (cfg_.token.empty() && required)
    return fail("engine '" + p->key + "' requires a shared secret: set MORI_IO_AUTH_TOKEN (the same on every engine)");
  if (!cfg_.token.empty() && !required)
    return fail("engine '" + p->key + "' has no MORI_IO_AUTH_TOKEN but this engine has one; set the same secret on both");
  std::string proof;
  if (required) {
    const Mac want = hmac_sha256(cfg_.token, transcript("target", client_nonce, ch[1], cfg_.key, p->key, instance_));
    if (!equal_ct(ch[2], std::string(want.begin(), want.end())))
      return fail("the engine did not prove it holds this engine's MORI_IO_AUTH_TOKEN");
    const Mac mine = hmac_sha256(cfg_.token, transcript("initiator", client_nonce, ch[1], cfg_.key, p->key, instance_));
    proof.assign(mine.begin(), mine.end());
  }
  Header au = make_header(kAuth);
  body.clear();
  append_string(&body, proof);
  au.body_len = uint32_t(body.size());
  err = send_msg(fd.get(), au, body.data(), nullptr, nullptr);
  if (!err.empty()) return fail(err);
  Header a;
  std::vector<uint8_t> ab;
  std::vector<int> raw_fds;
  const bool want_fds = direct && !unix_name.empty();
  err = recv_msg_until(fd.get(), &a, &ab, deadline_ms, want_fds ? &raw_fds : nullptr, 2);
  std::vector<Fd> fds = own(raw_fds);
  if (!err.empty()) return fail(err == kTimedOut ? timed_out : err);
  if (a.type != kHelloAck) return fail("unexpected answer to AUTH (message type " + std::to_string(a.type) + ")");
  if (a.status != 0) return fail(std::string(ab.begin(), ab.end()));
  const bool granted = want_fds && (a.flags & kFlagDirect);
  std::vector<std::string> strs;
  err = parse_strings(ab.data(), ab.size(), granted ? 3 : 2, &strs);
  if (err.empty() && strs[0].size() != sizeof(AckParams)) err = "bad HELLO answer";
  if (err.empty() && granted && strs[2].size() != sizeof(DirectGrant)) err = "bad table grant";
  if (!err.empty()) return fail(err);
  std::memcpy(ack, strs[0].data(), sizeof *ack);
  *unix_out = strs[1];

  auto conn = std::make_shared<Conn>(this, p.get(), std::move(fd));
  if (!conn->start(&err)) return fail(err);
  if (granted && direct_out) {
    DirectGrant grant;
    std::memcpy(&grant, strs[2].data(), sizeof grant);
    PeerCred cred = unix_peer(conn->fd());
    std::string why;
    *direct_out = cred.pid > 0 ? open_direct(grant, fds, std::move(cred), conn, &why) : nullptr;
    if (cred.pid <= 0) why = "the target's process is not visible from here (another pid namespace)";
    if (!*direct_out) {
      direct_refused.fetch_add(1);
      MORI_IO_LOG(20, "peer '%s': no direct attach (%s); the target moves the bytes", p->key.c_str(), why.c_str());
    }
  }
  *out = std::move(conn);
  return "";
}

// A fresh set of connections: over the target's Unix socket when it is on this node and that
// socket is reachable (known from an earlier handshake, else learnt over TCP first), else TCP.
// One deadline for all of it: each attempt, fallback and extra connection used to get its own
// MORI_IO_CP_TIMEOUT_MS (and a connect another one for its handshake), so a peer that answered
// slowly, or went silent after the first connection, held the caller for several timeouts.
std::string Engine::connect_peer(const PeerPtr& p, std::vector<std::shared_ptr<Conn>>* out) {
  const int64_t deadline = now_ms() + cfg_.cp_timeout_ms;
  const TcpConfig tcp = tcp_config();
  const int n = std::max(1, tcp.conns_per_peer);
  const bool want_direct = tcp.enable_cma && p->same_node;
  std::shared_ptr<Conn> c;
  AckParams ack{};
  std::string unix_name;
  std::shared_ptr<Direct> d;
  p->local_ipc = false;
  if (p->same_node && !p->unix_name.empty()) {
    std::string err = open_conn(p, p->unix_name, want_direct, deadline, &c, &ack, &unix_name, &d);
    if (err.empty()) {
      p->local_ipc = true;
    } else {
      MORI_IO_LOG(20, "peer '%s': %s; asking over TCP again", p->key.c_str(), err.c_str());
      p->unix_name.clear();
      c.reset();
    }
  }
  if (!c) {
    std::string err = open_conn(p, "", false, deadline, &c, &ack, &unix_name, nullptr);
    if (!err.empty()) return err;
    if (p->same_node && !unix_name.empty()) {
      std::shared_ptr<Conn> u;
      std::string unused;
      err = open_conn(p, unix_name, want_direct, deadline, &u, &ack, &unused, &d);
      if (err.empty()) {
        c->close();
        c = std::move(u);
        p->local_ipc = true;
        p->unix_name = unix_name;
      } else {
        MORI_IO_LOG(20, "peer '%s': its Unix socket is not reachable from here (%s); staying on TCP", p->key.c_str(),
                    err.c_str());
      }
    }
  }
  p->idle_timeout_ms = int64_t(ack.idle_timeout_ms);
  p->direct = d;
  out->push_back(std::move(c));
  while (int(out->size()) < n) {
    std::string unused;
    AckParams more{};
    std::shared_ptr<Conn> next;
    std::string err = open_conn(p, p->local_ipc ? p->unix_name : "", false, deadline, &next, &more, &unused, nullptr);
    if (!err.empty()) return err;
    out->push_back(std::move(next));
  }
  return "";
}

std::string Engine::peer_conns(const PeerPtr& p, std::vector<std::shared_ptr<Conn>>* out,
                               std::shared_ptr<Direct>* direct) {
  std::lock_guard<std::mutex> g(p->mu);
  bool healthy = !p->conns.empty();
  for (auto& c : p->conns) healthy = healthy && !c->broken();
  // The target closes connections silent for its idle timeout: connections silent for half of
  // it are replaced before use (only when none of them has a request in flight).
  if (healthy && p->idle_timeout_ms > 0) {
    const int64_t now = now_ms(), limit = p->idle_timeout_ms / 2;
    bool all_idle = true;
    for (auto& c : p->conns) all_idle = all_idle && c->idle_for(now, limit);
    healthy = !all_idle;
  }
  if (!healthy) {
    close_conns(p->conns);
    p->direct.reset();  // the slot belonged to the old connection
    std::string err = connect_peer(p, &p->conns);
    p->reachable = err.empty();
    if (!err.empty()) {
      close_conns(p->conns);
      p->direct.reset();
      return err;
    }
  }
  if (out) *out = p->conns;
  *direct = p->direct;
  return "";
}

std::string Engine::route_of(const std::string& peer_key, uint64_t local_id, bool remote_cpu) {
  PeerPtr p;
  {
    std::lock_guard<std::mutex> g(peer_mu_);
    auto it = peers_.find(peer_key);
    if (it == peers_.end()) return "";
    p = it->second;
  }
  RegionPtr r;
  {
    std::lock_guard<std::mutex> g(reg_mu_);
    auto it = regions_.find(local_id);
    if (it != regions_.end()) r = it->second;
  }
  bool connected;
  {
    std::lock_guard<std::mutex> g(p->mu);
    connected = !p->conns.empty();
  }
  // Before the first connection: what it will be if the target's Unix socket is reachable.
  const bool local = connected ? p->local_ipc.load() : p->same_node;
  bool cma = tcp_config().enable_cma && p->same_node && local && p->cma_ok && remote_cpu && r && r->loc == 1;
  return cma ? "tcp+cma" : "tcp";
}

}  // namespace mori::transfer

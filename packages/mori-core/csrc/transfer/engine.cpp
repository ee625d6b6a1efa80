// See engine.hpp for the design. Everything here runs without the GIL. This file holds the
// engine's life (start, shutdown), its settings, its inbound statuses and its counters; the
// other parts are one file each: the registration table (registration.cpp), peers and outbound
// connections (peers.cpp, conn.cpp), posting (post.cpp), the direct path (table.cpp on the target,
// direct.cpp on the initiator), GPU staging (staging.cpp), statuses (status.cpp), the target side
// (server.cpp) and the wire helpers (wire.cpp).
#include "engine.hpp"

#include <sys/mman.h>
#include <sys/socket.h>

#include <stdexcept>
#include <system_error>

#include "auth.hpp"
#include "conn.hpp"
#include "copy_pool.hpp"
#include "direct.hpp"
#include "log.hpp"
#include "wire.hpp"

namespace mori::transfer {

Engine::Engine(EngineConfig cfg) : cfg_(std::move(cfg)), inbound_(cfg_.limits.inbound) {
  if (!cfg_.token.empty()) {
    std::string why;
    if (!auth_available(&why))
      throw std::runtime_error("engine '" + cfg_.key + "' has a secret (MORI_IO_AUTH_TOKEN) but cannot prove it: " + why);
  }
  instance_ = random_string(16);
  slots_.resize(kTableSlots);
  listen_tcp();  // throws for a non-loopback address without a secret
  listen_unix();
  create_table();
  try {
    acceptor_ = std::thread([this] { accept_loop(); });
  } catch (const std::system_error& e) {
    throw std::runtime_error("engine '" + cfg_.key + "': cannot start its accept thread: " + e.what());
  }
}

Engine::~Engine() {
  shutdown();
  pool_.reset();
  for (auto& si : slots_)
    if (si.map) ::munmap(si.map, kSlotBytes);
  if (table_) ::munmap(table_, kTableBytes);
}

void Engine::shutdown() {
  if (shut_.exchange(true)) return;
  stop_ = true;
  retire_all();
  ::shutdown(listen_fd_.get(), SHUT_RDWR);
  if (unix_fd_) ::shutdown(unix_fd_.get(), SHUT_RDWR);
  if (acceptor_.joinable()) acceptor_.join();
  listen_fd_.reset();
  unix_fd_.reset();
  std::vector<PeerPtr> peers;
  {
    std::lock_guard<std::mutex> g(peer_mu_);
    for (auto& kv : peers_) peers.push_back(kv.second);
    peers_.clear();
  }
  for (auto& p : peers) {
    std::lock_guard<std::mutex> g(p->mu);
    close_conns(p->conns);
    p->direct.reset();
  }
  std::vector<Server> servers;
  {
    std::lock_guard<std::mutex> g(srv_mu_);
    servers.swap(servers_);
    for (auto& s : servers)
      if (s.s->fd) ::shutdown(s.s->fd.get(), SHUT_RDWR);
  }
  for (auto& s : servers) s.th.join();
  // The copy threads end with the engine's other threads: joined here once the last post holding
  // the pool returns (a post still copying keeps it, and the pool's destructor joins then).
  std::shared_ptr<CopyPool> pool;
  {
    std::lock_guard<std::mutex> g(pool_mu_);
    pool.swap(pool_);
  }
}

void Engine::configure_tcp(const TcpConfig& c) {
  std::lock_guard<std::mutex> g(tcp_mu_);
  tcp_ = c;
}

TcpConfig Engine::tcp_config() {
  std::lock_guard<std::mutex> g(tcp_mu_);
  return tcp_;
}

void Engine::record_inbound(const std::string& key, uint64_t uid, uint32_t total, int code,
                            const std::string& msg) {
  std::lock_guard<std::mutex> g(in_mu_);
  record_inbound_locked(key, uid, total, code, msg);
}

void Engine::record_inbound_locked(const std::string& key, uint64_t uid, uint32_t total, int code,
                                   const std::string& msg) {
  inbound_.record(key, uid, total, code, msg);
}

std::optional<std::pair<int, std::string>> Engine::pop_inbound(const std::string& key, uint64_t uid) {
  drain_slots();
  std::lock_guard<std::mutex> g(in_mu_);
  return inbound_.pop(key, uid);
}

std::map<std::string, int64_t> Engine::counters() {
  std::map<std::string, int64_t> c;
  c["served_cma"] = served_cma.load();
  c["served_socket"] = served_socket.load();
  c["failovers"] = failovers.load();
  c["staged_bytes"] = staged_bytes.load();
  c["direct_copies"] = direct_copies.load();
  c["direct_refused"] = direct_refused.load();
  c["direct_split"] = direct_split.load();
  {
    std::lock_guard<std::mutex> g(pool_mu_);
    c["copy_thread_moves"] = pool_ ? pool_->moves() : 0;
  }
  drain_slots();
  {
    std::lock_guard<std::mutex> g(in_mu_);
    c["inbound_pending"] = int64_t(inbound_.size());
    c["inbound_dropped"] = inbound_.dropped();
  }
  {
    std::lock_guard<std::mutex> g(srv_mu_);
    int64_t live = 0;
    for (const Server& s : servers_) live += s.s->finished ? 0 : 1;
    c["inbound_connections"] = live;
  }
  c["connections_refused"] = connections_refused.load();
  c["handshakes_failed"] = handshakes_failed.load();
  c["auth_failures"] = auth_failures.load();
  c["accept_errors"] = accept_errors.load();
  c["idle_closed"] = idle_closed.load();
  c["protocol_errors"] = protocol_errors.load();
  c["thread_failures"] = thread_failures.load();
  c["torn_transfers"] = torn_transfers.load();
  {
    std::lock_guard<std::mutex> g(reg_mu_);
    c["regions"] = int64_t(regions_.size());
  }
  return c;
}

}  // namespace mori::transfer

// The native mori-io engine: a registration table, listeners (TCP, and a Unix socket for peers of
// this host) whose per-connection progress threads serve one-sided reads and writes into
// registered memory, and outbound connections to remote engines (several per peer) that carry
// striped, chunked transfers.
//
// Trust. Every peer is untrusted. A connection starts with a handshake (protocol.hpp) in which both
// sides prove they hold the shared secret (MORI_IO_AUTH_TOKEN) by HMAC challenge-response: the
// secret never crosses the wire. An engine that listens beyond loopback refuses to start without a
// secret unless told to (allow_unauthenticated). Every request is checked against this engine's own
// registration table on the thread that serves it; the requester's word (its descriptor, its claims)
// decides nothing. Identity: a peer's key is bound to its engine instance while it has connections
// here (a second instance claiming a connected key is refused), inbound statuses are credited only
// to the key the serving connection authenticated. Cross-memory attach happens only with a process
// the kernel named: the peer of a Unix socket (SO_PEERCRED / SO_PEERPIDFD), never a pid a message
// claims. Bounds: connections, connections in their handshake (each with a deadline), idle time,
// inbound statuses (inbound.hpp), message sizes (protocol.hpp); counters say what was refused.
//
// Threads. One accept thread; per inbound connection one progress thread (it checks every
// request against this engine's own registration table, moves the bytes and answers); per
// outbound connection one sender thread (large messages, so the caller does not block) and one
// receiver thread (completes statuses, lands read data directly in registered memory, fails
// everything when the peer is silent longer than the control-plane timeout). No thread lets an
// exception escape; a thread that cannot be created fails what needed it, with a message.
//
// Same-host peers. A peer on this node (same node id) first handshakes over TCP and learns the
// target's Unix socket (an abstract name drawn at random, told only to authenticated peers), then
// connects there; where that fails (another network namespace) it stays on TCP.
//
// Same-host peers, direct path (the fast one): the target grants the initiator a slot and a
// read-only view of its registration table (table.hpp). The initiator then moves CPU bytes itself
// with process_vm_readv/writev, checking every block against the entry the target wrote, with no
// socket round trip: the transfer completes inside post() (its status is already Succeeded, or
// Failed, when post returns). Large transfers are cut into pieces copied in parallel by a small
// pool (TcpConfig::cma_threads threads in all, MORI_IO_CMA_THREADS; pieces of at least
// TcpConfig::cma_split_bytes, MORI_IO_CMA_SPLIT_BYTES). The inbound status reaches the
// target through the slot's ring. deregister_memory on the target retires the entry and waits for
// copies in flight (epoch and busy counters in the slot), so no byte is touched after it returns.
// Regions that are not in the table (GPU memory, a full table) and every refusal (no grant, the
// probe denied, EPERM) take the path below instead.
//
// Same-host peers, target-side attach (the fallback): when both memories are CPU memory and the
// peer is connected over the Unix socket, the bytes of a request move by cross-memory attach done by
// the *target* with the peer's process, so the target still checks bounds against its own table.
// If the OS refuses (EPERM, seccomp) or attach is off on the target (MORI_IO_TCP_CMA=0), the
// target answers "unavailable" and the initiator resends the same bytes over the socket and stops
// using attach for that peer: a failover, not a failure.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../fd.hpp"
#include "inbound.hpp"
#include "protocol.hpp"
#include "table.hpp"


namespace mori::transfer {

using Fd = mori::UniqueFd;

enum Code : int {
  SUCCESS = 0,
  INIT = 1,
  IN_PROGRESS = 2,
  ERR_INVALID_ARGS = 3,
  ERR_NOT_FOUND = 4,
  ERR_RDMA_OP = 5,
  ERR_BAD_STATE = 6,
  ERR_GPU_OP = 7,
};
constexpr int kCmaUnavailable = 100;  // internal answer: attach refused, resend over the socket

void set_log_level(int level);
int log_level();

// State of one transfer as the initiator sees it; completed exactly once.
class Status {
 public:
  // A backend that can finish the transfer in the waiting thread (XGMI: from its GPU events)
  // instead of handing the wait to another thread. wait() returns done() as wait_for does.
  struct Waiter {
    virtual ~Waiter() = default;
    virtual bool wait(Status& s, int64_t timeout_ms) = 0;
  };

  int code() const { return code_.load(std::memory_order_acquire); }
  bool done() const {
    int c = code();
    return c != INIT && c != IN_PROGRESS;
  }
  std::string message();
  void set_in_progress();
  bool complete(int code, const std::string& message);
  // Waits until done; timeout_ms < 0 waits forever, 0 polls. Returns done().
  bool wait_for(int64_t timeout_ms);
  // Set once, before the status is handed out (wait_for then goes through it).
  void set_waiter(std::shared_ptr<Waiter> w) { waiter_ = std::move(w); }
  // The plain wait (condition variable), what a Waiter falls back to when another thread finishes.
  bool wait_plain(int64_t timeout_ms);

 private:
  std::shared_ptr<Waiter> waiter_;
  std::atomic<int> code_{INIT};
  std::mutex mu_;
  std::condition_variable cv_;
  std::string msg_;
};
using StatusPtr = std::shared_ptr<Status>;

// A status already complete with `code` and `message` (a transfer refused before anything moved).
StatusPtr failed_status(int code, const std::string& message);
// The refusal of a block outside its region: "<side> block <i>: offset .. + size .. is outside the
// region (<limit> bytes)" (every backend's queue words it the same).
std::string block_outside(const char* side, size_t i, uint64_t off, uint64_t size, uint64_t limit);

// Waits for all; returns SUCCESS, the first failure's code, or IN_PROGRESS on timeout.
int wait_all(const std::vector<StatusPtr>& statuses, int64_t timeout_ms);

struct Region {
  uint64_t id = 0;
  uintptr_t addr = 0;
  uint64_t size = 0;
  int loc = 0;  // MemoryLocationType: 1 CPU, 2 GPU
  int device = -1;
  bool alive = true;
  bool published = false;  // in the shared registration table (table.hpp)
  int64_t inflight = 0;  // guarded by Engine::reg_mu_
};
using RegionPtr = std::shared_ptr<Region>;

// Copies between device memory and host memory, so the TCP backend can move GPU memory through
// host staging buffers (a piece of a transfer is staged, sent, and staged again on the other
// side; pieces on different connections overlap, which pipelines a large transfer). A device
// plugin provides it (Engine::set_device_copier); both functions are called from engine threads
// without the GIL and return 0 on success. `device` is the region's device_id.
// host_alloc/host_free (optional): the staging buffers themselves, pinned so the GPU's copy
// engines move them directly; without them the buffers are ordinary heap memory.
struct DeviceCopier {
  int (*to_host)(void* ctx, void* host_dst, uintptr_t device_src, uint64_t nbytes, int device) = nullptr;
  int (*from_host)(void* ctx, uintptr_t device_dst, const void* host_src, uint64_t nbytes, int device) = nullptr;
  void* ctx = nullptr;
  void* (*host_alloc)(void* ctx, uint64_t nbytes) = nullptr;
  void (*host_free)(void* ctx, void* ptr) = nullptr;
};

// Device blocks -> one host buffer (to_host), or one host buffer -> device blocks (from_host);
// 0 or the copier's error code.
int stage_out(const DeviceCopier& c, const std::vector<iovec>& dev, int device, uint8_t* buf);
int stage_in(const DeviceCopier& c, const std::vector<iovec>& dev, int device, const uint8_t* buf);
uint64_t iov_bytes(const std::vector<iovec>& v);

// A copier and what keeps its context alive (empty for a copier whose context is static).
struct CopierRef {
  DeviceCopier c;
  std::shared_ptr<void> owner;
};

// A host buffer that device memory is staged through: from the copier's host_alloc (pinned) when
// it has one, else the heap. Grows, never shrinks; used by one thread at a time.
class StageBuffer {
 public:
  StageBuffer() = default;
  ~StageBuffer() { release(); }
  StageBuffer(const StageBuffer&) = delete;
  StageBuffer& operator=(const StageBuffer&) = delete;
  // At least n bytes, from `by`'s allocator (a buffer of another copier is let go); nullptr if
  // that allocation failed.
  uint8_t* get(const CopierRef& by, uint64_t n);

 private:
  void release();
  uint8_t* p_ = nullptr;
  uint64_t cap_ = 0;
  CopierRef by_;  // who allocated p_ (kept alive to free it)
};

struct TcpConfig {
  int conns_per_peer = 4;
  uint64_t chunk_bytes = 1 << 20;
  int socket_buffer_bytes = 0;  // 0: kernel autotuning
  bool enable_cma = true;
  bool enable_notification = true;
  int cma_threads = 0;  // threads (the caller included) that copy one large direct transfer; 0: auto; at most kMaxCmaThreads
  // Smallest piece of a direct transfer cut over those threads (so cut from twice this size); 0:
  // auto (64 KiB where the target's bytes lie on 4 KiB pages, 256 KiB on huge pages); at least kSplitMinFloor.
  uint64_t cma_split_bytes = 0;
};
constexpr int kMaxCmaThreads = 64;              // MORI_IO_CMA_THREADS' bound (env.py)
constexpr uint64_t kSplitMinFloor = 4096;       // MORI_IO_CMA_SPLIT_BYTES' lower bound (env.py)

// Bounds of what peers may hold on the target side (the defaults are the documented ones, env.py).
struct ServerLimits {
  int max_connections = 1024;         // inbound connections at once; beyond, new ones are closed at accept
  int max_handshakes = 64;            // connections still in their handshake at once
  int64_t handshake_timeout_ms = 10000;  // a handshake not finished by then is dropped
  int64_t idle_timeout_ms = 600000;   // a connection silent this long is closed (0: never)
  InboundLimits inbound;
};

// What the library may change of its host process, each off unless asked for (env.py).
struct Manners {
  bool thp = false;                 // registration puts CPU memory on transparent huge pages
  uint64_t thp_collapse_max = uint64_t(1) << 30;
  bool short_slice = false;         // engine threads ask the scheduler for a 0.1 ms slice
  bool move_copy_threads = false;   // a poster moves a copy thread off its own CPU
};

struct EngineConfig {
  std::string key;
  std::string host;  // bind address; "" = all interfaces
  uint16_t port = 0;
  std::string node_id;
  std::string token;
  int64_t cp_timeout_ms = 30000;
  bool allow_unauthenticated = false;  // listen beyond loopback without a secret
  ServerLimits limits;
  Manners manners;
};

// The process at the other end of a Unix socket, as the kernel names it.
struct PeerCred {
  bool unix_socket = false;
  pid_t pid = 0;  // 0: not visible in this pid namespace (attach impossible)
  uid_t uid = 0;
  Fd pidfd;       // that very process (SO_PEERPIDFD), or pidfd_open(pid) on older kernels
};

class Engine;
class Conn;
struct Transfer;

struct Part {
  std::shared_ptr<Transfer> xfer;
  uint16_t op = kWrite;
  uint32_t flags = 0;
  uint64_t uid = 0;
  uint64_t mem_id = 0;
  uint32_t total_parts = 1;
  std::vector<Seg> segs;  // off: target offset; addr: initiator address (always filled locally)
  uint64_t bytes = 0;
  int local_loc = 1;  // MemoryLocationType of the initiator's region: 1 CPU, else staged
  int local_device = -1;
  std::vector<uint8_t> body;  // kNotify: NotifyRecords; kAtomic: its AtomicReq
};
using PartPtr = std::shared_ptr<Part>;

struct Direct;  // an initiator's view of a peer's shared table (direct.hpp)
class CopyPool;  // copy_pool.hpp

struct Peer {
  std::string key, host;
  uint16_t port = 0;
  bool same_node = false;
  std::mutex mu;
  std::vector<std::shared_ptr<Conn>> conns;
  // Guarded by mu: the target's Unix socket (learnt in the handshake), whether `conns` are on it,
  // the target's process (SO_PEERCRED of that socket), the target's idle timeout.
  std::string unix_name;
  std::atomic<bool> local_ipc{false};
  int64_t idle_timeout_ms = 0;
  std::atomic<bool> cma_ok{true};
  std::atomic<bool> reachable{true};  // false after a failed connect, until one succeeds
  std::atomic<uint64_t> rr{0};
  std::shared_ptr<Direct> direct;  // guarded by mu; set up with the connections
};
using PeerPtr = std::shared_ptr<Peer>;

class Engine {
 public:
  // Throws std::invalid_argument for a configuration that is not allowed (listening beyond
  // loopback without a secret), std::runtime_error when it cannot listen.
  explicit Engine(EngineConfig cfg);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  uint16_t port() const { return port_; }
  const std::string& key() const { return cfg_.key; }
  int64_t cp_timeout_ms() const { return cfg_.cp_timeout_ms; }
  void configure_tcp(const TcpConfig& c);
  // `owner` keeps the copier's context alive as long as the engine (and its buffers) use it.
  void set_device_copier(const DeviceCopier& c, std::shared_ptr<void> owner = {});
  bool has_device_copier();
  CopierRef device_copier();
  TcpConfig tcp_config();

  // Throws std::invalid_argument for a range that wraps around or (CPU memory) is not mapped.
  uint64_t register_memory(uintptr_t addr, uint64_t size, int loc, int device);
  // Marks the region gone (new transfers on it fail with ERR_INVALID_ARGS), then waits until no
  // transfer touches it. Returns false if transfers were still running after the timeout.
  bool deregister_memory(uint64_t id, int64_t timeout_ms);
  bool has_memory(uint64_t id);

  void add_peer(const std::string& key, const std::string& host, uint16_t port, bool same_node);
  void remove_peer(const std::string& key);
  bool peer_alive(const std::string& key);

  StatusPtr post(uint16_t op, uint64_t local_id, const std::string& peer_key, uint64_t remote_id,
                 const std::vector<uint64_t>& loffs, const std::vector<uint64_t>& roffs,
                 const std::vector<uint64_t>& sizes, uint64_t uid, bool remote_cpu, uint64_t remote_size);

  // Tells the peer (one way, over an authenticated connection) the inbound status of transfer `uid`
  // whose bytes moved over another path; "" or why it could not be sent.
  std::string notice(const std::string& peer_key, uint64_t uid, uint32_t total_parts, int code);

  // One atomic on the word at `off` of the peer's region `remote_id` (codes of mori/transport.h);
  // *old receives the word's value before it, once the status succeeded.
  StatusPtr post_atomic(const std::string& peer_key, uint64_t remote_id, uint64_t off, int op, int word, uint64_t value,
                        uint64_t compare, std::shared_ptr<uint64_t> old);

  std::optional<std::pair<int, std::string>> pop_inbound(const std::string& key, uint64_t uid);
  std::string route_of(const std::string& peer_key, uint64_t local_id, bool remote_cpu);
  std::map<std::string, int64_t> counters();
  void shutdown();

  // used by connections
  RegionPtr pin(uint64_t id, const Seg* segs, size_t n, std::string* err);
  void unpin(const RegionPtr& r);
  void record_inbound(const std::string& key, uint64_t uid, uint32_t total, int code, const std::string& msg);
  uint64_t next_req_id() { return req_ids_.fetch_add(1) + 1; }
  const EngineConfig& cfg() const { return cfg_; }
  const Manners& manners() const { return cfg_.manners; }
  std::atomic<int64_t> served_cma{0}, served_socket{0}, failovers{0}, staged_bytes{0};
  std::atomic<int64_t> direct_copies{0}, direct_refused{0}, direct_split{0};
  // What peers were refused or lost (see counters()).
  std::atomic<int64_t> connections_refused{0}, handshakes_failed{0}, auth_failures{0}, accept_errors{0},
      idle_closed{0}, protocol_errors{0}, thread_failures{0}, torn_transfers{0};
  // Test modes, settable only in a test build (MORI_TEST_HOOKS: test_hooks.cpp); elsewhere they
  // are constants that the compiler folds away.
  struct TestModes {
#ifdef MORI_TEST_HOOKS
    // Target: answer every attach request as if the OS refused it and grant no table (exercises
    // the failover).
    std::atomic<bool> refuse_cma{false};
    // Initiator: the direct path's probe fails as with EPERM; each direct copy sleeps this long
    // after its bounds check (makes a deregistration race deterministic).
    std::atomic<bool> refuse_direct{false};
    std::atomic<int64_t> direct_delay_ms{0};
#else
    static constexpr bool refuse_cma = false;
    static constexpr bool refuse_direct = false;
    static constexpr int64_t direct_delay_ms = 0;
#endif
  } test;
  // used by connections (initiator side)
  std::shared_ptr<Direct> open_direct(const DirectGrant& g, std::vector<Fd>& fds, PeerCred cred,
                                      const std::shared_ptr<Conn>& conn0, std::string* why);

 private:
  // -- target side (server.cpp) --
  void listen_tcp();
  void listen_unix();
  void accept_loop();
  void accept_one(int listen_fd, bool unix_socket, int64_t* backoff_ms);
  void serve(int fd, PeerCred cred);
  // The handshake; on success *key is the peer's authenticated key and *slot its grant (or -1).
  bool handshake(int fd, const PeerCred& cred, std::string* key, std::string* instance, int* slot);
  bool bind_key(const std::string& key, const std::string& instance, std::string* why);
  void unbind_key(const std::string& key);
  void serve_requests(int fd, const PeerCred& cred, const std::string& peer_key, int slot);

  // -- initiator side (peers.cpp; direct.cpp for the direct path) --
  // All of a peer's connections, within one MORI_IO_CP_TIMEOUT_MS from the call (every attempt,
  // fallback and extra connection shares that deadline: a silent peer costs the timeout once).
  std::string connect_peer(const PeerPtr& p, std::vector<std::shared_ptr<Conn>>* out);
  // One connection: connect (TCP to host:port, or the Unix socket `unix_name`), handshake, all
  // before `deadline_ms` (now_ms() clock). On success *ack holds the target's parameters,
  // *unix_out its Unix socket name and, with `direct`, the grant and its descriptors.
  std::string open_conn(const PeerPtr& p, const std::string& unix_name, bool direct, int64_t deadline_ms,
                        std::shared_ptr<Conn>* out, AckParams* ack, std::string* unix_out,
                        std::shared_ptr<Direct>* direct_out);
  void close_conns(std::vector<std::shared_ptr<Conn>>& conns);
  // The peer's connections (reconnecting broken or idle ones) into *out unless null, and its direct path.
  std::string peer_conns(const PeerPtr& p, std::vector<std::shared_ptr<Conn>>* out, std::shared_ptr<Direct>* direct);
  // Direct path, initiator: true if the transfer was handled (its status completed).
  bool direct_post(Direct& d, const std::string& peer_key, uint16_t op, uint64_t remote_id, const std::vector<Seg>& segs,
                   uint64_t uid, bool notify, const TcpConfig& tcp, const StatusPtr& st);
  // `huge`: the target's range is (mostly) on huge pages (TableEntry::huge_lo/hi), which allows smaller pieces.
  // `threads`, `split_bytes`: TcpConfig::cma_threads, cma_split_bytes (0: auto).
  int copy_parallel(bool pull, pid_t pid, std::vector<iovec>& local, std::vector<iovec>& remote, uint64_t total,
                    bool huge, int threads, uint64_t split_bytes);

  // -- direct path, target side: the table and its slots (table.cpp) --
  void create_table();
  TableEntry* table_entry(uint64_t id) const;
  // A fresh slot for the initiator engine `key` (process `cred`): *g and the descriptors to pass
  // (table, slot; the slot's is closed by the caller once sent); -1 if none is free.
  int grant_slot(const std::string& peer_key, const PeerCred& cred, DirectGrant* g, Fd* slot_fd);
  void release_slot(int slot);
  void drain_slots();
  void drain_slot_locked(uint32_t i);  // in_mu_ held
  void record_inbound_locked(const std::string& key, uint64_t uid, uint32_t total, int code, const std::string& msg);
  bool wait_copies(int64_t deadline_ms);  // flips the epoch, waits for copies that might see the old table
  void retire_all();

  struct SlotInfo {
    TableSlot* map = nullptr;  // this grant's slot memory (nullptr: never granted, or unmapped)
    bool used = false;         // granted to a connection that is still open
    Fd pidfd;                  // the initiator process (to ignore its counters once it is gone)
    std::string key;           // guarded by in_mu_ (the ring drain needs it)
  };
  uint8_t* table_ = nullptr;  // header + entries, this engine's read-write mapping
  Fd table_fd_;               // sealed: others can map it read-only only
  std::mutex slot_mu_;
  std::vector<SlotInfo> slots_;
  std::mutex dereg_mu_;
  std::mutex pool_mu_;
  std::shared_ptr<CopyPool> pool_;  // shared: a post holds it while its pieces are copied

  EngineConfig cfg_;
  std::string instance_;  // this engine's random instance id (16 bytes)
  std::mutex tcp_mu_;
  TcpConfig tcp_;
  CopierRef copier_;  // guarded by tcp_mu_
  Fd listen_fd_;      // TCP
  Fd unix_fd_;        // Unix, abstract name unix_name_ ("" if none)
  std::string unix_name_;
  uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread acceptor_;
  // One inbound connection: its socket (closed by its thread when serving ends, under srv_mu_, so
  // shutdown() never touches a number the process reused) and its progress thread.
  struct Served {
    Fd fd;               // guarded by srv_mu_
    bool finished = false;  // guarded by srv_mu_
  };
  struct Server {
    std::shared_ptr<Served> s;
    std::thread th;
  };
  std::mutex srv_mu_;
  std::vector<Server> servers_;
  void reap_servers();  // srv_mu_ held: joins the threads whose connection ended
  std::atomic<int> handshaking_{0};

  std::mutex bind_mu_;
  struct Binding {
    std::string instance;
    int conns = 0;
  };
  std::unordered_map<std::string, Binding> bindings_;  // bounded by the connection cap

  std::mutex reg_mu_;
  std::condition_variable reg_cv_;
  std::unordered_map<uint64_t, RegionPtr> regions_;

  std::mutex peer_mu_;
  std::unordered_map<std::string, PeerPtr> peers_;

  std::mutex in_mu_;
  InboundTable inbound_;

  std::atomic<uint64_t> req_ids_{0};
  std::atomic<bool> shut_{false};
};

// The process at the other end of Unix socket `fd` (SO_PEERCRED, SO_PEERPIDFD).
PeerCred peer_credentials(int fd);

}  // namespace mori::transfer

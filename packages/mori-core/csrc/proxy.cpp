// The proxy: one host thread per rank that executes one-sided operations for PEs that loads and
// stores cannot reach (other nodes), on a network transport of the contract (mori/transport.h).
//
// Producers -- device code through mori.shmem.device, and the host through Proxy.submit -- write
// fixed-size requests into a ring in host memory that the device can reach (plain memory on the
// cpu runtime, pinned host memory mapped into the GPU on a GPU runtime). Layout: see the kRing* and
// kSlot* constants (also exported to Python as PROXY_LAYOUT; mori.shmem.layout holds the same
// numbers and a test checks they agree). Every word is a little-endian 64-bit integer.
//
// Protocol (a ticket per request, a sequence word per slot; N slots, a power of two >= 4):
//   producer: t = fetch_add(head, 1); wait until slot[t % N].seq == t (the slot is free: a full
//             ring makes the producer wait, it never overwrites); write the fields; release-store
//             seq = t + 1 (published).
//   proxy, at ticket t: acquire-load seq; at t + 1 it copies the fields, then, if no reply is
//             wanted, release-stores seq = t + N (free for ticket t + N). A request that wants a
//             reply (get, fetching atomic) keeps its slot: once it is done the proxy writes the
//             result and release-stores seq = t + 2; the producer reads the result and frees the
//             slot (seq = t + N).
//   completed: every ticket below it is complete at its target (puts flushed). quiet = wait until
//             completed >= head (read at the quiet).
//   error: the first failure stores a code, the PE and the ticket (the message stays here); the
//             proxy then executes nothing more, and producers and waiters stop waiting when they
//             see it (a kernel cannot raise: the host API raises MoriBackendError naming the PE).
//
// Every request is checked before it runs: a known operation, a PE in range that the transport
// reaches, the remote range inside the symmetric heap, the local range inside registered memory,
// aligned atomic words. A request that fails a check is refused (error flag), never executed.
// Large transfers are split into pieces of `piece` bytes; at most kMaxInflight transport requests
// are outstanding, so the ring backs up (and producers wait) when the transport is slow.
//
// Device heaps on a transport without atomics on device memory (MORI_TP_CAP_DEVICE_ATOMIC; UCX
// without RDMA executes atomics on the target's CPU, which cannot touch GPU memory): the proxy is
// made with rma_signals, and then carries what needs no read-modify-write by puts and gets: a
// signal or atomic_set is a put of the value word (after a fence, behind the data), atomic_fetch a
// get of the word. Their local word is the slot's staging word in this PE's heap (kFlagStaged: a
// device producer wrote the value there; device to device memory is one-sided for UCX, cuda_ipc)
// or else the slot's own value / result word (host producers; the ring is registered with the
// transport). Such a slot stays taken until the request is complete. Every other atomic (add,
// swap, compare-swap, and, or, xor; SIGNAL_ADD) is refused, naming why.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sched.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "errors.hpp"
#include "mori/transport.h"
#include "registry.hpp"
#include "transport_objects.hpp"

namespace py = pybind11;

namespace mori {
namespace {

// -- ring layout (bytes from the ring's base) ---------------------------------------------------------
constexpr uint64_t kRingHead = 0;           // next ticket (producers fetch-add)
constexpr uint64_t kRingCompleted = 64;     // tickets below are complete (proxy writes)
constexpr uint64_t kRingError = 128;        // 0, or the first failure's code (kErr*)
constexpr uint64_t kRingErrorPe = 136;      // the PE the failed request named
constexpr uint64_t kRingErrorTicket = 144;  // its ticket
constexpr uint64_t kRingSlotCount = 192;    // N (written once, before the proxy starts)
constexpr uint64_t kRingRmaSignals = 200;   // 1 if the proxy runs with rma_signals (written once)
constexpr uint64_t kRingSlots = 256;        // first slot
constexpr uint64_t kSlotBytes = 128;
// words of a slot
enum SlotWord : uint64_t {
  kSeq = 0, kOp, kPe, kFlags, kAmo, kWord, kDst, kSrc, kNbytes, kValue, kCompare, kSigAddr, kResult
};
// operations; addresses are the producer's: symmetric ones as this PE sees them (dst of put, src
// of get, the atomic's and the signal's word), local ones (src of put, dst of get) in registered memory
enum Op : int64_t { kOpPut = 1, kOpGet = 2, kOpAmo = 3, kOpPutSignal = 4, kOpFence = 5 };
constexpr int64_t kFlagReply = 1;
// the producer also wrote the value into its heap's staging word of this slot (device producers
// under rma_signals): kStageOff + (ticket % N) * 8 from the heap base, inside the heap's reserved
// region (mori.shmem.layout), so at most kStageMaxSlots slots
constexpr int64_t kFlagStaged = 2;
constexpr uint64_t kStageOff = 32768;
constexpr uint64_t kStageMaxSlots = 4096;
// error codes in the ring's error word
enum Err : int64_t { kErrRefused = 1, kErrTransport = 2, kErrStopped = 3, kErrProducer = 4, kErrDied = 5 };

constexpr size_t kMaxInflight = 256;  // transport requests outstanding at once

const char* op_name(int64_t op) {
  switch (op) {
    case kOpPut: return "put";
    case kOpGet: return "get";
    case kOpAmo: return "atomic";
    case kOpPutSignal: return "put-with-signal";
    case kOpFence: return "fence";
  }
  return "unknown operation";
}

inline uint64_t load_acq(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void store_rel(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
inline uint64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Spins, then yields, then sleeps up to 1 ms: an idle proxy costs little on a shared machine.
struct Backoff {
  unsigned idle = 0;
  void reset() { idle = 0; }
  void pause() {
    ++idle;
    if (idle < 256) {
      cpu_relax();
    } else if (idle < 320) {
      sched_yield();
    } else {
      const long us = std::min<long>(1000, 10L << std::min<unsigned>(6, (idle - 320) / 64));
      timespec ts{0, us * 1000};
      nanosleep(&ts, nullptr);
    }
  }
};

struct Peer {
  EndpointPtr ep;
  RemoteKeyPtr rkey;
  uint64_t base = 0;  // the peer's heap address, as its transport registration names it
};

// One request being executed.
struct Entry {
  uint64_t ticket = 0;
  int64_t op = 0, pe = 0, amo = 0, word = 0;
  bool reply = false, needs_flush = false, signal_posted = false, fully_posted = false;
  bool by_rma = false;  // an atomic carried by a put or get (rma_signals); keeps the slot
  bool staged = false;  // its local word is the slot's staging word in the heap (kFlagStaged)
  uint64_t raddr = 0, laddr = 0, nbytes = 0, posted = 0, value = 0, compare = 0, sig_raddr = 0;
  MemoryPtr lmem;  // the local registration (kept alive while the transfer runs)
  std::vector<mori_tp_req> pending;
  std::unique_ptr<uint64_t> old = std::make_unique<uint64_t>(0);
};

class Proxy {
 public:
  Proxy(InstancePtr in, int my_pe, int n_pes, uint64_t heap_base, uint64_t heap_size, MemoryPtr heap, uint64_t ring,
        uint64_t ring_bytes, uint64_t nslots, uint64_t piece, double timeout_s, bool rma_signals)
      : in_(std::move(in)), my_pe_(my_pe), n_pes_(n_pes), heap_base_(heap_base), heap_size_(heap_size),
        ring_(reinterpret_cast<uint8_t*>(ring)), nslots_(nslots), piece_(piece),
        timeout_ns_(static_cast<uint64_t>(timeout_s * 1e9)), rma_signals_(rma_signals), peers_(n_pes) {
    if (n_pes <= 0 || my_pe < 0 || my_pe >= n_pes)
      raise_error("MoriValueError", "Proxy: my_pe=" + std::to_string(my_pe) + " is not in [0, " + std::to_string(n_pes) + ")");
    if (nslots < 4 || (nslots & (nslots - 1)) || nslots > (1u << 20))
      raise_error("MoriValueError", "Proxy: nslots=" + std::to_string(nslots) + " is not allowed; expected a power of two in [4, 2**20]");
    if (ring == 0 || ring % 64 || ring_bytes < ring_size(nslots))
      raise_error("MoriValueError", "Proxy: the ring at " + std::to_string(ring) + " (" + std::to_string(ring_bytes) +
                                        " bytes) must be 64-byte aligned and hold " + std::to_string(ring_size(nslots)) +
                                        " bytes for " + std::to_string(nslots) + " slots");
    if (piece < 64) raise_error("MoriValueError", "Proxy: piece=" + std::to_string(piece) + " is not allowed; expected >= 64 bytes");
    if (!heap) raise_error("MoriValueError", "Proxy: the heap's registration is required");
    heap_mem_ = heap;
    locals_.push_back(std::move(heap));
    if (rma_signals_ && (nslots > kStageMaxSlots || heap_size < kStageOff + nslots * 8))
      raise_error("MoriValueError", "Proxy: nslots=" + std::to_string(nslots) + " is not allowed with rma_signals (a GPU heap on a "
                                    "transport without atomics on device memory): at most " + std::to_string(kStageMaxSlots) +
                                    " (MORI_SHMEM_PROXY_SLOTS), one staging word each in the heap's reserved region");
    if (rma_signals_) {  // the slots are the sources and destinations of host producers' signals, sets and fetches
      mori_tp_error err{};
      mori_tp_mem* m = in_->ops->reg(in_->tp, ring_, ring_bytes, MORI_TP_MEM_HOST, -1, &err);
      if (!m) raise_transport_error("Proxy: registering the ring (rma_signals)", err.code, err);
      ring_mem_ = std::make_shared<Memory>();
      ring_mem_->in = in_;
      ring_mem_->mem = m;
      ring_mem_->addr = ring;
      ring_mem_->size = ring_bytes;
    }
    std::memset(ring_, 0, ring_size(nslots));
    for (uint64_t i = 0; i < nslots; ++i) word(slot(i), kSeq) = i;
    word(ring_, kRingSlotCount / 8) = nslots;
    word(ring_, kRingRmaSignals / 8) = rma_signals_ ? 1 : 0;
  }

  ~Proxy() { stop_thread(); }

  static uint64_t ring_size(uint64_t nslots) { return kRingSlots + nslots * kSlotBytes; }

  void add_peer(int pe, EndpointPtr ep, RemoteKeyPtr rkey, uint64_t base) {
    if (thread_.joinable()) raise_error("MoriStateError", "Proxy.add_peer: the proxy is already running");
    if (pe < 0 || pe >= n_pes_ || pe == my_pe_)
      raise_error("MoriValueError", "Proxy.add_peer: pe=" + std::to_string(pe) + " is not another PE in [0, " + std::to_string(n_pes_) + ")");
    peers_[pe] = Peer{std::move(ep), std::move(rkey), base};
  }

  void add_local(MemoryPtr m) {
    std::lock_guard<std::mutex> g(mu_);
    locals_.push_back(std::move(m));
  }

  void remove_local(uint64_t addr) {
    std::lock_guard<std::mutex> g(mu_);
    for (size_t i = 1; i < locals_.size(); ++i)  // [0] is the heap
      if (locals_[i]->addr == addr) {
        locals_.erase(locals_.begin() + i);
        return;
      }
  }

  void start() {
    if (thread_.joinable()) return;
    stop_.store(false);
    thread_ = std::thread([this] { run(); });
  }

  // Stops the thread (finishing what is in flight, bounded by the timeout); later producers see
  // the error word and stop waiting.
  void stop_thread() {
    if (!thread_.joinable()) return;
    stop_.store(true);
    thread_.join();
    fail(kErrStopped, -1, 0, "the proxy was stopped (shmem_finalize)");
  }

  void set_paused(bool p) { paused_.store(p); }

  uint64_t head() const { return load_acq(&word(ring_, kRingHead / 8)); }
  uint64_t completed() const { return load_acq(&word(ring_, kRingCompleted / 8)); }
  int64_t error_code() const { return static_cast<int64_t>(load_acq(&word(ring_, kRingError / 8))); }
  std::string error_message() const {
    std::lock_guard<std::mutex> g(mu_);
    return message_;
  }
  bool running() const { return thread_.joinable() && !dead_.load(); }

  // Raises MoriBackendError with the first failure's message, if there was one.
  void check() const {
    if (error_code() && error_code() != kErrStopped) raise_error("MoriBackendError", error_message());
  }

  // Until every request issued before the call is complete; raises on error or after timeout_s
  // (naming the oldest request not complete and its PE).
  void quiet(double timeout_s) {
    const uint64_t target = head();
    bool ok;
    {
      py::gil_scoped_release nogil;
      ok = wait_completed(target, timeout_s);
    }
    check();
    if (error_code() == kErrStopped) raise_error("MoriBackendError", "proxy of PE " + std::to_string(my_pe_) + ": not running");
    if (!ok) {
      const uint64_t done = completed();
      std::string oldest;
      {
        std::lock_guard<std::mutex> g(mu_);
        oldest = front_ == done ? " (" + std::string(op_name(front_op_)) + " to PE " + std::to_string(front_pe_) + ")"
                                : " (not yet published by its producer)";
      }
      raise_error("MoriTimeoutError", "proxy of PE " + std::to_string(my_pe_) + ": requests #" + std::to_string(done) +
                                          "..#" + std::to_string(target - 1) + " not complete after " +
                                          std::to_string(timeout_s) + " s; the oldest, #" + std::to_string(done) +
                                          oldest + ", waits on its target");
    }
  }

  // Enqueue one request from the host, as device code does. Waits (GIL released) for a free slot
  // and, for a reply, for the result; both bounded by timeout_s. Returns (ticket, result).
  std::pair<uint64_t, uint64_t> submit(int64_t op, int64_t pe, uint64_t dst, uint64_t src, uint64_t nbytes, int64_t amo,
                                       int64_t word_type, uint64_t value, uint64_t compare, uint64_t sig_addr, bool reply,
                                       double timeout_s) {
    uint64_t t = 0, result = 0;
    int state;  // 0 ok, 1 ring full, 2 no reply, 3 error
    {
      py::gil_scoped_release nogil;
      const uint64_t deadline = now_ns() + static_cast<uint64_t>(timeout_s * 1e9);
      t = __atomic_fetch_add(&word(ring_, kRingHead / 8), 1, __ATOMIC_ACQ_REL);
      uint8_t* s = slot(t);
      state = wait_seq(s, t, deadline) ? 0 : error_code() ? 3 : 1;
      if (state == 0) {
        word(s, kOp) = op;
        word(s, kPe) = pe;
        word(s, kFlags) = reply ? kFlagReply : 0;
        word(s, kAmo) = amo;
        word(s, kWord) = word_type;
        word(s, kDst) = dst;
        word(s, kSrc) = src;
        word(s, kNbytes) = nbytes;
        word(s, kValue) = value;
        word(s, kCompare) = compare;
        word(s, kSigAddr) = sig_addr;
        store_rel(&word(s, kSeq), t + 1);
        if (reply) {
          if (wait_seq(s, t + 2, deadline)) {
            result = word(s, kResult);
            store_rel(&word(s, kSeq), t + nslots_);
          } else {
            state = error_code() ? 3 : 2;
          }
        }
      } else if (state == 1) {
        // The ticket is taken but will never be published: the ring cannot go on in order.
        fail(kErrProducer, pe, t,
             "proxy of PE " + std::to_string(my_pe_) + ": the ring stayed full for " + std::to_string(timeout_s) +
                 " s (request #" + std::to_string(t) + ", " + op_name(op) + " to PE " + std::to_string(pe) +
                 " gave up; the proxy is stuck or its transport does not progress)");
      }
    }
    if (state == 1) raise_error("MoriTimeoutError", error_message());
    if (state == 2)
      raise_error("MoriTimeoutError", "proxy of PE " + std::to_string(my_pe_) + ": no reply to request #" + std::to_string(t) +
                                          " (" + op_name(op) + " to PE " + std::to_string(pe) + ") after " +
                                          std::to_string(timeout_s) + " s");
    check();
    if (state == 3) raise_error("MoriBackendError", "proxy of PE " + std::to_string(my_pe_) + ": not running");
    return {t, result};
  }

 private:
  static uint64_t& word(uint8_t* base, uint64_t i) { return reinterpret_cast<uint64_t*>(base)[i]; }
  static const uint64_t& word(const uint8_t* base, uint64_t i) { return reinterpret_cast<const uint64_t*>(base)[i]; }
  uint8_t* slot(uint64_t t) const { return ring_ + kRingSlots + (t & (nslots_ - 1)) * kSlotBytes; }

  bool wait_seq(uint8_t* s, uint64_t want, uint64_t deadline) const {
    Backoff b;
    while (load_acq(&word(s, kSeq)) != want) {
      if (error_code() || now_ns() > deadline) return false;
      b.pause();
    }
    return true;
  }

  bool wait_completed(uint64_t target, double timeout_s) const {
    const uint64_t deadline = now_ns() + static_cast<uint64_t>(timeout_s * 1e9);
    Backoff b;
    while (completed() < target) {
      if (error_code() || now_ns() > deadline) return false;
      b.pause();
    }
    return true;
  }

  // Records the first failure (later ones keep the first message).
  void fail(int64_t code, int64_t pe, uint64_t ticket, const std::string& msg) {
    std::lock_guard<std::mutex> g(mu_);
    if (word(ring_, kRingError / 8)) return;
    message_ = msg;
    word(ring_, kRingErrorPe / 8) = static_cast<uint64_t>(pe);
    word(ring_, kRingErrorTicket / 8) = ticket;
    store_rel(&word(ring_, kRingError / 8), static_cast<uint64_t>(code));
  }

  std::string who(const Entry& e) const {
    return "proxy of PE " + std::to_string(my_pe_) + ": request #" + std::to_string(e.ticket) + " (" + op_name(e.op) +
           " to PE " + std::to_string(e.pe) + ")";
  }

  bool refuse(const Entry& e, const std::string& why) {
    fail(kErrRefused, e.pe, e.ticket, who(e) + " refused: " + why);
    return false;
  }

  // The peer's address of this PE's symmetric [addr, addr + n), or a refusal.
  bool remote(Entry& e, uint64_t addr, uint64_t n, uint64_t* out, const char* what) {
    const uint64_t off = addr - heap_base_;  // wraps for addresses below the heap: caught below
    if (addr < heap_base_ || off > heap_size_ || n > heap_size_ - off)
      return refuse(e, std::string(what) + " [" + hex(addr) + ", +" + std::to_string(n) +
                           ") is outside the symmetric heap [" + hex(heap_base_) + ", +" + std::to_string(heap_size_) + ")");
    *out = peers_[e.pe].base + off;
    return true;
  }

  bool local(Entry& e, uint64_t addr, uint64_t n, const char* what) {
    {
      std::lock_guard<std::mutex> g(mu_);
      for (const auto& m : locals_)
        if (addr >= m->addr && addr - m->addr <= m->size && n <= m->size - (addr - m->addr)) {
          e.lmem = m;
          return true;
        }
    }
    return refuse(e, std::string(what) + " [" + hex(addr) + ", +" + std::to_string(n) +
                         ") is neither in the symmetric heap nor in a buffer registered with shmem_buffer_register");
  }

  static std::string hex(uint64_t v) {
    char b[24];
    std::snprintf(b, sizeof b, "%#llx", static_cast<unsigned long long>(v));
    return b;
  }

  static bool word_ok(int64_t w) { return w >= MORI_TP_WORD_INT32 && w <= MORI_TP_WORD_UINT64; }
  static uint64_t word_bytes(int64_t w) { return w <= MORI_TP_WORD_UINT32 ? 4 : 8; }

  // Copies and checks the request at ticket t; false if refused.
  bool take(uint64_t t, Entry& e) {
    const uint8_t* s = slot(t);
    e.ticket = t;
    e.op = static_cast<int64_t>(word(s, kOp));
    e.pe = static_cast<int64_t>(word(s, kPe));
    e.reply = word(s, kFlags) & kFlagReply;
    e.staged = rma_signals_ && (word(s, kFlags) & kFlagStaged);
    e.amo = static_cast<int64_t>(word(s, kAmo));
    e.word = static_cast<int64_t>(word(s, kWord));
    const uint64_t dst = word(s, kDst), src = word(s, kSrc), sig = word(s, kSigAddr);
    e.nbytes = word(s, kNbytes);
    e.value = word(s, kValue);
    e.compare = word(s, kCompare);
    if (e.op < kOpPut || e.op > kOpFence) return refuse(e, "unknown operation code " + std::to_string(e.op));
    if (e.op == kOpFence) return true;
    if (e.pe < 0 || e.pe >= n_pes_) return refuse(e, "PE " + std::to_string(e.pe) + " is not in [0, " + std::to_string(n_pes_) + ")");
    if (!peers_[e.pe].ep)
      return refuse(e, "PE " + std::to_string(e.pe) + " is not reached through the proxy (it is this PE or load/store reachable)");
    switch (e.op) {
      case kOpPut:
      case kOpPutSignal:
        if (!remote(e, dst, e.nbytes, &e.raddr, "destination") || !local(e, src, e.nbytes, "source")) return false;
        e.laddr = src;
        e.needs_flush = true;
        if (e.op == kOpPutSignal) {
          if ((e.amo != MORI_TP_OP_SET && e.amo != MORI_TP_OP_ADD) || !word_ok(e.word))
            return refuse(e, "signal operation " + std::to_string(e.amo) + " / word " + std::to_string(e.word) + " is not allowed");
          if (sig % word_bytes(e.word)) return refuse(e, "signal word " + hex(sig) + " is not aligned");
          if (!remote(e, sig, word_bytes(e.word), &e.sig_raddr, "signal word")) return false;
          if (rma_signals_ && !by_rma(e)) return false;
        }
        return true;
      case kOpGet:
        if (!remote(e, src, e.nbytes, &e.raddr, "source") || !local(e, dst, e.nbytes, "destination")) return false;
        e.laddr = dst;
        return true;
      default:  // kOpAmo
        if (e.amo < MORI_TP_OP_FETCH || e.amo > MORI_TP_OP_CSWAP || !word_ok(e.word))
          return refuse(e, "atomic operation " + std::to_string(e.amo) + " / word " + std::to_string(e.word) + " is not allowed");
        if (dst % word_bytes(e.word)) return refuse(e, "atomic word " + hex(dst) + " is not aligned");
        if (!remote(e, dst, word_bytes(e.word), &e.raddr, "atomic word")) return false;
        return !rma_signals_ || by_rma(e);
    }
  }

  // rma_signals: e (a signal or an atomic) becomes a put of its value word or a get into its
  // result word, or is refused when it needs a read-modify-write on the peer's device memory.
  bool by_rma(Entry& e) {
    const bool fetch = e.op == kOpAmo && e.amo == MORI_TP_OP_FETCH;
    if (e.amo != MORI_TP_OP_SET && !fetch)
      return refuse(e, std::string(e.op == kOpPutSignal ? "signal " : "") + amo_name(e.amo) + " on PE " +
                           std::to_string(e.pe) + "'s device memory: the " + in_->ops->name +
                           " transport has no atomics on device memory (MORI_TP_CAP_DEVICE_ATOMIC; RDMA with GPUDirect "
                           "atomics would), so only set, fetch and SIGNAL_SET reach another node's GPU heap");
    e.by_rma = true;
    e.needs_flush = !fetch;  // a set is a put: complete (visible at the peer) only after a flush
    if (fetch) word(slot(e.ticket), kResult) = 0;  // a 32-bit fetch fills the low half
    return true;
  }

  static const char* amo_name(int64_t amo) {
    switch (amo) {
      case MORI_TP_OP_FETCH: return "fetch";
      case MORI_TP_OP_SET: return "set";
      case MORI_TP_OP_ADD: return "add";
      case MORI_TP_OP_SWAP: return "swap";
      case MORI_TP_OP_AND: return "and";
      case MORI_TP_OP_OR: return "or";
      case MORI_TP_OP_XOR: return "xor";
      case MORI_TP_OP_CSWAP: return "compare-swap";
    }
    return "unknown atomic";
  }

  // Posts a put of e's value word (set, signal) or a get into its result word (fetch) to raddr: the
  // slot's staging word in the heap, or the slot's own words.
  bool post_by_rma(Entry& e, uint64_t raddr, const char* what) {
    const Peer& p = peers_[e.pe];
    uint8_t* s = slot(e.ticket);
    const bool fetch = e.op == kOpAmo && e.amo == MORI_TP_OP_FETCH;
    void* local = e.staged ? reinterpret_cast<void*>(heap_base_ + kStageOff + (e.ticket % nslots_) * 8)
                           : static_cast<void*>(&word(s, fetch ? kResult : kValue));
    mori_tp_mem* lmem = e.staged ? heap_mem_->mem : ring_mem_->mem;
    mori_tp_req r = 0;
    mori_tp_error err{};
    const uint64_t n = word_bytes(e.word);  // little-endian: the low half holds a 32-bit value
    int rc = fetch ? in_->ops->get(in_->tp, p.ep->ep, local, lmem, raddr, p.rkey->rkey, n, &r, &err)
                   : in_->ops->put(in_->tp, p.ep->ep, local, lmem, raddr, p.rkey->rkey, n, &r, &err);
    if (rc) return transport_failed(e, what, rc, err);
    if (r) e.pending.push_back(r), ++inflight_;
    return true;
  }

  bool transport_failed(const Entry& e, const char* what, int rc, const mori_tp_error& err) {
    fail(kErrTransport, e.pe, e.ticket,
         who(e) + ": " + std::string(in_->ops->name) + " " + what + " failed: " + (err.message[0] ? err.message : "no message") + " (code " +
             std::to_string(rc) + ")");
    return false;
  }

  // Posts what it can of e (pieces while there is room); false on a transport failure.
  bool advance(Entry& e) {
    const mori_tp_ops* ops = in_->ops;
    mori_tp* tp = in_->tp;
    mori_tp_error err{};
    if (e.op == kOpFence) {
      for (const Peer& p : peers_)
        if (p.ep) {
          if (int rc = ops->fence(tp, p.ep->ep, &err)) return transport_failed(e, "fence", rc, err);
        }
      e.fully_posted = true;
      return true;
    }
    const Peer& p = peers_[e.pe];
    if (e.op == kOpAmo && e.by_rma) {
      if (!post_by_rma(e, e.raddr, e.amo == MORI_TP_OP_FETCH ? "fetch (get)" : "set (put)")) return false;
      e.fully_posted = true;
      return true;
    }
    if (e.op == kOpAmo) {
      mori_tp_req r = 0;
      const uint64_t mask = word_bytes(e.word) == 4 ? 0xffffffffull : ~0ull;
      if (int rc = ops->atomic(tp, p.ep->ep, static_cast<int>(e.amo), static_cast<int>(e.word), e.value & mask,
                               e.compare & mask, e.raddr, p.rkey->rkey, e.old.get(), &r, &err))
        return transport_failed(e, "atomic", rc, err);
      if (r) e.pending.push_back(r), ++inflight_;
      e.fully_posted = true;
      return true;
    }
    while (e.posted < e.nbytes && inflight_ < kMaxInflight) {
      const uint64_t n = std::min(piece_, e.nbytes - e.posted);
      mori_tp_req r = 0;
      int rc = e.op == kOpGet ? ops->get(tp, p.ep->ep, reinterpret_cast<void*>(e.laddr + e.posted), e.lmem->mem,
                                       e.raddr + e.posted, p.rkey->rkey, n, &r, &err)
                            : ops->put(tp, p.ep->ep, reinterpret_cast<const void*>(e.laddr + e.posted), e.lmem->mem,
                                       e.raddr + e.posted, p.rkey->rkey, n, &r, &err);
      if (rc) return transport_failed(e, e.op == kOpGet ? "get" : "put", rc, err);
      if (r) e.pending.push_back(r), ++inflight_;
      e.posted += n;
    }
    if (e.posted < e.nbytes) return true;  // the rest when requests complete
    if (e.op == kOpPutSignal && !e.signal_posted) {
      // the signal only after the data: fence orders it behind every piece on this endpoint
      if (int rc = ops->fence(tp, p.ep->ep, &err)) return transport_failed(e, "fence", rc, err);
      if (e.by_rma) {
        if (!post_by_rma(e, e.sig_raddr, "signal (put)")) return false;
      } else {
        mori_tp_req r = 0;
        const uint64_t mask = word_bytes(e.word) == 4 ? 0xffffffffull : ~0ull;
        if (int rc = ops->atomic(tp, p.ep->ep, static_cast<int>(e.amo), static_cast<int>(e.word), e.value & mask, 0,
                                 e.sig_raddr, p.rkey->rkey, e.old.get(), &r, &err))
          return transport_failed(e, "signal atomic", rc, err);
        if (r) e.pending.push_back(r), ++inflight_;
      }
      e.signal_posted = true;
    }
    e.fully_posted = true;
    return true;
  }

  // Tests e's outstanding requests; false on a failure.
  bool progress(Entry& e) {
    mori_tp_error err{};
    for (size_t i = 0; i < e.pending.size();) {
      int rc = in_->ops->test(in_->tp, e.pending[i], &err);
      if (rc == 0) {
        ++i;
        continue;
      }
      e.pending.erase(e.pending.begin() + i);
      --inflight_;
      if (rc < 0) return transport_failed(e, "operation", rc, err);
    }
    return true;
  }

  void run() {
    try {
      loop();
    } catch (const std::exception& ex) {
      fail(kErrDied, -1, next_, "proxy of PE " + std::to_string(my_pe_) + " died: " + ex.what());
    } catch (...) {
      fail(kErrDied, -1, next_, "proxy of PE " + std::to_string(my_pe_) + " died");
    }
    dead_.store(true);
  }

  void loop() {
    Backoff backoff;
    std::deque<Entry> entries;
    uint64_t flushed = 0;        // tickets below are flushed
    uint64_t posted_through = 0; // tickets below are fully posted
    mori_tp_req flush_req = 0;
    bool flushing = false;
    uint64_t flush_covers = 0;
    uint64_t stop_deadline = 0;
    while (true) {
      bool work = false;
      const bool failed = error_code() != 0;
      if (stop_.load(std::memory_order_relaxed)) {
        if (!stop_deadline) stop_deadline = now_ns() + timeout_ns_;
        if ((entries.empty() && !flushing) || now_ns() > stop_deadline) return;
      }
      // 1. take published requests, in ticket order, while the last one is fully posted
      while (!failed && !paused_.load(std::memory_order_relaxed) && !stop_.load(std::memory_order_relaxed) &&
             (entries.empty() || entries.back().fully_posted) && inflight_ < kMaxInflight) {
        uint8_t* s = slot(next_);
        if (load_acq(&word(s, kSeq)) != next_ + 1) break;
        entries.emplace_back();
        Entry& e = entries.back();
        const bool ok = take(next_, e);
        // fields copied: the slot is free, unless a reply or a put/get from the slot needs it
        if (!e.reply && !e.by_rma) store_rel(&word(s, kSeq), next_ + nslots_);
        ++next_;
        work = true;
        if (!ok || !advance(e)) break;
      }
      if (error_code() && !failed) continue;  // a refusal or failure just now: stop executing
      // 2. the last entry may still have pieces to post
      if (!failed && !entries.empty() && !entries.back().fully_posted) {
        work = true;
        advance(entries.back());
      }
      for (Entry& e : entries)
        if (!e.pending.empty()) progress(e);
      for (const Entry& e : entries)
        if (e.fully_posted) posted_through = std::max(posted_through, e.ticket + 1);
      // 3. puts are complete at their target only after a flush
      if (flushing) {
        mori_tp_error err{};
        int rc = in_->ops->test(in_->tp, flush_req, &err);
        if (rc != 0) {
          flushing = false;
          if (rc < 0 && !entries.empty()) transport_failed(entries.front(), "flush", rc, err);
          else flushed = flush_covers;
          work = true;
        }
      }
      if (!flushing && !entries.empty()) {
        const Entry& f = entries.front();
        if (f.needs_flush && f.fully_posted && f.pending.empty() && flushed <= f.ticket) {
          mori_tp_error err{};
          mori_tp_req r = 0;
          flush_covers = posted_through;
          if (int rc = in_->ops->flush(in_->tp, nullptr, &r, &err)) {
            transport_failed(f, "flush", rc, err);
          } else if (r == 0) {
            flushed = flush_covers;
          } else {
            flush_req = r;
            flushing = true;
          }
          work = true;
        }
      }
      // 4. retire in order: reply, then completed
      while (!entries.empty() && !error_code()) {
        Entry& f = entries.front();
        if (!f.fully_posted || !f.pending.empty() || (f.needs_flush && flushed <= f.ticket)) break;
        if (f.reply) {
          uint8_t* s = slot(f.ticket);
          if (!f.by_rma) {
            word(s, kResult) = *f.old;
          } else if (!f.staged && f.word == MORI_TP_WORD_INT32) {  // the get wrote the low half: sign-extend, as atomics do
            word(s, kResult) = static_cast<uint64_t>(static_cast<int64_t>(static_cast<int32_t>(word(s, kResult))));
          }
          store_rel(&word(s, kSeq), f.ticket + 2);
        } else if (f.by_rma) {
          store_rel(&word(slot(f.ticket), kSeq), f.ticket + nslots_);  // the put from the slot is complete
        }
        store_rel(&word(ring_, kRingCompleted / 8), f.ticket + 1);
        entries.pop_front();
        work = true;
      }
      if (error_code()) {  // nothing more runs; drop what finished, keep testing the rest
        while (!entries.empty() && entries.front().pending.empty()) entries.pop_front();
        if (flushing) {
          mori_tp_error err{};
          if (in_->ops->test(in_->tp, flush_req, &err) != 0) flushing = false;
        }
      }
      {
        std::lock_guard<std::mutex> g(mu_);
        front_ = entries.empty() ? next_ : entries.front().ticket;
        front_op_ = entries.empty() ? 0 : entries.front().op;
        front_pe_ = entries.empty() ? -1 : entries.front().pe;
      }
      if (work) {
        backoff.reset();
      } else {
        backoff.pause();
      }
    }
  }

  InstancePtr in_;
  const int my_pe_, n_pes_;
  const uint64_t heap_base_, heap_size_;
  uint8_t* const ring_;
  const uint64_t nslots_, piece_, timeout_ns_;
  const bool rma_signals_;
  MemoryPtr heap_mem_;                // the heap's registration (also locals_[0])
  MemoryPtr ring_mem_;                // the ring's registration (rma_signals only)
  std::vector<Peer> peers_;           // by PE; set before start, then read-only
  std::vector<MemoryPtr> locals_;     // [0] the heap, then registered buffers (under mu_)
  mutable std::mutex mu_;
  std::string message_;               // the first failure (under mu_)
  uint64_t front_ = 0;                // oldest ticket not retired, its op and PE (under mu_)
  int64_t front_op_ = 0, front_pe_ = -1;
  uint64_t next_ = 0;                 // next ticket to take (proxy thread)
  size_t inflight_ = 0;               // transport requests outstanding (proxy thread)
  std::atomic<bool> stop_{false}, paused_{false}, dead_{false};
  std::thread thread_;
};

}  // namespace

void register_proxy(py::module_& m) {
  py::class_<Proxy, std::shared_ptr<Proxy>>(m, "Proxy",
                                            "The host proxy of one rank: a native thread that executes requests from a ring in "
                                            "device-reachable host memory on a network transport (see csrc/proxy.cpp).")
      .def(py::init<InstancePtr, int, int, uint64_t, uint64_t, MemoryPtr, uint64_t, uint64_t, uint64_t, uint64_t, double, bool>(),
           py::arg("transport"), py::arg("my_pe"), py::arg("n_pes"), py::arg("heap_base"), py::arg("heap_size"),
           py::arg("heap"), py::arg("ring"), py::arg("ring_bytes"), py::arg("nslots"), py::arg("piece"),
           py::arg("timeout_s"), py::arg("rma_signals") = false,
           "Initialises the ring at host address `ring` (`ring_bytes`, see ring_size) for `nslots` requests. "
           "rma_signals: carry signals, sets and fetches by puts and gets from the ring (registered with the "
           "transport) and refuse other atomics: for device heaps on a transport without MORI_TP_CAP_DEVICE_ATOMIC.")
      .def("add_peer", &Proxy::add_peer, py::arg("pe"), py::arg("endpoint"), py::arg("rkey"), py::arg("base"),
           "A PE the proxy serves: its endpoint, its heap's key and base address. Before start().")
      .def("add_local", &Proxy::add_local, py::arg("memory"), "A registered local buffer requests may use.")
      .def("remove_local", &Proxy::remove_local, py::arg("addr"))
      .def("start", &Proxy::start, "Start the thread.")
      .def("stop", &Proxy::stop_thread, py::call_guard<py::gil_scoped_release>(),
           "Stop the thread after what is in flight (bounded by timeout_s).")
      .def("set_paused", &Proxy::set_paused, py::arg("paused"),
           "Take no new requests while paused (tests and diagnostics: a full ring).")
      .def("check", &Proxy::check, "Raise MoriBackendError with the first failure, if any.")
      .def("quiet", &Proxy::quiet, py::arg("timeout_s"),
           "Block (GIL released) until every request issued before is complete; raises on failure or timeout.")
      .def("submit", &Proxy::submit, py::arg("op"), py::arg("pe"), py::arg("dst") = 0, py::arg("src") = 0,
           py::arg("nbytes") = 0, py::arg("amo") = 0, py::arg("word") = 0, py::arg("value") = 0, py::arg("compare") = 0,
           py::arg("sig_addr") = 0, py::arg("reply") = false, py::arg("timeout_s") = 10.0,
           "Enqueue one request from the host (as device code does); returns (ticket, result).")
      .def_property_readonly("head", &Proxy::head, "Tickets handed out (requests issued).")
      .def_property_readonly("completed", &Proxy::completed, "Tickets below this are complete.")
      .def_property_readonly("error_code", &Proxy::error_code, "0, or the ring's error code.")
      .def_property_readonly("error_message", &Proxy::error_message)
      .def_property_readonly("running", &Proxy::running)
      .def_static("ring_size", &Proxy::ring_size, py::arg("nslots"), "Bytes of a ring of nslots slots.");
  py::dict layout;
  layout["HEAD"] = kRingHead;
  layout["COMPLETED"] = kRingCompleted;
  layout["ERROR"] = kRingError;
  layout["ERROR_PE"] = kRingErrorPe;
  layout["ERROR_TICKET"] = kRingErrorTicket;
  layout["SLOT_COUNT"] = kRingSlotCount;
  layout["RMA_SIGNALS"] = kRingRmaSignals;
  layout["STAGE_OFF"] = kStageOff;
  layout["STAGE_MAX_SLOTS"] = kStageMaxSlots;
  layout["SLOTS"] = kRingSlots;
  layout["SLOT_BYTES"] = kSlotBytes;
  for (auto [name, w] : {std::pair<const char*, uint64_t>{"SEQ", kSeq}, {"OP", kOp}, {"PE", kPe}, {"FLAGS", kFlags},
                         {"AMO", kAmo}, {"WORD", kWord}, {"DST", kDst}, {"SRC", kSrc}, {"NBYTES", kNbytes},
                         {"VALUE", kValue}, {"COMPARE", kCompare}, {"SIG_ADDR", kSigAddr}, {"RESULT", kResult}})
    layout[(std::string("W_") + name).c_str()] = w;
  for (auto [name, v] : {std::pair<const char*, int64_t>{"OP_PUT", kOpPut}, {"OP_GET", kOpGet}, {"OP_AMO", kOpAmo},
                         {"OP_PUT_SIGNAL", kOpPutSignal}, {"OP_FENCE", kOpFence}, {"FLAG_REPLY", kFlagReply}, {"FLAG_STAGED", kFlagStaged},
                         {"ERR_REFUSED", kErrRefused}, {"ERR_TRANSPORT", kErrTransport}, {"ERR_STOPPED", kErrStopped},
                         {"ERR_PRODUCER", kErrProducer}, {"ERR_DIED", kErrDied}})
    layout[name] = v;
  m.attr("PROXY_LAYOUT") = layout;
}

}  // namespace mori

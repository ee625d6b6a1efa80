// Posting, initiator side: a transfer's blocks checked, merged and cut into parts spread over the
// peer's connections (or handed to the direct path), one-way notices, remote atomics.
#include <algorithm>

#include "conn.hpp"
#include "direct.hpp"
#include "wire.hpp"

namespace mori::transfer {

namespace {
// post's block lists, kept per thread: a batch's lists are kilobytes, and glibc answers every
// allocation that large by first consolidating its free small chunks (~0.5 us a transfer at 128
// blocks, measured with perf). Capacity beyond kSegScratchKeep entries is freed after the call.
struct SegScratch {
  std::vector<Seg> a, b;
  bool busy = false;
};
constexpr size_t kSegScratchKeep = 1 << 14;
}  // namespace

StatusPtr Engine::post(uint16_t op, uint64_t local_id, const std::string& peer_key, uint64_t remote_id,
                       const std::vector<uint64_t>& loffs, const std::vector<uint64_t>& roffs,
                       const std::vector<uint64_t>& sizes, uint64_t uid, bool remote_cpu, uint64_t remote_size) {
  auto st = std::make_shared<Status>();
  const size_t n = sizes.size();
  if (loffs.size() != n || roffs.size() != n) {
    st->complete(ERR_INVALID_ARGS, "offset and size lists differ in length");
    return st;
  }
  // Per-thread scratch (see SegScratch); a nested call (none today) would get vectors of its own.
  static thread_local SegScratch scratch;
  std::vector<Seg> own_a, own_b;
  const bool mine = !scratch.busy;
  struct Release {
    SegScratch& s;
    bool mine;
    ~Release() {
      if (!mine) return;
      s.busy = false;
      if (s.a.capacity() > kSegScratchKeep) std::vector<Seg>().swap(s.a);
      if (s.b.capacity() > kSegScratchKeep) std::vector<Seg>().swap(s.b);
    }
  } release{scratch, mine};
  scratch.busy = true;
  std::vector<Seg>& local_segs = mine ? scratch.a : own_a;
  std::vector<Seg>& segs = mine ? scratch.b : own_b;
  local_segs.resize(n);
  for (size_t i = 0; i < n; ++i) {
    local_segs[i] = {loffs[i], sizes[i], 0};
    // The descriptor's size lets the initiator fail early; the target checks again on its side.
    if (roffs[i] > remote_size || sizes[i] > remote_size - roffs[i]) {
      st->complete(ERR_INVALID_ARGS, "remote offset " + std::to_string(roffs[i]) + " + size " +
                                         std::to_string(sizes[i]) + " is outside the remote region (" +
                                         std::to_string(remote_size) + " bytes)");
      return st;
    }
  }
  std::string err;
  RegionPtr local = pin(local_id, local_segs.data(), n, &err);
  if (!local) {
    st->complete(ERR_INVALID_ARGS, "local: " + err);
    return st;
  }
  // Holds the pin until the socket path's Transfer takes it over (or this call returns).
  struct Pin {
    Engine* e;
    RegionPtr r;
    ~Pin() {
      if (r) e->unpin(r);
    }
  } pin_guard{this, local};
  if (local->loc != 1 && !has_device_copier()) {
    st->complete(ERR_INVALID_ARGS,
                 "local memory is not CPU memory and no device copier is installed (GPU staging)");
    return st;
  }
  PeerPtr peer;
  {
    std::lock_guard<std::mutex> g(peer_mu_);
    auto it = peers_.find(peer_key);
    if (it != peers_.end()) peer = it->second;
  }
  if (!peer) {
    st->complete(ERR_NOT_FOUND, "remote engine '" + peer_key + "' is not registered");
    return st;
  }
  // The connections are copied out only for the socket path (a same-host copy needs none of them).
  std::vector<std::shared_ptr<Conn>> conns;
  std::shared_ptr<Direct> direct;
  err = peer_conns(peer, nullptr, &direct);
  if (!err.empty()) {
    st->complete(ERR_BAD_STATE, "remote engine '" + peer_key + "': " + err);
    return st;
  }
  TcpConfig tcp = tcp_config();
  uint32_t flags = tcp.enable_notification ? uint32_t(kFlagNotify) : 0u;
  if (tcp.enable_cma && peer->same_node && peer->local_ipc && peer->cma_ok && remote_cpu && local->loc == 1)
    flags |= kFlagCma;
  const uint64_t chunk = std::max<uint64_t>(tcp.chunk_bytes, 4096);

  // Merge blocks contiguous on both sides, then cut into parts of at most `chunk` bytes.
  segs.clear();
  for (size_t i = 0; i < n; ++i) {
    if (sizes[i] == 0) continue;
    uintptr_t addr = local->addr + loffs[i];
    if (!segs.empty() && segs.back().off + segs.back().len == roffs[i] &&
        segs.back().addr + segs.back().len == addr) {
      segs.back().len += sizes[i];
    } else {
      segs.push_back({roffs[i], sizes[i], addr});
    }
  }
  // Same-host CPU memory: the initiator copies itself, checked against the target's own table.
  if ((flags & kFlagCma) && direct && direct->ok.load(std::memory_order_relaxed) &&
      direct_post(*direct, peer_key, op, remote_id, segs, uid, tcp.enable_notification, tcp, st))
    return st;
  err = peer_conns(peer, &conns, &direct);
  if (!err.empty()) {
    st->complete(ERR_BAD_STATE, "remote engine '" + peer_key + "': " + err);
    return st;
  }
  auto xfer = std::make_shared<Transfer>();  // unpins the region after the last part
  xfer->eng = this;
  xfer->st = st;
  xfer->local = std::move(pin_guard.r);
  std::vector<PartPtr> parts;
  auto new_part = [&] {
    auto p = std::make_shared<Part>();
    p->xfer = xfer;
    p->op = op;
    p->flags = flags;
    p->local_loc = local->loc;
    p->local_device = local->device;
    p->uid = uid;
    p->mem_id = remote_id;
    parts.push_back(p);
    return p.get();
  };
  Part* cur = new_part();
  for (const Seg& s0 : segs) {
    Seg s = s0;
    while (s.len > 0) {
      if (cur->bytes >= chunk || cur->segs.size() >= kMaxSegs) cur = new_part();
      uint64_t take = std::min(s.len, chunk - cur->bytes);
      cur->segs.push_back({s.off, take, s.addr});
      cur->bytes += take;
      s.off += take;
      s.addr += take;
      s.len -= take;
    }
  }
  const uint32_t total = uint32_t(parts.size());
  xfer->remaining = total;
  st->set_in_progress();
  uint64_t base = peer->rr.fetch_add(total);
  for (size_t i = 0; i < parts.size(); ++i) {
    parts[i]->total_parts = total;
    conns[(base + i) % conns.size()]->submit(parts[i]);
  }
  return st;
}

std::string Engine::notice(const std::string& peer_key, uint64_t uid, uint32_t total_parts, int code) {
  PeerPtr peer;
  {
    std::lock_guard<std::mutex> g(peer_mu_);
    auto it = peers_.find(peer_key);
    if (it != peers_.end()) peer = it->second;
  }
  if (!peer) return "remote engine '" + peer_key + "' is not registered";
  std::vector<std::shared_ptr<Conn>> conns;
  std::shared_ptr<Direct> direct;
  std::string err = peer_conns(peer, &conns, &direct);
  if (!err.empty()) return err;
  NotifyRecord rec{uid, code, std::max<uint32_t>(1, total_parts)};
  const auto* b = reinterpret_cast<const uint8_t*>(&rec);
  conns[0]->oneway(std::vector<uint8_t>(b, b + sizeof rec), kNotice);
  return "";
}

StatusPtr Engine::post_atomic(const std::string& peer_key, uint64_t remote_id, uint64_t off, int op, int word,
                              uint64_t value, uint64_t compare, std::shared_ptr<uint64_t> old) {
  auto st = std::make_shared<Status>();
  PeerPtr peer;
  {
    std::lock_guard<std::mutex> g(peer_mu_);
    auto it = peers_.find(peer_key);
    if (it != peers_.end()) peer = it->second;
  }
  if (!peer) {
    st->complete(ERR_NOT_FOUND, "remote engine '" + peer_key + "' is not registered");
    return st;
  }
  std::vector<std::shared_ptr<Conn>> conns;
  std::shared_ptr<Direct> direct;
  std::string err = peer_conns(peer, &conns, &direct);
  if (!err.empty()) {
    st->complete(ERR_BAD_STATE, "remote engine '" + peer_key + "': " + err);
    return st;
  }
  auto xfer = std::make_shared<Transfer>();
  xfer->eng = this;
  xfer->st = st;
  xfer->result = std::move(old);
  xfer->remaining = 1;
  auto p = std::make_shared<Part>();
  p->xfer = xfer;
  p->op = kAtomic;
  p->mem_id = remote_id;
  AtomicReq req{off, uint32_t(op), uint32_t(word), value, compare};
  const auto* b = reinterpret_cast<const uint8_t*>(&req);
  p->body.assign(b, b + sizeof req);
  st->set_in_progress();
  conns[peer->rr.fetch_add(1) % conns.size()]->submit(p);
  return st;
}

}  // namespace mori::transfer

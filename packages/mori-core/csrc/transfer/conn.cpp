// Conn: one outbound connection to a peer (conn.hpp). Its sender thread sends what the caller
// did not send itself; its receiver thread completes the parts' statuses, lands read data in
// registered memory (staging device memory) and fails everything when the peer goes silent.
#include "conn.hpp"

#include <sys/socket.h>

#include <cerrno>
#include <system_error>

#include "log.hpp"
#include "sched.hpp"
#include "wire.hpp"

namespace mori::transfer {

Conn::Conn(Engine* eng, Peer* peer, Fd fd) : eng_(eng), peer_(peer), fd_(std::move(fd)) {
  last_progress_.store(now_ms());
  last_used_.store(now_ms());
}

bool Conn::start(std::string* why) {
  // An exception escaping a thread would terminate the process (std::bad_alloc of a staging
  // buffer, say): it breaks this connection instead.
  const bool slice = eng_->manners().short_slice;
  try {
    tx_ = std::thread([this, slice] {
      if (slice) request_short_slice();
      try {
        tx_loop();
      } catch (const std::exception& e) {
        fail(std::string("sender thread: ") + e.what());
      } catch (...) {
        fail("sender thread: unknown exception");
      }
    });
    rx_ = std::thread([this, slice] {
      if (slice) request_short_slice();
      try {
        rx_loop();
      } catch (const std::exception& e) {
        fail(std::string("receiver thread: ") + e.what());
      } catch (...) {
        fail("receiver thread: unknown exception");
      }
    });
  } catch (const std::system_error& e) {
    eng_->thread_failures.fetch_add(1);
    *why = std::string("cannot start the connection's threads: ") + e.what();
    fail(*why);
    return false;
  }
  return true;
}

bool Conn::idle_for(int64_t now, int64_t ms) {
  if (now - last_used_.load(std::memory_order_relaxed) <= ms) return false;
  {
    std::lock_guard<std::mutex> g(pmu_);
    if (!pending_.empty()) return false;
  }
  std::lock_guard<std::mutex> q(qmu_);
  return q_.empty();
}

void Conn::submit(const PartPtr& p) {
  last_used_.store(now_ms(), std::memory_order_relaxed);
  uint64_t id = eng_->next_req_id();
  {
    std::lock_guard<std::mutex> g(pmu_);
    if (broken_) {
      std::string why = why_;
      p->xfer->part_done(ERR_BAD_STATE, why);
      return;
    }
    pending_.emplace(id, p);
  }
  // Small messages go out from the caller when nobody else is sending: one wake-up less.
  if (p->bytes <= (64u << 10) || (p->flags & kFlagCma) || p->op == kRead || p->op == kAtomic) {
    std::unique_lock<std::mutex> s(send_mu_, std::try_to_lock);
    if (s.owns_lock()) {
      bool idle;
      {
        std::lock_guard<std::mutex> g(qmu_);
        idle = q_.empty();
      }
      if (idle && send_part(id, *p, /*nonblocking_start=*/true)) return;
    }
  }
  {
    std::lock_guard<std::mutex> g(qmu_);
    q_.emplace_back(id, p);
  }
  qcv_.notify_one();
}

void Conn::oneway(std::vector<uint8_t> body, uint16_t op) {
  auto p = std::make_shared<Part>();
  p->op = op;
  p->body = std::move(body);
  {
    std::lock_guard<std::mutex> g(qmu_);
    if (broken_ || stop_) return;
    q_.emplace_back(0, p);
  }
  qcv_.notify_one();
}

void Conn::fail(std::string why) {
  const std::string timed_out = kTimedOut;
  if (why.size() >= timed_out.size() && why.compare(why.size() - timed_out.size(), timed_out.size(), timed_out) == 0)
    why += ": no progress within MORI_IO_CP_TIMEOUT_MS=" + std::to_string(eng_->cp_timeout_ms()) + " ms";
  std::unordered_map<uint64_t, PartPtr> parts;
  {
    std::lock_guard<std::mutex> g(pmu_);
    if (!broken_) {
      broken_ = true;
      why_ = "peer '" + peer_->key + "' (" + peer_->host + ":" + std::to_string(peer_->port) + "): " + why;
      // Only worth a warning when transfers fail with it; an idle peer going away is normal.
      if (!stop_) MORI_IO_LOG(pending_.empty() ? 20 : 30, "%s", why_.c_str());
    }
    parts.swap(pending_);
  }
  ::shutdown(fd_.get(), SHUT_RDWR);
  qcv_.notify_all();
  for (auto& kv : parts) kv.second->xfer->part_done(ERR_BAD_STATE, why_);
}

void Conn::close() {
  if (closed_.exchange(true)) return;
  stop_ = true;
  fail("connection closed");
  qcv_.notify_all();
  if (tx_.joinable()) tx_.join();
  if (rx_.joinable()) rx_.join();
  fd_.reset();
}

bool Conn::send_part(uint64_t id, const Part& p, bool nonblocking_start) {
  if (p.op == kNotify || p.op == kNotice || p.op == kAtomic) {
    Header n = make_header(p.op);
    n.body_len = uint32_t(p.body.size());
    if (p.op == kAtomic) {
      n.req_id = id;
      n.mem_id = p.mem_id;
      n.total_parts = 1;
    }
    std::string err = send_msg(fd_.get(), n, p.body.data(), nullptr, &last_progress_);
    if (!err.empty()) fail("send failed: " + err);
    return true;
  }
  Header h = make_header(p.op);
  h.flags = p.flags;
  h.req_id = id;
  h.uid = p.uid;
  h.mem_id = p.mem_id;
  h.nsegs = uint32_t(p.segs.size());
  h.body_len = uint32_t(p.segs.size() * sizeof(Seg));
  h.total_parts = p.total_parts;
  bool cma = p.flags & kFlagCma;
  std::vector<Seg> wire(p.segs);
  if (!cma)
    for (Seg& s : wire) s.addr = 0;  // the target needs our addresses only to attach
  std::vector<iovec> payload;
  if (p.op == kWrite && !cma) {
    h.payload_len = p.bytes;
    payload.reserve(p.segs.size());
    for (const Seg& s : p.segs) payload.push_back({reinterpret_cast<void*>(s.addr), s.len});
    if (p.local_loc != 1) {  // device memory: copy the blocks into one host buffer first
      const CopierRef copier = eng_->device_copier();
      uint8_t* buf = tx_stage_.get(copier, p.bytes);  // under send_mu_, as every send_part
      int rc = buf ? stage_out(copier.c, payload, p.local_device, buf) : -1;
      if (rc != 0) {
        if (PartPtr mine = take(id))
          mine->xfer->part_done(ERR_GPU_OP, buf ? "copying local device memory to host failed (code " +
                                                      std::to_string(rc) + ")"
                                                : "no host staging buffer of " + std::to_string(p.bytes) +
                                                      " bytes for local device memory");
        return true;
      }
      eng_->staged_bytes.fetch_add(int64_t(p.bytes));
      payload.assign(1, iovec{buf, p.bytes});
    }
  }
  bool would_block = false;
  std::string err =
      send_msg(fd_.get(), h, wire.data(), &payload, &last_progress_, nonblocking_start ? &would_block : nullptr);
  if (!err.empty()) fail("send failed: " + err);
  return !would_block;
}

void Conn::tx_loop() {
  for (;;) {
    std::pair<uint64_t, PartPtr> item;
    {
      std::unique_lock<std::mutex> g(qmu_);
      qcv_.wait(g, [this] { return stop_ || broken_ || !q_.empty(); });
      if (stop_ || broken_) {
        q_.clear();
        return;
      }
      item = std::move(q_.front());
      q_.pop_front();
    }
    std::lock_guard<std::mutex> s(send_mu_);
    if (broken_) continue;
    send_part(item.first, *item.second);
  }
}

PartPtr Conn::take(uint64_t id) {
  std::lock_guard<std::mutex> g(pmu_);
  auto it = pending_.find(id);
  if (it == pending_.end()) return nullptr;
  PartPtr p = it->second;
  pending_.erase(it);
  return p;
}

void Conn::rx_loop() {
  Header h;
  std::vector<uint8_t> body;
  int64_t timeout = eng_->cp_timeout_ms();
  while (!broken_) {
    int r = wait_readable(fd_.get(), 100);
    if (r < 0 && errno != EINTR) {
      fail("poll failed: " + errno_text(errno));
      return;
    }
    if (r <= 0) {
      bool waiting;
      {
        std::lock_guard<std::mutex> g(pmu_);
        waiting = !pending_.empty();
      }
      if (!waiting) last_progress_.store(now_ms());
      if (waiting && now_ms() - last_progress_.load() > timeout) {
        fail("no answer within MORI_IO_CP_TIMEOUT_MS=" + std::to_string(timeout) + " ms");
        return;
      }
      continue;
    }
    std::string err = recv_msg(fd_.get(), &h, &body);
    if (!err.empty()) {
      fail(err);
      return;
    }
    last_progress_.store(now_ms());
    last_used_.store(now_ms(), std::memory_order_relaxed);
    if (h.type != kAck && h.type != kReadData && h.type != kAtomicAck) {
      fail("unexpected message type " + std::to_string(h.type));
      return;
    }
    PartPtr p = take(h.req_id);
    if (!p) {
      fail("answer to an unknown request");
      return;
    }
    if ((h.type == kAtomicAck) != (p->op == kAtomic)) {
      p->xfer->part_done(ERR_BAD_STATE, "answer does not match the request");
      fail("answer does not match the request");
      return;
    }
    if (h.type == kAtomicAck) {
      int code = h.status;
      if (code != SUCCESS && (code < ERR_INVALID_ARGS || code > ERR_GPU_OP)) code = ERR_BAD_STATE;
      if (code == SUCCESS && p->xfer->result) *p->xfer->result = h.mem_id;
      p->xfer->part_done(code, std::string(body.begin(), body.end()));
      continue;
    }
    std::string text(body.begin(), body.end());
    if (h.type == kReadData && h.status == SUCCESS) {
      if (p->op != kRead || h.payload_len != p->bytes) {
        p->xfer->part_done(ERR_BAD_STATE, "read answer does not match the request");
        fail("read answer does not match the request");
        return;
      }
      std::vector<iovec> iov;
      iov.reserve(p->segs.size());
      for (const Seg& s : p->segs) iov.push_back({reinterpret_cast<void*>(s.addr), s.len});
      CopierRef copier;
      uint8_t* buf = nullptr;
      if (p->local_loc == 1) {
        err = recv_iov(fd_.get(), iov, &last_progress_);
      } else {
        copier = eng_->device_copier();
        buf = rx_stage_.get(copier, p->bytes);  // this thread's own
        if (buf) {
          std::vector<iovec> host{{buf, p->bytes}};
          err = recv_iov(fd_.get(), host, &last_progress_);
        } else {
          err = drain(fd_.get(), p->bytes);
        }
      }
      if (!err.empty()) {
        p->xfer->part_done(ERR_BAD_STATE, "receiving read data: " + err);
        fail("receiving read data: " + err);
        return;
      }
      int rc = p->local_loc == 1 ? 0 : buf ? stage_in(copier.c, iov, p->local_device, buf) : -1;
      if (p->local_loc != 1) eng_->staged_bytes.fetch_add(int64_t(p->bytes));
      p->xfer->part_done(rc == 0 ? SUCCESS : ERR_GPU_OP,
                         rc == 0   ? ""
                         : buf     ? "copying read data to local device memory failed (code " + std::to_string(rc) + ")"
                                   : "no host staging buffer of " + std::to_string(p->bytes) + " bytes for read data");
    } else if (h.type == kAck && h.status == kCmaUnavailable) {
      // Failover: the target cannot attach to us; the same part goes over the socket.
      peer_->cma_ok = false;
      eng_->failovers.fetch_add(1);
      MORI_IO_LOG(20, "peer '%s': cross-memory attach refused (%s); using the socket", peer_->key.c_str(),
                  text.c_str());
      p->flags &= ~kFlagCma;
      std::lock_guard<std::mutex> q(qmu_);
      q_.emplace_back(eng_->next_req_id(), p);
      {
        std::lock_guard<std::mutex> g(pmu_);
        if (broken_) {
          q_.pop_back();
          p->xfer->part_done(ERR_BAD_STATE, why_);
          continue;
        }
        pending_.emplace(q_.back().first, p);
      }
      qcv_.notify_one();
    } else {
      if (h.status == SUCCESS && h.type == kAck && p->op == kRead && !(p->flags & kFlagCma)) {
        p->xfer->part_done(ERR_BAD_STATE, "protocol error: read answered without data");
        continue;
      }
      int code = h.status;
      if (code != SUCCESS && (code < ERR_INVALID_ARGS || code > ERR_GPU_OP)) code = ERR_BAD_STATE;
      p->xfer->part_done(code, text);
    }
  }
}

}  // namespace mori::transfer

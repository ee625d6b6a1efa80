// The initiator's connections: Transfer (a transfer's bookkeeping, shared by its parts) and Conn
// (one outbound connection to a peer, with its sender and receiver threads). See engine.hpp.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine.hpp"

namespace mori::transfer {

// The initiator's bookkeeping of one transfer, shared by its parts; holds the local region pinned.
struct Transfer {
  Engine* eng = nullptr;
  StatusPtr st;
  RegionPtr local;
  std::shared_ptr<uint64_t> result;  // an atomic's old value, set before its part completes
  std::atomic<uint32_t> remaining{0};
  std::mutex mu;
  int fail_code = SUCCESS;
  std::string fail_msg;

  ~Transfer() {
    if (local) eng->unpin(local);
  }
  void part_done(int code, const std::string& msg) {
    if (code != SUCCESS) {
      std::lock_guard<std::mutex> g(mu);
      if (fail_code == SUCCESS) {
        fail_code = code;
        fail_msg = msg;
      }
    }
    if (remaining.fetch_sub(1) == 1) {
      std::lock_guard<std::mutex> g(mu);
      st->complete(fail_code, fail_msg);
    }
  }
};

// Conn: one outbound connection to a peer.
class Conn : public std::enable_shared_from_this<Conn> {
 public:
  Conn(Engine* eng, Peer* peer, Fd fd);
  ~Conn() { close(); }
  int fd() const { return fd_.get(); }

  // Starts the two threads; false (with the reason) if the system would not create them.
  bool start(std::string* why);
  bool broken() const { return broken_.load(); }
  // No request in flight or queued, and nothing carried for more than `ms` before `now`.
  bool idle_for(int64_t now, int64_t ms);

  void submit(const PartPtr& p);

  // A one-way kNotify (the direct path's doorbell, with records that found the ring full): queued
  // for the sender thread, never sent from the caller, never answered.
  void oneway(std::vector<uint8_t> body, uint16_t op = kNotify);

  void fail(std::string why);

  void close();

 private:
  // Returns false only with nonblocking_start when nothing could be sent without waiting.
  bool send_part(uint64_t id, const Part& p, bool nonblocking_start = false);

  void tx_loop();

  PartPtr take(uint64_t id);

  void rx_loop();

  Engine* eng_;
  Peer* peer_;
  Fd fd_;
  std::thread tx_, rx_;
  std::mutex send_mu_;
  StageBuffer tx_stage_;  // GPU data to send (under send_mu_)
  StageBuffer rx_stage_;  // GPU read data received (the receiver thread's)
  std::mutex qmu_;
  std::condition_variable qcv_;
  std::deque<std::pair<uint64_t, PartPtr>> q_;
  std::mutex pmu_;
  std::unordered_map<uint64_t, PartPtr> pending_;
  std::atomic<bool> broken_{false}, stop_{false}, closed_{false};
  std::string why_;
  std::atomic<int64_t> last_progress_{0};
  std::atomic<int64_t> last_used_{0};
};

}  // namespace mori::transfer

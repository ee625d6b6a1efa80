// Status: the state of one transfer as the initiator sees it (engine.hpp).
#include <algorithm>
#include <chrono>
#include <thread>

#include "engine.hpp"
#include "wire.hpp"

namespace mori::transfer {

std::string Status::message() {
  std::lock_guard<std::mutex> g(mu_);
  return msg_;
}

void Status::set_in_progress() {
  int expected = INIT;
  code_.compare_exchange_strong(expected, IN_PROGRESS);
}

bool Status::complete(int code, const std::string& message) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (done()) return false;
    msg_ = message;
    code_.store(code, std::memory_order_release);
  }
  cv_.notify_all();
  return true;
}

bool Status::wait_for(int64_t timeout_ms) {
  if (done()) return true;
  if (waiter_) return waiter_->wait(*this, timeout_ms);
  return wait_plain(timeout_ms);
}

bool Status::wait_plain(int64_t timeout_ms) {
  if (done()) return true;
  if (timeout_ms == 0) return false;
  // A short spin catches small transfers on loopback without a futex sleep.
  for (int i = 0; i < 200; ++i) {
    if (done()) return true;
    std::this_thread::yield();
  }
  std::unique_lock<std::mutex> g(mu_);
  if (timeout_ms < 0) {
    cv_.wait(g, [this] { return done(); });
    return true;
  }
  return cv_.wait_for(g, std::chrono::milliseconds(timeout_ms), [this] { return done(); });
}

int wait_all(const std::vector<StatusPtr>& statuses, int64_t timeout_ms) {
  int64_t deadline = timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
  int first_fail = SUCCESS;
  for (const auto& s : statuses) {
    int64_t left = deadline < 0 ? -1 : std::max<int64_t>(0, deadline - now_ms());
    if (!s->wait_for(left)) return IN_PROGRESS;
    if (s->code() != SUCCESS && first_fail == SUCCESS) first_fail = s->code();
  }
  return first_fail;
}
StatusPtr failed_status(int code, const std::string& message) {
  auto s = std::make_shared<Status>();
  s->complete(code, message);
  return s;
}

std::string block_outside(const char* side, size_t i, uint64_t off, uint64_t size, uint64_t limit) {
  return std::string(side) + " block " + std::to_string(i) + ": offset " + std::to_string(off) + " + size " +
         std::to_string(size) + " is outside the region (" + std::to_string(limit) + " bytes)";
}

}  // namespace mori::transfer

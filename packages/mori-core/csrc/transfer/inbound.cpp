#include "inbound.hpp"

#include <algorithm>

namespace mori::transfer {

void InboundTable::record(const std::string& key, uint64_t uid, uint32_t total, int code, const std::string& msg) {
  auto pit = peers_.find(key);
  if (pit == peers_.end()) pit = peers_.emplace(key, Peer{}).first;
  Peer& p = pit->second;
  auto it = p.by_uid.find(uid);
  if (it == p.by_uid.end()) {
    if (p.by_uid.size() >= std::max<size_t>(1, limits_.per_peer) && evict_oldest(p)) ++dropped_;
    if (live_ >= std::max<size_t>(1, limits_.total)) {
      evict_oldest_anywhere();
      ++dropped_;
      pit = peers_.find(key);  // the eviction may have removed this key's (empty) entry
      if (pit == peers_.end()) pit = peers_.emplace(key, Peer{}).first;
    }
    Peer& q = pit->second;
    Entry e;
    e.seq = ++next_seq_;
    it = q.by_uid.emplace(uid, std::move(e)).first;
    q.order.emplace_back(uid, it->second.seq);
    order_.push_back(Ref{key, uid, it->second.seq});
    ++live_;
    if (order_.size() > 2 * live_ + 1024) compact();
  }
  Entry& e = it->second;
  if (e.final) return;  // already failed for good
  e.total = std::max<uint32_t>(1, total);
  e.seen += 1;
  if (code != 0 && e.code == 0) {
    e.code = code;
    e.msg = msg;
  }
}

void InboundTable::fail_incomplete(const std::string& key, int code, const std::string& why) {
  auto pit = peers_.find(key);
  if (pit == peers_.end()) return;
  for (auto& kv : pit->second.by_uid) {
    Entry& e = kv.second;
    if (e.final || e.seen >= e.total) continue;
    e.final = true;
    if (e.code == 0) {
      e.code = code;
      e.msg = why + " (" + std::to_string(e.seen) + " of " + std::to_string(e.total) + " parts arrived)";
    }
  }
}

std::optional<std::pair<int, std::string>> InboundTable::pop(const std::string& key, uint64_t uid) {
  auto pit = peers_.find(key);
  if (pit == peers_.end()) return std::nullopt;
  auto it = pit->second.by_uid.find(uid);
  if (it == pit->second.by_uid.end() || (!it->second.final && it->second.seen < it->second.total)) return std::nullopt;
  auto out = std::make_pair(it->second.code, std::move(it->second.msg));
  erase(key, pit->second, it);
  return out;
}

void InboundTable::erase(const std::string& key, Peer& p, std::unordered_map<uint64_t, Entry>::iterator it) {
  p.by_uid.erase(it);
  --live_;
  if (p.by_uid.empty()) peers_.erase(key);
  else if (p.order.size() > 2 * p.by_uid.size() + 1024) {
    std::deque<std::pair<uint64_t, uint64_t>> kept;
    for (auto& o : p.order) {
      auto f = p.by_uid.find(o.first);
      if (f != p.by_uid.end() && f->second.seq == o.second) kept.push_back(o);
    }
    p.order.swap(kept);
  }
}

bool InboundTable::evict_oldest(Peer& p) {
  while (!p.order.empty()) {
    auto [uid, seq] = p.order.front();
    p.order.pop_front();
    auto it = p.by_uid.find(uid);
    if (it != p.by_uid.end() && it->second.seq == seq) {
      p.by_uid.erase(it);  // the peer keeps at least the record about to be made: not erased here
      --live_;
      return true;
    }
  }
  return false;
}

void InboundTable::evict_oldest_anywhere() {
  while (!order_.empty()) {
    Ref r = std::move(order_.front());
    order_.pop_front();
    auto pit = peers_.find(r.key);
    if (pit == peers_.end()) continue;
    auto it = pit->second.by_uid.find(r.uid);
    if (it != pit->second.by_uid.end() && it->second.seq == r.seq) {
      erase(r.key, pit->second, it);
      return;
    }
  }
}

void InboundTable::compact() {
  std::deque<Ref> kept;
  for (auto& r : order_) {
    auto pit = peers_.find(r.key);
    if (pit == peers_.end()) continue;
    auto it = pit->second.by_uid.find(r.uid);
    if (it != pit->second.by_uid.end() && it->second.seq == r.seq) kept.push_back(std::move(r));
  }
  order_.swap(kept);
}

}  // namespace mori::transfer

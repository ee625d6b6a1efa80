// The target's table of inbound transfer statuses (pop_inbound_transfer_status), bounded.
//
// A record is made only by the connection that served the bytes (socket path) or by the slot that
// connection holds (direct path), under the key that connection authenticated: no peer can make a
// record in another's name. Records wait to be popped, also after their initiator disconnected
// (the consumer often asks later). Bounds: at most `per_peer` records per initiator key and
// `total` in all; a record beyond either bound evicts the oldest one of that key (or of all), and
// `dropped()` counts every record lost that way. When the last connection of a key closes, its
// incomplete transfers (parts still missing) end as failed: no part can arrive any more.
// Not thread-safe: the engine serialises every call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>

namespace mori::transfer {

struct InboundLimits {
  size_t per_peer = 65536;
  size_t total = 262144;
};

class InboundTable {
 public:
  explicit InboundTable(InboundLimits limits = {}) : limits_(limits) {}

  // One part of transfer (key, uid), which has `total` parts, ended with `code` (`msg` on failure).
  void record(const std::string& key, uint64_t uid, uint32_t total, int code, const std::string& msg);
  // Every incomplete transfer of `key` ends failed with `code` and `why`.
  void fail_incomplete(const std::string& key, int code, const std::string& why);
  // The finished (complete or failed for good) status of (key, uid), removed; nullopt otherwise.
  std::optional<std::pair<int, std::string>> pop(const std::string& key, uint64_t uid);

  size_t size() const { return live_; }
  int64_t dropped() const { return dropped_; }
  const InboundLimits& limits() const { return limits_; }

 private:
  struct Entry {
    uint32_t seen = 0, total = 1;
    int code = 0;
    bool final = false;
    uint64_t seq = 0;
    std::string msg;
  };
  struct Peer {
    std::unordered_map<uint64_t, Entry> by_uid;
    std::deque<std::pair<uint64_t, uint64_t>> order;  // (uid, seq), oldest first; may hold popped ones
  };
  struct Ref {
    std::string key;
    uint64_t uid, seq;
  };
  bool evict_oldest(Peer& p);        // of one key
  void evict_oldest_anywhere();      // of all keys
  void erase(const std::string& key, Peer& p, std::unordered_map<uint64_t, Entry>::iterator it);
  void compact();

  InboundLimits limits_;
  std::unordered_map<std::string, Peer> peers_;
  std::deque<Ref> order_;  // every record, oldest first; may hold popped ones
  size_t live_ = 0;
  uint64_t next_seq_ = 0;
  int64_t dropped_ = 0;
};

}  // namespace mori::transfer

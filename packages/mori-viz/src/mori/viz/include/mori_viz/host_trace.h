// mori_viz/host_trace.h: record spans of native threads into a mori.viz host ring.
//
// Header-only, C++17, no dependencies. A ring is made on the Python side
// (mori.viz.host.HostRecorder.native_ring) and handed to the thread as an address; the thread is
// its only writer:
//
//     mori_viz::HostRing ring(address);                      // address: HostRing.address
//     static const uint16_t kPost = mori_viz::slot_id("io.engine", "post");
//     ring.begin(kPost); ... ring.end(kPost);
//     { mori_viz::Span s(ring, kPost); ... }                  // the same, scoped
//
// A HostRing made from address 0 records nothing, so code can keep its calls when tracing is off.
// Events are (CLOCK_MONOTONIC ns, meta) in the layout of mori/viz/layout.py: the event first,
// then the ring's event count with a release store, so a reader never sees a half-written event
// inside the count.
#ifndef MORI_VIZ_HOST_TRACE_H_
#define MORI_VIZ_HOST_TRACE_H_

#include <cstdint>
#include <cstring>
#include <ctime>

namespace mori_viz {

// layout (mori/viz/layout.py)
constexpr int64_t kMagic = 0x315A495649524F4DLL;  // "MORIVIZ1", little-endian
constexpr int kHeaderWords = 8, kCapacityWord = 3, kRecordingWord = 4, kEventWords = 2;
constexpr int kBegin = 0, kEnd = 1, kInstant = 2, kNext = 3;
constexpr int kSlotShift = 2;
constexpr uint32_t kMaxSlot = (1u << 14) - 1;

// The id of slot `name` of `group`: CRC-32 (zlib's) of "group/name", folded into 1..16383, as
// mori.viz.slots.slot_id computes it.
inline uint16_t slot_id(const char* group, const char* name) {
  uint32_t crc = 0xFFFFFFFFu;
  auto feed = [&crc](const char* s, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      crc ^= static_cast<uint8_t>(s[i]);
      for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
    }
  };
  feed(group, std::strlen(group));
  feed("/", 1);
  feed(name, std::strlen(name));
  crc ^= 0xFFFFFFFFu;
  return static_cast<uint16_t>(crc % kMaxSlot + 1);
}

inline int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

class HostRing {
 public:
  // `address`: HostRing.address of a ring made by mori.viz (one ring, any power-of-two capacity);
  // 0, or memory without the mori.viz header, gives a ring that records nothing.
  explicit HostRing(uintptr_t address) {
    auto* words = reinterpret_cast<int64_t*>(address);
    if (words == nullptr || words[0] != kMagic) return;
    int64_t capacity = words[kCapacityWord];
    if (capacity < 2 || (capacity & (capacity - 1)) != 0) return;
    recording_ = words + kRecordingWord;
    count_ = words + kHeaderWords;                     // ring 0's event count
    events_ = words + kHeaderWords + 2;                // ring 0's events (one ring: 2 table words)
    mask_ = capacity - 1;
    written_ = __atomic_load_n(count_, __ATOMIC_RELAXED);
  }

  // whether this is a ring at all (a ring records only while mori.viz records host spans)
  bool enabled() const { return count_ != nullptr; }
  void begin(uint16_t slot) { record(kBegin, slot); }
  void end(uint16_t slot) { record(kEnd, slot); }
  void instant(uint16_t slot) { record(kInstant, slot); }
  // ends the innermost open span and begins `slot`, with one timestamp
  void next(uint16_t slot) { record(kNext, slot); }

 private:
  void record(int kind, uint16_t slot) {
    if (count_ == nullptr || __atomic_load_n(recording_, __ATOMIC_RELAXED) == 0) return;
    int64_t* e = events_ + (written_ & mask_) * kEventWords;
    e[0] = now_ns();
    e[1] = static_cast<int64_t>(kind | (static_cast<int64_t>(slot & kMaxSlot) << kSlotShift));
    ++written_;
    __atomic_store_n(count_, written_, __ATOMIC_RELEASE);
  }

  const int64_t* recording_ = nullptr;
  int64_t* count_ = nullptr;
  int64_t* events_ = nullptr;
  int64_t mask_ = 0;
  int64_t written_ = 0;
};

// A span for the lifetime of the object.
class Span {
 public:
  Span(HostRing& ring, uint16_t slot) : ring_(ring), slot_(slot) { ring_.begin(slot_); }
  ~Span() { ring_.end(slot_); }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  HostRing& ring_;
  uint16_t slot_;
};

}  // namespace mori_viz

#endif  // MORI_VIZ_HOST_TRACE_H_

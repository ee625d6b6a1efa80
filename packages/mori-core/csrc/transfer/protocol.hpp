// Wire format of the mori-io engine: every message is a fixed 64-byte header, a body of
// `body_len` bytes (segments or text) and, for data-carrying messages, `payload_len` raw bytes.
// The parser here is the only code that interprets bytes from a peer; it rejects anything
// malformed or larger than the limits below before a single byte of memory is touched.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace mori::transfer {

constexpr uint32_t kMagic = 0x4f49524d;  // "MRIO"
constexpr uint16_t kVersion = 2;  // 2: challenge-response handshake, no pid claims
constexpr uint32_t kMaxSegs = 32768;                 // segments in one message
constexpr uint32_t kMaxText = 4096;                  // HELLO strings, error messages
constexpr uint64_t kMaxPayload = uint64_t(1) << 31;  // 2 GiB per message
constexpr uint32_t kMaxParts = 1u << 24;

// The handshake (every connection, before anything else; see engine.hpp):
//   initiator -> target  kHello      strings: initiator key, node id, client nonce, engine instance id
//   target -> initiator  kChallenge  strings: target key, server nonce, target proof (kFlagAuth: a
//                                    proof is required back), or a refusing kHelloAck
//   initiator -> target  kAuth       strings: initiator proof
//   target -> initiator  kHelloAck   status 0, strings: AckParams, Unix socket name, [DirectGrant];
//                                    status != 0: refused, body = reason
// A proof is HMAC-SHA256(secret, transcript) (auth.hpp), empty when the side has no secret.
enum MsgType : uint16_t {
  kHello = 1,
  kHelloAck = 2,
  kWrite = 3,     // segments then payload (or no payload with kFlagCma: target pulls)
  kRead = 4,      // segments; answered by kReadData (payload) or kAck (kFlagCma: target pushed)
  kAck = 5,       // status of a kWrite / CMA kRead; body = error message
  kReadData = 6,  // status + payload of a kRead; body = error message
  kNotify = 7,    // initiator -> target, one way, only on the connection holding a slot: drain my
                  // slot's ring; body = NotifyRecords (table.hpp)
  kChallenge = 8,
  kAuth = 9,
  kAtomic = 10,     // initiator -> target: mem_id, body = AtomicReq; answered by kAtomicAck
  kAtomicAck = 11,  // status; mem_id = the word's value before the operation; body = error message
  kNotice = 12,     // initiator -> target, one way, any authenticated connection: inbound statuses of
                    // transfers whose bytes moved over another path (an RDMA transport); body =
                    // NotifyRecords, credited to the key this connection authenticated
};

enum MsgFlags : uint32_t {
  kFlagCma = 1,     // bytes move by cross-memory attach done by the target, not over the socket
  kFlagNotify = 2,  // target records an inbound status for (initiator key, uid)
  kFlagDirect = 4,  // HELLO: asks for the registration table; HELLO answer: grants it (3rd string,
                    // the table's and the slot's memfds passed with it over the Unix socket)
  kFlagAuth = 8,    // CHALLENGE: the target has a secret and requires the initiator's proof
};
constexpr uint32_t kKnownFlags = kFlagCma | kFlagNotify | kFlagDirect | kFlagAuth;
constexpr uint32_t kNotifyRecordBytes = 16;

#pragma pack(push, 1)
struct Header {
  uint32_t magic;
  uint16_t version;
  uint16_t type;
  uint32_t flags;
  int32_t status;
  uint64_t req_id;
  uint64_t uid;
  uint64_t mem_id;
  uint32_t nsegs;
  uint32_t body_len;
  uint64_t payload_len;
  uint32_t total_parts;  // parts of the transfer `uid` (the target completes its inbound status at the last)
  uint32_t reserved;
};
// One block of a transfer: offset in the target's region, length, and (CMA only) the initiator's address.
struct Seg {
  uint64_t off;
  uint64_t len;
  uint64_t addr;
};
// One remote atomic (body of a kAtomic): the word at `off` in region mem_id, codes as in
// mori/transport.h (op: MORI_TP_OP_*, word: MORI_TP_WORD_*).
struct AtomicReq {
  uint64_t off;
  uint32_t op;
  uint32_t word;
  uint64_t value;
  uint64_t compare;
};

// What the target tells an authenticated initiator (first string of a kHelloAck).
struct AckParams {
  uint64_t idle_timeout_ms;  // the target closes a connection silent this long (0: never)
  uint64_t reserved;
};
#pragma pack(pop)
static_assert(sizeof(Header) == 64, "header is 64 bytes on the wire");
static_assert(sizeof(AckParams) == 16, "ack parameters are 16 bytes on the wire");
static_assert(sizeof(AtomicReq) == 32, "an atomic request is 32 bytes on the wire");
static_assert(sizeof(Seg) == 24, "segment is 24 bytes on the wire");

inline Header make_header(uint16_t type) {
  Header h;
  std::memset(&h, 0, sizeof h);
  h.magic = kMagic;
  h.version = kVersion;
  h.type = type;
  return h;
}

// Checks a header on its own; the body is checked by parse_segments / parse_strings.
// Returns an empty string when valid, else the reason.
inline std::string check_header(const Header& h) {
  if (h.magic != kMagic) return "bad magic";
  if (h.version != kVersion) return "unsupported protocol version " + std::to_string(h.version);
  if (h.flags & ~kKnownFlags) return "unknown flags";
  if (h.reserved != 0) return "reserved field not zero";
  if (h.payload_len > kMaxPayload) return "payload larger than 2 GiB";
  if ((h.flags & kFlagDirect) && h.type != kHello && h.type != kHelloAck) return "direct flag outside HELLO";
  if ((h.flags & kFlagAuth) && h.type != kChallenge) return "auth flag outside CHALLENGE";
  switch (h.type) {
    case kHello:
    case kChallenge:
    case kAuth:
      if (h.status != 0 || h.uid != 0 || h.mem_id != 0 || h.req_id != 0 || h.total_parts != 0)
        return "handshake message with request fields";
      [[fallthrough]];
    case kHelloAck:
    case kAck:
      if (h.nsegs != 0 || h.payload_len != 0) return "control message with segments or payload";
      if (h.body_len > kMaxText) return "text body too long";
      return "";
    case kNotify:
    case kNotice:
      if (h.nsegs != 0 || h.payload_len != 0) return "notification with segments or payload";
      if (h.body_len > kMaxText || h.body_len % kNotifyRecordBytes != 0) return "bad notification body";
      if (h.status != 0) return "notification with a status";
      return "";
    case kReadData:
      if (h.nsegs != 0) return "read data with segments";
      if (h.body_len > kMaxText) return "text body too long";
      if (h.status != 0 && h.payload_len != 0) return "failed read carries payload";
      return "";
    case kAtomic:
      if (h.nsegs != 0 || h.payload_len != 0 || h.status != 0) return "atomic with segments, payload or a status";
      if (h.body_len != sizeof(AtomicReq)) return "bad atomic body";
      if (h.total_parts != 1) return "bad part count";
      return "";
    case kAtomicAck:
      if (h.nsegs != 0 || h.payload_len != 0) return "atomic answer with segments or payload";
      if (h.body_len > kMaxText) return "text body too long";
      return "";
    case kWrite:
    case kRead:
      if (h.nsegs > kMaxSegs) return "too many segments";
      if (uint64_t(h.body_len) != uint64_t(h.nsegs) * sizeof(Seg)) return "body length does not match segments";
      if (h.total_parts == 0 || h.total_parts > kMaxParts) return "bad part count";
      if (h.type == kRead && h.payload_len != 0) return "read request carries payload";
      if ((h.flags & kFlagCma) && h.payload_len != 0) return "CMA request carries payload";
      if (h.status != 0) return "request with a status";
      return "";
    default:
      return "unknown message type " + std::to_string(h.type);
  }
}

// Segments of a kWrite/kRead body; checks sizes add up (no overflow) and match the payload.
inline std::string parse_segments(const Header& h, const uint8_t* body, std::vector<Seg>* out) {
  out->resize(h.nsegs);
  if (h.nsegs) std::memcpy(out->data(), body, size_t(h.nsegs) * sizeof(Seg));
  uint64_t total = 0;
  for (const Seg& s : *out) {
    if (s.len > kMaxPayload || s.off > (uint64_t(1) << 62)) return "segment out of range";
    total += s.len;
    if (total > kMaxPayload) return "segments larger than 2 GiB";
  }
  if (h.type == kWrite && !(h.flags & kFlagCma) && total != h.payload_len)
    return "payload length does not match segments";
  return "";
}

// Length-prefixed strings (u32 length + bytes) that must fill the body exactly.
inline std::string parse_strings(const uint8_t* body, size_t len, size_t count, std::vector<std::string>* out) {
  out->clear();
  size_t pos = 0;
  for (size_t i = 0; i < count; ++i) {
    if (len - pos < 4) return "truncated string length";
    uint32_t n;
    std::memcpy(&n, body + pos, 4);
    pos += 4;
    if (n > len - pos) return "string longer than body";
    out->emplace_back(reinterpret_cast<const char*>(body + pos), n);
    pos += n;
  }
  if (pos != len) return "trailing bytes after strings";
  return "";
}

inline void append_string(std::vector<uint8_t>* body, const std::string& s) {
  uint32_t n = uint32_t(s.size());
  const auto* p = reinterpret_cast<const uint8_t*>(&n);
  body->insert(body->end(), p, p + 4);
  body->insert(body->end(), s.begin(), s.end());
}

}  // namespace mori::transfer

// Peer authentication on a shared secret: HMAC-SHA256 challenge-response, so the secret itself
// never crosses the wire. The hash is OpenSSL's (libcrypto, loaded at run time: the one the Python
// interpreter's hashlib already loaded, else the system's), not code of our own.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace mori::transfer {

constexpr size_t kNonceBytes = 32;
constexpr size_t kMacBytes = 32;
using Mac = std::array<uint8_t, kMacBytes>;

// Whether HMAC-SHA256 can be computed here; if not, *why says what is missing.
bool auth_available(std::string* why);

// HMAC-SHA256(key, msg). Call only after auth_available() returned true.
Mac hmac_sha256(const std::string& key, const std::string& msg);

// n bytes from the kernel's CSPRNG (getrandom); throws std::runtime_error if it fails.
void random_bytes(void* out, size_t n);
std::string random_string(size_t n);

// Constant-time comparison of two byte strings (lengths are not secret).
bool equal_ct(const std::string& a, const std::string& b);

// What each side signs in the handshake: a label naming the side, then every field of the
// exchange, each length-prefixed, so no two different exchanges sign the same bytes and a proof
// made for one direction is never valid for the other.
std::string transcript(const char* side, const std::string& client_nonce, const std::string& server_nonce,
                       const std::string& initiator_key, const std::string& target_key, const std::string& instance);

}  // namespace mori::transfer

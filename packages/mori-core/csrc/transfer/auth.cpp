#include "auth.hpp"

#include <dlfcn.h>
#include <sys/random.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <stdexcept>

namespace mori::transfer {

namespace {

// The two OpenSSL functions used, with the signatures OpenSSL 1.1 and 3.x share.
using EvpMdFn = const void* (*)();
using HmacFn = unsigned char* (*)(const void* md, const void* key, int key_len, const unsigned char* d, size_t n,
                                  unsigned char* out, unsigned int* out_len);

struct Crypto {
  EvpMdFn sha256 = nullptr;
  HmacFn hmac = nullptr;
  std::string why;  // empty when loaded
};

const Crypto& crypto() {
  static Crypto c;
  static std::once_flag once;
  std::call_once(once, [] {
    // RTLD_NOLOAD first: the libcrypto this process already uses (Python's hashlib), whatever
    // its path; then the system's by soname.
    const char* names[] = {"libcrypto.so.3", "libcrypto.so.1.1", "libcrypto.so"};
    void* h = nullptr;
    for (int noload = 1; noload >= 0 && !h; --noload)
      for (const char* n : names)
        if ((h = ::dlopen(n, RTLD_NOW | RTLD_LOCAL | (noload ? RTLD_NOLOAD : 0)))) break;
    if (!h) {
      const char* e = ::dlerror();
      c.why = std::string("OpenSSL's libcrypto (libcrypto.so.3 or .so.1.1) cannot be loaded: ") + (e ? e : "not found");
      return;
    }
    c.sha256 = reinterpret_cast<EvpMdFn>(::dlsym(h, "EVP_sha256"));
    c.hmac = reinterpret_cast<HmacFn>(::dlsym(h, "HMAC"));
    if (!c.sha256 || !c.hmac) c.why = "the loaded libcrypto has no EVP_sha256/HMAC";
  });
  return c;
}

void append_field(std::string* out, const std::string& s) {
  const uint32_t n = uint32_t(s.size());
  out->append(reinterpret_cast<const char*>(&n), 4);
  out->append(s);
}

}  // namespace

bool auth_available(std::string* why) {
  const Crypto& c = crypto();
  if (why) *why = c.why;
  return c.why.empty();
}

Mac hmac_sha256(const std::string& key, const std::string& msg) {
  const Crypto& c = crypto();
  if (!c.why.empty()) throw std::runtime_error(c.why);
  Mac out{};
  unsigned int len = 0;
  if (!c.hmac(c.sha256(), key.data(), int(key.size()), reinterpret_cast<const unsigned char*>(msg.data()), msg.size(),
              out.data(), &len) ||
      len != kMacBytes)
    throw std::runtime_error("HMAC-SHA256 failed in libcrypto");
  return out;
}

void random_bytes(void* out, size_t n) {
  auto* p = static_cast<uint8_t*>(out);
  while (n > 0) {
    ssize_t r = ::getrandom(p, n, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error(std::string("getrandom failed: ") + std::strerror(errno));
    }
    p += r;
    n -= size_t(r);
  }
}

std::string random_string(size_t n) {
  std::string s(n, '\0');
  random_bytes(s.data(), n);
  return s;
}

bool equal_ct(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char d = 0;
  for (size_t i = 0; i < a.size(); ++i) d |= static_cast<unsigned char>(a[i] ^ b[i]);
  return d == 0;
}

std::string transcript(const char* side, const std::string& client_nonce, const std::string& server_nonce,
                       const std::string& initiator_key, const std::string& target_key, const std::string& instance) {
  std::string t = "mori-io handshake v2 ";
  t += side;
  for (const std::string* f : {&client_nonce, &server_nonce, &initiator_key, &target_key, &instance}) append_field(&t, *f);
  return t;
}

}  // namespace mori::transfer

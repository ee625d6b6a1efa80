// The `key=value;...` options of the ucx transport (documented in backends/ucx/README.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace mori_ucx {

struct Options {
  std::string tls;          // UCX_TLS; "" = the environment's UCX_TLS, else UCX's own default
  std::string net_devices;  // UCX_NET_DEVICES; "" = the environment's, else "lo" (see README)
  bool progress_thread = true;
  int64_t connect_timeout_ms = 30000;
  size_t max_requests = 65536;  // pending + completed-but-untested requests of one instance
  size_t max_endpoints = 4096;
  int64_t keepalive_ms = -1;  // UCX_KEEPALIVE_INTERVAL; < 0 = the environment's, else UCX's
  bool peer_error_mode = false;  // error_handling=peer: UCP_ERR_HANDLING_MODE_PEER (see README)
  std::vector<std::pair<std::string, std::string>> ucx;  // UCX_NAME=value, applied as given

  static constexpr size_t kMaxRequestsLimit = size_t{1} << 24;
  static constexpr size_t kMaxEndpointsLimit = size_t{1} << 20;
};

// Parse `text`; on failure returns false with a message naming the key, the value and what is allowed.
bool parse_options(const char* text, Options& out, std::string& error);

// The known keys, for messages: "tls, net_devices, ...".
const char* known_option_keys();

}  // namespace mori_ucx

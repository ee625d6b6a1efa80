#include "options.hpp"

#include <cerrno>
#include <cstdlib>
#include <set>

namespace mori_ucx {

namespace {

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\n");
  if (b == std::string::npos) return "";
  size_t e = s.find_last_not_of(" \t\n");
  return s.substr(b, e - b + 1);
}

bool parse_int(const std::string& key, const std::string& v, int64_t lo, int64_t hi, int64_t& out,
               std::string& error) {
  errno = 0;
  char* end = nullptr;
  long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || errno == ERANGE || x < lo || x > hi) {
    error = "option " + key + "='" + v + "': expected an integer from " + std::to_string(lo) + " to " +
            std::to_string(hi);
    return false;
  }
  out = x;
  return true;
}

bool parse_bool(const std::string& key, const std::string& v, bool& out, std::string& error) {
  if (v == "1" || v == "yes" || v == "true" || v == "on") {
    out = true;
  } else if (v == "0" || v == "no" || v == "false" || v == "off") {
    out = false;
  } else {
    error = "option " + key + "='" + v + "': expected 1/0, yes/no, true/false or on/off";
    return false;
  }
  return true;
}

// UCX's own settings pass through by their environment names; these are set from the keys above
// or by the transport itself, so they may not be given twice.
const std::set<std::string> kReserved = {"UCX_TLS", "UCX_NET_DEVICES", "UCX_KEEPALIVE_INTERVAL", "UCX_ATOMIC_MODE"};

}  // namespace

const char* known_option_keys() {
  return "tls, net_devices, progress_thread, connect_timeout_ms, max_requests, max_endpoints, keepalive_ms, "
         "error_handling, "
         "and UCX settings as UCX_NAME=value";
}

bool parse_options(const char* text, Options& out, std::string& error) {
  std::string s = text ? text : "";
  std::set<std::string> seen;
  size_t pos = 0;
  while (pos <= s.size()) {
    size_t semi = s.find(';', pos);
    std::string item = trim(s.substr(pos, semi == std::string::npos ? std::string::npos : semi - pos));
    pos = semi == std::string::npos ? s.size() + 1 : semi + 1;
    if (item.empty()) continue;
    size_t eq = item.find('=');
    if (eq == std::string::npos) {
      error = "option '" + item + "' has no value: options are key=value pairs separated by ';'";
      return false;
    }
    std::string key = trim(item.substr(0, eq)), value = trim(item.substr(eq + 1));
    if (key.empty()) {
      error = "option '" + item + "' has no key: options are key=value pairs separated by ';'";
      return false;
    }
    if (!seen.insert(key).second) {
      error = "option " + key + " is given twice";
      return false;
    }
    int64_t n = 0;
    if (key == "tls" || key == "net_devices") {
      if (value.empty()) {
        error = "option " + key + "='': expected a comma-separated list (UCX_" +
                std::string(key == "tls" ? "TLS" : "NET_DEVICES") + " syntax)";
        return false;
      }
      (key == "tls" ? out.tls : out.net_devices) = value;
    } else if (key == "progress_thread") {
      if (!parse_bool(key, value, out.progress_thread, error)) return false;
    } else if (key == "connect_timeout_ms") {
      if (!parse_int(key, value, 1, 3600 * 1000, n, error)) return false;
      out.connect_timeout_ms = n;
    } else if (key == "max_requests") {
      if (!parse_int(key, value, 1, static_cast<int64_t>(Options::kMaxRequestsLimit), n, error)) return false;
      out.max_requests = static_cast<size_t>(n);
    } else if (key == "max_endpoints") {
      if (!parse_int(key, value, 1, static_cast<int64_t>(Options::kMaxEndpointsLimit), n, error)) return false;
      out.max_endpoints = static_cast<size_t>(n);
    } else if (key == "error_handling") {
      if (value != "none" && value != "peer") {
        error = "option error_handling='" + value + "': expected none or peer";
        return false;
      }
      out.peer_error_mode = value == "peer";
    } else if (key == "keepalive_ms") {
      if (!parse_int(key, value, 1, 3600 * 1000, n, error)) return false;
      out.keepalive_ms = n;
    } else if (key.rfind("UCX_", 0) == 0 && key.size() > 4) {
      if (kReserved.count(key)) {
        error = "option " + key + " is set by the transport's own option or by the transport itself; use " +
                (key == "UCX_TLS" ? std::string("tls") : key == "UCX_NET_DEVICES" ? std::string("net_devices")
                 : key == "UCX_KEEPALIVE_INTERVAL" ? std::string("keepalive_ms") : std::string("nothing (fixed to cpu)"));
        return false;
      }
      out.ucx.emplace_back(key.substr(4), value);
    } else {
      error = "unknown option '" + key + "' (known: " + known_option_keys() + ")";
      return false;
    }
  }
  return true;
}

}  // namespace mori_ucx

// Test-only hooks, compiled in only with the CMake option MORI_TEST_HOOKS (test builds: `nox -s
// tests`; the wheels users get do not have them). They live in the submodule
// mori.core._core._testing, which mori.core.test_hooks wraps: the wire parser for the fuzz tests,
// a copier that treats "device" addresses as host memory, the engine's test modes (engine.hpp:
// TestModes) and the copy threads' CPU move.
#ifndef MORI_TEST_HOOKS
#error "test_hooks.cpp is compiled only into test builds (-DMORI_TEST_HOOKS=ON)"
#endif

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <string>
#include <vector>

#include "../registry.hpp"
#include "engine.hpp"
#include "protocol.hpp"
#include "sched.hpp"
#include "wire.hpp"

namespace py = pybind11;
using namespace mori::transfer;

namespace {

// Parses one complete message (header, body, payload) with the engine's own parser; raises
// ValueError naming the defect. Exposed for the fuzz test: any input either parses or raises.
py::dict parse_message(py::bytes data) {
  std::string buf = data;
  if (buf.size() < sizeof(Header)) throw py::value_error("message shorter than the 64-byte header");
  Header h;
  std::memcpy(&h, buf.data(), sizeof h);
  std::string err = check_header(h);
  if (!err.empty()) throw py::value_error("malformed message: " + err);
  if (buf.size() != sizeof h + h.body_len + h.payload_len)
    throw py::value_error("message length does not match header");
  const auto* body = reinterpret_cast<const uint8_t*>(buf.data() + sizeof h);
  py::dict out;
  out["type"] = h.type;
  out["flags"] = h.flags;
  out["status"] = h.status;
  out["req_id"] = h.req_id;
  out["uid"] = h.uid;
  out["mem_id"] = h.mem_id;
  out["total_parts"] = h.total_parts;
  out["payload_len"] = h.payload_len;
  if (h.type == kWrite || h.type == kRead) {
    std::vector<Seg> segs;
    err = parse_segments(h, body, &segs);
    if (!err.empty()) throw py::value_error("malformed message: " + err);
    py::list l;
    for (const Seg& s : segs) l.append(py::make_tuple(s.off, s.len, s.addr));
    out["segments"] = l;
  } else if (h.type == kHello || h.type == kHelloAck || h.type == kChallenge || h.type == kAuth) {
    std::vector<std::string> strs;
    if (h.status == 0) {
      const size_t count = h.type == kHello       ? 4
                           : h.type == kChallenge ? 3
                           : h.type == kAuth      ? 1
                                                  : (h.flags & kFlagDirect) ? 3 : 2;
      err = parse_strings(body, h.body_len, count, &strs);
      if (!err.empty()) throw py::value_error("malformed message: " + err);
    }
    py::list l;
    for (auto& s : strs) l.append(py::bytes(s));
    out["strings"] = l;
  } else if (h.type == kNotify) {
    py::list l;
    for (uint32_t off = 0; off < h.body_len; off += kNotifyRecordBytes) {
      NotifyRecord r;
      std::memcpy(&r, body + off, sizeof r);
      l.append(py::make_tuple(r.uid, r.code, r.total_parts));
    }
    out["records"] = l;
  } else {
    out["text"] = py::bytes(reinterpret_cast<const char*>(body), h.body_len);
  }
  return out;
}

// Test copier: "device memory" is host memory, copied with memcpy; ctx != nullptr makes every
// copy fail, to exercise ERR_GPU_OP.
int test_to_host(void* ctx, void* dst, uintptr_t src, uint64_t n, int) {
  if (ctx) return 1;
  std::memcpy(dst, reinterpret_cast<const void*>(src), n);
  return 0;
}
int test_from_host(void* ctx, uintptr_t dst, const void* src, uint64_t n, int) {
  if (ctx) return 1;
  std::memcpy(reinterpret_cast<void*>(dst), src, n);
  return 0;
}
int g_fail_marker = 0;

}  // namespace

namespace mori {

void register_test_hooks(py::module_& m) {
  py::module_ t = m.def_submodule("_testing", "Test-only hooks of the native extension (a test build: MORI_TEST_HOOKS).");
  t.def("parse_message", &parse_message, py::arg("data"),
        "Parse one complete wire message of the TCP engine; raises ValueError when malformed.");
  t.def("move_off_cpu", &move_off_cpu, py::arg("tid"), py::arg("cpu"),
        "Move thread `tid` (0: the calling one) off CPU `cpu`, its affinity mask left as it was; False when "
        "that is the only CPU it may run on.");
  t.def(
      "install_copier",
      [](Engine& e, bool fail) {
        e.set_device_copier(DeviceCopier{&test_to_host, &test_from_host, fail ? &g_fail_marker : nullptr});
      },
      py::arg("engine"), py::arg("fail") = false,
      "A copier that treats 'device' addresses as host memory (fail=True: every copy fails).");
  t.def(
      "refuse_cma", [](Engine& e, bool on) { e.test.refuse_cma = on; }, py::arg("engine"), py::arg("on"),
      "As a target, refuse cross-memory attach (and grant no table) so initiators fail over to the socket.");
  t.def(
      "refuse_direct", [](Engine& e, bool on) { e.test.refuse_direct = on; }, py::arg("engine"), py::arg("on"),
      "As an initiator, fail the direct path's probe as if the OS refused attach (applies to connections "
      "opened afterwards).");
  t.def(
      "direct_delay_ms", [](Engine& e, int64_t ms) { e.test.direct_delay_ms = ms; }, py::arg("engine"),
      py::arg("ms"), "As an initiator, sleep this long inside each direct copy, after its bounds check.");
}

}  // namespace mori

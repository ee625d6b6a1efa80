// mori_backend_ucx._native: the ucx transport's ops table as a PyCapsule ("mori.transport.v1"),
// and the few private helpers its Python side needs to load UCX and describe it (plus the
// benchmark's inner loops, bench.cpp). No UCX API is bound to Python: everything else goes
// through the contract (mori.core.transport).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "options.hpp"
#include "transport.hpp"
#include "ucx_api.hpp"

namespace py = pybind11;

void register_bench(py::module_& m);  // bench.cpp

namespace {

std::mutex g_caps_mu;
bool g_caps_done = false;
std::string g_caps_error;

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "The ucx transport's native side (private to mori_backend_ucx).";

  m.def(
      "load",
      [](const std::vector<std::string>& libraries) {
        py::gil_scoped_release nogil;
        return mori_ucx::load(libraries);
      },
      py::arg("libraries"), "dlopen UCX (files in order, or one soname); '' on success, else why not.");

  m.def(
      "version",
      []() -> std::optional<std::tuple<unsigned, unsigned, unsigned, std::string, std::string>> {
        const mori_ucx::UcxApi* a = mori_ucx::api();
        if (!a) return std::nullopt;
        return std::make_tuple(a->major, a->minor, a->release, a->libucp_path, a->libucs_path);
      },
      "(major, minor, release, libucp path, libucs path) of the loaded UCX, or None.");

  m.def(
      "ops",
      []() {
        {
          std::lock_guard<std::mutex> lock(g_caps_mu);
          if (!g_caps_done) {
            py::gil_scoped_release nogil;
            g_caps_error = mori_ucx::init_caps();
            g_caps_done = g_caps_error.empty();
          }
          if (!g_caps_done) throw std::runtime_error(g_caps_error);
        }
        return py::capsule(static_cast<const void*>(mori_ucx::ops_table()), MORI_TRANSPORT_CAPSULE);
      },
      "The ops table (a PyCapsule named 'mori.transport.v1'); UCX must be loaded.");

  m.def(
      "describe",
      [](const std::string& options) {
        std::string error, text;
        {
          py::gil_scoped_release nogil;
          text = mori_ucx::describe(options.c_str(), error);
        }
        return std::make_tuple(text, error);
      },
      py::arg("options") = "", "(ucp_context_print_info text + memory types + thread mode, error).");

  m.def("option_keys", [] { return std::string(mori_ucx::known_option_keys()); });
  register_bench(m);
  m.attr("ABI") = MORI_TRANSPORT_ABI;
  m.attr("UCX_HEADERS") = std::to_string(UCP_API_MAJOR) + "." + std::to_string(UCP_API_MINOR);
}

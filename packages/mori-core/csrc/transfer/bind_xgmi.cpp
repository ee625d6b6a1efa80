// Bindings of the XGMI backend's data path (mori.core.transfer.XgmiQueue, XgmiToken,
// XgmiSessionPost): peer copies between GPU memories of one node on the device plugins' driver
// functions. Every call that can wait releases the GIL, and so does the queue's destruction.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "../registry.hpp"
#include "bind_util.hpp"
#include "xgmi_queue.hpp"

namespace py = pybind11;
using namespace mori::transfer;
using namespace mori::transfer::bind;

namespace {

// The fixed half of an IOEngineSession's posts on the XGMI route: both regions' addresses and
// sizes and their tokens; the caller's current stream comes from `stream_of(device)` per post
// (torch's current stream). TypeError as SessionPost.
struct XgmiSessionPost {
  std::shared_ptr<XgmiQueue> q;
  uint64_t lbase, lsize, rbase, rsize;
  bool kernel_ok;
  GpuTokenPtr local, remote;
  std::string peer;
  py::object stream_of;
  int device;

  void* stream() { return reinterpret_cast<void*>(stream_of(device).cast<uintptr_t>()); }
  StatusPtr many(uint16_t op, py::handle lo, py::handle ro, py::handle sz, py::handle uid) {
    const uint64_t u = u64_of(uid.ptr());
    void* s = stream();
    return with_lists(lo, ro, sz, [&](const U64s& l, const U64s& r, const U64s& n) {
      return q->post(op == kWrite, lbase, lsize, rbase, rsize, l, r, n, u, s, kernel_ok, local, remote, peer);
    });
  }
  StatusPtr one(uint16_t op, py::handle lo, py::handle ro, py::handle sz, py::handle uid) {
    const uint64_t l = u64_of(lo.ptr()), r = u64_of(ro.ptr()), n = u64_of(sz.ptr()), u = u64_of(uid.ptr());
    void* s = stream();
    py::gil_scoped_release nogil;
    return q->post(op == kWrite, lbase, lsize, rbase, rsize, {l}, {r}, {n}, u, s, kernel_ok, local, remote, peer);
  }
};

}  // namespace

namespace mori {

void register_xgmi_queue(py::module_& m) {
  py::class_<GpuToken, GpuTokenPtr>(m, "XgmiToken", "A region's validity for XgmiQueue (retire() ends it).")
      .def_property_readonly("valid", [](const GpuToken& t) { return t.valid.load(); });

  py::class_<XgmiQueue, std::shared_ptr<XgmiQueue>>(
      m, "XgmiQueue",
      "The XGMI backend's data path: checks, plans and queues copies and scatter-gather kernel launches with "
      "the GPU driver's functions, completes statuses from GPU events (csrc/xgmi_queue.hpp).")
      .def(py::init([](const py::dict& calls, uint64_t context, const std::vector<uintptr_t>& streams,
                       const std::vector<std::tuple<uintptr_t, uint64_t, uint64_t, uintptr_t>>& tables, int num_events,
                       uint64_t threshold, int64_t timeout_ms) {
             XgmiConfig c;
             c.calls = gpu_calls(calls);
             c.context = context;
             for (auto s : streams) c.streams.push_back(reinterpret_cast<void*>(s));
             for (auto& [host, device, entries, event] : tables)
               c.tables.push_back(GpuTable{reinterpret_cast<int64_t*>(host), device, entries,
                                           reinterpret_cast<void*>(event), true});
             c.num_events = num_events;
             c.threshold = threshold;
             c.timeout_ms = timeout_ms;
             // destroyed without the GIL: the destructor waits for the completion thread, which
             // may call the driver (a test's fake driver is Python)
             std::shared_ptr<XgmiQueue> q(new XgmiQueue(std::move(c)), DeleteWithoutGil{});
             py::gil_scoped_release nogil;
             q->start();
             return q;
           }),
           py::arg("calls"), py::arg("context"), py::arg("streams"), py::arg("tables"), py::arg("num_events"),
           py::arg("threshold"), py::arg("timeout_ms"),
           "calls: driver function addresses and conventions (mori.core.gpu.driver.CtypesDriver.native_calls); "
           "context: the GPU's context (CUDA) or ordinal (HIP); streams: copy streams; tables: (host, device, "
           "entries, event) of pinned descriptor tables. Raises RuntimeError naming a failed driver call.")
      .def(
          "set_kernel",
          [](XgmiQueue& q, int word, uintptr_t function, unsigned threads, unsigned shared, uint64_t trace) {
            q.set_kernel(word, GpuKernel{reinterpret_cast<void*>(function), threads, shared, trace});
          },
          py::arg("word"), py::arg("function"), py::arg("threads"), py::arg("shared"), py::arg("trace") = 0,
          "The loaded scatter-gather kernel for one word width (its driver function handle, threads per "
          "program, dynamic shared memory), replacing the one set before for launches posted from now on. "
          "trace: 0 for the untraced variant; else the device address of the mori.viz trace buffer that "
          "this (traced) variant records into, passed as its trace_ptr argument (the caller keeps the "
          "buffer alive while launches may run).")
      .def("has_kernel", &XgmiQueue::has_kernel, py::arg("word"))
      .def_property("threshold", &XgmiQueue::threshold, &XgmiQueue::set_threshold,
                    "Blocks of a batch from which it goes through the kernel (0: never).")
      .def("token", [](XgmiQueue&) { return std::make_shared<GpuToken>(); }, "A new region token.")
      .def("retire", &XgmiQueue::retire, py::arg("token"), py::arg("timeout_ms") = -1,
           py::call_guard<py::gil_scoped_release>(),
           "Invalidate the token, then wait until no transfer using it is pending; False on timeout.")
      .def(
          "post",
          [](const std::shared_ptr<XgmiQueue>& q, const std::string& op, uint64_t lbase, uint64_t lsize, uint64_t rbase,
             uint64_t rsize, py::handle lo, py::handle ro, py::handle sz, py::handle uid, uintptr_t stream,
             bool kernel_ok, const GpuTokenPtr& local, const GpuTokenPtr& remote, const std::string& peer) {
            const bool write = op_code(op) == kWrite;
            const uint64_t u = u64_of(uid.ptr());
            return with_lists(lo, ro, sz, [&](const U64s& l, const U64s& r, const U64s& n) {
              return q->post(write, lbase, lsize, rbase, rsize, l, r, n, u, reinterpret_cast<void*>(stream), kernel_ok,
                             local, remote, peer);
            });
          },
          py::arg("op"), py::arg("local_base"), py::arg("local_size"), py::arg("remote_base"), py::arg("remote_size"),
          py::arg("local_offsets"), py::arg("remote_offsets"), py::arg("sizes"), py::arg("uid"), py::arg("stream"),
          py::arg("kernel_ok"), py::arg("local_token"), py::arg("remote_token"), py::arg("peer"),
          "Start one transfer; returns its TransferStatus (failed at once on a block outside a region). "
          "TypeError unless the offsets and sizes are lists or tuples of non-negative ints.")
      .def(
          "session",
          [](const std::shared_ptr<XgmiQueue>& q, uint64_t lbase, uint64_t lsize, uint64_t rbase, uint64_t rsize,
             bool kernel_ok, const GpuTokenPtr& local, const GpuTokenPtr& remote, const std::string& peer,
             py::object stream_of, int device) {
            return XgmiSessionPost{q, lbase, lsize, rbase, rsize, kernel_ok, local, remote, peer, std::move(stream_of),
                                   device};
          },
          py::arg("local_base"), py::arg("local_size"), py::arg("remote_base"), py::arg("remote_size"),
          py::arg("kernel_ok"), py::arg("local_token"), py::arg("remote_token"), py::arg("peer"), py::arg("stream_of"),
          py::arg("device"), "The fixed half of posts between two regions (IOEngineSession's fast path).")
      .def("counters", &XgmiQueue::counters, py::call_guard<py::gil_scoped_release>())
      .def("close", &XgmiQueue::close, py::call_guard<py::gil_scoped_release>(),
           "Complete every pending transfer, stop the completion thread, destroy the queue's events.");

  py::class_<XgmiSessionPost> xgmi_session_post(
      m, "XgmiSessionPost", "Posts between two regions on the XGMI route (XgmiQueue.session); TypeError as SessionPost.");
  def_session_posts(xgmi_session_post);
}

}  // namespace mori

// Bindings of the RDMA backend's data path (mori.core.transfer.RmaQueue, RmaSessionPost): a
// transfer's blocks checked, merged and posted on a network transport of the contract
// (mori/transport.h). Every call that can wait releases the GIL, and so does the queue's destruction.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>

#include "../registry.hpp"
#include "../transport_objects.hpp"
#include "bind_util.hpp"
#include "engine.hpp"
#include "rma_queue.hpp"

namespace py = pybind11;
using namespace mori::transfer;
using namespace mori::transfer::bind;

namespace {

// The fixed half of an IOEngineSession's posts on the RDMA route: the local registration, the
// endpoint, the remote key and the remote region's base and size. TypeError as SessionPost.
struct RmaSessionPost {
  std::shared_ptr<RmaQueue> q;
  mori::MemoryPtr lmem;
  mori::EndpointPtr ep;
  mori::RemoteKeyPtr rkey;
  uint64_t rbase, rsize;
  std::string peer;

  StatusPtr many(uint16_t op, py::handle lo, py::handle ro, py::handle sz, py::handle uid) {
    const uint64_t u = u64_of(uid.ptr());
    return with_lists(lo, ro, sz, [&](const U64s& l, const U64s& r, const U64s& n) {
      return q->post(op == kWrite, *lmem, *ep, *rkey, rbase, rsize, l, r, n, u, peer);
    });
  }
  StatusPtr one(uint16_t op, py::handle lo, py::handle ro, py::handle sz, py::handle uid) {
    static thread_local U64s l(1), r(1), n(1);
    const uint64_t a = u64_of(lo.ptr()), b = u64_of(ro.ptr()), c = u64_of(sz.ptr()), u = u64_of(uid.ptr());
    py::gil_scoped_release nogil;
    l[0] = a, r[0] = b, n[0] = c;
    return q->post(op == kWrite, *lmem, *ep, *rkey, rbase, rsize, l, r, n, u, peer);
  }
};

}  // namespace

namespace mori {

void register_rma_queue(py::module_& m) {
  py::class_<RmaQueue, std::shared_ptr<RmaQueue>>(
      m, "RmaQueue",
      "The RDMA backend's data path: checks, merges and posts a transfer's blocks on a network transport "
      "(mori.core.transport) and completes its status, in the waiting thread or a completion thread "
      "(csrc/transfer/rma_queue.hpp).")
      .def(py::init([](const std::shared_ptr<mori::Instance>& instance, py::object engine, bool notify,
                       int64_t timeout_ms) {
             if (!instance) throw py::type_error("RmaQueue: instance must be a TransportInstance");
             if (timeout_ms < 1) throw py::value_error("RmaQueue: timeout_ms must be >= 1");
             Engine* eng = engine.is_none() ? nullptr : &engine.cast<Engine&>();
             // destroyed without the GIL (the destructor joins the completion thread); the Python
             // objects it keeps are dropped with it
             std::shared_ptr<RmaQueue> q(new RmaQueue(instance->ops, instance->tp, eng, notify, timeout_ms),
                                         [](RmaQueue* x) {
                                           if (PyGILState_Check()) {
                                             {
                                               py::gil_scoped_release nogil;
                                               x->close();
                                             }
                                             x->keep = py::object();
                                             py::gil_scoped_release nogil;
                                             delete x;
                                           } else {
                                             x->close();
                                             {
                                               py::gil_scoped_acquire gil;
                                               x->keep = py::object();
                                             }
                                             delete x;
                                           }
                                         });
             q->keep = py::make_tuple(py::cast(instance), engine);
             q->start();
             return q;
           }),
           py::arg("instance"), py::arg("engine"), py::arg("notify"), py::arg("timeout_ms"),
           "A queue on `instance` (a TransportInstance); `engine` (a TcpEngine or None) carries the notices "
           "when `notify`; a transfer still pending after timeout_ms fails.")
      .def(
          "post",
          [](const std::shared_ptr<RmaQueue>& q, const std::string& op, const mori::MemoryPtr& lmem,
             const mori::EndpointPtr& ep, const mori::RemoteKeyPtr& rkey, uint64_t rbase, uint64_t rsize,
             py::handle lo, py::handle ro, py::handle sz, py::handle uid, const std::string& peer) {
            const bool write = op_code(op) == kWrite;
            if (!lmem || !ep || !rkey) throw py::type_error("RmaQueue.post: memory, endpoint and key are required");
            const uint64_t u = u64_of(uid.ptr());
            return with_lists(lo, ro, sz, [&](const U64s& l, const U64s& r, const U64s& n) {
              return q->post(write, *lmem, *ep, *rkey, rbase, rsize, l, r, n, u, peer);
            });
          },
          py::arg("op"), py::arg("local_memory"), py::arg("endpoint"), py::arg("rkey"), py::arg("remote_base"),
          py::arg("remote_size"), py::arg("local_offsets"), py::arg("remote_offsets"), py::arg("sizes"),
          py::arg("uid"), py::arg("peer"),
          "One transfer ('read' or 'write') of the blocks; TypeError unless offsets and sizes are lists or tuples "
          "of non-negative ints; blocks outside either region fail the status (ERR_INVALID_ARGS), nothing moved.")
      .def(
          "session",
          [](const std::shared_ptr<RmaQueue>& q, const mori::MemoryPtr& lmem, const mori::EndpointPtr& ep,
             const mori::RemoteKeyPtr& rkey, uint64_t rbase, uint64_t rsize, const std::string& peer) {
            if (!lmem || !ep || !rkey) throw py::type_error("RmaQueue.session: memory, endpoint and key are required");
            return RmaSessionPost{q, lmem, ep, rkey, rbase, rsize, peer};
          },
          py::arg("local_memory"), py::arg("endpoint"), py::arg("rkey"), py::arg("remote_base"),
          py::arg("remote_size"), py::arg("peer"), "The fixed half of posts between two regions (IOEngineSession's fast path).")
      .def("drain", &RmaQueue::drain, py::arg("timeout_ms") = -1, py::call_guard<py::gil_scoped_release>(),
           "Wait until no transfer is pending; False if some still were after timeout_ms (< 0: the queue's).")
      .def("counters", &RmaQueue::counters, py::call_guard<py::gil_scoped_release>())
      .def(
          "close",
          [](RmaQueue& q) {
            {
              py::gil_scoped_release nogil;
              q.close();
            }
            q.keep = py::object();
          },
          "Complete every pending transfer (failing those past their timeout) and stop the completion thread.");

  py::class_<RmaSessionPost> rma_session_post(
      m, "RmaSessionPost", "Posts between two regions on the RDMA route (RmaQueue.session); TypeError as SessionPost.");
  def_session_posts(rma_session_post);
}

}  // namespace mori

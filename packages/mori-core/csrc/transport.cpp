// The Python face of the transport contract (include/mori/transport.h): any transport's ops table
// (a PyCapsule named "mori.transport.v1") wrapped as objects. Every call that can wait releases
// the GIL; failures raise mori.core.errors.MoriBackendError (MoriValueError for bad arguments,
// MoriTimeoutError for a wait that ran out) with the transport's own message.
#include <pybind11/pybind11.h>

#include <memory>
#include <stdexcept>
#include <string>

#include "errors.hpp"
#include "mori/transport.h"
#include "registry.hpp"
#include "transport_objects.hpp"

namespace py = pybind11;

namespace mori {

namespace {

[[noreturn]] void raise(const char* what, int rc, const mori_tp_error& e) { raise_transport_error(what, rc, e); }

}  // namespace

[[noreturn]] void raise_transport_error(const char* what, int rc, const mori_tp_error& e) {
  std::string msg = std::string(what) + ": " + (e.message[0] ? e.message : "failed") + " (code " + std::to_string(rc) + ")";
  raise_error(rc == MORI_TP_EINVAL ? "MoriValueError" : rc == MORI_TP_ETIMEDOUT ? "MoriTimeoutError" : "MoriBackendError",
              msg);
}

namespace {

const mori_tp_ops* ops_of(py::handle arg) {
  if (!PyCapsule_CheckExact(arg.ptr()))
    raise_error("MoriTypeError", std::string("transport_open: ops has type ") + Py_TYPE(arg.ptr())->tp_name +
                                     "; expected a capsule named '" + MORI_TRANSPORT_CAPSULE + "'");
  auto cap = py::reinterpret_borrow<py::capsule>(arg);
  if (std::string(cap.name() ? cap.name() : "") != MORI_TRANSPORT_CAPSULE)
    raise_error("MoriValueError", std::string("expected a capsule named '") + MORI_TRANSPORT_CAPSULE + "'");
  const auto* ops = cap.get_pointer<const mori_tp_ops>();
  if (!ops || ops->abi != MORI_TRANSPORT_ABI || ops->size < sizeof(mori_tp_ops))
    raise_error("MoriValueError", "the transport's ops table is not ABI version " + std::to_string(MORI_TRANSPORT_ABI));
  return ops;
}

// A pending operation; keeps what it uses alive until it completed.
struct Request {
  InstancePtr in;
  mori_tp_req req = 0;
  bool done = false;
  std::shared_ptr<uint64_t> old = std::make_shared<uint64_t>(0);
  py::object keep;  // the Python objects whose memory the operation uses (buffers, keys)
  bool test() {
    if (done) return true;
    mori_tp_error e{};
    int rc;
    {
      py::gil_scoped_release nogil;
      rc = in->ops->test(in->tp, req, &e);
    }
    if (rc < 0) {
      done = true;
      raise("test", rc, e);
    }
    done = rc == 1;
    return done;
  }
  void wait(int64_t timeout_ms) {
    if (done) return;
    mori_tp_error e{};
    int rc;
    {
      py::gil_scoped_release nogil;
      rc = in->ops->wait(in->tp, req, timeout_ms, &e);
    }
    if (rc == MORI_TP_ETIMEDOUT) raise("wait", rc, e);
    done = true;
    if (rc < 0) raise("wait", rc, e);
  }
};
using RequestPtr = std::shared_ptr<Request>;

RequestPtr finished_or_pending(const InstancePtr& in, int rc, mori_tp_req req, const mori_tp_error& e, const char* what,
                               std::shared_ptr<uint64_t> old = nullptr) {
  if (rc != 0) raise(what, rc, e);
  auto r = std::make_shared<Request>();
  r->in = in;
  r->req = req;
  r->done = req == 0;
  if (old) r->old = std::move(old);
  return r;
}

}  // namespace

void register_transport(py::module_& m) {
  py::class_<Memory, std::shared_ptr<Memory>>(m, "TransportMemory", "Local memory registered with a transport.")
      .def_readonly("addr", &Memory::addr)
      .def_readonly("size", &Memory::size)
      .def_property_readonly("rkey", &Memory::rkey, "The remote key: bytes a peer unpacks to reach this memory.");

  py::class_<RemoteKey, std::shared_ptr<RemoteKey>>(m, "TransportRemoteKey", "A peer's memory, usable on one endpoint.");

  py::class_<Request, RequestPtr>(m, "TransportRequest", "A pending operation.")
      .def("test", &Request::test, "True once complete; raises if it failed.")
      .def("wait", &Request::wait, py::arg("timeout_ms") = -1,
           "Block (GIL released) until complete; MoriTimeoutError after timeout_ms (< 0: none).")
      .def_property_readonly(
          "old", [](const Request& r) { return *r.old; }, "An atomic's value before it (once complete).");

  py::class_<Endpoint, EndpointPtr>(m, "TransportEndpoint", "A connection to one peer.")
      .def(
          "unpack_rkey",
          [](const EndpointPtr& ep, py::bytes key) {
            std::string k = key;
            mori_tp_error e{};
            mori_tp_rkey* rk = ep->in->ops->unpack_rkey(ep->in->tp, ep->ep, k.data(), k.size(), &e);
            if (!rk) raise("unpack_rkey", e.code ? e.code : MORI_TP_EINVAL, e);
            auto out = std::make_shared<RemoteKey>();
            out->in = ep->in;
            out->ep = ep;
            out->rkey = rk;
            return out;
          },
          py::arg("rkey"))
      .def(
          "put",
          [](const EndpointPtr& ep, uint64_t src, const std::shared_ptr<Memory>& lmem, uint64_t raddr,
             const std::shared_ptr<RemoteKey>& rk, uint64_t n) {
            mori_tp_error e{};
            mori_tp_req req = 0;
            int rc;
            {
              py::gil_scoped_release nogil;
              rc = ep->in->ops->put(ep->in->tp, ep->ep, reinterpret_cast<const void*>(src), lmem ? lmem->mem : nullptr,
                                    raddr, rk->rkey, n, &req, &e);
            }
            auto r = finished_or_pending(ep->in, rc, req, e, "put");
            r->keep = py::make_tuple(lmem, rk);
            return r;
          },
          py::arg("src"), py::arg("local_memory"), py::arg("remote_addr"), py::arg("rkey"), py::arg("nbytes"),
          "Non-blocking put of nbytes at local address src to remote_addr.")
      .def(
          "get",
          [](const EndpointPtr& ep, uint64_t dst, const std::shared_ptr<Memory>& lmem, uint64_t raddr,
             const std::shared_ptr<RemoteKey>& rk, uint64_t n) {
            mori_tp_error e{};
            mori_tp_req req = 0;
            int rc;
            {
              py::gil_scoped_release nogil;
              rc = ep->in->ops->get(ep->in->tp, ep->ep, reinterpret_cast<void*>(dst), lmem ? lmem->mem : nullptr, raddr,
                                    rk->rkey, n, &req, &e);
            }
            auto r = finished_or_pending(ep->in, rc, req, e, "get");
            r->keep = py::make_tuple(lmem, rk);
            return r;
          },
          py::arg("dst"), py::arg("local_memory"), py::arg("remote_addr"), py::arg("rkey"), py::arg("nbytes"),
          "Non-blocking get of nbytes from remote_addr into local address dst.")
      .def(
          "atomic",
          [](const EndpointPtr& ep, int op, int word, uint64_t value, uint64_t compare, uint64_t raddr,
             const std::shared_ptr<RemoteKey>& rk) {
            mori_tp_error e{};
            mori_tp_req req = 0;
            auto old = std::make_shared<uint64_t>(0);
            int rc;
            {
              py::gil_scoped_release nogil;
              rc = ep->in->ops->atomic(ep->in->tp, ep->ep, op, word, value, compare, raddr, rk->rkey, old.get(), &req, &e);
            }
            auto r = finished_or_pending(ep->in, rc, req, e, "atomic", old);
            r->keep = py::make_tuple(rk);
            return r;
          },
          py::arg("op"), py::arg("word"), py::arg("value"), py::arg("compare"), py::arg("remote_addr"), py::arg("rkey"),
          "Non-blocking atomic (MORI_TP_OP_*, MORI_TP_WORD_*); the request's .old is the value before it.")
      .def(
          "fence",
          [](const EndpointPtr& ep) {
            mori_tp_error e{};
            int rc;
            {
              py::gil_scoped_release nogil;
              rc = ep->in->ops->fence(ep->in->tp, ep->ep, &e);
            }
            if (rc != 0) raise("fence", rc, e);
          },
          "Order: what was posted before is remotely visible before what is posted after.")
      .def(
          "flush",
          [](const EndpointPtr& ep) {
            mori_tp_error e{};
            mori_tp_req req = 0;
            int rc;
            {
              py::gil_scoped_release nogil;
              rc = ep->in->ops->flush(ep->in->tp, ep->ep, &req, &e);
            }
            return finished_or_pending(ep->in, rc, req, e, "flush");
          },
          "A request that completes once everything posted before on this endpoint is remotely complete.");

  py::class_<Instance, InstancePtr>(m, "TransportInstance", "One instance of a transport (include/mori/transport.h).")
      .def_property_readonly("name", [](const Instance& i) { return std::string(i.ops->name); })
      .def_property_readonly("caps", [](const Instance& i) { return i.ops->caps; })
      .def("address",
           [](const Instance& i) {
             std::string buf(1024, '\0');
             size_t len = buf.size();
             mori_tp_error e{};
             int rc = i.ops->address(i.tp, buf.data(), &len, &e);
             if (rc == MORI_TP_EINVAL && len > buf.size()) {
               buf.assign(len, '\0');
               rc = i.ops->address(i.tp, buf.data(), &len, &e);
             }
             if (rc != 0) raise("address", rc, e);
             buf.resize(len);
             return py::bytes(buf);
           },
           "Bytes a peer passes to connect().")
      .def(
          "connect",
          [](const InstancePtr& in, py::bytes address) {
            std::string a = address;
            mori_tp_error e{};
            mori_tp_ep* ep;
            {
              py::gil_scoped_release nogil;
              ep = in->ops->connect(in->tp, a.data(), a.size(), &e);
            }
            if (!ep) raise("connect", e.code ? e.code : MORI_TP_EUNREACH, e);
            auto out = std::make_shared<Endpoint>();
            out->in = in;
            out->ep = ep;
            return out;
          },
          py::arg("address"))
      .def(
          "register",
          [](const InstancePtr& in, uint64_t addr, uint64_t size, int mem_type, int device) {
            mori_tp_error e{};
            mori_tp_mem* mem;
            {
              py::gil_scoped_release nogil;
              mem = in->ops->reg(in->tp, reinterpret_cast<void*>(addr), size, mem_type, device, &e);
            }
            if (!mem) raise("register", e.code ? e.code : MORI_TP_EINVAL, e);
            auto out = std::make_shared<Memory>();
            out->in = in;
            out->mem = mem;
            out->addr = addr;
            out->size = size;
            return out;
          },
          py::arg("addr"), py::arg("size"), py::arg("mem_type") = MORI_TP_MEM_HOST, py::arg("device") = -1)
      .def(
          "flush_all",
          [](const InstancePtr& in) {
            mori_tp_error e{};
            mori_tp_req req = 0;
            int rc;
            {
              py::gil_scoped_release nogil;
              rc = in->ops->flush(in->tp, nullptr, &req, &e);
            }
            return finished_or_pending(in, rc, req, e, "flush");
          },
          "A request that completes once everything posted on every endpoint is remotely complete.")
      .def("progress", [](const Instance& i) {
        py::gil_scoped_release nogil;
        i.ops->progress(i.tp);
      });

  m.def(
      "transport_open",
      [](py::handle cap, py::handle options_arg) {
        const mori_tp_ops* ops = ops_of(cap);
        const std::string options = str_arg(options_arg, "transport_open", "options");
        mori_tp_error e{};
        mori_tp* tp;
        {
          py::gil_scoped_release nogil;
          tp = ops->create(options.c_str(), &e);
        }
        if (!tp) raise(("creating transport '" + std::string(ops->name) + "'").c_str(), e.code ? e.code : MORI_TP_EINTERNAL, e);
        auto in = std::make_shared<Instance>();
        in->ops = ops;
        in->tp = tp;
        in->capsule = py::reinterpret_borrow<py::object>(cap);
        return in;
      },
      py::arg("ops"), py::arg("options") = "",
      "An instance of the transport whose ops table the capsule holds ('mori.transport.v1').");
  m.attr("TRANSPORT_ABI") = MORI_TRANSPORT_ABI;
}

}  // namespace mori

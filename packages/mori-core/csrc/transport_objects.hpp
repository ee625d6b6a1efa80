// The Python-side objects of the transport contract (transport.cpp binds them), shared with the
// proxy (proxy.cpp), which drives the same instance, endpoints and keys from its own thread.
#pragma once
#include <pybind11/pybind11.h>

#include <memory>
#include <string>

#include "mori/transport.h"

// hidden, as pybind11 makes the module's own types (these hold py::object members)
#pragma GCC visibility push(hidden)
namespace mori {

namespace py = pybind11;

// Raise the MORI error class for a transport failure `rc` (needs the GIL).
[[noreturn]] void raise_transport_error(const char* what, int rc, const mori_tp_error& e);

// One transport instance; everything made from it keeps it alive.
struct Instance {
  const mori_tp_ops* ops;
  mori_tp* tp;
  py::object capsule;  // keeps the plugin's module (and so its ops table) loaded
  ~Instance() {
    if (tp) {
      py::gil_scoped_release nogil;
      ops->destroy(tp);
    }
  }
};
using InstancePtr = std::shared_ptr<Instance>;

struct Memory {
  InstancePtr in;
  mori_tp_mem* mem;
  uint64_t addr, size;
  ~Memory() {
    if (mem) in->ops->dereg(in->tp, mem);
  }
  py::bytes rkey() const {
    std::string buf(256, '\0');
    size_t len = buf.size();
    mori_tp_error e{};
    int rc = in->ops->pack_rkey(in->tp, mem, buf.data(), &len, &e);
    if (rc == MORI_TP_EINVAL && len > buf.size()) {
      buf.assign(len, '\0');
      rc = in->ops->pack_rkey(in->tp, mem, buf.data(), &len, &e);
    }
    if (rc != 0) raise_transport_error("pack_rkey", rc, e);
    buf.resize(len);
    return py::bytes(buf);
  }
};

struct Endpoint;

struct RemoteKey {
  InstancePtr in;
  std::shared_ptr<Endpoint> ep;
  mori_tp_rkey* rkey;
  ~RemoteKey();
};

struct Endpoint {
  InstancePtr in;
  mori_tp_ep* ep;
  ~Endpoint() {
    if (ep) {
      py::gil_scoped_release nogil;
      in->ops->disconnect(in->tp, ep);
    }
  }
};
using EndpointPtr = std::shared_ptr<Endpoint>;

inline RemoteKey::~RemoteKey() {
  if (rkey) in->ops->release_rkey(in->tp, rkey);
}

using MemoryPtr = std::shared_ptr<Memory>;
using RemoteKeyPtr = std::shared_ptr<RemoteKey>;

}  // namespace mori
#pragma GCC visibility pop

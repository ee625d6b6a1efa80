// The benchmark's inner loops (bench/ucx_bench.py), in C++ so that what is timed is a transport
// through its ops table (ours, or any other's capsule: the built-in tcp as the baseline), not
// Python's cost per call. Private: used by the benchmark script only.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "transport.hpp"

namespace py = pybind11;

namespace {

using Clock = std::chrono::steady_clock;

struct Bench {
  const mori_tp_ops* ops = nullptr;
  mori_tp* tp = nullptr;
  mori_tp_mem* mem = nullptr;
  mori_tp_ep* ep = nullptr;
  mori_tp_rkey* rkey = nullptr;
  std::vector<uint8_t> buf;
  uint64_t peer_base = 0;
};

[[noreturn]] void raise(const char* what, const mori_tp_error& e) {
  throw std::runtime_error(std::string(what) + ": " + e.message);
}

void wait(Bench& b, mori_tp_req req) {
  mori_tp_error e{};
  if (req && b.ops->wait(b.tp, req, 60000, &e) != 1) raise("wait", e);
}

// Post a put, progressing while the request table is full (max_requests).
mori_tp_req post_put(Bench& b, const void* src, uint64_t raddr, size_t n) {
  for (;;) {
    mori_tp_error e{};
    mori_tp_req req = 0;
    int rc = b.ops->put(b.tp, b.ep, src, b.mem, raddr, b.rkey, n, &req, &e);
    if (rc == MORI_TP_OK) return req;
    if (rc != MORI_TP_ENOMEM) raise("put", e);
    b.ops->progress(b.tp);
  }
}

}  // namespace

void register_bench(py::module_& m) {
  py::class_<Bench>(m, "Bench",
                    "Private: one instance of any transport (its ops capsule) with one registered buffer, for the benchmark.")
      .def(py::init([](py::capsule ops, const std::string& options, size_t size) {
             if (std::string(ops.name() ? ops.name() : "") != MORI_TRANSPORT_CAPSULE)
               throw std::invalid_argument("ops: expected a capsule named " MORI_TRANSPORT_CAPSULE);
             auto b = std::make_unique<Bench>();
             b->ops = ops.get_pointer<const mori_tp_ops>();
             if (!b->ops || b->ops->abi != MORI_TRANSPORT_ABI) throw std::invalid_argument("ops: not ABI 1");
             mori_tp_error e{};
             b->tp = b->ops->create(options.c_str(), &e);
             if (!b->tp) raise("create", e);
             b->buf.assign(size, 1);  // touched: no page faults while timing
             b->mem = b->ops->reg(b->tp, b->buf.data(), size, MORI_TP_MEM_HOST, -1, &e);
             if (!b->mem) raise("register", e);
             return b;
           }),
           py::arg("ops"), py::arg("options"), py::arg("size"))
      .def("address",
           [](Bench& b) {
             std::string out(4096, '\0');
             size_t len = out.size();
             mori_tp_error e{};
             if (b.ops->address(b.tp, out.data(), &len, &e)) raise("address", e);
             out.resize(len);
             return py::bytes(out);
           })
      .def("rkey",
           [](Bench& b) {
             std::string out(4096, '\0');
             size_t len = out.size();
             mori_tp_error e{};
             if (b.ops->pack_rkey(b.tp, b.mem, out.data(), &len, &e)) raise("pack_rkey", e);
             out.resize(len);
             return py::bytes(out);
           })
      .def_property_readonly("base", [](Bench& b) { return reinterpret_cast<uint64_t>(b.buf.data()); })
      .def("connect",
           [](Bench& b, const std::string& address, const std::string& rkey, uint64_t base) {
             py::gil_scoped_release nogil;
             mori_tp_error e{};
             b.ep = b.ops->connect(b.tp, address.data(), address.size(), &e);
             if (!b.ep) raise("connect", e);
             b.rkey = b.ops->unpack_rkey(b.tp, b.ep, rkey.data(), rkey.size(), &e);
             if (!b.rkey) raise("unpack_rkey", e);
             b.peer_base = base;
           })
      .def(
          "put_bandwidth",
          [](Bench& b, size_t size, size_t count) {
            py::gil_scoped_release nogil;
            auto t0 = Clock::now();
            for (size_t i = 0; i < count; ++i) post_put(b, b.buf.data(), b.peer_base, size);
            mori_tp_error e{};
            mori_tp_req req = 0;
            if (b.ops->flush(b.tp, b.ep, &req, &e)) raise("flush", e);
            wait(b, req);
            return std::chrono::duration<double>(Clock::now() - t0).count();
          },
          py::arg("size"), py::arg("count"), "Seconds for `count` puts of `size` bytes and one flush.")
      .def(
          "memcpy_bandwidth",
          [](Bench& b, size_t size, size_t count) {
            py::gil_scoped_release nogil;
            std::vector<uint8_t> dst(size, 0);
            auto t0 = Clock::now();
            for (size_t i = 0; i < count; ++i) {
              std::memcpy(dst.data(), b.buf.data(), size);
              asm volatile("" : : "r"(dst.data()) : "memory");  // keep every copy
            }
            return std::chrono::duration<double>(Clock::now() - t0).count();
          },
          py::arg("size"), py::arg("count"), "Seconds for `count` local memcpy of `size` bytes.")
      .def(
          "put_flush_latency",
          [](Bench& b, size_t iters) {
            py::gil_scoped_release nogil;
            std::vector<double> us;
            us.reserve(iters);
            for (size_t i = 0; i < iters; ++i) {
              auto t0 = Clock::now();
              wait(b, post_put(b, b.buf.data(), b.peer_base, 8));
              mori_tp_error e{};
              mori_tp_req req = 0;
              if (b.ops->flush(b.tp, b.ep, &req, &e)) raise("flush", e);
              wait(b, req);
              us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
            }
            return us;
          },
          py::arg("iters"), "Microseconds of each 8-byte put + flush, waited for.")
      .def("close", [](Bench& b) {
        py::gil_scoped_release nogil;
        if (b.rkey) b.ops->release_rkey(b.tp, b.rkey);
        if (b.ep) b.ops->disconnect(b.tp, b.ep);
        if (b.mem) b.ops->dereg(b.tp, b.mem);
        if (b.tp) b.ops->destroy(b.tp);
        b.rkey = nullptr;
        b.ep = nullptr;
        b.mem = nullptr;
        b.tp = nullptr;
      });
}

// Bindings of the TCP engine (mori.core.transfer.TcpEngine, SessionPost) and its staging copier
// on a GPU driver (GpuCopier). No libtorch, no GPU runtime: memory crosses as integer addresses.
// Every call that can wait or move bytes releases the GIL, and so does the engine's destruction.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <stdexcept>
#include <string>

#include "../registry.hpp"
#include "bind_util.hpp"
#include "engine.hpp"
#include "gpu_copier.hpp"

namespace py = pybind11;
using namespace mori::transfer;
using namespace mori::transfer::bind;

namespace {

// One block, through per-thread one-element lists (a post of one block allocates none of them).
StatusPtr post_one(Engine& e, uint16_t op, uint64_t local_id, const std::string& key, uint64_t remote_id, uint64_t l,
                   uint64_t r, uint64_t n, uint64_t uid, bool remote_cpu, uint64_t remote_size) {
  static thread_local U64s lo(1), ro(1), sz(1);
  lo[0] = l;
  ro[0] = r;
  sz[0] = n;
  return e.post(op, local_id, key, remote_id, lo, ro, sz, uid, remote_cpu, remote_size);
}

StatusPtr post_lists(Engine& e, uint16_t op, uint64_t local_id, const std::string& key, uint64_t remote_id,
                     py::handle local_offsets, py::handle remote_offsets, py::handle sizes, uint64_t uid,
                     bool remote_cpu, uint64_t remote_size) {
  return with_lists(local_offsets, remote_offsets, sizes, [&](const U64s& lo, const U64s& ro, const U64s& sz) {
    return e.post(op, local_id, key, remote_id, lo, ro, sz, uid, remote_cpu, remote_size);
  });
}

// The fixed half of an IOEngineSession's posts, held natively: the (local, remote) pair, so a
// post is one call taking the blocks and the uid. Unequal list lengths, non-list arguments and
// anything that is not a non-negative int raise TypeError: the Python side then takes its checked
// path, which names the bad argument. The engine checks ranges and registrations on every post.
struct SessionPost {
  Engine* e;
  uint64_t local_id;
  std::string key;
  uint64_t remote_id;
  bool remote_cpu;
  uint64_t remote_size;

  StatusPtr many(uint16_t op, py::handle lo, py::handle ro, py::handle sz, py::handle uid) {
    if (!PyList_Check(sz.ptr()) && !PyTuple_Check(sz.ptr())) throw py::type_error("expected a list or tuple");
    if (!PyList_Check(lo.ptr()) && !PyTuple_Check(lo.ptr())) throw py::type_error("expected a list or tuple");
    if (!PyList_Check(ro.ptr()) && !PyTuple_Check(ro.ptr())) throw py::type_error("expected a list or tuple");
    Py_ssize_t n = PySequence_Fast_GET_SIZE(sz.ptr());
    if (PySequence_Fast_GET_SIZE(lo.ptr()) != n || PySequence_Fast_GET_SIZE(ro.ptr()) != n)
      throw py::type_error("lists of unequal length");
    uint64_t u = u64_of(uid.ptr());
    return post_lists(*e, op, local_id, key, remote_id, lo, ro, sz, u, remote_cpu, remote_size);
  }
  StatusPtr one(uint16_t op, py::handle lo, py::handle ro, py::handle sz, py::handle uid) {
    uint64_t l = u64_of(lo.ptr()), r = u64_of(ro.ptr()), n = u64_of(sz.ptr()), u = u64_of(uid.ptr());
    py::gil_scoped_release nogil;
    return post_one(*e, op, local_id, key, remote_id, l, r, n, u, remote_cpu, remote_size);
  }
};

}  // namespace

namespace mori {

void register_tcp_engine(py::module_& m) {
  // Held with a deleter that releases the GIL: the destructor shuts the engine down and joins its
  // threads, which may be waiting for the GIL themselves (DeleteWithoutGil).
  py::class_<Engine, std::unique_ptr<Engine, DeleteWithoutGil>>(
      m, "TcpEngine", "The TCP engine (one-sided reads and writes into registered memory); mori.io.IOEngine wraps it.")
      .def(py::init([](const std::string& key, const std::string& host, uint16_t port, const std::string& node_id,
                       const std::string& token, int64_t cp_timeout_ms, bool allow_unauthenticated,
                       int max_connections, int max_handshakes, int64_t handshake_timeout_ms, int64_t idle_timeout_ms,
                       uint64_t inbound_per_peer, uint64_t inbound_total, bool thp, uint64_t thp_collapse_bytes,
                       bool short_slice, bool move_copy_threads) {
             EngineConfig c;
             c.key = key;
             c.host = host;
             c.port = port;
             c.node_id = node_id;
             c.token = token;
             c.cp_timeout_ms = cp_timeout_ms;
             c.allow_unauthenticated = allow_unauthenticated;
             c.limits.max_connections = max_connections;
             c.limits.max_handshakes = max_handshakes;
             c.limits.handshake_timeout_ms = handshake_timeout_ms;
             c.limits.idle_timeout_ms = idle_timeout_ms;
             c.limits.inbound.per_peer = size_t(inbound_per_peer);
             c.limits.inbound.total = size_t(inbound_total);
             c.manners.thp = thp;
             c.manners.thp_collapse_max = thp_collapse_bytes;
             c.manners.short_slice = short_slice;
             c.manners.move_copy_threads = move_copy_threads;
             py::gil_scoped_release nogil;
             return new Engine(c);
           }),
           py::arg("key"), py::arg("host"), py::arg("port"), py::arg("node_id"), py::arg("token"),
           py::arg("cp_timeout_ms"), py::arg("allow_unauthenticated") = false, py::arg("max_connections") = 1024,
           py::arg("max_handshakes") = 64, py::arg("handshake_timeout_ms") = 10000,
           py::arg("idle_timeout_ms") = 600000, py::arg("inbound_per_peer") = 65536,
           py::arg("inbound_total") = 262144, py::arg("thp") = false, py::arg("thp_collapse_bytes") = uint64_t(1) << 30,
           py::arg("short_slice") = false, py::arg("move_copy_threads") = false,
           "Raises mori.core.errors.MoriValueError for a configuration that is not allowed (listening beyond "
           "loopback without a secret), MoriBackendError when it cannot listen. The limits and manners are "
           "documented with their MORI_IO_* variables (mori.io.env).")
      .def_property_readonly("port", &Engine::port, "TCP port the engine listens on.")
      .def(
          "configure_tcp",
          [](Engine& e, int conns, uint64_t chunk, int sockbuf, bool cma, bool notify, int cma_threads,
             uint64_t cma_split_bytes) {
            e.configure_tcp(TcpConfig{conns, chunk, sockbuf, cma, notify, cma_threads, cma_split_bytes});
          },
          py::arg("conns_per_peer"), py::arg("chunk_bytes"), py::arg("socket_buffer_bytes"), py::arg("enable_cma"),
          py::arg("enable_notification"), py::arg("cma_threads") = 0, py::arg("cma_split_bytes") = 0,
          "Settings of the TCP backend (apply to new connections). cma_threads: threads (the caller "
          "included) that copy one large same-host transfer; 0 = min(4, CPUs); at most 64 are used. "
          "cma_split_bytes: smallest piece such a transfer is cut into; 0 = 64 KiB where the target's "
          "bytes lie on 4 KiB pages, 256 KiB on huge pages; values below 4096 count as 4096.")
      .def("register_memory", &Engine::register_memory, py::arg("addr"), py::arg("size"), py::arg("loc"),
           py::arg("device"), py::call_guard<py::gil_scoped_release>(),
           "Add a region to the table; returns its (random) id. MoriValueError for a range that wraps around "
           "or, for CPU memory, is not mapped. With thp=True at construction, CPU memory's 2 MiB-aligned "
           "interior is put on transparent huge pages (contents unchanged).")
      .def("deregister_memory", &Engine::deregister_memory, py::arg("id"), py::arg("timeout_ms"),
           py::call_guard<py::gil_scoped_release>(),
           "Remove a region, then wait for transfers touching it; False if some still ran at the timeout.")
      .def("has_memory", &Engine::has_memory, py::arg("id"))
      .def("add_peer", &Engine::add_peer, py::arg("key"), py::arg("host"), py::arg("port"), py::arg("same_node"),
           py::call_guard<py::gil_scoped_release>())
      .def("remove_peer", &Engine::remove_peer, py::arg("key"), py::call_guard<py::gil_scoped_release>())
      .def("peer_alive", &Engine::peer_alive, py::arg("key"), py::call_guard<py::gil_scoped_release>())
      .def(
          "post",
          [](Engine& e, const std::string& op, uint64_t local_id, const std::string& key, uint64_t remote_id,
             py::object local_offsets, py::object remote_offsets, py::object sizes_, py::handle uid, bool remote_cpu,
             uint64_t remote_size) {
            return post_lists(e, op_code(op), local_id, key, remote_id, local_offsets, remote_offsets, sizes_,
                              u64_of(uid.ptr()), remote_cpu, remote_size);
          },
          py::arg("op"), py::arg("local_id"), py::arg("peer_key"), py::arg("remote_id"), py::arg("local_offsets"),
          py::arg("remote_offsets"), py::arg("sizes"), py::arg("uid"), py::arg("remote_cpu"), py::arg("remote_size"),
          "Start a transfer of blocks; returns its TransferStatus.")
      .def(
          "post1",
          [](Engine& e, const std::string& op, uint64_t local_id, const std::string& key, uint64_t remote_id,
             py::handle loff, py::handle roff, py::handle size, py::handle uid, bool remote_cpu, uint64_t remote_size) {
            // u64_of, not pybind11's caster: that one takes bools, which the Python checks reject
            const uint16_t o = op_code(op);
            const uint64_t l = u64_of(loff.ptr()), r = u64_of(roff.ptr()), n = u64_of(size.ptr()), u = u64_of(uid.ptr());
            py::gil_scoped_release nogil;
            return post_one(e, o, local_id, key, remote_id, l, r, n, u, remote_cpu, remote_size);
          },
          py::arg("op"), py::arg("local_id"), py::arg("peer_key"), py::arg("remote_id"), py::arg("local_offset"),
          py::arg("remote_offset"), py::arg("size"), py::arg("uid"), py::arg("remote_cpu"), py::arg("remote_size"),
          "Start a transfer of one block; returns its TransferStatus.")
      .def(
          "session",
          [](Engine& e, uint64_t local_id, const std::string& key, uint64_t remote_id, bool remote_cpu,
             uint64_t remote_size) { return SessionPost{&e, local_id, key, remote_id, remote_cpu, remote_size}; },
          py::arg("local_id"), py::arg("peer_key"), py::arg("remote_id"), py::arg("remote_cpu"),
          py::arg("remote_size"), py::keep_alive<0, 1>(),
          "The fixed half of posts between one local and one remote region (IOEngineSession's fast path).")
      .def(
          "pop_inbound",
          [](Engine& e, const std::string& key, uint64_t uid) -> py::object {
            auto r = e.pop_inbound(key, uid);
            if (!r) return py::none();
            auto s = std::make_shared<Status>();
            s->complete(r->first, r->second);
            return py::cast(s);
          },
          py::arg("key"), py::arg("uid"), "Finished inbound transfer (initiator key, uid) or None.")
      .def("notice", &Engine::notice, py::arg("peer_key"), py::arg("uid"), py::arg("total_parts"), py::arg("code"),
           py::call_guard<py::gil_scoped_release>(),
           "Tell the peer, one way over an authenticated connection, the inbound status of transfer uid whose "
           "bytes moved over another path (an RDMA transport); '' or why it could not be sent.")
      .def("route_of", &Engine::route_of, py::arg("peer_key"), py::arg("local_id"), py::arg("remote_cpu"),
           "'tcp+cma' or 'tcp': how bytes to this peer move now; '' if the peer is unknown.")
      .def(
          "set_device_copier",
          [](Engine& e, py::capsule cap) {
            if (std::string(cap.name() ? cap.name() : "") != "mori.io.DeviceCopier")
              throw py::value_error("set_device_copier: expected a capsule named 'mori.io.DeviceCopier'");
            const auto* c = cap.get_pointer<DeviceCopier>();
            if (!c || !c->to_host || !c->from_host)
              throw py::value_error("set_device_copier: the DeviceCopier has null functions");
            e.set_device_copier(*c);
          },
          py::arg("copier"),
          "Install a device plugin's DeviceCopier (csrc/engine.hpp), passed as a capsule named "
          "'mori.io.DeviceCopier' that outlives the engine: the TCP backend then stages GPU memory.")
      .def(
          "set_gpu_copier",
          [](Engine& e, const py::dict& calls, const std::map<int, uint64_t>& contexts) {
            auto g = std::make_shared<GpuCopier>(gpu_calls(calls), contexts);
            e.set_device_copier(g->entry_points(), g);
            return g;
          },
          py::arg("calls"), py::arg("contexts"),
          "Install the staging copier on a GPU driver (csrc/gpu_copier.hpp): calls as for XgmiQueue "
          "(plus stream_create/stream_synchronize/stream_destroy/host_alloc/host_free), contexts: device "
          "ordinal -> context (CUDA) or ordinal (HIP). Returns it (its copies count).")
      .def("has_device_copier", &Engine::has_device_copier, "Whether GPU memory can be staged.")
      .def("counters", &Engine::counters, py::call_guard<py::gil_scoped_release>(),
           "Requests served, direct copies, failovers, table sizes.")
      .def("shutdown", &Engine::shutdown, py::call_guard<py::gil_scoped_release>(),
           "Close every connection and stop the threads; pending transfers fail.");


  py::class_<SessionPost> session_post(m, "SessionPost",
                                       "Posts between one local and one remote region (Engine.session); TypeError "
                                       "on anything but lists or tuples of equal length of non-negative ints.");
  def_session_posts(session_post);

  py::class_<GpuCopier, std::shared_ptr<GpuCopier>>(
      m, "GpuCopier", "The TCP backend's staging copier on a GPU driver (Engine.set_gpu_copier).")
      .def_property_readonly("copies", &GpuCopier::copies, "Pieces copied between device and host.")
      .def("add_context", &GpuCopier::add_context, py::arg("device"), py::arg("context"),
           "Copy for one more GPU: its ordinal and context (CUDA) or ordinal (HIP).");
}

}  // namespace mori

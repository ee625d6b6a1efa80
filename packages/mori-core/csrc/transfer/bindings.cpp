// The one-sided transfer machinery's bindings in mori.core._core (public face: mori.core.transfer):
// the TCP engine, the GPU copy queue (XGMI/NVLink peer copies) and the staging copier. No
// libtorch, no GPU runtime: memory crosses as integer addresses. Every call that can wait or move
// bytes releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <tuple>

#include "../registry.hpp"
#include "engine.hpp"
#include "gpu_copier.hpp"
#include "sched.hpp"
#include "xgmi_queue.hpp"

namespace py = pybind11;
using namespace mori::transfer;

namespace {

bool finished_ok(const StatusPtr& s) { return s->code() == SUCCESS; }
bool finished_bad(const StatusPtr& s) { return s->done() && s->code() != SUCCESS; }

uint16_t op_code(const std::string& op) {
  if (op == "read") return kRead;
  if (op == "write") return kWrite;
  throw py::value_error("op=" + op + " is not allowed; expected 'read' or 'write'");
}

// One index as a uint64: a non-negative int (or an object with __index__, not a bool, not a
// float) below 2**64; anything else raises TypeError, which the Python side turns into a message
// naming the argument (as mori.io does with its checks).
inline bool small_u64(PyObject* it, uint64_t* v) {
#if PY_VERSION_HEX < 0x030C0000
  // CPython 3.11 and older: Py_SIZE is the signed count of 30-bit digits. Offsets and sizes below
  // 2**60 are one or two digits; PyLong_AsUnsignedLongLong costs ~3 ns a block more (a 128-block
  // batch converts 384 of them).
  const auto* d = reinterpret_cast<const PyLongObject*>(it)->ob_digit;
  switch (Py_SIZE(it)) {
    case 0:
      *v = 0;
      return true;
    case 1:
      *v = d[0];
      return true;
    case 2:
      *v = uint64_t(d[0]) | (uint64_t(d[1]) << PyLong_SHIFT);
      return true;
    default:
      return false;
  }
#else
  if (!PyUnstable_Long_IsCompact(reinterpret_cast<PyLongObject*>(it))) return false;
  Py_ssize_t x = PyUnstable_Long_CompactValue(reinterpret_cast<PyLongObject*>(it));
  if (x < 0) return false;
  *v = uint64_t(x);
  return true;
#endif
}

uint64_t u64_of(PyObject* it) {
  unsigned long long v;
  if (PyLong_CheckExact(it)) {
    uint64_t small;
    if (small_u64(it, &small)) return small;
    v = PyLong_AsUnsignedLongLong(it);
  } else {
    if (PyFloat_Check(it) || PyBool_Check(it)) throw py::type_error("expected ints");
    PyObject* idx = PyNumber_Index(it);
    if (!idx) {
      PyErr_Clear();
      throw py::type_error("expected ints");
    }
    v = PyLong_AsUnsignedLongLong(idx);
    Py_DECREF(idx);
  }
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    throw py::type_error("expected non-negative ints below 2**64");
  }
  return uint64_t(v);
}

// A sequence of non-negative ints as uint64s, several times faster than pybind11's list caster
// (a batch of 128 blocks spent ~7 us converting its three lists). Raises TypeError as u64_of does.
// Only lists and tuples: reading anything else (a generator) here would consume what the Python
// side's error path then reads again. The caller's own list is read in place while every item is
// an exact int (nothing can run Python code then); at the first other item the rest is read from
// a tuple snapshot, since an __index__ written in Python could resize the list under the loop.
void u64s_into(py::handle obj, std::vector<uint64_t>& out) {
  if (!PyList_Check(obj.ptr()) && !PyTuple_Check(obj.ptr())) throw py::type_error("expected a list or tuple of ints");
  PyObject* fast = obj.ptr();
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  PyObject** items = PySequence_Fast_ITEMS(fast);
  out.resize(static_cast<size_t>(n));
  Py_ssize_t i = 0;
  for (; i < n && PyLong_CheckExact(items[i]); ++i) out[size_t(i)] = u64_of(items[i]);
  if (i == n) return;
  py::object snap = py::reinterpret_steal<py::object>(PySequence_Tuple(fast));
  if (!snap) throw py::error_already_set();
  n = PyTuple_GET_SIZE(snap.ptr());
  out.resize(static_cast<size_t>(n));
  for (; i < n; ++i) out[size_t(i)] = u64_of(PyTuple_GET_ITEM(snap.ptr(), i));
}

// Per-thread buffers for post's three lists: a batch's lists are 1 KiB and more each, and glibc
// answers every allocation that large by consolidating its free small chunks first (measured
// ~0.5 us a transfer for 128 blocks). `busy` covers the one way back in: an __index__ written in
// Python could post from inside the conversion; that inner post gets vectors of its own.
struct ListScratch {
  std::vector<uint64_t> v[3];
  bool busy = false;
};
constexpr size_t kScratchKeep = 1 << 16;  // entries kept between calls; beyond that, freed

// Converts the three lists (into per-thread buffers) and calls post(local, remote, sizes) with the
// GIL released: the Engine's posts and the XGMI queue's alike.
template <typename Post>
StatusPtr with_lists(py::handle local_offsets, py::handle remote_offsets, py::handle sizes, Post&& post) {
  static thread_local ListScratch tl;
  std::vector<uint64_t> own[3];
  const bool mine = !tl.busy;
  std::vector<uint64_t>* v = mine ? tl.v : own;
  struct Release {
    ListScratch& tl;
    bool mine;
    ~Release() {
      if (!mine) return;
      tl.busy = false;
      for (auto& x : tl.v)
        if (x.capacity() > kScratchKeep) std::vector<uint64_t>().swap(x);
    }
  } release{tl, mine};
  tl.busy = true;
  u64s_into(local_offsets, v[0]);
  if (remote_offsets.ptr() == local_offsets.ptr())  // the same list on both sides (common)
    v[1] = v[0];
  else
    u64s_into(remote_offsets, v[1]);
  u64s_into(sizes, v[2]);
  // an __index__ may have resized a list read after it: the Python side names the argument
  if (v[0].size() != v[2].size() || v[1].size() != v[2].size()) throw py::type_error("lists of unequal length");
  py::gil_scoped_release nogil;
  return post(v[0], v[1], v[2]);
}

using U64s = std::vector<uint64_t>;

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

// A session's four posts (read, write, batch_read, batch_write) on a class with many(op, ...) and
// one(op, ...), op kRead or kWrite.
template <typename S>
void def_session_posts(py::class_<S>& c) {
  const auto lists = std::make_tuple(py::arg("local_offsets"), py::arg("remote_offsets"), py::arg("sizes"),
                                     py::arg("uid"));
  const auto one = std::make_tuple(py::arg("local_offset"), py::arg("remote_offset"), py::arg("size"), py::arg("uid"));
  auto many_of = [](uint16_t op) {
    return [op](S& s, py::handle lo, py::handle ro, py::handle sz, py::handle uid) { return s.many(op, lo, ro, sz, uid); };
  };
  auto one_of = [](uint16_t op) {
    return [op](S& s, py::handle lo, py::handle ro, py::handle sz, py::handle uid) { return s.one(op, lo, ro, sz, uid); };
  };
  std::apply([&](auto... a) { c.def("batch_read", many_of(kRead), a...); }, lists);
  std::apply([&](auto... a) { c.def("batch_write", many_of(kWrite), a...); }, lists);
  std::apply([&](auto... a) { c.def("read", one_of(kRead), a...); }, one);
  std::apply([&](auto... a) { c.def("write", one_of(kWrite), a...); }, one);
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

// -- XGMI ----------------------------------------------------------------------------------------

template <typename T>
T call_at(const py::dict& d, const char* key) {
  if (!d.contains(key)) return T(nullptr);
  return reinterpret_cast<T>(d[key].cast<uintptr_t>());
}

GpuCalls gpu_calls(const py::dict& d) {
  GpuCalls c;
  c.memcpy_async = call_at<void*>(d, "memcpy_async");
  c.memcpy_kind = d.contains("memcpy_kind") ? d["memcpy_kind"].cast<int>() : -1;
  c.event_record = call_at<decltype(c.event_record)>(d, "event_record");
  c.stream_wait_event = call_at<decltype(c.stream_wait_event)>(d, "stream_wait_event");
  c.event_query = call_at<decltype(c.event_query)>(d, "event_query");
  c.event_synchronize = call_at<decltype(c.event_synchronize)>(d, "event_synchronize");
  c.event_create = call_at<decltype(c.event_create)>(d, "event_create");
  c.event_destroy = call_at<decltype(c.event_destroy)>(d, "event_destroy");
  c.launch_kernel = call_at<decltype(c.launch_kernel)>(d, "launch_kernel");
  c.get_context = call_at<void*>(d, "get_context");
  c.set_context = call_at<void*>(d, "set_context");
  c.context_is_device = d.contains("context_is_device") && d["context_is_device"].cast<bool>();
  c.error_name = call_at<void*>(d, "error_name");
  c.error_name_returns_string = d.contains("error_name_returns_string") && d["error_name_returns_string"].cast<bool>();
  c.stream_create = call_at<decltype(c.stream_create)>(d, "stream_create");
  c.stream_synchronize = call_at<decltype(c.stream_synchronize)>(d, "stream_synchronize");
  c.stream_destroy = call_at<decltype(c.stream_destroy)>(d, "stream_destroy");
  c.host_alloc = call_at<decltype(c.host_alloc)>(d, "host_alloc");
  c.host_free = call_at<decltype(c.host_free)>(d, "host_free");
  if (d.contains("stream_flags")) c.stream_flags = d["stream_flags"].cast<unsigned>();
  if (d.contains("host_alloc_flags")) c.host_alloc_flags = d["host_alloc_flags"].cast<unsigned>();
  if (d.contains("not_ready")) c.not_ready = d["not_ready"].cast<int>();
  if (d.contains("event_flags")) c.event_flags = d["event_flags"].cast<unsigned>();
  if (d.contains("names")) c.names = d["names"].cast<std::map<std::string, std::string>>();
  return c;
}

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

void register_transfer(py::module_& m) {
  py::enum_<Code>(m, "StatusCode", py::arithmetic(), "Result of a transfer (TransferStatus.Code()).")
      .value("SUCCESS", SUCCESS)
      .value("INIT", INIT)
      .value("IN_PROGRESS", IN_PROGRESS)
      .value("ERR_INVALID_ARGS", ERR_INVALID_ARGS)
      .value("ERR_NOT_FOUND", ERR_NOT_FOUND)
      .value("ERR_RDMA_OP", ERR_RDMA_OP)
      .value("ERR_BAD_STATE", ERR_BAD_STATE)
      .value("ERR_GPU_OP", ERR_GPU_OP);

  py::class_<Status, StatusPtr>(m, "TransferStatus",
                                "State of one asynchronous transfer; completed exactly once by the engine.")
      .def(py::init<>())
      .def("Code", [](const StatusPtr& s) { return Code(s->code()); }, "Current StatusCode.")
      .def("Message", [](const StatusPtr& s) { return s->message(); }, "Error text ('' on success).")
      .def("Init", [](const StatusPtr& s) { return s->code() == INIT; }, "Not started yet.")
      .def("InProgress", [](const StatusPtr& s) { return s->code() == IN_PROGRESS; }, "Posted, not finished.")
      .def("Succeeded", &finished_ok, "Finished and every byte arrived.")
      .def("Failed", &finished_bad, "Finished with an error (Code() says which).")
      .def(
          "Wait", [](const StatusPtr& s) { s->wait_for(-1); }, py::call_guard<py::gil_scoped_release>(),
          "Block until finished (GIL released).")
      .def(
          "WaitFor", [](const StatusPtr& s, int64_t ms) { return s->wait_for(ms); }, py::arg("timeout_ms"),
          py::call_guard<py::gil_scoped_release>(),
          "Block up to timeout_ms milliseconds (<0 forever, 0 polls once); True if finished. GIL released.")
      .def(
          "set_in_progress", [](const StatusPtr& s) { s->set_in_progress(); },
          "For backends written in Python: mark a posted transfer.")
      .def(
          "complete", [](const StatusPtr& s, int code, const std::string& msg) { return s->complete(code, msg); },
          py::arg("code"), py::arg("message") = "",
          "For backends written in Python: finish the status once (later calls return False).")
      .def("__repr__", [](const StatusPtr& s) {
        std::string name = py::str(py::cast(Code(s->code())));
        std::string msg = s->message();
        return "<TransferStatus " + name + (msg.empty() ? "" : ": " + msg) + ">";
      });

  m.def(
      "wait_all",
      [](const std::vector<StatusPtr>& statuses, int64_t timeout_ms) { return Code(wait_all(statuses, timeout_ms)); },
      py::arg("statuses"), py::arg("timeout_ms"), py::call_guard<py::gil_scoped_release>(),
      "Wait for every status: SUCCESS, the first failure's code, or IN_PROGRESS on timeout.");
  m.def("transfer_set_log_level", &set_log_level, py::arg("level"),
        "Log threshold of the transfer engine (logging levels: 10..50).");
  m.def("transfer_get_log_level", &log_level, "Log threshold of the transfer engine.");
  m.def("parse_message", &parse_message, py::arg("data"),
        "Parse one complete wire message of the TCP engine (for fuzz tests); raises ValueError when malformed.");
  m.def("move_off_cpu", &move_off_cpu, py::arg("tid"), py::arg("cpu"),
        "Move thread `tid` (0: the calling one) off CPU `cpu`, its affinity mask left as it was (for "
        "tests); False when that is the only CPU it may run on.");

  py::class_<Engine>(m, "TcpEngine", "The TCP engine (one-sided reads and writes into registered memory); mori.io.IOEngine wraps it.")
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
          [](Engine& e, int conns, uint64_t chunk, int sockbuf, bool cma, bool notify, int cma_threads) {
            e.configure_tcp(TcpConfig{conns, chunk, sockbuf, cma, notify, cma_threads});
          },
          py::arg("conns_per_peer"), py::arg("chunk_bytes"), py::arg("socket_buffer_bytes"), py::arg("enable_cma"),
          py::arg("enable_notification"), py::arg("cma_threads") = 0,
          "Settings of the TCP backend (apply to new connections). cma_threads: threads (the caller "
          "included) that copy one large same-host transfer; 0 = min(4, CPUs).")
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
      .def(
          "_install_test_copier",
          [](Engine& e, bool fail) {
            e.set_device_copier(DeviceCopier{&test_to_host, &test_from_host, fail ? &g_fail_marker : nullptr});
          },
          py::arg("fail") = false,
          "Test mode: a copier that treats 'device' addresses as host memory (fail=True: every copy fails).")
      .def(
          "_test_refuse_cma", [](Engine& e, bool on) { e.refuse_cma = on; }, py::arg("on"),
          "Test mode: as a target, refuse cross-memory attach so initiators fail over to the socket.")
      .def(
          "_test_refuse_direct", [](Engine& e, bool on) { e.refuse_direct = on; }, py::arg("on"),
          "Test mode: as an initiator, fail the direct path's probe as if the OS refused attach "
          "(applies to connections opened afterwards).")
      .def(
          "_test_direct_delay_ms", [](Engine& e, int64_t ms) { e.direct_delay_ms = ms; }, py::arg("ms"),
          "Test mode: as an initiator, sleep this long inside each direct copy, after its bounds check.")
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
             std::shared_ptr<XgmiQueue> q(new XgmiQueue(std::move(c)), [](XgmiQueue* x) {
               if (PyGILState_Check()) {
                 py::gil_scoped_release nogil;
                 delete x;
               } else {
                 delete x;
               }
             });
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
          [](XgmiQueue& q, int word, uintptr_t function, unsigned threads, unsigned shared) {
            q.set_kernel(word, GpuKernel{reinterpret_cast<void*>(function), threads, shared});
          },
          py::arg("word"), py::arg("function"), py::arg("threads"), py::arg("shared"),
          "The loaded scatter-gather kernel for one word width (its driver function handle, threads per "
          "program, dynamic shared memory).")
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

// Helpers the transfer bindings share (bind_engine.cpp, bind_xgmi.cpp): fast conversion of
// offset and size lists, the sessions' four posts, the GPU driver's function table from Python, and
// deleting objects whose destructors join threads with the GIL released.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "bind_fast.hpp"
#include "engine.hpp"
#include "gpu_calls.hpp"
#include "protocol.hpp"

namespace mori::transfer::bind {

namespace py = pybind11;

inline uint16_t op_code(const std::string& op) {
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

inline uint64_t u64_of(PyObject* it) {
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
inline void u64s_into(py::handle obj, std::vector<uint64_t>& out) {
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
inline StatusPtr with_lists(py::handle local_offsets, py::handle remote_offsets, py::handle sizes, Post&& post) {
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

// One of a session's posts as a METH_FASTCALL method (bind_fast.hpp): four arguments, by position
// or name, handed to S::many or S::one; a C++ exception becomes the Python exception pybind11's
// dispatcher would raise.
template <typename S, bool Many, uint16_t Op>
PyObject* session_post_raw(PyObject* self, PyObject* const* args, Py_ssize_t nargsf, PyObject* kwnames) {
  static const char* const one_names[4] = {"local_offset", "remote_offset", "size", "uid"};
  static const char* const many_names[4] = {"local_offsets", "remote_offsets", "sizes", "uid"};
  const char* func = Many ? (Op == kRead ? "batch_read" : "batch_write") : (Op == kRead ? "read" : "write");
  PyObject* a[4];
  if (!four_args(func, Many ? many_names : one_names, args, nargsf, kwnames, a)) return nullptr;
  S* s = held<S>(self);
  if (!s) return nullptr;
  try {
    StatusPtr st = Many ? s->many(Op, a[0], a[1], a[2], a[3]) : s->one(Op, a[0], a[1], a[2], a[3]);
    return py::cast(std::move(st)).release().ptr();
  } catch (...) {
    py::detail::try_translate_exceptions();
    return nullptr;
  }
}

template <typename S, bool Many, uint16_t Op>
PyMethodDef* session_post_def(const char* name, const char* doc) {
  static PyMethodDef def{name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&session_post_raw<S, Many, Op>)),
                         METH_FASTCALL | METH_KEYWORDS, doc};
  return &def;
}

// A session's four posts (read, write, batch_read, batch_write) on a class with many(op, ...) and
// one(op, ...), op kRead or kWrite.
template <typename S>
void def_session_posts(py::class_<S>& c) {
  set_method(c, session_post_def<S, true, kRead>(
                    "batch_read", "batch_read($self, local_offsets, remote_offsets, sizes, uid)\n--\n\n"
                                  "Remote -> local, blocks at the offsets (lists or tuples of ints); its TransferStatus."));
  set_method(c, session_post_def<S, true, kWrite>(
                    "batch_write", "batch_write($self, local_offsets, remote_offsets, sizes, uid)\n--\n\n"
                                   "Local -> remote, blocks at the offsets (lists or tuples of ints); its TransferStatus."));
  set_method(c, session_post_def<S, false, kRead>(
                    "read", "read($self, local_offset, remote_offset, size, uid)\n--\n\n"
                            "Remote -> local, one block; its TransferStatus."));
  set_method(c, session_post_def<S, false, kWrite>(
                    "write", "write($self, local_offset, remote_offset, size, uid)\n--\n\n"
                             "Local -> remote, one block; its TransferStatus."));
}

template <typename T>
T call_at(const py::dict& d, const char* key) {
  if (!d.contains(key)) return T(nullptr);
  return reinterpret_cast<T>(d[key].cast<uintptr_t>());
}

inline GpuCalls gpu_calls(const py::dict& d) {
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

// Deletes an object whose destructor joins threads with the GIL released. Those threads may call
// into Python (a device copier or a fake GPU driver written with ctypes): joining them while
// holding the GIL, as a plain pybind11 holder does when Python collects the object, deadlocks.
struct DeleteWithoutGil {
  template <typename T>
  void operator()(T* p) const {
    if (PyGILState_Check()) {
      py::gil_scoped_release nogil;
      delete p;
    } else {
      delete p;
    }
  }
};

}  // namespace mori::transfer::bind

// Bindings of the transfer statuses (mori.core.transfer.TransferStatus, StatusCode, wait_all)
// and the transfer engine's log threshold.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "../registry.hpp"
#include "bind_fast.hpp"
#include "engine.hpp"

namespace py = pybind11;
using namespace mori::transfer;

namespace {

using mori::transfer::bind::held;

// The status calls a waiting loop makes, as METH_NOARGS methods (bind_fast.hpp).
template <bool (*Test)(const Status&)>
PyObject* status_test(PyObject* self, PyObject*) {
  const Status* s = held<Status>(self);
  if (!s) return nullptr;
  return PyBool_FromLong(Test(*s));
}
bool finished_ok(const Status& s) { return s.code() == SUCCESS; }
bool finished_bad(const Status& s) { return s.done() && s.code() != SUCCESS; }
bool not_started(const Status& s) { return s.code() == INIT; }
bool in_progress(const Status& s) { return s.code() == IN_PROGRESS; }

// Wait: a status already done (a same-host copy completes inside its post) returns without
// letting go of the GIL.
PyObject* status_wait(PyObject* self, PyObject*) {
  Status* s = held<Status>(self);
  if (!s) return nullptr;
  if (!s->done()) {
    Py_BEGIN_ALLOW_THREADS s->wait_for(-1);
    Py_END_ALLOW_THREADS
  }
  Py_RETURN_NONE;
}

PyMethodDef kStatusMethods[] = {
    {"Init", status_test<not_started>, METH_NOARGS, "Init($self)\n--\n\nNot started yet."},
    {"InProgress", status_test<in_progress>, METH_NOARGS, "InProgress($self)\n--\n\nPosted, not finished."},
    {"Succeeded", status_test<finished_ok>, METH_NOARGS, "Succeeded($self)\n--\n\nFinished and every byte arrived."},
    {"Failed", status_test<finished_bad>, METH_NOARGS,
     "Failed($self)\n--\n\nFinished with an error (Code() says which)."},
    {"Wait", status_wait, METH_NOARGS, "Wait($self)\n--\n\nBlock until finished (GIL released)."},
};

}  // namespace

namespace mori {

void register_transfer_status(py::module_& m) {
  py::enum_<Code>(m, "StatusCode", py::arithmetic(), "Result of a transfer (TransferStatus.Code()).")
      .value("SUCCESS", SUCCESS)
      .value("INIT", INIT)
      .value("IN_PROGRESS", IN_PROGRESS)
      .value("ERR_INVALID_ARGS", ERR_INVALID_ARGS)
      .value("ERR_NOT_FOUND", ERR_NOT_FOUND)
      .value("ERR_RDMA_OP", ERR_RDMA_OP)
      .value("ERR_BAD_STATE", ERR_BAD_STATE)
      .value("ERR_GPU_OP", ERR_GPU_OP);

  py::class_<Status, StatusPtr> status(m, "TransferStatus",
                                       "State of one asynchronous transfer; completed exactly once by the engine.");
  status.def(py::init<>())
      .def("Code", [](const Status& s) { return Code(s.code()); }, "Current StatusCode.")
      .def("Message", [](Status& s) { return s.message(); }, "Error text ('' on success).")
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
  for (PyMethodDef& d : kStatusMethods) mori::transfer::bind::set_method(status, &d);

  m.def(
      "wait_all",
      [](const std::vector<StatusPtr>& statuses, int64_t timeout_ms) { return Code(wait_all(statuses, timeout_ms)); },
      py::arg("statuses"), py::arg("timeout_ms"), py::call_guard<py::gil_scoped_release>(),
      "Wait for every status: SUCCESS, the first failure's code, or IN_PROGRESS on timeout.");
  m.def("transfer_set_log_level", &set_log_level, py::arg("level"),
        "Log threshold of the transfer engine (logging levels: 10..50).");
  m.def("transfer_get_log_level", &log_level, "Log threshold of the transfer engine.");
}

}  // namespace mori

#include "errors.hpp"

#include <cstring>

namespace py = pybind11;

namespace mori {

[[noreturn]] void raise_error(const char* cls, const std::string& message) {
  py::object type = py::module_::import("mori.core.errors").attr(cls);
  PyErr_SetObject(type.ptr(), py::str(message).ptr());
  throw py::error_already_set();
}

[[noreturn]] void raise_os_error(const std::string& what, int err) {
  py::object type = py::module_::import("mori.core.errors").attr("MoriOSError");
  py::tuple args = py::make_tuple(err, what + ": " + std::strerror(err));
  PyErr_SetObject(type.ptr(), args.ptr());
  throw py::error_already_set();
}

std::string repr_of(py::handle v) { return py::repr(v).cast<std::string>(); }

namespace {

void require_int(py::handle v, const char* func, const char* arg) {
  if (!PyLong_Check(v.ptr()) || PyBool_Check(v.ptr()))
    raise_error("MoriTypeError", std::string(func) + ": " + arg + " has type " +
                                     Py_TYPE(v.ptr())->tp_name + "; expected an int");
}

}  // namespace

bool int_value(py::handle v, const char* func, const char* arg, long long* out) {
  require_int(v, func, arg);
  int overflow = 0;
  long long x = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
  if (x == -1 && PyErr_Occurred()) throw py::error_already_set();
  if (overflow != 0) return false;
  *out = x;
  return true;
}

bool int_value(py::handle v, const char* func, const char* arg, unsigned long long* out) {
  require_int(v, func, arg);
  int overflow = 0;
  long long s = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
  if (s == -1 && PyErr_Occurred()) throw py::error_already_set();
  if (overflow < 0 || (overflow == 0 && s < 0)) return false;  // negative
  unsigned long long x = PyLong_AsUnsignedLongLong(v.ptr());
  if (x == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();  // OverflowError: more than 64 bits
    return false;
  }
  *out = x;
  return true;
}

double float_arg(py::handle v, const char* func, const char* arg) {
  if ((!PyFloat_Check(v.ptr()) && !PyLong_Check(v.ptr())) || PyBool_Check(v.ptr()))
    raise_error("MoriTypeError", std::string(func) + ": " + arg + " has type " +
                                     Py_TYPE(v.ptr())->tp_name + "; expected a number of seconds");
  double x = PyFloat_AsDouble(v.ptr());
  if (x == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();  // an int too large for a double
    raise_error("MoriValueError", std::string(func) + ": " + arg + "=" + repr_of(v) +
                                      " is not allowed; expected a number of seconds");
  }
  return x;
}

std::string str_arg(py::handle v, const char* func, const char* arg) {
  if (!PyUnicode_Check(v.ptr()))
    raise_error("MoriTypeError", std::string(func) + ": " + arg + " has type " +
                                     Py_TYPE(v.ptr())->tp_name + "; expected a str");
  return v.cast<std::string>();
}

}  // namespace mori

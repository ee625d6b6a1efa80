// Methods in CPython's own calling convention for the calls every transfer makes (a session's
// post, its status's Wait and Succeeded). Through pybind11's dispatcher each costs ~160 ns on the
// 2-vCPU benchmark VM (TransferStatus.Init() 179 ns against 20 ns for an empty loop turn), about
// half of a 4 KiB direct copy's cost outside its system call when a post, a Wait and a
// Succeeded add up; a METH_NOARGS or METH_FASTCALL method is a plain C call. Each replaces the
// pybind11 method of the same name on the bound class (same name, arguments and docstring).
#pragma once

#include <pybind11/pybind11.h>

#include <cstring>

namespace mori::transfer::bind {

namespace py = pybind11;

// The C++ object a pybind11 instance of T holds, or nullptr with TypeError (an instance of a
// Python subclass whose __init__ never ran holds none).
template <typename T>
T* held(PyObject* self) {
  auto* inst = reinterpret_cast<py::detail::instance*>(self);
  if (inst->simple_layout) {
    if (inst->simple_holder_constructed) return static_cast<T*>(inst->simple_value_holder[0]);
  } else {
    try {
      auto vh = inst->get_value_and_holder(py::detail::get_type_info(typeid(T)));
      if (vh && vh.holder_constructed()) return vh.template value_ptr<T>();
    } catch (...) {
    }
  }
  PyErr_Format(PyExc_TypeError, "%s object is not initialized (its __init__ was not called)", Py_TYPE(self)->tp_name);
  return nullptr;
}

// Sets `def` (which must outlive the type: a static) as method `def->ml_name` of the bound class.
inline void set_method(py::handle cls, PyMethodDef* def) {
  PyObject* d = PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(cls.ptr()), def);
  if (!d) throw py::error_already_set();
  int rc = PyObject_SetAttrString(cls.ptr(), def->ml_name, d);
  Py_DECREF(d);
  if (rc != 0) throw py::error_already_set();
}

// The four arguments of a session post (vectorcall), by position or by the names in `names`:
// false with TypeError when one is missing, repeated or unknown.
inline bool four_args(const char* func, const char* const names[4], PyObject* const* args, Py_ssize_t nargsf,
                      PyObject* kwnames, PyObject* out[4]) {
  const Py_ssize_t n = PyVectorcall_NARGS(nargsf);
  if (n > 4) {
    PyErr_Format(PyExc_TypeError, "%s() takes 4 arguments (%zd given)", func, n);
    return false;
  }
  for (int i = 0; i < 4; ++i) out[i] = i < n ? args[i] : nullptr;
  const Py_ssize_t nk = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  for (Py_ssize_t k = 0; k < nk; ++k) {
    const char* key = PyUnicode_AsUTF8(PyTuple_GET_ITEM(kwnames, k));
    if (!key) return false;
    int at = -1;
    for (int i = 0; i < 4; ++i)
      if (std::strcmp(key, names[i]) == 0) at = i;
    if (at < 0 || out[at]) {
      PyErr_Format(PyExc_TypeError, "%s() got %s argument '%s'", func, at < 0 ? "an unexpected" : "a repeated", key);
      return false;
    }
    out[at] = args[n + k];
  }
  for (int i = 0; i < 4; ++i)
    if (!out[i]) {
      PyErr_Format(PyExc_TypeError, "%s() missing argument '%s'", func, names[i]);
      return false;
    }
  return true;
}

}  // namespace mori::transfer::bind

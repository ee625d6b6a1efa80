// Errors of the native module: every one is a class of mori.core.errors, so callers catch one
// hierarchy (MoriError) whether a check failed in Python or here. Arguments arrive as Python
// objects and are converted here, so a wrong type or an out-of-range int is a named MoriTypeError /
// MoriValueError, never pybind11's generic TypeError or RuntimeError.
//
// Every function here needs the GIL.
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

namespace mori {

// Raise mori.core.errors.<cls>(message).
[[noreturn]] void raise_error(const char* cls, const std::string& message);
// Raise mori.core.errors.MoriOSError(err, "<what>: <strerror(err)>").
[[noreturn]] void raise_os_error(const std::string& what, int err);

// The repr() of a Python object, for messages.
std::string repr_of(pybind11::handle v);

// A Python int (not a bool) as a 64-bit value: false if it does not fit. MoriTypeError if `v` is
// not an int.
bool int_value(pybind11::handle v, const char* func, const char* arg, long long* out);
bool int_value(pybind11::handle v, const char* func, const char* arg, unsigned long long* out);

// A Python int that fits T, if it does; MoriTypeError if `v` is not an int.
template <typename T>
bool fits(pybind11::handle v, const char* func, const char* arg, T* out) {
  static_assert(std::is_integral_v<T> && sizeof(T) <= 8);
  if constexpr (std::is_signed_v<T>) {
    long long x = 0;
    if (!int_value(v, func, arg, &x) || x < static_cast<long long>(std::numeric_limits<T>::min()) ||
        x > static_cast<long long>(std::numeric_limits<T>::max()))
      return false;
    *out = static_cast<T>(x);
  } else {
    unsigned long long x = 0;
    if (!int_value(v, func, arg, &x) || x > static_cast<unsigned long long>(std::numeric_limits<T>::max()))
      return false;
    *out = static_cast<T>(x);
  }
  return true;
}

// An int argument that must fit T: MoriValueError "func: arg=V is not allowed; expected ..." if not.
template <typename T>
T int_arg(pybind11::handle v, const char* func, const char* arg) {
  T out{};
  if (!fits<T>(v, func, arg, &out)) {
    raise_error("MoriValueError", std::string(func) + ": " + arg + "=" + repr_of(v) +
                                      " is not allowed; expected an int in [" +
                                      std::to_string(std::numeric_limits<T>::min()) + ", " +
                                      std::to_string(std::numeric_limits<T>::max()) + "]");
  }
  return out;
}

// A number of seconds (int or float); MoriTypeError otherwise.
double float_arg(pybind11::handle v, const char* func, const char* arg);
// A str argument; MoriTypeError otherwise.
std::string str_arg(pybind11::handle v, const char* func, const char* arg);

}  // namespace mori

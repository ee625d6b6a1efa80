// mori.core._core: the native boundary of mori-core. It holds no libtorch and no GPU runtime;
// memory crosses as integer addresses, so one build serves every torch version.
#include <exception>
#include <new>
#include <stdexcept>

#include "registry.hpp"

namespace py = pybind11;

PYBIND11_MODULE(_core, m) {
  m.doc() =
      "Native helpers of mori-core: POSIX shared-memory segments, host atomics and waits, the transport contract, "
      "the one-sided transfer engine (TCP), the GPU copy queue, the staging copier and the SHMEM proxy.";

  // Native errors surface as the MORI error hierarchy: std::invalid_argument as MoriValueError
  // (also a ValueError), any other std::exception as MoriBackendError (also a RuntimeError).
  // pybind11's own exceptions (py::type_error, ...) keep their builtin types; memory stays MemoryError.
  {
    py::module_ errors = py::module_::import("mori.core.errors");
    static PyObject* value_error = py::object(errors.attr("MoriValueError")).release().ptr();
    static PyObject* backend_error = py::object(errors.attr("MoriBackendError")).release().ptr();
    py::register_exception_translator([](std::exception_ptr p) {
      try {
        if (p) std::rethrow_exception(p);
      } catch (const py::builtin_exception&) {
        throw;
      } catch (const py::error_already_set&) {
        throw;
      } catch (const std::bad_alloc&) {
        throw;
      } catch (const std::invalid_argument& e) {
        PyErr_SetString(value_error, e.what());
      } catch (const std::exception& e) {
        PyErr_SetString(backend_error, e.what());
      }
    });
  }

  mori::register_shm_segment(m);
  mori::register_atomics(m);
  mori::register_copy(m);
  mori::register_transport(m);
  mori::register_transfer_status(m);
  mori::register_tcp_engine(m);
  mori::register_xgmi_queue(m);
  mori::register_rma_queue(m);
  mori::register_tcp_transport(m);
  mori::register_proxy(m);
#ifdef MORI_TEST_HOOKS
  mori::register_test_hooks(m);
#endif
}

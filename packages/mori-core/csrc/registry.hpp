// Each component of the extension registers its bindings here; module.cpp only calls them.
#pragma once
#include <pybind11/pybind11.h>

namespace mori {
void register_shm_segment(pybind11::module_& m);
void register_atomics(pybind11::module_& m);
void register_copy(pybind11::module_& m);
void register_transport(pybind11::module_& m);
void register_transfer_status(pybind11::module_& m);
void register_tcp_engine(pybind11::module_& m);
void register_xgmi_queue(pybind11::module_& m);
void register_rma_queue(pybind11::module_& m);
void register_tcp_transport(pybind11::module_& m);
void register_proxy(pybind11::module_& m);
#ifdef MORI_TEST_HOOKS
void register_test_hooks(pybind11::module_& m);  // test builds only (CMake option MORI_TEST_HOOKS)
#endif
}  // namespace mori

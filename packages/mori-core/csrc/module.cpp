// mori.core._core: the native boundary of mori-core. It holds no libtorch and no GPU runtime;
// memory crosses as integer addresses, so one build serves every torch version.
#include "registry.hpp"

PYBIND11_MODULE(_core, m) {
  m.doc() = "Native helpers of mori-core: POSIX shared-memory segments, host atomics and waits, the transport contract.";
  mori::register_shm_segment(m);
  mori::register_atomics(m);
  mori::register_copy(m);
  mori::register_transport(m);
}

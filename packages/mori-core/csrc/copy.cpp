// Byte copies between mapped addresses, for transfers too small to be worth a torch dispatch.
// Larger ones go through torch's copy, which runs on all intra-op threads.
#include <cstdint>
#include <cstring>

#include "registry.hpp"

namespace py = pybind11;

namespace mori {

void register_copy(py::module_& m) {
  m.def(
      "copy",
      [](std::uintptr_t dst, std::uintptr_t src, std::size_t nbytes) {
        if (nbytes == 0) return;
        if (dst == 0 || src == 0) throw py::value_error("copy: null address");
        py::gil_scoped_release nogil;
        std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), nbytes);
      },
      py::arg("dst"), py::arg("src"), py::arg("nbytes"),
      "memmove(dst, src, nbytes) with the GIL released; overlapping ranges are fine.");
}

}  // namespace mori

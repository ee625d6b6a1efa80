// Byte copies between mapped addresses, for transfers too small to be worth a torch dispatch.
// Larger ones go through torch's copy, which runs on all intra-op threads.
#include <cstdint>
#include <cstring>

#include "errors.hpp"
#include "registry.hpp"

namespace py = pybind11;

namespace mori {

void register_copy(py::module_& m) {
  m.def(
      "copy",
      [](py::handle dst_arg, py::handle src_arg, py::handle nbytes_arg) {
        const auto dst = int_arg<std::uintptr_t>(dst_arg, "copy", "dst");
        const auto src = int_arg<std::uintptr_t>(src_arg, "copy", "src");
        const auto nbytes = int_arg<std::size_t>(nbytes_arg, "copy", "nbytes");
        if (nbytes == 0) return;
        if (dst == 0 || src == 0) raise_error("MoriValueError", "copy: null address");
        if (dst + nbytes < dst || src + nbytes < src)
          raise_error("MoriValueError", "copy: nbytes=" + std::to_string(nbytes) +
                                            " runs past the end of the address space");
        py::gil_scoped_release nogil;
        std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), nbytes);
      },
      py::arg("dst"), py::arg("src"), py::arg("nbytes"),
      "memmove(dst, src, nbytes) with the GIL released; overlapping ranges are fine.");
}

}  // namespace mori

// POSIX shared-memory segments backing the CPU symmetric heap.
//
// A rank creates its segment, every peer on the node maps it, and once all have mapped it the
// name is unlinked: from then on the memory lives exactly as long as some process maps it, so a
// rank killed with SIGKILL leaves nothing behind in /dev/shm.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <limits>
#include <string>

#include "errors.hpp"
#include "fd.hpp"
#include "registry.hpp"

namespace py = pybind11;

namespace mori {
namespace {

// Every mapping starts on a kMapAlign boundary, so an allocation aligned within the heap is
// aligned in every process's address space too (up to kMapAlign), whatever mmap would pick.
constexpr std::size_t kMapAlign = std::size_t{2} << 20;

std::string quoted(const std::string& name) { return "'" + name + "'"; }

// Map `size` bytes of `fd` at a kMapAlign-aligned address.
Mapping map_fd(const UniqueFd& fd, std::size_t size, const std::string& name) {
  const std::size_t span = size + kMapAlign;
  void* reserve = mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (reserve == MAP_FAILED) raise_os_error("mmap (address reservation) for " + quoted(name), errno);
  Mapping reservation(reserve, span);
  const auto start = reinterpret_cast<std::uintptr_t>(reserve);
  const std::uintptr_t aligned = (start + kMapAlign - 1) & ~(kMapAlign - 1);
  void* addr = mmap(reinterpret_cast<void*>(aligned), size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                    fd.get(), 0);
  if (addr == MAP_FAILED) raise_os_error("mmap of shared-memory segment " + quoted(name), errno);
  // The segment now covers [aligned, aligned + size) of the reservation: give back its head and tail.
  reservation.release();
  if (aligned > start) munmap(reserve, aligned - start);
  const std::uintptr_t end = aligned + size, reserve_end = start + span;
  if (reserve_end > end) munmap(reinterpret_cast<void*>(end), reserve_end - end);
  return Mapping(addr, size);
}

std::size_t size_arg(py::handle v, const char* func) {
  auto size = int_arg<std::size_t>(v, func, "size");
  if (size == 0 || size > static_cast<std::size_t>(std::numeric_limits<off_t>::max()) - kMapAlign)
    raise_error("MoriValueError", std::string(func) + ": size=" + std::to_string(size) +
                                      " is not allowed; expected a number of bytes > 0");
  return size;
}

std::uintptr_t create_segment(py::handle name_arg, py::handle size_arg_) {
  const std::string name = str_arg(name_arg, "shm_create", "name");
  const std::size_t size = size_arg(size_arg_, "shm_create");
  UniqueFd fd(shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600));
  if (!fd) raise_os_error("shm_open(create) " + quoted(name), errno);
  try {
    if (ftruncate(fd.get(), static_cast<off_t>(size)) != 0) raise_os_error("ftruncate " + quoted(name), errno);
    return map_fd(fd, size, name).release();
  } catch (...) {
    shm_unlink(name.c_str());
    throw;
  }
}

std::uintptr_t open_segment(py::handle name_arg, py::handle size_arg_) {
  const std::string name = str_arg(name_arg, "shm_open", "name");
  const std::size_t size = size_arg(size_arg_, "shm_open");
  UniqueFd fd(shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600));
  if (!fd) raise_os_error("shm_open(open) " + quoted(name), errno);
  struct stat st {};
  if (fstat(fd.get(), &st) != 0) raise_os_error("fstat " + quoted(name), errno);
  if (static_cast<std::size_t>(st.st_size) < size)
    raise_error("MoriValueError", "shared-memory segment " + quoted(name) + " holds " +
                                      std::to_string(st.st_size) + " bytes, fewer than the " +
                                      std::to_string(size) + " expected");
  return map_fd(fd, size, name).release();
}

void unmap(py::handle addr_arg, py::handle size_arg_) {
  const auto addr = int_arg<std::uintptr_t>(addr_arg, "shm_unmap", "addr");
  const auto size = int_arg<std::size_t>(size_arg_, "shm_unmap", "size");
  if (munmap(reinterpret_cast<void*>(addr), size) != 0) raise_os_error("munmap", errno);
}

bool unlink_segment(py::handle name_arg) {
  const std::string name = str_arg(name_arg, "shm_unlink", "name");
  if (shm_unlink(name.c_str()) == 0) return true;
  if (errno == ENOENT) return false;
  raise_os_error("shm_unlink " + quoted(name), errno);
}

}  // namespace

void register_shm_segment(py::module_& m) {
  m.attr("SHM_MAP_ALIGN") = kMapAlign;
  m.def("shm_create", &create_segment, py::arg("name"), py::arg("size"),
        "Create (exclusively) and map a POSIX shared-memory segment of `size` bytes; return its address.");
  m.def("shm_open", &open_segment, py::arg("name"), py::arg("size"),
        "Map an existing segment created by another process; return its address in this process.");
  m.def("shm_unmap", &unmap, py::arg("addr"), py::arg("size"), "Unmap a mapping made by shm_create/shm_open.");
  m.def("shm_unlink", &unlink_segment, py::arg("name"),
        "Remove the segment's name. Returns False if it was already gone. Mappings stay valid.");
}

}  // namespace mori

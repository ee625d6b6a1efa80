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
#include <cstring>
#include <string>

#include "registry.hpp"

namespace py = pybind11;

namespace mori {
namespace {

[[noreturn]] void raise_os_error(const std::string& what, const std::string& name, int err) {
  PyErr_SetObject(PyExc_OSError,
                  py::make_tuple(err, what + " '" + name + "': " + std::strerror(err)).ptr());
  throw py::error_already_set();
}

// Every mapping starts on a kMapAlign boundary, so an allocation aligned within the heap is
// aligned in every process's address space too (up to kMapAlign), whatever mmap would pick.
constexpr std::size_t kMapAlign = std::size_t{2} << 20;

void* map_fd(int fd, std::size_t size, const std::string& name) {
  const std::size_t span = size + kMapAlign;
  void* reserve = mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (reserve == MAP_FAILED) {
    int err = errno;
    close(fd);
    raise_os_error("mmap (address reservation) for", name, err);
  }
  const auto start = reinterpret_cast<std::uintptr_t>(reserve);
  const std::uintptr_t aligned = (start + kMapAlign - 1) & ~(kMapAlign - 1);
  void* addr = mmap(reinterpret_cast<void*>(aligned), size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
  int err = errno;
  close(fd);
  if (addr == MAP_FAILED) {
    munmap(reserve, span);
    raise_os_error("mmap of shared-memory segment", name, err);
  }
  // give back the unused head and tail of the reservation
  if (aligned > start) munmap(reserve, aligned - start);
  const std::uintptr_t end = aligned + size, reserve_end = start + span;
  if (reserve_end > end) munmap(reinterpret_cast<void*>(end), reserve_end - end);
  return addr;
}

std::uintptr_t create_segment(const std::string& name, std::size_t size) {
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) raise_os_error("shm_open(create)", name, errno);
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    int err = errno;
    close(fd);
    shm_unlink(name.c_str());
    raise_os_error("ftruncate", name, err);
  }
  return reinterpret_cast<std::uintptr_t>(map_fd(fd, size, name));
}

std::uintptr_t open_segment(const std::string& name, std::size_t size) {
  int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) raise_os_error("shm_open(open)", name, errno);
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    int err = errno;
    close(fd);
    raise_os_error("fstat", name, err);
  }
  if (static_cast<std::size_t>(st.st_size) < size) {
    close(fd);
    throw py::value_error("shared-memory segment '" + name + "' holds " + std::to_string(st.st_size) +
                          " bytes, fewer than the " + std::to_string(size) + " expected");
  }
  return reinterpret_cast<std::uintptr_t>(map_fd(fd, size, name));
}

void unmap(std::uintptr_t addr, std::size_t size) {
  if (munmap(reinterpret_cast<void*>(addr), size) != 0) raise_os_error("munmap", "<mapping>", errno);
}

bool unlink_segment(const std::string& name) {
  if (shm_unlink(name.c_str()) == 0) return true;
  if (errno == ENOENT) return false;
  raise_os_error("shm_unlink", name, errno);
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

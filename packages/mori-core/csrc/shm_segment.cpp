// POSIX shared-memory segments backing the CPU symmetric heap.
//
// A rank creates its segment, every peer on the node maps it, and once all have mapped it the
// name is unlinked: from then on the memory lives exactly as long as some process maps it, so a
// rank killed with SIGKILL after that leaves nothing behind in /dev/shm.
//
// A rank killed *before* that leaves a name, which a later init removes. Whether a name is dead
// is decided by a lock, never by a pid (pids mean nothing across PID namespaces, and containers
// often share one /dev/shm): the creator holds a shared flock() on the segment from before it has
// a size until its name is gone. A name is stale only if an exclusive lock can be taken on it,
// i.e. no process holds the creator's lock, and it has a size (a size-0 segment may be one whose
// creator is between shm_open and flock), or it is older than kFreshSeconds. The kernel drops the
// lock when the creator dies however it dies; flock() works across PID and mount namespaces that
// share the filesystem.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <limits>
#include <memory>
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
// A size-0 segment younger than this may be one being created right now.
constexpr time_t kFreshSeconds = 60;
// How long a creator waits for its own lock (a sweeper holds it for microseconds).
constexpr int kLockTries = 2000;

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

// Take the creator's shared lock; a sweeper probing the new name may hold its exclusive one for
// a moment.
bool lock_shared(const UniqueFd& fd) {
  for (int i = 0; i < kLockTries; ++i) {
    if (flock(fd.get(), LOCK_SH | LOCK_NB) == 0) return true;
    if (errno != EWOULDBLOCK && errno != EINTR) return false;
    timespec ts{0, 500000};
    nanosleep(&ts, nullptr);
  }
  errno = EWOULDBLOCK;
  return false;
}

// A mapped segment: created here (holding the creator's lock while its name exists) or opened.
class SharedMemory {
 public:
  static std::unique_ptr<SharedMemory> create(py::handle name_arg, py::handle size_arg_) {
    auto self = std::unique_ptr<SharedMemory>(new SharedMemory());
    self->name_ = str_arg(name_arg, "SharedMemory.create", "name");
    const std::size_t size = size_arg(size_arg_, "SharedMemory.create");
    const std::string& name = self->name_;
    UniqueFd fd(shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600));
    if (!fd) raise_os_error("shm_open(create) " + quoted(name), errno);
    self->linked_ = true;  // from here on, an error path removes the name (the destructor)
    if (!lock_shared(fd)) raise_os_error("flock(LOCK_SH) of new segment " + quoted(name), errno);
    if (ftruncate(fd.get(), static_cast<off_t>(size)) != 0) raise_os_error("ftruncate " + quoted(name), errno);
    self->map_ = map_fd(fd, size, name);
    self->lock_ = std::move(fd);
    return self;
  }

  static std::unique_ptr<SharedMemory> open(py::handle name_arg, py::handle size_arg_) {
    auto self = std::unique_ptr<SharedMemory>(new SharedMemory());
    self->name_ = str_arg(name_arg, "SharedMemory.open", "name");
    const std::size_t size = size_arg(size_arg_, "SharedMemory.open");
    const std::string& name = self->name_;
    UniqueFd fd(shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600));
    if (!fd) raise_os_error("shm_open(open) " + quoted(name), errno);
    struct stat st {};
    if (fstat(fd.get(), &st) != 0) raise_os_error("fstat " + quoted(name), errno);
    if (static_cast<std::size_t>(st.st_size) < size)
      raise_error("MoriValueError", "shared-memory segment " + quoted(name) + " holds " +
                                        std::to_string(st.st_size) + " bytes, fewer than the " +
                                        std::to_string(size) + " expected");
    self->map_ = map_fd(fd, size, name);
    return self;  // the descriptor closes here: the mapping keeps the memory
  }

  SharedMemory(const SharedMemory&) = delete;
  SharedMemory& operator=(const SharedMemory&) = delete;
  ~SharedMemory() {
    if (linked_) shm_unlink(name_.c_str());
  }

  std::uintptr_t addr() const { return map_.addr(); }
  std::size_t size() const { return map_.size(); }
  const std::string& name() const { return name_; }
  bool linked() const { return linked_; }

  // Remove the name (created here), then drop the creator's lock. False if it was already gone.
  bool unlink() {
    if (!linked_) return false;
    linked_ = false;
    const bool removed = shm_unlink(name_.c_str()) == 0;
    const int err = errno;
    lock_.reset();
    if (!removed && err != ENOENT) raise_os_error("shm_unlink " + quoted(name_), err);
    return removed;
  }

  // unlink() if created here and still named, then unmap. Idempotent.
  void close() {
    unlink();
    if (map_.reset() != 0) raise_os_error("munmap of " + quoted(name_), errno);
  }

 private:
  SharedMemory() = default;
  std::string name_;
  Mapping map_;
  UniqueFd lock_;
  bool linked_ = false;
};

// Whether `name` is a segment no live process holds the creator's lock of; if `remove`, unlink
// it while holding the exclusive lock (so its creator cannot be between checks).
bool stale(py::handle name_arg, bool remove, const char* func) {
  const std::string name = str_arg(name_arg, func, "name");
  UniqueFd fd(shm_open(name.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW, 0));
  if (!fd) return false;  // gone, or not ours to open (another user's): not ours to judge
  struct stat st {};
  if (fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
  if (flock(fd.get(), LOCK_EX | LOCK_NB) != 0) return false;  // its creator (or a child) holds it
  if (st.st_size == 0 && time(nullptr) - st.st_ctime < kFreshSeconds) return false;
  if (!remove) return true;
  if (shm_unlink(name.c_str()) == 0) return true;
  if (errno == ENOENT) return false;
  raise_os_error("shm_unlink " + quoted(name), errno);
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
  py::class_<SharedMemory>(m, "SharedMemory",
                           "A POSIX shared-memory segment mapped at a SHM_MAP_ALIGN-aligned address.")
      .def_static("create", &SharedMemory::create, py::arg("name"), py::arg("size"),
                  "Create (exclusively) and map a segment of `size` bytes. Until unlink(), this process "
                  "holds the creator's lock on it, which tells other processes it is alive.")
      .def_static("open", &SharedMemory::open, py::arg("name"), py::arg("size"),
                  "Map an existing segment created by another process.")
      .def_property_readonly("addr", &SharedMemory::addr, "Address of the mapping in this process (0: closed).")
      .def_property_readonly("size", &SharedMemory::size, "Bytes mapped (0: closed).")
      .def_property_readonly("name", &SharedMemory::name)
      .def_property_readonly("linked", &SharedMemory::linked, "Created here and its name not yet removed.")
      .def("unlink", &SharedMemory::unlink,
           "Remove the name of a segment created here, then drop its lock; False if it was gone. "
           "Mappings stay valid.")
      .def("close", &SharedMemory::close, "unlink() if created here, then unmap. Idempotent.");
  m.def(
      "shm_is_stale", [](py::handle name) { return stale(name, false, "shm_is_stale"); }, py::arg("name"),
      "Whether the segment's creator is gone (no process holds its lock) and it was left named.");
  m.def(
      "shm_unlink_if_stale", [](py::handle name) { return stale(name, true, "shm_unlink_if_stale"); },
      py::arg("name"), "Unlink the segment if shm_is_stale(name); returns whether it was removed.");
  m.def("shm_unlink", &unlink_segment, py::arg("name"),
        "Remove the segment's name. Returns False if it was already gone. Mappings stay valid.");
}

}  // namespace mori

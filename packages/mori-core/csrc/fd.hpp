// RAII owners of the kernel resources the native module holds: a file descriptor and a mapping.
// Each closes what it owns exactly once, on every path out, errors included.
#pragma once
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <utility>

namespace mori {

// Sole owner of a file descriptor (-1: none).
class UniqueFd {
 public:
  UniqueFd() noexcept = default;
  explicit UniqueFd(int fd) noexcept : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    reset(other.release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  int release() noexcept { return std::exchange(fd_, -1); }
  void reset(int fd = -1) noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

// Sole owner of the mapping [addr, addr + size) (size 0: none).
class Mapping {
 public:
  Mapping() noexcept = default;
  Mapping(void* addr, std::size_t size) noexcept : addr_(addr), size_(size) {}
  Mapping(Mapping&& other) noexcept : addr_(other.addr_), size_(std::exchange(other.size_, 0)) {}
  Mapping& operator=(Mapping&& other) noexcept {
    if (this != &other) {
      reset();
      addr_ = other.addr_;
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() { reset(); }

  std::uintptr_t addr() const noexcept { return size_ ? reinterpret_cast<std::uintptr_t>(addr_) : 0; }
  std::size_t size() const noexcept { return size_; }
  // Give up ownership (the caller unmaps, or the mapping lives until exit); returns the address.
  std::uintptr_t release() noexcept {
    const std::uintptr_t a = addr();
    size_ = 0;
    return a;
  }
  // Unmap now; returns munmap's result (0, or -1 with errno set).
  int reset() noexcept {
    int rc = 0;
    if (size_ != 0) rc = munmap(addr_, size_);
    size_ = 0;
    return rc;
  }

 private:
  void* addr_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace mori

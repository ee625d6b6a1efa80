// Small system helpers the engine's files share: process handles (pidfds) and random ids.
#pragma once

#include <poll.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#include <cstdint>

#include "auth.hpp"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

namespace mori::transfer {

inline int pidfd_open(pid_t pid) { return int(::syscall(SYS_pidfd_open, pid, 0)); }

// A pidfd becomes readable when its process has exited.
inline bool process_gone(int pidfd) {
  if (pidfd < 0) return false;
  pollfd p{pidfd, POLLIN, 0};
  return ::poll(&p, 1, 0) > 0;
}

// A random nonzero 64-bit value (ids of regions, slot tokens).
inline uint64_t random_u64() {
  uint64_t v = 0;
  while (v == 0) random_bytes(&v, sizeof v);
  return v;
}

}  // namespace mori::transfer

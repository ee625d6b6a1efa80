// The engine's log: lines on stderr at or above set_log_level()'s threshold (Python logging levels).
#pragma once

#include <atomic>
#include <cstdio>

namespace mori::transfer {

extern std::atomic<int> g_log_level;

#define MORI_IO_LOG(level, ...)                           \
  do {                                                    \
    if ((level) >= ::mori::transfer::g_log_level.load()) {      \
      std::fprintf(stderr, "[mori.io] " __VA_ARGS__);     \
      std::fputc('\n', stderr);                           \
    }                                                     \
  } while (0)

}  // namespace mori::transfer

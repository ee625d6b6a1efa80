// The transfer engine's log threshold (log.hpp).
#include "engine.hpp"
#include "log.hpp"

namespace mori::transfer {

std::atomic<int> g_log_level{30};

void set_log_level(int level) { g_log_level.store(level); }
int log_level() { return g_log_level.load(); }

}  // namespace mori::transfer

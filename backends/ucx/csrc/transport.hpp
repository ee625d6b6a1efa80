// The `ucx` implementation of the transport contract (mori/transport.h).
#pragma once

#include <string>

#include "mori/transport.h"

namespace mori_ucx {

// The ops table. Its caps are filled by init_caps(); call that once UCX is loaded.
mori_tp_ops* ops_table();

// Query what the loaded UCX supports (memory types) and set ops_table()->caps. "" or why not.
std::string init_caps();

// For probe(): what UCX finds with these options (the text of ucp_context_print_info, then lines
// "memory_types: host,cuda" and "thread_mode: multi"). "" and `error` set when it cannot start.
std::string describe(const char* options, std::string& error);

}  // namespace mori_ucx

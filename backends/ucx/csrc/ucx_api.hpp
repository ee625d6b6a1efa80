// UCX's API, resolved at run time: the plugin is built against UCX's headers (from the libucx
// wheel) but links nothing of it, so importing it never fails for want of UCX; `load` dlopens
// libucp and fills this table, or says why it could not.
#pragma once

#include <ucp/api/ucp.h>

#include <string>
#include <vector>

namespace mori_ucx {

struct UcxApi {
#define MORI_UCX_FN(name) decltype(&::name) name = nullptr;
#include "ucx_functions.inc"
#undef MORI_UCX_FN
  unsigned major = 0, minor = 0, release = 0;  // of the library loaded, not of the headers
  std::string libucp_path;                     // the file libucp came from (dladdr)
  std::string libucs_path;
  bool ucm_events_disabled = false;  // we turned UCX's memory hooks off (UCX_MEM_EVENTS unset)
};

// The loaded API, or nullptr before a successful load().
const UcxApi* api();

// Load UCX once per process. `libraries`: files to dlopen in order (the wheel's libucs, libucm,
// libuct, libucp, so that their sonames bind to those copies), or one name such as "libucp.so.0"
// (the dynamic linker's search). Returns "" on success, else why not. A second call returns the
// first call's outcome if it succeeded with the same list, else an error naming the loaded files.
std::string load(const std::vector<std::string>& libraries);

// UCX's own words for a status ("Connection reset by remote peer", ...).
const char* status_string(ucs_status_t status);

}  // namespace mori_ucx

// What engine threads may ask of the scheduler, each only when the user asked for it (Manners).
#pragma once

#include <sys/types.h>

namespace mori::transfer {

// Engine threads' scheduler slice (Manners::short_slice): asks for 0.1 ms, if the kernel has
// EEVDF custom slices; nothing otherwise.
void request_short_slice();

// Moves thread `tid` (0: the calling one) to a CPU other than `cpu` among those it may run on,
// and leaves its affinity mask as it was (read before, written back after: a mask set for that
// thread by someone else in between is overwritten). False when `cpu` is the only one allowed or
// the kernel refused.
bool move_off_cpu(pid_t tid, int cpu);

}  // namespace mori::transfer

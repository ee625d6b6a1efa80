// Engine threads and the scheduler (sched.hpp): a short time slice, a move off the poster's CPU.
#include "sched.hpp"

#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace mori::transfer {

namespace {

// Engine threads may ask the scheduler for a short time slice (Manners::short_slice, off by default:
// Linux >= 6.12, EEVDF custom slices: sched_attr.sched_runtime on a SCHED_OTHER thread; no
// privilege needed). A thread with a short
// slice preempts a busy-polling neighbour when it wakes, instead of waiting out the neighbour's
// slice (a scheduler tick, ~4 ms): without it, one NIXL agent per process (its progress thread
// spins on a core) made every 4 KiB transfer on a 2-core machine take ~4 ms. Older kernels
// ignore the field or refuse the call; either way nothing else changes.
struct SchedAttr {
  uint32_t size;
  uint32_t sched_policy;
  uint64_t sched_flags;
  int32_t sched_nice;
  uint32_t sched_priority;
  uint64_t sched_runtime;
  uint64_t sched_deadline;
  uint64_t sched_period;
};

// Sets this thread's slice; returns the attributes to restore, or size 0 if nothing was changed
// (not a SCHED_OTHER thread, or a kernel without sched_setattr).
SchedAttr set_slice(uint64_t runtime_ns) {
  SchedAttr old{};
  if (::syscall(SYS_sched_getattr, 0, &old, sizeof old, 0) != 0 || old.sched_policy != 0) return SchedAttr{};
  SchedAttr attr = old;
  attr.size = sizeof attr;  // SCHED_ATTR_SIZE_VER0 (48 bytes)
  attr.sched_runtime = runtime_ns;
  if (::syscall(SYS_sched_setattr, 0, &attr, 0) != 0) return SchedAttr{};
  old.size = sizeof old;
  return old;
}

}  // namespace

void request_short_slice() { set_slice(100 * 1000); }  // 0.1 ms, the shortest the kernel accepts

bool move_off_cpu(pid_t tid, int cpu) {
  cpu_set_t allowed;
  if (cpu < 0 || cpu >= CPU_SETSIZE || ::sched_getaffinity(tid, sizeof allowed, &allowed) != 0) return false;
  cpu_set_t others = allowed;
  CPU_CLR(cpu, &others);
  // The thread leaves the CPU inside the first call; the second gives its mask back as it was.
  if (CPU_COUNT(&others) == 0 || ::sched_setaffinity(tid, sizeof others, &others) != 0) return false;
  ::sched_setaffinity(tid, sizeof allowed, &allowed);
  return true;
}

}  // namespace mori::transfer

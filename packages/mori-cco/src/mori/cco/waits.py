"""Host waits on a word for peers that share this node's cores.

The device runtime's ``wait_until`` spins a few thousand times before it yields: right when every
rank has a core of its own, wasteful when ranks outnumber the cores, because the spinning rank
holds the core the rank it waits for needs. :func:`wait_ge` first polls the word and yields the
core between polls (``sched_yield``) when this node's LSA team has more ranks than this process
may run on (its CPU affinity), then falls back to the runtime's wait, which sleeps with backoff.
It changes nothing of the process: yielding is a hint to the scheduler, not a policy.
"""

from __future__ import annotations

import os
import time

from mori.core.backend import CMP_GE, OP_FETCH, WORD_INT64, DeviceRuntime

__all__ = ["oversubscribed", "wait_ge"]

#: how long to poll-and-yield before the runtime's (sleeping) wait takes over
YIELD_FOR_S = 0.05


def oversubscribed(ranks_here: int) -> bool:
    """Whether ``ranks_here`` ranks on this node outnumber the CPUs this process may use."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return ranks_here > cpus


def wait_ge(rt: DeviceRuntime, addr: int, value: int, timeout_s: float, *, polite: bool) -> tuple[bool, int]:
    """Wait until the int64 at ``addr`` is >= ``value``; return ``(reached, last value seen)``.

    ``polite``: poll and yield first (host memory only; see the module docstring).
    """
    if polite and rt.torch_device == "cpu":
        start = time.monotonic()
        limit = min(YIELD_FOR_S, timeout_s) if timeout_s >= 0 else YIELD_FOR_S
        while True:
            seen = int(rt.atomic_rmw(addr, OP_FETCH, WORD_INT64, 0))
            if seen >= value:
                return True, seen
            if time.monotonic() - start >= limit:
                break
            os.sched_yield()
        left = -1.0 if timeout_s < 0 else max(0.0, timeout_s - (time.monotonic() - start))
        return rt.wait_until(addr, CMP_GE, WORD_INT64, value, left)
    return rt.wait_until(addr, CMP_GE, WORD_INT64, value, timeout_s)

"""Host waits on a word written by peers that share this node's cores.

The device runtime's ``wait_until`` spins a few thousand times before it yields: right when every
rank has a core of its own, wasteful when ranks outnumber the cores, because the spinning rank holds
the core that the rank it waits for needs. When this node's LSA team has more ranks than this
process may run on (its CPU affinity), :func:`wait_ge` polls and yields the core between looks for
:data:`YIELD_S`, then sleeps in the kernel (a futex on the word's low 32 bits, at most
:data:`SLEEP_S` at a time, so a writer that does not wake it, a kernel for example, delays it by that
much at worst); the host's writers call :func:`wake` after their store. Elsewhere (other systems, GPU memory) it polls, yielding the core, or uses the
runtime's wait. It changes nothing of the process.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import time

from mori.core.backend import CMP_GE, OP_FETCH, WORD_INT64, DeviceRuntime

__all__ = ["SLEEP_S", "YIELD_S", "oversubscribed", "wait_ge", "wake"]

#: a waiter first polls, yielding the core, this long (seconds); then it sleeps
YIELD_S = 2e-3
#: longest single sleep of a waiter (seconds): what a writer that does not wake it can cost
SLEEP_S = 1e-3
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine()) if sys.platform == "linux" else None


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_libc() -> ctypes.CDLL | None:
    if _SYS_FUTEX is None:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover - a Linux without a C library
        return None
    libc.syscall.restype = ctypes.c_long
    return libc


_libc = _load_libc()


def oversubscribed(ranks_here: int) -> bool:
    """Whether ``ranks_here`` ranks on this node outnumber the CPUs this process may use."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return ranks_here > cpus


def wake(addr: int) -> None:
    """Wake every process sleeping in :func:`wait_ge` on the word at ``addr`` (host memory)."""
    if _libc is not None:
        _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)


def _sleep(addr: int, seen: int, timeout_s: float) -> None:
    if _libc is None:
        os.sched_yield()
        return
    low = seen & 0xFFFFFFFF
    expected = low - (1 << 32) if low >= 1 << 31 else low  # the word's low half (little-endian)
    ts = _Timespec(0, max(1, int(timeout_s * 1e9)))
    # returns at a wake, at the timeout, or at once if the word already changed (EAGAIN)
    _libc.syscall(
        _SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_int(expected), ctypes.byref(ts), None, 0
    )


def wait_ge(rt: DeviceRuntime, addr: int, value: int, timeout_s: float, *, polite: bool) -> tuple[bool, int]:
    """Wait until the int64 at ``addr`` is >= ``value``; return ``(reached, last value seen)``.

    ``polite`` (host memory only): sleep between looks instead of spinning (module docstring).
    ``timeout_s`` < 0 waits forever.
    """
    if not (polite and rt.torch_device == "cpu"):
        return rt.wait_until(addr, CMP_GE, WORD_INT64, value, timeout_s)
    start = time.monotonic()
    deadline = None if timeout_s < 0 else start + timeout_s
    while True:
        seen = int(rt.atomic_rmw(addr, OP_FETCH, WORD_INT64, 0))
        if seen >= value:
            return True, seen
        now = time.monotonic()
        left = SLEEP_S if deadline is None else deadline - now
        if left <= 0:
            return False, seen
        if now - start < YIELD_S:
            os.sched_yield()  # a peer that is about to arrive: cheaper than a sleep and a wake
        else:
            _sleep(addr, seen, min(SLEEP_S, left))

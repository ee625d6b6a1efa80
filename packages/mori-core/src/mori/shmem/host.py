"""Host-side one-sided operations over the symmetric heap: put/get, atomics, signals, waits.

``dest``/``source``/``sig_addr``/``ivar`` are addresses of symmetric objects *as seen by this PE*
(what :func:`~mori.shmem.shmem_malloc` returned here); ``pe`` says whose copy is meant. Transfers
on the host are complete when the call returns (so :func:`shmem_quiet` only orders memory); they
run with the GIL released. Atomics and waits are native and sequentially consistent across
processes.
"""

from __future__ import annotations

from typing import Any

from mori.core.backend import (
    OP_ADD,
    OP_FETCH,
    OP_SET,
    OP_SWAP,
    WORD_INT32,
    WORD_INT64,
    WORD_UINT32,
    WORD_UINT64,
)
from mori.core.errors import MoriTimeoutError, MoriValueError, bad_value
from mori.core.transport import OP_CSWAP
from mori.shmem.context import current
from mori.shmem.network import signed_result, value_bits

#: signal operations for shmem_putmem_signal / shmem_signal_op (values as in the original)
SIGNAL_SET = 9
SIGNAL_ADD = 10

#: comparisons for shmem_wait_until
SHMEM_CMP_EQ = 0
SHMEM_CMP_NE = 1
SHMEM_CMP_GT = 2
SHMEM_CMP_GE = 3
SHMEM_CMP_LT = 4
SHMEM_CMP_LE = 5

_CMP_NAMES = {0: "==", 1: "!=", 2: ">", 3: ">=", 4: "<", 5: "<="}
# word codes of the runtime's host-access methods, and their sizes
_WORDS = {
    "int32": (WORD_INT32, 4),
    "uint32": (WORD_UINT32, 4),
    "int64": (WORD_INT64, 8),
    "uint64": (WORD_UINT64, 8),
}


def _word(func: str, dtype: Any) -> tuple[int, int]:
    name = str(dtype).removeprefix("torch.")
    if name not in _WORDS:
        raise bad_value(func, "dtype", dtype, "int32, uint32, int64 or uint64 (str or torch dtype)")
    return _WORDS[name]


def _nbytes(func: str, nbytes: Any) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise bad_value(func, "nbytes", nbytes, "a number of bytes >= 0")
    return nbytes


def shmem_putmem(dest: int, source: int, nbytes: int, pe: int) -> None:
    """Copy ``nbytes`` from local ``source`` (heap or registered buffer) to ``dest`` on PE ``pe``
    (through the network transport when ``pe`` is on another node)."""
    func = "shmem_putmem"
    ctx = current(func)
    ctx.check_pe(func, pe)
    n = _nbytes(func, nbytes)
    src = ctx.local_addr(func, "source", source, n)
    if ctx.over_network(func, pe):
        assert ctx.network is not None
        ctx.network.put(func, pe, ctx.heap_offset(func, "dest", dest, n), src, n)
        return
    ctx.runtime.copy(ctx.remote_addr(func, "dest", dest, n, pe), src, n)


def shmem_getmem(dest: int, source: int, nbytes: int, pe: int) -> None:
    """Copy ``nbytes`` from ``source`` on PE ``pe`` to local ``dest`` (heap or registered buffer)."""
    func = "shmem_getmem"
    ctx = current(func)
    ctx.check_pe(func, pe)
    n = _nbytes(func, nbytes)
    dst = ctx.local_addr(func, "dest", dest, n)
    if ctx.over_network(func, pe):
        assert ctx.network is not None
        ctx.network.get(func, pe, ctx.heap_offset(func, "source", source, n), dst, n)
        return
    ctx.runtime.copy(dst, ctx.remote_addr(func, "source", source, n, pe), n)


def shmem_putmem_signal(
    dest: int, source: int, nbytes: int, sig_addr: int, signal: int, sig_op: int, pe: int
) -> None:
    """Put, then update the uint64 signal word ``sig_addr`` on ``pe`` (after the data is visible).

    ``sig_op``: :data:`SIGNAL_SET` stores ``signal``, :data:`SIGNAL_ADD` adds it atomically.
    """
    func = "shmem_putmem_signal"
    _check_sig_op(func, sig_op)
    shmem_putmem(dest, source, nbytes, pe)
    ctx = current(func)
    ctx.runtime.fence()
    if ctx.network is not None:
        ctx.network.fence()
    shmem_signal_op(sig_addr, signal, sig_op, pe)


def shmem_signal_op(sig_addr: int, signal: int, sig_op: int, pe: int) -> None:
    """Update the uint64 signal word ``sig_addr`` on PE ``pe``: set (SIGNAL_SET) or add (SIGNAL_ADD)."""
    func = "shmem_signal_op"
    _check_sig_op(func, sig_op)
    _amo(func, sig_addr, pe, OP_SET if sig_op == SIGNAL_SET else OP_ADD, signal, "uint64")


def shmem_signal_fetch(sig_addr: int) -> int:
    """Read this PE's uint64 signal word ``sig_addr``."""
    return _amo("shmem_signal_fetch", sig_addr, current("shmem_signal_fetch").my_pe, OP_FETCH, 0, "uint64")


def _check_sig_op(func: str, sig_op: Any) -> None:
    if sig_op not in (SIGNAL_SET, SIGNAL_ADD):
        raise bad_value(func, "sig_op", sig_op, "SIGNAL_SET (9) or SIGNAL_ADD (10)")


def _amo(func: str, dest: int, pe: int, op: int, value: int, dtype: Any) -> int:
    ctx = current(func)
    ctx.check_pe(func, pe)
    code, size = _word(func, dtype)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_value(func, "value", value, f"an int that fits {dtype}")
    if ctx.over_network(func, pe):
        assert ctx.network is not None
        _fits(func, value, code, dtype)
        off = ctx.heap_offset(func, "dest", dest, size)
        old = ctx.network.atomic(func, pe, off, op, code, value_bits(value, code))
        return signed_result(old, code)
    addr = ctx.remote_addr(func, "dest", dest, size, pe)
    try:
        return int(ctx.runtime.atomic_rmw(addr, op, code, value))
    except (ValueError, OverflowError, TypeError) as e:
        raise MoriValueError(f"{func}: {e} (dest={dest:#x}, value={value}, dtype={dtype})") from None


def shmem_atomic_fetch(dest: int, pe: int, *, dtype: Any = "int64") -> int:
    """Atomically read the word at ``dest`` on ``pe``."""
    return _amo("shmem_atomic_fetch", dest, pe, OP_FETCH, 0, dtype)


def shmem_atomic_set(dest: int, value: int, pe: int, *, dtype: Any = "int64") -> None:
    """Atomically store ``value`` at ``dest`` on ``pe``."""
    _amo("shmem_atomic_set", dest, pe, OP_SET, value, dtype)


def shmem_atomic_add(dest: int, value: int, pe: int, *, dtype: Any = "int64") -> None:
    """Atomically add ``value`` to the word at ``dest`` on ``pe`` (wraps on overflow)."""
    _amo("shmem_atomic_add", dest, pe, OP_ADD, value, dtype)


def shmem_atomic_fetch_add(dest: int, value: int, pe: int, *, dtype: Any = "int64") -> int:
    """Atomically add ``value`` at ``dest`` on ``pe``; return the previous value."""
    return _amo("shmem_atomic_fetch_add", dest, pe, OP_ADD, value, dtype)


def shmem_atomic_swap(dest: int, value: int, pe: int, *, dtype: Any = "int64") -> int:
    """Atomically replace the word at ``dest`` on ``pe`` with ``value``; return the previous value."""
    return _amo("shmem_atomic_swap", dest, pe, OP_SWAP, value, dtype)


def shmem_atomic_compare_swap(dest: int, cond: int, value: int, pe: int, *, dtype: Any = "int64") -> int:
    """If the word at ``dest`` on ``pe`` equals ``cond``, replace it with ``value``. Returns the
    value found (equal to ``cond`` exactly when the swap happened)."""
    func = "shmem_atomic_compare_swap"
    ctx = current(func)
    ctx.check_pe(func, pe)
    code, size = _word(func, dtype)
    if ctx.over_network(func, pe):
        assert ctx.network is not None
        for arg, v in (("cond", cond), ("value", value)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise bad_value(func, arg, v, f"an int that fits {dtype}")
            _fits(func, v, code, dtype)
        off = ctx.heap_offset(func, "dest", dest, size)
        old = ctx.network.atomic(
            func, pe, off, OP_CSWAP, code, value_bits(value, code), value_bits(cond, code)
        )
        return signed_result(old, code)
    addr = ctx.remote_addr(func, "dest", dest, size, pe)
    try:
        return int(ctx.runtime.atomic_compare_swap(addr, code, cond, value))
    except (ValueError, OverflowError, TypeError) as e:
        raise MoriValueError(
            f"{func}: {e} (dest={dest:#x}, cond={cond}, value={value}, dtype={dtype})"
        ) from None


def shmem_wait_until(
    ivar: int, cmp: int, value: int, *, dtype: Any = "int64", timeout: float | None = None
) -> int:
    """Block until this PE's word at ``ivar`` satisfies ``word <cmp> value``; return the word.

    ``cmp``: one of ``SHMEM_CMP_EQ/NE/GT/GE/LT/LE``. ``timeout``: seconds; None means
    ``MORI_BOOTSTRAP_TIMEOUT``; a negative value waits forever. Raises
    :class:`~mori.core.errors.MoriTimeoutError` with the last value seen. Releases the GIL.
    """
    func = "shmem_wait_until"
    ctx = current(func)
    if cmp not in _CMP_NAMES:
        raise bad_value(func, "cmp", cmp, "SHMEM_CMP_EQ, _NE, _GT, _GE, _LT or _LE (0-5)")
    code, size = _word(func, dtype)
    addr = ctx.remote_addr(func, "ivar", ivar, size, ctx.my_pe)
    limit = ctx.timeout_s if timeout is None else float(timeout)
    try:
        ok, last = ctx.runtime.wait_until(addr, cmp, code, value, limit)
    except (ValueError, OverflowError, TypeError) as e:
        raise MoriValueError(f"{func}: {e} (ivar={ivar:#x}, value={value}, dtype={dtype})") from None
    if not ok:
        raise MoriTimeoutError(
            f"{func}: word at {ivar:#x} on PE {ctx.my_pe} is {last}, still not {_CMP_NAMES[cmp]} {value} "
            f"after {limit:g} s"
        )
    return int(last)


def shmem_fence() -> None:
    """Order this PE's puts: those before reach their targets before those after. With PEs on
    other nodes it also waits for the proxy (device-initiated operations), as :func:`shmem_quiet`."""
    func = "shmem_fence"
    ctx = current(func)
    ctx.runtime.fence()
    if ctx.network is not None:
        ctx.network.fence()
        ctx.network.quiet(func)


def shmem_quiet() -> None:
    """Complete every outstanding put and atomic of this PE: host transfers are already complete
    at return (this is the memory barrier that makes them visible); operations that device code
    handed to the proxy (PEs on other nodes) are waited for, bounded by ``MORI_BOOTSTRAP_TIMEOUT``.
    Raises :class:`~mori.core.errors.MoriBackendError` naming the PE if the proxy refused or failed
    a request."""
    func = "shmem_quiet"
    ctx = current(func)
    ctx.runtime.fence()
    if ctx.network is not None:
        ctx.network.fence()
        ctx.network.quiet(func)


_RANGES = {
    WORD_INT32: (-(1 << 31), (1 << 31) - 1),
    WORD_UINT32: (0, (1 << 32) - 1),
    WORD_INT64: (-(1 << 63), (1 << 63) - 1),
    WORD_UINT64: (0, (1 << 64) - 1),
}


def _fits(func: str, value: int, code: int, dtype: Any) -> None:
    lo, hi = _RANGES[code]
    if not lo <= value <= hi:
        raise MoriValueError(f"{func}: value {value} does not fit the atomic word (dtype={dtype})")

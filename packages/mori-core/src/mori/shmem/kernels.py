# Jitted functions carry no Python annotations (Triton reads them), so mypy may not ask for them:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Ready-made Triton kernels over the device API, and the host functions that launch them.

:func:`put`, :func:`get` and :func:`put_signal` copy a symmetric tensor to or from a peer with a
grid of programs, each copying its own chunk; :func:`barrier` is the device barrier on the current
stream. They launch on the runtime's device: real GPUs, or CPU tensors when ``TRITON_INTERPRET=1``
was set before Triton was imported. On a GPU they return once the launch is queued (stream
order); under the interpreter, once it has run.

A PE of another node is served by the proxy (see :mod:`mori.shmem.device`): the kernels then quiet
before they end, so completion means the same; the local tensor (``src`` of a put, ``dst`` of a
get) must be symmetric heap memory or registered with ``shmem_buffer_register``.

Every kernel lists its ahead-of-time variants (:func:`mori.core.kernels.aot`). The host
functions view the data as the widest of int64 / int32 / int16 / uint8 that the byte count and
both addresses allow, so the kernels see only those four element types and copy whole words.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import triton
import triton.language as tl

from mori.core.errors import MoriStateError, bad_type, bad_value
from mori.core.kernels import aot, aot_variants
from mori.shmem import device as shd
from mori.shmem.context import ShmemContext, current

if TYPE_CHECKING:
    import torch

__all__ = [
    "barrier",
    "barrier_kernel",
    "get",
    "get_kernel",
    "put",
    "put_kernel",
    "put_signal",
    "put_signal_kernel",
]

#: default elements per iteration of one program, and most programs per launch
DEFAULT_BLOCK = 1024
DEFAULT_MAX_PROGRAMS = 64

_WORD_TYPES = ("*i64", "*i32", "*i16", "*u8")
_SIG_TYPES = ("*i64", "*u64")


def _copy_variants() -> list[dict[str, Any]]:
    # one variant per element type the host functions launch with
    sig = {
        "dst_ptr": "",
        "src_ptr": "",
        "ctx_ptr": "*i64",
        "n_elems": "i64",
        "elems_per_program": "i64",
        "pe": "i32",
    }
    return [
        {
            "signature": {**sig, "dst_ptr": t, "src_ptr": t},
            "constexprs": {"BLOCK": DEFAULT_BLOCK},
            "aligned": ("dst_ptr", "src_ptr", "ctx_ptr"),
            "label": f"{t[1:]} BLOCK={DEFAULT_BLOCK}",
        }
        for t in _WORD_TYPES
    ]


# -- kernels ------------------------------------------------------------------------------------------


@aot_variants(_copy_variants())
@triton.jit
def put_kernel(
    # pointers: destination (this PE's address of a symmetric object), local source, shmem context
    dst_ptr,
    src_ptr,
    ctx_ptr,
    # sizes, in elements: the whole copy, and one program's share (a multiple of BLOCK)
    n_elems,
    elems_per_program,
    # target PE
    pe,
    # elements per iteration
    BLOCK: tl.constexpr,
):
    """Program i copies elements ``[i*elems_per_program, (i+1)*elems_per_program)`` to PE ``pe``.

    A PE of another node: each program hands its chunk to the proxy and quiets, so the data is at
    the peer (and the source reusable) when the kernel has completed, as with loads and stores."""
    pid = tl.program_id(0)
    # elems_per_program is a multiple of BLOCK (host side): say so, to keep the copies vectorised
    start = tl.multiple_of(tl.cast(pid, tl.int64) * elems_per_program, BLOCK)
    count = tl.minimum(n_elems - start, elems_per_program)
    shd.putmem_block(dst_ptr + start, src_ptr + start, count, pe, ctx_ptr, BLOCK)
    if shd._heap_base(pe, ctx_ptr) == 0:
        shd.quiet(ctx_ptr)


@aot_variants(_copy_variants())
@triton.jit
def get_kernel(
    # pointers: local destination, source (this PE's address of a symmetric object), shmem context
    dst_ptr,
    src_ptr,
    ctx_ptr,
    # sizes, in elements: the whole copy, and one program's share (a multiple of BLOCK)
    n_elems,
    elems_per_program,
    # source PE
    pe,
    # elements per iteration
    BLOCK: tl.constexpr,
):
    """Program i copies elements ``[i*elems_per_program, (i+1)*elems_per_program)`` from PE ``pe``."""
    pid = tl.program_id(0)
    start = tl.multiple_of(tl.cast(pid, tl.int64) * elems_per_program, BLOCK)
    count = tl.minimum(n_elems - start, elems_per_program)
    shd.getmem_block(dst_ptr + start, src_ptr + start, count, pe, ctx_ptr, BLOCK)


def _put_signal_variants() -> list[dict[str, Any]]:
    out = []
    for t in _WORD_TYPES:
        for s in _SIG_TYPES:
            for op, name in ((shd.SIGNAL_SET.value, "set"), (shd.SIGNAL_ADD.value, "add")):
                out.append(
                    {
                        "signature": {
                            "dst_ptr": t,
                            "src_ptr": t,
                            "sig_ptr": s,
                            "counter_ptr": "*i32",
                            "ctx_ptr": "*i64",
                            "n_elems": "i64",
                            "elems_per_program": "i64",
                            "signal": "i64",
                            "pe": "i32",
                        },
                        "constexprs": {"SIG_OP": op, "BLOCK": DEFAULT_BLOCK},
                        "aligned": ("dst_ptr", "src_ptr", "ctx_ptr"),
                        "label": f"{t[1:]} sig={s[1:]} {name} BLOCK={DEFAULT_BLOCK}",
                    }
                )
    return out


@aot_variants(_put_signal_variants())
@triton.jit
def put_signal_kernel(
    # pointers: destination (symmetric), local source, signal word (symmetric), a zeroed int32
    # counter of this PE that the programs share, shmem context
    dst_ptr,
    src_ptr,
    sig_ptr,
    counter_ptr,
    ctx_ptr,
    # sizes, in elements: the whole copy, and one program's share (a multiple of BLOCK)
    n_elems,
    elems_per_program,
    # signal value and target PE
    signal,
    pe,
    # SIGNAL_SET or SIGNAL_ADD; elements per iteration
    SIG_OP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Every program copies its chunk to PE ``pe``; the last one to finish sends the signal once."""
    # The last program to finish is found with a ticket: each program, after its stores, adds 1 to
    # the counter (acq_rel); the one that reads num_programs-1 knows every other program has
    # released its data, and acquired it, so its release on the signal covers the whole transfer.
    # No program ever waits for another, so this is safe in any launch order, interpreter included.
    pid = tl.program_id(0)
    start = tl.multiple_of(tl.cast(pid, tl.int64) * elems_per_program, BLOCK)
    count = tl.minimum(n_elems - start, elems_per_program)
    shd.putmem_block(dst_ptr + start, src_ptr + start, count, pe, ctx_ptr, BLOCK)
    tl.debug_barrier()
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="sys")
    if ticket == tl.num_programs(0) - 1:
        tl.store(counter_ptr, 0)  # reusable: every program has taken its ticket
        remote = shd._heap_base(pe, ctx_ptr) == 0
        if remote:  # the proxy: every program's put is queued before this fence, the signal after
            shd.fence(ctx_ptr)
        shd.signal_op(sig_ptr, signal, SIG_OP, pe, ctx_ptr)
        if remote:  # complete when the kernel is (the sources reusable), as with loads and stores
            shd.quiet(ctx_ptr)


@aot(signature={"ctx_ptr": "*i64"}, aligned=("ctx_ptr",))
@triton.jit
def barrier_kernel(ctx_ptr):
    """Device barrier over all PEs; launch with one program."""
    shd.barrier_all(ctx_ptr)


# -- host side ----------------------------------------------------------------------------------------

_WORDS_BY_SIZE: dict[int, str] = {8: "int64", 4: "int32", 2: "int16", 1: "uint8"}


def _launchable(func: str, ctx: ShmemContext, kernel: Any) -> None:
    # under TRITON_INTERPRET=1, triton.jit makes an InterpretedFunction instead of a JITFunction
    if ctx.runtime.torch_device == "cpu" and type(kernel).__name__ != "InterpretedFunction":
        raise MoriStateError(
            f"{func}: the {ctx.runtime.name} runtime runs Triton kernels only in the interpreter; set "
            f"TRITON_INTERPRET=1 before triton (and mori.shmem.kernels) is first imported"
        )


def _int(func: str, arg: str, value: Any, allowed: str, ok: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not ok(value):
        raise bad_value(func, arg, value, allowed)
    return value


def _tensor(func: str, ctx: ShmemContext, arg: str, t: Any) -> torch.Tensor:
    import torch

    if not isinstance(t, torch.Tensor):
        raise bad_type(func, arg, t, "a torch.Tensor")
    if t.device.type != ctx.runtime.torch_device:
        raise bad_value(
            func,
            f"{arg}.device",
            str(t.device),
            f"the {ctx.runtime.name} runtime's device ({ctx.runtime.torch_device})",
        )
    if not t.is_contiguous():
        raise bad_value(func, arg, f"tensor with strides {t.stride()}", "a contiguous tensor")
    return t


def _symmetric(func: str, ctx: ShmemContext, arg: str, t: torch.Tensor) -> None:
    if t.numel():  # an empty tensor has no address to check (torch may report 0)
        ctx.heap_offset(func, arg, t.data_ptr(), t.numel() * t.element_size())


def _as_words(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Widest word that divides the byte count and both addresses (torch also wants the offset in
    # the storage to be a whole number of words).
    import torch

    def fits(t: torch.Tensor, size: int) -> bool:
        return t.data_ptr() % size == 0 and (t.storage_offset() * t.element_size()) % size == 0

    a, b = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    for size, name in _WORDS_BY_SIZE.items():
        if a.numel() % size == 0 and fits(a, size) and fits(b, size):
            dt = getattr(torch, name)
            return a.view(dt), b.view(dt)
    return a, b


def _grid(n_elems: int, block: int, max_programs: int) -> tuple[int, int]:
    """(programs, elements per program), the share a multiple of ``block``."""
    n_blocks = triton.cdiv(n_elems, block)
    per = triton.cdiv(n_blocks, min(n_blocks, max_programs)) * block
    return triton.cdiv(n_elems, per), per


def _copy_args(
    func: str, dst: Any, src: Any, pe: Any, block: Any, max_programs: Any, symmetric: str
) -> tuple[ShmemContext, torch.Tensor, torch.Tensor, int, int, int]:
    ctx = current(func)
    ctx.check_pe(func, pe)
    dst = _tensor(func, ctx, "dst", dst)
    src = _tensor(func, ctx, "src", src)
    if src.dtype != dst.dtype or src.numel() != dst.numel():
        raise bad_value(
            func,
            "src",
            f"{src.dtype}[{src.numel()}]",
            f"the dtype and size of dst ({dst.dtype}[{dst.numel()}])",
        )
    _symmetric(func, ctx, symmetric, dst if symmetric == "dst" else src)
    if ctx.over_network(func, pe) and dst.numel():  # raises if no transport reaches pe
        local = src if symmetric == "dst" else dst  # the proxy moves it: heap or registered memory
        ctx.local_addr(
            func,
            "src" if symmetric == "dst" else "dst",
            local.data_ptr(),
            local.numel() * local.element_size(),
        )
    block = _int(func, "block", block, "a power of two >= 16", lambda v: v >= 16 and v & (v - 1) == 0)
    max_programs = _int(func, "max_programs", max_programs, "an int >= 1", lambda v: v >= 1)
    return ctx, dst, src, pe, block, max_programs


def put(
    dst: torch.Tensor,
    src: torch.Tensor,
    pe: int,
    *,
    block: int = DEFAULT_BLOCK,
    max_programs: int = DEFAULT_MAX_PROGRAMS,
) -> None:
    """Copy local ``src`` into PE ``pe``'s copy of the symmetric tensor ``dst``, with a kernel.

    ``dst``: contiguous tensor in this PE's symmetric heap (its address here names the object);
    ``src``: contiguous tensor on the runtime's device, same dtype and number of elements.
    ``block``: elements (of the word type picked, see the module docstring) per iteration;
    ``max_programs``: most programs in the grid. Not collective. The data is at the peer when the
    kernel has completed (stream order); to tell the peer, use :func:`put_signal`. With ``pe`` =
    this PE, ``src`` and ``dst`` must not overlap.
    """
    func = "put"
    ctx, dst, src, pe, block, max_programs = _copy_args(func, dst, src, pe, block, max_programs, "dst")
    _launchable(func, ctx, put_kernel)
    if dst.numel() == 0:
        return
    d, s = _as_words(dst, src)
    programs, per = _grid(d.numel(), block, max_programs)
    put_kernel[(programs,)](d, s, shd.shmem_device_context(), d.numel(), per, pe, BLOCK=block)


def get(
    dst: torch.Tensor,
    src: torch.Tensor,
    pe: int,
    *,
    block: int = DEFAULT_BLOCK,
    max_programs: int = DEFAULT_MAX_PROGRAMS,
) -> None:
    """Copy PE ``pe``'s copy of the symmetric tensor ``src`` into local ``dst``, with a kernel.

    ``src``: contiguous tensor in this PE's symmetric heap; ``dst``: contiguous tensor on the
    runtime's device, same dtype and number of elements. Other arguments as in :func:`put`. Not
    collective; the data is in ``dst`` when the kernel has completed.
    """
    func = "get"
    ctx, dst, src, pe, block, max_programs = _copy_args(func, dst, src, pe, block, max_programs, "src")
    _launchable(func, ctx, get_kernel)
    if dst.numel() == 0:
        return
    d, s = _as_words(dst, src)
    programs, per = _grid(d.numel(), block, max_programs)
    get_kernel[(programs,)](d, s, shd.shmem_device_context(), d.numel(), per, pe, BLOCK=block)


def put_signal(
    dst: torch.Tensor,
    src: torch.Tensor,
    sig: torch.Tensor,
    signal: int,
    sig_op: int,
    pe: int,
    *,
    block: int = DEFAULT_BLOCK,
    max_programs: int = DEFAULT_MAX_PROGRAMS,
) -> None:
    """:func:`put`, then update PE ``pe``'s copy of the signal word ``sig`` once all data is there.

    ``sig``: one-element int64 or uint64 tensor in this PE's symmetric heap; ``sig_op``:
    ``SIGNAL_SET`` (store ``signal``) or ``SIGNAL_ADD`` (add it). The signal is sent exactly once,
    by the last program to finish, with release semantics at system scope: a peer that sees it
    (``shmem_wait_until`` on the host, :func:`mori.shmem.device.wait_until` in a kernel) sees the
    whole ``dst``. With zero elements only the signal is sent. Not collective.
    """
    import torch

    func = "put_signal"
    ctx, dst, src, pe, block, max_programs = _copy_args(func, dst, src, pe, block, max_programs, "dst")
    sig = _tensor(func, ctx, "sig", sig)
    if sig.dtype not in (torch.int64, torch.uint64) or sig.numel() != 1:
        raise bad_value(func, "sig", f"{sig.dtype}[{sig.numel()}]", "a one-element int64 or uint64 tensor")
    _symmetric(func, ctx, "sig", sig)
    if sig_op not in (shd.SIGNAL_SET.value, shd.SIGNAL_ADD.value):
        raise bad_value(func, "sig_op", sig_op, "SIGNAL_SET (9) or SIGNAL_ADD (10)")
    lo, hi = (0, 2**64 - 1) if sig.dtype == torch.uint64 else (-(2**63), 2**63 - 1)
    signal = _int(func, "signal", signal, f"an int in [{lo}, {hi}] ({sig.dtype})", lambda v: lo <= v <= hi)
    if sig.dtype == torch.uint64 and signal >= 2**63:
        signal -= 2**64  # the kernel takes an i64; the atomic works on the bits
    _launchable(func, ctx, put_signal_kernel)
    d, s = _as_words(dst, src)
    n = d.numel()
    programs, per = _grid(n, block, max_programs) if n else (1, block)
    counter = torch.zeros(1, dtype=torch.int32, device=ctx.runtime.torch_device_of_heap())
    put_signal_kernel[(programs,)](
        d, s, sig, counter, shd.shmem_device_context(), n, per, signal, pe, SIG_OP=sig_op, BLOCK=block
    )


def barrier() -> None:
    """Device barrier over all PEs: launches :data:`barrier_kernel` (one program) on the current
    stream. Collective. On a GPU it returns at once and later work on the stream waits; under the
    interpreter it returns when every PE has arrived, with no timeout. PEs of other nodes take
    part through the proxy."""
    func = "barrier"
    ctx = current(func)
    for p in range(ctx.n_pes):
        ctx.over_network(func, p)  # raises if no transport reaches p
    _launchable(func, ctx, barrier_kernel)
    barrier_kernel[(1,)](shd.shmem_device_context())

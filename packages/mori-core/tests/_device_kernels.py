"""Test kernels over the device API (mori.shmem.device), used by test_device.py.

Imported inside the rank functions only: under the interpreter, ``TRITON_INTERPRET=1`` must be set
before ``triton.jit`` runs. Every kernel lists its ahead-of-time variants, so
``tools/compile_kernels.py`` also proves that every device function compiles for every target.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mori.core.kernels import aot, aot_variants
from mori.shmem import device as shd

# jitted code reads module globals only if they are tl.constexpr; hosts pass ``.value``
#: ops of atomic_kernel
OP_FETCH, OP_SET, OP_ADD, OP_FETCH_ADD, OP_SWAP, OP_COMPARE_SWAP = (tl.constexpr(i) for i in range(6))
#: how send_kernel orders the data before the signal
ORDER_PUT_SIGNAL, ORDER_QUIET, ORDER_FENCE = (tl.constexpr(i) for i in range(3))

_CTX = {"ctx_ptr": "*i64"}


@aot(signature={"out_ptr": "*i64", **_CTX})
@triton.jit
def identity_kernel(out_ptr, ctx_ptr):
    """out[0:2] = my_pe, n_pes."""
    tl.store(out_ptr, shd.my_pe(ctx_ptr))
    tl.store(out_ptr + 1, shd.n_pes(ctx_ptr))


@aot(signature={"buf_ptr": "*i32", **_CTX, "n": "i32"}, constexprs={"BLOCK": 64})
@triton.jit
def p2p_store_kernel(
    # symmetric int32 buffer [n_pes * BLOCK]; shmem context
    buf_ptr,
    ctx_ptr,
    # values per peer (<= BLOCK)
    n,
    BLOCK: tl.constexpr,
):
    """Into every PE's copy, at [my_pe*BLOCK, my_pe*BLOCK + n): my_pe * 100000 + i, through
    ptr_p2p on a block of pointers; and one scalar store through ptr_p2p at [my_pe*BLOCK + n]."""
    me = shd.my_pe(ctx_ptr)
    npes = shd.n_pes(ctx_ptr)
    offs = tl.arange(0, BLOCK)
    mask = offs < n  # n may be less than BLOCK: do not touch the rest of the slot
    vals = (me * 100000 + offs).to(tl.int32)
    pe = me * 0
    while pe < npes:
        mine = buf_ptr + me * BLOCK
        tl.store(shd.ptr_p2p(mine + offs, pe, ctx_ptr), vals, mask=mask)
        tl.store(shd.ptr_p2p(mine + n, pe, ctx_ptr), (-1 - me).to(tl.int32))
        pe += 1


@aot(
    signature={
        "dst_ptr": "*u8",
        "src_ptr": "*u8",
        "sig_ptr": "*u64",
        **_CTX,
        "n": "i32",
        "signal": "i64",
        "pe": "i32",
    },
    constexprs={"SIG_OP": shd.SIGNAL_SET.value, "ORDER": ORDER_PUT_SIGNAL.value, "BLOCK": 64},
)
@aot(
    signature={
        "dst_ptr": "*u8",
        "src_ptr": "*u8",
        "sig_ptr": "*u64",
        **_CTX,
        "n": "i32",
        "signal": "i64",
        "pe": "i32",
    },
    constexprs={"SIG_OP": shd.SIGNAL_ADD.value, "ORDER": ORDER_QUIET.value, "BLOCK": 64},
)
@aot(
    signature={
        "dst_ptr": "*i64",
        "src_ptr": "*i64",
        "sig_ptr": "*i64",
        **_CTX,
        "n": "i32",
        "signal": "i64",
        "pe": "i32",
    },
    constexprs={"SIG_OP": shd.SIGNAL_ADD.value, "ORDER": ORDER_FENCE.value, "BLOCK": 64},
)
@triton.jit
def send_kernel(
    # pointers: destination (symmetric), source (local), signal word (symmetric), shmem context
    dst_ptr,
    src_ptr,
    sig_ptr,
    ctx_ptr,
    # elements; signal value; target PE
    n,
    signal,
    pe,
    # SIGNAL_SET / SIGNAL_ADD; ORDER_*; elements per iteration
    SIG_OP: tl.constexpr,
    ORDER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program sends n elements and a signal, with put_signal_block or put + quiet/fence + signal."""
    if ORDER == ORDER_PUT_SIGNAL:
        shd.put_signal_block(dst_ptr, src_ptr, sig_ptr, n, signal, pe, ctx_ptr, SIG_OP, BLOCK)
    else:
        shd.putmem_block(dst_ptr, src_ptr, n, pe, ctx_ptr, BLOCK)
        if ORDER == ORDER_QUIET:
            shd.quiet(ctx_ptr)
        else:
            shd.fence(ctx_ptr)
        shd.signal_op(sig_ptr, signal, SIG_OP, pe, ctx_ptr)


@aot(
    signature={"sig_ptr": "*u64", "data_ptr": "*u8", "out_ptr": "*u8", "n": "i32", "expect": "i64"},
    constexprs={"BLOCK": 64},
)
@aot(
    signature={"sig_ptr": "*i64", "data_ptr": "*i64", "out_ptr": "*i64", "n": "i32", "expect": "i64"},
    constexprs={"BLOCK": 64},
)
@triton.jit
def recv_kernel(
    # pointers: local signal word, local received data, local output
    sig_ptr,
    data_ptr,
    out_ptr,
    # elements; signal value to wait for (>=)
    n,
    expect,
    BLOCK: tl.constexpr,
):
    """Wait until *sig >= expect, then copy n elements of data to out (what a consumer would read)."""
    shd.wait_until(sig_ptr, shd.SHMEM_CMP_GE, expect)
    offs = tl.arange(0, BLOCK)
    start = 0
    while start < n:
        mask = start + offs < n  # the last block is partial
        tl.store(out_ptr + start + offs, tl.load(data_ptr + start + offs, mask=mask), mask=mask)
        start += BLOCK


def _atomic_variants(word: str) -> list[dict[str, object]]:
    sig = {"word_ptr": word, "out_ptr": word, **_CTX, "value": "i64", "cond": "i64", "pe": "i32"}
    return [{"signature": sig, "constexprs": {"OP": op}} for op in range(6)]


@aot_variants(_atomic_variants("*i32") + _atomic_variants("*i64") + _atomic_variants("*u64"))
@triton.jit
def atomic_kernel(
    # pointers: symmetric word (its type picks the width), local output [num_programs]
    word_ptr,
    out_ptr,
    ctx_ptr,
    # operands and target PE
    value,
    cond,
    pe,
    # OP_*
    OP: tl.constexpr,
):
    """Every program does one atomic OP on PE pe's word; out[pid] = the value it returned (0 if none)."""
    pid = tl.program_id(0)
    got = tl.cast(0, word_ptr.dtype.element_ty)
    if OP == OP_FETCH:
        got = shd.atomic_fetch(word_ptr, pe, ctx_ptr)
    elif OP == OP_SET:
        shd.atomic_set(word_ptr, value, pe, ctx_ptr)
    elif OP == OP_ADD:
        shd.atomic_add(word_ptr, value, pe, ctx_ptr, SEM="relaxed")
    elif OP == OP_FETCH_ADD:
        got = shd.atomic_fetch_add(word_ptr, value, pe, ctx_ptr)
    elif OP == OP_SWAP:
        got = shd.atomic_swap(word_ptr, value, pe, ctx_ptr)
    else:
        got = shd.atomic_compare_swap(word_ptr, cond, value, pe, ctx_ptr)
    tl.store(out_ptr + pid, got)


@aot(signature={"word_ptr": "*i64", **_CTX, "pe": "i32"})
@aot(signature={"word_ptr": "*i32", **_CTX, "pe": "i32"})
@triton.jit
def cas_increment_kernel(word_ptr, ctx_ptr, pe):
    """Every program adds 1 to PE pe's word with a compare-and-swap loop (retries when it loses)."""
    old = shd.atomic_fetch(word_ptr, pe, ctx_ptr, SEM="relaxed")
    seen = shd.atomic_compare_swap(word_ptr, old, old + 1, pe, ctx_ptr)
    while seen != old:
        old = seen
        seen = shd.atomic_compare_swap(word_ptr, old, old + 1, pe, ctx_ptr)


def _wait_variants() -> list[dict[str, object]]:
    return [
        {"signature": {"word_ptr": w, "out_ptr": w, "value": "i64"}, "constexprs": {"CMP": cmp}}
        for w in ("*i32", "*i64", "*u64")
        for cmp in range(6)
    ]


@aot_variants(_wait_variants())
@triton.jit
def wait_kernel(word_ptr, out_ptr, value, CMP: tl.constexpr):
    """out[0] = wait_until(word, CMP, value)."""
    tl.store(out_ptr, shd.wait_until(word_ptr, CMP, value))


@aot(signature={"buf_ptr": "*i64", "out_ptr": "*i64", **_CTX}, constexprs={"ROUNDS": 20})
@triton.jit
def barrier_ring_kernel(
    # pointers: symmetric int64 word, local output [ROUNDS], shmem context
    buf_ptr,
    out_ptr,
    ctx_ptr,
    ROUNDS: tl.constexpr,
):
    """ROUNDS times: store round*1000 + my_pe into the right neighbour's word, barrier, read own
    word (the left neighbour's value) into out[round], barrier. Launch with one program."""
    me = shd.my_pe(ctx_ptr)
    right = (me + 1) % shd.n_pes(ctx_ptr)
    for r in range(ROUNDS):
        tl.store(shd.ptr_p2p(buf_ptr, right, ctx_ptr), r * 1000 + me)
        shd.barrier_all(ctx_ptr)  # everyone has written this round's value
        tl.store(out_ptr + r, tl.load(buf_ptr, volatile=True))
        shd.barrier_all(ctx_ptr)  # everyone has read it: the next round may overwrite it

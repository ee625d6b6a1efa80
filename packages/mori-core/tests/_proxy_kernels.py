# Jitted functions carry no Python annotations (Triton reads them), so mypy may not ask for them:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Triton kernels of test_proxy.py: each one screen, each the device API on a PE that loads and
stores cannot reach (the proxy serves it). Loaded by path after TRITON_INTERPRET is set."""

import triton
import triton.language as tl

from mori.core.kernels import aot
from mori.shmem import device as shd

# every kernel lists an ahead-of-time variant, so tools/compile_kernels.py proves the proxy path of
# the device API compiles for every GPU target too
_CTX = {"ctx_ptr": "*i64"}


@aot(
    signature={
        "dst_ptr": "*i32",
        "src_ptr": "*i32",
        "back_ptr": "*i32",
        "out_ptr": "*i64",
        "n": "i32",
        "peer": "i32",
        **_CTX,
    },
    constexprs={"BLOCK": 1024},
)
@triton.jit
def put_quiet_get_kernel(
    # symmetric destination, local source, local buffer the get fills (all int32)
    dst_ptr,
    src_ptr,
    back_ptr,
    # ring counters after the quiet: out[0] = issued (head), out[1] = completed
    out_ptr,
    n,
    peer,
    ctx_ptr,
    BLOCK: tl.constexpr,
):
    # put n elements to the peer, quiet (everything complete at the peer), read them back
    shd.putmem_block(dst_ptr, src_ptr, n, peer, ctx_ptr, BLOCK)
    shd.quiet(ctx_ptr)
    ring = shd._ring(ctx_ptr)
    tl.store(out_ptr, tl.load(ring + shd._RING_HEAD, volatile=True))
    tl.store(out_ptr + 1, tl.load(ring + shd._RING_COMPLETED, volatile=True))
    shd.getmem_block(back_ptr, dst_ptr, n, peer, ctx_ptr, BLOCK)


@aot(
    signature={
        "dst_ptr": "*i32",
        "src_ptr": "*i32",
        "sig_ptr": "*i64",
        "n": "i32",
        "signal": "i32",
        "peer": "i32",
        **_CTX,
    },
    constexprs={"BLOCK": 1024},
)
@triton.jit
def put_signal_kernel(dst_ptr, src_ptr, sig_ptr, n, signal, peer, ctx_ptr, BLOCK: tl.constexpr):
    # put n elements, then set the peer's signal word once they are there
    shd.put_signal_block(dst_ptr, src_ptr, sig_ptr, n, signal, peer, ctx_ptr, shd.SIGNAL_SET, BLOCK)


@aot(signature={"sig_ptr": "*i64", "value": "i32", "out_ptr": "*i64"})
@triton.jit
def wait_kernel(sig_ptr, value, out_ptr):
    # wait on this PE's own signal word (written by a peer's proxy), report what was seen
    tl.store(out_ptr, shd.wait_until(sig_ptr, shd.SHMEM_CMP_EQ, value))


@aot(
    signature={
        "words_ptr": "*i64",
        "word32_ptr": "*i32",
        "out_ptr": "*i64",
        "me": "i32",
        "target": "i32",
        **_CTX,
    }
)
@triton.jit
def atomics_kernel(
    # symmetric int64 words [4] of PE `target`, int32 word [1], local results int64 [8]
    words_ptr,
    word32_ptr,
    out_ptr,
    me,
    target,
    ctx_ptr,
):
    # every PE adds to words[0] and fetch-adds words[1]; the last PE also swaps and compare-swaps
    shd.atomic_add(words_ptr, 1000 + me, target, ctx_ptr)
    tl.store(out_ptr, shd.atomic_fetch_add(words_ptr + 1, 1, target, ctx_ptr))
    if me == shd.n_pes(ctx_ptr) - 1:
        tl.store(out_ptr + 1, shd.atomic_swap(words_ptr + 2, 5, target, ctx_ptr))
        tl.store(out_ptr + 2, shd.atomic_swap(words_ptr + 2, -7, target, ctx_ptr))
        tl.store(out_ptr + 3, shd.atomic_compare_swap(words_ptr + 3, 0, 42, target, ctx_ptr))
        tl.store(out_ptr + 4, shd.atomic_compare_swap(words_ptr + 3, 0, 99, target, ctx_ptr))
        shd.atomic_set(word32_ptr, -3, target, ctx_ptr)
        tl.store(out_ptr + 5, shd.atomic_fetch(word32_ptr, target, ctx_ptr).to(tl.int64))
        tl.store(out_ptr + 6, shd.atomic_fetch(words_ptr, target, ctx_ptr))


@aot(
    signature={
        "word_ptr": "*i64",
        "word32_ptr": "*i32",
        "out_ptr": "*i64",
        "value": "i64",
        "pe": "i32",
        **_CTX,
    }
)
@triton.jit
def set_fetch_kernel(word_ptr, word32_ptr, out_ptr, value, pe, ctx_ptr):
    # set PE pe's int64 and int32 words, then read them back with fetches: out[0], out[1]
    shd.atomic_set(word_ptr, value, pe, ctx_ptr)
    shd.atomic_set(word32_ptr, -value, pe, ctx_ptr)
    shd.quiet(ctx_ptr)
    tl.store(out_ptr, shd.atomic_fetch(word_ptr, pe, ctx_ptr))
    tl.store(out_ptr + 1, shd.atomic_fetch(word32_ptr, pe, ctx_ptr).to(tl.int64))


@aot(signature={"box_ptr": "*i64", "seen_ptr": "*i64", **_CTX}, constexprs={"ROUNDS": 3})
@triton.jit
def barrier_kernel(box_ptr, seen_ptr, ctx_ptr, ROUNDS: tl.constexpr):
    # each round: write round*100+me into my mailbox word of every PE, barrier, record my mailbox
    me = shd.my_pe(ctx_ptr)
    npes = shd.n_pes(ctx_ptr)
    for r in tl.static_range(ROUNDS):
        p = tl.cast(0, tl.int64)
        while p < npes:
            shd.atomic_set(box_ptr + me, r * 100 + me, p, ctx_ptr)
            p += 1
        shd.barrier_all(ctx_ptr)
        q = tl.cast(0, tl.int64)
        while q < npes:
            tl.store(seen_ptr + r * npes + q, tl.load(box_ptr + q, volatile=True))
            q += 1
        shd.barrier_all(ctx_ptr)


@aot(signature={"buf_ptr": "*i32", "out_ptr": "*i64", **_CTX})
@triton.jit
def ptr_p2p_kernel(buf_ptr, out_ptr, ctx_ptr):
    # out[p] = address of PE p's copy of buf as this PE sees it (0 when not load/store reachable)
    npes = shd.n_pes(ctx_ptr)
    p = tl.cast(0, tl.int64)
    while p < npes:
        tl.store(out_ptr + p, shd.ptr_p2p(buf_ptr, p, ctx_ptr).to(tl.int64, bitcast=True))
        p += 1


@aot(
    signature={"dst_ptr": "*i32", "src_ptr": "*i32", "n": "i32", "pe": "i32", **_CTX},
    constexprs={"BLOCK": 256},
)
@triton.jit
def raw_put_kernel(dst_ptr, src_ptr, n, pe, ctx_ptr, BLOCK: tl.constexpr):
    # a put to any PE number, any address: what an attacker's (or a buggy) kernel can write
    shd.putmem_block(dst_ptr, src_ptr, n, pe, ctx_ptr, BLOCK)


@aot(signature={"word_ptr": "*i64", "count": "i32", "pe": "i32", **_CTX})
@triton.jit
def many_adds_kernel(word_ptr, count, pe, ctx_ptr):
    # count non-fetching atomic adds of 1, 2, ..., count to one word of PE pe
    i = tl.cast(1, tl.int64)
    while i <= count:
        shd.atomic_add(word_ptr, i, pe, ctx_ptr)
        i += 1


@aot(signature=_CTX)
@triton.jit
def quiet_kernel(ctx_ptr):
    # wait until this PE's proxy completed everything issued before (or failed)
    shd.quiet(ctx_ptr)

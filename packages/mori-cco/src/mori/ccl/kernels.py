# Jitted functions carry no Python annotations (Triton reads them), so mypy may not ask for them:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Triton kernels of mori.ccl: load/store collectives over the LSA team, and the small kernels that
order copy-engine copies. Protocol and buffers: :mod:`mori.ccl.channel`.

Every kernel runs ``P`` programs (the channel's ``programs``); program ``k`` handles slice ``k`` of
every block of the call and synchronises only with program ``k`` of the other ranks (LSA barrier
``READY(k)`` / ``READY2(k)``), so no program ever waits for another program of its own launch:
the kernels run under the interpreter, and on a GPU need only the ranks' ``P`` programs resident
at once. Slices are ``per_program`` elements (a multiple of ``BLOCK``), the same on every rank.

Pointers named ``*_ptr`` are typed by the data (words for moves; the reduction dtype for
all-reduce); ``stage_ptr`` points into this rank's copy of the staging window ``win`` (its table),
so a peer's copy of the same element is :func:`mori.cco.device.lsa_peer_ptr` of it.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from mori.cco import device as ccd
from mori.core.kernels import aot_variants, device_function
from mori.viz import device as vd
from mori.viz.slots import declare_slots

__all__ = ["allreduce_oneshot_kernel", "allreduce_rsag_kernel", "gather_kernel", "sync_kernel"]

#: elements per step of one program, and warps per program, of every launch
BLOCK = 4096
NUM_WARPS = 8
#: torch dtype name -> Triton pointer type, for the variants
REDUCE_TYPES = {
    "uint32": "*u32",
    "int32": "*i32",
    "float32": "*fp32",
    "float16": "*fp16",
    "bfloat16": "*bf16",
}
WORD_TYPES = {8: "*i64", 4: "*i32", 2: "*i16", 1: "*u8"}
#: sync_kernel phases
PHASE_WAIT_DONE, PHASE_READY, PHASE_FINISH = 0, 1, 2

#: the protocol phases the kernels record when their TRACE constexpr is on (mori.viz): wait_done
#: (the peers finished reading the last large call), stage (own input into the staging window),
#: ready / ready2 (the LSA barriers), reduce / pull (reading the peers' copies), done (arriving at
#: DONE, the launch's last program)
ALLREDUCE = declare_slots(
    "ccl.allreduce", ["kernel", "wait_done", "stage", "ready", "reduce", "ready2", "pull", "done"]
)
GATHER = declare_slots("ccl.gather", ["kernel", "wait_done", "stage", "ready", "pull", "done"])


# -- device functions ---------------------------------------------------------------------------------


@device_function
@triton.jit
def _copy(dst_ptr, src_ptr, n, BLOCK: tl.constexpr):
    # Whole blocks unmasked (full-width vector accesses), then one masked partial block; n <= 0
    # copies nothing. (while, not range: a runtime bound is a 1-element array in the interpreter.)
    offs = tl.arange(0, BLOCK)
    n_full = n // BLOCK
    i = tl.cast(0, tl.int64)
    while i < n_full:
        start = i * BLOCK
        tl.store(dst_ptr + start + offs, tl.load(src_ptr + start + offs))
        i += 1
    start = tl.maximum(n_full, 0).to(tl.int64) * BLOCK
    if start < n:
        mask = start + offs < n
        tl.store(dst_ptr + start + offs, tl.load(src_ptr + start + offs, mask=mask), mask=mask)


@device_function
@triton.jit
def _bf16_rtne(x):
    # float32 -> bfloat16 rounded to nearest, ties to even, in integer arithmetic: the rounding torch
    # and the GPUs' cvt.rn use, written out so that the interpreter (which truncates) agrees
    bits = x.to(tl.uint32, bitcast=True)
    lsb = (bits >> 16) & 1
    rounded = ((bits + 0x7FFF + lsb) >> 16).to(tl.uint16)
    quiet_nan = ((bits >> 16) | 0x40).to(tl.uint16)
    return tl.where(x != x, quiet_nan, rounded).to(tl.bfloat16, bitcast=True)


@device_function
@triton.jit
def _reduce_block(out_ptr, local_ptr, start, mask, win, devcomm, ACC_F32: tl.constexpr, BLOCK: tl.constexpr):
    # out[start + i] = sum over LSA ranks p of p's copy of local[start + i], in rank order (every
    # rank sums in the same order, so all get the same bits); fp32 accumulation for floats, wrapping
    # integer sums for ints. Every load happens before the store, so out may be local (in place).
    offs = start + tl.arange(0, BLOCK)
    n = ccd.lsa_size(devcomm)
    if ACC_F32:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK], dtype=out_ptr.dtype.element_ty)
    p = tl.cast(0, tl.int64)
    while p < n:
        v = tl.load(ccd.lsa_peer_ptr(local_ptr + offs, win, p, devcomm), mask=mask, other=0)
        if ACC_F32:
            acc += v.to(tl.float32)
        else:
            acc += v
        p += 1
    if out_ptr.dtype.element_ty == tl.bfloat16:
        tl.store(out_ptr + offs, _bf16_rtne(acc), mask=mask)
    else:
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@device_function
@triton.jit
def _reduce(out_ptr, local_ptr, n, win, devcomm, ACC_F32: tl.constexpr, BLOCK: tl.constexpr):
    # _reduce_block over [0, n): whole blocks with an all-true mask, then the tail
    full = tl.full([BLOCK], 1, tl.int1)
    n_full = n // BLOCK
    i = tl.cast(0, tl.int64)
    while i < n_full:
        _reduce_block(out_ptr, local_ptr, i * BLOCK, full, win, devcomm, ACC_F32, BLOCK)
        i += 1
    start = tl.maximum(n_full, 0).to(tl.int64) * BLOCK
    if start < n:
        mask = start + tl.arange(0, BLOCK) < n
        _reduce_block(out_ptr, local_ptr, start, mask, win, devcomm, ACC_F32, BLOCK)


@device_function
@triton.jit
def _slice(block, k, n_total, block_elems, per_program):
    # elements [lo, lo + count) of program k's slice of block `block` (count may be <= 0)
    lo = block * block_elems + k * per_program
    hi = tl.minimum(block * block_elems + tl.minimum((k + 1) * per_program, block_elems), n_total)
    return lo, hi - lo


@device_function
@triton.jit
def _finish(devcomm, ticket_ptr, done_index):
    # The last program of the launch to get here arrives at DONE for the whole launch: every
    # program adds 1 to the ticket after its reads (acq_rel), so the one that draws P-1 follows
    # all of them; it resets the ticket for the next launch. Nobody waits for anybody.
    tl.debug_barrier()
    t = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
    if t == tl.num_programs(0) - 1:
        tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")
        ccd.lsa_barrier_arrive(devcomm, done_index)


# -- variants -----------------------------------------------------------------------------------------


def _reduce_variants(large: bool) -> list[dict[str, Any]]:
    out = []
    for name, t in REDUCE_TYPES.items():
        sig = {"inp_ptr": t, "out_ptr": t, "stage_ptr": t, "win": "*i64", "devcomm": "*i64"}
        if large:
            sig["ticket_ptr"] = "*i32"
        sig.update({"n_elems": "i64", "block_elems": "i64", "per_program": "i64"} if large else {})
        if not large:
            sig.update({"n_elems": "i64", "per_program": "i64", "half_elems": "i64"})
        out.append(
            {
                "signature": sig,
                "constexprs": {"ACC_F32": not name.endswith("int32"), "BLOCK": BLOCK},
                "aligned": ("inp_ptr", "out_ptr", "stage_ptr", "win", "devcomm"),
                "num_warps": NUM_WARPS,
                "label": f"{name} BLOCK={BLOCK}",
            }
        )
    return out


def _gather_variants() -> list[dict[str, Any]]:
    out = []
    for t in WORD_TYPES.values():
        for large in (False, True):
            out.append(
                {
                    "signature": {
                        "inp_ptr": t,
                        "out_ptr": t,
                        "stage_ptr": t,
                        "win": "*i64",
                        "devcomm": "*i64",
                        "ticket_ptr": "*i32",
                        "block_elems": "i64",
                        "in_blocks": "i64",
                        "src_block": "i64",
                        "per_program": "i64",
                        "half_elems": "i64",
                    },
                    "constexprs": {"LARGE": large, "BLOCK": BLOCK},
                    "aligned": ("inp_ptr", "out_ptr", "stage_ptr", "win", "devcomm"),
                    "num_warps": NUM_WARPS,
                    "label": f"{t[1:]} {'large' if large else 'small'} BLOCK={BLOCK}",
                }
            )
    return out


# -- kernels ------------------------------------------------------------------------------------------


@aot_variants(vd.traced_variants(_reduce_variants(large=False), traced=len(REDUCE_TYPES)))
@triton.jit
def allreduce_oneshot_kernel(
    # pointers (reduction dtype): input, output, this rank's small staging region (both halves)
    inp_ptr,
    out_ptr,
    stage_ptr,
    # staging window table, device communicator
    win,
    devcomm,
    # elements: the call, one program's slice (a multiple of BLOCK), one small half
    n_elems,
    per_program,
    half_elems,
    # accumulate in fp32 (floats); elements per step
    ACC_F32: tl.constexpr,
    BLOCK: tl.constexpr,
    # trace buffer (mori.viz) when TRACE; None otherwise
    trace_ptr=None,
    TRACE: tl.constexpr = False,
):
    """One-shot all-reduce (sum): program k stages its slice in the half this call's parity picks,
    syncs READY(k) with the peers' programs k, then sums that slice over every rank's copy."""
    tr = vd.open_trace(trace_ptr, TRACE)
    tr = vd.begin(tr, ALLREDUCE.kernel)
    k = tl.program_id(0)
    e = ccd.lsa_barrier_epoch(devcomm, k) + 1
    base = stage_ptr + (e % 2) * half_elems
    lo = k.to(tl.int64) * per_program
    count = tl.minimum(n_elems - lo, per_program)
    tr = vd.begin(tr, ALLREDUCE.stage)
    _copy(base + lo, inp_ptr + lo, count, BLOCK)
    tr = vd.next_span(tr, ALLREDUCE.ready)
    ccd.lsa_barrier_sync(devcomm, k)
    tr = vd.next_span(tr, ALLREDUCE.reduce)
    _reduce(out_ptr + lo, base + lo, count, win, devcomm, ACC_F32, BLOCK)
    tr = vd.end(tr, ALLREDUCE.reduce)
    tr = vd.end(tr, ALLREDUCE.kernel)
    vd.close_trace(tr)


@aot_variants(vd.traced_variants(_reduce_variants(large=True), traced=len(REDUCE_TYPES)))
@triton.jit
def allreduce_rsag_kernel(
    # pointers (reduction dtype): input, output, this rank's large staging region
    inp_ptr,
    out_ptr,
    stage_ptr,
    # staging window table, device communicator, the launch's ticket counter (int32, zero)
    win,
    devcomm,
    ticket_ptr,
    # elements: the call, one rank's chunk, one program's slice of a chunk (a multiple of BLOCK)
    n_elems,
    block_elems,
    per_program,
    # accumulate in fp32 (floats); elements per step
    ACC_F32: tl.constexpr,
    BLOCK: tl.constexpr,
    # trace buffer (mori.viz) when TRACE; None otherwise
    trace_ptr=None,
    TRACE: tl.constexpr = False,
):
    """Reduce-scatter + all-gather (sum). Rank r owns chunk r. Program k: waits at DONE (peers have
    finished reading the previous large call), stages slice k of every chunk, syncs READY(k), sums
    slice k of its own chunk over every rank's copy in place, syncs READY2(k), copies slice k of
    every rank's reduced chunk into the output, and the launch's last program arrives at DONE."""
    tr = vd.open_trace(trace_ptr, TRACE)
    tr = vd.begin(tr, ALLREDUCE.kernel)
    k = tl.program_id(0)
    P = tl.num_programs(0)
    n = ccd.lsa_size(devcomm)
    me = ccd.lsa_rank(devcomm)
    tr = vd.begin(tr, ALLREDUCE.wait_done)
    ccd.lsa_barrier_wait(devcomm, 2 * P)
    tr = vd.next_span(tr, ALLREDUCE.stage)
    r = tl.cast(0, tl.int64)
    while r < n:
        lo, count = _slice(r, k, n_elems, block_elems, per_program)
        _copy(stage_ptr + lo, inp_ptr + lo, count, BLOCK)
        r += 1
    tr = vd.next_span(tr, ALLREDUCE.ready)
    ccd.lsa_barrier_sync(devcomm, k)
    tr = vd.next_span(tr, ALLREDUCE.reduce)
    lo, count = _slice(me, k, n_elems, block_elems, per_program)
    _reduce(stage_ptr + lo, stage_ptr + lo, count, win, devcomm, ACC_F32, BLOCK)
    tr = vd.next_span(tr, ALLREDUCE.ready2)
    ccd.lsa_barrier_sync(devcomm, P + k)
    tr = vd.next_span(tr, ALLREDUCE.pull)
    r = tl.cast(0, tl.int64)
    while r < n:
        lo, count = _slice(r, k, n_elems, block_elems, per_program)
        _copy(out_ptr + lo, ccd.lsa_peer_ptr(stage_ptr + lo, win, r, devcomm), count, BLOCK)
        r += 1
    tr = vd.next_span(tr, ALLREDUCE.done)
    _finish(devcomm, ticket_ptr, 2 * P)
    tr = vd.end(tr, ALLREDUCE.done)
    tr = vd.end(tr, ALLREDUCE.kernel)
    vd.close_trace(tr)


@aot_variants(vd.traced_variants(_gather_variants(), traced=2 * len(WORD_TYPES)))
@triton.jit
def gather_kernel(
    # pointers (words): input, output, this rank's staging region (small: both halves; large)
    inp_ptr,
    out_ptr,
    stage_ptr,
    # staging window table, device communicator, the launch's ticket counter (int32, zero)
    win,
    devcomm,
    ticket_ptr,
    # elements of one block; blocks in the input (all-gather 1, all-to-all one per rank); the
    # block of every peer this rank takes (all-gather 0, all-to-all this rank's LSA rank)
    block_elems,
    in_blocks,
    src_block,
    # one program's slice of a block (a multiple of BLOCK); one small half (small calls)
    per_program,
    half_elems,
    # the large protocol (wait at DONE first, arrive at DONE last); elements per step
    LARGE: tl.constexpr,
    BLOCK: tl.constexpr,
    # trace buffer (mori.viz) when TRACE; None otherwise
    trace_ptr=None,
    TRACE: tl.constexpr = False,
):
    """All-gather / all-to-all by pulls. Program k stages slice k of every input block, syncs
    READY(k), then copies slice k of block ``src_block`` of every rank's staging into output block
    ``rank``."""
    tr = vd.open_trace(trace_ptr, TRACE)
    tr = vd.begin(tr, GATHER.kernel)
    k = tl.program_id(0)
    P = tl.num_programs(0)
    if LARGE:
        tr = vd.begin(tr, GATHER.wait_done)
        ccd.lsa_barrier_wait(devcomm, 2 * P)
        tr = vd.end(tr, GATHER.wait_done)
        base = stage_ptr
    else:
        base = stage_ptr + ((ccd.lsa_barrier_epoch(devcomm, k) + 1) % 2) * half_elems
    tr = vd.begin(tr, GATHER.stage)
    n_in = in_blocks * block_elems
    b = tl.cast(0, tl.int64)
    while b < in_blocks:
        lo, count = _slice(b, k, n_in, block_elems, per_program)
        _copy(base + lo, inp_ptr + lo, count, BLOCK)
        b += 1
    tr = vd.next_span(tr, GATHER.ready)
    ccd.lsa_barrier_sync(devcomm, k)
    tr = vd.next_span(tr, GATHER.pull)
    n = ccd.lsa_size(devcomm)
    lo, count = _slice(src_block, k, n_in, block_elems, per_program)
    p = tl.cast(0, tl.int64)
    while p < n:
        dst = out_ptr + p * block_elems + (lo - src_block * block_elems)
        _copy(dst, ccd.lsa_peer_ptr(base + lo, win, p, devcomm), count, BLOCK)
        p += 1
    tr = vd.end(tr, GATHER.pull)
    if LARGE:
        tr = vd.begin(tr, GATHER.done)
        _finish(devcomm, ticket_ptr, 2 * P)
        tr = vd.end(tr, GATHER.done)
    tr = vd.end(tr, GATHER.kernel)
    vd.close_trace(tr)


@aot_variants(
    [
        {
            "signature": {"devcomm": "*i64", "ticket_ptr": "*i32", "programs": "i64"},
            "constexprs": {"PHASE": phase},
            "aligned": ("devcomm",),
            "num_warps": 1,
            "label": name,
        }
        for phase, name in ((PHASE_WAIT_DONE, "wait DONE"), (PHASE_READY, "READY"), (PHASE_FINISH, "finish"))
    ]
)
@triton.jit
def sync_kernel(
    # device communicator, the launch's ticket counter (int32, zero)
    devcomm,
    ticket_ptr,
    # the channel's P (this launch has P programs)
    programs,
    # PHASE_WAIT_DONE, PHASE_READY or PHASE_FINISH
    PHASE: tl.constexpr,
):
    """The protocol's steps around copy-engine copies on the same stream: wait at DONE, sync
    READY(k) (program k: every READY barrier counts the call), or arrive at DONE (the last program)."""
    k = tl.program_id(0)
    if PHASE == 0:
        ccd.lsa_barrier_wait(devcomm, 2 * programs + k * 0)
    elif PHASE == 1:
        ccd.lsa_barrier_sync(devcomm, k)
    else:
        _finish(devcomm, ticket_ptr, 2 * programs)

"""Example kernels instrumented with mori.viz.device, used by the tests (under the interpreter)
and compiled for every GPU target by tools/compile_kernels.py, traced and untraced.

Imported inside rank functions or with TRITON_INTERPRET=1 already set: the interpreter is chosen
when ``triton.jit`` runs.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from mori import viz
from mori.core.kernels import aot, aot_variants
from mori.shmem import device as shd
from mori.viz import device as vd

#: the slots of the example kernels, declared once, next to them
COPY = viz.declare_slots("test.copy", ["kernel", "load", "store", "chunk", "done"])
PINGPONG = viz.declare_slots("test.pingpong", ["round", "wait", "sent", "received"])


def _traced_and_untraced(signature: dict[str, str], **constexprs: Any) -> list[dict[str, Any]]:
    return [
        {"signature": signature, "constexprs": {**constexprs, "TRACE": t}, "label": f"TRACE={t}"}
        for t in (True, False)
    ]


@aot_variants(
    _traced_and_untraced(
        {"dst_ptr": "*i32", "src_ptr": "*i32", "n": "i32", "trace_ptr": "*i64"}, CHUNKS=3, BLOCK=64
    )
)
@triton.jit
def copy_kernel(
    # int32 [n] destination and source
    dst_ptr,
    src_ptr,
    n,
    # trace buffer (int64), or anything when TRACE is off
    trace_ptr,
    TRACE: tl.constexpr,
    # chunks of BLOCK elements per program
    CHUNKS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program i copies its CHUNKS * BLOCK elements chunk by chunk, tracing each phase: a
    "kernel" span around everything, per chunk a "chunk" span with "load" then "store" inside
    (next_span), and a "done" instant."""
    tr = vd.open_trace(trace_ptr, TRACE)
    tr = vd.begin(tr, COPY.kernel)
    base = tl.program_id(0) * CHUNKS * BLOCK
    offs = tl.arange(0, BLOCK)
    for c in tl.static_range(CHUNKS):
        tr = vd.begin(tr, COPY.chunk)
        o = base + c * BLOCK + offs
        mask = o < n  # the last program's chunks may run past n
        tr = vd.begin(tr, COPY.load)
        x = tl.load(src_ptr + o, mask=mask)
        tr = vd.next_span(tr, COPY.store)
        tl.store(dst_ptr + o, x, mask=mask)
        tr = vd.end(tr, COPY.store)
        tr = vd.end(tr, COPY.chunk)
    tr = vd.instant(tr, COPY.done)
    tr = vd.end(tr, COPY.kernel)
    vd.close_trace(tr)


@aot(signature={"dst_ptr": "*i32", "src_ptr": "*i32", "n": "i32"}, constexprs={"CHUNKS": 3, "BLOCK": 64})
@triton.jit
def plain_copy_kernel(dst_ptr, src_ptr, n, CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    """copy_kernel without any tracing: what copy_kernel with TRACE=False must compile to."""
    base = tl.program_id(0) * CHUNKS * BLOCK
    offs = tl.arange(0, BLOCK)
    for c in tl.static_range(CHUNKS):
        o = base + c * BLOCK + offs
        mask = o < n
        x = tl.load(src_ptr + o, mask=mask)
        tl.store(dst_ptr + o, x, mask=mask)


@aot_variants(_traced_and_untraced({"out_ptr": "*i64", "n": "i32", "trace_ptr": "*i64"}))
@triton.jit
def loop_kernel(out_ptr, n, trace_ptr, TRACE: tl.constexpr):
    """n instants in a runtime loop (the state is loop-carried); out[pid] = n."""
    tr = vd.open_trace(trace_ptr, TRACE)
    i = 0
    while i < n:
        tr = vd.instant(tr, COPY.chunk)
        i += 1
    tl.store(out_ptr + tl.program_id(0), i.to(tl.int64))
    vd.close_trace(tr)


@aot_variants(
    _traced_and_untraced(
        {"buf_ptr": "*i64", "sig_ptr": "*i64", "ctx_ptr": "*i64", "rounds": "i32", "trace_ptr": "*i64"},
        BLOCK=16,
    )
)
@triton.jit
def pingpong_kernel(
    # symmetric int64 [BLOCK] payload and int64 [2] signal words (one per direction)
    buf_ptr,
    sig_ptr,
    ctx_ptr,
    # round trips
    rounds,
    trace_ptr,
    TRACE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """PE 0 and PE 1 (one program each) play ping-pong over shmem: in round r, PE 0 puts the
    payload with signal r+1 to PE 1 and waits for PE 1's answer r+1; PE 1 waits, then answers.
    "sent" is recorded before the signal is released, "received" after the wait returns, so a
    receiver's "received" is later in real time than the matching "sent"."""
    me = shd.my_pe(ctx_ptr)
    peer = 1 - me
    tr = vd.open_trace(trace_ptr, TRACE)
    r = 0
    while r < rounds:
        tr = vd.begin(tr, PINGPONG.round)
        if me == 0:
            tr = vd.instant(tr, PINGPONG.sent)
            shd.put_signal_block(
                buf_ptr, buf_ptr, sig_ptr, BLOCK, r + 1, peer, ctx_ptr, shd.SIGNAL_SET, BLOCK
            )
            tr = vd.begin(tr, PINGPONG.wait)
            shd.wait_until(sig_ptr + 1, shd.SHMEM_CMP_GE, r + 1)
            tr = vd.end(tr, PINGPONG.wait)
            tr = vd.instant(tr, PINGPONG.received)
        else:
            tr = vd.begin(tr, PINGPONG.wait)
            shd.wait_until(sig_ptr, shd.SHMEM_CMP_GE, r + 1)
            tr = vd.end(tr, PINGPONG.wait)
            tr = vd.instant(tr, PINGPONG.received)
            tr = vd.instant(tr, PINGPONG.sent)
            shd.signal_op(sig_ptr + 1, r + 1, shd.SIGNAL_SET, peer, ctx_ptr)
        tr = vd.end(tr, PINGPONG.round)
        r += 1
    vd.close_trace(tr)

# Jitted functions carry no Python annotations (Triton reads them), so mypy may not ask for them:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Instrumented example kernels: the pattern of the guide, and what ``mori bench viz`` times.

``phased_copy_kernel`` copies a buffer, each program its contiguous share, ``BLOCK`` elements per
chunk, inside a ``kernel`` span with ``split`` / ``copy`` / ``done`` phases; with
``PER_CHUNK=True`` it also records a ``chunk`` span around every chunk (two events per ``BLOCK``
elements: a stress far denser than a communication kernel's phases). ``record_loop_kernel``
records ``n`` instants per program and nothing else: the cost of one event.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from mori.core.kernels import aot_variants
from mori.viz import device as vd
from mori.viz.slots import declare_slots

__all__ = ["EXAMPLE", "phased_copy_kernel", "record_loop_kernel"]

#: the slots of the example kernels
EXAMPLE = declare_slots("viz.example", ["kernel", "split", "copy", "chunk", "done", "tick"])

#: elements per chunk of phased_copy_kernel
COPY_BLOCK = 4096


def _variants(signature: dict[str, str], **constexprs: Any) -> list[dict[str, Any]]:
    out = []
    for trace in (True, False):
        for per_chunk in (True, False) if "PER_CHUNK" in constexprs else (None,):
            c = {**constexprs, "TRACE": trace}
            if per_chunk is not None:
                c["PER_CHUNK"] = per_chunk
            label = f"TRACE={trace}" + (f" PER_CHUNK={per_chunk}" if per_chunk is not None else "")
            out.append(
                {"signature": signature, "constexprs": c, "aligned": ("dst_ptr", "src_ptr"), "label": label}
            )
    return out


@aot_variants(
    _variants(
        {"dst_ptr": "*i32", "src_ptr": "*i32", "n": "i64", "trace_ptr": "*i64"},
        PER_CHUNK=True,
        BLOCK=COPY_BLOCK,
    )
)
@triton.jit
def phased_copy_kernel(
    # int32 [n] destination and source
    dst_ptr,
    src_ptr,
    n,
    # trace buffer (int64), unused (or None) when TRACE is off
    trace_ptr,
    TRACE: tl.constexpr,
    # also a span per chunk
    PER_CHUNK: tl.constexpr,
    # elements per chunk (a power of two)
    BLOCK: tl.constexpr,
):
    """Program i copies elements ``[i*per, (i+1)*per)``, ``per = cdiv(cdiv(n, programs), BLOCK) *
    BLOCK``, chunk by chunk (masked at ``n``)."""
    tr = vd.open_trace(trace_ptr, TRACE)
    tr = vd.begin(tr, EXAMPLE.kernel)
    tr = vd.begin(tr, EXAMPLE.split)
    per = tl.cdiv(tl.cdiv(n, tl.num_programs(0)), BLOCK) * BLOCK
    start = tl.program_id(0).to(tl.int64) * per
    end = tl.minimum(start + per, n)
    offs = tl.arange(0, BLOCK)
    tr = vd.next_span(tr, EXAMPLE.copy)
    c = start
    while c < end:
        if PER_CHUNK:
            tr = vd.begin(tr, EXAMPLE.chunk)
        o = c + offs
        m = o < end  # the last chunk of the last program may run past n
        tl.store(dst_ptr + o, tl.load(src_ptr + o, mask=m), mask=m)
        if PER_CHUNK:
            tr = vd.end(tr, EXAMPLE.chunk)
        c += BLOCK
    tr = vd.end(tr, EXAMPLE.copy)
    tr = vd.instant(tr, EXAMPLE.done)
    tr = vd.end(tr, EXAMPLE.kernel)
    vd.close_trace(tr)


@aot_variants(
    [
        {
            "signature": {"out_ptr": "*i64", "n": "i32", "trace_ptr": "*i64"},
            "constexprs": {"TRACE": t},
            "label": f"TRACE={t}",
        }
        for t in (True, False)
    ]
)
@triton.jit
def record_loop_kernel(out_ptr, n, trace_ptr, TRACE: tl.constexpr):
    """Every program records ``n`` ``tick`` instants in a loop, then stores the loop count to
    ``out[pid]`` (int64), so that the untraced loop is not removed."""
    tr = vd.open_trace(trace_ptr, TRACE)
    i = 0
    while i < n:
        tr = vd.instant(tr, EXAMPLE.tick)
        i += 1
    tl.store(out_ptr + tl.program_id(0), tl.cast(i, tl.int64))
    vd.close_trace(tr)

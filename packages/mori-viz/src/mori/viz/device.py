# Jitted functions carry no Python annotations (Triton reads them), so mypy may not ask for them:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Device side of mori.viz: ``@triton.jit`` helpers that record spans and instants into a trace
buffer, compiled out entirely when tracing is off.

A kernel takes the buffer (:attr:`mori.viz.TraceBuffer.tensor`, int64) and a ``TRACE``
constexpr, opens its ring once, records, and closes it at the end::

    from mori import viz
    from mori.viz import device as vd

    SLOTS = viz.declare_slots("demo.copy", ["load", "store", "done"])

    @triton.jit
    def copy_kernel(dst_ptr, src_ptr, n, trace_ptr, TRACE: tl.constexpr, BLOCK: tl.constexpr):
        tr = vd.open_trace(trace_ptr, TRACE)
        tr = vd.begin(tr, SLOTS.load)
        x = tl.load(src_ptr + offs, mask=mask)
        tr = vd.next_span(tr, SLOTS.store)   # ends "load", begins "store": one timestamp
        tl.store(dst_ptr + offs, x, mask=mask)
        tr = vd.end(tr, SLOTS.store)
        tr = vd.instant(tr, SLOTS.done)
        vd.close_trace(tr)

**Off means absent.** With ``TRACE=False`` every helper is a constexpr branch that Triton does not
compile: the kernel is the uninstrumented kernel (its ``trace_ptr`` argument unused; pass ``None``
and Triton drops it from the signature too). Traced and untraced kernels are two variants of one
source, each compiled on first use.

**State.** :func:`open_trace` returns a small tuple (the ring's event pointer, its write cursor
and launch number, kept in registers; a one-element tuple when off); every recording helper returns it updated, so assign it
back (``tr = vd.begin(tr, ...)``), including inside loops and branches. :func:`close_trace`
writes the cursor back; a kernel that does not call it leaves its events unpublished.

**Cost when on**, per program and launch: four header loads at :func:`open_trace` (issued
together, one memory round trip: the buffer is allocated with room for every ring's row,
:data:`mori.viz.layout.MIN_DEVICE_WORDS`), two stores at :func:`close_trace`, and per event one
timer read and two 8-byte stores by one thread, which the program does not wait for. Measured on
an H200 (64 programs of 8 warps, a CUDA graph of 20 launches, each program a chain of dependent
loads with one event per load): 0.23 us more per launch than the untraced kernel with 2 events per
program, 0.27 us with 16 (0.37 and 0.42 us when the ring's row was read only after the header
arrived); a timer read alone costs nothing measurable.

**Buffers.** A kernel records into a :class:`mori.viz.TraceBuffer`'s ``tensor`` (or any int64
buffer of :func:`mori.viz.layout.device_words` words with its header): one of only
:func:`~mori.viz.layout.buffer_words` words would let programs read past its end.

**What is recorded.** One ring per program (the flattened program id); programs beyond the
buffer's ``n_rings`` record nothing. Triton runs all warps of a program through the same code and
stores a scalar from one thread, so a record is the program's (its first warp's) view; the warp
field of the event is 0. Timestamps: ``%globaltimer`` on NVIDIA (nanoseconds, one clock for the
whole GPU), ``s_memrealtime`` on AMD (the constant-rate wall clock, 100 MHz on MI300), and the host
clock (``CLOCK_MONOTONIC``, nanoseconds) under ``TRITON_INTERPRET=1``. Proton's instrumentation
mode, which this follows, inserts its records in a compiler pass and uses the SM cycle counter;
here records are explicit calls in the kernel and timestamps are on one clock across all
programs, so that spans of different programs, and (after :mod:`mori.viz.clock`'s alignment) of
different ranks, can be compared.
"""

from __future__ import annotations

import time
from typing import Any

try:
    import triton
    import triton.language as tl
    from triton.language import core as tlc
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "mori.viz.device needs Triton: install it with `pip install mori-core[triton]` "
        "(torch wheels for NVIDIA GPUs bring it already)"
    ) from e

from mori.core.kernels import aot, device_function
from mori.viz import layout

__all__ = [
    "begin",
    "clock_kernel",
    "clock_ping_kernel",
    "close_trace",
    "end",
    "instant",
    "next_span",
    "open_trace",
    "timestamp",
    "traced_variants",
]

_H_RINGS = tl.constexpr(layout.H_RINGS)
_H_CAPACITY = tl.constexpr(layout.H_CAPACITY)
_HEADER_WORDS = tl.constexpr(layout.HEADER_WORDS)
_MAX_RINGS = tl.constexpr(layout.MAX_RINGS)
_RING_WORDS = tl.constexpr(layout.RING_WORDS)
_EVENT_WORDS = tl.constexpr(layout.EVENT_WORDS)
_BEGIN = tl.constexpr(layout.BEGIN)
_END = tl.constexpr(layout.END)
_INSTANT = tl.constexpr(layout.INSTANT)
_NEXT = tl.constexpr(layout.NEXT)
_SLOT_SHIFT = tl.constexpr(layout.SLOT_SHIFT)
_LAUNCH_SHIFT = tl.constexpr(layout.LAUNCH_SHIFT)
_MAX_SLOT = tl.constexpr(layout.MAX_SLOT)


def _read_timer(_semantic: Any = None) -> Any:
    # Not a jitted function but a Triton builtin (marked below): Triton calls it with the
    # compiler's semantic object while generating code, and the interpreter calls it as plain
    # Python (no semantic object), where the "device" is this host.
    if _semantic is None:
        return tl.full((), time.monotonic_ns(), tl.int64)
    arch = str(getattr(_semantic.builder.options, "arch", "") or "")
    if arch.startswith("gfx"):
        if arch.startswith(("gfx11", "gfx12")):  # RDNA: the real-time counter is read by a message
            asm = "s_sendmsg_rtn_b64 $0, sendmsg(MSG_RTN_GET_REALTIME)\ns_waitcnt lgkmcnt(0)"
        else:  # CDNA (gfx9xx): scalar memory read of the 100 MHz wall clock
            asm = "s_memrealtime $0\ns_waitcnt lgkmcnt(0)"
        return tlc.inline_asm_elementwise(
            asm, "=s", [], dtype=tl.int64, is_pure=False, pack=1, _semantic=_semantic
        )
    return tlc.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1, _semantic=_semantic
    )


_read_timer.__triton_builtin__ = True  # type: ignore[attr-defined]


@device_function
@triton.jit
def timestamp():
    """The trace clock now, an int64 scalar in ticks (see the module docstring for the clock)."""
    return _read_timer()


@device_function
@triton.jit
def _ring_id():
    # flattened program id: axis 0 fastest
    pid = tl.program_id(0).to(tl.int64)
    pid += tl.program_id(1).to(tl.int64) * tl.num_programs(0)
    pid += tl.program_id(2).to(tl.int64) * tl.num_programs(0) * tl.num_programs(1)
    return pid


@device_function
@triton.jit
def open_trace(trace_ptr, TRACE: tl.constexpr):
    """Open this program's ring of the trace buffer ``trace_ptr`` (int64); return the state.

    Call once, at the start of the kernel; with ``TRACE=False`` it reads nothing and every
    helper that gets the state does nothing.
    """
    if TRACE:
        ring = _ring_id()
        # the four loads do not wait for each other (one memory round trip): the ring's row is
        # inside the allocation for any id below MAX_RINGS (layout.MIN_DEVICE_WORDS), and what a
        # program beyond n_rings reads there is ignored, as it then stores nothing
        ring_ptr = trace_ptr + _HEADER_WORDS + tl.minimum(ring, _MAX_RINGS - 1) * _RING_WORDS
        n_rings = tl.load(trace_ptr + _H_RINGS)
        capacity = tl.load(trace_ptr + _H_CAPACITY)
        written = tl.load(ring_ptr)
        launch = tl.load(ring_ptr + 1)
        ok = ring < n_rings
        events_ptr = trace_ptr + (_HEADER_WORDS + n_rings * _RING_WORDS + ring * capacity * _EVENT_WORDS)
        state = (events_ptr, written, capacity - 1, launch << _LAUNCH_SHIFT, ok, ring_ptr, launch)
    else:
        # Off: a one-element tuple. Its length is known while Triton generates code, so every
        # helper's `if len(tr) > 1` is decided then and nothing of it is compiled. (A constexpr
        # flag inside the tuple would not do: Triton turns constexprs passed through calls into
        # values; and an empty tuple breaks Triton 3.6's code for a runtime `if` that assigns it.)
        state = (TRACE,)  # type: ignore[assignment]
    return state


@device_function
@triton.jit
def _record(tr, KIND: tl.constexpr, SLOT: tl.constexpr):
    # tr = (events_ptr, written, capacity - 1, launch << 32, ok, ring_ptr, launch), or (False,) when off
    if len(tr) > 1:
        tl.static_assert(SLOT > 0 and SLOT <= _MAX_SLOT, "SLOT must be a slot id from viz.declare_slots")
        written = tr[1]
        p = tr[0] + (written & tr[2]) * _EVENT_WORDS
        ts = _read_timer()
        tl.store(p, ts, mask=tr[4])
        tl.store(p + 1, tr[3] | ((SLOT << _SLOT_SHIFT) | KIND), mask=tr[4])
        tr = (tr[0], written + 1, tr[2], tr[3], tr[4], tr[5], tr[6])
    return tr


@device_function
@triton.jit
def begin(tr, SLOT: tl.constexpr):
    """Begin a span of ``SLOT``; returns the state. Spans nest: end them innermost first."""
    return _record(tr, _BEGIN, SLOT)


@device_function
@triton.jit
def end(tr, SLOT: tl.constexpr):
    """End the innermost open span, which must be of ``SLOT``; returns the state."""
    return _record(tr, _END, SLOT)


@device_function
@triton.jit
def next_span(tr, SLOT: tl.constexpr):
    """End the innermost open span and begin one of ``SLOT``, with one timestamp (consecutive
    phases: the original's ``MORI_TRACE_SEQ`` / ``MORI_TRACE_NEXT``); returns the state."""
    return _record(tr, _NEXT, SLOT)


@device_function
@triton.jit
def instant(tr, SLOT: tl.constexpr):
    """Record an instant event of ``SLOT`` (a point in time: "sent", "received"); returns the state."""
    return _record(tr, _INSTANT, SLOT)


def traced_variants(variants: list[dict[str, Any]], traced: int = 1) -> list[dict[str, Any]]:
    """The ahead-of-time variants (``mori.core.kernels.aot_variants``) of an instrumented kernel
    whose last arguments are ``trace_ptr=None, TRACE: tl.constexpr = False``: every variant as a
    launch with tracing off passes it (``trace_ptr`` left at None, which Triton specialises as a
    constexpr, ``TRACE=False``), and the first ``traced`` of them as a launch with a
    :class:`~mori.viz.TraceBuffer` passes it (``trace_ptr`` an aligned int64 tensor, ``TRACE=True``).
    Declaring ``trace_ptr`` as a pointer in an untraced variant compiles code no launch looks up."""
    off = [{**v, "constexprs": {**v["constexprs"], "trace_ptr": None, "TRACE": False}} for v in variants]
    on = [
        {
            **v,
            "signature": {**v["signature"], "trace_ptr": "*i64"},
            "constexprs": {**v["constexprs"], "TRACE": True},
            "aligned": (*v.get("aligned", ()), "trace_ptr"),
            "label": v.get("label", "") + " traced",
        }
        for v in variants[:traced]
    ]
    return off + on


@device_function
@triton.jit
def close_trace(tr):
    """Publish this program's events: write the ring's cursor and launch count back. Call once, at
    the end of the kernel (after the last record)."""
    if len(tr) > 1:
        tl.store(tr[5], tr[1], mask=tr[4])
        tl.store(tr[5] + 1, tr[6] + 1, mask=tr[4])


# -- clock calibration kernels (used by mori.viz.clock) ---------------------------------------------


@aot(signature={"out_ptr": "*i64"})
@triton.jit
def clock_kernel(out_ptr):
    """out[0] = the trace clock now (one program)."""
    tl.store(out_ptr, timestamp())


@aot(signature={"flag_ptr": "*i64", "out_ptr": "*i64", "n": "i32"})
@triton.jit
def clock_ping_kernel(
    # host-visible int64 words (pinned host memory on a GPU): the host's flag, the answers [n]
    flag_ptr,
    out_ptr,
    # rounds
    n,
):
    """For round i < n: wait until the host sets ``flag >= i + 1``, then write the trace clock to
    ``out[i]`` (one program). The host brackets each round with its own clock."""
    i = 0
    while i < n:
        f = tl.load(flag_ptr, volatile=True)
        while f < i + 1:
            f = tl.load(flag_ptr, volatile=True)
        tl.store(out_ptr + i, timestamp())
        i += 1

#!/usr/bin/env python3
"""GPU check of what a traced launch pays (issue 20): the ring's opening, events, timer reads.

One kernel, 64 programs of 8 warps, each a chain of ``PHASES`` dependent loads (one memory latency
per phase, like a wait on a flag) with one ``next_span`` per load, in four variants timed in the
same run: ``off`` (the uninstrumented kernel), ``off+timer`` (a timer read per phase, nothing
stored), ``on`` (:func:`mori.viz.device.open_trace`, which reads the header and the ring's row in
one memory round trip) and ``on, two-round open`` (the opening before ``b922d02``: the ring's row
read only after ``n_rings`` arrived, written out here). Each variant is captured in a CUDA graph of
20 launches; 60 replays of every graph, interleaved; printed: the median per launch in us with
p10-p90 and the difference to ``off``. Under ``TRITON_INTERPRET=1`` (no GPU) every variant runs
once as a check of the code.

On an H200 (2026-12-03, before ``b922d02``, when ``on`` was the two-round opening): ``on`` added
0.37 / 0.41 / 0.42 us per launch at 0 / 7 / 14 phases, the one-round opening 0.23 / 0.27 / 0.27 us,
``off+timer`` -0.02 us: the cost is fixed per launch, not per event.

    python tools/viz_open_gpu_check.py
"""

from __future__ import annotations

import os
import statistics

import torch
import triton
import triton.language as tl

from mori import viz
from mori.viz import device as vd
from mori.viz import layout

S1 = tl.constexpr(1)
S2 = tl.constexpr(2)
H_RINGS = tl.constexpr(layout.H_RINGS)
H_CAPACITY = tl.constexpr(layout.H_CAPACITY)
HEADER_WORDS = tl.constexpr(layout.HEADER_WORDS)
LAUNCH_SHIFT = tl.constexpr(layout.LAUNCH_SHIFT)


@triton.jit
def open_two_round(trace_ptr):
    # vd.open_trace's state, as it was opened before b922d02: the row's loads masked by ring < n_rings
    ring = tl.program_id(0).to(tl.int64)
    n_rings = tl.load(trace_ptr + H_RINGS)
    capacity = tl.load(trace_ptr + H_CAPACITY)
    ok = ring < n_rings
    ring_ptr = trace_ptr + HEADER_WORDS + ring * 2
    written = tl.load(ring_ptr, mask=ok, other=0)
    launch = tl.load(ring_ptr + 1, mask=ok, other=0)
    events_ptr = trace_ptr + (HEADER_WORDS + n_rings * 2 + ring * capacity * 2)
    return (events_ptr, written, capacity - 1, launch << LAUNCH_SHIFT, ok, ring_ptr, launch)


@triton.jit
def chain_kernel(x_ptr, out_ptr, trace_ptr, TRACE: tl.constexpr, OLD_OPEN: tl.constexpr,
                 PHASES: tl.constexpr, TIMER: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    if OLD_OPEN:
        tr = open_two_round(trace_ptr)
    else:
        tr = vd.open_trace(trace_ptr, TRACE)
    tr = vd.begin(tr, S1)
    idx = pid * 1024
    for _ in tl.static_range(PHASES):
        idx = tl.load(x_ptr + idx)
        if TIMER:
            idx += (vd.timestamp() & 0).to(tl.int32)
        tr = vd.next_span(tr, S2)
    tr = vd.end(tr, S2)
    tl.store(out_ptr + pid, idx)
    vd.close_trace(tr)


VARIANTS = {
    "off": {"trace": False, "old": False, "timer": False},
    "off+timer": {"trace": False, "old": False, "timer": True},
    "on": {"trace": True, "old": False, "timer": False},
    "on, two-round open": {"trace": True, "old": True, "timer": False},
}


def main() -> None:
    gpu = torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET")
    dev = torch.device("cuda" if gpu else "cpu")
    n = 1 << 20
    x = ((torch.arange(n, dtype=torch.int64) * 7919 + 13) % n).to(torch.int32).to(dev)
    out = torch.zeros(64, dtype=torch.int32, device=dev)
    buf = viz.TraceBuffer(256, 4096, device=dev, calibrate=False)

    def launch(trace: bool, old: bool, timer: bool, phases: int) -> None:
        chain_kernel[(64,)](x, out, buf.tensor if trace else None, TRACE=trace, OLD_OPEN=old,
                            PHASES=phases, TIMER=timer, num_warps=8)  # fmt: skip

    if not gpu:
        for v in VARIANTS.values():
            launch(phases=2, **v)
        print(f"interpreter: every variant ran; {buf.read().events.size} events recorded")
        return
    for phases in (0, 7, 14):
        graphs = {}
        for name, v in VARIANTS.items():
            for _ in range(3):
                launch(phases=phases, **v)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(20):
                    launch(phases=phases, **v)
            graphs[name] = g
        samples: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for _ in range(60):
            for name, g in graphs.items():
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                g.replay()
                b.record()
                b.synchronize()
                samples[name].append(a.elapsed_time(b) * 1000 / 20)
        off = statistics.median(samples["off"])
        for name, q in samples.items():
            q.sort()
            med = statistics.median(q)
            print(f"phases {phases:2d}  {name:20s} {med:7.3f} us/launch [p10 {q[6]:.3f}, p90 {q[53]:.3f}]"
                  f"  vs off {med - off:+.3f}")  # fmt: skip


if __name__ == "__main__":
    main()

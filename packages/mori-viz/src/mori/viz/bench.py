"""Cost of tracing: instrumented kernels with tracing on against the same kernels with it off.

``mori bench viz`` times the example kernels of :mod:`mori.viz.examples` on one device, each
in its traced (``TRACE=True``, recording into a :class:`~mori.viz.TraceBuffer`) and untraced
(``TRACE=False``: the uninstrumented kernel) variant, in the same run:

* ``copy/phases``: a copy of ``--mib`` MiB by ``--programs`` programs, each recording its
  ``kernel`` / ``split`` / ``copy`` / ``done`` phases (6 events per program and launch, about what
  a communication kernel records);
* ``copy/chunks``: the same copy with a span around every 16 KiB chunk as well (2 events per
  chunk): a stress far denser than any MORI kernel's phases;
* ``record``: ``--events`` instants per program and nothing else: the cost of one event.

Timing. GPU: each variant is captured in a CUDA graph of ``--reps`` launches; one sample = one
graph replay between two CUDA events, traced and untraced replays alternating; time per launch =
elapsed / reps. CPU (the Triton interpreter, functional only): wall clock around one launch; those
times say nothing about a GPU. The table gives the median with p10-p90 of each, the ratio of the
medians (traced / untraced) and the added time per recorded event.

Checks in the same run: both variants produce the same output; the traced one records exactly
the expected number of events per program, in order, with non-decreasing timestamps. Also
reported: the clock pairs (method and error bound) and the trace clock's granularity (the smallest
non-zero step between two events of one program). ``--trace DIR`` writes the rank trace and a
Chrome JSON of the traced runs there.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mori.core import bench
from mori.core.bench import Stats, format_table, write_json

__all__ = ["add_arguments", "run"]

INTERPRET = {"TRITON_INTERPRET": "1"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device", choices=("auto", "cuda", "cpu"), default="auto", help="default: cuda if available"
    )
    p.add_argument("--mib", type=float, default=None, help="MiB copied per launch (default cuda 256, cpu 1)")
    p.add_argument(
        "--programs", type=int, default=None, help="programs per launch (default: SM count; cpu 4)"
    )
    p.add_argument(
        "--events", type=int, default=None, help="instants per program of `record` (default 256; cpu 16)"
    )
    p.add_argument(
        "--reps", type=int, default=None, help="launches per graph replay (default cuda 20, cpu 1)"
    )
    p.add_argument("--iters", type=int, default=None, help="samples per variant (default cuda 50, cpu 3)")
    p.add_argument("--warmup", type=int, default=3, help="untimed samples first")
    p.add_argument(
        "--trace", default=None, metavar="DIR", help="write the rank trace and a Chrome JSON there"
    )
    p.add_argument("--json", default=None, metavar="FILE", help="write the result record (JSON)")


def _spec(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("mori bench viz: --device cuda, but torch sees no GPU")
    programs = args.programs
    if programs is None:
        programs = torch.cuda.get_device_properties(0).multi_processor_count if cuda else 4
    return {
        "device": device,
        "bytes": int((args.mib if args.mib is not None else (256 if cuda else 1)) * (1 << 20)) // 4 * 4,
        "programs": programs,
        "events": args.events if args.events is not None else (256 if cuda else 16),
        "reps": args.reps if args.reps is not None else (20 if cuda else 1),
        "iters": args.iters if args.iters is not None else (50 if cuda else 3),
        "warmup": args.warmup,
        "trace": args.trace,
    }


def _timer(spec: dict[str, Any], launches: dict[str, Any]) -> dict[str, list[float]]:
    """Seconds per launch of each function in ``launches``, samples interleaved."""
    import torch

    reps, iters, warmup = spec["reps"], spec["iters"], spec["warmup"]
    if spec["device"] != "cuda":
        return bench.time_interleaved(launches, iters=iters, warmup=warmup)
    graphs = {}
    for name, fn in launches.items():
        fn()  # compile and load outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        graphs[name] = g
    torch.cuda.synchronize()
    out: dict[str, list[float]] = {k: [] for k in launches}
    for i in range(warmup + iters):
        for name, g in graphs.items():
            dt = bench.time_cuda(g.replay, reps)
            if i >= warmup:
                out[name].append(dt)
    return out


def _check_ring_order(data: Any, expected: list[int], what: str) -> int:
    """Program ``p`` recorded ``expected[p]`` events, time never going back; returns the smallest
    non-zero step between consecutive events of one program (ns, or ticks on AMD)."""
    import numpy as np

    got = data.written[: len(expected)].tolist()
    if got != expected:
        bad = [p for p, (g, e) in enumerate(zip(got, expected, strict=True)) if g != e][:5]
        raise AssertionError(
            f"{what}: programs {bad} recorded {[got[p] for p in bad]} events, not {[expected[p] for p in bad]}"
        )
    step = 0
    for r in range(len(expected)):
        ts = data.events["ts"][data.events["ring"] == r]
        d = np.diff(ts)
        if (d < 0).any():
            raise AssertionError(f"{what}: program {r}'s timestamps go back")
        pos = d[d > 0]
        if pos.size:
            step = int(pos.min()) if step == 0 else min(step, int(pos.min()))
    return step


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _bench(rank: int, nranks: int, spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from mori import viz
    from mori.viz import examples as ex

    dev = (
        torch.device("cuda", torch.cuda.current_device()) if spec["device"] == "cuda" else torch.device("cpu")
    )
    programs, n = spec["programs"], spec["bytes"] // 4
    src = torch.arange(n, dtype=torch.int32, device=dev)
    dst = torch.zeros_like(src)
    per = _cdiv(_cdiv(n, programs), ex.COPY_BLOCK) * ex.COPY_BLOCK  # elements per program (the kernel's rule)
    chunks = [max(0, _cdiv(min(p * per + per, n) - p * per, ex.COPY_BLOCK)) for p in range(programs)]
    rows: list[dict[str, Any]] = []
    buffers = []
    progress = bench.Progress("mori bench viz", 3)

    def copy_case(name: str, per_chunk: bool) -> None:
        progress.step(name)
        expected = [6 + (2 * c if per_chunk else 0) for c in chunks]
        cap = 1 << max(4, (max(expected) * 4 - 1).bit_length())
        buf = viz.TraceBuffer(n_rings=programs, capacity=cap, device=dev, name=name.replace("/", "-"))
        buffers.append(buf)

        def traced() -> None:
            ex.phased_copy_kernel[(programs,)](
                dst, src, n, buf.tensor, TRACE=True, PER_CHUNK=per_chunk, BLOCK=ex.COPY_BLOCK
            )

        def untraced() -> None:
            ex.phased_copy_kernel[(programs,)](
                dst, src, n, None, TRACE=False, PER_CHUNK=per_chunk, BLOCK=ex.COPY_BLOCK
            )

        for fn in (untraced, traced):
            dst.zero_()
            fn()
            if not torch.equal(dst, src):
                raise AssertionError(f"{name}: the {fn.__name__} copy is wrong")
        step = _check_ring_order(buf.read(), expected, name)
        buf.reset()
        t = _timer(spec, {"untraced": untraced, "traced": traced})
        rows.append(_row(name, sum(expected), spec["bytes"], t, step))

    copy_case("copy/phases", False)
    copy_case("copy/chunks", True)

    progress.step("record")
    events = spec["events"]
    out = torch.zeros(programs, dtype=torch.int64, device=dev)
    cap = 1 << max(4, (events * 4 - 1).bit_length())
    rbuf = viz.TraceBuffer(n_rings=programs, capacity=cap, device=dev, name="record")
    buffers.append(rbuf)

    def rtraced() -> None:
        ex.record_loop_kernel[(programs,)](out, events, rbuf.tensor, TRACE=True)

    def runtraced() -> None:
        ex.record_loop_kernel[(programs,)](out, events, None, TRACE=False)

    rtraced()
    step = _check_ring_order(rbuf.read(), [events] * programs, "record")
    rbuf.reset()
    rows.append(
        _row("record", events * programs, 0, _timer(spec, {"untraced": runtraced, "traced": rtraced}), step)
    )
    progress.close()

    trace_info: dict[str, Any] = {}
    if spec["trace"]:
        trace = viz.capture(buffers, host=False, rank=rank, world_size=nranks)
        path = trace.save(Path(spec["trace"]) / f"rank{rank}")
        report = viz.export_to_perfetto(trace, Path(spec["trace"]) / "viz-bench.json")
        trace_info = {"saved": str(path), "exported": report.summary()}
    pair = buffers[0].clock_pairs[-1] if buffers[0].clock_pairs else None
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (Triton interpreter)"
    return {
        "device_name": name,
        "rows": rows,
        "clock_pair": pair.to_json() if pair else None,
        "trace": trace_info,
    }


def _row(case: str, events: int, nbytes: int, t: dict[str, list[float]], step: int) -> dict[str, Any]:
    off, on = Stats.of(t["untraced"]), Stats.of(t["traced"])
    return {
        "case": case,
        "events_per_launch": events,
        "bytes": nbytes,
        "untraced_us": {k: v * 1e6 for k, v in vars(off).items() if k != "n"},
        "traced_us": {k: v * 1e6 for k, v in vars(on).items() if k != "n"},
        "samples": off.n,
        "ratio": on.median / off.median if off.median else float("nan"),
        "ns_per_event": (on.median - off.median) * 1e9 / events if events else float("nan"),
        "clock_step": step,
    }


def run(args: argparse.Namespace) -> int:
    from mori.core.launch import run_ranks

    spec = _spec(args)
    env = INTERPRET if spec["device"] == "cpu" else {}
    # one rank in its own process: the interpreter must be chosen before Triton is imported
    (res,) = run_ranks(_bench, 1, spec, env=env, timeout=1800.0)
    mode = (
        f"CUDA graph of {spec['reps']} launches per sample, traced and untraced alternating"
        if spec["device"] == "cuda"
        else "Triton interpreter, wall clock per launch (functional check; not GPU timings)"
    )
    print(f"mori bench viz on {res['device_name']}: {spec['programs']} programs, {mode}")
    table = []
    for r in res["rows"]:
        u, t = r["untraced_us"], r["traced_us"]
        table.append(
            [
                r["case"],
                r["events_per_launch"],
                f"{u['median']:.2f} ({u['p10']:.2f}-{u['p90']:.2f})",
                f"{t['median']:.2f} ({t['p10']:.2f}-{t['p90']:.2f})",
                f"{r['ratio']:.4f}",
                f"{r['ns_per_event']:.2f}",
                r["clock_step"],
            ]
        )
    print(
        format_table(
            [
                "case",
                "events/launch",
                "untraced µs (p10-p90)",
                "traced µs (p10-p90)",
                "ratio",
                "ns/event",
                "clock step",
            ],
            table,
        )
    )
    if res["clock_pair"]:
        p = res["clock_pair"]
        print(f"clock pair: {p['method']}, error bound {p['error_ns']} ns")
    if res["trace"]:
        print(res["trace"]["exported"])
    if args.json:
        out = write_json(args.json, "viz", {**spec, "device_name": res["device_name"]}, res["rows"])
        print(f"wrote {out}")
    return 0

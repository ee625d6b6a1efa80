"""All-reduce, all-gather, all-to-all in nccl-tests' layout, against gloo / NCCL / torch symm_mem.

Latency and bandwidth of mori.ccl's collectives and, in the same run, of the collectives a user
would pick instead.

``mori bench cco`` runs :class:`~mori.ccl.AllreduceSdma`, :class:`~mori.ccl.AllgatherSdma` and
:class:`~mori.ccl.All2allSdma` on ``--ranks`` local ranks (one :class:`~mori.cco.Communicator`)
and, on the same ranks and buffers' sizes, the baselines:

* CPU ranks (``--device cpu``): ``torch.distributed`` over **gloo** (``all_reduce``,
  ``all_gather_into_tensor``, ``all_to_all_single``);
* GPUs (``--device cuda``): **NCCL** through ``torch.distributed``, and for all-reduce torch
  **symmetric memory** ``one_shot_all_reduce`` and ``two_shot_all_reduce_``, wherever they run (a
  baseline that fails, e.g. NCCL with two ranks on one GPU, is reported with its error). The GPU
  run also times the **device barrier** (mori.cco's LSA barrier kernel) and reports every
  all-reduce time as a multiple of it.

**Sizes** are nccl-tests' "size": all-reduce: the buffer (``count`` elements of ``--dtype``);
all-gather: the gathered output (``ranks`` blocks); all-to-all: one rank's send buffer.
**Bandwidth** (GB = 1e9 bytes): ``algbw = size / time``; ``busbw`` by the nccl-tests formulas:
all-reduce ``algbw * 2 (n-1) / n``, all-gather and all-to-all ``algbw * (n-1) / n``.

**Timing.** CPU: wall clock (``perf_counter``) around ``reps`` host-blocking calls after a gloo
barrier, ``reps`` chosen (the same on every rank) so a sample lasts about ``--target-ms``; each
rank runs torch with ``cores / ranks`` threads (at least one). GPU: a CUDA graph of ``--reps`` calls,
replayed between CUDA events right after a device barrier; eager with events where capture fails
(said so). A sample is the slowest rank's time per call; the table gives the median and the p10-p90
spread of ``--iters`` samples, mori and baselines interleaved sample by sample. ``#wrong`` counts
the output elements of mori's last call that differ from the exact expected result (inputs are small
integers, so float sums are exact too).
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from mori.core import bench
from mori.core.errors import bad_value

__all__ = ["add_arguments", "busbw_factor", "run"]

SUITE = "mori bench cco"
COLLECTIVES = ("allreduce", "allgather", "alltoall")
DTYPES = ("float32", "bfloat16", "float16", "int32", "uint32")


def _default_sizes(device: str) -> list[int]:
    top = 64 << 20 if device == "cpu" else 1 << 30
    out, s = [], 4 << 10
    while s <= top:
        out.append(s)
        s *= 4
    return out


def busbw_factor(collective: str, n: int) -> float:
    """nccl-tests' busbw / algbw."""
    if collective == "allreduce":
        return 2 * (n - 1) / n
    return (n - 1) / n


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu ranks or one GPU per rank")
    p.add_argument("--ranks", type=int, default=None, help="ranks (default: cpu 4, cuda 2)")
    p.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="cuda: GPUs the ranks share, rank r on GPU r %% gpus (default all)",
    )
    p.add_argument(
        "--collectives",
        type=functools.partial(bench.name_list, allowed=COLLECTIVES),
        default=list(COLLECTIVES),
        help=f"comma list of {', '.join(COLLECTIVES)} (default all)",
    )
    p.add_argument(
        "--sizes",
        type=bench.size_list,
        default=None,
        help="comma list of sizes (e.g. 4K,1M,64M; default 4 KiB to 64 MiB on cpu, to 1 GiB on cuda, x4 steps)",
    )
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="all-reduce dtype (default float32)")
    p.add_argument("--impl", choices=("auto", "host", "triton"), default="auto", help="mori implementation")
    p.add_argument(
        "--max-programs",
        type=int,
        default=None,
        help="programs per kernel launch (default: the collectives' own)",
    )
    p.add_argument("--iters", type=int, default=None, help="samples per size (default cpu 7, cuda 20)")
    p.add_argument("--warmup", type=int, default=2, help="untimed samples first (default 2)")
    p.add_argument("--reps", type=int, default=20, help="cuda: calls per CUDA graph (default 20)")
    p.add_argument(
        "--target-ms", type=float, default=30.0, help="cpu: about this long per sample (default 30)"
    )
    p.add_argument("--no-baseline", action="store_true", help="time mori only")
    bench.output_arguments(p, "cco-DEVICE")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before the ranks are killed")
    p.add_argument(
        "--trace",
        default=None,
        metavar="DIR",
        help="also trace each size's checked call (Triton kernels, mori.viz), untimed; per-rank traces "
        "in DIR/<collective>/ (open them with `mori viz export`)",
    )


def _spec(args: argparse.Namespace) -> dict[str, Any]:
    dev = args.device
    ranks = args.ranks if args.ranks is not None else (4 if dev == "cpu" else 2)
    if ranks < 2:
        raise bad_value(SUITE, "--ranks", ranks, "an int >= 2")
    sizes = args.sizes or _default_sizes(dev)
    for coll in args.collectives:
        unit = 4 * (ranks if coll != "allreduce" else 1)
        odd = [s for s in sizes if s % unit]
        if odd:
            raise bad_value(SUITE, "--sizes", odd, f"multiples of {unit} bytes for {coll} with {ranks} ranks")
    for name in ("warmup", "reps"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            raise bad_value(SUITE, f"--{name}", getattr(args, name), "a positive int")
    iters = args.iters if args.iters is not None else (7 if dev == "cpu" else 20)
    if iters < 1:
        raise bad_value(SUITE, "--iters", iters, "an int >= 1")
    return {
        "device": dev,
        "ranks": ranks,
        "gpus": args.gpus,
        "collectives": list(args.collectives),
        "sizes": sizes,
        "dtype": args.dtype,
        "impl": args.impl,
        "max_programs": args.max_programs,
        "iters": iters,
        "warmup": args.warmup,
        "reps": args.reps,
        "target_s": args.target_ms / 1e3,
        "baseline": not args.no_baseline,
        "trace": args.trace,
        "port": bench.free_port(),
    }


def run(args: argparse.Namespace) -> int:
    spec = _spec(args)
    from mori.cco import Communicator
    from mori.core.launch import run_ranks

    env = {"MORI_DEVICE_RUNTIME": "cpu"}
    if spec["device"] == "cuda":
        import torch

        env = bench.gpu_rank_env(SUITE)
        spec["gpus"] = spec["gpus"] or torch.cuda.device_count()
    uid = Communicator.get_unique_id()
    load_before = os.getloadavg()
    results = run_ranks(_rank_main, spec["ranks"], uid, spec, timeout=args.timeout, env=env)
    rows = results[0]["rows"]
    config = {k: v for k, v in spec.items() if k != "port"}
    # the machine's 1/5/15-minute load averages around the run: CPU ranks share the cores with it
    config["load_average"] = {
        "before": [round(x, 2) for x in load_before],
        "after": [round(x, 2) for x in os.getloadavg()],
    }
    config.update(
        {k: results[0][k] for k in ("device_name", "torch", "barrier_us", "barrier_mode", "baselines_failed")}
    )
    ok = _report(config, rows)
    path = bench.json_path(args.json, f"cco-{spec['device']}")
    bench.write_json(path, "cco", config, rows)
    print(f"wrote {path}")
    if spec["trace"]:
        print(
            f"traces: {spec['trace']}/<collective>/rank*.mviz.npz (Triton kernels only; none on the host path)"
        )
    _plot(bench.plot_path(args.plot, path), config, rows)
    return 0 if ok else 1


# -- ranks ---------------------------------------------------------------------------------------------


def _rank_main(rank: int, nranks: int, uid: Any, spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from mori.cco import CCODevCommRequirements, Communicator

    cuda = spec["device"] == "cuda"
    init = f"tcp://127.0.0.1:{spec['port']}"
    if cuda:
        bench.gpu_per_rank(rank, nranks, spec["gpus"])
        dev = torch.device("cuda", torch.cuda.current_device())
        # NCCL refuses two ranks on one GPU (and its watchdog may then abort the process)
        backend = "cpu:gloo,cuda:nccl" if spec["baseline"] and spec["gpus"] >= nranks else "gloo"
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=nranks)
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(bench.cpu_threads(nranks))
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=nranks)
    top = max(spec["sizes"])
    comm = Communicator.init(
        nranks, rank, uid, per_rank_vmm=len(spec["collectives"]) * (top + (8 << 20)) + (64 << 20)
    )
    try:
        timer = _Timer(spec, dev, comm)
        barrier_us, barrier_mode = (None, "")
        if cuda:
            from mori.ccl import kernels

            bar = comm.create_dev_comm(CCODevCommRequirements(lsa_barrier_count=1))
            ticket = torch.zeros(1, dtype=torch.int32, device=dev)

            def barrier() -> None:
                kernels.sync_kernel[(1,)](bar.tensor, ticket, 1, PHASE=kernels.PHASE_READY, num_warps=1)

            timer.device_barrier = barrier
            got = timer.measure({"barrier": barrier})["barrier"]
            barrier_us, barrier_mode = bench.Stats.of(got["samples"]).median * 1e6, got["mode"]
        rows = []
        progress = bench.Progress(SUITE, len(spec["collectives"]) * len(spec["sizes"]))
        for coll in spec["collectives"]:
            rows.extend(_collective(rank, nranks, spec, coll, comm, dev, timer, progress))
        progress.close()
        name = bench.device_name(dev)
        return {
            "rows": rows,
            "device_name": name,
            "torch": torch.__version__,
            "barrier_us": barrier_us,
            "barrier_mode": barrier_mode,
            "baselines_failed": dict(_Failed.reasons),
        }
    finally:
        comm.destroy()
        dist.destroy_process_group()


class _Timer:
    """Times several functions on every rank the same way, interleaved sample by sample."""

    def __init__(self, spec: dict[str, Any], dev: Any, comm: Any) -> None:
        self.spec = spec
        self.cuda = dev.type == "cuda"
        self.dev = dev
        self.comm = comm
        self.device_barrier: Callable[[], None] | None = None

    def _max(self, values: list[float]) -> list[float]:
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [float(v) for v in t.tolist()]

    def measure(self, fns: dict[str, Callable[[], object]]) -> dict[str, dict[str, Any]]:
        return self._gpu(fns) if self.cuda else self._cpu(fns)

    def _cpu(self, fns: dict[str, Callable[[], object]]) -> dict[str, dict[str, Any]]:
        import torch.distributed as dist

        spec = self.spec
        reps: dict[str, int] = {}
        for name, fn in fns.items():
            # a warm call's time (the fastest of three after one), the same on every rank
            fn()
            best = min(bench.time_samples(fn, iters=3, warmup=0, before=dist.barrier))
            once = self._max([best])[0]
            reps[name] = max(1, min(10000, int(spec["target_s"] / max(once, 1e-7))))
        samples = bench.time_interleaved(
            fns,
            iters=spec["iters"],
            warmup=spec["warmup"],
            reps=reps,
            before=dist.barrier,
            sample=lambda dt: self._max([dt])[0],
        )
        return {
            name: {"samples": samples[name], "mode": f"wall clock around {reps[name]} host-blocking calls"}
            for name in fns
        }

    def _gpu(self, fns: dict[str, Callable[[], object]]) -> dict[str, dict[str, Any]]:
        spec, reps = self.spec, self.spec["reps"]
        plans = {name: bench.graph_or_eager(fn, reps, failed="capture failed") for name, fn in fns.items()}
        samples: dict[str, list[float]] = {name: [] for name in fns}
        for i in range(spec["warmup"] + spec["iters"]):
            for name in fns:
                once = plans[name][0]
                self.comm.barrier()
                if self.device_barrier is not None:
                    self.device_barrier()  # the ranks start together, on the device
                dt = bench.time_cuda(once, reps)
                if i >= spec["warmup"]:
                    samples[name].append(self._max([dt])[0])
        return {name: {"samples": samples[name], "mode": plans[name][1]} for name in fns}


def _pattern(rank: int, numel: int, dtype: Any, dev: Any) -> Any:
    """Small integers (exact in every dtype, sums too): (7 i + 13 rank) mod 17 - 8."""
    import torch

    i = torch.arange(numel, dtype=torch.int64)
    v = (7 * i + 13 * rank) % 17 - 8
    if dtype == torch.uint32:
        v = v + 8
    return v.to(dtype).to(dev)


def _collective(
    rank: int,
    n: int,
    spec: dict[str, Any],
    coll: str,
    comm: Any,
    dev: Any,
    timer: _Timer,
    progress: bench.Progress,
) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    import mori.ccl as ccl

    dtype = getattr(torch, spec["dtype"]) if coll == "allreduce" else torch.int32
    top = max(spec["sizes"])
    common = {
        "transit_buffer_size": top,
        "comm": comm,
        "impl": spec["impl"],
        "max_programs": spec["max_programs"],
    }
    if coll == "allreduce":
        obj: Any = ccl.AllreduceSdma(rank, n, dtype=dtype, **common)
    elif coll == "allgather":
        obj = ccl.AllgatherSdma(rank, n, **common)
    else:
        obj = ccl.All2allSdma(rank, n, **common)
    rows = []
    trace = None
    if spec["trace"] and obj.impl == "triton":
        from mori.viz import TraceBuffer

        # one ring per program, room for every size's one traced call
        trace = TraceBuffer(
            obj.ch.programs, 16 * len(spec["sizes"]), device=dev, rank=rank, name=f"ccl.{coll}"
        )
    try:
        for size in spec["sizes"]:
            if rank == 0:
                progress.step(f"{coll} {bench.human_bytes(size)}")
            es = dtype.itemsize
            in_numel = {"allreduce": size // es, "allgather": size // es // n, "alltoall": size // es}[coll]
            out_numel = {"allreduce": size // es, "allgather": size // es, "alltoall": size // es}[coll]
            x = _pattern(rank, in_numel, dtype, dev)
            out = torch.empty(out_numel, dtype=dtype, device=dev)
            if coll == "allreduce":
                expected = sum(_pattern(r, in_numel, torch.int64, "cpu") for r in range(n))
                if dtype == torch.uint32:
                    expected = expected % (1 << 32)
                arg = in_numel
            elif coll == "allgather":
                expected = torch.cat([_pattern(r, in_numel, torch.int64, "cpu") for r in range(n)])
                arg = in_numel
            else:
                block = in_numel // n
                expected = torch.cat(
                    [
                        _pattern(r, in_numel, torch.int64, "cpu")[rank * block : (rank + 1) * block]
                        for r in range(n)
                    ]
                )
                arg = in_numel // n

            def mori_fn(x: Any = x, out: Any = out, arg: int = arg) -> None:
                obj(x, out, arg)

            fns: dict[str, Callable[[], object]] = {"mori": mori_fn}
            fns.update(_baselines(spec, coll, dtype, in_numel, out_numel, dev) if spec["baseline"] else {})
            timed = timer.measure(fns)
            if trace is not None:
                obj.enable_tracing(trace)
            mori_fn()  # the checked call (traced with --trace)
            obj.disable_tracing()
            if spec["device"] == "cuda":
                torch.cuda.synchronize()
            got = (
                out.cpu().to(torch.int64)
                if dtype != torch.uint32
                else out.cpu().view(torch.int32).to(torch.int64) % (1 << 32)
            )
            wrong = int((got != expected).sum())
            wrong = int(timer._max([float(wrong)])[0])
            rows.append(
                {
                    "collective": coll,
                    "size": size,
                    "count": out_numel if coll != "allgather" else in_numel,
                    "type": str(dtype).removeprefix("torch."),
                    "redop": "sum" if coll == "allreduce" else "none",
                    "path": obj.last_path,
                    "programs": obj.ch.programs,
                    "wrong": wrong,
                    "timings": {k: v for k, v in timed.items()},
                }
            )
            dist.barrier()
        if trace is not None:
            from mori import viz

            viz.capture([trace], host=False).save(Path(spec["trace"]) / coll / f"rank{rank}.mviz.npz")
    finally:
        obj.close()
    return rows


def _baselines(
    spec: dict[str, Any], coll: str, dtype: Any, in_numel: int, out_numel: int, dev: Any
) -> dict[str, Callable[[], object]]:
    """The baselines for this size: buffers of zeros (repeated in-place sums stay finite)."""
    import torch
    import torch.distributed as dist

    cuda = spec["device"] == "cuda"
    name = "nccl" if cuda else "gloo"
    bdtype = torch.int32 if dtype == torch.uint32 else dtype  # same bytes; gloo and NCCL have no uint32 sum
    if cuda and spec["gpus"] < spec["ranks"]:
        _Failed.reasons["nccl"] = (
            f"not run: NCCL refuses several ranks on one GPU ({spec['ranks']} ranks, {spec['gpus']} GPU)"
        )
        return _runnable(_symm_mem(in_numel, bdtype, dev) if coll == "allreduce" else {})
    out: dict[str, Callable[[], object]] = {}
    if coll == "allreduce":
        y = torch.zeros(in_numel, dtype=bdtype, device=dev)
        out[name] = lambda: dist.all_reduce(y)
        if cuda:
            out.update(_symm_mem(in_numel, bdtype, dev))
    elif coll == "allgather":
        a = torch.zeros(in_numel, dtype=bdtype, device=dev)
        b = torch.empty(out_numel, dtype=bdtype, device=dev)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        out[name] = lambda: gather(b, a)
    else:
        a = torch.zeros(in_numel, dtype=bdtype, device=dev)
        b = torch.empty(out_numel, dtype=bdtype, device=dev)
        out[name] = lambda: dist.all_to_all_single(b, a)
    return _runnable(out)


def _symm_mem(numel: int, dtype: Any, dev: Any) -> dict[str, Callable[[], object]]:
    import torch
    import torch.distributed as dist

    try:
        import torch.distributed._symmetric_memory as symm_mem

        group = dist.group.WORLD.group_name  # type: ignore[union-attr]
        t = symm_mem.empty(numel, dtype=dtype, device=dev)
        t.zero_()
        symm_mem.rendezvous(t, group)
    except Exception as e:  # torch without symmetric memory, or a device it does not support
        msg = f"{type(e).__name__}: {e}".splitlines()[0][:160]
        return {"symm-one-shot": _Unavailable(msg), "symm-two-shot": _Unavailable(msg)}
    return {
        "symm-one-shot": lambda: torch.ops.symm_mem.one_shot_all_reduce(t, "sum", group),
        "symm-two-shot": lambda: torch.ops.symm_mem.two_shot_all_reduce_(t, "sum", group),
    }


class _Unavailable:
    """A baseline that cannot run here; calling it raises its reason."""

    def __init__(self, why: str) -> None:
        self.why = why

    def __call__(self) -> object:
        raise RuntimeError(self.why)


def _runnable(fns: dict[str, Callable[[], object]]) -> dict[str, Callable[[], object]]:
    """Keep the baselines that work on every rank (one trial call each, collectively agreed)."""
    import torch

    out: dict[str, Callable[[], object]] = {}
    for name, fn in fns.items():
        ok = True
        try:
            fn()
            if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
                torch.cuda.synchronize()
        except Exception as e:
            ok = False
            _Failed.reasons[name] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
        if bench.agree(ok):
            out[name] = fn
        else:
            _Failed.reasons.setdefault(name, "failed on a peer")
    return out


class _Failed:
    #: baseline -> why it did not run (this rank's view)
    reasons: ClassVar[dict[str, str]] = {}


# -- report --------------------------------------------------------------------------------------------


def _stats(samples: list[float], size: int, factor: float) -> dict[str, Any]:
    s = bench.Stats.of(samples)
    return {
        "time_us": s.median * 1e6,
        "p10_us": s.p10 * 1e6,
        "p90_us": s.p90 * 1e6,
        "algbw": bench.gbps(size, s.median),
        "busbw": bench.gbps(size, s.median) * factor,
        "samples_us": [v * 1e6 for v in samples],
    }


def _report(config: dict[str, Any], rows: list[dict[str, Any]]) -> bool:
    n = config["ranks"]
    load = config.get("load_average", {})
    print(
        f"{SUITE}: {config['device_name']}, {n} ranks, torch {config['torch']}; impl {config['impl']}; "
        "time = median (p10-p90) per call of the slowest rank, GB/s = 1e9 B/s"
    )
    if load:
        print(f"machine load average (1, 5, 15 min): before {load['before']}, after {load['after']}")
    if config.get("barrier_us") is not None:
        print(
            f"device barrier (mori.cco LSA barrier kernel): {config['barrier_us']:.2f} us ({config['barrier_mode']})"
        )
    ok = True
    for coll in config["collectives"]:
        mine = [r for r in rows if r["collective"] == coll]
        if not mine:
            continue
        factor = busbw_factor(coll, n)
        base_names = sorted({k for r in mine for k in r["timings"] if k != "mori"})
        headers = [
            "size",
            "count",
            "type",
            "redop",
            "root",
            "time(us)",
            "p10-p90",
            "algbw",
            "busbw",
            "#wrong",
            "path",
        ]
        for b in base_names:
            headers += [f"{b} us", f"{b} busbw", f"x{b}"]
        if coll == "allreduce" and config.get("barrier_us"):
            headers.append("x barrier")
        table = []
        for r in mine:
            m = _stats(r["timings"]["mori"]["samples"], r["size"], factor)
            r["mori"] = m
            line = [
                bench.human_bytes(r["size"]),
                r["count"],
                r["type"],
                r["redop"],
                -1,
                f"{m['time_us']:.1f}",
                f"{m['p10_us']:.1f}-{m['p90_us']:.1f}",
                f"{m['algbw']:.2f}",
                f"{m['busbw']:.2f}",
                r["wrong"],
                r["path"],
            ]
            ok = ok and r["wrong"] == 0
            r["baselines"] = {}
            for b in base_names:
                t = r["timings"].get(b)
                if t is None:
                    line += ["n/a", "n/a", "n/a"]
                    continue
                s = _stats(t["samples"], r["size"], factor)
                s["speedup"] = bench.speedup(m["time_us"], s["time_us"])
                r["baselines"][b] = s
                line += [f"{s['time_us']:.1f}", f"{s['busbw']:.2f}", f"{s['speedup']:.2f}"]
            if coll == "allreduce" and config.get("barrier_us"):
                r["x_barrier"] = m["time_us"] / config["barrier_us"]
                line.append(f"{r['x_barrier']:.2f}")
            table.append(line)
        print(f"\n{coll} (busbw = algbw * {factor:.3g}); x<baseline> = baseline time / mori time")
        print(bench.format_table(headers, table))
        modes = {k: v["mode"] for k, v in mine[0]["timings"].items()}
        print(
            "timing: "
            + "; ".join(f"{k}: {v}" for k, v in modes.items())
            + f"; mori programs per launch: {mine[0]['programs']}"
        )
    if config.get("baselines_failed"):
        print(
            "baselines that did not run: "
            + "; ".join(f"{k}: {v}" for k, v in config["baselines_failed"].items())
        )
    for r in rows:
        for t in r.pop("timings").values():
            t.pop("samples", None)
    if not ok:
        print("WRONG RESULTS: see #wrong")
    return ok


def _plot(path: Path | None, config: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """busbw against size per collective, mori and each baseline, to ``path`` (None: no plot)."""

    def draw(plt: Any) -> Any:
        colls = config["collectives"]
        fig, axes = plt.subplots(1, len(colls), figsize=(5 * len(colls), 4), squeeze=False)
        for ax, coll in zip(axes[0], colls, strict=True):
            mine = [r for r in rows if r["collective"] == coll]
            xs = [r["size"] for r in mine]
            ax.plot(xs, [r["mori"]["busbw"] for r in mine], marker="o", label="mori")
            for b in sorted({k for r in mine for k in r["baselines"]}):
                busbw = [r["baselines"].get(b, {}).get("busbw", float("nan")) for r in mine]
                ax.plot(xs, busbw, marker=".", label=b)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("size (bytes)")
            ax.set_ylabel("busbw (GB/s)")
            ax.set_title(f"{coll}, {config['ranks']} ranks, {config['device_name']}")
            ax.legend()
        fig.tight_layout()
        return fig

    bench.draw_plot(path, draw, dpi=100)

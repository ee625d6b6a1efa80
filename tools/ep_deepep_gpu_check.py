#!/usr/bin/env python3
"""GPU check of the DeepEP layer (issue 16): layout kernel time, and DeepEP layer vs MORI API.

One run on one GPU, ``--ranks`` ranks sharing it (start MPS first: ``nvidia-cuda-mps-control -d``),
``--sms`` programs per rank (ranks x SMs must not exceed the GPU's SM count). DeepSeek-V3 shape:
``--tokens`` (4096) per rank, hidden 7168, top-8 of 256 experts, bf16, routing uniform at random.

1. ``Buffer.get_dispatch_layout`` (the Triton kernel) against the torch path it replaces, same
   inputs, CUDA events around each call: bar ``--layout-bar-ms`` (0.1 ms).
2. Normal-mode dispatch and combine through ``mori.ep.deepep.Buffer`` (with the receive views of
   ``MORI_EP_DEEPEP_RECV_VIEWS=1``, and with the default new tensors) against
   ``EpDispatchCombineOp.dispatch`` / ``combine`` on the same inputs, launch geometry and run.
   Every call: device barrier, CUDA event, the call (host work included: the layer's count
   exchange and the MORI call's validation), CUDA event, synchronise. A sample is the slowest
   rank's time; reported: median with p10-p90 and the ratio of medians; bar ``--ratio-bar`` (1.10).
   The combined results of the layer and of the API are checked equal first.

``--pin`` runs each rank process on a CPU of its own (the calls are bound by their host time).
On one lent H200 (2026-12-04, two runs of each, alternating) it made the host-bound calls faster,
the API's as well as the layer's: layer dispatch 2.84 / 3.11 x the API pinned against 3.21 / 3.21 x
not, layer combine 1.10 / 1.11 x against 1.04 / 1.04 x, the layout 0.140 / 0.100 ms against
0.128 / 0.150 ms. Off by default, so records stay comparable with the earlier ones.

Exit status 0 only if every bar is met. ``--out FILE`` writes the JSON record. ``--profile DIR``
also runs a few calls of each (layout kernel, MORI dispatch, layer dispatch with views) under
``torch.profiler`` after the timed runs and writes, per rank, where host and device time went
(``DIR/rank<r>.txt``: the host wall time per call and torch's table by self CPU time; and each
call's timeline, ``DIR/rank<r>-<call>.trace.json``, for Perfetto or chrome://tracing).

    python tools/ep_deepep_gpu_check.py --ranks 2 --sms 66 --out ep-deepep-h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

import torch

HIDDEN, TOPK, EXPERTS = 7168, 8, 256


def _stats(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    q = statistics.quantiles(s, n=10) if len(s) >= 2 else [s[0]] * 9
    return {"median_ms": statistics.median(s) * 1e3, "p10_ms": q[0] * 1e3, "p90_ms": q[-1] * 1e3}


def _time(fn: Any, iters: int, warmup: int) -> list[float]:
    """Seconds per call: device barrier, CUDA events around the call (wall clock on the CPU)."""
    import time

    import mori.shmem as shmem

    cuda = torch.cuda.is_available() and os.environ.get("MORI_DEVICE_RUNTIME") != "cpu"
    for _ in range(warmup):
        shmem.shmem_barrier_on_stream() if cuda else shmem.shmem_barrier_all()
        fn()
    if cuda:
        torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        if not cuda:
            shmem.shmem_barrier_all()
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
            continue
        shmem.shmem_barrier_on_stream()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return out


def _set_gpu(rank: int, nranks: int) -> None:
    if os.environ.get("MORI_DEVICE_RUNTIME") != "cpu":
        torch.cuda.set_device(int(os.environ["EP_CHECK_GPU"]))
    if os.environ.get("EP_CHECK_PIN") == "1":
        # this tool's own rank processes, one CPU each (what the calls' host time is measured on;
        # the library itself never changes affinity)
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})


def _rank(rank: int, nranks: int, spec: dict[str, Any]) -> dict[str, Any]:
    import mori.shmem as shmem
    from mori.ep import EpDispatchCombineConfig, EpDispatchCombineOp, layout
    from mori.ep.bench import random_routing
    from mori.ep.deepep import Buffer, Config

    cuda = spec["device"] == "cuda"
    dev = torch.device("cuda", spec["gpu"]) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(1)
    n, sms, iters, warmup = spec["tokens"], spec["sms"], spec["iters"], spec["warmup"]
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(n, HIDDEN, generator=gen).bfloat16().to(dev)
    topk_idx = random_routing(n, EXPERTS, TOPK, 7, rank).to(torch.int64).to(dev)
    topk_w = torch.rand(n, TOPK, generator=gen).to(dev)
    idx32 = topk_idx.to(torch.int32)
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(dev) if cuda else "cpu"}

    # 1. layout: the kernel against the torch path, same inputs
    os.environ["MORI_EP_DEEPEP_RECV_VIEWS"] = "1"
    views = Buffer(None)
    os.environ["MORI_EP_DEEPEP_RECV_VIEWS"] = "0"
    copies = Buffer(None)
    lay = views.get_dispatch_layout(topk_idx, EXPERTS)
    ref = layout.dispatch_layout(topk_idx, EXPERTS, nranks, impl="torch")
    for got, want, name in zip(
        (lay[0], lay[2], lay[3]), ref, ("per_rank", "per_expert", "in_rank"), strict=True
    ):
        assert torch.equal(got, want), f"layout kernel differs from torch in {name}"
    res["layout_kernel"] = _time(lambda: views.get_dispatch_layout(topk_idx, EXPERTS), iters, warmup)
    res["layout_torch"] = _time(
        lambda: layout.dispatch_layout(topk_idx, EXPERTS, nranks, impl="torch"), iters, warmup
    )

    # 2. MORI API
    cfg = EpDispatchCombineConfig(
        torch.bfloat16, rank, nranks, HIDDEN, 0, 0, 2, n, EXPERTS // nranks, TOPK, block_num=sms
    )
    op = EpDispatchCombineOp(cfg)
    state: dict[str, Any] = {}

    def mori_dispatch() -> None:
        state["m"] = op.dispatch(x, topk_w, None, idx32, block_num=sms)

    def mori_combine() -> None:
        out = state["m"]
        state["mc"] = op.combine(out[0][: state["mtotal"]], None, idx32, block_num=sms)

    mori_dispatch()
    state["mtotal"] = int(state["m"][4][0])
    mori_combine()
    mori_ref = state["mc"][0][:n].clone()

    config = Config(sms, 6, 256)

    def layer_dispatch(buf: Buffer, key: str) -> None:
        state[key] = buf.dispatch(
            x,
            num_tokens_per_rank=lay[0],
            is_token_in_rank=lay[3],
            num_tokens_per_expert=lay[2],
            topk_idx=topk_idx,
            topk_weights=topk_w,
            config=config,
        )

    def layer_combine(buf: Buffer, key: str) -> None:
        recv_x, handle = state[key][0], state[key][4]
        state[key + "c"] = buf.combine(recv_x, handle, config=config)

    for buf, key in ((views, "v"), (copies, "c")):
        layer_dispatch(buf, key)
        layer_combine(buf, key)
        assert torch.equal(state[key + "c"][0], mori_ref), f"DeepEP layer ({key}) combine differs from MORI's"
    res["recv_rows"] = state["mtotal"]
    res["mori_dispatch"] = _time(mori_dispatch, iters, warmup)
    res["mori_combine"] = _time(mori_combine, iters, warmup)
    for buf, key, name in ((views, "v", "deepep_views"), (copies, "c", "deepep_copies")):
        res[name + "_dispatch"] = _time(lambda b=buf, k=key: layer_dispatch(b, k), iters, warmup)
        res[name + "_combine"] = _time(lambda b=buf, k=key: layer_combine(b, k), iters, warmup)
    if spec.get("profile"):
        _profile(
            spec["profile"],
            rank,
            {
                "get_dispatch_layout": lambda: views.get_dispatch_layout(topk_idx, EXPERTS),
                "mori_dispatch": mori_dispatch,
                "deepep_views_dispatch": lambda: layer_dispatch(views, "v"),
            },
        )
    shmem.shmem_barrier_all()
    return res


def _profile(out_dir: str, rank: int, calls: dict[str, Any], n: int = 5) -> None:
    """Each call ``n`` times under torch.profiler, device barrier between calls (collective)."""
    import time
    from pathlib import Path

    import mori.shmem as shmem

    cuda = torch.cuda.is_available() and os.environ.get("MORI_DEVICE_RUNTIME") != "cpu"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    lines: list[str] = []
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    for name, fn in calls.items():
        host = []
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(n):
                shmem.shmem_barrier_on_stream() if cuda else shmem.shmem_barrier_all()
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                host.append(time.perf_counter() - t0)
                if cuda:
                    torch.cuda.synchronize()
        host_us = ", ".join(f"{h * 1e6:.0f}" for h in host)
        lines += [f"== {name}: host wall per call (us, no sync inside the timing): {host_us}"]
        lines += [prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30), ""]
        prof.export_chrome_trace(str(Path(out_dir, f"rank{rank}-{name.replace(' ', '_')}.trace.json")))
    Path(out_dir, f"rank{rank}.txt").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--sms", type=int, default=66, help="programs per rank (ranks x sms <= SM count)")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--gpu", type=int, default=0, help="the GPU every rank uses")
    p.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke run of this script"
    )
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--layout-bar-ms", type=float, default=0.1)
    p.add_argument("--ratio-bar", type=float, default=1.10)
    p.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="run rank r on the r-th CPU this process may use (default: wherever the OS puts it)",
    )
    p.add_argument("--out", help="write the JSON record here")
    p.add_argument("--profile", help="also profile a few calls of each; tables into this directory")
    args = p.parse_args(argv)
    from mori.core.launch import shmem_ranks

    # --device cuda: this machine's GPU runtime (auto: cuda on NVIDIA GPUs, hip on AMD ones)
    runtime = "cpu" if args.device == "cpu" else os.environ.get("MORI_DEVICE_RUNTIME", "auto")
    env = {"MORI_DEVICE_RUNTIME": runtime, "EP_CHECK_GPU": str(args.gpu), "EP_CHECK_PIN": str(int(args.pin))}
    if args.device == "cuda":
        sm_count = torch.cuda.get_device_properties(args.gpu).multi_processor_count
        if args.ranks * args.sms > sm_count:
            p.error(f"--ranks x --sms = {args.ranks * args.sms} exceeds the GPU's {sm_count} SMs")
        env["CUDA_MODULE_LOADING"] = "EAGER"
    spec = vars(args)
    heap = os.environ.get("MORI_SHMEM_HEAP_SIZE", "6G" if args.device == "cuda" else "1G")
    results = shmem_ranks(_rank, args.ranks, spec, heap=heap, timeout=600, env=env, before_init=_set_gpu)

    def slowest(key: str) -> list[float]:
        return [max(r[key][i] for r in results) for i in range(args.iters)]

    record: dict[str, Any] = {
        "config": spec,
        "device": results[0]["device"],
        "recv_rows_rank0": results[0]["recv_rows"],
    }
    ok = True
    lk, lt = _stats(slowest("layout_kernel")), _stats(slowest("layout_torch"))
    record["layout"] = {"kernel": lk, "torch": lt, "speedup": lt["median_ms"] / lk["median_ms"]}
    met = lk["median_ms"] <= args.layout_bar_ms
    ok &= met
    print(
        f"{results[0]['device']}, {args.ranks} ranks x {args.sms} SMs, {args.tokens} tokens, hidden {HIDDEN}, top-{TOPK}/{EXPERTS}"
    )
    print(
        f"get_dispatch_layout: kernel {lk['median_ms']:.4f} ms (p10 {lk['p10_ms']:.4f}, p90 {lk['p90_ms']:.4f}); "
        f"torch path {lt['median_ms']:.4f} ms; {record['layout']['speedup']:.1f}x; bar <= {args.layout_bar_ms} ms: "
        + ("met" if met else "NOT met")
    )
    for phase in ("dispatch", "combine"):
        base = _stats(slowest(f"mori_{phase}"))
        record[f"mori_{phase}"] = base
        print(
            f"{phase}: MORI API {base['median_ms']:.4f} ms (p10 {base['p10_ms']:.4f}, p90 {base['p90_ms']:.4f})"
        )
        for name in ("deepep_views", "deepep_copies"):
            st = _stats(slowest(f"{name}_{phase}"))
            ratio = st["median_ms"] / base["median_ms"]
            record[f"{name}_{phase}"] = {**st, "ratio_to_mori": ratio}
            met = ratio <= args.ratio_bar
            if name == "deepep_views":
                ok &= met
            print(
                f"  {name}: {st['median_ms']:.4f} ms (p10 {st['p10_ms']:.4f}, p90 {st['p90_ms']:.4f}), "
                f"{ratio:.3f}x the MORI API; bar <= {args.ratio_bar}: "
                + ("met" if met else "NOT met")
                + ("" if name == "deepep_views" else " (informational: new tensors, one copy more)")
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
    print("all bars met" if ok else "some bar NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

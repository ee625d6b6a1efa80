# Jitted functions carry no Python annotations (Triton reads them):
# mypy: disable-error-code="no-untyped-def,untyped-decorator,no-untyped-call"
"""GPU part of ``mori bench shmem --device cuda``: 2 ranks, one GPU each.

Figures (all timed with CUDA events around CUDA-graph replays, so no Python launch cost is in them):

* Triton put bandwidth: ``mori.shmem.kernels.put`` from PE 0 into PE 1's heap, by size and by the
  number of programs (thread blocks) allowed; GB/s = bytes / median time per put (1 GB = 1e9 B).
* copy-engine put: ``peer_view.copy_(src)`` where ``peer_view`` is PE 1's heap mapped into PE 0
  (cudaMemcpyAsync through the copy engines over NVLink).
* baseline, same run: torch's own peer copy ``dst.copy_(src)`` from ``cuda:0`` to ``cuda:1``, timed
  eagerly (torch cannot capture a cross-device copy in a graph);
  ratios are put / baseline.
* put+signal+wait round trip: one kernel per PE bounces an 8-byte put with a signal back and
  forth ``iters`` times; round trip = kernel time / iters.
* barrier: ``shmem_barrier_on_stream`` replayed in a graph; also checked over 1000 replays.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

import triton
import triton.language as tl

from mori.core import bench
from mori.core.kernels import aot
from mori.shmem import device as shd

PROGRAMS = [8, 16, 32, 64, 132]
SIZES = [8 << (2 * i) for i in range(13)] + [64 << 20, 256 << 20]  # 8 B .. 128 MiB by 4x, + 64, 256 MiB


def _pingpong_variants() -> list[dict[str, Any]]:
    sig = {"buf_ptr": "*i64", "sig_ptr": "*i64", "ctx_ptr": "*i64", "n_iters": "i32", "start": "i64"}
    return [
        {"signature": sig, "constexprs": {"INITIATOR": flag}, "aligned": ("buf_ptr", "sig_ptr", "ctx_ptr")}
        for flag in (True, False)
    ]


@aot(**_pingpong_variants()[0])
@aot(**_pingpong_variants()[1])
@triton.jit
def pingpong_kernel(buf_ptr, sig_ptr, ctx_ptr, n_iters, start, INITIATOR: tl.constexpr):
    # PE 0 puts 8 bytes, then a release signal, to PE 1 and waits for PE 1's answer; PE 1 answers each one.
    # Signal values only grow (start + i + 1), so runs can follow each other without a reset.
    peer = 1 - shd.my_pe(ctx_ptr)
    i = 0
    while i < n_iters:
        value = start + i + 1
        # the 8-byte put is one store to the peer's copy; the release signal publishes it
        if INITIATOR:
            tl.store(shd.ptr_p2p(buf_ptr, peer, ctx_ptr), value)
            shd.signal_op(sig_ptr, value, shd.SIGNAL_SET, peer, ctx_ptr)
            shd.wait_until(sig_ptr, shd.SHMEM_CMP_GE, value)
        else:
            shd.wait_until(sig_ptr, shd.SHMEM_CMP_GE, value)
            tl.store(shd.ptr_p2p(buf_ptr, peer, ctx_ptr), value)
            shd.signal_op(sig_ptr, value, shd.SIGNAL_SET, peer, ctx_ptr)
        i += 1


def _graph_time(fn: Any, reps_in_graph: int, replays: int) -> list[float]:
    """Seconds per call of ``fn``: ``reps_in_graph`` calls captured in one CUDA graph, replayed."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm up: compile and load outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps_in_graph):
            fn()
    g.replay()
    torch.cuda.synchronize()
    return [bench.time_cuda(g.replay, reps_in_graph) for _ in range(replays)]


def _eager_time(fn: Any, reps: int, replays: int) -> list[float]:
    """Seconds per call of ``fn`` called ``reps`` times back to back between two CUDA events.

    For torch's cross-device copy, which cannot be captured in a graph (it synchronises with the
    other device's stream); its Python launch cost is in the figure, which matters for small sizes.
    """
    import torch

    fn()
    torch.cuda.synchronize()

    def calls() -> None:
        for _ in range(reps):
            fn()

    return [bench.time_cuda(calls, reps) for _ in range(replays)]


#: one GPU per rank (the launcher's ``before_init``)
set_device = bench.gpu_per_rank


def rank_main(rank: int, nranks: int, sizes: list[int], replays: int) -> dict[str, Any]:
    import torch

    import mori.shmem as shmem
    from mori.shmem import kernels

    dev = torch.device("cuda", torch.cuda.current_device())
    max_size = max(sizes)
    src = shmem.mori_shmem_create_tensor(max_size, torch.uint8)
    dst = shmem.mori_shmem_create_tensor(max_size, torch.uint8)
    buf = shmem.mori_shmem_create_tensor(16, torch.int64)
    sig = shmem.mori_shmem_create_tensor(16, torch.int64)
    src.fill_(rank + 1)
    torch.cuda.synchronize()
    shmem.shmem_barrier_all()
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(dev), "rows": []}
    if rank == 0:
        peer_dst = shmem.symm_mori_shmem_tensor(dst, 1)
        other = torch.device("cuda", 1 % torch.cuda.device_count())
        base_dst = torch.empty(max_size, dtype=torch.uint8, device=other)
        base_src = torch.full((max_size,), 3, dtype=torch.uint8, device=dev)
        for size in sizes:
            reps = max(1, min(50, (256 << 20) // (size * 4) or 1))
            row: dict[str, Any] = {"size": size}
            row["torch_peer_copy_s"] = _eager_time(
                lambda n=size: base_dst[:n].copy_(base_src[:n]), reps, replays
            )
            row["copy_engine_put_s"] = _graph_time(lambda n=size: peer_dst[:n].copy_(src[:n]), reps, replays)
            for p in PROGRAMS:
                row[f"triton_put_{p}_s"] = _graph_time(
                    lambda n=size, p=p: kernels.put(dst[:n], src[:n], 1, max_programs=p), reps, replays
                )
            out["rows"].append(row)
        torch.cuda.synchronize()
    shmem.shmem_barrier_all()
    if rank == 1:
        out["verified"] = bool((dst == 1).all().item())
    # put+signal round trip: both PEs run their kernel at once
    iters = 2000
    rtts = []
    ctx = shd.shmem_device_context()
    for run in range(5):
        shmem.shmem_barrier_all()

        def bounce(start: int = run * iters) -> None:
            pingpong_kernel[(1,)](buf, sig, ctx, iters, start, INITIATOR=(rank == 0))

        rtts.append(bench.time_cuda(bounce, iters))
    out["rtt_s"] = rtts[1:]
    # barrier: latency in a graph, then 1000 replays checked
    shmem.shmem_barrier_all()
    out["barrier_s"] = _graph_time(shmem.shmem_barrier_on_stream, 100, max(3, replays // 2))
    counter = shmem.mori_shmem_create_tensor(1, torch.int64)
    counter.zero_()
    torch.cuda.synchronize()
    shmem.shmem_barrier_all()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        shmem.shmem_barrier_on_stream()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        counter.add_(1)
        shmem.shmem_barrier_on_stream()
    for _ in range(1000):
        g.replay()
    torch.cuda.synchronize()
    shmem.shmem_barrier_all()
    out["graph_barrier_replays"] = int(counter.item())
    shmem.shmem_barrier_all()
    out["torch_symm_mem"] = _torch_symm_mem_baseline(rank, nranks, replays)
    shmem.shmem_barrier_all()
    return out


def _torch_symm_mem_baseline(rank: int, nranks: int, replays: int) -> dict[str, Any]:
    """Barrier and signal round trip with torch's symmetric memory, where this torch has it."""
    import torch
    import torch.distributed as dist

    try:
        import torch.distributed._symmetric_memory as symm_mem

        device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", rank=rank, world_size=nranks, device_id=device)
        t = symm_mem.empty(16, dtype=torch.int64, device=device)
        world = dist.group.WORLD
        if world is None:
            raise RuntimeError("torch.distributed has no world group")
        h = symm_mem.rendezvous(t, world.group_name)
        peer = 1 - rank
        barrier = _graph_time(lambda: h.barrier(channel=0), 100, max(3, replays // 2))

        def bounce() -> None:
            if rank == 0:
                h.put_signal(dst_rank=peer, channel=1)
                h.wait_signal(src_rank=peer, channel=1)
            else:
                h.wait_signal(src_rank=peer, channel=1)
                h.put_signal(dst_rank=peer, channel=1)

        h.barrier(channel=0)
        rtt = _graph_time(bounce, 100, max(3, replays // 2))
        h.barrier(channel=0)
        torch.cuda.synchronize()
        return {"barrier_s": barrier, "rtt_s": rtt}
    except Exception as e:  # the baseline is optional: say why it is missing
        return {"unavailable": f"{type(e).__name__}: {e}"[:300]}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_gpu(args: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    import torch

    from mori.core.launch import shmem_ranks

    if torch.cuda.device_count() < 1:
        raise SystemExit("mori bench shmem --device cuda: no CUDA device visible")
    sizes = sorted(set(args.sizes or SIZES))
    heap = 2 * max(sizes) + (64 << 20)
    port = bench.free_port()  # for the torch.distributed group of the symm_mem baseline
    env = {
        "MORI_DEVICE_RUNTIME": os.environ.get("MORI_DEVICE_RUNTIME", "auto"),
        "CUDA_MODULE_LOADING": "EAGER",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    r0, r1 = shmem_ranks(
        rank_main, 2, sizes, args.samples, heap=str(heap), timeout=900.0, env=env, before_init=set_device
    )
    return r0, r1


def report(args: Any, r0: dict[str, Any], r1: dict[str, Any]) -> int:
    """Print the tables, write the JSON record (and a plot if matplotlib is there)."""

    def gbps(size: int, samples: list[float]) -> float:
        return bench.gbps(size, statistics.median(samples))

    rows_out: list[dict[str, Any]] = []
    table = []
    for row in r0["rows"]:
        size = row["size"]
        base = gbps(size, row["torch_peer_copy_s"])
        ce = gbps(size, row["copy_engine_put_s"])
        puts = {p: gbps(size, row[f"triton_put_{p}_s"]) for p in PROGRAMS}
        best_p = max(puts, key=lambda p: puts[p])
        spread = bench.Stats.of(row[f"triton_put_{best_p}_s"])
        rows_out.append(
            {
                "size": size,
                "torch_peer_copy_gbps": base,
                "copy_engine_put_gbps": ce,
                **{f"triton_put_{p}_programs_gbps": v for p, v in puts.items()},
                "best_programs": best_p,
                "best_triton_put_gbps": puts[best_p],
                "best_triton_put_gbps_p10_p90": [size / spread.p90 / 1e9, size / spread.p10 / 1e9],
                "ratio_best_put_vs_torch_peer_copy": puts[best_p] / base,
                "ratio_copy_engine_vs_torch_peer_copy": ce / base,
                "triton_put_us_median_best": spread.median * 1e6,
            }
        )
        table.append(
            [bench.human_bytes(size), f"{base:.1f}", f"{ce:.1f}"]
            + [f"{puts[p]:.1f}" for p in PROGRAMS]
            + [f"{puts[best_p] / base:.2f}", f"{spread.median * 1e6:.2f}"]
        )
    print(
        f"mori bench shmem --device cuda: PE 0 -> PE 1, {r0['device']} x2, CUDA-graph replays, median of {args.samples}"
    )
    print(
        "GB/s = bytes / median seconds per put (1 GB = 1e9 B); baseline = torch dst.copy_(src) cuda:0 -> cuda:1"
    )
    print(
        bench.format_table(
            ["size", "torch copy", "CE put"] + [f"put {p}p" for p in PROGRAMS] + ["best/torch", "best us"],
            table,
        )
    )
    rtt = bench.Stats.of(r0["rtt_s"])
    bar = bench.Stats.of(r0["barrier_s"])
    print(
        f"put+signal+wait round trip (8 B, device loop): median {rtt.median * 1e6:.2f} us "
        f"(min {rtt.min * 1e6:.2f}, max {rtt.max * 1e6:.2f}, runs {rtt.n})"
    )
    print(
        f"barrier (shmem_barrier_on_stream in a CUDA graph): median {bar.median * 1e6:.2f} us "
        f"(p10 {bar.p10 * 1e6:.2f}, p90 {bar.p90 * 1e6:.2f})"
    )
    sm = r0["torch_symm_mem"]
    if "unavailable" in sm:
        print(f"torch symmetric memory baseline: unavailable ({sm['unavailable']})")
    else:
        sm_rtt, sm_bar = bench.Stats.of(sm["rtt_s"]), bench.Stats.of(sm["barrier_s"])
        print(
            f"baseline torch symm_mem (same run): put_signal+wait_signal round trip {sm_rtt.median * 1e6:.2f} us "
            f"(ratio mori/torch {rtt.median / sm_rtt.median:.2f}); barrier {sm_bar.median * 1e6:.2f} us "
            f"(ratio mori/torch {bar.median / sm_bar.median:.2f})"
        )
    replays = (r0["graph_barrier_replays"], r1["graph_barrier_replays"])
    print(f"graph with counter += 1 and the barrier, replayed 1000 times: counters {replays}")
    print(f"last put verified byte-exact on PE 1: {r1['verified']}")
    extra: list[dict[str, Any]] = [
        {
            "latency": "put_signal_wait_round_trip_8B",
            "median_us": rtt.median * 1e6,
            "samples_us": [x * 1e6 for x in r0["rtt_s"]],
        },
        {
            "latency": "barrier_on_stream_graph",
            "median_us": bar.median * 1e6,
            "p10_us": bar.p10 * 1e6,
            "p90_us": bar.p90 * 1e6,
        },
        {"check": "graph_barrier_1000_replays", "counters": list(replays)},
        {"baseline": "torch_symm_mem", **sm},
    ]
    path = bench.write_json(
        args.json,
        "shmem",
        {"device": "cuda", "gpu": r0["device"], "ranks": 2, "programs": PROGRAMS, "samples": args.samples},
        [*rows_out, *extra],
    )
    print(f"wrote {path}")
    bench.draw_plot(bench.plot_path(args.plot, path), lambda plt: _plot(plt, rows_out))
    return 0 if r1["verified"] and replays == (1000, 1000) else 1


def _plot(plt: Any, rows: list[dict[str, Any]]) -> Any:
    sizes = [r["size"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(sizes, [r["torch_peer_copy_gbps"] for r in rows], "k--", label="torch peer copy (baseline)")
    ax.plot(sizes, [r["copy_engine_put_gbps"] for r in rows], label="copy-engine put")
    for p in PROGRAMS:
        ax.plot(sizes, [r[f"triton_put_{p}_programs_gbps"] for r in rows], label=f"Triton put, {p} programs")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes per put")
    ax.set_ylabel("GB/s")
    ax.set_title("mori.shmem put bandwidth, GPU 0 -> GPU 1")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    return fig

r"""Host put bandwidth and put+signal round-trip latency between 2 CPU ranks, against a baseline.

Bandwidth: PE 0 puts ``size`` bytes from its heap into PE 1's heap (``shmem_putmem``) back to back;
GB/s = size / median time per put (GB = 1e9 bytes). Latency: PE 0 puts 8 bytes with a signal to
PE 1, which answers in kind; round trip = time from PE 0's put to PE 0 seeing the answer.

One node (default): the ranks share memory; the baseline, measured in the same process in the same
run, is ``dst.copy_(src)`` of two ``size``-byte tensors (the in-process memcpy a user would
otherwise do). ``--nodes 2``: the ranks get different ``MORI_NODE_ID`` (emulated nodes on this
machine), so every put and signal crosses the network transport (``--transport``, as
``MORI_SHMEM_TRANSPORT``; with ``--device cuda`` from kernels through the proxy:
:mod:`mori.shmem.bench_proxy`); the baseline, in the same processes in the same run, is torch.distributed
gloo over loopback: a ``send`` of ``size`` bytes that PE 1 receives and acknowledges with a
1-byte ``send`` (a put is complete at its target when it returns; the acknowledgement gives gloo
the same end), and an 8-byte send/recv ping-pong for the round trip. ratio = ours / baseline.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from mori.core import bench
from mori.core.launch import shmem_ranks

DEFAULT_SIZES = [8 << i for i in range(24)]  # 8 B, 16 B, ... 64 MiB


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cpu: 2 local ranks on the cpu runtime; cuda: 2 ranks on 2 GPUs (needs a GPU runtime plugin)",
    )
    p.add_argument(
        "--sizes",
        type=bench.size_list,
        default=None,
        help="comma-separated byte sizes, e.g. 4K,1M (default: cpu 8 B to 64 MiB by 2x; cuda 8 B to 256 MiB)",
    )
    p.add_argument(
        "--samples", type=int, default=15, help="timed samples per size (median and spread over them)"
    )
    p.add_argument("--pingpongs", type=int, default=2000, help="round trips timed for the latency figure")
    p.add_argument(
        "--nodes",
        type=int,
        choices=[1, 2],
        default=1,
        help="1 (shared memory / P2P) or 2 emulated nodes (one rank each, different MORI_NODE_ID: puts "
        "cross the network transport; baseline gloo send/recv). cuda with 2: both ranks on GPU 0 (start "
        "MPS), device-initiated puts and signals through the SHMEM proxy",
    )
    p.add_argument(
        "--transport",
        default=None,
        help="--nodes 2: the network transport (tcp, ucx; default: as MORI_SHMEM_TRANSPORT, else the "
        "usable one of highest priority)",
    )
    p.add_argument(
        "--json",
        default=None,
        help="where to write the JSON record (default bench-results/shmem-DEVICE.json)",
    )
    p.add_argument(
        "--plot",
        default=None,
        help="cuda: where to draw the plot (default: the JSON path with .png; 'none' for no plot; needs "
        "matplotlib); the cpu run draws none",
    )


def _time_per_call(fn: Callable[[], object], size: int, samples: int) -> list[float]:
    # Repeat short calls so one sample lasts about a millisecond or more; the timer's own cost
    # then stays below 1%.
    reps = max(1, min(2000, (1 << 21) // max(size, 1)))
    return bench.time_samples(fn, iters=samples, warmup=max(2, reps // 4), reps=reps)


def _node_per_rank(rank: int, nranks: int) -> None:
    # --nodes 2: each rank is its own emulated node, so its peer is reached by the network transport
    import os

    os.environ["MORI_NODE_ID"] = str(rank)


def gloo_pair(rank: int, port: int) -> Any:
    """A 2-rank gloo group over loopback (the --nodes 2 baseline); returns torch.distributed."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )
    return dist


def _gloo_baseline(rank: int, sizes: list[int], samples: int, pingpongs: int, port: int) -> dict[str, Any]:
    """PE 0's gloo times: per size, a send that PE 1 acknowledges; an 8-byte ping-pong."""
    import torch

    dist = gloo_pair(rank, port)
    buf = torch.full((max(sizes),), 3, dtype=torch.uint8)
    ack = torch.zeros(1, dtype=torch.uint8)
    out: dict[str, Any] = {"send_s": []}
    for size in sizes:
        reps = max(1, min(2000, (1 << 21) // max(size, 1)))
        warmup, calls = max(2, reps // 4), samples * reps
        if rank == 0:

            def send_(size: int = size) -> None:
                dist.send(buf[:size], 1)
                dist.recv(ack, 1)

            out["send_s"].append(bench.time_samples(send_, iters=samples, warmup=warmup, reps=reps))
        else:
            for _ in range(warmup + calls):
                dist.recv(buf[:size], 0)
                dist.send(ack, 0)
    rtts = []
    for _ in range(pingpongs):
        if rank == 0:
            t0 = time.perf_counter()
            dist.send(buf[:8], 1)
            dist.recv(buf[:8], 1)
            rtts.append(time.perf_counter() - t0)
        else:
            dist.recv(buf[:8], 0)
            dist.send(buf[:8], 0)
    out["rtt_s"] = rtts[pingpongs // 10 :]
    dist.destroy_process_group()
    return out


def _rank(
    rank: int, nranks: int, sizes: list[int], samples: int, pingpongs: int, gloo_port: int = 0
) -> dict[str, Any]:
    import torch

    import mori.shmem as shmem

    max_size = max(sizes)
    src = shmem.shmem_malloc(max_size)
    dst = shmem.shmem_malloc(max_size)
    sig = shmem.shmem_malloc(8)
    shmem.shmem_tensor_view(src, max_size, torch.uint8).fill_(rank + 1)
    shmem.shmem_barrier_all()
    from mori.shmem.context import current

    network = current("mori bench shmem").network  # None on one node
    result: dict[str, Any] = {"rows": [], "transport": None if network is None else network.tp.name}
    if rank == 0:
        a = torch.full((max_size,), 7, dtype=torch.uint8)
        b = torch.empty_like(a)
        progress = bench.Progress("mori bench shmem", len(sizes))
        for size in sizes:
            progress.step(f"put of {bench.human_bytes(size)}")

            def put_(size: int = size) -> None:
                shmem.shmem_putmem(dst, src, size, 1)

            def copy_(size: int = size) -> None:
                b[:size].copy_(a[:size])

            put = _time_per_call(put_, size, samples)
            row = {"size": size, "put_s": put}
            if not gloo_port:  # one node: the in-process copy_ (two nodes: gloo, after the puts)
                row["copy_s"] = _time_per_call(copy_, size, samples)
            result["rows"].append(row)
        progress.close()
    shmem.shmem_barrier_all()
    if rank == 1:  # the last put landed, bytes exact
        got = shmem.shmem_tensor_view(dst, max(sizes), torch.uint8)
        result["verified"] = bool((got[: max(sizes)] == 1).all())
    # put+signal ping-pong
    peer = 1 - rank
    shmem.shmem_barrier_all()
    rtts = []
    for i in range(1, pingpongs + 1):
        if rank == 0:
            t0 = time.perf_counter()
            shmem.shmem_putmem_signal(dst, src, 8, sig, i, shmem.SIGNAL_SET, peer)
            shmem.shmem_wait_until(sig, shmem.SHMEM_CMP_GE, i, dtype="uint64")
            rtts.append(time.perf_counter() - t0)
        else:
            shmem.shmem_wait_until(sig, shmem.SHMEM_CMP_GE, i, dtype="uint64")
            shmem.shmem_putmem_signal(dst, src, 8, sig, i, shmem.SIGNAL_SET, peer)
    result["rtt_s"] = rtts[pingpongs // 10 :]  # PE 0 only; the first tenth warms up
    shmem.shmem_barrier_all()
    if gloo_port:
        result["gloo"] = _gloo_baseline(rank, sizes, samples, pingpongs, gloo_port)
        shmem.shmem_barrier_all()
    return result


def summarise(
    rows: list[dict[str, Any]], baseline: str = "copy_"
) -> tuple[list[dict[str, Any]], list[list[str]], list[str]]:
    """PE 0's timed rows (``size``, ``put_s``, ``copy_s`` sample lists; ``copy_s`` holds the
    baseline's samples, named ``baseline``: ``copy_`` or ``gloo``) -> the JSON rows, the table rows
    and the notes under the table.

    A point whose put or ``copy_`` samples are clearly off (:func:`mori.core.bench.untrusted`) gets
    no ratio: the table says ``off*`` and a note why, the JSON row ``ratio: null`` and the reasons.
    """
    sizes = [row["size"] for row in rows]
    puts = [bench.Stats.of(row["put_s"]) for row in rows]
    copies = [bench.Stats.of(row["copy_s"]) for row in rows]
    ratios = bench.compare(sizes, puts, copies, ours_what="put", baseline_what=f"{baseline} baseline")
    key = "copy" if baseline == "copy_" else baseline  # the JSON rows' name of the baseline
    rows_out: list[dict[str, Any]] = []
    table: list[list[str]] = []
    for size, put, copy, ratio in zip(sizes, puts, copies, ratios, strict=True):
        put_gbs, copy_gbs = bench.gbps(size, put.median), bench.gbps(size, copy.median)
        rows_out.append(
            {
                "size": size,
                "put_gbps": put_gbs,
                "put_gbps_p10_p90": [bench.gbps(size, put.p90), bench.gbps(size, put.p10)],
                f"{key}_gbps": copy_gbs,
                f"{key}_gbps_p10_p90": [bench.gbps(size, copy.p90), bench.gbps(size, copy.p10)],
                "ratio": ratio.value,
                "off": ratio.off,
                "put_us_median": put.median * 1e6,
                f"{key}_us_median": copy.median * 1e6,
                "samples": put.n,
            }
        )
        table.append(
            [
                bench.human_bytes(size),
                f"{put.median * 1e6:.2f}",
                f"{put_gbs:.2f}",
                f"{bench.gbps(size, put.p90):.2f}-{bench.gbps(size, put.p10):.2f}",
                f"{copy_gbs:.2f}",
                f"{bench.gbps(size, copy.p90):.2f}-{bench.gbps(size, copy.p10):.2f}",
                "off*" if ratio.value is None else f"{ratio.value:.2f}",
            ]
        )
    notes = bench.ratio_notes([bench.human_bytes(s) for s in sizes], ratios, more="--samples")
    return rows_out, table, notes


def run(args: argparse.Namespace) -> int:
    two = args.nodes == 2
    args.json = bench.json_path(args.json, f"shmem-{args.device}" + ("-nodes2" if two else ""))
    if args.sizes is not None and (not args.sizes or min(args.sizes) <= 0):
        raise SystemExit("mori bench shmem: --sizes must be byte counts > 0")
    if args.transport is not None and not two:
        raise SystemExit(
            "mori bench shmem: --transport needs --nodes 2 (one node moves bytes by shared memory)"
        )
    if args.device == "cuda" and two:
        from mori.shmem import bench_proxy

        return bench_proxy.run(args)
    if args.device == "cuda":
        from mori.shmem import bench_gpu

        return bench_gpu.report(args, *bench_gpu.run_gpu(args))
    sizes = sorted(set(args.sizes or DEFAULT_SIZES))
    heap = 2 * max(sizes) + (16 << 20)
    env = {"MORI_SHMEM_TRANSPORT": args.transport} if args.transport else None
    r0, r1 = shmem_ranks(
        _rank,
        2,
        sizes,
        args.samples,
        args.pingpongs,
        bench.free_port() if two else 0,
        heap=str(heap),
        timeout=600.0,
        env=env,
        before_init=_node_per_rank if two else None,
    )
    baseline = "gloo" if two else "copy_"
    if two:  # the baseline's samples where summarise reads them
        for row, send_s in zip(r0["rows"], r0["gloo"]["send_s"], strict=True):
            row["copy_s"] = send_s
    rows_out, table, notes = summarise(r0["rows"], baseline)
    where = f"2 emulated nodes, transport {r0['transport']}" if two else "one node"
    print(f"mori bench shmem: host put bandwidth, PE 0 -> PE 1 (cpu runtime, 2 ranks, {where})")
    print("GB/s = bytes / median seconds per call (1 GB = 1e9 B); spread = p10-p90 of the samples")
    if two:
        print("baseline: gloo send of the same bytes, acknowledged by PE 1 (same processes, same run)")
    b = baseline
    print(
        bench.format_table(
            ["size", "put us", "put GB/s", "put p10-p90", f"{b} GB/s", f"{b} p10-p90", f"put/{b}"], table
        )
    )
    for note in notes:
        print(note)
    rtt = bench.Stats.of(r0["rtt_s"])
    print(
        f"put+signal round trip (8 B): median {rtt.median * 1e6:.2f} us "
        f"(p10 {rtt.p10 * 1e6:.2f}, p90 {rtt.p90 * 1e6:.2f}, n={rtt.n}); one way ~{rtt.median * 5e5:.2f} us"
    )
    gloo_rtt = bench.Stats.of(r0["gloo"]["rtt_s"]) if two else None
    if gloo_rtt is not None:
        print(
            f"gloo send/recv round trip (8 B): median {gloo_rtt.median * 1e6:.2f} us "
            f"(p10 {gloo_rtt.p10 * 1e6:.2f}, p90 {gloo_rtt.p90 * 1e6:.2f}); "
            f"gloo/ours {gloo_rtt.median / rtt.median:.2f}"
        )
    print(f"last put verified byte-exact on PE 1: {r1['verified']}")
    path = bench.write_json(
        args.json,
        "shmem",
        {
            "device": args.device,
            "ranks": 2,
            "nodes": args.nodes,
            "transport": r0["transport"] if two else None,
            "baseline": baseline,
            "sizes": sizes,
            "samples": args.samples,
            "pingpongs": args.pingpongs,
        },
        [
            *rows_out,
            {
                "latency": "put_signal_round_trip_8B",
                "median_us": rtt.median * 1e6,
                "p10_us": rtt.p10 * 1e6,
                "p90_us": rtt.p90 * 1e6,
                "n": rtt.n,
            },
            *(
                [
                    {
                        "latency": "gloo_send_recv_round_trip_8B",
                        "median_us": gloo_rtt.median * 1e6,
                        "p10_us": gloo_rtt.p10 * 1e6,
                        "p90_us": gloo_rtt.p90 * 1e6,
                        "n": gloo_rtt.n,
                    }
                ]
                if gloo_rtt is not None
                else []
            ),
        ],
    )
    print(f"wrote {path}")
    return 0 if r1["verified"] else 1

# Jitted functions carry no Python annotations (Triton reads them):
# mypy: disable-error-code="no-untyped-def,untyped-decorator,no-untyped-call"
"""GPU part of ``mori bench shmem --device cuda --nodes 2``: device-initiated SHMEM across nodes.

Two ranks share GPU 0 (run them under MPS, DEVELOPERS.md) as two emulated nodes (different
``MORI_NODE_ID``), so every put and signal of a kernel goes through the SHMEM proxy and the
network transport (``--transport``, as ``MORI_SHMEM_TRANSPORT``; ucx moves GPU memory).

Figures, all timed with CUDA events:

* put bandwidth: a kernel on PE 0 puts ``size`` bytes into PE 1's heap (``putmem_block``) and
  waits for them to be complete at PE 1 (``quiet``); launches back to back, time per launch;
  GB/s = size / median time (1 GB = 1e9 B);
* put+signal round trip: one kernel per PE bounces an 8-byte ``put_signal_block`` back and forth
  ``--pingpongs`` times; round trip = kernel time / pingpongs (no launch in it).

Baseline, same processes, same run: torch.distributed gloo, the way to move GPU bytes between
these two processes without MORI (NCCL refuses two ranks on one GPU): PE 0 copies the bytes to
pinned host memory, sends them, PE 1 receives them, copies them to its GPU and acknowledges with
one byte; the round trip is the same for 8 bytes, answered in kind. ratio = ours / baseline.
"""

from __future__ import annotations

import os
import time
from typing import Any

import triton
import triton.language as tl

from mori.core import bench
from mori.core.kernels import aot
from mori.shmem import device as shd

SIZES = [8 << (2 * i) for i in range(12)] + [64 << 20]  # 8 B .. 32 MiB by 4x, + 64 MiB
_CTX = {"ctx_ptr": "*i64"}


@aot(
    signature={"dst_ptr": "*u8", "src_ptr": "*u8", "n": "i32", "pe": "i32", **_CTX},
    constexprs={"BLOCK": 1024},
    aligned=("dst_ptr", "src_ptr", "ctx_ptr"),
)
@triton.jit
def proxy_put_kernel(dst_ptr, src_ptr, n, pe, ctx_ptr, BLOCK: tl.constexpr):
    # n bytes to PE pe, complete there when the kernel ends
    shd.putmem_block(dst_ptr, src_ptr, n, pe, ctx_ptr, BLOCK)
    shd.quiet(ctx_ptr)


def _pingpong_variants() -> list[dict[str, Any]]:
    sig = {"dst_ptr": "*i64", "src_ptr": "*i64", "sig_ptr": "*i64", **_CTX, "n_iters": "i32", "start": "i64"}
    aligned = ("dst_ptr", "src_ptr", "sig_ptr", "ctx_ptr")
    return [{"signature": sig, "constexprs": {"INITIATOR": f}, "aligned": aligned} for f in (True, False)]


@aot(**_pingpong_variants()[0])
@aot(**_pingpong_variants()[1])
@triton.jit
def proxy_pingpong_kernel(dst_ptr, src_ptr, sig_ptr, ctx_ptr, n_iters, start, INITIATOR: tl.constexpr):
    # PE 0 puts 8 bytes with a signal to PE 1 and waits for PE 1's answer; PE 1 answers each one.
    # Signal values only grow (start + i + 1), so runs follow each other without a reset.
    peer = 1 - shd.my_pe(ctx_ptr)
    i = 0
    while i < n_iters:
        value = start + i + 1
        if INITIATOR:
            shd.put_signal_block(dst_ptr, src_ptr, sig_ptr, 1, value, peer, ctx_ptr, shd.SIGNAL_SET, 16)
            shd.wait_until(sig_ptr, shd.SHMEM_CMP_GE, value)
        else:
            shd.wait_until(sig_ptr, shd.SHMEM_CMP_GE, value)
            shd.put_signal_block(dst_ptr, src_ptr, sig_ptr, 1, value, peer, ctx_ptr, shd.SIGNAL_SET, 16)
        i += 1


def _node_per_rank(rank: int, nranks: int) -> None:
    os.environ["MORI_NODE_ID"] = f"node{rank}"  # each rank its own emulated node; both on GPU 0


def _gloo_baseline(rank: int, sizes: list[int], samples: int, pingpongs: int, port: int) -> dict[str, Any]:
    """PE 0's gloo times, GPU bytes staged through pinned host memory (see the module docstring)."""
    import torch

    from mori.shmem.bench import gloo_pair

    dist = gloo_pair(rank, port)
    dev = torch.device("cuda", torch.cuda.current_device())
    gpu = torch.full((max(sizes),), 3, dtype=torch.uint8, device=dev)
    host = torch.empty(max(sizes), dtype=torch.uint8, pin_memory=True)
    ack = torch.zeros(1, dtype=torch.uint8)

    def send(n: int) -> None:
        host[:n].copy_(gpu[:n])  # (synchronous: pinned, the current stream)
        dist.send(host[:n], 1 - rank)

    def recv(n: int) -> None:
        dist.recv(host[:n], 1 - rank)
        gpu[:n].copy_(host[:n])
        torch.cuda.current_stream().synchronize()

    out: dict[str, Any] = {"send_s": []}
    for size in sizes:
        reps = max(1, min(200, (32 << 20) // max(size, 1)))
        warmup = max(2, reps // 4)
        if rank == 0:

            def once(size: int = size) -> None:
                send(size)
                dist.recv(ack, 1)

            out["send_s"].append(bench.time_samples(once, iters=samples, warmup=warmup, reps=reps))
        else:
            for _ in range(warmup + samples * reps):
                recv(size)
                dist.send(ack, 0)
    rtts = []
    for _ in range(pingpongs):
        if rank == 0:
            t0 = time.perf_counter()
            send(8)
            recv(8)
            rtts.append(time.perf_counter() - t0)
        else:
            recv(8)
            send(8)
    out["rtt_s"] = rtts[pingpongs // 10 :]
    dist.destroy_process_group()
    return out


def rank_main(
    rank: int, nranks: int, sizes: list[int], samples: int, pingpongs: int, port: int
) -> dict[str, Any]:
    import torch

    import mori.shmem as shmem
    from mori.shmem.context import current
    from mori.shmem.loading import KernelLoader

    network = current("mori bench shmem").network
    if network is None:
        raise SystemExit("mori bench shmem --nodes 2: the ranks share a node (MORI_NODE_ID is ignored?)")
    ctx = shd.shmem_device_context()
    max_size = max(sizes)
    src = shmem.mori_shmem_create_tensor(max_size, torch.uint8)
    dst = shmem.mori_shmem_create_tensor(max_size, torch.uint8)
    words = shmem.mori_shmem_create_tensor(8, torch.int64)
    sig = shmem.mori_shmem_create_tensor(1, torch.int64)
    src.fill_(rank + 1)
    dst.zero_()
    words.fill_(rank + 1)
    sig.zero_()
    torch.cuda.synchronize()
    shmem.shmem_barrier_all()
    loader = KernelLoader()  # no kernel loads while one waits on the proxy (mori.shmem.loading)
    out: dict[str, Any] = {"device": bench.device_name(src.device), "transport": network.tp.name, "rows": []}
    if rank == 0:
        progress = bench.Progress("mori bench shmem", len(sizes))
        for size in sizes:
            progress.step(f"put of {bench.human_bytes(size)} through the proxy")
            loader.launch(
                [(proxy_put_kernel, (1,), (dst, src, size, 1, ctx), {"BLOCK": 1024})]
            )  # loaded, run once
            reps = max(1, min(200, (32 << 20) // size))

            def puts(reps: int = reps, size: int = size) -> None:
                for _ in range(reps):
                    proxy_put_kernel[(1,)](dst, src, size, 1, ctx, BLOCK=1024)

            out["rows"].append({"size": size, "put_s": [bench.time_cuda(puts, reps) for _ in range(samples)]})
        progress.close()
    shmem.shmem_barrier_all()
    if rank == 1:
        out["verified"] = bool((dst == 1).all().item())
    rtts = []
    for run in range(6):
        shmem.shmem_barrier_all()

        def bounce(start: int = run * pingpongs) -> None:
            args = (words[4:], words, sig, ctx, pingpongs, start)
            loader.launch([(proxy_pingpong_kernel, (1,), args, {"INITIATOR": rank == 0})])

        rtts.append(bench.time_cuda(bounce, pingpongs))
    out["rtt_s"] = rtts[1:]  # the first run compiles and loads
    shmem.shmem_barrier_all()
    out["gloo"] = _gloo_baseline(rank, sizes, samples, max(200, pingpongs // 10), port)
    shmem.shmem_barrier_all()
    return out


def run(args: Any) -> int:
    """``mori bench shmem --device cuda --nodes 2``: measure, print, write the JSON record."""
    import torch

    from mori.core.launch import shmem_ranks
    from mori.shmem import bench as host_bench

    if torch.cuda.device_count() < 1:
        raise SystemExit("mori bench shmem --device cuda: no CUDA device visible")
    sizes = sorted(set(args.sizes or SIZES))
    env = {
        "MORI_DEVICE_RUNTIME": os.environ.get("MORI_DEVICE_RUNTIME", "auto"),
        "CUDA_MODULE_LOADING": "EAGER",
        **({"MORI_SHMEM_TRANSPORT": args.transport} if args.transport else {}),
    }
    r0, r1 = shmem_ranks(
        rank_main,
        2,
        sizes,
        args.samples,
        args.pingpongs,
        bench.free_port(),
        heap=str(2 * max(sizes) + (64 << 20)),
        timeout=900.0,
        env=env,
        before_init=_node_per_rank,
    )
    for row, send_s in zip(r0["rows"], r0["gloo"]["send_s"], strict=True):
        row["copy_s"] = send_s  # where summarise reads the baseline
    rows_out, table, notes = host_bench.summarise(r0["rows"], "gloo")
    print(
        f"mori bench shmem --device cuda --nodes 2: device-initiated put, PE 0 -> PE 1, both on "
        f"{r0['device']} (2 emulated nodes, through the proxy over {r0['transport']})"
    )
    print("put: kernel putmem_block + quiet, launches back to back, CUDA events; GB/s = bytes / median s")
    print("baseline: gloo send of the same GPU bytes staged through pinned host memory, acknowledged by PE 1")
    print(
        bench.format_table(
            ["size", "put us", "put GB/s", "put p10-p90", "gloo GB/s", "gloo p10-p90", "put/gloo"], table
        )
    )
    for note in notes:
        print(note)
    rtt = bench.Stats.of(r0["rtt_s"])
    base = bench.Stats.of(r0["gloo"]["rtt_s"])
    print(
        f"put+signal round trip (8 B, in one kernel per PE, {args.pingpongs} per run): median "
        f"{rtt.median * 1e6:.1f} us (min-max over {rtt.n} runs {min(r0['rtt_s']) * 1e6:.1f}-"
        f"{max(r0['rtt_s']) * 1e6:.1f})"
    )
    print(
        f"gloo round trip (8 B GPU bytes through host memory): median {base.median * 1e6:.1f} us "
        f"(p10 {base.p10 * 1e6:.1f}, p90 {base.p90 * 1e6:.1f}, n={base.n}); gloo/ours "
        f"{base.median / rtt.median:.2f}"
    )
    print(f"last put verified byte-exact on PE 1: {r1['verified']}")
    path = bench.write_json(
        args.json,
        "shmem",
        {
            "device": "cuda",
            "ranks": 2,
            "nodes": 2,
            "gpus": 1,
            "transport": r0["transport"],
            "baseline": "gloo (GPU bytes staged through pinned host memory)",
            "sizes": sizes,
            "samples": args.samples,
            "pingpongs": args.pingpongs,
        },
        [
            *rows_out,
            {
                "latency": "put_signal_round_trip_8B_device",
                "median_us": rtt.median * 1e6,
                "runs_us": [v * 1e6 for v in r0["rtt_s"]],
                "gloo_median_us": base.median * 1e6,
                "gloo_p10_p90_us": [base.p10 * 1e6, base.p90 * 1e6],
                "ratio_gloo_over_ours": base.median / rtt.median,
            },
        ],
    )
    print(f"wrote {path}")
    return 0 if r1["verified"] else 1


__all__ = ["proxy_pingpong_kernel", "proxy_put_kernel", "run"]

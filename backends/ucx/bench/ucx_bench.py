"""Microbenchmark of the ucx transport between two processes on this host, with two baselines
measured in the same run: local memcpy, and mori-core's built-in ``tcp`` transport (what a user
has without this plugin) through the same loops.

    python backends/ucx/bench/ucx_bench.py [--options "tls=..."] [--trials 7] [--json out.json]

The loops are native (``mori_backend_ucx._native.Bench``: a transport's ops table called from
C++), so what is timed is the transport, not Python's cost per call.

- put bandwidth (ucx and tcp, interleaved): for each size (4 KiB .. 64 MiB) enough puts to move >= 256 MiB (at least 4),
  back to back, then one flush; GB/s = bytes / time of the whole batch;
- memcpy: the same number of copies of the same size, locally, between two buffers;
- latency: one 8-byte put, waited for, then a flush, waited for; per iteration.

Every figure is the median of ``--trials`` trials, with the min and max (the spread).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import queue
import statistics
import subprocess
from typing import Any

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
MAX = SIZES[-1]
VOLUME = 256 << 20


def _benches(options: str) -> dict[str, Any]:
    """One bench per transport: ucx with ``options``, and the built-in tcp on loopback."""
    from mori_backend_ucx import UcxTransport, _native

    from mori.core.backends.tcp import TcpTransport

    return {
        "ucx": _native.Bench(UcxTransport().ops(), options, MAX),
        "tcp": _native.Bench(TcpTransport().ops(), TcpTransport().options("127.0.0.1"), MAX),
    }


def _target(q_out: Any, q_in: Any, options: str) -> None:
    benches = _benches(options)
    q_out.put({name: (b.address(), b.rkey(), b.base) for name, b in benches.items()})
    q_in.get()  # until the initiator is done; the progress threads serve it meanwhile
    for b in benches.values():
        b.close()


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def _initiator(q_out: Any, q_in: Any, options: str, trials: int, lat_iters: int) -> None:
    benches = _benches(options)
    peers = q_in.get()
    for name, b in benches.items():
        b.connect(*peers[name])
    memcpy = benches["ucx"]
    rows = []
    for size in SIZES:
        count = max(4, VOLUME // size)
        for b in benches.values():
            b.put_bandwidth(size, min(count, 64))  # warm up: wire-up, protocol choice, page faults
        samples: dict[str, list[float]] = {"ucx": [], "tcp": [], "memcpy": []}
        for _ in range(trials):  # interleaved, so that load on the machine hits all alike
            for name, b in benches.items():
                samples[name].append(size * count / b.put_bandwidth(size, count) / 1e9)
            samples["memcpy"].append(size * count / memcpy.memcpy_bandwidth(size, count) / 1e9)
        row: dict[str, Any] = {"size": size, "count": count}
        row.update({f"{k}_GBps": _stats(v) for k, v in samples.items()})
        row["ucx_over_memcpy"] = _stats(
            [u / c for u, c in zip(samples["ucx"], samples["memcpy"], strict=True)]
        )
        row["ucx_over_tcp"] = _stats([u / t for u, t in zip(samples["ucx"], samples["tcp"], strict=True)])
        rows.append(row)
    latency: dict[str, dict[str, float]] = {}
    for name, b in benches.items():
        b.put_flush_latency(200)  # warm up
        latency[name] = _stats([statistics.median(b.put_flush_latency(lat_iters)) for _ in range(trials)])
    for b in benches.values():
        b.close()
    q_out.put({"rows": rows, "put8_flush_us": latency, "lat_iters": lat_iters})


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--options", default="", help="ucx transport options (default: UCX's own choice)")
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--lat-iters", type=int, default=5000)
    ap.add_argument("--json", default="", help="write the record (every figure) here")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    to_init, to_target, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    target = ctx.Process(target=_target, args=(to_init, to_target, args.options), name="target")
    init = ctx.Process(
        target=_initiator,
        args=(results, to_init, args.options, args.trials, args.lat_iters),
        name="initiator",
    )
    target.start()
    init.start()
    out = None
    while out is None:  # a process that dies says so, the benchmark does not wait for it
        try:
            out = results.get(timeout=1)
        except queue.Empty:
            dead = [p.name for p in (target, init) if p.exitcode not in (None, 0)]
            if dead:
                raise SystemExit(f"ucx_bench: {', '.join(dead)} exited with an error (see above)") from None
    to_target.put("done")
    init.join(60)
    target.join(60)

    from mori_backend_ucx.library import load
    from mori_backend_ucx.transport import inventory

    inv = inventory(args.options)
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    with open("/proc/loadavg") as f:
        load_avg = f.read().split()[0]
    record = {
        "benchmark": "ucx transport: put bandwidth and 8-byte put+flush latency, two processes, one host",
        "command": "python backends/ucx/bench/ucx_bench.py "
        + (f"--options '{args.options}' " if args.options else "")
        + f"--trials {args.trials} --lat-iters {args.lat_iters}",
        "git": sha.stdout.strip(),
        "machine": f"{platform.node()}, {os.cpu_count()} cores, load average {load_avg} at the end",
        "ucx": f"{load().version} ({load().source})",
        "options": args.options or "(defaults: UCX's own choice of transports; net_devices=lo)",
        "transports": inv.transports,
        "trials": args.trials,
        **out,
    }
    print(f"{record['benchmark']}\nucx {record['ucx']}; options {record['options']}; {record['machine']}")
    print(f"put bandwidth, GB/s: median [min, max] over {args.trials} trials")
    print(f"{'size':>8} | {'ucx':>20} | {'tcp (built in)':>20} | {'memcpy':>20} | ucx/tcp | ucx/memcpy")
    for r in out["rows"]:
        cells = [
            f"{r[k]['median']:6.2f} [{r[k]['min']:5.2f},{r[k]['max']:6.2f}]"
            for k in ("ucx_GBps", "tcp_GBps", "memcpy_GBps")
        ]
        print(
            f"{_size(r['size']):>8} | {' | '.join(f'{c:>20}' for c in cells)} | "
            f"{r['ucx_over_tcp']['median']:7.2f} | {r['ucx_over_memcpy']['median']:10.2f}"
        )
    for name, lat in out["put8_flush_us"].items():
        print(
            f"8-byte put + flush, {name}: {lat['median']:.2f} us [{lat['min']:.2f}, {lat['max']:.2f}] "
            f"(median of {args.lat_iters} per trial)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()

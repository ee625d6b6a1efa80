"""Microbenchmark of the ucx transport between two processes on this host, with memcpy measured
in the same run as the baseline.

    python backends/ucx/bench/ucx_bench.py [--options "tls=..."] [--trials 7] [--json out.json]

The loops are native (``mori_backend_ucx._native.Bench``: the transport's ops table called from
C++), so what is timed is the transport, not Python's cost per call.

- put bandwidth: for each size (4 KiB .. 64 MiB) enough puts to move >= 256 MiB (at least 4),
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
import statistics
import subprocess
from typing import Any

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
MAX = SIZES[-1]
VOLUME = 256 << 20


def _bench(options: str) -> Any:
    from mori_backend_ucx import UcxTransport, _native

    UcxTransport().ops()  # loads UCX
    return _native.Bench(options, MAX)


def _target(q_out: Any, q_in: Any, options: str) -> None:
    b = _bench(options)
    q_out.put((b.address(), b.rkey(), b.base))
    q_in.get()  # until the initiator is done; the progress thread serves it meanwhile
    b.close()


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def _initiator(q_out: Any, q_in: Any, options: str, trials: int, lat_iters: int) -> None:
    b = _bench(options)
    b.connect(*q_in.get())
    rows = []
    for size in SIZES:
        count = max(4, VOLUME // size)
        b.put_bandwidth(size, min(count, 64))  # warm up: wire-up, protocol choice, page faults
        bw, cp = [], []
        for _ in range(trials):
            bw.append(size * count / b.put_bandwidth(size, count) / 1e9)
            cp.append(size * count / b.memcpy_bandwidth(size, count) / 1e9)
        ratio = [p / c for p, c in zip(bw, cp, strict=True)]
        rows.append(
            {
                "size": size,
                "count": count,
                "put_GBps": _stats(bw),
                "memcpy_GBps": _stats(cp),
                "ratio": _stats(ratio),
            }
        )
    b.put_flush_latency(200)  # warm up
    lat = [statistics.median(b.put_flush_latency(lat_iters)) for _ in range(trials)]
    b.close()
    q_out.put({"rows": rows, "put8_flush_us": _stats(lat), "lat_iters": lat_iters})


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
    target = ctx.Process(target=_target, args=(to_init, to_target, args.options))
    init = ctx.Process(target=_initiator, args=(results, to_init, args.options, args.trials, args.lat_iters))
    target.start()
    init.start()
    out = results.get(timeout=1800)
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
    print(f"median [min, max] over {args.trials} trials")
    print(f"{'size':>8} | {'put GB/s':>22} | {'memcpy GB/s':>22} | {'put/memcpy':>10}")
    for r in out["rows"]:
        p, c, q = r["put_GBps"], r["memcpy_GBps"], r["ratio"]
        print(
            f"{_size(r['size']):>8} | {p['median']:7.2f} [{p['min']:5.2f}, {p['max']:5.2f}] | "
            f"{c['median']:7.2f} [{c['min']:5.2f}, {c['max']:5.2f}] | {q['median']:10.2f}"
        )
    lat = out["put8_flush_us"]
    print(
        f"8-byte put + flush: {lat['median']:.2f} us [{lat['min']:.2f}, {lat['max']:.2f}] "
        f"(median of {args.lat_iters} per trial)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()

"""Tier bandwidth (DRAM, SSD) by batch size against memcpy and the disk, and master ops/s.

**Tiers.** ``--count`` objects of ``--size`` bytes (default 2048 x 2 MiB, the original's
benchmark shape) are put from one prefaulted host buffer and got back into another, in batches
of ``--batches`` keys per call. GB/s = count x size / (sum of the batch calls' times), 1 GB = 1e9 B;
median over ``--reps`` repetitions (the client is cleared between them: first write wins, so a
second put of a key would copy nothing), with min-max.

* DRAM: a :class:`mori.umbp.UMBPClient` whose DRAM tier holds every object (SSD off). Baseline,
  same run: ``memcpy`` (``ctypes.memmove``) of the same objects, one call per object, from the
  source buffer to the destination buffer, both prefaulted. ratio = UMBP / memcpy.
* SSD: the SSD tier alone (:class:`mori.umbp.ssd.SsdTier`) in ``--ssd-dir``, strict durability
  (an fsync per batch) and relaxed (one ``flush`` at the end, inside the timing). Baseline: the
  disk's own sequential bandwidth in the same directory: the same bytes written with 8 MiB
  ``pwrite`` calls and one fsync, read back with 8 MiB ``pread`` calls. Before every read phase
  the page cache of those files (ours and the baseline's) is dropped with
  ``posix_fadvise(DONTNEED)``, so reads come from the device (the file system may still cache
  metadata).
* HBM: needs a GPU (``--device cuda``), not measured on CPU.

**Master.** ``umbp_master`` runs as a process with the in-memory backend, then with the Redis
backend (a ``redis-server`` the benchmark starts on a free loopback port; skipped with the reason
if none is installed). 4 nodes register and report ``--hashes`` hashes; then ``--procs`` client
processes x ``--threads`` threads each call the operation in a loop for ``--seconds``, with
:class:`mori.umbp.UMBPMasterClient`. ops/s = calls completed / seconds, summed over clients;
median of ``--reps``. The threads of a process share one client, so concurrent
``match_external_kv`` calls are group-committed (see :class:`mori.umbp.UMBPMasterClient`): one
RPC in flight, the calls that arrive meanwhile go together in the next. Operations: ``match_external_kv`` of 8 hashes (6 reported, 2 not),
``report_external_kv_blocks`` of 8 hashes, ``route_get`` of 8 keys, and ``ping``, an RPC that
touches no state: what the same clients get from the gRPC framework alone (grpcio, asyncio
server), the ceiling of any Python master on the machine.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mori.core import bench
from mori.core.env import parse_size

MiB = 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--count", type=int, default=2048, help="objects per tier run (default 2048)")
    p.add_argument("--size", type=parse_size, default=2 * MiB, help="bytes per object (default 2M)")
    p.add_argument("--batches", default="1,16,128,2048", help="keys per batch call, comma-separated")
    p.add_argument("--tiers", default="dram,ssd", help="dram, ssd (comma-separated)")
    p.add_argument(
        "--ssd-count", type=int, default=512, help="objects of the SSD run (default 512: 1 GiB of 2 MiB)"
    )
    p.add_argument(
        "--ssd-dir", default="", help="directory of the SSD run (default: a temporary one under /var/tmp)"
    )
    p.add_argument("--reps", type=int, default=3, help="repetitions (median and spread)")
    p.add_argument("--master", default="inmemory,redis", help="master backends to measure ('' for none)")
    p.add_argument(
        "--ops", default="match,report,route,ping", help="master operations (ping: the RPC framework alone)"
    )
    p.add_argument("--procs", type=int, default=2, help="client processes of the master load")
    p.add_argument(
        "--threads", default="1,32", help="threads per client process, comma-separated (one row each)"
    )
    p.add_argument("--seconds", type=float, default=3.0, help="duration of one master measurement")
    p.add_argument("--hashes", type=int, default=20000, help="hashes reported before the master runs")
    p.add_argument("--json", default="bench-results/umbp-cpu.json", help="where the record goes")


# -- tiers ---------------------------------------------------------------------------------------------


def bench_dram(
    args: argparse.Namespace, batches: list[int], progress: bench.Progress | None = None
) -> list[dict[str, Any]]:
    from mori.umbp import UMBPClient, UMBPConfig
    from mori.umbp.host_memory import map_host, unmap_host

    n, size = args.count, args.size
    total = n * size
    src, dst = map_host(total), map_host(total)
    ctypes.memset(src.ptr, 0x5A, total)
    cfg = UMBPConfig()
    cfg.ssd.enabled = False
    cfg.dram.capacity_bytes = int(total / 0.85) + (64 << 20)  # every object below the high watermark
    client = UMBPClient(cfg)
    keys = [f"bench-{i}" for i in range(n)]
    srcs = [src.ptr + i * size for i in range(n)]
    dsts = [dst.ptr + i * size for i in range(n)]
    sizes = [size] * n
    rows: list[dict[str, Any]] = []
    try:
        for b in batches:
            if progress is not None:
                progress.step(f"dram, batch {b}")
            put, get, cpy = [], [], []
            for _ in range(args.reps):
                client.clear()
                t = 0.0
                for i in range(0, n, b):
                    t0 = time.perf_counter()
                    ok = client.batch_put_from_ptr(keys[i : i + b], srcs[i : i + b], sizes[i : i + b])
                    t += time.perf_counter() - t0
                    assert all(ok), "a put failed: the DRAM tier is too small"
                put.append(bench.gbps(total, t))
                t = 0.0
                for i in range(0, n, b):
                    t0 = time.perf_counter()
                    ok = client.batch_get_into_ptr(keys[i : i + b], dsts[i : i + b], sizes[i : i + b])
                    t += time.perf_counter() - t0
                    assert all(ok), "a get missed"
                get.append(bench.gbps(total, t))
                t0 = time.perf_counter()
                for s, d in zip(srcs, dsts, strict=True):
                    ctypes.memmove(d, s, size)
                cpy.append(bench.gbps(total, time.perf_counter() - t0))
            verified = ctypes.string_at(dst.ptr + (n - 1) * size, 64) == b"\x5a" * 64
            mc = statistics.median(cpy)
            rows.append({
                "tier": "dram", "batch": b, "count": n, "size": size, "put_gbps": bench.spread(put), "get_gbps": bench.spread(get),
                "memcpy_gbps": bench.spread(cpy), "put_ratio": statistics.median(put) / mc,
                "get_ratio": statistics.median(get) / mc, "verified": verified,
            })  # fmt: skip
    finally:
        client.close()
        unmap_host(src)
        unmap_host(dst)
    return rows


def _drop_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bench_ssd(
    args: argparse.Namespace, batches: list[int], progress: bench.Progress | None = None
) -> list[dict[str, Any]]:
    from mori.umbp.config import UMBPDurabilityMode, UMBPSsdConfig
    from mori.umbp.host_memory import map_host, unmap_host
    from mori.umbp.ssd import SsdTier

    n, size = args.ssd_count, args.size
    total = n * size
    root = Path(args.ssd_dir or tempfile.mkdtemp(prefix="umbp-bench-", dir="/var/tmp"))
    root.mkdir(parents=True, exist_ok=True)
    src, dst = map_host(total), map_host(total)
    for i in range(0, total, MiB):
        ctypes.memmove(src.ptr + i, os.urandom(64) * (MiB // 64), min(MiB, total - i))
    rows: list[dict[str, Any]] = []
    keys = [f"ssd-{i}" for i in range(n)]
    try:
        for mode in (UMBPDurabilityMode.Strict, UMBPDurabilityMode.Relaxed):
            for b in batches:
                if progress is not None:
                    progress.step(f"ssd {mode.name.lower()}, batch {b}")
                put, get, seq_w, seq_r = [], [], [], []
                for _ in range(args.reps):
                    d = root / "tier"
                    shutil.rmtree(d, ignore_errors=True)
                    cfg = UMBPSsdConfig()
                    cfg.storage_dir = str(d)
                    cfg.capacity_bytes = int(total * 1.5) + (256 << 20)
                    cfg.durability.mode = mode
                    tier = SsdTier(cfg)
                    t = 0.0
                    for i in range(0, n, b):
                        t0 = time.perf_counter()
                        ok = tier.put_many(
                            [(keys[j], src.ptr + j * size, size) for j in range(i, min(n, i + b))]
                        )
                        t += time.perf_counter() - t0
                        assert all(ok)
                    t0 = time.perf_counter()
                    tier.flush()
                    t += time.perf_counter() - t0
                    put.append(bench.gbps(total, t))
                    _drop_cache(sorted(d.glob("segment-*.log")))
                    t = 0.0
                    for i in range(0, n, b):
                        items = [(keys[j], dst.ptr + j * size, size) for j in range(i, min(n, i + b))]
                        t0 = time.perf_counter()
                        ok = tier.get_many(items)
                        t += time.perf_counter() - t0
                        assert all(ok)
                    get.append(bench.gbps(total, t))
                    tier.close()
                    w, r = _sequential(root / "seq.bin", src.ptr, total)
                    seq_w.append(w)
                    seq_r.append(r)
                verified = ctypes.string_at(dst.ptr, total // 8) == ctypes.string_at(src.ptr, total // 8)
                rows.append({
                    "tier": "ssd", "durability": mode.name.lower(), "batch": b, "count": n, "size": size,
                    "put_gbps": bench.spread(put), "get_gbps": bench.spread(get), "disk_write_gbps": bench.spread(seq_w),
                    "disk_read_gbps": bench.spread(seq_r), "put_ratio": statistics.median(put) / statistics.median(seq_w),
                    "get_ratio": statistics.median(get) / statistics.median(seq_r), "verified": verified,
                })  # fmt: skip
    finally:
        unmap_host(src)
        unmap_host(dst)
        if not args.ssd_dir:
            shutil.rmtree(root, ignore_errors=True)
    return rows


def _sequential(path: Path, ptr: int, total: int) -> tuple[float, float]:
    """The disk's own sequential write (8 MiB pwrites + one fsync) and read (8 MiB preads) GB/s."""
    chunk = 8 * MiB
    view = memoryview((ctypes.c_char * total).from_address(ptr)).cast("B")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t0 = time.perf_counter()
        for off in range(0, total, chunk):
            os.pwrite(fd, view[off : off + chunk], off)
        os.fsync(fd)
        w = bench.gbps(total, time.perf_counter() - t0)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        buf = bytearray(chunk)
        t0 = time.perf_counter()
        for off in range(0, total, chunk):
            os.preadv(fd, [buf], off)
        r = bench.gbps(total, time.perf_counter() - t0)
    finally:
        os.close(fd)
        path.unlink()
    return w, r


# -- master --------------------------------------------------------------------------------------------


def _wait_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"mori bench umbp: nothing listened on 127.0.0.1:{port} within {timeout} s")


def _load(address: str, op: str, threads: int, seconds: float, hashes: int, q: Any) -> None:
    import threading

    from mori.umbp import UMBPMasterClient, UMBPTierType

    counts = [0] * threads
    start = threading.Barrier(threads + 1)

    c = UMBPMasterClient(address)  # one client per process, shared by its threads (as an engine would)

    def work(t: int) -> None:
        rng = (t * 7919) % max(1, hashes - 8)
        start.wait()
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            base = (rng + i * 8) % max(1, hashes - 8)
            if op == "match":
                c.match_external_kv([f"h{base + j}" for j in range(6)] + [f"miss{i}", f"miss{i + 1}"])
            elif op == "report":
                c.report_external_kv_blocks(
                    f"node-{t % 4}", [f"r{t}-{i}-{j}" for j in range(8)], UMBPTierType.HBM
                )
            elif op == "route":
                c.route_get([f"k{base + j}" for j in range(8)])
            else:
                c.ping()
            i += 1
        counts[t] = i

    ts = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for th in ts:
        th.start()
    start.wait()
    for th in ts:
        th.join()
    q.put(sum(counts))


def bench_master(
    args: argparse.Namespace, backend: str, progress: bench.Progress | None = None
) -> list[dict[str, Any]]:
    from mori.umbp import UMBPMasterClient, UMBPTierType

    env = dict(os.environ)
    env.pop("UMBP_MASTER_AUTH_TOKEN", None)
    redis_proc = None
    tmp = tempfile.mkdtemp(prefix="umbp-bench-redis-")
    if backend == "redis":
        exe = shutil.which("redis-server")
        if exe is None:
            print("mori bench umbp: redis-server is not installed; the Redis backend is not measured")
            return [{"master": "redis", "skipped": "redis-server is not installed"}]
        rport = bench.free_port()
        redis_proc = subprocess.Popen(
            [exe, "--port", str(rport), "--bind", "127.0.0.1", "--dir", tmp, "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        _wait_port(rport)
        env.update(
            UMBP_METADATA_BACKEND="redis",
            UMBP_REDIS_URI=f"redis://127.0.0.1:{rport}/0",
            UMBP_REDIS_NAMESPACE="bench",
        )
    else:
        env["UMBP_METADATA_BACKEND"] = "inmemory"
    env["UMBP_HEARTBEAT_TTL_SEC"] = "3600"
    port = bench.free_port()
    exe = shutil.which("umbp_master")
    cmd = [exe] if exe else [sys.executable, "-m", "mori.umbp.master.server"]
    master = subprocess.Popen([*cmd, f"127.0.0.1:{port}", "0", "--log-level", "WARNING"], env=env)
    rows: list[dict[str, Any]] = []
    try:
        _wait_port(port)
        address = f"127.0.0.1:{port}"
        for i in range(4):
            n = UMBPMasterClient(address, node_id=f"node-{i}", node_address=f"10.0.0.{i}")
            n.register_self({UMBPTierType.DRAM: (1 << 40, 1 << 40)}, peer_address=f"10.0.0.{i}:1")
            n.heartbeat([(0, f"k{j}", UMBPTierType.DRAM, 4096) for j in range(i, args.hashes, 4)])
        q = UMBPMasterClient(address)
        for i in range(0, args.hashes, 2000):
            q.report_external_kv_blocks(f"node-{(i // 2000) % 4}", [f"h{j}" for j in range(i, min(args.hashes, i + 2000))],
                                        UMBPTierType.DRAM)  # fmt: skip
        ctx = mp.get_context("spawn")
        for op in [o for o in args.ops.split(",") if o]:
            for threads in _ints("--threads", str(args.threads)):
                if progress is not None:
                    progress.step(f"master {backend}, {op}, {args.procs} x {threads}")
                rates = []
                for _ in range(args.reps):
                    out = ctx.Queue()
                    ps = [
                        ctx.Process(target=_load, args=(address, op, threads, args.seconds, args.hashes, out))
                        for _ in range(args.procs)
                    ]
                    for p in ps:
                        p.start()
                    total = sum(out.get(timeout=args.seconds + 120) for _ in ps)
                    for p in ps:
                        p.join()
                    rates.append(total / args.seconds)
                rows.append(
                    {
                        "master": backend,
                        "op": op,
                        "procs": args.procs,
                        "threads": threads,
                        "ops_per_s": bench.spread(rates),
                    }
                )
    finally:
        master.terminate()
        master.wait(timeout=30)
        if redis_proc is not None:
            redis_proc.kill()
            redis_proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


# -- entry point ---------------------------------------------------------------------------------------


def _fmt(s: dict[str, float]) -> str:
    return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"


def _ints(option: str, text: str) -> list[int]:
    """``text`` of ``option`` as integers >= 1 (mori.core.bench's parser; the options stay strings,
    as the record's config has them)."""
    try:
        return bench.int_list(text, minimum=1)
    except argparse.ArgumentTypeError as e:
        raise SystemExit(f"mori bench umbp: {option}: {e}") from None


def run(args: argparse.Namespace) -> int:
    batches = _ints("--batches", args.batches)
    if args.reps < 1 or args.count < 1:
        raise SystemExit("mori bench umbp: --reps, --count and every --batches value must be >= 1")
    tiers = [t for t in args.tiers.split(",") if t]
    masters = [b for b in args.master.split(",") if b]
    ssd_batches = [b for b in batches if b <= args.ssd_count]
    threads = _ints("--threads", str(args.threads)) if masters else []
    ops = [o for o in args.ops.split(",") if o]
    steps = len(batches) * ("dram" in tiers) + 2 * len(ssd_batches) * ("ssd" in tiers)
    rows: list[dict[str, Any]] = []
    with bench.Progress("mori bench umbp", steps + len(masters) * len(ops) * len(threads)) as progress:
        if "dram" in tiers:
            rows += bench_dram(args, batches, progress)
        if "ssd" in tiers:
            rows += bench_ssd(args, ssd_batches, progress)
        for backend in masters:
            rows += bench_master(args, backend, progress)
    tier_rows = [r for r in rows if "tier" in r]
    if tier_rows:
        print(bench.format_table(
            ["tier", "durability", "batch", "objects", "put GB/s (min-max)", "get GB/s (min-max)", "baseline write", "baseline read",
             "put/base", "get/base"],
            [[r["tier"], r.get("durability", "-"), r["batch"], f"{r['count']} x {bench.human_bytes(r['size'])}",
              _fmt(r["put_gbps"]), _fmt(r["get_gbps"]),
              _fmt(r["memcpy_gbps"] if r["tier"] == "dram" else r["disk_write_gbps"]),
              _fmt(r["memcpy_gbps"] if r["tier"] == "dram" else r["disk_read_gbps"]),
              f"{r['put_ratio']:.2f}", f"{r['get_ratio']:.2f}"] for r in tier_rows],
        ))  # fmt: skip
        print(
            "baseline: DRAM = memcpy of the same objects; SSD = the disk's sequential write (+fsync) / read"
        )
    master_rows = [r for r in rows if "op" in r]
    if master_rows:
        print(bench.format_table(
            ["master", "op", "clients", "ops/s (min-max)"],
            [[r["master"], r["op"], f"{r['procs']} x {r['threads']}", _fmt(r["ops_per_s"])] for r in master_rows],
        ))  # fmt: skip
    config = {k: v for k, v in vars(args).items() if k not in ("func",)}
    path = bench.write_json(args.json, "umbp", config, rows)
    print(f"wrote {path}")
    return 0 if all(r.get("verified", True) for r in rows) else 1

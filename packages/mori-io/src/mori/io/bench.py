"""Transfer bandwidth and latency between two engines (nixlbench-style), against NIXL or the raw peer copy.

Two processes on one host: an initiator (this process) and a target (spawned). For every op
(WRITE: initiator -> target, READ: target -> initiator), block size and batch size, the initiator
posts one transfer of ``batch`` blocks of ``block`` bytes and waits for its completion, ``iters``
times in a row (stop-and-wait, as nixlbench does). Per iteration it records the *post time* (the
call that starts the transfer) and the *latency* (post until completion seen). Figures:

* GB/s = block x batch x iters / (sum of the iterations' latencies) per repetition (1 GB = 1e9 B);
  the table shows the median over repetitions and the spread min-max;
* avg latency and p99 latency over every timed iteration of every repetition; avg post time.

``--device cpu``: mori.io's TCP backend (the native engine: sockets, or cross-memory attach between
engines of one host) against NIXL (UCX backend, DRAM registered the same way). The target process
registers one buffer with both; mori's initiator is this process, NIXL's a process of its own (NIXL
1.5.1 crashes in interpreter teardown once an agent existed, so NIXL never runs here). Phases: every
point with mori, then every point with NIXL, the order reversed each repetition, so that both see
the same machine load. NIXL's agents exist only during NIXL's phases: an idle agent's progress
thread keeps a core busy, which would slow whatever runs beside it. The target's agent has that
thread (a passive target needs it); the initiator's polls while it waits
(``--nixl-initiator-thread on`` gives it one too). ratio = mori GB/s / NIXL GB/s. The UCX
transports NIXL used are read from UCX's own log.
``--device cuda``: the XGMI backend (NVLink / xGMI, GPU IPC) between GPU 0 (initiator) and GPU 1
(target) against the raw copy-engine peer copy ``dst.copy_(src)`` from ``cuda:0`` to ``cuda:1``
(READ: the other way) in the initiator. There GB/s comes from ``iters`` transfers posted back to
back and then waited for (the GPU's bandwidth, not the host's round trip; copy_: one synchronize of
both GPUs at the end), while latency and post time stay stop-and-wait; plus the latency of a batch
of 128 strided 16 KiB blocks, through the scatter-gather kernel and with one copy per block. Every
path is checked byte-exact first.

This module keeps the workload; the concepts beside it live in modules of their own: the pipe to
the other processes (:mod:`mori.io.bench_peer`), the NIXL baseline (:mod:`mori.io.bench_nixl`),
the buffers on pages or huge pages (:mod:`mori.io.bench_buffers`) and the network namespaces of
``--netns on`` (:mod:`mori.io.bench_netns`); options, timers, tables and the record are
:mod:`mori.core.bench`'s.
"""

from __future__ import annotations

import argparse
import functools
import gc
import multiprocessing as mp
import os
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mori.core import bench
from mori.core.bench import time_pipelined, time_transfers
from mori.core.env import parse_positive_float, parse_size
from mori.io.bench_buffers import cpu_buffer, digest, huge_fraction
from mori.io.bench_netns import enter_namespace, make_namespaces, veth_bytes
from mori.io.bench_nixl import NixlBaseline, make_nixl, nixl_missing, ucx_transports
from mori.io.bench_peer import PEER_TIMEOUT_S, TARGET_TIMEOUT_S, Peer, exit_without_teardown

KiB, MiB = 1 << 10, 1 << 20
DEFAULT_BLOCKS = [4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB]
DEFAULT_BATCHES = [1, 32, 128]
#: bytes moved per repetition when --iters is not given (iterations = this / bytes per transfer)
BYTES_PER_REP = 128 * MiB
MIN_ITERS, MAX_ITERS = 5, 1000
#: the GPU batch-latency figure: this many strided blocks of this size
GPU_BATCH, GPU_BATCH_BLOCK = 128, 16 * KiB


#: the option parsers (mori.core.bench's, with this suite's allowed values)
_ints = functools.partial(bench.int_list, minimum=1)
_ops = functools.partial(bench.name_list, allowed=("write", "read"), lower=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cpu: TCP backend vs NIXL on DRAM; cuda: XGMI backend GPU 0 -> GPU 1 vs dst.copy_(src)",
    )
    p.add_argument("--ops", type=_ops, default=["write", "read"], help="write, read or write,read (default)")
    p.add_argument(
        "--blocks",
        type=bench.size_list,
        default=None,
        help="comma-separated block sizes, e.g. 4K,1M,64M (default 4 KiB to 64 MiB by 4x)",
    )
    p.add_argument(
        "--batches",
        type=_ints,
        default=None,
        help="comma-separated batch sizes: blocks per transfer (default 1,32,128; cuda: 1)",
    )
    p.add_argument(
        "--max-bytes",
        type=parse_size,
        default=256 * MiB,
        help="largest block x batch measured (the buffers have this size on both sides; default 256M)",
    )
    p.add_argument(
        "--iters",
        type=int,
        default=0,
        help=f"timed transfers per repetition (default: {BYTES_PER_REP >> 20} MiB worth, {MIN_ITERS} to {MAX_ITERS})",
    )
    p.add_argument("--reps", type=int, default=5, help="repetitions per point (median and spread over them)")
    p.add_argument(
        "--mode",
        choices=["session", "engine"],
        default="session",
        help="post through an IOEngineSession (default; NIXL's counterpart is a prepared transfer) "
        "or through IOEngine.write/batch_write",
    )
    p.add_argument(
        "--tcp-cma",
        choices=["on", "off"],
        default="on",
        help="cpu: let the TCP backend use cross-memory attach between the two processes (default on)",
    )
    p.add_argument(
        "--backend",
        choices=["tcp", "rdma"],
        default="tcp",
        help="cpu: the mori backend measured: tcp (the TCP backend) or rdma (BackendType.RDMA on its network "
        "transport, MORI_IO_RDMA_TRANSPORT, default ucx)",
    )
    p.add_argument(
        "--buffers",
        choices=["pages", "huge"],
        default="pages",
        help="cpu: how the benchmark allocates the buffers of both engines (both sides): 'pages' as any "
        "allocation (4 KiB pages here), 'huge' on 2 MiB transparent huge pages (mmap + MADV_HUGEPAGE, "
        "as a tuning user would); the engines themselves are left at their defaults",
    )
    p.add_argument(
        "--netns",
        choices=["on", "off"],
        default="off",
        help="cpu, as root: put the target in a network namespace of its own and the initiators in another, "
        "joined by a veth pair (created and deleted by the run), so every byte crosses a network stack: "
        "UCX (mori's transport and NIXL's) on TCP over the veth only, the engines on the veth addresses "
        "with a shared secret, the TCP backend without cross-memory attach",
    )
    p.add_argument(
        "--nixl",
        choices=["on", "off"],
        default="on",
        help="cpu: measure NIXL as the baseline (default on; reported as missing if not installed)",
    )
    p.add_argument(
        "--nixl-initiator-thread",
        choices=["on", "off"],
        default="off",
        help="cpu: give the NIXL initiator NIXL's progress thread too (default off: it polls while it waits; "
        "the target always has one)",
    )
    p.add_argument(
        "--ucx-tls",
        default=None,
        help="cpu: force UCX_TLS for NIXL (e.g. tcp); default: UCX's own choice (UCX_TLS as in the environment)",
    )
    p.add_argument(
        "--timeout",
        type=parse_positive_float,
        default=PEER_TIMEOUT_S,
        help=f"seconds to wait for an answer of the target process (start included) before failing "
        f"(default {PEER_TIMEOUT_S:.0f}); a target that exits fails the run at once",
    )
    bench.output_arguments(p, "io-DEVICE")


# -- helpers ---------------------------------------------------------------------------------------------


def iterations(nbytes: int, iters: int) -> int:
    """Timed transfers per repetition: ``iters`` if given, else ``BYTES_PER_REP`` worth, clamped."""
    if iters > 0:
        return iters
    return max(MIN_ITERS, min(MAX_ITERS, BYTES_PER_REP // max(1, nbytes)))


def points(
    ops: Sequence[str], blocks: Sequence[int], batches: Sequence[int], max_bytes: int
) -> list[tuple[str, int, int]]:
    """(op, block, batch) to measure: every combination whose block x batch fits ``max_bytes``."""
    return [
        (op, block, batch)
        for op in ops
        for block in sorted(set(blocks))
        for batch in sorted(set(batches))
        if block * batch <= max_bytes
    ]


def summarize(nbytes: int, reps: Sequence[tuple[Sequence[float], Sequence[float]]]) -> dict[str, Any]:
    """Figures of one point from its repetitions, each ``(latencies_s, post_times_s)`` of one rep."""
    gbps = [bench.gbps(nbytes * len(lat), sum(lat)) for lat, _ in reps if lat and sum(lat) > 0]
    lats = sorted(x for lat, _ in reps for x in lat)
    posts = [x for _, post in reps for x in post]
    if not gbps or not lats:
        raise ValueError("no timed iterations")
    p99 = bench.percentile(lats, 0.99)
    return {
        "gbps": statistics.median(gbps),
        "gbps_min": min(gbps),
        "gbps_max": max(gbps),
        "gbps_reps": gbps,
        "avg_lat_us": statistics.fmean(lats) * 1e6,
        "median_lat_us": statistics.median(lats) * 1e6,
        "p99_lat_us": p99 * 1e6,
        "avg_post_us": statistics.fmean(posts) * 1e6,
        "iterations": len(lats),
    }


def with_stream_figures(
    fig: dict[str, Any], nbytes: int, iters: int, seconds: Sequence[float]
) -> dict[str, Any]:
    """``fig`` (stop-and-wait figures) with GB/s replaced by the pipelined ones (``seconds`` per rep of
    ``iters`` transfers); the stop-and-wait GB/s stay under ``sw_*``."""
    gbps = [bench.gbps(nbytes * iters, t) for t in seconds]
    return {
        **fig,
        "sw_gbps": fig["gbps"],
        "sw_gbps_min": fig["gbps_min"],
        "sw_gbps_max": fig["gbps_max"],
        "gbps": statistics.median(gbps),
        "gbps_min": min(gbps),
        "gbps_max": max(gbps),
        "gbps_reps": gbps,
    }


def session_post(
    sess: Any, uid: Callable[[], int], op: str, offsets: Sequence[int], sizes: Sequence[int]
) -> Callable[[], Any]:
    """A call that posts one transfer of the blocks (same offsets on both sides) through ``sess``."""
    if len(sizes) == 1:
        one = sess.write if op == "write" else sess.read
        off, size = offsets[0], sizes[0]
        return lambda: one(off, off, size, uid())
    many = sess.batch_write if op == "write" else sess.batch_read
    offs, szs = list(offsets), list(sizes)
    return lambda: many(offs, offs, szs, uid())


def _fmt(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}"


# -- CPU: the two processes ------------------------------------------------------------------------------


def _make_engine(key: str, cma: bool, backend: str = "tcp") -> Any:
    """An engine on loopback with the TCP backend, or (``backend="rdma"``) the RDMA backend on its
    network transport (``MORI_IO_RDMA_TRANSPORT``, default ucx) and the TCP one beside it."""
    from mori.io import BackendType, IOEngine, IOEngineConfig, RdmaBackendConfig, TcpBackendConfig

    engine = IOEngine(key, IOEngineConfig(os.environ.get("MORI_BENCH_IO_HOST", "127.0.0.1"), 0))
    engine.create_backend(BackendType.TCP, TcpBackendConfig(enable_cma=cma))
    if backend == "rdma":
        engine.create_backend(BackendType.RDMA, RdmaBackendConfig(enable_notification=False))
    return engine


def _target(conn: Any, nbytes: int, cma: bool, use_nixl: bool, env: dict[str, str], buffers: str) -> None:
    """The target process: owns registered memory (mori and, during NIXL's phases, NIXL), answers
    digests, exits on "stop"."""
    os.environ.update(env)
    code = 0
    if env.get("MORI_BENCH_IO_NETNS"):
        enter_namespace(env["MORI_BENCH_IO_NETNS"])
    try:
        import torch

        from mori.io import EngineDesc

        buf = cpu_buffer(nbytes, buffers)
        buf.copy_(torch.arange(nbytes, dtype=torch.int64).remainder_(251).to(torch.uint8))
        engine = _make_engine("bench-target", cma, os.environ.get("MORI_BENCH_IO_BACKEND", "tcp"))
        desc = engine.register_torch_tensor(buf)
        why = nixl_missing() if use_nixl else "disabled (--nixl off)"
        agent: Any = None
        conn.send(
            {
                "engine": engine.get_engine_desc().pack(),
                "mem": desc.pack(),
                "addr": buf.data_ptr(),
                "nixl_error": why,
                "huge": huge_fraction(buf),
            }
        )
        try:
            while conn.poll(TARGET_TIMEOUT_S):
                msg = conn.recv()
                if msg[0] == "peer":
                    engine.register_remote_engine(EngineDesc.unpack(msg[1]))
                    conn.send("ok")
                elif msg[0] == "digest":
                    _, off, n = msg
                    conn.send(digest(buf[off : off + n].numpy()))
                elif msg[0] == "nixl_up":  # NIXL agents live only while NIXL is measured
                    agent, why = make_nixl("bench-target", buf)
                    conn.send((agent.get_agent_metadata() if agent is not None else None, why))
                elif msg[0] == "nixl_down":
                    agent = None
                    gc.collect()
                    conn.send("ok")
                elif msg[0] == "stop":
                    break
        finally:
            agent = None
            engine.shutdown()
        conn.send("bye")
    except BaseException:
        traceback.print_exc()
        code = 1
    exit_without_teardown(code)


class _CpuInitiator:
    """The initiator's mori side: an engine and a registered buffer in the ``mori`` process."""

    def __init__(self, args: argparse.Namespace, conn: Peer, hello: dict[str, Any], nbytes: int) -> None:
        import torch

        from mori.io import EngineDesc, MemoryDesc

        self.conn = conn
        self.args = args
        gen = torch.Generator().manual_seed(7)
        self.buf = cpu_buffer(nbytes, args.buffers)
        self.buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen))
        self.engine = _make_engine("bench-initiator", args.tcp_cma == "on", args.backend)
        self.local = self.engine.register_torch_tensor(self.buf)
        self.remote = MemoryDesc.unpack(hello["mem"])
        self.engine.register_remote_engine(EngineDesc.unpack(hello["engine"]))
        conn.ask("peer", self.engine.get_engine_desc().pack())
        self.session = self.engine.create_session(self.local, self.remote)
        if args.mode == "session" and self.session is None:
            raise SystemExit("mori bench io: create_session returned None for the TCP path")
        self.remote_addr: int = hello["addr"]

    def route(self) -> str:
        return str(self.engine._route_name(self.local, self.remote))

    def mori_post(self, op: str, block: int, batch: int) -> Callable[[], Any]:
        offs = [i * block for i in range(batch)]
        sizes = [block] * batch
        uid = self.engine.allocate_transfer_uid
        if self.args.mode == "session":
            return session_post(self.session, uid, op, offs, sizes)
        e, loc, rem = self.engine, self.local, self.remote
        if batch == 1:
            one_e = e.write if op == "write" else e.read
            return lambda: one_e(loc, 0, rem, 0, block, uid())
        many_e = e.batch_write if op == "write" else e.batch_read
        return lambda: many_e([loc], [offs], [rem], [offs], [sizes], [uid()])[0]

    @staticmethod
    def mori_wait(st: Any) -> None:
        st.Wait()
        if not st.Succeeded():
            raise RuntimeError(f"mori transfer failed: {st.Code()} {st.Message()}")

    def verify(self, n: int) -> bool:
        """Write our bytes [0, n) to the target and read them back into [n, 2n)."""
        self.buf[n : 2 * n].zero_()
        st = self.engine.write(self.local, 0, self.remote, 0, n, self.engine.allocate_transfer_uid())
        self.mori_wait(st)
        wrote = self.conn.ask("digest", 0, n) == digest(self.buf[:n].numpy())
        st = self.engine.read(self.local, n, self.remote, 0, n, self.engine.allocate_transfer_uid())
        self.mori_wait(st)
        return bool(wrote and bool((self.buf[n : 2 * n] == self.buf[:n]).all()))


def _measure_cpu(
    args: argparse.Namespace, ini: _CpuInitiator, nixl: NixlBaseline | None, check: int
) -> tuple[list[dict[str, Any]], bool | None, str]:
    """Every point, in phases: all points with mori, then all with NIXL (its agents created for the
    phase and destroyed after it), the order reversed every repetition. Returns the rows, whether
    NIXL's bytes checked out (None: not measured) and why NIXL was not measured."""
    pts = points(args.ops, args.blocks, args.batches, args.max_bytes)
    reps: dict[str, dict[tuple[str, int, int], list[tuple[list[float], list[float]]]]] = {
        "mori": {p: [] for p in pts},
        "nixl": {p: [] for p in pts},
    }
    names = ["mori", "nixl"] if nixl is not None else ["mori"]
    nixl_verified: bool | None = None
    why_not = ""
    progress = bench.Progress("mori bench io", args.reps * len(names))
    for r in range(args.reps):
        for name in names if r % 2 == 0 else reversed(names):
            progress.step(f"rep {r + 1}/{args.reps}: {name}, {len(pts)} points")
            t0 = time.perf_counter()
            if name == "mori":
                for op, block, batch in pts:
                    iters = iterations(block * batch, args.iters)
                    post = ini.mori_post(op, block, batch)
                    try:
                        time_transfers(post, ini.mori_wait, max(2, iters // 10))
                        reps["mori"][(op, block, batch)].append(time_transfers(post, ini.mori_wait, iters))
                    except RuntimeError as e:  # a transfer failed: because the target is gone?
                        ini.conn.proc.join(2.0)  # the engine may see it gone before it is reaped
                        if not ini.conn.proc.is_alive():
                            raise ini.conn.lost(f"a {op} of {batch} x {block} B") from e
                        raise
            elif nixl is not None and not why_not:
                why_not = nixl.up(ini.remote_addr)
                if why_not:
                    continue
                if nixl_verified is None:  # the first NIXL phase checks its bytes first
                    nixl_verified = nixl.verify(check)
                counts = [iterations(block * batch, args.iters) for _, block, batch in pts]
                for p, samples in nixl.measure(pts, counts).items():
                    reps["nixl"][p].append(samples)
                nixl.down()
            else:
                continue
            progress.close()
            print(f"  rep {r + 1}/{args.reps}: {name} done in {time.perf_counter() - t0:.1f} s", flush=True)
    progress.close()
    rows = []
    for op, block, batch in pts:
        nbytes = block * batch
        row: dict[str, Any] = {
            "op": op,
            "block": block,
            "batch": batch,
            "bytes": nbytes,
            "iters": iterations(nbytes, args.iters),
        }
        for name in ("mori", "nixl"):
            if reps[name][(op, block, batch)]:
                row[name] = summarize(nbytes, reps[name][(op, block, batch)])
        if "nixl" in row:
            row["ratio"] = row["mori"]["gbps"] / row["nixl"]["gbps"]
        rows.append(row)
    return rows, nixl_verified, why_not


_COLUMNS = ["op", "block", "batch", "mori GB/s", "min-max", "avg us", "p99 us", "post us"]
_WIDTHS = [5, 7, 5, 9, 13, 9, 9, 8, 11, 13, 9, 9, 8, 6]


def _print_header(baseline: str) -> None:
    print(bench.format_row([*_COLUMNS[:8], f"{baseline} GB/s", *_COLUMNS[4:8], "ratio"], _WIDTHS), flush=True)


def _cells(fig: dict[str, Any] | None) -> list[str]:
    if fig is None:
        return ["-", "-", "-", "-", "-"]
    return [
        _fmt(fig["gbps"]),
        f"{_fmt(fig['gbps_min'])}-{_fmt(fig['gbps_max'])}",
        _fmt(fig["avg_lat_us"], 1),
        _fmt(fig["p99_lat_us"], 1),
        _fmt(fig["avg_post_us"], 1),
    ]


def _row_cells(row: dict[str, Any], baseline_key: str) -> list[str]:
    base = row.get(baseline_key)
    ratio = f"{row['ratio']:.2f}" if "ratio" in row else "-"
    return [
        row["op"],
        bench.human_bytes(row["block"]),
        str(row["batch"]),
        *_cells(row["mori"]),
        *_cells(base),
        ratio,
    ]


def _print_row(row: dict[str, Any], baseline_key: str = "nixl") -> None:
    print(bench.format_row(_row_cells(row, baseline_key), _WIDTHS), flush=True)


def markdown_table(rows: Sequence[dict[str, Any]], baseline: str, baseline_key: str) -> str:
    """The result rows as a Markdown table (for docs/benchmarks/io.md)."""
    head = [
        "op",
        "block",
        "batch",
        "mori GB/s",
        "min-max",
        "avg lat us",
        "p99 lat us",
        "post us",
        f"{baseline} GB/s",
        "min-max",
        "avg lat us",
        "p99 lat us",
        "post us",
        f"mori/{baseline}",
    ]
    return bench.markdown_table(head, [_row_cells(row, baseline_key) for row in rows])


def run_cpu(args: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    if args.netns != "on":
        return _run_cpu(args, None)
    import secrets

    specs, janitor = make_namespaces()
    try:
        os.environ["MORI_IO_AUTH_TOKEN"] = secrets.token_hex(16)  # the engines listen on the veth
        # this process (and NIXL's initiator, spawned from it); the target: specs[1]
        enter_namespace(specs[0])
        args.tcp_cma = "off"  # cross-memory attach would go around the veth
        args.ucx_tls = "tcp"
        return _run_cpu(args, specs)
    finally:
        janitor.stdin.close()
        janitor.wait(30)


def _run_cpu(
    args: argparse.Namespace, netns: list[str] | None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    nbytes = args.max_bytes
    env: dict[str, str] = {"MORI_BENCH_IO_BACKEND": args.backend}  # the target's engine gets the same backend
    log_dir = tempfile.mkdtemp(prefix="mori-bench-io-ucx-")
    if args.ucx_tls:
        env["UCX_TLS"] = args.ucx_tls
    if "UCX_LOG_LEVEL" not in os.environ:  # UCX writes the transports it picks at level info
        env["UCX_LOG_LEVEL"] = "info"
        env["UCX_LOG_FILE"] = os.path.join(log_dir, "ucx.%p.log")
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    target_env = {**env, "MORI_BENCH_IO_NETNS": netns[1]} if netns else env
    proc = ctx.Process(
        target=_target,
        args=(child, nbytes, args.tcp_cma == "on", args.nixl == "on", target_env, args.buffers),
    )
    proc.start()
    parent = Peer("target", conn, proc, args.timeout)
    nixl: NixlBaseline | None = None
    failed = True
    try:
        hello = parent.recv("its first message (ready)")
        ini = _CpuInitiator(args, parent, hello, nbytes)
        why_not = str(hello["nixl_error"])
        if not why_not:
            nixl = NixlBaseline(ctx, parent, nbytes, env, args.nixl_initiator_thread == "on", args.buffers)
        huge = {"target": hello["huge"], "mori initiator": huge_fraction(ini.buf)}
        if nixl is not None:
            huge["nixl initiator"] = nixl.huge
        check = min(4 * MiB, nbytes // 2)
        verified: dict[str, bool] = {"mori": ini.verify(check)}
        where = (
            f"across 2 network namespaces joined by a veth pair ({netns[0].split(',')[2]} -> {netns[1].split(',')[2]}, "
            "UCX on TCP over the veth only, no cross-memory attach)"
            if netns
            else "on loopback"
        )
        sent0 = [veth_bytes(s) for s in netns] if netns else []
        print(
            f"mori bench io --device cpu: 2 processes {where}, mode {args.mode}, route {ini.route()!r}, "
            f"{args.reps} reps, buffers {bench.human_bytes(nbytes)} on "
            + ("4 KiB pages (--buffers pages)" if args.buffers == "pages" else "huge pages (--buffers huge)")
            + ", share on huge pages now: "
            + ", ".join(f"{k} {v:.0%}" for k, v in huge.items())
        )
        print("engines " + _manners())
        print(
            "phases: every point with mori, then every point with NIXL (its agents alive only then), "
            "order reversed each rep"
        )
        rows, nixl_ok, why = _measure_cpu(args, ini, nixl, check)
        why_not = why_not or why
        measured = any("nixl" in r for r in rows)
        if measured and nixl_ok is not None:
            verified["nixl"] = nixl_ok
        else:
            print(f"NIXL baseline: unavailable ({why_not})")
        print(
            "GB/s = block x batch x iters / sum of latencies, median of reps (1 GB = 1e9 B); ratio = mori/NIXL"
        )
        print(f"verified byte-exact ({bench.human_bytes(check)} write + read back): {verified}")
        _print_header("NIXL")
        for row in rows:
            _print_row(row)
        route = ini.route()
        veth = [veth_bytes(s) - b for s, b in zip(netns, sent0, strict=True)] if netns else []
        if netns:
            print(
                f"bytes sent over the veth during the run: initiators' end {veth[0]}, target's end {veth[1]}"
            )
        ini.engine.shutdown()
        if nixl is not None:
            nixl.stop()
        parent.ask("stop")
        failed = False
    finally:
        for p in (parent, nixl.peer if nixl is not None else None):
            if p is not None:
                p.stop(failed)
    transports = ucx_transports(log_dir)
    info = {
        "route": route,
        "netns": (
            {"initiators": netns[0], "target": netns[1], "veth_tx_bytes": veth} if netns else "off (loopback)"
        ),
        "mode": args.mode,
        "tcp_cma": args.tcp_cma,
        "backend": args.backend,
        "buffers": args.buffers,
        "huge_page_share": huge,
        "engine_tuning": _manners(),
        "verified": verified,
        "nixl": "measured" if measured else f"unavailable: {why_not}",
        "nixl_agents": "created per NIXL phase, initiator in a process of its own; target with NIXL's progress "
        "thread, initiator " + ("with one" if args.nixl_initiator_thread == "on" else "without (it polls)"),
        "nixl_version": bench.version("nixl"),
        "ucx_tls": args.ucx_tls or os.environ.get("UCX_TLS") or "unset (UCX default)",
        "ucx_transports": transports,
    }
    if measured:
        print(f"NIXL UCX_TLS={info['ucx_tls']}; UCX endpoint lanes: {'; '.join(transports) or 'not logged'}")
    return info, rows


def _manners() -> str:
    """Whether the engines run at the library's defaults: which of mori-io's opt-in tunings of the
    host process, and which overrides of the TCP backend's settings, are set."""
    from mori.io import env

    tuned = (
        env.MORI_IO_THP,
        env.MORI_IO_SHORT_SLICE,
        env.MORI_IO_MOVE_COPY_THREADS,
        env.MORI_IO_CMA_THREADS,
        env.MORI_IO_CMA_SPLIT_BYTES,
        env.MORI_IO_CHUNK_BYTES,
        env.MORI_IO_TCP_CONNS_PER_PEER,
        env.MORI_IO_TCP_CMA,
    )
    on = [v.name for v in tuned if v.raw()]
    return (
        "NOT at the library's defaults: " + ", ".join(f"{n}={os.environ[n]}" for n in on)
        if on
        else "at the library's defaults: no opt-in tuning set"
    )


# -- GPU -------------------------------------------------------------------------------------------------


def _gpu_target(conn: Any, nbytes: int) -> None:
    import torch

    from mori.io import BackendType, EngineDesc, IOEngine, IOEngineConfig, XgmiBackendConfig

    torch.cuda.set_device(1)
    buf = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:1")
    engine = IOEngine("bench-gpu-target", IOEngineConfig("127.0.0.1", 0))
    engine.create_backend(BackendType.XGMI, XgmiBackendConfig())
    desc = engine.register_torch_tensor(buf)
    torch.cuda.synchronize()
    conn.send({"engine": engine.get_engine_desc().pack(), "mem": desc.pack()})
    try:
        while conn.poll(TARGET_TIMEOUT_S):
            msg = conn.recv()
            if msg[0] == "peer":
                engine.register_remote_engine(EngineDesc.unpack(msg[1]))
                conn.send("ok")
            elif msg[0] == "digest":
                _, off, n = msg
                torch.cuda.synchronize()
                conn.send(digest(buf[off : off + n].cpu().numpy()))
            elif msg[0] == "stop":
                break
    finally:
        engine.shutdown()
        conn.send("bye")


def run_gpu(args: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    import torch

    from mori.io import BackendType, EngineDesc, IOEngine, IOEngineConfig, MemoryDesc, XgmiBackendConfig

    if torch.cuda.device_count() < 2:
        raise SystemExit(
            f"mori bench io --device cuda: needs 2 GPUs, {torch.cuda.device_count()} visible "
            "(torch.cuda.device_count())"
        )
    nbytes = args.max_bytes
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_gpu_target, args=(child, nbytes))
    proc.start()
    parent = Peer("target", conn, proc, max(args.timeout, 300.0))  # CUDA start-up is slower
    failed = True
    try:
        hello = parent.recv("its first message (ready)")
        torch.cuda.set_device(0)
        dev0, dev1 = torch.device("cuda", 0), torch.device("cuda", 1)
        buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev0)
        engine = IOEngine("bench-gpu-initiator", IOEngineConfig("127.0.0.1", 0))
        engine.create_backend(BackendType.XGMI, XgmiBackendConfig())
        local = engine.register_torch_tensor(buf)
        remote = MemoryDesc.unpack(hello["mem"])
        engine.register_remote_engine(EngineDesc.unpack(hello["engine"]))
        parent.ask("peer", engine.get_engine_desc().pack())
        route = str(engine._route_name(local, remote))
        sess = engine.create_session(local, remote)
        if sess is None:
            raise SystemExit(f"mori bench io --device cuda: create_session returned None (route {route!r})")
        # byte-exact check: write [0, n), read it back into [n, 2n)
        n = min(4 * MiB, nbytes // 2)
        st = engine.write(local, 0, remote, 0, n, engine.allocate_transfer_uid())
        _CpuInitiator.mori_wait(st)
        wrote = parent.ask("digest", 0, n) == digest(buf[:n].cpu().numpy())
        st = engine.read(local, n, remote, 0, n, engine.allocate_transfer_uid())
        _CpuInitiator.mori_wait(st)
        torch.cuda.synchronize()
        verified = bool(wrote and bool((buf[n : 2 * n] == buf[:n]).all().item()))
        # the baseline's own buffers: cuda:0 and cuda:1 in this process
        base0 = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev0)
        base1 = torch.empty(nbytes, dtype=torch.uint8, device=dev1)

        def sync_both(_: Any = None) -> None:
            torch.cuda.synchronize(dev0)
            torch.cuda.synchronize(dev1)

        print(
            f"mori bench io --device cuda: {torch.cuda.get_device_name(dev0)} x2, route {route!r}, "
            f"mode {args.mode}, {args.reps} reps"
        )
        print(
            "baseline (raw copy-engine peer copy) = dst.copy_(src) cuda:0 -> cuda:1 (read: cuda:1 -> cuda:0)"
        )
        print(
            "GB/s: iters transfers posted back to back, then all waited for (median of reps); "
            "latencies and post: stop-and-wait"
        )
        _print_header("copy_")
        rows = []
        batches = args.batches or [1]
        pts = points(args.ops, args.blocks, batches, nbytes)
        progress = bench.Progress("mori bench io", len(pts))
        for op, block, batch in pts:
            progress.step(f"{op} {batch} x {bench.human_bytes(block)}")
            iters = iterations(block * batch, args.iters)
            offs = [i * block for i in range(batch)]
            mori_post = session_post(sess, engine.allocate_transfer_uid, op, offs, [block] * batch)
            src, dst = (base0, base1) if op == "write" else (base1, base0)

            def copy_post(src: Any = src, dst: Any = dst, block: int = block, batch: int = batch) -> None:
                for i in range(batch):
                    dst[i * block : (i + 1) * block].copy_(src[i * block : (i + 1) * block])

            runners: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {
                "mori": (mori_post, _CpuInitiator.mori_wait),
                "copy": (copy_post, sync_both),
            }
            reps: dict[str, list[tuple[list[float], list[float]]]] = {k: [] for k in runners}
            piped: dict[str, list[float]] = {k: [] for k in runners}
            for post, wait in runners.values():
                time_transfers(post, wait, max(2, iters // 10))
            for r in range(args.reps):
                for name in ("mori", "copy") if r % 2 == 0 else ("copy", "mori"):
                    post, wait = runners[name]
                    reps[name].append(time_transfers(post, wait, iters))
                    # copy_: one synchronize of both GPUs covers every copy before it
                    piped[name].append(time_pipelined(post, wait, iters, wait_each=name == "mori"))
            row: dict[str, Any] = {
                "op": op,
                "block": block,
                "batch": batch,
                "bytes": block * batch,
                "iters": iters,
            }
            for name in runners:
                row[name] = with_stream_figures(
                    summarize(block * batch, reps[name]), block * batch, iters, piped[name]
                )
            row["ratio"] = row["mori"]["gbps"] / row["copy"]["gbps"]
            rows.append(row)
            progress.close()
            _print_row(row, "copy")
        # the batch-latency figure: 128 blocks of 16 KiB, strided (every other block), so nothing merges
        lat_rows = []
        stride = 2 * GPU_BATCH_BLOCK
        if GPU_BATCH * stride <= nbytes:
            offs = [i * stride for i in range(GPU_BATCH)]
            sizes = [GPU_BATCH_BLOCK] * GPU_BATCH
            for op in args.ops:
                src, dst = (base0, base1) if op == "write" else (base1, base0)

                def batch_copy(src: Any = src, dst: Any = dst) -> None:
                    for o in offs:
                        dst[o : o + GPU_BATCH_BLOCK].copy_(src[o : o + GPU_BATCH_BLOCK])

                post = session_post(sess, engine.allocate_transfer_uid, op, offs, sizes)
                xgmi_backend: Any = engine._backends[BackendType.XGMI]
                figures: dict[str, Any] = {}
                # the backend as configured (scatter-gather kernel at its threshold), then one copy per block
                for label, threshold in (("mori", xgmi_backend.threshold), ("mori_copies", 0)):
                    saved, xgmi_backend.threshold = xgmi_backend.threshold, threshold
                    try:
                        time_transfers(post, _CpuInitiator.mori_wait, 20)
                        figures[label] = [
                            time_transfers(post, _CpuInitiator.mori_wait, 200) for _ in range(args.reps)
                        ]
                    finally:
                        xgmi_backend.threshold = saved
                time_transfers(batch_copy, sync_both, 5)
                figures["copy"] = [time_transfers(batch_copy, sync_both, 50) for _ in range(args.reps)]
                m, mc, c = (
                    summarize(GPU_BATCH * GPU_BATCH_BLOCK, figures[k])
                    for k in ("mori", "mori_copies", "copy")
                )
                lat_rows.append(
                    {
                        "op": op,
                        "latency": f"batch_{GPU_BATCH}x16KiB_strided",
                        "scatter_gather_threshold": xgmi_backend.threshold,
                        "mori": m,
                        "mori_copy_per_block": mc,
                        "copy": c,
                    }
                )
                print(
                    f"{op} batch {GPU_BATCH} x 16 KiB (strided): mori median {m['median_lat_us']:.1f} us "
                    f"(avg {m['avg_lat_us']:.1f}, p99 {m['p99_lat_us']:.1f}, post {m['avg_post_us']:.1f}); "
                    f"mori with one copy per block {mc['median_lat_us']:.1f} us; "
                    f"{GPU_BATCH} x copy_ median {c['median_lat_us']:.1f} us"
                )
        parent.ask("stop")
        engine.shutdown()
        failed = False
    finally:
        parent.stop(failed)
    info = {"route": route, "mode": args.mode, "verified": verified, "gpu": torch.cuda.get_device_name(0)}
    print(f"verified byte-exact ({bench.human_bytes(n)} write + read back): {verified}")
    return info, rows + lat_rows


# -- entry -----------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    if args.reps < 1 or args.iters < 0:
        raise SystemExit("mori bench io: --reps must be >= 1 and --iters >= 0")
    args.blocks = args.blocks or DEFAULT_BLOCKS
    args.json = bench.json_path(
        args.json, f"io-cpu-{args.buffers}" if args.device == "cpu" else f"io-{args.device}"
    )
    if args.device == "cpu":
        args.batches = args.batches or DEFAULT_BATCHES
        info, rows = run_cpu(args)
        baseline, key = "NIXL", "nixl"
    else:
        info, rows = run_gpu(args)
        baseline, key = "copy_", "copy"
    config = {
        "device": args.device,
        "ops": args.ops,
        "blocks": sorted(set(args.blocks)),
        "batches": sorted(set(args.batches or [1])),
        "max_bytes": args.max_bytes,
        "reps": args.reps,
        "iters": args.iters or f"auto ({BYTES_PER_REP} bytes per rep, {MIN_ITERS}-{MAX_ITERS})",
        **info,
    }
    path = bench.write_json(args.json, "io", config, rows)
    print(f"wrote {path}")
    table_rows = [r for r in rows if "block" in r]
    plot(bench.plot_path(args.plot, path), table_rows, baseline, key)
    return (
        0
        if all(info["verified"].values() if isinstance(info["verified"], dict) else [info["verified"]])
        else 1
    )


def plot(path: Path | None, rows: Sequence[dict[str, Any]], baseline: str, key: str) -> bool:
    """GB/s against block size, one line per (framework, op, batch), drawn to ``path`` (``None``: no
    plot); False without a path or (with a message) without matplotlib."""

    def draw(plt: Any) -> Any:
        ops = sorted({r["op"] for r in rows}, reverse=True)  # write, read
        batches = sorted({r["batch"] for r in rows})
        fig, axes = plt.subplots(1, max(1, len(ops)), figsize=(6.5 * max(1, len(ops)), 5), squeeze=False)
        for ax, op in zip(axes[0], ops, strict=False):
            for i, batch in enumerate(batches):
                sel = [r for r in rows if r["op"] == op and r["batch"] == batch]
                if not sel:
                    continue
                color = f"C{i}"
                x = [r["block"] for r in sel]
                ax.plot(x, [r["mori"]["gbps"] for r in sel], "-o", color=color, label=f"mori, batch {batch}")
                if all(key in r for r in sel):
                    ax.plot(
                        x,
                        [r[key]["gbps"] for r in sel],
                        "--x",
                        color=color,
                        label=f"{baseline}, batch {batch}",
                    )
            ax.set_xscale("log", base=2)
            ax.set_xlabel("block bytes")
            ax.set_ylabel("GB/s (median of reps)")
            ax.set_title(f"{op.upper()}: mori.io (solid) vs {baseline} (dashed)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        return fig

    return bench.draw_plot(path, draw, dpi=110)

"""MoE dispatch/combine latency and bandwidth (DeepSeek-V3 shape) against torch all_to_all_single.

``mori bench ep`` runs :class:`~mori.ep.EpDispatchCombineOp` on ``--ranks`` local ranks and, in the
same run on the same inputs, the dispatch/combine a user would write without MORI:

* **baseline dispatch** (:func:`mori.ep.bench_a2a.a2a_dispatch`): per destination rank, the tokens with at least one
  expert there (the same once-per-destination-rank rule as MORI); ``all_to_all_single`` of the
  split sizes, then ``all_to_all_single`` of the token rows and of one packed row of metadata
  (K weights, K expert ids, scales) with those splits. The counts exchange and the host sync that
  reading the split sizes needs are part of its time.
* **baseline combine** (:func:`mori.ep.bench_a2a.a2a_combine`): the reverse ``all_to_all_single`` of the expert
  outputs, then an fp32 ``index_add_`` over each token's destination ranks at the source.

NCCL on GPUs (``--device cuda``), gloo on CPU ranks (``--device cpu``). Both combines move the token
rows only (MORI's is called with ``weights=None``). ``--sms`` is the ``block_num`` given to MORI's
dispatch and combine; NCCL keeps its own defaults (``NCCL_MAX_CTAS`` and the like apply).

Shapes: hidden 7168, top-8 of 256 experts, ``--tokens`` per rank (GPU default 4096 for throughput
and 128 for latency; CPU default smaller). Routing: every token picks ``--topk`` distinct experts
uniformly at random (seeded per rank). Dispatch dtypes: ``bf16``, and ``fp8`` = float8_e4m3fn with
per-token scales of ``hidden / 128`` fp32 (one per 128 channels, DeepEP's fp8 format); combine is
bf16 in both cases (the expert outputs are the dequantised received rows: identity experts, so the
combined result is checked against ``x * U`` where ``U`` = the token's distinct destination ranks).

Timing. GPU: dispatch alone and combine alone are each captured in a CUDA graph of ``--reps`` calls;
one measurement = one graph replay between two CUDA events, started right after a device barrier
(``shmem_barrier_on_stream``) so the ranks start together; time per call = elapsed / reps. If the
capture fails on any rank, every rank times eager calls instead and the output says so. The
baseline dispatch reads its split sizes on the host, so it cannot be captured: it is timed eagerly
with events around ``--reps`` calls (its host syncs included); the baseline combine and the
baseline dispatch with known splits ("cached") are captured when NCCL allows it. CPU: wall clock
(``time.perf_counter``) around ``--reps`` host-blocking calls after a barrier; each rank runs torch
with ``cores / ranks`` threads (at least one). Every rank measures; a sample is the slowest rank's
time, and the latency is the median of the samples with p10-p90.

Bandwidth, per rank, then the mean over ranks (GB = 1e9 bytes), by two formulas:

* **original MORI formula** (``tests/python/ops/bench_dispatch_combine.py``): ``total_recv * hidden
  * element size / time``, ``total_recv`` = rows this rank received (one per source token with at
  least one expert here, its own tokens included); element size of the phase's token dtype (fp8: 1
  byte, scales not counted; combine: bf16, 2 bytes).
* **DeepEP logical formula** (DeepEP ``tests/test_intranode.py``): the bytes a rank receives,
  local tokens included: the number of (token, destination rank) pairs it receives times ``hidden
  * 2`` for bf16, or ``hidden + scale_dim * 4`` for fp8 with its scales; combine counts the same
  bytes as its dispatch, in bf16.

With bf16 the two agree; they differ for fp8 dispatch (scales). The original's low-latency
rescaling (``M * K / total_recv``) is given as ``original_ll_scale`` in the JSON record.
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mori.core import bench
from mori.core.bench import gbps
from mori.core.errors import bad_value
from mori.ep.bench_a2a import a2a_combine, a2a_dispatch

if TYPE_CHECKING:
    import torch

__all__ = [
    "add_arguments",
    "bytes_deepep",
    "bytes_original",
    "dequantise_fp8",
    "gbps",
    "quantise_fp8",
    "random_routing",
    "recv_rows",
    "run",
]

SUITE = "mori bench ep"
#: DeepSeek-V3 MoE layer
HIDDEN, TOPK, EXPERTS = 7168, 8, 256
#: tokens per rank: throughput and latency shapes
DEFAULT_TOKENS = {"cuda": [4096, 128], "cpu": [512, 128]}
DEFAULT_ITERS = {"cuda": 50, "cpu": 10}
DEFAULT_WARMUP = {"cuda": 5, "cpu": 1}
DEFAULT_REPS = {"cuda": 10, "cpu": 1}
#: with --trace: untraced and traced samples taken in turn, TRACE_ROUNDS x --iters of each
TRACE_ROUNDS = 4
#: channels per fp8 scale (DeepEP's per-token, per-128-channel format)
FP8_BLOCK = 128
FP8_MAX = 448.0
DTYPES = ("bf16", "fp8")
KERNEL_TYPES = ("IntraNode", "IntraNodeLL", "AsyncLL", "InterNode", "InterNodeV1", "InterNodeV1LL")
#: kernel types whose ranks may sit on several (emulated) nodes
INTER_NODE_TYPES = ("InterNode", "InterNodeV1", "InterNodeV1LL")
#: combine tolerance against x * U (bf16 output of an fp32 sum of at most world equal bf16 rows)
RTOL, ATOL = 2e-2, 2e-2
#: combine check tolerance (relative and absolute) when rows cross as fp8 (--combine-quant)
FP8_WIRE_TOL = 1e-1


# -- the ``mori bench ep`` suite (registered by :mod:`mori.ep.cli`) --------------------------------------


#: ``--dtype``: mori.core.bench's list parser with this suite's dtypes
_dtype_list = functools.partial(bench.name_list, allowed=DTYPES)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cpu: ranks are local processes on the cpu runtime, baseline on gloo; cuda: one process per "
        "GPU (rank r on GPU r %% count), mori.shmem on its GPU runtime (MORI_DEVICE_RUNTIME, default auto), "
        "baseline on NCCL (RCCL on ROCm)",
    )
    p.add_argument("--ranks", type=int, default=2, help="expert-parallel ranks (default 2)")
    p.add_argument(
        "--tokens",
        type=bench.int_list,
        default=None,
        help="comma-separated tokens per rank (default cuda 4096,128; cpu 512,128)",
    )
    p.add_argument("--hidden", type=int, default=HIDDEN, help=f"hidden size (default {HIDDEN})")
    p.add_argument("--experts", type=int, default=EXPERTS, help=f"experts in total (default {EXPERTS})")
    p.add_argument("--topk", type=int, default=TOPK, help=f"experts per token (default {TOPK})")
    p.add_argument(
        "--dtype",
        type=_dtype_list,
        default=list(DTYPES),
        help="dispatch dtypes, comma-separated: bf16, fp8 (e4m3fn + hidden/128 fp32 scales per token); "
        "combine is bf16 (default bf16,fp8)",
    )
    p.add_argument(
        "--sms",
        type=bench.int_list,
        default=[-1],
        help="comma-separated block_num values given to dispatch and combine (one block per SM), so "
        "results compare at equal SM budgets; -1 = the op's default (default -1)",
    )
    p.add_argument(
        "--warps", type=int, default=-1, help="warp_per_block given to dispatch and combine (-1 = the op's)"
    )
    p.add_argument(
        "--kernel-type",
        choices=KERNEL_TYPES,
        default=None,
        help="(default IntraNode on one node, InterNodeV1 with --nodes > 1)",
    )
    p.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="emulated nodes (cpu only): rank r gets MORI_NODE_ID node<r // (ranks / nodes)>, so ranks of "
        "different nodes reach each other only through the network transport (MORI_SHMEM_TRANSPORT: tcp, "
        "or ucx when installed); needs an inter-node --kernel-type; default 1",
    )
    p.add_argument(
        "--combine-quant",
        choices=["none", "fp8_direct_cast", "fp8_blockwise"],
        default="none",
        help="combine wire format (the config's quant_type; fp8 rows cross to other ranks, checked "
        "with a 10%% tolerance); default none",
    )
    p.add_argument(
        "--zero-copy",
        action="store_true",
        help="combine from the registered input buffer (use_external_inp_buf=False: the experts write "
        "their outputs there); default: combine an ordinary tensor",
    )
    p.add_argument(
        "--iters", type=int, default=None, help="measurements per figure (default cuda 50, cpu 10)"
    )
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed measurements first (default cuda 5, cpu 1)"
    )
    p.add_argument(
        "--reps",
        type=int,
        default=None,
        help="calls per measurement (in one CUDA graph on GPU; default cuda 10, cpu 1)",
    )
    p.add_argument("--seed", type=int, default=123, help="routing and token seed (default 123)")
    p.add_argument("--no-baseline", action="store_true", help="skip the all_to_all_single baseline")
    bench.output_arguments(p, "ep-DEVICE")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before the ranks are killed")
    p.add_argument(
        "--trace",
        default=None,
        metavar="DIR",
        help="also time dispatch and combine with tracing compiled in and on (mori.viz), alternating "
        f"sample by sample with the untraced kernels ({TRACE_ROUNDS} x --iters samples of each), and write each "
        "rank's trace to DIR/<tokens>-<dtype>/ (GPU kernels only)",
    )


def _check_args(args: argparse.Namespace) -> None:
    """Fill the device defaults and reject what cannot run, naming the option."""
    dev = args.device
    args.tokens = args.tokens if args.tokens is not None else list(DEFAULT_TOKENS[dev])
    args.iters = args.iters if args.iters is not None else DEFAULT_ITERS[dev]
    args.warmup = args.warmup if args.warmup is not None else DEFAULT_WARMUP[dev]
    args.reps = args.reps if args.reps is not None else DEFAULT_REPS[dev]
    args.json = bench.json_path(args.json, f"ep-{dev}")

    def positive(name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad_value(SUITE, name, value, "an int >= 1")

    positive("--ranks", args.ranks)
    positive("--nodes", args.nodes)
    if args.kernel_type is None:
        args.kernel_type = "InterNodeV1" if args.nodes > 1 else "IntraNode"
    if args.ranks % args.nodes:
        raise bad_value(SUITE, "--nodes", args.nodes, f"a divisor of --ranks = {args.ranks}")
    if args.nodes > 1 and args.kernel_type not in INTER_NODE_TYPES:
        raise bad_value(
            SUITE, "--kernel-type", args.kernel_type, f"one of {', '.join(INTER_NODE_TYPES)} with --nodes > 1"
        )
    if args.nodes > 1 and dev != "cpu":
        raise bad_value(
            SUITE,
            "--nodes",
            args.nodes,
            "1 with --device cuda (the bench runs the inter-node kernel types on the cpu runtime only)",
        )
    positive("--hidden", args.hidden)
    positive("--experts", args.experts)
    positive("--iters", args.iters)
    positive("--reps", args.reps)
    if args.warmup < 0:
        raise bad_value(SUITE, "--warmup", args.warmup, "an int >= 0")
    if not args.tokens or min(args.tokens) < 1:
        raise bad_value(SUITE, "--tokens", args.tokens, "one or more token counts >= 1")
    from mori.ep.config import MAX_EXPERTS_PER_TOKEN

    if not 1 <= args.topk <= min(MAX_EXPERTS_PER_TOKEN, args.experts):
        raise bad_value(
            SUITE, "--topk", args.topk, f"an int in [1, {min(MAX_EXPERTS_PER_TOKEN, args.experts)}]"
        )
    if args.experts % args.ranks:
        raise bad_value(SUITE, "--experts", args.experts, f"a multiple of --ranks = {args.ranks}")
    if "fp8" in args.dtype and args.hidden % FP8_BLOCK:
        raise bad_value(
            SUITE, "--hidden", args.hidden, f"a multiple of {FP8_BLOCK} with --dtype fp8 (one scale per 128)"
        )
    if not args.sms or any(s == 0 or s < -1 for s in args.sms):
        raise bad_value(SUITE, "--sms", args.sms, "block counts >= 1, or -1 for the op's default")
    if args.warps == 0 or args.warps < -1:
        raise bad_value(SUITE, "--warps", args.warps, "an int >= 1, or -1 for the op's default")
    if args.timeout <= 0:
        raise bad_value(SUITE, "--timeout", args.timeout, "seconds > 0")
    if args.trace and dev != "cuda":
        raise bad_value(
            SUITE, "--trace", args.trace, "a directory with --device cuda (only the kernels record)"
        )


#: the options the ranks need (the rest stays in this process)
_SPEC_KEYS: tuple[str, ...] = ("device", "ranks", "tokens", "hidden", "experts", "topk", "dtype", "sms")
_SPEC_KEYS += (
    "warps",
    "kernel_type",
    "nodes",
    "iters",
    "warmup",
    "reps",
    "seed",
    "zero_copy",
    "combine_quant",
    "trace",
)


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    spec = {k: getattr(args, k) for k in _SPEC_KEYS}
    spec["baseline"] = not args.no_baseline
    spec["baseline_skipped"] = "--no-baseline" if args.no_baseline else ""
    if args.device == "cuda" and spec["baseline"]:
        import torch

        gpus = torch.cuda.device_count()
        if 0 < gpus < args.ranks:  # NCCL refuses two ranks of one communicator on one GPU
            spec["baseline"] = False
            spec["baseline_skipped"] = f"NCCL needs one GPU per rank; {args.ranks} ranks share {gpus} GPUs"
    spec["port"] = bench.free_port()
    results = _launch(spec, args.timeout)
    if spec["trace"]:
        _export_traces(spec)
    rows = _rows(spec, results)
    verified = _report(spec, results, rows)
    config = {**spec, "device_name": results[0]["device_name"], "torch": results[0]["torch"]}
    if spec["device"] == "cpu":
        config["torch_threads_per_rank"] = bench.cpu_threads(spec["ranks"])
    config.pop("port")
    path = bench.write_json(args.json, "ep", config, rows)
    print(f"wrote {path}")
    _plot(bench.plot_path(args.plot, path), rows, config)
    return 0 if verified else 1


def _trace_dir(spec: dict[str, Any], tokens: int, dtype: str) -> str:
    return os.path.join(spec["trace"], f"{tokens}-{dtype}")


def _export_traces(spec: dict[str, Any]) -> None:
    """One Perfetto trace of every rank per case, from the ranks' saved traces."""
    from mori import viz

    for tokens in spec["tokens"]:
        for dtype in spec["dtype"]:
            d = _trace_dir(spec, tokens, dtype)
            report = viz.export_to_perfetto(viz.load_traces(d), os.path.join(d, "trace.json"))
            print(f"trace: {report.summary()}")


# -- formulas -------------------------------------------------------------------------------------------


def bytes_original(rows: int, hidden: int, elem_size: int) -> int:
    """The original MORI formula's bytes: received rows * hidden * element size (no scales)."""
    return rows * hidden * elem_size


def bytes_deepep(rows: int, hidden: int, phase: str, dtype: str, scale_dim: int = 0) -> int:
    """DeepEP's logical bytes for ``rows`` (token, destination rank) pairs received.

    dispatch bf16: ``hidden * 2`` per row; dispatch fp8: ``hidden`` bytes plus ``scale_dim`` fp32
    scales per row (DeepEP counts ``bf16 bytes * (1 + 4 / 128) / 2``, the same with
    ``scale_dim = hidden / 128``); combine: the bytes of its dispatch in bf16, ``hidden * 2``.
    """
    if phase == "combine" or dtype == "bf16":
        return rows * hidden * 2
    if dtype == "fp8":
        return rows * (hidden + scale_dim * 4)
    raise bad_value("bytes_deepep", "dtype", dtype, "'bf16' or 'fp8'")


def recv_rows(indices: Sequence[torch.Tensor], num_experts_per_rank: int) -> list[int]:
    """Rows each rank receives: (token, destination rank) pairs over every source rank's routing.

    ``indices[s]`` is rank ``s``'s [N, K] expert ids (``-1`` = none); a token counts once per
    distinct destination rank, its own rank included.
    """
    from mori.ep.reference import dest_ranks

    world = len(indices)
    total = [0] * world
    for idx in indices:
        per = dest_ranks(idx.cpu(), num_experts_per_rank, world).sum(0).tolist()
        total = [a + int(b) for a, b in zip(total, per, strict=True)]
    return total


def random_routing(tokens: int, experts: int, topk: int, seed: int, rank: int) -> torch.Tensor:
    """int32 [tokens, topk]: ``topk`` distinct experts per token, uniform, seeded by (seed, rank)."""
    import torch

    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    return torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices.to(torch.int32)


def quantise_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, H] -> (float8_e4m3fn [N, H], float32 scales [N, H / 128]): one scale per 128 channels,
    ``amax / 448`` (DeepEP's ``per_token_cast_to_fp8``)."""
    import torch

    n, h = x.shape
    v = x.float().reshape(n, h // FP8_BLOCK, FP8_BLOCK)
    amax = v.abs().amax(dim=2).clamp(min=1e-4)
    q = (v * (FP8_MAX / amax)[:, :, None]).to(torch.float8_e4m3fn).reshape(n, h)
    return q, amax / FP8_MAX


def dequantise_fp8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantise_fp8`, to bf16."""
    import torch

    n, h = q.shape
    v = q.float().reshape(n, h // FP8_BLOCK, FP8_BLOCK) * scales[:, : h // FP8_BLOCK, None].float()
    return v.reshape(n, h).to(torch.bfloat16)


# -- ranks ---------------------------------------------------------------------------------------------


def _heap_bytes(spec: dict[str, Any]) -> int:
    """Symmetric heap per rank: every op of the run (one per tokens x dtype), with room to spare."""
    w, h, k = spec["ranks"], spec["hidden"], spec["topk"]
    per_row = h * 2 + (h // FP8_BLOCK) * 4 + 4 * k * 4 + 64
    rows = sum(w * t for t in spec["tokens"]) * len(spec["dtype"])
    return int(2 * 4 * rows * per_row + (256 << 20))


def _launch(spec: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    from mori.core.launch import shmem_ranks

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(spec["port"])}
    heap = os.environ.get("MORI_SHMEM_HEAP_SIZE") or str(_heap_bytes(spec))
    if spec["device"] == "cuda":
        env.update(bench.gpu_rank_env(SUITE))
        return shmem_ranks(
            _rank_main,
            spec["ranks"],
            spec,
            heap=heap,
            timeout=timeout,
            env=env,
            before_init=bench.gpu_per_rank,
        )
    env["MORI_DEVICE_RUNTIME"] = "cpu"
    split = functools.partial(_set_node, spec["ranks"] // spec["nodes"]) if spec["nodes"] > 1 else None
    return shmem_ranks(
        _rank_main, spec["ranks"], spec, heap=heap, timeout=timeout, env=env, before_init=split
    )


def _set_node(ranks_per_node: int, rank: int, nranks: int) -> None:
    """Emulated nodes: rank ``r`` is on node ``r // ranks_per_node``."""
    os.environ["MORI_NODE_ID"] = f"node{rank // ranks_per_node}"


def _rank_main(rank: int, nranks: int, spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    cuda = spec["device"] == "cuda"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    init = f"tcp://127.0.0.1:{spec['port']}"
    if cuda and spec["baseline"]:
        # NCCL for the baseline's GPU tensors, gloo for the timer's host-side agreement
        dist.init_process_group(
            "cpu:gloo,cuda:nccl", init_method=init, rank=rank, world_size=nranks, device_id=dev
        )
    elif cuda:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=nranks)
    else:
        # ranks share the cores: one share each, so torch's thread pools do not oversubscribe them
        torch.set_num_threads(bench.cpu_threads(nranks))
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=nranks)
    try:
        progress = bench.Progress("mori bench ep", len(spec["tokens"]) * len(spec["dtype"]))
        cases = []
        for t in spec["tokens"]:
            for d in spec["dtype"]:
                if rank == 0:
                    progress.step(f"{t} tokens, {d} dispatch")
                cases.append(_case(rank, nranks, spec, t, d, dev))
        progress.close()
        name = bench.device_name(dev)
        from mori.shmem.context import current

        network = current("mori bench ep").network
        transport = network.tp.name if network is not None else None
        return {"device_name": name, "torch": torch.__version__, "cases": cases, "transport": transport}
    finally:
        dist.destroy_process_group()


class _Timer:
    """Times ``fn`` on every rank the same way: CUDA graph or eager with events, or wall clock."""

    def __init__(self, spec: dict[str, Any], dev: torch.device) -> None:
        self.cuda = dev.type == "cuda"
        self.reps, self.iters, self.warmup = spec["reps"], spec["iters"], spec["warmup"]
        self.dev = dev

    def _barrier(self) -> None:
        import mori.shmem as shmem

        if self.cuda:
            shmem.shmem_barrier_on_stream()  # ranks leave together, on the device
        else:
            shmem.shmem_barrier_all()

    def __call__(self, fn: Callable[[], object], *, capture: bool, why_eager: str = "") -> dict[str, Any]:
        if not self.cuda:
            return self._wall(fn)
        import torch

        once, mode = bench.graph_or_eager(fn, self.reps, capture=capture, why_eager=why_eager)
        for _ in range(self.warmup):
            self._barrier()
            once()
        torch.cuda.synchronize()
        samples = []
        for _ in range(self.iters):
            self._barrier()
            samples.append(bench.time_cuda(once, self.reps))
        return {"samples": samples, "mode": mode}

    def interleaved(self, fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, dict[str, Any]]:
        """Times every one of ``fns`` (captured once each) ``rounds * iters`` times, one sample of
        each in turn, the order reversed every other turn (A B, B A, ...): a drift of the clocks or
        of another MPS client falls on all of them alike, and no one always goes first."""
        keys = list(fns)
        if not self.cuda:
            return {k: self._wall(fns[k]) for k in keys}
        import torch

        prepared = {k: bench.graph_or_eager(fns[k], self.reps, capture=True) for k in keys}
        for _ in range(self.warmup):
            for k in keys:
                self._barrier()
                prepared[k][0]()
        torch.cuda.synchronize()
        samples: dict[str, list[float]] = {k: [] for k in keys}
        for i in range(rounds * self.iters):
            for k in keys if i % 2 == 0 else reversed(keys):
                self._barrier()
                samples[k].append(bench.time_cuda(prepared[k][0], self.reps))
        return {k: {"samples": samples[k], "mode": prepared[k][1]} for k in keys}

    def _wall(self, fn: Callable[[], object]) -> dict[str, Any]:
        samples = bench.time_samples(
            fn, iters=self.iters, warmup=self.warmup, reps=self.reps, before=self._barrier
        )
        calls = "1 host-blocking call" if self.reps == 1 else f"{self.reps} host-blocking calls"
        return {"samples": samples, "mode": f"wall clock (perf_counter) around {calls}"}


def _rounds(spec: dict[str, Any]) -> int:
    """Timing rounds of each call: TRACE_ROUNDS with --trace (untraced and traced alternate), else 1."""
    return TRACE_ROUNDS if spec["trace"] else 1


def _traced(op: Any, buf: Any, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with ``op``'s tracing on into ``buf`` (a CUDA graph captured of it replays the traced
    kernels; eagerly, each call turns tracing on and off again on the host)."""

    def call() -> object:
        op.enable_tracing(buf)
        try:
            return fn()
        finally:
            op.disable_tracing()

    return call


def _case(
    rank: int, nranks: int, spec: dict[str, Any], tokens: int, dtype: str, dev: torch.device
) -> dict[str, Any]:
    """One (tokens, dispatch dtype): build the op, check it once, time it at every --sms, then the baseline."""
    import torch

    from mori.ep import EpDispatchCombineConfig, EpDispatchCombineKernelType, EpDispatchCombineOp
    from mori.ep.reference import dest_ranks

    hidden, experts, k, seed = spec["hidden"], spec["experts"], spec["topk"], spec["seed"]
    e_local = experts // nranks
    fp8 = dtype == "fp8"
    scale_dim = hidden // FP8_BLOCK if fp8 else 0
    all_idx = [random_routing(tokens, experts, k, seed, s) for s in range(nranks)]
    rows = recv_rows(all_idx, e_local)
    idx_cpu = all_idx[rank]
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    x_bf16 = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    weights = torch.rand(tokens, k, generator=gen).to(dev)
    if fp8:
        x_in, scales_cpu = quantise_fp8(x_bf16)
        x_ref = dequantise_fp8(x_in, scales_cpu)
        scales: torch.Tensor | None = scales_cpu.to(dev)
    else:
        x_in, x_ref, scales = x_bf16, x_bf16, None
    x_in, idx = x_in.to(dev), idx_cpu.to(dev)
    u = dest_ranks(idx_cpu, e_local, nranks).sum(1, dtype=torch.float32)
    expected = (x_ref.float() * u[:, None]).to(dev)

    kt = EpDispatchCombineKernelType[spec["kernel_type"]]
    cfg = EpDispatchCombineConfig(
        data_type=x_in.dtype,
        rank=rank,
        world_size=nranks,
        hidden_dim=hidden,
        scale_dim=scale_dim,
        scale_type_size=4 if fp8 else 0,
        max_token_type_size=2,
        max_num_inp_token_per_rank=tokens,
        num_experts_per_rank=e_local,
        num_experts_per_token=k,
        kernel_type=kt,
        gpu_per_node=nranks // spec.get("nodes", 1),
        use_external_inp_buf=not spec["zero_copy"],
        quant_type=spec["combine_quant"],
    )
    op = EpDispatchCombineOp(cfg)
    warps = spec["warps"]
    asynchronous = kt == EpDispatchCombineKernelType.AsyncLL

    def dispatch(sms: int) -> Any:
        out = op.dispatch(x_in, weights, scales, idx, block_num=sms, warp_per_block=warps)
        if asynchronous:
            op.dispatch_recv(block_num=sms, warp_per_block=warps)
        return out

    inter = kt.name in INTER_NODE_TYPES
    t0 = op.inter_node_traffic() if inter else None
    # one checked dispatch + combine; its received rows (dequantised) are the expert outputs
    out, _, out_scales, _, total = dispatch(spec["sms"][0])
    t1 = op.inter_node_traffic() if inter else None
    n_recv = int(total[0])
    comb_in = (dequantise_fp8(out, out_scales) if fp8 else out).to(torch.bfloat16).clone()
    comb_in[n_recv:] = 0
    if spec["zero_copy"]:  # the expert outputs live in the registered buffer
        registered = op.get_registered_combine_input_buffer(torch.bfloat16)
        registered[: comb_in.shape[0]] = comb_in
        comb_in = registered

    def combine(sms: int) -> Any:
        res = op.combine(comb_in, None, idx, block_num=sms, warp_per_block=warps)
        if asynchronous:
            op.combine_recv(block_num=sms, warp_per_block=warps)
        return res

    combined = combine(spec["sms"][0])[0][:tokens].float()
    traffic = None
    if inter:  # what this rank sent to other nodes in that one dispatch and one combine
        assert t0 is not None and t1 is not None
        t2 = op.inter_node_traffic()
        traffic = {
            "dispatch": {f: t1[f"dispatch_{f}"] - t0[f"dispatch_{f}"] for f in ("rows", "bytes")},
            "combine": {f: t2[f"combine_{f}"] - t1[f"combine_{f}"] for f in ("rows", "bytes")},
        }
        traffic["dispatch"]["messages"] = t1["messages"] - t0["messages"]
        traffic["combine"]["messages"] = t2["messages"] - t1["messages"]
    tol = RTOL if spec["combine_quant"] == "none" else FP8_WIRE_TOL
    ok = n_recv == rows[rank] and bool(torch.allclose(combined, expected, rtol=tol, atol=tol))
    timer = _Timer(spec, dev)
    ours = []
    trace_buf = None
    for sms in spec["sms"]:
        times: dict[str, Any] = {"sms": sms}
        if not spec["trace"]:
            times["dispatch"] = timer(functools.partial(dispatch, sms), capture=True)
            times["combine"] = timer(functools.partial(combine, sms), capture=True)
        else:
            # the untraced and the traced calls sample in turn (one CUDA graph each, the traced
            # one captured with tracing on): what differs between them is the tracing alone
            trace_buf = op.enable_tracing(trace_buf)
            op.disable_tracing()
            for phase, call in (("dispatch", dispatch), ("combine", combine)):
                plain = functools.partial(call, sms)
                times.update(
                    timer.interleaved(
                        {phase: plain, f"{phase}_traced": _traced(op, trace_buf, plain)}, TRACE_ROUNDS
                    )
                )
        ours.append(times)
    if trace_buf is not None:
        from mori import viz

        viz.capture([trace_buf], host=False).save(
            os.path.join(_trace_dir(spec, tokens, dtype), f"rank{rank}")
        )
    result: dict[str, Any] = {
        "tokens": tokens,
        "dtype": dtype,
        "scale_dim": scale_dim,
        "recv_rows": n_recv,
        "verified": ok,
        "ours": ours,
        "inter_node": traffic,
    }
    if spec["baseline"]:
        result["baseline"] = _baseline(
            timer, x_in, weights, scales, idx, e_local, tokens, expected, rows[rank]
        )
    return result


def _baseline(
    timer: _Timer,
    x: torch.Tensor,
    weights: torch.Tensor,
    scales: torch.Tensor | None,
    idx: torch.Tensor,
    e_local: int,
    tokens: int,
    expected: torch.Tensor,
    rows: int,
) -> dict[str, Any]:
    """Check the all_to_all_single baseline once (same inputs, same expected result), then time it."""
    import torch

    layout, rx, _, _, rs = a2a_dispatch(x, weights, scales, idx, e_local)
    y = (dequantise_fp8(rx, rs) if rs is not None else rx).to(torch.bfloat16).contiguous()
    combined = a2a_combine(y, layout, tokens).float()
    ok = rx.shape[0] == rows and bool(torch.allclose(combined, expected, rtol=RTOL, atol=ATOL))
    host_sync = "split sizes read on the host: not capturable"
    return {
        "verified": ok,
        "recv_rows": int(rx.shape[0]),
        "dispatch": timer(
            lambda: a2a_dispatch(x, weights, scales, idx, e_local), capture=False, why_eager=host_sync
        ),
        "dispatch_cached": timer(
            lambda: a2a_dispatch(x, weights, scales, idx, e_local, layout=layout), capture=True
        ),
        "combine": timer(lambda: a2a_combine(y, layout, tokens), capture=True),
    }


# -- results ----------------------------------------------------------------------------------------------


def _lat(samples: Sequence[float]) -> dict[str, Any]:
    """Median, p10, p90, min, max (us) and n of per-call samples in seconds."""
    return bench.Stats.of(samples).us()


def _rows(spec: dict[str, Any], results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (phase, tokens, dtype, sms): latency, both bandwidths, baseline, ratio."""
    import statistics

    out = []
    hidden, k = spec["hidden"], spec["topk"]
    base_name = "nccl" if spec["device"] == "cuda" else "gloo"
    for ci, case in enumerate(results[0]["cases"]):
        per_rank = [r["cases"][ci] for r in results]
        tokens, dtype, scale_dim = case["tokens"], case["dtype"], case["scale_dim"]
        rows = [c["recv_rows"] for c in per_rank]
        verified = all(c["verified"] for c in per_rank)
        base = [c.get("baseline") for c in per_rank]
        for si, sms in enumerate(spec["sms"]):
            for phase in ("dispatch", "combine"):
                elem = 1 if (phase == "dispatch" and dtype == "fp8") else 2
                meas = [c["ours"][si][phase] for c in per_rank]
                samples = bench.slowest([m["samples"] for m in meas])
                medians = [statistics.median(m["samples"]) for m in meas]
                b_orig = [bytes_original(r, hidden, elem) for r in rows]
                b_dpe = [bytes_deepep(r, hidden, phase, dtype, scale_dim) for r in rows]
                g_orig = [gbps(b, t) for b, t in zip(b_orig, medians, strict=True)]
                g_dpe = [gbps(b, t) for b, t in zip(b_dpe, medians, strict=True)]
                row: dict[str, Any] = {
                    "phase": phase,
                    "tokens": tokens,
                    "dispatch_dtype": dtype,
                    "dtype": dtype if phase == "dispatch" else "bf16",
                    "sms": sms,
                    "warps": spec["warps"],
                    "kernel_type": spec["kernel_type"],
                    "ranks": spec["ranks"],
                    "nodes": spec.get("nodes", 1),
                    "timing": meas[0]["mode"],
                    "latency_us": _lat(samples),
                    "recv_rows_per_rank": rows,
                    "bytes_original_per_rank": b_orig,
                    "bytes_deepep_per_rank": b_dpe,
                    "gbps_original": sum(g_orig) / len(g_orig),
                    "gbps_deepep": sum(g_dpe) / len(g_dpe),
                    "gbps_original_per_rank": g_orig,
                    "gbps_deepep_per_rank": g_dpe,
                    "original_ll_scale": [tokens * k / max(r, 1) for r in rows],
                    "verified": verified,
                    "samples_us": [s * 1e6 for s in samples],
                }
                if per_rank[0].get("inter_node") is not None:
                    # per rank, one call: wire rows and bytes sent to other nodes, and messages
                    # (puts, signals, atomics) to other nodes, control included
                    row["transport"] = results[0].get("transport")
                    for f in ("rows", "bytes", "messages"):
                        row[f"inter_node_{f}_per_rank"] = [c["inter_node"][phase][f] for c in per_rank]
                if f"{phase}_traced" in per_rank[0]["ours"][si]:
                    traced = _lat(
                        bench.slowest([c["ours"][si][f"{phase}_traced"]["samples"] for c in per_rank])
                    )
                    row["traced"] = {
                        "latency_us": traced,
                        "ratio": traced["median"] / row["latency_us"]["median"],
                    }
                if all(b is not None for b in base):
                    row["baseline"] = _baseline_row(base, phase, base_name, b_dpe, row)
                    row["ratio"] = bench.speedup(
                        row["latency_us"]["median"], row["baseline"]["latency_us"]["median"]
                    )
                out.append(row)
    return out


def _baseline_row(
    base: list[Any], phase: str, name: str, b_dpe: list[int], ours: dict[str, Any]
) -> dict[str, Any]:
    import statistics

    def figure(key: str) -> dict[str, Any]:
        meas = [b[key] for b in base]
        medians = [statistics.median(m["samples"]) for m in meas]
        g = [gbps(b, t) for b, t in zip(b_dpe, medians, strict=True)]
        return {
            "timing": meas[0]["mode"],
            "latency_us": _lat(bench.slowest([m["samples"] for m in meas])),
            "gbps_deepep": sum(g) / len(g),
        }

    what = (
        "all_to_all_single of the counts, host read of the split sizes, all_to_all_single of token rows "
        "and of packed weights/ids/scales"
        if phase == "dispatch"
        else "all_to_all_single back, fp32 index_add_ at the source"
    )
    row = {"name": f"torch.distributed.all_to_all_single ({name})", "what": what, **figure(phase)}
    row["verified"] = all(b["verified"] for b in base)
    if phase == "dispatch":
        row["cached"] = {
            "what": "split sizes known (counts exchange skipped): index_select + 2 all_to_all_single",
            **figure("dispatch_cached"),
        }
    return row


def _report(spec: dict[str, Any], results: list[dict[str, Any]], rows: list[dict[str, Any]]) -> bool:
    dev = spec["device"]
    base_name = "NCCL" if dev == "cuda" else "gloo"
    table = []
    for r in rows:
        zc = ", zero-copy" if spec.get("zero_copy") else ""
        if spec.get("combine_quant", "none") != "none":
            zc += f", {spec['combine_quant']} wire"
        dtype = r["dtype"] if r["phase"] == "dispatch" else f"bf16 ({r['dispatch_dtype']} run{zc})"
        b = r.get("baseline")
        table.append(
            [
                r["phase"],
                r["tokens"],
                dtype,
                "n/a" if dev == "cpu" else ("default" if r["sms"] == -1 else r["sms"]),
                bench.format_spread(r["latency_us"]),
                bench.format_gbps(r["gbps_original"]),
                bench.format_gbps(r["gbps_deepep"]),
                "-" if b is None else bench.format_spread(b["latency_us"]),
                "-" if b is None else f"{r['ratio']:.2f}",
            ]
        )
    print(
        f"mori bench ep: EpDispatchCombineOp ({spec['kernel_type']}) on {spec['ranks']} ranks"
        + (
            f" in {spec['nodes']} emulated nodes (inter-node legs over {results[0].get('transport')})"
            if spec.get("nodes", 1) > 1
            else ""
        )
        + f", {results[0]['device_name']}; hidden {spec['hidden']}, top-{spec['topk']} of {spec['experts']} "
        f"experts, random routing (seed {spec['seed']}), combine bf16"
    )
    print(
        "latency: median [p10-p90] us per call of the slowest rank over "
        f"{spec['iters'] * _rounds(spec)} measurements of {spec['reps']} call(s)"
        + (", taken in turn with the traced calls' samples" if spec["trace"] else "")
        + "; GB/s: per rank, mean over ranks, 1 GB = 1e9 B"
    )
    print(
        bench.format_table(
            [
                "phase",
                "tokens",
                "dtype",
                "sms",
                "latency us [p10-p90]",
                "GB/s orig",
                "GB/s DeepEP",
                f"{base_name} a2a us [p10-p90]",
                "ours/a2a",
            ],
            table,
        )
    )
    print(
        "GB/s orig = original MORI formula: received rows x hidden x element size (fp8: 1 B, scales not "
        "counted) / time"
    )
    print(
        "GB/s DeepEP = DeepEP logical formula: (token, destination rank) pairs received (own tokens "
        "included) x hidden x 2 B (fp8: hidden + 4 B per scale) / time; combine: its dispatch's bytes in bf16"
    )
    modes = sorted({r["timing"] for r in rows})
    print("timing (ours): " + "; ".join(modes))
    if rows and "inter_node_bytes_per_rank" in rows[0]:
        print(
            "sent to other nodes per call (per rank: wire rows, MB, messages incl. control; V1/V1LL: a "
            "token crosses once per destination node, InterNode once per destination rank):"
        )
        for r in rows:
            mb = ", ".join(f"{b / 1e6:.2f}" for b in r["inter_node_bytes_per_rank"])
            print(
                f"  {r['phase']} {r['tokens']} tokens {r['dtype']}: rows {r['inter_node_rows_per_rank']}, "
                f"MB [{mb}], messages {r['inter_node_messages_per_rank']}"
            )
    if rows and "baseline" in rows[0]:
        print(
            f"baseline: torch.distributed.all_to_all_single on {base_name}; ours/a2a = our GB/s / the "
            "baseline's = baseline median time / our median time (> 1: we are faster)"
        )
        b_modes = sorted({f"{r['phase']}: {r['baseline']['timing']}" for r in rows})
        print("timing (baseline): " + "; ".join(b_modes))
        print("baseline dispatch with the split sizes known ('cached': counts exchange skipped):")
        seen = set()
        for r in rows:
            key = (r["tokens"], r["dispatch_dtype"])
            if r["phase"] != "dispatch" or key in seen:
                continue
            seen.add(key)
            c = r["baseline"]["cached"]
            print(
                f"  {r['tokens']} tokens {r['dispatch_dtype']}: {bench.format_spread(c['latency_us'])} us, "
                f"{bench.format_gbps(c['gbps_deepep'])} GB/s DeepEP ({c['timing']})"
            )
    if spec["baseline_skipped"]:
        print(f"baseline not run: {spec['baseline_skipped']}")
    if rows and "traced" in rows[0]:
        print(
            "tracing compiled in and on (mori.viz) vs off, same calls, samples taken in turn (traced/untraced):"
        )
        for r in rows:
            t = r["traced"]
            print(
                f"  {r['phase']} {r['tokens']} tokens {r['dtype']} sms {r['sms']}: {bench.format_spread(t['latency_us'])} us "
                f"vs {bench.format_spread(r['latency_us'])} us, ratio {t['ratio']:.4f}"
            )
    verified = all(r["verified"] for r in rows)
    base_ok = all(r["baseline"]["verified"] for r in rows if "baseline" in r)
    print(
        f"combine == x * U (identity experts) and total_recv as expected, every rank: ours {verified}, "
        f"baseline {base_ok if rows and 'baseline' in rows[0] else 'not run'}"
    )
    return verified and base_ok


def _plot(path: Path | None, rows: list[dict[str, Any]], config: dict[str, Any]) -> None:
    """Latency and GB/s (DeepEP formula) per row, ours and the baseline's, to ``path`` (None: none)."""

    def draw(plt: Any) -> Any:
        labels = []
        for r in rows:
            run = "" if r["phase"] == "dispatch" else f"\n({r['dispatch_dtype']} run)"
            sms = "" if r["sms"] == -1 else f"\n{r['sms']} SMs"
            labels.append(f"{r['phase']}\n{r['tokens']} {r['dtype']}{run}{sms}")
        xs = list(range(len(rows)))
        has_base = all("baseline" in r for r in rows)
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(8, len(rows) * 1.1), 8))
        width = 0.4 if has_base else 0.8
        ours_x = [x - width / 2 if has_base else x for x in xs]
        base_x = [x + width / 2 for x in xs]
        ax1.bar(ours_x, [r["latency_us"]["median"] for r in rows], width, label="mori.ep")
        if has_base:
            base_lat = [r["baseline"]["latency_us"]["median"] for r in rows]
            ax1.bar(base_x, base_lat, width, label="all_to_all_single")
        ax1.set_yscale("log")
        ax1.set_ylabel("latency, median us")
        ax2.bar(ours_x, [r["gbps_deepep"] for r in rows], width, label="mori.ep")
        if has_base:
            ax2.bar(base_x, [r["baseline"]["gbps_deepep"] for r in rows], width, label="all_to_all_single")
        ax2.set_ylabel("GB/s (DeepEP logical formula)")
        for ax in (ax1, ax2):
            ax.set_xticks(xs)
            ax.set_xticklabels(labels, fontsize=7)
            ax.legend()
            ax.grid(True, axis="y", alpha=0.3)
        ax1.set_title(
            f"mori bench ep: {config['ranks']} ranks, {config['device_name']}, hidden {config['hidden']}"
        )
        return fig

    bench.draw_plot(path, draw)

"""The toolkit every ``mori bench`` suite shares: options, placement, timers, statistics, the
baseline ratio, the JSON record, the table, the plot and the progress line.

A suite measures its component and, in the same run, the baseline a user would pick instead,
and reports the ratio. Results are medians with their spread (min, p10, p90, max), never a mean
of a noisy distribution alone. A suite module keeps its workload (what it runs, its figures and
their formulas); how options are parsed, how a call is timed, how a record, a table or a plot is
written lives here once, so every suite does it the same way.

* options: :func:`size_list` (``"4K,1M"``), :func:`int_list`, :func:`name_list`,
  :func:`output_arguments` (``--json`` and ``--plot``), and :func:`json_path` / :func:`plot_path`
  (``--plot none`` means no plot, in every suite);
* placement: :func:`free_port`, :func:`cpu_threads`, :func:`gpu_rank_env`, :func:`gpu_per_rank`,
  :func:`device_name`, :func:`agree`;
* timers: :func:`time_samples`, :func:`time_interleaved`, :func:`time_transfers` and
  :func:`time_pipelined` (host clock), :func:`capture_graph`, :func:`graph_or_eager` and
  :func:`time_cuda` (CUDA graphs and events);
* statistics: :class:`Stats`, :func:`percentile`, :func:`slowest`, :func:`spread`, :func:`gbps`;
* the baseline: :func:`speedup`, :func:`untrusted`, :func:`compare` and :func:`ratio_notes`;
* output: :func:`write_json` (git sha, machine, config, rows), :func:`format_table`,
  :func:`format_row`, :func:`markdown_table`, :func:`human_bytes`, :func:`format_gbps`,
  :func:`format_spread`, :func:`draw_plot`, and
  :class:`Progress` (a progress line on a terminal, silent otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from mori.core.errors import MoriValueError, bad_value

__all__ = [
    "CLIFF_LIMIT",
    "FLOOR_LIMIT",
    "SPREAD_LIMIT",
    "BenchSuite",
    "Progress",
    "Ratio",
    "Stats",
    "agree",
    "capture_graph",
    "compare",
    "cpu_threads",
    "device_name",
    "draw_plot",
    "format_gbps",
    "format_row",
    "format_spread",
    "format_table",
    "free_port",
    "gbps",
    "git_sha",
    "gpu_per_rank",
    "gpu_rank_env",
    "graph_or_eager",
    "human_bytes",
    "int_list",
    "json_path",
    "machine",
    "markdown_table",
    "name_list",
    "output_arguments",
    "percentile",
    "plot_path",
    "ratio_notes",
    "size_list",
    "slowest",
    "speedup",
    "spread",
    "time_cuda",
    "time_interleaved",
    "time_pipelined",
    "time_samples",
    "time_transfers",
    "untrusted",
    "version",
    "write_json",
]


@dataclass(frozen=True)
class BenchSuite:
    """A benchmark that ``mori bench NAME`` runs."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# -- options -----------------------------------------------------------------------------------------


def _items(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def size_list(text: str) -> list[int]:
    """``"4K,1M,64M"`` -> byte counts (binary suffixes, :func:`mori.core.env.parse_size`), for an
    argparse ``type=``. At least one; a bad item is an :class:`argparse.ArgumentTypeError` naming it."""
    from mori.core.env import parse_size

    try:
        out = [parse_size(x) for x in _items(text)]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    if not out:
        raise argparse.ArgumentTypeError(f"{text!r}: expected at least one size")
    return out


def int_list(text: str, *, minimum: int | None = None) -> list[int]:
    """``"1,32,128"`` -> integers, for an argparse ``type=`` (with ``minimum``:
    ``functools.partial(int_list, minimum=1)``). At least one, each ``>= minimum`` if given."""
    try:
        out = [int(x) for x in _items(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if minimum is not None and min(out) < minimum:
        raise argparse.ArgumentTypeError(f"expected integers >= {minimum}, got {text!r}")
    return out


def name_list(text: str, allowed: Sequence[str], *, lower: bool = False) -> list[str]:
    """``"bf16,fp8"`` -> names, each one of ``allowed`` (``lower``: compared in lower case), for an
    argparse ``type=`` through ``functools.partial``. At least one."""
    out = [x.lower() if lower else x for x in _items(text)]
    if not out or any(x not in allowed for x in out):
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated subset of {','.join(allowed)}, got {text!r}"
        )
    return out


def json_path(given: str | Path | None, default_name: str) -> Path:
    """Where a suite writes its record: ``--json`` if given, else ``bench-results/NAME.json``
    (``default_name`` without the extension, e.g. ``"ep-cpu"``; the directory is ignored by git)."""
    return Path(given) if given else Path("bench-results") / f"{default_name}.json"


def output_arguments(p: argparse.ArgumentParser, record: str, *, plot_note: str = "") -> None:
    """Add a suite's ``--json`` (read with :func:`json_path`) and ``--plot`` (:func:`plot_path`)
    options to ``p``, with the same help in every suite: ``record`` names the default record in that
    help (``"ep-DEVICE"``: ``bench-results/ep-DEVICE.json``), ``plot_note`` leads the plot's help
    (``"cuda: "`` where only one device draws one)."""
    p.add_argument(
        "--json", default=None, help=f"where to write the JSON record (default bench-results/{record}.json)"
    )
    p.add_argument(
        "--plot",
        default=None,
        help=f"{plot_note}where to draw the plot (default: the JSON path with .png; 'none' for no plot; "
        "needs matplotlib)",
    )


def plot_path(given: str | Path | None, record: Path) -> Path | None:
    """Where a suite draws its plot: ``--plot`` if given, else the record's path with ``.png``;
    ``None`` for ``--plot none`` (no plot). The one place that reads the option's value."""
    if given is None or str(given) == "":
        return record.with_suffix(".png")
    if str(given).lower() == "none":
        return None
    return Path(given)


# -- placement ---------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port free on loopback now (for a rendezvous the ranks of one run share)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_threads(nranks: int) -> int:
    """torch threads per CPU rank when ``nranks`` ranks share the cores: an even share, at least 1."""
    return max(1, (os.cpu_count() or 1) // nranks)


def gpu_rank_env(suite: str) -> dict[str, str]:
    """The environment of a suite's ranks with ``--device cuda`` (torch's name for the GPUs of every
    vendor): ``MORI_DEVICE_RUNTIME`` as the caller's, else ``auto`` (the usable runtime of highest
    priority: this machine's GPU runtime, ``cuda`` or ``hip``), and ``CUDA_MODULE_LOADING`` as the
    caller's, else ``EAGER`` (a kernel first loaded while another spins for it may deadlock).
    Raises :class:`MoriValueError` naming ``--device`` where torch sees no GPU."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        raise bad_value(suite, "--device", "cuda", "cpu: torch sees no CUDA device here")
    return {
        "MORI_DEVICE_RUNTIME": os.environ.get("MORI_DEVICE_RUNTIME", "auto"),
        "CUDA_MODULE_LOADING": os.environ.get("CUDA_MODULE_LOADING", "EAGER"),
    }


def gpu_per_rank(rank: int, nranks: int, gpus: int | None = None) -> None:
    """Put ``rank`` on GPU ``rank % gpus`` (default: every visible GPU); its signature is that of
    a launcher's ``before_init``."""
    import torch

    torch.cuda.set_device(rank % (gpus or torch.cuda.device_count()))


def device_name(dev: Any) -> str:
    """The name a record gives a ``torch.device``: the GPU's name, or ``cpu (N cores)``."""
    if getattr(dev, "type", dev) == "cuda":
        import torch

        return str(torch.cuda.get_device_name(dev))
    return f"cpu ({os.cpu_count()} cores)"


def agree(ok: bool) -> bool:
    """True on every rank if ``ok`` is true on every rank. Collective over the default
    ``torch.distributed`` group, through a CPU tensor (gloo, also where GPUs use NCCL)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


# -- timers ------------------------------------------------------------------------------------------


def time_samples(
    fn: Callable[[], object],
    *,
    iters: int,
    warmup: int,
    reps: int = 1,
    before: Callable[[], object] | None = None,
) -> list[float]:
    """Seconds per call of ``fn`` on the host clock (``perf_counter``): ``iters`` samples, each
    the time of ``reps`` calls in a row divided by ``reps``, after ``warmup`` untimed calls.
    ``before`` (a barrier, say) runs untimed ahead of every warmup call and every sample."""
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    out = []
    for _ in range(iters):
        if before is not None:
            before()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        out.append((time.perf_counter() - t0) / reps)
    return out


def time_interleaved(
    fns: Mapping[str, Callable[[], object]],
    *,
    iters: int,
    warmup: int,
    reps: int | Mapping[str, int] = 1,
    before: Callable[[], object] | None = None,
    sample: Callable[[float], float] | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of each of ``fns`` on the host clock, sample by sample in turn (so that
    a change of the machine's load touches them all alike): ``warmup`` untimed rounds, then
    ``iters`` timed ones. A sample is ``reps`` calls (per name if a mapping) divided by ``reps``;
    ``before`` runs untimed ahead of each; ``sample`` maps each timed sample (e.g. the slowest
    rank's, a collective every rank calls alike)."""
    out: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(warmup + iters):
        for name, fn in fns.items():
            n = reps[name] if isinstance(reps, Mapping) else reps
            if before is not None:
                before()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            dt = (time.perf_counter() - t0) / n
            if i >= warmup:
                out[name].append(sample(dt) if sample is not None else dt)
    return out


def time_transfers(
    post: Callable[[], Any], wait: Callable[[Any], None], iters: int
) -> tuple[list[float], list[float]]:
    """``iters`` stop-and-wait operations (``post()`` starts one and returns its handle,
    ``wait(handle)`` returns when it is done): per iteration the latency (post until done) and
    the post time (the call that starts it), in seconds, as two lists."""
    lat, posts = [], []
    clock = time.perf_counter
    for _ in range(iters):
        t0 = clock()
        handle = post()
        t1 = clock()
        wait(handle)
        t2 = clock()
        posts.append(t1 - t0)
        lat.append(t2 - t0)
    return lat, posts


def time_pipelined(
    post: Callable[[], Any], wait: Callable[[Any], None], iters: int, *, wait_each: bool = True
) -> float:
    """Seconds for ``iters`` operations posted back to back (all in flight at once), then all
    waited for: each handle, or with ``wait_each=False`` only the last (a wait that covers
    everything before it, such as a device synchronize)."""
    t0 = time.perf_counter()
    handles = [post() for _ in range(iters)]
    for h in handles if wait_each else handles[-1:]:
        wait(h)
    return time.perf_counter() - t0


def capture_graph(fn: Callable[[], object], reps: int) -> tuple[Any, str]:
    """``reps`` calls of ``fn`` captured in one CUDA graph: ``(graph, "")``, or ``(None, why)``
    where capture fails. ``fn`` runs once first on a side stream (compile and load outside the
    capture); the capture is ``thread_local`` (NCCL's watchdog thread may query events meanwhile)."""
    import torch

    try:
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call,unused-ignore]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for _ in range(reps):
                fn()
    except Exception as e:  # the caller says why and times eagerly
        torch.cuda.synchronize()
        return None, f"{type(e).__name__}: {e}".splitlines()[0][:200]
    torch.cuda.synchronize()
    return graph, ""


def graph_or_eager(
    fn: Callable[[], object],
    reps: int,
    *,
    capture: bool = True,
    why_eager: str = "",
    failed: str = "graph capture failed",
) -> tuple[Callable[[], None], str]:
    """How every rank times ``reps`` calls of ``fn`` on the GPU: ``(once, mode)``, ``once()`` making
    the ``reps`` calls (a replay of their CUDA graph, or a loop) for :func:`time_cuda`, and ``mode``
    saying which for the record. With ``capture`` the calls are captured (:func:`capture_graph`) and
    replayed where every rank's capture succeeded (:func:`agree`, collective), else run eagerly
    with the reason after ``failed``; without, eagerly, for ``why_eager`` if given."""
    graph: Any = None
    mode = f"eager, CUDA events around {reps} calls" + (f" ({why_eager})" if why_eager else "")
    if capture:
        graph, error = capture_graph(fn, reps)
        if agree(graph is not None):
            mode = f"CUDA graph of {reps} calls, replayed between CUDA events"
        else:
            graph = None
            mode = f"eager, CUDA events around {reps} calls ({failed}: {error or 'on a peer'})"

    def once() -> None:
        if graph is not None:
            graph.replay()
        else:
            for _ in range(reps):
                fn()

    return once, mode


def time_cuda(run: Callable[[], object], calls: int) -> float:
    """Seconds per call of one ``run()`` that makes ``calls`` calls (a graph replay, or a loop),
    between two CUDA events on the current stream; synchronises the device."""
    import torch

    a = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call,unused-ignore]
    b = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call,unused-ignore]
    a.record()
    run()
    b.record()
    torch.cuda.synchronize()
    return float(a.elapsed_time(b)) / 1e3 / calls


# -- statistics --------------------------------------------------------------------------------------


def percentile(samples: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (``0 <= q <= 1``) of ``samples``: a value that occurred."""
    s = sorted(samples)
    if not s:
        raise ValueError("no samples")
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


@dataclass(frozen=True)
class Stats:
    """Median and spread of one point's samples (same unit as the samples)."""

    median: float
    min: float
    p10: float
    p90: float
    max: float
    n: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Stats:
        s = sorted(samples)
        if not s:
            raise ValueError("no samples")
        return cls(statistics.median(s), s[0], percentile(s, 0.1), percentile(s, 0.9), s[-1], len(s))

    def us(self) -> dict[str, Any]:
        """The figures in microseconds (samples in seconds): median, p10, p90, min, max and n."""
        return {
            "median": self.median * 1e6,
            "p10": self.p10 * 1e6,
            "p90": self.p90 * 1e6,
            "min": self.min * 1e6,
            "max": self.max * 1e6,
            "n": self.n,
        }


def slowest(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Sample ``i`` = the slowest rank's sample ``i`` (``per_rank[r]``: rank ``r``'s samples, taken
    together): a collective is done when its last rank is."""
    return [max(s) for s in zip(*per_rank, strict=True)]


def spread(values: Sequence[float]) -> dict[str, float]:
    """``{"median", "min", "max"}`` of a few repetitions' figures."""
    if not values:
        raise ValueError("no values")
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def gbps(nbytes: float, seconds: float) -> float:
    """GB/s with GB = 1e9 bytes."""
    return nbytes / seconds / 1e9


# -- the baseline ------------------------------------------------------------------------------------


def speedup(ours_s: float, baseline_s: float) -> float:
    """The ratio a suite reports: the baseline's time over ours, which is our rate over the
    baseline's (> 1: we are faster)."""
    return baseline_s / ours_s


#: p90 / p10 of one point's samples above this: they disagree (a busy machine), the median is luck
SPREAD_LIMIT = 3.0
#: a size's median above this many times a larger size's: a stall or a floor, not what it costs
FLOOR_LIMIT = 4.0
#: a size's median above this many times what the last trusted smaller size predicts, at that
#: size's bandwidth: far beyond any cache cliff (those are 2-10x)
CLIFF_LIMIT = 16.0


def untrusted(sizes: Sequence[int], stats: Sequence[Stats], what: str) -> list[str | None]:
    """For a sweep of one measurement (``stats[i]``: seconds per call at ``sizes[i]`` bytes, sizes
    ascending), why each point is clearly off, or None where it can be used.

    A point is off when its samples spread more than :data:`SPREAD_LIMIT` (p90/p10), when it is
    more than :data:`FLOOR_LIMIT` times slower than a *larger* size (moving fewer bytes cannot
    honestly take longer), or when it is more than :data:`CLIFF_LIMIT` times what the last trusted
    smaller size predicts (its time scaled by the size). A ratio against such a point is not a
    result: suites print the reason instead. ``what`` names the measurement in the reasons.
    """
    if len(sizes) != len(stats) or list(sizes) != sorted(sizes):
        raise MoriValueError("untrusted: sizes must be ascending, one Stats per size")
    out: list[str | None] = [None] * len(sizes)
    last_ok: int | None = None
    for i, (size, st) in enumerate(zip(sizes, stats, strict=True)):
        if st.p10 > 0 and st.p90 / st.p10 > SPREAD_LIMIT:
            out[i] = (
                f"{what} samples spread {st.p10 * 1e6:.2f}-{st.p90 * 1e6:.2f} us (p10-p90, "
                f"{st.p90 / st.p10:.0f}x): the machine was busy"
            )
            continue
        faster = [j for j in range(i + 1, len(sizes)) if st.median > FLOOR_LIMIT * stats[j].median]
        if faster:
            j = faster[0]
            out[i] = (
                f"{what} median {st.median * 1e6:.2f} us is {st.median / stats[j].median:.0f}x the "
                f"{stats[j].median * 1e6:.2f} us of {sizes[j]} bytes: a stall or a floor"
            )
            continue
        if last_ok is not None:
            predicted = stats[last_ok].median * size / sizes[last_ok]
            if st.median > CLIFF_LIMIT * predicted:
                out[i] = (
                    f"{what} median {st.median * 1e6:.2f} us is {st.median / predicted:.0f}x what "
                    f"{sizes[last_ok]} bytes at {stats[last_ok].median * 1e6:.2f} us predicts: a floor"
                )
                continue
        last_ok = i
    return out


@dataclass(frozen=True)
class Ratio:
    """One point's comparison with its baseline: :func:`speedup` of the medians, or ``None`` with
    the reasons (``off``) where either measurement is clearly off (:func:`untrusted`)."""

    value: float | None
    off: list[str]


def compare(
    sizes: Sequence[int],
    ours: Sequence[Stats],
    baseline: Sequence[Stats],
    *,
    ours_what: str,
    baseline_what: str,
) -> list[Ratio]:
    """A sweep against its baseline, point by point (``sizes`` ascending, seconds per call): the
    ratio where both points can be trusted, else no ratio and why (``ours_what`` and
    ``baseline_what`` name the two measurements in the reasons)."""
    ours_off = untrusted(sizes, ours, ours_what)
    base_off = untrusted(sizes, baseline, baseline_what)
    out = []
    for o, b, *why in zip(ours, baseline, ours_off, base_off, strict=True):
        off = [w for w in why if w is not None]
        out.append(Ratio(None if off else speedup(o.median, b.median), off))
    return out


def ratio_notes(labels: Sequence[str], ratios: Sequence[Ratio], *, more: str) -> list[str]:
    """The notes under a table for the points without a ratio (``labels[i]`` names point ``i``):
    one per such point, then how many and what to do (``more``: the option that takes more
    samples). Empty when every point has its ratio."""
    notes = [
        f"* {label}: no ratio, " + "; ".join(r.off)
        for label, r in zip(labels, ratios, strict=True)
        if r.value is None
    ]
    if notes:
        notes.append(
            f"{len(notes)} point(s) without a ratio: a measurement clearly off is not a result; run again "
            f"on a quieter machine (or with more {more})"
        )
    return notes


# -- the record --------------------------------------------------------------------------------------


def git_sha() -> str:
    """The commit of the code that ran: MORI_BENCH_GIT_SHA, else HEAD, marked ``+dirty`` when a
    tracked file differs from it (a record must not name code it did not run)."""
    from mori.core.env import MORI_BENCH_GIT_SHA

    given = MORI_BENCH_GIT_SHA.get()
    if given:
        return given

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, check=True, timeout=5
        ).stdout.strip()

    try:
        sha = git("rev-parse", "--short", "HEAD")
        return sha + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine() -> dict[str, Any]:
    """The record's ``machine``: host name, CPU, cores and Python version."""
    return {
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
    }


def version(dist: str) -> str:
    """The installed version of distribution ``dist``, or ``"not installed"`` (for a baseline's)."""
    import importlib.metadata as md

    try:
        return md.version(dist)
    except Exception:
        return "not installed"


def write_json(path: str | Path, suite: str, config: dict[str, Any], rows: list[dict[str, Any]]) -> Path:
    """Write a result record: suite, git sha, time, machine, config and every row."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "suite": suite,
        "git_sha": git_sha(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "config": config,
        "rows": rows,
    }
    out.write_text(json.dumps(record, indent=2) + "\n")
    return out


# -- tables, plots, progress -------------------------------------------------------------------------


def format_row(cells: Sequence[object], widths: Sequence[int]) -> str:
    """One table line: each cell right-aligned to its width, two spaces between."""
    return "  ".join(str(c).rjust(w) for c, w in zip(cells, widths, strict=True))


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table: the headers, a rule, the rows; columns as wide as their widest cell."""
    cells = [[str(h) for h in headers], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [format_row(row, widths) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """The same table in Markdown (for a page of ``docs/benchmarks``)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def human_bytes(n: int) -> str:
    """``4096`` -> ``"4 KiB"``; a count that is no whole number of KiB stays in bytes."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def format_gbps(v: float) -> str:
    """A bandwidth for a table: one decimal from 10 on, three significant digits below."""
    return f"{v:.1f}" if v >= 10 else f"{v:.3g}"


def format_spread(figures: Mapping[str, float], digits: int = 1) -> str:
    """``"median [p10-p90]"`` of a :meth:`Stats.us`-style mapping, for a table cell."""
    return f"{figures['median']:.{digits}f} [{figures['p10']:.{digits}f}-{figures['p90']:.{digits}f}]"


def draw_plot(path: Path | None, draw: Callable[[Any], Any], *, dpi: int = 120) -> bool:
    """Draw a suite's plot to ``path`` (``None``: no plot, see :func:`plot_path`): ``draw`` gets
    ``matplotlib.pyplot`` (Agg backend) and returns the figure, which is saved and closed; says
    ``wrote PATH``. False without a path, or, with a message, without matplotlib."""
    if path is None:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return False
    fig = draw(plt)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path}")
    return True


class Progress:
    """A progress line for a person watching: on a terminal (``stream.isatty()``, default
    ``sys.stderr``) each :meth:`step` rewrites one line in place; elsewhere (CI, a pipe, a file)
    nothing is written, so logs and records stay as they were. A context manager; leaving it
    clears the line.

    ``suite`` starts the line (``mori bench ep``); ``total``, if known, is the number of steps.
    """

    def __init__(self, suite: str, total: int | None = None, *, stream: TextIO | None = None) -> None:
        self.suite, self.total, self.done = suite, total, 0
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.on = bool(isatty()) if callable(isatty) else False
        self._width = 0

    def _write(self, text: str) -> None:
        pad = max(0, self._width - len(text))
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()
        self._width = len(text)

    def step(self, what: str) -> None:
        """Count one step and show ``what`` is being measured now."""
        self.done += 1
        if not self.on:
            return
        count = f"{self.done}/{self.total}" if self.total else str(self.done)
        self._write(f"{self.suite}: [{count}] {what}")

    def close(self) -> None:
        """Clear the line (on a terminal)."""
        if self.on and self._width:
            self._write("")
            self.stream.write("\r")
            self.stream.flush()
            self._width = 0

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

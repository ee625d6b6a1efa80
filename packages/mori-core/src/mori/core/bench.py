"""What every ``mori bench`` suite shares: the suite contract, statistics and the JSON record.

A suite measures its component and, in the same run, the baseline a user would pick instead,
and reports the ratio. Results are medians with their spread (min, p10, p90, max), never a mean
of a noisy distribution alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mori.core.errors import MoriValueError


@dataclass(frozen=True)
class BenchSuite:
    """A benchmark that ``mori bench NAME`` runs."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


@dataclass(frozen=True)
class Stats:
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

        def pct(q: float) -> float:
            return s[min(len(s) - 1, round(q * (len(s) - 1)))]

        return cls(statistics.median(s), s[0], pct(0.1), pct(0.9), s[-1], len(s))


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


def time_samples(fn: Callable[[], object], *, iters: int, warmup: int) -> list[float]:
    """Seconds per call of ``fn``, one sample per call, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


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
    return {
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
    }


def write_json(path: str | Path, suite: str, config: dict[str, Any], rows: list[dict[str, Any]]) -> Path:
    """Write a result record: git sha, machine, config and every row."""
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


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"

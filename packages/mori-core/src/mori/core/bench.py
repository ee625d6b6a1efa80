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
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True, timeout=5
        ).stdout.strip()
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

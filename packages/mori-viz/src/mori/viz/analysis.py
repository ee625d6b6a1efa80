"""Per-phase statistics of a timeline: what ``mori viz summary`` prints.

For every rank and slot: how many spans, and their durations (median with the spread: min, p10,
p90, max, and the total), plus how many instants; per rank, how many orphans were dropped and
events lost. Durations are per span, i.e. per program and launch: a phase that 132 programs run
in one launch counts 132 times.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from mori.viz.timeline import Timeline

__all__ = ["PhaseStats", "format_summary", "summarize"]


@dataclass(frozen=True)
class PhaseStats:
    """Durations (ns) of the spans of one slot on one rank; ``instants`` if it is an instant."""

    rank: int
    group: str
    name: str
    slot: int
    spans: int
    instants: int
    total_ns: int
    median_ns: float
    min_ns: int
    p10_ns: float
    p90_ns: float
    max_ns: int
    launches: int  # distinct launches it was seen in

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(tl_: Timeline) -> list[PhaseStats]:
    """One :class:`PhaseStats` per (rank, slot) seen, sorted by rank, group, then start order."""
    durations: dict[tuple[int, int], list[int]] = defaultdict(list)
    first_seen: dict[tuple[int, int], int] = {}
    launches: dict[tuple[int, int], set[int]] = defaultdict(set)
    counts: dict[tuple[int, int], int] = defaultdict(int)
    for sp in tl_.spans:
        key = (tl_.tracks[sp.track].rank, sp.slot)
        durations[key].append(sp.end_ns - sp.start_ns)
        launches[key].add(sp.launch)
        first_seen[key] = min(first_seen.get(key, sp.start_ns), sp.start_ns)
    for ins in tl_.instants:
        key = (tl_.tracks[ins.track].rank, ins.slot)
        counts[key] += 1
        launches[key].add(ins.launch)
        first_seen[key] = min(first_seen.get(key, ins.ts_ns), ins.ts_ns)
    rows = []
    for key in set(durations) | set(counts):
        rank, slot = key
        name, group = tl_.slot_label(slot)
        d = np.asarray(durations.get(key, []), dtype=np.int64)
        if d.size:
            stats = (
                int(d.sum()),
                float(np.median(d)),
                int(d.min()),
                float(np.percentile(d, 10)),
                float(np.percentile(d, 90)),
                int(d.max()),
            )
        else:
            stats = (0, 0.0, 0, 0.0, 0.0, 0)
        rows.append(
            PhaseStats(rank, group, name, slot, int(d.size), counts.get(key, 0), *stats, len(launches[key]))
        )
    return sorted(rows, key=lambda r: (r.rank, r.group, first_seen[(r.rank, r.slot)]))


def _us(ns: float) -> str:
    return f"{ns / 1000.0:.3f}"


def format_summary(tl_: Timeline, rows: list[PhaseStats]) -> str:
    """The table ``mori viz summary`` prints (times in µs), with the alignment and loss lines."""
    headers = [
        "rank",
        "group",
        "phase",
        "spans",
        "launches",
        "median",
        "min",
        "p10",
        "p90",
        "max",
        "total",
        "instants",
    ]
    cells = [
        [
            str(r.rank),
            r.group,
            r.name,
            str(r.spans),
            str(r.launches),
            *(
                (
                    _us(r.median_ns),
                    _us(r.min_ns),
                    _us(r.p10_ns),
                    _us(r.p90_ns),
                    _us(r.max_ns),
                    _us(r.total_ns),
                )
                if r.spans
                else ("-",) * 6
            ),
            str(r.instants),
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.append("durations in µs, per span (one per program and launch)")
    for a in tl_.alignment:
        if a["kind"] == "device":
            lines.append(
                f"rank {a['rank']} {a['source']}: device clock on {tl_.clock} within {a['error_ns']} ns "
                f"({a['method']}; {'rate fitted' if a['rate_fitted'] else 'nominal rate'}, {a['ns_per_tick']:.6f} ns/tick)"
            )
    dropped, lost = sum(tl_.dropped.values()), sum(tl_.lost.values())
    if dropped or lost:
        lines.append(f"orphans dropped: {dropped}; events lost to full rings: {lost}")
    return "\n".join(lines)

"""From recorded events to a timeline: common clock, tracks, and begin/end pairing.

Every rank trace's device ticks are mapped to its host clock (:class:`~mori.viz.clock.ClockModel`),
and host clocks to one clock: ``CLOCK_MONOTONIC`` when every trace comes from the same host (same
boot), else ``CLOCK_REALTIME`` through each process's epoch. The timeline's zero is its earliest
event.

**Tracks**: one per (rank, source, ring, warp): a program of a kernel (``ep · program 3``), a host
thread. **Pairing**, per track, in the order the events were written:

* ``begin`` opens a span, ``end`` closes the innermost open span, ``next`` closes it and opens
  another (one timestamp), ``instant`` is a point;
* an *orphan* is an ``end`` (or ``next``) with no open span to close (its begin was overwritten by
  the ring, or recording started inside it), a span still open when the track ends (the kernel
  was read mid-span, or ended without its ``end``), or, strictly, an ``end`` of another slot than
  the innermost open span;
* ``validate_pairs=True``: the slot of an ``end`` must be the innermost open span's; with
  ``sanitize_orphans=True`` orphans are dropped and counted (an ``end`` of a slot open deeper in
  the stack closes it, and the spans above it are orphans), otherwise the first problems raise
  :class:`TraceFormatError`. A span that ends before it begins is always an error;
* ``validate_pairs=False``: an ``end`` closes the innermost open span of its slot wherever it is
  (no nesting check); orphans are dropped with ``sanitize_orphans``, else kept as unpaired
  begin/end markers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mori.core.errors import MoriValueError, bad_value
from mori.viz import layout
from mori.viz.trace import RankTrace, merge_slots

__all__ = ["Orphan", "Span", "TimelineInstant", "Timeline", "TraceFormatError", "Track", "build_timeline"]

#: how many problems a TraceFormatError lists
MAX_LISTED = 10


class TraceFormatError(MoriValueError):
    """Events that do not pair up (see :mod:`mori.viz.timeline`)."""


@dataclass(frozen=True)
class Track:
    """One timeline row: ``rank``, its ``source`` (buffer or ``host``), ``ring`` and ``warp``."""

    rank: int
    source: str
    kind: str  # "device" or "host"
    ring: int
    warp: int
    name: str


@dataclass(frozen=True)
class Span:
    track: int  # index into Timeline.tracks
    start_ns: int  # on the timeline (0 = its earliest event)
    end_ns: int
    slot: int
    launch: int
    depth: int  # nesting depth when it began (0 = outermost)
    begin_seq: int  # index of its begin and end events among the track's events (write order)
    end_seq: int


@dataclass(frozen=True)
class TimelineInstant:
    track: int
    ts_ns: int
    slot: int
    launch: int
    seq: int


@dataclass(frozen=True)
class Orphan:
    track: int
    ts_ns: int
    slot: int
    launch: int
    kind: str  # "begin" (never ended) or "end" (never begun)
    seq: int


@dataclass
class Timeline:
    """Spans, instants and orphans of every track, on one clock (ns from ``origin_ns``)."""

    tracks: list[Track]
    spans: list[Span]
    instants: list[TimelineInstant]
    orphans: list[Orphan]  # kept (sanitize_orphans=False with validate_pairs=False)
    dropped: dict[int, int]  # track -> orphans dropped
    lost: dict[int, int]  # track -> events overwritten in its ring
    slot_names: dict[int, str]
    origin_ns: int
    clock: str  # which clock origin_ns is on
    alignment: list[dict[str, Any]] = field(default_factory=list)  # per rank/source: how it was aligned

    def slot_label(self, slot: int) -> tuple[str, str]:
        """(name, group) of a slot for display; unknown ids show as ``slot N``."""
        full = self.slot_names.get(slot)
        if full is None:
            return f"slot {slot}", "unknown"
        group, _, name = full.rpartition("/")
        return (name or full), (group or "unknown")


def _to_common(trace: RankTrace, host_ns: np.ndarray, same_host: bool) -> np.ndarray:
    if same_host:
        return host_ns
    return host_ns + (trace.epoch.realtime_ns - trace.epoch.monotonic_ns)


@dataclass(frozen=True)
class _Open:
    slot: int
    ts: int
    launch: int
    seq: int
    depth: int = 0  # spans open below it when it began


class _Pairer:
    def __init__(self, validate: bool, sanitize: bool, track_names: list[str], slot_names: Mapping[int, str]):
        self.validate, self.sanitize = validate, sanitize
        self.track_names, self.slot_names = track_names, slot_names
        self.spans: list[Span] = []
        self.instants: list[TimelineInstant] = []
        self.orphans: list[Orphan] = []
        self.dropped: dict[int, int] = {}
        self.problems: list[str] = []

    def _name(self, slot: int) -> str:
        return self.slot_names.get(slot, f"slot {slot}")

    def _orphan(self, track: int, ev: _Open, kind: str, why: str) -> None:
        if self.sanitize:
            self.dropped[track] = self.dropped.get(track, 0) + 1
        elif self.validate:
            self.problems.append(f"{self.track_names[track]}: {why}")
        else:
            self.orphans.append(Orphan(track, ev.ts, ev.slot, ev.launch, kind, ev.seq))

    def _close(self, track: int, stack: list[_Open], i: int, ts: int, seq: int) -> None:
        # i: the span's index in the stack
        o = stack.pop(i)
        if ts < o.ts:
            self.problems.append(
                f"{self.track_names[track]}: span {self._name(o.slot)} ends {o.ts - ts} ns before it begins "
                "(timestamps out of order: a corrupted buffer or the wrong clock rate)"
            )
            return
        self.spans.append(Span(track, o.ts, ts, o.slot, o.launch, o.depth, o.seq, seq))

    def track(
        self, track: int, ts: np.ndarray, kinds: np.ndarray, slots: np.ndarray, launches: np.ndarray
    ) -> None:
        stack: list[_Open] = []  # innermost last
        rows = zip(ts.tolist(), kinds.tolist(), slots.tolist(), launches.tolist(), strict=True)
        for j, (t, k, s, la) in enumerate(rows):
            ev = _Open(s, t, la, j, len(stack))
            if k == layout.BEGIN:
                stack.append(ev)
            elif k == layout.INSTANT:
                self.instants.append(TimelineInstant(track, t, s, la, j))
            elif k == layout.END:
                self._end(track, stack, ev)
            else:  # NEXT: close the innermost, open s
                if stack:
                    self._close(track, stack, len(stack) - 1, t, j)
                else:
                    self._orphan(track, ev, "end", f"next-span {self._name(s)} with no span open")
                stack.append(_Open(s, t, la, j, len(stack)))
        for o in stack:
            self._orphan(track, o, "begin", f"span {self._name(o.slot)} never ends")

    def _end(self, track: int, stack: list[_Open], ev: _Open) -> None:
        s = ev.slot
        where = next((i for i in range(len(stack) - 1, -1, -1) if stack[i].slot == s), None)
        if where is None:
            self._orphan(track, ev, "end", f"end of {self._name(s)} with no such span open")
            return
        innermost = len(stack) - 1
        if where != innermost and self.validate and not self.sanitize:
            self.problems.append(
                f"{self.track_names[track]}: end of {self._name(s)} while {self._name(stack[-1].slot)} "
                "is the innermost open span"
            )
        if self.validate:
            # strict nesting: what is open above the span that ends is orphaned (never ended)
            while len(stack) - 1 > where:
                above = stack.pop()
                if self.sanitize:
                    self._orphan(track, above, "begin", "")
        self._close(track, stack, where, ev.ts, ev.seq)


def build_timeline(
    traces: Sequence[RankTrace],
    *,
    slot_map: Mapping[int, str] | None = None,
    gpu_freq_ghz: float | None = None,
    validate_pairs: bool = True,
    sanitize_orphans: bool = True,
) -> Timeline:
    """The :class:`Timeline` of ``traces`` (see the module docstring for the rules)."""
    func = "build_timeline"
    if not traces:
        raise bad_value(func, "traces", [], "at least one rank trace")
    if gpu_freq_ghz is not None and (
        isinstance(gpu_freq_ghz, bool)
        or not isinstance(gpu_freq_ghz, (int, float))
        or not 1e-3 <= gpu_freq_ghz <= 100
    ):
        raise bad_value(func, "gpu_freq_ghz", gpu_freq_ghz, "None or a clock rate in GHz in [0.001, 100]")
    slot_names = merge_slots(traces, slot_map)
    same_host = len({t.host_id for t in traces}) == 1
    clock = f"CLOCK_MONOTONIC of {traces[0].hostname}" if same_host else "CLOCK_REALTIME"

    tracks: list[Track] = []
    per_track: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    lost: dict[int, int] = {}
    alignment: list[dict[str, Any]] = []
    for trace in traces:
        for src in trace.sources:
            model = src.clock_model(gpu_freq_ghz if src.kind == "device" else None)
            alignment.append(
                {
                    "rank": trace.rank,
                    "source": src.name,
                    "kind": src.kind,
                    "error_ns": model.error_ns,
                    "ns_per_tick": model.ns_per_tick,
                    "rate_fitted": model.fitted,
                    "method": src.clock_pairs[0].method if src.clock_pairs else "host clock",
                }
            )
            ev = src.events
            if ev.size == 0:
                continue
            common = _to_common(trace, model.to_host(ev["ts"]), same_host)
            keys = ev["ring"].astype(np.int64) * 65536 + ev["warp"].astype(np.int64)
            order = np.lexsort((ev["seq"], keys))
            keys, common, ev = keys[order], common[order], ev[order]
            bounds = np.flatnonzero(np.diff(keys)) + 1
            for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, keys.size], strict=True):
                ring, warp = int(ev["ring"][lo]), int(ev["warp"][lo])
                base = src.ring_names[ring] if ring < len(src.ring_names) else f"ring {ring}"
                name = f"{src.name} · {base}" + (f" / warp {warp}" if warp else "")
                idx = len(tracks)
                tracks.append(Track(trace.rank, src.name, src.kind, ring, warp, name))
                per_track.append((common[lo:hi], ev["kind"][lo:hi], ev["slot"][lo:hi], ev["launch"][lo:hi]))
                if ring < src.lost.size and int(src.lost[ring]):
                    lost[idx] = int(src.lost[ring])
    origin = min((int(p[0].min()) for p in per_track), default=0)
    pairer = _Pairer(validate_pairs, sanitize_orphans, [t.name for t in tracks], slot_names)
    for i, (ts, kinds, slots, launches) in enumerate(per_track):
        pairer.track(i, ts - origin, kinds, slots, launches)
        if len(pairer.problems) >= MAX_LISTED:
            break
    if pairer.problems:
        listed = "\n  ".join(pairer.problems[:MAX_LISTED])
        raise TraceFormatError(
            f"events do not pair up (first {min(len(pairer.problems), MAX_LISTED)}):\n  {listed}\n"
            "pass sanitize_orphans=True to drop orphans, or validate_pairs=False to keep them unpaired"
        )
    return Timeline(
        tracks,
        pairer.spans,
        pairer.instants,
        pairer.orphans,
        pairer.dropped,
        lost,
        slot_names,
        origin,
        clock,
        alignment,
    )

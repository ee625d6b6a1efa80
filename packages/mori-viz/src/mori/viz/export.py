"""Writing traces for ui.perfetto.dev: Chrome trace JSON and Perfetto's protobuf format.

:func:`export_to_perfetto` is the original's entry point with the original's parameters; it
takes what this package records (a :class:`~mori.viz.buffer.TraceBuffer`, a
:class:`~mori.viz.trace.RankTrace`, several of them, saved files or directories) and writes one
file with every rank on one clock (:mod:`mori.viz.timeline`).

In both formats a rank is a process (``rank 0``, with its host name), and each program of each
buffer and each host thread is a track of it, sorted device first. A span carries its slot's
group as category and the launch (graph replay) it belongs to. The protobuf form is built with the
``perfetto`` package's trace builder (``TracePacket`` messages of Perfetto's own schema: track
descriptors, then slice begin/end and instant events in ns); it keeps full ns precision, where
JSON's microsecond floats keep three decimals.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mori.core.errors import MoriValueError, bad_type, bad_value
from mori.viz.buffer import TraceBuffer, parse_rings
from mori.viz.clock import ClockPair, host_epoch
from mori.viz.timeline import Timeline, build_timeline
from mori.viz.trace import RankTrace, Source, capture, load_traces

__all__ = ["FORMATS", "ExportReport", "export_to_perfetto", "write_chrome_json", "write_perfetto_proto"]

#: file endings -> format
FORMATS = {
    ".json": "json",
    ".pftrace": "proto",
    ".perfetto-trace": "proto",
    ".pb": "proto",
    ".proto": "proto",
}


@dataclass(frozen=True)
class ExportReport:
    """What :func:`export_to_perfetto` wrote."""

    path: Path
    format: str  # "json" or "proto"
    ranks: list[int]
    tracks: int
    spans: int
    instants: int
    orphans_dropped: int
    orphans_kept: int
    events_lost: int  # overwritten in full rings before they were read
    clock: str
    alignment: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> str:
        """One line for logs."""
        worst = max((a["error_ns"] for a in self.alignment), default=0)
        return (
            f"{self.path} ({self.format}): {len(self.ranks)} rank(s), {self.tracks} tracks, {self.spans} spans, "
            f"{self.instants} instants; orphans dropped {self.orphans_dropped}, kept {self.orphans_kept}; "
            f"events lost to full rings {self.events_lost}; ranks aligned on {self.clock} within {worst} ns"
        )


def _raw_trace(words: np.ndarray, gpu_freq_ghz: float | None) -> RankTrace:
    # an original-style call with a bare buffer: no clock pairs, so ticks are put at 0 (one rank)
    data = parse_rings(words, what="trace_buffer")
    n_rings = int(data.written.size)
    pair = ClockPair(0, int(data.events["ts"].min()) if data.events.size else 0, 0, "none (raw buffer)")
    src = Source(
        "device",
        "device",
        [f"program {r}" for r in range(n_rings)],
        data.events,
        data.lost,
        [pair],
        gpu_freq_ghz or 1.0,
        "raw buffer",
    )
    from mori.viz.slots import slot_table

    return RankTrace(0, 1, "", "raw", 0, host_epoch(), {k: str(v) for k, v in slot_table().items()}, [src])


def _as_traces(obj: Any, gpu_freq_ghz: float | None) -> list[RankTrace]:
    func = "export_to_perfetto"
    if isinstance(obj, RankTrace):
        return [obj]
    if isinstance(obj, TraceBuffer):
        return [capture([obj], host=True)]
    if isinstance(obj, (str, os.PathLike)):
        return load_traces(obj)
    if isinstance(obj, np.ndarray):
        return [_raw_trace(obj, gpu_freq_ghz)]
    if hasattr(obj, "detach") and hasattr(obj, "dtype"):  # a torch tensor: the raw buffer
        return [_raw_trace(obj.detach().to("cpu").numpy().copy(), gpu_freq_ghz)]
    if isinstance(obj, Iterable):
        items = list(obj)
        if not items:
            raise bad_value(func, "trace_buffer", items, "at least one trace")
        bufs = [o for o in items if isinstance(o, TraceBuffer)]
        rest = [o for o in items if not isinstance(o, TraceBuffer)]
        out = [capture(bufs, host=True)] if bufs else []
        for o in rest:
            out += _as_traces(o, gpu_freq_ghz)
        return out
    raise bad_type(
        func,
        "trace_buffer",
        obj,
        "a TraceBuffer, a RankTrace, a path to saved traces, a raw int64 buffer, or a list of these",
    )


def export_to_perfetto(
    trace_buffer: Any,
    filename: str | os.PathLike[str] = "trace.json",
    slot_map: Mapping[int, str] | None = None,
    gpu_freq_ghz: float | None = None,
    validate_pairs: bool = True,
    sanitize_orphans: bool = True,
    *,
    format: str | None = None,
) -> ExportReport:
    """Write a trace for ui.perfetto.dev to ``filename``; return what was written.

    ``trace_buffer``: a :class:`~mori.viz.buffer.TraceBuffer` (read now, with this process's host
    spans), a :class:`~mori.viz.trace.RankTrace`, a path to saved rank traces (a file or a
    directory of them), a raw int64 buffer (tensor or array; no clock pairs, so one rank and its
    own ticks), or a list of any of these: several ranks on one timeline.
    ``slot_map``: ``{slot id: name}`` overriding the slot table (names ``"group/name"`` or plain).
    ``gpu_freq_ghz``: the device trace clock's rate (ticks per ns), instead of the one fitted from
    the clock pairs or the nominal one (1.0 for ``%globaltimer``, 0.1 for AMD's wall clock).
    ``validate_pairs`` / ``sanitize_orphans``: see :mod:`mori.viz.timeline`.
    ``format``: ``"json"`` (Chrome trace JSON) or ``"proto"`` (Perfetto protobuf); by default
    from the file name (``.json``; ``.pftrace``, ``.perfetto-trace``, ``.pb``, ``.proto``).
    Raises :class:`~mori.viz.timeline.TraceFormatError` when events do not pair up as asked.
    """
    func = "export_to_perfetto"
    if not isinstance(filename, (str, os.PathLike)):
        raise bad_type(func, "filename", filename, "a path")
    path = Path(filename)
    if format is None:
        suffix = path.suffix.lower()
        if suffix not in FORMATS:
            raise bad_value(
                func, "filename", str(path), f"a name ending in one of {', '.join(FORMATS)} (or pass format=)"
            )
        format = FORMATS[suffix]
    if format not in ("json", "proto"):
        raise bad_value(func, "format", format, "'json' or 'proto'")
    for name, v in (("validate_pairs", validate_pairs), ("sanitize_orphans", sanitize_orphans)):
        if not isinstance(v, bool):
            raise bad_type(func, name, v, "a bool")
    if slot_map is not None and not isinstance(slot_map, Mapping):
        raise bad_type(func, "slot_map", slot_map, "None or a mapping {slot id: name}")
    traces = _as_traces(trace_buffer, gpu_freq_ghz)
    tl_ = build_timeline(
        traces,
        slot_map=slot_map,
        gpu_freq_ghz=gpu_freq_ghz,
        validate_pairs=validate_pairs,
        sanitize_orphans=sanitize_orphans,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    if format == "json":
        write_chrome_json(tl_, path, traces)
    else:
        write_perfetto_proto(tl_, path, traces)
    return ExportReport(
        path,
        format,
        sorted({t.rank for t in traces}),
        len(tl_.tracks),
        len(tl_.spans),
        len(tl_.instants),
        sum(tl_.dropped.values()),
        len(tl_.orphans),
        sum(tl_.lost.values()),
        tl_.clock,
        tl_.alignment,
    )


# -- shared naming ------------------------------------------------------------------------------------


def _process_names(traces: Sequence[RankTrace]) -> dict[int, str]:
    out = {}
    for t in traces:
        devices = sorted({s.device for s in t.sources if s.kind == "device" and s.device})
        where = f" on {t.hostname}" if t.hostname else ""
        out[t.rank] = f"rank {t.rank}{where}" + (f" ({', '.join(devices)})" if devices else "")
    return out


def _track_order(tl_: Timeline) -> list[int]:
    # device tracks first (by source, then ring), then host threads
    return sorted(
        range(len(tl_.tracks)),
        key=lambda i: (
            tl_.tracks[i].rank,
            tl_.tracks[i].kind != "device",
            tl_.tracks[i].source,
            tl_.tracks[i].ring,
        ),
    )


def _tid(i: int) -> int:
    return i + 1  # Chrome JSON: tid 0 is avoided (some viewers treat it as the process itself)


# -- Chrome trace JSON ------------------------------------------------------------------------------


def _us(ns: int) -> float:
    return round(ns / 1000.0, 3)


def write_chrome_json(tl_: Timeline, path: Path, traces: Sequence[RankTrace]) -> None:
    """Write ``tl_`` as Chrome trace JSON (the ``traceEvents`` object form)."""
    events: list[dict[str, Any]] = []
    for rank, name in sorted(_process_names(traces).items()):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": name}})
        events.append(
            {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}}
        )
    for order, i in enumerate(_track_order(tl_)):
        tr = tl_.tracks[i]
        tid = _tid(i)
        events.append(
            {"ph": "M", "name": "thread_name", "pid": tr.rank, "tid": tid, "args": {"name": tr.name}}
        )
        events.append(
            {
                "ph": "M",
                "name": "thread_sort_index",
                "pid": tr.rank,
                "tid": tid,
                "args": {"sort_index": order},
            }
        )
    labels: dict[int, tuple[str, str]] = {}  # slot -> (name, group), computed once per slot

    def label(slot: int) -> tuple[str, str]:
        if slot not in labels:
            labels[slot] = tl_.slot_label(slot)
        return labels[slot]

    for sp in tl_.spans:
        name, cat = label(sp.slot)
        tr = tl_.tracks[sp.track]
        events.append(
            {
                "ph": "X",
                "name": name,
                "cat": cat,
                "ts": _us(sp.start_ns),
                "dur": _us(sp.end_ns - sp.start_ns),
                "pid": tr.rank,
                "tid": _tid(sp.track),
                "args": {"launch": sp.launch, "slot": sp.slot},
            }
        )
    for ins in tl_.instants:
        name, cat = label(ins.slot)
        tr = tl_.tracks[ins.track]
        events.append(
            {
                "ph": "i",
                "s": "t",
                "name": name,
                "cat": cat,
                "ts": _us(ins.ts_ns),
                "pid": tr.rank,
                "tid": _tid(ins.track),
                "args": {"launch": ins.launch, "slot": ins.slot},
            }
        )
    for o in tl_.orphans:
        name, cat = label(o.slot)
        tr = tl_.tracks[o.track]
        events.append(
            {
                "ph": "B" if o.kind == "begin" else "E",
                "name": name,
                "cat": cat,
                "ts": _us(o.ts_ns),
                "pid": tr.rank,
                "tid": _tid(o.track),
                "args": {"launch": o.launch, "slot": o.slot, "orphan": True},
            }
        )
    doc = {
        "traceEvents": events,
        "displayTimeUnit": "ns",
        "otherData": {
            "producer": "mori.viz",
            "clock": tl_.clock,
            "origin_ns": tl_.origin_ns,
            "alignment": tl_.alignment,
            "orphans_dropped": sum(tl_.dropped.values()),
            "events_lost": sum(tl_.lost.values()),
        },
    }
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        json.dump(doc, fh, separators=(",", ":"))
    tmp.replace(path)


# -- Perfetto protobuf --------------------------------------------------------------------------------

_SEQUENCE_ID = 0x4D56  # trusted_packet_sequence_id of every packet ("MV")


def _perfetto() -> Any:
    try:
        from perfetto.trace_builder.proto_builder import TraceProtoBuilder
    except ImportError as e:
        raise MoriValueError(
            "export_to_perfetto: the protobuf format needs the perfetto package (pip install perfetto); "
            "or write Chrome JSON (a .json file name)"
        ) from e
    return TraceProtoBuilder


def write_perfetto_proto(tl_: Timeline, path: Path, traces: Sequence[RankTrace]) -> None:
    """Write ``tl_`` as a Perfetto protobuf trace (``Trace`` of ``TracePacket``)."""
    builder = _perfetto()()
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import TracePacket, TrackEvent

    # uuids: processes 1..n, tracks after them
    proc_uuid = {rank: 1 + k for k, rank in enumerate(sorted({t.rank for t in traces}))}
    names = _process_names(traces)
    first = True

    def packet() -> Any:
        nonlocal first
        p = builder.add_packet()
        p.trusted_packet_sequence_id = _SEQUENCE_ID
        if first:
            p.sequence_flags = TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
            first = False
        return p

    for rank, uuid in proc_uuid.items():
        p = packet()
        p.track_descriptor.uuid = uuid
        p.track_descriptor.process.pid = rank + 1  # pid 0 is reserved in Perfetto
        p.track_descriptor.process.process_name = names.get(rank, f"rank {rank}")
    track_uuid = {}
    for order, i in enumerate(_track_order(tl_)):
        tr = tl_.tracks[i]
        uuid = len(proc_uuid) + 1 + i
        track_uuid[i] = uuid
        p = packet()
        d = p.track_descriptor
        d.uuid = uuid
        d.parent_uuid = proc_uuid[tr.rank]
        d.name = tr.name
        d.child_ordering = d.EXPLICIT if hasattr(d, "EXPLICIT") else 0
        d.sibling_order_rank = order

    def event(ts: int, kind: Any, track: int, slot: int, launch: int, name: str | None = None) -> None:
        p = packet()
        p.timestamp = ts
        e = p.track_event
        e.type = kind
        e.track_uuid = track_uuid[track]
        if kind != TrackEvent.TYPE_SLICE_END:
            n, cat = tl_.slot_label(slot)
            e.name = name or n
            e.categories.append(cat)
            a = e.debug_annotations.add()
            a.name = "launch"
            a.int_value = launch
            a = e.debug_annotations.add()
            a.name = "slot"
            a.int_value = slot

    # Per track in the order the events were written (a next-span's end before its begin): the
    # slice stack Perfetto rebuilds is then the one recorded, even for spans of zero duration.
    marks: list[tuple[int, int, int, int, Any, int, int, str | None]] = []
    for sp in tl_.spans:
        marks.append(
            (sp.track, sp.begin_seq, 1, sp.start_ns, TrackEvent.TYPE_SLICE_BEGIN, sp.slot, sp.launch, None)
        )
        marks.append(
            (sp.track, sp.end_seq, 0, sp.end_ns, TrackEvent.TYPE_SLICE_END, sp.slot, sp.launch, None)
        )
    for ins in tl_.instants:
        marks.append((ins.track, ins.seq, 2, ins.ts_ns, TrackEvent.TYPE_INSTANT, ins.slot, ins.launch, None))
    for o in tl_.orphans:  # unpaired markers would break the slice stack: show them as instants
        n, _ = tl_.slot_label(o.slot)
        marks.append(
            (o.track, o.seq, 2, o.ts_ns, TrackEvent.TYPE_INSTANT, o.slot, o.launch, f"{n} (orphan {o.kind})")
        )
    marks.sort(key=lambda m: (m[0], m[1], m[2]))
    for track, _, _, ts, kind, slot, launch, name in marks:
        event(ts, kind, track, slot, launch, name)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(builder.serialize())
    tmp.replace(path)

"""export_to_perfetto: Chrome JSON against a JSON schema, the protobuf decoded with Perfetto's own
schema, saved traces, and the ``mori viz`` commands (through the real ``mori`` entry point)."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest

from mori import viz
from mori.core import cli as mori_cli
from mori.viz import layout, slots
from mori.viz.clock import ClockPair
from mori.viz.timeline import TraceFormatError, build_timeline


def _load(name: str):  # type: ignore[no-untyped-def]
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


syn = _load("_synthetic")
B, E, INS, N = syn.B, syn.E, syn.INS, syn.N
S = slots.declare_slots("test.export", ["kernel", "send", "fence", "sent"])
SCHEMA = json.loads(Path(__file__).with_name("chrome_trace.schema.json").read_text())


def _traces() -> list[Any]:
    """Two ranks, two programs each and a host thread on rank 0; rank 1's device clock runs
    1 ms ahead of its host clock (the pairs say so)."""
    k, s, f, sent = S.kernel.value, S.send.value, S.fence.value, S.sent.value

    def prog(t: int) -> list[tuple[int, int, int]]:
        return [
            (t, B, k),
            (t + 10, B, s),
            (t + 30, INS, sent),
            (t + 40, N, f),
            (t + 45, E, f),
            (t + 50, E, k),
        ]

    r0 = syn.rank_trace(0, [syn.device_source({0: prog(1_000), 1: prog(1_005)})])
    off = 1_000_000
    dev1 = syn.device_source({0: prog(1_020 + off), 1: prog(1_025 + off)}, [ClockPair(0, off, 0, "ping")])
    host = syn.device_source({0: [(900, B, k), (1_200, E, k)]}, name="host")
    host.kind = "host"
    host.clock_pairs = []
    host.ring_names = ["MainThread (tid 1)"]
    return [syn.rank_trace(0, [r0.sources[0], host]), syn.rank_trace(1, [dev1])]


def test_chrome_json_is_valid_and_holds_the_timeline(tmp_path: Path) -> None:
    traces = _traces()
    report = viz.export_to_perfetto(traces, tmp_path / "t.json")
    doc = json.loads((tmp_path / "t.json").read_text())
    jsonschema.validate(doc, SCHEMA)
    assert report.format == "json" and report.ranks == [0, 1]
    assert (report.tracks, report.spans, report.instants) == (5, 13, 4)

    events = doc["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert procs[0].startswith("rank 0") and procs[1].startswith("rank 1")
    for e in events:
        if e["ph"] in "Xi":
            assert (e["pid"], e["tid"]) in names, f"event on a track without a name: {e}"
    # the spans are the timeline's, in µs
    tl = build_timeline(traces)
    got = sorted(
        (e["pid"], names[(e["pid"], e["tid"])], e["name"], e["ts"], e["dur"])
        for e in events
        if e["ph"] == "X"
    )
    want = sorted(
        (
            tl.tracks[x.track].rank,
            tl.tracks[x.track].name,
            tl.slot_label(x.slot)[0],
            x.start_ns / 1000,
            (x.end_ns - x.start_ns) / 1000,
        )
        for x in tl.spans
    )
    assert got == want
    kernel0 = [
        e
        for e in events
        if e["ph"] == "X" and e["name"] == "kernel" and e["pid"] == 0 and "program 0" in names[(0, e["tid"])]
    ]
    kernel1 = [
        e
        for e in events
        if e["ph"] == "X" and e["name"] == "kernel" and e["pid"] == 1 and "program 0" in names[(1, e["tid"])]
    ]
    assert kernel1[0]["ts"] - kernel0[0]["ts"] == pytest.approx(
        0.020
    )  # 20 ns: rank 1's 1 ms offset is undone
    host = [e for e in events if e["ph"] == "X" and "MainThread" in names[(e["pid"], e["tid"])]]
    assert host and host[0]["ts"] == 0 and host[0]["dur"] == 0.3
    assert [e["cat"] for e in events if e["ph"] == "X" and e["name"] == "send"] == ["test.export"] * 4


def test_protobuf_decodes_with_perfettos_schema_into_the_same_slices(tmp_path: Path) -> None:
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace, TracePacket, TrackEvent

    traces = _traces()
    report = viz.export_to_perfetto(traces, tmp_path / "t.pftrace")
    assert report.format == "proto"
    trace = Trace.FromString((tmp_path / "t.pftrace").read_bytes())
    packets = list(trace.packet)
    assert all(p.trusted_packet_sequence_id == packets[0].trusted_packet_sequence_id for p in packets)
    assert packets[0].sequence_flags & TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
    descs = [p.track_descriptor for p in packets if p.HasField("track_descriptor")]
    procs = {d.uuid: d.process for d in descs if d.HasField("process")}
    tracks = {d.uuid: d for d in descs if not d.HasField("process")}
    assert len(procs) == 2 and len(tracks) == 5 and len({d.uuid for d in descs}) == len(descs)
    assert {p.process_name.split(" on")[0].split(" (")[0] for p in procs.values()} == {"rank 0", "rank 1"}
    assert all(d.parent_uuid in procs for d in tracks.values())

    # rebuild slices from begin/end per track: they must nest and match the timeline's spans
    stacks: dict[int, list[tuple[str, int]]] = defaultdict(list)
    slices, instants, last_ts = [], [], {}
    for p in packets:
        if not p.HasField("track_event"):
            continue
        ev, u = p.track_event, p.track_event.track_uuid
        assert u in tracks and p.timestamp >= last_ts.get(u, 0)
        last_ts[u] = p.timestamp
        if ev.type == TrackEvent.TYPE_SLICE_BEGIN:
            assert ev.categories[0] == "test.export"
            assert {a.name for a in ev.debug_annotations} == {"launch", "slot"}
            stacks[u].append((ev.name, p.timestamp))
        elif ev.type == TrackEvent.TYPE_SLICE_END:
            name, start = stacks[u].pop()
            slices.append((tracks[u].name, name, start, p.timestamp))
        else:
            assert ev.type == TrackEvent.TYPE_INSTANT
            instants.append((tracks[u].name, ev.name, p.timestamp))
    assert not any(stacks.values())
    tl = build_timeline(traces)
    assert sorted(slices) == sorted(
        (tl.tracks[x.track].name, tl.slot_label(x.slot)[0], x.start_ns, x.end_ns) for x in tl.spans
    )
    assert len(instants) == 4 and all(n == "sent" for _, n, _ in instants)


def test_orphans_follow_the_options_in_both_formats(tmp_path: Path) -> None:
    k = S.kernel.value
    t = [syn.rank_trace(0, [syn.device_source({0: [(10, E, k), (20, B, k), (30, E, k), (40, B, k)]})])]
    r = viz.export_to_perfetto(t, tmp_path / "a.json")
    assert (r.spans, r.orphans_dropped, r.orphans_kept) == (1, 2, 0)
    with pytest.raises(TraceFormatError):
        viz.export_to_perfetto(t, tmp_path / "b.json", sanitize_orphans=False)
    r = viz.export_to_perfetto(t, tmp_path / "c.json", validate_pairs=False, sanitize_orphans=False)
    doc = json.loads((tmp_path / "c.json").read_text())
    jsonschema.validate(doc, SCHEMA)
    assert sorted(e["ph"] for e in doc["traceEvents"] if e["ph"] in "BE") == ["B", "E"]
    r = viz.export_to_perfetto(t, tmp_path / "c.pftrace", validate_pairs=False, sanitize_orphans=False)
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace

    names = [p.track_event.name for p in Trace.FromString((tmp_path / "c.pftrace").read_bytes()).packet]
    assert "kernel (orphan end)" in names and "kernel (orphan begin)" in names


def test_a_raw_buffer_exports_on_its_own_clock(tmp_path: Path) -> None:
    words = np.zeros(layout.buffer_words(1, 8), dtype=np.int64)
    from mori.viz.buffer import init_header

    init_header(words, 1, 8)
    base = layout.events_offset(1)
    words[base : base + 4] = [500, layout.pack_meta(B, S.send.value), 800, layout.pack_meta(E, S.send.value)]
    words[layout.HEADER_WORDS] = 2
    r = viz.export_to_perfetto(words, tmp_path / "raw.json")
    doc = json.loads((tmp_path / "raw.json").read_text())
    (x,) = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert (r.spans, x["name"], x["ts"], x["dur"]) == (1, "send", 0.0, 0.3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"filename": "t.txt"}, "filename"),
        ({"filename": "t.json", "format": "xml"}, "format"),
        ({"filename": "t.json", "validate_pairs": 1}, "validate_pairs"),
        ({"filename": "t.json", "slot_map": [1]}, "slot_map"),
    ],
)
def test_bad_export_arguments_are_refused(tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    kwargs["filename"] = tmp_path / kwargs["filename"]
    with pytest.raises((ValueError, TypeError), match=match):
        viz.export_to_perfetto(_traces(), **kwargs)
    with pytest.raises(TypeError, match="trace_buffer"):
        viz.export_to_perfetto(3, tmp_path / "t.json")


def test_saved_traces_round_trip_and_bad_files_are_named(tmp_path: Path) -> None:
    traces = _traces()
    paths = [t.save(tmp_path / "run" / f"rank{t.rank}") for t in traces]
    assert [p.name for p in paths] == ["rank0.mviz.npz", "rank1.mviz.npz"]
    back = viz.load_traces(tmp_path / "run")
    assert [t.rank for t in back] == [0, 1]
    for a, b in zip(traces, back, strict=True):
        assert [s.name for s in a.sources] == [s.name for s in b.sources]
        for sa, sb in zip(a.sources, b.sources, strict=True):
            assert np.array_equal(sa.events, sb.events) and sa.clock_pairs == sb.clock_pairs
            assert sa.ring_names == sb.ring_names and sa.kind == sb.kind
    bad = tmp_path / "bad.mviz.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(ValueError, match=r"bad\.mviz\.npz: cannot read"):
        viz.load_traces(bad)
    np.savez(tmp_path / "other.mviz.npz", meta=np.frombuffer(b'{"format": "x"}', dtype=np.uint8))
    with pytest.raises(ValueError, match=r"not a mori\.viz rank trace"):
        viz.load_traces(tmp_path / "other.mviz.npz")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no"):
        viz.load_traces(tmp_path / "empty")
    with pytest.raises(ValueError, match="does not exist"):
        viz.load_traces(tmp_path / "missing")


def test_mori_viz_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for t in _traces():
        t.save(tmp_path / "run" / f"rank{t.rank}")
    run = str(tmp_path / "run")
    # through `mori`, so the entry point (group mori.extensions) is what adds `viz`
    assert mori_cli.main(["viz", "export", run, "-o", str(tmp_path / "all.json")]) == 0
    assert "2 rank(s), 5 tracks, 13 spans" in capsys.readouterr().out
    jsonschema.validate(json.loads((tmp_path / "all.json").read_text()), SCHEMA)
    assert mori_cli.main(["viz", "export", run, "-o", str(tmp_path / "all.pb"), "--format", "proto"]) == 0
    assert (tmp_path / "all.pb").stat().st_size > 0
    capsys.readouterr()

    assert mori_cli.main(["viz", "summary", run, "--json", str(tmp_path / "s.json")]) == 0
    out = capsys.readouterr().out
    assert "test.export" in out and "fence" in out
    phases = json.loads((tmp_path / "s.json").read_text())["phases"]
    send = [p for p in phases if p["name"] == "send" and p["rank"] == 0]
    assert send[0]["spans"] == 2 and send[0]["median_ns"] == 30.0 and send[0]["max_ns"] == 30
    sent = [p for p in phases if p["name"] == "sent" and p["rank"] == 1]
    assert sent[0]["instants"] == 2 and sent[0]["spans"] == 0

    assert mori_cli.main(["viz", "plot", run, "-o", str(tmp_path / "g.png")]) == 0
    png = (tmp_path / "g.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert mori_cli.main(["viz", "plot", run, "-o", str(tmp_path / "none.png"), "--launch", "7"]) == 1
    assert "nothing to draw in launch 7" in capsys.readouterr().err
    assert mori_cli.main(["viz"]) == 2
    assert mori_cli.main(["viz", "summary", str(tmp_path / "missing")]) == 1
    capsys.readouterr()
    assert mori_cli.main(["viz", "slots", "mori.viz.examples"]) == 0
    out = capsys.readouterr().out
    assert f"{slots.slot_id('viz.example', 'kernel'):>5}  viz.example/kernel" in out
    assert mori_cli.main(["viz", "slots", "mori.no_such_module"]) == 1

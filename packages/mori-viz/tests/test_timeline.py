"""Pairing and orphan rules, and clock alignment across ranks and hosts, on hand-made traces."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from mori.viz import slots
from mori.viz.clock import ClockModel, ClockPair, HostEpoch
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
S = slots.declare_slots("test.timeline", ["outer", "a", "b", "c", "mark"])
OUTER, A, BB, C, MARK = (S.outer.value, S.a.value, S.b.value, S.c.value, S.mark.value)


def _tl(rings, **kw):  # type: ignore[no-untyped-def]
    return build_timeline([syn.rank_trace(0, [syn.device_source(rings)])], **kw)


def _spans(tl):  # type: ignore[no-untyped-def]
    return sorted((tl.slot_label(s.slot)[0], s.start_ns, s.end_ns, s.depth) for s in tl.spans)


def test_nested_spans_next_and_instants_pair_up() -> None:
    tl = _tl(
        {0: [(100, B, OUTER), (110, B, A), (120, N, BB), (125, INS, MARK), (130, E, BB), (140, E, OUTER)]}
    )
    # times are from the earliest event (100)
    assert _spans(tl) == [("a", 10, 20, 1), ("b", 20, 30, 1), ("outer", 0, 40, 0)]
    assert [(tl.slot_label(i.slot)[0], i.ts_ns) for i in tl.instants] == [("mark", 25)]
    assert not tl.orphans and not tl.dropped
    assert tl.slot_label(A) == ("a", "test.timeline")


def test_zero_length_and_equal_time_spans_keep_their_order() -> None:
    tl = _tl({0: [(5, B, OUTER), (5, B, A), (5, N, BB), (5, E, BB), (5, E, OUTER)]})
    assert [(tl.slot_label(s.slot)[0], s.begin_seq, s.end_seq, s.depth) for s in tl.spans] == [
        ("a", 1, 2, 1),
        ("b", 2, 3, 1),
        ("outer", 0, 4, 0),
    ]
    assert not tl.dropped


def test_an_end_whose_begin_was_overwritten_is_an_orphan() -> None:
    # the ring wrapped: the oldest kept event is the end of a span that began before it
    rings = {0: [(10, E, A), (20, B, BB), (30, E, BB)]}
    tl = _tl(rings)
    assert _spans(tl) == [("b", 10, 20, 0)] and tl.dropped == {0: 1}
    with pytest.raises(
        TraceFormatError, match=r"dev · program 0: end of test\.timeline/a with no such span open"
    ):
        _tl(rings, sanitize_orphans=False)
    kept = _tl(rings, sanitize_orphans=False, validate_pairs=False)
    assert [(kept.slot_label(o.slot)[0], o.kind, o.ts_ns) for o in kept.orphans] == [("a", "end", 0)]


def test_a_span_that_never_ends_is_an_orphan() -> None:
    rings = {0: [(10, B, OUTER), (20, B, A), (30, E, A)]}
    tl = _tl(rings)
    assert _spans(tl) == [("a", 10, 20, 1)] and tl.dropped == {0: 1}
    with pytest.raises(TraceFormatError, match=r"span test\.timeline/outer never ends"):
        _tl(rings, sanitize_orphans=False)


def test_a_next_with_nothing_open_begins_its_span_and_drops_the_lost_end() -> None:
    tl = _tl({0: [(10, N, BB), (20, E, BB)]})
    assert _spans(tl) == [("b", 0, 10, 0)] and tl.dropped == {0: 1}


def test_strict_nesting_rejects_an_end_of_an_outer_span() -> None:
    rings = {0: [(10, B, OUTER), (20, B, A), (30, E, OUTER), (40, E, A)]}
    with pytest.raises(
        TraceFormatError, match=r"end of test\.timeline/outer while test\.timeline/a is the innermost"
    ):
        _tl(rings, sanitize_orphans=False)
    # sanitised: a (open above outer) is orphaned by outer's end, and a's own end is an orphan too
    tl = _tl(rings)
    assert _spans(tl) == [("outer", 0, 20, 0)] and tl.dropped == {0: 2}
    # not validated: each end closes the innermost open span of its own slot
    loose = _tl(rings, validate_pairs=False)
    assert _spans(loose) == [("a", 10, 30, 1), ("outer", 0, 20, 0)] and not loose.dropped


def test_a_span_ending_before_it_begins_is_always_an_error() -> None:
    with pytest.raises(TraceFormatError, match="ends 5 ns before it begins"):
        _tl({0: [(10, B, A), (5, E, A)]})


def test_problems_are_listed_per_track() -> None:
    rings = {r: [(10, E, A)] for r in range(15)}
    with pytest.raises(TraceFormatError) as err:
        _tl(rings, sanitize_orphans=False)
    text = str(err.value)
    assert "first 10" in text and "program 0:" in text and "program 9:" in text and "program 14" not in text


def test_unknown_slots_show_by_number() -> None:
    tl = _tl({0: [(1, INS, 16000)]})
    assert tl.slot_label(16000) == ("slot 16000", "unknown")
    tl = _tl({0: [(1, INS, 16000)]}, slot_map={16000: "mine/custom"})
    assert tl.slot_label(16000) == ("custom", "mine")


# -- clocks -----------------------------------------------------------------------------------------


def test_clock_model_fits_the_rate_only_when_the_pairs_measure_it() -> None:
    a, b = ClockPair(1_000, 5_000, 10, "ping"), ClockPair(1_001_000, 5_000 + 1_000_100, 10, "ping")
    fit = ClockModel.from_pairs([a, b], nominal_ghz=1.0)
    assert fit.fitted and fit.ns_per_tick == pytest.approx(1_000_000 / 1_000_100)
    assert fit.to_host(5_000 + 1_000_100) == 1_001_000
    # brackets too wide for the distance: nominal rate through the better pair
    wide = ClockModel.from_pairs(
        [ClockPair(0, 0, 100, "launch"), ClockPair(1_000_000, 1_000_100, 5, "launch")], 1.0
    )
    assert not wide.fitted and wide.ns_per_tick == 1.0 and wide.to_host(1_000_100) == 1_000_000
    # an implausible rate (40% off the nominal clock) is not believed
    odd = ClockModel.from_pairs([a, ClockPair(1_001_000, 5_000 + 1_400_000, 10, "ping")], 1.0)
    assert not odd.fitted
    # a given rate wins
    given = ClockModel.from_pairs([a, b], 1.0, override_ghz=0.5)
    assert given.ns_per_tick == 2.0 and not given.fitted
    with pytest.raises(ValueError, match="at least one clock pair"):
        ClockModel.from_pairs([], 1.0)


def _two_rank_message(host_b: str, epoch_b: HostEpoch, mono_shift_b: int):  # type: ignore[no-untyped-def]
    """Rank 0 sends at host time 1_000_000 ns (its device clock is 5 ms ahead of its host clock);
    rank 1 receives 2 µs later by real time, its device clock 1 ms behind and 100 ppm fast, its
    host clock ``mono_shift_b`` ahead of rank 0's (another host)."""
    t_send, t_recv = 1_000_000, 1_002_000
    dev0 = lambda h: h + 5_000_000  # noqa: E731
    dev1 = lambda h: round((h + mono_shift_b - 1_000_000) * 1.0001)  # noqa: E731
    pairs0 = [ClockPair(h, dev0(h), 1_000, "ping") for h in (0, 2_000_000_000)]
    pairs1 = [ClockPair(h + mono_shift_b, dev1(h), 1_000, "ping") for h in (0, 2_000_000_000)]
    r0 = syn.rank_trace(0, [syn.device_source({0: [(dev0(t_send), INS, MARK)]}, pairs0)])
    r1 = syn.rank_trace(
        1, [syn.device_source({0: [(dev1(t_recv), INS, MARK)]}, pairs1)], host_id=host_b, epoch=epoch_b
    )
    return r0, r1


def _ts_by_rank(tl) -> dict[int, int]:  # type: ignore[no-untyped-def]
    return {tl.tracks[i.track].rank: i.ts_ns for i in tl.instants}


def test_ranks_of_one_host_meet_on_its_monotonic_clock() -> None:
    r0, r1 = _two_rank_message("host-a", r_epoch := HostEpoch(1_700_000_000_000_000_000, 0, 0), 0)
    assert r_epoch == r0.epoch
    # raw device ticks put the receive 6 ms before the send
    assert r1.sources[0].events["ts"][0] < r0.sources[0].events["ts"][0]
    tl = build_timeline([r0, r1])
    ts = _ts_by_rank(tl)
    assert tl.clock == "CLOCK_MONOTONIC of host-a"
    # within the pairs' brackets (1 µs each) of the true 2 µs
    assert abs((ts[1] - ts[0]) - 2_000) <= 2_000 and ts[1] > ts[0]
    assert {a["rank"]: a["rate_fitted"] for a in tl.alignment} == {0: True, 1: True}


def test_ranks_of_two_hosts_meet_on_the_wall_clock() -> None:
    # host b's monotonic clock is 123 s ahead of host a's; both wall clocks agree
    shift = 123_000_000_000
    epoch_b = HostEpoch(1_700_000_000_000_000_000, shift, 0)
    r0, r1 = _two_rank_message("host-b", epoch_b, shift)
    tl = build_timeline([r0, r1])
    ts = _ts_by_rank(tl)
    assert tl.clock == "CLOCK_REALTIME"
    assert abs((ts[1] - ts[0]) - 2_000) <= 2_000 and ts[1] > ts[0]
    # taken as one host, the 123 s shift would not be undone
    wrong = build_timeline([r0, syn.rank_trace(1, r1.sources, host_id="host-a", epoch=epoch_b)])
    assert abs(_ts_by_rank(wrong)[1] - _ts_by_rank(wrong)[0]) > 100_000_000_000


def test_a_device_source_without_pairs_cannot_be_aligned() -> None:
    src = syn.device_source({0: [(1, INS, MARK)]}, pairs=[])
    with pytest.raises(ValueError, match="no clock pairs"):
        build_timeline([syn.rank_trace(0, [src])])


def test_bad_rate_argument_is_refused() -> None:
    with pytest.raises(ValueError, match="gpu_freq_ghz"):
        _tl({0: [(1, INS, MARK)]}, gpu_freq_ghz=0.0)

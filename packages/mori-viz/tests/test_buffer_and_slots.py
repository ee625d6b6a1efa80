"""The buffer layout, the event word, slot declarations and ring parsing (host only, no kernels)."""

from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mori.core.errors import MoriValueError
from mori.viz import layout, slots
from mori.viz.buffer import TraceBuffer, init_header, parse_rings


@given(
    kind=st.integers(0, 3),
    slot=st.integers(1, layout.MAX_SLOT),
    warp=st.integers(0, 0xFFFF),
    launch=st.integers(0, 0xFFFFFFFF),
)
def test_meta_word_round_trips_every_field(kind: int, slot: int, warp: int, launch: int) -> None:
    meta = layout.pack_meta(kind, slot, warp, launch)
    assert -(1 << 63) <= meta < 1 << 63  # fits the int64 the buffer stores
    assert layout.unpack_meta(meta) == (kind, slot, warp, launch)


def test_meta_fields_sit_where_the_original_put_them() -> None:
    # type[0:2], slot[2:16], warp[16:32] (the original's), launch[32:64] (ours)
    assert layout.pack_meta(2, 1, 0, 0) == 2 | (1 << 2)
    assert layout.pack_meta(0, 0, 1, 0) == 1 << 16
    assert layout.pack_meta(0, 0, 0, 1) == 1 << 32


# -- slots ------------------------------------------------------------------------------------------


def test_slot_ids_depend_on_names_only() -> None:
    ns = slots.declare_slots("test.ids", ["alpha", "beta"])
    for name in ("alpha", "beta"):
        want = zlib.crc32(f"test.ids/{name}".encode()) % layout.MAX_SLOT + 1
        assert getattr(ns, name).value == want == slots.slot_id("test.ids", name)
    # declaring again (a reload), in another order and with more names, keeps every id
    again = slots.declare_slots("test.ids", ["gamma", "beta", "alpha"])
    assert again.alpha.value == ns.alpha.value and again.beta.value == ns.beta.value
    table = slots.slot_table()
    assert str(table[ns.alpha.value]) == "test.ids/alpha"
    assert table[again.gamma.value].group == "test.ids" and table[again.gamma.value].name == "gamma"
    assert ns.GROUP == "test.ids" and ns.NAMES == ("alpha", "beta")


def test_two_names_with_one_id_are_refused_naming_both() -> None:
    # find two slot names of one group that fold to the same id (a birthday search: ~160 tries)
    seen: dict[int, str] = {}
    for i in itertools.count():
        name = f"n{i}"
        sid = slots.slot_id("test.collide", name)
        if sid in seen:
            first, second = seen[sid], name
            break
        seen[sid] = name
    slots.declare_slots("test.collide", [first])
    with pytest.raises(MoriValueError, match=rf"test.collide/{second} has id {sid}.*test.collide/{first}"):
        slots.declare_slots("test.collide", [second])
    assert str(slots.slot_table()[sid]) == f"test.collide/{first}"  # the table is unchanged


@pytest.mark.parametrize(
    ("group", "names", "match"),
    [
        ("bad group", ["a"], "group"),
        ("", ["a"], "group"),
        (3, ["a"], "group"),
        ("ok", ["_private"], "names"),
        ("ok", ["has space"], "names"),
        ("ok", ["GROUP"], "names"),
        ("ok", [], "names"),
        ("ok", ["a", "a"], "each name once"),
        ("ok", [f"s{i}" for i in range(slots.MAX_SLOTS_PER_GROUP + 1)], "at most"),
    ],
)
def test_bad_declarations_name_the_argument(group: object, names: list[str], match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        slots.declare_slots(group, names)  # type: ignore[arg-type]


def test_space_separated_names_are_a_list() -> None:
    ns = slots.declare_slots("test.spaces", "one two  three")
    assert ns.NAMES == ("one", "two", "three")


# -- parsing ----------------------------------------------------------------------------------------


def _buffer(n_rings: int, capacity: int) -> np.ndarray:
    words = np.zeros(layout.buffer_words(n_rings, capacity), dtype=np.int64)
    init_header(words, n_rings, capacity)
    return words


def _write(words: np.ndarray, ring: int, events: list[tuple[int, int, int]]) -> None:
    """Append (ts, kind, slot) events to a ring the way a writer does."""
    n_rings, cap = int(words[layout.H_RINGS]), int(words[layout.H_CAPACITY])
    count = layout.HEADER_WORDS + ring * layout.RING_WORDS
    base = layout.events_offset(n_rings) + ring * cap * layout.EVENT_WORDS
    for ts, kind, slot in events:
        n = int(words[count])
        p = base + (n % cap) * layout.EVENT_WORDS
        words[p] = ts
        words[p + 1] = layout.pack_meta(kind, slot, 0, int(words[count + 1]))
        words[count] = n + 1


def test_parse_keeps_the_newest_events_of_a_full_ring_in_order() -> None:
    words = _buffer(3, 4)
    _write(words, 0, [(10 + i, layout.INSTANT, 1 + i) for i in range(10)])  # wraps twice
    _write(words, 2, [(5, layout.BEGIN, 7), (6, layout.END, 7)])
    data = parse_rings(words)
    assert data.written.tolist() == [10, 0, 2] and data.lost.tolist() == [6, 0, 0]
    ring0 = data.events[data.events["ring"] == 0]
    assert ring0["seq"].tolist() == [6, 7, 8, 9]  # the last 4 of 10, oldest first
    assert ring0["ts"].tolist() == [16, 17, 18, 19] and ring0["slot"].tolist() == [7, 8, 9, 10]
    ring2 = data.events[data.events["ring"] == 2]
    assert ring2["kind"].tolist() == [layout.BEGIN, layout.END] and ring2["ts"].tolist() == [5, 6]


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda w: w.__setitem__(0, 1), "not a mori.viz trace buffer"),
        (lambda w: w.__setitem__(layout.H_VERSION, 99), "layout version 99"),
        (lambda w: w.__setitem__(layout.H_CAPACITY, 3), "bad header"),
        (lambda w: w.__setitem__(layout.H_RINGS, 5), "words"),
        (lambda w: w.__setitem__(layout.HEADER_WORDS, -4), "negative event counts"),
    ],
)
def test_a_damaged_buffer_is_refused_by_name(damage: object, match: str) -> None:
    words = _buffer(2, 8)
    damage(words)  # type: ignore[operator]
    with pytest.raises(MoriValueError, match=match):
        parse_rings(words, what="test buffer")


def test_parse_refuses_other_arrays() -> None:
    with pytest.raises(MoriValueError, match="1-D int64"):
        parse_rings(np.zeros(16, dtype=np.int32))
    with pytest.raises(MoriValueError, match="no MORIVIZ1 header"):
        parse_rings(np.zeros(3, dtype=np.int64))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_rings": 0}, "n_rings"),
        ({"n_rings": layout.MAX_RINGS + 1}, "n_rings"),
        ({"capacity": 1000}, "power of two"),
        ({"capacity": 1}, "power of two"),
        ({"n_rings": 65536, "capacity": 1 << 14}, "at most 4 GiB"),
        ({"name": ""}, "name"),
        ({"rank": -1}, "rank"),
    ],
)
def test_trace_buffer_arguments_are_checked(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        TraceBuffer(**{"device": "cpu", "calibrate": False, **kwargs})  # type: ignore[arg-type]


def test_trace_buffer_layout_and_reset() -> None:
    buf = TraceBuffer(n_rings=3, capacity=8, device="cpu", rank=2, name="ep", calibrate=False)
    words = buf.tensor.numpy()
    # padded for the kernels' header loads, which read a ring's row before they know n_rings
    assert words.size == layout.device_words(3, 8) == layout.MIN_DEVICE_WORDS > layout.buffer_words(3, 8)
    assert buf.words().size == layout.buffer_words(3, 8), "the host copy leaves the padding out"
    assert words[: layout.HEADER_WORDS].tolist()[:4] == [layout.MAGIC, layout.VERSION, 3, 8]
    assert (layout.events_offset(3) * 8) % 16 == 0  # events start 16-byte aligned within the buffer
    _write(words, 1, [(1, layout.INSTANT, 5)])
    assert buf.read().written.tolist() == [0, 1, 0]
    buf.reset()
    assert buf.read().written.tolist() == [0, 0, 0] and buf.read().events.size == 0


def test_the_originals_debug_time_names_read_an_operators_buffer() -> None:
    import types

    from mori import cpp
    from mori.core.errors import MoriStateError

    op = types.SimpleNamespace(trace_buffer=None)
    with pytest.raises(MoriStateError, match="enable_tracing"):
        cpp.get_debug_time_buf(op)
    with pytest.raises(TypeError, match="op has type object"):
        cpp.get_debug_time_offset(object())
    op.trace_buffer = TraceBuffer(n_rings=3, capacity=8, device="cpu", calibrate=False)
    words = cpp.get_debug_time_buf(op)
    assert words.data_ptr() == op.trace_buffer.tensor.data_ptr(), "a view of the operator's buffer"
    _write(words.numpy(), 2, [(1, layout.BEGIN, 5), (2, layout.END, 5)])
    assert cpp.get_debug_time_offset(op).tolist() == [0, 0, 2]
    group = slots.declare_slots("test.debug_time", ["phase_a"])
    assert cpp.ALL_PROFILER_SLOTS[group.phase_a.value] == ("test.debug_time", "phase_a")


def test_every_installed_kernel_module_declares_slots_that_fold_apart() -> None:
    # Slot ids fold names into 14 bits; a collision between two packages' groups surfaces only
    # when both modules are imported into one process (ccl.gather/finish and ep.dispatch/wait_ready
    # once did): import them all here.
    import importlib
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        pytest.skip("kernel modules need Triton")
    modules = ["mori.viz.examples", "mori.ep.kernels", "mori.ccl.kernels"]
    found = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:  # its distribution is not installed here
            if not (e.name or "").startswith(("mori.ep", "mori.ccl", "mori.cco")):
                raise
            continue
        found.append(name)
    assert "mori.viz.examples" in found
    groups = {info.group for info in slots.slot_table().values()}
    assert {"ep.dispatch", "ccl.allreduce"} <= groups or len(found) < 3, groups

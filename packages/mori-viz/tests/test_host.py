"""Host spans: Python threads, the limits on rings, and native threads writing through
``mori_viz/host_trace.h`` (compiled here with the system C++ compiler)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import threading
import time

import pytest

from mori import viz
from mori.viz import host, layout, slots
from mori.viz.timeline import build_timeline
from mori.viz.trace import capture


@pytest.fixture(autouse=True)
def _no_recorder_left() -> object:
    yield
    viz.stop_host_recording()


def test_spans_record_only_while_recording() -> None:
    with viz.span("before"):
        viz.instant("before")
    assert host.recorder() is None
    rec = viz.record_host(capacity=64)

    @viz.traced()
    def work(x: int) -> int:
        viz.instant("inside")
        return x + 1

    with viz.span("outer", group="test.host"):
        assert work(1) == 2
    viz.stop_host_recording()
    with viz.span("after"):
        pass
    (ring,) = rec.rings()
    d = ring.read()
    names = [str(slots.slot_table()[s]) for s in d.events["slot"].tolist()]
    q = "python/test_spans_record_only_while_recording.<locals>.work"
    assert names == ["test.host/outer", q, "python/inside", q, "test.host/outer"]
    assert d.events["kind"].tolist() == [layout.BEGIN, layout.BEGIN, layout.INSTANT, layout.END, layout.END]
    assert "MainThread" in ring.name


def test_each_thread_gets_its_ring_and_the_number_of_rings_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(host, "MAX_RINGS", 3)
    rec = viz.record_host(capacity=16)
    viz.instant("main")

    def worker() -> None:
        with viz.span("work"):
            pass

    threads = [threading.Thread(target=worker, name=f"worker-{i}") for i in range(4)]
    for t in threads:
        t.start()
        t.join()
    rings = rec.rings()
    assert len(rings) == 3 and rec.dropped_threads == 2
    assert [r.name.split(" ")[0] for r in rings] == ["MainThread", "worker-0", "worker-1"]
    assert all(r.read().events.size == 2 for r in rings[1:])
    # native rings: their own limit per process
    monkeypatch.setattr(host, "_native", {})
    for i in range(3):
        host.native_ring(f"native-{i}")
    assert host.native_ring("native-0") is host.native_ring("native-0"), "one ring per name"
    with pytest.raises(ValueError, match="3 native rings already"):
        host.native_ring("native-3")


def test_a_full_host_ring_keeps_its_newest_events() -> None:
    rec = viz.record_host(capacity=4)
    for i in range(10):
        viz.instant(f"i{i}")
    d = rec.rings()[0].read()
    assert d.lost.tolist() == [6]
    assert [str(slots.slot_table()[s]).split("/")[1] for s in d.events["slot"].tolist()] == [
        "i6",
        "i7",
        "i8",
        "i9",
    ]


_NATIVE = r"""
#include <mori_viz/host_trace.h>
#include <thread>

extern "C" unsigned short native_slot_id(const char* group, const char* name) {
  return mori_viz::slot_id(group, name);
}

extern "C" int null_ring_enabled() {
  mori_viz::HostRing ring(0);
  ring.begin(1);  // must do nothing
  return ring.enabled() ? 1 : 0;
}

// a native thread: n spans "work" with an instant "tick" in each, then a next-span pair
extern "C" void run_thread(uintptr_t address, int n) {
  std::thread t([address, n] {
    mori_viz::HostRing ring(address);
    static const uint16_t work = mori_viz::slot_id("test.native", "work");
    static const uint16_t tick = mori_viz::slot_id("test.native", "tick");
    for (int i = 0; i < n; ++i) {
      mori_viz::Span s(ring, work);
      ring.instant(tick);
    }
    ring.begin(work);
    ring.next(tick);
    ring.end(tick);
  });
  t.join();
}
"""


@pytest.fixture(scope="module")
def native_lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.fail("no C++ compiler (g++) on PATH: the native host-trace header cannot be checked")
    d = tmp_path_factory.mktemp("native")
    (d / "native.cpp").write_text(_NATIVE)
    subprocess.run(
        [cxx, "-std=c++17", "-O2", "-Wall", "-Werror", "-shared", "-fPIC", "-pthread",
         f"-I{host.include_dir()}", str(d / "native.cpp"), "-o", str(d / "libnative.so")],
        check=True,
        capture_output=True,
        timeout=120,
    )  # fmt: skip
    lib = ctypes.CDLL(str(d / "libnative.so"))
    lib.native_slot_id.restype = ctypes.c_ushort
    lib.native_slot_id.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    lib.run_thread.argtypes = [ctypes.c_size_t, ctypes.c_int]
    return lib


@pytest.mark.parametrize(
    ("group", "name"), [("test.native", "work"), ("io.engine", "post"), ("a", "b" * 150)]
)
def test_native_slot_ids_are_pythons(native_lib: ctypes.CDLL, group: str, name: str) -> None:
    assert native_lib.native_slot_id(group.encode(), name.encode()) == slots.slot_id(group, name)


def test_a_native_thread_records_into_its_ring(native_lib: ctypes.CDLL) -> None:
    assert native_lib.null_ring_enabled() == 0
    slots.declare_slots("test.native", ["work", "tick"])
    ring = host.native_ring("proxy thread", capacity=64)
    native_lib.run_thread(ring.address, 5)  # not recording: nothing is written
    assert ring.read().written.tolist() == [0]
    viz.record_host(capacity=64)
    assert host.native_ring("proxy thread") is ring
    t0 = time.monotonic_ns()
    native_lib.run_thread(ring.address, 5)
    t1 = time.monotonic_ns()
    d = ring.read()
    assert d.written.tolist() == [5 * 3 + 3]
    ts = d.events["ts"]
    assert (t0 <= ts).all() and (ts <= t1).all(), "stamped with this process's CLOCK_MONOTONIC"
    tl = build_timeline([capture(host=True)])
    names = sorted((tl.slot_label(s.slot)[0], tl.tracks[s.track].name) for s in tl.spans)
    assert names == [("tick", "host · proxy thread")] + [("work", "host · proxy thread")] * 6
    assert len(tl.instants) == 5 and not tl.dropped
    viz.stop_host_recording()
    native_lib.run_thread(ring.address, 5)
    assert ring.read().written.tolist() == [5 * 3 + 3], "stopped: nothing more"


def test_include_dir_holds_the_header() -> None:
    assert (host.include_dir() / "mori_viz" / "host_trace.h").is_file()

"""Host spans: Python calls and native threads, on the same trace as the kernels.

Host events are stamped with ``CLOCK_MONOTONIC`` (ns) and kept in *host rings*: trace buffers of
one ring each, in ordinary host memory, with the device layout (:mod:`mori.viz.layout`), so that
one parser reads both. Every writer has its own ring, so recording takes no lock:

* **Python**: :func:`span` (a context manager), :func:`traced` (a decorator) and :func:`instant`
  record into a ring of the calling thread, made on its first event. They record only while
  :func:`record_host` is in effect; otherwise they cost one global check.
* **Native threads** (C++): :meth:`HostRecorder.native_ring` makes a ring and gives its address;
  the thread records into it with the header-only ``mori_viz/host_trace.h``
  (:func:`include_dir`), which needs neither Python nor ctypes at record time: ``clock_gettime``
  and three stores per event. Slot ids there are computed from the same names
  (``mori_viz::slot_id("io.engine", "post")``); declare the names on the Python side too
  (:func:`~mori.viz.slots.declare_slots`) so that the export can show them.

Rings are bounded: at most :data:`MAX_RINGS` per process (a thread beyond that records nothing,
and is counted in :attr:`HostRecorder.dropped_threads`), each keeps its newest ``capacity``
events. Read rings only when their writers are quiet (a snapshot taken during writes may miss the
last events, never mis-read older ones: a writer publishes its count after the event).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from mori.core.errors import MoriStateError, MoriValueError, bad_value
from mori.viz import layout
from mori.viz.buffer import RingData, _check_sizes, init_header, parse_rings
from mori.viz.slots import intern_slot

__all__ = [
    "MAX_RINGS",
    "HostRecorder",
    "HostRing",
    "include_dir",
    "instant",
    "record_host",
    "recorder",
    "span",
    "stop_host_recording",
    "traced",
]

#: most host rings per process
MAX_RINGS = 1024
#: default events per host ring
DEFAULT_CAPACITY = 16384
#: the slot group of Python spans named at run time
PYTHON_GROUP = "python"

F = TypeVar("F", bound=Callable[..., Any])

_CURSOR = layout.HEADER_WORDS  # word of ring 0's event count
_LAUNCHES = layout.HEADER_WORDS + 1
_EVENTS = layout.events_offset(1)


class HostRing:
    """One ring of host events, written by one thread. ``name``: its track's name."""

    def __init__(self, name: str, capacity: int = DEFAULT_CAPACITY, *, native: bool = False) -> None:
        _check_sizes("HostRing", 1, capacity)
        if not isinstance(name, str) or not name or len(name) > 128 or not name.isprintable():
            raise bad_value("HostRing", "name", name, "a printable str of 1 to 128 characters")
        self.name = name
        self.capacity = capacity
        self.native = native
        #: the ring's words (int64, the trace-buffer layout with one ring)
        self.words = np.zeros(layout.buffer_words(1, capacity), dtype=np.int64)
        init_header(self.words, 1, capacity)
        self.thread_id = threading.get_ident() if not native else 0

    @property
    def address(self) -> int:
        """Address of the ring's first word, for ``mori_viz::HostRing`` in native code. Valid while
        this object is alive (the recorder keeps it until the next :func:`record_host`)."""
        return int(self.words.ctypes.data)

    def record(self, kind: int, slot: int) -> None:
        """Append one event stamped now (the calling thread must be the ring's only writer)."""
        w = self.words
        n = int(w[_CURSOR])
        p = _EVENTS + (n & (self.capacity - 1)) * layout.EVENT_WORDS
        w[p] = time.monotonic_ns()
        w[p + 1] = kind | (slot << layout.SLOT_SHIFT) | (int(w[_LAUNCHES]) << layout.LAUNCH_SHIFT)
        w[_CURSOR] = n + 1  # published after the event

    def read(self) -> RingData:
        """The ring's events (see :func:`~mori.viz.buffer.parse_rings`)."""
        return parse_rings(self.words.copy(), what=f"host ring {self.name!r}")


class HostRecorder:
    """The host rings of this process while :func:`record_host` is in effect."""

    def __init__(self, capacity: int) -> None:
        _check_sizes("record_host", 1, capacity)
        self.capacity = capacity
        self._lock = threading.Lock()
        self._rings: list[HostRing] = []
        self._local = threading.local()
        #: threads that wanted a ring when MAX_RINGS existed already
        self.dropped_threads = 0

    def rings(self) -> list[HostRing]:
        """Every ring so far, in the order they were made."""
        with self._lock:
            return list(self._rings)

    def _add(self, ring: HostRing) -> bool:
        with self._lock:
            if len(self._rings) >= MAX_RINGS:
                return False
            self._rings.append(ring)
            return True

    def native_ring(self, name: str, capacity: int | None = None) -> HostRing:
        """A ring for one native thread (pass :attr:`HostRing.address` to it). Raises
        :class:`~mori.core.errors.MoriValueError` when :data:`MAX_RINGS` rings exist."""
        ring = HostRing(name, capacity or self.capacity, native=True)
        if not self._add(ring):
            raise MoriValueError(f"native_ring: this process has {MAX_RINGS} host rings already, the limit")
        return ring

    def thread_ring(self) -> HostRing | None:
        """The calling thread's ring (made on first use), or None past the limit."""
        ring: HostRing | None = getattr(self._local, "ring", None)
        if ring is None and not getattr(self._local, "dropped", False):
            t = threading.current_thread()
            ring = HostRing(f"{t.name} (tid {threading.get_native_id()})", self.capacity)
            if self._add(ring):
                self._local.ring = ring
            else:
                ring = None
                self._local.dropped = True
                with self._lock:
                    self.dropped_threads += 1
        return ring


_recorder: HostRecorder | None = None


def record_host(capacity: int = DEFAULT_CAPACITY) -> HostRecorder:
    """Start recording host spans in this process (a fresh :class:`HostRecorder`, replacing any
    earlier one); ``capacity`` events per ring (a power of two). Returns the recorder."""
    global _recorder
    _recorder = HostRecorder(capacity)
    return _recorder


def stop_host_recording() -> HostRecorder | None:
    """Stop recording; return the recorder that was in effect (its rings stay readable)."""
    global _recorder
    r, _recorder = _recorder, None
    return r


def recorder() -> HostRecorder | None:
    """The recorder in effect, or None."""
    return _recorder


def _slot_of(name: str, group: str) -> int:
    return intern_slot(group, name)


@contextmanager
def _recording_span(rec: HostRecorder, slot: int) -> Iterator[None]:
    ring = rec.thread_ring()
    if ring is None:
        yield
        return
    ring.record(layout.BEGIN, slot)
    try:
        yield
    finally:
        ring.record(layout.END, slot)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def span(name: str, group: str = PYTHON_GROUP) -> Any:
    """Context manager: a span ``name`` (slot ``group/name``) on the calling thread's track while
    :func:`record_host` is in effect; does nothing otherwise."""
    rec = _recorder
    if rec is None:
        return _nothing()
    return _recording_span(rec, _slot_of(name, group))


def instant(name: str, group: str = PYTHON_GROUP) -> None:
    """An instant event ``name`` on the calling thread's track (while recording)."""
    rec = _recorder
    if rec is None:
        return
    ring = rec.thread_ring()
    if ring is not None:
        ring.record(layout.INSTANT, _slot_of(name, group))


def traced(name: str | None = None, group: str = PYTHON_GROUP) -> Callable[[F], F]:
    """Decorator: every call of the function is a :func:`span` (named ``name``, default the
    function's qualified name)."""

    def wrap(fn: F) -> F:
        label = name if name is not None else str(getattr(fn, "__qualname__", repr(fn)))

        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            if _recorder is None:
                return fn(*args, **kwargs)
            with span(label, group):
                return fn(*args, **kwargs)

        return inner  # type: ignore[return-value]

    return wrap


def include_dir() -> Path:
    """The directory to put on a C++ include path for ``#include <mori_viz/host_trace.h>``."""
    path = Path(str(resources.files("mori.viz") / "include"))
    if not (path / "mori_viz" / "host_trace.h").is_file():
        raise MoriStateError(f"include_dir: {path}/mori_viz/host_trace.h is missing from this install")
    return path

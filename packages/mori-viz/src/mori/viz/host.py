"""Host spans: Python calls and native threads, on the same trace as the kernels.

Host events are stamped with ``CLOCK_MONOTONIC`` (ns) and kept in *host rings*: trace buffers of
one ring each, in ordinary host memory, with the device layout (:mod:`mori.viz.layout`), so that
one parser reads both. Every writer has its own ring, so recording takes no lock:

* **Python**: :func:`span` (a context manager), :func:`traced` (a decorator) and :func:`instant`
  record into a ring of the calling thread, made on its first event. They record only while
  :func:`record_host` is in effect; otherwise they cost one global check.
* **Native threads** (C++): :func:`native_ring` makes a ring and gives its address, once, when
  the thread is set up; the thread records into it with the header-only ``mori_viz/host_trace.h``
  (:func:`include_dir`), which needs neither Python nor ctypes at record time: one flag load, then
  ``clock_gettime`` and three stores per event. Native rings live as long as the process (their
  memory is never freed, so an address handed out stays valid), keep their events across
  recordings, and record only while :func:`record_host` is in effect (the ring's *recording*
  word; a skipped event costs one load). Slot ids there are computed from the same names
  (``mori_viz::slot_id("io.engine", "post")``); declare the names on the Python side too
  (:func:`~mori.viz.slots.declare_slots`) so that the export can show them.

Rings are bounded: at most :data:`MAX_RINGS` thread rings per recording (a thread beyond that
records nothing and is counted in :attr:`HostRecorder.dropped_threads`) and :data:`MAX_RINGS`
native rings per process; each keeps its newest ``capacity`` events. Read rings only when their
writers are quiet (a snapshot taken during writes may miss the last events, never mis-read older
ones: a writer publishes its count after the event).
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
    "native_ring",
    "native_rings",
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
        """Address of the ring's first word, for ``mori_viz::HostRing`` in native code (valid
        while this object lives: for the process, for rings from :func:`native_ring`)."""
        return int(self.words.ctypes.data)

    def set_recording(self, on: bool) -> None:
        """Set the ring's *recording* word, which native writers check before every event."""
        self.words[layout.H_RECORDING] = 1 if on else 0

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
        """The Python threads' rings of this recording, in the order they were made, then every
        native ring of the process."""
        with self._lock:
            mine = list(self._rings)
        return mine + native_rings()

    def _add(self, ring: HostRing) -> bool:
        with self._lock:
            if len(self._rings) >= MAX_RINGS:
                return False
            self._rings.append(ring)
            return True

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
_native_lock = threading.Lock()
_native: dict[str, HostRing] = {}


def native_ring(name: str, capacity: int = DEFAULT_CAPACITY) -> HostRing:
    """The process-wide ring ``name`` for one native thread (made on first use; the same ring for
    the same name afterwards). Pass :attr:`HostRing.address` to the thread. Raises
    :class:`~mori.core.errors.MoriValueError` when :data:`MAX_RINGS` native rings exist."""
    with _native_lock:
        ring = _native.get(name)
        if ring is None:
            if len(_native) >= MAX_RINGS:
                raise MoriValueError(
                    f"native_ring: this process has {MAX_RINGS} native rings already, the limit"
                )
            ring = HostRing(name, capacity, native=True)
            ring.set_recording(_recorder is not None)
            _native[name] = ring
        return ring


def native_rings() -> list[HostRing]:
    """Every native ring of the process, in the order they were made."""
    with _native_lock:
        return list(_native.values())


def _set_native_recording(on: bool) -> None:
    with _native_lock:
        for ring in _native.values():
            ring.set_recording(on)


def record_host(capacity: int = DEFAULT_CAPACITY) -> HostRecorder:
    """Start recording host spans in this process: Python threads into the rings of a fresh
    :class:`HostRecorder` (replacing any earlier one), native threads into their rings;
    ``capacity`` events per Python thread's ring (a power of two). Returns the recorder."""
    global _recorder
    _recorder = HostRecorder(capacity)
    _set_native_recording(True)
    return _recorder


def stop_host_recording() -> HostRecorder | None:
    """Stop recording; return the recorder that was in effect (its rings stay readable)."""
    global _recorder
    r, _recorder = _recorder, None
    _set_native_recording(False)
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

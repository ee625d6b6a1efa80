"""Asynchronous copies on the GPU's copy engines (DMA), for transports and feature packages.

Get the one of a runtime with :meth:`GpuRuntime.copy_engine() <mori.core.gpu.runtime.GpuRuntime.copy_engine>`::

    engine = runtime.copy_engine()
    ticket = engine.copy_async(peer_addr, local_addr, nbytes)   # returns at once
    ...                                                          # overlap other work
    engine.wait(ticket)                                          # or: with ticket: ...
    engine.quiet()                                               # every copy issued so far is done

Copies go round-robin onto ``streams`` dedicated streams (non-blocking: they never wait for the
legacy default / null stream), so independent copies can run on several copy engines at once. Each
copy starts after the work already queued on torch's current stream (the GPU waits for an event;
the host does not block), so data written by earlier kernels is what gets copied. Addresses are
unified virtual addresses: this GPU's memory, a peer's heap mapped by the runtime, or pinned host
memory. Thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import TracebackType

from mori.core.errors import MoriStateError, MoriValueError
from mori.core.gpu.driver import GpuDriver

__all__ = ["CopyEngine", "CopyTicket"]

DEFAULT_STREAMS = 4


class CopyTicket:
    """One copy queued by :meth:`CopyEngine.copy_async`. ``wait()`` blocks until it has completed;
    a ``with`` block waits at its end. ``done()`` asks without blocking."""

    def __init__(self, engine: CopyEngine, event: int, stream: int, nbytes: int) -> None:
        self._engine = engine
        self._event = event
        #: index of the engine's stream it runs on, and its size in bytes
        self.stream = stream
        self.nbytes = nbytes

    @property
    def completed(self) -> bool:
        """Whether :meth:`wait` (or the engine's ``quiet``) has seen it complete."""
        return self._event == 0

    def done(self) -> bool:
        """True once the copy has completed (does not block)."""
        return self._engine._query(self)

    def wait(self) -> None:
        """Block until the copy has completed. Calling it again does nothing."""
        self._engine.wait(self)

    def __enter__(self) -> CopyTicket:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.wait()

    def __repr__(self) -> str:
        state = "completed" if self.completed else "queued"
        return f"CopyTicket({self.nbytes} bytes on stream {self.stream}, {state})"


class CopyEngine:
    """Copies on dedicated streams of one GPU (see the module docstring).

    ``drv``: the driver binding; ``active``: returns a context manager that makes the GPU current
    (CUDA: its context; HIP: the calling thread's device); ``current_stream(index)``: torch's
    current stream handle of device ``index``; ``streams``: how many streams to spread copies over.
    """

    def __init__(
        self,
        drv: GpuDriver,
        active: Callable[[], AbstractContextManager[None]],
        current_stream: Callable[[int], int],
        index: int,
        streams: int = DEFAULT_STREAMS,
    ) -> None:
        if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
            raise MoriValueError(f"CopyEngine: streams={streams!r} is not allowed; expected an int >= 1")
        self._drv = drv
        self._active = active
        self._current_stream = current_stream
        self.index = index
        self._lock = threading.Lock()
        self._next = 0
        self._pending: set[CopyTicket] = set()
        self._free_events: list[int] = []
        self._closed = False
        with active():
            self._streams = [drv.stream_create() for _ in range(streams)]
            self._order = drv.event_create()

    @property
    def streams(self) -> int:
        return len(self._streams)

    def copy_async(self, dst: int, src: int, nbytes: int, *, after_current_stream: bool = True) -> CopyTicket:
        """Queue a copy of ``nbytes`` from ``src`` to ``dst`` (unified addresses, not overlapping);
        return at once with its :class:`CopyTicket`. ``after_current_stream=False`` lets it start
        without waiting for torch's current stream."""
        for arg, v in (("dst", dst), ("src", src), ("nbytes", nbytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise MoriValueError(f"copy_async: {arg}={v!r} is not allowed; expected an int >= 0")
        if nbytes and (not dst or not src):
            raise MoriValueError("copy_async: dst and src must not be 0 (null)")
        if nbytes and abs(dst - src) < nbytes:
            raise MoriValueError(f"copy_async: [{src:#x}, +{nbytes}) and [{dst:#x}, +{nbytes}) overlap")
        drv = self._drv
        with self._lock, self._active():
            if self._closed:
                raise MoriStateError("copy_async: the copy engine is closed")
            index = self._next
            self._next = (index + 1) % len(self._streams)
            stream = self._streams[index]
            if after_current_stream:
                drv.event_record(self._order, self._current_stream(self.index))
                drv.stream_wait_event(stream, self._order)
            if nbytes:
                drv.memcpy_async(dst, src, nbytes, stream)
            event = self._free_events.pop() if self._free_events else drv.event_create()
            drv.event_record(event, stream)
            ticket = CopyTicket(self, event, index, nbytes)
            self._pending.add(ticket)
            return ticket

    def _retire(self, ticket: CopyTicket) -> None:
        # with the lock held: the ticket's event goes back to the pool
        if ticket._event:
            self._free_events.append(ticket._event)
            ticket._event = 0
            self._pending.discard(ticket)

    def _query(self, ticket: CopyTicket) -> bool:
        with self._lock:
            if not ticket._event:
                return True
            with self._active():
                if not self._drv.event_query(ticket._event):
                    return False
            self._retire(ticket)
            return True

    def wait(self, ticket: CopyTicket) -> None:
        """Block until ``ticket``'s copy has completed."""
        if ticket._engine is not self:
            raise MoriValueError("wait: the ticket belongs to another copy engine")
        with self._lock:
            event = ticket._event
        if not event:
            return
        with self._active():
            self._drv.event_synchronize(event)  # outside the lock: other threads may queue meanwhile
        with self._lock:
            self._retire(ticket)

    def quiet(self) -> None:
        """Block until every copy issued so far has completed."""
        with self._lock, self._active():
            for stream in self._streams:
                self._drv.stream_synchronize(stream)
            for ticket in list(self._pending):
                self._retire(ticket)

    def close(self) -> None:
        """Complete every copy and release the streams and events. The engine is unusable after."""
        self.quiet()
        with self._lock, self._active():
            if self._closed:
                return
            self._closed = True
            for event in [*self._free_events, self._order]:
                self._drv.event_destroy(event)
            for stream in self._streams:
                self._drv.stream_destroy(stream)
            self._free_events.clear()

"""Copy-engine queues ("SDMA" in the original): asynchronous peer copies with signals, posted from
the host (:class:`SdmaQueue`) or from a kernel (:mod:`mori.cco.device`'s ``sdma_*`` functions),
executed by one copy thread per communicator.

**Model.** A communicator has ``Q`` queues (``CCODevCommRequirements.sdma_queue_count``, fixed by
its first device communicator). A *put* copies bytes of a local window into an LSA peer's
window and then adds one to the peer's signal counter ``[queue][my LSA rank]``; a *get* copies a
peer's window into a local one. Posting is non-blocking: the request lands in the queue's ring
(host-visible memory of this rank), :meth:`SdmaQueue.commit` wakes the copy thread, which runs
the requests of each queue in order; :meth:`SdmaQueue.quiet` waits until every request posted so
far has completed; :meth:`SdmaQueue.wait_signal` waits until a peer's puts have landed here.

**Engines.** On the ``cpu`` runtime the copy thread copies with ``memmove`` (large copies with
torch's multi-threaded copy) and stores the signal with a sequentially consistent atomic, after
the data. On a GPU runtime it drives the runtime plugin's copy engine
(:class:`~mori.core.gpu.copy_engine.CopyEngine`: ``cudaMemcpyAsync`` peer copies on dedicated
streams that never wait for the default stream), then copies the new signal value after the data.
Rings live in pinned host memory there, which kernels reach over the bus.

**Bounds.** A ring holds ``MORI_SDMA_QUEUE_DEPTH`` requests (default 256): a post waits for room
(host: at most ``MORI_BOOTSTRAP_TIMEOUT``; device: no timeout). The copy thread checks every
request against the communicator's own tables (both ends inside a heap of the LSA team or a
window, the sizes in range) and refuses the rest; a refused request completes without copying,
and the next :meth:`SdmaQueue.quiet` raises naming it.

**Library manners.** The copy thread sleeps in a native wait (GIL released) between requests and
stops when the communicator is destroyed. It changes nothing of the process (no affinity, no
priority).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from mori.cco import layout
from mori.core.backend import CMP_GE, CMP_GT, OP_ADD, OP_FETCH, OP_SET, WORD_INT64, DeviceRuntime
from mori.core.errors import MoriBackendError, MoriStateError, MoriTimeoutError, bad_type, bad_value
from mori.core.plugins import get_plugins, select

if TYPE_CHECKING:
    import torch

    from mori.cco.communicator import Communicator
    from mori.cco.windows import RegisteredWindow

__all__ = ["SdmaEngine", "SdmaQueue"]

_W = layout.SLOT_BYTES
#: the copy thread looks at its stop flag at least this often (seconds)
_POLL_S = 0.1
#: most refused requests remembered for the next quiet()
_MAX_ERRORS = 16


def host_runtime() -> DeviceRuntime:
    """The ``cpu`` runtime: native atomics and waits on host memory (rings, pinned words)."""
    found = select("device runtime", get_plugins().runtimes(), "cpu")
    if not isinstance(found.backend, DeviceRuntime):  # pragma: no cover - mori-core's own plugin
        raise MoriBackendError("the cpu runtime plugin returned no device runtime")
    return found.backend


class SdmaEngine:
    """The queues of one communicator: their signal counters (a window), rings, and copy thread.

    Made by the communicator's first device communicator (collective), closed by ``destroy``.
    """

    def __init__(self, comm: Communicator, queues: int, depth: int) -> None:
        import torch

        self.comm = comm
        self.queues = queues
        self.depth = depth
        self.runtime = comm._runtime
        self.host = host_runtime()
        self.gpu = self.runtime.torch_device != "cpu"
        lsa = comm.lsa_size
        # signals [queues][lsa] then the reservation counters [queues], in the heap (device memory)
        nbytes = (queues * lsa + queues) * _W
        self._mem = comm.alloc_mem(nbytes)
        comm.tensor(self._mem.ptr, nbytes).zero_()
        comm._runtime.fence()  # zeroed before any peer can signal (a GPU zeroes asynchronously)
        self.window = comm.register_window(self._mem.ptr, nbytes)  # collective, after every rank zeroed
        self.reserved_addr = self._mem.ptr + queues * lsa * _W
        # rings and doorbell: host-visible memory of this rank
        self.ring_words = layout.RING_HEADER_WORDS + depth * layout.ENTRY_WORDS
        ring_bytes = (queues * self.ring_words + 1) * _W
        self._pinned: torch.Tensor | None = None
        if self.gpu:
            self._pinned = torch.zeros(ring_bytes, dtype=torch.uint8, pin_memory=True)
            self.rings_addr = int(self._pinned.data_ptr())
            self._ring_mem = None
        else:
            self._ring_mem = comm.alloc_mem(ring_bytes)
            self.rings_addr = self._ring_mem.ptr
            comm.tensor(self.rings_addr, ring_bytes).zero_()
        self.doorbell_addr = self.rings_addr + queues * self.ring_words * _W
        self._sent = [[0] * lsa for _ in range(queues)]  # puts per (queue, peer), for their signals
        self._errors: list[str] = []
        self._errors_lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"mori-cco-sdma-{comm.name}", daemon=True)
        self._thread.start()

    # -- addresses ----------------------------------------------------------------------------------

    def ring(self, q: int) -> int:
        return self.rings_addr + q * self.ring_words * _W

    def completed_addr(self, q: int) -> int:
        return self.ring(q) + layout.RING_COMPLETED * _W

    def entry(self, q: int, n: int) -> int:
        return self.ring(q) + (layout.RING_HEADER_WORDS + (n % self.depth) * layout.ENTRY_WORDS) * _W

    def signal_addr(self, q: int, lsa_peer: int, of_lsa_rank: int) -> int:
        """Address, here, of LSA peer ``lsa_peer``'s counter of puts from ``of_lsa_rank`` on queue ``q``."""
        return self.window.peer_ptrs[lsa_peer] + (q * self.comm.lsa_size + of_lsa_rank) * _W

    # -- the copy thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        done = [0] * self.queues
        h = self.host
        while not self._stop:
            bell = h.atomic_rmw(self.doorbell_addr, OP_FETCH, WORD_INT64, 0)
            worked = False
            for q in range(self.queues):
                while not self._stop:
                    n = done[q]
                    e = self.entry(q, n)
                    if h.atomic_rmw(e, OP_FETCH, WORD_INT64, 0) != n + 1:
                        break
                    try:
                        self._execute(q, e)
                    except Exception as err:  # a refused or failed request: report it at quiet()
                        with self._errors_lock:
                            if len(self._errors) < _MAX_ERRORS:
                                self._errors.append(f"queue {q} request #{n}: {err}")
                    done[q] = n + 1
                    h.atomic_rmw(self.completed_addr(q), OP_SET, WORD_INT64, n + 1)
                    worked = True
            if not worked:
                h.wait_until(self.doorbell_addr, CMP_GT, WORD_INT64, bell, _POLL_S)

    def _execute(self, q: int, e: int) -> None:
        h = self.host
        words = [h.atomic_rmw(e + i * _W, OP_FETCH, WORD_INT64, 0) for i in range(layout.ENTRY_WORDS)]
        op, peer = words[layout.ENTRY_OP] & 0xFF, words[layout.ENTRY_OP] >> 8
        dst, src, nbytes = words[layout.ENTRY_DST], words[layout.ENTRY_SRC], words[layout.ENTRY_BYTES]
        comm = self.comm
        if op not in (layout.SDMA_OP_PUT, layout.SDMA_OP_GET):
            raise MoriBackendError(f"unknown op {op}")
        if not 0 <= peer < comm.lsa_size:
            raise MoriBackendError(f"peer {peer} is not an LSA rank (the team has {comm.lsa_size})")
        if not 0 <= nbytes <= comm.per_rank_size:
            raise MoriBackendError(f"{nbytes} bytes is not a size a window can hold")
        # both ends must be memory this communicator knows (never an address a kernel made up)
        comm._check_reachable("sdma", "dst", dst, nbytes)
        comm._check_reachable("sdma", "src", src, nbytes)
        if nbytes:
            if self.gpu:
                engine = self._copy_engine()
                engine.copy_async(dst, src, nbytes, after_current_stream=False).wait()
            else:
                self.runtime.copy(dst, src, nbytes)
        if op == layout.SDMA_OP_PUT:
            self._sent[q][peer] += 1
            count = self._sent[q][peer]
            sig = self.signal_addr(q, peer, comm.lsa_rank)
            if self.gpu:
                # the value travels from the entry's scratch word, after the data (one writer per slot)
                h.atomic_rmw(e + layout.ENTRY_SIGNAL * _W, OP_SET, WORD_INT64, count)
                self._copy_engine().copy_async(
                    sig, e + layout.ENTRY_SIGNAL * _W, _W, after_current_stream=False
                ).wait()
            else:
                self.runtime.atomic_rmw(sig, OP_SET, WORD_INT64, count)

    def _copy_engine(self) -> Any:
        make = getattr(self.runtime, "copy_engine", None)
        if make is None:
            raise MoriBackendError(f"the {self.runtime.name} runtime has no copy engine")
        return make()

    def take_errors(self) -> list[str]:
        with self._errors_lock:
            out, self._errors = self._errors, []
        return out

    def close(self) -> None:
        self._stop = True
        self.host.atomic_rmw(self.doorbell_addr, OP_ADD, WORD_INT64, 1)
        self._thread.join(timeout=10)
        self._pinned = None


class SdmaQueue:
    """Host side of copy-engine queue ``index`` of a device communicator (see the module
    docstring). Get it with :meth:`DevCommHandle.sdma_queue() <mori.cco.DevCommHandle.sdma_queue>`.
    Thread-safe; the same ring serves kernels that post to the same queue."""

    def __init__(self, engine: SdmaEngine, index: int) -> None:
        self._engine = engine
        self.index = index
        self._lock = threading.Lock()

    def _check(self, func: str) -> SdmaEngine:
        if self._engine.comm.closed:
            raise MoriStateError(f"{func}: the communicator was destroyed")
        return self._engine

    def _window_range(self, func: str, arg: str, win: Any, offset: Any, nbytes: int, lsa_rank: int) -> int:
        from mori.cco.windows import RegisteredWindow

        if not isinstance(win, RegisteredWindow) or win._comm is not self._engine.comm:
            raise bad_type(func, arg, win, "a window of this queue's communicator")
        if (
            isinstance(offset, bool)
            or not isinstance(offset, int)
            or offset < 0
            or offset + nbytes > win.size
        ):
            raise bad_value(func, f"{arg} offset", offset, f"an offset with offset + {nbytes} <= {win.size}")
        return win.peer_ptr(lsa_rank, offset)

    def _post(
        self, func: str, op: int, peer: Any, dst: int, src: int, nbytes: int, timeout: float | None
    ) -> None:
        eng = self._check(func)
        h, q = eng.host, self.index
        with self._lock:
            slot = eng.runtime.atomic_rmw(eng.reserved_addr + q * _W, OP_ADD, WORD_INT64, 1)
            limit = eng.comm.timeout_s if timeout is None else timeout
            ok, _ = h.wait_until(eng.completed_addr(q), CMP_GE, WORD_INT64, slot - eng.depth + 1, limit)
            if not ok:
                raise MoriTimeoutError(
                    f"{func}: queue {q} stayed full ({eng.depth} requests in flight) for {limit:g} s"
                )
            e = eng.entry(q, slot)
            for word, value in (
                (layout.ENTRY_OP, op | (peer << 8)),
                (layout.ENTRY_DST, dst),
                (layout.ENTRY_SRC, src),
                (layout.ENTRY_BYTES, nbytes),
            ):
                h.atomic_rmw(e + word * _W, OP_SET, WORD_INT64, value)
            h.atomic_rmw(e + layout.ENTRY_SEQ * _W, OP_SET, WORD_INT64, slot + 1)  # valid from here

    def _peer(self, func: str, peer: Any) -> int:
        n = self._engine.comm.lsa_size
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < n:
            raise bad_value(func, "peer", peer, f"an LSA rank in [0, {n})")
        return peer

    def _nbytes(self, func: str, nbytes: Any) -> int:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise bad_value(func, "nbytes", nbytes, "a number of bytes >= 0")
        return nbytes

    def put(
        self,
        peer: int,
        dst_win: RegisteredWindow,
        dst_off: int,
        src_win: RegisteredWindow,
        src_off: int,
        nbytes: int,
        *,
        timeout: float | None = None,
    ) -> None:
        """Post a copy of ``nbytes`` from this rank's ``src_win`` at ``src_off`` into LSA peer
        ``peer``'s ``dst_win`` at ``dst_off``; once the bytes are there, the peer's counter of
        this rank's puts on this queue grows by one. Returns at once (waits only while the ring is
        full, at most ``timeout`` seconds, default ``MORI_BOOTSTRAP_TIMEOUT``). Starts by
        :meth:`commit` at the latest."""
        func = "SdmaQueue.put"
        self._check(func)
        peer = self._peer(func, peer)
        nbytes = self._nbytes(func, nbytes)
        me = self._engine.comm.lsa_rank
        dst = self._window_range(func, "dst_win", dst_win, dst_off, nbytes, peer)
        src = self._window_range(func, "src_win", src_win, src_off, nbytes, me)
        self._post(func, layout.SDMA_OP_PUT, peer, dst, src, nbytes, timeout)

    def get(
        self,
        peer: int,
        dst_win: RegisteredWindow,
        dst_off: int,
        src_win: RegisteredWindow,
        src_off: int,
        nbytes: int,
        *,
        timeout: float | None = None,
    ) -> None:
        """Post a copy of ``nbytes`` from LSA peer ``peer``'s ``src_win`` at ``src_off`` into this
        rank's ``dst_win`` at ``dst_off``. Complete after :meth:`quiet`; no signal."""
        func = "SdmaQueue.get"
        self._check(func)
        peer = self._peer(func, peer)
        nbytes = self._nbytes(func, nbytes)
        me = self._engine.comm.lsa_rank
        dst = self._window_range(func, "dst_win", dst_win, dst_off, nbytes, me)
        src = self._window_range(func, "src_win", src_win, src_off, nbytes, peer)
        self._post(func, layout.SDMA_OP_GET, peer, dst, src, nbytes, timeout)

    def commit(self) -> None:
        """Hand every request posted so far to the copy engine (wakes the copy thread)."""
        eng = self._check("SdmaQueue.commit")
        eng.host.atomic_rmw(eng.doorbell_addr, OP_ADD, WORD_INT64, 1)

    def quiet(self, *, timeout: float | None = None) -> None:
        """Commit, then block until every request posted to this queue so far (by the host or by
        kernels) has completed. Raises :class:`~mori.core.errors.MoriBackendError` naming the
        requests the copy thread refused, :class:`~mori.core.errors.MoriTimeoutError` after
        ``timeout`` seconds (default ``MORI_BOOTSTRAP_TIMEOUT``)."""
        func = "SdmaQueue.quiet"
        self.commit()
        eng = self._engine
        target = eng.runtime.atomic_rmw(eng.reserved_addr + self.index * _W, OP_FETCH, WORD_INT64, 0)
        limit = eng.comm.timeout_s if timeout is None else timeout
        ok, seen = eng.host.wait_until(eng.completed_addr(self.index), CMP_GE, WORD_INT64, target, limit)
        errors = eng.take_errors()
        if errors:
            raise MoriBackendError(f"{func}: the copy engine refused requests: " + "; ".join(errors))
        if not ok:
            raise MoriTimeoutError(
                f"{func}: queue {self.index} completed {seen} of {target} requests within {limit:g} s"
            )

    def signal(self, peer: int) -> int:
        """How many of LSA peer ``peer``'s puts on this queue have landed in this rank's memory."""
        func = "SdmaQueue.signal"
        eng = self._check(func)
        peer = self._peer(func, peer)
        addr = eng.signal_addr(self.index, eng.comm.lsa_rank, peer)
        return int(eng.runtime.atomic_rmw(addr, OP_FETCH, WORD_INT64, 0))

    def wait_signal(self, peer: int, value: int, *, timeout: float | None = None) -> int:
        """Block until at least ``value`` puts of LSA peer ``peer`` on this queue have landed here;
        returns the count. :class:`~mori.core.errors.MoriTimeoutError` names the peer after
        ``timeout`` seconds (default ``MORI_BOOTSTRAP_TIMEOUT``)."""
        func = "SdmaQueue.wait_signal"
        eng = self._check(func)
        peer = self._peer(func, peer)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise bad_value(func, "value", value, "a count >= 0")
        addr = eng.signal_addr(self.index, eng.comm.lsa_rank, peer)
        limit = eng.comm.timeout_s if timeout is None else timeout
        ok, seen = eng.runtime.wait_until(addr, CMP_GE, WORD_INT64, value, limit)
        if not ok:
            rank = eng.comm.lsa_ranks[peer]
            raise MoriTimeoutError(
                f"{func}: rank {rank} (LSA {peer}) delivered {seen} puts on queue {self.index}, not {value}, "
                f"within {limit:g} s",
                [rank],
            )
        return int(seen)

"""The XGMI backend (``BackendType.XGMI``): GPU memory to GPU memory of one node, over NVLink (NVIDIA,
CUDA IPC) or xGMI (AMD, HIP IPC), built on :mod:`mori.core.gpu` and a device plugin's runtime.

Registration (Python, once per region or peer). Each local GPU region is exported with the
runtime's :meth:`~mori.core.gpu.runtime.GpuRuntime.export_range`: a segment handle (the driver's IPC
handle of the allocation plus the region's offset in it, its size, owner pid and GPU PCI address)
that goes into ``MemoryDesc.ipc_handle``. A region may be any sub-range of a larger allocation
(per-layer KV views). A peer opens the handle with
:meth:`~mori.core.gpu.runtime.GpuRuntime.open_range` on its first transfer to the region: one IPC
mapping per allocation per process (the runtime shares it between regions of the same allocation),
kept until the remote engine is deregistered or the backend closes. Regions of this same process
are used directly, without IPC.

Transfers (native, ``csrc/xgmi_queue.hpp``). Each post is one call into the engine's
``XgmiQueue``, which holds the driver's function addresses
(:meth:`~mori.core.gpu.driver.CtypesDriver.native_calls`) and does the rest without Python and
without the GIL: it checks every block against both regions (a block outside either fails the
transfer with ``ERR_INVALID_ARGS``; nothing moves), merges blocks contiguous on both sides, and
queues the copies after an event recorded on torch's current stream of the backend's GPU (the GPU
waits; the host does not), so data written by earlier kernels is what moves:

* a batch with at least ``MORI_IO_XGMI_SCATTER_GATHER_THRESHOLD`` blocks of at most
  :data:`SG_MAX_BLOCK` bytes goes through one launch of the Triton scatter-gather kernel
  (:mod:`mori.io.xgmi_kernels`, compiled once per word width when the backend binds its GPU and
  launched by the driver's own launch call), its descriptor table from a ring of
  :data:`NUM_TABLES` pinned host tables the GPU reads directly, each reused once the event recorded
  after its kernel completed;
* every other block is one asynchronous copy (copy engines / DMA), spread round-robin over the
  backend's ``XgmiBackendConfig.num_streams`` streams.

Completion. An event is recorded on every stream a transfer used. ``Wait()``/``WaitFor()`` wait for
those events in the calling thread and complete the status there; a native completion thread
completes the statuses nobody waits on, in posting order (``SUCCESS``, or ``ERR_GPU_OP`` with the
driver's message). XGMI has no notifications: the target's ``pop_inbound_transfer_status`` stays
empty. ``XgmiBackendConfig.num_events`` events are made up front; more are made while that many
are in use.

Safety. The target takes no part in a one-sided GPU copy, so the checks are the initiator's: the
queue checks offsets against both regions, and this backend refuses a remote descriptor whose size
or address disagrees with its segment handle (``supports`` answers ``False``), so a descriptor
cannot reach past the region its owner exported. Deregistering a region (or a remote engine)
first makes new transfers on it fail, then waits for the ones in flight (at most
``MORI_IO_CP_TIMEOUT_MS``), and only then unmaps it.

The backend runs its copies on the GPU its runtime is bound to: torch's current device when the
first GPU region was registered (call ``torch.cuda.set_device`` first in a multi-GPU process).

Tracing (mori.viz). :meth:`XgmiBackend.enable_tracing` (or :meth:`mori.io.IOEngine.enable_tracing`)
loads the traced variant of the scatter-gather kernel for every word width and hands it to the
queue with the trace buffer's address, which the queue passes as the kernel's ``trace_ptr``; every
kernel launch posted from then on records, per program, the spans of
:data:`mori.io.xgmi_kernels.SLOTS`. :meth:`XgmiBackend.disable_tracing` hands the untraced
variants back (the uninstrumented kernel). Copy-engine copies record nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from mori.core.errors import MoriBackendError, MoriStateError, MoriTimeoutError, MoriValueError, bad_type
from mori.io.env import MORI_IO_XGMI_SCATTER_GATHER_THRESHOLD
from mori.io.handles import backend_handle

if TYPE_CHECKING:
    from mori.core.gpu.runtime import GpuRuntime
    from mori.io import EngineDesc, MemoryDesc, TransferStatus

__all__ = [
    "MORI_IO_XGMI_SCATTER_GATHER_THRESHOLD",
    "NUM_TABLES",
    "SG_MAX_BLOCK",
    "TABLE_ENTRIES",
    "TRACE_RINGS",
    "XgmiBackend",
    "create_backend",
    "find_gpu_runtime",
    "kernel_reaches",
]

_log = logging.getLogger("mori.io")

#: blocks larger than this never go through the scatter-gather kernel (copy engines do them
#: better); the native queue's kSgMaxBlock
SG_MAX_BLOCK = 1 << 20
#: descriptor-table entries of one pinned table (a larger batch takes several launches)
TABLE_ENTRIES = 4096
#: pinned descriptor tables per backend: at most this many kernel launches are in flight (a post
#: beyond that waits for the oldest one's kernel)
NUM_TABLES = 8
#: trace-buffer rings :meth:`XgmiBackend.enable_tracing` makes by default (one per program of a launch:
#: ``blocks * split`` of them, programs beyond the last ring record nothing)
TRACE_RINGS = 1024
#: trace buffers replaced by a later enable/disable_tracing that are kept while launches may still
#: record into them; replacing one more first waits until nothing is pending
TRACE_KEPT_REPLACED = 4


def kernel_reaches(handle: Any, gpu_pci: Any, pid: int) -> bool:
    """Whether a kernel on the GPU at ``gpu_pci`` of process ``pid`` may load and store the region
    of ``handle`` (a decoded segment handle): memory of that same GPU, or another process's memory
    mapped with IPC (which enables peer access). Memory of another GPU of this same process is not
    mapped with IPC and peer access may be off, so its copies go to the copy engines instead."""
    return bool(handle.pci == gpu_pci or handle.pid != pid)


def find_gpu_runtime() -> GpuRuntime:
    """The usable GPU device runtime of the installed device plugins (``cuda`` from
    mori-backend-nvlink, ``hip`` from mori-backend-xgmi); raises :class:`MoriBackendError` saying
    why there is none."""
    from mori.core.gpu.runtime import GpuRuntime
    from mori.core.plugins import get_plugins

    found = get_plugins().runtimes()
    reasons = []
    for f in found:
        if isinstance(f.backend, GpuRuntime):
            if f.availability.usable:
                return f.backend
            reasons.append(f"{f.backend.name} ({f.plugin.distribution}): {f.availability.reason}")
    detail = "; ".join(reasons) or "no GPU device plugin installed (mori-backend-nvlink or mori-backend-xgmi)"
    raise MoriBackendError(f"create_backend(XGMI): no usable GPU runtime: {detail}")


def create_backend(engine: Any, config: Any) -> XgmiBackend:
    """The factory :meth:`mori.io.IOEngine.create_backend` calls for ``BackendType.XGMI``."""
    from mori.io import XgmiBackendConfig

    if config is None:
        config = XgmiBackendConfig()
    desc = engine.get_engine_desc()
    return XgmiBackend(desc.key, desc.node_id, find_gpu_runtime(), config.num_streams, config.num_events)


class XgmiBackend:
    """The XGMI data path of one engine (see the module docstring). ``key``/``node_id``: the
    engine's; ``runtime``: the GPU runtime that maps and copies; ``num_streams``/``num_events``:
    from :class:`~mori.io.XgmiBackendConfig`."""

    preference = 100
    #: post() checks every block against both regions itself (the engine may skip its per-block checks)
    checks_ranges = True

    def __init__(
        self, key: str, node_id: str, runtime: GpuRuntime, num_streams: int = 64, num_events: int = 64
    ) -> None:
        for arg, v in (("num_streams", num_streams), ("num_events", num_events)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise MoriValueError(f"XgmiBackend: {arg}={v!r} is not allowed; expected an int >= 1")
        self.key = key
        self.node_id = node_id
        self.runtime = runtime
        self.num_streams = num_streams
        self.num_events = num_events
        self._threshold = MORI_IO_XGMI_SCATTER_GATHER_THRESHOLD.get() or 0
        self._lock = threading.Lock()
        self._remote_nodes: dict[str, str] = {}
        #: (engine key, region id) -> (handle bytes, opened segment, whether the kernel reaches it, token)
        self._mapped: dict[tuple[str, int], tuple[bytes, Any, bool, Any]] = {}
        #: region id -> its segment handle (exported)
        self._exported: dict[int, bytes] = {}
        #: region id -> (token, whether the scatter-gather kernel may touch it, see kernel_reaches)
        self._local: dict[int, tuple[Any, bool]] = {}
        #: region id -> why it could not be exported (XGMI then does not serve it)
        self.export_errors: dict[int, str] = {}
        self._dev: Any = None  # the runtime's device state, bound on first use
        self._queue: Any = None  # the native XgmiQueue, made with the device state
        self._streams: list[int] = []
        self._tables: list[tuple[int, int, int]] = []  # (host, device, event) of each pinned table
        self._stream_of: Callable[[int], int] = runtime.current_stream
        self._closed = False
        #: the mori.viz TraceBuffer the kernel records into (its traced variants), or None
        self._trace: Any = None
        #: the buffer handed to the queue and those it replaced while a launch may still record into
        #: them (at most TRACE_KEPT_REPLACED of those, see _release_replaced)
        self._trace_kept: list[Any] = []
        #: word width -> (function, threads, shared) of the untraced kernel handed to the queue
        self._kernels: dict[int, tuple[int, int, int]] = {}

    @property
    def threshold(self) -> int:
        """Blocks from which a batch goes through the scatter-gather kernel (0: never)."""
        return int(self._queue.threshold) if self._queue is not None else self._threshold

    @threshold.setter
    def threshold(self, value: int) -> None:
        self._threshold = value
        if self._queue is not None:
            self._queue.threshold = value

    @property
    def counters(self) -> dict[str, int]:
        """What went where: copies, kernel launches and the blocks they copied, transfers posted."""
        keys = ("copies", "kernel_launches", "kernel_blocks", "transfers")
        if self._queue is None:
            return dict.fromkeys(keys, 0)
        c = self._queue.counters()
        return {k: int(c[k]) for k in keys}

    # -- the GPU -------------------------------------------------------------------------------------

    def _device(self) -> Any:
        """The runtime's device state (its driver, GPU index, ``active()``), with our streams,
        descriptor tables and native queue."""
        if self._dev is not None:
            return self._dev
        with self._lock:
            if self._dev is None:
                st = self.runtime.bound_device()
                self._queue = self._make_queue(st)
                self._dev = st
            return self._dev

    def _make_queue(self, st: Any) -> Any:
        from mori.core import transfer
        from mori.io import env

        drv = st.drv
        with st.active():
            try:
                self._streams = [drv.stream_create() for _ in range(self.num_streams)]
                for _ in range(NUM_TABLES):
                    host = drv.host_alloc(3 * 8 * TABLE_ENTRIES)
                    self._tables.append((host, drv.host_device_pointer(host), drv.event_create()))
                calls = self._native_calls(drv)
                queue = transfer.XgmiQueue(
                    calls,
                    int(st.ctx),
                    self._streams,
                    [(h, d, TABLE_ENTRIES, e) for h, d, e in self._tables],
                    self.num_events,
                    self._threshold,
                    env.MORI_IO_CP_TIMEOUT_MS.get() or 30000,
                )
            except BaseException:
                self._free_device(st)
                raise
        if "launch_kernel" in calls:
            self._kernels = self._load_kernels(st)
            for word, (function, threads, shared) in self._kernels.items():
                queue.set_kernel(word, function, threads, shared)
        return queue

    # -- tracing (mori.viz) ------------------------------------------------------------------------

    def enable_tracing(self, buffer: Any = None, *, capacity: int = 1024, n_rings: int | None = None) -> Any:
        """Launch the traced variant of the scatter-gather kernel from now on, recording into
        ``buffer`` (a :class:`mori.viz.TraceBuffer` on this backend's GPU), or a new one; return it.

        Program ``(i, j)`` of a launch (block ``i``, share ``j`` of ``split``) records into ring
        ``i + j * blocks``: a ``kernel`` span of ``io.scatter_gather`` with ``table`` and ``copy``
        nested in it (:data:`mori.io.xgmi_kernels.SLOTS`); programs beyond the buffer's ``n_rings``
        record nothing. For a new buffer, ``n_rings``: default :data:`TRACE_RINGS`; ``capacity``:
        events per ring (a power of two; a program records 5 per launch, a full ring keeps the
        newest). Read it with ``mori.viz.capture([buf])`` when the GPU is idle. Copy-engine copies
        record nothing. Binds the backend's GPU (as the first GPU registration does) and loads
        (compiles, or takes from Triton's cache) the traced variants; raises
        :class:`~mori.core.errors.MoriStateError` if the kernel cannot be loaded or launched here,
        or the backend is closed. Host-blocking while it compiles; not collective. A buffer this
        replaces is kept alive while transfers posted before are pending (they may still record
        into it); with :data:`TRACE_KEPT_REPLACED` such buffers kept, this first waits until no
        transfer is pending (:class:`~mori.core.errors.MoriTimeoutError` after
        ``MORI_IO_CP_TIMEOUT_MS``, tracing unchanged).
        """
        func = "enable_tracing"
        if self._closed:
            raise MoriStateError(f"{func}: the XGMI backend was removed")
        from mori.viz import TraceBuffer

        st = self._device()
        device = self._trace_device(st)
        if buffer is None:
            rings = TRACE_RINGS if n_rings is None else n_rings
            buffer = TraceBuffer(rings, capacity, device=device, name=f"io {self.key}")
        elif not isinstance(buffer, TraceBuffer) or buffer.device != device:
            raise bad_type(func, "buffer", buffer, f"None or a mori.viz.TraceBuffer on {device}")
        if not self._kernels:
            raise MoriStateError(
                f"{func}: the scatter-gather kernel is not loaded on this backend (no Triton, or it "
                "failed to compile: see the log), so nothing would record"
            )
        kernels = self._load_kernels(st, traced=True)
        if not kernels:
            raise MoriStateError(
                f"{func}: the traced scatter-gather kernel could not be loaded (see the log)"
            )
        address = int(buffer.tensor.data_ptr())
        if self._trace is not None and self._trace is not buffer:
            self._release_replaced(switching=True)
        with self._lock:
            if all(b is not buffer for b in self._trace_kept):
                self._trace_kept.append(buffer)
            self._trace = buffer
        for word, (function, threads, shared) in kernels.items():
            self._queue.set_kernel(word, function, threads, shared, address)
        self._release_replaced()
        return buffer

    def disable_tracing(self) -> None:
        """Launch the untraced (uninstrumented) kernel again from now on; the buffer of
        :meth:`enable_tracing` stays readable. Does nothing if tracing is off."""
        if self._trace is None or self._queue is None:
            return
        with self._lock:
            self._trace = None
        for word, (function, threads, shared) in self._kernels.items():
            self._queue.set_kernel(word, function, threads, shared)
        self._release_replaced()

    def _release_replaced(self, *, switching: bool = False) -> None:
        """Drop the trace buffers the queue's kernels no longer record into, once nothing is
        pending: a post reads the kernel and counts as pending in one step of the native queue,
        so every launch that got a replaced buffer's address is pending until it has run.
        ``switching``: called before a change that replaces the current buffer; with
        TRACE_KEPT_REPLACED replaced ones kept already, wait for that first (nothing changed if
        the wait times out)."""
        with self._lock:
            replaced = [b for b in self._trace_kept if b is not self._trace]
        if not replaced:
            return
        if switching and len(replaced) >= TRACE_KEPT_REPLACED:
            self._wait_idle(f"the transfers that may record into the {len(replaced)} trace buffers replaced")
        elif self._queue.counters()["pending"] != 0:
            return
        with self._lock:
            self._trace_kept = [b for b in self._trace_kept if all(b is not r for r in replaced)]

    def _wait_idle(self, what: str) -> None:
        from mori.io import env

        timeout_ms = env.MORI_IO_CP_TIMEOUT_MS.get() or 30000
        deadline = time.monotonic() + timeout_ms / 1000
        while self._queue.counters()["pending"] != 0:
            if time.monotonic() > deadline:
                raise MoriTimeoutError(f"XGMI: {what} still ran after MORI_IO_CP_TIMEOUT_MS={timeout_ms} ms")
            time.sleep(0.001)

    @property
    def trace_buffer(self) -> Any:
        """The :class:`mori.viz.TraceBuffer` the kernel records into, or None (tracing off)."""
        return self._trace

    def _trace_device(self, st: Any) -> Any:
        """The torch device a trace buffer must be on: the backend's GPU (a test may use the CPU)."""
        import torch

        return torch.device("cuda", st.index)

    def _native_calls(self, drv: Any) -> dict[str, Any]:
        """The driver functions the native queue calls (a test may add its own kernel launcher)."""
        return dict(drv.native_calls())

    def _load_kernels(self, st: Any, traced: bool = False) -> dict[int, tuple[int, int, int]]:
        """Word width -> (driver function, threads, shared bytes) of the scatter-gather kernel,
        compiled (or loaded from Triton's cache) for this GPU: its untraced variant, or with
        ``traced`` the one that takes a trace buffer. None compiled (no Triton, a compile error):
        batches then go to the copy engines, which is slower but correct."""
        try:
            import torch

            from mori.core.kernels import launch_config
            from mori.io import xgmi_kernels

            out = {}
            with torch.cuda.device(st.index):
                # traced: trace_ptr an int64 pointer and TRACE on; untraced: both left at their
                # defaults (trace_ptr None: not a parameter of the compiled kernel). Positional:
                # warmup takes a dtype for a pointer only there (a keyword dtype fails to specialize)
                trace = (torch.int64, True) if traced else ()
                for word in xgmi_kernels.WORD_TYPES:
                    kernel = xgmi_kernels.scatter_gather_kernel.warmup(
                        torch.int64, 1, 1, word, xgmi_kernels.DEFAULT_BLOCK, *trace, grid=(1, 1)
                    )
                    out[word] = launch_config(kernel)
            return out
        except Exception as e:  # any failure only costs speed
            _log.warning("XGMI: the scatter-gather kernel is not available, batches use copy engines: %s", e)
            return {}

    def _free_device(self, st: Any) -> None:
        drv = st.drv
        with st.lock, st.active():
            for s in self._streams:
                drv.stream_destroy(s)
            for host, _, event in self._tables:
                drv.event_destroy(event)
                drv.host_free(host)
        self._streams = []
        self._tables = []

    # -- Backend protocol -----------------------------------------------------------------------------

    def supports(self, local: MemoryDesc, remote: MemoryDesc) -> bool:
        from mori.io import MemoryLocationType

        gpu = MemoryLocationType.GPU
        if local.loc != gpu or remote.loc != gpu or local.engine_key != self.key:
            return False
        if remote.engine_key != self.key and self._remote_nodes.get(remote.engine_key) != self.node_id:
            return False  # another node: IPC cannot reach it
        remote_handle = backend_handle(remote, "XGMI")
        if local.id not in self._exported or not remote_handle:
            return False
        try:
            h = self.runtime.handle_class.unpack(remote_handle, what="remote MemoryDesc.ipc_handle")
        except MoriValueError:
            return False  # another vendor's handle, or not a GPU segment handle
        return bool(h.addr == remote.data and h.size == remote.size)

    def on_register_memory(self, desc: MemoryDesc) -> bytes | None:
        from mori.io import MemoryLocationType

        if desc.loc != MemoryLocationType.GPU:
            return None
        try:
            handle = self.runtime.export_range(desc.data, desc.size)
        except (MoriBackendError, MoriValueError) as e:
            # the region stays registered (other backends may serve it); XGMI does not support it
            _log.warning(
                "XGMI: region %d cannot be shared with GPU IPC, XGMI will not serve it: %s", desc.id, e
            )
            with self._lock:
                self.export_errors[desc.id] = str(e)
            return None
        st = self._device()
        h = self.runtime.handle_class.unpack(handle)
        with self._lock:
            self._exported[desc.id] = handle
            self._local[desc.id] = (self._queue.token(), kernel_reaches(h, st.pci, self.runtime.pid))
        return handle

    def on_deregister_memory(self, desc: MemoryDesc) -> None:
        with self._lock:
            entry = self._local.pop(desc.id, None)
            self._exported.pop(desc.id, None)
            self.export_errors.pop(desc.id, None)
        if entry is not None:
            self._retire(entry[0], f"region {desc.id}")

    def on_register_remote_engine(self, desc: EngineDesc) -> None:
        with self._lock:
            self._remote_nodes[desc.key] = desc.node_id

    def on_deregister_remote_engine(self, desc: EngineDesc) -> None:
        with self._lock:
            self._remote_nodes.pop(desc.key, None)
            gone = [self._mapped.pop(k) for k in [k for k in self._mapped if k[0] == desc.key]]
        try:
            for entry in gone:
                self._retire(entry[3], f"remote engine {desc.key!r}")
        finally:
            for entry in gone:
                entry[1].close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._queue is not None:
            self._queue.close()  # completes what is pending (at most MORI_IO_CP_TIMEOUT_MS)
        with self._lock:
            segments = [entry[1] for entry in self._mapped.values()]
            self._mapped.clear()
        for seg in segments:
            seg.close()
        if self._dev is not None:
            self._free_device(self._dev)
        self._trace = None
        self._trace_kept.clear()  # no launch runs any more

    def _retire(self, token: Any, what: str) -> None:
        """New transfers with ``token`` fail; waits for those in flight (MORI_IO_CP_TIMEOUT_MS)."""
        if self._queue is not None and not self._queue.retire(token, -1):
            from mori.io import env

            raise MoriTimeoutError(
                f"XGMI: transfers on {what} still ran after MORI_IO_CP_TIMEOUT_MS="
                f"{env.MORI_IO_CP_TIMEOUT_MS.get() or 30000} ms"
            )

    # -- transfers -------------------------------------------------------------------------------------

    def _remote(self, remote: MemoryDesc) -> tuple[int, bool, Any]:
        """Where ``remote``'s first byte is mapped in this process (opened on first use), whether
        the scatter-gather kernel may touch it, and its token."""
        k = (remote.engine_key, remote.id)
        handle = backend_handle(remote, "XGMI") or b""
        entry = self._mapped.get(k)
        if entry is not None and entry[0] == handle:
            return int(entry[1].addr), entry[2], entry[3]
        try:
            h = self.runtime.handle_class.unpack(handle)
            seg = self.runtime.open_range(handle)
        except Exception as e:
            raise MoriBackendError(
                f"XGMI: cannot map region {remote.id} of engine {remote.engine_key!r}: {e}"
            ) from e
        reach = kernel_reaches(h, self._device().pci, self.runtime.pid)
        with self._lock:
            # another thread may have opened the same handle meanwhile: the first mapping stays
            # (its token and address may be in use already), this one is closed
            entry = self._mapped.get(k)
            if entry is not None and entry[0] == handle:
                old, spare = None, seg
            else:
                old, spare = self._mapped.pop(k, None), None
                entry = self._mapped[k] = (handle, seg, reach, self._queue.token())
        if spare is not None:
            spare.close()
        if old is not None:  # the same region id with another handle: the old mapping goes
            try:
                self._retire(old[3], f"region {remote.id} of engine {remote.engine_key!r}")
            finally:
                old[1].close()
        return int(entry[1].addr), entry[2], entry[3]

    def _pair(self, local: MemoryDesc, remote: MemoryDesc) -> tuple[Any, bool, int, bool, Any]:
        if self._closed:
            raise MoriBackendError("XGMI: the backend was removed")
        st = self._dev if self._dev is not None else self._device()
        entry = self._local.get(local.id)
        if entry is None:
            raise MoriBackendError(f"XGMI: local region {local.id} is not exported for XGMI")
        rbase, rreach, rtok = self._remote(remote)
        return entry[0], entry[1] and rreach, rbase, st.index, rtok

    def post(
        self,
        op: str,
        local: MemoryDesc,
        local_offsets: Sequence[int],
        remote: MemoryDesc,
        remote_offsets: Sequence[int],
        sizes: Sequence[int],
        uid: int,
    ) -> TransferStatus:
        """One transfer through the native queue. TypeError unless offsets and sizes are lists or
        tuples of non-negative ints (the engine then names the bad argument)."""
        ltok, kernel_ok, rbase, index, rtok = self._pair(local, remote)
        return self._queue.post(  # type: ignore[no-any-return]
            op,
            local.data,
            local.size,
            rbase,
            remote.size,
            local_offsets if type(local_offsets) in (list, tuple) else list(local_offsets),
            remote_offsets if type(remote_offsets) in (list, tuple) else list(remote_offsets),
            sizes if type(sizes) in (list, tuple) else list(sizes),
            uid,
            self._stream_of(index),
            kernel_ok,
            ltok,
            rtok,
            remote.engine_key,
        )

    def session_post(self, local: MemoryDesc, remote: MemoryDesc) -> Any:
        """The native half of an IOEngineSession between ``local`` and ``remote``: read, write,
        batch_read, batch_write with the offsets, sizes and uid (TypeError as :meth:`post`)."""
        ltok, kernel_ok, rbase, index, rtok = self._pair(local, remote)
        return self._queue.session(
            local.data,
            local.size,
            rbase,
            remote.size,
            kernel_ok,
            ltok,
            rtok,
            remote.engine_key,
            self._stream_of,
            index,
        )

    def __repr__(self) -> str:
        return f"XgmiBackend(engine {self.key!r}, {self.runtime.name} runtime, {self.num_streams} streams)"

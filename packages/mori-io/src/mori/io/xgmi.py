"""The XGMI backend (``BackendType.XGMI``): GPU memory to GPU memory of one node, over NVLink (NVIDIA,
CUDA IPC) or xGMI (AMD, HIP IPC), built on :mod:`mori.core.gpu` and a device plugin's runtime.

Registration. Each local GPU region is exported with the runtime's
:meth:`~mori.core.gpu.runtime.GpuRuntime.export_range`: a segment handle (the driver's IPC handle of
the allocation plus the region's offset in it, its size, owner pid and GPU PCI address) that goes
into ``MemoryDesc.ipc_handle``. A region may be any sub-range of a larger allocation (per-layer KV
views). A peer opens the handle with :meth:`~mori.core.gpu.runtime.GpuRuntime.open_range` on its
first transfer to the region: one IPC mapping per allocation per process (the runtime shares it
between regions of the same allocation), kept until the remote engine is deregistered or the
backend closes. Regions of this same process are used directly, without IPC.

Transfers. ``read`` copies remote -> local, ``write`` local -> remote; adjacent blocks (contiguous
on both sides) are merged first. The copies start after the work already queued on torch's current
stream of the backend's GPU (the GPU waits for an event; the host does not block), so data written
by earlier kernels is what moves. Then:

* a batch with at least ``MORI_IO_XGMI_SCATTER_GATHER_THRESHOLD`` blocks of at most
  :data:`SG_MAX_BLOCK` bytes goes through one launch of the Triton scatter-gather kernel
  (:mod:`mori.io.xgmi_kernels`), whose descriptor table sits in pinned host memory the GPU reads
  directly;
* every other block is one asynchronous copy (copy engines / DMA), spread round-robin over the
  backend's ``XgmiBackendConfig.num_streams`` streams.

Completion. An event is recorded on every stream a transfer used; a completion thread waits for
them and completes the :class:`~mori.io.TransferStatus` (``SUCCESS``, or ``ERR_GPU_OP`` with the
driver's message), so statuses progress without anyone calling ``Wait()``. XGMI has no
notifications: the target's ``pop_inbound_transfer_status`` stays empty. At most
``XgmiBackendConfig.num_events`` idle events are kept for reuse.

Safety. The target takes no part in a one-sided GPU copy, so the checks are the initiator's: the
engine checks offsets against both descriptors, and this backend refuses a remote descriptor whose
size or address disagrees with its segment handle (``supports`` answers ``False``), so a
descriptor cannot reach past the region its owner exported.

The backend runs its copies on the GPU its runtime is bound to: torch's current device when the
first GPU region was registered (call ``torch.cuda.set_device`` first in a multi-GPU process).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mori.core.errors import MoriBackendError, MoriTimeoutError, MoriValueError
from mori.io.env import MORI_IO_XGMI_SCATTER_GATHER_THRESHOLD

try:  # numpy makes planning a batch of thousands of blocks take microseconds; it is optional
    import numpy as _np
except ImportError:  # pragma: no cover - numpy comes with torch wheels
    _np = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from mori.core.gpu.runtime import GpuRuntime
    from mori.io import EngineDesc, MemoryDesc, TransferStatus

__all__ = [
    "MORI_IO_XGMI_SCATTER_GATHER_THRESHOLD",
    "Plan",
    "SG_MAX_BLOCK",
    "XgmiBackend",
    "create_backend",
    "find_gpu_runtime",
    "kernel_reaches",
    "out_of_range",
    "merge_blocks",
    "plan",
]

_log = logging.getLogger("mori.io")

#: blocks larger than this never go through the scatter-gather kernel (copy engines do them better)
SG_MAX_BLOCK = 1 << 20
#: descriptor-table entries of one pinned slot (larger batches get a slot of their own size)
TABLE_ENTRIES = 4096
#: a program of the kernel copies about this many bytes of a block (sets the grid's second axis)
SG_BYTES_PER_PROGRAM = 64 << 10
#: most programs per block
SG_MAX_SPLIT = 16
#: batches of at least this many blocks are planned and checked with numpy (fewer: plain Python)
NUMPY_MIN_BLOCKS = 8


# StatusCode values (mori.io.StatusCode; a test checks them); kept here so this module imports
# without the native engine
_SUCCESS = 0
_ERR_INVALID_ARGS = 3
_ERR_GPU_OP = 7


@dataclass(frozen=True)
class Block:
    """One copy: ``size`` bytes from unified address ``src`` to ``dst``."""

    dst: int
    src: int
    size: int


def merge_blocks(dst: Sequence[int], src: Sequence[int], sizes: Sequence[int]) -> list[Block]:
    """Blocks in order, each merged into the previous one where it continues it on both sides;
    zero-sized blocks are dropped."""
    out: list[Block] = []
    for d, s, n in zip(dst, src, sizes, strict=True):
        if n == 0:
            continue
        if out:
            last = out[-1]
            if last.dst + last.size == d and last.src + last.size == s:
                out[-1] = Block(last.dst, last.src, last.size + n)
                continue
        out.append(Block(d, s, n))
    return out


def word_bytes(blocks: Sequence[Block]) -> int:
    """The widest word (8, 4, 2 or 1 bytes) that every address and size of ``blocks`` is a multiple of."""
    acc = 0
    for b in blocks:
        acc |= b.dst | b.src | b.size
    for w in (8, 4, 2):
        if acc % w == 0:
            return w
    return 1


class Plan:
    """The copies of one transfer as parallel int64 sequences ``dst``, ``src``, ``size`` (numpy
    arrays when numpy is installed, else lists), contiguous blocks already merged."""

    __slots__ = ("dst", "size", "src")

    def __init__(self, dst: Any, src: Any, size: Any) -> None:
        self.dst, self.src, self.size = dst, src, size

    def __len__(self) -> int:
        return len(self.size)

    def blocks(self) -> list[Block]:
        return [Block(int(d), int(s), int(n)) for d, s, n in zip(self.dst, self.src, self.size, strict=True)]

    def split(self, limit: int) -> tuple[Plan, Plan]:
        """(blocks of at most ``limit`` bytes, the larger ones)."""
        if self.largest() <= limit:
            return self, Plan([], [], [])
        if not isinstance(self.size, list):  # numpy arrays
            small = self.size <= limit
            large = ~small
            return (
                Plan(self.dst[small], self.src[small], self.size[small]),
                Plan(self.dst[large], self.src[large], self.size[large]),
            )
        parts: tuple[list[int], ...] = ([], [], [], [], [], [])
        for d, s, n in zip(self.dst, self.src, self.size, strict=True):
            k = 0 if n <= limit else 3
            parts[k].append(d)
            parts[k + 1].append(s)
            parts[k + 2].append(n)
        return Plan(*parts[:3]), Plan(*parts[3:])

    def word(self) -> int:
        """:func:`word_bytes` of the blocks."""
        if not isinstance(self.size, list) and len(self):
            acc = int(_np.bitwise_or.reduce(self.dst | self.src | self.size))
        else:
            acc = 0
            for d, s, n in zip(self.dst, self.src, self.size, strict=True):
                acc |= d | s | n
        for w in (8, 4, 2):
            if acc % w == 0:
                return w
        return 1

    def largest(self) -> int:
        if not len(self):
            return 0
        return int(max(self.size)) if isinstance(self.size, list) else int(self.size.max())


def plan(
    dst_base: int, dst_offsets: Sequence[int], src_base: int, src_offsets: Sequence[int], sizes: Sequence[int]
) -> Plan:
    """The copies of one transfer: addresses are base + offset; adjacent blocks that continue each
    other on both sides are merged (as :func:`merge_blocks`); zero-sized blocks are dropped."""
    if _np is None or len(sizes) < NUMPY_MIN_BLOCKS:
        bl = merge_blocks([dst_base + o for o in dst_offsets], [src_base + o for o in src_offsets], sizes)
        return Plan([b.dst for b in bl], [b.src for b in bl], [b.size for b in bl])
    d = _np.asarray(dst_offsets, dtype=_np.int64) + dst_base
    s = _np.asarray(src_offsets, dtype=_np.int64) + src_base
    n = _np.asarray(sizes, dtype=_np.int64)
    if not (len(d) == len(s) == len(n)):
        raise ValueError("dst_offsets, src_offsets and sizes differ in length")
    if not n.all():
        keep = n != 0
        d, s, n = d[keep], s[keep], n[keep]
    if len(n) > 1:
        ends_d, ends_s = d[:-1] + n[:-1], s[:-1] + n[:-1]
        cont = (ends_d == d[1:]) & (ends_s == s[1:])
        if cont.any():
            start = _np.concatenate(([True], ~cont))
            idx = _np.flatnonzero(start)
            n = _np.add.reduceat(n, idx)
            d, s = d[idx], s[idx]
    return Plan(d, s, n)


def out_of_range(offsets: Sequence[int], sizes: Sequence[int], limit: int) -> str:
    """``""`` if every ``[offset, offset + size)`` lies in ``[0, limit)``, else what is wrong with
    the first block that does not. Raises TypeError unless offsets and sizes are ints."""
    if len(offsets) != len(sizes):
        return f"{len(offsets)} offsets for {len(sizes)} sizes"
    if _np is not None and len(sizes) >= NUMPY_MIN_BLOCKS:
        o, n = _np.asarray(offsets), _np.asarray(sizes)
        if o.dtype.kind not in "iu" or n.dtype.kind not in "iu":
            raise TypeError("offsets and sizes must be ints")
        bad = (o < 0) | (n < 0) | (o + n > limit)
        if not bad.any():
            return ""
        i = int(_np.flatnonzero(bad)[0])
    else:
        i = -1
        for k, (off, size) in enumerate(zip(offsets, sizes, strict=True)):
            if type(off) is not int or type(size) is not int:
                raise TypeError("offsets and sizes must be ints")
            if off < 0 or size < 0 or off + size > limit:
                i = k
                break
        if i < 0:
            return ""
    return f"block {i}: offset {offsets[i]} + size {sizes[i]} is outside the region ({limit} bytes)"


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


class _Pointer:
    """What Triton takes as a pointer argument: an address and a torch dtype."""

    def __init__(self, addr: int, dtype: Any) -> None:
        self.addr = addr
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self.addr


class _Table:
    """A descriptor table of ``entries`` blocks in pinned host memory mapped into the GPU."""

    def __init__(self, drv: Any, entries: int) -> None:
        self.entries = entries
        self.host = drv.host_alloc(3 * 8 * entries)
        self.device = drv.host_device_pointer(self.host)
        self.words = (ctypes.c_int64 * (3 * entries)).from_address(self.host)

    def fill(self, p: Plan, word: int) -> None:
        """Row 0 destinations, row 1 sources, row 2 sizes in words; rows are ``len(p)`` long."""
        n = len(p)
        if not isinstance(p.size, list):  # numpy arrays
            view = _np.ctypeslib.as_array(self.words)[: 3 * n]
            view[0:n] = p.dst
            view[n : 2 * n] = p.src
            view[2 * n : 3 * n] = p.size // word
            return
        w = self.words
        w[0:n] = list(p.dst)
        w[n : 2 * n] = list(p.src)
        w[2 * n : 3 * n] = [x // word for x in p.size]


@dataclass(eq=False)
class _Pending:
    status: TransferStatus
    events: list[int]
    table: _Table | None
    local_id: int
    remote_key: str
    what: str


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
        self.threshold = MORI_IO_XGMI_SCATTER_GATHER_THRESHOLD.get() or 0
        self._lock = threading.Lock()
        self._remote_nodes: dict[str, str] = {}
        #: (engine key, region id) -> (handle bytes, opened segment, whether the kernel reaches it)
        self._mapped: dict[tuple[str, int], tuple[bytes, Any, bool]] = {}
        self._exported: dict[int, bytes] = {}
        #: region id -> whether the scatter-gather kernel may touch it (see kernel_reaches)
        self._kernel_local: dict[int, bool] = {}
        #: region id -> why it could not be exported (XGMI then does not serve it)
        self.export_errors: dict[int, str] = {}
        self._dev: Any = None  # the runtime's device state, bound on first use
        self._streams: list[int] = []
        self._torch_streams: dict[int, Any] = {}
        self._next_stream = itertools.count()
        self._order_event = 0
        self._free_events: list[int] = []
        self._free_tables: list[_Table] = []
        self._pending: set[_Pending] = set()
        self._idle = threading.Condition(self._lock)
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        #: what went where: copies, kernel launches (for tests and the benchmark)
        self.counters = {"copies": 0, "kernel_launches": 0, "kernel_blocks": 0, "transfers": 0}

    # -- the GPU -------------------------------------------------------------------------------------

    def _device(self) -> Any:
        """The runtime's device state (its driver, GPU index, ``active()``), with our streams."""
        if self._dev is not None:
            return self._dev
        with self._lock:
            if self._dev is None:
                rt = self.runtime
                st = rt._state if rt._state is not None else rt._bind()
                with st.active():
                    self._streams = [st.drv.stream_create() for _ in range(self.num_streams)]
                    self._order_event = st.drv.event_create()
                self._dev = st
                self._thread = threading.Thread(
                    target=self._complete_loop, name=f"mori-io-xgmi-{self.key}", daemon=True
                )
                self._thread.start()
            return self._dev

    def _current_stream(self, index: int) -> int:
        return int(self.runtime._torch_current_stream(index))

    def _launch_kernel(self, stream: int, table: _Table, n: int, split: int, word: int) -> None:
        """Queue the scatter-gather kernel on ``stream`` (a driver stream handle)."""
        import torch

        from mori.io import xgmi_kernels

        dev = self._dev
        ts = self._torch_streams.get(stream)
        if ts is None:
            ts = torch.cuda.ExternalStream(stream, device=torch.device("cuda", dev.index))  # type: ignore[no-untyped-call]
            self._torch_streams[stream] = ts
        with torch.cuda.stream(ts):
            xgmi_kernels.scatter_gather_kernel[(n, split)](
                _Pointer(table.device, torch.int64),
                n,
                split,
                WORD_BYTES=word,
                BLOCK=xgmi_kernels.DEFAULT_BLOCK,
            )

    # -- Backend protocol -----------------------------------------------------------------------------

    def supports(self, local: MemoryDesc, remote: MemoryDesc) -> bool:
        from mori.io import MemoryLocationType

        gpu = MemoryLocationType.GPU
        if local.loc != gpu or remote.loc != gpu or local.engine_key != self.key:
            return False
        if remote.engine_key != self.key and self._remote_nodes.get(remote.engine_key) != self.node_id:
            return False  # another node: IPC cannot reach it
        if local.id not in self._exported or not remote.ipc_handle:
            return False
        try:
            h = self.runtime.handle_class.unpack(remote.ipc_handle, what="remote MemoryDesc.ipc_handle")
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
            self._kernel_local[desc.id] = kernel_reaches(h, st.pci, self.runtime.pid)
        return handle

    def on_deregister_memory(self, desc: MemoryDesc) -> None:
        self._drain(lambda p: p.local_id == desc.id, f"region {desc.id}")
        with self._lock:
            self._exported.pop(desc.id, None)
            self._kernel_local.pop(desc.id, None)
            self.export_errors.pop(desc.id, None)

    def on_register_remote_engine(self, desc: EngineDesc) -> None:
        with self._lock:
            self._remote_nodes[desc.key] = desc.node_id

    def on_deregister_remote_engine(self, desc: EngineDesc) -> None:
        self._drain(lambda p: p.remote_key == desc.key, f"remote engine {desc.key!r}")
        with self._lock:
            self._remote_nodes.pop(desc.key, None)
            gone = [k for k in self._mapped if k[0] == desc.key]
            segments = [self._mapped.pop(k)[1] for k in gone]
        for seg in segments:
            seg.close()

    def close(self) -> None:
        if self._closed:
            return
        self._drain(lambda p: True, "the backend")
        self._closed = True
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(10)
        with self._lock:
            segments = [entry[1] for entry in self._mapped.values()]
            self._mapped.clear()
        for seg in segments:
            seg.close()
        st = self._dev
        if st is not None:
            with st.lock, st.active():
                for ev in [*self._free_events, self._order_event]:
                    st.drv.event_destroy(ev)
                for s in self._streams:
                    st.drv.stream_destroy(s)
                for t in self._free_tables:
                    st.drv.host_free(t.host)
            self._free_events.clear()
            self._free_tables.clear()
            self._streams = []

    # -- transfers -------------------------------------------------------------------------------------

    def _remote_base(self, remote: MemoryDesc) -> tuple[int, bool]:
        """Where ``remote``'s first byte is mapped in this process (opened on first use), and
        whether the scatter-gather kernel may touch it."""
        k = (remote.engine_key, remote.id)
        entry = self._mapped.get(k)
        if entry is not None and entry[0] == remote.ipc_handle:
            return int(entry[1].addr), entry[2]
        try:
            h = self.runtime.handle_class.unpack(remote.ipc_handle)
            seg = self.runtime.open_range(remote.ipc_handle)
        except Exception as e:
            raise MoriBackendError(
                f"XGMI: cannot map region {remote.id} of engine {remote.engine_key!r}: {e}"
            ) from e
        reach = kernel_reaches(h, self._device().pci, self.runtime.pid)
        with self._lock:
            old = self._mapped.pop(k, None)
            self._mapped[k] = (remote.ipc_handle, seg, reach)
        if old is not None:
            old[1].close()
        return int(seg.addr), reach

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
        from mori.io import TransferStatus

        if self._closed:
            raise MoriBackendError("XGMI: the backend was removed")
        status = TransferStatus()
        what = f"XGMI {op} uid {uid} ({len(sizes)} blocks) with engine {remote.engine_key!r}"
        lo: Any = local_offsets
        ro: Any = remote_offsets
        ns: Any = sizes
        if _np is not None and len(sizes) >= NUMPY_MIN_BLOCKS:  # convert once for the checks and the plan
            lo, ro, ns = _np.asarray(lo), _np.asarray(ro), _np.asarray(ns)
        # the target takes no part in a GPU copy: these checks are the only ones (the engine may skip its own)
        for side, offsets, desc in (("local", lo, local), ("remote", ro, remote)):
            why = out_of_range(offsets, ns, desc.size)
            if why:
                status._complete(_ERR_INVALID_ARGS, f"{what}: {side} {why}")
                return status
        st = self._device()
        rbase, remote_reach = self._remote_base(remote)
        kernel_ok = remote_reach and self._kernel_local.get(local.id, False)
        lbase = local.data
        if op == "write":
            copies = plan(rbase, ro, lbase, lo, ns)
        else:
            copies = plan(lbase, lo, rbase, ro, ns)
        try:
            events, table = self._enqueue(st, copies, kernel_ok)
        except Exception as e:  # a driver call failed: the transfer fails, the backend stays
            status._complete(_ERR_GPU_OP, f"{what}: {e}")
            return status
        status._set_in_progress()
        pending = _Pending(status, events, table, local.id, remote.engine_key, what)
        with self._lock:
            self._pending.add(pending)
            self.counters["transfers"] += 1
        self._queue.put(pending)
        return status

    def _enqueue(self, st: Any, copies: Plan, kernel_ok: bool = True) -> tuple[list[int], _Table | None]:
        """Queue ``copies``; return the events recorded after them and the table used.
        ``kernel_ok``: whether the scatter-gather kernel may touch both regions."""
        drv = st.drv
        use_kernel = kernel_ok and self.threshold > 0 and len(copies) >= self.threshold
        if use_kernel:
            small, large = copies.split(SG_MAX_BLOCK)
            use_kernel = len(small) >= self.threshold
        if not use_kernel:
            small, large = Plan([], [], []), copies
        used: list[int] = []
        table = None
        with st.lock, st.active():
            drv.event_record(self._order_event, self._current_stream(st.index))

            def stream() -> int:
                s = self._streams[next(self._next_stream) % len(self._streams)]
                if s not in used:
                    drv.stream_wait_event(s, self._order_event)
                    used.append(s)
                return s

            if use_kernel:
                word = small.word()
                table = self._table(drv, len(small))
                table.fill(small, word)
                split = max(1, min(SG_MAX_SPLIT, small.largest() // SG_BYTES_PER_PROGRAM))
                self._launch_kernel(stream(), table, len(small), split, word)
                self.counters["kernel_launches"] += 1
                self.counters["kernel_blocks"] += len(small)
            for d, s, n in zip(large.dst, large.src, large.size, strict=True):
                drv.memcpy_async(int(d), int(s), int(n), stream())
            self.counters["copies"] += len(large)
            if not used:  # nothing to copy (all sizes 0): still complete after the current stream
                stream()
            events = []
            for s in used:
                ev = self._free_events.pop() if self._free_events else drv.event_create()
                drv.event_record(ev, s)
                events.append(ev)
        return events, table

    def _table(self, drv: Any, n: int) -> _Table:
        # with the device lock held
        for i, t in enumerate(self._free_tables):
            if t.entries >= n:
                return self._free_tables.pop(i)
        return _Table(drv, max(n, TABLE_ENTRIES))

    def _complete_loop(self) -> None:
        """The completion thread: waits for each transfer's events, in posting order."""
        st0 = self._dev
        try:  # keep the GPU current on this thread: each wait then costs no context switch
            st0.drv.set_current_context(st0.ctx)
        except Exception as e:  # not fatal: active() makes it current per wait instead
            _log.debug("XGMI: completion thread could not keep the GPU current: %s", e)
        while True:
            p = self._queue.get()
            if p is None:
                return
            st = self._dev
            code, message = _SUCCESS, ""
            try:
                with st.active():
                    for ev in p.events:
                        st.drv.event_synchronize(ev)
            except Exception as e:
                code, message = _ERR_GPU_OP, f"{p.what}: {e}"
            with st.lock:
                for ev in p.events:
                    if len(self._free_events) < self.num_events:
                        self._free_events.append(ev)
                    else:
                        with st.active():
                            st.drv.event_destroy(ev)
                if p.table is not None:
                    self._free_tables.append(p.table)
            p.status._complete(code, message)
            with self._lock:
                self._pending.discard(p)
                self._idle.notify_all()

    def _drain(self, match: Any, what: str) -> None:
        """Block until no pending transfer matches (at most MORI_IO_CP_TIMEOUT_MS)."""
        from mori.io import env

        timeout_s = (env.MORI_IO_CP_TIMEOUT_MS.get() or 30000) / 1000
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while any(match(p) for p in self._pending):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise MoriTimeoutError(
                        f"XGMI: transfers on {what} still ran after MORI_IO_CP_TIMEOUT_MS={int(timeout_s * 1000)} ms"
                    )
                self._idle.wait(left)

    def __repr__(self) -> str:
        return f"XgmiBackend(engine {self.key!r}, {self.runtime.name} runtime, {self.num_streams} streams)"

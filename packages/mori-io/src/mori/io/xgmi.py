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
  directly. Tables form a ring, each with its own event recorded after the kernel that reads it:
  a table is reused once that event completed. The first launch of a word width goes through
  Triton; later ones call the compiled kernel's launcher directly (:class:`_FastLaunch`);
* every other block is one asynchronous copy (copy engines / DMA), spread round-robin over the
  backend's ``XgmiBackendConfig.num_streams`` streams; a block of at least twice
  ``MORI_IO_XGMI_STRIPE_BYTES`` (default 0: never) is cut into pieces on several streams.

One block is checked and queued without building any list (record on the current stream, wait on
a copy stream, copy, record); a batch is checked and planned with numpy in one conversion
(:func:`check_and_plan`).

Completion. An event is recorded on every stream a transfer used. Statuses are
:class:`XgmiTransferStatus` (see :func:`status_class`): ``Wait()``/``WaitFor()`` wait for the
events in the calling thread and complete the status there (no thread hand-off). A completion
thread completes the statuses nobody waits on, in posting order, so statuses progress without
anyone calling ``Wait()``. Exactly one party (the waiter or the thread, the first to claim it)
waits on a transfer's events and completes it (``SUCCESS``, or ``ERR_GPU_OP`` with the driver's
message): its events go back to the pool only then, so no event is reused while another thread
still waits on it. XGMI has no notifications: the target's ``pop_inbound_transfer_status`` stays
empty. At most ``XgmiBackendConfig.num_events`` idle events are kept for reuse.

Safety. The target takes no part in a one-sided GPU copy, so the checks are the initiator's: the
engine checks offsets against both descriptors, and this backend refuses a remote descriptor whose
size or address disagrees with its segment handle (``supports`` answers ``False``), so a
descriptor cannot reach past the region its owner exported.

The backend runs its copies on the GPU its runtime is bound to: torch's current device when the
first GPU region was registered (call ``torch.cuda.set_device`` first in a multi-GPU process).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mori.core.errors import MoriBackendError, MoriTimeoutError, MoriValueError
from mori.io.env import MORI_IO_XGMI_SCATTER_GATHER_THRESHOLD, MORI_IO_XGMI_STRIPE_BYTES

try:  # numpy makes planning a batch of thousands of blocks take microseconds; it is optional
    import numpy as _np
except ImportError:  # pragma: no cover - numpy comes with torch wheels
    _np = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from mori.core.gpu.runtime import GpuRuntime
    from mori.io import EngineDesc, MemoryDesc, TransferStatus

__all__ = [
    "MORI_IO_XGMI_SCATTER_GATHER_THRESHOLD",
    "MORI_IO_XGMI_STRIPE_BYTES",
    "Plan",
    "SG_MAX_BLOCK",
    "XgmiBackend",
    "create_backend",
    "find_gpu_runtime",
    "kernel_reaches",
    "out_of_range",
    "merge_blocks",
    "plan",
    "status_class",
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
#: WaitFor(timeout) polls the events without sleeping this long, then sleeps, backing off to WAIT_MAX_SLEEP_S
WAIT_SPIN_S = 100e-6
WAIT_MAX_SLEEP_S = 1e-3


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

    __slots__ = ("_largest", "_word", "dst", "size", "src")

    def __init__(self, dst: Any, src: Any, size: Any) -> None:
        self.dst, self.src, self.size = dst, src, size
        self._largest = self._word = 0  # 0: not known yet

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
        if self._word:
            return self._word
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
        if self._largest:
            return self._largest
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


def _word_of(acc: int) -> int:
    for w in (8, 4, 2):
        if acc % w == 0:
            return w
    return 1


def check_and_plan(op: str, lbase: int, lsize: int, rbase: int, rsize: int, rows: Any) -> Plan | None:
    """The plan of a batch given as one int array ``rows`` = [local offsets, remote offsets,
    sizes] (numpy), checked against both regions in a few vectorised steps: ``None`` if a block
    lies outside either region (:func:`out_of_range` then says which). Same result as
    :func:`plan`; blocks with nothing to merge and no zero size (the common case) take a short cut."""
    size = rows[2]
    ends = rows[:2] + size
    emax = ends.max(axis=1)
    if int(rows.min()) < 0 or int(emax[0]) > lsize or int(emax[1]) > rsize:
        return None
    # a block merges only if it continues the previous one on both sides; checking one side first
    # is enough when nothing continues there (strided batches)
    if size.all() and (
        not (ends[0, :-1] == rows[0, 1:]).any() or not (ends[:, :-1] == rows[:2, 1:]).all(axis=0).any()
    ):
        laddr, raddr = rows[0] + lbase, rows[1] + rbase
        p = Plan(raddr, laddr, size) if op == "write" else Plan(laddr, raddr, size)
        p._largest = int(size.max())
        p._word = _word_of(int(_np.bitwise_or.reduce(rows, axis=None)) | lbase | rbase)
        return p
    if op == "write":
        return plan(rbase, rows[1], lbase, rows[0], size)
    return plan(lbase, rows[0], rbase, rows[1], size)


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
    """A descriptor table of ``entries`` blocks in pinned host memory mapped into the GPU, and the
    event recorded after the kernel that last read it (the table is reused only once that event
    has completed, see :meth:`XgmiBackend._table`)."""

    __slots__ = ("device", "entries", "event", "host", "view", "words")

    def __init__(self, drv: Any, entries: int) -> None:
        self.entries = entries
        self.host = drv.host_alloc(3 * 8 * entries)
        try:
            self.device = drv.host_device_pointer(self.host)
            self.event = drv.event_create()
        except BaseException:
            drv.host_free(self.host)
            raise
        self.words = (ctypes.c_int64 * (3 * entries)).from_address(self.host)
        self.view = _np.ctypeslib.as_array(self.words) if _np is not None else None

    def fill(self, p: Plan, word: int) -> None:
        """Row 0 destinations, row 1 sources, row 2 sizes in words; rows are ``len(p)`` long."""
        n = len(p)
        if not isinstance(p.size, list):  # numpy arrays
            view = self.view
            view[0:n] = p.dst
            view[n : 2 * n] = p.src
            view[2 * n : 3 * n] = p.size // word
            return
        w = self.words
        w[0:n] = list(p.dst)
        w[n : 2 * n] = list(p.src)
        w[2 * n : 3 * n] = [x // word for x in p.size]

    def close(self, drv: Any) -> None:
        drv.event_destroy(self.event)
        drv.host_free(self.host)


#: who completes a pending transfer (see XgmiBackend._wait and _complete_loop)
_WAITER = 1
_THREAD = 2


class _Pending:
    """One posted transfer until it completes. ``events``: recorded after its copies (one per
    stream used); ``table``: the descriptor table its kernel reads (its event is among
    ``events``); ``owner``: who waits for the events and completes it (set once, under the
    backend's ``_lock``); ``done``: completed and its events returned (under the device lock)."""

    __slots__ = (
        "done",
        "events",
        "local_id",
        "nblocks",
        "op",
        "owner",
        "remote_key",
        "status",
        "table",
        "uid",
    )

    def __init__(self, status: Any, op: str, uid: int, nblocks: int, local_id: int, remote_key: str) -> None:
        self.status = status
        self.op = op
        self.uid = uid
        self.nblocks = nblocks
        self.local_id = local_id
        self.remote_key = remote_key
        self.events: list[int] = []
        self.table: _Table | None = None
        self.owner = 0
        self.done = False

    def what(self) -> str:
        return f"XGMI {self.op} uid {self.uid} ({self.nblocks} blocks) with engine {self.remote_key!r}"


_STATUS_CLASS: Any = None


def status_class() -> Any:
    """:class:`XgmiTransferStatus`, made on first use (this module imports without the native engine)."""
    global _STATUS_CLASS
    if _STATUS_CLASS is not None:
        return _STATUS_CLASS
    from mori.io import TransferStatus

    base_wait, base_wait_for = TransferStatus.Wait, TransferStatus.WaitFor

    class XgmiTransferStatus(TransferStatus):  # type: ignore[misc]
        """A :class:`~mori.io.TransferStatus` of the XGMI backend. ``Wait()`` and ``WaitFor()`` wait
        for the transfer's GPU events in the calling thread and complete the status there (no
        hand-off through the completion thread, which still completes statuses nobody waits on)."""

        __slots__ = ("_xgmi",)

        def Wait(self) -> None:
            p = self._xgmi
            if p is not None and p[0]._wait(p[1], -1) is None:
                return  # completed here (the native wait would only hand the GIL around)
            base_wait(self)  # the completion thread completes it

        def WaitFor(self, timeout_ms: int) -> bool:
            p = self._xgmi
            if p is not None and type(timeout_ms) is int:
                left = p[0]._wait(p[1], timeout_ms)
                if left is None:
                    return True
                timeout_ms = left
            return bool(base_wait_for(self, timeout_ms))

    XgmiTransferStatus.__module__ = __name__
    _STATUS_CLASS = XgmiTransferStatus
    return _STATUS_CLASS


def _no_hooks(hook: Any) -> bool:
    # Triton < 3.5: None when unset; 3.5+: a HookChain whose ``calls`` is empty
    return hook is None or not getattr(hook, "calls", True)


class _FastLaunch:
    """Launches of one compiled variant of the scatter-gather kernel without Triton's Python
    binder (argument binding, specialization key, cache lookup: tens of microseconds a launch):
    the compiled kernel's own launcher is called the way ``JITFunction.run`` calls it, with launch
    hooks (profilers) honoured. ``args`` after the grid: every kernel argument in signature
    order, constexprs included (the launcher ignores them)."""

    __slots__ = ("kernel", "knobs")

    def __init__(self, kernel: Any) -> None:
        from triton import knobs

        self.kernel = kernel
        self.knobs = knobs.runtime

    @staticmethod
    def usable(kernel: Any) -> bool:
        return all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata", "launch_metadata"))

    def __call__(self, grid0: int, grid1: int, stream: int, *args: Any) -> None:
        k = self.kernel
        enter, leave = self.knobs.launch_enter_hook, self.knobs.launch_exit_hook
        if _no_hooks(enter) and _no_hooks(leave):
            k.run(grid0, grid1, 1, stream, k.function, k.packed_metadata, None, None, None, *args)
        else:
            meta = k.launch_metadata((grid0, grid1, 1), stream, *args)
            k.run(grid0, grid1, 1, stream, k.function, k.packed_metadata, meta, enter, leave, *args)


class XgmiBackend:
    """The XGMI data path of one engine (see the module docstring). ``key``/``node_id``: the
    engine's; ``runtime``: the GPU runtime that maps and copies; ``num_streams``/``num_events``:
    from :class:`~mori.io.XgmiBackendConfig`."""

    preference = 100
    #: post() checks every block against both regions itself (the engine may skip its per-block checks)
    checks_ranges = True
    #: launch the kernel through the compiled kernel's launcher after the first launch (False: every
    #: launch through Triton's JITFunction, for comparison or if a Triton version changes the call)
    fast_launch = True

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
        #: a copy of at least 2 x this many bytes is cut into pieces of at least this size on
        #: several streams (copy engines), at most num_streams pieces; 0: never
        self.stripe_bytes = MORI_IO_XGMI_STRIPE_BYTES.get() or 0
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
        self._next_stream = 0
        self._order_event = 0
        self._free_events: list[int] = []
        #: descriptor tables, reused in order once their event completed (see _table)
        self._tables: list[_Table] = []
        #: word width -> launcher of the compiled scatter-gather kernel (see _launch_kernel)
        self._launchers: dict[int, _FastLaunch] = {}
        self._current_stream = runtime._torch_current_stream
        self._status_class = status_class()
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

    def _launch_kernel(self, stream: int, table: _Table, n: int, split: int, word: int) -> None:
        """Queue the scatter-gather kernel on ``stream`` (a driver stream handle): the first launch
        of a word width through Triton (which compiles or loads the kernel), later ones straight
        through the compiled kernel's launcher (:class:`_FastLaunch`)."""
        from mori.io.xgmi_kernels import DEFAULT_BLOCK

        fast = self._launchers.get(word)
        if fast is not None:
            fast(n, split, stream, table.device, n, split, word, DEFAULT_BLOCK)
            return
        kernel = self._launch_jit(stream, table, n, split, word)
        if self.fast_launch and _FastLaunch.usable(kernel):
            self._launchers[word] = _FastLaunch(kernel)

    def _launch_jit(self, stream: int, table: _Table, n: int, split: int, word: int) -> Any:
        """Launch through ``JITFunction.run`` on ``stream``; returns the compiled kernel."""
        import torch

        from mori.io import xgmi_kernels

        dev = self._dev
        ts = self._torch_streams.get(stream)
        if ts is None:
            ts = torch.cuda.ExternalStream(stream, device=torch.device("cuda", dev.index))  # type: ignore[no-untyped-call]
            self._torch_streams[stream] = ts
        with torch.cuda.stream(ts):
            return xgmi_kernels.scatter_gather_kernel[(n, split)](
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
                for t in self._tables:
                    t.close(st.drv)
            self._free_events.clear()
            self._tables.clear()
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
        if self._closed:
            raise MoriBackendError("XGMI: the backend was removed")
        n = len(sizes)
        single = n == 1 and len(local_offsets) == 1 and len(remote_offsets) == 1
        lo: Any = local_offsets
        ro: Any = remote_offsets
        ns: Any = sizes
        copies: Plan | None = None
        if single:  # one block: checked here, without building lists (the common case)
            lo0, ro0, size = lo[0], ro[0], ns[0]
            if type(lo0) is not int or type(ro0) is not int or type(size) is not int:
                raise TypeError("offsets and sizes must be ints")
            bad = size < 0 or lo0 < 0 or lo0 + size > local.size or ro0 < 0 or ro0 + size > remote.size
        elif _np is not None and n >= NUMPY_MIN_BLOCKS and len(lo) == n == len(ro):
            # one conversion for the checks and the plan
            rows = _np.array((lo, ro, ns))
            if rows.dtype.kind not in "iu" or rows.ndim != 2:
                raise TypeError("offsets and sizes must be ints")
            lo, ro, ns = rows
            rbase, remote_reach = self._remote_base(remote)
            copies = check_and_plan(op, local.data, local.size, rbase, remote.size, rows)
            bad = copies is None
        else:
            bad = True
        if bad:  # the target takes no part in a GPU copy: these checks are the only ones
            for side, offsets, desc in (("local", lo, local), ("remote", ro, remote)):
                why = out_of_range(offsets, ns, desc.size)
                if why:
                    return self._failed(
                        _ERR_INVALID_ARGS,
                        f"XGMI {op} uid {uid} ({n} blocks) with engine {remote.engine_key!r}: {side} {why}",
                    )
        st = self._dev if self._dev is not None else self._device()
        if copies is None:
            rbase, remote_reach = self._remote_base(remote)
        status = self._status_class()
        p = _Pending(status, op, uid, n, local.id, remote.engine_key)
        try:
            if single:
                if op == "write":
                    self._enqueue_one(st, p, rbase + ro0, local.data + lo0, size)
                else:
                    self._enqueue_one(st, p, local.data + lo0, rbase + ro0, size)
            else:
                kernel_ok = remote_reach and self._kernel_local.get(local.id, False)
                if copies is None:
                    if op == "write":
                        copies = plan(rbase, ro, local.data, lo, ns)
                    else:
                        copies = plan(local.data, lo, rbase, ro, ns)
                self._enqueue(st, p, copies, kernel_ok)
        except Exception as e:  # a driver call failed: the transfer fails, the backend stays
            status._xgmi = None
            status._complete(_ERR_GPU_OP, f"{p.what()}: {e}")
            return status  # type: ignore[no-any-return]
        status._set_in_progress()
        status._xgmi = (self, p)
        with self._lock:
            self._pending.add(p)
        self.counters["transfers"] += 1
        self._queue.put(p)  # last: the completion thread may take the GIL from here on
        return status  # type: ignore[no-any-return]

    @staticmethod
    def _failed(code: int, message: str) -> TransferStatus:
        from mori.io import TransferStatus

        st = TransferStatus()
        st._complete(code, message)
        return st

    def _stream(self) -> int:
        # with the device lock held
        i = self._next_stream
        self._next_stream = i + 1
        return self._streams[i % len(self._streams)]

    def _event(self, drv: Any) -> int:
        # with the device lock held
        return self._free_events.pop() if self._free_events else int(drv.event_create())

    def _pieces(self, dst: int, src: int, size: int) -> list[tuple[int, int, int]]:
        """One copy cut into pieces for several streams (``stripe_bytes``), or itself."""
        stripe = self.stripe_bytes
        if not stripe or size < 2 * stripe:
            return [(dst, src, size)]
        k = min(self.num_streams, size // stripe)
        piece = -(-size // k)
        piece = -(-piece // 4096) * 4096  # page-sized pieces
        return [(dst + o, src + o, min(piece, size - o)) for o in range(0, size, piece)]

    def _enqueue_one(self, st: Any, p: _Pending, dst: int, src: int, size: int) -> None:
        """Queue one block: after torch's current stream, one async copy and one event record (or
        a piece per stream when striped)."""
        drv = st.drv
        with st.lock:
            prev = drv.current_context()
            if prev != st.ctx:
                drv.set_current_context(st.ctx)
            try:
                drv.event_record(self._order_event, self._current_stream(st.index))
                pieces = self._pieces(dst, src, size) if size else [(dst, src, 0)]
                events = p.events
                for d, s, n in pieces:
                    stream = self._stream()
                    drv.stream_wait_event(stream, self._order_event)
                    if n:
                        drv.memcpy_async(d, s, n, stream)
                    ev = self._event(drv)
                    events.append(ev)
                    drv.event_record(ev, stream)
                self.counters["copies"] += 1 if size else 0
            except BaseException:
                self._free_events.extend(p.events)
                p.events = []
                raise
            finally:
                if prev != st.ctx:
                    drv.restore_context(prev)

    def _enqueue(self, st: Any, p: _Pending, copies: Plan, kernel_ok: bool = True) -> None:
        """Queue ``copies``; sets ``p.events`` (recorded after them) and ``p.table``.
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
        kernel_stream = 0
        with st.lock:
            prev = drv.current_context()
            if prev != st.ctx:
                drv.set_current_context(st.ctx)
            try:
                drv.event_record(self._order_event, self._current_stream(st.index))

                def stream() -> int:
                    s = self._stream()
                    if s not in used:
                        drv.stream_wait_event(s, self._order_event)
                        used.append(s)
                    return s

                if use_kernel:
                    word = small.word()
                    table = self._table(drv, len(small))
                    table.fill(small, word)
                    split = max(1, min(SG_MAX_SPLIT, small.largest() // SG_BYTES_PER_PROGRAM))
                    kernel_stream = stream()
                    self._launch_kernel(kernel_stream, table, len(small), split, word)
                    p.table = table
                    self.counters["kernel_launches"] += 1
                    self.counters["kernel_blocks"] += len(small)
                for d, s, n in zip(large.dst, large.src, large.size, strict=True):
                    for d1, s1, n1 in self._pieces(int(d), int(s), int(n)):
                        drv.memcpy_async(d1, s1, n1, stream())
                self.counters["copies"] += len(large)
                if not used:  # nothing to copy (all sizes 0): still complete after the current stream
                    stream()
                for s in used:
                    ev = table.event if table is not None and s == kernel_stream else self._event(drv)
                    p.events.append(ev)
                    drv.event_record(ev, s)
            except BaseException:
                if table is not None and table.event not in p.events:
                    # the kernel may read the table: it is not reused before the stream got there
                    with contextlib.suppress(Exception):
                        drv.stream_synchronize(kernel_stream)
                self._free_events.extend(ev for ev in p.events if table is None or ev != table.event)
                p.events = []
                raise
            finally:
                if prev != st.ctx:
                    drv.restore_context(prev)

    def _table(self, drv: Any, n: int) -> _Table:
        """A descriptor table of at least ``n`` entries that no kernel reads any more: the first of
        the ring whose event (recorded after the kernel that last used it) has completed, else a
        new one added to the ring. With the device lock held. (The transfer that last used it may
        not be completed yet; its owner may then wait on the table's event after it was recorded
        again, which only makes that wait longer, never wrong.)"""
        for t in self._tables:
            if t.entries >= n and drv.event_query(t.event):
                return t
        t = _Table(drv, max(n, TABLE_ENTRIES))
        self._tables.append(t)
        return t

    # -- completion ----------------------------------------------------------------------------------------

    def _claim(self, p: _Pending, who: int) -> bool:
        """Make ``who`` the one that waits for ``p``'s events and completes it; False if another is."""
        with self._lock:
            if p.owner:
                return False
            p.owner = who
            return True

    def _sync(self, st: Any, p: _Pending) -> tuple[int, str]:
        """Wait for ``p``'s events (GIL released in each driver call): (code, message)."""
        drv = st.drv
        try:
            prev = drv.current_context()
            if prev != st.ctx:
                drv.set_current_context(st.ctx)
            try:
                for ev in p.events:
                    drv.event_synchronize(ev)
            finally:
                if prev != st.ctx:
                    drv.restore_context(prev)
        except Exception as e:
            return _ERR_GPU_OP, f"{p.what()}: {e}"
        return _SUCCESS, ""

    def _finish(self, p: _Pending, code: int, message: str) -> None:
        """Complete ``p`` (by its owner, after its events): events back to the pool, status done."""
        st = self._dev
        with st.lock:
            p.done = True
            free = self._free_events
            table_event = p.table.event if p.table is not None else None
            extra = []
            for ev in p.events:
                if ev == table_event:
                    continue
                if len(free) < self.num_events:
                    free.append(ev)
                else:
                    extra.append(ev)
            if extra:
                with contextlib.suppress(Exception), st.active():
                    for ev in extra:
                        st.drv.event_destroy(ev)
        status, p.status = p.status, None
        if status is not None:
            status._xgmi = None
            status._complete(code, message)
        with self._lock:
            self._pending.discard(p)
            self._idle.notify_all()

    def _wait(self, p: _Pending, timeout_ms: int) -> int | None:
        """``Wait()`` (``timeout_ms`` < 0) / ``WaitFor(timeout_ms)`` of ``p``'s status in the
        calling thread: waits for the events and completes the status here, unless the completion
        thread already does. Returns None if this call completed the status, else the
        milliseconds left for the status's own (native) wait: ``timeout_ms`` (-1: no limit) when
        another completes it, 0 on timeout."""
        st = self._dev
        if timeout_ms < 0:
            if self._claim(p, _WAITER):
                self._finish(p, *self._sync(st, p))
                return None
            return timeout_ms
        # bounded: poll the events (no blocking driver call that could outlast the timeout)
        drv = st.drv
        clock = time.monotonic
        start = clock()
        deadline = start + timeout_ms / 1000
        pause = 0.0
        prev = drv.current_context()
        if prev != st.ctx:
            drv.set_current_context(st.ctx)
        try:
            while True:
                with st.lock:
                    if p.done:  # completed by another (its events may be reused by now)
                        return max(0, int((deadline - clock()) * 1000))
                    try:
                        ready = all(drv.event_query(ev) for ev in p.events)
                        code, message = _SUCCESS, ""
                    except Exception as e:
                        ready, code, message = True, _ERR_GPU_OP, f"{p.what()}: {e}"
                if ready:
                    if self._claim(p, _WAITER):
                        self._finish(p, code, message)
                        return None
                    return max(0, int((deadline - clock()) * 1000))
                now = clock()
                if now >= deadline:
                    return 0
                if now - start >= WAIT_SPIN_S:  # sleep (GIL released), backing off
                    pause = min(max(2 * pause, 20e-6), WAIT_MAX_SLEEP_S, deadline - now)
                    time.sleep(pause)
        finally:
            if prev != st.ctx:
                drv.restore_context(prev)

    def _complete_loop(self) -> None:
        """The completion thread: waits for the events of each transfer nobody waits on, in
        posting order, and completes its status."""
        st0 = self._dev
        try:  # keep the GPU current on this thread: each wait then costs no context switch
            st0.drv.set_current_context(st0.ctx)
        except Exception as e:  # not fatal: _sync makes it current per wait instead
            _log.debug("XGMI: completion thread could not keep the GPU current: %s", e)
        while True:
            p = self._queue.get()
            if p is None:
                return
            if self._claim(p, _THREAD):
                self._finish(p, *self._sync(self._dev, p))

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

"""The ``cuda`` device runtime: the symmetric heap in NVIDIA GPU memory, shared with CUDA IPC.

**Device.** The heap lives on the *current torch CUDA device* when the first segment is created
(each rank calls ``torch.cuda.set_device`` before ``shmem_init``). Every driver call runs in that
device's primary context, the one torch uses, made current for the call and restored after.

**Heap.** ``static_heap`` only: one ``cuMemAlloc`` of ``MORI_SHMEM_HEAP_SIZE`` bytes, 2 MiB
aligned and zeroed, exported with ``cuIpcGetMemHandle``. Peers (other processes, on this GPU or
another one of the node) map it with ``cuIpcOpenMemHandle`` and peer access enabled lazily.
``vmm_heap`` and ``isolation`` are refused with a clear error (see the README for why IPC).

**Host access** (the methods core's host API uses), all synchronous with the host and ordered
after the work already queued on torch's current stream of the device:

* :meth:`byte_view`: a uint8 tensor over any mapped address on this rank's GPU (DLPack, no copy);
* :meth:`copy`: ``cuMemcpyAsync`` on the runtime's stream, any unified address (heap, peer heap,
  registered device or host memory), overlapping ranges handled like ``memmove``;
* :meth:`atomic_rmw` / :meth:`atomic_compare_swap`: one system-scope atomic done by the GPU (a
  one-program Triton kernel on the runtime's stream), the old value read from pinned host memory;
* :meth:`wait_until`: polls the word with a device-to-host copy on a stream of its own (so it
  never queues behind a kernel), spinning briefly and then sleeping, GIL released;
* :meth:`fence`: ``cuCtxSynchronize``, every earlier kernel and copy of this process has completed.

**Beyond the contract:** :meth:`CudaRuntime.export_range` / :meth:`CudaRuntime.open_range` share any
``cudaMalloc``'ed range (a torch tensor) with another process; :meth:`CudaRuntime.copy_engine`
gives asynchronous copies on dedicated streams (:class:`~mori_backend_nvlink.copy_engine.CopyEngine`).
"""

from __future__ import annotations

import contextlib
import ctypes
import operator
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from mori.core import env as core_env
from mori.core.backend import (
    OP_ADD,
    OP_AND,
    OP_FETCH,
    OP_OR,
    OP_SET,
    OP_SWAP,
    OP_XOR,
    WORD_INT32,
    WORD_INT64,
    WORD_UINT32,
    WORD_UINT64,
    Availability,
    DeviceRuntime,
    HeapSegment,
    PeerInfo,
    PeerSegment,
)
from mori.core.errors import MoriBackendError, MoriStateError, MoriValueError
from mori_backend_nvlink import _dlpack
from mori_backend_nvlink.driver import CudaDriver, CudaError, load_driver
from mori_backend_nvlink.handles import KIND_HEAP, KIND_RANGE, PciAddress, SegmentHandle

if TYPE_CHECKING:
    import torch

    from mori_backend_nvlink.copy_engine import CopyEngine

__all__ = ["CudaPeerSegment", "CudaRuntime", "CudaSegment"]

#: heap segments are placed at a multiple of this (mori.shmem promises alignments up to 2 MiB)
HEAP_ALIGN = 2 << 20
#: the compare-and-swap op of the atomic kernel (after mori.core.backend's OP_* codes)
OP_CAS = 7
#: copies of overlapping ranges go through a device buffer of at most this many bytes
SCRATCH_MAX = 64 << 20
#: wait_until spins this long before it starts to sleep, and sleeps at most this long
_SPIN_S = 1e-3
_MAX_SLEEP_S = 1e-3

# word code -> (name, bytes, smallest, largest, ctypes type)
_WORDS: dict[int, tuple[str, int, int, int, Any]] = {
    WORD_INT32: ("int32", 4, -(2**31), 2**31 - 1, ctypes.c_int32),
    WORD_UINT32: ("uint32", 4, 0, 2**32 - 1, ctypes.c_uint32),
    WORD_INT64: ("int64", 8, -(2**63), 2**63 - 1, ctypes.c_int64),
    WORD_UINT64: ("uint64", 8, 0, 2**64 - 1, ctypes.c_uint64),
}
_OPS = (OP_FETCH, OP_SET, OP_ADD, OP_SWAP, OP_AND, OP_OR, OP_XOR)
_CMPS: dict[int, Callable[[int, int], bool]] = {
    0: operator.eq,
    1: operator.ne,
    2: operator.gt,
    3: operator.ge,
    4: operator.lt,
    5: operator.le,
}


def _word(word: int) -> tuple[str, int, int, int, Any]:
    if word not in _WORDS:
        raise ValueError(f"unknown word type {word}")
    return _WORDS[word]


def _check_word(addr: int, word: int, *values: int) -> tuple[str, int, Any]:
    """Validate the address and operands like mori.core._core does (same messages)."""
    name, size, lo, hi, ctype = _word(word)
    if addr == 0:
        raise ValueError("address is 0 (null)")
    if addr % size:
        raise ValueError(f"address {addr} is not aligned to {size} bytes")
    for v in values:
        if not lo <= v <= hi:
            raise ValueError(f"value {v} does not fit the atomic word")
    return name, size, ctype


def _halves(value: int) -> tuple[int, int]:
    """The low and high 32 bits of ``value``'s 64-bit two's-complement pattern, as signed int32s."""
    bits = value & 0xFFFF_FFFF_FFFF_FFFF

    def signed(x: int) -> int:
        return x - (1 << 32) if x >= 1 << 31 else x

    return signed(bits & 0xFFFF_FFFF), signed(bits >> 32)


class _Pointer:
    """What Triton takes as a typed pointer argument: an address and a torch dtype."""

    def __init__(self, addr: int, dtype: Any) -> None:
        self.addr = addr
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self.addr


class _DeviceState:
    """What the runtime holds for its GPU: context, streams, pinned words, IPC mappings."""

    def __init__(self, drv: CudaDriver, index: int) -> None:
        self.drv = drv
        self.index = index
        drv.init()
        self.device = drv.device(index)
        self.ctx = drv.primary_context_retain(self.device)  # the context torch's runtime API uses
        self.pci = PciAddress.parse(drv.pci_bus_id(self.device))
        self.lock = threading.RLock()
        self._ordinals: dict[PciAddress, int] | None = None
        #: IPC handle -> [address mapped here, references]
        self.opened: dict[bytes, list[int]] = {}
        self.scratch = 0
        self.scratch_size = 0
        self.torch_stream: Any = None  # torch.cuda.ExternalStream over op_stream (Triton launches)
        self.copy_engine: CopyEngine | None = None
        with self.active():
            self.op_stream = drv.stream_create()
            self.poll_stream = drv.stream_create()
            self.order_event = drv.event_create()
            # [0, 8): result of the last atomic; [8, 16): the word wait_until polls
            self.pinned = drv.host_alloc(64)
            self.pinned_device = drv.host_device_pointer(self.pinned)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Make this GPU's primary context current for the block (restoring another one after)."""
        prev = self.drv.current_context()
        if prev == self.ctx:
            yield
            return
        self.drv.set_current_context(self.ctx)
        try:
            yield
        finally:
            if prev:  # a thread without a context keeps ours: it is the one torch would pick
                self.drv.set_current_context(prev)

    def ordinal_of(self, pci: PciAddress) -> int | None:
        """This process's ordinal of the GPU at ``pci``, None if it is not visible here."""
        if self._ordinals is None:
            found = {}
            for i in range(self.drv.device_count()):
                found[PciAddress.parse(self.drv.pci_bus_id(self.drv.device(i)))] = i
            self._ordinals = found
        return self._ordinals.get(pci)

    def open_ipc(self, ipc: bytes, detail: str) -> int:
        """Map the allocation ``ipc`` names (once per process; later opens share the mapping)."""
        with self.lock:
            entry = self.opened.get(ipc)
            if entry is not None:
                entry[1] += 1
                return entry[0]
            with self.active():
                addr = self.drv.ipc_open_handle(ipc, detail=detail)
            self.opened[ipc] = [addr, 1]
            return addr

    def close_ipc(self, ipc: bytes) -> None:
        with self.lock:
            entry = self.opened.get(ipc)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del self.opened[ipc]
                with self.active():
                    self.drv.ipc_close_handle(entry[0])

    def scratch_buffer(self, nbytes: int) -> int:
        """A device buffer of at least ``nbytes`` (call with the lock held)."""
        if self.scratch_size < nbytes:
            with self.active():
                if self.scratch:
                    self.drv.mem_free(self.scratch)
                    self.scratch, self.scratch_size = 0, 0
                self.scratch = self.drv.mem_alloc(nbytes)
                self.scratch_size = nbytes
        return self.scratch


class CudaSegment(HeapSegment):
    """This rank's heap: ``size`` zeroed bytes of GPU memory at ``addr`` (2 MiB aligned)."""

    def __init__(self, state: _DeviceState, raw: int, addr: int, size: int, handle: bytes) -> None:
        self._state = state
        self._raw = raw  # what cuMemAlloc returned (addr may be above it, for alignment)
        self.addr = addr
        self.size = size
        self.handle = handle

    def close(self) -> None:
        if self._raw:
            raw, self._raw, self.addr = self._raw, 0, 0
            with self._state.lock, self._state.active():
                self._state.drv.synchronize()  # no kernel or copy of ours may still touch it
                self._state.drv.mem_free(raw)


class CudaPeerSegment(PeerSegment):
    """Another process's GPU memory (a heap or an exported range) mapped into this one at ``addr``.

    ``close`` unmaps it (the mapping is shared by every open of the same allocation and goes away
    with the last one). A range exported by this same process is not mapped again: ``addr`` is the
    original address and ``close`` does nothing.
    """

    def __init__(self, state: _DeviceState | None, ipc: bytes | None, addr: int, size: int) -> None:
        self._state = state
        self._ipc = ipc
        self.addr = addr
        self.size = size

    def close(self) -> None:
        if self._ipc is not None and self._state is not None:
            ipc, self._ipc = self._ipc, None
            self._state.close_ipc(ipc)
        self.addr = 0


class CudaRuntime(DeviceRuntime):
    """The ``cuda`` device runtime (see the module docstring).

    ``load``: returns the driver binding (default :func:`~mori_backend_nvlink.driver.load_driver`;
    tests pass a fake).
    """

    name = "cuda"
    description = "NVIDIA GPU memory through the CUDA driver (libcuda.so.1, loaded at run time); CUDA IPC"
    priority = 100
    torch_device = "cuda"

    def __init__(self, load: Callable[[], CudaDriver] | None = None) -> None:
        self._load = load or load_driver
        self._state: _DeviceState | None = None
        self._bind_lock = threading.Lock()
        self._pid_override: int | None = None  # tests: pretend to be another process

    # -- availability -------------------------------------------------------------------------------

    def probe(self) -> Availability:
        """Usable if the driver loads, sees a GPU, torch is a CUDA build and Triton is installed.
        Loads the driver and calls cuInit, nothing more (no context, no memory)."""
        try:
            drv = self._load()
            try:
                drv.init()
                count = drv.device_count()
            except CudaError as e:
                if e.code == 100:  # CUDA_ERROR_NO_DEVICE
                    return Availability(False, f"no CUDA device ({e.call}: CUDA_ERROR_NO_DEVICE)")
                return Availability(False, str(e))
            if count == 0:
                return Availability(False, "no CUDA device (cuDeviceGetCount = 0)")
            import importlib.util

            if importlib.util.find_spec("torch") is None:
                return Availability(False, "torch is not installed")
            import torch

            if torch.version.cuda is None:
                return Availability(False, f"torch {torch.__version__} is not a CUDA build")
            if importlib.util.find_spec("triton") is None:
                return Availability(False, "triton is not installed (host atomics on GPU memory need it)")
            version = drv.version()
            return Availability(
                True, f"{count} CUDA device(s), driver {version // 1000}.{version % 1000 // 10} ({drv.path})"
            )
        except Exception as e:
            return Availability(
                False, str(e) if isinstance(e, MoriBackendError) else f"{type(e).__name__}: {e}"
            )

    # -- the device ---------------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self._pid_override or os.getpid()

    @property
    def device_index(self) -> int | None:
        """The torch CUDA device index of this runtime's GPU, None before the first segment."""
        return self._state.index if self._state is not None else None

    def _torch_device_index(self) -> int:
        import torch

        if not torch.cuda.is_available():
            raise MoriBackendError(
                f"the cuda runtime needs torch with CUDA: torch {torch.__version__} reports "
                f"torch.cuda.is_available() = False"
            )
        return int(torch.cuda.current_device())

    def _torch_current_stream(self, index: int) -> int:
        import torch

        return int(torch.cuda.current_stream(index).cuda_stream)

    def _bind(self) -> _DeviceState:
        """The state of the current torch device, made on first use."""
        with self._bind_lock:
            index = self._torch_device_index()
            st = self._state
            if st is None or (st.index != index and not st.opened):
                st = self._state = _DeviceState(self._load(), index)
            return st

    def _require(self, func: str) -> _DeviceState:
        st = self._state
        if st is None:
            raise MoriStateError(f"{func}: the cuda runtime has no device yet: initialise mori.shmem first")
        return st

    # -- segments -----------------------------------------------------------------------------------

    def create_segment(self, size: int, tag: str) -> HeapSegment:
        mode = core_env.MORI_SHMEM_MODE.require()
        if mode != "static_heap":
            raise MoriValueError(
                f"MORI_SHMEM_MODE={mode!r} is not supported by the cuda runtime (mori-backend-nvlink): use "
                f"static_heap. vmm_heap is not implemented yet; the heap is one cuMemAlloc shared with CUDA IPC"
            )
        st = self._bind()
        drv = st.drv
        with st.lock, st.active():
            try:
                raw = drv.mem_alloc(size)
                addr = raw
                if raw % HEAP_ALIGN:  # large allocations are 2 MiB aligned already; else align by hand
                    drv.mem_free(raw)
                    raw = drv.mem_alloc(size + HEAP_ALIGN)
                    addr = -(-raw // HEAP_ALIGN) * HEAP_ALIGN
            except CudaError as e:
                raise MoriBackendError(
                    f"cannot allocate the {size}-byte symmetric heap on cuda:{st.index} ({e}); lower "
                    f"MORI_SHMEM_HEAP_SIZE or free GPU memory"
                ) from e
            try:
                drv.memset_async(addr, 0, size, st.op_stream)
                drv.stream_synchronize(st.op_stream)
                ipc = drv.ipc_get_handle(raw)
            except BaseException:
                drv.mem_free(raw)
                raise
        handle = SegmentHandle(KIND_HEAP, self.pid, st.index, st.pci, addr, addr - raw, size, ipc)
        return CudaSegment(st, raw, addr, size, handle.pack())

    def open_peer_segment(self, peer: PeerInfo) -> PeerSegment:
        h = SegmentHandle.unpack(peer.segment_handle, what=f"the heap handle of PE {peer.rank}")
        if h.kind != KIND_HEAP or h.size < peer.heap_size:
            raise MoriValueError(
                f"the heap handle of PE {peer.rank} describes a {h.describe()}, not its heap"
            )
        return self._open(h, peer.heap_size, f"heap of PE {peer.rank} ({h.describe()})")

    def _open(self, h: SegmentHandle, size: int, what: str) -> CudaPeerSegment:
        st = self._require("open")
        if h.pid == self.pid:  # our own memory: it is already mapped here
            return CudaPeerSegment(None, None, h.addr, size)
        base = st.open_ipc(h.ipc, detail=f"mapping the {what}")
        return CudaPeerSegment(st, h.ipc, base + h.offset, size)

    def can_reach(self, peer: PeerInfo) -> tuple[bool, str]:
        """Whether this GPU can load and store the GPU of ``peer``'s heap, and why not."""
        h = SegmentHandle.unpack(peer.segment_handle, what=f"the heap handle of PE {peer.rank}")
        st = self._require("can_reach")
        if h.pci == st.pci:
            return True, "same GPU"
        other = st.ordinal_of(h.pci)
        if other is None:
            # Not visible here (CUDA_VISIBLE_DEVICES): CUDA IPC can still open it; let the driver decide.
            return True, f"GPU {h.pci} is not visible in this process"
        if st.drv.can_access_peer(st.device, st.drv.device(other)):
            return True, f"peer access to GPU {h.pci}"
        return False, f"cuDeviceCanAccessPeer(cuda:{st.index}, cuda:{other}) = 0"

    # -- ranges of any allocation (shmem_buffer_register) ---------------------------------------------

    def export_range(self, addr: int, size: int) -> bytes:
        """Handle bytes that let another process of this node map ``[addr, addr+size)``.

        ``addr``: device memory from ``cudaMalloc``/``cuMemAlloc`` (e.g. a tensor of torch's default
        caching allocator), anywhere inside its allocation; ``size``: bytes, > 0, not past the end of
        the allocation. The whole allocation is exported (CUDA IPC works per allocation); the
        importer sees only the range. Not collective. Memory from ``cudaMallocAsync`` pools or torch's
        ``expandable_segments`` cannot be exported this way and raises.
        """
        func = "export_range"
        for arg, v in (("addr", addr), ("size", size)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise MoriValueError(f"{func}: {arg}={v!r} is not allowed; expected an int > 0")
        st = self._bind() if self._state is None else self._state
        drv = st.drv
        with st.lock, st.active():
            try:
                base, length = drv.address_range(addr)
                ordinal = drv.pointer_device(addr)
            except CudaError as e:
                raise MoriValueError(
                    f"{func}: addr={addr:#x} is not GPU memory allocated with cudaMalloc/cuMemAlloc ({e})"
                ) from e
            if addr + size > base + length:
                raise MoriValueError(
                    f"{func}: [{addr:#x}, +{size}) runs past the end of its allocation [{base:#x}, +{length})"
                )
            try:
                ipc = drv.ipc_get_handle(base)
            except CudaError as e:
                raise MoriBackendError(
                    f"{func}: the allocation at {base:#x} cannot be shared with CUDA IPC ({e}); memory from "
                    f"cudaMallocAsync pools or torch's expandable_segments is not exportable"
                ) from e
            pci = st.pci if ordinal == st.index else PciAddress.parse(drv.pci_bus_id(drv.device(ordinal)))
        return SegmentHandle(KIND_RANGE, self.pid, ordinal, pci, addr, addr - base, size, ipc).pack()

    def open_range(self, handle: bytes) -> PeerSegment:
        """Map a range from :meth:`export_range` (of another process of this node, or this one).

        Returns a :class:`CudaPeerSegment` whose ``addr`` is the range's first byte here and ``size``
        its length; ``close()`` it when done (before the exporter frees the memory). Opening the
        same allocation several times shares one mapping. Not collective.
        """
        h = SegmentHandle.unpack(handle, what="open_range: handle")
        if h.kind != KIND_RANGE:
            raise MoriValueError(f"open_range: the handle describes a {h.describe()}, not an exported range")
        if self._state is None:
            self._bind()
        return self._open(h, h.size, f"range {h.describe()}")

    def copy_engine(self) -> CopyEngine:
        """This GPU's :class:`~mori_backend_nvlink.copy_engine.CopyEngine` (made on first use)."""
        from mori_backend_nvlink.copy_engine import CopyEngine

        st = self._bind() if self._state is None else self._state
        with st.lock:
            if st.copy_engine is None:
                st.copy_engine = CopyEngine(st.drv, st.active, self._torch_current_stream, st.index)
            return st.copy_engine

    # -- host access ----------------------------------------------------------------------------------

    def _view(self, addr: int, nbytes: int, index: int) -> torch.Tensor:
        return _dlpack.byte_view(addr, nbytes, _dlpack.KDL_CUDA, index)

    def byte_view(self, addr: int, nbytes: int) -> torch.Tensor:
        """uint8 tensor ``[nbytes]`` on ``cuda:<this GPU>`` over ``addr`` (own heap, a peer's mapped
        heap, or any device memory this GPU can reach). No copy; the memory must outlive it."""
        return self._view(addr, nbytes, self._require("byte_view").index)

    def _order_after_current_stream(self, st: _DeviceState) -> None:
        # the runtime's stream waits (on the GPU) for what is queued on torch's current stream
        st.drv.event_record(st.order_event, self._torch_current_stream(st.index))
        st.drv.stream_wait_event(st.op_stream, st.order_event)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"copy: nbytes={nbytes} is negative")
        if nbytes == 0:
            return
        if not dst or not src:
            raise ValueError("copy: null address")
        st = self._require("copy")
        drv = st.drv
        with st.lock, st.active():
            self._order_after_current_stream(st)
            if dst != src and abs(dst - src) < nbytes:
                self._copy_overlapping(st, dst, src, nbytes)
            elif dst != src:
                drv.memcpy_async(dst, src, nbytes, st.op_stream)
            drv.stream_synchronize(st.op_stream)

    def _copy_overlapping(self, st: _DeviceState, dst: int, src: int, nbytes: int) -> None:
        # memmove through a scratch buffer, chunk by chunk, in the order that never overwrites
        # source bytes not yet copied: from the end when moving up, from the start when moving down
        chunk = min(nbytes, SCRATCH_MAX)
        tmp = st.scratch_buffer(chunk)
        starts = range(0, nbytes, chunk)
        for off in reversed(starts) if dst > src else starts:
            n = min(chunk, nbytes - off)
            st.drv.memcpy_async(tmp, src + off, n, st.op_stream)
            st.drv.memcpy_async(dst + off, tmp, n, st.op_stream)

    def atomic_rmw(self, addr: int, op: int, word: int, value: int) -> int:
        if op not in _OPS:
            raise ValueError(f"unknown atomic op {op}")
        _check_word(addr, word, value)
        return self._atomic(addr, word, op, value, 0)

    def atomic_compare_swap(self, addr: int, word: int, expected: int, desired: int) -> int:
        _check_word(addr, word, expected, desired)
        return self._atomic(addr, word, OP_CAS, desired, expected)

    def _atomic(self, addr: int, word: int, op: int, value: int, cond: int) -> int:
        _, _, ctype = _check_word(addr, word)
        st = self._require("atomic")
        with st.lock, st.active():
            self._order_after_current_stream(st)
            self._launch_atomic(st, addr, word, op, value, cond)
            st.drv.stream_synchronize(st.op_stream)
            return int(ctype.from_address(st.pinned).value)

    def _launch_atomic(self, st: _DeviceState, addr: int, word: int, op: int, value: int, cond: int) -> None:
        """Queue the atomic kernel on the runtime's stream; its result goes to ``st.pinned``."""
        import torch

        from mori_backend_nvlink._atomics import host_atomic_kernel

        dtype = getattr(torch, _WORDS[word][0])
        if st.torch_stream is None:
            device = torch.device("cuda", st.index)
            st.torch_stream = torch.cuda.ExternalStream(st.op_stream, device=device)  # type: ignore[no-untyped-call]
        lo, hi = _halves(value)
        clo, chi = _halves(cond)
        with torch.cuda.stream(st.torch_stream):
            host_atomic_kernel[(1,)](
                _Pointer(addr, dtype), _Pointer(st.pinned_device, dtype), lo, hi, clo, chi, OP=op, num_warps=1
            )

    def wait_until(self, addr: int, cmp: int, word: int, value: int, timeout_s: float) -> tuple[bool, int]:
        if cmp not in _CMPS:
            raise ValueError(f"unknown comparison {cmp}")
        _, size, ctype = _check_word(addr, word, value)
        test = _CMPS[cmp]
        st = self._require("wait_until")
        start = time.monotonic()
        pause = 0.0
        while True:
            with st.lock, st.active():
                st.drv.memcpy_async(st.pinned + 8, addr, size, st.poll_stream)
                st.drv.stream_synchronize(st.poll_stream)
                seen = int(ctype.from_address(st.pinned + 8).value)
            if test(seen, value):
                return True, seen
            waited = time.monotonic() - start
            if timeout_s >= 0 and waited >= timeout_s:
                return False, seen
            if waited >= _SPIN_S:  # sleep (GIL released), backing off to _MAX_SLEEP_S
                pause = min(max(2 * pause, 20e-6), _MAX_SLEEP_S)
                time.sleep(pause if timeout_s < 0 else min(pause, max(0.0, timeout_s - waited)))

    def fence(self) -> None:
        st = self._state
        if st is None:
            return
        with st.active():
            st.drv.synchronize()

"""The GPU device runtime both device plugins share: the symmetric heap in GPU memory, shared with IPC.

:class:`GpuRuntime` holds the logic; a plugin makes one of its vendor's descriptor
(:class:`~mori.core.gpu.vendor.GpuVendor`: its driver binding, names and messages; ``cuda`` in the
CUDA plugin, ``hip`` in the HIP one). Imports neither torch, Triton nor a driver.

**Device.** The heap lives on the *current torch device* when the first segment is created (each
rank calls ``torch.cuda.set_device`` before ``shmem_init``). Every driver call runs with that GPU
made current (CUDA: its primary context, the one torch uses; HIP: the thread's current device),
restored after.

**Heap.** ``static_heap`` only: one allocation of ``MORI_SHMEM_HEAP_SIZE`` bytes, 2 MiB aligned and
zeroed, exported with the driver's IPC. Peers (other processes, on this GPU or another one of the
node) map it with IPC, peer access enabled lazily. ``vmm_heap`` and ``isolation`` are refused with a
clear error.

**Host access** (the methods core's host API uses), all synchronous with the host and ordered
after the work already queued on torch's current stream of the device:

* :meth:`byte_view`: a uint8 tensor over any mapped address on this rank's GPU (DLPack, no copy);
* :meth:`copy`: an async memcpy on the runtime's stream, any unified address (heap, peer heap,
  registered device or host memory), overlapping ranges handled like ``memmove``;
* :meth:`atomic_rmw` / :meth:`atomic_compare_swap`: one system-scope atomic done by the GPU (a
  one-program Triton kernel on the runtime's stream), the old value read from pinned host memory;
* :meth:`wait_until`: polls the word with a device-to-host copy on a stream of its own (so it
  never queues behind a kernel), spinning briefly and then sleeping, GIL released;
* :meth:`fence`: a context/device synchronize, every earlier kernel and copy has completed.

**Beyond the contract:** :meth:`GpuRuntime.export_range` / :meth:`GpuRuntime.open_range` share any
device allocation (a torch tensor) with another process; :meth:`GpuRuntime.copy_engine` gives
asynchronous copies on dedicated streams (:class:`~mori.core.gpu.copy_engine.CopyEngine`).
Packages that drive the GPU themselves (mori-io's XGMI backend and staging copier) take the bound
:class:`GpuDevice` (driver, context, ``active()``) from :meth:`GpuRuntime.bound_device` and torch's
current stream from :meth:`GpuRuntime.current_stream`.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import operator
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

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
    MappedHostMemory,
    PeerInfo,
    PeerSegment,
)
from mori.core.errors import MoriBackendError, MoriStateError, MoriValueError
from mori.core.gpu import dlpack as _dlpack
from mori.core.gpu.driver import GpuDriver, GpuError
from mori.core.gpu.handles import KIND_HEAP, KIND_RANGE, PciAddress, SegmentHandle

if TYPE_CHECKING:
    import torch

    from mori.core.gpu.copy_engine import CopyEngine
    from mori.core.gpu.vendor import GpuVendor

__all__ = ["GpuDevice", "GpuPeerSegment", "GpuRuntime", "GpuSegment", "torch_stream_getter"]

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
        raise MoriValueError(f"unknown word type {word}")
    return _WORDS[word]


def _check_word(addr: int, word: int, *values: int) -> tuple[str, int, Any]:
    """Validate the address and operands like mori.core._core does (same messages)."""
    name, size, lo, hi, ctype = _word(word)
    if addr == 0:
        raise MoriValueError("address is 0 (null)")
    if addr % size:
        raise MoriValueError(f"address {addr} is not aligned to {size} bytes")
    for v in values:
        if not lo <= v <= hi:
            raise MoriValueError(f"value {v} does not fit the atomic word")
    return name, size, ctype


@functools.cache
def torch_stream_getter() -> Callable[[int], int]:
    """``index -> raw handle of torch's current stream on GPU index`` (a ``CUstream`` /
    ``hipStream_t`` as an int), as cheap as torch allows.

    This is the one place MORI uses a private name of torch: ``torch._C._cuda_getCurrentRawStream``,
    the getter Triton's own launcher calls. It returns the handle without making a
    ``torch.cuda.Stream`` object, about ten times faster than the public
    ``torch.cuda.current_stream(index).cuda_stream``, which matters on the per-transfer path of
    mori-io. Where a torch lacks it, the public form is returned instead."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw  # type: ignore[no-any-return]

    def public(index: int) -> int:
        return int(torch.cuda.current_stream(index).cuda_stream)

    return public


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


class GpuDevice:
    """The GPU a runtime is bound to, with what the runtime holds for it (from
    :meth:`GpuRuntime.bound_device`). Public for packages that drive the GPU themselves:

    * ``drv``: the driver binding (:class:`~mori.core.gpu.driver.GpuDriver`); ``index``: the torch
      device index; ``device``: the driver's name for the GPU; ``ctx``: what makes it current
      (CUDA: its primary context, the one torch uses; HIP: the ordinal); ``pci``: its PCI address;
    * :meth:`active`: a context manager making the GPU current for a block of driver calls;
    * ``lock``: held by the runtime around its own calls (hold it to free memory it may use);
    * ``pinned`` / ``pinned_device``: 64 bytes of pinned host memory (host and device address) the
      runtime's atomics and waits use: [0, 8) the last atomic's result, [8, 16) the polled word.

    The rest (streams, IPC mappings, scratch buffer) is the runtime's own.
    """

    def __init__(self, drv: GpuDriver, index: int) -> None:
        self.drv = drv
        self.index = index
        drv.init()
        self.device = drv.device(index)
        self.ctx = drv.primary_context_retain(self.device)  # CUDA: the context torch uses; HIP: the ordinal
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
        """Make this GPU current for the block (CUDA: its primary context; HIP: the thread's device),
        restoring the previous one after."""
        prev = self.drv.current_context()
        if prev == self.ctx:
            yield
            return
        self.drv.set_current_context(self.ctx)
        try:
            yield
        finally:
            self.drv.restore_context(prev)

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


class GpuSegment(HeapSegment):
    """This rank's heap: ``size`` zeroed bytes of GPU memory at ``addr`` (2 MiB aligned)."""

    def __init__(self, state: GpuDevice, raw: int, addr: int, size: int, handle: bytes) -> None:
        self._state = state
        self._raw = raw  # what the allocation returned (addr may be above it, for alignment)
        self.addr = addr
        self.size = size
        self.handle = handle

    def close(self) -> None:
        if self._raw:
            raw, self._raw, self.addr = self._raw, 0, 0
            with self._state.lock, self._state.active():
                self._state.drv.synchronize()  # no kernel or copy of ours may still touch it
                self._state.drv.mem_free(raw)


class GpuPeerSegment(PeerSegment):
    """Another process's GPU memory (a heap or an exported range) mapped into this one at ``addr``.

    ``close`` unmaps it (the mapping is shared by every open of the same allocation and goes away
    with the last one). A range exported by this same process is not mapped again: ``addr`` is the
    original address and ``close`` does nothing.
    """

    def __init__(self, state: GpuDevice | None, ipc: bytes | None, addr: int, size: int) -> None:
        self._state = state
        self._ipc = ipc
        self.addr = addr
        self.size = size

    def close(self) -> None:
        if self._ipc is not None and self._state is not None:
            ipc, self._ipc = self._ipc, None
            self._state.close_ipc(ipc)
        self.addr = 0


class GpuMappedHostMemory(MappedHostMemory):
    """Pinned host memory mapped into the GPU (``cuMemHostAlloc`` portable | device-mapped, or the
    HIP equivalent), with the device address from ``cuMemHostGetDevicePointer``.

    The proxy's ring lives here (run on an H200: kernels reserve tickets with system-scope
    fetch-adds on it and the proxy thread reads it). Host producers fetch-add the same head word,
    which is atomic against the device's only with host-native atomics
    (``CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED``); device code alone is the usual case.
    """

    def __init__(self, state: GpuDevice, size: int) -> None:
        self._state: GpuDevice | None = state
        with state.active():
            self.host_addr = state.drv.host_alloc(size)
            try:
                self.device_addr = state.drv.host_device_pointer(self.host_addr)
            except BaseException:
                state.drv.host_free(self.host_addr)
                raise
        self.size = size
        ctypes.memset(self.host_addr, 0, size)

    def close(self) -> None:
        st, self._state = self._state, None
        if st is not None:
            with st.active():
                st.drv.host_free(self.host_addr)


class GpuRuntime(DeviceRuntime):
    """The GPU device runtime of one vendor (see the module docstring).

    ``vendor``: the vendor's descriptor (names, driver, messages); ``load``: returns the driver
    binding (default: ``vendor.load_driver``; tests pass a fake).
    """

    priority = 100
    torch_device = "cuda"  # ROCm builds of torch call their GPUs cuda too

    def __init__(self, vendor: GpuVendor, load: Callable[[], GpuDriver] | None = None) -> None:
        self.vendor = vendor
        self.name = vendor.runtime
        self.description = vendor.runtime_description
        #: the plugin's distribution, for messages
        self.package = vendor.distribution
        #: the driver's error class (a :class:`~mori.core.gpu.driver.GpuError`)
        self.error_class: type[GpuError] = vendor.error_class
        #: the segment handle class (its MAGIC is the vendor's)
        self.handle_class: type[SegmentHandle] = vendor.handle_class
        # a vendor's binding is a CtypesDriver subclass with the GpuDriver methods the base lacks
        self._load: Callable[[], GpuDriver] = load or cast("Callable[[], GpuDriver]", vendor.load_driver)
        self._state: GpuDevice | None = None
        self._bind_lock = threading.Lock()

    # -- availability -------------------------------------------------------------------------------

    def probe(self) -> Availability:
        """Usable if the driver loads, sees a GPU, torch is a build for it and Triton is installed.
        Loads the driver and initialises it, nothing more (no context, no memory)."""
        v = self.vendor
        try:
            drv = self._load()
            try:
                drv.init()
                count = drv.device_count()
            except self.error_class as e:
                if e.code == 100:  # CUDA_ERROR_NO_DEVICE, hipErrorNoDevice
                    return Availability(False, f"no {v.gpu_noun} ({e.call}: {v.no_device_result})")
                return Availability(False, str(e))
            if count == 0:
                return Availability(False, f"no {v.gpu_noun} ({v.device_count_call} = 0)")
            import importlib.util

            if importlib.util.find_spec("torch") is None:
                return Availability(False, "torch is not installed")
            import torch

            if not v.torch_build_ok(torch):
                return Availability(False, f"torch {torch.__version__} is not a {v.torch_flavour} build")
            if importlib.util.find_spec("triton") is None:
                return Availability(False, "triton is not installed (host atomics on GPU memory need it)")
            version = v.version_text(drv.version())
            return Availability(True, v.available.format(count=count, version=version, path=drv.path))
        except Exception as e:
            return Availability(
                False, str(e) if isinstance(e, MoriBackendError) else f"{type(e).__name__}: {e}"
            )

    # -- the device ---------------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        """The process id segment handles name as their owner."""
        return os.getpid()

    @property
    def device_index(self) -> int | None:
        """The torch device index of this runtime's GPU, None before the first segment."""
        return self._state.index if self._state is not None else None

    def current_device_index(self) -> int:
        """Torch's current device index: the GPU :meth:`bound_device` binds to. Raises
        :class:`~mori.core.errors.MoriBackendError` if torch sees no GPU."""
        import torch

        if not torch.cuda.is_available():
            raise MoriBackendError(
                f"the {self.name} runtime needs torch with {self.vendor.torch_flavour}: torch {torch.__version__} "
                f"reports torch.cuda.is_available() = False"
            )
        return int(torch.cuda.current_device())

    def current_stream(self, index: int) -> int:
        """The raw handle of torch's current stream on GPU ``index`` (what work of MORI's is
        ordered after; see :func:`torch_stream_getter`)."""
        return int(torch_stream_getter()(index))

    def bound_device(self) -> GpuDevice:
        """The GPU this runtime works on (:class:`GpuDevice`), bound on first use to torch's current
        device (:meth:`current_device_index`; the driver is loaded then). Later calls return the
        same device once the heap or a mapping lives there. Not collective; thread-safe."""
        st = self._state
        return st if st is not None else self._bind()

    def _bind(self) -> GpuDevice:
        """The state of the current torch device, made on first use."""
        with self._bind_lock:
            index = self.current_device_index()
            st = self._state
            if st is None or (st.index != index and not st.opened):
                st = self._state = GpuDevice(self._load(), index)
            return st

    def _require(self, func: str) -> GpuDevice:
        st = self._state
        if st is None:
            raise MoriStateError(
                f"{func}: the {self.name} runtime has no device yet: initialise mori.shmem first"
            )
        return st

    # -- segments -----------------------------------------------------------------------------------

    def create_segment(self, size: int, tag: str) -> HeapSegment:
        mode = core_env.MORI_SHMEM_MODE.require()
        if mode != "static_heap":
            raise MoriValueError(
                f"MORI_SHMEM_MODE={mode!r} is not supported by the {self.name} runtime ({self.package}): use "
                f"static_heap. vmm_heap is not implemented yet; the heap is {self.vendor.heap_allocation} shared "
                f"with {self.vendor.ipc_name}"
            )
        options = self.vendor.heap_alloc_options()
        st = self._bind()
        drv = st.drv
        with st.lock, st.active():
            try:
                raw = drv.mem_alloc(size, **options)
                addr = raw
                if raw % HEAP_ALIGN:  # large allocations are 2 MiB aligned already; else align by hand
                    drv.mem_free(raw)
                    raw = drv.mem_alloc(size + HEAP_ALIGN, **options)
                    addr = -(-raw // HEAP_ALIGN) * HEAP_ALIGN
            except self.error_class as e:
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
        handle = self.handle_class(KIND_HEAP, self.pid, st.index, st.pci, addr, addr - raw, size, ipc)
        return GpuSegment(st, raw, addr, size, handle.pack())

    def open_peer_segment(self, peer: PeerInfo) -> PeerSegment:
        h = self.handle_class.unpack(peer.segment_handle, what=f"the heap handle of PE {peer.rank}")
        if h.kind != KIND_HEAP or h.size < peer.heap_size:
            raise MoriValueError(
                f"the heap handle of PE {peer.rank} describes a {h.describe()}, not its heap"
            )
        return self._open(h, peer.heap_size, f"heap of PE {peer.rank} ({h.describe()})")

    def _open(self, h: SegmentHandle, size: int, what: str) -> GpuPeerSegment:
        st = self._require("open")
        if h.pid == self.pid:  # our own memory: it is already mapped here
            return GpuPeerSegment(None, None, h.addr, size)
        base = st.open_ipc(h.ipc, detail=f"mapping the {what}")
        return GpuPeerSegment(st, h.ipc, base + h.offset, size)

    def can_reach(self, peer: PeerInfo) -> tuple[bool, str]:
        """Whether this GPU can load and store the GPU of ``peer``'s heap, and why not."""
        h = self.handle_class.unpack(peer.segment_handle, what=f"the heap handle of PE {peer.rank}")
        st = self._require("can_reach")
        if h.pci == st.pci:
            return True, "same GPU"
        other = st.ordinal_of(h.pci)
        if other is None:
            # Not visible here (CUDA_/HIP_VISIBLE_DEVICES): IPC can still open it; let the driver decide.
            return True, f"GPU {h.pci} is not visible in this process"
        if st.drv.can_access_peer(st.device, st.drv.device(other)):
            return True, f"peer access to GPU {h.pci}"
        return False, f"{self.vendor.peer_access_query.format(index=st.index, other=other)} = 0"

    # -- ranges of any allocation (shmem_buffer_register) ---------------------------------------------

    def export_range(self, addr: int, size: int) -> bytes:
        """Handle bytes that let another process of this node map ``[addr, addr+size)``.

        ``addr``: device memory from the driver's allocator (``cudaMalloc``/``hipMalloc``, e.g. a
        tensor of torch's default caching allocator), anywhere inside its allocation; ``size``: bytes,
        > 0, not past the end of the allocation. The whole allocation is exported (IPC works per
        allocation); the importer sees only the range. Not collective. Memory from stream-ordered
        pools or torch's ``expandable_segments`` cannot be exported this way and raises.
        """
        func = "export_range"
        for arg, v in (("addr", addr), ("size", size)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise MoriValueError(f"{func}: {arg}={v!r} is not allowed; expected an int > 0")
        st = self.bound_device()
        drv = st.drv
        with st.lock, st.active():
            try:
                base, length = drv.address_range(addr)
                ordinal = drv.pointer_device(addr)
            except self.error_class as e:
                raise MoriValueError(
                    f"{func}: addr={addr:#x} is not GPU memory allocated with {self.vendor.alloc_functions} ({e})"
                ) from e
            if addr + size > base + length:
                raise MoriValueError(
                    f"{func}: [{addr:#x}, +{size}) runs past the end of its allocation [{base:#x}, +{length})"
                )
            try:
                ipc = drv.ipc_get_handle(base)
            except self.error_class as e:
                raise MoriBackendError(
                    f"{func}: the allocation at {base:#x} cannot be shared with {self.vendor.ipc_name} ({e}); memory "
                    f"from {self.vendor.async_pool} pools or torch's expandable_segments is not exportable"
                ) from e
            pci = st.pci if ordinal == st.index else PciAddress.parse(drv.pci_bus_id(drv.device(ordinal)))
        return self.handle_class(KIND_RANGE, self.pid, ordinal, pci, addr, addr - base, size, ipc).pack()

    def open_range(self, handle: bytes) -> PeerSegment:
        """Map a range from :meth:`export_range` (of another process of this node, or this one).

        Returns a :class:`GpuPeerSegment` whose ``addr`` is the range's first byte here and ``size``
        its length; ``close()`` it when done (before the exporter frees the memory). Opening the
        same allocation several times shares one mapping. Not collective.
        """
        h = self.handle_class.unpack(handle, what="open_range: handle")
        if h.kind != KIND_RANGE:
            raise MoriValueError(f"open_range: the handle describes a {h.describe()}, not an exported range")
        self.bound_device()
        return self._open(h, h.size, f"range {h.describe()}")

    def copy_engine(self) -> CopyEngine:
        """This GPU's :class:`~mori.core.gpu.copy_engine.CopyEngine` (made on first use)."""
        from mori.core.gpu.copy_engine import CopyEngine

        st = self.bound_device()
        with st.lock:
            if st.copy_engine is None:
                st.copy_engine = CopyEngine(st.drv, st.active, self.current_stream, st.index)
            return st.copy_engine

    # -- host access ----------------------------------------------------------------------------------

    def byte_view(self, addr: int, nbytes: int) -> torch.Tensor:
        """uint8 tensor ``[nbytes]`` on ``cuda:<this GPU>`` (torch's name, ROCm too) over ``addr`` (own heap, a peer's mapped
        heap, or any device memory this GPU can reach). No copy; the memory must outlive it."""
        index = self._require("byte_view").index
        return _dlpack.byte_view(addr, nbytes, self.vendor.dlpack_device, index)

    def _order_after_current_stream(self, st: GpuDevice) -> None:
        # the runtime's stream waits (on the GPU) for what is queued on torch's current stream
        st.drv.event_record(st.order_event, self.current_stream(st.index))
        st.drv.stream_wait_event(st.op_stream, st.order_event)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        if nbytes < 0:
            raise MoriValueError(f"copy: nbytes={nbytes} is negative")
        if nbytes == 0:
            return
        if not dst or not src:
            raise MoriValueError("copy: null address")
        st = self._require("copy")
        drv = st.drv
        with st.lock, st.active():
            self._order_after_current_stream(st)
            if dst != src and abs(dst - src) < nbytes:
                self._copy_overlapping(st, dst, src, nbytes)
            elif dst != src:
                drv.memcpy_async(dst, src, nbytes, st.op_stream)
            drv.stream_synchronize(st.op_stream)

    def _copy_overlapping(self, st: GpuDevice, dst: int, src: int, nbytes: int) -> None:
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
            raise MoriValueError(f"unknown atomic op {op}")
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
            self.launch_atomic(st, addr, _WORDS[word][0], op, (*_halves(value), *_halves(cond)))
            st.drv.stream_synchronize(st.op_stream)
            return int(ctype.from_address(st.pinned).value)

    def launch_atomic(
        self, st: GpuDevice, addr: int, dtype: str, op: int, operands: tuple[int, int, int, int]
    ) -> None:
        """Queue the host-atomic kernel (:mod:`mori.core.gpu.atomics`) on the runtime's stream; its
        result (the word's old value) goes to ``st.pinned_device``. ``dtype``: the word's torch
        dtype name (``int32``, ``uint32``, ``int64``, ``uint64``); ``op``: an ``OP_*`` code or
        :data:`OP_CAS`; ``operands``: the value's and the compared value's low and high 32 bits, as
        signed int32s. Called with ``st.lock`` held and the GPU current; a subclass may run the
        kernel elsewhere (the fake runtimes of the tests run it in Triton's interpreter)."""
        import torch

        from mori.core.gpu.atomics import host_atomic_kernel

        torch_dtype = getattr(torch, dtype)
        if st.torch_stream is None:
            device = torch.device("cuda", st.index)
            st.torch_stream = torch.cuda.ExternalStream(st.op_stream, device=device)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(st.torch_stream):
            host_atomic_kernel[(1,)](
                _Pointer(addr, torch_dtype),
                _Pointer(st.pinned_device, torch_dtype),
                *operands,
                OP=op,
                num_warps=1,
            )

    def wait_until(self, addr: int, cmp: int, word: int, value: int, timeout_s: float) -> tuple[bool, int]:
        if cmp not in _CMPS:
            raise MoriValueError(f"unknown comparison {cmp}")
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

    def alloc_mapped_host(self, size: int) -> MappedHostMemory:
        """Pinned host memory mapped into this GPU (:class:`GpuMappedHostMemory`)."""
        return GpuMappedHostMemory(self._require("alloc_mapped_host"), size)

"""The contract between mori-core and its backends: what a plugin's objects must provide.

A *device runtime* owns the memory that backs the symmetric heap (``cpu`` in core; ``cuda`` and
``hip`` from device plugins). A *transport* decides how this process reaches a peer's heap (``shm``
in core for ranks of one node; ``p2p``, ``ucx``, ``verbs`` from plugins). A *NIC provider* drives one
family of network cards. Plugins return instances of these classes from the hooks in
:mod:`mori.core.hookspecs`; core picks among them by name and priority, never by plugin.
"""

from __future__ import annotations

import ctypes
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Codes shared by every runtime's host-access methods (and by the native module mori.core._core).
#: atomic read-modify-write operations
OP_FETCH, OP_SET, OP_ADD, OP_SWAP, OP_AND, OP_OR, OP_XOR = range(7)
#: comparisons for wait_until: ==, !=, >, >=, <, <=
CMP_EQ, CMP_NE, CMP_GT, CMP_GE, CMP_LT, CMP_LE = range(6)
#: atomic word types
WORD_INT32, WORD_UINT32, WORD_INT64, WORD_UINT64 = range(4)


@dataclass(frozen=True)
class Availability:
    """Whether a backend can be used on this machine; ``reason`` says why not (or a detail if so)."""

    usable: bool
    reason: str = ""


@dataclass(frozen=True)
class PeerInfo:
    """What a rank tells every other rank about itself at init (exchanged through the bootstrap)."""

    rank: int
    node_id: str
    hostname: str
    pid: int
    runtime: str
    heap_size: int
    #: runtime-specific bytes that let a peer map this rank's heap segment
    segment_handle: bytes = field(repr=False, default=b"")


class HeapSegment(ABC):
    """Memory one rank owns and exports: the local part of the symmetric heap."""

    addr: int
    size: int
    handle: bytes

    def seal(self) -> None:  # noqa: B027 - optional hook, default does nothing
        """Called once every peer has opened the segment: drop names that could leak."""

    @abstractmethod
    def close(self) -> None:
        """Release the memory. Called once, at finalize."""


class PeerSegment(ABC):
    """A peer's heap segment opened in this process, at ``addr`` (load/store reachable)."""

    addr: int
    size: int

    @abstractmethod
    def close(self) -> None:
        """Unmap. Called once, at finalize."""


class MappedHostMemory(ABC):
    """Host memory that this process's host threads and its device code both reach: the proxy's
    request ring. ``host_addr`` is the address host code uses, ``device_addr`` the one kernels use
    (equal on the cpu runtime). Zeroed when allocated."""

    host_addr: int
    device_addr: int
    size: int

    @abstractmethod
    def close(self) -> None:
        """Release the memory. Called once, after every user of it stopped."""


class _PlainHostMemory(MappedHostMemory):
    """Ordinary host memory (anonymous pages): what kernels reach on a host-memory runtime."""

    def __init__(self, size: int) -> None:
        import mmap

        self._map: mmap.mmap | None = mmap.mmap(-1, size)
        self._view = (ctypes.c_uint8 * size).from_buffer(self._map)
        self.host_addr = self.device_addr = ctypes.addressof(self._view)
        self.size = size

    def close(self) -> None:
        if self._map is not None:
            del self._view
            self._map.close()
            self._map = None


class DeviceRuntime(ABC):
    """A kind of memory the symmetric heap can live in, and the device that computes on it."""

    #: name users select with MORI_DEVICE_RUNTIME; unique among all plugins
    name: str
    description: str = ""
    #: ``auto`` picks the usable runtime with the highest priority
    priority: int = 0
    #: the torch device type tensors on this runtime's memory have ("cpu", "cuda")
    torch_device: str = "cpu"

    @property
    def device_index(self) -> int | None:
        """Index of the device that holds this process's heap (None: host memory, no index)."""
        return None

    def torch_device_of_heap(self) -> str:
        """``"cpu"`` or ``"cuda:N"``: where tensors over this process's heap live."""
        idx = self.device_index
        return self.torch_device if idx is None else f"{self.torch_device}:{idx}"

    @abstractmethod
    def probe(self) -> Availability:
        """Check, without side effects, whether this runtime works on this machine."""

    @abstractmethod
    def create_segment(self, size: int, tag: str) -> HeapSegment:
        """Allocate ``size`` bytes of zeroed, exportable memory. ``tag`` is unique per rank and job."""

    @abstractmethod
    def open_peer_segment(self, peer: PeerInfo) -> PeerSegment:
        """Map a peer's segment (same runtime, same node) into this process."""

    def check_local_buffer(self, func: str, addr: int, nbytes: int) -> None:  # noqa: B027 - optional hook
        """Raise :class:`~mori.core.errors.MoriValueError` unless ``[addr, addr+nbytes)`` is memory
        :meth:`copy` may read and write (``shmem_buffer_register``). ``nbytes > 0``.

        Default: no check here (device memory is checked by the driver when a copy uses it, which
        fails with an error, not a crash). Host-memory runtimes check the process's mappings.
        """

    def alloc_mapped_host(self, size: int) -> MappedHostMemory:
        """``size`` zeroed bytes of host memory that device code of this runtime loads, stores and
        does atomics on, and host threads too (pinned and mapped into the device on a GPU).

        Default: ordinary host memory, which is right for runtimes whose kernels run on the CPU
        (the ``cpu`` runtime, the Triton interpreter). GPU runtimes override it.
        """
        return _PlainHostMemory(size)

    # -- how the host touches heap memory; every address is one this process has mapped ---------

    @abstractmethod
    def byte_view(self, addr: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` at ``addr`` on :attr:`torch_device` (no copy)."""

    @abstractmethod
    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Copy bytes (ranges may overlap); complete and visible to peers when it returns."""

    @abstractmethod
    def atomic_rmw(self, addr: int, op: int, word: int, value: int) -> int:
        """Sequentially consistent ``OP_*`` on the ``WORD_*`` at ``addr``; returns the old value."""

    @abstractmethod
    def atomic_compare_swap(self, addr: int, word: int, expected: int, desired: int) -> int:
        """Replace the word with ``desired`` if it equals ``expected``; returns the value found."""

    @abstractmethod
    def wait_until(self, addr: int, cmp: int, word: int, value: int, timeout_s: float) -> tuple[bool, int]:
        """Block until ``word <CMP_*> value`` or ``timeout_s`` passes (< 0: forever); returns
        ``(reached, last value seen)``. Must not hold the GIL while it waits."""

    @abstractmethod
    def fence(self) -> None:
        """Order every earlier store of this process before every later one, for all observers."""


class HostMemoryRuntime(DeviceRuntime):
    """Base for runtimes whose heap is ordinary host memory: host access through native code."""

    torch_device = "cpu"

    def byte_view(self, addr: int, nbytes: int) -> torch.Tensor:
        import torch

        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(addr), dtype=torch.uint8, count=nbytes)

    def check_local_buffer(self, func: str, addr: int, nbytes: int) -> None:
        """Mapped readable and writable in this process: a copy from anything else is a SIGSEGV."""
        from mori.core import mappings

        mappings.require_read_write(func, "ptr", addr, nbytes)

    # Below this size a native memmove beats a torch dispatch; above it torch's copy wins by
    # running on every intra-op thread.
    NATIVE_COPY_MAX = 256 << 10

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        from mori.core import _core

        if nbytes <= self.NATIVE_COPY_MAX or abs(dst - src) < nbytes:  # overlap needs memmove
            _core.copy(dst, src, nbytes)
        else:
            self.byte_view(dst, nbytes).copy_(self.byte_view(src, nbytes))  # releases the GIL

    def atomic_rmw(self, addr: int, op: int, word: int, value: int) -> int:
        from mori.core import _core

        return _core.atomic_rmw(addr, op, word, value)

    def atomic_compare_swap(self, addr: int, word: int, expected: int, desired: int) -> int:
        from mori.core import _core

        return _core.atomic_compare_swap(addr, word, expected, desired)

    def wait_until(self, addr: int, cmp: int, word: int, value: int, timeout_s: float) -> tuple[bool, int]:
        from mori.core import _core

        return _core.wait_until(addr, cmp, word, value, timeout_s)

    def fence(self) -> None:
        from mori.core import _core

        _core.fence()


class Transport(ABC):
    """A way for this process to reach a peer's heap."""

    name: str
    description: str = ""
    #: transports are tried in decreasing priority; the first that connects wins
    priority: int = 0
    #: True if a connection gives an address that loads and stores reach (shmem_ptr_p2p != 0)
    load_store: bool = True

    @abstractmethod
    def probe(self) -> Availability:
        """Check, without side effects, whether this transport works on this machine."""

    @abstractmethod
    def connect(self, runtime: DeviceRuntime, me: PeerInfo, peer: PeerInfo) -> PeerSegment | None:
        """Reach ``peer``'s heap, or return None if this transport cannot reach that peer."""


class NetworkTransport(Transport):
    """A transport that reaches peers on other nodes through a network engine (``tcp`` in core,
    ``ucx`` from mori-backend-ucx). It gives no load/store mapping; features move bytes through
    its native ops table (the C ABI ``mori/transport.h``, opened by
    :func:`mori.core.transport.open_transport`)."""

    load_store = False

    @abstractmethod
    def ops(self) -> object:
        """The native ops table: a PyCapsule named ``"mori.transport.v1"`` that stays valid as long
        as the process lives."""

    def options(self) -> str:
        """The ``key=value;...`` options to open it with on this machine (from its environment
        variables and the NIC plugins' data); ``""`` for its defaults."""
        return ""

    def connect(self, runtime: DeviceRuntime, me: PeerInfo, peer: PeerInfo) -> PeerSegment | None:
        return None  # never a load/store mapping


class NicProvider(ABC):
    """Host-side driver for one family of RDMA NICs (mlx5, bnxt, ionic, ...).

    NIC plugins return :class:`mori.core.nic.VendorNicProvider` objects: one data descriptor
    (:class:`mori.core.nic.NicVendor`) each, from which core reads sysfs, selects devices and
    configures the network transports."""

    name: str
    description: str = ""

    @abstractmethod
    def probe(self) -> Availability:
        """Check, without side effects, whether such a NIC and its user-space library are present."""

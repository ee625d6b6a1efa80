"""The contract between mori-core and its backends: what a plugin's objects must provide.

A *device runtime* owns the memory that backs the symmetric heap (``cpu`` in core; ``cuda`` and
``hip`` from device plugins). A *transport* decides how this process reaches a peer's heap (``shm``
in core for ranks of one node; ``p2p``, ``ucx``, ``verbs`` from plugins). A *NIC provider* drives one
family of network cards. Plugins return instances of these classes from the hooks in
:mod:`mori.core.hookspecs`; core picks among them by name and priority, never by plugin.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field


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


class DeviceRuntime(ABC):
    """A kind of memory the symmetric heap can live in, and the device that computes on it."""

    #: name users select with MORI_DEVICE_RUNTIME; unique among all plugins
    name: str
    description: str = ""
    #: ``auto`` picks the usable runtime with the highest priority
    priority: int = 0
    #: the torch device type tensors on this runtime's memory have ("cpu", "cuda")
    torch_device: str = "cpu"

    @abstractmethod
    def probe(self) -> Availability:
        """Check, without side effects, whether this runtime works on this machine."""

    @abstractmethod
    def create_segment(self, size: int, tag: str) -> HeapSegment:
        """Allocate ``size`` bytes of zeroed, exportable memory. ``tag`` is unique per rank and job."""

    @abstractmethod
    def open_peer_segment(self, peer: PeerInfo) -> PeerSegment:
        """Map a peer's segment (same runtime, same node) into this process."""


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


class NicProvider(ABC):
    """Host-side driver for one family of RDMA NICs (mlx5, bnxt, ionic, ...)."""

    name: str
    description: str = ""

    @abstractmethod
    def probe(self) -> Availability:
        """Check, without side effects, whether such a NIC and its user-space library are present."""

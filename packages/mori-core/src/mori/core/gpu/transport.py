"""The same-node GPU load/store transport the GPU device plugins share (each names its own).

For a peer on the same node that also uses this runtime, ``connect`` maps the peer's heap with the
driver's IPC when the two GPUs can load and store each other's memory: the same GPU (several ranks
sharing one), or GPUs with peer access (NVLink, xGMI, or PCIe where the platform allows it). Loads,
stores and atomics of kernels then reach the peer directly, and ``shmem_ptr_p2p`` is non-zero.
Otherwise it returns None and the next transport is tried. A plugin subclasses
:class:`GpuP2PTransport` with its ``name``, ``description``, ``runtime_class``, ``error_class``
and ``ipc_name``.
"""

from __future__ import annotations

from typing import ClassVar

from mori.core.backend import Availability, DeviceRuntime, PeerInfo, PeerSegment, Transport
from mori.core.gpu.driver import GpuError
from mori.core.gpu.runtime import GpuRuntime

__all__ = ["GpuP2PTransport"]


class GpuP2PTransport(Transport):
    priority = 200  # before the host-memory transports, which do not serve GPU heaps anyway
    load_store = True
    #: the runtime it serves (made with no argument when none is given) and its driver's errors
    runtime_class: ClassVar[type[GpuRuntime]] = GpuRuntime
    error_class: ClassVar[type[GpuError]] = GpuError
    #: how messages name the IPC ("CUDA IPC")
    ipc_name: ClassVar[str] = "IPC"

    def __init__(self, runtime: GpuRuntime | None = None) -> None:
        self._runtime = runtime or self.runtime_class()
        #: peer rank -> why connect() returned None for it (diagnostics)
        self.unreachable: dict[int, str] = {}

    def probe(self) -> Availability:
        return self._runtime.probe()

    def connect(self, runtime: DeviceRuntime, me: PeerInfo, peer: PeerInfo) -> PeerSegment | None:
        if (
            not isinstance(runtime, self.runtime_class)
            or me.runtime != runtime.name
            or peer.runtime != runtime.name
        ):
            return None
        if peer.node_id != me.node_id:
            self.unreachable[peer.rank] = f"on node {peer.node_id}, not {me.node_id}"
            return None
        ok, why = runtime.can_reach(peer)
        if not ok:
            self.unreachable[peer.rank] = why
            return None
        try:
            return runtime.open_peer_segment(peer)
        except self.error_class as e:
            if "not visible" not in why:
                raise
            self.unreachable[peer.rank] = f"{why}, and {self.ipc_name} could not map it: {e}"
            return None

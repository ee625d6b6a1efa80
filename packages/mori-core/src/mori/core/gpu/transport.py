"""The same-node GPU load/store transport the GPU device plugins share (each names its own).

For a peer on the same node that also uses this runtime, ``connect`` maps the peer's heap with the
driver's IPC when the two GPUs can load and store each other's memory: the same GPU (several ranks
sharing one), or GPUs with peer access (NVLink, xGMI, or PCIe where the platform allows it). Loads,
stores and atomics of kernels then reach the peer directly, and ``shmem_ptr_p2p`` is non-zero.
Otherwise it returns None and the next transport is tried. Its name and description are the
vendor's (:class:`~mori.core.gpu.vendor.GpuVendor`: ``p2p`` for CUDA, ``xgmi`` for HIP); a device
plugin's :class:`~mori.core.gpu.vendor.GpuVendorPlugin` makes one over its runtime.
"""

from __future__ import annotations

from mori.core.backend import Availability, DeviceRuntime, PeerInfo, PeerSegment, Transport
from mori.core.gpu.runtime import GpuRuntime

__all__ = ["GpuP2PTransport"]


class GpuP2PTransport(Transport):
    """The same-node load/store transport over ``runtime`` (see the module docstring)."""

    priority = 200  # before the host-memory transports, which do not serve GPU heaps anyway
    load_store = True

    def __init__(self, runtime: GpuRuntime) -> None:
        self._runtime = runtime
        self.name = runtime.vendor.transport
        self.description = runtime.vendor.transport_description
        #: peer rank -> why connect() returned None for it (diagnostics)
        self.unreachable: dict[int, str] = {}

    def probe(self) -> Availability:
        return self._runtime.probe()

    def connect(self, runtime: DeviceRuntime, me: PeerInfo, peer: PeerInfo) -> PeerSegment | None:
        if (
            not isinstance(runtime, GpuRuntime)
            or runtime.name != self._runtime.name
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
        except runtime.error_class as e:
            if "not visible" not in why:
                raise
            self.unreachable[peer.rank] = f"{why}, and {runtime.vendor.ipc_name} could not map it: {e}"
            return None

"""The ``p2p`` transport: ranks of one node whose GPUs can reach each other map each other's heap.

For a peer on the same node that also uses the ``cuda`` runtime, ``connect`` maps the peer's heap
with CUDA IPC when the two GPUs can load and store each other's memory: the same GPU (several
ranks sharing one), or GPUs with peer access (NVLink, or PCIe where the platform allows it). Loads,
stores and atomics of kernels then reach the peer directly, and ``shmem_ptr_p2p`` is non-zero.
Otherwise it returns None and the next transport is tried.
"""

from __future__ import annotations

from mori.core.backend import Availability, DeviceRuntime, PeerInfo, PeerSegment, Transport
from mori_backend_nvlink.driver import CudaError
from mori_backend_nvlink.runtime import CudaRuntime

__all__ = ["P2PTransport"]


class P2PTransport(Transport):
    name = "p2p"
    description = (
        "same-node GPU load/store (NVLink, PCIe peer access): each rank maps its peers' heaps (CUDA IPC)"
    )
    priority = 200  # before the host-memory transports, which do not serve GPU heaps anyway
    load_store = True

    def __init__(self, runtime: CudaRuntime | None = None) -> None:
        self._runtime = runtime or CudaRuntime()
        #: peer rank -> why connect() returned None for it (diagnostics)
        self.unreachable: dict[int, str] = {}

    def probe(self) -> Availability:
        return self._runtime.probe()

    def connect(self, runtime: DeviceRuntime, me: PeerInfo, peer: PeerInfo) -> PeerSegment | None:
        if not isinstance(runtime, CudaRuntime) or me.runtime != runtime.name or peer.runtime != runtime.name:
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
        except CudaError as e:
            if "not visible" not in why:
                raise
            self.unreachable[peer.rank] = f"{why}, and CUDA IPC could not map it: {e}"
            return None

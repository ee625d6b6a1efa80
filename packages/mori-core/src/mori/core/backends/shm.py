"""The ``shm`` transport: peers on the same node map each other's heap and use loads and stores."""

from __future__ import annotations

from collections.abc import Sequence

from mori.core.backend import Availability, DeviceRuntime, PeerInfo, PeerSegment, Transport
from mori.core.plugins import hookimpl


class ShmTransport(Transport):
    name = "shm"
    description = "same-node load/store: each rank maps its peers' heap segments"
    priority = 100
    load_store = True

    def probe(self) -> Availability:
        return Availability(True, "ranks with the same node id")

    def connect(self, runtime: DeviceRuntime, me: PeerInfo, peer: PeerInfo) -> PeerSegment | None:
        # Host memory only: device memory needs the device runtime's own peer mapping (p2p plugins).
        if runtime.torch_device != "cpu":
            return None
        if peer.node_id != me.node_id or peer.runtime != me.runtime:
            return None
        return runtime.open_peer_segment(peer)


@hookimpl
def mori_transports() -> Sequence[Transport]:
    return [ShmTransport()]

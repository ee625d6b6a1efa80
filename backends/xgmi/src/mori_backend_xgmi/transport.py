"""The ``xgmi`` transport: ranks of one node whose GPUs can reach each other map each other's heap.

For a peer on the same node that also uses the ``hip`` runtime, ``connect`` maps the peer's heap
with HIP IPC when the two GPUs can load and store each other's memory: the same GPU (several ranks
sharing one), or GPUs with peer access (xGMI links, or PCIe where the platform allows it). Loads,
stores and atomics of kernels then reach the peer directly, and ``shmem_ptr_p2p`` is non-zero.
Otherwise it returns None and the next transport is tried.
"""

from __future__ import annotations

from mori.core.gpu.transport import GpuP2PTransport
from mori_backend_xgmi.driver import HipError
from mori_backend_xgmi.runtime import HipRuntime

__all__ = ["XgmiTransport"]


class XgmiTransport(GpuP2PTransport):
    name = "xgmi"
    description = (
        "same-node GPU load/store (xGMI, PCIe peer access): each rank maps its peers' heaps (HIP IPC)"
    )
    runtime_class = HipRuntime
    error_class = HipError
    ipc_name = "HIP IPC"

    def __init__(self, runtime: HipRuntime | None = None) -> None:
        super().__init__(runtime)

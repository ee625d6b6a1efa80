"""The ``p2p`` transport: ranks of one node whose GPUs can reach each other map each other's heap.

For a peer on the same node that also uses the ``cuda`` runtime, ``connect`` maps the peer's heap
with CUDA IPC when the two GPUs can load and store each other's memory: the same GPU (several
ranks sharing one), or GPUs with peer access (NVLink, or PCIe where the platform allows it). Loads,
stores and atomics of kernels then reach the peer directly, and ``shmem_ptr_p2p`` is non-zero.
Otherwise it returns None and the next transport is tried.
"""

from __future__ import annotations

from mori.core.gpu.transport import GpuP2PTransport
from mori_backend_nvlink.driver import CudaError
from mori_backend_nvlink.runtime import CudaRuntime

__all__ = ["P2PTransport"]


class P2PTransport(GpuP2PTransport):
    name = "p2p"
    description = (
        "same-node GPU load/store (NVLink, PCIe peer access): each rank maps its peers' heaps (CUDA IPC)"
    )
    runtime_class = CudaRuntime
    error_class = CudaError
    ipc_name = "CUDA IPC"

    def __init__(self, runtime: CudaRuntime | None = None) -> None:
        super().__init__(runtime)

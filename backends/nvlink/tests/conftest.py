"""mori-backend-nvlink's tests run the GPU plugins' shared ones (:mod:`mori.testing.gpu_runtime`)
on its fake CUDA driver; ``gpu_backend`` tells them what CUDA does there."""

from __future__ import annotations

from pathlib import Path

from mori.testing.gpu_runtime import backend_fixture, interpreted_atomics, runtimes, world

__all__ = ["gpu_backend", "interpreted_atomics", "runtimes", "world"]

gpu_backend = backend_fixture(
    "mori_backend_nvlink",
    Path(__file__).parent,
    "_fake_cuda.py:FakeCudaLib",
    no_devices_reason="no CUDA device (cuDeviceGetCount = 0)",
    heap_alloc_call="cuMemAlloc_v2",
    memcpy_failure=r"cuMemcpyAsync failed: CUresult 700|CUDA_ERROR_ILLEGAL_ADDRESS",
)

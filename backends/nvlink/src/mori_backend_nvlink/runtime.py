"""The ``cuda`` device runtime: the symmetric heap in NVIDIA GPU memory, shared with CUDA IPC.

:class:`CudaRuntime` is :class:`mori.core.gpu.runtime.GpuRuntime` (the logic, shared with the
``hip`` runtime, and its documentation) on the CUDA driver API (:mod:`mori_backend_nvlink.driver`):
every driver call runs in the GPU's *primary context*, the one torch uses, made current for the call
and restored after; the heap is one ``cuMemAlloc`` exported with ``cuIpcGetMemHandle``, peers map
it with ``cuIpcOpenMemHandle``; :meth:`~CudaRuntime.fence` is ``cuCtxSynchronize``.
:meth:`~CudaRuntime.export_range` shares any ``cudaMalloc``'ed range (not ``cudaMallocAsync``
pools); :meth:`~CudaRuntime.copy_engine` gives asynchronous copies on dedicated streams.
"""

from __future__ import annotations

from typing import Any

from mori.core.gpu import dlpack as _dlpack
from mori.core.gpu.driver import GpuDriver
from mori.core.gpu.runtime import _WORDS, GpuPeerSegment, GpuRuntime, GpuSegment, _DeviceState, _halves
from mori_backend_nvlink.driver import CudaError, load_driver
from mori_backend_nvlink.handles import SegmentHandle

__all__ = ["CudaPeerSegment", "CudaRuntime", "CudaSegment"]
# _DeviceState, _WORDS, _halves: for the tests' fake runtime
_ = (_DeviceState, _WORDS, _halves)

CudaSegment = GpuSegment
CudaPeerSegment = GpuPeerSegment


class CudaRuntime(GpuRuntime):
    """The ``cuda`` device runtime (see the module docstring).

    ``load``: returns the driver binding (default :func:`~mori_backend_nvlink.driver.load_driver`;
    tests pass a fake).
    """

    name = "cuda"
    description = "NVIDIA GPU memory through the CUDA driver (libcuda.so.1, loaded at run time); CUDA IPC"
    package = "mori-backend-nvlink"
    error_class = CudaError
    handle_class = SegmentHandle
    dlpack_device = _dlpack.KDL_CUDA
    gpu_noun = "CUDA device"
    no_device_result = "CUDA_ERROR_NO_DEVICE"
    device_count_call = "cuDeviceGetCount"
    torch_flavour = "CUDA"
    ipc_name = "CUDA IPC"
    heap_allocation = "one cuMemAlloc"
    alloc_functions = "cudaMalloc/cuMemAlloc"
    async_pool = "cudaMallocAsync"

    @staticmethod
    def _default_load() -> GpuDriver:
        drv: GpuDriver = load_driver()
        return drv

    def _torch_build_ok(self, torch: Any) -> bool:
        return torch.version.cuda is not None

    def _available(self, count: int, version: int, path: str) -> str:
        return f"{count} CUDA device(s), driver {version // 1000}.{version % 1000 // 10} ({path})"

    def _no_peer_access(self, index: int, other: int) -> str:
        return f"cuDeviceCanAccessPeer(cuda:{index}, cuda:{other}) = 0"

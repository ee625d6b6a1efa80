"""The ``hip`` device runtime: the symmetric heap in AMD GPU memory, shared with HIP IPC.

:class:`HipRuntime` is :class:`mori.core.gpu.runtime.GpuRuntime` (the logic, shared with the
``cuda`` runtime, and its documentation) on the HIP runtime API (:mod:`mori_backend_xgmi.driver`):
HIP has no explicit contexts, so every call runs with the GPU made the calling thread's *current
device*, restored after. ``MORI_SHMEM_HEAP_TYPE=uncached`` (the default, as in the original MORI)
allocates the heap fine-grained and uncached (``hipExtMallocWithFlags`` with
``hipDeviceMallocUncached``), so that flags polled across GPUs and by the host are coherent;
``normal`` uses ``hipMalloc``. :meth:`~HipRuntime.fence` is ``hipDeviceSynchronize``; ROCm torch
calls its GPUs ``cuda``, and views are DLPack ``kDLROCM`` tensors.
"""

from __future__ import annotations

from typing import Any

from mori.core.gpu import dlpack as _dlpack
from mori.core.gpu.driver import GpuDriver
from mori.core.gpu.runtime import _WORDS, GpuPeerSegment, GpuRuntime, GpuSegment, _DeviceState, _halves
from mori_backend_xgmi.driver import HipError, load_driver
from mori_backend_xgmi.env import MORI_SHMEM_HEAP_TYPE
from mori_backend_xgmi.handles import SegmentHandle

__all__ = ["HipPeerSegment", "HipRuntime", "HipSegment"]
# _DeviceState, _WORDS, _halves: for the tests' fake runtime
_ = (_DeviceState, _WORDS, _halves)

HipSegment = GpuSegment
HipPeerSegment = GpuPeerSegment


class HipRuntime(GpuRuntime):
    """The ``hip`` device runtime (see the module docstring).

    ``load``: returns the HIP binding (default :func:`~mori_backend_xgmi.driver.load_driver`;
    tests pass a fake).
    """

    name = "hip"
    description = "AMD GPU memory through the HIP runtime (libamdhip64.so, loaded at run time); HIP IPC"
    torch_device = "cuda"  # what ROCm builds of torch call their GPUs
    package = "mori-backend-xgmi"
    error_class = HipError
    handle_class = SegmentHandle
    dlpack_device = _dlpack.KDL_ROCM
    gpu_noun = "AMD GPU"
    no_device_result = "hipErrorNoDevice"
    device_count_call = "hipGetDeviceCount"
    torch_flavour = "ROCm"
    ipc_name = "HIP IPC"
    heap_allocation = "one allocation"
    alloc_functions = "hipMalloc"
    async_pool = "hipMallocAsync"

    @staticmethod
    def _default_load() -> GpuDriver:
        drv: GpuDriver = load_driver()
        return drv

    def _torch_build_ok(self, torch: Any) -> bool:
        return getattr(torch.version, "hip", None) is not None

    def _available(self, count: int, version: int, path: str) -> str:
        return f"{count} AMD GPU(s), HIP driver {version} ({path})"

    def _no_peer_access(self, index: int, other: int) -> str:
        return f"hipDeviceCanAccessPeer({index}, {other}) = 0"

    def _heap_alloc_options(self) -> dict[str, Any]:
        return {"uncached": MORI_SHMEM_HEAP_TYPE.require() == "uncached"}

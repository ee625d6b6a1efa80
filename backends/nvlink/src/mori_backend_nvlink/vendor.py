"""What MORI knows of NVIDIA GPUs, as data (:class:`mori.core.gpu.vendor.GpuVendor`): mori-core's
runtime and transport work from it. The ``cuda`` runtime keeps the heap in GPU memory (one
``cuMemAlloc``, every driver call in the GPU's primary context, the one torch uses) and shares it
with CUDA IPC; the ``p2p`` transport maps peers' heaps where the GPUs reach each other."""

from __future__ import annotations

from mori.core.env import EnvVar
from mori.core.gpu.dlpack import KDL_CUDA
from mori.core.gpu.vendor import GpuVendor
from mori_backend_nvlink.driver import CudaDriver

__all__ = ["MORI_CUDA_DRIVER_LIBRARY", "VENDOR"]

MORI_CUDA_DRIVER_LIBRARY = EnvVar(
    "MORI_CUDA_DRIVER_LIBRARY",
    "libcuda.so.1",
    "CUDA driver library the cuda device runtime loads at run time (a name the dynamic linker finds, or a path).",
    "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
    str,
)


def _cuda_version(version: int) -> str:
    """``cuDriverGetVersion``'s 13000 as "13.0"."""
    return f"{version // 1000}.{version % 1000 // 10}"


VENDOR = GpuVendor(
    runtime="cuda",
    transport="p2p",
    distribution="mori-backend-nvlink",
    runtime_description="NVIDIA GPU memory through the CUDA driver (libcuda.so.1, loaded at run time); CUDA IPC",
    transport_description=(
        "same-node GPU load/store (NVLink, PCIe peer access): each rank maps its peers' heaps (CUDA IPC)"
    ),
    driver_class=CudaDriver,
    library_env=MORI_CUDA_DRIVER_LIBRARY,
    libraries=("libcuda.so.1",),
    missing="no NVIDIA driver on this machine",
    prefer_loaded=None,
    handle_magic=b"MNVL",
    ipc_name="CUDA IPC",
    gpu_noun="CUDA device",
    no_device_result="CUDA_ERROR_NO_DEVICE",
    device_count_call="cuDeviceGetCount",
    torch_flavour="CUDA",
    heap_allocation="one cuMemAlloc",
    alloc_functions="cudaMalloc/cuMemAlloc",
    async_pool="cudaMallocAsync",
    available="{count} CUDA device(s), driver {version} ({path})",
    version_text=_cuda_version,
    peer_access_query="cuDeviceCanAccessPeer(cuda:{index}, cuda:{other})",
    torch_version="cuda",
    dlpack_device=KDL_CUDA,
)

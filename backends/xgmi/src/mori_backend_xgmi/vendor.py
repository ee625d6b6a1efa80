"""What MORI knows of AMD GPUs, as data (:class:`mori.core.gpu.vendor.GpuVendor`): mori-core's
runtime and transport work from it. The ``hip`` runtime keeps the heap in GPU memory and shares it
with HIP IPC; HIP has no explicit contexts, so every call runs with the GPU made the calling
thread's current device, restored after. ``MORI_SHMEM_HEAP_TYPE=uncached`` (the default, as in the
original MORI) allocates the heap fine-grained and uncached (``hipExtMallocWithFlags`` with
``hipDeviceMallocUncached``), so that flags polled across GPUs and by the host are coherent;
``normal`` uses ``hipMalloc``. ROCm torch calls its GPUs ``cuda``; views are DLPack ``kDLROCM``
tensors. The ``xgmi`` transport maps peers' heaps where the GPUs reach each other."""

from __future__ import annotations

from collections.abc import Mapping

from mori.core.env import EnvVar, choice
from mori.core.gpu.dlpack import KDL_ROCM
from mori.core.gpu.vendor import GpuVendor
from mori_backend_xgmi.driver import LIBRARIES, HipDriver

__all__ = ["MORI_HIP_LIBRARY", "MORI_SHMEM_HEAP_TYPE", "VENDOR"]

MORI_HIP_LIBRARY = EnvVar(
    "MORI_HIP_LIBRARY",
    None,
    "HIP runtime library the hip device runtime loads at run time. Default: the libamdhip64 already "
    "loaded in the process (a ROCm build of torch brings one), else libamdhip64.so from the linker's path "
    "or /opt/rocm/lib.",
    "/opt/rocm/lib/libamdhip64.so",
    str,
)
MORI_SHMEM_HEAP_TYPE = EnvVar(
    "MORI_SHMEM_HEAP_TYPE",
    "uncached",
    "Memory of the hip runtime's symmetric heap: uncached (fine-grained, hipExtMallocWithFlags with "
    "hipDeviceMallocUncached: coherent for flags polled across GPUs, as in the original MORI) or normal "
    "(hipMalloc, coarse-grained: faster for bulk data, coherent only at kernel boundaries).",
    "normal",
    choice("normal", "uncached"),
    "normal, uncached",
)


def _heap_options() -> Mapping[str, bool]:
    """The heap's ``HipDriver.mem_alloc`` options: ``MORI_SHMEM_HEAP_TYPE`` (checked)."""
    return {"uncached": MORI_SHMEM_HEAP_TYPE.require() == "uncached"}


VENDOR = GpuVendor(
    runtime="hip",
    transport="xgmi",
    distribution="mori-backend-xgmi",
    runtime_description="AMD GPU memory through the HIP runtime (libamdhip64.so, loaded at run time); HIP IPC",
    transport_description=(
        "same-node GPU load/store (xGMI, PCIe peer access): each rank maps its peers' heaps (HIP IPC)"
    ),
    driver_class=HipDriver,
    library_env=MORI_HIP_LIBRARY,
    libraries=LIBRARIES,
    missing="no ROCm on this machine",
    prefer_loaded="libamdhip64.so",
    handle_magic=b"MXGM",
    ipc_name="HIP IPC",
    gpu_noun="AMD GPU",
    no_device_result="hipErrorNoDevice",
    device_count_call="hipGetDeviceCount",
    torch_flavour="ROCm",
    heap_allocation="one allocation",
    alloc_functions="hipMalloc",
    async_pool="hipMallocAsync",
    available="{count} AMD GPU(s), HIP driver {version} ({path})",
    peer_access_query="hipDeviceCanAccessPeer({index}, {other})",
    torch_version="hip",
    dlpack_device=KDL_ROCM,
    heap_alloc_options=_heap_options,
    env_vars=(MORI_SHMEM_HEAP_TYPE,),
)

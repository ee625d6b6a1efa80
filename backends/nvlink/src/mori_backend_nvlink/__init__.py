"""mori-backend-nvlink: the ``cuda`` device runtime and the ``p2p`` transport for NVIDIA GPUs.

Installed next to mori-core, it is found through the ``mori.backends`` entry point ``nvlink``;
select it with ``MORI_DEVICE_RUNTIME=cuda`` (or ``auto``, where a GPU works). The CUDA driver is
loaded with ctypes when the runtime is first used: importing this package loads neither
``libcuda.so.1`` nor ``torch.cuda``, and it imports on machines without CUDA.

The package is data: :data:`~mori_backend_nvlink.vendor.VENDOR` (a
:class:`mori.core.gpu.vendor.GpuVendor`) and the CUDA driver binding
:class:`~mori_backend_nvlink.driver.CudaDriver` with its C prototypes and its
:class:`~mori_backend_nvlink.driver.CudaError`. The runtime (``PLUGIN.runtime``, a
:class:`mori.core.gpu.runtime.GpuRuntime`), the transport and the copy engine are mori-core's.
"""

from __future__ import annotations

from mori.core.version import installed_version
from mori_backend_nvlink.driver import CudaDriver, CudaError
from mori_backend_nvlink.vendor import VENDOR

__version__ = installed_version("mori-backend-nvlink")

__all__ = ["VENDOR", "CudaDriver", "CudaError", "__version__"]

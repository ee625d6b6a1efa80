"""mori-backend-xgmi: the ``hip`` device runtime and the ``xgmi`` transport for AMD GPUs.

Installed next to mori-core, it is found through the ``mori.backends`` entry point ``xgmi``;
select it with ``MORI_DEVICE_RUNTIME=hip`` (or ``auto``, where a GPU works). The HIP runtime is
loaded with ctypes when the runtime is first used: importing this package loads neither
``libamdhip64.so`` nor torch, and it imports on machines without ROCm.

The package is data: :data:`~mori_backend_xgmi.vendor.VENDOR` (a
:class:`mori.core.gpu.vendor.GpuVendor`, with ``MORI_SHMEM_HEAP_TYPE``) and the HIP binding
:class:`~mori_backend_xgmi.driver.HipDriver` with its C prototypes and its
:class:`~mori_backend_xgmi.driver.HipError`. The runtime (``PLUGIN.runtime``, a
:class:`mori.core.gpu.runtime.GpuRuntime`), the transport and the copy engine are mori-core's.
"""

from __future__ import annotations

from mori.core.version import installed_version
from mori_backend_xgmi.driver import HipDriver, HipError
from mori_backend_xgmi.vendor import VENDOR

__version__ = installed_version("mori-backend-xgmi")

__all__ = ["VENDOR", "HipDriver", "HipError", "__version__"]

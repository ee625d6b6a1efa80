"""The plugin the ``mori.backends`` entry point ``xgmi`` names: :data:`PLUGIN`, mori-core's
:class:`~mori.core.gpu.vendor.GpuVendorPlugin` over :data:`~mori_backend_xgmi.vendor.VENDOR`
(the ``hip`` runtime, the ``xgmi`` transport, ``MORI_HIP_LIBRARY`` and ``MORI_SHMEM_HEAP_TYPE``).

Importing it loads neither the HIP runtime nor torch; the runtime does that when used.
"""

from __future__ import annotations

from mori.core.gpu.vendor import GpuVendorPlugin
from mori_backend_xgmi.vendor import VENDOR

#: what the entry point names
PLUGIN = GpuVendorPlugin(VENDOR)

"""The plugin the ``mori.backends`` entry point ``nvlink`` names: :data:`PLUGIN`, mori-core's
:class:`~mori.core.gpu.vendor.GpuVendorPlugin` over :data:`~mori_backend_nvlink.vendor.VENDOR`
(the ``cuda`` runtime, the ``p2p`` transport and ``MORI_CUDA_DRIVER_LIBRARY``).

Importing it loads neither the CUDA driver nor torch.cuda; the runtime does that when used.
"""

from __future__ import annotations

from mori.core.gpu.vendor import GpuVendorPlugin
from mori_backend_nvlink.vendor import VENDOR

#: what the entry point names
PLUGIN = GpuVendorPlugin(VENDOR)

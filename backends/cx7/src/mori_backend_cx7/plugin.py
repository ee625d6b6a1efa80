"""The plugin module the ``mori.backends`` entry point ``cx7`` names: :data:`PLUGIN`, its hooks
(mori-core's :class:`mori.core.nic.VendorPlugin` over :data:`~mori_backend_cx7.vendor.VENDOR`).

Importing it reads nothing and loads no library; the provider's probe reads sysfs when asked.
"""

from __future__ import annotations

from mori.core.nic import VendorPlugin
from mori_backend_cx7.vendor import VENDOR

#: what the entry point names: the provider and the vendor's variables
PLUGIN = VendorPlugin(VENDOR)

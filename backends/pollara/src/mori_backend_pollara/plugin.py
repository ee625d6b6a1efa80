"""The plugin module the ``mori.backends`` entry point ``pollara`` names: its hooks.

Importing it reads nothing and loads no library; the provider's probe reads sysfs when asked.
"""

from __future__ import annotations

from collections.abc import Sequence

from mori.core.backend import NicProvider
from mori.core.env import EnvVar
from mori.core.nic import VendorNicProvider
from mori.core.plugins import hookimpl
from mori_backend_pollara.vendor import VENDOR


@hookimpl
def mori_nic_providers() -> Sequence[NicProvider]:
    return [VendorNicProvider(VENDOR)]


@hookimpl
def mori_env_vars() -> Sequence[EnvVar[object]]:
    return list(VENDOR.env_vars)

"""The plugin module the ``mori.backends`` entry point ``xgmi`` names: its hooks.

Importing it loads neither the HIP runtime nor torch; the runtime does that when used.
"""

from __future__ import annotations

from collections.abc import Sequence

from mori.core.backend import DeviceRuntime, Transport
from mori.core.env import EnvVar
from mori.core.plugins import hookimpl
from mori_backend_xgmi import env
from mori_backend_xgmi.runtime import HipRuntime
from mori_backend_xgmi.transport import XgmiTransport

_runtime = HipRuntime()


@hookimpl
def mori_device_runtimes() -> Sequence[DeviceRuntime]:
    return [_runtime]


@hookimpl
def mori_transports() -> Sequence[Transport]:
    return [XgmiTransport(_runtime)]


@hookimpl
def mori_env_vars() -> Sequence[EnvVar[object]]:
    return list(env.ALL)

"""The plugin module the ``mori.backends`` entry point ``nvlink`` names: its hooks.

Importing it loads neither the CUDA driver nor torch.cuda; the runtime does that when used.
"""

from __future__ import annotations

from collections.abc import Sequence

from mori.core.backend import DeviceRuntime, Transport
from mori.core.env import EnvVar
from mori.core.plugins import hookimpl
from mori_backend_nvlink import env
from mori_backend_nvlink.runtime import CudaRuntime
from mori_backend_nvlink.transport import P2PTransport

_runtime = CudaRuntime()


@hookimpl
def mori_device_runtimes() -> Sequence[DeviceRuntime]:
    return [_runtime]


@hookimpl
def mori_transports() -> Sequence[Transport]:
    return [P2PTransport(_runtime)]


@hookimpl
def mori_env_vars() -> Sequence[EnvVar[object]]:
    return list(env.ALL)

"""The plugin module the ``mori.backends`` entry point ``ucx`` names: its hooks.

Importing it loads no UCX; the transport does that when it is probed or opened.
"""

from __future__ import annotations

from collections.abc import Sequence

from mori.core.backend import Transport
from mori.core.env import EnvVar
from mori.core.plugins import hookimpl
from mori_backend_ucx import env
from mori_backend_ucx.transport import UcxTransport

_transport = UcxTransport()


@hookimpl
def mori_transports() -> Sequence[Transport]:
    return [_transport]


@hookimpl
def mori_env_vars() -> Sequence[EnvVar[object]]:
    return list(env.ALL)

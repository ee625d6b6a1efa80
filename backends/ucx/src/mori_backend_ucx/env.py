"""The ``MORI_*`` variables mori-backend-ucx reads (``mori env`` lists them through the plugin).

Values are read on use, never at import. UCX's own ``UCX_*`` variables keep their meaning: the
transport's options override them where given (``tls``, ``net_devices``, ...).
"""

from __future__ import annotations

from mori.core.env import EnvVar


def _library(text: str) -> str:
    value = text.strip()
    if not value:
        raise ValueError("expected 'wheel', 'system' or a path to libucp.so")
    return value


MORI_UCX_LIBRARY = EnvVar(
    "MORI_UCX_LIBRARY",
    "wheel",
    "Which UCX the ucx transport loads: 'wheel' (the libucx-cu12 wheel's, no RDMA verbs), 'system' "
    "(the dynamic linker's libucp.so.0, e.g. a UCX built with verbs), or a path to a libucp.so.",
    "system",
    _library,
    "wheel, system, or a path",
)

MORI_UCX_OPTIONS = EnvVar(
    "MORI_UCX_OPTIONS",
    "",
    "Options the ucx transport opens with when MORI picks it (key=value;... as in the plugin's README), "
    "e.g. the network devices that may listen beyond loopback.",
    "net_devices=mlx5_0:1,eth0;tls=rc,sm,self",
    str,
)

#: every variable this plugin reads, for the mori_env_vars hook
ALL: tuple[EnvVar[object], ...] = (MORI_UCX_LIBRARY, MORI_UCX_OPTIONS)  # type: ignore[assignment]

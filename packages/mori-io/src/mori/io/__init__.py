"""mori.io: one-sided point-to-point transfer engine. PLACEHOLDER: nothing is implemented yet.

mori-io 0.1.0 is an empty placeholder. The IO component is not implemented yet; this module
provides none of its names, and accessing any of them raises :class:`AttributeError`. Progress is
tracked in the project's issues.

What it will be: an engine per process that registers local memory, exchanges engine and memory
descriptors with remote engines, and moves bytes between registered regions with asynchronous
one-sided reads and writes (single, batched, or through a session), for example to move KV caches
between prefill and decode servers. The data path is chosen per pair of memories.

Planned public names: ``IOEngine``, ``IOEngineConfig``, ``IOEngineSession``, ``TransferStatus``,
``BackendType``, ``MemoryLocationType``, ``StatusCode``, ``PollCqMode``, ``RdmaBackendConfig``,
``XgmiBackendConfig``, ``FabricBackendConfig``, ``EngineDesc``, ``MemoryDesc``, ``set_log_level``.
"""

from __future__ import annotations

from typing import NoReturn

__all__: list[str] = []
__status__ = "placeholder"

_DISTRIBUTION = "mori-io"
_COMPONENT = "IO"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(_DISTRIBUTION)
    except PackageNotFoundError:  # a source tree that is not installed
        return "0+unknown"


def __getattr__(name: str) -> NoReturn:
    if name.startswith("_"):  # dunder probes (copy, inspect, pytest) get the ordinary error
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}", name=name)
    raise AttributeError(
        f"{__name__}.{name} is not available: {_DISTRIBUTION} {_version()} is a placeholder; "
        f"the {_COMPONENT} component is not implemented yet (see the project's issues)",
        name=name,
    )

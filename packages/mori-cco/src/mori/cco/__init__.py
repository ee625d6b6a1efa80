"""mori.cco: explicit communicators over a flat symmetric address space. PLACEHOLDER: nothing is
implemented yet.

mori-cco 0.1.0 is an empty placeholder. The CCO component is not implemented yet; this module
provides none of its names, and accessing any of them raises :class:`AttributeError`. Progress is
tracked in the project's issues. The collectives that will use it live in :mod:`mori.ccl`, from the
same distribution and equally empty.

What it will be: communicator objects (several per process) created from a unique id, which
allocate and register memory windows that every rank can reach, and hand kernels a device-side
communicator for load/store access to peers on the node, device-initiated RDMA and copy-engine
transfers, with barriers.

Planned public names: ``Communicator``, ``UniqueId``, ``AllocatedMemory``, ``RegisteredWindow``,
``ImportedWindow``, ``DevCommHandle``, ``CCODevCommRequirements``.
"""

from __future__ import annotations

from typing import NoReturn

__all__: list[str] = []
__status__ = "placeholder"

_DISTRIBUTION = "mori-cco"
_COMPONENT = "CCO"


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

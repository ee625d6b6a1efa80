"""mori.ep: MoE expert-parallel dispatch and combine. PLACEHOLDER: nothing is implemented yet.

mori-ep 0.1.0 is an empty placeholder. The EP component is not implemented yet; this module
provides none of its names, and accessing any of them raises :class:`AttributeError`. Progress is
tracked in the project's issues.

What it will be: dispatch sends every token of a mixture-of-experts layer to each rank that hosts
one of its top-k experts (once per destination rank), with its weights, expert ids and optional
scales; combine returns the experts' outputs to the token's source rank and sums them. It will be
built on :mod:`mori.shmem`, and also be importable as ``mori.ops`` like the original.

Planned public names: ``EpDispatchCombineConfig``, ``EpDispatchCombineOp``,
``EpDispatchCombineKernelType``, ``EpDispatchRoutingHandle``, ``launch_local_expert_count``.
"""

from __future__ import annotations

from typing import NoReturn

__all__: list[str] = []
__status__ = "placeholder"

_DISTRIBUTION = "mori-ep"
_COMPONENT = "EP"


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

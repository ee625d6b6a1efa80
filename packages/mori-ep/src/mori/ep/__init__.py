"""mori.ep: MoE expert-parallel dispatch and combine (also importable as ``mori.ops``).

*Dispatch* sends each token of a mixture-of-experts layer to every rank that hosts one of its
top-k experts, once per destination rank, with its routing weights, expert ids and optional
scales. *Combine* returns the experts' outputs to the token's source rank and sums them there
(unweighted, in fp32). Built on :mod:`mori.shmem`: Triton kernels on GPUs (:mod:`mori.ep.kernels`,
NVIDIA and AMD), the same protocol as vectorised torch code on the CPU runtime; the single-node
kernel types ``IntraNode``, ``IntraNodeLL`` and ``AsyncLL``. :mod:`mori.ep.deepep` offers DeepEP's
``Buffer`` API on top.

The names below are imported on first use, so that ``mori`` commands that only list this package
(its bench suite, its environment variables) do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mori.ep.config import MAX_EXPERTS_PER_TOKEN, EpDispatchCombineConfig, EpDispatchCombineKernelType
    from mori.ep.op import EpDispatchCombineOp, EpDispatchRoutingHandle

__all__ = [
    "MAX_EXPERTS_PER_TOKEN",
    "EpDispatchCombineConfig",
    "EpDispatchCombineKernelType",
    "EpDispatchCombineOp",
    "EpDispatchRoutingHandle",
]

_WHERE = {
    "MAX_EXPERTS_PER_TOKEN": "mori.ep.config",
    "EpDispatchCombineConfig": "mori.ep.config",
    "EpDispatchCombineKernelType": "mori.ep.config",
    "EpDispatchCombineOp": "mori.ep.op",
    "EpDispatchRoutingHandle": "mori.ep.op",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'mori.ep' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])

"""mori.ep: MoE expert-parallel dispatch and combine (also importable as ``mori.ops``).

*Dispatch* sends each token of a mixture-of-experts layer to every rank that hosts one of its
top-k experts, once per destination rank, with its routing weights, expert ids and optional
scales. *Combine* returns the experts' outputs to the token's source rank and sums them there
(unweighted, in fp32). Built on :mod:`mori.shmem`; the CPU runtime implements the single-node
kernel types ``IntraNode``, ``IntraNodeLL`` and ``AsyncLL``.
"""

from __future__ import annotations

from mori.ep.config import (
    MAX_EXPERTS_PER_TOKEN,
    EpDispatchCombineConfig,
    EpDispatchCombineKernelType,
)
from mori.ep.op import EpDispatchCombineOp, EpDispatchRoutingHandle

__all__ = [
    "MAX_EXPERTS_PER_TOKEN",
    "EpDispatchCombineConfig",
    "EpDispatchCombineKernelType",
    "EpDispatchCombineOp",
    "EpDispatchRoutingHandle",
]
__status__ = "cpu"

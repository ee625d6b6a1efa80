"""mori.ops: the original MORI's name for the EP component; the same objects as :mod:`mori.ep`."""

from __future__ import annotations

from mori.ep import (
    MAX_EXPERTS_PER_TOKEN,
    EpDispatchCombineConfig,
    EpDispatchCombineKernelType,
    EpDispatchCombineOp,
    EpDispatchRoutingHandle,
)

__all__ = [
    "MAX_EXPERTS_PER_TOKEN",
    "EpDispatchCombineConfig",
    "EpDispatchCombineKernelType",
    "EpDispatchCombineOp",
    "EpDispatchRoutingHandle",
]

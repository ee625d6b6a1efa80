"""Configuration of the EP dispatch/combine operator: kernel families and sizes.

Names, field order and defaults follow the original ``mori.ops`` so that code written for it runs
unchanged. Every field is validated when the config is built; a bad value raises
:class:`~mori.core.errors.MoriValueError` (also a :class:`ValueError`) naming the field, the value
and what is allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from mori.core.errors import MoriTypeError, bad_value

__all__ = [
    "MAX_EXPERTS_PER_TOKEN",
    "QUANT_TYPES",
    "EpDispatchCombineConfig",
    "EpDispatchCombineKernelType",
]

#: largest top-k the kernels support (the original's ``MAX_EXPERTS_PER_TOKEN``)
MAX_EXPERTS_PER_TOKEN = 9
#: accepted values of :attr:`EpDispatchCombineConfig.quant_type` (combine wire format)
QUANT_TYPES = ("none", "fp8_direct_cast", "fp8_blockwise", "fp4_blockwise")


class EpDispatchCombineKernelType(IntEnum):
    """Which kernel family moves the tokens (values as in the original)."""

    #: ranks of one node, direct loads/stores between devices
    IntraNode = 0
    #: baseline multi-node (RDMA)
    InterNode = 1
    #: throughput multi-node: RDMA blocks plus intra-node blocks in one grid
    InterNodeV1 = 2
    #: low-latency variant of InterNodeV1
    InterNodeV1LL = 3
    #: split send/receive calls (``dispatch_send``/``dispatch_recv``, ...) for overlap
    AsyncLL = 4
    #: low-latency variant of IntraNode
    IntraNodeLL = 5


def _int_field(name: str, value: Any, minimum: int, allowed: str | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise bad_value("EpDispatchCombineConfig", name, value, allowed or f"an int >= {minimum}")
    return int(value)


@dataclass
class EpDispatchCombineConfig:
    """Sizes and launch settings of one :class:`~mori.ep.EpDispatchCombineOp`.

    Every rank builds the same config except for ``rank``.

    Args:
        data_type: token dtype (deprecated, kept for compatibility: the dtype of each call's input
            tensor is used). A ``torch.dtype`` or None.
        rank: this rank, in ``[0, world_size)``.
        world_size: number of expert-parallel ranks.
        hidden_dim: largest hidden size (elements) of dispatch and combine tokens; a call may use a
            smaller one.
        scale_dim: number of per-token scale elements dispatch forwards (0 = none).
        scale_type_size: bytes per scale element (0 = no scales).
        max_token_type_size: bytes of the widest token element type used (sizes the buffers).
        max_num_inp_token_per_rank: ``M``, the most tokens a rank dispatches per call.
        num_experts_per_rank: ``E_local``; global expert ``e`` lives on rank ``e // E_local``.
        num_experts_per_token: ``K``, the top-k (at most :data:`MAX_EXPERTS_PER_TOKEN`).
        warp_num_per_block, block_num: GPU launch geometry (accepted; unused on the CPU runtime).
        max_total_recv_tokens: receive capacity; 0 means ``world_size * M`` rows, otherwise
            ``world_size * min(ceil(max_total_recv_tokens / world_size), M)`` rows. A dispatch that
            would receive more raises.
        use_external_inp_buf: True: combine's input is any tensor; False: zero-copy, the caller
            writes expert outputs into :meth:`~mori.ep.EpDispatchCombineOp.get_registered_combine_input_buffer`.
        kernel_type: an :class:`EpDispatchCombineKernelType` (or its int value).
        gpu_per_node: ranks per node (node = ``rank // gpu_per_node``); the inter-node kernel
            types cap it at ``world_size`` and need it to divide ``world_size``.
        rdma_block_num: GPU blocks dedicated to RDMA in the V1 kernels; 0 or fewer than
            ``block_num`` for InterNodeV1/V1LL. Validated and recorded; unused on the CPU runtime
            (each inter-node stream is one host transport operation, see :mod:`mori.ep.internode`).
        num_qp_per_pe: RDMA queue pairs per peer (>= 1; the env ``MORI_NUM_QP_PER_PE`` is the
            shmem-level one). Validated and recorded; unused on the CPU runtime.
        quant_type: combine wire format, one of :data:`QUANT_TYPES`.
    """

    data_type: Any
    rank: int
    world_size: int
    hidden_dim: int
    scale_dim: int
    scale_type_size: int
    max_token_type_size: int
    max_num_inp_token_per_rank: int
    num_experts_per_rank: int
    num_experts_per_token: int
    warp_num_per_block: int = 8
    block_num: int = 80
    max_total_recv_tokens: int = 0
    use_external_inp_buf: bool = True
    kernel_type: EpDispatchCombineKernelType = EpDispatchCombineKernelType.IntraNode
    gpu_per_node: int = 8
    rdma_block_num: int = 0
    num_qp_per_pe: int = 1
    quant_type: str = "none"

    def __post_init__(self) -> None:
        import torch

        if self.data_type is not None and not isinstance(self.data_type, torch.dtype):
            raise MoriTypeError(
                f"EpDispatchCombineConfig: data_type has type {type(self.data_type).__name__}; "
                "expected a torch.dtype or None"
            )
        self.world_size = _int_field("world_size", self.world_size, 1)
        self.rank = _int_field("rank", self.rank, 0)
        if self.rank >= self.world_size:
            raise bad_value("EpDispatchCombineConfig", "rank", self.rank, f"an int in [0, {self.world_size})")
        self.hidden_dim = _int_field("hidden_dim", self.hidden_dim, 1)
        self.scale_dim = _int_field("scale_dim", self.scale_dim, 0)
        self.scale_type_size = _int_field(
            "scale_type_size", self.scale_type_size, 0, "an int >= 0 (bytes per scale element)"
        )
        self.max_token_type_size = _int_field(
            "max_token_type_size", self.max_token_type_size, 1, "an int >= 1 (bytes per token element)"
        )
        self.max_num_inp_token_per_rank = _int_field(
            "max_num_inp_token_per_rank", self.max_num_inp_token_per_rank, 1
        )
        self.num_experts_per_rank = _int_field("num_experts_per_rank", self.num_experts_per_rank, 1)
        k = self.num_experts_per_token
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_EXPERTS_PER_TOKEN:
            raise bad_value(
                "EpDispatchCombineConfig",
                "num_experts_per_token",
                k,
                f"an int in [1, {MAX_EXPERTS_PER_TOKEN}]",
            )
        self.warp_num_per_block = _int_field("warp_num_per_block", self.warp_num_per_block, 1)
        self.block_num = _int_field("block_num", self.block_num, 1)
        self.max_total_recv_tokens = _int_field(
            "max_total_recv_tokens", self.max_total_recv_tokens, 0, "an int >= 0 (0 = world_size * M)"
        )
        if not isinstance(self.use_external_inp_buf, bool):
            raise bad_value(
                "EpDispatchCombineConfig", "use_external_inp_buf", self.use_external_inp_buf, "True or False"
            )
        kt = self.kernel_type
        names = ", ".join(f"{m.name} ({m.value})" for m in EpDispatchCombineKernelType)
        if isinstance(kt, bool) or not isinstance(kt, int) or kt not in set(EpDispatchCombineKernelType):
            raise bad_value("EpDispatchCombineConfig", "kernel_type", kt, f"one of {names}")
        self.kernel_type = EpDispatchCombineKernelType(kt)
        self.gpu_per_node = _int_field("gpu_per_node", self.gpu_per_node, 1)
        self.rdma_block_num = _int_field("rdma_block_num", self.rdma_block_num, 0)
        self.num_qp_per_pe = _int_field("num_qp_per_pe", self.num_qp_per_pe, 1)
        if self.quant_type not in QUANT_TYPES:
            raise bad_value("EpDispatchCombineConfig", "quant_type", self.quant_type, f"one of {QUANT_TYPES}")

    # -- derived sizes --------------------------------------------------------------------------

    def max_num_tokens_to_recv_per_rank(self) -> int:
        """Receive rows reserved per source rank (``M``, or less with ``max_total_recv_tokens``)."""
        m = self.max_num_inp_token_per_rank
        if self.max_total_recv_tokens == 0:
            return m
        return min(math.ceil(self.max_total_recv_tokens / self.world_size), m)

    def max_num_tokens_to_recv(self) -> int:
        """Rows of the receive buffers: ``world_size * max_num_tokens_to_recv_per_rank()``."""
        return self.world_size * self.max_num_tokens_to_recv_per_rank()

    def max_num_tokens_to_send(self) -> int:
        """``world_size * M``: the span of flat source positions."""
        return self.world_size * self.max_num_inp_token_per_rank

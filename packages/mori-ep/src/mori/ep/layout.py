"""Dispatch layout: what a dispatch of ``topk_idx`` sends, per rank and per expert (one kernel).

DeepEP's ``Buffer.get_dispatch_layout`` counts, for ``topk_idx`` [N, K] (global expert ids,
``-1`` = none), the tokens each rank receives (a token counts once per rank however many of its
experts live there), the (token, k) pairs of each expert, and the bool [N, W] "token t goes to
rank r" table. Engines call it every step, so on a GPU it is one Triton launch with no host
synchronisation (:func:`dispatch_layout_kernel`, plus one memset of the counters); on the CPU
runtime the same result comes from a few vectorised torch operations.

Expert ``e`` lives on rank ``e // (num_experts // W)``. Ids outside ``[0, num_experts)`` count
as ``-1``; callers that can afford it (the CPU runtime) reject them before.
"""

from __future__ import annotations

import torch

from mori.core.relaunch import Relaunch

__all__ = ["IMPLS", "dispatch_layout", "pow2_at_least"]

#: implementations: "auto" (the kernel on a GPU, torch on the CPU), "triton" (the kernel; on the
#: CPU only under TRITON_INTERPRET=1), "torch"
IMPLS = ("auto", "triton", "torch")


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``): the block sizes of the layout and
    handle kernels."""
    return 1 << max(0, n - 1).bit_length()


def _torch_layout(
    topk_idx: torch.Tensor, num_experts: int, world: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = topk_idx.shape[0]
    e_local = num_experts // world
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    per_expert = torch.bincount(topk_idx[valid].long(), minlength=num_experts).to(torch.int32)
    ranks = torch.where(valid, topk_idx // e_local, world).long()
    in_rank = torch.zeros(n, world + 1, dtype=torch.bool, device=topk_idx.device)
    in_rank.scatter_(1, ranks, True)
    in_rank = in_rank[:, :world].contiguous()
    return in_rank.sum(0, dtype=torch.int32), per_expert, in_rank


#: the layout kernel, relaunched without Triton's per-call dispatch (on an H200 host that dispatch
#: took longer than the kernel); its module is imported on the first launch, so the CPU runtime
#: never imports Triton here
_KERNEL = Relaunch("mori.ep.layout_kernel:dispatch_layout_kernel")


def dispatch_layout(
    topk_idx: torch.Tensor, num_experts: int, world: int, impl: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(num_tokens_per_rank int32 [world], num_tokens_per_expert int32 [num_experts],
    is_token_in_rank bool [N, world])`` for ``topk_idx`` [N, K] int64 or int32 (``-1`` = none),
    on ``topk_idx``'s device. ``num_experts`` must be a multiple of ``world``. Not collective; no
    host synchronisation on a GPU (``impl``: see :data:`IMPLS`)."""
    use_kernel = impl == "triton" or (impl == "auto" and topk_idx.device.type != "cpu")
    if not use_kernel:
        return _torch_layout(topk_idx, num_experts, world)
    n, k = topk_idx.shape
    idx = topk_idx.contiguous()
    # one zeroed allocation (each torch call costs microseconds of host time): the bool table's
    # bytes (all written by the kernel), rounded up to 16 bytes, then the counters
    table = -(-n * world // 16) * 4
    out = torch.zeros(table + world + num_experts, dtype=torch.int32, device=idx.device)
    in_rank = out[:table].view(torch.bool)[: n * world].view(n, world)
    per_rank, per_expert = out[table:].split_with_sizes([world, num_experts])
    if n:
        bt = 64
        _KERNEL(
            (-(-n // bt),),
            idx,
            n,
            per_rank,
            per_expert,
            in_rank.view(torch.uint8),
            num_experts,
            num_experts // world,
            W=world,
            W_P2=pow2_at_least(world),
            K=k,
            K_P2=pow2_at_least(k),
            E_P2=pow2_at_least(num_experts + 1),
            BT=bt,
            num_warps=4,
        )
    return per_rank, per_expert, in_rank

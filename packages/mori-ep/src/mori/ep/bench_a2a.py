"""The baseline of ``mori bench ep``: MoE dispatch and combine written with
``torch.distributed.all_to_all_single``, as a user would write them without MORI.

* :func:`a2a_dispatch`: per destination rank, the tokens with at least one expert there (the same
  once-per-destination-rank rule as MORI); ``all_to_all_single`` of the split sizes, read on the
  host, then of the token rows and of one packed metadata row per token (weights, expert ids,
  scales). With a known :class:`A2ALayout` the split exchange is skipped (the "cached" variant).
* :func:`a2a_combine`: the reverse ``all_to_all_single`` of the expert outputs, summed at the
  source in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["A2ALayout", "a2a_combine", "a2a_dispatch"]


@dataclass
class A2ALayout:
    """Where a baseline dispatch sent and received rows; its combine reverses it.

    Attributes:
        send_tok: int64 [S]: source token of each sent row, rows grouped by destination rank.
        send_counts: rows sent to each rank (``S = sum``).
        recv_counts: rows received from each rank.
    """

    send_tok: torch.Tensor
    send_counts: list[int]
    recv_counts: list[int]


def a2a_dispatch(
    x: torch.Tensor,
    weights: torch.Tensor,
    scales: torch.Tensor | None,
    indices: torch.Tensor,
    num_experts_per_rank: int,
    *,
    layout: A2ALayout | None = None,
    group: Any = None,
) -> tuple[A2ALayout, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Dispatch with ``all_to_all_single``, as a user would write it. Collective.

    Each token goes once to every distinct rank hosting one of its experts (``-1`` ids skipped).
    Without ``layout``: count rows per destination, exchange the counts (``all_to_all_single``) and
    read them on the host, then exchange the token rows and one packed metadata row (weights,
    expert ids, scales) per token. With ``layout`` (same routing as the call that made it): the
    counts exchange is skipped (the "cached" variant, graph-capturable).

    Returns ``(layout, recv_x [R, H], recv_weights [R, K] f32, recv_indices [R, K] int32,
    recv_scales [R, S] | None)``, rows grouped by source rank, each group in token order.
    """
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    n, h = x.shape
    k = indices.shape[1]
    if layout is None:
        ranks = torch.where(indices >= 0, indices // num_experts_per_rank, world).long()
        dest = torch.zeros(n, world + 1, dtype=torch.bool, device=x.device)
        dest.scatter_(1, ranks, True)
        dest = dest[:, :world]
        # (rank, token) pairs in rank-major order: the rows of each destination are contiguous
        send_tok = dest.t().nonzero()[:, 1]
        send_counts_t = dest.sum(0)
        recv_counts_t = torch.empty_like(send_counts_t)
        dist.all_to_all_single(recv_counts_t, send_counts_t, group=group)
        layout = A2ALayout(send_tok, send_counts_t.tolist(), recv_counts_t.tolist())  # host sync
    total = sum(layout.recv_counts)
    meta_cols = 2 * k + (0 if scales is None else scales.shape[1])
    meta = torch.empty(n, meta_cols, dtype=torch.int32, device=x.device)
    meta[:, :k] = weights.float().view(torch.int32)
    meta[:, k : 2 * k] = indices
    if scales is not None:
        meta[:, 2 * k :] = scales.float().view(torch.int32)
    # fp8 rows travel as bytes: same bits, and gloo has no float8 type
    wire = x.view(torch.uint8) if x.element_size() == 1 else x
    recv_x = torch.empty(total, h, dtype=wire.dtype, device=x.device)
    dist.all_to_all_single(
        recv_x, wire.index_select(0, layout.send_tok), layout.recv_counts, layout.send_counts, group=group
    )
    recv_meta = torch.empty(total, meta_cols, dtype=torch.int32, device=x.device)
    dist.all_to_all_single(
        recv_meta, meta.index_select(0, layout.send_tok), layout.recv_counts, layout.send_counts, group=group
    )
    recv_scales = None if scales is None else recv_meta[:, 2 * k :].view(torch.float32)
    return (
        layout,
        recv_x.view(x.dtype),
        recv_meta[:, :k].view(torch.float32),
        recv_meta[:, k : 2 * k],
        recv_scales,
    )


def a2a_combine(y: torch.Tensor, layout: A2ALayout, num_tokens: int, *, group: Any = None) -> torch.Tensor:
    """Combine with ``all_to_all_single``: send received row ``i``'s output ``y[i]`` back to its
    source, which sums each token's rows in fp32 (``index_add_``) and casts once. Collective.

    ``y``: [R, H], row ``i`` for received row ``i`` of :func:`a2a_dispatch`. Returns [num_tokens, H].
    """
    import torch
    import torch.distributed as dist

    back = torch.empty(len(layout.send_tok), y.shape[1], dtype=y.dtype, device=y.device)
    dist.all_to_all_single(back, y, layout.send_counts, layout.recv_counts, group=group)
    acc = torch.zeros(num_tokens, y.shape[1], dtype=torch.float32, device=y.device)
    acc.index_add_(0, layout.send_tok, back.float())
    return acc.to(y.dtype)

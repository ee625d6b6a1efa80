"""Pure-torch reference of dispatch and combine over every rank's inputs at once (for tests).

No communication and no buffers: it says which rows each rank must receive and what combine must
return, so a test can check the operator row by row.
"""

from __future__ import annotations

import torch

__all__ = ["dest_ranks", "reference_combine", "reference_dispatch"]


def dest_ranks(indices: torch.Tensor, num_experts_per_rank: int, world_size: int) -> torch.Tensor:
    """bool [N, world_size]: token ``t`` has at least one expert (id ``!= -1``) on rank ``p``."""
    n = indices.shape[0]
    dest = torch.zeros(n, world_size + 1, dtype=torch.bool)
    ranks = torch.where(indices >= 0, indices // num_experts_per_rank, world_size).long()
    dest.scatter_(1, ranks, True)
    return dest[:, :world_size]


def reference_dispatch(
    indices: list[torch.Tensor], num_experts_per_rank: int, max_tokens_per_rank: int
) -> list[torch.Tensor]:
    """For each receiving rank, the sorted int64 flat source positions ``src_rank * world * M +
    src_tok`` of the rows it must receive (``indices[s]`` is rank ``s``'s [N_s, K] routing)."""
    world = len(indices)
    span = world * max_tokens_per_rank
    per_dest: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for s, idx in enumerate(indices):
        dest = dest_ranks(idx, num_experts_per_rank, world)
        for p in range(world):
            per_dest[p].append(dest[:, p].nonzero().flatten() + s * span)
    return [torch.cat(rows).sort().values if rows else torch.zeros(0, dtype=torch.int64) for rows in per_dest]


def reference_combine(
    x: torch.Tensor, indices: torch.Tensor, num_experts_per_rank: int, world_size: int
) -> torch.Tensor:
    """Combine of identity experts: ``x[t] * U_t`` in fp32 (``U_t`` = distinct destination ranks)."""
    u = dest_ranks(indices, num_experts_per_rank, world_size).sum(1, dtype=torch.float32)
    return x.float() * u[:, None]

"""Triton kernel of :func:`mori.ep.layout.dispatch_layout` (imported on first use, so that the
CPU runtime never imports Triton for it and tests may choose ``TRITON_INTERPRET`` first)."""

# mypy: disable-error-code="no-untyped-def,untyped-decorator"

from __future__ import annotations

import triton
import triton.language as tl

from mori.core.kernels import aot_variants
from mori.ep.layout import pow2_at_least

__all__ = ["dispatch_layout_kernel"]


def _layout_variants() -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for idx_t, w, k, e in (
        ("*i64", 2, 8, 256),
        ("*i64", 8, 8, 256),
        ("*i32", 8, 9, 288),
        ("*i64", 16, 6, 64),
    ):
        out.append(
            {
                "signature": {
                    "idx_ptr": idx_t,
                    "n_tok": "i32",
                    "per_rank_ptr": "*i32",
                    "per_expert_ptr": "*i32",
                    "in_rank_ptr": "*u8",
                    "n_experts": "i32",
                    "e_local": "i32",
                },
                "constexprs": {
                    "W": w,
                    "W_P2": pow2_at_least(w),
                    "K": k,
                    "K_P2": pow2_at_least(k),
                    "E_P2": pow2_at_least(e + 1),
                    "BT": 64,
                },
                "aligned": ("idx_ptr", "per_rank_ptr", "per_expert_ptr"),
                "num_warps": 4,
                "label": f"{idx_t[1:]} W={w} K={k} E={e}",
            }
        )
    return out


@aot_variants(_layout_variants())
@triton.jit
def dispatch_layout_kernel(
    # expert ids [n_tok, K] (int64 or int32, contiguous), -1 = none
    idx_ptr,
    n_tok,
    # outputs: int32 [W] tokens per rank and int32 [n_experts] pairs per expert (both zeroed
    # before the launch, added to atomically), uint8 [n_tok, W] token-in-rank (0/1, every
    # entry written)
    per_rank_ptr,
    per_expert_ptr,
    in_rank_ptr,
    n_experts,
    e_local,
    W: tl.constexpr,
    W_P2: tl.constexpr,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    E_P2: tl.constexpr,
    BT: tl.constexpr,
):
    """Program ``i`` takes tokens ``[i * BT, (i + 1) * BT)``.

    1. load their ids ``[BT, K_P2]`` (padding and out-of-range ids become "none");
    2. ``hit[t, r]`` = some id of token ``t`` lives on rank ``r``: one compare of
       ``[BT, K_P2, W_P2]`` and a max over ``k``; stored as the token-in-rank rows;
    3. the column sums of ``hit`` are added to the per-rank counters, a histogram of the
       ids over ``E_P2`` bins (bin ``n_experts`` collects the "none" ids, ``E_P2 > n_experts``)
       to the per-expert counters: ``W + n_experts`` atomics per program.
    """
    toks = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = toks < n_tok
    ks = tl.arange(0, K_P2)
    # masked: tokens past n_tok and k past K read as "none"
    ids = tl.load(
        idx_ptr + toks.to(tl.int64)[:, None] * K + ks[None, :],
        mask=tmask[:, None] & (ks < K)[None, :],
        other=-1,
    ).to(tl.int32)
    valid = (ids >= 0) & (ids < n_experts)
    dest = tl.where(valid, ids // e_local, -1)
    lanes = tl.arange(0, W_P2)
    hit = tl.max((dest[:, :, None] == lanes[None, None, :]).to(tl.int32), axis=1)  # [BT, W_P2]
    tl.store(
        in_rank_ptr + toks.to(tl.int64)[:, None] * W + lanes[None, :],
        hit.to(tl.uint8),
        mask=tmask[:, None] & (lanes < W)[None, :],
    )
    tl.atomic_add(per_rank_ptr + lanes, tl.sum(hit, axis=0), mask=lanes < W)
    bins = tl.arange(0, E_P2)
    hist = tl.histogram(tl.reshape(tl.where(valid, ids, n_experts), [BT * K_P2]), E_P2)
    tl.atomic_add(per_expert_ptr + bins, hist, mask=bins < n_experts)

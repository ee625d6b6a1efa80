"""DeepEP V2's API shape (mori.ep.elastic.ElasticBuffer) on CPU ranks: compact and expand layouts.

Every rank sends rows filled with its rank, the token index in the last 128 columns, and checks
what it receives against every rank's routing (regenerated from seeds): compact rows by source
rank then token, the handle's prefix sums and source metadata; expanded rows expert-major with
aligned blocks, one weight per expanded row; combine of both, weights returned, cached replays.
"""

from __future__ import annotations

import pytest
import torch

import mori.shmem as shmem
from mori.core.errors import MoriValueError
from mori.ep.elastic import ElasticBuffer, EPHandle
from mori.testing import shmem_ranks

H, E_LOCAL, K, ALIGN = 256, 4, 3, 4


def _routing(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    gen = torch.Generator().manual_seed(rank)
    n = 6 + 2 * rank
    e = world * E_LOCAL
    idx = torch.stack([torch.randperm(e, generator=gen)[:K] for _ in range(n)])
    idx = torch.where(torch.rand(n, K, generator=gen) < 0.25, -1, idx)
    return idx, torch.rand(n, K, generator=gen), n


def _tokens(rank: int, n: int) -> torch.Tensor:
    x = torch.full((n, H), float(rank))
    x[:, -128:] = torch.arange(n, dtype=torch.float32)[:, None]
    return x.bfloat16()


def _run(rank: int, world: int) -> str:
    torch.set_num_threads(1)
    m = 6 + 2 * (world - 1)
    buf = ElasticBuffer(None, num_max_tokens_per_rank=m, hidden=H, num_topk=K, explicitly_destroy=True)
    assert buf.get_logical_domain_size() == (1, world) and buf.get_physical_domain_size() == (1, world)
    routes = [_routing(s, world) for s in range(world)]
    idx, wts, n = routes[rank]
    x = _tokens(rank, n)
    num_experts = world * E_LOCAL
    stats = torch.zeros(E_LOCAL, dtype=torch.int32)

    # -- compact -------------------------------------------------------------------------------------
    recv_x, recv_idx, recv_w, handle, event = buf.dispatch(
        x,
        topk_idx=idx,
        topk_weights=wts,
        num_experts=num_experts,
        expert_alignment=ALIGN,
        cumulative_local_expert_recv_stats=stats,
    )
    assert isinstance(handle, EPHandle) and not handle.do_expand and event.event is None
    want_src = []
    for s, (i_s, _, _) in enumerate(routes):
        toks = ((i_s >= 0) & (i_s // E_LOCAL == rank)).any(1).nonzero().flatten()
        want_src.append(s * m + toks)
    want_src = torch.cat(want_src)
    total = want_src.numel()
    assert handle.num_recv_tokens == total and recv_x.shape == (total, H)
    assert int(handle.psum_num_recv_tokens_per_scaleup_rank[-1]) == total
    assert torch.equal(handle.recv_src_metadata[:, 0], want_src), "rows by source rank, then token"
    assert torch.equal(recv_x[:, 0].float(), (want_src // m).float()) and torch.equal(
        recv_x[:, -1].float(), (want_src % m).float()
    )
    # local expert ids and their weights, counts per expert (aligned), prefix sums
    glob = (
        torch.cat(
            [
                routes[s][0][t % m][None]
                for s, t in zip((want_src // m).tolist(), want_src.tolist(), strict=True)
            ]
        )
        if total
        else idx[:0]
    )
    wglob = (
        torch.cat(
            [
                routes[s][1][t % m][None]
                for s, t in zip((want_src // m).tolist(), want_src.tolist(), strict=True)
            ]
        )
        if total
        else wts[:0]
    )
    mine = (glob >= 0) & (glob // E_LOCAL == rank)
    assert recv_idx is not None and torch.equal(recv_idx, torch.where(mine, glob - rank * E_LOCAL, -1))
    assert recv_w is not None and torch.equal(recv_w, torch.where(mine, wglob, 0.0))
    count = torch.stack([(recv_idx == e).sum() for e in range(E_LOCAL)])
    aligned = (count + ALIGN - 1) // ALIGN * ALIGN
    assert handle.num_recv_tokens_per_expert_list == aligned.tolist()
    assert torch.equal(handle.psum_num_recv_tokens_per_expert, torch.cumsum(aligned, 0).int())
    assert torch.equal(stats, count.int())
    # combine: unweighted sum over the receiving ranks; weights back
    combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
    u = ((idx[:, :, None] >= 0) & (idx[:, :, None] // E_LOCAL == torch.arange(world))).any(1).sum(1)
    assert torch.equal(combined.float(), (x.float() * u[:, None]).bfloat16().float())
    torch.testing.assert_close(combined_w, torch.where(idx >= 0, wts, 0.0))
    # cached compact dispatch: the same rows with a new payload
    again, none_idx, _, same, _ = buf.dispatch(x * 2, handle=handle)
    assert same is handle and none_idx is None and torch.equal(again.float(), recv_x.float() * 2)

    # -- expand ----------------------------------------------------------------------------------------
    ex_x, ex_idx, ex_w, eh, _ = buf.dispatch(
        x, topk_idx=idx, topk_weights=wts, num_experts=num_experts, expert_alignment=ALIGN, do_expand=True
    )
    assert eh.do_expand and eh.num_expanded_tokens == int(aligned.sum()) == ex_x.shape[0]
    assert torch.equal(eh.num_unaligned_recv_tokens_per_expert, count.int())
    start = 0
    for e in range(E_LOCAL):
        c = int(count[e])
        assert int(eh.psum_num_recv_tokens_per_expert[e]) == start + c
        rows = ex_x[start : start + c]
        assert bool((ex_idx[start : start + c] == e).all()) and bool(
            (ex_idx[start + c : start + int(aligned[e])] == -1).all()
        )
        assert not bool(ex_x[start + c : start + int(aligned[e])].float().any()), "padding rows are zeros"
        # the tokens of global expert e from every rank, by source rank then token
        g = rank * E_LOCAL + e
        want = [
            (s, t)
            for s, (i_s, _, _) in enumerate(routes)
            for t in (i_s == g).any(1).nonzero().flatten().tolist()
        ]
        assert [(int(r[0]), int(r[-1])) for r in rows.float()] == want
        want_w = [float(routes[s][1][t][(routes[s][0][t] == g).nonzero()[0, 0]]) for s, t in want]
        assert ex_w is not None and ex_w[start : start + c].tolist() == pytest.approx(want_w)
        start += int(aligned[e])
    # combine of identity experts: each token comes back once per (token, k) with a valid expert
    combined, combined_w, _ = buf.combine(ex_x, eh, topk_weights=ex_w)
    valid = (idx >= 0).sum(1)
    torch.testing.assert_close(combined.float(), x.float() * valid[:, None], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(combined_w, torch.where(idx >= 0, wts, 0.0))
    # cached expand with new weights (a backward pass)
    new_w = wts * 3
    ex2, _, ex2_w, _, _ = buf.dispatch(x, topk_weights=new_w, handle=eh, do_expand=True)
    assert torch.equal(ex2, ex_x) and ex2_w is not None and torch.allclose(ex2_w, ex_w * 3)

    # -- errors, before anything is sent ---------------------------------------------------------------
    with pytest.raises(MoriValueError, match=r"topk_idx=.*None when handle"):
        buf.dispatch(x, topk_idx=idx, handle=handle)
    with pytest.raises(MoriValueError, match=r"do_expand=True .*False, the handle"):
        buf.dispatch(x, handle=handle, do_expand=True)
    with pytest.raises(MoriValueError, match=r"x\.shape"):
        buf.combine(ex_x[1:], eh)
    with pytest.raises(MoriValueError, match="num_sms=3"):
        buf.dispatch(x, topk_idx=idx, num_experts=num_experts, num_sms=3)
    shmem.shmem_barrier_all()
    buf.destroy()
    return "ok"


@pytest.mark.parametrize("world", [2, 3])
def test_elastic_buffer(world: int) -> None:
    assert shmem_ranks(_run, world) == ["ok"] * world

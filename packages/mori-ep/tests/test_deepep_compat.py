"""mori.ep.deepep as an exact DeepEP V1 drop-in, checked the way DeepEP's own tests check it.

As in DeepEP's ``tests/test_intranode.py``, every rank sends rows filled with its rank (and the
token index in the last columns), and the received rows are checked against the rank prefix
matrix of the handle, unpacked as DeepEP's 6-tuple; as in ``tests/test_low_latency.py``, the
packed low-latency rows of each local expert are checked against ``handle[1][i]`` (per source
rank ``(begin << 32) | count``) and ``handle[0][i]`` (source token of each row). Also: the public
surface of DeepEP's ``Buffer`` / module, ``install_as_deep_ep``, the layout kernel against torch
(interpreter), and the receive views of ``MORI_EP_DEEPEP_RECV_VIEWS=1``.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

import mori.shmem as shmem
from mori.core.errors import MoriBackendError, MoriStateError, MoriValueError
from mori.ep import deepep
from mori.ep.deepep import Buffer, Config, DispatchHandle, LowLatencyHandle
from mori.testing import run_ranks, shmem_ranks

H, E_LOCAL, K, LL_M = 256, 4, 3, 8
MASK32 = (1 << 32) - 1


def _routing(seed: int, rank: int, world: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 31 + rank)
    e = world * E_LOCAL
    idx = torch.stack([torch.randperm(e, generator=gen)[:K] for _ in range(n)]) if n else torch.zeros(0, K)
    idx = torch.where(torch.rand(n, K, generator=gen) < 0.25, -1, idx.long())
    return idx, torch.rand(n, K, generator=gen)


def _tokens(rank: int, n: int) -> torch.Tensor:
    """DeepEP's test data: every element is the rank, the last 128 columns the token index."""
    x = torch.full((n, H), float(rank))
    x[:, -128:] = torch.arange(n, dtype=torch.float32)[:, None]
    return x.bfloat16()


def _normal(rank: int, world: int) -> str:
    torch.set_num_threads(1)
    buf = Buffer(None)
    num_experts = world * E_LOCAL
    for seed in range(2):
        n = 5 + 3 * rank + seed
        idx, wts = _routing(seed, rank, world, n)
        x = _tokens(rank, n)
        num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, _ = (
            buf.get_dispatch_layout(idx, num_experts)
        )
        assert num_tokens_per_rdma_rank is None
        cfg = Config(4, 6, 256)  # two channels
        recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
            x,
            num_tokens_per_rank=num_tokens_per_rank,
            is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert,
            topk_idx=idx,
            topk_weights=wts,
            config=cfg,
        )
        # DeepEP's handle: a 6-tuple, unpacked by position
        assert isinstance(handle, tuple) and isinstance(handle, DispatchHandle) and len(handle) == 6
        (
            rank_prefix_matrix,
            channel_prefix_matrix,
            recv_channel_prefix_matrix,
            recv_src_idx,
            in_rank,
            send_head,
        ) = handle
        assert handle[0] is rank_prefix_matrix and in_rank is is_token_in_rank
        assert rank_prefix_matrix.dtype == torch.int32 and rank_prefix_matrix.shape == (world, world)
        # DeepEP's check_data: rows between consecutive prefix entries come from that rank, whole rows
        start = 0
        for i in range(world):
            end = int(rank_prefix_matrix[i][rank])
            assert bool((recv_x[start:end, :-128].float() == i).all()), (
                f"rows {start}:{end} are not from rank {i}"
            )
            # recv_src_idx: the token index on the source, which its rows carry
            assert torch.equal(recv_x[start:end, -1].float(), recv_src_idx[start:end].float())
            start = end
        assert start == recv_x.shape[0] == int(rank_prefix_matrix[-1, rank])
        # the channel matrices: C = num_sms / 2 = 2 channels
        assert channel_prefix_matrix.shape == (world, 2) and recv_channel_prefix_matrix.shape == (world, 2)
        assert torch.equal(channel_prefix_matrix[:, -1], num_tokens_per_rank)
        seg = torch.cat([torch.zeros(1, dtype=torch.int32), rank_prefix_matrix[:-1, rank]])
        assert torch.equal(recv_channel_prefix_matrix[:, 0], seg)
        for s in range(world):  # channel c of source s: its tokens [c * per, (c + 1) * per)
            n_s = 5 + 3 * s + seed
            per = -(-n_s // 2)
            rows_s = recv_src_idx[int(seg[s]) : int(rank_prefix_matrix[s, rank])]
            assert int(recv_channel_prefix_matrix[s, 1]) == int(seg[s]) + int((rows_s < per).sum())
        # send_head[t, r]: position of t among this rank's rows for r
        for r in range(world):
            sent = is_token_in_rank[:, r]
            assert torch.equal(send_head[sent, r], torch.arange(int(sent.sum()), dtype=torch.int32))
            assert bool((send_head[~sent, r] == -1).all())
        # local expert ids and counts, as DeepEP
        assert recv_idx is not None and recv_w is not None
        assert sum(counts) == int((recv_idx >= 0).sum())
        # combine: the unweighted sum over the ranks a token went to
        combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
        u = is_token_in_rank.sum(1, dtype=torch.float32)
        assert torch.equal(combined.float(), (x.float() * u[:, None]).bfloat16().float())
        assert combined_w is not None
        torch.testing.assert_close(combined_w, torch.where(idx >= 0, wts, 0.0))
        # cached dispatch through the same tuple
        again = buf.dispatch(_tokens(rank, n) * 2, handle=handle)
        assert torch.equal(again[0].float(), recv_x.float() * 2)
    # ranks that disagree on a call (fp32 tokens on rank 0) fail by name on every rank, sending nothing
    idx, wts = _routing(5, rank, world, 4)
    lay = buf.get_dispatch_layout(idx, num_experts)
    xx = _tokens(rank, 4).float() if rank == 0 else _tokens(rank, 4)
    kw = dict(num_tokens_per_rank=lay[0], is_token_in_rank=lay[3], num_tokens_per_expert=lay[2], topk_idx=idx)
    with pytest.raises(MoriValueError, match=r"x\.dtype: float32 on rank 0; bfloat16 on rank"):
        buf.dispatch(xx, topk_weights=wts, **kw)
    out = buf.dispatch(_tokens(rank, 4), topk_weights=wts, **kw)  # and the buffer still works
    assert bool((out[0][:, 0].float() < world).all())
    # ranks that disagree on the number of experts (here after each has dispatched with both
    # numbers before, so nothing is allocated anew) fail by name on every rank; they used to wait
    # for each other forever, each in a count table of its own width
    idx2 = torch.where(idx >= 0, idx * 2, -1)
    lay2 = buf.get_dispatch_layout(idx2, 2 * num_experts)
    kw2 = dict(
        num_tokens_per_rank=lay2[0], is_token_in_rank=lay2[3], num_tokens_per_expert=lay2[2], topk_idx=idx2
    )
    for args in (kw, kw2):
        buf.dispatch(_tokens(rank, 4), topk_weights=wts, **args)
    with pytest.raises(MoriValueError, match=r"num_experts \(num_tokens_per_expert.shape\[0\]\): "):
        buf.dispatch(_tokens(rank, 4), topk_weights=wts, **(kw if rank == 0 else kw2))
    # more experts than the count table holds at first (256): it grows on every rank, and the
    # per-expert counts of the call that grew it are complete
    big = 512 // world * world
    idx3 = torch.where(idx >= 0, idx * (big // num_experts), -1)
    lay3 = buf.get_dispatch_layout(idx3, big)
    for _ in range(2):
        got = buf.dispatch(
            _tokens(rank, 4), topk_weights=wts, num_tokens_per_rank=lay3[0], is_token_in_rank=lay3[3],
            num_tokens_per_expert=lay3[2], topk_idx=idx3,
        )  # fmt: skip
        assert len(got[3]) == big // world and sum(got[3]) == int((got[1] >= 0).sum()) > 0
    # a tuple rebuilt from the items lacks the routing: refused by name
    with pytest.raises(TypeError, match=r"handle has type tuple.*rebuilt"):
        buf.combine(recv_x, tuple(handle))  # type: ignore[arg-type]
    shmem.shmem_barrier_all()
    return "ok"


@pytest.mark.parametrize("world", [2, 4])
def test_normal_mode_like_deepep(world: int) -> None:
    assert shmem_ranks(_normal, world) == ["ok"] * world


def _recv_views(rank: int, world: int) -> str:
    torch.set_num_threads(1)
    buf = Buffer(None)
    num_experts = world * E_LOCAL
    got = []
    for seed in range(3):
        idx, wts = _routing(10 + seed, rank, world, 6)
        layout = buf.get_dispatch_layout(idx, num_experts)
        out = buf.dispatch(
            _tokens(rank, 6) * (seed + 1),
            num_tokens_per_rank=layout[0],
            is_token_in_rank=layout[3],
            num_tokens_per_expert=layout[2],
            topk_idx=idx,
            topk_weights=wts,
        )
        got.append((out[0], out[0].clone(), out[4]))
        if seed >= 1:  # the result of the dispatch before is still intact
            assert torch.equal(got[seed - 1][0], got[seed - 1][1]), (
                "a view was overwritten by the next dispatch"
            )
            assert got[seed - 1][0].data_ptr() != out[0].data_ptr()
        combined = buf.combine(out[0], out[4])[0]
        u = layout[3].sum(1, dtype=torch.float32)
        assert torch.equal(
            combined.float(), (_tokens(rank, 6).float() * (seed + 1) * u[:, None]).bfloat16().float()
        )
    assert got[0][0].data_ptr() == got[2][0].data_ptr(), "two buffers in turn"
    shmem.shmem_barrier_all()
    return "ok"


def test_normal_mode_receive_views() -> None:
    assert shmem_ranks(_recv_views, 2, env={"MORI_EP_DEEPEP_RECV_VIEWS": "1"}) == ["ok", "ok"]


def _low_latency(rank: int, world: int) -> str:
    torch.set_num_threads(1)
    num_experts = world * E_LOCAL
    buf = Buffer(None, low_latency_mode=True, num_qps_per_rank=E_LOCAL)
    stats = torch.zeros(E_LOCAL, dtype=torch.int32)
    all_idx = [_routing(20, s, world, LL_M - s % 3)[0] for s in range(world)]
    idx = all_idx[rank]
    x = _tokens(rank, idx.shape[0])
    for use_fp8, hook_mode in ((False, False), (True, True)):
        recv, count, handle, _event, hook = buf.low_latency_dispatch(
            x,
            idx,
            LL_M,
            num_experts,
            cumulative_local_expert_recv_stats=stats,
            use_fp8=use_fp8,
            async_finish=not hook_mode,
            return_recv_hook=hook_mode,
        )
        if hook_mode:
            assert hook is not None and not handle.received
            hook()
        recv_x = recv[0].float() * recv[1].repeat_interleave(128, dim=2) if use_fp8 else recv.float()
        # DeepEP's handle: (src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)
        assert isinstance(handle, tuple) and isinstance(handle, LowLatencyHandle) and len(handle) == 5
        src_info, layout_range, m, hidden, e = handle
        assert (m, hidden, e) == (LL_M, H, num_experts)
        for i in range(E_LOCAL):
            expert = rank * E_LOCAL + i
            valid = int(count[i])
            assert bool((src_info[i][valid:] == -1).all())
            total = 0
            for j in range(world):
                begin, cnt = int(layout_range[i][j] >> 32), int(layout_range[i][j] & MASK32)
                want = (all_idx[j] == expert).any(1).nonzero().flatten()
                assert cnt == want.numel(), (i, j, cnt, want)
                assert begin == total, "ranges are rank-major and contiguous"
                rows = recv_x[i, begin : begin + cnt]
                assert bool((rows[:, :-128] == j).all()), (
                    f"expert {i}: rows {begin}:{begin + cnt} not from rank {j}"
                )
                # handle[0][i]: the source token of each row, which its last columns carry
                assert torch.equal(handle[0][i][begin : begin + cnt], want.int())
                assert torch.equal(rows[:, -1], want.float())
                total += cnt
            assert total == valid
        weights = torch.rand(idx.shape[0], K)
        y = buf.get_next_low_latency_combine_buffer(handle)
        y.copy_(recv_x.bfloat16())
        combined, _, _ = buf.low_latency_combine(y, idx, weights, handle, zero_copy=True)
        expect = (x.float()[:, None, :] * torch.where(idx >= 0, weights, 0.0)[:, :, None]).sum(1)
        tol = 0.1 if use_fp8 else 2e-2  # (fp8: the rows were e4m3 on the wire)
        torch.testing.assert_close(combined.float(), expect, rtol=tol, atol=tol)
    # cumulative_local_expert_recv_stats counts both dispatches
    for i in range(E_LOCAL):
        want = sum(int((all_idx[j] == rank * E_LOCAL + i).any(1).sum()) for j in range(world))
        assert int(stats[i]) == 2 * want
    with pytest.raises(MoriStateError, match="enable_shrink"):
        buf.low_latency_update_mask_buffer(0, True)
    with pytest.raises(MoriBackendError, match="internode"):
        buf.internode_dispatch()
    shmem.shmem_barrier_all()
    return "ok"


@pytest.mark.parametrize("world", [2, 4])
def test_low_latency_like_deepep(world: int) -> None:
    assert shmem_ranks(_low_latency, world) == ["ok"] * world


# -- the public surface ------------------------------------------------------------------------------

#: DeepEP V1's public Buffer members (deep_ep/buffer.py), Config and EventOverlap, module names
BUFFER_MEMBERS = [
    "num_sms",
    "destroy",
    "is_sm90_compiled",
    "set_num_sms",
    "capture",
    "get_low_latency_rdma_size_hint",
    "get_comm_stream",
    "get_local_buffer_tensor",
    "get_dispatch_config",
    "get_combine_config",
    "get_dispatch_layout",
    "dispatch",
    "combine",
    "internode_dispatch",
    "internode_combine",
    "clean_low_latency_buffer",
    "low_latency_dispatch",
    "low_latency_combine",
    "low_latency_update_mask_buffer",
    "low_latency_query_mask_buffer",
    "low_latency_clean_mask_buffer",
    "get_next_low_latency_combine_buffer",
]
BUFFER_ATTRS = [
    "rank",
    "group_size",
    "group",
    "num_nvl_bytes",
    "num_rdma_bytes",
    "low_latency_mode",
    "explicitly_destroy",
]
CONFIG_MEMBERS = [
    "num_sms",
    "num_max_nvl_chunked_send_tokens",
    "num_max_nvl_chunked_recv_tokens",
    "num_max_rdma_chunked_send_tokens",
    "num_max_rdma_chunked_recv_tokens",
    "get_nvl_buffer_size_hint",
    "get_rdma_buffer_size_hint",
]
MODULE_NAMES = [
    "Buffer",
    "Config",
    "EventOverlap",
    "topk_idx_t",
    "__version__",
    "is_sm90_compiled",
    "get_low_latency_rdma_size_hint",
]


def test_public_surface() -> None:
    for name in BUFFER_MEMBERS:
        assert hasattr(Buffer, name), f"Buffer.{name}"
    c = Config(20, 6, 256)
    for name in CONFIG_MEMBERS:
        assert hasattr(c, name), f"Config.{name}"
    ev = deepep.EventOverlap()
    for name in ("event", "extra_tensors", "current_stream_wait", "__enter__", "__exit__"):
        assert hasattr(ev, name), f"EventOverlap.{name}"
    for name in MODULE_NAMES:
        assert hasattr(deepep, name), name
    assert Buffer.is_sm90_compiled() is True and deepep.is_sm90_compiled() is True
    assert deepep.get_low_latency_rdma_size_hint(128, 7168, 8, 256) == Buffer.get_low_latency_rdma_size_hint(
        128, 7168, 8, 256
    )


def _attrs(rank: int, world: int) -> str:
    buf = Buffer(None)
    for name in BUFFER_ATTRS:
        assert hasattr(buf, name), f"Buffer().{name}"
    shmem.shmem_barrier_all()
    return "ok"


def test_buffer_attributes() -> None:
    assert shmem_ranks(_attrs, 1) == ["ok"]


def test_install_as_deep_ep() -> None:
    saved = {
        n: sys.modules.pop(n) for n in ("deep_ep", "deep_ep.buffer", "deep_ep.utils") if n in sys.modules
    }
    try:
        assert deepep.install_as_deep_ep() is deepep
        import deep_ep  # type: ignore[import-not-found]
        from deep_ep import Buffer as B  # type: ignore[import-not-found]
        from deep_ep.utils import EventOverlap  # type: ignore[import-not-found]

        assert deep_ep is deepep and B is Buffer and EventOverlap is deepep.EventOverlap
        assert deep_ep.Buffer.is_sm90_compiled() and deep_ep.topk_idx_t is torch.int64
        assert deepep.install_as_deep_ep() is deepep  # again: a no-op
        sys.modules["deep_ep"] = type(sys)("deep_ep")  # someone else's deep_ep
        with pytest.raises(MoriStateError, match="deep_ep is imported already"):
            deepep.install_as_deep_ep()
        assert deepep.install_as_deep_ep(force=True) is sys.modules["deep_ep"]
    finally:
        for n in ("deep_ep", "deep_ep.buffer", "deep_ep.utils"):
            sys.modules.pop(n, None)
        sys.modules.update(saved)


# -- the layout kernel (interpreter) against the torch path ------------------------------------------


def _layout_kernel(rank: int, world: int) -> str:
    from mori.ep.layout import dispatch_layout

    for seed, (w, k, e_local, n, dt) in enumerate(
        [
            (2, 8, 4, 150, torch.int64),
            (3, 6, 2, 65, torch.int32),
            (8, 9, 2, 10, torch.int64),
            (4, 1, 1, 0, torch.int64),
        ]
    ):
        gen = torch.Generator().manual_seed(seed)
        e = w * e_local
        idx = torch.randint(-1, e + 2, (n, k), generator=gen).to(dt)  # -1, and ids out of range
        got = dispatch_layout(idx, e, w, impl="triton")
        want = dispatch_layout(idx, e, w, impl="torch")
        for g, r, name in zip(
            got, want, ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank"), strict=True
        ):
            assert g.dtype == r.dtype and torch.equal(g, r), (name, w, k)
        # an independent count: once per rank, once per (token, k)
        ok = (idx >= 0) & (idx < e)
        ranks = torch.where(ok, idx // e_local, -1)
        in_rank = (
            torch.stack([(ranks == p).any(1) for p in range(w)], 1)
            if n
            else torch.zeros(0, w, dtype=torch.bool)
        )
        assert torch.equal(got[2], in_rank) and torch.equal(got[0], in_rank.sum(0).int())
        assert torch.equal(got[1], torch.stack([(idx == x).sum() for x in range(e)]).int())
    return "ok"


def test_layout_kernel_matches_torch() -> None:
    pytest.importorskip("triton")
    assert run_ranks(_layout_kernel, 1, env={"TRITON_INTERPRET": "1"}, timeout=120) == ["ok"]


# -- the dispatch handle's bookkeeping kernels (interpreter) against the torch path -------------------


def _gathered(gen: torch.Generator, w: int, rank: int, n: int, in_rank: torch.Tensor) -> torch.Tensor:
    """A table as the all-gather leaves it: row s = [n_s, sent to rank 0..w-1, 7 other words];
    this rank's row from ``in_rank``, the others at random (at most n_s to each rank)."""
    table = torch.zeros(w, 1 + w + 7, dtype=torch.int64)
    for s in range(w):
        n_s = n if s == rank else int(torch.randint(0, 40, (1,), generator=gen))
        table[s, 0] = n_s
        table[s, 1 : 1 + w] = in_rank.sum(0) if s == rank else torch.randint(0, n_s + 1, (w,), generator=gen)
    table[:, 1 + w :] = 99  # never read as counts
    return table


def _handle_kernels(rank: int, world: int, device: str = "cpu") -> str:
    """The kernels (interpreted on the CPU, compiled and relaunched on a GPU) against torch."""
    from mori.ep import deepep_handle

    dev = torch.device(device)

    for seed, (w, me, n, channels, k, dt, pad) in enumerate(
        [
            (2, 0, 150, 3, 8, torch.int64, 0),
            (2, 1, 150, 33, 8, torch.int64, 5),
            (3, 2, 65, 4, 6, torch.int32, 0),
            (8, 5, 10, 12, 9, torch.int64, 3),  # more channels than tokens: empty channels
            (4, 1, 0, 2, 1, torch.int64, 2),  # no tokens
            (5, 3, 1100, 7, 0, None, 0),  # no top-k; more than one step of the kernels' loops
            (2, 1, 0, 4, 8, torch.int64, 0),  # nothing sent, nothing received: empty outputs
        ]
    ):
        gen = torch.Generator().manual_seed(seed)
        in_rank = torch.rand(n, w, generator=gen) < 0.4
        table = _gathered(gen, w, me, n, in_rank)
        if seed == 6:
            table[:, 1 + me] = 0
        m = max(16, 1 << max(0, max(n, int(table[:, 0].max())) - 1).bit_length())
        in_rank_d, table_d = in_rank.to(dev), table.to(dev)
        own = in_rank_d.sum(0, dtype=torch.int32)
        for _ in range(2):  # (on a GPU the second call is a relaunch of the compiled kernel)
            got = deepep_handle.send_side(
                in_rank_d, table_d, None, me, m, channels, impl="triton", per_rank=own
            )
        want = deepep_handle.send_side(in_rank_d, table_d, table, me, m, channels, impl="torch")
        got = deepep_handle.SendSide(
            *(t.cpu() for t in (got.dest, got.total, got.send_head, got.channel_prefix))
        )
        for name in ("dest", "total", "send_head", "channel_prefix"):
            g, r = getattr(got, name), getattr(want, name).cpu()
            assert g.dtype == r.dtype == torch.int32 and torch.equal(g, r), (name, seed)
        # independently: the sent tokens of each rank p land on consecutive rows after what lower
        # ranks send p, in token order
        for p in range(w):
            rows_p = got.dest[p, :n][in_rank[:, p]]
            base = int(table[:me, 1 + p].sum())
            assert torch.equal(rows_p, torch.arange(base, base + len(rows_p), dtype=torch.int32)), (p, seed)
            assert bool(
                (got.dest[p][torch.cat([~in_rank[:, p], torch.ones(m - n, dtype=torch.bool)])] == -1).all()
            )
        assert int(got.total) == int(table[:, 1 + me].sum())

        # receive side: rows of source s are s's sent tokens in order (flat positions s * W * M + tok)
        total = int(table[:, 1 + me].sum())
        pos = []
        for s in range(w):
            toks = (
                torch.randperm(max(1, int(table[s, 0])), generator=gen)[: int(table[s, 1 + me])].sort().values
            )
            pos.append(s * w * m + toks)
        recv_src_pos = torch.cat(pos).to(torch.int32) if pos else torch.zeros(0, dtype=torch.int32)
        topk = None
        if k:
            e_local = 4
            gidx = torch.randint(-1, w * e_local, (total + 3, k), generator=gen, dtype=torch.int32)
            gw = torch.rand(total + 3, k, generator=gen)
            topk = (gidx.to(dev), gw.to(dev), e_local, dt)
        args = (table_d, table, me, recv_src_pos.to(dev), w * m, channels, total + pad, topk)
        # the operator's slot table, copied by the same launch (every other case without it)
        slot = torch.randint(-1, 50, (w, m), generator=gen, dtype=torch.int32).to(dev) if seed % 2 else None
        for _ in range(2):
            got_r = deepep_handle.recv_side(*args, impl="triton", recv_slot=slot)
        want_r = deepep_handle.recv_side(*args, impl="torch", recv_slot=slot)
        assert torch.equal(got_r.recv_src_pos.cpu(), recv_src_pos), seed
        # (16-byte aligned like the operator's tables: Triton specialises combine on it)
        assert got_r.recv_src_pos.data_ptr() % 16 == 0, seed
        if slot is None:
            assert got_r.recv_slot is None
        else:
            assert got_r.recv_slot is not None and got_r.recv_slot.data_ptr() != slot.data_ptr()
            assert torch.equal(got_r.recv_slot.cpu(), slot.cpu()), seed
            assert got_r.recv_slot.data_ptr() % 16 == 0, seed
        for name in ("rank_prefix", "recv_channel_prefix", "recv_src_idx", "recv_idx", "recv_w"):
            g, r = getattr(got_r, name), getattr(want_r, name)
            if r is None:
                assert g is None, (name, seed)
                continue
            assert g.dtype == r.dtype and g.shape == r.shape and torch.equal(g.cpu(), r.cpu()), (name, seed)
        assert torch.equal(got_r.rank_prefix.cpu(), torch.cumsum(table[:, 1 : 1 + w], 0).int())
        if k:
            assert got_r.recv_idx is not None and got_r.recv_w is not None
            assert bool((got_r.recv_idx[total:] == -1).all()) and bool((got_r.recv_w[total:] == 0).all())

    # the all-gather in the send side's launch: this rank's row (epoch last) into every rank's
    # table (here w local tables), then a wait for the other ranks' rows of its own table (here
    # written beforehand, with the epoch), then the send side from the complete table; n = 1 and
    # words of 1 arrive in the kernel as constants, which it must handle like any value
    # (the header, with the epoch at column w + 8, is the same whatever the number of experts)
    for w, e, me, n, words in (
        (2, 8, 1, 1, [1, 1, 1, 0, 1, 1, 8]),
        (3, 12, 0, 70, [5, 7168, 56, 4, 0, 8, 12]),
    ):
        gen = torch.Generator().manual_seed(100 + w)
        width = deepep_handle.header_width(w) + e
        in_rank = torch.rand(n, w, generator=gen) < 0.5
        per_rank = in_rank.sum(0, dtype=torch.int32)
        per_expert = torch.arange(e, dtype=torch.int32) * 2
        for par, epoch, late in ((1, 5, False), (0, 6, True)):
            tables = [torch.full((2, w, width), -7, dtype=torch.int64) for _ in range(w)]
            for s in range(w):  # the other ranks' rows of this rank's table
                if s != me:
                    tables[me][par, s] = torch.randint(0, 9, (width,), generator=gen)
                    tables[me][par, s, 0] = 20
                    tables[me][par, s, w + 8] = epoch
            before = [t.clone() for t in tables]
            tables = [t.to(dev) for t in tables]
            # one peer's row arrives 2 s after the launch: the kernel must wait for it (in the
            # interpreter only: on a GPU the late copy would queue behind the waiting kernel)
            late = late and dev.type == "cpu"
            if late:
                peer = (me + 1) % w
                arrived = before[me][par, peer].to(dev)
                tables[me][par, peer] = -7
                timer = threading.Timer(2.0, lambda t=tables[me], a=arrived, p=peer, q=par: t[q, p].copy_(a))
                timer.start()
                t0 = time.monotonic()
            addrs = torch.tensor([t.data_ptr() for t in tables], dtype=torch.int64, device=dev)
            put = deepep_handle.Put(
                addrs, (par * w + me) * width, epoch, per_rank.to(dev), per_expert.to(dev), words
            )
            got = deepep_handle.send_side(
                in_rank.to(dev), tables[me][par], None, me, 128, 3, impl="triton", put=put
            )
            if late:
                assert time.monotonic() - t0 >= 2.0, "the send side did not wait for a peer's row"
                timer.join()
            row = torch.tensor([n, *per_rank.tolist(), *words, epoch, *range(0, 2 * e, 2)])
            for t, b0 in zip(tables, before, strict=True):
                t = t.cpu()
                assert torch.equal(t[par, me], row), (w, par)
                b0[par, me] = row
                assert torch.equal(t, b0), "wrote outside this rank's rows"
            host = tables[me][par].cpu()
            want = deepep_handle.send_side(in_rank.to(dev), tables[me][par], host, me, 128, 3, impl="torch")
            for name in ("dest", "total", "send_head", "channel_prefix"):
                assert torch.equal(getattr(got, name).cpu(), getattr(want, name).cpu()), (name, w, par)
    return "ok"


def test_handle_kernels_match_torch() -> None:
    pytest.importorskip("triton")
    assert run_ranks(_handle_kernels, 1, env={"TRITON_INTERPRET": "1"}, timeout=180) == ["ok"]


@pytest.mark.gpu
def test_handle_kernels_match_torch_on_a_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip(f"needs a GPU: torch {torch.__version__} sees none")
    assert run_ranks(_handle_kernels, 1, "cuda", env={"TRITON_INTERPRET": "0"}, timeout=300) == ["ok"]

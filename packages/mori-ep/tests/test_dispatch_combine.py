"""EP dispatch/combine on the CPU runtime across 2, 4 and 8 ranks, checked row by row.

Every rank regenerates every rank's inputs from a seed, so a received row is checked bit-exactly
against its source without extra communication. One launch per world size runs all scenarios
(spawning ranks dominates the run time on a small machine).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import mori.shmem as shmem
from mori.core.errors import MoriBackendError, MoriStateError, MoriTypeError, MoriValueError
from mori.ep import EpDispatchCombineConfig, EpDispatchCombineKernelType, EpDispatchCombineOp
from mori.ep.reference import dest_ranks, reference_combine, reference_dispatch
from mori.testing import shmem_ranks
from mori.testing.gpu_shmem import machine_gpu_runtime

KT = EpDispatchCombineKernelType
M, H, E_LOCAL, K, SCALE_DIM = 16, 128, 4, 4, 8
#: combine tolerance by output dtype
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _config(rank: int, world: int, **kw: Any) -> EpDispatchCombineConfig:
    args: dict[str, Any] = dict(
        data_type=torch.bfloat16,
        rank=rank,
        world_size=world,
        hidden_dim=H,
        scale_dim=SCALE_DIM,
        scale_type_size=4,
        max_token_type_size=4,
        max_num_inp_token_per_rank=M,
        num_experts_per_rank=E_LOCAL,
        num_experts_per_token=K,
    )
    args.update(kw)
    return EpDispatchCombineConfig(**args)


#: which kernel types a scenario runs: the main one, its low-latency sibling and the extra types
#: the quantisation scenario covers, plus config fields every op gets (test_internode.py runs the
#: same scenarios with inter-node families)
SINGLE_NODE: dict[str, Any] = {
    "kernel_type": KT.IntraNode,
    "ll": KT.IntraNodeLL,
    "quant_also": (KT.IntraNodeLL, KT.AsyncLL),
    "config": {},
}


def _op(
    impl: str, rank: int, world: int, fam: dict[str, Any] | None = None, **kw: Any
) -> EpDispatchCombineOp:
    """An operator on ``impl``; the Triton kernels (run by the interpreter here) get 3 programs, so
    token ranges split unevenly and some programs get none. ``fam``: a kernel family like
    :data:`SINGLE_NODE` (its main type unless ``kw`` names one)."""
    fam = fam or SINGLE_NODE
    kw = {"kernel_type": fam["kernel_type"], **fam["config"], **kw}
    if impl == "triton":
        kw.setdefault("block_num", 3)
    return EpDispatchCombineOp(_config(rank, world, **kw), impl=impl)


def _routing(gen: torch.Generator, pattern: str, n: int, world: int, k: int, src: int) -> torch.Tensor:
    e_total = world * E_LOCAL
    t = torch.arange(n)[:, None]
    j = torch.arange(k)[None, :]
    if pattern == "random":  # top-k of a random permutation, with -1 sentinels
        idx = torch.stack([torch.randperm(e_total, generator=gen)[:k] for _ in range(n)]) if n else None
        idx = torch.zeros(0, k, dtype=torch.int64) if idx is None else idx
        drop = torch.rand(n, k, generator=gen) < 0.2
        idx = torch.where(drop, -1, idx)
    elif pattern == "round_robin":
        idx = (t * k + j + src) % e_total
    elif pattern == "all_to_one":
        idx = (t + j) % E_LOCAL + 0 * t
    elif pattern == "spread":  # one expert on every rank: the worst case for receivers
        idx = j * E_LOCAL + torch.randint(0, E_LOCAL, (n, k), generator=gen)
    else:
        raise AssertionError(pattern)
    return idx.to(torch.int32)


def _inputs(seed: int, src: int, world: int, pattern: str, dtype: torch.dtype, k: int) -> dict[str, Any]:
    """Rank ``src``'s inputs for one call (every rank can compute every rank's)."""
    gen = torch.Generator().manual_seed(seed * 1000 + src)
    n = int(torch.randint(0, M + 1, (1,), generator=gen))
    if (seed + src) % 5 == 1:
        n = 0  # ranks with no tokens
    x = (torch.randn(n, H, generator=gen) * 4).to(dtype)
    w = torch.rand(n, k, generator=gen)
    s = torch.randn(n, SCALE_DIM, generator=gen)
    idx = _routing(gen, pattern, n, world, k, src)
    return {"x": x, "w": w, "s": s, "idx": idx, "n": n}


def _dev(op: EpDispatchCombineOp, d: dict[str, Any]) -> dict[str, Any]:
    """One rank's inputs on the operator's device (references stay on the CPU)."""
    return {k: v.to(op.buffers.recv_tok.device) if isinstance(v, torch.Tensor) else v for k, v in d.items()}


def _cpu(ts: Any) -> list[Any]:
    return [t.cpu() if isinstance(t, torch.Tensor) else t for t in ts]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _check_dispatch(
    op: EpDispatchCombineOp, outs: tuple[Any, ...], all_in: list[dict[str, Any]], counted: bool = False
) -> int:
    rank, world = op.rank, op.world_size
    out, out_w, out_s, out_idx, total_t = _cpu(outs[:5])
    total = int(total_t[0])
    pos = op.get_dispatch_src_token_pos().cpu()
    assert pos.shape == (total,) and pos.dtype == torch.int32
    assert torch.unique(pos).numel() == total, "source positions are not unique"
    ref = reference_dispatch([d["idx"] for d in all_in], E_LOCAL, M)[rank]
    assert torch.equal(pos.long().sort().values, ref), "received rows differ from the reference"
    src_rank, src_tok = op.decode_send_flat_idx(pos.long())
    for s in range(world):
        rows = (src_rank == s).nonzero().flatten()
        toks = src_tok[rows]
        d = all_in[s]
        assert torch.equal(_bits(out[:total][rows]), _bits(d["x"][toks])), f"tokens from rank {s}"
        assert torch.equal(_bits(out_w[:total][rows]), _bits(d["w"][toks])), f"weights from rank {s}"
        assert torch.equal(out_idx[:total][rows], d["idx"][toks]), f"indices from rank {s}"
        if out_s is not None:
            assert torch.equal(_bits(out_s[:total][rows]), _bits(d["s"][toks])), f"scales from rank {s}"
    if op._kern is not None:  # the receiver's table the push combine follows: row of (s, t), or -1
        expect_slot = torch.full((world, M), -1, dtype=torch.int32)
        expect_slot[src_rank, src_tok] = torch.arange(total, dtype=torch.int32)
        assert torch.equal(op._kern.recv_slot.cpu(), expect_slot), "recv_slot disagrees with the rows"
    if not counted:
        return total
    # local expert count over the received (token, k) pairs
    idx = out_idx[:total]
    mine = (idx >= 0) & (idx // E_LOCAL == rank)
    expect = torch.bincount((idx[mine] - rank * E_LOCAL).long(), minlength=E_LOCAL).to(torch.int32)
    assert torch.equal(op.local_expert_count.cpu(), expect)
    return total


def _check_combine(
    op: EpDispatchCombineOp,
    got: tuple[Any, ...],
    mine: dict[str, Any],
    cdtype: torch.dtype,
    tol: float | None = None,
) -> None:
    out, out_w = _cpu(got)
    n, world = mine["n"], op.world_size
    assert out.shape == (M, H) and out.dtype == cdtype
    expect = reference_combine(mine["x"].to(cdtype), mine["idx"], E_LOCAL, world)
    tol = TOL[cdtype] if tol is None else tol
    torch.testing.assert_close(out[:n].float(), expect, rtol=tol, atol=tol)
    u = dest_ranks(mine["idx"], E_LOCAL, world).sum(1, dtype=torch.float32)
    if out_w is not None:
        torch.testing.assert_close(out_w[:n], mine["w"] * u[:, None], rtol=1e-6, atol=1e-6)


def _round(
    op: EpDispatchCombineOp,
    seed: int,
    pattern: str,
    dtype: torch.dtype,
    cdtype: torch.dtype,
    *,
    k: int = K,
    scales: bool = True,
    zero_copy: bool = False,
) -> None:
    rank, world = op.rank, op.world_size
    all_in = [_inputs(seed, s, world, pattern, dtype, k) for s in range(world)]
    me = _dev(op, all_in[rank])
    outs = op.dispatch(me["x"], me["w"], me["s"] if scales else None, me["idx"], call_local_expert_count=True)
    total = _check_dispatch(op, outs, all_in, counted=True)
    y = outs[0][:total].to(cdtype)  # identity experts
    if zero_copy:
        buf = op.get_registered_combine_input_buffer(cdtype)
        buf[:total] = y
        got = op.combine(buf, outs[1], me["idx"], use_external_inp_buf=False)
    else:
        got = op.combine(y, outs[1], me["idx"])
    _check_combine(op, got, all_in[rank], cdtype)


def _scenarios(
    rank: int, world: int, impl: str = "host", rounds: int = 10, fam: dict[str, Any] | None = None
) -> None:
    fam = fam or SINGLE_NODE
    # random routing with sentinels and scales, `rounds` calls in a row on one op, bf16
    op = _op(impl, rank, world, fam)
    if impl == "triton":  # interpreter: one resident program, M = 16 -> chunks of 2 tokens: push
        assert op._kern is not None and op._kern._push_chunk(-1, -1, torch.bfloat16) == 2
    for it in range(rounds):
        _round(op, it, "random", torch.bfloat16, torch.bfloat16)
    # other patterns, other dtypes, cross-dtype combine, no scales
    _round(op, 20, "round_robin", torch.float32, torch.bfloat16, scales=False)
    _round(op, 21, "all_to_one", torch.float16, torch.float16)
    _round(op, 22, "random", torch.float32, torch.float32)
    _round(op, 23, "random", torch.float8_e4m3fn, torch.bfloat16)
    # zero-copy combine
    _round(op, 24, "random", torch.bfloat16, torch.bfloat16, zero_copy=True)
    zc = _op(impl, rank, world, fam, use_external_inp_buf=False)
    for it in range(2):
        _round(zc, 30 + it, "round_robin", torch.bfloat16, torch.float32, zero_copy=True)
    # spread (K = world), with a capped receive buffer that still fits
    sp = _op(impl, rank, world, fam, num_experts_per_token=world, max_total_recv_tokens=world * M)
    assert sp.max_num_tokens_to_recv() == world * M
    for it in range(2):
        _round(sp, 40 + it, "spread", torch.bfloat16, torch.bfloat16, k=world)
    # the low-latency sibling (IntraNodeLL, InterNodeV1LL): same path
    ll = _op(impl, rank, world, fam, kernel_type=fam["ll"])
    for it in range(2):
        _round(ll, 50 + it, "random", torch.bfloat16, torch.bfloat16)


def _async_ll(rank: int, world: int, impl: str = "host") -> None:
    op = _op(impl, rank, world, kernel_type=KT.AsyncLL)
    for it in range(4):
        all_in = [_inputs(60 + it, s, world, "random", torch.bfloat16, K) for s in range(world)]
        me = _dev(op, all_in[rank])
        outs = op.dispatch_send(me["x"], me["w"], me["s"], me["idx"])
        with pytest.raises(MoriStateError, match="dispatch_recv"):
            op.combine(outs[0], outs[1], me["idx"])
        op.dispatch_recv(call_local_expert_count=True)
        total = _check_dispatch(op, outs, all_in, counted=True)
        got = op.combine_send(outs[0][:total].clone(), outs[1][:total].clone(), me["idx"])
        op.combine_recv()
        _check_combine(op, got, all_in[rank], torch.bfloat16)


def _new_payload(src: int, n: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(700 + src)
    return {"x": torch.randn(n, H, generator=gen).to(torch.bfloat16), "w": torch.rand(n, K, generator=gen)}


def _replay(rank: int, world: int, impl: str = "host", fam: dict[str, Any] | None = None) -> None:
    op = _op(impl, rank, world, fam)
    a = [_inputs(70, s, world, "random", torch.bfloat16, K) for s in range(world)]
    b = [_inputs(71, s, world, "round_robin", torch.bfloat16, K) for s in range(world)]
    da, db = _dev(op, a[rank]), _dev(op, b[rank])
    outs = op.dispatch(da["x"], da["w"], None, da["idx"], return_routing=True)
    handle = outs[5]
    ta, pos_a = int(outs[4][0]), op.get_dispatch_src_token_pos()
    ya = outs[0][:ta].clone()  # layer a's expert outputs, taken before the next dispatch
    # layer b overwrites the receive buffers
    outs_b = op.dispatch(db["x"], db["w"], None, db["idx"])
    _check_dispatch(op, outs_b, b)
    # combine layer a through its handle (kernels: pushing rows, by the handle's recv_slot)
    assert (handle.recv_slot is not None) == (op._kern is not None)
    got = op.combine(ya, None, da["idx"], routing=handle)
    _check_combine(op, got, a[rank], torch.bfloat16)
    assert got[1] is None
    # replay layer a's layout with a new payload (same routing, new tokens and weights)
    all_new = [dict(a[s], **_new_payload(s, a[s]["n"])) for s in range(world)]
    new, n = _dev(op, all_new[rank]), a[rank]["n"]
    rebuilt = type(handle).from_tensors(handle.tensors(), n)
    assert rebuilt.recv_slot is None  # (kernels: its combine copies into the registered buffer)
    outs_r = op.dispatch(new["x"], new["w"], None, new["idx"], routing=rebuilt)
    assert int(outs_r[4][0]) == ta
    assert torch.equal(op.get_dispatch_src_token_pos(), pos_a), "replay moved rows"
    _check_dispatch(op, outs_r, all_new)
    got = op.combine(outs_r[0][: int(outs_r[4][0])], outs_r[1], new["idx"], routing=rebuilt)
    _check_combine(op, got, all_new[rank], torch.bfloat16)


def _quant_round(op: EpDispatchCombineOp, seed: int, tol: float, *, big: bool = False) -> None:
    """bf16 dispatch -> identity experts -> quantised bf16 combine; ``big``: every other token x100
    (values far above the fp8 maximum of 448, so blockwise must scale their blocks)."""
    rank, world = op.rank, op.world_size
    all_in = [_inputs(seed, s, world, "random", torch.bfloat16, K) for s in range(world)]
    if big:
        for d in all_in:
            d["x"][::2] = d["x"][::2] * 100
    me = _dev(op, all_in[rank])
    outs = op.dispatch(me["x"], me["w"], me["s"], me["idx"])
    if op.config.kernel_type == KT.AsyncLL:
        op.dispatch_recv()
    total = _check_dispatch(op, outs, all_in)
    if op.config.kernel_type == KT.AsyncLL:
        got = op.combine_send(outs[0][:total].clone(), outs[1][:total].clone(), me["idx"])
        op.combine_recv()
    else:
        got = op.combine(outs[0][:total], outs[1], me["idx"])
    _check_combine(op, got, all_in[rank], torch.bfloat16, tol)
    if big and me["n"]:
        assert float(got[0][: me["n"]].float().abs().max()) > 448, "large values were not kept"


def _quant(rank: int, world: int, impl: str = "host", fam: dict[str, Any] | None = None) -> str:
    fam = fam or SINGLE_NODE
    # MORI_FP8_COMBINE_SCALE_DIM=4 (set by the test): blocks of H / 4 = 32 elements
    # fp8_direct_cast: the staging buffer holds fp8 (one byte per element)
    dc = _op(impl, rank, world, fam, quant_type="fp8_direct_cast")
    assert dc.buffers.stage_tok.shape[-1] == H and dc.buffers.stage_sc is None
    for it in range(3):
        _quant_round(dc, 80 + it, 1e-1)
    # fp8_blockwise: fp8 rows plus 4 fp32 scales per row; rows far above 448 survive
    bw = _op(impl, rank, world, fam, quant_type="fp8_blockwise")
    assert bw.buffers.stage_tok.shape[-1] == H
    assert bw.buffers.stage_sc is not None and bw.buffers.stage_sc.shape[-1] == 4
    for it in range(3):
        _quant_round(bw, 85 + it, 7e-2, big=it > 0)
    for kt in fam["quant_also"]:
        for quant in ("fp8_direct_cast", "fp8_blockwise"):
            op = _op(impl, rank, world, fam, kernel_type=kt, quant_type=quant)
            _quant_round(op, 90, 1e-1 if quant == "fp8_direct_cast" else 7e-2, big=quant == "fp8_blockwise")

    # error paths: raised before anything is sent, so every rank raises and the ops stay usable
    me = _dev(dc, _inputs(95, rank, world, "random", torch.bfloat16, K))
    dev = dc.buffers.recv_tok.device
    for op in (dc, bw):
        outs = op.dispatch(me["x"], me["w"], None, me["idx"])
        total = int(outs[4][0])
        for dtype in (torch.float16, torch.float32):
            with pytest.raises(MoriValueError, match=r"input\.dtype=torch\.float(16|32) .*bfloat16"):
                op.combine(outs[0][:total].to(dtype), None, me["idx"])
        buf = op.get_registered_combine_input_buffer(torch.bfloat16)
        buf[:total] = outs[0][:total]
        with pytest.raises(MoriValueError, match=r"use_external_inp_buf=False .*zero-copy"):
            op.combine(buf, None, me["idx"], use_external_inp_buf=False)
        op.combine(buf, None, me["idx"])  # the registered buffer is fine as an external input
    with pytest.raises(MoriValueError, match=r"input\.shape\[1\]=16 .*block of 32"):
        bw.combine(torch.zeros(M * world, 16, device=dev).bfloat16(), None, me["idx"])
    for quant in ("fp8_direct_cast", "fp8_blockwise"):
        with pytest.raises(MoriValueError, match=r"config\.use_external_inp_buf=False .*True"):
            _op(impl, rank, world, fam, quant_type=quant, use_external_inp_buf=False)
    saved = os.environ.get("MORI_FP8_COMBINE_SCALE_DIM")
    try:
        for bad in ("5", "0", "-4", "abc", "256"):
            os.environ["MORI_FP8_COMBINE_SCALE_DIM"] = bad
            with pytest.raises(MoriValueError, match=f"MORI_FP8_COMBINE_SCALE_DIM={bad!r}.*divides"):
                _op(impl, rank, world, fam, quant_type="fp8_blockwise")
        # default 56: H = 128 is not a multiple, H = 112 is (blocks of 2)
        del os.environ["MORI_FP8_COMBINE_SCALE_DIM"]
        with pytest.raises(MoriValueError, match=r"MORI_FP8_COMBINE_SCALE_DIM=56 .*hidden_dim = 128"):
            _op(impl, rank, world, fam, quant_type="fp8_blockwise")
        op = _op(impl, rank, world, fam, quant_type="fp8_blockwise", hidden_dim=112)
        assert op.buffers.stage_sc is not None and op.buffers.stage_sc.shape[-1] == 56
        x = torch.full((2, 112), 1000.0, device=dev).bfloat16()
        idx = torch.full((2, K), rank * E_LOCAL, dtype=torch.int32, device=dev)
        outs = op.dispatch(x, None, None, idx)
        total = int(outs[4][0])
        got = op.combine(outs[0][:total], None, idx)
        torch.testing.assert_close(got[0][:2].float().cpu(), x.float().cpu(), rtol=7e-2, atol=7e-2)
        # the variable is read when an op is built, not at each call
        os.environ["MORI_FP8_COMBINE_SCALE_DIM"] = "5"
        outs = op.dispatch(x, None, None, idx)
        op.combine(outs[0][: int(outs[4][0])], None, idx)
    finally:
        if saved is None:
            os.environ.pop("MORI_FP8_COMBINE_SCALE_DIM", None)
        else:
            os.environ["MORI_FP8_COMBINE_SCALE_DIM"] = saved
    shmem.shmem_barrier_all()
    return "ok"


def _errors(rank: int, world: int) -> str:
    with pytest.raises(MoriValueError, match="world_size"):
        EpDispatchCombineOp(_config(0, world + 1))
    with pytest.raises(MoriValueError, match=r"config\.rank"):
        EpDispatchCombineOp(_config((rank + 1) % world, world))
    for kt in (KT.InterNode, KT.InterNodeV1, KT.InterNodeV1LL):
        # on one node (gpu_per_node 8 >= world) the inter-node types run; their Triton kernels
        # (mori.ep.internode_kernels) have no combine wire quantisation yet
        with pytest.raises(
            MoriBackendError, match=r"quant_type='fp8_direct_cast' on the kernel path: .*quant_type='none'"
        ):
            EpDispatchCombineOp(
                _config(rank, world, kernel_type=kt, quant_type="fp8_direct_cast", use_external_inp_buf=True),
                impl="triton",
            )
    with pytest.raises(MoriValueError, match=r"impl='cuda' .*'auto', 'host', 'triton'"):
        EpDispatchCombineOp(_config(rank, world), impl="cuda")
    op = EpDispatchCombineOp(_config(rank, world))
    x, w, s = torch.randn(3, H).bfloat16(), torch.rand(3, K), torch.randn(3, SCALE_DIM)
    idx = torch.zeros(3, K, dtype=torch.int32)
    with pytest.raises(MoriStateError, match="no dispatch to combine"):
        op.combine(x, None, idx)
    with pytest.raises(MoriStateError, match="no finished dispatch"):
        op.get_dispatch_src_token_pos()
    bad_calls = [
        (
            (torch.randn(M + 1, H).bfloat16(), None, None, torch.zeros(M + 1, K, dtype=torch.int32)),
            "input.shape",
        ),
        ((x, w, s, idx.long()), r"indices.dtype=torch.int64"),
        ((x, w, s, idx[:, :2]), r"indices.shape=\[3, 2\]"),
        ((x, w, s, idx + world * E_LOCAL), "expert ids in"),
        ((x, w, s, idx - 2), "contains -2"),
        ((x, w[:2], s, idx), "weights.shape"),
        ((x, w.double(), s, idx), "weights.dtype"),
        ((x, w, s.double(), idx), "scales.dtype"),
        ((x.int(), w, s, idx), "input.dtype"),
        ((torch.randn(3, H + 1), w, s, idx), r"input.shape\[1\]"),
        ((x[0], w, s, idx), "input.shape"),
    ]
    for args, match in bad_calls:
        with pytest.raises(MoriValueError, match=match):
            op.dispatch(*args)
    with pytest.raises(MoriTypeError, match="input has type list"):
        op.dispatch([1], w, s, idx)
    with pytest.raises(MoriValueError, match="block_num=0"):
        op.dispatch(x, w, s, idx, block_num=0)
    with pytest.raises(MoriValueError, match="warp_per_block=-2"):
        op.dispatch(x, w, s, idx, warp_per_block=-2)
    with pytest.raises(MoriStateError, match="only for kernel_type AsyncLL"):
        op.dispatch_recv()
    with pytest.raises(MoriStateError, match="only for kernel_type AsyncLL"):
        op.combine_recv()
    # a good call still works after the rejected ones (nothing was sent)
    outs = op.dispatch(x, w, s, torch.full((3, K), -1, dtype=torch.int32))
    assert int(outs[4][0]) == 0
    got = op.combine(torch.zeros(0, H).bfloat16(), None, torch.zeros(3, K, dtype=torch.int32))
    assert torch.equal(got[0][:3], torch.zeros(3, H).bfloat16())
    with pytest.raises(MoriValueError, match=r"indices\.shape"):
        op.combine(torch.zeros(0, H).bfloat16(), None, torch.zeros(4, K, dtype=torch.int32))
    with pytest.raises(MoriValueError, match="registered buffer"):
        op.combine(torch.zeros(1, H).bfloat16(), None, idx, use_external_inp_buf=False)
    with pytest.raises(MoriValueError, match="dtype"):
        op.get_registered_combine_input_buffer(torch.int32)
    # too few combine rows: every rank receives rows when all tokens go to every rank
    outs = op.dispatch(x, w, s, torch.full((3, K), rank * E_LOCAL, dtype=torch.int32))
    assert int(outs[4][0]) >= 3
    with pytest.raises(MoriValueError, match="total_recv"):
        op.combine(torch.zeros(2, H).bfloat16(), None, idx)
    op.combine(outs[0][: int(outs[4][0])], None, idx)
    # routing handles are IntraNode-only
    al = EpDispatchCombineOp(_config(rank, world, kernel_type=KT.AsyncLL))
    with pytest.raises(MoriValueError, match="return_routing"):
        al.dispatch(x, w, s, idx, return_routing=True)
    # overflow of a capped receive buffer raises on every rank
    small = EpDispatchCombineOp(_config(rank, world, max_total_recv_tokens=world))
    assert small.max_num_tokens_to_recv() == world
    every_rank = (torch.arange(K, dtype=torch.int32) % world * E_LOCAL).repeat(M, 1)
    with pytest.raises(MoriValueError, match="max_total_recv_tokens"):
        small.dispatch(torch.zeros(M, H).bfloat16(), None, None, every_rank)
    shmem.shmem_barrier_all()
    return "ok"


@pytest.mark.parametrize("world", [2, 4, 8])
def test_dispatch_combine_scenarios(world: int) -> None:
    shmem_ranks(_scenarios, world)


@pytest.mark.parametrize("world", [2, 4])
def test_async_ll_split(world: int) -> None:
    shmem_ranks(_async_ll, world)


@pytest.mark.parametrize("world", [2, 4])
def test_routing_handle_replay(world: int) -> None:
    shmem_ranks(_replay, world)


@pytest.mark.parametrize("world", [2, 4])
def test_combine_fp8_wire_quantisation(world: int) -> None:
    assert shmem_ranks(_quant, world, env={"MORI_FP8_COMBINE_SCALE_DIM": "4"}) == ["ok"] * world


def _fnuz(rank: int, world: int, impl: str = "host", fam: dict[str, Any] | None = None) -> None:
    # AMD's fp8 (float8_e4m3fnuz): rows and scales travel as bytes, checked bit-exact
    op = _op(impl, rank, world, fam)
    for it in range(2):
        _round(op, 90 + it, "random", torch.float8_e4m3fnuz, torch.bfloat16)


@pytest.mark.parametrize("impl", ["host", "triton"])
def test_fp8_e4m3fnuz_dispatch(impl: str) -> None:
    shmem_ranks(_fnuz, 2, impl, env=INTERPRET if impl == "triton" else None, timeout=300)


def test_error_paths() -> None:
    assert shmem_ranks(_errors, 2) == ["ok", "ok"]


def test_op_needs_shmem() -> None:
    with pytest.raises(MoriStateError, match="not initialised"):
        EpDispatchCombineOp(_config(0, 1))
    with pytest.raises(MoriTypeError, match="config"):
        EpDispatchCombineOp("cfg")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("num_experts_per_token", 10, r"num_experts_per_token=10 .*\[1, 9\]"),
        ("num_experts_per_token", 0, "num_experts_per_token=0"),
        ("rank", 2, r"rank=2 .*\[0, 2\)"),
        ("world_size", 0, "world_size=0"),
        ("hidden_dim", -1, "hidden_dim=-1"),
        ("max_num_inp_token_per_rank", 0, "max_num_inp_token_per_rank=0"),
        ("kernel_type", 7, "kernel_type=7 .*IntraNode"),
        ("quant_type", "fp8", "quant_type='fp8'"),
        ("use_external_inp_buf", 1, "use_external_inp_buf=1"),
        ("max_total_recv_tokens", -1, "max_total_recv_tokens=-1"),
        ("block_num", True, "block_num=True"),
    ],
)
def test_config_rejects(field: str, value: Any, match: str) -> None:
    base: dict[str, Any] = {"rank": 0, "world": 2}
    if field in ("rank", "world_size"):
        base["rank" if field == "rank" else "world"] = value
        field, value = "quant_type", "none"
    with pytest.raises(MoriValueError, match=match):
        _config(base["rank"], base["world"], **{field: value})


def test_config_defaults_and_sizes() -> None:
    c = EpDispatchCombineConfig(torch.bfloat16, 1, 8, 7168, 0, 0, 2, 128, 32, 8)
    assert (c.warp_num_per_block, c.block_num, c.max_total_recv_tokens) == (8, 80, 0)
    assert (c.use_external_inp_buf, c.kernel_type, c.gpu_per_node) == (True, KT.IntraNode, 8)
    assert (c.rdma_block_num, c.num_qp_per_pe, c.quant_type) == (0, 1, "none")
    assert c.max_num_tokens_to_recv() == 8 * 128 and c.max_num_tokens_to_send() == 8 * 128
    # (M, cap) pairs of the original's tests
    for m, cap, per_rank in [(32, 0, 32), (32, 256, 32), (1, 128, 1), (16, 128, 16), (32, 100, 13)]:
        c = EpDispatchCombineConfig(None, 0, 8, 64, 0, 0, 2, m, 4, 2, max_total_recv_tokens=cap)
        assert c.max_num_tokens_to_recv() == 8 * per_rank
    assert (
        EpDispatchCombineConfig(None, 0, 2, 64, 0, 0, 2, 8, 4, 2, kernel_type=5).kernel_type is KT.IntraNodeLL
    )
    assert [int(k) for k in KT] == [0, 1, 2, 3, 4, 5]


def test_mori_ops_alias() -> None:
    import mori
    import mori.ep
    import mori.ops

    assert mori.ops.EpDispatchCombineOp is EpDispatchCombineOp
    assert set(mori.ops.__all__) == set(mori.ep.__all__)


# -- the Triton kernels, run by the interpreter on the cpu runtime (the same scenarios) ------------

INTERPRET = {"TRITON_INTERPRET": "1"}


@pytest.mark.parametrize("world", [2, 4])
def test_kernels_scenarios(world: int) -> None:
    # (the interpreter runs every program of every launch in Python: fewer rounds, more time)
    shmem_ranks(_scenarios, world, "triton", 4, env=INTERPRET, timeout=300)


def test_kernels_combine_fp8_wire_quantisation() -> None:
    env = {**INTERPRET, "MORI_FP8_COMBINE_SCALE_DIM": "4"}
    assert shmem_ranks(_quant, 2, "triton", env=env, timeout=300) == ["ok", "ok"]


def test_kernels_async_ll_split() -> None:
    shmem_ranks(_async_ll, 2, "triton", env=INTERPRET, timeout=300)


def test_kernels_routing_handle_replay() -> None:
    shmem_ranks(_replay, 2, "triton", env=INTERPRET, timeout=300)


# -- on GPUs (this machine's runtime, any vendor): 2 ranks on 2 GPUs, 4 and 8 ranks sharing them --


def _gpu_rank_device(rank: int, nranks: int) -> None:
    torch.cuda.set_device(rank % int(os.environ["MORI_TEST_GPUS"]))


def _gpu_env(gpus: int) -> dict[str, str]:
    """The ranks' environment on ``gpus`` GPUs of this machine (skips with fewer, or none)."""
    runtime = machine_gpu_runtime()  # skips without a GPU, fails without a plugin serving it
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs, torch sees {torch.cuda.device_count()}")
    return {"MORI_DEVICE_RUNTIME": runtime, "MORI_SHMEM_HEAP_SIZE": "512M", "MORI_TEST_GPUS": str(gpus)}


def _on_gpus(fn: Any, nranks: int, gpus: int) -> None:
    shmem_ranks(fn, nranks, "auto", env=_gpu_env(gpus), timeout=300, before_init=_gpu_rank_device)


GPU_CONFIGS = [
    pytest.param(2, 2, id="2gpus-2ranks"),
    pytest.param(4, 2, id="2gpus-4ranks"),
    pytest.param(8, 2, id="2gpus-8ranks"),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("nranks", "gpus"), GPU_CONFIGS)
def test_gpu_scenarios(nranks: int, gpus: int) -> None:
    _on_gpus(_scenarios, nranks, gpus)


@pytest.mark.gpu
def test_gpu_scenarios_push_combine_small_chunks() -> None:
    # the suite's M = 16 tokens gives chunks under 2 tokens on a GPU: the ordinary combine gathers;
    # MORI_EP_PUSH_CHUNK forces the push (the interpreter tests push by default)
    env = _gpu_env(2)
    env["MORI_EP_PUSH_CHUNK"] = "2"
    shmem_ranks(_scenarios, 2, "auto", env=env, timeout=300, before_init=_gpu_rank_device)


@pytest.mark.gpu
def test_gpu_combine_fp8_wire_quantisation() -> None:
    env = _gpu_env(2)
    env["MORI_FP8_COMBINE_SCALE_DIM"] = "4"
    assert shmem_ranks(_quant, 2, "auto", env=env, timeout=300, before_init=_gpu_rank_device) == ["ok", "ok"]


@pytest.mark.gpu
@pytest.mark.parametrize(("nranks", "gpus"), GPU_CONFIGS[:2])
def test_gpu_async_ll_and_replay(nranks: int, gpus: int) -> None:
    _on_gpus(_async_ll, nranks, gpus)
    _on_gpus(_replay, nranks, gpus)

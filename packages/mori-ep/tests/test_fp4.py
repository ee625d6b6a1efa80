"""fp4: float4_e2m1fn_x2 dispatch (bytes, bit-exact) and the fp4_blockwise combine wire.

The software e2m1 rounding (mori.ep.fp4, and the kernels' copy of it) is checked against a brute
force nearest-value search with ties to the even code, on every midpoint and on random values;
then round trips on 2 CPU ranks, on the host path and on the Triton kernels (interpreter).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mori.shmem as shmem
from mori.core.errors import MoriValueError
from mori.ep import EpDispatchCombineConfig, EpDispatchCombineOp, fp4
from mori.ep.reference import dest_ranks
from mori.testing import shmem_ranks

GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _brute_force(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 magnitude (ties: the even code), saturating, with the sign of x."""
    a = x.abs().clamp(max=6.0)
    d = (a[:, None] - GRID[None, :]).abs()
    best = d.min(dim=1, keepdim=True).values
    tied = d == best
    codes = torch.arange(8).expand_as(d)
    # among the nearest codes, the even one (at most two are nearest, adjacent: one is even)
    pick = torch.where(tied & (codes % 2 == 0), codes, 99).min(dim=1).values
    pick = torch.where(pick == 99, torch.where(tied, codes, 99).min(dim=1).values, pick)
    return torch.where(x < 0, -GRID[pick], GRID[pick])


def test_e2m1_rounding_exact() -> None:
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = torch.cat(
        [
            GRID,
            -GRID,
            mids,
            -mids,
            mids + 1e-6,
            mids - 1e-6,
            torch.tensor([7.0, -100.0, 1e-9]),
            torch.randn(5000) * 3,
        ]
    )
    got = fp4.decode(fp4.encode(x))
    assert torch.equal(got, _brute_force(x)), "e2m1 rounding is not nearest-even"
    codes = fp4.encode(torch.randn(64) * 4)
    assert torch.equal(fp4.unpack(fp4.pack(codes)), codes)
    # torch's float4_e2m1fn_x2 byte layout: two codes a byte, the first in the low nibble
    packed = fp4.pack(codes.view(1, -1))
    assert packed.view(torch.float4_e2m1fn_x2).shape == (1, 32)
    assert int(packed[0, 0]) == int(codes[0]) | int(codes[1]) << 4


def test_blockwise_error_bound() -> None:
    x = torch.randn(8, 256) * torch.logspace(-3, 3, 8)[:, None]
    q, s = fp4.quantise(x)
    assert q.shape == (8, 128) and q.dtype == torch.uint8 and s.shape == (8, 8)
    back = fp4.dequantise(q, s)
    blockmax = x.abs().view(8, 8, 32).amax(2)
    # e2m1's widest gap is 4..6, so a value is off by at most half of it: 1 * scale = blockmax / 6
    bound = (blockmax / 6).repeat_interleave(32, dim=1) * (1 + 1e-6)
    assert bool(((back - x).abs() <= bound).all())
    # a block's max maps to 6 exactly: it comes back up to the scale's own fp32 rounding
    torch.testing.assert_close(back.view(8, 8, 32).abs().amax(2), blockmax, rtol=1e-6, atol=0)


M, H, E_LOCAL, K = 8, 64, 2, 2


def _op(rank: int, world: int, impl: str, **kw: Any) -> EpDispatchCombineOp:
    args: dict[str, Any] = dict(
        data_type=torch.bfloat16,
        rank=rank,
        world_size=world,
        hidden_dim=H,
        scale_dim=0,
        scale_type_size=0,
        max_token_type_size=2,
        max_num_inp_token_per_rank=M,
        num_experts_per_rank=E_LOCAL,
        num_experts_per_token=K,
        block_num=2,
    )
    args.update(kw)
    return EpDispatchCombineOp(EpDispatchCombineConfig(**args), impl=impl)


def _inputs(seed: int, src: int, world: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 10 + src)
    e = world * E_LOCAL
    idx = torch.stack([torch.randperm(e, generator=gen)[:K] for _ in range(M)]).to(torch.int32)
    scale = torch.logspace(-2, 3, M)[:, None]  # rows from tiny to far above e2m1's range
    return {
        "idx": idx,
        "x": (torch.randn(M, H, generator=gen) * scale).bfloat16(),
        "fp4": torch.randint(0, 256, (M, H // 2), dtype=torch.uint8, generator=gen).view(
            torch.float4_e2m1fn_x2
        ),
    }


def _round_trip(rank: int, world: int, impl: str) -> str:
    torch.set_num_threads(1)
    all_in = [_inputs(1, s, world) for s in range(world)]
    me = all_in[rank]
    # float4_e2m1fn_x2 dispatch: bytes travel unchanged (hidden counts bytes: H / 2 for H values)
    op = _op(rank, world, impl)
    outs = op.dispatch(me["fp4"], None, None, me["idx"])
    total = int(outs[4][0])
    assert outs[0].dtype == torch.float4_e2m1fn_x2 and outs[0].shape[1] == H // 2
    pos = op.get_dispatch_src_token_pos().long()
    span = world * M
    for i in range(total):
        s, t = int(pos[i]) // span, int(pos[i]) % span
        assert torch.equal(outs[0][i].view(torch.uint8), all_in[s]["fp4"][t].view(torch.uint8))

    # fp4_blockwise combine of bf16 identity experts
    q = _op(rank, world, impl, quant_type="fp4_blockwise")
    assert (
        q.buffers.stage_tok.shape[-1] == H // 2
        and q.buffers.stage_sc is not None
        and q.buffers.stage_sc.shape[-1] == H // 32
    )
    for seed in (2, 3):
        all_in = [_inputs(seed, s, world) for s in range(world)]
        me = all_in[rank]
        outs = q.dispatch(me["x"], None, None, me["idx"])
        total = int(outs[4][0])
        got = q.combine(outs[0][:total], None, me["idx"])[0][:M].float()
        x = me["x"].float()
        u = dest_ranks(me["idx"], E_LOCAL, world).sum(1, dtype=torch.float32)[:, None]
        blockmax = x.abs().view(M, H // 32, 32).amax(2).repeat_interleave(32, dim=1)
        # each of the U copies is off by at most blockmax / 6 (half e2m1's widest gap, times the
        # block's scale); the sum is then rounded once to bf16 (2^-8 relative: 1e-2 covers it)
        bound = u * blockmax / 6 + 1e-2 * (x * u).abs() + 1e-6
        err = (got - x * u).abs()
        assert bool((err <= bound).all()), f"fp4 combine error {float((err - bound).max())} over the bound"
        assert float(got.abs().max()) > 100, "large values were kept (the block scales)"
    with pytest.raises(MoriValueError, match=r"input\.dtype=torch\.float16 .*bfloat16"):
        q.combine(outs[0][:total].half(), None, me["idx"])
    with pytest.raises(MoriValueError, match=r"hidden_dim=48 .*multiple of 32"):
        _op(rank, world, impl, quant_type="fp4_blockwise", hidden_dim=48)
    shmem.shmem_barrier_all()
    return "ok"


def test_fp4_round_trip_host() -> None:
    assert shmem_ranks(_round_trip, 2, "host") == ["ok", "ok"]


def test_fp4_round_trip_kernels() -> None:
    pytest.importorskip("triton")
    assert shmem_ranks(_round_trip, 2, "triton", env={"TRITON_INTERPRET": "1"}, timeout=240) == ["ok", "ok"]

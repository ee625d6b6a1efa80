"""Ranks that disagree fail loudly, by name, on every rank (mori.ep.agreement).

Each attack of issue 16, reproduced on 2 CPU ranks: configs that differ in a field that shapes
the wire (num_experts_per_rank; hidden_dim x element size equal in bytes but not in shape; a
hidden size the symmetric allocation would have reported without naming it), and calls that
differ in what can change per call (fp32 input on one rank, bf16 on the other; hidden size;
combine dtype). Every rank must raise the same error naming the field and the ranks; after a
rejected call the operator still works.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mori.shmem as shmem
from mori.core.errors import MoriValueError
from mori.ep import EpDispatchCombineConfig, EpDispatchCombineOp
from mori.testing import shmem_ranks

H, M, E_LOCAL, K = 128, 8, 4, 2


def _config(rank: int, world: int, **kw: Any) -> EpDispatchCombineConfig:
    args: dict[str, Any] = dict(
        data_type=torch.bfloat16,
        rank=rank,
        world_size=world,
        hidden_dim=H,
        scale_dim=0,
        scale_type_size=0,
        max_token_type_size=4,
        max_num_inp_token_per_rank=M,
        num_experts_per_rank=E_LOCAL,
        num_experts_per_token=K,
    )
    args.update(kw)
    return EpDispatchCombineConfig(**args)


def _build_error(rank: int, world: int, impl: str, base: dict[str, Any], **kw: Any) -> str:
    with pytest.raises(MoriValueError) as info:
        EpDispatchCombineOp(_config(rank, world, **{**base, **kw}), impl=impl)
    return str(info.value)


def _call_inputs(rank: int, world: int, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    # every token goes to expert 0 of ranks 0 .. K - 1
    idx = (torch.arange(K, dtype=torch.int32) % world * E_LOCAL).repeat(n, 1)
    return torch.full((n, H), 4.0), idx


def _good_round(op: EpDispatchCombineOp, rank: int, world: int) -> None:
    x, idx = _call_inputs(rank, world)
    dev = op.buffers.recv_tok.device
    outs = op.dispatch(x.bfloat16().to(dev), None, None, idx.to(dev))
    total = int(outs[4][0])
    assert total == (4 * world if rank < K else 0), total  # (experts on ranks 0 .. K - 1 only)
    assert bool((outs[0][:total].float() == 4.0).all()), "the rows of a good call after a rejected one"
    got = op.combine(outs[0][:total], None, idx.to(dev))[0]
    assert torch.equal(got[:4].float().cpu(), torch.full((4, H), 4.0 * min(world, K)))


def _attacks(rank: int, world: int, impl: str, base: dict[str, Any] | None = None) -> list[str]:
    """``base``: config fields every op gets (test_internode.py: an inter-node kernel type)."""
    base = base or {}
    errors = []
    # 1. num_experts_per_rank 4 on rank 0, 2 on the others (today: tokens for expert 3 kept locally)
    errors.append(_build_error(rank, world, impl, base, num_experts_per_rank=4 if rank == 0 else 2))
    # 2. hidden x element size equal in bytes, not in shape (64 fp32 vs 128 bf16 elements per row)
    errors.append(
        _build_error(
            rank,
            world,
            impl,
            base,
            hidden_dim=64 if rank == 0 else 128,
            max_token_type_size=4 if rank == 0 else 2,
        )
    )
    # 3. a hidden size the symmetric allocation would have caught without naming it
    errors.append(_build_error(rank, world, impl, base, hidden_dim=H if rank == 0 else 2 * H))

    # per call: the same config, fp32 input on rank 0 and bf16 elsewhere (today: 4.0078 for 4.0)
    op = EpDispatchCombineOp(_config(rank, world, **base), impl=impl)
    dev = op.buffers.recv_tok.device
    x, idx = _call_inputs(rank, world)
    x, idx = x.to(dev), idx.to(dev)
    with pytest.raises(MoriValueError) as info:
        op.dispatch(x if rank == 0 else x.bfloat16(), None, None, idx)
    errors.append(str(info.value))
    _good_round(op, rank, world)
    # equal bytes per row, different shape: 64 fp32 on rank 0, 128 bf16 elsewhere
    with pytest.raises(MoriValueError) as info:
        op.dispatch(x[:, :64] if rank == 0 else x.bfloat16(), None, None, idx)
    errors.append(str(info.value))
    _good_round(op, rank, world)
    # weights on one rank only
    w = torch.rand(4, K, device=dev)
    with pytest.raises(MoriValueError) as info:
        op.dispatch(x.bfloat16(), w if rank == 0 else None, None, idx)
    errors.append(str(info.value))
    if impl == "triton":  # (the combine kernels do not compare their calls yet)
        _good_round(op, rank, world)
        shmem.shmem_barrier_all()
        return errors
    # combine: fp32 expert outputs on rank 0, bf16 elsewhere
    outs = op.dispatch(x.bfloat16(), None, None, idx)
    total = int(outs[4][0])
    y = outs[0][:total]
    with pytest.raises(MoriValueError) as info:
        op.combine(y.float() if rank == 0 else y, None, idx)
    errors.append(str(info.value))
    got = op.combine(y, None, idx)[0]  # the operator still works
    assert torch.equal(got[:4].float().cpu(), torch.full((4, H), 4.0 * min(world, K)))
    _good_round(op, rank, world)
    shmem.shmem_barrier_all()
    return errors


def _check(results: list[list[str]], world: int) -> None:
    # every rank raised the same errors, naming the field and which ranks have which value
    others = "1" if world == 2 else f"1-{world - 1}" if world > 3 else "1, 2"
    for errs in results[1:]:
        assert [e.split("(seen by rank")[0] for e in errs] == [
            e.split("(seen by rank")[0] for e in results[0]
        ]
    e = results[0]
    assert f"num_experts_per_rank: 4 on rank 0; 2 on rank{'s' if world > 2 else ''} {others}" in e[0], e[0]
    assert "hidden_dim: 64 on rank 0" in e[1] and "max_token_type_size: 4 on rank 0" in e[1], e[1]
    assert "hidden_dim: 128 on rank 0; 256 on rank" in e[2], e[2]
    assert "input.dtype: float32 on rank 0; bfloat16 on rank" in e[3], e[3]
    assert "input.dtype: float32 on rank 0" in e[4] and "hidden size): 64 on rank 0; 128 on" in e[4], e[4]
    assert "weights: given on rank 0; None on rank" in e[5], e[5]
    if len(e) > 6:
        assert "combine call" in e[6] and "input.dtype: float32 on rank 0; bfloat16 on rank" in e[6], e[6]


@pytest.mark.parametrize("world", [2, 3])
def test_disagreeing_ranks_fail_by_name_host(world: int) -> None:
    res = shmem_ranks(_attacks, world, "host")
    assert len(res[0]) == 7
    _check(res, world)


def test_disagreeing_ranks_fail_by_name_kernels() -> None:
    pytest.importorskip("triton")
    res = shmem_ranks(_attacks, 2, "triton", env={"TRITON_INTERPRET": "1"}, timeout=240)
    assert len(res[0]) == 6
    _check(res, 2)

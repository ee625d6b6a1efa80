"""mori.ep.buffers.EpBuffers: the operator's sizes and symmetric tensors, in allocation order."""

from __future__ import annotations

from typing import Any

import torch

import mori.shmem as shmem
from mori.ep import EpDispatchCombineConfig, EpDispatchCombineOp
from mori.ep.buffers import EpBuffers
from mori.testing import shmem_ranks

M, H, E_LOCAL, K, SCALE_DIM = 8, 64, 2, 2, 4


def _config(rank: int, world: int, **kw: Any) -> EpDispatchCombineConfig:
    args: dict[str, Any] = dict(
        data_type=torch.bfloat16,
        rank=rank,
        world_size=world,
        hidden_dim=H,
        scale_dim=SCALE_DIM,
        scale_type_size=4,
        max_token_type_size=2,
        max_num_inp_token_per_rank=M,
        num_experts_per_rank=E_LOCAL,
        num_experts_per_token=K,
    )
    args.update(kw)
    return EpDispatchCombineConfig(**args)


def _check(rank: int, world: int) -> str:
    op = EpDispatchCombineOp(_config(rank, world), impl="host")
    b = op.buffers
    r = op.max_num_tokens_to_recv()
    assert (b.world_size, b.m, b.k, b.e_local, b.r) == (world, M, K, E_LOCAL, r)
    assert (b.row_bytes, b.scale_bytes, b.stage_bytes) == (2 * H, 4 * SCALE_DIM, 2 * H)
    assert (b.quant_scale_dim, b.quant_block, b.stage_sc) == (0, 0, None)
    named = [b.recv_tok, b.recv_w, b.recv_scales, b.recv_idx, b.recv_src, b.comb_inp, b.stage_tok]
    named += [b.stage_w, b.ctrl]
    assert [t.data_ptr() for t in b.tensors] == [t.data_ptr() for t in named]
    shapes = [(r, 2 * H), (r, K), (r, 4 * SCALE_DIM), (r, K), (r,), (r, 2 * H), (world, M, 2 * H)]
    shapes += [(world, M, K), (4 * world + 2,)]
    assert [tuple(t.shape) for t in b.tensors] == shapes
    u8, i32, f32 = torch.uint8, torch.int32, torch.float32
    assert [t.dtype for t in b.tensors] == [u8, f32, u8, i32, i32, u8, u8, f32, torch.int64]
    assert all(not t.any() for t in b.tensors)  # zeroed by the operator

    # blockwise quantisation adds the staged block scales
    q = EpDispatchCombineOp(
        _config(rank, world, quant_type="fp4_blockwise", use_external_inp_buf=True), impl="host"
    )
    assert q.buffers.stage_sc is not None and q.buffers.tensors[-1] is q.buffers.stage_sc
    assert tuple(q.buffers.stage_sc.shape) == (world, M, H // 32) and q.buffers.stage_bytes == H // 2

    # standalone: add, zero and free (collective; freed in reverse order, so the heap space is reused)
    extra = EpBuffers(_config(rank, world))
    first = extra.recv_tok.data_ptr()
    added = shmem.mori_shmem_create_tensor((3,), torch.int64)
    assert extra.add(added) is added and extra.tensors[-1] is added
    for t in extra.tensors:
        t.fill_(1)
    extra.zero()
    assert all(not t.any() for t in extra.tensors)
    extra.free()
    assert extra.tensors == []
    again = EpBuffers(_config(rank, world))
    assert again.recv_tok.data_ptr() == first
    again.free()
    shmem.shmem_barrier_all()
    return "ok"


def test_buffers() -> None:
    assert shmem_ranks(_check, 2) == ["ok", "ok"]

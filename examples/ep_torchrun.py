"""EP under torchrun: one MoE layer's dispatch and combine across the ranks, checked.

CPU (the host path)::

    torchrun --nproc-per-node 2 examples/ep_torchrun.py

NVIDIA GPUs (the Triton kernels; needs mori-backend-nvlink; AMD: mori-backend-xgmi and
``MORI_DEVICE_RUNTIME=hip``)::

    MORI_DEVICE_RUNTIME=cuda torchrun --nproc-per-node 2 examples/ep_torchrun.py

Each rank routes its tokens to top-k experts spread over all ranks; the "experts" return their
rows unchanged, so combine (an unweighted sum over the distinct ranks a token went to) must give
back each token times that number of ranks.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import mori.shmem as shmem
from mori.ep import EpDispatchCombineConfig, EpDispatchCombineOp

HIDDEN, TOKENS, EXPERTS_PER_RANK, TOPK = 256, 64, 4, 2


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    runtime = os.environ.get("MORI_DEVICE_RUNTIME", "cpu")
    device = torch.device("cpu")
    if runtime in ("cuda", "hip"):  # one GPU per rank; ranks may share one (use MPS on NVIDIA)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    os.environ.setdefault("MORI_DEVICE_RUNTIME", runtime)
    os.environ.setdefault("MORI_SHMEM_HEAP_SIZE", "256M")  # per rank; the default is 4 GiB
    dist.init_process_group("gloo")
    shmem.shmem_torch_process_group_init("default")

    cfg = EpDispatchCombineConfig(
        data_type=torch.bfloat16,
        rank=rank,
        world_size=world,
        hidden_dim=HIDDEN,
        scale_dim=0,
        scale_type_size=0,
        max_token_type_size=2,  # bytes of the widest token dtype (bf16)
        max_num_inp_token_per_rank=TOKENS,
        num_experts_per_rank=EXPERTS_PER_RANK,
        num_experts_per_token=TOPK,
    )
    op = EpDispatchCombineOp(cfg)  # collective: every rank, same config

    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).bfloat16().to(device)  # [tokens, hidden] bf16
    n_experts = world * EXPERTS_PER_RANK
    topk_ids = torch.stack([torch.randperm(n_experts, generator=gen)[:TOPK] for _ in range(TOKENS)])
    topk_ids = topk_ids.to(torch.int32).to(device)  # [tokens, topk]; expert e lives on rank e // 4
    weights = torch.rand(TOKENS, TOPK, generator=gen).to(device)  # [tokens, topk] fp32

    out, _out_w, _out_s, _out_idx, total = op.dispatch(x, weights, None, topk_ids)
    received = int(total[0])
    y = out[:received]  # the experts: rows back unchanged
    combined, _ = op.combine(y, None, topk_ids)

    ranks_hit = torch.stack([(topk_ids // EXPERTS_PER_RANK == r).any(dim=1) for r in range(world)], 1)
    want = x.float() * ranks_hit.sum(dim=1, keepdim=True).float()
    err = (combined[:TOKENS].float() - want).abs().max().item()
    if err > 0.05 * want.abs().max().item():
        raise SystemExit(f"rank {rank}: combine differs from the reference by {err}")
    print(f"rank {rank}/{world} ({device}): sent {TOKENS} tokens, received {received} rows, combine checked")

    del op
    shmem.shmem_finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

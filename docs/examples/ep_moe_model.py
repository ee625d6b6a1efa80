#!/usr/bin/env python3
"""A Hugging Face ``transformers`` Mixtral model with its experts sharded over EP ranks by mori.ep.

Every rank builds the same small random-weight Mixtral (a config made here: nothing is
downloaded), keeps only its share of each layer's experts (``num_local_experts / world``) and
replaces each MoE block's ``experts`` module: the block's router still picks the top-k experts of
every token; the replacement sends each token to the ranks of its experts, runs the local ones on
what it received, weighted by the router's weights, and sums the results back on the token's rank.
Attention and everything else stay replicated; each rank runs its own batch (data parallel over
tokens, expert parallel over experts), the way MoE inference engines run EP.

Two ways to do the communication, both shown:

* ``--api mori``: MORI's own API, :class:`mori.ep.EpDispatchCombineOp` (``dispatch`` ->
  received rows with their full top-k ids and weights; ``combine`` -> the unweighted sum);
* ``--api deepep``: the DeepEP-compatible layer, :class:`mori.ep.deepep.Buffer` in normal mode
  (``get_dispatch_layout``, ``dispatch``, ``combine``), as engines written for DeepEP call it.

Run (CPU ranks; ``MORI_DEVICE_RUNTIME=cuda`` and one GPU per rank on GPUs)::

    python docs/examples/ep_moe_model.py --ranks 4 --api deepep

It prints, per rank and case (:data:`CASES`), the largest difference between the logits of the
sharded model and those of the same model run whole in one process. Needs ``pip install transformers`` (5.x: experts stored
as fused 3-D tensors).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn

#: the tiny model: 2 layers, 8 experts of which each token uses 2, hidden 64
CONFIG = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    initializer_range=0.1,  # (larger than the default 0.02: the experts weigh on the logits)
)
SEQ, BATCH = 8, 2


#: the cases run: (dtype, decoder layers). In bf16 the sharded model sums each token's expert
#: outputs in fp32 and rounds once where the whole model rounds after each expert: a 1-ulp
#: difference, which in a second layer may flip a near-tie of its router (a different expert, a
#: different logit, correctly computed), so bf16 runs one layer; fp32 runs two.
CASES = ((torch.bfloat16, 1), (torch.float32, 2))


def build_model(seed: int = 0, dtype: torch.dtype = torch.bfloat16, layers: int = 2) -> Any:
    """The same random-weight Mixtral on every rank (seeded), in ``dtype``, in eval mode."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    return MixtralForCausalLM(MixtralConfig(**{**CONFIG, "num_hidden_layers": layers})).to(dtype).eval()


def batch(rank: int) -> torch.Tensor:
    """Rank ``rank``'s token ids [BATCH, SEQ]."""
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=gen)


class LocalExperts(nn.Module):
    """This rank's slice of one layer's experts (``transformers``' fused ``MixtralExperts``)."""

    def __init__(self, experts: nn.Module, rank: int, world: int) -> None:
        super().__init__()
        e_local = experts.num_experts // world
        lo = rank * e_local
        self.e_local = e_local
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj[lo : lo + e_local].detach().clone())
        self.down_proj = nn.Parameter(experts.down_proj[lo : lo + e_local].detach().clone())
        self.act_fn = experts.act_fn

    def run(self, x: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """For received rows ``x`` [R, H] with local expert ids [R, K] (-1: another rank's expert)
        and router weights [R, K]: the weighted sum of this rank's experts per row, fp32 [R, H]."""
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for e in range(self.e_local):
            rows, ks = torch.where(local_ids == e)
            if rows.numel() == 0:
                continue
            gate, up = nn.functional.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e])
            out.index_add_(0, rows, y.float() * weights[rows, ks, None].float())
        return out


class MoriExperts(nn.Module):
    """``experts`` replacement on MORI's API: dispatch, local experts, combine."""

    def __init__(self, experts: nn.Module, op: Any, rank: int, world: int) -> None:
        super().__init__()
        self.local = LocalExperts(experts, rank, world)
        self.op, self.rank = op, rank

    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        idx = top_k_index.to(torch.int32)
        out, out_w, _, out_idx, total_t = self.op.dispatch(hidden, top_k_weights.float(), None, idx)
        total = int(total_t[0])
        # the received rows carry every one of their top-k ids: keep this rank's, as local ids
        glob = out_idx[:total].to(torch.int64)
        local = glob - self.rank * self.local.e_local
        local = torch.where((glob >= 0) & (local >= 0) & (local < self.local.e_local), local, -1)
        y = self.local.run(out[:total], local, out_w[:total])
        combined, _ = self.op.combine(y.to(hidden.dtype), None, idx)  # the sum over the ranks
        return combined[: hidden.shape[0]]


class DeepEPExperts(nn.Module):
    """``experts`` replacement on the DeepEP layer (normal mode), as a DeepEP engine calls it."""

    def __init__(self, experts: nn.Module, buffer: Any, rank: int, world: int) -> None:
        super().__init__()
        self.local = LocalExperts(experts, rank, world)
        self.buffer, self.num_experts = buffer, experts.num_experts

    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        per_rank, _, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(top_k_index, self.num_experts)
        recv_x, recv_idx, recv_w, _, handle, _ = self.buffer.dispatch(
            hidden,
            num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=top_k_index,
            topk_weights=top_k_weights.float(),
        )
        y = self.local.run(recv_x, recv_idx, recv_w)  # recv_idx: local ids, -1 elsewhere
        combined, _, _ = self.buffer.combine(y.to(hidden.dtype), handle)
        return combined


def shard(model: Any, api: str, rank: int, world: int) -> Any:
    """Replace every MoE block's experts by this rank's share, communicating through ``api``.
    ``mori.shmem`` must be initialised over the ``world`` ranks (collective)."""
    import mori.ep
    from mori.ep.deepep import Buffer

    cfg = model.config
    if cfg.num_local_experts % world:
        raise ValueError(f"num_local_experts={cfg.num_local_experts} does not split over {world} ranks")
    comm: Any
    if api == "mori":
        comm = mori.ep.EpDispatchCombineOp(
            mori.ep.EpDispatchCombineConfig(
                data_type=torch.bfloat16,
                rank=rank,
                world_size=world,
                hidden_dim=cfg.hidden_size,
                scale_dim=0,
                scale_type_size=0,
                max_token_type_size=4,  # (fp32 or bf16 tokens)
                max_num_inp_token_per_rank=BATCH * SEQ,
                num_experts_per_rank=cfg.num_local_experts // world,
                num_experts_per_token=cfg.num_experts_per_tok,
            )
        )
    else:
        comm = Buffer(None)
    for layer in model.model.layers:
        moe = layer.mlp
        make = MoriExperts if api == "mori" else DeepEPExperts
        moe.experts = make(moe.experts, comm, rank, world)
    return model


def rank_main(rank: int, world: int, apis: tuple[str, ...]) -> list[dict[str, list[Any]]]:
    """On one rank, for each of :data:`CASES`: the whole model's logits for this rank's batch (key
    ``"whole"``), those of the model without its MoE output (``"no_moe"``: how much the experts
    matter) and those of the sharded model through each of ``apis`` (as lists: tensors do not
    outlive the rank's process)."""
    import mori.shmem as shmem

    torch.set_num_threads(1)
    results = []
    with torch.no_grad():
        for dtype, layers in CASES:
            out = {"whole": build_model(dtype=dtype, layers=layers)(batch(rank)).logits.float().tolist()}
            no_moe = build_model(dtype=dtype, layers=layers)
            for layer in no_moe.model.layers:
                layer.mlp.experts.down_proj.zero_()
            out["no_moe"] = no_moe(batch(rank)).logits.float().tolist()
            for api in apis:
                model = shard(build_model(dtype=dtype, layers=layers), api, rank, world)
                out[api] = model(batch(rank)).logits.float().tolist()
            results.append(out)
    shmem.shmem_barrier_all()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--api", choices=("mori", "deepep"), default="deepep")
    args = p.parse_args()
    from mori.core.launch import shmem_ranks

    results = shmem_ranks(rank_main, args.ranks, (args.api,), env={"MORI_DEVICE_RUNTIME": "cpu"})
    for rank, per_case in enumerate(results):
        for (dtype, layers), r in zip(CASES, per_case, strict=True):
            sharded, whole = torch.tensor(r[args.api]), torch.tensor(r["whole"])
            diff = (sharded - whole).abs().max().item()
            print(
                f"rank {rank}, {str(dtype).removeprefix('torch.')}, {layers} layer(s): max |sharded - whole| "
                f"= {diff:.3g}, max |logit| = {whole.abs().max().item():.3g}"
            )


if __name__ == "__main__":
    main()

"""A real MoE model: Hugging Face transformers' Mixtral, experts sharded over 4 CPU ranks by mori.ep.

``docs/examples/ep_moe_model.py`` builds a tiny random-weight Mixtral (no download) on every
rank, keeps each rank's 2 of the 8 experts of each layer and routes the tokens through the MORI
API and through the DeepEP layer; the logits of each rank's batch must match the same model run
whole in one process.

Tolerances. bf16, one decoder layer: the logits are bf16 values. The sharded model computes the
same expert matmuls on the same bf16 inputs; only the sum of each token's top-2 expert outputs
differs: the whole model rounds it to bf16 after each expert (``index_add_`` into a bf16 tensor),
MORI sums in fp32 and rounds once. That is at most one bf16 rounding (2^-8 relative) of each MoE
output, which the residual stream and the LM head carry into the logits as a few bf16 ulps: the
bound is 4 ulps at the largest logit's magnitude, ``2^-6 * max|logit|``. (With a second layer
that 1-ulp difference may flip a near-tie of the next router, a different but correctly computed
expert: hence one layer in bf16.) fp32, two layers: only the order of fp32 additions differs
(measured 1e-6 at logits of magnitude 3), so 1e-4. The test can fail: the same model without its
MoE output differs from the whole one by more than 10 times the bound (checked), so a lost,
doubled or unweighted expert contribution does not pass.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from mori.testing import shmem_ranks

EXAMPLE = Path(__file__).resolve().parents[3] / "docs" / "examples" / "ep_moe_model.py"


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("ep_moe_model", EXAMPLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rank(rank: int, world: int) -> list[dict[str, list[Any]]]:
    return _example().rank_main(rank, world, ("mori", "deepep"))  # type: ignore[no-any-return]


def test_mixtral_experts_sharded_over_4_ranks() -> None:
    if not os.environ.get("CI"):  # (in CI the test dependency group installs it: a failure there)
        pytest.importorskip("transformers", reason="pip install transformers (root test dependency group)")
    results = shmem_ranks(_rank, 4, timeout=240)
    for rank, per_case in enumerate(results):
        for case, r in zip(("bf16, 1 layer", "fp32, 2 layers"), per_case, strict=True):
            whole = torch.tensor(r["whole"])
            bound = 2**-6 * float(whole.abs().max()) if case.startswith("bf16") else 1e-4
            moe = float((torch.tensor(r["no_moe"]) - whole).abs().max())
            assert moe > 10 * bound, f"{case}: the experts must matter ({moe:.3g})"
            for api in ("mori", "deepep"):
                diff = float((torch.tensor(r[api]) - whole).abs().max())
                assert diff <= bound, f"rank {rank}, {case}, {api}: logits off by {diff:.3g} > {bound:.3g}"
    assert results[0][0]["whole"] != results[1][0]["whole"], "every rank runs its own batch"

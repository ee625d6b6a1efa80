"""Ranks agree or fail loudly: what every rank of an EP operator must have alike, checked by name.

Ranks that build an operator from different configs, or call it with different dtypes or hidden
sizes, would otherwise exchange bytes that the receiver reads with the wrong layout: tokens for
another rank's experts kept locally, fp32 rows read as bf16, a hidden size that is reported only
as a failed symmetric allocation. Two checks prevent that:

* **once, when an operator is built** (collective): every rank writes the value of every config
  field that shapes the wire (:data:`CONFIG_FIELDS`, plus the environment variables and the
  implementation that change the layout) into one row of a small symmetric table, before any
  other symmetric allocation; after a barrier every rank compares all rows and, if they differ,
  raises the same :class:`~mori.core.errors.MoriValueError` naming each field that differs and
  which ranks have which value;
* **at every call** (no extra barrier): what can change per call (the tokens' dtype and hidden
  size, scale bytes, whether weights are given, a routing replay) is written as a few words into
  every peer's table before the call's "ready" signal, and compared after it, before any data
  moves. On a mismatch every rank raises the same error and nothing was sent, so the operator
  stays usable. The dispatch kernel does the same with words in its control block (see
  :mod:`mori.ep.kernels`): it then moves no row; the CPU runtime raises from ``dispatch``, a GPU
  when the result is read (:meth:`~mori.ep.EpDispatchCombineOp.raise_if_ranks_disagreed`, which
  synchronises). The combine kernels do not compare their calls yet (a combine's layout is its
  dispatch's, which was compared; its dtype and hidden size are not). The DeepEP layer compares
  each normal dispatch's dtype, hidden size, scales and top-k with the counts it all-gathers
  anyway, on every runtime.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mori.core.errors import MoriValueError, format_ranks

__all__ = [
    "COMBINE_FIELDS",
    "CONFIG_FIELDS",
    "DISPATCH_FIELDS",
    "DTYPES",
    "Field",
    "dtype_code",
    "mismatch",
]


def _float_types(*names: str) -> tuple[torch.dtype, ...]:
    return tuple(getattr(torch, n) for n in names if hasattr(torch, n))


#: every dtype a call may carry, by code (the code is ``index + 1``; 0 means "none")
DTYPES: tuple[torch.dtype, ...] = (
    torch.bfloat16,
    torch.float16,
    torch.float32,
    *_float_types("float8_e4m3fn", "float8_e4m3fnuz", "float4_e2m1fn_x2"),
    torch.uint8,
    torch.int8,
    torch.int32,
)


def dtype_code(dtype: torch.dtype | None) -> int:
    """Small integer naming ``dtype`` (0 for None), the same on every rank."""
    return 0 if dtype is None else DTYPES.index(dtype) + 1


def _dtype_name(code: int) -> str:
    if code == 0:
        return "None"
    if 1 <= code <= len(DTYPES):
        return str(DTYPES[code - 1]).removeprefix("torch.")
    return f"dtype code {code}"


def _given(v: int) -> str:
    return "given" if v else "None"


@dataclass(frozen=True)
class Field:
    """One compared value: its name in errors and how to print it."""

    name: str
    show: Callable[[int], str] = str


#: config fields (and the settings derived from the environment) that change what travels or
#: where; ``rank`` differs by design, ``data_type`` is deprecated (each call's dtype is used),
#: ``rdma_block_num`` and ``num_qp_per_pe`` are unused on one node
CONFIG_FIELDS: tuple[Field, ...] = (
    Field("world_size"),
    Field("hidden_dim"),
    Field("scale_dim"),
    Field("scale_type_size"),
    Field("max_token_type_size"),
    Field("max_num_inp_token_per_rank"),
    Field("num_experts_per_rank"),
    Field("num_experts_per_token"),
    Field("max_total_recv_tokens"),
    Field("use_external_inp_buf", lambda v: str(bool(v))),
    Field("kernel_type"),
    Field("gpu_per_node"),
    Field("quant_type"),
    # the push combine's chunk (GPU kernels) is planned from the launch geometry
    Field("block_num"),
    Field("warp_num_per_block"),
    Field("environment variable MORI_FP8_COMBINE_SCALE_DIM", lambda v: "unset" if v == -1 else str(v)),
    Field("environment variable MORI_EP_PUSH_CHUNK", lambda v: "unset" if v == 0 else str(v)),
    Field("implementation (1 = Triton kernels, 0 = host path)"),
)

#: what each dispatch call must have alike on every rank
DISPATCH_FIELDS: tuple[Field, ...] = (
    Field("input.dtype", _dtype_name),
    Field("input.shape[1] (hidden size)"),
    Field("scales (bytes per token)"),
    Field("scales.dtype", _dtype_name),
    Field("weights", _given),
    Field("routing (a replay)", _given),
)

#: what each combine call must have alike on every rank
COMBINE_FIELDS: tuple[Field, ...] = (
    Field("input.dtype", _dtype_name),
    Field("input.shape[1] (hidden size)"),
    Field("weights", _given),
    Field("use_external_inp_buf (0 = zero-copy)"),
)

#: words per row of the agreement table
ROW_WORDS = max(len(CONFIG_FIELDS), len(DISPATCH_FIELDS), len(COMBINE_FIELDS))


def mismatch(
    func: str, what: str, fields: Sequence[Field], rows: torch.Tensor, rank: int
) -> MoriValueError | None:
    """The error naming every field on which the ranks' ``rows`` (int64 [world, >= len(fields)],
    one row per rank) differ, or None if all agree. Every rank builds the same message."""
    table = rows[:, : len(fields)].tolist()
    parts = []
    for i, f in enumerate(fields):
        values = [r[i] for r in table]
        if len(set(values)) == 1:
            continue
        by_value: dict[int, list[int]] = {}
        for r, v in enumerate(values):
            by_value.setdefault(v, []).append(r)
        where = "; ".join(
            f"{f.show(v)} on rank{'s' if len(rs) > 1 else ''} {format_ranks(rs)}"
            for v, rs in by_value.items()
        )
        parts.append(f"{f.name}: {where}")
    if not parts:
        return None
    return MoriValueError(
        f"{func}: the ranks disagree on {what} (seen by rank {rank}): "
        + " | ".join(parts)
        + f". Every rank must use the same {what}; nothing was sent"
    )

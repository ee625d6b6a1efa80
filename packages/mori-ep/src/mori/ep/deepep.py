"""DeepEP-compatible expert-parallel layer: ``Buffer``, ``Config``, ``EventOverlap`` (DeepEP V1 API).

An engine written for DeepEP switches by changing its import, or without touching its code::

    from mori.ep.deepep import Buffer, Config, EventOverlap   # was: from deep_ep import ...

    import mori.ep.deepep
    mori.ep.deepep.install_as_deep_ep()   # from here on, `import deep_ep` is this module

The names, parameters, defaults and return tuples follow DeepEP's V1 Python API
(``deep_ep.Buffer``, module names ``topk_idx_t``, ``is_sm90_compiled``,
``get_low_latency_rdma_size_hint``, ``__version__``): normal mode (``get_dispatch_layout``,
``dispatch``, ``combine``) and low-latency mode (``low_latency_dispatch``,
``low_latency_combine``, ``get_next_low_latency_combine_buffer``). The handles are DeepEP's
tuples (:class:`DispatchHandle`, :class:`LowLatencyHandle` are tuple subclasses that also carry
MORI's routing). The communication is done by MORI's :class:`~mori.ep.EpDispatchCombineOp`
(kernel type ``IntraNode``); ``get_dispatch_layout`` is one Triton launch on GPUs
(:mod:`mori.ep.layout`).

Semantics, as in DeepEP:

* normal ``dispatch`` returns the received rows grouped by source rank in rank order, and within a
  source rank in ascending source-token order: the operator places them there directly (the
  layer computes each row's place from the all-gathered counts and has the operator replay that
  layout, so nothing is reordered afterwards); ``recv_topk_idx`` holds local expert ids (``-1``
  for experts on other ranks, whose ``recv_topk_weights`` are 0); ``num_recv_tokens_per_expert_list``
  counts received tokens per local expert, each rounded up to ``expert_alignment``; the handle's
  ``rank_prefix_matrix[i, j]`` = tokens ranks ``0..i`` send to rank ``j``; passing ``handle``
  repeats the layout with a new payload (cached dispatch); ``num_worst_tokens > 0`` pads the
  outputs to that many rows;
* normal ``combine`` is an unweighted sum over the ranks a token went to (fp32, cast once), and sums
  ``topk_weights`` back the same way;
* ``low_latency_dispatch`` packs expert-major, ``[num_local_experts, num_ranks *
  num_max_dispatch_tokens_per_rank, hidden]``, with ``recv_count`` per local expert, optionally in
  fp8 e4m3fn with one fp32 scale per 128 channels (``amax / 448``, DeepEP's rule, optionally rounded
  to a power of two or packed as UE8M0); ``handle[0][i]`` is the source token of each packed row of
  local expert ``i``, ``handle[1][i]`` per source rank ``(begin << 32) | count``;
  ``low_latency_combine`` returns, for each token, the sum of its experts' outputs weighted by
  ``topk_weights``.

Differences from DeepEP that remain (also in ``docs/ep_deepep.md``):

* **Communication backend.** Buffers come from the ``mori.shmem`` symmetric heap
  (``MORI_SHMEM_HEAP_SIZE``), sized per call from the shapes; ``num_nvl_bytes``/``num_rdma_bytes``
  are validated and kept but size nothing, and ``get_local_buffer_tensor`` raises. If
  ``mori.shmem`` is not initialised, the constructor initialises it over ``group`` (rank 0 of the
  group makes a unique id and broadcasts it over the group; ``shmem_init_attr`` on every rank) and
  :meth:`Buffer.destroy` finalises it again; if it is initialised already, its PEs must be the
  group's ranks. ``group=None`` uses the initialised ``mori.shmem`` world.
* **One node only** (what the operator implements today): ``num_tokens_per_rdma_rank`` is always
  None, there are no RDMA ranks; ``internode_dispatch``/``internode_combine`` raise.
* **Host-blocking.** Every call returns with its results complete on the CPU runtime, and queued on
  the current stream on a GPU (a normal dispatch waits on the host for the all-gathered counts,
  as DeepEP does unless ``num_worst_tokens``): ``async_finish=True`` returns an event recorded
  after the call, ``previous_event`` is waited for first, ``allocate_on_comm_stream`` is validated
  only. ``Config.num_sms`` is passed to the operator as its block count and sets the handle's
  channels.
* **Received rows**: new tensors (DeepEP's contract), one local copy of the rows more than the
  MORI API; ``MORI_EP_DEEPEP_RECV_VIEWS=1`` returns views of the operator's receive buffers
  instead, two per shape used in turn, valid until the second dispatch after (as DeepEP's
  low-latency results).
* **Channel fields of the handle** (``channel_prefix_matrix``, ``recv_channel_prefix_matrix``,
  ``send_head``) have DeepEP's shapes and the meanings documented at :class:`DispatchHandle`;
  combine does not read them. A tuple rebuilt from a handle's items is refused (it lacks MORI's
  routing): pass the handle object back.
* **topk**: at most 9 experts per token (``MAX_EXPERTS_PER_TOKEN``); ``topk_idx`` int64 or int32
  (DeepEP: ``topk_idx_t``); a normal dispatch without ``topk_idx`` (by ``is_token_in_rank``
  alone) needs at most 9 ranks; on the CPU runtime ``is_token_in_rank``, ``num_tokens_per_rank``
  and ``num_tokens_per_expert`` are checked against ``topk_idx`` (on GPUs that would synchronise).
* **Undefined rows are defined**: rows past the valid ones (``num_worst_tokens`` padding, packed
  low-latency rows past ``recv_count``) are zeros, ``recv_topk_idx`` -1 as in DeepEP; the
  low-latency ``src_info`` past ``recv_count`` is -1.
* **Precision**: normal ``combine`` with ``bias`` adds the bias to the bf16 sum (DeepEP adds it in
  fp32 before the one cast); low-latency combine sends, per destination rank, the fp32 weighted sum
  of that rank's experts rounded to bf16 (DeepEP sends each expert's bf16 output), so results agree
  to bf16 rounding. ``use_logfmt`` is accepted and the wire stays bf16.
* **Low-latency combine** re-sends ``topk_weights`` to the expert ranks first (a replay of the
  dispatch's layout with the weights as payload: ``low_latency_dispatch`` takes no weights, and the
  operator reduces on the expert side). ``zero_copy=True`` needs ``x`` to be the tensor from
  :meth:`Buffer.get_next_low_latency_combine_buffer`, which is a plain tensor, not part of the
  communication buffer. ``dispatch_wait_recv_cost_stats`` / ``combine_wait_recv_cost_stats`` are
  validated and left unchanged (no wait times are measured).
* **return_recv_hook**: the transfer finishes inside the call; the hook unpacks the received rows
  into the returned tensors (``recv_count`` is zeros before) or writes ``combined_x``. Data are not
  valid before the hook is called, as in DeepEP.
* ``enable_shrink`` (and the ``low_latency_*_mask_buffer`` calls), MNNVL/fabric are not supported;
  ``clean_low_latency_buffer`` is a validated no-op (MORI's buffers self-reset);
  ``is_sm90_compiled()`` is True (every feature DeepEP gates on it exists here). DeepEP V2's
  ``ElasticBuffer`` API is :mod:`mori.ep.elastic`.
"""

from __future__ import annotations

import math
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

import mori.shmem as shmem
from mori.core.env import EnvVar, parse_bool
from mori.core.errors import MoriBackendError, MoriStateError, MoriValueError, bad_type, bad_value
from mori.ep import agreement, deepep_handle, layout
from mori.ep.config import MAX_EXPERTS_PER_TOKEN, EpDispatchCombineConfig, EpDispatchCombineKernelType
from mori.ep.op import IMPLS, EpDispatchCombineOp, EpDispatchRoutingHandle

__all__ = [
    "MORI_EP_DEEPEP_RECV_VIEWS",
    "Buffer",
    "Config",
    "DispatchHandle",
    "EventHandle",
    "EventOverlap",
    "LowLatencyHandle",
    "get_low_latency_rdma_size_hint",
    "install_as_deep_ep",
    "is_sm90_compiled",
    "topk_idx_t",
]

#: dtype of ``topk_idx`` that DeepEP uses by default (int32 is accepted too)
topk_idx_t = torch.int64

MORI_EP_DEEPEP_RECV_VIEWS = EnvVar(
    "MORI_EP_DEEPEP_RECV_VIEWS",
    "0",
    "mori.ep.deepep normal-mode dispatch: 1 returns recv_x (and its scales) as views of MORI's receive "
    "buffers, two per shape used in turn, so a result stays valid until the second dispatch after it "
    "(as DeepEP's low-latency results); 0 (default) returns new tensors like DeepEP, one local copy of "
    "the received rows more.",
    "1",
    parse_bool,
    "0 or 1",
)
#: channels per fp8 scale in low-latency mode (and DeepEP's per-token-group fp8 recipe)
FP8_GROUP = 128
#: experts whose per-call counts the count table has room for at first (it grows, collectively,
#: the first time every rank's dispatch has more)
_EXPERT_CAP = 256
#: largest finite float8_e4m3fn value
FP8_MAX = 448.0
#: smallest amax used for an fp8 scale (DeepEP's ``kFP8Margin``)
FP8_MARGIN = 1e-4
_TOPK_DTYPES = (torch.int64, torch.int32)
_SCALE_DTYPES = (torch.float32, torch.int32)
_COMBINE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_DISPATCH_X: tuple[torch.dtype, ...] = (
    torch.bfloat16,
    torch.float16,
    torch.float32,
    *(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz") if hasattr(torch, n)),
)


#: what every rank's normal dispatch must have alike (all-gathered with the counts)
_NORMAL_FIELDS = (
    agreement.Field("x.dtype", agreement.DISPATCH_FIELDS[0].show),
    agreement.Field("x.shape[1] (hidden size)"),
    agreement.Field("x[1].shape[1] (scales per token)"),
    agreement.Field("x[1].dtype", agreement.DISPATCH_FIELDS[0].show),
    agreement.Field("topk_idx", lambda v: "given" if v else "None"),
    agreement.Field("top-k (topk_idx.shape[1], or the ranks without topk_idx)"),
    agreement.Field("num_experts (num_tokens_per_expert.shape[0])"),
)


# -- events ----------------------------------------------------------------------------------------


class EventHandle:
    """A point in a device stream (DeepEP's ``EventHandle``).

    On a CUDA device it records a ``torch.cuda.Event`` on the current stream when made; on the CPU
    runtime there is no stream and the event is complete when made.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.event: Any = None
        if device is not None and device.type == "cuda":
            self.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self.event.record()

    def current_stream_wait(self) -> None:
        """Make the current stream wait for this event (nothing to wait for on the CPU runtime)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class EventOverlap:
    """An optional event plus tensors kept alive until it completes (DeepEP's ``EventOverlap``).

    ``with event: ...`` runs the block, then makes the current stream wait for the event (if any).

    Args:
        event: an :class:`EventHandle`, or None (the call was not asynchronous).
        extra_tensors: tensors to keep referenced while the event is pending.
    """

    def __init__(
        self, event: EventHandle | None = None, extra_tensors: tuple[torch.Tensor, ...] | None = None
    ):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Make the current stream wait for the event. Raises if there is none (as DeepEP asserts)."""
        if self.event is None:
            raise MoriStateError(
                "EventOverlap.current_stream_wait: no event; the call that made it had async_finish=False"
            )
        self.event.current_stream_wait()

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.event.current_stream_wait()


# -- config ----------------------------------------------------------------------------------------


def _int(func: str, name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise bad_value(func, name, value, f"an int >= {minimum}")
    return int(value)


class Config:
    """Performance settings of a normal-mode call (DeepEP's ``deep_ep.Config``).

    Args:
        num_sms: streaming multiprocessors (compute units) the kernels may use; even.
        num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens: NVLink chunk sizes
            (tokens); send < recv.
        num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens: RDMA chunk sizes.

    MORI passes ``num_sms`` to the operator as its block count; the chunk sizes are validated and
    kept for the buffer-size hints.
    """

    def __init__(
        self,
        num_sms: int,
        num_max_nvl_chunked_send_tokens: int,
        num_max_nvl_chunked_recv_tokens: int,
        num_max_rdma_chunked_send_tokens: int = 6,
        num_max_rdma_chunked_recv_tokens: int = 128,
    ) -> None:
        func = "Config"
        self.num_sms = _int(func, "num_sms", num_sms, 1)
        if num_sms % 2:
            raise bad_value(func, "num_sms", num_sms, "an even int (two SMs per channel)")
        self.num_max_nvl_chunked_send_tokens = _int(
            func, "num_max_nvl_chunked_send_tokens", num_max_nvl_chunked_send_tokens, 1
        )
        self.num_max_nvl_chunked_recv_tokens = _int(
            func, "num_max_nvl_chunked_recv_tokens", num_max_nvl_chunked_recv_tokens, 1
        )
        if num_max_nvl_chunked_send_tokens >= num_max_nvl_chunked_recv_tokens:
            raise bad_value(
                func,
                "num_max_nvl_chunked_send_tokens",
                num_max_nvl_chunked_send_tokens,
                f"less than num_max_nvl_chunked_recv_tokens = {num_max_nvl_chunked_recv_tokens}",
            )
        self.num_max_rdma_chunked_send_tokens = _int(
            func, "num_max_rdma_chunked_send_tokens", num_max_rdma_chunked_send_tokens, 1
        )
        self.num_max_rdma_chunked_recv_tokens = _int(
            func, "num_max_rdma_chunked_recv_tokens", num_max_rdma_chunked_recv_tokens, 1
        )

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes DeepEP's NVLink buffer needs for ``hidden_bytes`` per token and ``num_ranks`` ranks
        (DeepEP's formula; for ``Buffer(num_nvl_bytes=...)``)."""
        func = "Config.get_nvl_buffer_size_hint"
        _int(func, "hidden_bytes", hidden_bytes, 1)
        _int(func, "num_ranks", num_ranks, 1)
        num_rdma = max(num_ranks // 8, 1)
        num_nvl = min(num_ranks, 8)
        channels = self.num_sms // 2
        rows = channels * num_nvl * self.num_max_nvl_chunked_recv_tokens
        n = channels * num_nvl * (2 * num_rdma + 3) * 4
        n += rows * (hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4)  # data, source meta, top-k, scales
        return (n + 127) // 128 * 128

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's RDMA buffer size hint: 0 with at most 8 ranks (one node)."""
        func = "Config.get_rdma_buffer_size_hint"
        _int(func, "hidden_bytes", hidden_bytes, 1)
        _int(func, "num_ranks", num_ranks, 1)
        if num_ranks <= 8:
            return 0
        num_rdma = num_ranks // 8
        channels = self.num_sms // 2
        rows = channels * num_rdma * self.num_max_rdma_chunked_recv_tokens * 2
        n = channels * num_rdma * (8 * 2 + 2) * 2 * 4
        n += rows * (hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4)
        return (n + 127) // 128 * 128

    def __repr__(self) -> str:
        return (
            f"Config(num_sms={self.num_sms}, nvl_send={self.num_max_nvl_chunked_send_tokens}, "
            f"nvl_recv={self.num_max_nvl_chunked_recv_tokens}, rdma_send={self.num_max_rdma_chunked_send_tokens}, "
            f"rdma_recv={self.num_max_rdma_chunked_recv_tokens})"
        )


#: DeepEP's tuned (nvl_send, nvl_recv, rdma_send, rdma_recv) chunk sizes by number of ranks
_DISPATCH_CONFIGS = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128)}
_COMBINE_CONFIGS = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128)}


def _table_config(func: str, table: dict[int, tuple[int, int, int, int]], num_ranks: Any) -> Config:
    _int(func, "num_ranks", num_ranks, 1)
    key = min((k for k in table if k >= num_ranks), default=max(table))
    return Config(Buffer.num_sms, *table[key])


# -- handles ---------------------------------------------------------------------------------------


class DispatchHandle(tuple[torch.Tensor, ...]):
    """DeepEP's normal-mode handle: the 6-tuple ``(rank_prefix_matrix, channel_prefix_matrix,
    recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head)``, plus MORI's routing.

    Code written for DeepEP indexes or unpacks it as a tuple; pass the object itself back to
    ``combine`` and to a cached ``dispatch`` (a tuple rebuilt from its items is refused: it lacks
    the routing). Fields (``C`` = channels = ``Config.num_sms // 2`` of the dispatch; a channel of
    a rank is a contiguous ``ceil(num_tokens / C)`` of its tokens, as DeepEP splits them):

    * ``rank_prefix_matrix`` int32 [num_ranks, num_ranks]: ``[i, j]`` = tokens ranks ``0..i``
      send to rank ``j``; rows from source ``s`` are received rows
      ``rank_prefix_matrix[s - 1, rank] .. rank_prefix_matrix[s, rank]``;
    * ``channel_prefix_matrix`` int32 [num_ranks, C] (sender side): ``[r, c]`` = this rank's
      tokens of channels ``0..c`` sent to rank ``r``;
    * ``recv_channel_prefix_matrix`` int32 [num_ranks, C] (receiver side): ``[s, c]`` = the first
      received row holding channel ``c`` of rank ``s``;
    * ``recv_src_idx`` int32 [num_recv_tokens]: each received row's token index on its source;
    * ``is_token_in_rank`` bool [num_tokens, num_ranks]: the sent layout;
    * ``send_head`` int32 [num_tokens, num_ranks]: ``[t, r]`` = the position of token ``t`` among
      the rows rank ``r`` receives from this rank, ``-1`` if not sent.

    The channel matrices and ``send_head`` are DeepEP-internal (ring-buffer positions there);
    here they have the documented shapes and the meanings above, and combine does not read them.

    Attributes besides the tuple: ``num_recv_tokens``, ``num_recv_rows`` (``num_worst_tokens`` if
    that was given), ``num_tokens`` (tokens this rank dispatched), ``has_topk``.
    """

    num_recv_tokens: int
    num_recv_rows: int
    num_tokens: int
    has_topk: bool
    _buffer: Buffer
    _op: EpDispatchCombineOp
    _routing: EpDispatchRoutingHandle
    _indices: torch.Tensor

    def __new__(
        cls,
        items: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        *,
        buffer: Buffer,
        op: EpDispatchCombineOp,
        routing: EpDispatchRoutingHandle,
        indices: torch.Tensor,
        num_recv_rows: int,
        has_topk: bool,
    ) -> DispatchHandle:
        self = super().__new__(cls, items)
        self.num_recv_tokens = int(items[3].shape[0])
        self.num_recv_rows = int(num_recv_rows)
        self.num_tokens = int(items[4].shape[0])
        self.has_topk = has_topk
        self._buffer, self._op, self._routing, self._indices = buffer, op, routing, indices
        return self

    rank_prefix_matrix = property(lambda self: self[0], doc="int32 [num_ranks, num_ranks]")
    channel_prefix_matrix = property(lambda self: self[1], doc="int32 [num_ranks, channels]")
    recv_channel_prefix_matrix = property(lambda self: self[2], doc="int32 [num_ranks, channels]")
    recv_src_idx = property(lambda self: self[3], doc="int32 [num_recv_tokens]")
    is_token_in_rank = property(lambda self: self[4], doc="bool [num_tokens, num_ranks]")
    send_head = property(lambda self: self[5], doc="int32 [num_tokens, num_ranks]")

    def __repr__(self) -> str:
        return f"DispatchHandle(num_tokens={self.num_tokens}, num_recv_tokens={self.num_recv_tokens})"


class LowLatencyHandle(tuple[torch.Tensor | int, ...]):
    """DeepEP's low-latency handle: the 5-tuple ``(packed_recv_src_info, packed_recv_layout_range,
    num_max_dispatch_tokens_per_rank, hidden, num_experts)``; pass the object itself to
    ``low_latency_combine`` and ``get_next_low_latency_combine_buffer``.

    * ``handle[0][i]`` (``packed_recv_src_info``) int32 [num_ranks * num_max_dispatch_tokens_per_rank]:
      for each packed row of local expert ``i``, the index of its token on its source rank (-1
      past ``recv_count[i]``);
    * ``handle[1][i]`` (``packed_recv_layout_range``) int64 [num_ranks]: per source rank,
      ``(begin << 32) | count``, the packed rows of local expert ``i`` that came from it.

    With ``return_recv_hook=True`` both are filled when the hook is called (``received`` tells).
    """

    _buffer: Buffer
    _op: EpDispatchCombineOp
    _routing: EpDispatchRoutingHandle
    _indices: torch.Tensor
    # per (received row, top-k slot) pair, sorted by (local expert, source): operator row,
    # top-k slot, local expert, packed row (set when the receive completes)
    _pairs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None

    def __new__(
        cls,
        items: tuple[torch.Tensor, torch.Tensor, int, int, int],
        *,
        buffer: Buffer,
        op: EpDispatchCombineOp,
        routing: EpDispatchRoutingHandle,
        indices: torch.Tensor,
    ) -> LowLatencyHandle:
        self = super().__new__(cls, items)
        self._buffer, self._op, self._routing, self._indices = buffer, op, routing, indices
        self._pairs = None
        return self

    packed_recv_src_info = property(lambda self: self[0], doc="int32 [num_local_experts, num_ranks * max]")
    packed_recv_layout_range = property(lambda self: self[1], doc="int64 [num_local_experts, num_ranks]")
    num_max_dispatch_tokens_per_rank = property(lambda self: self[2], doc="the dispatch's maximum")
    hidden = property(lambda self: self[3], doc="hidden size of the dispatch")
    num_experts = property(lambda self: self[4], doc="experts over all ranks")

    @property
    def received(self) -> bool:
        """False until the receive hook of a ``return_recv_hook=True`` dispatch was called."""
        return self._pairs is not None

    def __repr__(self) -> str:
        return (
            f"LowLatencyHandle(num_max_dispatch_tokens_per_rank={self[2]}, hidden={self[3]}, "
            f"num_experts={self[4]}, received={self.received})"
        )


# -- helpers ---------------------------------------------------------------------------------------


def _tensor(
    func: str, name: str, t: Any, dtypes: tuple[torch.dtype, ...], shape: tuple[int | None, ...]
) -> torch.Tensor:
    """Check type, dtype and shape (``None`` = any size there)."""
    if not isinstance(t, torch.Tensor):
        raise bad_type(func, name, t, "a torch.Tensor")
    if t.dtype not in dtypes:
        raise bad_value(func, f"{name}.dtype", t.dtype, " or ".join(str(d) for d in dtypes))
    got = t.shape
    if len(got) != len(shape) or any(s is not None and s != d for s, d in zip(shape, got, strict=True)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise bad_value(func, f"{name}.shape", list(got), want)
    return t


def _wait_stats(func: str, name: str, t: Any, world: int) -> None:
    """int64 [num_ranks] (DeepEP until 2025) or [num_ranks, num_ranks] (since)."""
    shape = (world,) if isinstance(t, torch.Tensor) and t.dim() == 1 else (world, world)
    _tensor(func, name, t, (torch.int64,), shape)


def _bool(func: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise bad_value(func, name, value, "True or False")
    return value


def _fp8_quantise(x: torch.Tensor, round_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [N, H] -> (float8_e4m3fn [N, H], fp32 dequant scales [N, H / 128]) by DeepEP's rule:
    per 128 channels ``scale_inv = max(amax, 1e-4) / 448`` (rounded up to a power of two with
    ``round_scale``); the fp8 value is ``x * (1 / scale_inv)``."""
    n, h = x.shape
    xf = x.float().view(n, h // FP8_GROUP, FP8_GROUP)
    amax = xf.abs().amax(dim=2).clamp(min=FP8_MARGIN)
    scale_inv = amax / FP8_MAX
    if round_scale:
        scale_inv = torch.exp2(torch.ceil(torch.log2(scale_inv)))
    q = (xf * (1.0 / scale_inv)[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(n, h), scale_inv


def _ue8m0_pack(scale_inv: torch.Tensor) -> torch.Tensor:
    """fp32 power-of-two scales [N, S] -> int32 [N, S / 4], four UE8M0 exponents per int
    (the exponent byte of each fp32 scale, lowest byte first)."""
    exp = ((scale_inv.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    return exp.contiguous().view(torch.int32)


def _pow2_at_least(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << max(0, n - 1).bit_length())


# -- the buffer ------------------------------------------------------------------------------------


class Buffer:
    """DeepEP-compatible communication buffer over MORI's EP operator.

    The constructor is **collective** over ``group`` (every rank builds its ``Buffer`` together),
    host-blocking. So are ``dispatch``, ``combine``, ``low_latency_dispatch`` and
    ``low_latency_combine``: every rank calls them in the same order with the same sizes (hidden
    size, number of experts, top-k). They return with their results complete; none is
    graph-capturable on the CPU runtime.

    Args:
        group: the ``torch.distributed`` process group of the expert-parallel ranks, or None to
            use the ranks of an already initialised ``mori.shmem``. If ``mori.shmem`` is not
            initialised it is initialised over ``group`` (and finalised by :meth:`destroy`).
        num_nvl_bytes, num_rdma_bytes: DeepEP's buffer sizes (bytes, >= 0); validated and kept,
            MORI sizes its buffers from each call's shapes in the ``mori.shmem`` heap.
        low_latency_mode: allow ``low_latency_dispatch``/``low_latency_combine`` (required, as in
            DeepEP).
        num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, use_fabric: DeepEP
            transport settings; validated, unused on one node.
        explicitly_destroy: if True, call :meth:`destroy` when done (DeepEP's rule); if False,
            nothing is released when the object is collected.
        enable_shrink: must be False (not supported).
        comm: an mpi4py communicator used to initialise ``mori.shmem`` when ``group`` is None and
            ``mori.shmem`` is not initialised.
        impl: (MORI only) the operator implementation: ``"auto"`` (Triton kernels on a GPU heap,
            the host path on the cpu runtime), ``"host"`` or ``"triton"`` (on the cpu runtime only
            under ``TRITON_INTERPRET=1``).
    """

    #: SMs (compute units) the normal-mode kernels use by default (DeepEP's class attribute)
    num_sms: int = 20

    def __init__(
        self,
        group: Any = None,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        use_fabric: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm: Any = None,
        *,
        impl: str = "auto",
    ) -> None:
        func = "Buffer"
        import torch.distributed as dist

        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise bad_type(func, "group", group, "a torch.distributed.ProcessGroup or None")
        self.num_nvl_bytes = _int(func, "num_nvl_bytes", num_nvl_bytes, 0)
        self.num_rdma_bytes = _int(func, "num_rdma_bytes", num_rdma_bytes, 0)
        self.low_latency_mode = _bool(func, "low_latency_mode", low_latency_mode)
        self.num_qps_per_rank = _int(func, "num_qps_per_rank", num_qps_per_rank, 1)
        _bool(func, "allow_nvlink_for_low_latency_mode", allow_nvlink_for_low_latency_mode)
        _bool(func, "allow_mnnvl", allow_mnnvl)
        _bool(func, "use_fabric", use_fabric)
        self.explicitly_destroy = _bool(func, "explicitly_destroy", explicitly_destroy)
        self.enable_shrink = False
        if impl not in IMPLS:
            raise bad_value(func, "impl", impl, f"one of {', '.join(repr(i) for i in IMPLS)}")
        self._impl = impl
        if enable_shrink is not False:
            raise bad_value(func, "enable_shrink", enable_shrink, "False (shrinking is not supported)")
        self.group = group
        self._owns_shmem = False
        if not shmem.shmem_is_initialized():
            if group is not None:
                # rank 0 of the group makes the unique id (and serves its store); the group carries it
                box: list[Any] = [shmem.shmem_get_unique_id() if group.rank() == 0 else None]
                dist.broadcast_object_list(box, group=group, group_src=0)
                shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, group.rank(), group.size(), box[0])
            elif comm is not None:
                shmem.shmem_mpi_init(comm)
            else:
                raise MoriStateError(
                    f"{func}: group=None needs mori.shmem initialised (or an mpi4py comm); pass the "
                    "torch.distributed process group of the expert-parallel ranks"
                )
            self._owns_shmem = True
        elif group is not None and (group.rank(), group.size()) != (shmem.shmem_mype(), shmem.shmem_npes()):
            raise bad_value(
                func,
                "group",
                f"a group with rank {group.rank()} of {group.size()}",
                f"the ranks of the initialised mori.shmem (PE {shmem.shmem_mype()} of {shmem.shmem_npes()})",
            )
        self.rank = shmem.shmem_mype()
        self.group_size = shmem.shmem_npes()
        # the symmetric table that all-gathers each normal dispatch's counts, with room for the
        # per-expert counts of _expert_cap experts (grown when every rank's call needs more)
        self._expert_cap = _EXPERT_CAP
        self._tables: dict[int, tuple[torch.Tensor, list[torch.Tensor], list[int], torch.Tensor]] = {}
        self.device = self._table(deepep_handle.header_width(self.group_size) + self._expert_cap)[0].device
        self._ops: dict[tuple[Any, ...], EpDispatchCombineOp] = {}
        #: normal dispatch returns views of the receive buffers (two per shape, alternating)
        self._recv_views = bool(MORI_EP_DEEPEP_RECV_VIEWS.get())
        self._slots: dict[tuple[Any, ...], int] = {}
        self._layout_impl = "triton" if impl == "triton" else "auto"
        self._handle_impl = "triton" if impl == "triton" else "auto"
        self._combine_bufs: dict[tuple[int, ...], torch.Tensor] = {}
        self._destroyed = False
        shmem.shmem_barrier_all()

    # -- information --------------------------------------------------------------------------

    def is_available(self) -> bool:
        """True until :meth:`destroy`."""
        return not self._destroyed

    def get_num_rdma_ranks(self) -> int:
        """Nodes in the group: 1 (MORI's operator runs on one node today)."""
        return 1

    def get_rdma_rank(self) -> int:
        """This rank's node: 0."""
        return 0

    def get_root_rdma_rank(self, global_: bool) -> int:
        """The first rank of this node (0)."""
        return 0

    def get_local_device_id(self) -> int:
        """Index of this rank's device (-1 on the CPU runtime)."""
        return -1 if self.device.index is None else int(self.device.index)

    def get_comm_stream(self) -> Any:
        """The stream the communication runs on: the current CUDA stream, None on the CPU runtime."""
        return torch.cuda.current_stream() if self.device.type == "cuda" else None

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set :attr:`num_sms` for the default configs of every buffer (an even int)."""
        _int("Buffer.set_num_sms", "new_num_sms", new_num_sms, 2)
        if new_num_sms % 2:
            raise bad_value("Buffer.set_num_sms", "new_num_sms", new_num_sms, "an even int")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream (complete at once on the CPU runtime)."""
        live = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        dev = torch.device("cuda") if live else None
        return EventOverlap(EventHandle(dev))

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP's default normal-mode dispatch config for ``num_ranks`` ranks."""
        return _table_config("Buffer.get_dispatch_config", _DISPATCH_CONFIGS, num_ranks)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP's default normal-mode combine config for ``num_ranks`` ranks."""
        return _table_config("Buffer.get_combine_config", _COMBINE_CONFIGS, num_ranks)

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """Bytes DeepEP's low-latency buffer needs (DeepEP's formula; for ``num_rdma_bytes``)."""
        func = "Buffer.get_low_latency_rdma_size_hint"
        m = _int(func, "num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1)
        h = _int(func, "hidden", hidden, 1)
        _int(func, "num_ranks", num_ranks, 1)
        e = _int(func, "num_experts", num_experts, 1)
        scales = h // FP8_GROUP
        dispatch_msg = 16 + max(h * 2, h + scales * 4)
        combine_msg = scales * 4 + h * 2
        send = max(m * dispatch_msg, e * m * combine_msg)
        recv = e * m * max(dispatch_msg, combine_msg)
        signal = e * 4
        total = 2 * (send + recv + signal)
        return (total + 128) // 128 * 128

    # -- lifetime -----------------------------------------------------------------------------

    def destroy(self) -> None:
        """Release the buffer (collective). Needs ``explicitly_destroy=True``, as in DeepEP.

        Finalises ``mori.shmem`` if this buffer initialised it.
        """
        if not self.explicitly_destroy:
            raise MoriStateError("Buffer.destroy: the buffer was built with explicitly_destroy=False")
        self._live("Buffer.destroy")
        self._destroyed = True
        self._ops.clear()
        self._combine_bufs.clear()
        if self._owns_shmem and shmem.shmem_is_initialized():
            shmem.shmem_finalize()
        else:
            shmem.shmem_barrier_all()

    def _live(self, func: str) -> None:
        if self._destroyed:
            raise MoriStateError(f"{func}: the buffer was destroyed")

    # -- shared pieces ------------------------------------------------------------------------

    def _events_in(
        self, func: str, previous_event: Any, async_finish: Any, allocate_on_comm_stream: Any
    ) -> None:
        if previous_event is not None and not isinstance(previous_event, EventOverlap):
            raise bad_type(func, "previous_event", previous_event, "an EventOverlap or None")
        _bool(func, "async_finish", async_finish)
        if _bool(func, "allocate_on_comm_stream", allocate_on_comm_stream) and (
            previous_event is None or not async_finish
        ):
            raise bad_value(
                func,
                "allocate_on_comm_stream",
                True,
                "False unless previous_event is given and async_finish=True (as in DeepEP)",
            )
        if previous_event is not None and previous_event.event is not None:
            previous_event.event.current_stream_wait()

    def _event_out(self, async_finish: bool, tensors: tuple[torch.Tensor, ...] = ()) -> EventOverlap:
        if not async_finish:
            return EventOverlap(None)
        return EventOverlap(EventHandle(self.device), tensors or None)

    def _config_blocks(self, func: str, config: Any) -> int:
        if config is None:
            return -1
        if not isinstance(config, Config):
            raise bad_type(func, "config", config, "a Config or None")
        return config.num_sms

    def _table(self, width: int) -> tuple[torch.Tensor, list[torch.Tensor], list[int], torch.Tensor]:
        """Symmetric int64 [2, group_size, width], its peers' views, a call counter and the views'
        addresses (int64 [group_size] on the device). The first use of a width allocates it:
        collective (every rank needs the same widths in the same order)."""
        entry = self._tables.get(width)
        if entry is None:
            t = shmem.mori_shmem_create_tensor((2, self.group_size, width), torch.int64)
            t.zero_()
            peers = [
                t if p == self.rank else shmem.symm_mori_shmem_tensor(t, p) for p in range(self.group_size)
            ]
            addrs = torch.tensor([p.data_ptr() for p in peers], dtype=torch.int64).to(t.device)
            entry = (t, peers, [0], addrs)
            self._tables[width] = entry
            shmem.shmem_barrier_all()  # zeroed everywhere before anyone writes
        return entry

    def _allgather_counts(
        self, n: int, per_rank: torch.Tensor, per_expert: torch.Tensor, words: list[int]
    ) -> tuple[torch.Tensor, deepep_handle.Put | None]:
        """All-gather every rank's int64 row ``[n, per_rank, *words, epoch, per_expert]`` into a
        [group_size, width] view of the symmetric table, valid until the second call after this
        one (collective). On the kernels this returns the :class:`~mori.ep.deepep_handle.Put`
        that the send side's launch does (nothing is launched here); else the rows are put and a
        barrier is queued, and this returns None. Every rank uses the same table whatever its
        arguments, so ranks that disagree (even on the number of experts) see each other's words;
        per-expert counts beyond the table's room are left out (the caller grows it and calls
        again, see :meth:`dispatch`).

        Two tables alternate: a peer writes this one again only after every rank's row of the
        call between has arrived, which this rank sends after everything it queued before."""
        if per_expert.shape[0] > self._expert_cap:
            per_expert = per_expert[:0]
        width = deepep_handle.header_width(self.group_size) + self._expert_cap
        table, peers, calls, addrs = self._table(width)
        par = calls[0] % 2
        calls[0] += 1
        if deepep_handle.uses_kernels(self._handle_impl, self.device):
            offset = (par * self.group_size + self.rank) * width
            put = deepep_handle.Put(addrs, offset, calls[0], per_rank, per_expert.to(self.device), words)
            return table[par], put
        row = torch.cat(
            [
                torch.tensor([n]),
                per_rank.to(torch.int64),
                torch.tensor([*words, calls[0]]),
                per_expert.to(dtype=torch.int64),
            ]
        ).to(self.device)
        for peer in peers:
            peer[par, self.rank, : row.shape[0]] = row
        shmem.shmem_barrier_on_stream()
        return table[par], None

    def _op(
        self,
        kind: str,
        m: int,
        hidden: int,
        elem_bytes: int,
        e_local: int,
        k: int,
        scale_dim: int,
        slot: int = 0,
    ) -> EpDispatchCombineOp:
        """The operator for one shape (built on first use: collective, every rank reaches here with
        the same key), with room for ``m`` tokens per rank. ``slot`` picks one of several operators
        of the same shape (normal mode with receive views alternates two)."""
        key = (kind, hidden, elem_bytes, e_local, k, scale_dim, slot)
        op = self._ops.get(key)
        if op is None or op.config.max_num_inp_token_per_rank < m:
            cfg = EpDispatchCombineConfig(
                data_type=torch.bfloat16,
                rank=self.rank,
                world_size=self.group_size,
                hidden_dim=hidden,
                scale_dim=scale_dim,
                scale_type_size=4 if scale_dim else 0,
                max_token_type_size=elem_bytes,
                max_num_inp_token_per_rank=m,
                num_experts_per_rank=e_local,
                num_experts_per_token=k,
                kernel_type=EpDispatchCombineKernelType.IntraNode,
            )
            op = EpDispatchCombineOp(cfg, impl=self._impl)
            self._ops[key] = op
        return op

    def _check_topk_idx(self, func: str, topk_idx: Any, num_experts: int, n: int | None) -> torch.Tensor:
        t = _tensor(func, "topk_idx", topk_idx, _TOPK_DTYPES, (n, None))
        if not 1 <= t.shape[1] <= MAX_EXPERTS_PER_TOKEN:
            raise bad_value(
                func, "topk_idx.shape[1]", t.shape[1], f"an int in [1, {MAX_EXPERTS_PER_TOKEN}] (top-k)"
            )
        if t.device != self.device:
            raise bad_value(func, "topk_idx.device", t.device, f"{self.device} (the buffer's)")
        # ids are checked where that costs no device synchronisation (the kernels treat ids out
        # of range as -1)
        if t.device.type == "cpu" and t.numel() and bool(((t < -1) | (t >= num_experts)).any()):
            bad = int(t[(t < -1) | (t >= num_experts)][0])
            raise bad_value(func, "topk_idx", f"contains {bad}", f"expert ids in [0, {num_experts}) or -1")
        return t

    def _num_experts(self, func: str, name: str, num_experts: Any) -> int:
        n = _int(func, name, num_experts, 1)
        if n % self.group_size:
            raise bad_value(func, name, n, f"a multiple of the number of ranks, {self.group_size}")
        return n

    def _layout(self, topk_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, ...]:
        """(num_tokens_per_rank int32 [R], num_tokens_per_expert int32 [E], is_token_in_rank bool [N, R])."""
        return layout.dispatch_layout(topk_idx, num_experts, self.group_size, self._layout_impl)

    # -- normal mode --------------------------------------------------------------------------

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, None, torch.Tensor, torch.Tensor, EventOverlap]:
        """Count what a dispatch of ``topk_idx`` sends. Local (not collective); on a GPU one
        Triton launch (:mod:`mori.ep.layout`) and no host synchronisation.

        Args:
            topk_idx: [num_tokens, num_topk] int64 (or int32) global expert ids; ``-1`` means no
                selection.
            num_experts: experts over all ranks (a multiple of the number of ranks).
            previous_event, async_finish, allocate_on_comm_stream: as in DeepEP (see the module
                docstring).

        Returns:
            ``(num_tokens_per_rank int32 [num_ranks], num_tokens_per_rdma_rank None,
            num_tokens_per_expert int32 [num_experts], is_token_in_rank bool [num_tokens,
            num_ranks], event)``; a token counts once per rank however many of its experts are
            there, and once per expert.
        """
        func = "Buffer.get_dispatch_layout"
        self._live(func)
        num_experts = self._num_experts(func, "num_experts", num_experts)
        topk_idx = self._check_topk_idx(func, topk_idx, num_experts, None)
        self._events_in(func, previous_event, async_finish, allocate_on_comm_stream)
        per_rank, per_expert, in_rank = self._layout(topk_idx, num_experts)
        return per_rank, None, per_expert, in_rank, self._event_out(async_finish)

    def _split_x(self, func: str, x: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(x, tuple):
            if len(x) != 2:
                raise bad_value(func, "x", f"a tuple of {len(x)}", "a tensor or (fp8 tensor, scales)")
            data, scales = x
        else:
            data, scales = x, None
        data = _tensor(func, "x" if scales is None else "x[0]", data, _DISPATCH_X, (None, None))
        if data.device != self.device:
            raise bad_value(func, "x.device", data.device, f"{self.device} (the buffer's)")
        if scales is not None:
            scales = _tensor(func, "x[1]", scales, _SCALE_DTYPES, (data.shape[0], None))
            limit = math.ceil(data.shape[1] / FP8_GROUP)
            if not 1 <= scales.shape[1] <= limit:
                raise bad_value(
                    func, "x[1].shape[1]", scales.shape[1], f"an int in [1, {limit}] (hidden / {FP8_GROUP})"
                )
        return data, scales

    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        handle: DispatchHandle | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[Any, ...]:
        """Send each token to every rank that hosts one of its experts (normal mode). Collective.

        Args:
            x: [num_tokens, hidden] tokens (bf16, fp16, fp32 or fp8), or ``(fp8 tokens, scales)``
                with scales float32 (or int32) [num_tokens, <= hidden / 128].
            handle: a :class:`DispatchHandle` to repeat (cached dispatch: same layout, new ``x``;
                the layout arguments must then be None; ``topk_idx``/``topk_weights`` are ignored
                as in DeepEP).
            num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert:
                from :meth:`get_dispatch_layout` for ``topk_idx`` (``num_tokens_per_rdma_rank``
                must be None: one node). Required unless ``handle`` is given. On the CPU runtime
                they are checked against ``topk_idx``.
            topk_idx: [num_tokens, num_topk] int64/int32 global expert ids, ``-1`` = none; or None
                (with ``topk_weights`` None) to send by ``is_token_in_rank`` alone (at most 9
                ranks): ``recv_topk_idx`` and ``recv_topk_weights`` are then None.
            topk_weights: [num_tokens, num_topk] float32, or None with ``topk_idx``.
            expert_alignment: round each entry of ``num_recv_tokens_per_expert_list`` up to this.
            num_worst_tokens: if > 0, pad the outputs to this many rows (it must be at least the
                received count) and return an empty ``num_recv_tokens_per_expert_list``.
            config: a :class:`Config` (``num_sms`` becomes the operator's block count and sets the
                handle's channels) or None (:meth:`get_dispatch_config`).
            previous_event, async_finish, allocate_on_comm_stream: see the module docstring.

        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle,
            event)``: ``recv_x`` [rows, hidden] (or ``(recv_x, recv_x_scales)``), rows grouped by
            source rank in rank order, by source token within a rank; ``recv_topk_idx`` [rows,
            num_topk] local expert ids (-1 for other ranks' experts and padding rows);
            ``recv_topk_weights`` [rows, num_topk] float32 (0 where ``recv_topk_idx`` is -1);
            the list: received tokens per local expert (python ints; the sum over ranks of
            ``num_tokens_per_expert`` for this rank's experts, as DeepEP); ``handle`` a
            :class:`DispatchHandle` (DeepEP's 6-tuple). A cached dispatch returns
            ``(recv_x, None, None, None, None, event)``. ``recv_x`` is a new tensor, or with
            ``MORI_EP_DEEPEP_RECV_VIEWS=1`` a view valid until the second dispatch after this one.
        """
        func = "Buffer.dispatch"
        self._live(func)
        data, scales = self._split_x(func, x)
        _int(func, "expert_alignment", expert_alignment, 1)
        _int(func, "num_worst_tokens", num_worst_tokens, 0)
        blocks = self._config_blocks(func, config)
        if num_tokens_per_rdma_rank is not None:
            raise bad_value(func, "num_tokens_per_rdma_rank", "a tensor", "None (one node, no RDMA ranks)")
        if handle is not None:
            self._check_handle(func, handle)
            for name, v in (
                ("num_tokens_per_rank", num_tokens_per_rank),
                ("is_token_in_rank", is_token_in_rank),
                ("num_tokens_per_expert", num_tokens_per_expert),
            ):
                if v is not None:
                    raise bad_value(func, name, "a tensor", "None when handle is given (cached dispatch)")
            if data.shape[0] != handle.num_tokens:
                raise bad_value(
                    func, "x.shape[0]", data.shape[0], f"{handle.num_tokens}, the token count of handle"
                )
            self._events_in(func, previous_event, async_finish, allocate_on_comm_stream)
            return self._cached_dispatch(func, data, scales, handle, num_worst_tokens, blocks, async_finish)

        for name, v in (
            ("num_tokens_per_rank", num_tokens_per_rank),
            ("is_token_in_rank", is_token_in_rank),
            ("num_tokens_per_expert", num_tokens_per_expert),
        ):
            if v is None:
                raise bad_value(func, name, None, "a tensor from get_dispatch_layout unless handle is given")
        if (topk_idx is None) != (topk_weights is None):
            missing = "topk_weights" if topk_weights is None else "topk_idx"
            raise bad_value(
                func, missing, None, "a tensor: give topk_idx and topk_weights together, or neither"
            )
        w, n = self.group_size, data.shape[0]
        num_tokens_per_expert = _tensor(
            func, "num_tokens_per_expert", num_tokens_per_expert, (torch.int32,), (None,)
        )
        num_experts = self._num_experts(
            func, "num_tokens_per_expert.shape[0]", num_tokens_per_expert.shape[0]
        )
        e_local = num_experts // w
        num_tokens_per_rank = _tensor(func, "num_tokens_per_rank", num_tokens_per_rank, (torch.int32,), (w,))
        is_token_in_rank = _tensor(func, "is_token_in_rank", is_token_in_rank, (torch.bool,), (n, w))
        if is_token_in_rank.device != self.device:
            raise bad_value(func, "is_token_in_rank.device", is_token_in_rank.device, f"{self.device}")
        checks: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        on_cpu = self.device.type == "cpu"  # (checks that cost no device synchronisation)
        if topk_idx is not None:
            topk_idx = self._check_topk_idx(func, topk_idx, num_experts, n)
            k = topk_idx.shape[1]
            topk_weights = _tensor(func, "topk_weights", topk_weights, (torch.float32,), (n, k))
            if on_cpu:
                per_rank, per_expert, in_rank = self._layout(topk_idx, num_experts)
                checks = [
                    ("is_token_in_rank", is_token_in_rank, in_rank),
                    ("num_tokens_per_rank", num_tokens_per_rank, per_rank),
                    ("num_tokens_per_expert", num_tokens_per_expert, per_expert),
                ]
        else:
            # no top-k: route by is_token_in_rank alone, one pseudo expert id per destination rank
            if w > MAX_EXPERTS_PER_TOKEN:
                raise bad_value(
                    func, "topk_idx", None, f"a tensor with more than {MAX_EXPERTS_PER_TOKEN} ranks"
                )
            k = w
            if on_cpu:
                checks = [
                    ("num_tokens_per_rank", num_tokens_per_rank, is_token_in_rank.sum(0, dtype=torch.int32))
                ]
        for name, got, want in checks:
            if not torch.equal(got, want):
                raise bad_value(
                    func, name, "a tensor that disagrees with the routing", "get_dispatch_layout's"
                )
        self._events_in(func, previous_event, async_finish, allocate_on_comm_stream)

        # every rank's token count, send counts and per-expert counts (one all-gather through the
        # symmetric heap; DeepEP also waits for the counts on the host): the operator's capacity,
        # the rank prefix matrix and where each row lands
        # (the last words: what every rank's call must have alike, compared before anything moves)
        words = [
            agreement.dtype_code(data.dtype),
            data.shape[1],
            0 if scales is None else scales.shape[1],
            agreement.dtype_code(None if scales is None else scales.dtype),
            int(topk_idx is not None),
            k,
            num_experts,
        ]
        hidden, elem = data.shape[1], max(data.element_size(), 2)
        scale_dim = math.ceil(hidden / FP8_GROUP)
        slot = self._next_slot(("normal", hidden, elem, e_local, k))
        num_channels = (config or self.get_dispatch_config(w)).num_sms // 2
        gathered, put = self._allgather_counts(n, num_tokens_per_rank, num_tokens_per_expert, words)
        send = None
        if put is not None:
            # the all-gather and the send side in one launch, for the operator of this shape if it
            # has room for this rank's tokens (every rank's count is checked below; if the operator
            # changes, the send side is made again)
            op = self._ops.get(("normal", hidden, elem, e_local, k, scale_dim, slot))
            m = op.max_num_tokens_to_send_per_rank() if op is not None else 0
            send = deepep_handle.send_side(
                is_token_in_rank, gathered, None, self.rank, m if m >= n else _pow2_at_least(n), num_channels,
                self._handle_impl, put=put,
            )  # fmt: skip
        # the operator's int32 expert ids, made while the all-gather runs on the device
        if topk_idx is not None:
            idx32 = topk_idx.to(torch.int32)
        else:  # no top-k: one pseudo expert id per destination rank
            first = (torch.arange(w, device=self.device, dtype=torch.int32) * e_local).expand(n, w)
            idx32 = torch.where(is_token_in_rank, first, -1).contiguous()
        table = gathered.cpu()
        # Python arithmetic: a torch op on these few CPU numbers took 5-30 us (profiled)
        rows_of = table.tolist()
        w0 = 1 + w  # the words' first column
        if any(r[w0 : w0 + len(words)] != words for r in rows_of):
            err = agreement.mismatch(
                func,
                "each dispatch call's arguments",
                _NORMAL_FIELDS,
                table[:, w0 : w0 + len(words)],
                self.rank,
            )
            raise err or MoriValueError(f"{func}: the ranks disagree on each dispatch call's arguments")
        if num_experts > self._expert_cap:
            # every rank's call has this many experts (just compared): all grow the table together
            # (collective) and repeat the all-gather with the per-expert counts
            self._expert_cap = _pow2_at_least(num_experts)
            if self._recv_views:  # the slot this call took is taken again
                key = ("normal", hidden, elem, e_local, k)
                self._slots[key] ^= 1
            return self.dispatch(
                x, None, num_tokens_per_rank, None, is_token_in_rank, num_tokens_per_expert, topk_idx,
                topk_weights, expert_alignment, num_worst_tokens, config, previous_event, async_finish,
                allocate_on_comm_stream,
            )  # fmt: skip
        m = _pow2_at_least(max(r[0] for r in rows_of))
        total = sum(r[1 + self.rank] for r in rows_of)
        rows = num_worst_tokens or total
        if num_worst_tokens and total > num_worst_tokens:
            raise bad_value(
                func, "num_worst_tokens", num_worst_tokens, f"at least the {total} rows this rank receives"
            )
        op = self._op("normal", m, hidden, elem, e_local, k, scale_dim, slot)
        # rows land where DeepEP puts them: source rank by source rank, each source's by token, so
        # the operator replays a layout made here instead of reserving slots (no reordering after)
        m_op = op.max_num_tokens_to_send_per_rank()
        if send is None or send.dest.shape[1] != m_op:
            send = deepep_handle.send_side(
                is_token_in_rank, gathered, table, self.rank, m_op, num_channels, self._handle_impl,
                per_rank=num_tokens_per_rank,
            )  # fmt: skip
        routing = EpDispatchRoutingHandle(send.dest, send.total, op.buffers.recv_src[:total], n)
        op.dispatch(data, topk_weights, scales, idx32, block_num=blocks, routing=routing)
        recv = deepep_handle.recv_side(
            gathered,
            table,
            self.rank,
            routing.recv_src_pos,
            op.max_num_tokens_to_send(),
            num_channels,
            rows,
            None if topk_idx is None else (op.buffers.recv_idx, op.buffers.recv_w, e_local, topk_idx.dtype),
            self._handle_impl,
            None if op._kern is None else op._kern.recv_slot,
        )
        # what combine needs of this dispatch after the operator's tables are overwritten
        routing.recv_src_pos = recv.recv_src_pos
        if recv.recv_slot is not None:
            routing.recv_slot = recv.recv_slot
        items = (
            recv.rank_prefix,
            send.channel_prefix,
            recv.recv_channel_prefix,
            recv.recv_src_idx,
            is_token_in_rank,
            send.send_head,
        )
        h = DispatchHandle(
            items,
            buffer=self,
            op=op,
            routing=routing,
            indices=idx32,
            num_recv_rows=rows,
            has_topk=topk_idx is not None,
        )
        recv_x = self._recv_rows(op.buffers.recv_tok, data.dtype, data.shape[1], total, rows)
        recv_scales = None
        if scales is not None:
            recv_scales = self._recv_rows(op.buffers.recv_scales, scales.dtype, scales.shape[1], total, rows)
        recv_idx, recv_w = recv.recv_idx, recv.recv_w
        base = deepep_handle.header_width(w) + self.rank * e_local
        counts: list[int] = []
        if not num_worst_tokens:
            per_local = map(sum, zip(*(r[base : base + e_local] for r in rows_of), strict=True))
            counts = [-(-c // expert_alignment) * expert_alignment for c in per_local]
        out_x = recv_x if recv_scales is None else (recv_x, recv_scales)
        return out_x, recv_idx, recv_w, counts, h, self._event_out(async_finish)

    def _next_slot(self, key: tuple[Any, ...]) -> int:
        """Which of the two operators of a shape the next normal dispatch uses: always 0, or
        alternating with receive views (so a view stays valid until the second dispatch after)."""
        if not self._recv_views:
            return 0
        slot = self._slots.get(key, 1) ^ 1
        self._slots[key] = slot
        return slot

    def _recv_rows(
        self, buf: torch.Tensor, dtype: torch.dtype, width: int, total: int, rows: int
    ) -> torch.Tensor:
        """The first ``total`` received rows of an operator buffer as ``dtype`` [rows, width]: a new
        tensor (zero padding past ``total``), or with receive views the buffer itself."""
        typed = buf[:, : width * dtype.itemsize].view(dtype)
        if self._recv_views and rows <= typed.shape[0]:
            if rows > total:
                typed[total:rows].zero_()
            return typed[:rows]
        out = torch.empty(rows, width, dtype=dtype, device=self.device)
        out[:total] = typed[:total]
        if rows > total:
            out[total:].zero_()
        return out

    def _check_handle(self, func: str, handle: Any) -> None:
        if not isinstance(handle, DispatchHandle) or handle._buffer is not self:
            raise bad_type(
                func,
                "handle",
                handle,
                "the handle this buffer's dispatch returned (a DispatchHandle, DeepEP's 6-tuple; a "
                "tuple rebuilt from its items lacks the routing)",
            )

    def _cached_dispatch(
        self,
        func: str,
        data: torch.Tensor,
        scales: torch.Tensor | None,
        handle: DispatchHandle,
        num_worst_tokens: int,
        blocks: int,
        async_finish: bool,
        weights: torch.Tensor | None = None,
    ) -> tuple[Any, ...]:
        """The replay of ``handle``'s layout; ``weights`` (the V2 layer's cached dispatch) are sent
        too and come back in place 2, masked to this rank's experts, else None as in DeepEP V1."""
        op = handle._op
        if data.shape[1] > op.config.hidden_dim or data.element_size() > op.config.max_token_type_size:
            raise bad_value(
                func,
                "x",
                f"[{data.shape[0]}, {data.shape[1]}] {data.dtype}",
                f"at most hidden {op.config.hidden_dim} with elements of at most "
                f"{op.config.max_token_type_size} bytes (the dispatch that made handle)",
            )
        total = handle.num_recv_tokens
        rows = num_worst_tokens or handle.num_recv_rows
        if rows < total:
            raise bad_value(func, "num_worst_tokens", num_worst_tokens, f"0 or at least {total}")
        op.dispatch(data, weights, scales, handle._indices, block_num=blocks, routing=handle._routing)
        out_x: Any = self._recv_rows(op.buffers.recv_tok, data.dtype, data.shape[1], total, rows)
        if scales is not None:
            out_x = (
                out_x,
                self._recv_rows(op.buffers.recv_scales, scales.dtype, scales.shape[1], total, rows),
            )
        recv_w = None
        if weights is not None:
            e_local = op.config.num_experts_per_rank
            glob = op.buffers.recv_idx[:total]
            local = glob.to(torch.int64) - self.rank * e_local
            mine = (glob >= 0) & (local >= 0) & (local < e_local)
            recv_w = torch.zeros(rows, weights.shape[1], dtype=torch.float32, device=self.device)
            recv_w[:total] = torch.where(mine, op.buffers.recv_w[:total], 0.0)
        return out_x, None, recv_w, None, None, self._event_out(async_finish)

    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        """Return each received row to its source rank and sum there (normal mode). Collective.

        Args:
            x: [handle.num_recv_rows, hidden] expert outputs in ``recv_x``'s row order (bf16, fp16,
                or fp32 when the dispatch was fp32); padding rows are ignored.
            handle: the :class:`DispatchHandle` of the dispatch.
            topk_weights: [handle.num_recv_rows, num_topk] float32 summed back the same way, or None.
            bias: a tensor or a tuple of two tensors [num_tokens, hidden] added to the result, or None.
            config, previous_event, async_finish, allocate_on_comm_stream: as for :meth:`dispatch`.

        Returns:
            ``(combined_x [num_tokens, hidden], combined_topk_weights [num_tokens, num_topk] | None,
            event)``: ``combined_x[t]`` is the unweighted fp32 sum of the rows of token ``t`` from
            every rank it went to, cast to ``x.dtype``.
        """
        func = "Buffer.combine"
        self._live(func)
        self._check_handle(func, handle)
        op = handle._op
        rows, total, n = handle.num_recv_rows, handle.num_recv_tokens, handle.num_tokens
        x = _tensor(func, "x", x, _COMBINE_DTYPES, (rows, None))
        if x.shape[1] > op.config.hidden_dim or x.element_size() > op.config.max_token_type_size:
            raise bad_value(
                func,
                "x",
                f"[{rows}, {x.shape[1]}] {x.dtype}",
                f"at most hidden {op.config.hidden_dim} with elements of at most "
                f"{op.config.max_token_type_size} bytes (the dispatch that made handle)",
            )
        k = op.config.num_experts_per_token
        if topk_weights is not None and not handle.has_topk:
            raise bad_value(func, "topk_weights", "a tensor", "None: the dispatch of handle had no top-k")
        if topk_weights is not None:
            topk_weights = _tensor(func, "topk_weights", topk_weights, (torch.float32,), (rows, k))
        biases: tuple[torch.Tensor, ...] = ()
        if bias is not None:
            biases = bias if isinstance(bias, tuple) else (bias,)
            if len(biases) > 2:
                raise bad_value(func, "bias", f"a tuple of {len(biases)}", "a tensor or a tuple of two")
            biases = tuple(
                _tensor(func, f"bias[{i}]", b, _COMBINE_DTYPES, (n, x.shape[1])) for i, b in enumerate(biases)
            )
        blocks = self._config_blocks(func, config)
        self._events_in(func, previous_event, async_finish, allocate_on_comm_stream)
        # the rows are in the operator's order already (see dispatch): no reordering
        wts = None if topk_weights is None else topk_weights[:total]
        out, out_w = op.combine(x[:total], wts, handle._indices, block_num=blocks, routing=handle._routing)
        combined = out[:n]
        if biases:
            acc = combined.float()
            for b in biases:
                acc = acc + b.float()
            combined = acc.to(x.dtype)
        combined_w = None if out_w is None else out_w[:n]
        return combined, combined_w, self._event_out(async_finish)

    # -- low-latency mode ---------------------------------------------------------------------

    def _ll_check(self, func: str) -> None:
        self._live(func)
        if not self.low_latency_mode:
            raise MoriStateError(f"{func}: the buffer was built with low_latency_mode=False")

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ) -> tuple[Any, torch.Tensor, LowLatencyHandle, EventOverlap, Callable[[], None] | None]:
        """Send tokens to their experts, packed expert-major (low-latency mode). Collective.

        Args:
            x: [num_tokens, hidden] bf16, ``num_tokens <= num_max_dispatch_tokens_per_rank``;
                ``hidden`` a multiple of 128 with ``use_fp8``.
            topk_idx: [num_tokens, num_topk] int64/int32 global expert ids, ``-1`` = none.
            num_max_dispatch_tokens_per_rank: the same on every rank.
            num_experts: experts over all ranks (a multiple of the number of ranks).
            cumulative_local_expert_recv_stats: int32 [num_local_experts] to which ``recv_count``
                is added, or None.
            dispatch_wait_recv_cost_stats: int64 [num_ranks] or None; left unchanged.
            use_fp8: send fp8 e4m3fn with one fp32 scale per 128 channels (DeepEP's rule).
            round_scale: round the scales up to powers of two.
            use_ue8m0: return the (rounded) scales as packed UE8M0 exponents, int32 [..., hidden /
                512]; needs ``round_scale``.
            async_finish: return a (complete) event.
            return_recv_hook: return a hook that completes the receive: the outputs are valid only
                after calling it.

        Returns:
            ``(recv_x, recv_count, handle, event, hook)``: ``recv_x`` bf16 [num_local_experts,
            num_ranks * num_max_dispatch_tokens_per_rank, hidden], or with ``use_fp8``
            ``(float8_e4m3fn [...same...], scales float32 [num_local_experts, num_ranks * max,
            hidden / 128])`` (scales stored column-major in the last two dimensions, as DeepEP);
            rows of local expert ``e`` are its tokens from rank 0, then rank 1, ..., each rank's
            by token index; ``recv_count`` int32 [num_local_experts]; ``hook`` None unless
            ``return_recv_hook``.
        """
        func = "Buffer.low_latency_dispatch"
        self._ll_check(func)
        w = self.group_size
        m = _int(func, "num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1)
        num_experts = self._num_experts(func, "num_experts", num_experts)
        e_local = num_experts // w
        x = _tensor(func, "x", x, (torch.bfloat16,), (None, None))
        if x.device != self.device:
            raise bad_value(func, "x.device", x.device, f"{self.device} (the buffer's)")
        n, hidden = x.shape
        if n > m:
            raise bad_value(func, "x.shape[0]", n, f"at most num_max_dispatch_tokens_per_rank = {m}")
        topk_idx = self._check_topk_idx(func, topk_idx, num_experts, n)
        k = topk_idx.shape[1]
        if cumulative_local_expert_recv_stats is not None:
            _tensor(
                func,
                "cumulative_local_expert_recv_stats",
                cumulative_local_expert_recv_stats,
                (torch.int32,),
                (e_local,),
            )
        if dispatch_wait_recv_cost_stats is not None:
            _wait_stats(func, "dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats, w)
        use_fp8 = _bool(func, "use_fp8", use_fp8)
        round_scale = _bool(func, "round_scale", round_scale)
        use_ue8m0 = _bool(func, "use_ue8m0", use_ue8m0)
        _bool(func, "async_finish", async_finish)
        return_recv_hook = _bool(func, "return_recv_hook", return_recv_hook)
        if use_fp8 and hidden % FP8_GROUP:
            raise bad_value(func, "x.shape[1]", hidden, f"a multiple of {FP8_GROUP} with use_fp8=True")
        if use_ue8m0 and not (use_fp8 and round_scale):
            raise bad_value(func, "use_ue8m0", True, "False unless use_fp8=True and round_scale=True")
        if use_ue8m0 and hidden % (4 * FP8_GROUP):
            raise bad_value(func, "x.shape[1]", hidden, f"a multiple of {4 * FP8_GROUP} with use_ue8m0=True")

        scale_dim = hidden // FP8_GROUP if hidden % FP8_GROUP == 0 else 0
        op = self._op("low_latency", m, hidden, 2, e_local, k, scale_dim)
        payload, scales = x, None
        if use_fp8:
            payload, scale_inv = _fp8_quantise(x, round_scale)
            scales = _ue8m0_pack(scale_inv) if use_ue8m0 else scale_inv
        idx32 = topk_idx.to(torch.int32)
        outs = op.dispatch(payload, None, scales, idx32, return_routing=True)
        routing: EpDispatchRoutingHandle = outs[5]
        total = routing.num_recv
        # keep what the receive needs: the operator's buffers belong to its next dispatch
        rows = outs[0][:total].to(self.device).clone()
        rows_sc = None if scales is None else outs[2][:total].to(self.device).clone()
        glob = outs[3][:total].to(self.device).clone()
        pos = routing.recv_src_pos[:total].to(device=self.device, dtype=torch.int64)

        slots = w * m
        dev = self.device
        recv_x = torch.empty(e_local, slots, hidden, dtype=payload.dtype, device=dev)
        recv_sc: torch.Tensor | None = None
        if scales is not None:  # DeepEP's layout: [E, S, slots] storage, transposed to [E, slots, S]
            recv_sc = torch.empty(e_local, scales.shape[1], slots, dtype=scales.dtype, device=dev).transpose(
                1, 2
            )
        recv_count = torch.zeros(e_local, dtype=torch.int32, device=dev)
        info = torch.full((e_local, slots), -1, dtype=torch.int32, device=dev)
        layout_range = torch.zeros(e_local, w, dtype=torch.int64, device=dev)
        handle = LowLatencyHandle(
            (info, layout_range, m, hidden, num_experts), buffer=self, op=op, routing=routing, indices=idx32
        )
        span = op.max_num_tokens_to_send()

        def receive() -> None:
            if handle.received:
                raise MoriStateError(f"{func}: the receive hook was already called")
            local = glob.to(torch.int64) - self.rank * e_local
            valid = (glob >= 0) & (local >= 0) & (local < e_local)
            row_i, k_i = valid.nonzero(as_tuple=True)
            le = local[row_i, k_i]
            order = torch.argsort(le * (w * span) + pos[row_i])  # by local expert, then (rank, token)
            row_i, k_i, le = row_i[order], k_i[order], le[order]
            count = torch.bincount(le, minlength=e_local)
            start = torch.cumsum(count, 0) - count
            j = torch.arange(le.numel(), device=dev) - start[le]
            recv_x.zero_()
            recv_x[le, j] = rows[row_i].view(payload.dtype)
            if recv_sc is not None and rows_sc is not None:
                recv_sc.zero_()
                recv_sc[le, j] = rows_sc[row_i]
            src_rank, src_tok = pos[row_i] // span, pos[row_i] % span
            info[le, j] = src_tok.to(torch.int32)
            per_src = torch.bincount(le * w + src_rank, minlength=e_local * w).view(e_local, w)
            begin = torch.cumsum(per_src, 1) - per_src  # first packed row of each source, per expert
            layout_range.copy_((begin << 32) | per_src)
            handle._pairs = (row_i, k_i, le, j)
            recv_count.copy_(count.to(torch.int32))
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats.add_(recv_count)

        hook: Callable[[], None] | None = None
        if return_recv_hook:
            hook = receive
        else:
            receive()
        out_x: Any = recv_x if recv_sc is None else (recv_x, recv_sc)
        return out_x, recv_count, handle, self._event_out(async_finish), hook

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """A bf16 [num_local_experts, num_ranks * max_tokens, hidden] tensor to write the expert
        outputs into, for ``low_latency_combine(..., zero_copy=True)``."""
        func = "Buffer.get_next_low_latency_combine_buffer"
        self._ll_check(func)
        if not isinstance(handle, LowLatencyHandle) or handle._buffer is not self:
            raise bad_type(
                func, "handle", handle, "a LowLatencyHandle from this buffer's low_latency_dispatch"
            )
        shape = (
            handle.num_experts // self.group_size,
            self.group_size * handle.num_max_dispatch_tokens_per_rank,
            handle.hidden,
        )
        buf = self._combine_bufs.get(shape)
        if buf is None:
            buf = torch.zeros(shape, dtype=torch.bfloat16, device=self.device)
            self._combine_bufs[shape] = buf
        return buf

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
        combine_wait_recv_cost_stats: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, EventOverlap, Callable[[], None] | None]:
        """Return expert outputs to their tokens' ranks and sum them weighted (low-latency mode).

        Collective.

        Args:
            x: bf16 [num_local_experts, num_ranks * max_tokens, hidden] expert outputs in
                ``recv_x``'s packing (rows past ``recv_count`` are ignored).
            topk_idx: the dispatch's ``topk_idx`` [num_tokens, num_topk].
            topk_weights: float32 [num_tokens, num_topk] gating weights.
            handle: the :class:`LowLatencyHandle` of the dispatch (its receive completed).
            use_logfmt: accepted; the wire stays bf16.
            zero_copy: ``x`` is the tensor from :meth:`get_next_low_latency_combine_buffer`.
            async_finish: return a (complete) event.
            return_recv_hook: ``combined_x`` is written only when the returned hook is called.
            out: bf16 [num_tokens, hidden] to write the result into, or None.
            combine_wait_recv_cost_stats: int64 [num_ranks] or None; left unchanged.

        Returns:
            ``(combined_x bf16 [num_tokens, hidden], event, hook)``: ``combined_x[t] = sum_k
            topk_weights[t, k] * expert_output(t, k)`` over ``topk_idx[t, k] != -1``.
        """
        func = "Buffer.low_latency_combine"
        self._ll_check(func)
        if not isinstance(handle, LowLatencyHandle) or handle._buffer is not self:
            raise bad_type(
                func, "handle", handle, "a LowLatencyHandle from this buffer's low_latency_dispatch"
            )
        if not handle.received:
            raise MoriStateError(f"{func}: the dispatch's receive hook was not called yet")
        w, e_local = self.group_size, handle.num_experts // self.group_size
        slots, hidden = w * handle.num_max_dispatch_tokens_per_rank, handle.hidden
        x = _tensor(func, "x", x, (torch.bfloat16,), (e_local, slots, hidden))
        n, k = handle._indices.shape
        topk_idx = self._check_topk_idx(func, topk_idx, handle.num_experts, n)
        if topk_idx.shape[1] != k or not torch.equal(topk_idx.to(torch.int32), handle._indices):
            raise bad_value(
                func, "topk_idx", "a different routing", "the topk_idx of the dispatch that made handle"
            )
        topk_weights = _tensor(func, "topk_weights", topk_weights, (torch.float32,), (n, k))
        _bool(func, "use_logfmt", use_logfmt)
        if _bool(func, "zero_copy", zero_copy):
            buf = self._combine_bufs.get((e_local, slots, hidden))
            if buf is None or x.data_ptr() != buf.data_ptr():
                raise bad_value(
                    func,
                    "x",
                    "another tensor",
                    "get_next_low_latency_combine_buffer(handle) with zero_copy=True",
                )
        _bool(func, "async_finish", async_finish)
        return_recv_hook = _bool(func, "return_recv_hook", return_recv_hook)
        if out is not None:
            out = _tensor(func, "out", out, (torch.bfloat16,), (n, hidden))
        if combine_wait_recv_cost_stats is not None:
            _wait_stats(func, "combine_wait_recv_cost_stats", combine_wait_recv_cost_stats, w)

        op, routing = handle._op, handle._routing
        # 1. the gating weights to the expert ranks: the dispatch's layout, the weights as payload
        dummy = torch.zeros(n, 1, dtype=torch.bfloat16, device=self.device)
        wouts = op.dispatch(dummy, topk_weights, None, handle._indices, routing=routing)
        total = routing.num_recv
        assert handle._pairs is not None
        row_i, k_i, le, j = handle._pairs
        # 2. per received row, the weighted sum of this rank's experts' outputs for that token
        w_recv = wouts[1][:total].to(self.device)
        y = torch.zeros(total, hidden, dtype=torch.float32, device=self.device)
        y.index_add_(0, row_i, x[le, j].float() * w_recv[row_i, k_i][:, None])
        # 3. back to the source ranks, summed over destination ranks
        res, _ = op.combine(y.to(torch.bfloat16), None, handle._indices, routing=routing)
        combined = (
            out if out is not None else torch.empty(n, hidden, dtype=torch.bfloat16, device=self.device)
        )
        done = [False]

        def receive() -> None:
            if done[0]:
                raise MoriStateError(f"{func}: the receive hook was already called")
            done[0] = True
            combined.copy_(res[:n])

        hook: Callable[[], None] | None = None
        if return_recv_hook:
            hook = receive
        else:
            receive()
        return combined, self._event_out(async_finish), hook

    def clean_low_latency_buffer(
        self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int
    ) -> None:
        """Nothing to clean: MORI's buffers reset themselves. Arguments are validated."""
        func = "Buffer.clean_low_latency_buffer"
        self._ll_check(func)
        _int(func, "num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1)
        _int(func, "hidden", hidden, 1)
        self._num_experts(func, "num_experts", num_experts)

    # -- the rest of DeepEP's public surface ------------------------------------------------------

    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: every feature DeepEP guards with its SM90 build (fp8 dispatch, low-latency mode,
        TMA-friendly scale layouts) is available here on every device, CPU runtime included."""
        return is_sm90_compiled()

    def get_local_buffer_tensor(
        self,
        dtype: torch.dtype,
        size: torch.Size | None = None,
        offset: int = 0,
        use_rdma_buffer: bool = False,
    ) -> torch.Tensor:
        """Not available: MORI has no raw communication buffer of ``num_nvl_bytes`` (its operators
        size their symmetric buffers per call from the shapes). Raises
        :class:`~mori.core.errors.MoriBackendError`."""
        raise MoriBackendError(
            "Buffer.get_local_buffer_tensor: MORI sizes its symmetric buffers per call from the shapes and "
            "has no raw NVLink/RDMA buffer to return; allocate symmetric memory with "
            "mori.shmem.mori_shmem_create_tensor instead"
        )

    def internode_dispatch(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """DeepEP's inter-node normal dispatch (DeepEP calls it from ``dispatch`` with more than one
        node). One node only here: raises :class:`~mori.core.errors.MoriBackendError`."""
        raise MoriBackendError(
            "Buffer.internode_dispatch: inter-node normal mode needs MORI's network transport (not yet "
            "available); on one node call dispatch"
        )

    def internode_combine(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """See :meth:`internode_dispatch`: raises :class:`~mori.core.errors.MoriBackendError`."""
        raise MoriBackendError(
            "Buffer.internode_combine: inter-node normal mode needs MORI's network transport (not yet "
            "available); on one node call combine"
        )

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """DeepEP's shrink mode (mask a failed rank). Needs ``enable_shrink=True``, which MORI does
        not support (every rank takes part in every call): raises
        :class:`~mori.core.errors.MoriStateError`."""
        self._no_shrink("Buffer.low_latency_update_mask_buffer")

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """See :meth:`low_latency_update_mask_buffer`: raises."""
        self._no_shrink("Buffer.low_latency_query_mask_buffer")

    def low_latency_clean_mask_buffer(self) -> None:
        """See :meth:`low_latency_update_mask_buffer`: raises."""
        self._no_shrink("Buffer.low_latency_clean_mask_buffer")

    def _no_shrink(self, func: str) -> None:
        raise MoriStateError(f"{func}: needs enable_shrink=True, which MORI does not support")


def is_sm90_compiled() -> bool:
    """DeepEP's ``deep_ep_cpp.is_sm90_compiled``: True (see :meth:`Buffer.is_sm90_compiled`)."""
    return True


def get_low_latency_rdma_size_hint(
    num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
) -> int:
    """DeepEP's module-level ``get_low_latency_rdma_size_hint`` (:meth:`Buffer.get_low_latency_rdma_size_hint`)."""
    return Buffer.get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts
    )


#: the DeepEP V1 API version this module follows, as ``deep_ep.__version__`` (``+mori`` marks ours)
__version__ = "1.2.1+mori"


def install_as_deep_ep(force: bool = False) -> types.ModuleType:
    """Make ``import deep_ep`` (and ``deep_ep.buffer``, ``deep_ep.utils``) resolve to this module,
    so an engine written for DeepEP runs on MORI unchanged. Returns the module.

    Changes only ``sys.modules``. If another ``deep_ep`` is imported already, raises
    :class:`~mori.core.errors.MoriStateError` unless ``force=True`` (objects made by it keep
    working with it; new imports get MORI's).
    """
    me = sys.modules[__name__]
    names = ("deep_ep", "deep_ep.buffer", "deep_ep.utils")
    other = [n for n in names if n in sys.modules and sys.modules[n] is not me]
    if other and not force:
        raise MoriStateError(
            f"install_as_deep_ep: {', '.join(other)} is imported already (from "
            f"{getattr(sys.modules[other[0]], '__file__', '?')}); pass force=True to replace it"
        )
    for n in names:
        sys.modules[n] = me
    return me

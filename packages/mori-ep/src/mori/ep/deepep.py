"""DeepEP-compatible expert-parallel layer: ``Buffer``, ``Config``, ``EventOverlap`` (DeepEP V1 API).

An engine written for DeepEP switches by changing its import::

    from mori.ep.deepep import Buffer, Config, EventOverlap   # was: from deep_ep import ...

The names, parameters, defaults and return tuples follow DeepEP's V1 Python API
(``deep_ep.Buffer``): normal mode (``get_dispatch_layout``, ``dispatch``, ``combine``) and
low-latency mode (``low_latency_dispatch``, ``low_latency_combine``). The communication is done by
MORI's :class:`~mori.ep.EpDispatchCombineOp` (kernel type ``IntraNode``, with routing handles);
this layer validates, converts routing ids, reorders rows into DeepEP's layouts and keeps the
handles. It uses only torch operations on the operator's outputs (no loops over tokens), on the
device of the operator's tensors.

Semantics, as in DeepEP:

* normal ``dispatch`` returns the received rows grouped by source rank in rank order, and within a
  source rank in ascending source-token order; ``recv_topk_idx`` holds local expert ids (``-1`` for
  experts on other ranks, whose ``recv_topk_weights`` are 0); ``num_recv_tokens_per_expert_list``
  counts received tokens per local expert, each rounded up to ``expert_alignment``; the handle
  holds the rank prefix matrix (``rank_prefix_matrix[i, j]`` = tokens ranks ``0..i`` send to rank
  ``j``); passing ``handle`` repeats the layout with a new payload (cached dispatch);
  ``num_worst_tokens > 0`` pads the outputs to that many rows;
* normal ``combine`` is an unweighted sum over the ranks a token went to (fp32, cast once), and sums
  ``topk_weights`` back the same way;
* ``low_latency_dispatch`` packs expert-major, ``[num_local_experts, num_ranks *
  num_max_dispatch_tokens_per_rank, hidden]``, with ``recv_count`` per local expert, optionally in
  fp8 e4m3fn with one fp32 scale per 128 channels (``amax / 448``, DeepEP's rule, optionally rounded
  to a power of two or packed as UE8M0); ``low_latency_combine`` returns, for each token, the sum of
  its experts' outputs weighted by ``topk_weights``.

Differences from DeepEP that remain (also in ``docs/ep_deepep.md``):

* **Communication backend.** Buffers come from the ``mori.shmem`` symmetric heap
  (``MORI_SHMEM_HEAP_SIZE``), sized per call from the shapes; ``num_nvl_bytes``/``num_rdma_bytes``
  are validated and kept but size nothing. If ``mori.shmem`` is not initialised, the constructor
  initialises it over ``group`` (rank 0 of the group makes a unique id and broadcasts it over the
  group; ``shmem_init_attr`` on every rank) and :meth:`Buffer.destroy` finalises it again; if it is
  initialised already, its PEs must be the group's ranks. ``group=None`` uses the initialised
  ``mori.shmem`` world (DeepEP needs a group or an MPI ``comm``).
* **One node only** (what the operator implements today): ``num_tokens_per_rdma_rank`` is always
  None, there are no RDMA ranks.
* **Host-blocking.** Every call returns with its results complete (the CPU runtime has no streams):
  ``async_finish=True`` returns an event that is already complete, ``previous_event`` is waited
  for first, ``allocate_on_comm_stream`` is validated only. ``Config`` and ``num_sms`` are
  validated; ``Config.num_sms`` is passed to the operator as its block count. A normal dispatch
  exchanges every rank's token count and send counts through the symmetric heap (one barrier): the
  rank prefix matrix and the operator's capacity come from it (DeepEP also waits for the counts on
  the host unless ``num_worst_tokens`` is given).
* **The handles** are documented classes (:class:`DispatchHandle`, :class:`LowLatencyHandle`), not
  tuples; DeepEP's channel prefix matrices and ``send_head`` do not exist (rows are not
  split into channels).
* **topk**: at most 9 experts per token (``MAX_EXPERTS_PER_TOKEN``); ``topk_idx`` int64 or int32
  (DeepEP: ``topk_idx_t``); a normal dispatch without ``topk_idx`` (by ``is_token_in_rank``
  alone) needs at most 9 ranks; ``is_token_in_rank``, ``num_tokens_per_rank`` and
  ``num_tokens_per_expert`` must be what :meth:`Buffer.get_dispatch_layout` returns for
  ``topk_idx`` (checked).
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
* ``get_local_buffer_tensor``, ``enable_shrink``, MNNVL/fabric and the V2 ``ElasticBuffer`` are not
  provided; ``clean_low_latency_buffer`` is a validated no-op (MORI's buffers self-reset).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

import mori.shmem as shmem
from mori.core.errors import MoriStateError, bad_type, bad_value
from mori.ep.config import MAX_EXPERTS_PER_TOKEN, EpDispatchCombineConfig, EpDispatchCombineKernelType
from mori.ep.op import IMPLS, EpDispatchCombineOp, EpDispatchRoutingHandle

__all__ = [
    "Buffer",
    "Config",
    "DispatchHandle",
    "EventHandle",
    "EventOverlap",
    "LowLatencyHandle",
    "topk_idx_t",
]

#: dtype of ``topk_idx`` that DeepEP uses by default (int32 is accepted too)
topk_idx_t = torch.int64
#: channels per fp8 scale in low-latency mode (and DeepEP's per-token-group fp8 recipe)
FP8_GROUP = 128
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


class DispatchHandle:
    """Layout of one normal-mode dispatch: pass it to ``combine`` and to a cached ``dispatch``.

    Attributes:
        rank_prefix_matrix: int32 [num_ranks, num_ranks]; ``[i, j]`` = tokens that ranks ``0..i``
            send to rank ``j``. Rows from source rank ``s`` are received rows
            ``rank_prefix_matrix[s - 1, rank] .. rank_prefix_matrix[s, rank]``.
        recv_src_idx: int32 [num_recv_tokens]: index of each received row's token on its source rank.
        is_token_in_rank: bool [num_tokens, num_ranks]: the sent layout.
        num_recv_tokens: valid received rows.
        num_recv_rows: rows of ``recv_x`` (``num_worst_tokens`` if that was given, else
            ``num_recv_tokens``); ``combine``'s ``x`` has this many rows.
        num_tokens: tokens this rank dispatched.
    """

    def __init__(
        self,
        buffer: Buffer,
        op: EpDispatchCombineOp,
        routing: EpDispatchRoutingHandle,
        indices: torch.Tensor,
        perm: torch.Tensor,
        rank_prefix_matrix: torch.Tensor,
        recv_src_idx: torch.Tensor,
        is_token_in_rank: torch.Tensor,
        num_recv_rows: int,
    ) -> None:
        self.rank_prefix_matrix = rank_prefix_matrix
        self.recv_src_idx = recv_src_idx
        self.is_token_in_rank = is_token_in_rank
        self.num_recv_tokens = int(perm.numel())
        self.num_recv_rows = int(num_recv_rows)
        self.num_tokens = int(indices.shape[0])
        #: whether the dispatch had topk_idx / topk_weights
        self.has_topk = True
        self._buffer, self._op, self._routing, self._indices = buffer, op, routing, indices
        self._perm = perm  # recv row i <- operator row perm[i]
        self._inv = torch.argsort(perm)  # operator row r <- recv row inv[r]

    def __repr__(self) -> str:
        return f"DispatchHandle(num_tokens={self.num_tokens}, num_recv_tokens={self.num_recv_tokens})"


class LowLatencyHandle:
    """Source information of one ``low_latency_dispatch``: pass it to ``low_latency_combine``.

    Attributes:
        packed_recv_src_info: int32 [num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank]:
            index of each packed row's token on its source rank (-1 past ``recv_count``).
        packed_recv_layout_range: int64 [num_local_experts, num_ranks]: ``(begin << 32) | count``,
            the packed rows of each local expert that came from each source rank.
        num_max_dispatch_tokens_per_rank, hidden, num_experts: the dispatch's sizes.
    """

    def __init__(
        self,
        buffer: Buffer,
        op: EpDispatchCombineOp,
        routing: EpDispatchRoutingHandle,
        indices: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        hidden: int,
        num_experts: int,
    ) -> None:
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        self.hidden = hidden
        self.num_experts = num_experts
        self.packed_recv_src_info: torch.Tensor | None = None  # set when the receive completes
        self.packed_recv_layout_range: torch.Tensor | None = None
        self._buffer, self._op, self._routing, self._indices = buffer, op, routing, indices
        # per (received row, top-k slot) pair, sorted by (local expert, source): operator row,
        # top-k slot, local expert, packed row
        self._pairs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def received(self) -> bool:
        """False until the receive hook of a ``return_recv_hook=True`` dispatch was called."""
        return self._pairs is not None

    def __repr__(self) -> str:
        return (
            f"LowLatencyHandle(num_max_dispatch_tokens_per_rank={self.num_max_dispatch_tokens_per_rank}, "
            f"hidden={self.hidden}, num_experts={self.num_experts}, received={self.received})"
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
    want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape, strict=True)):
        raise bad_value(func, f"{name}.shape", list(t.shape), want)
    return t


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
        # small symmetric tables to all-gather per-call counts, by row width (made on first use)
        self._tables: dict[int, tuple[torch.Tensor, list[torch.Tensor], list[int]]] = {}
        self.device = self._table(1)[0].device
        self._ops: dict[tuple[Any, ...], EpDispatchCombineOp] = {}
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

    def _table(self, width: int) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
        """Symmetric int64 [2, group_size, width], its peers' views and a call counter. The first
        use of a width allocates it: collective (every rank needs the same widths in the same order)."""
        entry = self._tables.get(width)
        if entry is None:
            t = shmem.mori_shmem_create_tensor((2, self.group_size, width), torch.int64)
            t.zero_()
            peers = [
                t if p == self.rank else shmem.symm_mori_shmem_tensor(t, p) for p in range(self.group_size)
            ]
            entry = (t, peers, [0])
            self._tables[width] = entry
            shmem.shmem_barrier_all()  # zeroed everywhere before anyone writes
        return entry

    def _allgather(self, row: torch.Tensor) -> torch.Tensor:
        """All-gather one int64 row from every rank -> [group_size, row.numel()]. Collective.

        Two tables alternate: a rank reuses one only after the next call's barrier, which every
        rank reaches after reading it."""
        table, peers, calls = self._table(row.numel())
        par = calls[0] % 2
        calls[0] += 1
        for peer in peers:
            peer[par, self.rank] = row
        shmem.shmem_barrier_on_stream()
        return table[par].clone()

    def _op(
        self, kind: str, m: int, hidden: int, elem_bytes: int, e_local: int, k: int, scale_dim: int
    ) -> EpDispatchCombineOp:
        key = (kind, hidden, elem_bytes, e_local, k, scale_dim)
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
            op = EpDispatchCombineOp(
                cfg, impl=self._impl
            )  # collective: every rank reaches here with the same key
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
        if t.numel() and bool(((t < -1) | (t >= num_experts)).any()):
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
        w, e_local = self.group_size, num_experts // self.group_size
        n = topk_idx.shape[0]
        valid = topk_idx >= 0
        experts = topk_idx[valid].long()
        per_expert = torch.bincount(experts, minlength=num_experts).to(torch.int32)
        ranks = torch.where(valid, topk_idx // e_local, w).long()
        in_rank = torch.zeros(n, w + 1, dtype=torch.bool, device=topk_idx.device)
        in_rank.scatter_(1, ranks, True)
        in_rank = in_rank[:, :w].contiguous()
        per_rank = in_rank.sum(0, dtype=torch.int32)
        return per_rank, per_expert, in_rank

    # -- normal mode --------------------------------------------------------------------------

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, None, torch.Tensor, torch.Tensor, EventOverlap]:
        """Count what a dispatch of ``topk_idx`` sends. Local (not collective).

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
                must be None: one node). Required unless ``handle`` is given.
            topk_idx: [num_tokens, num_topk] int64/int32 global expert ids, ``-1`` = none; or None
                (with ``topk_weights`` None) to send by ``is_token_in_rank`` alone (at most 9
                ranks): ``recv_topk_idx`` and ``recv_topk_weights`` are then None.
            topk_weights: [num_tokens, num_topk] float32, or None with ``topk_idx``.
            expert_alignment: round each entry of ``num_recv_tokens_per_expert_list`` up to this.
            num_worst_tokens: if > 0, pad the outputs to this many rows (it must be at least the
                received count) and return an empty ``num_recv_tokens_per_expert_list``.
            config: a :class:`Config` (``num_sms`` becomes the operator's block count) or None.
            previous_event, async_finish, allocate_on_comm_stream: see the module docstring.

        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle,
            event)``: ``recv_x`` [rows, hidden] (or ``(recv_x, recv_x_scales)``), rows grouped by
            source rank in rank order, by source token within a rank; ``recv_topk_idx`` [rows,
            num_topk] local expert ids (-1 for other ranks' experts and padding rows);
            ``recv_topk_weights`` [rows, num_topk] float32 (0 where ``recv_topk_idx`` is -1);
            the list: received tokens per local expert (python ints; the sum over ranks of
            ``num_tokens_per_expert`` for this rank's experts, as DeepEP). A cached dispatch returns
            ``(recv_x, None, None, None, None, event)``.
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
            if not isinstance(handle, DispatchHandle) or handle._buffer is not self:
                raise bad_type(func, "handle", handle, "a DispatchHandle from this buffer's dispatch")
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
        if topk_idx is not None:
            topk_idx = self._check_topk_idx(func, topk_idx, num_experts, n)
            k = topk_idx.shape[1]
            topk_weights = _tensor(func, "topk_weights", topk_weights, (torch.float32,), (n, k))
            per_rank, per_expert, in_rank = self._layout(topk_idx, num_experts)
            checks = [
                ("is_token_in_rank", is_token_in_rank, in_rank),
                ("num_tokens_per_rank", num_tokens_per_rank, per_rank),
                ("num_tokens_per_expert", num_tokens_per_expert, per_expert),
            ]
            idx32 = topk_idx.to(torch.int32)
        else:
            # no top-k: route by is_token_in_rank alone, one pseudo expert id per destination rank
            if w > MAX_EXPERTS_PER_TOKEN:
                raise bad_value(
                    func, "topk_idx", None, f"a tensor with more than {MAX_EXPERTS_PER_TOKEN} ranks"
                )
            k, in_rank = w, is_token_in_rank
            per_rank = in_rank.sum(0, dtype=torch.int32)
            checks = [("num_tokens_per_rank", num_tokens_per_rank, per_rank)]
            first = (torch.arange(w, device=self.device, dtype=torch.int32) * e_local).expand(n, w)
            idx32 = torch.where(in_rank, first, -1).contiguous()
        for name, got, want in checks:
            if not torch.equal(got, want):
                raise bad_value(
                    func, name, "a tensor that disagrees with the routing", "get_dispatch_layout's"
                )
        self._events_in(func, previous_event, async_finish, allocate_on_comm_stream)

        # every rank's token count, send counts and per-expert counts: the operator's capacity, the
        # prefix matrix and the per-expert receive counts (as DeepEP sums num_tokens_per_expert)
        row = torch.cat(
            [
                torch.tensor([n], device=self.device),
                per_rank.to(torch.int64),
                num_tokens_per_expert.to(device=self.device, dtype=torch.int64),
            ]
        )
        table = self._allgather(row)
        m = _pow2_at_least(int(table[:, 0].max()))
        hidden, elem = data.shape[1], max(data.element_size(), 2)
        op = self._op("normal", m, hidden, elem, e_local, k, math.ceil(hidden / FP8_GROUP))
        outs = op.dispatch(data, topk_weights, scales, idx32, block_num=blocks, return_routing=True)
        routing: EpDispatchRoutingHandle = outs[5]
        total = routing.num_recv
        prefix = torch.cumsum(table[:, 1 : 1 + w], dim=0).to(torch.int32)
        if int(prefix[-1, self.rank]) != total:
            raise MoriStateError(
                f"{func}: rank {self.rank} received {total} rows but the ranks announced "
                f"{int(prefix[-1, self.rank])}"
            )
        pos = routing.recv_src_pos[:total].to(device=self.device, dtype=torch.int64)
        perm = torch.argsort(pos)  # flat positions sort by (source rank, source token)
        _, src_tok = op.decode_send_flat_idx(pos[perm])
        rows = num_worst_tokens or total
        if num_worst_tokens and total > num_worst_tokens:
            raise bad_value(
                func, "num_worst_tokens", num_worst_tokens, f"at least the {total} rows this rank receives"
            )
        recv_x = self._gather_rows(outs[0], perm, rows)
        recv_scales = None if scales is None else self._gather_rows(outs[2], perm, rows)
        recv_idx: torch.Tensor | None = None
        recv_w: torch.Tensor | None = None
        if topk_idx is not None:
            glob = outs[3][:total].index_select(0, perm.to(outs[3].device)).to(self.device)
            local = glob.to(torch.int64) - self.rank * e_local
            mine = (glob >= 0) & (local >= 0) & (local < e_local)
            recv_idx = torch.full((rows, k), -1, dtype=topk_idx.dtype, device=self.device)
            recv_idx[:total] = torch.where(mine, local, -1).to(topk_idx.dtype)
            recv_w = torch.zeros(rows, k, dtype=torch.float32, device=self.device)
            wts = outs[1][:total].index_select(0, perm.to(outs[1].device)).to(self.device)
            recv_w[:total] = torch.where(mine, wts, torch.zeros_like(wts))
        base = 1 + w + self.rank * e_local
        per_local = table[:, base : base + e_local].sum(0)
        aligned = (per_local + expert_alignment - 1) // expert_alignment * expert_alignment
        counts: list[int] = [] if num_worst_tokens else [int(c) for c in aligned.tolist()]
        h = DispatchHandle(self, op, routing, idx32, perm, prefix, src_tok.to(torch.int32), in_rank, rows)
        h.has_topk = topk_idx is not None
        out_x = recv_x if recv_scales is None else (recv_x, recv_scales)
        return out_x, recv_idx, recv_w, counts, h, self._event_out(async_finish)

    def _gather_rows(self, buf: torch.Tensor, perm: torch.Tensor, rows: int) -> torch.Tensor:
        """Rows ``perm`` of an operator output, in that order, padded with zeros to ``rows``."""
        total = perm.numel()
        out = torch.zeros(rows, *buf.shape[1:], dtype=buf.dtype, device=self.device)
        out[:total] = buf[:total].index_select(0, perm.to(buf.device)).to(self.device)
        return out

    def _cached_dispatch(
        self,
        func: str,
        data: torch.Tensor,
        scales: torch.Tensor | None,
        handle: DispatchHandle,
        num_worst_tokens: int,
        blocks: int,
        async_finish: bool,
    ) -> tuple[Any, ...]:
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
        outs = op.dispatch(data, None, scales, handle._indices, block_num=blocks, routing=handle._routing)
        recv_x = self._gather_rows(outs[0], handle._perm, rows)
        out_x: Any = recv_x
        if scales is not None:
            out_x = (recv_x, self._gather_rows(outs[2], handle._perm, rows))
        return out_x, None, None, None, None, self._event_out(async_finish)

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
        if not isinstance(handle, DispatchHandle) or handle._buffer is not self:
            raise bad_type(func, "handle", handle, "a DispatchHandle from this buffer's dispatch")
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
        inv = handle._inv
        y = x[:total].index_select(0, inv)
        wts = None if topk_weights is None else topk_weights[:total].index_select(0, inv)
        out, out_w = op.combine(y, wts, handle._indices, block_num=blocks, routing=handle._routing)
        combined = out[:n].to(self.device).clone()
        if biases:
            acc = combined.float()
            for b in biases:
                acc = acc + b.float()
            combined = acc.to(x.dtype)
        combined_w = None if out_w is None else out_w[:n].to(self.device).clone()
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
            _tensor(
                func, "dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats, (torch.int64,), (w,)
            )
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
        handle = LowLatencyHandle(self, op, routing, idx32, m, hidden, num_experts)
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
            info = torch.full((e_local, slots), -1, dtype=torch.int32, device=dev)
            info[le, j] = src_tok.to(torch.int32)
            per_src = torch.bincount(le * w + src_rank, minlength=e_local * w).view(e_local, w)
            begin = torch.cumsum(per_src, 1) - per_src  # first packed row of each source, per expert
            handle.packed_recv_src_info = info
            handle.packed_recv_layout_range = (begin << 32) | per_src
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
            _tensor(func, "combine_wait_recv_cost_stats", combine_wait_recv_cost_stats, (torch.int64,), (w,))

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

"""DeepEP V2's API shape: ``ElasticBuffer.dispatch`` returning an :class:`EPHandle`, ``combine``.

Engines moving to DeepEP V2 call::

    buffer = ElasticBuffer(group, num_max_tokens_per_rank=4096, hidden=7168, num_topk=8)
    recv_x, recv_topk_idx, recv_topk_weights, handle, event = buffer.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=256, expert_alignment=128,
        do_expand=True,
    )
    y = experts(recv_x, handle.psum_num_recv_tokens_per_expert)
    combined_x, combined_topk_weights, event = buffer.combine(y, handle, topk_weights=recv_topk_weights)

Two receive layouts, as in DeepEP V2:

* **compact** (``do_expand=False``): one row per (token, receiving rank), deduplicated, grouped by
  source rank in rank order and by token within a rank (always deterministic here);
  ``recv_topk_idx`` [num_recv_tokens, num_topk] holds local expert ids (``-1``: an expert of
  another rank), ``recv_topk_weights`` the matching weights (0 there);
* **expand** (``do_expand=True``): one row per (token, local expert), expert-major: the rows of
  local expert ``e`` are ``[align(psum[e - 1]), align(psum[e - 1]) + count[e])`` with
  ``psum = handle.psum_num_recv_tokens_per_expert`` and ``align`` rounding up to
  ``expert_alignment`` (padding rows are zeros); ``recv_topk_weights`` is 1-D, one weight per
  expanded row; ``recv_topk_idx`` is 1-D too, the local expert of each expanded row (``-1`` on
  padding). Fixed-size expert blocks of a graph-captured MoE are the expanded rows sliced by
  ``expert_alignment``.

``combine`` is the unweighted sum, per token, over the rows that came from it (expand: each
rank's expanded rows of a token are first summed in fp32 on that rank, then across ranks, as
DeepEP V2 with ``allow_multiple_reduction=True``), plus 0, 1 or 2 bias tensors;
``combined_topk_weights`` [num_tokens, num_topk] returns the weights the same way.

The mapping to MORI: an :class:`ElasticBuffer` holds a :class:`mori.ep.deepep.Buffer` (normal
mode, intranode) and its operators; ``dispatch`` is its normal dispatch (rows placed in DeepEP's
order by the operator), expand adds one local gather, ``combine`` one local fp32 reduction before
the operator's combine. Differences from DeepEP V2 (also in ``docs/ep_elastic.md``): one node,
one scale-up domain (``num_scaleout_ranks`` 1); the buffer sizes nothing (``num_bytes`` is kept);
the host waits for the counts (``do_cpu_sync`` is accepted, a cached dispatch needs no wait);
``allow_multiple_reduction=False`` still reduces in two steps; events are recorded on the current
stream; Engram, PP and AGRS calls are not provided.
"""

from __future__ import annotations

from typing import Any

import torch

from mori.core.errors import MoriStateError, bad_type, bad_value
from mori.ep.deepep import Buffer, Config, DispatchHandle, EventHandle, EventOverlap

__all__ = ["EPHandle", "ElasticBuffer"]


def _align(n: torch.Tensor | int, a: int) -> Any:
    return (n + a - 1) // a * a


class EPHandle:
    """The handle of one :meth:`ElasticBuffer.dispatch`: reuse it for a cached dispatch and give it
    to :meth:`ElasticBuffer.combine`. Attributes as DeepEP V2's (``E`` = local experts, ``K`` =
    top-k, ``R`` = received rows, compact):

    Attributes:
        do_expand: whether the expand layout was used.
        num_experts, expert_alignment, num_max_tokens_per_rank, num_sms: the dispatch's settings.
        topk_idx: the dispatch's ``topk_idx`` [num_tokens, K] (a copy with ``do_handle_copy``).
        num_recv_tokens: ``R``; num_expanded_tokens: expanded rows (padding included; 0 compact).
        num_recv_tokens_per_expert_list: received (token, k) rows per local expert, python ints,
            each aligned to ``expert_alignment``.
        psum_num_recv_tokens_per_scaleup_rank: int32 [num_ranks], inclusive prefix sum of the rows
            received from each rank; the last element is ``R``.
        psum_num_recv_tokens_per_expert: int32 [E]: compact, the inclusive prefix sum of the aligned
            counts; expand, the aligned start of expert ``i`` plus its real count.
        num_unaligned_recv_tokens_per_expert: int32 [E] real counts (expand), else None.
        recv_src_metadata: int64 [R, 2 + K]: column 0 the source token's global index
            ``src_rank * num_max_tokens_per_rank + token``, column 1 the compact row, columns 2..
            the expanded row of each top-k slot (``-1``: not a local expert, or compact mode).
        dst_buffer_slot_idx: int32 [num_tokens, num_ranks]: the row each of this rank's tokens
            takes on each rank (``-1``: not sent).
        token_metadata_at_forward, channel_linked_list: None (hybrid mode only in DeepEP).
    """

    def __init__(
        self,
        *,
        do_expand: bool,
        num_experts: int,
        expert_alignment: int,
        num_max_tokens_per_rank: int,
        num_sms: int,
        topk_idx: torch.Tensor,
        num_recv_tokens: int,
        num_expanded_tokens: int,
        num_recv_tokens_per_expert_list: list[int],
        psum_num_recv_tokens_per_scaleup_rank: torch.Tensor,
        psum_num_recv_tokens_per_expert: torch.Tensor,
        num_unaligned_recv_tokens_per_expert: torch.Tensor | None,
        recv_src_metadata: torch.Tensor,
        dst_buffer_slot_idx: torch.Tensor,
        v1: DispatchHandle,
    ) -> None:
        self.do_expand = do_expand
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self.num_recv_tokens = num_recv_tokens
        self.num_expanded_tokens = num_expanded_tokens
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = num_unaligned_recv_tokens_per_expert
        self.recv_src_metadata = recv_src_metadata
        self.dst_buffer_slot_idx = dst_buffer_slot_idx
        self.token_metadata_at_forward: torch.Tensor | None = None
        self.channel_linked_list: torch.Tensor | None = None
        self._v1 = v1
        self._local = torch.zeros(0, dtype=torch.int64)  # set by dispatch

    def __repr__(self) -> str:
        return (
            f"EPHandle(do_expand={self.do_expand}, num_recv_tokens={self.num_recv_tokens}, "
            f"num_expanded_tokens={self.num_expanded_tokens})"
        )


def _event_in(func: str, name: str, e: Any) -> None:
    if e is None:
        return
    if isinstance(e, EventOverlap):
        e = e.event
    if e is not None and not isinstance(e, EventHandle):
        raise bad_type(func, name, e, "an EventHandle (from capture()), an EventOverlap or None")
    if e is not None:
        e.current_stream_wait()


class ElasticBuffer:
    """DeepEP V2's ``ElasticBuffer`` for expert-parallel dispatch and combine, on MORI.

    The constructor is collective over ``group`` (or the initialised ``mori.shmem`` world with
    ``group=None``); so are ``dispatch`` and ``combine``. Arguments are DeepEP V2's; the sizes
    (``num_bytes``, ``num_cpu_bytes``, ``hidden``, ``num_topk``, ``use_fp8_dispatch``) and the
    RDMA / hybrid settings are validated and kept (MORI sizes its buffers per call), the
    timeouts are ``MORI_BOOTSTRAP_TIMEOUT``'s. ``impl`` (MORI only) as for
    :class:`mori.ep.deepep.Buffer`.
    """

    def __init__(
        self,
        group: Any = None,
        num_bytes: int | None = None,
        num_cpu_bytes: int = 0,
        num_max_tokens_per_rank: int = 0,
        hidden: int = 0,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        deterministic: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
        prefer_overlap_with_compute: bool = True,
        sl_idx: int = 3,
        num_allocated_qps: int = 0,
        num_cpu_timeout_secs: int = 300,
        num_gpu_timeout_secs: int = 100,
        explicitly_destroy: bool = False,
        *,
        impl: str = "auto",
    ) -> None:
        func = "ElasticBuffer"
        for name, v, low in (
            ("num_cpu_bytes", num_cpu_bytes, 0),
            ("num_max_tokens_per_rank", num_max_tokens_per_rank, 0),
            ("hidden", hidden, 0),
            ("num_topk", num_topk, 0),
            ("sl_idx", sl_idx, 0),
            ("num_allocated_qps", num_allocated_qps, 0),
            ("num_cpu_timeout_secs", num_cpu_timeout_secs, 1),
            ("num_gpu_timeout_secs", num_gpu_timeout_secs, 1),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise bad_value(func, name, v, f"an int >= {low}")
        if num_bytes is not None and (
            isinstance(num_bytes, bool) or not isinstance(num_bytes, int) or num_bytes < 0
        ):
            raise bad_value(func, "num_bytes", num_bytes, "None or an int >= 0")
        for name, b in (
            ("use_fp8_dispatch", use_fp8_dispatch),
            ("deterministic", deterministic),
            ("allow_hybrid_mode", allow_hybrid_mode),
            ("allow_multiple_reduction", allow_multiple_reduction),
            ("prefer_overlap_with_compute", prefer_overlap_with_compute),
            ("explicitly_destroy", explicitly_destroy),
        ):
            if not isinstance(b, bool):
                raise bad_value(func, name, b, "True or False")
        self._buffer = Buffer(group, explicitly_destroy=True, impl=impl)
        self.group = group
        self.rank_idx, self.num_ranks = self._buffer.rank, self._buffer.group_size
        self.num_bytes = num_bytes or 0
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.deterministic = deterministic
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        self.num_allocated_qps = num_allocated_qps or 17
        self.explicitly_destroy = explicitly_destroy
        self.num_scaleout_ranks, self.num_scaleup_ranks = 1, self.num_ranks
        self.scaleout_rank_idx, self.scaleup_rank_idx = 0, self.rank_idx
        self.num_rdma_ranks, self.num_nvlink_ranks = 1, self.num_ranks
        self.device = self._buffer.device

    # -- information ----------------------------------------------------------------------------

    def destroy(self) -> None:
        """Release the buffer (collective). Needs ``explicitly_destroy=True``, as in DeepEP."""
        if not self.explicitly_destroy:
            raise MoriStateError("ElasticBuffer.destroy: the buffer was built with explicitly_destroy=False")
        self._buffer.destroy()

    @staticmethod
    def get_buffer_size_hint(
        group: Any,
        num_max_tokens_per_rank: int,
        hidden: int,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
    ) -> int:
        """Bytes of symmetric heap MORI's operator takes for these sizes (2 MiB-aligned), a hint for
        ``MORI_SHMEM_HEAP_SIZE``: receive rows, combine input and staging at bf16, with ``group``'s
        ranks (the initialised ``mori.shmem`` world's for None)."""
        import mori.shmem as shmem

        world = group.size() if group is not None else shmem.shmem_npes()
        row = hidden * 2 + max(num_topk, 1) * 8 + (hidden // 128) * 4 + 4
        total = 3 * world * num_max_tokens_per_rank * row
        return int(_align(total + (1 << 20), 1 << 21))

    def barrier(
        self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True
    ) -> None:
        """A barrier of every rank (collective)."""
        import mori.shmem as shmem

        if with_cpu_sync and self.device.type == "cuda":
            torch.cuda.synchronize()
        shmem.shmem_barrier_all()

    @staticmethod
    def capture() -> EventHandle:
        """An event on the current stream (complete at once on the CPU runtime)."""
        live = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        return EventHandle(torch.device("cuda") if live else None)

    def get_comm_stream(self) -> Any:
        """The stream the communication runs on: the current CUDA stream (None on the CPU runtime)."""
        return self._buffer.get_comm_stream()

    def get_physical_domain_size(self) -> tuple[int, int]:
        """``(num_rdma_ranks, num_nvlink_ranks)``: ``(1, num_ranks)`` on one node."""
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> tuple[int, int]:
        """``(num_scaleout_ranks, num_scaleup_ranks)``: ``(1, num_ranks)`` on one node."""
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, *args: Any, **kwargs: Any) -> int:
        """The default program count: :attr:`mori.ep.deepep.Buffer.num_sms`."""
        return Buffer.num_sms

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """Queue pairs: not used on one node; ``min(num_sms, 9)`` capped by ``num_allocated_qps``."""
        return min(num_sms, 9, self.num_allocated_qps)

    # -- dispatch / combine ---------------------------------------------------------------------

    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        num_experts: int | None = None,
        num_max_tokens_per_rank: int | None = None,
        expert_alignment: int | None = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event: Any = None,
        previous_event_before_epilogue: Any = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
        handle: EPHandle | None = None,
        do_handle_copy: bool = True,
        do_cpu_sync: bool | None = None,
        do_expand: bool = False,
        do_zero_padding: bool = False,
        use_tma_aligned_col_major_sf: bool = False,
    ) -> tuple[Any, torch.Tensor | None, torch.Tensor | None, EPHandle, EventOverlap]:
        """Send each token to the ranks of its experts (see the module docstring). Collective.

        Args:
            x: [num_tokens, hidden] bf16, or ``(fp8 e4m3fn [num_tokens, hidden], scales float32 or
                int32 [num_tokens, <= hidden / 128])``.
            topk_idx: [num_tokens, num_topk] int64/int32 global expert ids, ``-1`` = none. Must be
                None with ``handle``.
            topk_weights: [num_tokens, num_topk] float32, or None (then ``recv_topk_weights`` is
                None); with ``handle``, optional: the new weights travel with the replay.
            cumulative_local_expert_recv_stats: int32 [num_local_experts] to which the received
                (token, k) counts are added, or None.
            num_experts, num_max_tokens_per_rank, expert_alignment: from ``handle`` if None there;
                ``num_max_tokens_per_rank`` defaults to the constructor's (0: ``num_tokens``).
            num_sms: programs per rank (0: :meth:`get_theoretical_num_sms`); num_qps: validated.
            previous_event, previous_event_before_epilogue: events to wait for first, or None.
            async_with_compute_stream, allocate_on_comm_stream, do_cpu_sync, do_zero_padding:
                accepted (kernels on the current stream; padding rows are always zeros).
            handle: an :class:`EPHandle` to replay (same layout, new payload).
            do_handle_copy: keep a copy of ``topk_idx`` in the handle (else the tensor itself).
            do_expand: the expand layout (one row per token and local expert).
            use_tma_aligned_col_major_sf: return the fp8 scales column-major (``.t().contiguous().t()``).

        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, handle, event)``; a cached dispatch
            returns the same ``handle`` and, in compact mode, ``recv_topk_idx`` None.
        """
        func = "ElasticBuffer.dispatch"
        _event_in(func, "previous_event", previous_event)
        _event_in(func, "previous_event_before_epilogue", previous_event_before_epilogue)
        for name, b in (
            ("async_with_compute_stream", async_with_compute_stream),
            ("allocate_on_comm_stream", allocate_on_comm_stream),
            ("do_handle_copy", do_handle_copy),
            ("do_expand", do_expand),
            ("do_zero_padding", do_zero_padding),
            ("use_tma_aligned_col_major_sf", use_tma_aligned_col_major_sf),
        ):
            if not isinstance(b, bool):
                raise bad_value(func, name, b, "True or False")
        if do_cpu_sync is not None and not isinstance(do_cpu_sync, bool):
            raise bad_value(func, "do_cpu_sync", do_cpu_sync, "None, True or False")
        if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 0 or num_sms % 2:
            raise bad_value(func, "num_sms", num_sms, "0 (automatic) or an even int > 0")
        config = Config(num_sms or self.get_theoretical_num_sms(0, 0), 6, 256)
        buf = self._buffer
        if handle is not None:
            if not isinstance(handle, EPHandle) or handle._v1._buffer is not buf:
                raise bad_type(func, "handle", handle, "an EPHandle from this buffer's dispatch")
            if topk_idx is not None:
                raise bad_value(func, "topk_idx", "a tensor", "None when handle is given (reused from it)")
            if do_cpu_sync:
                raise bad_value(func, "do_cpu_sync", True, "None or False with a cached handle")
            for name, v, have in (
                ("num_experts", num_experts, handle.num_experts),
                ("expert_alignment", expert_alignment, handle.expert_alignment),
                ("num_max_tokens_per_rank", num_max_tokens_per_rank, handle.num_max_tokens_per_rank),
            ):
                if v is not None and v != have:
                    raise bad_value(func, name, v, f"{have}, the handle's (or None)")
            if do_expand != handle.do_expand:
                raise bad_value(func, "do_expand", do_expand, f"{handle.do_expand}, the handle's")
            data, scales = buf._split_x(func, x)
            if topk_weights is not None:
                topk_weights = _check_weights(func, topk_weights, handle.topk_idx)
            out = buf._cached_dispatch(
                func, data, scales, handle._v1, 0, config.num_sms, False, weights=topk_weights
            )
            recv_x, recv_w = out[0], out[2]
            recv_idx = None
            if handle.do_expand:
                recv_x, recv_idx, recv_w = self._expand(handle, recv_x, recv_w, use_tma_aligned_col_major_sf)
            elif use_tma_aligned_col_major_sf and isinstance(recv_x, tuple):
                recv_x = (recv_x[0], _col_major(recv_x[1]))
            return recv_x, recv_idx, recv_w, handle, buf._event_out(async_with_compute_stream)

        if topk_idx is None:
            raise bad_value(func, "topk_idx", None, "a tensor unless handle is given")
        if num_experts is None:
            raise bad_value(func, "num_experts", None, "an int unless handle is given")
        alignment = 1 if expert_alignment is None else expert_alignment
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1:
            raise bad_value(func, "expert_alignment", expert_alignment, "None or an int >= 1")
        num_experts = buf._num_experts(func, "num_experts", num_experts)
        topk_idx = buf._check_topk_idx(func, topk_idx, num_experts, None)
        n, k = topk_idx.shape
        data, scales = buf._split_x(func, x)
        if data.shape[0] != n:
            raise bad_value(func, "x.shape[0]", data.shape[0], f"{n}, the rows of topk_idx")
        m = num_max_tokens_per_rank if num_max_tokens_per_rank is not None else self.num_max_tokens_per_rank
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise bad_value(func, "num_max_tokens_per_rank", m, "None or an int >= 0")
        m = m or n
        if n > m:
            raise bad_value(func, "x.shape[0]", n, f"at most num_max_tokens_per_rank = {m}")
        e_local = num_experts // self.num_ranks
        wts = topk_weights
        if wts is not None:
            wts = _check_weights(func, wts, topk_idx)
        else:  # the V1 layer sends weights with top-k ids; zeros stand for "none given"
            wts = torch.zeros(n, k, dtype=torch.float32, device=self.device)
        if cumulative_local_expert_recv_stats is not None:
            t = cumulative_local_expert_recv_stats
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != (e_local,):
                raise bad_value(
                    func, "cumulative_local_expert_recv_stats", t, f"None or an int32 tensor [{e_local}]"
                )
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, num_experts)
        recv_x, recv_idx, recv_w, _counts, v1, _ = buf.dispatch(
            x,
            num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=topk_idx,
            topk_weights=wts,
            config=config,
        )
        assert recv_idx is not None and recv_w is not None
        total = v1.num_recv_tokens
        rpm = v1.rank_prefix_matrix
        src_rank = torch.repeat_interleave(
            torch.arange(self.num_ranks, device=self.device),
            torch.diff(rpm[:, self.rank_idx], prepend=rpm.new_zeros(1)).to(torch.int64),
        )
        meta = torch.full((total, 2 + k), -1, dtype=torch.int64, device=self.device)
        meta[:, 0] = src_rank * m + v1.recv_src_idx.to(torch.int64)
        meta[:, 1] = torch.arange(total, device=self.device)
        local = recv_idx.to(torch.int64)
        count = torch.zeros(e_local, dtype=torch.int64, device=self.device)
        count.index_add_(0, local[local >= 0], torch.ones_like(local[local >= 0]))
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats.add_(count.to(torch.int32))
        aligned = _align(count, alignment)
        counts_list = [int(c) for c in aligned.tolist()]
        dst = torch.full((n, self.num_ranks), -1, dtype=torch.int32, device=self.device)
        dest_slot = v1._routing.dest_slot[:, :n]
        dst[:] = dest_slot.t()
        starts = torch.cumsum(aligned, 0) - aligned
        if do_expand:
            # expanded row of (received row r, slot j) with local expert e: e's aligned start plus
            # the rank of (r, j) among e's pairs in (row, slot) order
            flat = local.flatten()
            ok = flat >= 0
            key = torch.where(ok, flat, e_local)
            order = torch.argsort(key, stable=True)
            group = torch.bincount(key, minlength=e_local + 1)
            within = torch.empty_like(flat)
            within[order] = (
                torch.arange(flat.numel(), device=self.device) - (torch.cumsum(group, 0) - group)[key[order]]
            )
            slot = torch.where(ok, starts[torch.where(ok, flat, 0)] + within, -1)
            meta[:, 2:] = slot.view(total, k)
            psum = starts + count
            unaligned: torch.Tensor | None = count.to(torch.int32)
            expanded = int(aligned.sum())
        else:
            psum = torch.cumsum(aligned, 0)
            unaligned = None
            expanded = 0
        handle = EPHandle(
            do_expand=do_expand,
            num_experts=num_experts,
            expert_alignment=alignment,
            num_max_tokens_per_rank=m,
            num_sms=config.num_sms,
            topk_idx=topk_idx.clone() if do_handle_copy else topk_idx,
            num_recv_tokens=total,
            num_expanded_tokens=expanded,
            num_recv_tokens_per_expert_list=counts_list,
            psum_num_recv_tokens_per_scaleup_rank=rpm[:, self.rank_idx].clone(),
            psum_num_recv_tokens_per_expert=psum.to(torch.int32),
            num_unaligned_recv_tokens_per_expert=unaligned,
            recv_src_metadata=meta,
            dst_buffer_slot_idx=dst,
            v1=v1,
        )
        handle._local = local  # int64 [R, K] local expert of each received (row, slot), -1: another rank's
        out_w: torch.Tensor | None = recv_w if topk_weights is not None else None
        out_idx: torch.Tensor | None = recv_idx
        if do_expand:
            recv_x, out_idx, out_w = self._expand(handle, recv_x, out_w, use_tma_aligned_col_major_sf)
        elif use_tma_aligned_col_major_sf and isinstance(recv_x, tuple):
            recv_x = (recv_x[0], _col_major(recv_x[1]))
        return recv_x, out_idx, out_w, handle, buf._event_out(async_with_compute_stream)

    def _expand(
        self, handle: EPHandle, recv_x: Any, recv_w: torch.Tensor | None, col_major_sf: bool
    ) -> tuple[Any, torch.Tensor, torch.Tensor | None]:
        """Compact rows -> expanded rows (zeros on padding), the local expert of each expanded row
        (-1 on padding), and the weight of each expanded row (1-D) if weights were given."""
        slots = handle.recv_src_metadata[:, 2:]
        ok = slots >= 0
        src_row = torch.nonzero(ok, as_tuple=True)[0]  # (row-major: the order of slots[ok])
        dst = slots[ok]
        n_exp = handle.num_expanded_tokens

        def spread(t: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(n_exp, *t.shape[1:], dtype=t.dtype, device=self.device)
            out[dst] = t[src_row]
            return out

        ex: Any
        if isinstance(recv_x, tuple):
            ex = (spread(recv_x[0]), spread(recv_x[1]))
            if col_major_sf:
                ex = (ex[0], _col_major(ex[1]))
        else:
            ex = spread(recv_x)
        expert = torch.full((n_exp,), -1, dtype=torch.int64, device=self.device)
        expert[dst] = handle._local[ok]
        w = None
        if recv_w is not None:
            w = torch.zeros(n_exp, dtype=torch.float32, device=self.device)
            w[dst] = recv_w[: slots.shape[0]][ok]
        return ex, expert, w

    def combine(
        self,
        x: torch.Tensor,
        handle: EPHandle,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event: Any = None,
        previous_event_before_epilogue: Any = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        """Return the rows to their tokens' ranks and sum them there (unweighted). Collective.

        Args:
            x: bf16 (or fp16 / fp32 after an fp32 dispatch) [num_recv_tokens, hidden] compact, or
                [num_expanded_tokens, hidden] expand (padding rows are ignored).
            handle: the :class:`EPHandle` of the dispatch.
            topk_weights: float32 [num_recv_tokens, num_topk] compact, [num_expanded_tokens] expand,
                or None.
            bias: 0, 1 or 2 tensors [num_tokens, hidden] added to the result.
            num_sms: programs per rank (0: the dispatch's).
            num_qps, previous_event, previous_event_before_epilogue: as for :meth:`dispatch`.
            async_with_compute_stream, allocate_on_comm_stream: as for :meth:`dispatch`.

        Returns:
            ``(combined_x [num_tokens, hidden], combined_topk_weights [num_tokens, num_topk] | None,
            event)``.
        """
        func = "ElasticBuffer.combine"
        if not isinstance(handle, EPHandle) or handle._v1._buffer is not self._buffer:
            raise bad_type(func, "handle", handle, "an EPHandle from this buffer's dispatch")
        _event_in(func, "previous_event", previous_event)
        _event_in(func, "previous_event_before_epilogue", previous_event_before_epilogue)
        if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 0 or num_sms % 2:
            raise bad_value(func, "num_sms", num_sms, "0 (the dispatch's) or an even int > 0")
        config = Config(num_sms or handle.num_sms, 6, 256)
        total = handle.num_recv_tokens
        if not isinstance(x, torch.Tensor):
            raise bad_type(func, "x", x, "a torch.Tensor")
        want_rows = handle.num_expanded_tokens if handle.do_expand else total
        if x.dim() != 2 or x.shape[0] != want_rows:
            raise bad_value(func, "x.shape", list(x.shape), f"[{want_rows}, hidden]")
        k = handle.topk_idx.shape[1]
        if handle.do_expand:
            slots = handle.recv_src_metadata[:, 2:]
            ok = slots >= 0
            acc = torch.zeros(total, x.shape[1], dtype=torch.float32, device=self.device)
            acc.index_add_(0, torch.nonzero(ok, as_tuple=True)[0], x[slots[ok]].float())
            y = acc.to(x.dtype)
            wts = None
            if topk_weights is not None:
                if (
                    not isinstance(topk_weights, torch.Tensor)
                    or topk_weights.dtype != torch.float32
                    or tuple(topk_weights.shape) != (want_rows,)
                ):
                    raise bad_value(func, "topk_weights", topk_weights, f"None or float32 [{want_rows}]")
                wts = torch.zeros(total, k, dtype=torch.float32, device=self.device)
                wts[ok] = topk_weights[slots[ok]]
        else:
            y = x
            wts = topk_weights
        combined, combined_w, _ = self._buffer.combine(
            y, handle._v1, topk_weights=wts, bias=bias, config=config
        )
        return combined, combined_w, self._buffer._event_out(async_with_compute_stream)


def _check_weights(func: str, w: Any, topk_idx: torch.Tensor) -> torch.Tensor:
    if not isinstance(w, torch.Tensor) or w.dtype != torch.float32 or w.shape != topk_idx.shape:
        raise bad_value(
            func,
            "topk_weights",
            w if not isinstance(w, torch.Tensor) else f"{w.dtype} {list(w.shape)}",
            f"None or float32 {list(topk_idx.shape)}",
        )
    return w


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """The same values stored column-major in the last two dimensions (TMA-friendly scales)."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)

"""Host side of the Triton EP kernels: views, launch geometry, launches. No host synchronisation.

:class:`KernelPath` belongs to one :class:`~mori.ep.EpDispatchCombineOp` and uses its symmetric
buffers (``op.buffers``, a :class:`~mori.ep.buffers.EpBuffers`: the layout of the host path), plus
its own control words and tables (added to ``op.buffers``) and the ``dest_slot`` table on the
device. It uses the operator's public attributes only. Every call only launches kernels on the current stream: nothing here reads a device
value on the host, so dispatch and combine can be captured in a CUDA graph and replayed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

import mori.shmem as shmem
from mori.core.errors import MoriStateError, MoriValueError
from mori.core.relaunch import Relaunch
from mori.ep import agreement, tuning

if TYPE_CHECKING:
    from mori.ep.op import EpDispatchCombineOp, EpDispatchRoutingHandle

__all__ = ["KernelPath", "TileConfig"]

_WORDS = {4: torch.int32, 2: torch.int16, 1: torch.uint8}

#: the kernels of :mod:`mori.ep.kernels`, relaunched from Triton's compiled kernel without its
#: per-call binding of some forty arguments (:class:`mori.core.relaunch.Relaunch`); imported on
#: the first launch, after the caller chose ``TRITON_INTERPRET``
_RELAUNCH = {
    name: Relaunch(f"mori.ep.kernels:{name}")
    for name in ("dispatch_kernel", "dispatch_recv_kernel", "combine_kernel", "combine_push_kernel")
}


def _pow2_at_most(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _pow2_at_least(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def _word_size(*byte_counts: int) -> int:
    """Widest word (4, 2 or 1 bytes) dividing every byte count (sizes, strides and addresses)."""
    for w in (4, 2, 1):
        if all(b % w == 0 for b in byte_counts):
            return w
    return 1


def _as_words(t: torch.Tensor, word: int) -> torch.Tensor:
    """A 2-D tensor with contiguous rows viewed as rows of ``word``-byte integers."""
    return t.view(torch.uint8).view(_WORDS[word])


@dataclass(frozen=True)
class TileConfig:
    """Tile of one program: ``rows`` token rows by ``block`` words per step (powers of two)."""

    rows: int
    block: int

    @staticmethod
    def for_row(row_elems: int, target: int, n_rows: int, programs: int) -> TileConfig:
        """About ``target`` elements: rows of up to 2048 elements per step, but no more rows than
        each of ``programs`` gets of ``n_rows`` (a small batch is spread over every program)."""
        block = min(_pow2_at_least(row_elems), 2048)
        share = _pow2_at_most(max(1, -(-n_rows // max(1, programs))))
        return TileConfig(rows=max(1, min(16, target // block, share)), block=block)


class KernelPath:
    """Launches the kernels of :mod:`mori.ep.kernels` for one operator."""

    def __init__(self, op: EpDispatchCombineOp) -> None:
        # Triton is imported only when kernels are used (and after the caller chose TRITON_INTERPRET)
        from mori.ep import kernels
        from mori.shmem.device import shmem_device_context

        self.kernels = kernels
        self.op = op
        dev = op.buffers.device
        if dev.type == "cpu" and type(kernels.dispatch_kernel).__name__ != "InterpretedFunction":
            raise MoriStateError(
                "EpDispatchCombineOp: the cpu runtime runs the Triton kernels only in the interpreter; "
                "set TRITON_INTERPRET=1 before triton is first imported, or use impl='host'"
            )
        w, m = op.world_size, op.buffers.m
        self.device = dev
        self.ctx = shmem_device_context()
        self.ctrl = shmem.mori_shmem_create_tensor((kernels.ctrl_words(w),), torch.int64)
        self.ctrl.zero_()
        op.buffers.add(self.ctrl)
        #: dispatch launches so far: the epoch of the last one (ERR_D holds a disagreeing call's)
        self.dispatch_calls = 0
        #: registered combine weights: peers read each row's weights here
        self.comb_w = shmem.mori_shmem_create_tensor((op.buffers.r, op.buffers.k), torch.float32)
        self.comb_w.zero_()
        op.buffers.add(self.comb_w)
        #: fp8_blockwise combine: the fp32 block scales of the quantised rows, read by peers
        self.quant = {"none": 0, "fp8_direct_cast": 1, "fp8_blockwise": 2, "fp4_blockwise": 3}[
            op.config.quant_type
        ]
        self.comb_scales = self.comb_w
        if self.quant in (2, 3):
            self.comb_scales = shmem.mori_shmem_create_tensor(
                (op.buffers.r, op.buffers.quant_scale_dim), torch.float32
            )
            self.comb_scales.zero_()
            op.buffers.add(self.comb_scales)
        self.dest_slot = torch.full((w, m), -1, dtype=torch.int32, device=dev)
        #: the dispatch's table seen from the receiver (written by the peers' dispatch kernels):
        #: recv_slot[s, t] = the received row holding rank s's token t, -1 if none
        self.recv_slot = shmem.mori_shmem_create_tensor((w, m), torch.int32)
        self.recv_slot.fill_(-1)
        op.buffers.add(self.recv_slot)
        self.total_recv = torch.zeros(1, dtype=torch.int32, device=dev)
        self.is_gpu = dev.type != "cpu"
        #: programs that are surely resident at once (one per SM); the interpreter runs one at a time
        self.resident_programs = (
            torch.cuda.get_device_properties(dev).multi_processor_count if self.is_gpu else 1
        )
        #: push combine: flag[p, c] = the epoch once rank p's rows of chunk c are here (room for
        #: chunks of one token)
        self.push_flags = shmem.mori_shmem_create_tensor((w, m), torch.int64)
        self.push_flags.zero_()
        op.buffers.add(self.push_flags)
        # Triton's num_warps is a power of two; AMD wavefronts are 64 wide, so at most 16 there
        self.max_warps = 16 if torch.version.hip else 32
        #: (arch, model) naming the AUTO tables, e.g. ("sm90", "H200"); None on the CPU
        self.model: tuple[str, str] | None = None
        if self.is_gpu:
            props = torch.cuda.get_device_properties(dev)
            arch = getattr(props, "gcnArchName", "").split(":")[0] or f"sm{props.major}{props.minor}"
            self.model = (arch, props.name.split()[-1])
        #: the mori.viz trace buffer the kernels record into (their traced variants), or None
        self.trace: Any = None

    def _launch(self, name: str, grid: tuple[int, ...], *args: Any, **kw: Any) -> None:
        """Launch kernel ``name`` of :mod:`mori.ep.kernels`: untraced through its
        :class:`~mori.core.relaunch.Relaunch`, traced (a tensor passed by keyword, which Relaunch
        would key by value) through Triton's own launch with the trace arguments."""
        if self.trace is None:
            _RELAUNCH[name](grid, *args, **kw)
        else:
            getattr(self.kernels, name)[grid](*args, **kw, trace_ptr=self.trace.tensor, TRACE=True)

    # -- geometry ------------------------------------------------------------------------------

    def _geometry(
        self, phase: str, block_num: int, warp_per_block: int, dtype: torch.dtype, n_tok: int, zero_copy: bool
    ) -> tuple[int, int, int]:
        """(programs, warps, tile elements): call arguments, else the AUTO table, else the config."""
        cfg = self.op.config
        rule = None
        if self.model is not None and (block_num == -1 or warp_per_block == -1):
            rule = tuning.lookup(
                arch=self.model[0],
                model=self.model[1],
                kernel=cfg.kernel_type.name,
                world=cfg.world_size,
                phase=phase,
                dtype=str(dtype).removeprefix("torch."),
                num_tokens=n_tok,
                hidden_dim=cfg.hidden_dim,
                zero_copy=zero_copy,
                topk=cfg.num_experts_per_token,
                quant_type=cfg.quant_type,
            )
        if block_num == -1:
            block_num = rule.block_num if rule else cfg.block_num
        if warp_per_block == -1:
            warp_per_block = rule.warp_per_block if rule else cfg.warp_num_per_block
        tile = rule.tile_elems if rule and rule.tile_elems else tuning.DEFAULT_TILE_ELEMS[phase]
        return max(1, block_num), min(self.max_warps, _pow2_at_most(warp_per_block)), tile

    # -- dispatch ------------------------------------------------------------------------------

    def dispatch_send(
        self,
        input: torch.Tensor,
        weights: torch.Tensor | None,
        scales: torch.Tensor | None,
        indices: torch.Tensor,
        routing: EpDispatchRoutingHandle | None,
        block_num: int,
        warp_per_block: int,
        recv: bool,
    ) -> None:
        """Launch :func:`~mori.ep.kernels.dispatch_kernel`; ``recv``: its last program also waits
        for every peer and publishes ``total_recv`` (else :meth:`dispatch_recv` does)."""
        op, k = self.op, self.op.buffers.k
        self.dispatch_calls += 1
        n, h = input.shape
        nb = h * input.element_size()
        row_bytes = op.buffers.row_bytes
        word = _word_size(nb, input.stride(0) * input.element_size(), input.data_ptr(), row_bytes)
        inp_w = _as_words(input, word)
        recv_w = _as_words(op.buffers.recv_tok, word)
        grid, warps, tile_elems = self._geometry("dispatch", block_num, warp_per_block, input.dtype, n, False)
        tile = TileConfig.for_row(nb // word, tile_elems, n, grid)
        indices = indices.contiguous()
        wts = weights.contiguous() if weights is not None else op.buffers.recv_w  # unused when HAS_W=0
        if scales is not None:
            sc = scales.contiguous().view(torch.uint8)
            sb, sc_stride = sc.shape[1], sc.stride(0)
        else:
            sc, sb, sc_stride = op.buffers.recv_scales, 0, 0
        dest_slot = routing.dest_slot if routing is not None else self.dest_slot
        self._launch(
            "dispatch_kernel",
            (grid,),
            inp_w,
            inp_w.stride(0),
            wts,
            sc,
            sc_stride,
            indices,
            n,
            recv_w,
            op.buffers.recv_w,
            op.buffers.recv_scales,
            op.buffers.recv_idx,
            op.buffers.recv_src,
            dest_slot,
            self.recv_slot,
            self.total_recv,
            routing.total_recv if routing is not None else self.total_recv,
            self.ctrl,
            self.ctx,
            dispatch_desc(input, weights, scales, routing is not None),
            nb // word,
            row_bytes // word,
            sb,
            op.buffers.scale_bytes,
            op.buffers.m,
            op.buffers.r,
            op.buffers.e_local,
            W=op.world_size,
            K=k,
            K_P2=_pow2_at_least(k),
            W_P2=_pow2_at_least(op.world_size),
            HAS_W=weights is not None,
            HAS_SC=scales is not None and sb > 0,
            REPLAY=routing is not None,
            RECV=recv,
            BT=tile.rows,
            BLOCK=tile.block,
            SC_BLOCK=min(256, _pow2_at_least(max(sb, 1))),
            num_warps=warps,
        )

    def disagreement(self, func: str) -> MoriValueError | None:
        """The error naming what the ranks disagreed on in the last dispatch, or None. Reads two
        words of the control block: a device synchronisation on a GPU."""
        w = self.op.world_size
        epoch = self.dispatch_calls
        if epoch == 0 or int(self.ctrl[self.kernels.err_d_word(w)]) != epoch:
            return None
        words = self.ctrl[self.kernels.desc_d_words(w, epoch)].cpu()
        rows = torch.stack([unpack_desc(int(v)) for v in words])
        err = agreement.mismatch(
            func, "each dispatch call's arguments", agreement.DISPATCH_FIELDS, rows, self.op.rank
        )
        return err or MoriValueError(f"{func}: the ranks disagreed on the last dispatch call")

    def dispatch_recv(self, routing: EpDispatchRoutingHandle | None, count: bool, launch: bool) -> None:
        """``launch``: wait for the peers here (AsyncLL); then ``count`` local experts' rows."""
        op = self.op
        if launch:
            replay_total = routing.total_recv if routing is not None else self.total_recv
            self._launch(
                "dispatch_recv_kernel",
                (1,),
                self.ctrl,
                self.total_recv,
                replay_total,
                W=op.world_size,
                REPLAY=routing is not None,
            )
        if count:
            self._local_expert_count()

    def _local_expert_count(self) -> None:
        # received (token, k) pairs per local expert, from the valid rows only; device ops, no sync
        self.op.buffers.count_local_experts(self.total_recv, self.op.rank, self.op.local_expert_count)

    # -- combine -------------------------------------------------------------------------------

    def combine(
        self,
        input: torch.Tensor,
        weights: torch.Tensor | None,
        out: torch.Tensor,
        out_w: torch.Tensor | None,
        n_tok: int,
        routing: EpDispatchRoutingHandle | None,
        block_num: int,
        warp_per_block: int,
        phases: int,
    ) -> None:
        """Launch the combine for ``phases`` (STAGE, REDUCE or both).

        ``input`` is either the registered buffer itself (zero-copy: peers read their rows there,
        :func:`~mori.ep.kernels.combine_kernel`) or any tensor: its rows are pushed to the peers'
        staging (:func:`~mori.ep.kernels.combine_push_kernel`), or, with chunks of under 2 tokens
        (see :meth:`_push_chunk`), wire quantisation or a routing handle that has no
        ``recv_slot`` table, copied (quantised) into the registered buffer first and gathered
        from there.
        """
        zero_copy = input.data_ptr() == self.op.buffers.comb_inp.data_ptr()
        recv_slot = self.recv_slot if routing is None else routing.recv_slot
        if not zero_copy and self.quant == 0 and recv_slot is not None:
            chunk = self._push_chunk(block_num, warp_per_block, input.dtype)
            if chunk:
                self._combine_push(
                    input,
                    weights,
                    out,
                    out_w,
                    n_tok,
                    routing,
                    recv_slot,
                    chunk,
                    block_num,
                    warp_per_block,
                    phases,
                )
                return
        self._combine_gather(
            input, weights, out, out_w, n_tok, routing, zero_copy, block_num, warp_per_block, phases
        )

    def _combine_geometry(
        self,
        phases: int,
        block_num: int,
        warp_per_block: int,
        dtype: torch.dtype,
        n_tok: int,
        zero_copy: bool,
    ) -> tuple[int, int, int]:
        """(programs, warps, tile elements) of a combine launch: one launch doing both phases waits
        inside for every program's first phase, so all of its programs must be resident at once."""
        grid, warps, tile_elems = self._geometry(
            "combine", block_num, warp_per_block, dtype, n_tok, zero_copy
        )
        if phases == self.kernels.STAGE | self.kernels.REDUCE:
            grid = min(grid, self.resident_programs)
        return grid, warps, tile_elems

    def _combine_push(
        self,
        input: torch.Tensor,
        weights: torch.Tensor | None,
        out: torch.Tensor,
        out_w: torch.Tensor | None,
        n_tok: int,
        routing: EpDispatchRoutingHandle | None,
        recv_slot: torch.Tensor,
        ct: int,
        block_num: int,
        warp_per_block: int,
        phases: int,
    ) -> None:
        op, k, kern = self.op, self.op.buffers.k, self.kernels
        w, m = op.world_size, op.buffers.m
        rows, h = input.shape
        nb = h * input.element_size()
        word = _word_size(nb, input.stride(0) * input.element_size(), input.data_ptr(), op.buffers.row_bytes)
        inp_w = _as_words(input, word)
        stage = op.buffers.stage_tok.view(w * m, op.buffers.row_bytes)
        stage_w = _as_words(stage, word)
        stage_typed = stage.view(input.dtype)
        grid, warps, tile_elems = self._combine_geometry(
            phases, block_num, warp_per_block, input.dtype, n_tok, False
        )
        bt = min(ct, TileConfig.for_row(h, tile_elems, n_tok, grid).rows)
        # few rows per step: longer column blocks keep as many bytes in flight per program
        block = min(_pow2_at_least(max(h, nb // word)), max(2048, tile_elems // bt), 8192)
        dest_slot = routing.dest_slot if routing is not None else self.dest_slot
        wts = weights.contiguous() if weights is not None else self.comb_w  # unused when HAS_W=0
        self._launch(
            "combine_push_kernel",
            (grid,),
            inp_w,
            inp_w.stride(0),
            input,
            input.stride(0),
            wts,
            rows,
            recv_slot,
            dest_slot,
            stage_w,
            stage_w.stride(0),
            stage_typed,
            stage_typed.stride(0),
            op.buffers.stage_w,
            self.push_flags,
            -(-m // ct),
            out,
            out_w if out_w is not None else self.comb_w,
            self.ctrl,
            self.ctx,
            n_tok,
            h,
            nb // word,
            m,
            W=w,
            K=k,
            K_P2=_pow2_at_least(k),
            HAS_W=weights is not None,
            DO_PUSH=bool(phases & kern.STAGE),
            DO_REDUCE=bool(phases & kern.REDUCE),
            CT=ct,
            BT=bt,
            BLOCK=block,
            num_warps=warps,
        )

    def _push_chunk(self, block_num: int, warp_per_block: int, dtype: torch.dtype) -> int | None:
        """Tokens per chunk of the push combine, or None: gather (with a copy) instead.

        Every rank must decide alike (a rank flags a chunk to a peer, which reduces the same
        chunk), so this depends on the call's arguments and the config, not on this rank's token
        count: the geometry planned for M tokens, about six chunks per program, at most 16 tokens.
        On 2 x H200, EP2: at 4096 tokens the best of 2, 4, 8 and 16 was 16 at 24 programs and 4
        at 132; at 128 tokens (one chunk of one token per program, nothing to overlap) the gather
        with a copy was faster. So below two tokens per chunk the gather is used.
        ``MORI_EP_PUSH_CHUNK`` forces the push with its chunk."""
        chunk = tuning.MORI_EP_PUSH_CHUNK.get()
        if chunk:
            return chunk
        m = self.op.buffers.m
        planned, _w, _t = self._geometry("combine", block_num, warp_per_block, dtype, m, False)
        chunk = min(16, _pow2_at_most(max(1, m // (6 * min(planned, self.resident_programs)))))
        return chunk if chunk >= 2 else None

    def _combine_gather(
        self,
        input: torch.Tensor,
        weights: torch.Tensor | None,
        out: torch.Tensor,
        out_w: torch.Tensor | None,
        n_tok: int,
        routing: EpDispatchRoutingHandle | None,
        zero_copy: bool,
        block_num: int,
        warp_per_block: int,
        phases: int,
    ) -> None:
        op, k, kern = self.op, self.op.buffers.k, self.kernels
        rows, h = input.shape
        nb = h * input.element_size()
        row_bytes = op.buffers.row_bytes
        word = _word_size(nb, input.stride(0) * input.element_size(), input.data_ptr(), row_bytes)
        inp_w = _as_words(input, word)
        cinp_w = _as_words(op.buffers.comb_inp, word)
        cinp_typed = op.buffers.comb_inp.view(input.dtype)
        grid, warps, tile_elems = self._combine_geometry(
            phases, block_num, warp_per_block, input.dtype, n_tok, zero_copy
        )
        tile = TileConfig.for_row(h, tile_elems, n_tok, grid)
        # the dispatch to combine: a routing handle's tables, or the live ones of the last dispatch
        recv_src = routing.recv_src_pos if routing is not None else op.buffers.recv_src
        total = routing.total_recv if routing is not None else self.total_recv
        dest_slot = routing.dest_slot if routing is not None else self.dest_slot
        wts = weights.contiguous() if weights is not None else self.comb_w  # unused when HAS_W=0
        self._launch(
            "combine_kernel",
            (grid,),
            inp_w,
            inp_w.stride(0),
            input,
            input.stride(0),
            wts,
            rows,
            recv_src,
            total,
            cinp_w,
            cinp_w.stride(0),
            cinp_typed,
            cinp_typed.stride(0),
            self.comb_w,
            op.buffers.comb_inp if self.quant == 3 else op.buffers.comb_inp.view(torch.float8_e4m3fn),
            op.buffers.comb_inp.stride(0),
            self.comb_scales,
            self.comb_scales.shape[1],
            dest_slot,
            out,
            out_w if out_w is not None else self.comb_w,
            self.ctrl,
            self.ctx,
            n_tok,
            h,
            nb // word,
            op.buffers.m,
            W=op.world_size,
            K=k,
            K_P2=_pow2_at_least(k),
            HAS_W=weights is not None,
            COPY=not zero_copy,
            DO_STAGE=bool(phases & kern.STAGE),
            DO_REDUCE=bool(phases & kern.REDUCE),
            QUANT=self.quant,
            QB=op.buffers.quant_block if self.quant in (2, 3) else 1,
            BT=tile.rows,
            BLOCK=tile.block,
            num_warps=warps,
        )


#: bit fields (shift, width) of the dispatch descriptor word, in the order of DISPATCH_FIELDS
_DESC_BITS = ((0, 8), (8, 24), (32, 16), (48, 8), (56, 1), (57, 1))


def dispatch_desc(
    input: torch.Tensor, weights: torch.Tensor | None, scales: torch.Tensor | None, replay: bool
) -> int:
    """One int64 word packing :data:`mori.ep.agreement.DISPATCH_FIELDS` for the kernels (the
    dtype is the call's, not that of the word view the kernel moves)."""
    sb = 0 if scales is None else scales.shape[1] * scales.element_size()
    values = (
        agreement.dtype_code(input.dtype),
        input.shape[1],
        sb,
        agreement.dtype_code(None if scales is None else scales.dtype),
        int(weights is not None),
        int(replay),
    )
    word = 0
    for (shift, width), v in zip(_DESC_BITS, values, strict=True):
        word |= min(v, (1 << width) - 1) << shift  # (a size beyond its field saturates)
    return word


def unpack_desc(word: int) -> torch.Tensor:
    """int64 [len(DISPATCH_FIELDS)] from :func:`dispatch_desc`'s word."""
    return torch.tensor([(word >> shift) & ((1 << width) - 1) for shift, width in _DESC_BITS])


def kernels_requested(device: torch.device, impl: str) -> bool:
    """Whether an operator on ``device`` runs the Triton kernels for ``impl`` ("auto", "host" or
    "triton"): "auto" means kernels on a GPU heap, the vectorised host path on the cpu runtime."""
    if impl == "auto":
        return device.type != "cpu"
    return impl == "triton"

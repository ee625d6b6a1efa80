"""The symmetric buffers of one EP operator: sizes, tensors and their lifetime, in one place.

:class:`EpBuffers` is owned by :class:`~mori.ep.EpDispatchCombineOp` (as ``op.buffers``) and used
by every path that moves its rows: the host path (:mod:`mori.ep.op`), the Triton kernels' host side
(:mod:`mori.ep.kernel_path`) and the inter-node legs (:mod:`mori.ep.internode`). The paths that need
extra symmetric tensors allocate them and register them here with :meth:`EpBuffers.add`.
"""

from __future__ import annotations

import torch

import mori.shmem as shmem
from mori.ep.config import EpDispatchCombineConfig

__all__ = ["EpBuffers"]


class EpBuffers:
    """Sizes and symmetric-heap tensors of one EP operator (one per rank; collective to build).

    Sizes (from the config; ``W`` = ``world_size``):

    * ``m``: ``max_num_inp_token_per_rank`` (``M``), tokens a rank sends per call at most;
    * ``k``: ``num_experts_per_token`` (``K``);
    * ``e_local``: ``num_experts_per_rank``;
    * ``r``: ``config.max_num_tokens_to_recv()`` (``R``), rows a rank receives per call at most;
    * ``row_bytes``: ``hidden_dim * max_token_type_size``, bytes of one token row;
    * ``scale_bytes``: ``scale_dim * scale_type_size``, bytes of one row's dispatch scales;
    * ``quant_scale_dim`` / ``quant_block``: blockwise combine quantisation (``fp8_blockwise``,
      ``fp4_blockwise``): fp32 scales per row and elements per block; 0 otherwise;
    * ``stage_bytes``: bytes of one staged combine row in its wire format (``row_bytes``, one byte
      per element with fp8, half a byte with fp4).

    Symmetric tensors, allocated in this order (the order is the same on every rank: allocation
    is collective):

    * ``recv_tok``: uint8 ``[R, row_bytes]``, received token rows (the dispatch output);
    * ``recv_w``: float32 ``[R, K]``, their gating weights;
    * ``recv_scales``: uint8 ``[R, scale_bytes]``, their dispatch scales;
    * ``recv_idx``: int32 ``[R, K]``, their expert ids;
    * ``recv_src``: int32 ``[R]``, their flat source positions (``src_rank * W * M + src_tok``);
    * ``comb_inp``: uint8 ``[R, row_bytes]``, the registered (zero-copy) combine input;
    * ``stage_tok``: uint8 ``[W, M, stage_bytes]``, combine staging: the rows in wire format;
    * ``stage_w``: float32 ``[W, M, K]``, combine staging: their weights;
    * ``ctrl``: int64 ``[4 W + 2]``, control words: dispatch done ``[W]``, combine done ``[W]``,
      slot counters ``[2]`` (by epoch parity), dispatch ready ``[W]``, combine ready ``[W]``;
    * ``stage_sc``: float32 ``[W, M, quant_scale_dim]``, the rows' block scales (blockwise
      quantisation only; None otherwise).

    :attr:`tensors` lists them in allocation order, followed by the tensors registered with
    :meth:`add` (the inter-node legs' buffers, the kernel path's control words and tables).
    """

    def __init__(
        self, config: EpDispatchCombineConfig, *, quant_scale_dim: int = 0, quant_block: int = 0
    ) -> None:
        """Allocate the operator's symmetric tensors for ``config`` (collective: every rank calls
        it with an agreeing config). Their contents are undefined until :meth:`zero`."""
        self.world_size = config.world_size
        self.m = config.max_num_inp_token_per_rank
        self.k = config.num_experts_per_token
        self.e_local = config.num_experts_per_rank
        self.r = config.max_num_tokens_to_recv()
        self.row_bytes = config.hidden_dim * config.max_token_type_size
        self.scale_bytes = config.scale_dim * config.scale_type_size
        self.quant_scale_dim = quant_scale_dim
        self.quant_block = quant_block
        self.stage_bytes = {"none": self.row_bytes, "fp4_blockwise": config.hidden_dim // 2}.get(
            config.quant_type, config.hidden_dim
        )
        w, m, k, r = self.world_size, self.m, self.k, self.r

        create = shmem.mori_shmem_create_tensor
        self.recv_tok = create((r, self.row_bytes), torch.uint8)
        self.recv_w = create((r, k), torch.float32)
        self.recv_scales = create((r, self.scale_bytes), torch.uint8)
        self.recv_idx = create((r, k), torch.int32)
        self.recv_src = create((r,), torch.int32)
        self.comb_inp = create((r, self.row_bytes), torch.uint8)
        self.stage_tok = create((w, m, self.stage_bytes), torch.uint8)
        self.stage_w = create((w, m, k), torch.float32)
        self.ctrl = create((4 * w + 2,), torch.int64)
        #: every symmetric tensor held, in allocation order
        self.tensors: list[torch.Tensor] = [
            self.recv_tok,
            self.recv_w,
            self.recv_scales,
            self.recv_idx,
            self.recv_src,
            self.comb_inp,
            self.stage_tok,
            self.stage_w,
            self.ctrl,
        ]
        self.stage_sc: torch.Tensor | None = None
        if quant_scale_dim:
            self.stage_sc = self.add(create((w, m, quant_scale_dim), torch.float32))

    @property
    def device(self) -> torch.device:
        """The device of the symmetric heap the tensors live on."""
        return self.recv_tok.device

    def add(self, tensor: torch.Tensor) -> torch.Tensor:
        """Hold ``tensor`` (one from :func:`mori.shmem.mori_shmem_create_tensor`) with the others,
        so that :meth:`zero` and :meth:`free` include it; returns it. Every rank adds the same
        tensors in the same order."""
        self.tensors.append(tensor)
        return tensor

    def count_local_experts(self, total_recv: torch.Tensor, rank: int, out: torch.Tensor) -> None:
        """``out`` int32 [e_local] = received (token, k) pairs per local expert of ``rank``, over the
        first ``total_recv`` (int32 [1], on the device) received rows. Device ops only, no sync."""
        e = self.e_local
        valid = torch.arange(self.r, device=self.device)[:, None] < total_recv.to(torch.int64)
        local = self.recv_idx.to(torch.int64) - rank * e
        mine = valid & (self.recv_idx >= 0) & (local >= 0) & (local < e)
        counts = torch.zeros(e, dtype=torch.int32, device=self.device)
        counts.scatter_add_(0, torch.where(mine, local, 0).flatten(), mine.to(torch.int32).flatten())
        out.copy_(counts)

    def zero(self) -> None:
        """Zero every tensor held now (this rank's copies; not collective, no barrier)."""
        for t in self.tensors:
            t.zero_()

    def free(self) -> None:
        """Free every tensor held, in reverse allocation order (collective); the buffers cannot be
        used afterwards."""
        while self.tensors:
            shmem.mori_shmem_free_tensor(self.tensors.pop())

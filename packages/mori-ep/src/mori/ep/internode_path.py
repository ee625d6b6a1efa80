"""Host side of the inter-node Triton kernels (:mod:`mori.ep.internode_kernels`). On a GPU each call
returns once its kernels ended (see :meth:`InterNodeKernels._wait`), and the first launch of each
kernel variant waits for the stream first (:mod:`mori.shmem.loading`); on the cpu runtime (the
interpreter) there is nothing to wait for.

:class:`InterNodeKernels` belongs to one :class:`~mori.ep.EpDispatchCombineOp` of kernel type
``InterNode``, ``InterNodeV1`` or ``InterNodeV1LL`` on the kernel path. It uses the operator's
buffers (``op.buffers``) and the stream buffers of its :class:`~mori.ep.internode.InterNodeHost`
(``xin``, ``xout``, ``cst``, ``cst_w``, ``sig``: the host path's layout), and adds its control
words ``xctrl`` and local tables. Each dispatch is two launches and each combine two, on the
current stream (loaded first, see :mod:`mori.shmem.loading`); nothing reads a device value on
the host (:meth:`error` does, on request).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

import mori.shmem as shmem
from mori.core.errors import MoriStateError, MoriValueError
from mori.shmem.loading import KernelLoader

if TYPE_CHECKING:
    from mori.ep.internode import InterNodeHost
    from mori.ep.op import EpDispatchCombineOp

__all__ = ["InterNodeKernels"]


def _pow2_at_least(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


class InterNodeKernels:
    """Launches the inter-node kernels for one operator. Collective to build (``xctrl``)."""

    def __init__(self, op: EpDispatchCombineOp, inter: InterNodeHost) -> None:
        from mori.ep import internode_kernels as kern
        from mori.shmem.device import shmem_device_context

        self.kern = kern
        self.op, self.inter = op, inter
        b = op.buffers
        if b.device.type == "cpu" and type(kern.xd_send_kernel).__name__ != "InterpretedFunction":
            raise MoriStateError(
                "EpDispatchCombineOp: the cpu runtime runs the Triton kernels only in the interpreter; "
                "set TRITON_INTERPRET=1 before triton is first imported, or use impl='host'"
            )
        w, m = op.world_size, b.m
        dev = b.device
        self.device = dev
        self.is_gpu = dev.type != "cpu"
        self.ctx = shmem_device_context()
        self.n_slots = inter.n_slots
        self.xctrl = b.add(shmem.mori_shmem_create_tensor((kern.xctrl_words(w, self.n_slots),), torch.int64))
        self.xctrl.zero_()

        def i32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values or [0], dtype=torch.int32, device=dev)

        ns = len(inter.out_streams)
        self.ns = ns
        self.memb = max(1, max((len(mem) for _, mem in inter.out_streams), default=1))
        self.local = i32(inter.local)
        self.strm_to = i32([to for to, _ in inter.out_streams])
        self.strm_mem = i32([p for _, mem in inter.out_streams for p in mem])
        self.in_src = i32(inter.in_src)
        self.fan = i32(inter.fan)
        self.dest_slot = torch.full((w, m), -1, dtype=torch.int32, device=dev)
        self.xtok = torch.zeros((max(1, ns), m), dtype=torch.int32, device=dev)
        self.xrow = torch.full((max(1, ns), m), -1, dtype=torch.int32, device=dev)
        self.xcnt = torch.zeros(max(1, ns), dtype=torch.int32, device=dev)
        self.relay_cnt = torch.zeros(self.n_slots, dtype=torch.int32, device=dev)
        self.relay_tok = torch.zeros((self.n_slots, m), dtype=torch.int32, device=dev)
        self.relay_slot = torch.full((self.n_slots, m, len(inter.fan)), -1, dtype=torch.int32, device=dev)
        self.total_recv = torch.zeros(1, dtype=torch.int32, device=dev)
        #: added to every dispatch stream header's row count: 0 (a test sets it to play a lying peer)
        self.forge = 0
        #: every kernel of a dispatch or combine is loaded before the first of them runs: the
        #: first waits on the proxy, and a module load meanwhile would never return
        self.loader = KernelLoader()
        self.dispatch_calls = 0
        self.combine_calls = 0

    def _common(self) -> dict[str, Any]:
        op = self.op
        return {
            "W": op.world_size,
            "G": self.inter.g,
            "NS": self.ns,
            "K": op.buffers.k,
            "K_P2": _pow2_at_least(op.buffers.k),
            "HIER": self.inter.hier,
        }

    # -- dispatch --------------------------------------------------------------------------------

    def dispatch(
        self,
        input: torch.Tensor,
        weights: torch.Tensor | None,
        scales: torch.Tensor | None,
        indices: torch.Tensor,
    ) -> None:
        """Launch the two dispatch kernels (send, then fan-out and completion)."""
        b, inter = self.op.buffers, self.inter
        self.dispatch_calls += 1
        n, h = input.shape
        nb = h * input.element_size()
        inp_b = input.contiguous().view(torch.uint8)
        if scales is not None:
            sc = scales.contiguous().view(torch.uint8)
            sb, sc_stride = sc.shape[1], sc.stride(0)
        else:
            sc, sb, sc_stride = b.recv_scales, 0, 0
        off_w, off_s, off_i, off_t, stride = inter.dispatch_layout(nb, weights is not None, sb)
        wts = weights.contiguous() if weights is not None else b.recv_w  # unused when HAS_W=0
        sizes = (nb, b.row_bytes, sb, b.scale_bytes, b.m, b.r, b.e_local, off_w, off_s, off_i, off_t, stride)
        block = min(1024, _pow2_at_least(max(nb, sb, 16)))
        common = {**self._common(), "HAS_W": weights is not None, "BLOCK": block}
        send_args = (
            inp_b,
            inp_b.stride(0),
            wts,
            sc,
            sc_stride,
            indices.contiguous(),
            n,
            b.recv_tok,
            b.recv_w,
            b.recv_scales,
            b.recv_idx,
            b.recv_src,
            self.dest_slot,
            self.xtok,
            self.xrow,
            self.xcnt,
            self.local,
            self.strm_to,
            self.strm_mem,
            self.in_src,
            inter.xout,
            inter.xout.stride(0),
            inter.xin,
            inter.xin.stride(0),
            inter.sig,
            self.xctrl,
            self.ctx,
            self.forge,
            *sizes,
        )
        send_kw = {"NS_P2": _pow2_at_least(self.ns), "MEMB": self.memb, **common}
        fan_args = (
            b.recv_tok,
            b.recv_w,
            b.recv_scales,
            b.recv_idx,
            b.recv_src,
            self.relay_cnt,
            self.relay_tok,
            self.relay_slot,
            self.total_recv,
            self.fan,
            self.local,
            self.in_src,
            inter.xin,
            inter.xin.stride(0),
            inter.sig,
            self.xctrl,
            self.ctx,
            *sizes,
        )
        self.loader.launch(
            [
                (self.kern.xd_send_kernel, (1,), send_args, send_kw),
                (self.kern.xd_fan_kernel, (1,), fan_args, {"F": len(inter.fan), **common}),
            ]
        )
        self._wait("dispatch")

    def dispatch_error(self, func: str) -> MoriValueError | None:
        """The error of the last dispatch (a bad stream, or more rows than the receive buffers),
        or None. Reads control words: a device synchronisation on a GPU."""
        w, e = self.op.world_size, self.dispatch_calls
        x = self.kern.XCTRL
        words = self.xctrl[4 * w : 4 * w + 8].cpu().tolist()
        if e and words[x["ERR"]] == e:
            src, kind = int(words[x["ERR_SRC"]]) & 0xFFFFFFFF, int(words[x["ERR_SRC"]]) >> 32
            what = (
                f"a stream header that is not call {e} with at most {self.op.buffers.m} rows"
                if kind == 1
                else f"source token ids outside [0, {self.op.buffers.m}) or out of order"
            )
            return MoriValueError(
                f"{func}: rank {src} (node {src // self.inter.g}) sent a bad stream for call {e}: {what}; "
                "its rows were dropped"
            )
        if e and words[x["OVF"]] == e:
            return MoriValueError(
                f"{func}: rank {self.op.rank} or a rank it sent to would receive more than "
                f"max_num_tokens_to_recv() = {self.op.buffers.r} rows; raise max_total_recv_tokens (the rows "
                "beyond it were dropped)"
            )
        return None

    def combine_error(self, func: str) -> MoriValueError | None:
        """The error of the last combine (a combined stream with another call or row count), or
        None. Reads a control word: a device synchronisation on a GPU."""
        w, c = self.op.world_size, self.combine_calls
        if c and int(self.xctrl[4 * w + self.kern.XCTRL["ERR_C"]]) == c:
            return MoriValueError(
                f"{func}: a relay of another node sent combined rows that are not call {c} or not one "
                "row per token this rank sent it; its rows were not added"
            )
        return None

    def local_expert_count(self) -> None:
        """Fill ``op.local_expert_count`` from the valid received rows (device ops, no sync)."""
        self.op.buffers.count_local_experts(self.total_recv, self.op.rank, self.op.local_expert_count)

    # -- combine ---------------------------------------------------------------------------------

    def combine(
        self,
        input: torch.Tensor,
        weights: torch.Tensor | None,
        out: torch.Tensor,
        out_w: torch.Tensor | None,
        n_tok: int,
    ) -> None:
        """Launch the two combine kernels (stage, then relay sums and the reduction into ``out``)."""
        op, b, inter = self.op, self.op.buffers, self.inter
        self.combine_calls += 1
        w, m = op.world_size, b.m
        h = input.shape[1]
        dt, es = input.dtype, input.element_size()
        stage = b.stage_tok.view(w * m, b.stage_bytes).view(dt)
        cst = inter.cst.view(-1, inter.cst.shape[-1]).view(dt)
        nbw = h * es
        off_w, _off_s, cstride = inter.combine_layout(nbw, weights is not None, 0)
        xs = inter.xin.stride(0)
        common = {
            **self._common(),
            "S": self.n_slots,
            "NS_P2": _pow2_at_least(self.ns),
            "F": len(inter.fan),
            "HAS_W": weights is not None,
            "BLOCK": min(1024, _pow2_at_least(h)),
        }
        wts = weights.contiguous() if weights is not None else b.recv_w  # unused when HAS_W=0
        topo = (self.local, self.strm_to, self.in_src, self.xctrl, self.ctx, h, m)
        stage_args = (stage, stage.stride(0), b.stage_w, cst, cst.stride(0), inter.cst_w)
        stage_call = (input, input.stride(0), wts, self.total_recv, b.recv_src, *stage_args, *topo)
        reduce_call = (
            out,
            out_w if out_w is not None else b.recv_w,
            n_tok,
            self.dest_slot,
            self.xrow,
            self.xcnt,
            self.relay_cnt,
            self.relay_tok,
            self.relay_slot,
            inter.xout.view(dt),
            inter.xout.view(torch.float32),
            inter.xin.view(dt),
            inter.xin.view(torch.float32),
            xs // es,
            xs // 4,
            cstride // es,
            cstride // 4,
            off_w // 4,
            inter.sig,
            *stage_args,
            *topo,
        )
        self.loader.launch(
            [
                (self.kern.xc_stage_kernel, (1,), stage_call, common),
                (self.kern.xc_reduce_kernel, (1,), reduce_call, common),
            ]
        )
        self._wait("combine")

    def _wait(self, func: str) -> None:
        """On a GPU: return only once this call's kernels ended.

        Its kernels wait on the proxy, whose transport moves GPU memory through the CUDA driver
        (UCX's cuda_ipc / cuda_copy); a synchronous call of the host meanwhile -- a ``.cpu()`` or
        ``.item()`` of a tensor, a copy to pageable memory on the stream the kernels run on --
        stops those copies, and neither ever ends (one H200, 2 emulated nodes: the GPU test's
        ``.cpu()`` of the received rows hung; with this wait its rounds passed). Not while a CUDA
        graph is being captured: these kernels are not capturable."""
        if not self.is_gpu:
            return
        if torch.cuda.is_current_stream_capturing():
            raise MoriStateError(
                f"EpDispatchCombineOp.{func}: the inter-node kernel types cannot be captured in a CUDA graph "
                "on a GPU heap (each call waits for its kernels: the proxy's copies and a host sync would "
                "otherwise wait on each other)"
            )
        torch.cuda.current_stream(self.device).synchronize()

"""All-reduce (sum): :class:`AllreduceSdma`.

Two algorithms, chosen by size on every rank alike (``last_path`` says which ran):

* **one-shot** (at most ``oneshot_max`` bytes, default 1 MiB): every rank stages its input in the
  small half of this call's parity, one synchronisation, then every rank sums every rank's copy;
* **reduce-scatter + all-gather** (larger): every rank stages its input in the large region; rank
  ``r`` sums chunk ``r`` over every rank's copy, publishes it, and every rank gathers every chunk.

Sums run in rank order 0, 1, ..., so every rank gets the same bits, by both algorithms and both
implementations: integers wrap (int32, uint32), float32 adds in float32, float16 and bfloat16
accumulate in float32 and round once.
"""

from __future__ import annotations

from typing import Any

import torch

from mori.ccl.base import Collective
from mori.core.errors import bad_type, bad_value

__all__ = ["DTYPES", "AllreduceSdma"]

#: dtypes the all-reduce sums (the original's)
DTYPES: tuple[torch.dtype, ...] = (torch.uint32, torch.int32, torch.float32, torch.float16, torch.bfloat16)
MODES = ("eager", "graph")
#: chunk boundaries of reduce-scatter are multiples of this many bytes (aligned vector accesses)
CHUNK_ALIGN = 256


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def sum_views(views: list[torch.Tensor], out: torch.Tensor) -> None:
    """``out = views[0] + views[1] + ...`` in that order; 16-bit floats accumulate in float32;
    uint32 adds as int32 (the same bits: both wrap modulo 2**32; torch has no uint32 add on CPU)."""
    if out.dtype == torch.uint32:
        views = [v.view(torch.int32) for v in views]
        out = out.view(torch.int32)
    if out.dtype in (torch.float16, torch.bfloat16):
        acc = views[0].float()
        for v in views[1:]:
            acc.add_(v)
        out.copy_(acc)
        return
    if len(views) == 1:
        out.copy_(views[0])
        return
    torch.add(views[0], views[1], out=out)
    for v in views[2:]:
        out.add_(v)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes of two contiguous tensors overlap."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


class AllreduceSdma(Collective):
    """Sum of every PE's ``count`` elements of ``dtype``, on every PE (see the module docstring).

    Arguments as :class:`~mori.ccl.base.Collective`, plus ``dtype`` (one of :data:`DTYPES`),
    ``mode`` (``"eager"`` or ``"graph"``: the same kernels either way, capturable on GPUs) and
    ``oneshot_max`` (bytes; default 1 MiB).
    """

    NAME = "AllreduceSdma"

    def __init__(
        self,
        my_pe: int,
        npes: int,
        input_buffer_size: int | None = None,
        output_buffer_size: int | None = None,
        transit_buffer_size: int | None = None,
        copy_output_to_user: bool = True,
        dtype: torch.dtype = torch.float32,
        mode: str = "eager",
        *,
        comm: Any = None,
        impl: str = "auto",
        max_programs: int | None = None,
        oneshot_max: int | None = None,
    ) -> None:
        func = self.NAME
        if not isinstance(dtype, torch.dtype):
            raise bad_type(func, "dtype", dtype, f"a torch.dtype ({_names(DTYPES)})")
        if dtype not in DTYPES:
            raise bad_value(func, "dtype", dtype, _names(DTYPES))
        if mode not in MODES:
            raise bad_value(func, "mode", mode, "'eager' or 'graph'")
        self.dtype = dtype
        self.mode = mode
        super().__init__(
            my_pe,
            npes,
            input_buffer_size,
            output_buffer_size,
            transit_buffer_size,
            copy_output_to_user,
            comm=comm,
            impl=impl,
            max_programs=max_programs,
            small_cap=oneshot_max,
        )

    # -- public calls -------------------------------------------------------------------------------

    def __call__(self, inp: torch.Tensor, out: torch.Tensor | None, count: int, stream: Any = None) -> None:
        """``out[:count] = sum over PEs of inp[:count]``. Collective. ``inp``/``out``: contiguous tensors
        on the communicator's device with at least ``count`` elements of ``dtype`` (viewed as such; they
        may be the same tensor). Host-blocking on CPU; stream-ordered (graph-capturable) on GPUs."""
        func = f"{self.NAME}.__call__"
        a, b = self._plan(func, inp, out, count)
        self._run(func, stream, lambda: self._body(a, b))

    def allreduce_inplace(self, data: torch.Tensor, count: int, stream: Any = None) -> None:
        """``data[:count] = sum over PEs of data[:count]``. Collective."""
        func = f"{self.NAME}.allreduce_inplace"
        a, b = self._plan(func, data, data, count, inplace=True)
        self._run(func, stream, lambda: self._body(a, b))

    def start_async(
        self, inp: torch.Tensor, out: torch.Tensor | None, count: int, stream: Any = None
    ) -> None:
        """:meth:`__call__` started asynchronously (see :mod:`mori.ccl.base`); finish with ``wait_async``."""
        func = f"{self.NAME}.start_async"
        a, b = self._plan(func, inp, out, count)
        self._start_async(func, stream, lambda: self._body(a, b))

    # -- planning -----------------------------------------------------------------------------------

    def _plan(
        self, func: str, inp: Any, out: Any, count: Any, *, inplace: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        count = self._count(func, "count", count)
        nbytes = count * self.dtype.itemsize
        inp = self._tensor(func, "data" if inplace else "inp", inp, min_bytes=nbytes)
        a = inp.reshape(-1).view(torch.uint8)[:nbytes].view(self.dtype)
        if inplace:
            b = a
        else:
            o = self._output(func, out, nbytes, a)
            b = o.reshape(-1).view(torch.uint8)[:nbytes].view(self.dtype)
        self._check_limits(func, nbytes, nbytes, nbytes)
        return a, b

    def _body(self, inp: torch.Tensor, out: torch.Tensor) -> str:
        if inp.numel() == 0:
            return "empty"
        small = inp.numel() * inp.element_size() <= self.ch.small_cap
        if self.impl == "host":
            return self._host_oneshot(inp, out) if small else self._host_rsag(inp, out)
        return self._kernel_oneshot(inp, out) if small else self._kernel_rsag(inp, out)

    def _chunk(self, count: int) -> int:
        """Elements of each rank's reduce-scatter chunk: count / ranks, rounded up to CHUNK_ALIGN bytes."""
        align = max(1, CHUNK_ALIGN // self.dtype.itemsize)
        per_rank = -(-count // self.ch.nranks)
        return -(-per_rank // align) * align

    # -- host path ----------------------------------------------------------------------------------

    def _host_oneshot(self, inp: torch.Tensor, out: torch.Tensor) -> str:
        ch = self.ch
        nb = inp.numel() * inp.element_size()
        off = ch.small_half(ch.calls() + 1)
        ch.view(ch.rank, off, nb).copy_(inp.view(torch.uint8))
        ch.devcomm.lsa_barrier_sync(ch.ready(0))
        sum_views([ch.view(p, off, nb).view(self.dtype) for p in range(ch.nranks)], out)
        return "host:oneshot"

    def _host_rsag(self, inp: torch.Tensor, out: torch.Tensor) -> str:
        ch = self.ch
        es = inp.element_size()
        count = inp.numel()
        off = ch.large_off
        dc = ch.devcomm
        dc.lsa_barrier_wait(ch.done)  # every peer finished reading our large region
        chunk = self._chunk(count)

        def bounds(r: int) -> tuple[int, int]:
            return min(r * chunk, count), min((r + 1) * chunk, count)

        lo, hi = bounds(ch.rank)
        # Stage what the peers reduce: every chunk but ours, which we read from the input itself,
        # unless the output overlaps the input (in place): the sum then must not read what it writes.
        raw, mine = inp.view(torch.uint8), ch.view(ch.rank, off, count * es)
        aliased = _overlap(inp, out)
        if aliased:
            mine.copy_(raw)
        else:
            mine[: lo * es].copy_(raw[: lo * es])
            mine[hi * es :].copy_(raw[hi * es :])
        dc.lsa_barrier_sync(ch.ready(0))
        if hi > lo:
            # our chunk, summed in rank order straight into the output, then published for the peers
            views = [
                inp[lo:hi]
                if p == ch.rank and not aliased
                else ch.view(p, off + lo * es, (hi - lo) * es).view(self.dtype)
                for p in range(ch.nranks)
            ]
            sum_views(views, out[lo:hi])
            ch.view(ch.rank, off + lo * es, (hi - lo) * es).view(self.dtype).copy_(out[lo:hi])
        dc.lsa_barrier_sync(ch.ready2(0))
        for p in range(ch.nranks):
            plo, phi = bounds(p)
            if p != ch.rank and phi > plo:
                out[plo:phi].copy_(ch.view(p, off + plo * es, (phi - plo) * es).view(self.dtype))
        dc.lsa_barrier_arrive(ch.done)
        return "host:rsag"

    # -- kernel path --------------------------------------------------------------------------------

    def _kernel_oneshot(self, inp: torch.Tensor, out: torch.Tensor) -> str:
        k, ch = self.kernels, self.ch
        es = inp.element_size()
        stage = self._stage(ch.small_off, 2 * ch.small_cap, self.dtype)
        k.allreduce_oneshot_kernel[(ch.programs,)](
            inp,
            out,
            stage,
            ch.window.table,
            ch.devcomm.tensor,
            inp.numel(),
            self._per_program(inp.numel()),
            ch.small_cap // es,
            ACC_F32=self.dtype.is_floating_point,
            BLOCK=k.BLOCK,
            num_warps=k.NUM_WARPS,
        )
        return "triton:oneshot"

    def _kernel_rsag(self, inp: torch.Tensor, out: torch.Tensor) -> str:
        k, ch = self.kernels, self.ch
        count = inp.numel()
        chunk = self._chunk(count)
        stage = self._stage(ch.large_off, count * inp.element_size(), self.dtype)
        k.allreduce_rsag_kernel[(ch.programs,)](
            inp,
            out,
            stage,
            ch.window.table,
            ch.devcomm.tensor,
            ch.ticket,
            count,
            chunk,
            self._per_program(chunk),
            ACC_F32=self.dtype.is_floating_point,
            BLOCK=k.BLOCK,
            num_warps=k.NUM_WARPS,
        )
        return "triton:rsag"

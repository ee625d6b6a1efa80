"""All-reduce (sum): :class:`AllreduceSdma`.

Two algorithms, chosen by size on every rank alike (``last_path`` says which ran):

* **one-shot** (at most ``oneshot_max`` bytes): every rank stages its input in the small half of
  this call's parity, one synchronisation, then every rank sums every rank's copy, in rank order;
* **reduce-scatter + all-gather** (larger): rank ``r`` owns chunk ``r``.
  Kernels (``triton:rsag``): every rank stages its input; rank ``r`` sums chunk ``r`` over every
  rank's copy in rank order, publishes it, and every rank copies every chunk.
  Host path (``host:rsag``): the reduce-scatter accumulates: rank ``r`` puts its own chunk ``r`` in
  its staging, then in step ``s = 1 .. n-1`` rank ``r - s`` adds its chunk ``r`` there (every rank
  adds into another chunk in each step, so the steps run in parallel); every rank then copies every
  chunk. No input is staged twice: a quarter less memory traffic than staging, on CPU ranks that
  share cores the difference is the time.

``oneshot_max`` defaults to 1 MiB (the original's limit) for the kernels and to 512 KiB on the host
path: there, on 4 ranks sharing 2 cores, the reduce-scatter above was faster than the one-shot from
1 MiB on (1.9-2.0 ms against 2.3 ms at 1 MiB, 3.2 against 4.4-4.6 ms at 2 MiB, about equal at 512 KiB,
in two runs of the same processes alternating between the two).

Every rank gets the same bits: each element is summed once, in a fixed order (rank order, or for
``host:rsag`` the ring order ``r, r-1, ..., r-n+1`` of its chunk ``r``, modulo ``n``), and all ranks
copy that sum. Integers wrap (int32, uint32), float32 adds in float32, float16 and bfloat16
accumulate in float32 and round once.
"""

from __future__ import annotations

from typing import Any

import torch

from mori.ccl.base import Collective
from mori.ccl.channel import SMALL_CAP
from mori.core.errors import bad_type, bad_value

__all__ = ["DTYPES", "AllreduceSdma"]

#: dtypes the all-reduce sums (the original's)
DTYPES: tuple[torch.dtype, ...] = (torch.uint32, torch.int32, torch.float32, torch.float16, torch.bfloat16)
MODES = ("eager", "graph")
#: chunk boundaries of reduce-scatter are multiples of this many bytes (aligned vector accesses)
CHUNK_ALIGN = 256
#: default ``oneshot_max`` of the host path (see the module docstring)
HOST_ONESHOT_MAX = 512 << 10


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


class AllreduceSdma(Collective):
    """Sum of every PE's ``count`` elements of ``dtype``, on every PE (see the module docstring).

    Arguments as :class:`~mori.ccl.base.Collective`, plus ``dtype`` (one of :data:`DTYPES`),
    ``mode`` (``"eager"`` or ``"graph"``: the same kernels either way, capturable on GPUs) and
    ``oneshot_max`` (bytes; default 1 MiB for the kernels, 512 KiB on the host path).
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

    def _default_small_cap(self) -> int:
        return HOST_ONESHOT_MAX if self.impl == "host" else SMALL_CAP

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
        # Reduce-scatter by accumulation in place, then all-gather. Rank p's chunk is summed in
        # rank p's staging: p copies its own chunk there, then in step s = 1 .. n-1 rank p - s
        # adds its chunk p to it (every rank works on a different chunk in every step, so the
        # steps run in parallel; a rank waits only for the rank whose chunk it adds into next,
        # and for everybody after the last step). No rank stages its input for the
        # others, and nobody copies a result twice: every rank then copies every chunk's sum
        # into its output. 16-bit floats accumulate in float32 (the staged sums are float32).
        ch = self.ch
        dc = ch.devcomm
        n, me = ch.nranks, ch.rank
        count = inp.numel()
        chunk = self._chunk(count)
        x, o = (inp.view(torch.int32), out.view(torch.int32)) if self.dtype == torch.uint32 else (inp, out)
        acc_dtype = torch.float32 if self.dtype in (torch.float16, torch.bfloat16) else x.dtype

        def bounds(r: int) -> tuple[int, int]:
            return min(r * chunk, count), min((r + 1) * chunk, count)

        def acc(r: int) -> torch.Tensor:
            lo, hi = bounds(r)
            return ch.view(r, ch.large_off, (hi - lo) * acc_dtype.itemsize).view(acc_dtype)

        if n == 1:
            o.copy_(x)
            return "host:rsag"
        dc.lsa_barrier_wait(ch.done)  # every peer finished reading our sums of the last call
        lo, hi = bounds(me)
        acc(me).copy_(x[lo:hi])
        # Step s adds into the chunk that rank me + 1 added into in step s - 1 (or initialised):
        # waiting for that one rank is enough, until the last step, after which every sum is read.
        nxt = ((me + 1) % n,)
        dc.lsa_barrier_arrive(ch.ready(0))
        dc.lsa_barrier_wait(ch.ready(0), members=nxt)
        for step in range(1, n):
            t = (me + step) % n
            tlo, thi = bounds(t)
            if thi > tlo:
                acc(t).add_(x[tlo:thi])
            dc.lsa_barrier_arrive(ch.ready2(0))
            dc.lsa_barrier_wait(ch.ready2(0), members=nxt if step < n - 1 else None)
        # every sum is complete; the input is no longer read (so out may be inp: in place)
        for p in range(n):
            plo, phi = bounds(p)
            if phi > plo:
                o[plo:phi].copy_(acc(p))
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
            **self._trace(),
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
            **self._trace(),
        )
        return "triton:rsag"

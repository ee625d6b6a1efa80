"""All-gather and all-to-all by pulls: :class:`AllgatherSdma`, :class:`All2allSdma`.

Every rank stages its input; after one synchronisation every rank copies what it needs from every
rank's staging straight into its output: all-gather takes each rank's whole input (output block
``p`` = rank ``p``'s input), all-to-all takes block ``me`` of each rank's input (output block ``p``
= block ``me`` of rank ``p``'s input). Inputs staging at most ``small_cap`` bytes (1 MiB) use the
small halves (one synchronisation per call); larger ones the large region (plus the DONE step).

Paths (``last_path``): ``host:small`` / ``host:large`` (cpu runtime: torch copies of the peers'
views), ``triton:small`` / ``triton:large`` (the load/store :func:`~mori.ccl.kernels.gather_kernel`),
``copy-engine:large`` (GPU, blocks of at least ``copy_engine_min`` bytes: ``cudaMemcpyAsync`` of
the peers' staging into the output on the caller's stream, ordered by :func:`sync_kernel`).

Both move bytes: the original counts them in uint32 words (``count_per_pe``); any dtype whose
bytes are that many words works.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from mori.ccl.base import Collective
from mori.core.errors import MoriStateError, bad_value

__all__ = ["All2allSdma", "AllgatherSdma"]

WORD = 4
#: GPU blocks of at least this many bytes go through the copy engines (the load/store kernel below)
DEFAULT_COPY_ENGINE_MIN = 16 << 20
_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _word(*counts: int) -> int:
    """Widest word size dividing every count (bytes and addresses)."""
    return next(w for w in (8, 4, 2, 1) if all(c % w == 0 for c in counts))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class _Pull(Collective):
    """The pull protocol shared by all-gather and all-to-all (and the FSDP layout)."""

    def __init__(self, *args: Any, copy_engine_min: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if copy_engine_min is not None and (
            isinstance(copy_engine_min, bool) or not isinstance(copy_engine_min, int) or copy_engine_min < 0
        ):
            raise bad_value(self.NAME, "copy_engine_min", copy_engine_min, "None or a number of bytes >= 0")
        self.copy_engine_min = DEFAULT_COPY_ENGINE_MIN if copy_engine_min is None else copy_engine_min

    def _pull(self, inp: torch.Tensor, out: torch.Tensor, block: int, in_blocks: int, src_block: int) -> str:
        """``inp``/``out``: uint8 views (``in_blocks * block`` and ``nranks * block`` bytes)."""
        if block == 0:
            return "empty"
        staged = in_blocks * block
        small = staged <= self.ch.small_cap
        if self.impl == "host":
            return self._host(inp, out, block, in_blocks, src_block, small)
        if not small and block >= self.copy_engine_min:
            return self._copy_engine(inp, out, block, src_block)
        return self._kernel(inp, out, block, in_blocks, src_block, small)

    def _host(
        self, inp: torch.Tensor, out: torch.Tensor, block: int, in_blocks: int, src_block: int, small: bool
    ) -> str:
        ch = self.ch
        dc = ch.devcomm
        staged = in_blocks * block
        if small:
            off = ch.small_half(ch.calls() + 1)
        else:
            off = ch.large_off
            dc.lsa_barrier_wait(ch.done)
        w = _word(block, staged, off, inp.data_ptr(), out.data_ptr())
        dt = _WORD_DTYPES[w]
        ch.view(ch.rank, off, staged).view(dt).copy_(inp.view(dt))
        dc.lsa_barrier_sync(ch.ready(0))
        src = off + src_block * block
        for p in range(ch.nranks):
            out[p * block : (p + 1) * block].view(dt).copy_(ch.view(p, src, block).view(dt))
        if not small:
            dc.lsa_barrier_arrive(ch.done)
        return "host:small" if small else "host:large"

    def _kernel(
        self, inp: torch.Tensor, out: torch.Tensor, block: int, in_blocks: int, src_block: int, small: bool
    ) -> str:
        k, ch = self.kernels, self.ch
        w = _word(block, ch.small_cap, inp.data_ptr(), out.data_ptr())
        dt = _WORD_DTYPES[w]
        stage = self._stage(
            ch.small_off if small else ch.large_off, 2 * ch.small_cap if small else in_blocks * block, dt
        )
        k.gather_kernel[(ch.programs,)](
            inp.view(dt),
            out.view(dt),
            stage,
            ch.window.table,
            ch.devcomm.tensor,
            ch.ticket,
            block // w,
            in_blocks,
            src_block,
            self._per_program(block // w),
            ch.small_cap // w,
            LARGE=not small,
            BLOCK=k.BLOCK,
            num_warps=k.NUM_WARPS,
            **self._trace(),
        )
        return "triton:small" if small else "triton:large"

    def _copy_engine(self, inp: torch.Tensor, out: torch.Tensor, block: int, src_block: int) -> str:
        # stream-ordered: wait DONE, stage, sync READY, one copy per rank, arrive DONE
        k, ch = self.kernels, self.ch
        off = ch.large_off
        self._sync(k.PHASE_WAIT_DONE)
        ch.view(ch.rank, off, inp.numel()).copy_(inp)
        self._sync(k.PHASE_READY)
        src = off + src_block * block
        for p in range(ch.nranks):
            out[p * block : (p + 1) * block].copy_(ch.view(p, src, block))
        self._sync(k.PHASE_FINISH)
        return "copy-engine:large"


class AllgatherSdma(_Pull):
    """All-gather: output block ``p`` (``count_per_pe`` uint32 words) = PE ``p``'s input, in PE order.

    Arguments as :class:`~mori.ccl.base.Collective`, plus ``copy_engine_min`` (GPU: bytes per PE
    from which the copy engines move the data; default 16 MiB). Also the FSDP
    parameter-contiguous layout: :meth:`enqueue_param_contiguous`, then
    :meth:`start_async_param_contiguous` and ``wait_async``.
    """

    NAME = "AllgatherSdma"

    def __init__(
        self,
        my_pe: int,
        npes: int,
        input_buffer_size: int | None = None,
        output_buffer_size: int | None = None,
        transit_buffer_size: int | None = None,
        copy_output_to_user: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            my_pe,
            npes,
            input_buffer_size,
            output_buffer_size,
            transit_buffer_size,
            copy_output_to_user,
            **kwargs,
        )
        self._params: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _plan(self, func: str, inp: Any, out: Any, count_per_pe: Any) -> tuple[torch.Tensor, torch.Tensor]:
        n = self._count(func, "count_per_pe", count_per_pe) * WORD
        a = as_bytes(self._tensor(func, "inp", inp, min_bytes=n))[:n]
        o = as_bytes(self._output(func, out, n * self.npes, a))[: n * self.npes]
        self._check_limits(func, n, n * self.npes, n)
        return a, o

    def __call__(
        self, inp: torch.Tensor, out: torch.Tensor | None, count_per_pe: int, stream: Any = None
    ) -> bool:
        """Gather ``count_per_pe`` uint32 words of ``inp`` from every PE into ``out`` (``npes`` blocks in
        PE order). Collective. Returns True."""
        func = f"{self.NAME}.__call__"
        a, o = self._plan(func, inp, out, count_per_pe)
        self._run(func, stream, lambda: self._pull(a, o, a.numel(), 1, 0))
        return True

    def start_async(
        self, inp: torch.Tensor, out: torch.Tensor | None, count_per_pe: int, stream: Any = None
    ) -> bool:
        """:meth:`__call__`, asynchronously (see :mod:`mori.ccl.base`). Returns True."""
        func = f"{self.NAME}.start_async"
        a, o = self._plan(func, inp, out, count_per_pe)
        self._start_async(func, stream, lambda: self._pull(a, o, a.numel(), 1, 0))
        return True

    # -- FSDP parameter-contiguous layout -----------------------------------------------------------

    def enqueue_param_contiguous(self, inp: torch.Tensor, out: torch.Tensor) -> int:
        """Queue one parameter for the next :meth:`start_async_param_contiguous`: ``inp`` is this PE's
        shard (any dtype, ``s`` bytes, a multiple of 4), ``out`` the full parameter, rank-major (at
        least ``npes * s`` bytes: shard of PE ``p`` at bytes ``[p*s, (p+1)*s)``). Not collective;
        every PE must queue the same shapes in the same order. Returns the parameter's index."""
        func = f"{self.NAME}.enqueue_param_contiguous"
        if self.is_async_in_progress():
            raise MoriStateError(f"{func}: an async call is in progress; wait_async() first")
        a = as_bytes(self._tensor(func, "inp", inp, min_bytes=0))
        if a.numel() % WORD:
            raise bad_value(func, "inp", f"{a.numel()} bytes", "a multiple of 4 bytes (uint32 words)")
        o = as_bytes(self._tensor(func, "out", out, min_bytes=a.numel() * self.npes))[: a.numel() * self.npes]
        self._params.append((a, o))
        return len(self._params) - 1

    def start_async_param_contiguous(self, stream: Any = None) -> bool:
        """All-gather every queued parameter in one collective: the shards travel packed, each
        parameter lands contiguous in its ``out``. Finish with ``wait_async``; the queue is then
        empty. Collective. Returns True (False: nothing was queued)."""
        func = f"{self.NAME}.start_async_param_contiguous"
        if not self._params:
            return False
        params, self._params = self._params, []
        total = sum(a.numel() for a, _ in params)
        self._check_limits(func, total, total * self.npes, total)
        self._start_async(func, stream, lambda: self._param_contiguous(params, total))
        return True

    def _param_contiguous(self, params: list[tuple[torch.Tensor, torch.Tensor]], total: int) -> str:
        ch = self.ch
        if total == 0:
            return "empty"
        # the small protocol needs the call's parity on the host: GPU calls use the large one
        small = total <= ch.small_cap and self.impl == "host"
        if self.impl == "host":
            dc = ch.devcomm
            off = ch.small_half(ch.calls() + 1) if small else ch.large_off
            if not small:
                dc.lsa_barrier_wait(ch.done)
        else:
            off = ch.large_off
            self._sync(self.kernels.PHASE_WAIT_DONE)
        pos = off
        for a, _ in params:
            ch.view(ch.rank, pos, a.numel()).copy_(a)
            pos += a.numel()
        if self.impl == "host":
            ch.devcomm.lsa_barrier_sync(ch.ready(0))
        else:
            self._sync(self.kernels.PHASE_READY)
        for p in range(ch.nranks):
            pos = off
            for a, o in params:
                s = a.numel()
                o[p * s : (p + 1) * s].copy_(ch.view(p, pos, s))
                pos += s
        if self.impl == "host":
            if not small:
                ch.devcomm.lsa_barrier_arrive(ch.done)
            return "host:param-contiguous"
        self._sync(self.kernels.PHASE_FINISH)
        return "copy-engine:param-contiguous"


class All2allSdma(_Pull):
    """All-to-all: block ``q`` (``count`` uint32 words) of PE ``p``'s input becomes block ``p`` of PE
    ``q``'s output. Arguments as :class:`AllgatherSdma`."""

    NAME = "All2allSdma"

    def _plan(self, func: str, inp: Any, out: Any, count: Any) -> tuple[torch.Tensor, torch.Tensor]:
        n = self._count(func, "count", count) * WORD
        a = as_bytes(self._tensor(func, "inp", inp, min_bytes=n * self.npes))[: n * self.npes]
        o = as_bytes(self._output(func, out, n * self.npes, a))[: n * self.npes]
        self._check_limits(func, n * self.npes, n * self.npes, n * self.npes)
        return a, o

    def __call__(self, inp: torch.Tensor, out: torch.Tensor | None, count: int, stream: Any = None) -> float:
        """Exchange ``count`` uint32 words with every PE. Collective. Returns the seconds the call took
        on the host (on a GPU: to enqueue, not to run)."""
        func = f"{self.NAME}.__call__"
        a, o = self._plan(func, inp, out, count)
        t0 = time.perf_counter()
        self._run(func, stream, lambda: self._pull(a, o, a.numel() // self.npes, self.npes, self.ch.rank))
        return time.perf_counter() - t0

    def start_async(
        self, inp: torch.Tensor, out: torch.Tensor | None, count: int, stream: Any = None
    ) -> bool:
        """:meth:`__call__`, asynchronously (see :mod:`mori.ccl.base`). Returns True."""
        func = f"{self.NAME}.start_async"
        a, o = self._plan(func, inp, out, count)
        self._start_async(
            func, stream, lambda: self._pull(a, o, a.numel() // self.npes, self.npes, self.ch.rank)
        )
        return True

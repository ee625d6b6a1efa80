"""Launching Triton kernels that wait on the SHMEM proxy, without a deadlock on module loading.

A GPU runtime may wait for the context's running kernels while it loads a module (CUDA says so
of lazy loading; measured on one H200 under MPS with eager loading too). Meanwhile the proxy's
transport cannot move bytes through that context (UCX's CUDA copies wait as well), so a kernel
that waits on the proxy -- a signal from a PE of another node, a ``quiet`` -- never ends, and the
load never returns. Two shapes of launch code hit it: a sequence of launches where a later one is
compiled and loaded at its first call while an earlier one waits (the inter-node EP kernels), and
a loop whose integer arguments make Triton compile a new specialisation (``1``, a multiple of 16)
while the previous launch waits.

:class:`KernelLoader` runs a sequence of launches so that no kernel loads while one of the
sequence, or an earlier one on this stream, is running: each launch is first compiled without
running (Triton's ``warmup``, the same specialisation key as the launch), and if any of them is
not loaded yet, the stream is synchronised, they are loaded, and only then do they launch. After
the first call of each variant that costs one key lookup per launch and no synchronisation.
Under the Triton interpreter it only launches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["KernelLoader", "Launch"]

#: one launch: the jitted function, its grid, its positional and keyword arguments
Launch = tuple[Any, tuple[int, ...], Sequence[Any], dict[str, Any]]


class KernelLoader:
    """Remembers which compiled kernels this process has loaded; one per launching object."""

    def __init__(self) -> None:
        self._loaded: dict[int, Any] = {}  # id -> the CompiledKernel (kept alive, so ids stay unique)

    def launch(self, launches: Sequence[Launch]) -> None:
        """Launch ``launches`` in order on the current stream, each one loaded before the first starts.

        A variant not loaded yet costs a synchronisation of the current stream first (not while
        a CUDA graph is being captured: warm a variant up before capturing it)."""
        import torch

        fresh = []
        for fn, grid, args, kw in launches:
            warmup = getattr(fn, "warmup", None)
            compiled = None if warmup is None else warmup(*args, grid=grid, **kw)
            if compiled is None:  # the interpreter (or no Triton function): nothing to load
                continue
            if hasattr(compiled, "result"):  # an asynchronous compile
                compiled = compiled.result()
            if id(compiled) not in self._loaded:
                fresh.append(compiled)
        if fresh:
            if not torch.cuda.is_current_stream_capturing():
                torch.cuda.current_stream().synchronize()
            for compiled in fresh:
                compiled[(1, 1, 1)]  # loads the module: a runner, not a launch
                self._loaded[id(compiled)] = compiled
        for fn, grid, args, kw in launches:
            fn[grid](*args, **kw)

    @property
    def loaded(self) -> int:
        """How many compiled kernels this loader has loaded."""
        return len(self._loaded)

"""Launching a Triton kernel again without Triton's per-call dispatch.

``kernel[grid](*args, **kw)`` binds and specialises every argument, builds a cache key from them
and looks the compiled kernel up, on every call: on an H200 host that took longer than the small
kernels it launched (the EP layer's bookkeeping kernels run for a few microseconds). A
:class:`Relaunch` keeps, per specialisation, the ``CompiledKernel`` that Triton's own
``kernel.warmup(...)`` returns and launches it as ``compiled[grid](*args)`` does.

The key is never coarser than Triton's: a tensor by its dtype, its 16-byte alignment and, on
AMD GPUs, whether its storage is under 2 GiB (what Triton's backends specialise on); an int by
whether it is 1, a multiple of 16, and 32-bit, 64-bit or unsigned 64-bit; every keyword
argument (the ``tl.constexpr`` ones, ``num_warps``) by value. A key Triton would treat alike costs one more ``warmup`` (a hit in
Triton's cache), never a wrong kernel. The launch is the call ``compiled[grid](*args)`` makes
(``CompiledKernel.run`` with its function handle, metadata and Triton's launch hooks), made
directly, with every tensor given as its device address (the launcher otherwise calls
``data_ptr()`` and makes one driver query per tensor on every launch; a tensor that is not on a
GPU is refused here instead). On an H200 host the layout kernel of :mod:`mori.ep.layout` launched in 12 us this way
(the key 2.4 us of it) and in 16 us as ``kernel[grid](...)``. Under
``TRITON_INTERPRET=1`` (the kernel is an ``InterpretedFunction``) the launch is the plain
``kernel[grid](...)``.

    launch = Relaunch("mypkg.kernels:scale_kernel")      # once, at import
    launch((triton.cdiv(n, 1024),), x, n, BLOCK=1024, num_warps=4)
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from mori.core.kernels import load_compiled

__all__ = ["Relaunch"]


def _spec(arg: Any) -> Any:
    """An argument that is neither a tensor nor an int: bools and None by value, floats by type."""
    if isinstance(arg, bool) or arg is None:
        return arg
    if isinstance(arg, float):
        return float
    return (type(arg), arg)


class Relaunch:
    """``kernel`` launched by ``self(grid, *args, **constexprs_and_options)``.

    ``kernel`` is a ``@triton.jit`` function, or its ``"package.module:name"``, imported on the
    first launch (so a module can make its launchers at import without importing Triton, and
    tests may set ``TRITON_INTERPRET`` before the kernel's module is imported). ``args`` are the
    kernel's leading parameters, positionally; every later parameter (its ``tl.constexpr`` ones)
    by keyword or by its default; ``num_warps`` and the other launch options by keyword. A
    parameter given by keyword is keyed by its value: pass runtime arguments positionally.
    ``grid`` is a tuple of one to three program counts."""

    def __init__(self, kernel: Any) -> None:
        self._source = kernel
        self._ready = False

    def _resolve(self) -> None:
        kernel = self._source
        if isinstance(kernel, str):
            module, _, name = kernel.partition(":")
            kernel = getattr(importlib.import_module(module), name)
        self.kernel = kernel
        self._interpreted = type(kernel).__name__ == "InterpretedFunction"
        fn = getattr(kernel, "fn", kernel)
        params = list(inspect.signature(fn).parameters.values())
        self._names = [p.name for p in params]
        self._defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        self._name = getattr(fn, "__name__", repr(kernel))
        self._compiled: dict[Any, Any] = {}
        if not self._interpreted:
            import torch
            from triton import knobs
            from triton.runtime import driver

            self._torch, self._knobs, self._driver = torch, knobs, driver
            self._sizes = torch.version.hip is not None  # (AMD's buffer ops: tensors under 2 GiB)
        self._ready = True

    def _key(self, args: tuple[Any, ...], kw: dict[str, Any]) -> tuple[tuple[Any, ...], list[Any]]:
        """The specialisation key of ``args`` and ``kw``, and ``args`` as the launcher takes them:
        each tensor by its device address (Triton's launcher would call ``data_ptr()`` and ask the
        driver about that address again, for every tensor on every launch)."""
        key: list[Any] = [self._torch.cuda.current_device()]
        call: list[Any] = []
        tensor = self._torch.Tensor
        for a in args:
            if isinstance(a, tensor):
                p = a.data_ptr()
                if not a.is_cuda and p:  # (what the launcher's driver query would have refused)
                    raise ValueError(f"{self._name}: argument {len(call)} is on {a.device}, not a GPU")
                if self._sizes:
                    key.append((a.dtype, p & 15 == 0, a.untyped_storage().nbytes() < 1 << 31))
                else:
                    key.append((a.dtype, p & 15 == 0))
                a = p
            elif type(a) is int:  # 1, a multiple of 16, and the type: i32, i64 or u64
                key.append(
                    (a == 1) + 2 * (a & 15 == 0) + 4 * (-(1 << 31) <= a < 1 << 31) + 8 * (a >= 1 << 63)
                )
            else:
                key.append(_spec(a))
            call.append(a)
        key.append(tuple(kw.items()))  # constexprs and options, by value (in the caller's order)
        return tuple(key), call

    def __call__(self, grid: tuple[int, ...], *args: Any, **kw: Any) -> None:
        if not self._ready:
            self._resolve()
        if self._interpreted:
            self.kernel[grid](*args, **kw)
            return
        key, call = self._key(args, kw)
        compiled = self._compiled.get(key)
        if compiled is None:
            rest = self._names[len(args) :]
            missing = [n for n in rest if n not in kw and n not in self._defaults]
            if missing:
                raise TypeError(f"{self._name}: missing the argument {missing[0]!r}")
            # loaded into the context here, as compiled[grid] does before its first launch
            compiled = load_compiled(self.kernel.warmup(*args, grid=grid, **kw))
            tail = tuple(kw[n] if n in kw else self._defaults[n] for n in rest)
            compiled = self._compiled[key] = (compiled, tail)
        kernel, tail = compiled
        g0, g1, g2 = grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1
        stream = self._driver.active.get_current_stream(key[0])
        enter, leave = self._knobs.runtime.launch_enter_hook, self._knobs.runtime.launch_exit_hook
        meta = None if enter is None else kernel.launch_metadata((g0, g1, g2), stream, *args, *tail)
        # the call compiled[grid](*args) makes, without building its closure on every launch
        kernel.run(
            g0, g1, g2, stream, kernel.function, kernel.packed_metadata, meta, enter, leave, *call, *tail
        )

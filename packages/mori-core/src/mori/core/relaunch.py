"""Launching a Triton kernel again without Triton's per-call dispatch.

``kernel[grid](*args, **kw)`` binds and specialises every argument, builds a cache key from them
and looks the compiled kernel up, on every call: on an H200 host that took longer than the small
kernels it launched (the EP layer's bookkeeping kernels run for a few microseconds). A
:class:`Relaunch` keeps, per specialisation, the ``CompiledKernel`` that Triton's own
``kernel.warmup(...)`` returns and launches it through Triton's public ``compiled[grid](*args)``.

The key is never coarser than Triton's: a tensor by its dtype, its 16-byte alignment and whether
its storage is under 2 GiB (what the NVIDIA and AMD backends specialise on), an int by whether it
is 1, a multiple of 16, and 32-bit; every ``tl.constexpr`` and launch option (``num_warps``) by
value. A key Triton would treat alike costs one more ``warmup`` (a hit in Triton's cache), never
a wrong kernel. Under ``TRITON_INTERPRET=1`` (the kernel is an ``InterpretedFunction``) the
launch is the plain ``kernel[grid](...)``.

    launch = Relaunch(scale_kernel)      # once, at import
    launch((triton.cdiv(n, 1024),), x, n, BLOCK=1024, num_warps=4)
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["Relaunch"]

#: Triton's launch options (keyword arguments that are not kernel parameters)
_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "launch_pdl"})


def _spec(arg: Any) -> Any:
    if hasattr(arg, "data_ptr") and hasattr(arg, "dtype"):
        nbytes = arg.untyped_storage().nbytes() if hasattr(arg, "untyped_storage") else 0
        return (arg.dtype, arg.data_ptr() % 16 == 0, nbytes < 1 << 31)
    if isinstance(arg, bool) or arg is None:
        return arg
    if isinstance(arg, int):
        return (int, arg == 1, arg % 16 == 0, -(1 << 31) <= arg < 1 << 31)
    if isinstance(arg, float):
        return float
    return (type(arg), arg)


class Relaunch:
    """``kernel`` (a ``@triton.jit`` function) launched by ``self(grid, *args, **constexprs_and_options)``.

    ``args`` are the kernel's leading parameters, positionally; every later parameter (its
    ``tl.constexpr`` ones) by keyword or by its default; ``num_warps`` and the other launch options
    by keyword. ``grid`` is a tuple of one to three program counts."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._interpreted = type(kernel).__name__ == "InterpretedFunction"
        fn = getattr(kernel, "fn", kernel)
        params = list(inspect.signature(fn).parameters.values())
        self._names = [p.name for p in params]
        self._defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        self._name = getattr(fn, "__name__", repr(kernel))
        self._compiled: dict[Any, Any] = {}

    def __call__(self, grid: tuple[int, ...], *args: Any, **kw: Any) -> None:
        if self._interpreted:
            self.kernel[grid](*args, **kw)
            return
        rest = self._names[len(args) :]
        try:
            full = [*args, *(kw[n] if n in kw else self._defaults[n] for n in rest)]
        except KeyError as e:
            raise TypeError(f"{self._name}: missing the argument {e.args[0]!r}") from None
        options = tuple(sorted((k, v) for k, v in kw.items() if k in _OPTIONS))
        import torch  # (the kernels launched this way take torch tensors)

        key = (torch.cuda.current_device(), tuple(_spec(a) for a in full), options)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self.kernel.warmup(*args, grid=grid, **kw)
            self._compiled[key] = compiled
        g = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        compiled[g](*full)

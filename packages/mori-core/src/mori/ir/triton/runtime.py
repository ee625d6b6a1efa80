"""``get_extern_libs()`` and ``install_hook()``: the original's two set-up calls, and what they do here.

The original links its device bitcode into each kernel (``extern_libs``) and fills the bitcode's
device global after each compile (a Triton post-compile hook). Here the device functions are Triton
functions and the context reaches kernels as a compile-time constant (:mod:`mori.ir.triton.context`),
so neither is needed; both calls are kept, do what they can do usefully, and change nothing of
Triton's global settings.
"""

from __future__ import annotations

from mori.ir.bitcode import find_bitcode
from mori.ir.triton.context import CONTEXT

__all__ = ["get_extern_libs", "install_hook"]

#: the key the original uses in ``extern_libs``
LIB_KEY = "mori_shmem"


def get_extern_libs() -> dict[str, str]:
    """``{"mori_shmem": path}`` for ``kernel[grid](..., extern_libs=get_extern_libs())``.

    The path is :func:`mori.ir.find_bitcode`'s bitcode file with no functions, so the dict is valid
    for Triton on every backend (the interpreter ignores it) and links nothing: the device functions
    of :mod:`mori.ir.triton` are inlined by Triton. Passing it is optional.
    """
    return {LIB_KEY: find_bitcode()}


def install_hook() -> None:
    """Kept for code written for the original, which needs it before its first launch.

    Installs no Triton hook: kernels reach the shmem context through a compile-time constant. If
    shmem is initialised, it binds this process's context buffer now (so a problem shows here rather
    than at the first launch) and makes it current after a re-init; otherwise it does nothing, and
    the buffer is bound when a kernel that uses :mod:`mori.ir.triton` is first compiled or run.
    Idempotent.
    """
    from mori.shmem import shmem_is_initialized

    if shmem_is_initialized():
        _ = CONTEXT.value  # binds on first use
        CONTEXT.refresh()

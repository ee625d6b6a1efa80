"""mori.jit: compiling MORI's kernels before they are needed, and where their code is kept.

MORI's kernels are Triton kernels: Triton compiles each on its first launch ("just in time") for the
GPU it runs on and keeps the code in its on-disk cache. This package adds no second compiler and no
second cache; it decides *when* compiling happens:

* :func:`precompile` (``MORI_PRECOMPILE=1`` at ``import mori``, or ``mori jit precompile``) compiles
  every ahead-of-time variant of every installed MORI kernel for this machine's GPU, exactly as its
  launch would, so launches find their code in the cache;
* :func:`cache_dir` is where that cache is; ``MORI_JIT_CACHE_DIR`` moves it (:mod:`mori.jit.cache`);
* ``MORI_DISABLE_JIT=1`` makes a launch of a MORI kernel whose code is not cached raise instead of
  compiling;
* :func:`compile_variant` is the one compile function, shared with ``tools/compile_kernels.py``.
"""

from __future__ import annotations

from mori.jit.cache import cache_dir
from mori.jit.compile import TARGETS, compile_variant, parse_target
from mori.jit.precompile import Kernel, PrecompileReport, Result, find_kernels, kernels_in, precompile

__all__ = [
    "TARGETS",
    "Kernel",
    "PrecompileReport",
    "Result",
    "cache_dir",
    "compile_variant",
    "find_kernels",
    "kernels_in",
    "parse_target",
    "precompile",
]

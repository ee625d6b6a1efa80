"""Where compiled kernels live (Triton's cache), ``MORI_JIT_CACHE_DIR`` and ``MORI_DISABLE_JIT``.

MORI's kernels are Triton kernels, so their code is kept where Triton keeps all code: its on-disk
cache, ``TRITON_CACHE_DIR`` (default ``~/.triton/cache``). There is no second cache.

* ``MORI_JIT_CACHE_DIR=DIR`` makes DIR Triton's cache directory for the process, when ``mori`` is
  imported (and in :func:`cache_dir`), unless ``TRITON_CACHE_DIR`` is set: Triton has one cache for
  every kernel, and an explicit ``TRITON_CACHE_DIR`` wins. It is set as ``TRITON_CACHE_DIR`` in the
  environment, so ranks started from this process use it too.
* ``MORI_DISABLE_JIT=1`` forbids compiling MORI's kernels at run time: a launch of a kernel of a
  ``mori.*`` module whose code is not in the cache raises :class:`~mori.core.errors.MoriStateError`
  naming the kernel, instead of compiling (for machines where compiling is slow or not wanted; fill
  the cache with :func:`mori.jit.precompile` first). It installs Triton's ``jit_cache_hook`` (the
  one Triton calls before it compiles), keeping any hook already there, when ``mori`` is imported.
  User kernels, kernels that use :mod:`mori.ir.triton` included, are not affected; the interpreter
  compiles nothing, so there it changes nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from mori.core import env
from mori.core.errors import MoriStateError

__all__ = ["apply_environment", "cache_dir", "install_disable_jit_hook"]


def _apply_cache_dir() -> None:
    wanted = env.MORI_JIT_CACHE_DIR.get()
    if wanted and not os.environ.get("TRITON_CACHE_DIR", "").strip():
        os.environ["TRITON_CACHE_DIR"] = str(Path(wanted).expanduser())


def cache_dir() -> Path:
    """The directory Triton's cache (and so MORI's compiled kernels) uses in this process."""
    _apply_cache_dir()
    explicit = os.environ.get("TRITON_CACHE_DIR", "").strip()
    if explicit:
        return Path(explicit).expanduser()
    try:
        import triton

        return Path(triton.knobs.cache.dir)
    except ImportError:  # Triton's default, without Triton
        return Path.home() / ".triton" / "cache"


_installed: list[Any] = []  # the hook this module installed (at most one per process)


def install_disable_jit_hook() -> None:
    """Make Triton refuse to compile a MORI kernel that is not in the cache (see the module doc).
    Idempotent; called when ``mori`` is imported with ``MORI_DISABLE_JIT=1``."""
    import triton

    if _installed and triton.knobs.runtime.jit_cache_hook is _installed[0]:
        return
    previous = triton.knobs.runtime.jit_cache_hook

    def refuse_uncached(*args: Any, **kwargs: Any) -> Any:
        info = kwargs["fn"]
        if str(info.module).startswith("mori.") and env.MORI_DISABLE_JIT.get():
            _refuse_if_not_cached(info, kwargs["compile"], str(kwargs.get("repr", info.name)))
        return previous(*args, **kwargs) if previous is not None else False

    triton.knobs.runtime.jit_cache_hook = refuse_uncached
    _installed[:] = [refuse_uncached]


def _refuse_if_not_cached(info: Any, compile_args: dict[str, Any], shown: str) -> None:
    from triton.compiler import ASTSource

    from mori.jit.compile import is_cached

    jit = info.jit_function
    target = jit.device_caches[compile_args["device"]][2]
    data = json.loads(compile_args["specialization_data"])  # what JITFunction.preload reads back
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in data["options"].items()}
    src = ASTSource(jit, compile_args["signature"], compile_args["constants"], compile_args["configs"][0])
    if not is_cached(src, target, options):
        raise MoriStateError(
            f"MORI_DISABLE_JIT=1: the code of {info.module}.{info.name} for this launch ({shown}, "
            f"target {target.backend}:{target.arch}) is not in Triton's cache {cache_dir()}, and compiling "
            f"is disabled: fill the cache with `mori jit precompile` (mori.jit.precompile()) on this machine "
            f"first, launch with arguments of a precompiled variant, or unset MORI_DISABLE_JIT"
        )


def apply_environment() -> None:
    """What ``import mori`` does for mori.jit: ``MORI_JIT_CACHE_DIR``, then ``MORI_DISABLE_JIT`` (which
    imports Triton; only when it is set)."""
    _apply_cache_dir()
    if env.MORI_DISABLE_JIT.get():
        with contextlib.suppress(ImportError):  # no Triton: no kernels to compile either
            install_disable_jit_hook()

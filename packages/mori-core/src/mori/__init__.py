"""MORI: Modular RDMA Interface.

``mori`` is a namespace shared by several distributions: ``mori-core`` (``mori.core``,
``mori.shmem``, ``mori.ir``, ``mori.jit``, ``mori.tensor_utils``, ``mori.cpp``,
``mori.kernel_profiler``), ``mori-ep`` (``mori.ep``, ``mori.ops``), ``mori-io`` (``mori.io``),
``mori-cco`` (``mori.cco``, ``mori.ccl``), ``mori-umbp`` (``mori.umbp``) and ``mori-viz``
(``mori.viz``). Components are imported lazily, so ``import mori`` then ``mori.shmem.shmem_mype()``
works, and touching a component whose distribution is missing says which one to install.

Importing ``mori`` applies ``MORI_JIT_CACHE_DIR`` and ``MORI_DISABLE_JIT`` and, with
``MORI_PRECOMPILE=1``, compiles every kernel variant for this machine's GPU (:mod:`mori.jit`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from pkgutil import extend_path
from types import ModuleType
from typing import Any

# Every installed distribution contributes its own mori/<component>; extend_path finds them all
# whether they sit in one site-packages (normal install) or in several source trees (editable).
__path__ = extend_path(__path__, __name__)

#: component module -> distribution that provides it
COMPONENTS: dict[str, str] = {
    "core": "mori-core",
    "shmem": "mori-core",
    "ir": "mori-core",
    "jit": "mori-core",
    "tensor_utils": "mori-core",
    "cpp": "mori-core",
    "kernel_profiler": "mori-core",  # forwards to mori.viz, which names mori-viz when it is missing
    "ep": "mori-ep",
    "ops": "mori-ep",  # the original's name for the EP component
    "io": "mori-io",
    "cco": "mori-cco",
    "ccl": "mori-cco",
    "umbp": "mori-umbp",
    "viz": "mori-viz",
}


def _missing(component: str) -> ModuleNotFoundError:
    dist = COMPONENTS[component]
    return ModuleNotFoundError(
        f"mori.{component} is provided by the distribution '{dist}', which is not installed: "
        f"pip install {dist}",
        name=f"mori.{component}",
    )


class _MissingComponentFinder(importlib.abc.MetaPathFinder):
    """Last finder on ``sys.meta_path``: only consulted once every real finder has failed."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        prefix, _, component = fullname.partition(".")
        if prefix == __name__ and component in COMPONENTS:
            raise _missing(component)
        return None


if not any(isinstance(f, _MissingComponentFinder) for f in sys.meta_path):
    sys.meta_path.append(_MissingComponentFinder())


def __getattr__(name: str) -> ModuleType:
    if name in COMPONENTS:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'mori' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *COMPONENTS])


def _start() -> None:
    # mori.jit's settings (MORI_JIT_CACHE_DIR, MORI_DISABLE_JIT), then MORI_PRECOMPILE=1. Failures are
    # reported on stderr, not raised: a bad setting must not make `import mori` fail (`mori env`
    # shows the invalid value too).
    from mori.core import env
    from mori.jit.cache import apply_environment

    try:
        apply_environment()
        if env.MORI_PRECOMPILE.get():
            from mori.jit import precompile

            precompile()
    except Exception as e:
        print(f"mori: at import, mori.jit: {type(e).__name__}: {e}", file=sys.stderr)


_start()

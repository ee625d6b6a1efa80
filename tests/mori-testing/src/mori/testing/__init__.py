"""Test helpers shared by every MORI package's tests.

The launcher itself lives in mori-core (:mod:`mori.core.launch`, also behind ``mori demo`` and
``mori bench``); this package fixes the defaults tests want: small heaps and short timeouts, so a
broken test fails in seconds instead of hanging for the production default of 300 s.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from mori.core import launch
from mori.core.launch import RankError, run_ranks

__all__ = ["RankError", "load_module_file", "run_ranks", "shmem_ranks"]

TEST_TIMEOUT_S = 90.0


def load_module_file(name: str, path: str | Path) -> ModuleType:
    """Import the file ``path`` as module ``name``, once per process (tests are not packages: a
    test's kernel module is loaded by path, after the test chose ``TRITON_INTERPRET``)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None, path
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def shmem_ranks(
    fn: Callable[..., Any],
    nranks: int,
    *args: Any,
    heap: str = "64M",
    timeout: float = TEST_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
    before_init: Callable[[int, int], None] | None = None,
) -> list[Any]:
    """Run ``fn(rank, nranks, *args)`` on ``nranks`` ranks with mori.shmem initialised around it.

    ``before_init(rank, nranks)`` runs on each rank before init (e.g. ``torch.cuda.set_device``).
    """
    # Tests get the cpu runtime unless they ask for another: on a GPU machine with a device plugin
    # installed, "auto" would move every CPU test onto GPU memory.
    env = {"MORI_DEVICE_RUNTIME": "cpu", **(env or {})}
    return launch.shmem_ranks(fn, nranks, *args, heap=heap, timeout=timeout, env=env, before_init=before_init)

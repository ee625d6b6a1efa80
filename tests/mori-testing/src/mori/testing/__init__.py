"""Test helpers shared by every MORI package's tests.

The launcher itself lives in mori-core (:mod:`mori.core.launch`, also behind ``mori demo`` and
``mori bench``); this package fixes the defaults tests want: small heaps and short timeouts, so a
broken test fails in seconds instead of hanging for the production default of 300 s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from mori.core import launch
from mori.core.launch import RankError, run_ranks

__all__ = ["RankError", "run_ranks", "shmem_ranks"]

TEST_TIMEOUT_S = 90.0


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

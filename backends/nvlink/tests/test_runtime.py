"""The cuda runtime, transport and copy engine on a fake driver: the real code paths without a GPU.

The tests both GPU plugins share are :mod:`mori.testing.gpu_runtime`'s, imported here so that they
run against this backend (``gpu_backend`` in conftest.py); what follows them is CUDA's own: calls
run in the GPU's primary context.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mori.testing.gpu_runtime import *  # noqa: F403  (the shared tests, and GpuBackend)

Make = Callable[..., Any]
MiB = 1 << 20


def test_calls_run_in_the_gpus_primary_context_and_restore_the_callers(runtimes: Make) -> None:
    rt = runtimes(device=1)
    seg = rt.create_segment(4 * MiB, "t.0")
    assert rt.lib.current == 0xC001  # no context was current: ours stays (it is the one torch picks)
    rt.lib.current = 0xBEEF  # another library's context
    rt.copy(seg.addr + 64, seg.addr, 8)
    assert rt.lib.current == 0xBEEF
    sets = [c for c in rt.lib.calls if c == "cuCtxSetCurrent"]
    assert len(sets) >= 3

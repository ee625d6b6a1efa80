"""The cuda runtime, transport, copy engine and driver binding on a fake driver: the real code paths
without a GPU.

The tests both GPU plugins share are :mod:`mori.testing.gpu_runtime`'s, imported here so that they
run against this backend (``gpu_backend`` in conftest.py); what follows them is CUDA's own: calls
run in the GPU's primary context, results are named through an out-pointer, older function names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from mori_backend_nvlink.driver import CudaDriver, CudaError

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


def test_results_the_driver_cannot_name_still_read_well(gpu_backend: GpuBackend) -> None:  # noqa: F405
    lib = gpu_backend.fake_lib()
    drv = CudaDriver(lib, "fake")
    lib.fail["cuCtxSynchronize"] = 719  # the fake cannot name it: cuGetErrorName fails
    with pytest.raises(CudaError, match=r"cuCtxSynchronize failed: CUDA_ERROR_LAUNCH_FAILED \(719\)"):
        drv.synchronize()
    lib.fail["cuCtxSynchronize"] = 12345
    with pytest.raises(CudaError, match=r"CUresult 12345 \(12345\): no description from the driver"):
        drv.synchronize()
    with pytest.raises(
        CudaError, match=r"cuDeviceGet failed: CUDA_ERROR_INVALID_DEVICE \(101\).*device ordinal 5"
    ):
        drv.device(5)


def test_a_driver_without_the_v2_name_is_called_by_the_older_one() -> None:
    class OldDriver:
        """Has only the pre-_v2 name of cuIpcOpenMemHandle."""

        def __init__(self) -> None:
            self.seen: list[bytes] = []

        def cuIpcOpenMemHandle(self, out: Any, handle: Any, flags: int) -> int:
            self.seen.append(bytes(handle))
            out._obj.value = 0xABC000
            return 0

    old = OldDriver()
    assert CudaDriver(old, "old").ipc_open_handle(b"h" * 64) == 0xABC000
    assert old.seen == [b"h" * 64]

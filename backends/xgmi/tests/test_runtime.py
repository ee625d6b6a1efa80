"""The hip runtime, transport, copy engine and HIP binding on a fake HIP: the real code paths
without a GPU.

The tests both GPU plugins share are :mod:`mori.testing.gpu_runtime`'s, imported here so that they
run against this backend (``gpu_backend`` in conftest.py); what follows them is HIP's own: calls run
on the runtime's device (HIP's current device), the heap is uncached unless asked otherwise, HIP
returns its names as strings and newer function names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from mori_backend_xgmi.driver import HipDriver, HipError

from mori.core.errors import MoriValueError
from mori.testing.gpu_runtime import *  # noqa: F403  (the shared tests, and GpuBackend)

Make = Callable[..., Any]
MiB = 1 << 20


def test_calls_run_on_the_runtimes_device_and_restore_the_callers(runtimes: Make) -> None:
    rt = runtimes(device=1)
    assert rt.lib.device == 0
    seg = rt.create_segment(4 * MiB, "t.0")
    assert {m.memory.device for _, m in rt.lib.allocs.values()} == {1}, "the heap is on the runtime's device"
    assert rt.lib.device == 0, "the thread's current device is restored"
    rt.lib.calls.clear()
    rt.copy(seg.addr + 64, seg.addr, 8)
    assert rt.lib.device == 0
    assert rt.lib.calls.count("hipSetDevice") == 2  # to the runtime's device and back
    rt.lib.device = 1
    rt.lib.calls.clear()
    rt.copy(seg.addr + 64, seg.addr, 8)
    assert "hipSetDevice" not in rt.lib.calls  # already current: nothing to switch


def test_the_heap_is_uncached_unless_asked_otherwise(runtimes: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    rt = runtimes()
    seg = rt.create_segment(4 * MiB, "t.0")
    flags = {m.memory.flags for _, m in rt.lib.allocs.values() if m.memory.size >= 4 * MiB}
    assert flags == {3} and "hipExtMallocWithFlags" in rt.lib.calls  # hipDeviceMallocUncached
    seg.close()
    monkeypatch.setenv("MORI_SHMEM_HEAP_TYPE", "normal")
    rt.lib.calls.clear()
    seg = rt.create_segment(4 * MiB, "t.1")
    assert "hipMalloc" in rt.lib.calls and "hipExtMallocWithFlags" not in rt.lib.calls
    seg.close()
    monkeypatch.setenv("MORI_SHMEM_HEAP_TYPE", "cached")
    with pytest.raises(MoriValueError, match="MORI_SHMEM_HEAP_TYPE='cached' is not valid"):
        rt.create_segment(4 * MiB, "t.2")


def test_hip_names_its_results_itself(gpu_backend: GpuBackend) -> None:  # noqa: F405
    lib = gpu_backend.fake_lib()
    drv = HipDriver(lib, "fake")
    lib.fail["hipDeviceSynchronize"] = 719
    with pytest.raises(
        HipError, match=r"hipDeviceSynchronize failed: hipErrorUnknown \(719\): unknown error"
    ):
        drv.synchronize()
    with pytest.raises(HipError, match=r"hipSetDevice failed: hipErrorInvalidDevice \(101\).*device 5"):
        drv.set_device(5)


def test_uncached_allocations_use_the_extended_allocator(gpu_backend: GpuBackend) -> None:  # noqa: F405
    lib = gpu_backend.fake_lib()
    drv = HipDriver(lib, "fake")
    ptr = drv.mem_alloc(4096, uncached=True)
    assert lib.calls[-1] == "hipExtMallocWithFlags" and lib.allocs[ptr][1].memory.flags == 3
    drv.mem_free(ptr)


def test_a_runtime_without_hip_host_malloc_is_called_by_its_newer_name() -> None:
    class NewerHip:
        """Has hipExtHostAlloc, not the deprecated hipHostMalloc."""

        def hipExtHostAlloc(self, out: Any, n: int, flags: int) -> int:
            out._obj.value = 0x1000 + n
            return 0

    assert HipDriver(NewerHip(), "newer").host_alloc(64) == 0x1040

"""mori-backend-xgmi's tests: the shared tests of every GPU plugin (:mod:`mori.testing.gpu_runtime`)
against a fake HIP runtime, with what HIP's calls and names are (``gpu_backend``)."""

from __future__ import annotations

from pathlib import Path

from mori.testing.gpu_runtime import backend_fixture, interpreted_atomics, runtimes, world

__all__ = ["gpu_backend", "interpreted_atomics", "runtimes", "world"]

gpu_backend = backend_fixture(
    "mori_backend_xgmi",
    Path(__file__).parent,
    "_fake_hip.py:FakeHipLib",
    no_devices_reason="no AMD GPU (hipGetDeviceCount: hipErrorNoDevice)",
    heap_alloc_call="hipExtMallocWithFlags",  # the heap is uncached by default
    memcpy_failure=r"hipMemcpyAsync failed: hipErrorUnknown \(700\)",
    native_conventions=(4, True, True),  # hipMemcpyDefault, the device as context, names as strings
)

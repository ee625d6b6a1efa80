"""Fixtures for mori-backend-nvlink's tests: a fake CUDA driver and runtimes built on it.

The fixtures and the runtime tests both GPU plugins share are :mod:`mori.testing.gpu_runtime`'s;
this file describes the backend to them (``gpu_backend``) and loads its fake library.

The package under test is the installed one; from a bare source tree (not installed) its ``src``
directory is put on the path, so ``python -m pytest backends`` works in a checkout too.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

HERE = Path(__file__).parent
SRC = HERE.parent / "src"
if importlib.util.find_spec("mori_backend_nvlink") is None:
    sys.path.insert(0, str(SRC))

from mori_backend_nvlink.driver import CudaDriver  # noqa: E402
from mori_backend_nvlink.runtime import CudaRuntime  # noqa: E402
from mori_backend_nvlink.transport import P2PTransport  # noqa: E402

from mori.testing.gpu_runtime import (  # noqa: E402
    GpuBackend,
    interpreted_atomics,
    load_module_file,
    runtimes,
    world,
)

__all__ = ["interpreted_atomics", "runtimes", "world"]


@pytest.fixture(scope="session")
def fake() -> ModuleType:
    """The fake library module (_fake_cuda.py)."""
    return load_module_file("mori_nvlink_fake_cuda", str(HERE / "_fake_cuda.py"))


@pytest.fixture(scope="session")
def gpu_backend(fake: ModuleType) -> GpuBackend:
    """This backend, as the shared tests see it."""
    return GpuBackend(
        runtime_class=CudaRuntime,
        driver_class=CudaDriver,
        transport_class=P2PTransport,
        fake_lib=fake.FakeCudaLib,
        library="libcuda.so.1",
        missing_why="no NVIDIA driver on this machine",
        no_devices_reason="no CUDA device (cuDeviceGetCount = 0)",
        other_runtime="hip",
        heap_alloc_call="cuMemAlloc_v2",
        memcpy_call="cuMemcpyAsync",
        context_calls=("cuCtxGetCurrent", "cuCtxSetCurrent"),
        memcpy_failure=r"cuMemcpyAsync failed: CUresult 700|CUDA_ERROR_ILLEGAL_ADDRESS",
    )

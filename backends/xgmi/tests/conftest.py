"""Fixtures for mori-backend-xgmi's tests: a fake HIP runtime and runtimes built on it.

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
if importlib.util.find_spec("mori_backend_xgmi") is None:
    sys.path.insert(0, str(SRC))

from mori_backend_xgmi.driver import HipDriver  # noqa: E402
from mori_backend_xgmi.runtime import HipRuntime  # noqa: E402
from mori_backend_xgmi.transport import XgmiTransport  # noqa: E402

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
    """The fake library module (_fake_hip.py)."""
    return load_module_file("mori_xgmi_fake_hip", str(HERE / "_fake_hip.py"))


@pytest.fixture(scope="session")
def gpu_backend(fake: ModuleType) -> GpuBackend:
    """This backend, as the shared tests see it."""
    return GpuBackend(
        runtime_class=HipRuntime,
        driver_class=HipDriver,
        transport_class=XgmiTransport,
        fake_lib=fake.FakeHipLib,
        library="libamdhip64.so",
        missing_why="no ROCm on this machine",
        no_devices_reason="no AMD GPU (hipGetDeviceCount: hipErrorNoDevice)",
        other_runtime="cuda",
        heap_alloc_call="hipExtMallocWithFlags",
        memcpy_call="hipMemcpyAsync",
        context_calls=("hipGetDevice", "hipSetDevice"),
        memcpy_failure=r"hipMemcpyAsync failed: hipErrorUnknown \(700\)",
        native_conventions=(4, True, True),  # hipMemcpyDefault, the device as context, names as strings
    )

"""Fixtures for mori-backend-nvlink's tests: a fake CUDA driver and runtimes built on it.

The package under test is the installed one; from a bare source tree (not installed) its ``src``
directory is put on the path, so ``python -m pytest backends`` works in a checkout too.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

HERE = Path(__file__).parent
SRC = HERE.parent / "src"
if importlib.util.find_spec("mori_backend_nvlink") is None:
    sys.path.insert(0, str(SRC))

from mori_backend_nvlink import _dlpack  # noqa: E402
from mori_backend_nvlink.driver import CudaDriver  # noqa: E402
from mori_backend_nvlink.runtime import CudaRuntime, _DeviceState  # noqa: E402


def _load(name: str, path: Path) -> ModuleType:
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def fake() -> ModuleType:
    """The fake driver module (_fake_cuda.py)."""
    return _load("mori_nvlink_fake_cuda", HERE / "_fake_cuda.py")


@pytest.fixture(scope="session")
def interpreted_atomics() -> ModuleType:
    """The host-atomic kernel module compiled for the Triton interpreter (runs on CPU memory)."""
    pytest.importorskip("triton", reason="the host-atomic kernel needs Triton")
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # triton.jit picks the interpreter when it decorates
    try:
        return _load("mori_nvlink_atomics_interpreted", SRC / "mori_backend_nvlink" / "_atomics.py")
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


class FakeRuntime(CudaRuntime):
    """The cuda runtime on a fake driver: what needs torch.cuda (current device and stream, views,
    the kernel launch) is done on the CPU instead; everything else is the real code."""

    def __init__(self, lib: Any, *, device: int = 0, pid: int | None = None, kernels: Any = None) -> None:
        super().__init__(load=lambda: CudaDriver(lib, "fake-libcuda.so.1"))
        self.lib = lib
        self.device = device
        self.kernels = kernels
        self._pid_override = pid

    def _torch_device_index(self) -> int:
        return self.device

    def _torch_current_stream(self, index: int) -> int:
        return 0

    def _view(self, addr: int, nbytes: int, index: int) -> Any:
        return _dlpack.byte_view(addr, nbytes, _dlpack.KDL_CPU, 0)

    def _launch_atomic(self, st: _DeviceState, addr: int, word: int, op: int, value: int, cond: int) -> None:
        import torch
        from mori_backend_nvlink.runtime import _WORDS, _halves

        assert self.kernels is not None, "pass kernels=interpreted_atomics to use atomics"
        name, size = _WORDS[word][0], _WORDS[word][1]
        dtype = getattr(torch, name)

        def word_at(a: int) -> Any:
            return torch.frombuffer((ctypes.c_uint8 * size).from_address(a), dtype=torch.uint8).view(dtype)

        lo, hi = _halves(value)
        clo, chi = _halves(cond)
        self.kernels.host_atomic_kernel[(1,)](
            word_at(addr), word_at(st.pinned_device), lo, hi, clo, chi, OP=op
        )


@pytest.fixture
def runtimes(fake: ModuleType) -> Iterator[Callable[..., FakeRuntime]]:
    """Make fake runtimes: ``make(device=0, pid=None, world=None, **lib_kwargs)``. Runtimes made
    with the same ``world`` are processes of one node; give them different ``pid``s."""
    made: list[Any] = []
    worlds: list[Any] = []

    def make(
        *, device: int = 0, pid: int | None = None, world: Any = None, kernels: Any = None, **kw: Any
    ) -> FakeRuntime:
        if world is None:
            world = fake.FakeWorld()
            worlds.append(world)
        lib = fake.FakeCudaLib(world, **kw)
        made.append(lib)
        return FakeRuntime(lib, device=device, pid=pid, kernels=kernels)

    yield make
    for lib in made:
        lib.close()
    for world in worlds:
        world.close()


@pytest.fixture
def world(fake: ModuleType) -> Iterator[Any]:
    w = fake.FakeWorld()
    yield w
    w.close()

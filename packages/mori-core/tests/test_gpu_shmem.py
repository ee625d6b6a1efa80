"""On GPUs of any vendor: the SHMEM host API on GPU memory and the Triton device API, across processes.

Marked ``gpu`` (``nox -s tests-cuda`` and ``tests-rocm`` both run it); the runtime is the installed
device plugin's that serves this machine (``cuda`` from mori-backend-nvlink, ``hip`` from
mori-backend-xgmi). Each test skips (with the reason) where torch sees no GPU or fewer than it
needs. The tests and their rank functions are :mod:`mori.testing.gpu_shmem`'s.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mori.testing.gpu_shmem import *  # noqa: F403  (the shared tests)
from mori.testing.gpu_shmem import GpuShmemBackend, machine_backend

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_shmem() -> GpuShmemBackend:
    return machine_backend(Path(__file__).parent / "_device_kernels.py")

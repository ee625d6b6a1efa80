"""On NVIDIA GPUs: the SHMEM host API on GPU memory and the Triton device API, across processes.

Marked ``cuda``; each test skips (with the reason) where torch sees no CUDA GPU or fewer than it
needs. mori-backend-nvlink must be installed (its entry point is how ranks find the runtime):
``pip install -e backends/nvlink``. Run with ``python -m pytest -m cuda backends/nvlink``.

The tests (and their rank functions) are :mod:`mori.testing.gpu_shmem`'s, shared with
mori-backend-xgmi; this module runs them for the ``cuda`` runtime (``gpu_shmem`` below).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mori.testing.gpu_shmem import *  # noqa: F403  (the shared tests)
from mori.testing.gpu_shmem import GpuShmemBackend

pytestmark = pytest.mark.cuda


def _torch_unusable(torch: Any) -> str | None:
    if torch.version.cuda is None or not torch.cuda.is_available():
        return f"needs an NVIDIA GPU: torch {torch.__version__} has torch.cuda.is_available() = False"
    return None


@pytest.fixture(scope="module")
def gpu_shmem() -> GpuShmemBackend:
    return GpuShmemBackend(
        runtime="cuda",
        entry_point="nvlink",
        directory="backends/nvlink",
        torch_unusable=_torch_unusable,
        kernels=Path(__file__).resolve().parents[3]
        / "packages"
        / "mori-core"
        / "tests"
        / "_device_kernels.py",
        export_env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"},
    )

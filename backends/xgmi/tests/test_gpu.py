"""On AMD GPUs: the SHMEM host API on GPU memory and the Triton device API, across processes.

Marked ``rocm``; each test skips (with the reason) where torch sees no ROCm GPU or fewer than it
needs. mori-backend-xgmi must be installed (its entry point is how ranks find the runtime):
``pip install -e backends/xgmi``. Run with ``python -m pytest -m rocm backends/xgmi``.

The tests (and their rank functions) are :mod:`mori.testing.gpu_shmem`'s, shared with
mori-backend-nvlink; this module runs them for the ``hip`` runtime (``gpu_shmem`` below).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mori.testing.gpu_shmem import *  # noqa: F403  (the shared tests)
from mori.testing.gpu_shmem import GpuShmemBackend

pytestmark = pytest.mark.rocm


def _torch_unusable(torch: Any) -> str | None:
    if getattr(torch.version, "hip", None) is None:
        return f"needs an AMD GPU and a ROCm build of torch; torch {torch.__version__} is not one"
    if not torch.cuda.is_available():
        return f"needs an AMD GPU: torch {torch.__version__} has torch.cuda.is_available() = False"
    return None


@pytest.fixture(scope="module")
def gpu_shmem() -> GpuShmemBackend:
    return GpuShmemBackend(
        runtime="hip",
        entry_point="xgmi",
        directory="backends/xgmi",
        torch_unusable=_torch_unusable,
        kernels=Path(__file__).resolve().parents[3]
        / "packages"
        / "mori-core"
        / "tests"
        / "_device_kernels.py",
        export_env={
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False",
            "PYTORCH_HIP_ALLOC_CONF": "expandable_segments:False",
        },
    )

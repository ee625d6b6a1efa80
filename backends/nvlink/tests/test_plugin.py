"""The plugin as a user installs it: found through the entry point, unavailable here with a reason."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mori.testing.plugin_install import install_plugin
from mori.testing.plugin_install import run_installed as _run

PACKAGE = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """mori-backend-nvlink installed with pip into a directory of its own."""
    return install_plugin(PACKAGE, tmp_path_factory.mktemp("site"))


def _cuda_usable() -> bool:
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() == "True"


def test_listed_by_mori_backends_with_why_it_is_unavailable(site: Path) -> None:
    out = _run(site, "-m", "mori.core.cli", "backends", "-v")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    cuda = next(line for line in lines if line.strip().startswith("cuda "))
    p2p = next(line for line in lines if line.strip().startswith("p2p "))
    assert "mori-backend-nvlink 0.1.0" in cuda and "mori-backend-nvlink 0.1.0" in p2p
    entry = next(line for line in lines if line.strip().startswith("nvlink "))
    assert "mori.backends" in entry and "mori_backend_nvlink.plugin" in entry
    if _cuda_usable():
        assert " available" in cuda, cuda
    else:
        assert "unavailable" in cuda and "unavailable" in p2p
        # the reason names what is missing: the driver library, a GPU, or a CUDA build of torch
        assert any(r in cuda for r in ("libcuda.so.1 not found", "no CUDA device", "not a CUDA build")), cuda


def test_a_missing_driver_library_is_the_reason(site: Path, tmp_path: Path) -> None:
    missing = str(tmp_path / "libcuda.so.1")
    out = _run(site, "-m", "mori.core.cli", "backends", env={"MORI_CUDA_DRIVER_LIBRARY": missing})
    assert out.returncode == 0, out.stderr
    cuda = next(line for line in out.stdout.splitlines() if line.strip().startswith("cuda "))
    assert "unavailable" in cuda and f"{missing} not found" in cuda


def test_env_vars_are_listed(site: Path) -> None:
    out = _run(site, "-m", "mori.core.cli", "env", "-v")
    assert out.returncode == 0, out.stderr
    assert "MORI_CUDA_DRIVER_LIBRARY=(unset, default 'libcuda.so.1')" in out.stdout


def test_selecting_it_where_it_cannot_work_says_why(site: Path, tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.so")
    out = _run(
        site,
        "-c",
        "from mori.core.launch import shmem_ranks\nshmem_ranks(print, 1, timeout=60)",
        env={"MORI_DEVICE_RUNTIME": "cuda", "MORI_CUDA_DRIVER_LIBRARY": missing},
    )
    assert out.returncode != 0
    assert "device runtime 'cuda' (from mori-backend-nvlink 0.1.0) is not usable here" in out.stderr
    assert f"{missing} not found" in out.stderr


def test_import_loads_neither_the_driver_nor_torch_cuda(site: Path) -> None:
    code = (
        "import sys\n"
        "import mori_backend_nvlink, mori_backend_nvlink.plugin\n"
        "maps = open('/proc/self/maps').read()\n"
        "print('libcuda' in maps, 'torch' in sys.modules, 'triton' in sys.modules)\n"
    )
    out = _run(site, "-c", code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "False"]

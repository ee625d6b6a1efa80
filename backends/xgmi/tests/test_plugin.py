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
    """mori-backend-xgmi installed with pip into a directory of its own."""
    return install_plugin(PACKAGE, tmp_path_factory.mktemp("site"))


def _rocm_usable() -> bool:
    code = "import torch; print(torch.cuda.is_available() and torch.version.hip is not None)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return out.stdout.strip() == "True"


def test_listed_by_mori_backends_with_why_it_is_unavailable(site: Path) -> None:
    out = _run(site, "-m", "mori.core.cli", "backends", "-v")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    hip = next(line for line in lines if line.strip().startswith("hip "))
    xgmi = next(line for line in lines if line.strip().startswith("xgmi ") and "mori.backends" not in line)
    assert "mori-backend-xgmi 0.1.0" in hip and "mori-backend-xgmi 0.1.0" in xgmi
    entry = next(line for line in lines if line.strip().startswith("xgmi ") and "mori.backends" in line)
    assert "mori_backend_xgmi.plugin" in entry
    if _rocm_usable():
        assert " available" in hip, hip
    else:
        assert "unavailable" in hip and "unavailable" in xgmi
        assert any(r in hip for r in ("libamdhip64.so not found", "no AMD GPU", "not a ROCm build")), hip


def test_a_missing_hip_library_is_the_reason(site: Path, tmp_path: Path) -> None:
    missing = str(tmp_path / "libamdhip64.so")
    out = _run(site, "-m", "mori.core.cli", "backends", env={"MORI_HIP_LIBRARY": missing})
    assert out.returncode == 0, out.stderr
    hip = next(line for line in out.stdout.splitlines() if line.strip().startswith("hip "))
    assert "unavailable" in hip and f"{missing} not found" in hip


def test_env_vars_are_listed_and_checked(site: Path) -> None:
    out = _run(site, "-m", "mori.core.cli", "env", "-v")
    assert out.returncode == 0, out.stderr
    assert "MORI_HIP_LIBRARY=(unset, default None)" in out.stdout
    assert "MORI_SHMEM_HEAP_TYPE=(unset, default 'uncached')" in out.stdout
    bad = _run(site, "-m", "mori.core.cli", "env", env={"MORI_SHMEM_HEAP_TYPE": "cached"})
    assert bad.returncode == 1 and "MORI_SHMEM_HEAP_TYPE='cached' is not valid" in bad.stdout


def test_selecting_it_where_it_cannot_work_says_why(site: Path, tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.so")
    out = _run(
        site,
        "-c",
        "from mori.core.launch import shmem_ranks\nshmem_ranks(print, 1, timeout=60)",
        env={"MORI_DEVICE_RUNTIME": "hip", "MORI_HIP_LIBRARY": missing},
    )
    assert out.returncode != 0
    assert "device runtime 'hip' (from mori-backend-xgmi 0.1.0) is not usable here" in out.stderr
    assert f"{missing} not found" in out.stderr


def test_import_loads_neither_hip_nor_torch(site: Path) -> None:
    code = (
        "import sys\n"
        "import mori_backend_xgmi, mori_backend_xgmi.plugin\n"
        "maps = open('/proc/self/maps').read()\n"
        "print('libamdhip64' in maps, 'torch' in sys.modules, 'triton' in sys.modules)\n"
    )
    out = _run(site, "-c", code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "False"]

"""One version for every MORI distribution: the repository's VERSION file, read by each build backend."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from mori.core.version import UNKNOWN, installed_version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
VERSION_FILE = ROOT / "VERSION"
#: every MORI distribution, as noxfile.py finds them (test fixtures under */tests/ are not ours)
PYPROJECTS = sorted(
    p for pattern in ("packages/*", "backends/*", "tests/*") for p in ROOT.glob(f"{pattern}/pyproject.toml")
)


def _version() -> str:
    text = VERSION_FILE.read_text()
    assert re.fullmatch(r"\d+\.\d+\.\d+\n", text), f"VERSION must hold one X.Y.Z line, not {text!r}"
    return text.strip()


def _meta(pyproject: Path) -> dict[str, object]:
    return tomllib.loads(pyproject.read_text())


def test_every_distribution_reads_its_version_from_the_version_file() -> None:
    assert len(PYPROJECTS) >= 13, [p.parent.name for p in PYPROJECTS]
    for pyproject in PYPROJECTS:
        meta = _meta(pyproject)
        project = meta["project"]
        assert isinstance(project, dict)
        where = pyproject.relative_to(ROOT)
        assert "version" not in project, f"{where} hard-codes version = {project['version']!r}"
        assert "version" in project.get("dynamic", []), f"{where}: version is not dynamic"
        tool = meta["tool"]
        assert isinstance(tool, dict)
        if "scikit-build" in tool:
            source = tool["scikit-build"]["metadata"]["version"]
            assert source["provider"] == "scikit_build_core.metadata.regex", where
            path = source["input"]
            # a wheel built from the sdist (nox -s build) reads the version back from PKG-INFO
            from_sdist = [
                o for o in tool["scikit-build"].get("overrides", []) if o.get("if", {}).get("from-sdist")
            ]
            assert from_sdist and from_sdist[0]["metadata"]["version"]["input"] == "PKG-INFO", where
        else:
            path = tool["hatch"]["version"]["path"]
        assert (pyproject.parent / path).resolve() == VERSION_FILE, f"{where} reads its version from {path}"


def test_every_installed_distribution_has_the_version_of_the_version_file() -> None:
    want = _version()
    names = [_meta(p)["project"]["name"] for p in PYPROJECTS]  # type: ignore[index]
    got = {name: installed_version(str(name)) for name in names}
    missing = sorted(n for n, v in got.items() if v == UNKNOWN)
    if len(missing) == len(got):
        pytest.skip("no MORI distribution is installed (a source tree on sys.path)")
    assert not missing, f"not installed: {missing}"
    assert {n: v for n, v in got.items() if v != want} == {}, f"VERSION says {want}"


def test_version_fallbacks_are_the_one_in_mori_core() -> None:
    assert installed_version("mori-no-such-distribution") == UNKNOWN == "0+unknown"
    # a module of ours that finds its own version some other way would have its own fallback
    own = [
        path.relative_to(ROOT).as_posix()
        for base in ("packages", "backends", "tests")
        for path in (ROOT / base).rglob("*.py")
        if "PackageNotFoundError" in path.read_text(encoding="utf-8")
        and path not in (ROOT / "packages/mori-core/src/mori/core/version.py", Path(__file__).resolve())
        and "/build/" not in path.as_posix()
    ]
    assert own == [], "use mori.core.version.installed_version instead"


def test_modules_report_their_distributions_version() -> None:
    import mori.core

    assert mori.core.__version__ == installed_version("mori-core")
    for module, dist in (
        ("mori_backend_nvlink", "mori-backend-nvlink"),
        ("mori_backend_xgmi", "mori-backend-xgmi"),
    ):
        mod = pytest.importorskip(module)
        assert mod.__version__ == installed_version(dist)

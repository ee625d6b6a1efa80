"""The tests every GPU device plugin runs as a user installs it: pip-installed into a directory of
its own (:mod:`mori.testing.plugin_install`), found through its entry point, unavailable here with
a reason, its variables listed, nothing loaded at import.

A GPU plugin is one :class:`mori.core.gpu.vendor.GpuVendor` descriptor, so these tests differ only
in data: a plugin's ``test_plugin.py`` subclasses :class:`GpuPluginTests`::

    from mori_backend_nvlink import VENDOR
    from mori.testing.gpu_plugin import GpuPluginTests

    class TestNvlinkPlugin(GpuPluginTests):
        vendor = VENDOR
        entry_point = "nvlink"
        directory = Path(__file__).parent.parent
        reasons = ("libcuda.so.1 not found", "no CUDA device", "not a CUDA build")
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest

from mori.core.gpu.vendor import GpuVendor
from mori.core.version import installed_version
from mori.testing.plugin_install import install_plugin, run_installed

__all__ = ["GpuPluginTests"]


class GpuPluginTests:
    """Test methods over the class attributes a subclass sets."""

    #: the plugin's descriptor, its entry point's name and its distribution's directory
    vendor: ClassVar[GpuVendor]
    entry_point: ClassVar[str]
    directory: ClassVar[Path]
    #: what ``mori backends`` may give here as the runtime's reason (one of them is in its line)
    reasons: ClassVar[tuple[str, ...]]

    @property
    def module(self) -> str:
        return self.vendor.distribution.replace("-", "_")

    @pytest.fixture(scope="class")
    @classmethod
    def site(cls, tmp_path_factory: pytest.TempPathFactory) -> Path:
        """The plugin installed with pip into a directory of its own."""
        return install_plugin(cls.directory, tmp_path_factory.mktemp("site"))

    def _usable(self) -> bool:
        code = f"import torch; print(torch.cuda.is_available() and torch.version.{self.vendor.torch_version} is not None)"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        return out.stdout.strip() == "True"

    def _line(self, out: str, name: str, *, entry: bool = False) -> str:
        """The line of ``mori backends`` listing backend ``name`` (``entry``: its entry point)."""
        return next(
            line
            for line in out.splitlines()
            if line.strip().startswith(f"{name} ") and ("mori.backends" in line) == entry
        )

    def test_listed_by_mori_backends_with_why_it_is_unavailable(self, site: Path) -> None:
        out = run_installed(site, "-m", "mori.core.cli", "backends", "-v")
        assert out.returncode == 0, out.stderr
        runtime = self._line(out.stdout, self.vendor.runtime)
        transport = self._line(out.stdout, self.vendor.transport)
        release = f"{self.vendor.distribution} {installed_version(self.vendor.distribution)}"
        assert release in runtime and release in transport
        assert f"{self.module}.plugin" in self._line(out.stdout, self.entry_point, entry=True)
        if self._usable():
            assert " available" in runtime, runtime
        else:
            assert "unavailable" in runtime and "unavailable" in transport
            # the reason names what is missing: the driver library, a GPU, or a build of torch
            assert any(r in runtime for r in self.reasons), runtime

    def test_a_missing_driver_library_is_the_reason(self, site: Path, tmp_path: Path) -> None:
        missing = str(tmp_path / self.vendor.libraries[0])
        out = run_installed(
            site, "-m", "mori.core.cli", "backends", env={self.vendor.library_env.name: missing}
        )
        assert out.returncode == 0, out.stderr
        runtime = self._line(out.stdout, self.vendor.runtime)
        assert "unavailable" in runtime and f"{missing} not found: {self.vendor.missing}" in runtime

    def test_env_vars_are_listed(self, site: Path) -> None:
        out = run_installed(site, "-m", "mori.core.cli", "env", "-v")
        assert out.returncode == 0, out.stderr
        for var in (self.vendor.library_env, *self.vendor.env_vars):
            assert f"{var.name}=(unset, default {var.default!r})" in out.stdout

    def test_selecting_it_where_it_cannot_work_says_why(self, site: Path, tmp_path: Path) -> None:
        missing = str(tmp_path / "nope.so")
        out = run_installed(
            site,
            "-c",
            "from mori.core.launch import shmem_ranks\nshmem_ranks(print, 1, timeout=60)",
            env={"MORI_DEVICE_RUNTIME": self.vendor.runtime, self.vendor.library_env.name: missing},
        )
        assert out.returncode != 0
        release = f"{self.vendor.distribution} {installed_version(self.vendor.distribution)}"
        assert f"device runtime '{self.vendor.runtime}' (from {release}) is not usable here" in out.stderr
        assert f"{missing} not found" in out.stderr

    def test_import_loads_neither_the_driver_nor_torch(self, site: Path) -> None:
        library = self.vendor.libraries[0].split(".so")[0]
        code = (
            "import sys\n"
            f"import {self.module}, {self.module}.plugin\n"
            "maps = open('/proc/self/maps').read()\n"
            f"print({library!r} in maps, 'torch' in sys.modules, 'triton' in sys.modules)\n"
        )
        out = run_installed(site, "-c", code)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["False", "False", "False"]

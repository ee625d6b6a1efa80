"""The plugin as a user installs it: found through the entry point, unavailable here with a reason
(:class:`mori.testing.gpu_plugin.GpuPluginTests` over this backend's descriptor), and its own
variable checked."""

from __future__ import annotations

from pathlib import Path

from mori_backend_xgmi import VENDOR

from mori.testing.gpu_plugin import GpuPluginTests
from mori.testing.plugin_install import run_installed


class TestXgmiPlugin(GpuPluginTests):
    vendor = VENDOR
    entry_point = "xgmi"
    directory = Path(__file__).parent.parent
    reasons = ("libamdhip64.so not found", "no AMD GPU", "not a ROCm build")

    def test_the_heap_type_is_checked(self, site: Path) -> None:
        bad = run_installed(site, "-m", "mori.core.cli", "env", env={"MORI_SHMEM_HEAP_TYPE": "cached"})
        assert bad.returncode == 1 and "MORI_SHMEM_HEAP_TYPE='cached' is not valid" in bad.stdout

"""The tests every NIC plugin runs, on the fake sysfs trees of :mod:`mori.testing.fake_sysfs`.

A NIC plugin is one :class:`mori.core.nic.NicVendor` descriptor, so its tests differ only in data:
a plugin's test module describes its case and subclasses :class:`NicPluginTests`::

    from mori_backend_thor2 import VENDOR
    from mori.testing.nic_plugin import NicPluginCase, NicPluginTests

    class TestThor2(NicPluginTests):
        case = NicPluginCase(VENDOR, "mori-backend-thor2", "bnxt", "bnxt_re", ...)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from mori.core.nic import VendorNicProvider, network_settings, scan_rdma_devices
from mori.core.plugins import Plugins
from mori.core.version import installed_version
from mori.testing.fake_sysfs import NICS, eight_gpus_eight_nics, no_nic

__all__ = ["NicPluginCase", "NicPluginTests"]


@dataclass(frozen=True)
class NicPluginCase:
    vendor: Any  # the plugin's NicVendor
    distribution: str  # "mori-backend-thor2"
    family: str  # the fake_sysfs family of its devices: "mlx5", "bnxt", "ionic"
    driver: str  # the name its "no device" reason gives: "bnxt_re"
    first_device: str  # how the probe lists the first device: "bnxt_re0 (bnxt_re device 0x1760, fw "
    env_var: str  # one variable of its own that `mori env` lists
    max_send_wr: int | None  # its send-queue cap in the network settings
    fw_low: str | None = None  # a firmware below its minimum (None: it has no minimum)
    fw_ok: str | None = None  # its minimum
    fw_warning: str = ""  # the probe's warning for fw_low


class NicPluginTests:
    """Test methods over ``case`` (set by the subclass)."""

    case: NicPluginCase

    @property
    def name(self) -> str:
        return str(self.case.vendor.name)

    def test_found_through_the_entry_point_with_a_true_reason_here(self) -> None:
        f = {f.backend.name: f for f in Plugins().nic_providers()}[self.name]
        assert f.plugin.distribution == self.case.distribution and f.plugin.group == "mori.backends"
        if not Path("/sys/class/infiniband").is_dir():  # this CI machine: no RDMA device at all
            assert not f.availability.usable
            assert f.availability.reason.startswith(f"no {self.case.driver} device in /sys/class/infiniband")

    def test_claims_its_devices_and_no_other_family(self, tmp_path: Path) -> None:
        for fam in NICS:
            eight_gpus_eight_nics(tmp_path / fam, family=fam)
            claimed = [d for d in scan_rdma_devices(tmp_path / fam) if self.case.vendor.claims(d)]
            assert len(claimed) == (8 if fam == self.case.family else 0), fam

    def test_probe_on_a_node_with_eight_nics(self, tmp_path: Path) -> None:
        eight_gpus_eight_nics(tmp_path, family=self.case.family, inactive=(2,))
        a = VendorNicProvider(self.case.vendor, tmp_path).probe()
        assert a.usable, a.reason
        assert self.case.first_device in a.reason and "port 1 DOWN" in a.reason

    def test_probe_without_nic_or_library(self, tmp_path: Path) -> None:
        no_nic(tmp_path)
        a = VendorNicProvider(self.case.vendor, tmp_path).probe()
        assert not a.usable and a.reason.startswith(f"no {self.case.driver} device in ")
        eight_gpus_eight_nics(tmp_path / "nolib", family=self.case.family, library=False)
        a = VendorNicProvider(self.case.vendor, tmp_path / "nolib").probe()
        assert not a.usable and "not installed" in a.reason

    def test_its_variables_are_listed_by_mori_env(self, capsys: pytest.CaptureFixture[str]) -> None:
        from mori.core import cli

        cli.main(["env"])
        assert f"{self.case.env_var}=" in capsys.readouterr().out

    def test_firmware_below_the_minimum_warns(self, tmp_path: Path) -> None:
        if self.case.fw_low is None or self.case.fw_ok is None:
            pytest.skip(f"{self.name} has no firmware minimum")
        eight_gpus_eight_nics(tmp_path, family=self.case.family, fw=self.case.fw_low)
        a = VendorNicProvider(self.case.vendor, tmp_path).probe()
        assert a.usable and self.case.fw_warning in a.reason, a.reason
        eight_gpus_eight_nics(tmp_path / "ok", family=self.case.family, fw=self.case.fw_ok)
        assert "WARNING" not in VendorNicProvider(self.case.vendor, tmp_path / "ok").probe().reason

    def test_send_queue_cap_reaches_the_network_settings(
        self, tmp_path: Path, clean_env: pytest.MonkeyPatch
    ) -> None:
        eight_gpus_eight_nics(tmp_path, family=self.case.family)
        s = network_settings([self.case.vendor], tmp_path)
        assert s.max_send_wr == self.case.max_send_wr and s.vendors == (self.name,) and len(s.ports) == 8

    def test_mori_backends_lists_it_with_its_reason(self, capsys: pytest.CaptureFixture[str]) -> None:
        from mori.core import cli
        from mori.core.plugins import reset_plugins

        reset_plugins()
        assert cli.main(["backends"]) == 0
        line = next(s for s in capsys.readouterr().out.splitlines() if s.strip().startswith(f"{self.name} "))
        assert f"{self.case.distribution} {installed_version(self.case.distribution)}" in line
        if not Path("/sys/class/infiniband").is_dir():
            assert "unavailable" in line and f"no {self.case.driver} device in /sys/class/infiniband" in line

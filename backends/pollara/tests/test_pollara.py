"""The pollara NIC plugin: found through its entry point, its probe on fake sysfs trees of real shapes."""

from __future__ import annotations

from pathlib import Path

import pytest
from mori_backend_pollara import VENDOR

from mori.core.nic import VendorNicProvider, network_settings, scan_rdma_devices
from mori.core.plugins import Plugins
from mori.testing.fake_sysfs import NICS, eight_gpus_eight_nics, no_nic


def test_found_through_the_entry_point_with_a_true_reason_here() -> None:
    found = {f.backend.name: f for f in Plugins().nic_providers()}
    f = found["pollara"]
    assert f.plugin.distribution == "mori-backend-pollara" and f.plugin.group == "mori.backends"
    if not Path("/sys/class/infiniband").is_dir():  # this CI machine: no RDMA device at all
        assert not f.availability.usable
        assert f.availability.reason.startswith("no ionic device in /sys/class/infiniband")


def test_claims_its_devices_and_no_other_family(tmp_path: Path) -> None:
    for fam in NICS:
        eight_gpus_eight_nics(tmp_path / fam, family=fam)
        claimed = [d for d in scan_rdma_devices(tmp_path / fam) if VENDOR.claims(d)]
        assert len(claimed) == (8 if fam == "ionic" else 0), fam


def test_probe_on_a_node_with_eight_nics(tmp_path: Path) -> None:
    eight_gpus_eight_nics(tmp_path, family="ionic", inactive=(2,))
    a = VendorNicProvider(VENDOR, tmp_path).probe()
    assert a.usable, a.reason
    assert "ionic_0 (ionic device 0x1002, fw " in a.reason and "port 1 DOWN" in a.reason


def test_probe_without_nic_or_library(tmp_path: Path) -> None:
    no_nic(tmp_path)
    a = VendorNicProvider(VENDOR, tmp_path).probe()
    assert not a.usable and a.reason.startswith("no ionic device in ")
    eight_gpus_eight_nics(tmp_path / "nolib", family="ionic", library=False)
    a = VendorNicProvider(VENDOR, tmp_path / "nolib").probe()
    assert not a.usable and "not installed" in a.reason


def test_its_variables_are_listed_by_mori_env(capsys: pytest.CaptureFixture[str]) -> None:
    from mori.core import cli

    cli.main(["env"])
    assert "MORI_DISABLE_IONIC_CCQE=" in capsys.readouterr().out


def test_firmware_below_the_minimum_warns(tmp_path: Path) -> None:
    eight_gpus_eight_nics(tmp_path, family="ionic", fw="1.117.5-a-44")
    a = VendorNicProvider(VENDOR, tmp_path).probe()
    assert (
        a.usable
        and "WARNING: firmware below ionic's minimum 1.117.5-a-45 on ionic_0 (1.117.5-a-44)" in a.reason
    )
    eight_gpus_eight_nics(tmp_path / "ok", family="ionic", fw="1.117.5-a-45")
    assert "WARNING" not in VendorNicProvider(VENDOR, tmp_path / "ok").probe().reason


def test_send_queue_cap_reaches_the_network_settings(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    eight_gpus_eight_nics(tmp_path, family="ionic")
    s = network_settings([VENDOR], tmp_path)
    assert s.max_send_wr == 32767 and s.vendors == ("pollara",) and len(s.ports) == 8


def test_mori_backends_lists_it_with_its_reason(capsys: pytest.CaptureFixture[str]) -> None:
    from mori.core import cli
    from mori.core.plugins import reset_plugins

    reset_plugins()
    assert cli.main(["backends"]) == 0
    line = next(s for s in capsys.readouterr().out.splitlines() if s.strip().startswith("pollara "))
    assert "mori-backend-pollara 0.1.0" in line
    if not Path("/sys/class/infiniband").is_dir():
        assert "unavailable" in line and "no ionic device in /sys/class/infiniband" in line

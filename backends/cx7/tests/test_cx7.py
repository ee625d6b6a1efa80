"""The cx7 NIC plugin: found through its entry point, its probe on fake sysfs trees of real shapes."""

from __future__ import annotations

from pathlib import Path

import pytest
from mori_backend_cx7 import VENDOR

from mori.core.nic import VendorNicProvider, network_settings, scan_rdma_devices
from mori.core.plugins import Plugins
from mori.testing.fake_sysfs import NICS, eight_gpus_eight_nics, no_nic


def test_found_through_the_entry_point_with_a_true_reason_here() -> None:
    found = {f.backend.name: f for f in Plugins().nic_providers()}
    f = found["cx7"]
    assert f.plugin.distribution == "mori-backend-cx7" and f.plugin.group == "mori.backends"
    if not Path("/sys/class/infiniband").is_dir():  # this CI machine: no RDMA device at all
        assert not f.availability.usable
        assert f.availability.reason.startswith("no mlx5 device in /sys/class/infiniband")


def test_claims_its_devices_and_no_other_family(tmp_path: Path) -> None:
    for fam in NICS:
        eight_gpus_eight_nics(tmp_path / fam, family=fam)
        claimed = [d for d in scan_rdma_devices(tmp_path / fam) if VENDOR.claims(d)]
        assert len(claimed) == (8 if fam == "mlx5" else 0), fam


def test_probe_on_a_node_with_eight_nics(tmp_path: Path) -> None:
    eight_gpus_eight_nics(tmp_path, family="mlx5", inactive=(2,))
    a = VendorNicProvider(VENDOR, tmp_path).probe()
    assert a.usable, a.reason
    assert "mlx5_0 (ConnectX-7, fw " in a.reason and "port 1 DOWN" in a.reason


def test_probe_without_nic_or_library(tmp_path: Path) -> None:
    no_nic(tmp_path)
    a = VendorNicProvider(VENDOR, tmp_path).probe()
    assert not a.usable and a.reason.startswith("no mlx5 device in ")
    eight_gpus_eight_nics(tmp_path / "nolib", family="mlx5", library=False)
    a = VendorNicProvider(VENDOR, tmp_path / "nolib").probe()
    assert not a.usable and "not installed" in a.reason


def test_its_variables_are_listed_by_mori_env(capsys: pytest.CaptureFixture[str]) -> None:
    from mori.core import cli

    cli.main(["env"])
    assert "MORI_MLX5_ENABLE_UDP_SPORT=" in capsys.readouterr().out


def test_send_queue_cap_reaches_the_network_settings(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    eight_gpus_eight_nics(tmp_path, family="mlx5")
    s = network_settings([VENDOR], tmp_path)
    assert s.max_send_wr is None and s.vendors == ("cx7",) and len(s.ports) == 8


def test_mori_backends_lists_it_with_its_reason(capsys: pytest.CaptureFixture[str]) -> None:
    from mori.core import cli
    from mori.core.plugins import reset_plugins

    reset_plugins()
    assert cli.main(["backends"]) == 0
    line = next(s for s in capsys.readouterr().out.splitlines() if s.strip().startswith("cx7 "))
    assert "mori-backend-cx7 0.1.0" in line
    if not Path("/sys/class/infiniband").is_dir():
        assert "unavailable" in line and "no mlx5 device in /sys/class/infiniband" in line

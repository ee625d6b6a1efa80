"""mori.core.nic: sysfs reading, vendors as data, MORI_RDMA_DEVICES, network settings (fake trees)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mori.core import env, nic
from mori.core.errors import MoriValueError
from mori.testing.fake_sysfs import CLASS_ETH, INTEL, FakeSysfs, eight_gpus_eight_nics, no_nic

#: a vendor made up for the tests: core must handle any descriptor, not three it knows
ACME = nic.NicVendor(
    name="acme",
    family="acme",
    description="test NICs",
    drivers=("mlx5_core",),
    pci_vendors=(0x15B3,),
    name_prefixes=("mlx5_",),
    libraries=("libmlx5",),
    models={0x1021: "Acme-7"},
    firmware_minimums=("28.40.0",),
    max_send_wr=1000,
)


def test_scan_reads_devices_drivers_ports_and_firmware(tmp_path: Path) -> None:
    eight_gpus_eight_nics(tmp_path, inactive=(3,))
    devs = nic.scan_rdma_devices(tmp_path)
    assert [d.name for d in devs] == [f"mlx5_{i}" for i in range(8)]
    d0, d3 = devs[0], devs[3]
    assert d0.drivers == ("mlx5_core",) and d0.pci_vendor == 0x15B3 and d0.pci_device == 0x1021
    assert d0.pci_address == "0000:05:00.0" and d0.fw_ver == "28.39.1002" and d0.numa_node == 0
    assert d0.ports[0].active and d0.ports[0].link_layer == "Ethernet"
    assert d3.ports[0].state == "DOWN" and d3.port_names() == [] and d3.port_names(False) == ["mlx5_3:1"]
    assert devs[7].numa_node == 1


def test_scan_of_a_machine_without_nics_is_empty(tmp_path: Path) -> None:
    no_nic(tmp_path)
    assert nic.scan_rdma_devices(tmp_path) == []
    assert nic.scan_rdma_devices(tmp_path / "nothing-here") == []


def test_auxiliary_bus_devices_are_walked_up_to_their_pci_function(tmp_path: Path) -> None:
    eight_gpus_eight_nics(tmp_path, family="bnxt")
    d = nic.scan_rdma_devices(tmp_path)[0]
    assert d.name == "bnxt_re0" and d.drivers == ("bnxt_re", "bnxt_en") and d.pci_vendor == 0x14E4


def test_claims_by_driver_then_vendor_then_name(tmp_path: Path) -> None:
    fs = FakeSysfs(tmp_path)
    fs.pci("0000:00:01.0")
    # a ConnectX-3: Mellanox's vendor id, but mlx4's driver: not an mlx5 device
    fs.pci(
        "0000:01:00.0",
        parent="0000:00:01.0",
        vendor=0x15B3,
        device=0x1003,
        pci_class=CLASS_ETH,
        driver="mlx4_core",
    )
    fs.rdma("mlx4_0", "0000:01:00.0")
    # no driver bound: the vendor id decides
    fs.pci("0000:02:00.0", parent="0000:00:01.0", vendor=0x15B3, device=0x1021, pci_class=CLASS_ETH)
    fs.rdma("mlx5_9", "0000:02:00.0")
    # an unknown vendor's NIC, and a soft device with no PCI function
    fs.pci(
        "0000:03:00.0", parent="0000:00:01.0", vendor=INTEL, device=0x1593, pci_class=CLASS_ETH, driver="ice"
    )
    fs.rdma("irdma0", "0000:03:00.0")
    fs.rdma("mlx5_soft", None)
    claimed = {d.name: ACME.claims(d) for d in nic.scan_rdma_devices(tmp_path)}
    assert claimed == {"mlx4_0": False, "mlx5_9": True, "irdma0": False, "mlx5_soft": True}


@pytest.mark.parametrize(
    ("version", "minimums", "below"),
    [
        ("235.2.86", ("235.2.86", "237.1.137"), None),
        ("235.2.85", ("235.2.86", "237.1.137"), "235.2.86"),
        ("235.10.1", ("235.2.86", "237.1.137"), None),  # numeric, not text, comparison
        ("237.1.100", ("235.2.86", "237.1.137"), "237.1.137"),
        ("236.0.1", ("235.2.86", "237.1.137"), None),  # held to the older branch's minimum
        ("234.9.9", ("235.2.86", "237.1.137"), "235.2.86"),
        ("1.117.5-a-45", ("1.117.5-a-45",), None),
        ("1.117.5-a-44", ("1.117.5-a-45",), "1.117.5-a-45"),
        ("1.117.5-a-100", ("1.117.5-a-45",), None),
        ("1.116.9-a-99", ("1.117.5-a-45",), "1.117.5-a-45"),
        ("", ("1.0",), None),
        ("weird", ("1.0",), None),  # cannot be compared: no claim either way
        ("1.0", (), None),
    ],
)
def test_firmware_minimums_per_branch(version: str, minimums: tuple[str, ...], below: str | None) -> None:
    assert nic.firmware_below(version, minimums) == below


def test_probe_is_true_about_what_is_missing(tmp_path: Path) -> None:
    p = nic.VendorNicProvider(ACME, tmp_path)
    a = p.probe()
    assert not a.usable and "no acme device in" in a.reason and "does not exist" in a.reason
    eight_gpus_eight_nics(tmp_path / "nolib", library=False)
    a = nic.VendorNicProvider(ACME, tmp_path / "nolib").probe()
    assert not a.usable and "libmlx5" in a.reason and "not installed" in a.reason
    eight_gpus_eight_nics(tmp_path / "down", inactive=tuple(range(8)))
    a = nic.VendorNicProvider(ACME, tmp_path / "down").probe()
    assert not a.usable and "no port is ACTIVE" in a.reason
    eight_gpus_eight_nics(tmp_path / "ok")
    a = nic.VendorNicProvider(ACME, tmp_path / "ok").probe()
    assert a.usable and "mlx5_0 (Acme-7, fw 28.39.1002, port 1 ACTIVE)" in a.reason
    # 28.39.1002 is below the made-up minimum 28.40.0: a warning naming the device
    assert (
        "WARNING: firmware below acme's minimum 28.40.0 on mlx5_0 (28.39.1002), mlx5_1 (28.39.1002)"
        in a.reason
    )


def test_probe_has_no_side_effects(tmp_path: Path) -> None:
    eight_gpus_eight_nics(tmp_path)
    before = sorted((p, p.stat().st_mtime_ns) for p in tmp_path.rglob("*") if not p.is_symlink())
    nic.VendorNicProvider(ACME, tmp_path).probe()
    after = sorted((p, p.stat().st_mtime_ns) for p in tmp_path.rglob("*") if not p.is_symlink())
    assert before == after


def test_device_filter_syntax() -> None:
    f = nic.parse_device_filter("mlx5_0,mlx5_1:2")
    assert f.allows("mlx5_0", 1) and f.allows("mlx5_1", 2) and not f.allows("mlx5_1", 1)
    assert not f.allows("mlx5_2", 1)
    x = nic.parse_device_filter(" ^mlx5_2 ")
    assert x.exclude and not x.allows("mlx5_2", 1) and x.allows("mlx5_0", 1)
    assert nic.parse_device_filter(None).allows("anything", 7)
    for bad in ("mlx5_0,,mlx5_1", "mlx5 0", "mlx5_0:x", "^"):
        with pytest.raises(
            MoriValueError, match=r"MORI_RDMA_DEVICES: entry=.* is not allowed; expected NAME"
        ):
            nic.parse_device_filter(bad)


def test_bad_device_list_in_env_is_reported_by_name(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("MORI_RDMA_DEVICES", "mlx5_0;mlx5_1")
    with pytest.raises(MoriValueError, match="MORI_RDMA_DEVICES='mlx5_0;mlx5_1' is not valid"):
        env.MORI_RDMA_DEVICES.get()


def test_network_settings_select_active_ports_and_qos(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    eight_gpus_eight_nics(tmp_path, inactive=(3,))
    s = nic.network_settings([ACME], tmp_path)
    assert s.ports == tuple(f"mlx5_{i}:1" for i in range(8) if i != 3)
    assert s.vendors == ("acme",) and not s.explicit and s.max_send_wr == 1000
    assert s.gid_index is None and s.traffic_class is None and s.service_level is None
    clean_env.setenv("MORI_RDMA_DEVICES", "^mlx5_0,mlx5_7")
    clean_env.setenv("MORI_IB_GID_INDEX", "3")
    clean_env.setenv("MORI_RDMA_TC", "104")
    clean_env.setenv("MORI_RDMA_SL", "3")
    s = nic.network_settings([ACME], tmp_path)
    assert s.ports == ("mlx5_1:1", "mlx5_2:1", "mlx5_4:1", "mlx5_5:1", "mlx5_6:1") and s.explicit
    assert (s.gid_index, s.traffic_class, s.service_level) == (3, 104, 3)
    clean_env.setenv("MORI_RDMA_DEVICES", "mlx5_1,mlx5_9")
    with pytest.raises(MoriValueError, match="names mlx5_9: not on this machine"):
        nic.network_settings([ACME], tmp_path)
    clean_env.delenv("MORI_RDMA_DEVICES")
    # no device on the machine: nothing selected
    assert nic.network_settings([], tmp_path / "x").ports == ()


@pytest.mark.parametrize(
    ("name", "value"), [("MORI_RDMA_SL", "16"), ("MORI_RDMA_TC", "256"), ("MORI_IB_GID_INDEX", "-1")]
)
def test_qos_values_are_range_checked(clean_env: pytest.MonkeyPatch, name: str, value: str) -> None:
    clean_env.setenv(name, value)
    var = {v.name: v for v in env.ALL}[name]
    with pytest.raises(
        MoriValueError, match=f"{name}='{value}' is not valid: expected a whole number from 0"
    ):
        var.get()


def test_gid_entries(tmp_path: Path) -> None:
    eight_gpus_eight_nics(tmp_path)
    assert nic.gid("mlx5_0", 1, 3, tmp_path) == ("0000:0000:0000:0000:0000:ffff:0a00:0001", "RoCE v2")
    assert nic.gid("mlx5_0", 1, 0, tmp_path) == ("fe80:0000:0000:0000:0a00:00ff:fe00:0001", "IB/RoCE v1")
    assert nic.gid("mlx5_0", 1, 2, tmp_path) is None  # all zero: unused
    assert nic.gid("mlx5_0", 1, 9, tmp_path) is None and nic.gid("mlx5_9", 1, 0, tmp_path) is None

"""The NIC plugins' data reaches the ucx transport's options: devices only when the user opts in,
QoS settings only where this UCX has verbs, the user's own options always win."""

from __future__ import annotations

from pathlib import Path

import pytest
from mori_backend_ucx.transport import UcxTransport, nic_options

from mori.core.nic import NetworkSettings


def _settings(explicit: bool = True, **kw: object) -> NetworkSettings:
    base: dict[str, object] = {
        "ports": ("mlx5_0:1", "mlx5_1:1"),
        "vendors": ("cx7",),
        "explicit": explicit,
        "gid_index": None,
        "traffic_class": None,
        "service_level": None,
        "max_send_wr": None,
    }
    base.update(kw)
    return NetworkSettings(**base)  # type: ignore[arg-type]


def test_devices_join_net_devices_only_when_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    assert nic_options(_settings(), "", has_verbs=True) == ["net_devices=mlx5_0:1,mlx5_1:1,lo"]
    assert nic_options(_settings(explicit=False), "", has_verbs=True) == []  # loopback stays the default
    assert nic_options(_settings(), "net_devices=eth0", has_verbs=True) == []  # the user's choice wins
    monkeypatch.setenv("UCX_NET_DEVICES", "mlx5_1:1")
    assert nic_options(_settings(), "", has_verbs=True) == []


def test_qos_settings_need_a_verbs_ucx(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("UCX_NET_DEVICES", "UCX_IB_GID_INDEX", "UCX_IB_TRAFFIC_CLASS", "UCX_IB_SL"):
        monkeypatch.delenv(var, raising=False)
    s = _settings(explicit=False, gid_index=3, traffic_class=104, service_level=5)
    assert nic_options(s, "", has_verbs=True) == [
        "UCX_IB_GID_INDEX=3",
        "UCX_IB_TRAFFIC_CLASS=104",
        "UCX_IB_SL=5",
    ]
    assert nic_options(s, "", has_verbs=False) == []  # the wheel's UCX would refuse these names
    assert nic_options(s, "UCX_IB_SL=1", has_verbs=True) == ["UCX_IB_GID_INDEX=3", "UCX_IB_TRAFFIC_CLASS=104"]


def test_a_device_that_is_not_here_makes_the_probe_say_so(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("MORI_RDMA_DEVICES", "mlx5_7")
    a = UcxTransport().probe()
    assert not a.usable and "MORI_RDMA_DEVICES='mlx5_7' names mlx5_7: not on this machine" in a.reason


@pytest.mark.skipif(Path("/sys/class/infiniband").is_dir(), reason="this machine has RDMA devices")
def test_without_nics_the_options_are_the_users(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("MORI_UCX_OPTIONS", "tls=tcp")
    clean_env.setenv("MORI_RDMA_TC", "104")  # nothing to apply it to: no RDMA port, no UCX_IB_*
    assert UcxTransport().options() == "tls=tcp"

"""mori.core.netns: emulated nodes in network namespaces (the real pair only as root with ip)."""

from __future__ import annotations

import subprocess

import pytest

from mori.core import netns


def test_node_spec_round_trips() -> None:
    node = netns.Node("mori-x-1-a", "mx1a", "10.9.8.1")
    assert netns.Node.from_spec(node.spec()) == node


def test_not_root_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert netns.unavailable() == "network namespaces need root (ip netns add)"
    with pytest.raises(netns.NetnsUnavailable, match="need root"):
        netns.create_pair("t", 240)


def test_a_failed_step_is_named_and_what_was_made_is_removed(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, ...]] = []

    def fake_ip(*args: str) -> subprocess.CompletedProcess[str]:
        calls.append(args)
        failed = args[:2] == ("link", "add")
        return subprocess.CompletedProcess(
            ["ip", *args], 2 if failed else 0, "", "no veth here" if failed else ""
        )

    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda name: "/sbin/ip")
    monkeypatch.setattr(netns, "_ip", fake_ip)
    with pytest.raises(netns.NetnsUnavailable, match=r"ip link add m.* type veth .* failed: no veth here"):
        netns.create_pair("t", 240)
    made = [a[2] for a in calls if a[:2] == ("netns", "add")]
    removed = [a[2] for a in calls if a[:2] == ("netns", "del")]
    assert len(made) == 2 and removed == made, calls


def test_a_real_pair_is_made_and_removed() -> None:
    why = netns.unavailable()
    if why is not None:
        pytest.skip(why)
    try:
        with netns.pair("t", 240) as nodes:
            listed = subprocess.run(
                ["ip", "netns", "list"], capture_output=True, text=True, check=False
            ).stdout
            assert all(n.name in listed for n in nodes)
            ping = subprocess.run(
                ["ip", "netns", "exec", nodes[0].name, "ping", "-c", "1", "-W", "2", nodes[1].ip],
                capture_output=True,
                text=True,
                check=False,
            )
            if ping.returncode == 0:  # (ping may be missing from the image)
                assert netns.tx_bytes(nodes[0]) > 0
    except netns.NetnsUnavailable as e:
        pytest.skip(str(e))
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    assert all(n.name not in listed for n in nodes)

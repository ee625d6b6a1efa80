"""The conformance suite across two network namespaces joined by a veth pair (as root), so that
every byte really crosses a network stack: UCX over TCP between 10.231.x.1 and 10.231.x.2."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from mori.testing import transport_conformance

CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
MS_REC, MS_SLAVE, MNT_DETACH = 0x4000, 1 << 19, 2


def netns_factory() -> tuple[Any, str]:
    """Enter this rank's namespace (rank from the launcher's process name), then open the
    transport on that namespace's veth end only."""
    rank = int(multiprocessing.current_process().name.removeprefix("rank"))
    ns = os.environ["MORI_UCX_TEST_NETNS"].split(",")[rank]
    dev = os.environ["MORI_UCX_TEST_VETH"].split(",")[rank]
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns}")
    finally:
        os.close(fd)
    # as `ip netns exec` does: a private /sys of this namespace, where UCX lists its devices
    if libc.unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    if libc.mount(b"none", b"/", None, MS_REC | MS_SLAVE, None) != 0:
        raise OSError(ctypes.get_errno(), "mount --make-rslave /")
    libc.umount2(b"/sys", MNT_DETACH)
    if libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None) != 0:
        raise OSError(ctypes.get_errno(), "mount sysfs")
    from mori_backend_ucx import UcxTransport

    return UcxTransport().ops(), f"tls=tcp;net_devices={dev}"


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)


@pytest.fixture
def two_namespaces() -> Iterator[tuple[list[str], list[str]]]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (ip netns add)")
    if shutil.which("ip") is None:
        pytest.skip("the ip command (iproute2) is not installed")
    tag = f"{os.getpid() % 100000}"
    names = [f"mori-ucx-{tag}-a", f"mori-ucx-{tag}-b"]
    veths = [f"mu{tag}a", f"mu{tag}b"]
    subnet = f"10.231.{os.getpid() % 250}"
    try:
        for ns in names:
            r = _ip("netns", "add", ns)
            if r.returncode != 0:
                pytest.skip(f"cannot create a network namespace here: {r.stderr.strip()}")
        steps = [
            ("link", "add", veths[0], "type", "veth", "peer", "name", veths[1]),
            ("link", "set", veths[0], "netns", names[0]),
            ("link", "set", veths[1], "netns", names[1]),
        ]
        for i in range(2):
            steps += [
                ("-n", names[i], "addr", "add", f"{subnet}.{i + 1}/24", "dev", veths[i]),
                ("-n", names[i], "link", "set", veths[i], "up"),
                ("-n", names[i], "link", "set", "lo", "up"),
            ]
        for step in steps:
            r = _ip(*step)
            if r.returncode != 0:
                pytest.skip(f"cannot set up the veth pair (ip {' '.join(step)}): {r.stderr.strip()}")
        yield names, veths
    finally:
        for ns in names:  # deleting a namespace deletes its veth end, and so the pair
            _ip("netns", "del", ns)


def _tx_bytes(ns: str, dev: str) -> int:
    r = _ip("-n", ns, "-s", "-j", "link", "show", dev)
    import json

    return int(json.loads(r.stdout)[0]["stats64"]["tx"]["bytes"])


def test_conformance_across_network_namespaces(two_namespaces: tuple[list[str], list[str]]) -> None:
    names, veths = two_namespaces
    env = {"MORI_UCX_TEST_NETNS": ",".join(names), "MORI_UCX_TEST_VETH": ",".join(veths)}
    results = transport_conformance.check(f"{__name__}:netns_factory", env, timeout=120)
    assert all(r["atomics"] == "ok" and r["errors"] == "ok" for r in results)
    # the suite moves ~18 MiB each way: it went through the veth, not around it
    assert _tx_bytes(names[0], veths[0]) > 8 << 20
    assert _tx_bytes(names[1], veths[1]) > 8 << 20

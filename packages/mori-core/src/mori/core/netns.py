"""Emulated nodes in Linux network namespaces: two namespaces joined by a veth pair, so that bytes
between them cross a real network stack (root only; iproute2's ``ip``).

The tests that run transports and engines "across nodes" on one machine and
``mori bench io --netns on`` use it; nothing else in MORI creates namespaces. A process joins a
namespace with :func:`enter` (as ``ip netns exec`` does), or a command is started under
``ip netns exec NAME``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Node", "NetnsUnavailable", "create_pair", "enter", "pair", "remove", "tx_bytes", "unavailable"]

_CLONE_NEWNET, _CLONE_NEWNS = 0x40000000, 0x00020000
_MS_REC, _MS_SLAVE, _MNT_DETACH = 0x4000, 1 << 19, 2


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be made here; the message says why (not root, no ``ip``, or what ``ip``
    answered)."""


@dataclass(frozen=True)
class Node:
    """One emulated node: the namespace ``name`` (``/run/netns/NAME``), its veth end ``dev`` and the
    address ``ip`` on it (a /24 shared with the other end)."""

    name: str
    dev: str
    ip: str

    def spec(self) -> str:
        """``"name,dev,ip"``: the node as one string (an environment variable, a process argument)."""
        return f"{self.name},{self.dev},{self.ip}"

    @classmethod
    def from_spec(cls, spec: str) -> Node:
        name, dev, ip = spec.split(",")
        return cls(name, dev, ip)


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)


def unavailable() -> str | None:
    """Why namespaces cannot be made by this process, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    return None


def create_pair(kind: str, octet: int) -> list[Node]:
    """Two namespaces ``mori-KIND-TAG-a`` / ``-b`` joined by a veth pair, addresses
    ``10.OCTET.X.1`` and ``.2`` (``TAG`` and ``X`` from this process id, so concurrent jobs do not
    collide; ``octet`` keeps different users apart). Raises :class:`NetnsUnavailable`, having
    removed what it made, if any step fails."""
    why = unavailable()
    if why is not None:
        raise NetnsUnavailable(why)
    if not 0 < octet < 256 or not kind:
        raise ValueError(f"create_pair: kind={kind!r}, octet={octet}: expected a name and 1..255")
    tag = f"{os.getpid() % 100000}"
    subnet = f"10.{octet}.{os.getpid() % 250}"
    nodes = [
        Node(f"mori-{kind}-{tag}-{s}", f"m{kind[0]}{tag}{s}", f"{subnet}.{i + 1}") for i, s in enumerate("ab")
    ]
    steps: list[tuple[str, ...]] = [("netns", "add", n.name) for n in nodes]
    steps.append(("link", "add", nodes[0].dev, "type", "veth", "peer", "name", nodes[1].dev))
    for n in nodes:
        steps += [
            ("link", "set", n.dev, "netns", n.name),
            ("-n", n.name, "addr", "add", f"{n.ip}/24", "dev", n.dev),
            ("-n", n.name, "link", "set", n.dev, "up"),
            ("-n", n.name, "link", "set", "lo", "up"),
        ]
    for step in steps:
        r = _ip(*step)
        if r.returncode != 0:
            remove(nodes)
            raise NetnsUnavailable(f"ip {' '.join(step)} failed: {r.stderr.strip()}")
    return nodes


def remove(nodes: list[Node]) -> None:
    """Delete the namespaces (and so their veth ends); missing ones are no error."""
    for n in nodes:
        _ip("netns", "del", n.name)


@contextlib.contextmanager
def pair(kind: str, octet: int) -> Iterator[list[Node]]:
    """:func:`create_pair`, removed again when the block ends, however it ends."""
    nodes = create_pair(kind, octet)
    try:
        yield nodes
    finally:
        remove(nodes)


def enter(node: Node) -> None:
    """Move this process into ``node``'s namespace as ``ip netns exec`` does, with a private
    ``/sys`` of that namespace (where UCX lists its network devices). Call it before any library
    opens sockets or reads the devices; a process does not come back out."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{node.name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {node.name}")
    finally:
        os.close(fd)
    if libc.unshare(_CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    if libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None) != 0:
        raise OSError(ctypes.get_errno(), "mount --make-rslave /")
    libc.umount2(b"/sys", _MNT_DETACH)
    if libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None) != 0:
        raise OSError(ctypes.get_errno(), "mount sysfs")


def tx_bytes(node: Node) -> int:
    """Bytes ``node``'s veth end has sent so far; -1 if ``ip`` cannot say."""
    r = _ip("-n", node.name, "-s", "-j", "link", "show", node.dev)
    try:
        return int(json.loads(r.stdout)[0]["stats64"]["tx"]["bytes"])
    except (ValueError, KeyError, IndexError, TypeError):
        return -1

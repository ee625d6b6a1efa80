"""Where this process runs: node identity and the address peers can reach it at."""

from __future__ import annotations

import fcntl
import socket
import struct
from pathlib import Path

from mori.core import env
from mori.core.errors import MoriValueError

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def node_id() -> str:
    """Ranks with the same node id share host memory: ``MORI_NODE_ID``, else boot id, else hostname."""
    explicit = env.MORI_NODE_ID.get()
    if explicit:
        return explicit
    try:
        boot = _BOOT_ID.read_text().strip()
        if boot:
            return f"boot:{boot}"
    except OSError:
        pass
    return f"host:{socket.gethostname()}"


def interface_ipv4(ifname: str) -> str:
    """IPv4 address of a network interface, e.g. ``eth0``."""
    if ifname not in {name for _, name in socket.if_nameindex()}:
        known = ", ".join(name for _, name in socket.if_nameindex())
        raise MoriValueError(f"MORI_SOCKET_IFNAME={ifname!r}: no such interface (this host has: {known})")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))  # SIOCGIFADDR
        except OSError as e:
            raise MoriValueError(
                f"MORI_SOCKET_IFNAME={ifname!r}: interface has no IPv4 address ({e})"
            ) from None
    return socket.inet_ntoa(packed[20:24])


def advertised_host() -> str:
    """The address this process tells peers to connect to (rendezvous servers)."""
    ifname = env.MORI_SOCKET_IFNAME.get()
    if ifname:
        return interface_ipv4(ifname)
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"

"""``mori bench io --netns on``: the target in a network namespace of its own and the initiators in
another, joined by a veth pair (:mod:`mori.core.netns`), created and deleted by the run, so every
byte crosses a network stack."""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["enter_namespace", "make_namespaces", "veth_bytes"]


#: a process started before the initiator leaves its namespaces: deletes them when its stdin closes
#: (the run ended, or the initiator died)
_JANITOR = (
    "import subprocess, sys\n"
    "sys.stdin.read()\n"
    "for ns in sys.argv[1:]:\n"
    "    subprocess.run(['ip', 'netns', 'del', ns], capture_output=True, check=False)\n"
)


def make_namespaces() -> tuple[list[str], Any]:
    """Two network namespaces joined by a veth pair (:mod:`mori.core.netns`): their specs
    ``["ns,dev,ip", "ns,dev,ip"]`` (initiators, target) and the janitor process that deletes them
    once its stdin closes, even if this process dies."""
    import subprocess

    from mori.core import netns

    try:
        nodes = netns.create_pair("bench", 233)
    except netns.NetnsUnavailable as e:
        raise SystemExit(f"mori bench io --netns on: {e}") from None
    try:
        janitor = subprocess.Popen(
            [sys.executable, "-c", _JANITOR, *(n.name for n in nodes)], stdin=subprocess.PIPE
        )
    except BaseException:
        netns.remove(nodes)
        raise
    return [n.spec() for n in nodes], janitor


def enter_namespace(spec: str) -> None:
    """Enter the network namespace of ``spec`` ("ns,dev,ip", :func:`mori.core.netns.enter`) and
    point UCX and the engines at its veth end."""
    from mori.core import netns

    node = netns.Node.from_spec(spec)
    netns.enter(node)
    os.environ.update(
        {
            "MORI_BENCH_IO_HOST": node.ip,
            "MORI_NODE_ID": f"bench-{node.name}",
            "MORI_UCX_OPTIONS": f"tls=tcp;net_devices={node.dev}",
            "UCX_TLS": "tcp",
            "UCX_NET_DEVICES": node.dev,
        }
    )


def veth_bytes(spec: str) -> int:
    """Bytes sent by this namespace's veth end so far (-1 if unknown)."""
    from mori.core import netns

    return netns.tx_bytes(netns.Node.from_spec(spec))

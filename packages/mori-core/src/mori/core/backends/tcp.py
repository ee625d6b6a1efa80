"""The ``tcp`` network transport: built in, no extra install. It reaches peers on other nodes over
TCP (and peers of this node over a Unix socket, with cross-memory attach where the OS allows),
authenticated by the job's shared secret, every request checked against the target's own
registration table. Its native half is mori-core's transfer engine (``mori.core.transfer``);
features use it through the transport contract (:mod:`mori.core.transport`)."""

from __future__ import annotations

from collections.abc import Sequence

from mori.core import _core, env, topology
from mori.core.backend import Availability, NetworkTransport, Transport
from mori.core.plugins import hookimpl


class TcpTransport(NetworkTransport):
    name = "tcp"
    description = (
        "built-in network transport: TCP between nodes, Unix sockets and cross-memory attach within one"
    )
    priority = 10

    def probe(self) -> Availability:
        return Availability(True, "built in (sockets; authenticated by MORI_AUTH_TOKEN beyond loopback)")

    def ops(self) -> object:
        return _core.tcp_transport_ops()

    def options(self, host: str | None = None) -> str:
        """Listen on ``host`` (default: this node's advertised address when a secret is set, else
        loopback), with the secret from ``MORI_AUTH_TOKEN`` and this node's id."""
        token = env.MORI_AUTH_TOKEN.get() or ""
        if host is None:
            host = topology.advertised_host() if token else "127.0.0.1"
        parts = [f"host={host}", f"node_id={topology.node_id()}"]
        if token:
            parts.append(f"token={token}")
        for value in parts:
            if ";" in value:
                raise ValueError(f"tcp transport option {value.split('=')[0]!r} may not contain ';'")
        return ";".join(parts)


def conformance_factory() -> tuple[object, str]:
    """``(ops, options)`` for :func:`mori.testing.transport_conformance.check` (loopback)."""
    t = TcpTransport()
    return t.ops(), t.options("127.0.0.1")


@hookimpl
def mori_transports() -> Sequence[Transport]:
    return [TcpTransport()]

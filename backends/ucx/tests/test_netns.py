"""The conformance suite across two network namespaces joined by a veth pair (as root), so that
every byte really crosses a network stack: UCX over TCP between 10.231.x.1 and 10.231.x.2."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from typing import Any

import pytest

from mori.core import netns
from mori.testing import transport_conformance


def netns_factory() -> tuple[Any, str]:
    """Enter this rank's namespace (rank from the launcher's process name), then open the
    transport on that namespace's veth end only."""
    rank = int(multiprocessing.current_process().name.removeprefix("rank"))
    node = netns.Node.from_spec(os.environ["MORI_UCX_TEST_NETNS"].split(";")[rank])
    netns.enter(node)
    from mori_backend_ucx import UcxTransport

    return UcxTransport().ops(), f"tls=tcp;net_devices={node.dev}"


@pytest.fixture
def two_namespaces() -> Iterator[list[netns.Node]]:
    try:
        with netns.pair("ucx", 231) as nodes:
            yield nodes
    except netns.NetnsUnavailable as e:
        pytest.skip(str(e))


def test_conformance_across_network_namespaces(two_namespaces: list[netns.Node]) -> None:
    nodes = two_namespaces
    env = {"MORI_UCX_TEST_NETNS": ";".join(n.spec() for n in nodes)}
    results = transport_conformance.check(f"{__name__}:netns_factory", env, timeout=120)
    assert all(r["atomics"] == "ok" and r["errors"] == "ok" for r in results)
    # the suite moves ~18 MiB each way: it went through the veth, not around it
    assert netns.tx_bytes(nodes[0]) > 8 << 20
    assert netns.tx_bytes(nodes[1]) > 8 << 20

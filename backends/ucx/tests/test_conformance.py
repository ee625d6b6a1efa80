"""The contract's conformance suite (mori.testing.transport_conformance) over each way UCX moves
bytes on one host: TCP, shared memory (with CMA for large RMA), and UCX's own default choice; and
over an older system UCX where one is installed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mori.testing import transport_conformance


def factory() -> tuple[Any, str]:
    """(ops capsule, options) for the conformance ranks: the plugin's transport as MORI opens it."""
    from mori_backend_ucx import UcxTransport

    t = UcxTransport()
    return t.ops(), t.options()


FACTORY = f"{__name__}:factory"
#: a UCX installed by the OS (Debian's libucx0 comes with Open MPI): an older UCX, built with verbs
SYSTEM_UCP = Path("/lib/x86_64-linux-gnu/libucp.so.0")


@pytest.mark.parametrize(
    "env",
    [
        pytest.param({"UCX_TLS": "tcp"}, id="tcp"),
        pytest.param({"UCX_TLS": "sm,self"}, id="sm"),
        pytest.param({}, id="default"),
        pytest.param(
            {"MORI_UCX_LIBRARY": "system", "UCX_TLS": "tcp"},
            id="system-ucx-tcp",
            marks=pytest.mark.skipif(not SYSTEM_UCP.exists(), reason=f"no system UCX ({SYSTEM_UCP})"),
        ),
    ],
)
def test_conformance(env: dict[str, str]) -> None:
    results = transport_conformance.check(FACTORY, env, timeout=120)
    assert [r["name"] for r in results] == ["ucx", "ucx"]
    assert results[0]["rma"] == "ok" and results[1]["fence"] == "ok"
    assert all(r["atomics"] == "ok" and r["errors"] == "ok" for r in results)

"""The built-in tcp transport passes the transport contract's conformance tests, and its options
and addresses are checked."""

from __future__ import annotations

import pytest

from mori.core import transport
from mori.core.backends.tcp import TcpTransport
from mori.core.errors import MoriValueError
from mori.testing import transport_conformance


def test_conformance() -> None:
    got = transport_conformance.check("mori.core.backends.tcp:conformance_factory")
    assert [r["name"] for r in got] == ["tcp", "tcp"]
    assert got[0]["rma"] == "ok" and got[1]["fence"] == "ok"
    assert all(r["atomics"] == "ok" and r["errors"] == "ok" for r in got)


def test_capabilities_and_probe() -> None:
    t = TcpTransport()
    assert t.probe().usable and not t.load_store
    tp = transport.open_transport(t.ops(), t.options("127.0.0.1"))
    want = transport.CAP_RMA | transport.CAP_ATOMIC64 | transport.CAP_ATOMIC32 | transport.CAP_ATOMIC_NATIVE
    assert tp.name == "tcp" and tp.caps == want
    assert b"host=127.0.0.1" in tp.address()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ("colour=blue", "unknown key 'colour'"),
        ("port=70000", "port"),
        ("justtext", "is not key=value"),
        ("host=0.0.0.0", "without a shared secret"),
    ],
)
def test_bad_options_are_named(options: str, match: str) -> None:
    with pytest.raises(MoriValueError, match=match):
        transport.open_transport(TcpTransport().ops(), options)


def test_a_bad_address_and_gpu_memory_are_refused() -> None:
    import torch

    from mori.core.errors import MoriBackendError

    tp = transport.open_transport(TcpTransport().ops(), "host=127.0.0.1")
    with pytest.raises(MoriValueError, match="not a tcp transport address"):
        tp.connect(b"nonsense")
    buf = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(MoriBackendError, match="host memory only"):
        tp.register(buf.data_ptr(), 64, transport.MEM_CUDA, 0)
    with pytest.raises(MoriValueError, match="not mapped"):
        tp.register(4096, 4096)

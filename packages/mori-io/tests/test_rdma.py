"""BackendType.RDMA: the original's RDMA test matrix on a network transport of mori-core's contract.

Every test runs over the built-in tcp transport (``MORI_IO_RDMA_TRANSPORT=tcp``), so it needs no
extra install; with mori-backend-ucx installed the same tests run over UCX too.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch

from mori.core.errors import MoriBackendError
from mori.core.transport import find_network_transport
from mori.io import (
    BackendType,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    PollCqMode,
    RdmaBackendConfig,
    StatusCode,
)


def _transports() -> list[str]:
    out = ["tcp"]
    try:
        find_network_transport("ucx")
        out.append("ucx")
    except Exception:  # not installed or not usable here: the tcp runs cover the backend
        pass
    return out


@pytest.fixture(params=_transports())
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("MORI_IO_RDMA_TRANSPORT", request.param)
    return str(request.param)


def _engines(
    notify: bool, n: int = 1 << 20
) -> tuple[IOEngine, IOEngine, torch.Tensor, torch.Tensor, MemoryDesc, MemoryDesc]:
    a = IOEngine("a", IOEngineConfig("127.0.0.1", 0))
    b = IOEngine("b", IOEngineConfig("127.0.0.1", 0))
    # the vLLM MoRIIOConnector's call: positional qp_per_transfer, post_batch_size, num_workers
    cfg = RdmaBackendConfig(2, -1, 4, PollCqMode.POLLING, enable_notification=notify)
    for e in (a, b):
        e.create_backend(BackendType.RDMA, cfg)
    a.register_remote_engine(b.get_engine_desc())
    b.register_remote_engine(a.get_engine_desc())
    x = torch.randint(0, 256, (n,), dtype=torch.uint8)
    y = torch.zeros(n, dtype=torch.uint8)
    return a, b, x, y, a.register_torch_tensor(x), b.register_torch_tensor(y)


@pytest.fixture
def rdma(transport: str) -> Iterator[tuple]:
    made = _engines(True)
    yield made
    made[0].shutdown()
    made[1].shutdown()


@pytest.mark.parametrize(
    ("op", "batch", "size", "session"),
    list(itertools.product(["write", "read"], [1, 64], [8, 8192], [False, True])),
)
def test_matrix(rdma, op: str, batch: int, size: int, session: bool) -> None:
    a, b, x, y, mx, my = rdma
    assert a._route_name(mx, my) == "RdmaBackend"
    if op == "read":
        y.copy_(torch.randint(0, 256, y.shape, dtype=torch.uint8))
    stride = size + 24  # discrete blocks: nothing merges
    offs = [i * stride for i in range(batch)]
    uid = a.allocate_transfer_uid()
    if session:
        sess = a.create_session(mx, my)
        assert sess is not None
        post = sess.batch_write if op == "write" else sess.batch_read
        st = post(offs, offs, [size] * batch, uid)
    else:
        post = a.batch_write if op == "write" else a.batch_read
        st = post([mx], [offs], [my], [offs], [[size] * batch], [uid])[0]
    assert st.WaitFor(30_000) and st.Succeeded(), st.Message()
    for o in offs:
        assert torch.equal(x[o : o + size], y[o : o + size]), f"block at {o}"
    if op == "write":  # the target learns of it, credited to the initiator's key
        inbound = None
        for _ in range(200):
            inbound = b.pop_inbound_transfer_status("a", uid)
            if inbound is not None:
                break
            import time

            time.sleep(0.01)
        assert inbound is not None and inbound.Succeeded()


def test_without_notification_the_target_sees_no_status(transport: str) -> None:
    a, b, x, y, mx, my = _engines(False)
    try:
        st = a.write(mx, 0, my, 0, 4096, 7)
        assert st.WaitFor(30_000) and st.Succeeded(), st.Message()
        assert torch.equal(x[:4096], y[:4096])
        import time

        time.sleep(0.2)
        assert b.pop_inbound_transfer_status("a", 7) is None
    finally:
        a.shutdown()
        b.shutdown()


def test_out_of_range_fails_with_a_status(rdma) -> None:
    a, _b, _x, y, mx, my = rdma
    st = a.write(mx, 0, my, my.size - 4, 8, 1)
    assert st.WaitFor(30_000) and st.Code() == StatusCode.ERR_INVALID_ARGS
    forged = MemoryDesc(**{**my.__dict__, "size": my.size * 2})  # lies about its size
    st = a.write(mx, 0, forged, my.size, 64, 2)
    assert st.WaitFor(30_000) and st.Failed(), "the transport's key bounds the region, not the descriptor"
    assert int(y.count_nonzero()) == 0


def test_an_unknown_transport_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MORI_IO_RDMA_TRANSPORT", "smoke-signals")
    e = IOEngine("x", IOEngineConfig("127.0.0.1", 0))
    try:
        with pytest.raises(MoriBackendError, match="MORI_IO_RDMA_TRANSPORT='smoke-signals'"):
            e.create_backend(BackendType.RDMA)
    finally:
        e.shutdown()

"""Fuzz the control-plane parser (the only code that reads a peer's bytes) and a live engine."""

from __future__ import annotations

import socket
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mori.io import _engine

HEADER = struct.Struct("<IHHIiQQQIIQII")
MAGIC = 0x4F49524D
LIMIT_SEGS = 32768
LIMIT_PAYLOAD = 1 << 31


def _parse(data: bytes) -> dict[str, object] | None:
    try:
        return _engine._parse_message(data)
    except ValueError as e:
        assert str(e), "a rejection must say why"
        return None


@settings(max_examples=600, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_parse_or_raise_value_error(data: bytes) -> None:
    _parse(data)


u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)


@st.composite
def messages(draw: st.DrawFn) -> bytes:
    """Headers that are mostly right with one field pushed anywhere, and bodies of any shape."""
    mtype = draw(st.integers(0, 8))
    nsegs = draw(st.one_of(st.integers(0, 4), u32))
    segs = draw(st.lists(st.tuples(u64, st.one_of(st.integers(0, 64), u64), u64), max_size=4))
    body = b"".join(struct.pack("<QQQ", *s) for s in segs)
    body = draw(st.one_of(st.just(body), st.binary(max_size=96)))
    payload_len = draw(st.one_of(st.integers(0, 256), u64))
    payload = b"\0" * payload_len if payload_len <= 256 else b""
    fields = [
        draw(st.one_of(st.just(MAGIC), u32)),
        draw(st.one_of(st.just(1), st.integers(0, 2**16 - 1))),
        mtype,
        draw(st.one_of(st.integers(0, 7), u32)),
        draw(st.one_of(st.just(0), st.integers(-(2**31), 2**31 - 1))),
        draw(u64),
        draw(u64),
        draw(u64),
        nsegs,
        draw(st.one_of(st.just(len(body)), u32)),
        payload_len,
        draw(st.one_of(st.just(1), u32)),
        draw(st.one_of(st.just(0), u32)),
    ]
    return HEADER.pack(*fields) + body + payload


@settings(max_examples=1500, deadline=None)
@given(messages())
def test_structured_messages_respect_the_limits(data: bytes) -> None:
    out = _parse(data)
    if out is None:
        return
    (magic, version, mtype, flags, status, _, _, _, nsegs, body_len, payload_len, parts, reserved) = (
        HEADER.unpack(data[:64])
    )
    # whatever parses is within every limit the engine relies on
    assert magic == MAGIC and version == 1 and reserved == 0 and flags & ~7 == 0
    assert not flags & 4 or mtype in (1, 2)  # kFlagDirect: HELLO and its answer only
    assert len(data) == 64 + body_len + payload_len and payload_len <= LIMIT_PAYLOAD
    if mtype in (3, 4):
        segs = out["segments"]
        assert isinstance(segs, list) and len(segs) == nsegs <= LIMIT_SEGS and body_len == 24 * nsegs
        assert 1 <= parts <= 1 << 24 and status == 0
        total = sum(n for _, n, _ in segs)
        assert total <= LIMIT_PAYLOAD
        if mtype == 3 and not flags & 1:
            assert total == payload_len
        else:
            assert payload_len == 0
    elif mtype == 7:  # kNotify: one-way records of the direct path, 16 bytes each
        assert nsegs == 0 and payload_len == 0 and status == 0 and body_len <= 4096 and body_len % 16 == 0
        assert len(out["records"]) == body_len // 16
    else:
        assert mtype in (1, 2, 5, 6) and nsegs == 0 and body_len <= 4096


def test_parser_accepts_what_the_engine_sends() -> None:
    body = struct.pack("<QQQ", 16, 8, 0)
    msg = HEADER.pack(MAGIC, 1, 3, 2, 0, 7, 9, 1, 1, 24, 8, 1, 0) + body + b"x" * 8
    out = _engine._parse_message(msg)
    assert out["segments"] == [(16, 8, 0)] and out["uid"] == 9 and out["payload_len"] == 8
    hello = b"".join(struct.pack("<I", len(s)) + s for s in (b"k", b"", b"node"))
    out = _engine._parse_message(HEADER.pack(MAGIC, 1, 1, 0, 0, 0, 0, 0, 0, len(hello), 0, 0, 0) + hello)
    assert out["strings"] == [b"k", b"", b"node"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=st.lists(messages(), min_size=1, max_size=3))
def test_live_engine_survives_fuzzed_connections(pair_for_fuzz, junk: list[bytes]) -> None:
    a, b, src_desc, dst_desc, dst = pair_for_fuzz
    before = dst.clone()
    port = b.get_engine_desc().port
    # a proper HELLO first, so the fuzzed messages reach the request parser
    hello_body = b"".join(struct.pack("<I", len(s)) + s for s in (b"fuzzer", b"", b"elsewhere"))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(HEADER.pack(MAGIC, 1, 1, 0, 0, 0, 0, 0, 0, len(hello_body), 0, 0, 0) + hello_body)
        ack = HEADER.unpack(s.recv(64, socket.MSG_WAITALL))
        s.recv(ack[9], socket.MSG_WAITALL)
        for m in junk:
            try:
                s.sendall(m)
            except OSError:
                break
    # the only bytes a fuzzer may change are inside the registered region (it was registered to be
    # written), and the engine still serves real peers
    st_ = a.write(src_desc, 0, dst_desc, 0, 64, 1)
    assert st_.WaitFor(30_000) and st_.Succeeded(), st_.Message()
    assert dst.numel() == before.numel()


@pytest.fixture(scope="module")
def pair_for_fuzz():
    from mori.io import BackendType, IOEngine, IOEngineConfig

    a = IOEngine("fa", IOEngineConfig("127.0.0.1", 0))
    b = IOEngine("fb", IOEngineConfig("127.0.0.1", 0))
    for e in (a, b):
        e.create_backend(BackendType.TCP)
    a.register_remote_engine(b.get_engine_desc())
    src = torch.ones(4096, dtype=torch.uint8)
    dst = torch.zeros(4096, dtype=torch.uint8)
    yield a, b, a.register_torch_tensor(src), b.register_torch_tensor(dst), dst
    a.shutdown()
    b.shutdown()

"""Fuzz the control-plane parser (the only code that reads a peer's bytes) and a live engine."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mori.core import test_hooks
from mori.io import MemoryLocationType

HEADER = struct.Struct("<IHHIiQQQIIQII")
MAGIC = 0x4F49524D
VERSION = 2
LIMIT_SEGS = 32768
LIMIT_PAYLOAD = 1 << 31


def _parse(data: bytes) -> dict[str, object] | None:
    try:
        out = test_hooks.parse_message(data)
    except ValueError as e:
        assert str(e), "a rejection must say why"
        return None
    _within_limits(data, out)
    return out


def _within_limits(data: bytes, out: dict[str, object]) -> None:
    """Whatever parses is within every limit the engine relies on."""
    (
        magic,
        version,
        mtype,
        flags,
        status,
        req_id,
        uid,
        mem_id,
        nsegs,
        body_len,
        payload_len,
        parts,
        reserved,
    ) = HEADER.unpack(data[:64])
    assert magic == MAGIC and version == VERSION and reserved == 0 and flags & ~15 == 0
    assert not flags & 4 or mtype in (1, 2)  # kFlagDirect: HELLO and its answer only
    assert not flags & 8 or mtype == 8  # kFlagAuth: CHALLENGE only
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
        assert mtype in (1, 2, 5, 6, 8, 9) and nsegs == 0 and body_len <= 4096
        if mtype in (1, 8, 9):  # handshake messages carry no request fields
            assert (
                status == 0 and req_id == 0 and uid == 0 and mem_id == 0 and parts == 0 and payload_len == 0
            )


@settings(max_examples=600, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_parse_or_raise_value_error(data: bytes) -> None:
    _parse(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=160))
def test_random_bodies_behind_a_valid_header_parse_or_raise(body: bytes) -> None:
    """Random bytes rarely get past the magic; here every message type has a valid header and a
    random body, so the body parsers (segments, strings, records) see the garbage."""
    for mtype in range(1, 10):
        _parse(HEADER.pack(MAGIC, VERSION, mtype, 0, 0, 0, 0, 0, len(body) // 24, len(body), 0, 1, 0) + body)


u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)


@st.composite
def messages(draw: st.DrawFn, mem_ids: tuple[int, ...] = ()) -> bytes:
    """Headers that are mostly right with one field pushed anywhere, and bodies of any shape;
    ``mem_ids``: region ids the requests may name (so some reach a real region)."""
    mtype = draw(st.integers(0, 10))
    nsegs = draw(st.one_of(st.integers(0, 4), u32))
    segs = draw(st.lists(st.tuples(u64, st.one_of(st.integers(0, 64), u64), u64), max_size=4))
    body = b"".join(struct.pack("<QQQ", *s) for s in segs)
    body = draw(st.one_of(st.just(body), st.binary(max_size=96)))
    payload_len = draw(st.one_of(st.integers(0, 256), u64))
    payload = b"\0" * payload_len if payload_len <= 256 else b""
    mem_id = draw(st.one_of(st.sampled_from(mem_ids), u64) if mem_ids else u64)
    fields = [
        draw(st.one_of(st.just(MAGIC), u32)),
        draw(st.one_of(st.just(VERSION), st.integers(0, 2**16 - 1))),
        mtype,
        draw(st.one_of(st.integers(0, 15), u32)),
        draw(st.one_of(st.just(0), st.integers(-(2**31), 2**31 - 1))),
        draw(u64),
        draw(u64),
        mem_id,
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
    _parse(data)


def test_parser_accepts_what_the_engine_sends() -> None:
    body = struct.pack("<QQQ", 16, 8, 0)
    msg = HEADER.pack(MAGIC, VERSION, 3, 2, 0, 7, 9, 1, 1, 24, 8, 1, 0) + body + b"x" * 8
    out = test_hooks.parse_message(msg)
    assert out["segments"] == [(16, 8, 0)] and out["uid"] == 9 and out["payload_len"] == 8
    hello = b"".join(struct.pack("<I", len(s)) + s for s in (b"k", b"node", b"n" * 32, b"i" * 16))
    out = test_hooks.parse_message(
        HEADER.pack(MAGIC, VERSION, 1, 0, 0, 0, 0, 0, 0, len(hello), 0, 0, 0) + hello
    )
    assert out["strings"] == [b"k", b"node", b"n" * 32, b"i" * 16]
    # the old handshake's pid and nonce address in a HELLO are refused, not read
    with pytest.raises(ValueError, match="handshake message with request fields"):
        test_hooks.parse_message(
            HEADER.pack(MAGIC, VERSION, 1, 0, 0, 0, 4096, 1234, 0, len(hello), 0, 0, 0) + hello
        )


CANARY = 0xA5
# One fuzzing "engine" across examples: each example reconnects as the same instance, which the
# engine accepts while the previous example's connection is still being torn down (a new instance
# under the same key would be refused as a second engine taking a connected key; test_trust).
FUZZ_INSTANCE = b"fuzzing-engine-1"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_live_engine_survives_fuzzed_connections(pair_for_fuzz, peer, data: st.DataObject) -> None:
    """Fuzzed messages after a real handshake reach the request parser; some name the real region.
    Bytes may change only inside the registered region (it is registered to be written), never in
    the canaries around it, and the engine serves real peers afterwards."""
    a, b, src_desc, dst_desc, whole, lo, hi = pair_for_fuzz
    junk = data.draw(st.lists(messages(mem_ids=(dst_desc.id,)), min_size=1, max_size=3))
    with peer.RawPeer(port=b.get_engine_desc().port) as s:
        s.handshake("fuzzer", "fb", instance=FUZZ_INSTANCE)
        for m in junk:
            try:
                s.send(m)
            except OSError:
                break
    st_ = a.write(src_desc, 0, dst_desc, 0, 64, 1)
    assert st_.WaitFor(30_000) and st_.Succeeded(), st_.Message()
    assert int((whole[:lo] != CANARY).sum()) == 0 and int((whole[hi:] != CANARY).sum()) == 0, (
        "a canary changed"
    )


@pytest.fixture(scope="module")
def pair_for_fuzz():
    from mori.io import BackendType, IOEngine, IOEngineConfig

    a = IOEngine("fa", IOEngineConfig("127.0.0.1", 0))
    b = IOEngine("fb", IOEngineConfig("127.0.0.1", 0))
    for e in (a, b):
        e.create_backend(BackendType.TCP)
    a.register_remote_engine(b.get_engine_desc())
    src = torch.ones(4096, dtype=torch.uint8)
    whole = torch.full((3 * 4096,), CANARY, dtype=torch.uint8)  # canary page | region | canary page
    lo, hi = 4096, 2 * 4096
    dst_desc = b.register_memory(whole.data_ptr() + lo, hi - lo, -1, MemoryLocationType.CPU)
    yield a, b, a.register_torch_tensor(src), dst_desc, whole, lo, hi
    a.shutdown()
    b.shutdown()

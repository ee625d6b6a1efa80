"""Attacks a caller or a peer can make on the initiator side, each refused by name, and the
endpoint still works after them. (What UCX enforces on the target: README, "What the target
enforces".)"""

from __future__ import annotations

import ctypes
import struct
from typing import Any

import pytest

from mori.core import transport as T
from mori.core.errors import MoriBackendError, MoriValueError

from .conftest import SIZE, Pair


def _still_works(p: Pair) -> None:
    ctypes.memset(p.a.addr, 0x5A, 64)
    p.ep.put(p.a.addr, p.a.mem, p.b.mem.addr + 128, p.rk, 64).wait(10_000)
    p.ep.flush().wait(10_000)
    assert bytes(p.b.buf[128:192]) == b"\x5a" * 64


@pytest.mark.parametrize(
    ("op", "offset", "n"),
    [
        ("put", SIZE - 8, 64),  # runs off the end
        ("get", -4096, 16),  # below the start
        ("put", SIZE, 1),  # one past the end
        ("get", 0, SIZE + 1),  # longer than the registration
        ("put", 2**63, 2**63),  # wraps around
    ],
)
def test_outside_the_peers_registration_is_refused(pair: Pair, op: str, offset: int, n: int) -> None:
    raddr = (pair.b.mem.addr + offset) % 2**64
    call = pair.ep.put if op == "put" else pair.ep.get
    with pytest.raises(MoriBackendError) as e:
        call(pair.a.addr, None, raddr, pair.rk, n)
    msg = str(e.value)
    assert "outside the peer's registered memory" in msg and "code -5" in msg
    assert f"{pair.b.mem.addr:#x}" in msg  # the range is named
    _still_works(pair)


def test_atomic_outside_or_misaligned_is_refused(pair: Pair) -> None:
    with pytest.raises(MoriBackendError, match="outside the peer's registered memory"):
        pair.ep.atomic(T.OP_ADD, T.WORD_UINT64, 1, 0, pair.b.mem.addr + SIZE - 4, pair.rk)
    with pytest.raises(MoriValueError, match="not aligned"):
        pair.ep.atomic(T.OP_ADD, T.WORD_UINT64, 1, 0, pair.b.mem.addr + 4, pair.rk)
    with pytest.raises(MoriValueError, match="does not fit a 32-bit word"):
        pair.ep.atomic(T.OP_ADD, T.WORD_UINT32, 1 << 32, 0, pair.b.mem.addr, pair.rk)
    with pytest.raises(MoriValueError, match="op 9"):
        pair.ep.atomic(9, T.WORD_UINT64, 1, 0, pair.b.mem.addr, pair.rk)
    _still_works(pair)


def test_local_buffer_outside_its_registration_is_refused(pair: Pair) -> None:
    with pytest.raises(MoriValueError, match="not inside local_memory"):
        pair.ep.put(pair.a.addr + SIZE - 8, pair.a.mem, pair.b.mem.addr, pair.rk, 64)
    _still_works(pair)


def test_a_key_from_another_instance_is_refused(pair: Pair, ops: Any) -> None:
    """A key packed by instance C, handed to the endpoint to B: UCX's software RMA would write at
    that address in B's memory; the key names its instance, so it is refused before any byte moves."""
    c = T.open_transport(ops, "tls=sm,self")
    buf = (ctypes.c_uint8 * 4096)()
    cmem = c.register(ctypes.addressof(buf), 4096)
    with pytest.raises(MoriBackendError) as e:
        pair.ep.unpack_rkey(cmem.rkey)
    assert "packed by transport instance" in str(e.value) and "code -5" in str(e.value)
    _still_works(pair)


def _corrupt(key: bytes, at: int, value: bytes) -> bytes:
    return key[:at] + value + key[at + len(value) :]


@pytest.mark.parametrize(
    "mangle",
    [
        pytest.param(lambda k: k[:3], id="truncated-header"),
        pytest.param(lambda k: k[:-1], id="truncated-ucx-key"),
        pytest.param(lambda k: k + b"\0", id="trailing-byte"),
        pytest.param(lambda k: _corrupt(k, 0, b"XXXXXXXX"), id="bad-magic"),
        pytest.param(lambda k: _corrupt(k, 8, struct.pack("<I", 2)), id="other-version"),
        pytest.param(lambda k: _corrupt(k, 12, struct.pack("<I", 1 << 30)), id="huge-length"),
        pytest.param(lambda k: _corrupt(k, 32, struct.pack("<Q", 0)), id="empty-range"),
        pytest.param(lambda k: _corrupt(k, 24, struct.pack("<QQ", 2**64 - 8, 16)), id="wrapping-range"),
        pytest.param(lambda k: _corrupt(k, 40, struct.pack("<I", 7)), id="bad-memory-type"),
    ],
)
def test_malformed_key_is_refused(pair: Pair, mangle: Any) -> None:
    with pytest.raises((MoriValueError, MoriBackendError)) as e:
        pair.ep.unpack_rkey(mangle(pair.b.mem.rkey))
    assert "unpack_rkey" in str(e.value)
    _still_works(pair)


@pytest.mark.parametrize(
    "mangle",
    [
        pytest.param(lambda a: b"", id="empty"),
        pytest.param(lambda a: a[:20], id="truncated-header"),
        pytest.param(lambda a: a[:-1], id="truncated-ucx-address"),
        pytest.param(lambda a: _corrupt(a, 0, b"NOTMORI!"), id="bad-magic"),
        pytest.param(lambda a: _corrupt(a, 12, struct.pack("<I", 0)), id="zero-length"),
    ],
)
def test_malformed_address_is_refused(pair: Pair, mangle: Any) -> None:
    with pytest.raises(MoriValueError):
        pair.a.tp.connect(mangle(pair.b.tp.address()))
    _still_works(pair)


def test_key_is_bound_to_its_endpoint(pair: Pair, ops: Any) -> None:
    """A remote key unpacked on one endpoint cannot be used on another (it names its peer's memory)."""
    c = T.open_transport(ops, pair.options)
    ep_c = pair.a.tp.connect(c.address())
    with pytest.raises(MoriValueError, match="unpacked on another endpoint"):
        ep_c.put(pair.a.addr, None, pair.b.mem.addr, pair.rk, 8)
    _still_works(pair)

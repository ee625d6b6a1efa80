"""A peer that dies mid-operation gives an error within a bounded time, never a hang."""

from __future__ import annotations

import ctypes
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from mori.testing import run_ranks
from mori.testing.file_rendezvous import get, put

#: how long the survivor may take to notice (TCP: the socket resets at once; shared memory: our
#: same-host liveness check runs every 100 ms); the rest is slack for a loaded 2-core machine
BOUND_S = 10.0


def _rank(rank: int, nranks: int, rdv: str, options: str, with_atomics: bool) -> dict[str, Any]:
    """Rank 0 keeps posting; rank 1's peer is a child process that dies without a goodbye (the
    rank itself stays alive to report to the launcher)."""
    if rank == 1:
        child = os.fork()
        if child:
            os.waitpid(child, 0)
            return {}
    return _side(rank, rdv, options, with_atomics)


def _side(rank: int, rdv: str, options: str, with_atomics: bool) -> dict[str, Any]:
    import struct

    from mori_backend_ucx import UcxTransport

    from mori.core import transport as T
    from mori.core.errors import MoriBackendError, MoriTimeoutError

    d = Path(rdv)
    tp = T.open_transport(UcxTransport().ops(), options)
    size = 4 << 20
    buf = (ctypes.c_uint8 * size)()
    addr = ctypes.addressof(buf)
    mem = tp.register(addr, size)
    put(d, f"addr{rank}", tp.address())
    put(d, f"key{rank}", mem.rkey + struct.pack("<Q", addr))
    peer = 1 - rank
    ep = tp.connect(get(d, f"addr{peer}"))
    key = get(d, f"key{peer}")
    rk, (base,) = ep.unpack_rkey(key[:-8]), struct.unpack("<Q", key[-8:])
    ep.flush().wait(10_000)
    put(d, f"ready{rank}", b"1")
    get(d, f"ready{peer}")
    if rank == 1:
        time.sleep(0.3)  # let rank 0 get going, then die without any goodbye
        os._exit(0)
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 60:
            ep.put(addr, mem, base, rk, 1 << 20)
            if with_atomics:
                ep.atomic(T.OP_ADD, T.WORD_UINT64, 1, 0, base + 64, rk).wait(30_000)
            ep.flush().wait(30_000)
    except MoriTimeoutError as e:
        return {"error": "timeout", "after": time.monotonic() - t0, "message": str(e)}
    except MoriBackendError as e:
        # the endpoint stays failed: the next operation says so at once
        try:
            ep.put(addr, mem, base, rk, 8)
            again = "no error"
        except MoriBackendError as e2:
            again = str(e2)
        return {"error": "backend", "after": time.monotonic() - t0, "message": str(e), "again": again}
    return {"error": None}


@pytest.mark.parametrize(
    ("options", "with_atomics"),
    [
        pytest.param("tls=tcp", False, id="tcp"),
        pytest.param("tls=sm,self", True, id="sm"),
        pytest.param("tls=tcp;error_handling=peer", False, id="tcp-peer-mode"),
    ],
)
def test_dead_peer_fails_in_bounded_time(options: str, with_atomics: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="mori-ucx-death-") as rdv:
        out = run_ranks(_rank, 2, rdv, options, with_atomics, timeout=90)[0]
    assert out["error"] == "backend", out  # an error naming the peer, not a timeout
    assert out["after"] < BOUND_S, out
    assert "code -2" in out["message"]  # MORI_TP_EUNREACH
    assert "peer" in out["message"]
    assert "code -2" in out["again"], out


def _atomics_in_peer_mode(rank: int, nranks: int, rdv: str) -> str:
    from mori_backend_ucx import UcxTransport

    from mori.core import transport as T
    from mori.core.errors import MoriBackendError

    d = Path(rdv)
    tp = T.open_transport(UcxTransport().ops(), "tls=tcp;error_handling=peer")
    buf = (ctypes.c_uint64 * 8)()
    mem = tp.register(ctypes.addressof(buf), 64)
    put(d, f"a{rank}", tp.address())
    put(d, f"k{rank}", mem.rkey)
    put(d, f"b{rank}", ctypes.addressof(buf).to_bytes(8, "little"))
    ep = tp.connect(get(d, f"a{1 - rank}"))
    rk = ep.unpack_rkey(get(d, f"k{1 - rank}"))
    base = int.from_bytes(get(d, f"b{1 - rank}"), "little")
    try:
        ep.atomic(T.OP_ADD, T.WORD_UINT64, 1, 0, base, rk).wait(10_000)
        result = "no error"
    except MoriBackendError as e:
        result = str(e)
    put(d, f"done{rank}", b"1")
    get(d, f"done{1 - rank}")
    return result


def test_peer_error_mode_has_no_software_atomics() -> None:
    """UCX's software-emulated atomics do not support its peer-failure mode: an atomic over TCP
    then fails with an error (at once), it does not hang. README: "Error handling"."""
    with tempfile.TemporaryDirectory(prefix="mori-ucx-peermode-") as rdv:
        results = run_ranks(_atomics_in_peer_mode, 2, rdv, timeout=60)
    for r in results:
        assert r != "no error" and "atomic add" in r, r

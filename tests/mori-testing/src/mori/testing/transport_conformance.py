"""The tests every implementation of the transport contract (``mori/transport.h``) must pass.

A transport's own test file calls :func:`check` with a *factory*: the dotted name of a function
(importable in a fresh process) that returns ``(ops capsule, options)``. Two processes each open an
instance, register a buffer, exchange addresses and keys through files, and check, byte by byte:
put and get of sizes from 1 byte to 8 MiB at odd offsets, many requests in flight, fence ordering
(put then flag: a reader that sees the flag sees the data), flush, every atomic on 32- and 64-bit
words (each rank adding distinct values: exact totals), compare-and-swap, and the errors a caller
can cause (out-of-range remote addresses, a malformed key). A peer that goes away is each
transport's own test (how fast it can tell depends on the transport).

``env`` (e.g. ``{"UCX_TLS": "tcp"}``) is set in both processes.
"""

from __future__ import annotations

import importlib
import os
import struct
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from mori.testing import run_ranks
from mori.testing.file_rendezvous import get, put

SIZE = 16 << 20
FLAG_OFF = SIZE - 4096  # the flag/atomic words live in the last page
ROUNDS = 200


def _factory(name: str) -> tuple[Any, str]:
    module, _, attr = name.partition(":")
    ops, options = getattr(importlib.import_module(module), attr)()
    return ops, options


def _rank(rank: int, nranks: int, factory: str, rdv: str, env: dict[str, str]) -> dict[str, Any]:
    import torch

    from mori.core import transport as T
    from mori.core.errors import MoriBackendError, MoriValueError

    os.environ.update(env)
    d = Path(rdv)
    ops, options = _factory(factory)
    tp = T.open_transport(ops, options)
    buf = torch.zeros(SIZE, dtype=torch.uint8)
    mem = tp.register(buf.data_ptr(), SIZE)
    put(d, f"addr{rank}", tp.address())
    put(d, f"rkey{rank}", mem.rkey)
    put(d, f"base{rank}", struct.pack("<Q", buf.data_ptr()))
    peer = 1 - rank
    ep = tp.connect(get(d, f"addr{peer}"))
    rk = ep.unpack_rkey(get(d, f"rkey{peer}"))
    (base,) = struct.unpack("<Q", get(d, f"base{peer}"))
    out: dict[str, Any] = {"name": tp.name, "caps": tp.caps}
    gen = torch.Generator().manual_seed(100 + rank)

    def barrier(tag: str) -> None:
        put(d, f"{tag}{rank}", b"1")
        get(d, f"{tag}{peer}", timeout=120)

    # 1. put / get, sizes 1 B to 8 MiB at odd offsets, byte-exact
    if rank == 0:
        at = 3
        for n in (1, 7, 64, 4095, 4096, 65537, 1 << 20, 8 << 20):
            src = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
            buf[at : at + n] = src
            ep.put(buf.data_ptr() + at, mem, base + at + 1, rk, n).wait(30_000)
            ep.flush().wait(30_000)
            buf[at : at + n] = 0
            ep.get(buf.data_ptr() + at, mem, base + at + 1, rk, n).wait(30_000)
            assert torch.equal(buf[at : at + n], src), f"put+get of {n} bytes came back different"
        out["rma"] = "ok"
    barrier("rma")

    # 2. many requests in flight, then flush: every one landed
    if rank == 1:
        n, count = 512, 256
        pattern = torch.randint(0, 256, (n * count,), dtype=torch.uint8, generator=gen)
        buf[: n * count] = pattern
        reqs = [ep.put(buf.data_ptr() + i * n, mem, base + 1_000_000 + i * n, rk, n) for i in range(count)]
        ep.flush().wait(30_000)
        for r in reqs:
            assert r.test()
        put(d, "inflight", bytes(pattern.numpy()))
    barrier("inflight")
    if rank == 0:
        want = get(d, "inflight")
        assert bytes(buf[1_000_000 : 1_000_000 + len(want)].numpy()) == want, "a put in flight did not land"

    # 3. fence: data, fence, flag; the target spins on the flag, then checks the data
    flag = FLAG_OFF
    if rank == 0:
        for i in range(1, ROUNDS + 1):
            buf[:4096] = i % 251
            ep.put(buf.data_ptr(), mem, base + 2_000_000, rk, 4096)
            ep.fence()
            buf[8192:8200] = torch.tensor(list(struct.pack("<Q", i)), dtype=torch.uint8)
            ep.put(buf.data_ptr() + 8192, mem, base + flag, rk, 8)
            ep.flush().wait(30_000)
            get(d, f"ack{i}", timeout=60)
    else:
        for i in range(1, ROUNDS + 1):
            deadline = time.monotonic() + 60
            while struct.unpack_from("<Q", bytes(buf[flag : flag + 8].numpy()))[0] != i:
                assert time.monotonic() < deadline, f"flag {i} never arrived"
            got = buf[2_000_000 : 2_000_000 + 4096]
            assert bool((got == i % 251).all()), f"round {i}: the flag arrived before the data"
            put(d, f"ack{i}", b"1")
        out["fence"] = "ok"
    barrier("fence")

    # 4. atomics on the peer's words: both ranks add distinct values to the same words
    a64, a32, cas = FLAG_OFF + 64, FLAG_OFF + 128, FLAG_OFF + 192
    if tp.caps & T.CAP_ATOMIC64:
        for i in range(ROUNDS):
            r = ep.atomic(T.OP_ADD, T.WORD_UINT64, (rank + 1) * 1000 + i, 0, base + a64, rk)
            r.wait(30_000)
        # a fetch returns the word as it is: at least what this rank added (the peer adds too)
        r = ep.atomic(T.OP_FETCH, T.WORD_UINT64, 0, 0, base + a64, rk)
        r.wait(30_000)
        assert r.old >= (rank + 1) * 1000 * ROUNDS + sum(range(ROUNDS)), r.old
    if tp.caps & T.CAP_ATOMIC32:
        for _ in range(ROUNDS):
            ep.atomic(T.OP_ADD, T.WORD_UINT32, rank + 1, 0, base + a32, rk).wait(30_000)
        r = ep.atomic(T.OP_SWAP, T.WORD_UINT32, 7 + rank, 0, base + a32 + 8, rk)
        r.wait(30_000)
    ep.flush().wait(30_000)  # a completed request is only local completion: the adds landed by now
    barrier("atomics")
    if tp.caps & T.CAP_ATOMIC64:
        # the peer added (peer+1)*1000*ROUNDS + sum(range(ROUNDS)) to my word
        mine = struct.unpack_from("<Q", bytes(buf[a64 : a64 + 8].numpy()))[0]
        assert mine == (peer + 1) * 1000 * ROUNDS + sum(range(ROUNDS)), mine
    if tp.caps & T.CAP_ATOMIC32:
        mine32 = struct.unpack_from("<I", bytes(buf[a32 : a32 + 4].numpy()))[0]
        assert mine32 == (peer + 1) * ROUNDS, mine32
        assert struct.unpack_from("<I", bytes(buf[a32 + 8 : a32 + 12].numpy()))[0] == 7 + peer
    # compare-and-swap: swaps when the word holds the expected value, and never otherwise
    if tp.caps & T.CAP_ATOMIC64:
        r = ep.atomic(T.OP_CSWAP, T.WORD_UINT64, 5, 0, base + cas, rk)
        r.wait(30_000)
        assert r.old == 0
        r = ep.atomic(T.OP_CSWAP, T.WORD_UINT64, 9, 0, base + cas, rk)  # expects 0, finds 5: no swap
        r.wait(30_000)
        assert r.old == 5
        barrier("cas")
        assert struct.unpack_from("<Q", bytes(buf[cas : cas + 8].numpy()))[0] == 5
    out["atomics"] = "ok"

    # 5. errors a caller can cause, each named, and the endpoint still works after them
    errors = []
    calls: tuple[tuple[str, Callable[[], Any]], ...] = (
        ("beyond the peer's memory", lambda: ep.put(buf.data_ptr(), mem, base + SIZE - 8, rk, 64)),
        ("below the peer's memory", lambda: ep.get(buf.data_ptr(), mem, base - 4096, rk, 16)),
    )
    for what, call in calls:
        try:
            call().wait(30_000)
            errors.append(f"{what}: no error")
        except (MoriBackendError, MoriValueError) as e:
            assert str(e), what
    try:
        ep.unpack_rkey(b"\x00" * 3)
        errors.append("a malformed key was accepted")
    except (MoriBackendError, MoriValueError):
        pass
    assert not errors, errors
    ep.put(buf.data_ptr(), mem, base + 4096, rk, 8).wait(30_000)
    # The put's completion is local: without the flush it can still be on the wire when the peer
    # passes the barrier and frees its buffer, and a transport that writes on the target's side
    # (UCX over TCP) then writes into freed memory (a segfault in ucp_put_handler, seen in CI).
    ep.flush().wait(30_000)
    barrier("errors")
    out["errors"] = "ok"
    return out


def check(factory: str, env: Mapping[str, str] | None = None, timeout: float = 240.0) -> list[dict[str, Any]]:
    """Run the conformance checks on two processes with the transport ``factory`` makes
    (``"module:function"`` returning ``(ops capsule, options)``); returns what each rank saw."""
    with tempfile.TemporaryDirectory(prefix="mori-tp-") as rdv:
        return run_ranks(_rank, 2, factory, rdv, dict(env or {}), timeout=timeout)

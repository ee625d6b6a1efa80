"""Thread safety: two threads posting on one endpoint at once (puts to disjoint ranges and atomics
on one shared word), while the progress thread runs; every byte lands, the atomic total is exact."""

from __future__ import annotations

import ctypes
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest

from mori.testing import run_ranks
from mori.testing.file_rendezvous import get, put

ROUNDS = 300
CHUNK = 4096


def _rank(rank: int, nranks: int, rdv: str, options: str) -> Any:
    from mori_backend_ucx import UcxTransport

    from mori.core import transport as T

    d = Path(rdv)
    tp = T.open_transport(UcxTransport().ops(), options)
    size = 2 * ROUNDS * CHUNK + 4096
    buf = (ctypes.c_uint8 * size)()
    addr = ctypes.addressof(buf)
    mem = tp.register(addr, size)
    put(d, f"addr{rank}", tp.address())
    put(d, f"key{rank}", mem.rkey)
    put(d, f"base{rank}", addr.to_bytes(8, "little"))
    if rank == 1:  # the target: waits, then checks what arrived
        get(d, "done", timeout=120)
        data = bytes(buf[: 2 * ROUNDS * CHUNK])
        counter = int.from_bytes(bytes(buf[size - 8 : size]), "little")
        return data, counter
    ep = tp.connect(get(d, "addr1"))
    rk = ep.unpack_rkey(get(d, "key1"))
    base = int.from_bytes(get(d, "base1"), "little")
    for i in range(2 * ROUNDS):  # each chunk holds its own index pattern
        ctypes.memset(addr + i * CHUNK, i % 251, CHUNK)
    errors: list[BaseException] = []
    olds: list[list[int]] = [[], []]

    def worker(t: int) -> None:
        try:
            for i in range(ROUNDS):
                c = 2 * i + t
                r = ep.put(addr + c * CHUNK, mem, base + c * CHUNK, rk, CHUNK)
                a = ep.atomic(T.OP_ADD, T.WORD_UINT64, 1, 0, base + size - 8, rk)
                a.wait(30_000)
                olds[t].append(a.old)
                if i % 16 == 0:
                    ep.flush().wait(30_000)
                r.wait(30_000)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    ep.flush().wait(30_000)
    put(d, "done", b"1")
    return olds


@pytest.mark.parametrize("options", ["tls=tcp", "tls=sm,self"], ids=["tcp", "sm"])
def test_two_threads_on_one_endpoint(options: str) -> None:
    with tempfile.TemporaryDirectory(prefix="mori-ucx-threads-") as rdv:
        olds, (data, counter) = run_ranks(_rank, 2, rdv, options, timeout=120)
    want = b"".join(bytes([i % 251]) * CHUNK for i in range(2 * ROUNDS))
    assert data == want, "a chunk put by one of the two threads did not land intact"
    assert counter == 2 * ROUNDS
    # every fetch-add saw a distinct old value: the two threads' atomics did not merge
    assert sorted(olds[0] + olds[1]) == list(range(2 * ROUNDS))

"""GPU memory over UCX (CUDA): two processes sharing one GPU register device buffers and move
bytes with put and get, where the loaded UCX supports CUDA memory. Run on a GPU machine:

    python -m pytest -m cuda backends/ucx/tests/test_gpu.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest

from mori.testing import run_ranks
from mori.testing.file_rendezvous import get, put

N = 8 << 20


def _rank(rank: int, nranks: int, rdv: str) -> Any:
    import torch
    from mori_backend_ucx import UcxTransport

    from mori.core import transport as T

    torch.cuda.set_device(0)
    d = Path(rdv)
    tp = T.open_transport(UcxTransport().ops(), "")
    if not tp.caps & T.CAP_CUDA_MEMORY:
        return "no CUDA memory support in this UCX"
    buf = torch.zeros(N, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    mem = tp.register(buf.data_ptr(), N, T.MEM_CUDA, 0)
    put(d, f"addr{rank}", tp.address())
    put(d, f"key{rank}", mem.rkey)
    put(d, f"base{rank}", buf.data_ptr().to_bytes(8, "little"))
    ep = tp.connect(get(d, f"addr{1 - rank}"))
    rk = ep.unpack_rkey(get(d, f"key{1 - rank}"))
    base = int.from_bytes(get(d, f"base{1 - rank}"), "little")
    gen = torch.Generator(device="cuda").manual_seed(7)
    want = torch.randint(0, 256, (N // 2,), dtype=torch.uint8, device="cuda", generator=gen)
    if rank == 0:
        buf[: N // 2] = want
        torch.cuda.synchronize()
        ep.put(buf.data_ptr(), mem, base + N // 2, rk, N // 2).wait(60_000)  # into the peer's upper half
        ep.flush().wait(60_000)
        put(d, "put", b"1")
        get(d, "checked")
        ep.get(buf.data_ptr() + N // 2, mem, base + N // 2, rk, N // 2).wait(60_000)  # and back
        torch.cuda.synchronize()
        ok = torch.equal(buf[N // 2 :], want)
    else:
        get(d, "put")
        torch.cuda.synchronize()
        ok = torch.equal(buf[N // 2 :], want)
        put(d, "checked", b"1")
    put(d, f"done{rank}", b"1")
    get(d, f"done{1 - rank}")
    return "ok" if ok else "bytes differ"


@pytest.mark.cuda  # NVIDIA only: ucx's CUDA memory support (MEM_CUDA, CAP_CUDA_MEMORY)
def test_cuda_memory_put_get() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    with tempfile.TemporaryDirectory(prefix="mori-ucx-gpu-") as rdv:
        results = run_ranks(_rank, 2, rdv, timeout=180)
    if results[0].startswith("no CUDA"):
        pytest.skip(results[0])
    assert results == ["ok", "ok"]

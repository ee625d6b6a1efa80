"""Host one-sided API across processes: put/get, signals, atomics, waits, fence/quiet."""

from __future__ import annotations

import time
from typing import Any

import pytest

import mori.shmem as shmem
from mori.core.errors import MoriTimeoutError, MoriValueError
from mori.testing import shmem_ranks

SIZES = [0, 1, 7, 8, 4095, 65536 + 3, 1 << 20]


def _put_get(rank: int, nranks: int, sizes: list[int]) -> None:
    import torch

    biggest = max(sizes)
    src = shmem.shmem_malloc(biggest + 1)
    dst = shmem.shmem_malloc(biggest + 1)
    got = shmem.shmem_malloc(biggest + 1)
    gen = torch.Generator().manual_seed(rank)
    pattern = torch.randint(0, 256, (biggest + 1,), dtype=torch.uint8, generator=gen)
    shmem.shmem_tensor_view(src, biggest + 1, torch.uint8).copy_(pattern)
    right, left = (rank + 1) % nranks, (rank - 1) % nranks
    left_pattern = torch.randint(
        0, 256, (biggest + 1,), dtype=torch.uint8, generator=torch.Generator().manual_seed(left)
    )
    dst_view = shmem.shmem_tensor_view(dst, biggest + 1, torch.uint8)
    got_view = shmem.shmem_tensor_view(got, biggest + 1, torch.uint8)
    for n in sizes:
        dst_view.fill_(0)
        got_view.fill_(0)
        shmem.shmem_barrier_all()
        shmem.shmem_putmem(dst, src, n, right)  # push my bytes to the right
        shmem.shmem_quiet()
        shmem.shmem_barrier_all()
        assert torch.equal(dst_view[:n], left_pattern[:n]), f"put of {n} B from PE {left}"
        assert int(dst_view[n]) == 0, "put wrote past its end"
        shmem.shmem_getmem(got, src, n, left)  # pull the left neighbour's bytes
        assert torch.equal(got_view[:n], left_pattern[:n]), f"get of {n} B from PE {left}"
        assert int(got_view[n]) == 0, "get wrote past its end"
    shmem.shmem_barrier_all()  # every PE is done reading my src
    # put to self with overlapping ranges behaves like memmove
    base = shmem.shmem_tensor_view(src, 16, torch.uint8)
    before = base.clone()
    shmem.shmem_putmem(src + 4, src, 8, rank)
    assert torch.equal(base[4:12], before[:8])
    shmem.shmem_barrier_all()


@pytest.mark.parametrize("nranks", [2, 4])
def test_put_get_exact_bytes(nranks: int) -> None:
    shmem_ranks(_put_get, nranks, SIZES)


def test_put_get_64_mib() -> None:
    shmem_ranks(_put_get, 2, [64 << 20], heap="208M")


def _registered_source(rank: int, nranks: int) -> None:
    import torch

    local = torch.arange(256, dtype=torch.uint8)
    dst = shmem.shmem_malloc(256)
    peer = 1 - rank
    with pytest.raises(MoriValueError, match="shmem_buffer_register"):
        shmem.shmem_putmem(dst, local.data_ptr(), 256, peer)
    shmem.shmem_buffer_register(local.data_ptr(), 256)
    shmem.shmem_putmem(dst, local.data_ptr(), 256, peer)
    shmem.shmem_barrier_all()
    assert torch.equal(shmem.shmem_tensor_view(dst, 256, torch.uint8), local)
    back = torch.zeros(256, dtype=torch.uint8)
    shmem.shmem_buffer_register(back.data_ptr(), 256)
    shmem.shmem_getmem(back.data_ptr(), dst, 256, peer)
    assert torch.equal(back, local)
    shmem.shmem_buffer_deregister(local.data_ptr(), 256)
    shmem.shmem_buffer_deregister(back.data_ptr(), 256)
    shmem.shmem_barrier_all()


def test_registered_buffers_as_local_side() -> None:
    shmem_ranks(_registered_source, 2)


def _put_signal_ring(rank: int, nranks: int, rounds: int) -> None:
    import torch

    n = 4096
    src = shmem.shmem_malloc(n)
    dst = shmem.shmem_malloc(n)
    sig = shmem.shmem_malloc(8)
    counter = shmem.shmem_malloc(8)
    right, left = (rank + 1) % nranks, (rank - 1) % nranks
    src_view = shmem.shmem_tensor_view(src, n // 8, torch.int64)
    dst_view = shmem.shmem_tensor_view(dst, n // 8, torch.int64)
    shmem.shmem_barrier_all()
    for r in range(1, rounds + 1):
        src_view.fill_(rank * 1000 + r)
        shmem.shmem_putmem_signal(dst, src, n, sig, r, shmem.SIGNAL_SET, right)
        assert shmem.shmem_wait_until(sig, shmem.SHMEM_CMP_GE, r, dtype="uint64") == r
        # the data arrived before the signal did
        assert bool((dst_view == left * 1000 + r).all()), f"round {r}"
        shmem.shmem_barrier_all()
    # SIGNAL_ADD from every PE into PE 0's counter
    shmem.shmem_putmem_signal(dst, src, 8, counter, rank + 1, shmem.SIGNAL_ADD, 0)
    shmem.shmem_signal_op(counter, 100, shmem.SIGNAL_ADD, 0)
    shmem.shmem_barrier_all()
    if rank == 0:
        assert shmem.shmem_signal_fetch(counter) == sum(range(1, nranks + 1)) + 100 * nranks
    with pytest.raises(MoriValueError, match="sig_op=3"):
        shmem.shmem_putmem_signal(dst, src, 8, sig, 1, 3, right)
    with pytest.raises(MoriValueError, match="sig_op=0"):
        shmem.shmem_signal_op(sig, 1, 0, right)
    shmem.shmem_barrier_all()


@pytest.mark.parametrize("nranks", [2, 4])
def test_put_with_signal_ring(nranks: int) -> None:
    shmem_ranks(_put_signal_ring, nranks, 30)


def _atomics(rank: int, nranks: int, dtype: str, iters: int) -> None:
    word = shmem.shmem_malloc(8)
    flag = shmem.shmem_malloc(8)
    shmem.shmem_atomic_set(word, 0, rank, dtype=dtype)
    shmem.shmem_barrier_all()
    # contended fetch-add from every PE on PE 0's word: the total is exact and the fetched values unique
    fetched = [shmem.shmem_atomic_fetch_add(word, 1, 0, dtype=dtype) for _ in range(iters)]
    shmem.shmem_atomic_add(word, 2, 0, dtype=dtype)
    shmem.shmem_barrier_all()
    assert shmem.shmem_atomic_fetch(word, 0, dtype=dtype) == nranks * (iters + 2)
    assert fetched == sorted(fetched) and len(set(fetched)) == iters
    shmem.shmem_barrier_all()
    # swap and compare-swap on the right neighbour's word
    right = (rank + 1) % nranks
    shmem.shmem_atomic_set(word, 5, rank, dtype=dtype)
    shmem.shmem_barrier_all()
    assert shmem.shmem_atomic_swap(word, 9, right, dtype=dtype) == 5
    shmem.shmem_barrier_all()
    assert shmem.shmem_atomic_compare_swap(word, 1, 2, right, dtype=dtype) == 9  # no swap
    assert shmem.shmem_atomic_compare_swap(word, 9, 3, right, dtype=dtype) == 9  # swap
    shmem.shmem_barrier_all()
    assert shmem.shmem_atomic_fetch(word, rank, dtype=dtype) == 3
    # a lock built from compare-swap: exactly one PE wins each round
    shmem.shmem_atomic_set(flag, 0, rank, dtype=dtype)
    shmem.shmem_barrier_all()
    won = shmem.shmem_atomic_compare_swap(flag, 0, rank + 1, 0, dtype=dtype) == 0
    shmem.shmem_barrier_all()
    winner = shmem.shmem_atomic_fetch(flag, 0, dtype=dtype)
    assert won == (winner == rank + 1)
    shmem.shmem_barrier_all()


@pytest.mark.parametrize("dtype", ["int32", "uint32", "int64", "uint64"])
def test_atomics_exact_under_contention(dtype: str) -> None:
    shmem_ranks(_atomics, 4, dtype, 300)


def _atomic_edges(rank: int, nranks: int) -> None:
    import torch

    word = shmem.shmem_malloc(8)
    # unsigned wrap-around and signed negatives
    shmem.shmem_atomic_set(word, 2**32 - 1, rank, dtype="uint32")
    assert shmem.shmem_atomic_fetch_add(word, 1, rank, dtype=torch.uint32) == 2**32 - 1
    assert shmem.shmem_atomic_fetch(word, rank, dtype="uint32") == 0
    shmem.shmem_atomic_set(word, -5, rank, dtype="int64")
    assert shmem.shmem_atomic_fetch(word, rank, dtype=torch.int64) == -5
    with pytest.raises(MoriValueError, match="does not fit"):
        shmem.shmem_atomic_set(word, 2**32, rank, dtype="uint32")
    with pytest.raises(MoriValueError, match="value -1 does not fit"):  # was pybind's RuntimeError
        shmem.shmem_atomic_compare_swap(word, -1, 0, rank, dtype="uint64")
    with pytest.raises(MoriValueError, match="dtype='float32'"):
        shmem.shmem_atomic_add(word, 1, rank, dtype="float32")
    with pytest.raises(MoriValueError, match="not aligned"):
        shmem.shmem_atomic_add(word + 2, 1, rank, dtype="int32")
    with pytest.raises(MoriValueError, match="pe=7"):
        shmem.shmem_atomic_add(word, 1, 7)
    with pytest.raises(MoriValueError, match="not inside the symmetric heap"):
        shmem.shmem_atomic_add(64, 1, rank)
    with pytest.raises(MoriValueError, match=r"value=1\.5"):
        shmem.shmem_atomic_add(word, 1.5, rank)  # type: ignore[arg-type]
    shmem.shmem_barrier_all()


def test_atomic_edge_cases_and_errors() -> None:
    shmem_ranks(_atomic_edges, 2)


def _waits(rank: int, nranks: int) -> dict[str, Any]:
    word = shmem.shmem_malloc(8)
    shmem.shmem_atomic_set(word, 10, rank)
    shmem.shmem_barrier_all()
    out: dict[str, Any] = {}
    for cmp, value in [
        (shmem.SHMEM_CMP_EQ, 10),
        (shmem.SHMEM_CMP_NE, 3),
        (shmem.SHMEM_CMP_GT, 9),
        (shmem.SHMEM_CMP_GE, 10),
        (shmem.SHMEM_CMP_LT, 11),
        (shmem.SHMEM_CMP_LE, 10),
    ]:
        assert shmem.shmem_wait_until(word, cmp, value, timeout=1) == 10
    t0 = time.monotonic()
    with pytest.raises(MoriTimeoutError, match=r"is 10, still not > 10 after 0.3 s"):
        shmem.shmem_wait_until(word, shmem.SHMEM_CMP_GT, 10, timeout=0.3)
    out["timeout_s"] = time.monotonic() - t0
    with pytest.raises(MoriValueError, match="cmp=9"):
        shmem.shmem_wait_until(word, 9, 1)
    shmem.shmem_barrier_all()
    # a wait satisfied by a peer 200 ms later, from another process
    if rank == 0:
        t0 = time.monotonic()
        shmem.shmem_wait_until(word, shmem.SHMEM_CMP_EQ, 77, timeout=30)
        out["woke_after_s"] = time.monotonic() - t0
    else:
        time.sleep(0.2)
        shmem.shmem_atomic_set(word, 77, 0)
    shmem.shmem_fence()
    shmem.shmem_barrier_all()
    return out


def test_wait_until_comparisons_timeout_and_wakeup() -> None:
    r0, _ = shmem_ranks(_waits, 2)
    assert 0.25 <= r0["timeout_s"] < 2.0
    assert 0.15 <= r0["woke_after_s"] < 5.0


def _put_errors(rank: int, nranks: int) -> None:
    buf = shmem.shmem_malloc(1024)
    peer = (rank + 1) % nranks
    with pytest.raises(MoriValueError, match="nbytes=-1"):
        shmem.shmem_putmem(buf, buf, -1, peer)
    with pytest.raises(MoriValueError, match="pe=-1"):
        shmem.shmem_putmem(buf, buf, 8, -1)
    with pytest.raises(MoriValueError, match="pe=True"):
        shmem.shmem_putmem(buf, buf, 8, True)  # type: ignore[arg-type]
    info = shmem.shmem_heap_info()
    end = info["base"] + info["size"]
    with pytest.raises(MoriValueError, match=r"dest=.*not inside the symmetric heap"):
        shmem.shmem_putmem(end - 4, buf, 8, peer)  # would run past the end of the peer's heap
    with pytest.raises(MoriValueError, match=r"source=.*neither symmetric heap memory nor"):
        shmem.shmem_putmem(buf, 4096, 8, peer)
    with pytest.raises(MoriValueError, match=r"source=.*not inside the symmetric heap"):
        shmem.shmem_getmem(buf, info["base"], 8, peer)  # the reserved region is not user memory
    shmem.shmem_barrier_all()


@pytest.mark.parametrize("nranks", [2, 4])
def test_put_get_errors_name_the_argument(nranks: int) -> None:
    shmem_ranks(_put_errors, nranks)


def _barrier_on_stream(rank: int, nranks: int, rounds: int) -> None:
    word = shmem.shmem_malloc(8)
    for r in range(1, rounds + 1):
        shmem.shmem_atomic_set(word, r, (rank + 1) % nranks)
        assert shmem.shmem_barrier_on_stream() == 0  # on the cpu runtime: the host barrier
        assert shmem.shmem_atomic_fetch(word, rank) == r
        shmem.shmem_barrier_on_stream(None)


def test_barrier_on_stream_orders_puts_on_the_cpu_runtime() -> None:
    shmem_ranks(_barrier_on_stream, 4, 10)


def _set_races_add(rank: int, nranks: int, adds: int) -> int:
    # PE 1 owns one uint64 word. PE 0 adds 1 to it `adds` times; meanwhile PE 1 swaps it back to 0
    # with SIGNAL_SET's host operation and sums the old values it gets. If SET is one atomic
    # exchange, every increment is handed to exactly one SET, so the sum is `adds`; a load followed
    # by a store loses each increment that lands between the two (it is overwritten unseen).
    from mori.core.backend import OP_SET, WORD_UINT64
    from mori.shmem.context import current

    word = shmem.shmem_malloc(8)
    done = shmem.shmem_malloc(8)
    shmem.shmem_barrier_all()
    if rank == 0:
        for _ in range(adds):
            shmem.shmem_signal_op(word, 1, shmem.SIGNAL_ADD, 1)
        shmem.shmem_signal_op(done, 1, shmem.SIGNAL_SET, 1)
        shmem.shmem_barrier_all()
        return 0
    runtime = current("test").runtime
    seen = 0
    while not shmem.shmem_signal_fetch(done):
        for _ in range(64):
            seen += runtime.atomic_rmw(word, OP_SET, WORD_UINT64, 0)
    seen += runtime.atomic_rmw(word, OP_SET, WORD_UINT64, 0)  # what came after the last swap
    shmem.shmem_barrier_all()
    return seen


def test_signal_set_is_one_atomic_exchange_under_concurrent_adds() -> None:
    adds = 200_000
    assert shmem_ranks(_set_races_add, 2, adds)[1] == adds

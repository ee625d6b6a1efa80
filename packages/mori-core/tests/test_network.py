"""SHMEM across nodes: PEs of different emulated nodes (MORI_NODE_ID) reach each other through a
network transport of the transport contract. Every host call between two nodes, byte-exact, on
2 nodes x 2 ranks (ranks of one node still use loads and stores)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import mori.shmem as shmem
from mori.testing import shmem_ranks


def _on_node(rank: int, nranks: int) -> None:
    os.environ["MORI_NODE_ID"] = f"node{rank // 2}"


def _host_api(rank: int, nranks: int) -> dict[str, Any]:
    from mori.shmem.context import current

    ctx = current("test")
    far = [p for p in range(nranks) if p // 2 != rank // 2]
    near = [p for p in range(nranks) if p // 2 == rank // 2 and p != rank]
    assert all(ctx.bases[p] == 0 for p in far) and all(ctx.bases[p] for p in near)
    assert ctx.network is not None and sorted(ctx.network.peers) == far
    out: dict[str, Any] = {"transport": ctx.network.tp.name}

    n = 1 << 20
    buf = shmem.shmem_malloc(n)
    sig = shmem.shmem_malloc(8 * nranks)
    words = shmem.shmem_malloc(8 * 4)
    mine = shmem.shmem_tensor_view(buf, (n,), torch.uint8)
    mine.zero_()
    shmem.shmem_tensor_view(sig, (nranks,), torch.int64).zero_()
    shmem.shmem_tensor_view(words, (4,), torch.int64).zero_()
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(rank))
    shmem.shmem_buffer_register(src.data_ptr(), n)
    shmem.shmem_barrier_all()

    # put + signal to the next PE of the other node, 4 KiB slice per sender; the target waits
    peer = far[0]
    off = rank * 4096
    shmem.shmem_putmem_signal(
        buf + off, src.data_ptr() + off, 4096, sig + 8 * rank, 7, shmem.SIGNAL_SET, peer
    )
    shmem.shmem_barrier_all()
    first_far = {p: min(q for q in range(nranks) if q // 2 != p // 2) for p in range(nranks)}
    senders = [p for p in range(nranks) if first_far[p] == rank]
    for s in senders:
        shmem.shmem_wait_until(sig + 8 * s, shmem.SHMEM_CMP_EQ, 7, dtype="int64")
        want = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(s))
        assert torch.equal(mine[s * 4096 : (s + 1) * 4096], want[s * 4096 : (s + 1) * 4096]), f"put from {s}"
    out["put_signal"] = len(senders)

    # get back what this PE put on the far peer
    back = torch.zeros(4096, dtype=torch.uint8)
    shmem.shmem_buffer_register(back.data_ptr(), 4096)
    shmem.shmem_getmem(back.data_ptr(), buf + off, 4096, peer)
    assert torch.equal(back, src[off : off + 4096])
    shmem.shmem_barrier_all()

    # atomics: every PE adds to word 0 of PE 0 (near and far), distinct values; fetch-add, swap, cas
    shmem.shmem_atomic_add(words, 1000 + rank, 0)
    shmem.shmem_atomic_add(words + 8, -(rank + 1), 0)  # negative: two's complement on the wire
    shmem.shmem_barrier_all()
    if rank == 0:
        w = shmem.shmem_tensor_view(words, (4,), torch.int64)
        assert int(w[0]) == sum(1000 + r for r in range(nranks)), w
        assert int(w[1]) == -sum(r + 1 for r in range(nranks)), w
    shmem.shmem_barrier_all()
    got = shmem.shmem_atomic_fetch(words, 0)
    assert got == sum(1000 + r for r in range(nranks))
    if rank == 3:  # PE 3 is on the other node than PE 0
        assert shmem.shmem_atomic_compare_swap(words + 16, 0, 42, 0) == 0
        assert shmem.shmem_atomic_compare_swap(words + 16, 0, 99, 0) == 42  # no swap: finds 42
        assert shmem.shmem_atomic_swap(words + 24, 5, 0) == 0
        assert shmem.shmem_atomic_fetch_add(words + 24, 2, 0) == 5
        assert shmem.shmem_atomic_fetch(words + 24, 0, dtype="int64") == 7
        shmem.shmem_atomic_set(words + 24, -3, 0)
        assert shmem.shmem_atomic_fetch(words + 24, 0) == -3
        shmem.shmem_atomic_set(words + 28, 2**31 - 1, 0, dtype="int32")  # the upper half of word 3
        assert shmem.shmem_atomic_fetch(words + 28, 0, dtype="int32") == 2**31 - 1
    shmem.shmem_barrier_all()
    if rank == 0:
        w = shmem.shmem_tensor_view(words, (8,), torch.int32)
        assert int(w[4]) == 42 and int(w[7]) == 2**31 - 1
    # a far PE is not load/store reachable: shmem_ptr_p2p is 0 for it, non-zero for a near one
    assert shmem.shmem_ptr_p2p(buf, rank, peer) == 0
    if near:
        assert shmem.shmem_ptr_p2p(buf, rank, near[0]) != 0
    shmem.shmem_barrier_all()
    shmem.shmem_buffer_deregister(back.data_ptr(), 4096)
    shmem.shmem_buffer_deregister(src.data_ptr(), n)
    return out


def _network_transports() -> list[str]:
    from mori.core.transport import find_network_transport

    out = ["tcp"]
    try:  # mori-backend-ucx, when installed and usable here
        find_network_transport("ucx")
        out.append("ucx")
    except Exception:
        pass
    return out


@pytest.mark.parametrize("transport", _network_transports())
def test_host_api_across_two_nodes(transport: str) -> None:
    got = shmem_ranks(_host_api, 4, env={"MORI_SHMEM_TRANSPORT": transport}, before_init=_on_node)
    assert all(r["transport"] == transport for r in got)
    assert sum(r["put_signal"] for r in got) == 4  # each PE received one put from the other node


def test_a_transport_nobody_has_is_named() -> None:
    from mori.testing import RankError

    with pytest.raises(RankError, match=r"MORI_SHMEM_TRANSPORT=.carrier-pigeon. is not allowed"):
        shmem_ranks(_nothing, 2, env={"MORI_SHMEM_TRANSPORT": "carrier-pigeon"}, before_init=_node_per_rank)


def _nothing(rank: int, nranks: int) -> None:
    pass


def _node_per_rank(rank: int, nranks: int) -> None:
    os.environ["MORI_NODE_ID"] = f"node{rank}"

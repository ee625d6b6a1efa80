"""mori.cco.Communicator on the cpu runtime: unique ids, init, heaps and windows across ranks,
external shared memory, device communicators, copy-engine queues from the host, several
communicators at once, emulated nodes, and the errors (bad arguments, absent ranks).

Rank functions are module level (the launcher imports them in the ranks) and check in the rank
itself, so a failure carries that rank's traceback. One launch runs many checks: spawning ranks
dominates the run time on a small machine.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import threading
import time
from multiprocessing import shared_memory
from typing import Any

import pytest
import torch

from mori.cco import (
    GDA_CONNECTION_CROSSNODE,
    GDA_CONNECTION_FULL,
    CCODevCommRequirements,
    Communicator,
    ImportedWindow,
    UniqueId,
)
from mori.core.errors import (
    MoriBackendError,
    MoriOutOfMemoryError,
    MoriStateError,
    MoriTimeoutError,
    MoriTypeError,
    MoriValueError,
)
from mori.testing import run_ranks

ENV = {"MORI_DEVICE_RUNTIME": "cpu", "MORI_BOOTSTRAP_TIMEOUT": "30"}
HEAP = 8 << 20


def _ranks(fn: Any, n: int, *args: Any, uids: int = 1, env: dict[str, str] | None = None) -> list[Any]:
    ids = [Communicator.get_unique_id() for _ in range(uids)]
    return run_ranks(fn, n, *ids, *args, env={**ENV, **(env or {})}, timeout=90)


# -- one process -----------------------------------------------------------------------------------


def test_unique_id_is_128_picklable_bytes_and_checked() -> None:
    uid = Communicator.get_unique_id()
    raw = bytes(uid)
    assert len(raw) == 128 and len(uid) == 128
    assert pickle.loads(pickle.dumps(uid)) == uid
    assert UniqueId.from_bytes(bytearray(raw)) == uid and hash(UniqueId.from_bytes(raw)) == hash(uid)
    assert Communicator.get_unique_id() != uid
    with pytest.raises(MoriValueError, match="data='<127 bytes>'"):
        UniqueId.from_bytes(raw[:127])
    with pytest.raises(MoriValueError, match=r"made by Communicator.get_unique_id"):
        UniqueId.from_bytes(b"x" * 128)
    with pytest.raises(MoriTypeError, match="data has type str"):
        UniqueId.from_bytes("x" * 128)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 0), "nranks=0"),
        ((True, 0), "nranks=True"),
        ((2000, 0), "nranks=2000"),
        ((2, 2), r"rank=2 is not allowed; expected an int in \[0, 2\)"),
        ((2, -1), "rank=-1"),
        ((2, 0, "uid"), "uid has type str"),
        ((2, 0, b"short"), "data='<5 bytes>'"),
        ((2, 0, None, 4096), "per_rank_vmm=4096"),
        ((2, 0, None, 1.5e9), "per_rank_vmm=1500000000.0"),
    ],
)
def test_init_rejects_bad_arguments_before_any_rendezvous(args: tuple[Any, ...], match: str) -> None:
    nranks, rank, *rest = args
    uid = rest[0] if rest and rest[0] is not None else Communicator.get_unique_id()
    kw = {"per_rank_vmm": rest[1]} if len(rest) > 1 else {}
    with pytest.raises((MoriValueError, MoriTypeError), match=match):
        Communicator.init(nranks, rank, uid, **kw)


def test_communicator_cannot_be_made_directly() -> None:
    with pytest.raises(MoriStateError, match=r"Communicator.init"):
        Communicator(object(), None, 0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"),
    [("lsa_barrier_count", -1), ("barrier_count", 5000), ("sdma_queue_count", 9), ("gda_connection_type", 4)],
)
def test_dev_comm_requirements_name_the_bad_field(field: str, value: int) -> None:
    with pytest.raises(MoriValueError, match=f"CCODevCommRequirements: {field}={value}"):
        CCODevCommRequirements(**{field: value}).validated()


# -- basics on 3 ranks --------------------------------------------------------------------------------


def _basics(rank: int, n: int, uid: UniqueId) -> None:
    with Communicator.init(n, rank, uid, per_rank_vmm=HEAP) as c:
        assert (c.rank, c.nranks, c.lsa_size, c.lsa_rank, c.lsa_ranks) == (rank, n, n, rank, tuple(range(n)))
        assert c.per_rank_size == HEAP and c.ptr != 0 and c.device == "cpu" and c.runtime_name == "cpu"
        assert c.node_ids() == [c.node_ids()[0]] * n

        # local memory: alignment, bounds, errors
        m = c.alloc_mem(1000, alignment=4096)
        assert m.ptr % 4096 == 0 and m.size == 1000
        with pytest.raises(MoriValueError, match="size=0"):
            c.alloc_mem(0)
        with pytest.raises(MoriValueError, match="alignment=3"):
            c.alloc_mem(8, alignment=3)
        with pytest.raises(MoriOutOfMemoryError, match="raise per_rank_vmm"):
            c.alloc_mem(HEAP)

        # a window: every rank sees every rank's bytes, and stores into a peer land there
        mine = c.tensor(m.ptr, 1000)
        mine.copy_((torch.arange(1000) * 3 + rank).to(torch.uint8))
        w = c.register_window(m.ptr, 1000)
        assert w.local_ptr == m.ptr and w.size == 1000 and w.table.tolist() == list(w.peer_ptrs)
        assert w.handle == w.table.data_ptr() and w.peer_ptrs[rank] == m.ptr
        c.barrier()
        for p in range(n):
            assert torch.equal(w.view(p), (torch.arange(1000) * 3 + p).to(torch.uint8)), p
        c.barrier()  # everybody has read before anybody stores
        right = (rank + 1) % n
        w.view(right, torch.int32, offset=400, numel=1)[0] = 1000 + rank
        c.barrier()
        assert int(w.view(None, torch.int32, offset=400, numel=1)[0]) == 1000 + (rank - 1) % n
        with pytest.raises(MoriValueError, match="lsa_rank=3"):
            w.peer_ptr(3)
        with pytest.raises(MoriValueError, match="numel=1000"):
            w.view(0, torch.int32, numel=1000)

        # what cannot be a window on the cpu runtime, or freed while it is one
        private = torch.zeros(16)
        with pytest.raises(MoriValueError, match="not in this communicator's heap"):
            c.register_window(private.data_ptr(), 64)
        with pytest.raises(MoriValueError, match="not inside one block from alloc_mem"):
            c.register_window(m.ptr, 5000)
        with pytest.raises(MoriStateError, match="deregister_window it first"):
            c.free_mem(m)
        c.deregister_window(w)
        with pytest.raises(MoriValueError, match="was deregistered"):
            w.view(0)
        c.free_mem(m)
        with pytest.raises(MoriValueError, match="not freed yet"):
            c.free_mem(m)

        # device communicator fields, host LSA barriers counted the same on every rank
        dc = c.create_dev_comm(CCODevCommRequirements(lsa_barrier_count=2, barrier_count=1))
        assert (dc.rank, dc.world_size, dc.lsa_size, dc.lsa_rank) == (rank, n, n, rank)
        assert dc.flat_base == 0 and dc.per_rank_size == HEAP and dc.ptr == dc.tensor.data_ptr()
        assert dc.sdma_queue_count == 2 and dc.tensor[:4].tolist() == [rank, n, n, rank]
        for _ in range(25):
            dc.lsa_barrier_sync(1)
        assert dc.lsa_barrier_epoch(1) == 25 and dc.lsa_barrier_epoch(0) == 0
        dc.lsa_barrier_arrive(0)
        dc.lsa_barrier_wait(0, members=((rank + 1) % n,))  # one peer only
        with pytest.raises(MoriValueError, match=r"members=\[5\] is not allowed"):
            dc.lsa_barrier_wait(0, members=(5,))
        dc.lsa_barrier_wait(0)
        with pytest.raises(
            MoriValueError, match=r"index=2 is not allowed; expected an LSA barrier in \[0, 2\)"
        ):
            dc.lsa_barrier_arrive(2)
        with pytest.raises(MoriBackendError, match="issue 14"):
            c.create_dev_comm(CCODevCommRequirements(gda_connection_type=GDA_CONNECTION_FULL))
        with pytest.raises(MoriValueError, match="fixed 2 queues"):
            c.create_dev_comm(CCODevCommRequirements(sdma_queue_count=3))
        # one node: cross-node GDA needs no connection, so it is accepted
        c.create_dev_comm(
            CCODevCommRequirements(gda_connection_type=GDA_CONNECTION_CROSSNODE, lsa_barrier_count=1)
        )

        # copy-engine queue from the host: put to the right neighbour, get from it
        src_m, dst_m = c.alloc_mem(4096), c.alloc_mem(4096)
        c.tensor(src_m.ptr, 4096).copy_(((torch.arange(4096) + 7 * rank) % 251).to(torch.uint8))
        c.tensor(dst_m.ptr, 4096).zero_()
        src, dst = c.register_window(src_m.ptr, 4096), c.register_window(dst_m.ptr, 4096)
        q = dc.sdma_queue(1)
        for i in range(10):  # ten puts of 400 bytes each, one signal each
            q.put(right, dst, 400 * i, src, 400 * i, 400)
        q.quiet()
        left = (rank - 1) % n
        assert q.wait_signal(left, 10, timeout=20) == 10 and q.signal(left) == 10
        expect = ((torch.arange(4000) + 7 * left) % 251).to(torch.uint8)
        assert torch.equal(dst.view()[:4000], expect)
        c.barrier()
        q.get(right, dst, 0, src, 0, 4096)
        q.quiet()
        assert torch.equal(dst.view(), ((torch.arange(4096) + 7 * right) % 251).to(torch.uint8))
        with pytest.raises(MoriValueError, match="peer=3"):
            q.put(3, dst, 0, src, 0, 4)
        with pytest.raises(MoriValueError, match="offset=4000"):
            q.put(right, dst, 4000, src, 0, 200)
        with pytest.raises(MoriTimeoutError, match=f"rank {left} .*delivered 10 puts"):
            q.wait_signal(left, 11, timeout=0.2)
        with pytest.raises(MoriValueError, match=r"index=2 .* queue in \[0, 2\)"):
            dc.sdma_queue(2)

        assert c.allgather_bytes(bytes([rank])) == [bytes([p]) for p in range(n)]
        with pytest.raises(MoriValueError, match="at most 65536 bytes"):
            c.allgather_bytes(b"x" * 70000)
        c.barrier()
    assert c.closed
    with pytest.raises(MoriStateError, match="was destroyed"):
        c.alloc_mem(8)
    with pytest.raises(MoriStateError, match="was destroyed"):
        q.put(right, dst, 0, src, 0, 4)
    c.destroy()  # again: nothing


def test_windows_barriers_dev_comm_and_queues_on_3_ranks() -> None:
    _ranks(_basics, 3)


# -- collective checks ---------------------------------------------------------------------------------


def _mismatch(rank: int, n: int, uid: UniqueId) -> None:
    with Communicator.init(n, rank, uid, per_rank_vmm=HEAP) as c:
        m = c.alloc_mem(8192)
        with pytest.raises(
            MoriStateError, match=r"register_window is collective.*rank 1: call #1 .* size 8192"
        ):
            c.register_window(m.ptr, 4096 if rank == 0 else 8192)
        # the communicator stays usable: every rank counted the failed call
        w = c.register_window(m.ptr, 4096)
        c.barrier()
        assert len(w.peer_ptrs) == n


def test_register_window_with_different_sizes_fails_on_every_rank() -> None:
    _ranks(_mismatch, 2)


# -- several communicators, threads -------------------------------------------------------------------


def _many(rank: int, n: int, uid_a: UniqueId, uid_b: UniqueId, uid_c: UniqueId) -> None:
    a = Communicator.init(n, rank, uid_a, per_rank_vmm=HEAP)
    b = Communicator.init(n, rank, uid_b, per_rank_vmm=HEAP)
    assert a.name != b.name and a.ptr != b.ptr
    assert Communicator.by_name(a.name) is a
    errors: list[BaseException] = []

    def work(comm: Communicator, tag: int) -> None:
        try:
            m = comm.alloc_mem(256)
            w = comm.register_window(m.ptr, 256)
            for i in range(30):
                w.view(None, torch.int64, numel=1)[0] = tag * 1000 + i * n + rank
                comm.barrier()
                got = [int(w.view(p, torch.int64, numel=1)[0]) for p in range(n)]
                assert got == [tag * 1000 + i * n + p for p in range(n)], (tag, i, got)
                comm.barrier()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(comm, t)) for t, comm in ((1, a), (2, b))]
    for t in threads:
        t.start()
    # a third one made and destroyed while the two others are busy in their threads
    with Communicator.init(n, rank, uid_c, per_rank_vmm=HEAP) as c:
        c.barrier()
    for t in threads:
        t.join()
    assert not errors, errors
    b.destroy()
    a.barrier()
    a.destroy()
    with pytest.raises(MoriValueError, match="name of a live communicator"):
        Communicator.by_name(a.name)


def test_three_communicators_at_once_two_of_them_in_threads() -> None:
    _ranks(_many, 2, uids=3)


# -- external shared memory -----------------------------------------------------------------------------


def _external(rank: int, n: int, uid: UniqueId) -> None:
    with Communicator.init(n, rank, uid, per_rank_vmm=HEAP) as c:
        shm = shared_memory.SharedMemory(create=True, size=3 * 4096)
        anchor = ctypes.c_char.from_buffer(shm.buf)
        try:
            base = ctypes.addressof(anchor)
            view = torch.frombuffer(shm.buf, dtype=torch.int32)
            view.copy_(torch.arange(view.numel(), dtype=torch.int32) + 100000 * rank)
            # a range that starts inside the segment (file offset 4096 + 8)
            w = c.register_external_window(base + 4104, 4096)
            assert isinstance(w, ImportedWindow) and w.source == f"shm:/dev/shm/{shm.name}"
            c.barrier()
            for p in range(n):
                expect = torch.arange(1026, 1026 + 1024, dtype=torch.int32) + 100000 * p
                assert torch.equal(w.view(p, torch.int32), expect), p
            c.barrier()  # everybody has read before anybody stores
            # a store into a peer's import lands in the peer's own segment
            w.view((rank + 1) % n, torch.int32, numel=1)[0] = -1 - rank
            c.barrier()
            assert int(view[1026]) == -1 - (rank - 1) % n
            c.deregister_window(w)

            private = torch.zeros(1024)
            with pytest.raises(MoriValueError, match=r"not a POSIX shared-memory file|private mapping"):
                c.register_external_window(private.data_ptr(), 1024)
            with pytest.raises(MoriValueError, match="ends before the range does"):
                c.register_external_window(base, 4 * 4096)
            gone = shared_memory.SharedMemory(create=True, size=4096)
            gone_anchor = ctypes.c_char.from_buffer(gone.buf)
            gone.unlink()
            with pytest.raises(MoriValueError, match="already unlinked"):
                c.register_external_window(ctypes.addressof(gone_anchor), 4096)
            del gone_anchor
            gone.close()
            c.barrier()
        finally:
            del anchor
            shm.close()
            shm.unlink()


def test_external_shared_memory_is_imported_zero_copy() -> None:
    _ranks(_external, 2)


# -- absent ranks -----------------------------------------------------------------------------------------


def _absent_at_init(rank: int, n: int, uid: UniqueId) -> str:
    if rank == 2:
        return "absent"
    with pytest.raises(MoriTimeoutError, match=r"ranks 2 of 3 did not arrive within 2 s") as info:
        Communicator.init(n, rank, uid, per_rank_vmm=HEAP)
    assert info.value.missing == [2]
    return "timed out"


def test_a_rank_that_never_joins_times_out_by_name() -> None:
    assert _ranks(_absent_at_init, 3, env={"MORI_BOOTSTRAP_TIMEOUT": "2"}) == [
        "timed out",
        "timed out",
        "absent",
    ]


class _Leave(Exception):
    """Leaves a communicator's ``with`` without its collective barrier."""


def _absent_at_barrier(rank: int, n: int, uid: UniqueId) -> list[int]:
    missing: list[int] = []
    with pytest.raises(_Leave), Communicator.init(n, rank, uid, per_rank_vmm=HEAP) as c:
        c.barrier()
        if rank == 2:
            time.sleep(3)  # never comes to the second barrier
        else:
            with pytest.raises(MoriTimeoutError, match=r"ranks 2 of 3 did not arrive") as info:
                c.barrier()
            missing = info.value.missing
        raise _Leave
    return missing


def test_a_rank_that_skips_a_barrier_times_out_by_name() -> None:
    assert _ranks(_absent_at_barrier, 3, env={"MORI_BOOTSTRAP_TIMEOUT": "1.5"})[:2] == [[2], [2]]


# -- emulated nodes ------------------------------------------------------------------------------------------


def _two_nodes(rank: int, n: int, uid: UniqueId) -> None:
    os.environ["MORI_NODE_ID"] = f"node{rank // 2}"
    with Communicator.init(n, rank, uid, per_rank_vmm=HEAP) as c:
        team = (0, 1) if rank < 2 else (2, 3)
        assert (c.lsa_ranks, c.lsa_rank, c.lsa_size) == (team, rank % 2, 2)
        assert c.node_ids() == ["node0", "node0", "node1", "node1"]
        m = c.alloc_mem(64)
        c.tensor(m.ptr, 8).view(torch.int64)[0] = rank
        w = c.register_window(m.ptr, 64)
        c.barrier()  # across nodes: through the rendezvous store
        assert [int(w.view(i, torch.int64, numel=1)[0]) for i in range(2)] == list(team)
        dc = c.create_dev_comm(CCODevCommRequirements(lsa_barrier_count=1))
        assert (dc.lsa_size, dc.world_size) == (2, 4)
        other = "2, 3" if rank < 2 else "0, 1"
        with pytest.raises(
            MoriBackendError, match=rf"GDA connections to ranks {other} on other nodes.*issue 14"
        ):
            c.create_dev_comm(CCODevCommRequirements(gda_connection_type=GDA_CONNECTION_CROSSNODE))
        with pytest.raises(MoriBackendError, match=r"world barriers across nodes.*issue 14"):
            c.create_dev_comm(CCODevCommRequirements(barrier_count=1))
        import mori.ccl as ccl

        with pytest.raises(MoriBackendError, match=r"not load/store reachable.*issue 14"):
            ccl.AllreduceSdma(rank, n, transit_buffer_size=1 << 20, comm=c)
        c.barrier()


def test_ranks_on_two_emulated_nodes_form_two_lsa_teams() -> None:
    _ranks(_two_nodes, 4)

"""Four CPU ranks on one symmetric heap: each puts a message into its right neighbour's buffer,
raises a signal there, and waits for the message from its left neighbour.

Run: python docs/examples/shmem_ring.py
"""

from __future__ import annotations

import multiprocessing as mp
import os

import torch

import mori.shmem as shmem

NRANKS = 4
N = 1024  # float32 elements per message


def rank_main(rank: int, nranks: int, uid: bytes) -> None:
    os.environ.setdefault("MORI_SHMEM_HEAP_SIZE", "64M")  # per rank; read at init
    shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, rank, nranks, uid)
    me, npes = shmem.shmem_mype(), shmem.shmem_npes()
    right = (me + 1) % npes

    # Collective allocations: same size, same order on every PE.
    inbox = shmem.mori_shmem_create_tensor(N, torch.float32)
    signal = shmem.mori_shmem_create_tensor(1, torch.int64)
    signal.zero_()
    outbox = torch.full((N,), float(me))
    shmem.shmem_buffer_register(outbox.data_ptr(), outbox.nbytes)  # a local source for puts
    shmem.shmem_barrier_all()  # every PE has zeroed its signal before anyone raises one

    shmem.shmem_putmem_signal(
        inbox.data_ptr(), outbox.data_ptr(), outbox.nbytes, signal.data_ptr(), 1, shmem.SIGNAL_ADD, right
    )
    shmem.shmem_wait_until(signal.data_ptr(), shmem.SHMEM_CMP_EQ, 1, timeout=30)
    left = (me - 1) % npes
    assert torch.equal(inbox, torch.full((N,), float(left))), f"PE {me}: wrong data from PE {left}"

    shmem.shmem_barrier_all()
    shmem.shmem_buffer_deregister(outbox.data_ptr(), outbox.nbytes)
    shmem.mori_shmem_free_tensor(signal)
    shmem.mori_shmem_free_tensor(inbox)
    shmem.shmem_finalize()
    print(f"PE {me}/{npes}: received PE {left}'s message")


def main() -> None:
    # The process that makes the unique id hosts the rendezvous: it must live until all ranks
    # have initialised. Here it is the parent, which waits for its children.
    uid = shmem.shmem_get_unique_id()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, NRANKS, uid)) for r in range(NRANKS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit("a rank failed")


if __name__ == "__main__":
    main()

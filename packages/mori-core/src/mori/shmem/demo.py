"""The main CPU job: N local ranks on a shared symmetric heap pass data around a ring.

Each rank allocates a symmetric buffer and a signal word, writes its own pattern, puts it into
its right neighbour's buffer with a signal, waits for its left neighbour's, checks every byte,
then all meet in a barrier. A timed ring of bigger puts gives the bandwidth each rank achieved.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from mori.core.launch import shmem_ranks


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=4, help="number of local ranks (processes)")
    p.add_argument(
        "--size", type=int, default=16 << 20, help="bytes each rank puts per round of the timed ring"
    )
    p.add_argument("--rounds", type=int, default=20, help="timed ring rounds")


def _rank(rank: int, nranks: int, size: int, rounds: int) -> dict[str, Any]:
    import torch

    import mori.shmem as shmem

    right, left = (rank + 1) % nranks, (rank - 1) % nranks
    mine = shmem.mori_shmem_create_tensor(size, torch.uint8)
    inbox = shmem.mori_shmem_create_tensor(size, torch.uint8)
    sig = shmem.shmem_malloc(8)
    mine.fill_(rank + 1)
    shmem.shmem_barrier_all()
    lines = [
        f"PE {rank}/{nranks}: heap at {shmem.shmem_heap_info()['base']:#x}, runtime {shmem.shmem_heap_info()['runtime']}"
    ]

    # 1. one put with signal around the ring, checked byte for byte
    shmem.shmem_putmem_signal(inbox.data_ptr(), mine.data_ptr(), size, sig, 1, shmem.SIGNAL_SET, right)
    shmem.shmem_wait_until(sig, shmem.SHMEM_CMP_EQ, 1, dtype="uint64")
    ok = bool((inbox == left + 1).all())
    lines.append(
        f"PE {rank}: put {size} B to PE {right} with a signal; got PE {left}'s {size} B, exact: {ok}"
    )
    shmem.shmem_barrier_all()
    lines.append(f"PE {rank}: barrier passed")

    # 2. timed ring: every rank puts to its right neighbour at once, round after round
    samples = []
    for r in range(2, rounds + 2):
        t0 = time.perf_counter()
        shmem.shmem_putmem_signal(inbox.data_ptr(), mine.data_ptr(), size, sig, r, shmem.SIGNAL_SET, right)
        shmem.shmem_wait_until(sig, shmem.SHMEM_CMP_GE, r, dtype="uint64")
        samples.append(time.perf_counter() - t0)
        shmem.shmem_barrier_all()
    samples.sort()
    median = samples[len(samples) // 2]
    lines.append(
        f"PE {rank}: ring of {rounds} x {size} B puts, median {median * 1e3:.3f} ms per round, {size / median / 1e9:.2f} GB/s"
    )
    shmem.mori_shmem_free_tensor(inbox)
    shmem.mori_shmem_free_tensor(mine)
    shmem.shmem_free(sig)
    return {"ok": ok, "lines": lines, "gbps": size / median / 1e9}


def run(args: argparse.Namespace) -> int:
    if args.ranks < 2:
        raise SystemExit("mori demo: --ranks must be at least 2")
    if args.size <= 0 or args.rounds <= 0:
        raise SystemExit("mori demo: --size and --rounds must be > 0")
    heap = 2 * args.size + (8 << 20)
    t0 = time.perf_counter()
    results = shmem_ranks(_rank, args.ranks, args.size, args.rounds, heap=str(heap), timeout=300.0)
    for res in results:
        for line in res["lines"]:
            print(line)
    ok = all(r["ok"] for r in results)
    total = sum(r["gbps"] for r in results)
    print(
        f"demo: {args.ranks} ranks, symmetric heap of {heap} B each in /dev/shm; ring {'verified' if ok else 'FAILED'}; "
        f"aggregate put bandwidth {total:.2f} GB/s; wall time {time.perf_counter() - t0:.1f} s"
    )
    return 0 if ok else 1

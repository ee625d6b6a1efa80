"""SHMEM under torchrun: a ring of put-with-signal on the symmetric heap, one process per rank.

CPU (the heap in /dev/shm)::

    torchrun --nproc-per-node 2 examples/shmem_torchrun.py

NVIDIA GPUs (the heap in GPU memory; needs mori-backend-nvlink; AMD: mori-backend-xgmi and
``MORI_DEVICE_RUNTIME=hip``)::

    MORI_DEVICE_RUNTIME=cuda torchrun --nproc-per-node 2 examples/shmem_torchrun.py

Every rank fills its source buffer with its rank number, puts it into its right neighbour's
buffer together with a signal, waits for its left neighbour's signal and checks the bytes.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import mori.shmem as shmem

N = 1024  # int64 elements per message


def main() -> None:
    runtime = os.environ.get("MORI_DEVICE_RUNTIME", "cpu")
    if runtime in ("cuda", "hip"):  # one GPU per rank; ranks may share one (use MPS on NVIDIA)
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    os.environ.setdefault("MORI_DEVICE_RUNTIME", runtime)
    os.environ.setdefault("MORI_SHMEM_HEAP_SIZE", "64M")  # per rank; the default is 4 GiB
    # torchrun gives every rank the rendezvous (MASTER_ADDR, MASTER_PORT): SHMEM meets in the
    # process group's store, so no unique id has to be passed around.
    dist.init_process_group("gloo")
    shmem.shmem_torch_process_group_init("default")
    me, npes = shmem.shmem_mype(), shmem.shmem_npes()
    right, left = (me + 1) % npes, (me - 1) % npes

    # collective allocations: same sizes, same order on every rank
    src, dst, sig = shmem.shmem_malloc(N * 8), shmem.shmem_malloc(N * 8), shmem.shmem_malloc(8)
    src_v = shmem.shmem_tensor_view(src, N, torch.int64)
    dst_v = shmem.shmem_tensor_view(dst, N, torch.int64)
    src_v.fill_(me)
    shmem.shmem_atomic_set(sig, 0, me, dtype="uint64")
    shmem.shmem_barrier_all()  # every signal word is 0 before anyone raises one

    shmem.shmem_putmem_signal(dst, src, N * 8, sig, 1, shmem.SIGNAL_SET, right)
    shmem.shmem_wait_until(sig, shmem.SHMEM_CMP_EQ, 1, dtype="uint64", timeout=60)
    if not bool((dst_v == left).all()):
        raise SystemExit(f"rank {me}: wrong bytes from rank {left}")
    print(f"rank {me}/{npes} ({src_v.device}): got rank {left}'s {N * 8} bytes after its signal", flush=True)

    shmem.shmem_barrier_all()
    for p in (sig, dst, src):
        shmem.shmem_free(p)
    shmem.shmem_finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

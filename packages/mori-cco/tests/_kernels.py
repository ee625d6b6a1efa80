"""Test kernels over mori.cco.device, used by test_device.py (and test_gpu.py on GPUs).

Imported inside the rank functions only: under the interpreter ``TRITON_INTERPRET=1`` must be set
before ``triton.jit`` runs. Each kernel lists an ahead-of-time variant, so ``tools/compile_kernels.py``
also proves the device functions it calls compile for every target.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mori.cco import device as ccd
from mori.core.kernels import aot

_DC = {"devcomm": "*i64"}


@aot(signature={"out_ptr": "*i64", **_DC})
@triton.jit
def identity_kernel(out_ptr, devcomm):
    """out[0:4] = rank, world_size, lsa_size, lsa_rank."""
    tl.store(out_ptr, ccd.rank(devcomm))
    tl.store(out_ptr + 1, ccd.world_size(devcomm))
    tl.store(out_ptr + 2, ccd.lsa_size(devcomm))
    tl.store(out_ptr + 3, ccd.lsa_rank(devcomm))


@aot(signature={"win": "*i64", "buf_ptr": "*i32", **_DC, "rounds": "i32"}, constexprs={"SLOT": 64})
@triton.jit
def lsa_rounds_kernel(
    # window table; this rank's copy of it: int32 [num_programs * lsa_size * SLOT]; device communicator
    win,
    buf_ptr,
    devcomm,
    # rounds of store, barrier, check
    rounds,
    SLOT: tl.constexpr,
):
    """Program k, each round r: store r * 1000 + my LSA rank into my slot of every peer's row k
    (typed pointers moved with lsa_peer_ptr, and once through get_lsa_peer_ptr), sync LSA barrier k,
    check the row in my copy holds every peer's value of round r (a wrong word leaves -1 in my
    slot at its place), sync again so nobody overwrites what a slower peer still checks."""
    k = tl.program_id(0)
    n = ccd.lsa_size(devcomm)
    me = ccd.lsa_rank(devcomm)
    offs = tl.arange(0, SLOT)
    row = buf_ptr + k * n * SLOT
    r = tl.cast(0, tl.int32)
    bad = tl.zeros([SLOT], dtype=tl.int32)
    while r < rounds:
        value = r * 1000 + me
        p = tl.cast(0, tl.int64)
        while p < n:
            mine = row + me * SLOT + offs
            if p == 0:
                addr = ccd.get_lsa_peer_ptr(win, p, ((k * n + me) * SLOT) * 4)
                tl.store(addr.to(tl.pointer_type(tl.int32)) + offs, value.to(tl.int32) + offs * 0)
            else:
                tl.store(ccd.lsa_peer_ptr(mine, win, p, devcomm), value.to(tl.int32) + offs * 0)
            p += 1
        ccd.lsa_barrier_sync(devcomm, k)
        q = tl.cast(0, tl.int64)
        while q < n:
            got = tl.load(row + q * SLOT + offs)
            bad += (got != (r * 1000 + q).to(tl.int32)).to(tl.int32)
            q += 1
        ccd.lsa_barrier_sync(devcomm, k)
        r += 1
    tl.store(row + me * SLOT + offs, tl.full([SLOT], -1, tl.int32), mask=bad != 0)


@aot(signature={"count_ptr": "*i64", **_DC, "rounds": "i32"})
@triton.jit
def world_barrier_kernel(count_ptr, devcomm, rounds):
    """``rounds`` world barriers (index 0); count_ptr[0] += 1 after each (one program)."""
    r = tl.cast(0, tl.int32)
    while r < rounds:
        ccd.barrier_sync(devcomm, 0)
        tl.store(count_ptr, tl.load(count_ptr) + 1)
        r += 1


@aot(
    signature={
        "dst_win": "*i64",
        "src_win": "*i64",
        **_DC,
        "nbytes": "i64",
        "puts": "i32",
        "expect": "i64",
        "queue": "i32",
        "bogus_offset": "i64",
    }
)
@triton.jit
def sdma_kernel(dst_win, src_win, devcomm, nbytes, puts, expect, queue, bogus_offset):
    """``puts`` copy-engine puts of ``nbytes`` (piece i at byte i * nbytes) of my source window into
    the right neighbour's destination window on ``queue``, quiet, then wait until the left
    neighbour's puts on that queue reached ``expect``. A non-zero ``bogus_offset`` posts one more put
    to that offset (outside any window), which the copy thread must refuse."""
    me = ccd.lsa_rank(devcomm)
    n = ccd.lsa_size(devcomm)
    right = (me + 1) % n
    left = (me + n - 1) % n
    i = tl.cast(0, tl.int64)
    while i < puts:
        ccd.sdma_put(devcomm, right, dst_win, i * nbytes, src_win, i * nbytes, nbytes, queue)
        i += 1
    if bogus_offset != 0:
        ccd.sdma_put(devcomm, right, dst_win, bogus_offset, src_win, 0, nbytes, queue)
    ccd.sdma_commit(devcomm, queue)
    ccd.sdma_quiet(devcomm, queue)
    ccd.sdma_wait_signal(devcomm, queue, left, expect)


@aot(signature={"dst_win": "*i64", "src_win": "*i64", **_DC, "nbytes": "i64", "queue": "i32"})
@triton.jit
def sdma_get_kernel(dst_win, src_win, devcomm, nbytes, queue):
    """A copy-engine get of the right neighbour's source window into my destination window, quiet."""
    me = ccd.lsa_rank(devcomm)
    right = (me + 1) % ccd.lsa_size(devcomm)
    ccd.sdma_get(devcomm, right, dst_win, 0, src_win, 0, nbytes, queue)
    ccd.sdma_quiet(devcomm, queue)


@aot(signature={"out_ptr": "*i64", **_DC, "queue": "i32", "peer": "i32"})
@triton.jit
def sdma_signal_kernel(out_ptr, devcomm, queue, peer):
    """out[0] = how many of peer's puts on queue have landed here; out[1] = LSA barrier 0's epoch."""
    tl.store(out_ptr, ccd.sdma_signal(devcomm, queue, peer))
    tl.store(out_ptr + 1, ccd.lsa_barrier_epoch(devcomm, 0))


@aot(signature={**_DC})
@triton.jit
def arrive_kernel(devcomm):
    """Arrive at LSA barrier 0 (the host waits)."""
    ccd.lsa_barrier_arrive(devcomm, 0)


@aot(signature={**_DC})
@triton.jit
def wait_kernel(devcomm):
    """Wait at LSA barrier 0 (the host arrived)."""
    ccd.lsa_barrier_wait(devcomm, 0)

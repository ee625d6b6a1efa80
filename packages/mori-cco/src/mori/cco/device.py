# Jitted functions carry no Python annotations (Triton reads them), so mypy may not ask for them:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Device API of mori.cco for Triton kernels: ``@triton.jit`` functions over a device communicator.

A kernel takes the device communicator as one argument, ``devcomm``: the int64 tensor
:attr:`DevCommHandle.tensor <mori.cco.DevCommHandle.tensor>` (layout in :mod:`mori.cco.layout`), and
a window as another: :attr:`RegisteredWindow.table <mori.cco.RegisteredWindow.table>` (int64
``[lsa_size]``, the address of every LSA peer's copy in this process). Triton inlines the functions
below into the kernel; one source compiles for NVIDIA (sm_90, sm_100) and AMD (gfx942, gfx950) GPUs
and runs on CPU tensors under ``TRITON_INTERPRET=1``::

    from mori.cco import device as ccd

    @triton.jit
    def push_kernel(win, devcomm, n, BLOCK: tl.constexpr):
        me = ccd.lsa_rank(devcomm)
        peer = (me + 1) % ccd.lsa_size(devcomm)
        dst = ccd.get_lsa_peer_ptr(win, peer, 0).to(tl.pointer_type(tl.float32))
        ...                                   # stores into the peer's copy of the window
        ccd.lsa_barrier_sync(devcomm, 0)      # every LSA peer has stored into us

**LSA** (load/store access): :func:`get_lsa_peer_ptr` gives the address of a byte of an LSA peer's
copy of a window; :func:`lsa_peer_ptr` moves a typed pointer into this rank's copy onto a peer's
copy keeping its alignment (vectorised accesses). **LSA barrier sessions**
(``lsa_barrier_count`` of them): :func:`lsa_barrier_arrive`, :func:`lsa_barrier_wait`,
:func:`lsa_barrier_sync`; world barriers (``barrier_count``): :func:`barrier_sync`. **Copy-engine
queues**: :func:`sdma_put`, :func:`sdma_get`, :func:`sdma_commit`, :func:`sdma_quiet`,
:func:`sdma_wait_signal` post to the same rings as the host's :class:`~mori.cco.SdmaQueue`; the
communicator's copy thread executes them (:mod:`mori.cco.sdma`). **GDA** (RDMA to other nodes)
comes with the transport layer's proxy (issue 14); there are no GDA functions yet.

**Scope.** A call is made by one program (all its threads). Barrier ``index`` values must be
below the counts the device communicator was made with, and one barrier must not be used by two
programs at once: give each program its own index. Nothing here checks indices on the device.

**No timeouts on the device**: waits spin until their condition holds (a peer that never arrives
hangs the kernel). Under the interpreter the programs of a launch run one after another: a program
must never wait for a later program of the same launch; waiting for other ranks is fine. On a GPU,
every program that waits must be resident at once with the programs it waits for (keep grids at or
below the number of SMs, shared by the ranks on one GPU).
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "mori.cco.device needs Triton: install it with `pip install mori-core[triton]` "
        "(torch wheels for NVIDIA GPUs bring it already)"
    ) from e

from mori.cco import layout
from mori.core.kernels import device_function
from mori.shmem import device as shd

__all__ = [
    "barrier_sync",
    "get_lsa_peer_ptr",
    "lsa_barrier_arrive",
    "lsa_barrier_epoch",
    "lsa_barrier_sync",
    "lsa_barrier_wait",
    "lsa_peer_ptr",
    "lsa_rank",
    "lsa_size",
    "rank",
    "sdma_commit",
    "sdma_get",
    "sdma_put",
    "sdma_quiet",
    "sdma_signal",
    "sdma_wait_signal",
    "world_size",
]

_RANK = tl.constexpr(layout.DC_RANK)
_WORLD_SIZE = tl.constexpr(layout.DC_WORLD_SIZE)
_LSA_SIZE = tl.constexpr(layout.DC_LSA_SIZE)
_LSA_RANK = tl.constexpr(layout.DC_LSA_RANK)
_LSA_BARRIER_SLOTS_AT = tl.constexpr(layout.DC_LSA_BARRIER_SLOTS_AT)
_LSA_BARRIER_EPOCHS = tl.constexpr(layout.DC_LSA_BARRIER_EPOCHS)
_WORLD_BARRIER_SLOTS_AT = tl.constexpr(layout.DC_WORLD_BARRIER_SLOTS_AT)
_WORLD_BARRIER_EPOCHS = tl.constexpr(layout.DC_WORLD_BARRIER_EPOCHS)
_SDMA_QUEUE_DEPTH = tl.constexpr(layout.DC_SDMA_QUEUE_DEPTH)
_SDMA_SIGNALS_AT = tl.constexpr(layout.DC_SDMA_SIGNALS_AT)
_SDMA_RINGS = tl.constexpr(layout.DC_SDMA_RINGS)
_SDMA_DOORBELL = tl.constexpr(layout.DC_SDMA_DOORBELL)
_SDMA_RESERVED = tl.constexpr(layout.DC_SDMA_RESERVED)
_W = tl.constexpr(layout.SLOT_BYTES)
_RING_HEADER_WORDS = tl.constexpr(layout.RING_HEADER_WORDS)
_RING_COMPLETED = tl.constexpr(layout.RING_COMPLETED)
_ENTRY_WORDS = tl.constexpr(layout.ENTRY_WORDS)
_ENTRY_SEQ = tl.constexpr(layout.ENTRY_SEQ)
_ENTRY_OP = tl.constexpr(layout.ENTRY_OP)
_ENTRY_DST = tl.constexpr(layout.ENTRY_DST)
_ENTRY_SRC = tl.constexpr(layout.ENTRY_SRC)
_ENTRY_BYTES = tl.constexpr(layout.ENTRY_BYTES)
_OP_PUT = tl.constexpr(layout.SDMA_OP_PUT)
_OP_GET = tl.constexpr(layout.SDMA_OP_GET)
#: window copies whose distance is a multiple of this keep a typed pointer's alignment
_ALIGN = tl.constexpr(16)


# -- identity -----------------------------------------------------------------------------------------


@device_function
@triton.jit
def rank(devcomm):
    """This rank in the communicator (int64)."""
    return tl.load(devcomm + _RANK)


@device_function
@triton.jit
def world_size(devcomm):
    """Ranks in the communicator (int64)."""
    return tl.load(devcomm + _WORLD_SIZE)


@device_function
@triton.jit
def lsa_size(devcomm):
    """Ranks in this rank's LSA team (int64)."""
    return tl.load(devcomm + _LSA_SIZE)


@device_function
@triton.jit
def lsa_rank(devcomm):
    """This rank's index in its LSA team (int64)."""
    return tl.load(devcomm + _LSA_RANK)


@device_function
@triton.jit
def _table(devcomm, AT: tl.constexpr, i):
    # entry i of the table whose word index the header holds at AT
    return tl.load(devcomm + tl.load(devcomm + AT) + i)


@device_function
@triton.jit
def _i64_ptr(addr):
    return addr.to(tl.pointer_type(tl.int64))


# -- LSA pointers -------------------------------------------------------------------------------------


@device_function
@triton.jit
def get_lsa_peer_ptr(win, peer, offset):
    """Address (int64) in this process of byte ``offset`` of LSA peer ``peer``'s copy of window ``win``.

    ``win``: the window's ``table`` (int64 ``[lsa_size]``); ``peer``: an LSA rank (scalar or block);
    ``offset``: bytes. Turn the address into a pointer with ``.to(tl.pointer_type(tl.float32))``
    (Triton then knows nothing of its alignment; :func:`lsa_peer_ptr` keeps it).
    """
    return tl.load(win + peer) + offset


@device_function
@triton.jit
def lsa_peer_ptr(ptr, win, peer, devcomm):
    """Pointer to LSA peer ``peer``'s copy of what ``ptr`` points to in this rank's copy of ``win``.

    ``ptr``: a typed pointer (or block of pointers) into this rank's copy; the result has its type
    and shape, moved by the distance between the two copies. That distance must be a multiple of 16
    bytes (windows from ``alloc_mem`` are 256-byte aligned), which lets the compiler keep vectorised
    accesses.
    """
    delta = tl.load(win + peer) - tl.load(win + lsa_rank(devcomm))
    delta = tl.multiple_of(delta, _ALIGN)
    ELEM_BYTES: tl.constexpr = (ptr.dtype.element_ty.primitive_bitwidth + 7) // 8
    return ptr + delta // ELEM_BYTES


# -- barriers -----------------------------------------------------------------------------------------
# Barrier b of a kind (LSA or world) has, in every member's memory, one int64 slot per member:
# slot [b][i] = the last epoch member i arrived at b with. Arriving, a member bumps its own epoch of
# b (only it touches it) and stores it with a release into its slot of every member; waiting, it
# spins until every slot of its own row b reached its epoch (acquire). Epochs only grow, so a fast
# member that already arrived at the next epoch still counts, nothing is reset, and the barrier
# works the same on every launch and on every replay of a CUDA graph.


@device_function
@triton.jit
def _arrive(devcomm, index, SLOTS_AT: tl.constexpr, EPOCHS: tl.constexpr, n, me):
    epoch_ptr = _i64_ptr(tl.load(devcomm + EPOCHS) + index * _W)
    epoch = tl.load(epoch_ptr, volatile=True) + 1
    tl.store(epoch_ptr, epoch)
    tl.debug_barrier()  # every thread of the program has issued its earlier stores
    m = tl.load(devcomm + _LSA_SIZE)
    i = tl.cast(0, tl.int64)
    while i < m:
        slot = _i64_ptr(_table(devcomm, SLOTS_AT, i) + (index * n + me) * _W)
        tl.atomic_xchg(slot, epoch, sem="release", scope="sys")
        i += 1
    return epoch


@device_function
@triton.jit
def _wait(devcomm, index, SLOTS_AT: tl.constexpr, EPOCHS: tl.constexpr, n):
    epoch = tl.load(_i64_ptr(tl.load(devcomm + EPOCHS) + index * _W), volatile=True)
    row = _table(devcomm, SLOTS_AT, tl.load(devcomm + _LSA_RANK)) + index * n * _W
    i = tl.cast(0, tl.int64)
    while i < n:
        shd.wait_until(_i64_ptr(row + i * _W), shd.SHMEM_CMP_GE, epoch)
        i += 1
    tl.debug_barrier()  # no thread of the program runs ahead of the waits


@device_function
@triton.jit
def lsa_barrier_epoch(devcomm, index):
    """How often this rank arrived at LSA barrier ``index`` so far (int64; the next arrival makes it
    one more). Only this rank changes it, so a program may read it ahead of its arrival, e.g. to
    pick a double buffer by parity."""
    return tl.load(_i64_ptr(tl.load(devcomm + _LSA_BARRIER_EPOCHS) + index * _W), volatile=True)


@device_function
@triton.jit
def lsa_barrier_arrive(devcomm, index):
    """Arrive at LSA barrier ``index``: every LSA peer learns this rank got here (what the program
    wrote before is visible to a peer once its :func:`lsa_barrier_wait` returns). Returns the epoch."""
    return _arrive(
        devcomm, index, _LSA_BARRIER_SLOTS_AT, _LSA_BARRIER_EPOCHS, lsa_size(devcomm), lsa_rank(devcomm)
    )


@device_function
@triton.jit
def lsa_barrier_wait(devcomm, index):
    """Wait until every LSA peer arrived at LSA barrier ``index`` as often as this rank did."""
    _wait(devcomm, index, _LSA_BARRIER_SLOTS_AT, _LSA_BARRIER_EPOCHS, lsa_size(devcomm))


@device_function
@triton.jit
def lsa_barrier_sync(devcomm, index):
    """:func:`lsa_barrier_arrive` then :func:`lsa_barrier_wait` on LSA barrier ``index``."""
    lsa_barrier_arrive(devcomm, index)
    lsa_barrier_wait(devcomm, index)


@device_function
@triton.jit
def barrier_sync(devcomm, index):
    """World barrier ``index`` (``barrier_count``) over every rank of the communicator. On one node
    the world is the LSA team (a communicator spanning nodes refuses world barriers until GDA)."""
    _arrive(
        devcomm, index, _WORLD_BARRIER_SLOTS_AT, _WORLD_BARRIER_EPOCHS, world_size(devcomm), rank(devcomm)
    )
    _wait(devcomm, index, _WORLD_BARRIER_SLOTS_AT, _WORLD_BARRIER_EPOCHS, world_size(devcomm))


# -- copy-engine queues -------------------------------------------------------------------------------
# A request is 8 words in the queue's ring (host-visible memory): the program takes an entry number
# from the queue's reservation counter (atomic add), waits while the ring is full (the copy thread
# counts completed entries), writes the op, addresses and size, then, after a CTA barrier, stores
# the entry's sequence word with a release at system scope: from then on the copy thread may run it.


@device_function
@triton.jit
def _ring(devcomm, queue):
    depth = tl.load(devcomm + _SDMA_QUEUE_DEPTH)
    return tl.load(devcomm + _SDMA_RINGS) + queue * (_RING_HEADER_WORDS + depth * _ENTRY_WORDS) * _W


@device_function
@triton.jit
def _sdma_post(devcomm, queue, op, dst, src, nbytes):
    reserved = _i64_ptr(tl.load(devcomm + _SDMA_RESERVED) + queue * _W)
    slot = tl.atomic_add(reserved, 1, sem="acq_rel", scope="sys")
    depth = tl.load(devcomm + _SDMA_QUEUE_DEPTH)
    ring = _ring(devcomm, queue)
    completed = _i64_ptr(ring + _RING_COMPLETED * _W)
    while slot - tl.load(completed, volatile=True) >= depth:
        pass
    entry = _i64_ptr(ring + (_RING_HEADER_WORDS + (slot % depth) * _ENTRY_WORDS) * _W)
    tl.store(entry + _ENTRY_OP, op)
    tl.store(entry + _ENTRY_DST, dst)
    tl.store(entry + _ENTRY_SRC, src)
    tl.store(entry + _ENTRY_BYTES, nbytes)
    tl.debug_barrier()
    tl.atomic_xchg(entry + _ENTRY_SEQ, slot + 1, sem="release", scope="sys")


@device_function
@triton.jit
def sdma_put(devcomm, peer, dst_win, dst_off, src_win, src_off, nbytes, queue):
    """Post a copy of ``nbytes`` from this rank's copy of ``src_win`` (byte ``src_off``) into LSA
    peer ``peer``'s copy of ``dst_win`` (byte ``dst_off``) on copy-engine queue ``queue``; once the
    bytes are there the peer's signal counter ``[queue][this LSA rank]`` grows by one. Non-blocking
    (waits only while the ring is full); runs after :func:`sdma_commit` at the latest."""
    dst = get_lsa_peer_ptr(dst_win, peer, dst_off)
    src = get_lsa_peer_ptr(src_win, lsa_rank(devcomm), src_off)
    _sdma_post(devcomm, queue, _OP_PUT + peer * 256, dst, src, nbytes)


@device_function
@triton.jit
def sdma_get(devcomm, peer, dst_win, dst_off, src_win, src_off, nbytes, queue):
    """Post a copy of ``nbytes`` from LSA peer ``peer``'s copy of ``src_win`` into this rank's copy of
    ``dst_win``. Complete after :func:`sdma_quiet`; no signal."""
    dst = get_lsa_peer_ptr(dst_win, lsa_rank(devcomm), dst_off)
    src = get_lsa_peer_ptr(src_win, peer, src_off)
    _sdma_post(devcomm, queue, _OP_GET + peer * 256, dst, src, nbytes)


@device_function
@triton.jit
def sdma_commit(devcomm, queue):
    """Hand the requests posted so far to the copy engine (rings the doorbell). ``queue`` is
    accepted for the original's call shape; one doorbell serves every queue."""
    tl.debug_barrier()
    tl.atomic_add(_i64_ptr(tl.load(devcomm + _SDMA_DOORBELL)), 1 + queue * 0, sem="release", scope="sys")


@device_function
@triton.jit
def sdma_quiet(devcomm, queue):
    """Commit, then spin until every request posted to ``queue`` so far (by any program or the host)
    has completed: their bytes are at the destination."""
    target = tl.atomic_or(
        _i64_ptr(tl.load(devcomm + _SDMA_RESERVED) + queue * _W), 0, sem="acq_rel", scope="sys"
    )
    sdma_commit(devcomm, queue)
    completed = _i64_ptr(_ring(devcomm, queue) + _RING_COMPLETED * _W)
    while tl.load(completed, volatile=True) < target:
        pass
    tl.atomic_or(devcomm + _RANK, 0, sem="acq_rel", scope="sys")  # acquire what the copies wrote
    tl.debug_barrier()


@device_function
@triton.jit
def _signal_ptr(devcomm, queue, peer):
    me = lsa_rank(devcomm)
    return _i64_ptr(_table(devcomm, _SDMA_SIGNALS_AT, me) + (queue * lsa_size(devcomm) + peer) * _W)


@device_function
@triton.jit
def sdma_signal(devcomm, queue, peer):
    """How many of LSA peer ``peer``'s puts on ``queue`` have landed in this rank's memory (acquire)."""
    return tl.atomic_or(_signal_ptr(devcomm, queue, peer), 0, sem="acquire", scope="sys")


@device_function
@triton.jit
def sdma_wait_signal(devcomm, queue, peer, value):
    """Spin until at least ``value`` puts of LSA peer ``peer`` on ``queue`` have landed here; the
    bytes of those puts are visible after it returns."""
    shd.wait_until(_signal_ptr(devcomm, queue, peer), shd.SHMEM_CMP_GE, value)

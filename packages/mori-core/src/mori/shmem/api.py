"""Host API of mori.shmem: init and finalize, the symmetric heap, barriers, pointer translation.

Names and semantics follow the original MORI (and OpenSHMEM). Addresses are plain ints; calls that
the original returns a status from return 0 on success and raise on error. "Collective" means
every PE must make the call, in the same order, with the same arguments.
"""

from __future__ import annotations

from typing import Any

from mori.core import bootstrap
from mori.core.errors import MoriOutOfMemoryError, MoriValueError, bad_value
from mori.core.mappings import ADDRESS_LIMIT
from mori.shmem import context, layout
from mori.shmem.context import ShmemContext, current
from mori.shmem.heap import MIN_ALIGN

#: every heap segment is mapped at a multiple of this, so larger alignments cannot be promised
MAX_ALIGN = 2 << 20

#: shmem_init_attr flags
MORI_SHMEM_INIT_WITH_MPI_COMM = 0
MORI_SHMEM_INIT_WITH_UNIQUEID = 1

_KIND_MALLOC, _KIND_FREE = 1, 2

# -- init / finalize --------------------------------------------------------------------------------


def shmem_get_unique_id() -> bytes:
    """Return a 128-byte id to pass to :func:`shmem_init_attr` on every rank.

    Starts the rendezvous store (a torch ``TCPStore``) in this process, which must stay alive until
    every rank has initialised. Exactly one process calls it (usually rank 0) and sends the bytes to
    all the others: a rank that makes its own id waits alone in its own store (it says so after a few
    seconds, and in its timeout error). An id serves one init; make a new one for the next.
    """
    return bootstrap.get_unique_id()


def shmem_init_attr(flags: int, rank: int, nranks: int, uid: Any) -> int:
    """Initialise SHMEM on this rank. Collective over ``nranks`` processes; host-blocking.

    ``flags``: :data:`MORI_SHMEM_INIT_WITH_UNIQUEID` (``uid`` = bytes from
    :func:`shmem_get_unique_id`) or :data:`MORI_SHMEM_INIT_WITH_MPI_COMM` (``uid`` = an mpi4py
    communicator, or None for ``COMM_WORLD``; ``rank``/``nranks`` must match it).
    Waits at most ``MORI_BOOTSTRAP_TIMEOUT`` seconds for the other ranks, then raises
    :class:`~mori.core.errors.MoriTimeoutError` naming those that did not arrive. A unique id
    serves one init: once its job met, a second init with it (after finalize, or by a restarted
    rank) raises :class:`~mori.core.errors.MoriValueError` at once. Returns 0.
    """
    func = "shmem_init_attr"
    if flags == MORI_SHMEM_INIT_WITH_UNIQUEID:
        if not isinstance(uid, (bytes, bytearray, memoryview)):
            raise bad_value(func, "uid", type(uid).__name__, "bytes from shmem_get_unique_id()")
        context.install(
            func, lambda: ShmemContext(bootstrap.from_unique_id(rank, nranks, bytes(uid), func=func))
        )
    elif flags == MORI_SHMEM_INIT_WITH_MPI_COMM:

        def make() -> ShmemContext:
            boot = bootstrap.from_mpi(uid, func=func)
            if (boot.rank, boot.nranks) != (rank, nranks):
                boot.close()
                raise bad_value(
                    func, "rank/nranks", (rank, nranks), f"the communicator's ({boot.rank}, {boot.nranks})"
                )
            return ShmemContext(boot)

        context.install(func, make)
    else:
        raise bad_value(
            func, "flags", flags, "MORI_SHMEM_INIT_WITH_UNIQUEID (1) or MORI_SHMEM_INIT_WITH_MPI_COMM (0)"
        )
    return 0


def shmem_torch_process_group_init(group_name: str) -> int:
    """Initialise SHMEM over a torch.distributed process group (gloo on CPU). Collective; returns 0.

    ``group_name``: the name the group was registered under with
    ``torch._C._distributed_c10d._register_process_group(name, group)``; ``"default"`` also finds
    the world group when nothing is registered under that name. The ranks meet in the group's
    store, not through a collective: a rank of the group that never calls this makes the others
    fail after ``MORI_BOOTSTRAP_TIMEOUT`` with a :class:`~mori.core.errors.MoriTimeoutError` naming
    it (its rank in the group).
    """
    func = "shmem_torch_process_group_init"
    context.install(func, lambda: ShmemContext(bootstrap.from_process_group(group_name, func=func)))
    return 0


def shmem_mpi_init(comm: Any = None) -> int:
    """Initialise SHMEM over an MPI communicator (mpi4py; default ``COMM_WORLD``). Collective; returns 0."""
    func = "shmem_mpi_init"
    context.install(func, lambda: ShmemContext(bootstrap.from_mpi(comm, func=func)))
    return 0


def shmem_finalize() -> int:
    """Collective: barrier, then unmap every heap and release this rank's memory. Re-init works after."""
    context.uninstall("shmem_finalize")
    return 0


def shmem_mype() -> int:
    """This process's PE number in [0, shmem_npes())."""
    return current("shmem_mype").my_pe


def shmem_npes() -> int:
    """Number of PEs in the job."""
    return current("shmem_npes").n_pes


def shmem_is_initialized() -> bool:
    return context._current is not None


# -- symmetric heap ---------------------------------------------------------------------------------


def shmem_malloc(size: int) -> int:
    """Allocate ``size`` bytes of symmetric memory; returns its address (256-byte aligned).

    Collective: every PE calls it with the same size, in the same order, and gets the same offset
    in its own heap (checked: a PE that differs makes the call fail on every PE). Memory is not
    zeroed after a free. Raises :class:`~mori.core.errors.MoriOutOfMemoryError` if the heap
    (``MORI_SHMEM_HEAP_SIZE``) has no room.
    """
    return shmem_malloc_align(MIN_ALIGN, size, func="shmem_malloc")


def shmem_malloc_align(alignment: int, size: int, *, func: str = "shmem_malloc_align") -> int:
    """Like :func:`shmem_malloc`, aligned to ``alignment`` bytes (a power of two). Collective."""
    ctx = current(func)
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise bad_value(func, "size", size, "a number of bytes > 0")
    if (
        isinstance(alignment, bool)
        or not isinstance(alignment, int)
        or alignment <= 0
        or alignment & (alignment - 1)
        or alignment > MAX_ALIGN
    ):
        raise bad_value(func, "alignment", alignment, f"a power of two in [1, {MAX_ALIGN}]")
    with ctx.lock:
        block = ctx.allocator.allocate(size, alignment)
        offset = block.offset if block else 0
        try:
            ctx.check_collective(func, _KIND_MALLOC, offset, size)
        except BaseException:
            if block:
                ctx.allocator.release(block.offset)
            raise
        if block is None:
            raise MoriOutOfMemoryError(
                f"{func}: cannot allocate {size} bytes (aligned {alignment}): the symmetric heap has "
                f"{ctx.allocator.free_bytes} bytes free, largest free block {ctx.allocator.largest_free}; "
                f"raise MORI_SHMEM_HEAP_SIZE (now {ctx.heap_size})"
            )
        return ctx.base + offset


def shmem_ext_malloc_with_flags(size: int, flags: int = 0) -> int:
    """:func:`shmem_malloc` with allocation flags. The CPU runtime accepts ``flags=0`` only."""
    if flags != 0:
        raise bad_value(
            "shmem_ext_malloc_with_flags", "flags", flags, "0 (no flags are defined for this runtime)"
        )
    return shmem_malloc_align(MIN_ALIGN, size, func="shmem_ext_malloc_with_flags")


def shmem_free(ptr: int) -> int:
    """Free memory from :func:`shmem_malloc`. Collective. Foreign pointers and double frees raise."""
    func = "shmem_free"
    ctx = current(func)
    with ctx.lock:
        off = ctx.heap_offset(func, "ptr", ptr, 0)  # foreign pointers and non-ints raise here
        size = ctx.allocator.live.get(off)
        if size is None:
            if off in ctx.allocator.freed:
                raise MoriValueError(f"{func}: ptr={ptr:#x} was already freed (double free)")
            inside = ctx.allocator.containing(off)
            hint = (
                f" (it points {off - inside.offset} bytes into the block at {ctx.base + inside.offset:#x})"
                if inside
                else ""
            )
            raise MoriValueError(f"{func}: ptr={ptr:#x} was not returned by shmem_malloc{hint}")
        ctx.check_collective(func, _KIND_FREE, off, size)
        ctx.allocator.release(off)
    return 0


def shmem_buffer_register(ptr: int, size: int) -> int:
    """Register existing local memory (e.g. a torch tensor) as a source/target of one-sided calls.

    Not collective. On the CPU runtime peers cannot load or store it (``shmem_ptr_p2p`` gives 0);
    it can be the local side of :func:`~mori.shmem.shmem_putmem`/``getmem``. The range must be
    memory the runtime can copy from and to: on the CPU runtime, mapped readable and writable in
    this process (checked against the kernel's list of mappings; an unmapped, read-only or
    no-access page raises :class:`~mori.core.errors.MoriValueError` naming its address).
    Overlapping registrations raise. Deregister before freeing the memory. Returns 0.
    """
    func = "shmem_buffer_register"
    ctx = current(func)
    if isinstance(ptr, bool) or not isinstance(ptr, int) or ptr <= 0:
        raise bad_value(func, "ptr", ptr, "the address (int > 0) of existing memory")
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise bad_value(func, "size", size, "a number of bytes > 0")
    if ptr >= ADDRESS_LIMIT:
        raise bad_value(func, "ptr", ptr, "an address below 2**64")
    if ptr + size > ADDRESS_LIMIT:
        raise MoriValueError(f"{func}: [{ptr:#x}, +{size}) runs past the end of the address space")
    ctx.runtime.check_local_buffer(func, ptr, size)
    with ctx.lock:
        for start, length in ctx.registered.items():
            if ptr < start + length and start < ptr + size:
                raise MoriValueError(
                    f"{func}: [{ptr:#x}, +{size}) overlaps the registered buffer [{start:#x}, +{length})"
                )
        ctx.registered[ptr] = size
        if ctx.network is not None:  # a source or target of transfers with PEs on other nodes too
            ctx.network.register_buffer(ptr, size)
    return 0


def shmem_buffer_deregister(ptr: int, size: int) -> int:
    """Undo :func:`shmem_buffer_register` with the same ``ptr`` and ``size``. Returns 0."""
    func = "shmem_buffer_deregister"
    ctx = current(func)
    with ctx.lock:
        if ctx.registered.get(ptr) != size:
            known = ", ".join(f"({a:#x}, {s})" for a, s in ctx.registered.items()) or "none"
            raise MoriValueError(
                f"{func}: ({ptr!r}, {size!r}) is not a registered buffer (registered: {known})"
            )
        del ctx.registered[ptr]
        if ctx.network is not None:
            ctx.network.deregister_buffer(ptr)
    return 0


def shmem_ptr_p2p(ptr: int, my_pe: int, dest_pe: int) -> int:
    """Address, in this process, of ``dest_pe``'s copy of the symmetric object at ``ptr``.

    Returns 0 when loads and stores cannot reach ``dest_pe`` (another node, or a transport
    without load/store) or when ``ptr`` is not in the symmetric heap. ``my_pe`` must be this PE.
    """
    func = "shmem_ptr_p2p"
    ctx = current(func)
    ctx.check_pe(func, my_pe, "my_pe")
    if my_pe != ctx.my_pe:
        raise bad_value(func, "my_pe", my_pe, f"this process's PE ({ctx.my_pe})")
    ctx.check_pe(func, dest_pe, "dest_pe")
    if isinstance(ptr, bool) or not isinstance(ptr, int):
        return 0
    off = ptr - ctx.base
    if not layout.USER_OFF <= off < ctx.heap_size or ctx.bases[dest_pe] == 0:
        return 0
    return ctx.bases[dest_pe] + off


def shmem_barrier_all() -> int:
    """Host barrier over all PEs. Collective, host-blocking; fails after ``MORI_BOOTSTRAP_TIMEOUT``
    naming the PEs that did not arrive. Orders memory: every put before it is visible after it."""
    current("shmem_barrier_all").barrier_all()
    return 0


def shmem_barrier_on_stream(stream: Any = None) -> int:
    """Barrier over all PEs, ordered on a device stream: collective, graph-capturable.

    ``stream``: None (the current stream), a ``torch.cuda.Stream`` or a raw stream handle (int).
    On a GPU runtime this enqueues the device barrier kernel and returns at once; PEs wait on the
    device, not the host. On the ``cpu`` runtime there is no stream: it is :func:`shmem_barrier_all`.
    """
    func = "shmem_barrier_on_stream"
    ctx = current(func)
    if ctx.runtime.torch_device == "cpu":
        ctx.barrier_all(what=func)
        return 0
    import torch

    from mori.shmem import kernels

    if stream is None:
        kernels.barrier()
    else:
        if isinstance(stream, int) and not isinstance(stream, bool):
            stream = torch.cuda.ExternalStream(stream)  # type: ignore[no-untyped-call]
        if not isinstance(stream, torch.cuda.Stream):
            raise bad_value(func, "stream", stream, "None, a torch.cuda.Stream or a raw stream handle (int)")
        with torch.cuda.stream(stream):
            kernels.barrier()
    return 0


def shmem_num_qp_per_pe() -> int:
    """RDMA queue pairs per peer. Host transports use none, so this is 0 until a NIC transport exists."""
    current("shmem_num_qp_per_pe")
    return 0


def shmem_heap_info() -> dict[str, Any]:
    """Where this PE's heap lives and what it holds: for diagnostics and tests."""
    ctx = current("shmem_heap_info")
    return {
        "runtime": ctx.runtime.name,
        "job_id": ctx.bootstrap.job_id,
        "base": ctx.base,
        "size": ctx.heap_size,
        "user_offset": layout.USER_OFF,
        "free_bytes": ctx.allocator.free_bytes,
        "peers_reachable": [b != 0 for b in ctx.bases],
    }

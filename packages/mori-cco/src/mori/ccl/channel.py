"""What every collective object of mori.ccl stands on: a communicator, symmetric staging, and the
synchronisation protocol that the host path and the Triton kernels share.

**Communicator.** A collective runs on a :class:`mori.cco.Communicator`: the one passed as ``comm=``,
or, in the original's call shape (``AllgatherSdma(my_pe, npes, ...)`` after ``shmem_init``), one
the object makes for itself: PE 0 makes a unique id and hands it to the others through the SHMEM
heap, and every PE joins. Collectives need every rank in the LSA team (one node); the hierarchical
all-gather's inter-node ring needs GDA across nodes, which comes with the transport layer (issue 14).

**Staging.** One registered window per object: two *small* halves of ``small_cap`` bytes
(calls up to ``small_cap`` alternate between them by parity) and a *large* region of the transit
buffer size. A rank copies what its peers must read into its own staging; peers pull from there.

**Protocol** (``P`` programs per kernel launch on a GPU, ``P = 1`` on the host path), with the
LSA barriers of a device communicator made for the object (``2P + 1`` of them):

* ``READY(k) = k``: program ``k`` of every rank has staged its slice of this call;
* ``READY2(k) = P + k``: second phase (all-reduce above ``small_cap``: the reduced slice is there);
* ``DONE = 2P``: a rank has finished reading its peers' *large* regions for a call. The last
  program of a launch to finish (a ticket counter; no program waits for another) arrives at it;
  a large call starts by waiting at it, so nobody overwrites staging a peer still reads.

Every call arrives at ``READY(k)`` with every ``k``, so all of them count calls: the parity of that
count picks the small half. A rank enters call ``e`` only after it saw every peer arrive for call
``e - 1``, which a peer does after finishing call ``e - 2`` (its work is stream-ordered): so a
half written in call ``e`` was last read in call ``e - 2``, finished everywhere. Epochs only grow
and live in device memory, so the protocol is the same on every launch and every CUDA-graph replay;
calls on one object must be ordered (one stream on a GPU; one thread, or the async worker, on CPU).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from mori.cco import UNIQUE_ID_BYTES, CCODevCommRequirements, Communicator, UniqueId
from mori.cco.communicator import GDA_PENDING
from mori.core.errors import (
    MoriBackendError,
    MoriStateError,
    MoriValueError,
    bad_type,
    bad_value,
    format_ranks,
)

if TYPE_CHECKING:
    from mori.cco import AllocatedMemory, DevCommHandle, RegisteredWindow

__all__ = ["Channel", "resolve_comm"]

#: calls up to this many staged bytes use the one-sync small protocol (the original's one-shot limit)
SMALL_CAP = 1 << 20
#: the original's default transit buffer
DEFAULT_TRANSIT = 512 << 20
ALIGN = 256
#: implementations: auto (host path on the cpu runtime, kernels on GPUs), host, triton (on the cpu
#: runtime only under TRITON_INTERPRET=1, which is how CI runs the kernels)
IMPLS = ("auto", "host", "triton")


def _round(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def resolve_comm(func: str, my_pe: Any, npes: Any, comm: Any, need_bytes: int) -> tuple[Communicator, bool]:
    """The communicator a collective runs on, and whether the collective owns it (made it)."""
    if isinstance(npes, bool) or not isinstance(npes, int) or npes < 1:
        raise bad_value(func, "npes", npes, "the number of PEs (an int >= 1)")
    if isinstance(my_pe, bool) or not isinstance(my_pe, int) or not 0 <= my_pe < npes:
        raise bad_value(func, "my_pe", my_pe, f"this PE's number, in [0, {npes})")
    if comm is not None:
        if not isinstance(comm, Communicator):
            raise bad_type(func, "comm", comm, "a mori.cco.Communicator (or None: one over mori.shmem)")
        if comm.closed:
            raise MoriStateError(f"{func}: comm was destroyed")
        if (comm.rank, comm.nranks) != (my_pe, npes):
            raise bad_value(
                func, "my_pe/npes", (my_pe, npes), f"comm's rank and size ({comm.rank}, {comm.nranks})"
            )
        return comm, False
    import mori.shmem as shmem

    if not shmem.shmem_is_initialized():
        raise MoriStateError(
            f"{func}: mori.shmem is not initialised (shmem_torch_process_group_init / shmem_init_attr), and no "
            f"comm= was given: the collective needs one of the two"
        )
    if (shmem.shmem_mype(), shmem.shmem_npes()) != (my_pe, npes):
        raise bad_value(
            func,
            "my_pe/npes",
            (my_pe, npes),
            f"the SHMEM PE and size ({shmem.shmem_mype()}, {shmem.shmem_npes()})",
        )
    return _comm_over_shmem(my_pe, npes, need_bytes), True


def _comm_over_shmem(my_pe: int, npes: int, need_bytes: int) -> Communicator:
    """A new communicator of the SHMEM job: PE 0's unique id travels through the symmetric heap."""
    import mori.shmem as shmem

    n = UNIQUE_ID_BYTES
    buf = shmem.shmem_malloc(n)
    try:
        view = shmem.shmem_tensor_view(buf, n, torch.uint8)
        if my_pe == 0:
            raw = bytes(Communicator.get_unique_id())
            view.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        shmem.shmem_barrier_all()
        if my_pe != 0:
            shmem.shmem_getmem(buf, buf, n, 0)
        raw = bytes(view.cpu().tolist())
        shmem.shmem_barrier_all()  # PE 0's copy may be freed only once everybody read it
    finally:
        shmem.shmem_free(buf)
    return Communicator.init(npes, my_pe, UniqueId.from_bytes(raw), per_rank_vmm=need_bytes + (4 << 20))


class Channel:
    """Staging window, device communicator and protocol of one collective object (module docstring).

    ``small_cap`` / ``large_cap``: bytes of each small half and of the large region; ``programs``:
    ``P``, fixed for the object's life.
    """

    def __init__(
        self, func: str, comm: Communicator, *, small_cap: int, large_cap: int, programs: int, owned: bool
    ) -> None:
        if comm.lsa_size != comm.nranks:
            remote = [r for r in range(comm.nranks) if r not in comm.lsa_ranks]
            raise MoriBackendError(
                f"{func}: ranks {format_ranks(remote)} are not load/store reachable from rank {comm.rank} (other "
                f"nodes); collectives across nodes need {GDA_PENDING}"
            )
        self.func = func
        self.comm = comm
        self.owned = owned
        self.rank = comm.rank
        self.nranks = comm.nranks
        self.programs = programs
        self.small_cap = _round(small_cap)
        self.large_cap = _round(large_cap)
        self.small_off = 0
        self.large_off = 2 * self.small_cap
        self.nbytes = self.large_off + self.large_cap
        self.devcomm: DevCommHandle = comm.create_dev_comm(
            CCODevCommRequirements(lsa_barrier_count=2 * programs + 1)
        )
        self.mem: AllocatedMemory = comm.alloc_mem(self.nbytes)
        self.window: RegisteredWindow = comm.register_window(self.mem.ptr, self.nbytes)
        self.device = torch.device(comm.device)
        #: the kernels' ticket counter (local; the last program of a launch resets it)
        self.ticket = torch.zeros(1, dtype=torch.int32, device=self.device)
        #: uint8 views of every rank's staging window, as mapped here (host path)
        self.peer_bytes = [self.window.view(p) for p in range(self.nranks)]
        self.closed = False

    # indices of the protocol's LSA barriers
    def ready(self, k: int = 0) -> int:
        return k

    def ready2(self, k: int = 0) -> int:
        return self.programs + k

    @property
    def done(self) -> int:
        return 2 * self.programs

    def calls(self) -> int:
        """Calls made so far (host read of READY(0)'s epoch)."""
        return self.devcomm.lsa_barrier_epoch(0)

    def small_half(self, epoch: int) -> int:
        """Byte offset of the small half call number ``epoch`` uses."""
        return self.small_off + (epoch % 2) * self.small_cap

    def view(self, rank: int, offset: int, nbytes: int) -> torch.Tensor:
        return self.peer_bytes[rank][offset : offset + nbytes]

    def check_staged(self, func: str, nbytes: int, what: str) -> None:
        if nbytes > self.large_cap:
            raise bad_value(
                func,
                what,
                f"{nbytes} bytes",
                f"at most the transit buffer's {self.large_cap} bytes (transit_buffer_size)",
            )

    def reset(self) -> None:
        """Collective: forget every epoch (zero the protocol's barriers everywhere)."""
        self.comm.barrier()
        d = self.devcomm
        assert d._window is not None
        d._window.view().zero_()
        self.ticket.zero_()
        self.comm.barrier()  # fences first: the zeroes are in place everywhere after it

    def close(self) -> None:
        """Collective: free the staging (on a caller's communicator: deregister and free it; the
        device communicator's few barrier words stay until the communicator is destroyed)."""
        if self.closed:
            return
        self.closed = True
        if self.owned:
            self.comm.destroy()
        elif not self.comm.closed:
            self.comm.deregister_window(self.window)
            self.comm.free_mem(self.mem)


def reject_unknown(func: str, name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise MoriValueError(f"{func}: {name}={value!r} is not allowed; expected one of {', '.join(allowed)}")
    return str(value)

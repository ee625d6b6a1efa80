"""Device communicators: what a kernel needs to reach its peers, as one int64 tensor.

:meth:`Communicator.create_dev_comm <mori.cco.Communicator.create_dev_comm>` takes a
:class:`CCODevCommRequirements` (how many barriers, copy-engine queues, GDA resources) and returns a
:class:`DevCommHandle`. Its :attr:`~DevCommHandle.tensor` is the ``devcomm`` argument of kernels
that use :mod:`mori.cco.device` (the layout is in :mod:`mori.cco.layout`).

**GDA.** The ``gda_*`` fields and ``rail_gda_barrier_count`` are accepted as the original's. GDA
(device-initiated RDMA put/get/signal/counter to ranks on other nodes) is served through the proxy
of the transport layer (issue 14), which is not in this build: a device communicator that would
need a GDA connection (``GDA_CONNECTION_FULL``, or a cross-node or rail type in a communicator
that spans nodes, or world barriers across nodes) is refused with an error that says so. On one
node, ``GDA_CONNECTION_CROSSNODE`` and ``GDA_CONNECTION_RAIL`` need no connection and are
accepted; nothing in :mod:`mori.cco.device` issues GDA operations yet.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from mori.cco import env, layout
from mori.cco.sdma import SdmaEngine, SdmaQueue
from mori.core.errors import MoriBackendError, MoriValueError, bad_value, format_ranks

if TYPE_CHECKING:
    import torch

    from mori.cco.communicator import Communicator
    from mori.cco.windows import AllocatedMemory, RegisteredWindow

__all__ = [
    "GDA_CONNECTION_CROSSNODE",
    "GDA_CONNECTION_FULL",
    "GDA_CONNECTION_NONE",
    "GDA_CONNECTION_RAIL",
    "CCODevCommRequirements",
    "DevCommHandle",
]

#: gda_connection_type values (the original's names)
GDA_CONNECTION_NONE = 0
GDA_CONNECTION_CROSSNODE = 1
GDA_CONNECTION_FULL = 2
GDA_CONNECTION_RAIL = 3
_GDA_NAMES = {"none": 0, "crossnode": 1, "full": 2, "rail": 3}

#: most barriers of each kind per device communicator (slots are [count][ranks] int64)
MAX_BARRIERS = 4096
#: bound of every gda_* count (nothing allocates them yet; bounded like everything a caller sizes)
MAX_GDA_COUNT = 1 << 16


@dataclass
class CCODevCommRequirements:
    """What a device communicator must provide (all counts are per device communicator).

    Attributes:
        lsa_barrier_count: LSA barriers (``mori.cco.device.lsa_barrier_*``): independent barriers
            over the LSA team, e.g. one per program of a launch.
        barrier_count: world barriers (``mori.cco.device.barrier_sync``) over every rank; on one
            node they are LSA barriers over the whole team.
        sdma_queue_count: copy-engine queues; 0 takes ``MORI_SDMA_NUM_CHANNELS`` (default 2), at
            most 8. The communicator's first device communicator fixes it; later ones share those
            queues and must ask for 0 or the same number.
        gda_connection_type: ``GDA_CONNECTION_NONE`` (default), ``_CROSSNODE``, ``_FULL``, ``_RAIL``
            (``MORI_CCO_GDA_CONN`` overrides it).
        gda_context_count, gda_signal_count, gda_counter_count, gda_queue_depth, gda_traffic_class,
        rail_gda_barrier_count: GDA resources, accepted; GDA itself comes with the transport layer
            (issue 14, see the module docstring).
    """

    gda_connection_type: int = GDA_CONNECTION_NONE
    gda_context_count: int = 0
    gda_signal_count: int = 0
    gda_counter_count: int = 0
    gda_queue_depth: int = 0
    gda_traffic_class: int = 0
    lsa_barrier_count: int = 0
    rail_gda_barrier_count: int = 0
    sdma_queue_count: int = 0
    barrier_count: int = 0

    def validated(self) -> CCODevCommRequirements:
        """A checked copy: every field an int in its range (errors name the field)."""
        func = "CCODevCommRequirements"
        limits = {
            "gda_connection_type": (0, 3, "GDA_CONNECTION_NONE/CROSSNODE/FULL/RAIL (0-3)"),
            "lsa_barrier_count": (0, MAX_BARRIERS, f"an int in [0, {MAX_BARRIERS}]"),
            "barrier_count": (0, MAX_BARRIERS, f"an int in [0, {MAX_BARRIERS}]"),
            "sdma_queue_count": (
                0,
                env.MAX_SDMA_QUEUES,
                f"an int in [0, {env.MAX_SDMA_QUEUES}] (0: the default)",
            ),
            "gda_traffic_class": (0, 255, "an int in [0, 255]"),
        }
        for f in fields(self):
            value = getattr(self, f.name)
            lo, hi, allowed = limits.get(f.name, (0, MAX_GDA_COUNT, f"an int in [0, {MAX_GDA_COUNT}]"))
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise bad_value(func, f.name, value, allowed)
        out = CCODevCommRequirements(**{f.name: getattr(self, f.name) for f in fields(self)})
        override = env.MORI_CCO_GDA_CONN.get()
        if override is not None:
            out.gda_connection_type = _GDA_NAMES[str(override)]
        return out


class DevCommHandle:
    """A device communicator (from ``create_dev_comm``).

    Attributes:
        ptr: address of :attr:`tensor` (the original's handle value).
        rank, world_size: this rank and the communicator's size.
        lsa_size, lsa_rank: the LSA team's size and this rank's index in it.
        flat_base: 0: peers' heaps are mapped at separate addresses in each process (no flat
            virtual address range yet); kernels find them through the device communicator's
            table (``mori.cco.device.get_lsa_peer_ptr``).
        per_rank_size: bytes of every rank's heap.
        tensor: int64 ``[words]`` on the communicator's device: pass it as a kernel's ``devcomm``.
        requirements: what it was made with (checked, GDA override applied).
        sdma_queue_count: copy-engine queues it can use.
    """

    def __init__(
        self,
        comm: Communicator,
        tensor: torch.Tensor,
        requirements: CCODevCommRequirements,
        window: RegisteredWindow | None,
        mem: AllocatedMemory | None,
        sdma: SdmaEngine,
    ) -> None:
        self._comm = comm
        self.tensor = tensor
        self.ptr = int(tensor.data_ptr())
        self.rank = comm.rank
        self.world_size = comm.nranks
        self.lsa_size = comm.lsa_size
        self.lsa_rank = comm.lsa_rank
        self.flat_base = 0
        self.per_rank_size = comm.per_rank_size
        self.requirements = requirements
        self.sdma_queue_count = sdma.queues
        self._window = window
        self._mem = mem
        self._sdma = sdma
        self.closed = False

    def sdma_queue(self, index: int = 0) -> SdmaQueue:
        """Host side of copy-engine queue ``index`` (see :mod:`mori.cco.sdma`)."""
        n = self.sdma_queue_count
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n:
            raise bad_value("DevCommHandle.sdma_queue", "index", index, f"a queue in [0, {n})")
        return SdmaQueue(self._sdma, index)

    def _close(self) -> None:
        self.closed = True

    def __repr__(self) -> str:
        r = self.requirements
        return (
            f"DevCommHandle(rank {self.rank}/{self.world_size}, LSA {self.lsa_rank}/{self.lsa_size}, "
            f"{r.lsa_barrier_count} LSA barriers, {r.barrier_count} barriers, {self.sdma_queue_count} queues)"
        )


def _check_gda(comm: Communicator, reqs: CCODevCommRequirements) -> None:
    func = "Communicator.create_dev_comm"
    remote = [r for r in range(comm.nranks) if r not in comm.lsa_ranks]
    need = []
    if reqs.gda_connection_type == GDA_CONNECTION_FULL:
        need.append("gda_connection_type=GDA_CONNECTION_FULL (GDA to every rank, this node's too)")
    elif reqs.gda_connection_type in (GDA_CONNECTION_CROSSNODE, GDA_CONNECTION_RAIL) and remote:
        need.append(f"GDA connections to ranks {format_ranks(remote)} on other nodes")
    if remote and reqs.barrier_count:
        need.append(f"barrier_count={reqs.barrier_count} world barriers across nodes")
    if remote and reqs.rail_gda_barrier_count:
        need.append(f"rail_gda_barrier_count={reqs.rail_gda_barrier_count}")
    if need:
        from mori.cco.communicator import GDA_PENDING

        raise MoriBackendError(
            f"{func}: {'; '.join(need)} asked for, but {GDA_PENDING}. On one node use LSA barriers and the "
            f"copy-engine queues (gda_connection_type=GDA_CONNECTION_NONE)"
        )


def create_dev_comm(comm: Communicator, requirements: CCODevCommRequirements) -> DevCommHandle:
    """Build a device communicator (collective); see :meth:`Communicator.create_dev_comm`."""
    import torch

    func = "Communicator.create_dev_comm"
    reqs = requirements.validated()
    _check_gda(comm, reqs)
    # the copy-engine queues: made by the first device communicator, shared by the later ones
    queues = reqs.sdma_queue_count or env.MORI_SDMA_NUM_CHANNELS.require()
    if comm._sdma is not None and reqs.sdma_queue_count and reqs.sdma_queue_count != comm._sdma.queues:
        raise MoriValueError(
            f"{func}: sdma_queue_count={reqs.sdma_queue_count}, but the communicator's first device "
            f"communicator fixed {comm._sdma.queues} queues; ask for 0 or {comm._sdma.queues}"
        )
    # A collective first step: every rank asks for the same resources (the sizes below depend on it).
    shape = [reqs.lsa_barrier_count, reqs.barrier_count, queues if comm._sdma is None else comm._sdma.queues]
    comm._collective(func, {"size": shape})
    if comm._sdma is None:
        comm._sdma = SdmaEngine(comm, queues, env.MORI_SDMA_QUEUE_DEPTH.require())
    sdma = comm._sdma
    lsa, world = comm.lsa_size, comm.nranks
    w = layout.SLOT_BYTES
    # one block: LSA barrier slots [Lb][lsa], world barrier slots [B][world], then this rank's
    # epochs of both (read and written only by this rank)
    lsa_slots = reqs.lsa_barrier_count * lsa * w
    world_slots = reqs.barrier_count * world * w
    epochs = (reqs.lsa_barrier_count + reqs.barrier_count) * w
    nbytes = lsa_slots + world_slots + epochs
    window: RegisteredWindow | None = None
    mem: AllocatedMemory | None = None
    if nbytes:
        mem = comm.alloc_mem(nbytes)
        comm.tensor(mem.ptr, nbytes).zero_()
        window = comm.register_window(mem.ptr, nbytes)  # collective: every rank zeroed its slots first
    words: list[int] = [0] * layout.DC_HEADER_WORDS
    words[layout.DC_RANK] = comm.rank
    words[layout.DC_WORLD_SIZE] = world
    words[layout.DC_LSA_SIZE] = lsa
    words[layout.DC_LSA_RANK] = comm.lsa_rank
    words[layout.DC_FLAT_BASE] = 0
    words[layout.DC_PER_RANK_SIZE] = comm.per_rank_size
    words[layout.DC_LSA_BARRIER_COUNT] = reqs.lsa_barrier_count
    words[layout.DC_BARRIER_COUNT] = reqs.barrier_count
    words[layout.DC_SDMA_QUEUE_COUNT] = sdma.queues
    words[layout.DC_SDMA_QUEUE_DEPTH] = sdma.depth

    def table(values: list[int]) -> int:
        at = len(words)
        words.extend(values)
        return at

    peers = window.peer_ptrs if window is not None else (0,) * lsa
    base = window.local_ptr if window is not None else 0
    words[layout.DC_LSA_RANKS_AT] = table(list(comm.lsa_ranks))
    words[layout.DC_HEAP_BASES_AT] = table([comm._bases[r] for r in comm.lsa_ranks])
    words[layout.DC_LSA_BARRIER_SLOTS_AT] = table(list(peers) if lsa_slots else [0] * lsa)
    words[layout.DC_LSA_BARRIER_EPOCHS] = base + lsa_slots + world_slots if reqs.lsa_barrier_count else 0
    words[layout.DC_WORLD_BARRIER_SLOTS_AT] = table(
        [p + lsa_slots for p in peers] if world_slots else [0] * lsa
    )
    words[layout.DC_WORLD_BARRIER_EPOCHS] = (
        base + lsa_slots + world_slots + reqs.lsa_barrier_count * w if reqs.barrier_count else 0
    )
    words[layout.DC_SDMA_SIGNALS_AT] = table(list(sdma.window.peer_ptrs))
    words[layout.DC_SDMA_RINGS] = sdma.rings_addr
    words[layout.DC_SDMA_DOORBELL] = sdma.doorbell_addr
    words[layout.DC_SDMA_RESERVED] = sdma.reserved_addr
    tensor = torch.tensor(words, dtype=torch.int64, device=comm.device)
    return DevCommHandle(comm, tensor, reqs, window, mem, sdma)

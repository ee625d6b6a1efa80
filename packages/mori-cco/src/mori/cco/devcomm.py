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

import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from mori.cco import env, layout
from mori.cco.sdma import SdmaEngine, SdmaQueue
from mori.cco.waits import wait_ge, wake
from mori.core.backend import OP_FETCH, OP_SET, WORD_INT64
from mori.core.errors import (
    MoriBackendError,
    MoriStateError,
    MoriTimeoutError,
    MoriValueError,
    bad_value,
    format_ranks,
)

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

    # -- LSA barriers from the host (the same barriers kernels use) ---------------------------------

    def _lsa_barrier(self, func: str, index: Any) -> int:
        if self.closed or self._comm.closed:
            raise MoriStateError(f"{func}: the device communicator's communicator was destroyed")
        n = self.requirements.lsa_barrier_count
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n:
            raise bad_value(func, "index", index, f"an LSA barrier in [0, {n}) (lsa_barrier_count={n})")
        return index

    def _lsa_epoch_addr(self, index: int) -> int:
        assert self._window is not None  # lsa_barrier_count > 0 allocates it
        r = self.requirements
        return (
            self._window.local_ptr
            + (r.lsa_barrier_count * self.lsa_size + r.barrier_count * self.world_size + index) * 8
        )

    def _lsa_slot_addr(self, member: int, index: int, of: int) -> int:
        assert self._window is not None
        return self._window.peer_ptrs[member] + (index * self.lsa_size + of) * 8

    def lsa_barrier_epoch(self, index: int) -> int:
        """How often this rank arrived at LSA barrier ``index`` (host or device)."""
        index = self._lsa_barrier("DevCommHandle.lsa_barrier_epoch", index)
        return int(self._comm._runtime.atomic_rmw(self._lsa_epoch_addr(index), OP_FETCH, WORD_INT64, 0))

    def lsa_barrier_arrive(self, index: int) -> int:
        """Arrive at LSA barrier ``index`` from the host: the barrier kernels use
        (:func:`mori.cco.device.lsa_barrier_arrive`), so host and device arrivals count alike.
        Memory this process wrote before (host stores, completed device work) is visible to a peer
        once its wait returns. Returns the new epoch."""
        index = self._lsa_barrier("DevCommHandle.lsa_barrier_arrive", index)
        rt = self._comm._runtime
        addr = self._lsa_epoch_addr(index)
        epoch = int(rt.atomic_rmw(addr, OP_FETCH, WORD_INT64, 0)) + 1
        rt.atomic_rmw(addr, OP_SET, WORD_INT64, epoch)
        rt.fence()
        polite = self._comm._polite and rt.torch_device == "cpu"
        for member in range(self.lsa_size):
            slot = self._lsa_slot_addr(member, index, self.lsa_rank)
            rt.atomic_rmw(slot, OP_SET, WORD_INT64, epoch)
            if polite:
                wake(slot)  # a peer may sleep on it (mori.cco.waits)
        return epoch

    def lsa_barrier_wait(
        self, index: int, *, timeout: float | None = None, members: Sequence[int] | None = None
    ) -> None:
        """Wait until every LSA peer arrived at LSA barrier ``index`` as often as this rank did.

        ``members``: wait for these LSA ranks only (default: all), e.g. the one whose work this
        rank depends on next. Raises :class:`~mori.core.errors.MoriTimeoutError` naming the late
        ranks after ``timeout`` seconds (default ``MORI_BOOTSTRAP_TIMEOUT``)."""
        func = "DevCommHandle.lsa_barrier_wait"
        index = self._lsa_barrier(func, index)
        wanted = range(self.lsa_size) if members is None else members
        for member in wanted:
            if isinstance(member, bool) or not isinstance(member, int) or not 0 <= member < self.lsa_size:
                raise bad_value(func, "members", list(wanted), f"LSA ranks in [0, {self.lsa_size})")
        rt = self._comm._runtime
        epoch = int(rt.atomic_rmw(self._lsa_epoch_addr(index), OP_FETCH, WORD_INT64, 0))
        limit = self._comm.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        for member in wanted:
            addr = self._lsa_slot_addr(self.lsa_rank, index, member)
            ok, _ = wait_ge(rt, addr, epoch, max(0.0, deadline - time.monotonic()), polite=self._comm._polite)
            if not ok:
                late = [
                    self._comm.lsa_ranks[m]
                    for m in wanted
                    if rt.atomic_rmw(self._lsa_slot_addr(self.lsa_rank, index, m), OP_FETCH, WORD_INT64, 0)
                    < epoch
                ]
                raise MoriTimeoutError(
                    f"{func}: ranks {format_ranks(late)} did not arrive at LSA barrier {index} (epoch {epoch}) "
                    f"within {limit:g} s; this is rank {self.rank}",
                    late,
                )

    def lsa_barrier_sync(self, index: int, *, timeout: float | None = None) -> None:
        """:meth:`lsa_barrier_arrive` then :meth:`lsa_barrier_wait`."""
        self.lsa_barrier_arrive(index)
        self.lsa_barrier_wait(index, timeout=timeout)

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
        comm._runtime.fence()  # zeroed before any peer can arrive (a GPU zeroes asynchronously)
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

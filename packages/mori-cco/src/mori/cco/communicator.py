"""The explicit communicator of MORI-CCO: ranks, a per-rank heap, windows, device communicators.

A :class:`Communicator` is made collectively by ``nranks`` processes from one :class:`UniqueId`
(:meth:`Communicator.init`). Each rank owns a heap of ``per_rank_vmm`` bytes in the memory of the
device runtime (``MORI_DEVICE_RUNTIME``: POSIX shared memory on the ``cpu`` runtime, GPU memory
on ``cuda``/``hip``); the ranks of one node that load/store can reach (the **LSA team**) map each
other's heaps. Memory comes from :meth:`~Communicator.alloc_mem` (local) and becomes reachable
by peers once registered as a window (:meth:`~Communicator.register_window`, collective).
Kernels get a device communicator (:meth:`~Communicator.create_dev_comm`) and the device API of
:mod:`mori.cco.device`.

Several communicators may live in one process, each with its own rendezvous, heap and windows;
each serialises its own calls with a lock, so threads may share one. Collective calls
(``init``, ``register_window``, ``register_external_window``, ``deregister_window``,
``create_dev_comm``, ``barrier``, ``destroy``) must be made by every rank, in the same order.
Every wait for peers gives up after ``MORI_BOOTSTRAP_TIMEOUT`` seconds naming the ranks that did
not arrive.

Ranks on other nodes (another ``MORI_NODE_ID``) are members of the communicator but not of the
LSA team: they are reached by GDA, which is served through the proxy of the transport layer
(issue 14) and not available in this build; calls that would need it say so.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

from mori.cco import layout
from mori.cco.unique_id import UniqueId
from mori.cco.waits import oversubscribed, wait_ge, wake
from mori.cco.windows import AllocatedMemory, ImportedWindow, RegisteredWindow, ShmImport, find_shm_range
from mori.core import bootstrap, env
from mori.core.backend import (
    OP_FETCH,
    OP_SET,
    WORD_INT64,
    DeviceRuntime,
    HeapSegment,
    PeerInfo,
    PeerSegment,
    Transport,
)
from mori.core.errors import (
    MoriBackendError,
    MoriOutOfMemoryError,
    MoriStateError,
    MoriTimeoutError,
    MoriValueError,
    bad_type,
    bad_value,
    format_ranks,
)
from mori.core.plugins import get_plugins, select
from mori.core.topology import node_id
from mori.shmem.heap import MIN_ALIGN, HeapAllocator

if TYPE_CHECKING:
    import torch

    from mori.cco.devcomm import CCODevCommRequirements, DevCommHandle
    from mori.cco.sdma import SdmaEngine

__all__ = ["DEFAULT_PER_RANK_VMM", "GDA_PENDING", "Communicator"]

#: default heap of every rank: 4 GiB (sparse shared memory on the cpu runtime; allocated up front
#: on a GPU, where mori-core has no VMM heap yet: pass what you need)
DEFAULT_PER_RANK_VMM = 4 << 30
#: heaps are sized in, and mapped at, multiples of this
HEAP_ALIGN = 2 << 20
#: largest alignment alloc_mem can promise (heaps are mapped at multiples of HEAP_ALIGN)
MAX_ALIGN = HEAP_ALIGN
#: what errors say about cross-node (GDA) operations
GDA_PENDING = (
    "GDA (device-initiated RDMA to ranks on other nodes) is served through the proxy of the "
    "transport layer (issue 14), which is not in this build yet"
)

_names = itertools.count()
_by_name: weakref.WeakValueDictionary[str, Communicator] = weakref.WeakValueDictionary()
_by_name_lock = threading.Lock()


def _positive_int(func: str, arg: str, value: Any, allowed: str = "an int > 0") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise bad_value(func, arg, value, allowed)
    return value


class Communicator:
    """A communicator over ``nranks`` processes (see the module docstring). Make it with
    :meth:`init`; use it as a context manager or call :meth:`destroy`.

    Attributes:
        rank, nranks: this rank and the world size (read-only, like every attribute here).
        lsa_rank, lsa_size, lsa_ranks: this rank's index in its LSA team, the team's size and its
            members' global ranks (ascending).
        per_rank_size: bytes of every rank's heap.
        ptr: address of this rank's heap (the base its allocations lie in).
        device: the torch device of the heap (``"cpu"``, ``"cuda:0"``, ...).
        name: a name unique in this process (how :mod:`mori.ccl.torch_ops` finds it).
    """

    def __init__(self, _key: object, boot: bootstrap.StoreBootstrap, per_rank: int) -> None:
        if _key is not _INIT_KEY:
            raise MoriStateError("Communicator: make one with Communicator.init(nranks, rank, uid)")
        self._boot = boot
        self.rank = boot.rank
        self.nranks = boot.nranks
        self.per_rank_size = per_rank
        self.timeout_s: float = boot.timeout_s
        self._lock = threading.RLock()
        self._closed = False
        plugins = get_plugins()
        found = select("device runtime", plugins.runtimes(), env.MORI_DEVICE_RUNTIME.require())
        if not isinstance(found.backend, DeviceRuntime):
            raise MoriBackendError(
                f"plugin '{found.plugin.name}' returned a {type(found.backend).__name__} as a device runtime"
            )
        self._runtime: DeviceRuntime = found.backend
        self._transports: list[Transport] = [
            f.backend
            for f in plugins.transports()
            if f.availability.usable and isinstance(f.backend, Transport)
        ]
        self._segment: HeapSegment | None = None
        self._peer_segments: list[PeerSegment | None] = [None] * self.nranks
        #: address of every rank's heap in this process, 0 if it is not load/store reachable
        self._bases: list[int] = [0] * self.nranks
        self._infos: list[PeerInfo] = []
        self._alloc = HeapAllocator(layout.USER_OFF, per_rank)
        self._windows: list[RegisteredWindow] = []
        self._devcomms: list[DevCommHandle] = []
        #: copy-engine queues, rings and thread: made by the first device communicator
        self._sdma: SdmaEngine | None = None
        self._barrier_epoch = 0
        self._seq = 0  # collective calls so far (every rank counts the same)
        self.lsa_ranks: tuple[int, ...] = (self.rank,)
        self.lsa_rank = 0
        self._polite = False
        with _by_name_lock:
            self.name = f"cco{next(_names)}"
            _by_name[self.name] = self
        try:
            self._setup()
        except BaseException:
            self._teardown()
            raise

    # -- making one ---------------------------------------------------------------------------------

    @staticmethod
    def get_unique_id() -> UniqueId:
        """A new :class:`UniqueId`: starts the rendezvous store (a torch ``TCPStore``) in this process,
        which must stay alive until every rank has called :meth:`init`. Not collective; usually
        rank 0 calls it and sends the id to the others. ``MORI_SOCKET_IFNAME`` picks the interface
        whose address goes into the id."""
        return UniqueId(bootstrap.get_unique_id())

    @classmethod
    def init(
        cls,
        nranks: int,
        rank: int,
        uid: UniqueId | bytes,
        per_rank_vmm: int = DEFAULT_PER_RANK_VMM,
    ) -> Communicator:
        """Join the communicator named by ``uid`` as ``rank`` of ``nranks``. Collective, host-blocking.

        ``per_rank_vmm``: bytes of this rank's heap (rounded up to 2 MiB; the same on every rank).
        On the ``cpu`` runtime the heap is POSIX shared memory that costs only the pages written;
        on a GPU it is allocated at once on the current torch device (call
        ``torch.cuda.set_device`` first). Waits at most ``MORI_BOOTSTRAP_TIMEOUT`` seconds for the
        other ranks, then raises :class:`~mori.core.errors.MoriTimeoutError` naming them.
        """
        func = "Communicator.init"
        _positive_int(func, "nranks", nranks, f"an int in [1, {layout.MAX_RANKS}]")
        if nranks > layout.MAX_RANKS:
            raise bad_value(func, "nranks", nranks, f"an int in [1, {layout.MAX_RANKS}]")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < nranks:
            raise bad_value(func, "rank", rank, f"an int in [0, {nranks})")
        if isinstance(uid, (bytes, bytearray, memoryview)):
            uid = UniqueId.from_bytes(uid)
        if not isinstance(uid, UniqueId):
            raise bad_type(func, "uid", uid, "a UniqueId from Communicator.get_unique_id() (or its bytes)")
        _positive_int(func, "per_rank_vmm", per_rank_vmm, f"a number of bytes >= {2 * layout.USER_OFF}")
        if per_rank_vmm < 2 * layout.USER_OFF:
            raise bad_value(func, "per_rank_vmm", per_rank_vmm, f"a number of bytes >= {2 * layout.USER_OFF}")
        per_rank = -(-per_rank_vmm // HEAP_ALIGN) * HEAP_ALIGN
        boot = bootstrap.from_unique_id(rank, nranks, bytes(uid), func=func)
        try:
            return cls(_INIT_KEY, boot, per_rank)
        except BaseException:
            boot.close()
            raise

    def _setup(self) -> None:
        func = "Communicator.init"
        # the job's id first: every name a runtime derives from it groups by job (mori-heap.<job>.*)
        tag = f"{self._boot.job_id}.{self.rank}"
        try:
            self._segment = self._runtime.create_segment(self.per_rank_size, tag)
        except MoriOutOfMemoryError as e:  # the runtime's text speaks of mori.shmem's variable
            raise MoriOutOfMemoryError(
                f"{func}: per_rank_vmm={self.per_rank_size} bytes cannot be allocated for this rank's heap on "
                f"the {self._runtime.name} runtime; lower per_rank_vmm ({e})"
            ) from e
        self._bases[self.rank] = self._segment.addr
        me = PeerInfo(
            rank=self.rank,
            node_id=node_id(),
            hostname=socket.gethostname(),
            pid=os.getpid(),
            runtime=self._runtime.name,
            heap_size=self.per_rank_size,
            segment_handle=self._segment.handle,
        )
        raw = self._boot.allgather(_encode_peer(me), what=f"{func} (heap exchange)")
        infos = [_decode_peer(func, p, r) for p, r in enumerate(raw)]
        odd = [i.rank for i in infos if i.heap_size != self.per_rank_size]
        if odd:
            raise MoriValueError(
                f"{func}: per_rank_vmm differs between ranks: this rank {self.rank} has {self.per_rank_size} "
                f"bytes, ranks {format_ranks(odd)} have {sorted({infos[r].heap_size for r in odd})}; it must be "
                f"the same on every rank"
            )
        other_runtime = [i.rank for i in infos if i.runtime != self._runtime.name]
        if other_runtime:
            raise MoriValueError(
                f"{func}: ranks {format_ranks(other_runtime)} use the device runtime "
                f"{sorted({infos[r].runtime for r in other_runtime})}, this rank {self.rank} uses "
                f"{self._runtime.name!r}; set MORI_DEVICE_RUNTIME the same everywhere"
            )
        self._infos = infos
        disable_p2p = env.MORI_DISABLE_P2P.require()
        unreachable: dict[int, str] = {}
        for info in infos:
            if info.rank == self.rank or info.node_id != me.node_id:
                continue
            for transport in self._transports:
                if disable_p2p and transport.load_store:
                    continue
                if not transport.load_store:
                    continue  # only load/store peers are LSA; the rest is GDA's (issue 14)
                seg = transport.connect(self._runtime, me, info)
                if seg is not None:
                    self._peer_segments[info.rank] = seg
                    self._bases[info.rank] = seg.addr
                    break
            else:
                why = [getattr(t, "unreachable", {}).get(info.rank) for t in self._transports]
                unreachable[info.rank] = (
                    "; ".join(w for w in why if w) or "no load/store transport connects them"
                )
        # The LSA team: this node's ranks that load/store reach. Every member must see the same team.
        team = tuple(r for r in range(self.nranks) if self._bases[r])
        views = self._boot.allgather(json.dumps(team).encode(), what=f"{func} (LSA teams)")
        disagree = []
        for r in team:
            theirs = tuple(json.loads(views[r]))
            if theirs != team:
                disagree.append(f"rank {r} sees {list(theirs)}")
        if disagree or (unreachable and not disable_p2p):
            detail = "; ".join(f"rank {r}: {why}" for r, why in unreachable.items())
            raise MoriBackendError(
                f"{func}: the ranks of node {me.node_id} cannot all load/store each other's memory "
                f"(this rank {self.rank} reaches {list(team)}"
                + (f"; {'; '.join(disagree)}" if disagree else "")
                + (f"; unreachable: {detail}" if detail else "")
                + "): GPUs without peer access, or a missing transport"
            )
        self.lsa_ranks = team
        self.lsa_rank = team.index(self.rank)
        #: host waits yield the core between polls when this node's ranks outnumber its CPUs
        self._polite = oversubscribed(len(team))
        # Nobody may drop the heap's name before every peer has mapped it.
        self._boot.barrier(what=f"{func} (heap mapping)")
        self._segment.seal()

    # -- properties ---------------------------------------------------------------------------------

    @property
    def lsa_size(self) -> int:
        return len(self.lsa_ranks)

    @property
    def ptr(self) -> int:
        return self._bases[self.rank]

    @property
    def device(self) -> str:
        return self._runtime.torch_device_of_heap()

    @property
    def runtime_name(self) -> str:
        """The device runtime of the heap (``cpu``, ``cuda``, ``hip``)."""
        return self._runtime.name

    @property
    def closed(self) -> bool:
        return self._closed

    def node_ids(self) -> list[str]:
        """The node id of every rank, in rank order."""
        return [i.node_id for i in self._infos]

    def __repr__(self) -> str:
        state = "destroyed" if self._closed else f"{self._runtime.name}, LSA {self.lsa_rank}/{self.lsa_size}"
        return f"Communicator({self.name}: rank {self.rank} of {self.nranks}, {state})"

    # -- local memory -------------------------------------------------------------------------------

    def alloc_mem(self, size: int, *, alignment: int = MIN_ALIGN) -> AllocatedMemory:
        """``size`` bytes of this rank's heap (``alignment``: a power of two up to 2 MiB, default 256).

        Local, not collective: register the memory as a window to let peers reach it. Contents are
        undefined. Raises :class:`~mori.core.errors.MoriOutOfMemoryError` when the heap
        (``per_rank_vmm``) has no room.
        """
        func = "Communicator.alloc_mem"
        _positive_int(func, "size", size, "a number of bytes > 0")
        if (
            isinstance(alignment, bool)
            or not isinstance(alignment, int)
            or alignment <= 0
            or alignment & (alignment - 1)
            or alignment > MAX_ALIGN
        ):
            raise bad_value(func, "alignment", alignment, f"a power of two in [1, {MAX_ALIGN}]")
        with self._lock:
            self._check_open(func)
            block = self._alloc.allocate(size, alignment)
            if block is None:
                raise MoriOutOfMemoryError(
                    f"{func}: cannot allocate {size} bytes (aligned {alignment}): the heap has "
                    f"{self._alloc.free_bytes} bytes free, largest free block {self._alloc.largest_free}; "
                    f"raise per_rank_vmm (now {self.per_rank_size})"
                )
            return AllocatedMemory(self.ptr + block.offset, size)

    def free_mem(self, mem: AllocatedMemory | int) -> None:
        """Give back memory from :meth:`alloc_mem` (local). Memory inside a registered window must
        be deregistered first."""
        func = "Communicator.free_mem"
        ptr = mem.ptr if isinstance(mem, AllocatedMemory) else mem
        if isinstance(ptr, bool) or not isinstance(ptr, int):
            raise bad_type(func, "mem", mem, "an AllocatedMemory or its ptr")
        with self._lock:
            self._check_open(func)
            off = ptr - self.ptr
            if off not in self._alloc.live:
                raise bad_value(func, "mem", f"{ptr:#x}", "memory returned by alloc_mem and not freed yet")
            size = self._alloc.live[off]
            for w in self._windows:
                if not w.closed and w.local_ptr < ptr + size and ptr < w.local_ptr + w.size:
                    raise MoriStateError(f"{func}: {ptr:#x} is inside {w!r}; deregister_window it first")
            self._alloc.release(off)

    def tensor(self, ptr: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over ``nbytes`` at ``ptr`` of this rank's heap (or a peer's, as mapped
        here), on the heap's device. No copy. Not collective."""
        func = "Communicator.tensor"
        self._check_open(func)
        self._check_reachable(func, "ptr", ptr, nbytes)
        return self._runtime.byte_view(ptr, nbytes)

    def _check_reachable(self, func: str, arg: str, ptr: Any, nbytes: int) -> None:
        if isinstance(ptr, bool) or not isinstance(ptr, int):
            raise bad_type(func, arg, ptr, "an address (int)")
        for r in self.lsa_ranks:
            base = self._bases[r]
            if base <= ptr and ptr + nbytes <= base + self.per_rank_size:
                return
        for w in self._windows:
            if w.closed:
                continue
            for p in w.peer_ptrs:
                if p <= ptr and ptr + nbytes <= p + w.size:
                    return
        raise MoriValueError(
            f"{func}: {arg}={ptr:#x} (+{nbytes} bytes) is neither in an LSA peer's heap nor in a window"
        )

    # -- windows ------------------------------------------------------------------------------------

    def register_window(self, ptr: int, size: int) -> RegisteredWindow:
        """Make ``[ptr, ptr+size)`` reachable by every LSA peer. Collective: every rank registers, in
        the same order, a range of the same ``size`` (its address may differ).

        ``ptr``: memory from :meth:`alloc_mem`; on a GPU runtime also any device memory of torch's
        default allocator (shared with the driver's IPC). Returns the :class:`RegisteredWindow`
        (its ``table`` is what kernels take). Freed by :meth:`deregister_window` or :meth:`destroy`.
        """
        func = "Communicator.register_window"
        _positive_int(func, "size", size, "a number of bytes > 0")
        if isinstance(ptr, bool) or not isinstance(ptr, int) or ptr <= 0:
            raise bad_value(func, "ptr", ptr, "the address (int > 0) of memory from alloc_mem")
        with self._lock:
            self._check_open(func)
            mine = self._describe_local(func, ptr, size)
            entries = self._collective(func, {"size": size, **mine})
            peer_ptrs: list[int] = []
            closers: list[Callable[[], None]] = []
            try:
                for r in self.lsa_ranks:
                    if r == self.rank:
                        peer_ptrs.append(ptr)
                        continue
                    entry = entries[r]
                    if entry.get("kind") == "heap":
                        off = entry.get("offset")
                        if (
                            isinstance(off, bool)
                            or not isinstance(off, int)
                            or off < layout.USER_OFF
                            or off + size > self.per_rank_size
                        ):
                            raise MoriValueError(
                                f"{func}: rank {r} sent the heap offset {off!r}, outside its heap"
                            )
                        peer_ptrs.append(self._bases[r] + off)
                    elif entry.get("kind") == "range":
                        opener = getattr(self._runtime, "open_range", None)
                        if opener is None:
                            raise MoriValueError(
                                f"{func}: rank {r} registered device memory this runtime cannot map"
                            )
                        seg = opener(bytes.fromhex(str(entry.get("handle", ""))))
                        closers.append(seg.close)
                        if seg.size < size:
                            raise MoriValueError(
                                f"{func}: rank {r}'s range holds {seg.size} bytes, not {size}"
                            )
                        peer_ptrs.append(seg.addr)
                    else:
                        raise MoriValueError(f"{func}: rank {r} sent a window of kind {entry.get('kind')!r}")
                win = RegisteredWindow(self, ptr, size, peer_ptrs, self._table(peer_ptrs), closers)
            except BaseException:
                for close in reversed(closers):
                    close()
                raise
            self._windows.append(win)
            return win

    def _describe_local(self, func: str, ptr: int, size: int) -> dict[str, Any]:
        off = ptr - self.ptr
        if layout.USER_OFF <= off < self.per_rank_size:
            block = self._alloc.containing(off)
            if block is None or off + size > block.offset + block.size:
                raise MoriValueError(
                    f"{func}: [{ptr:#x}, +{size}) is not inside one block from alloc_mem"
                    + (
                        f" (the block at {self.ptr + block.offset:#x} holds {block.size} bytes)"
                        if block
                        else ""
                    )
                )
            return {"kind": "heap", "offset": off}
        exporter = getattr(self._runtime, "export_range", None)
        if exporter is None:
            raise MoriValueError(
                f"{func}: ptr={ptr:#x} is not in this communicator's heap: on the {self._runtime.name} runtime "
                f"peers can only map memory from alloc_mem (or shared memory, with register_external_window)"
            )
        return {"kind": "range", "handle": bytes(exporter(ptr, size)).hex()}

    def register_external_window(
        self, ext_ptr: Any, size: int | None = None, *, group: Any = None
    ) -> ImportedWindow:
        """Import memory this communicator did not allocate as a window, zero-copy. Collective.

        * ``cpu`` runtime: ``ext_ptr`` (int) lies in a shared mapping of a POSIX shared-memory file
          under /dev/shm that still has its name (``multiprocessing.shared_memory``, ``shm_open``,
          another process's segment); every peer maps the same bytes of its rank's file.
        * GPU runtimes: ``ext_ptr`` is a torch symmetric-memory tensor (``symm_mem.empty``) and
          ``group`` its process group (or group name); the tensor is rendezvoused with torch and
          the peers' buffers come from torch's handle. Group rank ``i`` must be rank ``i`` here.

        ``size``: bytes (a tensor's own size by default), the same on every rank. Returns an
        :class:`~mori.cco.ImportedWindow`; the memory must outlive it.
        """
        func = "Communicator.register_external_window"
        with self._lock:
            self._check_open(func)
            if self._runtime.torch_device == "cpu":
                return self._import_shm(func, ext_ptr, size)
            return self._import_symm_mem(func, ext_ptr, size, group)

    def _import_shm(self, func: str, ext_ptr: Any, size: int | None) -> ImportedWindow:
        if hasattr(ext_ptr, "data_ptr"):
            if size is None:
                size = int(ext_ptr.numel() * ext_ptr.element_size())
            ext_ptr = int(ext_ptr.data_ptr())
        if isinstance(ext_ptr, bool) or not isinstance(ext_ptr, int) or ext_ptr <= 0:
            raise bad_value(func, "ext_ptr", ext_ptr, "the address (int > 0) of shared memory")
        if size is None:
            raise bad_value(func, "size", size, "a number of bytes > 0 (needed with an int ext_ptr)")
        _positive_int(func, "size", size, "a number of bytes > 0")
        where = find_shm_range(func, ext_ptr, size)
        entries = self._collective(func, {"size": size, "name": where.name, "offset": where.file_offset})
        peer_ptrs: list[int] = []
        closers: list[Callable[[], None]] = []
        try:
            for r in self.lsa_ranks:
                if r == self.rank:
                    peer_ptrs.append(ext_ptr)
                    continue
                imp = ShmImport(func, r, entries[r].get("name"), entries[r].get("offset"), size)
                closers.append(imp.close)
                peer_ptrs.append(imp.addr)
            win = ImportedWindow(
                self,
                ext_ptr,
                size,
                peer_ptrs,
                self._table(peer_ptrs),
                closers,
                source=f"shm:/dev/shm/{where.name}",
            )
        except BaseException:
            for close in reversed(closers):
                close()
            raise
        self._windows.append(win)
        return win

    def _import_symm_mem(self, func: str, tensor: Any, size: int | None, group: Any) -> ImportedWindow:
        import torch

        if not isinstance(tensor, torch.Tensor):
            raise bad_type(
                func, "ext_ptr", tensor, "a torch symmetric-memory tensor (symm_mem.empty) on a GPU"
            )
        if group is None:
            raise bad_value(
                func, "group", group, "the process group (or its name) the tensor is symmetric over"
            )
        import torch.distributed._symmetric_memory as symm_mem

        nbytes = int(tensor.numel() * tensor.element_size())
        size = (
            nbytes
            if size is None
            else _positive_int(func, "size", size, f"a number of bytes in (0, {nbytes}]")
        )
        if size > nbytes:
            raise bad_value(func, "size", size, f"at most the tensor's {nbytes} bytes")
        handle = symm_mem.rendezvous(tensor, group)
        if (handle.world_size, handle.rank) != (self.nranks, self.rank):
            raise MoriValueError(
                f"{func}: the tensor's group has rank {handle.rank} of {handle.world_size}; this communicator "
                f"has rank {self.rank} of {self.nranks}: group rank i must be communicator rank i"
            )
        ptrs = [int(p) for p in handle.buffer_ptrs]
        offset = int(tensor.data_ptr()) - ptrs[self.rank]
        self._collective(func, {"size": size, "offset": offset})
        peer_ptrs = [ptrs[r] + offset for r in self.lsa_ranks]
        win = ImportedWindow(
            self, int(tensor.data_ptr()), size, peer_ptrs, self._table(peer_ptrs), [], source="torch.symm_mem"
        )
        win._symm_handle = handle  # type: ignore[attr-defined]  # keeps torch's mappings alive
        self._windows.append(win)
        return win

    def deregister_window(self, window: RegisteredWindow) -> None:
        """Undo :meth:`register_window` / :meth:`register_external_window`. Collective: waits until
        every rank deregisters it (so no peer still uses it), then unmaps the peers' copies."""
        func = "Communicator.deregister_window"
        if not isinstance(window, RegisteredWindow):
            raise bad_type(func, "window", window, "a RegisteredWindow of this communicator")
        with self._lock:
            self._check_open(func)
            if window not in self._windows or window.closed:
                raise bad_value(func, "window", window, "a live window of this communicator")
            index = self._windows.index(window)
            self._collective(func, {"index": index, "size": window.size})
            window._close()
            self._windows.remove(window)

    def _table(self, peer_ptrs: list[int]) -> torch.Tensor:
        import torch

        return torch.tensor(peer_ptrs, dtype=torch.int64, device=self.device)

    def _collective(self, func: str, mine: dict[str, Any]) -> list[dict[str, Any]]:
        """One checked collective step over the bootstrap: every rank must be making the same call
        (same ``func``, same sequence number, same ``size``) now. Returns every rank's entry."""
        self._seq += 1
        payload = {"seq": self._seq, "func": func, **mine}
        raw = self._boot.allgather(json.dumps(payload).encode(), what=f"{func} (call #{self._seq})")
        entries: list[dict[str, Any]] = []
        differ: list[str] = []
        for r, blob in enumerate(raw):
            try:
                entry = json.loads(blob)
                if not isinstance(entry, dict):
                    raise ValueError("not an object")
            except ValueError:
                raise MoriValueError(f"{func}: rank {r} sent a malformed message") from None
            entries.append(entry)
            ours = (entry.get("seq"), entry.get("func"), entry.get("size"))
            if ours != (self._seq, func, mine.get("size")):
                differ.append(
                    f"rank {r}: call #{entry.get('seq')} {entry.get('func')} size {entry.get('size')}"
                )
        if differ:
            raise MoriStateError(
                f"{func} is collective: every rank must make the same calls, in the same order, with the same "
                f"size. This rank {self.rank}: call #{self._seq} {func} size {mine.get('size')}; {'; '.join(differ)}"
            )
        return entries

    # -- device communicators -----------------------------------------------------------------------

    def create_dev_comm(self, requirements: CCODevCommRequirements | None = None) -> DevCommHandle:
        """A device communicator for kernels (collective). See :class:`~mori.cco.CCODevCommRequirements`
        for what it holds and :mod:`mori.cco.device` for the functions that use it. Freed with the
        communicator."""
        from mori.cco.devcomm import CCODevCommRequirements, create_dev_comm

        func = "Communicator.create_dev_comm"
        reqs = CCODevCommRequirements() if requirements is None else requirements
        if not isinstance(reqs, CCODevCommRequirements):
            raise bad_type(func, "requirements", requirements, "a CCODevCommRequirements")
        with self._lock:
            self._check_open(func)
            handle = create_dev_comm(self, reqs)
            self._devcomms.append(handle)
            return handle

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank contributes ``data`` (at most 64 KiB); every rank gets the list in rank order.
        Collective, out of band (the rendezvous store): for setup, not for data."""
        func = "Communicator.allgather_bytes"
        if not isinstance(data, bytes):
            raise bad_type(func, "data", data, "bytes")
        if len(data) > 64 << 10:
            raise bad_value(func, "data", f"<{len(data)} bytes>", "at most 65536 bytes")
        with self._lock:
            self._check_open(func)
            entries = self._collective(func, {"size": None, "data": data.hex()})
            out = []
            for r, e in enumerate(entries):
                try:
                    out.append(bytes.fromhex(str(e.get("data"))))
                except ValueError:
                    raise MoriValueError(f"{func}: rank {r} sent a malformed message") from None
            return out

    # -- barrier ------------------------------------------------------------------------------------

    def barrier(self) -> None:
        """Host barrier over every rank. Collective, host-blocking; memory written before it (by host
        or completed device work) is visible to every rank after it. Raises
        :class:`~mori.core.errors.MoriTimeoutError` naming the ranks that did not arrive within
        ``MORI_BOOTSTRAP_TIMEOUT`` seconds."""
        func = "Communicator.barrier"
        with self._lock:
            self._check_open(func)
            self._barrier(func)

    def _barrier(self, what: str) -> None:
        if self.lsa_size < self.nranks:
            self._runtime.fence()
            self._boot.barrier(what=what)
            return
        # Every rank writes its barrier number into its slot on every peer, then waits for all slots.
        self._barrier_epoch += 1
        epoch = self._barrier_epoch
        rt = self._runtime
        rt.fence()
        slot = layout.HOST_BARRIER_OFF + self.rank * layout.SLOT_BYTES
        polite = self._polite and rt.torch_device == "cpu"
        for r in self.lsa_ranks:
            rt.atomic_rmw(self._bases[r] + slot, OP_SET, WORD_INT64, epoch)
            if polite:
                wake(self._bases[r] + slot)  # a peer may sleep on it (mori.cco.waits)
        deadline = time.monotonic() + self.timeout_s
        for r in self.lsa_ranks:
            addr = self.ptr + layout.HOST_BARRIER_OFF + r * layout.SLOT_BYTES
            ok, _ = wait_ge(rt, addr, epoch, max(0.0, deadline - time.monotonic()), polite=self._polite)
            if not ok:
                late = [
                    q
                    for q in self.lsa_ranks
                    if rt.atomic_rmw(
                        self.ptr + layout.HOST_BARRIER_OFF + q * layout.SLOT_BYTES, OP_FETCH, WORD_INT64, 0
                    )
                    < epoch
                ]
                raise MoriTimeoutError(
                    f"{what}: ranks {format_ranks(late)} of {self.nranks} did not arrive within {self.timeout_s:g} s "
                    f"(MORI_BOOTSTRAP_TIMEOUT); this is rank {self.rank}",
                    late,
                )

    # -- teardown -----------------------------------------------------------------------------------

    def destroy(self) -> None:
        """Free everything this communicator holds: device communicators (and their copy thread),
        windows, imported mappings, the heap. Collective: a barrier first, so no peer still reads
        this rank's memory; the resources are freed even if the barrier fails (a peer died), and
        the barrier's error is raised after. Calling it again does nothing."""
        with self._lock:
            if self._closed:
                return
            try:
                self._barrier("Communicator.destroy")
            finally:
                self._teardown()

    def _teardown(self) -> None:
        self._closed = True
        if self._sdma is not None:
            self._sdma.close()
            self._sdma = None
        for dc in self._devcomms:
            dc._close()
        self._devcomms.clear()
        for w in reversed(self._windows):
            w._close()
        self._windows.clear()
        for seg in self._peer_segments:
            if seg is not None:
                seg.close()
        self._peer_segments = [None] * self.nranks
        self._bases = [0] * self.nranks
        if self._segment is not None:
            self._segment.close()
            self._segment = None
        self._boot.close()
        with _by_name_lock:
            if _by_name.get(self.name) is self:
                del _by_name[self.name]

    def _check_open(self, func: str) -> None:
        if self._closed:
            raise MoriStateError(f"{func}: the communicator was destroyed")

    def __enter__(self) -> Communicator:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.destroy()
        else:
            # leaving on an error: free the memory without waiting for peers that may never come
            with self._lock:
                if not self._closed:
                    self._teardown()

    @staticmethod
    def by_name(name: str) -> Communicator:
        """The live communicator of this process called ``name`` (see :attr:`name`)."""
        with _by_name_lock:
            comm = _by_name.get(name)
        if comm is None or comm._closed:
            raise bad_value(
                "Communicator.by_name", "name", name, "the name of a live communicator of this process"
            )
        return comm


_INIT_KEY = object()


def _encode_peer(info: PeerInfo) -> bytes:
    return json.dumps(
        {
            "rank": info.rank,
            "node_id": info.node_id,
            "hostname": info.hostname,
            "pid": info.pid,
            "runtime": info.runtime,
            "heap_size": info.heap_size,
            "segment_handle": info.segment_handle.hex(),
        }
    ).encode()


def _decode_peer(func: str, rank: int, raw: bytes) -> PeerInfo:
    # what a peer sends is checked field by field before anything uses it
    try:
        d = json.loads(raw)
        info = PeerInfo(
            rank=int(d["rank"]),
            node_id=str(d["node_id"]),
            hostname=str(d["hostname"]),
            pid=int(d["pid"]),
            runtime=str(d["runtime"]),
            heap_size=int(d["heap_size"]),
            segment_handle=bytes.fromhex(str(d["segment_handle"])),
        )
    except (ValueError, KeyError, TypeError) as e:
        raise MoriValueError(f"{func}: rank {rank} sent a malformed description of itself ({e})") from None
    if info.rank != rank:
        raise MoriValueError(
            f"{func}: the rendezvous slot of rank {rank} holds rank {info.rank}'s description"
        )
    return info

"""The state of an initialised SHMEM job in this process: bootstrap, heap segment, peers.

There is at most one :class:`ShmemContext` per process (``current()``); ``shmem_init_*`` creates it
and ``shmem_finalize`` destroys it, after which a new init works.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from mori.core import env
from mori.core.backend import (
    CMP_GE,
    OP_FETCH,
    OP_SET,
    WORD_INT64,
    DeviceRuntime,
    HeapSegment,
    PeerInfo,
    PeerSegment,
    Transport,
)
from mori.core.bootstrap import StoreBootstrap
from mori.core.errors import (
    MoriBackendError,
    MoriStateError,
    MoriTimeoutError,
    MoriValueError,
    format_ranks,
)
from mori.core.plugins import get_plugins, select
from mori.core.topology import node_id
from mori.shmem import layout
from mori.shmem.heap import HeapAllocator

if TYPE_CHECKING:
    from mori.shmem.network import NetworkPeers


class ShmemContext:
    def __init__(self, bootstrap: StoreBootstrap) -> None:
        self.bootstrap = bootstrap
        self.my_pe = bootstrap.rank
        self.n_pes = bootstrap.nranks
        if self.n_pes > layout.MAX_PES:
            raise MoriValueError(f"shmem supports at most {layout.MAX_PES} PEs, got nranks={self.n_pes}")
        self.timeout_s = bootstrap.timeout_s
        self.lock = threading.RLock()
        mode = env.MORI_SHMEM_MODE.require()
        self.heap_size: int = env.MORI_SHMEM_HEAP_SIZE.require()
        if self.heap_size < 2 * layout.USER_OFF:
            raise MoriValueError(
                f"MORI_SHMEM_HEAP_SIZE={self.heap_size} bytes is too small: at least {2 * layout.USER_OFF}"
            )
        plugins = get_plugins()
        found = select("device runtime", plugins.runtimes(), env.MORI_DEVICE_RUNTIME.require())
        if not isinstance(found.backend, DeviceRuntime):
            raise MoriBackendError(
                f"plugin '{found.plugin.name}' returned a {type(found.backend).__name__} as a device runtime"
            )
        self.runtime: DeviceRuntime = found.backend
        if mode != "static_heap" and self.runtime.torch_device == "cpu":
            raise MoriValueError(
                f"MORI_SHMEM_MODE={mode!r} is not supported by the {self.runtime.name} runtime: use static_heap"
            )
        # load/store transports only (peers on this node); network ones are probed, and their
        # libraries loaded, only when some peer is out of reach (mori.shmem.network)
        self.transports: list[Transport] = [
            f.backend
            for f in plugins.transports()
            if isinstance(f.backend, Transport) and f.backend.load_store and f.availability.usable
        ]
        self.segment: HeapSegment | None = None
        self.peers: list[PeerSegment | None] = [None] * self.n_pes
        self.bases: list[int] = [0] * self.n_pes  # peer heap address in this process, 0 if unreachable
        self.allocator = HeapAllocator(layout.USER_OFF, self.heap_size)
        self.registered: dict[int, int] = {}  # addr -> size of shmem_buffer_register'ed host buffers
        self.host_barrier_epoch = 0
        self.call_seq = 0
        self.device_context: Any = None
        self.network: NetworkPeers | None = None
        try:
            self._setup()
        except BaseException:
            self._teardown()
            raise

    # -- setup / teardown ---------------------------------------------------------------------------

    def _setup(self) -> None:
        # the job's id first: every name a runtime derives from it groups by job (mori-heap.<job>.*)
        tag = f"{self.bootstrap.job_id}.{self.my_pe}"
        self.segment = self.runtime.create_segment(self.heap_size, tag)
        self.bases[self.my_pe] = self.segment.addr
        me = PeerInfo(
            rank=self.my_pe,
            node_id=node_id(),
            hostname=socket.gethostname(),
            pid=os.getpid(),
            runtime=self.runtime.name,
            heap_size=self.heap_size,
            segment_handle=self.segment.handle,
        )
        infos = [
            _decode_peer(raw)
            for raw in self.bootstrap.allgather(_encode_peer(me), what="shmem heap exchange")
        ]
        sizes = {i.rank: i.heap_size for i in infos}
        odd = [r for r, s in sizes.items() if s != self.heap_size]
        if odd:
            raise MoriValueError(
                f"MORI_SHMEM_HEAP_SIZE differs between ranks: this rank {self.my_pe} has {self.heap_size}, "
                f"ranks {format_ranks(odd)} have {sorted(set(sizes[r] for r in odd))}; the heap must be symmetric"
            )
        self.peer_infos = infos
        disable_p2p = env.MORI_DISABLE_P2P.require()
        for info in infos:
            if info.rank == self.my_pe:
                continue
            for transport in [] if disable_p2p else self.transports:
                seg = transport.connect(self.runtime, me, info)
                if seg is not None:
                    self.peers[info.rank] = seg
                    self.bases[info.rank] = seg.addr
                    break
        # PEs that no load/store transport reaches (other nodes) are reached over the network; the
        # decision is the job's (every PE opens the transport, or none does).
        unreachable = [p for p in range(self.n_pes) if p != self.my_pe and not self.bases[p]]
        votes = self.bootstrap.allgather(b"1" if unreachable else b"0", what="shmem reachability")
        if b"1" in votes:
            from mori.shmem.network import NetworkPeers

            self.network = NetworkPeers(self)
        # Nobody may unlink (seal) before every peer has mapped.
        self.bootstrap.barrier(what="shmem heap mapping")
        self.segment.seal()

    def _teardown(self) -> None:
        if self.network is not None:
            self.network.close()
            self.network = None
        for seg in self.peers:
            if seg is not None:
                seg.close()
        self.peers = [None] * self.n_pes
        if self.segment is not None:
            self.segment.close()
            self.segment = None
        self.bootstrap.close()

    def finalize(self) -> None:
        try:
            self.barrier_all(what="shmem_finalize")
        finally:
            self._teardown()

    # -- addresses ----------------------------------------------------------------------------------

    @property
    def base(self) -> int:
        return self.bases[self.my_pe]

    def check_pe(self, func: str, pe: Any, arg: str = "pe") -> int:
        if isinstance(pe, bool) or not isinstance(pe, int) or not 0 <= pe < self.n_pes:
            raise MoriValueError(f"{func}: {arg}={pe!r} is not allowed; expected a PE in [0, {self.n_pes})")
        return pe

    def heap_offset(self, func: str, arg: str, addr: Any, nbytes: int) -> int:
        """Offset of ``[addr, addr+nbytes)`` in the user heap; error if it is not all inside."""
        if isinstance(addr, bool) or not isinstance(addr, int):
            raise MoriValueError(
                f"{func}: {arg}={addr!r} is not allowed; expected an address (int) in the symmetric heap"
            )
        off = addr - self.base
        if off < layout.USER_OFF or off + nbytes > self.heap_size:
            raise MoriValueError(
                f"{func}: {arg}={addr:#x} (+{nbytes} bytes) is not inside the symmetric heap "
                f"[{self.base + layout.USER_OFF:#x}, {self.base + self.heap_size:#x}): pass memory from shmem_malloc"
            )
        return off

    def over_network(self, func: str, pe: int) -> bool:
        """True if PE ``pe`` is reached over the network transport (no mapping of its heap here);
        raises, naming why, if it is not reachable at all."""
        if self.bases[pe]:
            return False
        if self.network is not None and pe in self.network.peers:
            return True
        self.peer_base(func, pe)  # raises with the reason
        return False

    def peer_base(self, func: str, pe: int) -> int:
        base = self.bases[pe]
        if base == 0:
            me, other = self.peer_infos[self.my_pe], self.peer_infos[pe]
            raise MoriBackendError(
                f"{func}: PE {pe} (node {other.node_id}, runtime {other.runtime}) is not reachable from PE "
                f"{self.my_pe} (node {me.node_id}): no installed transport connects them"
                + (" (MORI_DISABLE_P2P is set)" if env.MORI_DISABLE_P2P.require() else "")
            )
        return base

    def remote_addr(self, func: str, arg: str, addr: int, nbytes: int, pe: int) -> int:
        off = self.heap_offset(func, arg, addr, nbytes)
        return self.peer_base(func, pe) + off

    def local_addr(self, func: str, arg: str, addr: Any, nbytes: int) -> int:
        """Validate that ``[addr, addr+nbytes)`` is local memory in the heap or a registered buffer."""
        if isinstance(addr, int) and not isinstance(addr, bool):
            off = addr - self.base
            if off >= layout.USER_OFF and off + nbytes <= self.heap_size:
                return addr
            for start, size in self.registered.items():
                if start <= addr and addr + nbytes <= start + size:
                    return addr
        raise MoriValueError(
            f"{func}: {arg}={addr!r} (+{nbytes} bytes) is neither symmetric heap memory nor inside a buffer "
            f"registered with shmem_buffer_register"
        )

    # -- host barrier -------------------------------------------------------------------------------

    def barrier_all(self, *, what: str = "shmem_barrier_all") -> None:
        """Each PE writes its barrier number into its slot on every peer, then waits for all slots."""
        with self.lock:
            if self.network is not None:  # what device code handed to the proxy is complete first
                self.network.quiet(what)
            self.host_barrier_epoch += 1
            epoch = self.host_barrier_epoch
            slot = layout.HOST_BARRIER_OFF + self.my_pe * layout.SLOT_BYTES
            unreachable = [p for p in range(self.n_pes) if self.bases[p] == 0]
            self.runtime.fence()
            for p in range(self.n_pes):
                if self.bases[p]:
                    self.runtime.atomic_rmw(self.bases[p] + slot, OP_SET, WORD_INT64, epoch)
            if unreachable:
                self.bootstrap.barrier(what=what)
            deadline = _now() + self.timeout_s
            for p in range(self.n_pes):
                if not self.bases[p]:
                    continue
                addr = self.base + layout.HOST_BARRIER_OFF + p * layout.SLOT_BYTES
                ok, _ = self.runtime.wait_until(addr, CMP_GE, WORD_INT64, epoch, max(0.0, deadline - _now()))
                if not ok:
                    late = [
                        q
                        for q in range(self.n_pes)
                        if self.bases[q]
                        and self.runtime.atomic_rmw(
                            self.base + layout.HOST_BARRIER_OFF + q * 8, OP_FETCH, WORD_INT64, 0
                        )
                        < epoch
                    ]
                    raise MoriTimeoutError(
                        f"{what}: PEs {format_ranks(late)} of {self.n_pes} did not arrive within "
                        f"{self.timeout_s:g} s (MORI_BOOTSTRAP_TIMEOUT); this is PE {self.my_pe}",
                        late,
                    )

    def check_collective(self, func: str, kind: int, offset: int, size: int) -> None:
        """Verify every PE made the same collective call (same kind, offset, size) at this point."""
        self.call_seq += 1
        seq = self.call_seq
        rec = layout.CALL_RECORD_OFF + (seq % 2) * layout.CALL_RECORD_WORDS * layout.SLOT_BYTES
        for i, v in enumerate((seq, kind, offset, size)):
            self.runtime.atomic_rmw(self.base + rec + 8 * i, OP_SET, WORD_INT64, v)
        self.barrier_all(what=func)
        mine = (seq, kind, offset, size)
        differ: dict[int, tuple[int, ...]] = {}
        for p in range(self.n_pes):
            if p == self.my_pe or not self.bases[p]:
                continue
            theirs = tuple(
                self.runtime.atomic_rmw(self.bases[p] + rec + 8 * i, OP_FETCH, WORD_INT64, 0)
                for i in range(4)
            )
            if theirs != mine:
                differ[p] = theirs
        if differ:
            names = {1: "shmem_malloc", 2: "shmem_free"}
            detail = "; ".join(
                f"PE {p}: call #{t[0]} {names.get(t[1], '?')} offset {t[2]:#x} size {t[3]}"
                for p, t in differ.items()
            )
            raise MoriStateError(
                f"{func} is collective: every PE must make the same calls in the same order. This PE "
                f"{self.my_pe}: call #{seq} {names.get(kind, '?')} offset {offset:#x} size {size}; {detail}"
            )


def _now() -> float:
    import time

    return time.monotonic()


def _encode_peer(info: PeerInfo) -> bytes:
    d = asdict(info)
    d["segment_handle"] = info.segment_handle.hex()
    return json.dumps(d).encode()


def _decode_peer(raw: bytes) -> PeerInfo:
    d = json.loads(raw)
    d["segment_handle"] = bytes.fromhex(d["segment_handle"])
    return PeerInfo(**d)


_current: ShmemContext | None = None
_current_lock = threading.Lock()


def current(func: str) -> ShmemContext:
    ctx = _current
    if ctx is None:
        raise MoriStateError(
            f"{func}: mori.shmem is not initialised; call shmem_torch_process_group_init, "
            f"shmem_init_attr or shmem_mpi_init first"
        )
    return ctx


def install(func: str, make: Any) -> None:
    global _current
    with _current_lock:
        if _current is not None:
            raise MoriStateError(
                f"{func}: mori.shmem is already initialised in this process (PE {_current.my_pe} of "
                f"{_current.n_pes}); call shmem_finalize first"
            )
        _current = make()


def uninstall(func: str) -> None:
    global _current
    with _current_lock:
        ctx = current(func)
        try:
            ctx.finalize()
        finally:
            _current = None

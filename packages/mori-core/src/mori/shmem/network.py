"""PEs that loads and stores cannot reach (other nodes): the host API reaches them through a network
transport of the one transport contract (:mod:`mori.core.transport`).

At init, if any PE of the job has a peer it cannot map, every PE opens the same network transport
(``MORI_SHMEM_TRANSPORT``, else the usable one of highest priority: ``ucx`` where it has RDMA
verbs, else the built-in ``tcp``, which authenticates peers and checks every request against the
target's table where UCX's tcp/shared-memory transports do neither), registers its heap with it and exchanges address, remote key and heap base
through the bootstrap. Each host call on such a PE is one transport operation, complete (remotely
visible) when the call returns, as every host transfer is.

Device code reaches those PEs through the **proxy** (``csrc/proxy.cpp``): a native thread of this
rank that drains a ring of requests in host memory the device reaches (allocated by the device
runtime: :meth:`~mori.core.backend.DeviceRuntime.alloc_mapped_host`) and executes them on the
same transport instance. :meth:`NetworkPeers.quiet` waits for it; its failures (a refused request,
a transport error, a proxy that stopped) raise :class:`~mori.core.errors.MoriBackendError` naming
the PE, from the next host call that waits on the proxy (``shmem_quiet``, ``shmem_fence``,
``shmem_barrier_all``).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from mori.core import _core, env
from mori.core.errors import MoriBackendError, MoriTimeoutError, MoriValueError, format_ranks
from mori.core.transport import (
    CAP_DEVICE_ATOMIC,
    MEM_CUDA,
    MEM_HOST,
    TransportEndpoint,
    TransportInstance,
    TransportMemory,
    TransportRemoteKey,
    find_network_transport,
    open_transport,
)

if TYPE_CHECKING:
    from mori.shmem.context import ShmemContext


class NetworkPeers:
    """The network half of a SHMEM context: one transport instance, the heap registered with it,
    an endpoint and remote key per PE that loads and stores cannot reach."""

    def __init__(self, ctx: ShmemContext) -> None:
        self.ctx = ctx
        self.transport = find_network_transport(env.MORI_SHMEM_TRANSPORT.get(), "MORI_SHMEM_TRANSPORT")
        self.tp: TransportInstance = open_transport(self.transport.ops(), self.transport.options())
        rt = ctx.runtime
        mem_type = MEM_HOST if rt.torch_device == "cpu" else MEM_CUDA
        device = -1 if rt.device_index is None else rt.device_index
        self.heap: TransportMemory = self.tp.register(ctx.base, ctx.heap_size, mem_type, device)
        self.buffers: dict[int, TransportMemory] = {}
        self.peers: dict[int, tuple[TransportEndpoint, TransportRemoteKey, int]] = {}
        self.timeout_ms = int(ctx.timeout_s * 1000)
        me = {
            "transport": self.tp.name,
            "address": self.tp.address().hex(),
            "rkey": self.heap.rkey.hex(),
            "base": ctx.base,
        }
        infos = [
            json.loads(r)
            for r in ctx.bootstrap.allgather(json.dumps(me).encode(), what="shmem network exchange")
        ]
        names = {i["transport"] for i in infos}
        if len(names) > 1:
            by = {n: [r for r, i in enumerate(infos) if i["transport"] == n] for n in names}
            raise MoriValueError(
                "PEs chose different network transports: "
                + "; ".join(f"ranks {format_ranks(rs)}: {n}" for n, rs in sorted(by.items()))
                + " (set MORI_SHMEM_TRANSPORT to the same name on every rank)"
            )
        for pe, info in enumerate(infos):
            if pe == ctx.my_pe or ctx.bases[pe]:
                continue
            ep = self.tp.connect(bytes.fromhex(info["address"]))
            self.peers[pe] = (ep, ep.unpack_rkey(bytes.fromhex(info["rkey"])), int(info["base"]))
        # the proxy: device-initiated operations on those PEs
        slots = env.MORI_SHMEM_PROXY_SLOTS.require()
        self.ring = rt.alloc_mapped_host(_core.Proxy.ring_size(slots))
        self.reported: str | None = None  # the proxy failure already raised to the user, if any
        try:
            self.proxy = _core.Proxy(
                self.tp,
                ctx.my_pe,
                ctx.n_pes,
                ctx.base,
                ctx.heap_size,
                self.heap,
                self.ring.host_addr,
                self.ring.size,
                slots,
                env.MORI_SHMEM_PROXY_PIECE.require(),
                ctx.timeout_s,
                # a GPU heap on a transport without atomics on device memory: signals, sets and
                # fetches by puts and gets, other atomics refused (csrc/proxy.cpp)
                rma_signals=env.MORI_SHMEM_PROXY_ATOMICS.require() == "rma"
                or (mem_type != MEM_HOST and not self.tp.caps & CAP_DEVICE_ATOMIC),
            )
            for pe, (ep, rk, base) in self.peers.items():
                self.proxy.add_peer(pe, ep, rk, base)
            self.proxy.start()
        except BaseException:
            self.ring.close()
            raise

    # -- local memory -------------------------------------------------------------------------------

    def register_buffer(self, ptr: int, size: int) -> None:
        self.buffers[ptr] = self.tp.register(ptr, size)
        self.proxy.add_local(self.buffers[ptr])

    def deregister_buffer(self, ptr: int) -> None:
        self.proxy.remove_local(ptr)
        self.buffers.pop(ptr, None)  # deregistered when the last request using it is gone

    def _local(self, addr: int, nbytes: int) -> TransportMemory:
        if self.heap.addr <= addr and addr + nbytes <= self.heap.addr + self.heap.size:
            return self.heap
        for start, mem in self.buffers.items():
            if start <= addr and addr + nbytes <= start + mem.size:
                return mem
        raise MoriValueError(
            f"address {addr:#x} (+{nbytes}) is not memory registered with the network transport"
        )

    def _peer(self, func: str, pe: int) -> tuple[TransportEndpoint, TransportRemoteKey, int]:
        try:
            return self.peers[pe]
        except KeyError:
            raise MoriBackendError(f"{func}: PE {pe} is not reachable over {self.tp.name}") from None

    # -- operations, each complete when it returns --------------------------------------------------

    def put(self, func: str, pe: int, dest_off: int, source: int, nbytes: int) -> None:
        ep, rk, base = self._peer(func, pe)
        if nbytes:
            ep.put(source, self._local(source, nbytes), base + dest_off, rk, nbytes).wait(self.timeout_ms)

    def get(self, func: str, pe: int, source_off: int, dest: int, nbytes: int) -> None:
        ep, rk, base = self._peer(func, pe)
        if nbytes:
            ep.get(dest, self._local(dest, nbytes), base + source_off, rk, nbytes).wait(self.timeout_ms)

    def atomic(self, func: str, pe: int, off: int, op: int, word: int, value: int, compare: int = 0) -> int:
        ep, rk, base = self._peer(func, pe)
        req = ep.atomic(op, word, value, compare, base + off, rk)
        req.wait(self.timeout_ms)
        return int(req.old)

    def fence(self) -> None:
        for ep, _, _ in self.peers.values():
            ep.fence()

    def quiet(self, what: str) -> None:
        """Until every request device code (or the host) put in the proxy's ring before is
        complete. Raises :class:`MoriBackendError` (naming the PE) if the proxy failed, and
        :class:`MoriTimeoutError` after ``MORI_BOOTSTRAP_TIMEOUT``. ``shmem_finalize`` does not
        raise again a failure an earlier call raised."""
        try:
            self.proxy.quiet(self.ctx.timeout_s)
        except (MoriBackendError, MoriTimeoutError) as e:
            if what == "shmem_finalize" and self.reported is not None:
                return
            self.reported = str(e)
            raise type(e)(f"{what}: {e}") from None

    def close(self) -> None:
        try:
            self.proxy.stop()  # before the transport objects it uses go
        finally:
            self.ring.close()
        self.peers.clear()
        self.buffers.clear()


def value_bits(value: int, word: int) -> int:
    """A signed value as the transport's unsigned word bits (two's complement)."""
    bits = 32 if word in (0, 1) else 64
    return value & ((1 << bits) - 1)


def signed_result(old: int, word: int) -> int:
    """The transport's unsigned result as the word type's value."""
    if word == 0:  # int32
        return old - (1 << 32) if old >= 1 << 31 else old
    if word == 2:  # int64
        return old - (1 << 64) if old >= 1 << 63 else old
    return old


__all__ = ["NetworkPeers", "signed_result", "value_bits"]

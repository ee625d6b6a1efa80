"""Distributed mode: a :class:`mori.umbp.UMBPClient` that is also a node of a pool.

Each node owns its tiers. It registers with the master (capacities, its peer-service address and
its mori-io engine and DRAM-pool descriptors), tells the master what it stores and drops through
heartbeat events, and serves its blocks to peers:

1. A reader asks the master where ``key`` is (``RouteGet``) and gets ``(node, peer address)``.
2. It asks that node's *peer service* (gRPC) to ``Resolve`` the key: the owner pins the object
   (a lease of ``LEASE_MS``: eviction cannot free it meanwhile; an SSD object is first read
   into a registered staging slot) and answers where it is in its registered memory.
3. The reader pulls the bytes with mori-io (``IOEngine.read``, the TCP backend on CPU memory),
   straight into the destination when the caller registered it (:meth:`UMBPClient.register_memory`),
   else through a registered staging buffer, then ``Release``\\ s the lease. Every wait has a
   deadline: a peer that dies mid-fetch makes the get fail (False), never hang.
4. With ``cache_remote_fetches`` the reader keeps a copy in its own DRAM tier (admission per
   :class:`mori.umbp.CacheRemoteAdmission`).

Only mori-io's public API is used. Engines bind to ``io_engine.host`` (default 127.0.0.1);
``MORI_IO_AUTH_TOKEN`` (read by mori-io) protects them beyond loopback. The peer service binds to
the same host and requires the pool's ``UMBP_MASTER_AUTH_TOKEN`` when one is set. A peer's
``Resolve`` answers only for keys in the owner's own index; the lease table is bounded
(``MAX_LEASES``).
"""

from __future__ import annotations

import contextlib
import hmac
import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import grpc
import msgpack

from mori.umbp import env
from mori.umbp.config import CacheRemoteAdmission, UMBPDistributedConfig, UMBPTierType
from mori.umbp.errors import UMBPError
from mori.umbp.host_memory import map_host, unmap_host
from mori.umbp.master import wire
from mori.umbp.master.server import AUTH_METADATA_KEY
from mori.umbp.master_client import UMBPExternalKvHitCountEntry, UMBPExternalKvNodeMatch, UMBPMasterClient

if TYPE_CHECKING:
    from mori.umbp.client import UMBPClient

log = logging.getLogger("mori.umbp.distributed")

PEER_SERVICE = "umbp.Peer"
LEASE_MS = 30000  #: how long a Resolve pins an object; longer than any fetch may take (UMBP_FETCH_TIMEOUT_MS)
MAX_LEASES = 65536  #: leases held at once by one node; Resolve beyond it answers "busy"
MAX_OUTBOX = 1 << 20  #: unsent heartbeat events; past it the next heartbeat is a full sync
AUTO_FLUSH_EVENTS = 128  #: a batch put that leaves this many unsent events ships them at once


class _Lease:
    __slots__ = ("deadline", "entry", "slot")

    def __init__(self, entry: Any, slot: int | None, deadline: float) -> None:
        self.entry, self.slot, self.deadline = entry, slot, deadline


class DistributedNode:
    def __init__(self, client: UMBPClient, cfg: UMBPDistributedConfig) -> None:
        from mori.io import BackendType, IOEngine, IOEngineConfig, MemoryLocationType

        self.client = client
        self.cfg = cfg
        mc = cfg.master_config
        self.node_id = mc.node_id
        self._token = mc.auth_token or env.UMBP_MASTER_AUTH_TOKEN.get() or ""
        self._MemLoc = MemoryLocationType
        host = cfg.io_engine.host or "127.0.0.1"
        self._closed = False
        self._lock = threading.Lock()
        self._outbox: list[tuple[int, str, UMBPTierType, int]] = []
        self._need_full_sync = False
        self._leases: dict[int, _Lease] = {}
        self._lease_ids = itertools.count(1)
        self._remote: dict[str, tuple[Any, Any, Any]] = {}  # node -> (engine desc, pool desc, staging desc)
        self._peer_stubs: dict[str, Any] = {}
        self._registered: dict[int, tuple[int, Any]] = {}  # ptr -> (size, MemoryDesc)
        self.engine = None
        self._server: grpc.Server | None = None
        self._staging: Any = None
        self._ssd_staging: Any = None
        try:
            io_cfg = IOEngineConfig(host, cfg.io_engine.port, auth_token=cfg.io_engine.auth_token or None)
            self.engine = IOEngine(f"umbp-{self.node_id}", io_cfg)
            self.engine.create_backend(BackendType.TCP)
            dram = client._dram
            self.pool_desc = self.engine.register_memory(dram.base, dram.capacity, -1, MemoryLocationType.CPU)
            self._staging = map_host(cfg.staging_buffer_size, prefault=False)
            self._staging_lock = threading.Lock()
            self.staging_desc = self.engine.register_memory(
                self._staging.ptr, cfg.staging_buffer_size, -1, MemoryLocationType.CPU
            )
            # the owner's side of remote SSD reads: slots an SSD object is read into before a peer pulls it
            self._slots = max(1, cfg.ssd_staging_buffer_slots)
            self._slot_size = max(4096, cfg.ssd_staging_buffer_size // self._slots)
            self._ssd_staging = map_host(self._slot_size * self._slots, prefault=False)
            self.ssd_staging_desc = self.engine.register_memory(
                self._ssd_staging.ptr, self._slot_size * self._slots, -1, MemoryLocationType.CPU
            )
            self._free_slots = list(range(self._slots))
            self._server = grpc.server(ThreadPoolExecutor(max_workers=8, thread_name_prefix="umbp-peer"),
                                       maximum_concurrent_rpcs=256)  # fmt: skip
            self._server.add_generic_rpc_handlers((self._peer_handler(),))
            port = self._server.add_insecure_port(f"{host}:{cfg.peer_service_port}")
            if port == 0:
                raise UMBPError(
                    f"UMBPClient: the peer service cannot listen on {host}:{cfg.peer_service_port}"
                )
            self._server.start()
            self.peer_address = f"{host}:{port}"
            self.master = UMBPMasterClient(
                mc.master_address, mc.node_id, mc.node_address, auth_token=self._token
            )
            self._register()
        except BaseException:
            self.close()
            raise
        self._stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        if mc.auto_heartbeat:
            self._hb_thread = threading.Thread(target=self._heartbeat_loop, name=f"umbp-heartbeat-{self.node_id}",
                                               daemon=True)  # fmt: skip
            self._hb_thread.start()

    # -- master ------------------------------------------------------------------------------------

    def _descs(self) -> bytes:
        assert self.engine is not None
        return wire.pack(
            {"engine": self.engine.get_engine_desc().pack(), "pool": self.pool_desc.pack(),
             "staging": self.ssd_staging_desc.pack(), "slot_size": self._slot_size},
        )  # fmt: skip

    def _capacities(self) -> dict[UMBPTierType, tuple[int, int]]:
        dram = self.client._dram
        caps = {UMBPTierType.DRAM: (dram.capacity, dram.capacity - dram.used_bytes())}
        ssd = self.client._ssd
        if ssd is not None:
            caps[UMBPTierType.SSD] = (ssd.capacity, max(0, ssd.capacity - ssd.file_bytes()))
        return caps

    def _register(self) -> None:
        self.master.register_self(
            self._capacities(), peer_address=self.peer_address, engine_desc=self._descs(),
            tags=list(self.cfg.master_config.tags),
        )  # fmt: skip
        self._need_full_sync = True

    def _snapshot(self) -> list[tuple[int, str, UMBPTierType, int]]:
        c = self.client
        with c._dram.lock:
            events = [(wire.ADD, k, UMBPTierType.DRAM, size) for k, size in c._dram.sizes()]
        if c._hbm is not None:
            with c._hbm.lock:
                events += [(wire.ADD, k, UMBPTierType.HBM, size) for k, size in c._hbm.sizes()]
        if c._ssd is not None:
            events += [(wire.ADD, k, UMBPTierType.SSD, loc.size) for k, loc in list(c._ssd._index.items())]
        return events

    def heartbeat_now(self, *, again: bool = True) -> None:
        with self._lock:
            full = self._need_full_sync
            events = self._snapshot() if full else self._outbox
            self._outbox = []
            self._need_full_sync = False
        try:
            alive = self.master.heartbeat(events, self._capacities(), full_sync=full)
        except UMBPError:
            with self._lock:  # not shipped: ship again (a full sync keeps it simple and exact)
                self._need_full_sync = True
            raise
        if not alive:  # the master restarted or expired us: register again and resend everything
            log.warning("UMBP node %s: the master does not know this node; registering again", self.node_id)
            self._register()
            if again:  # once: a master that forgets us at once again is reported by the next heartbeat
                self.heartbeat_now(again=False)

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(max(0.2, (self.master.heartbeat_interval_ms or 5000) / 1000)):
            try:
                self.heartbeat_now()
            except UMBPError as e:
                log.warning("UMBP node %s: heartbeat failed: %s", self.node_id, e)

    def _emit(self, kind: int, key: str, tier: UMBPTierType, size: int) -> None:
        with self._lock:
            if len(self._outbox) >= MAX_OUTBOX:
                self._outbox.clear()
                self._need_full_sync = True
            if not self._need_full_sync:
                self._outbox.append((kind, key, tier, size))

    def on_stored(self, key: str, size: int, tier: UMBPTierType = UMBPTierType.DRAM) -> None:
        self._emit(wire.ADD, key, tier, size)

    def on_evicted(
        self, key: str, size: int, *, on_ssd: bool, tier: UMBPTierType = UMBPTierType.DRAM
    ) -> None:
        self._emit(wire.REMOVE, key, tier, size)
        if on_ssd:
            self._emit(wire.ADD, key, UMBPTierType.SSD, size)

    def maybe_flush_events(self) -> None:
        if len(self._outbox) >= AUTO_FLUSH_EVENTS:
            try:
                self.heartbeat_now()
            except UMBPError as e:
                log.warning("UMBP node %s: event flush failed: %s", self.node_id, e)

    def flush(self) -> None:
        try:
            self.heartbeat_now()
        except UMBPError as e:
            log.warning("UMBP node %s: flush could not reach the master: %s", self.node_id, e)

    def on_cleared(self, keys: list[str]) -> None:
        with self._lock:
            self._outbox.clear()
            self._need_full_sync = True
        try:
            self.master.revoke_all_external_kv_blocks_for_node(self.node_id)
            self.heartbeat_now()
        except UMBPError as e:
            log.warning("UMBP node %s: clear could not reach the master: %s", self.node_id, e)

    def lookup(self, keys: list[str]) -> list[bool]:
        try:
            return self.master.batch_lookup(keys)
        except UMBPError as e:
            log.warning("UMBP node %s: lookup failed: %s", self.node_id, e)
            return [False] * len(keys)

    # -- external KV ---------------------------------------------------------------------------------

    def external(self, op: str, hashes: list[str], tier: UMBPTierType) -> bool:
        try:
            if op == "report":
                if hashes:
                    self.master.report_external_kv_blocks(self.node_id, hashes, tier)
            elif op == "revoke":
                self.master.revoke_external_kv_blocks(self.node_id, hashes, tier)
            else:
                self.master.revoke_all_external_kv_blocks_at_tier(self.node_id, tier)
            return True
        except UMBPError as e:
            log.warning("UMBP node %s: %s_external_kv_blocks failed: %s", self.node_id, op, e)
            return False

    def match_external_kv(self, hashes: list[str], count_as_hit: bool) -> list[UMBPExternalKvNodeMatch]:
        try:
            return self.master.match_external_kv(hashes, count_as_hit)
        except UMBPError as e:
            log.warning("UMBP node %s: match_external_kv failed: %s", self.node_id, e)
            return []

    def get_external_kv_hit_counts(self, hashes: list[str]) -> list[UMBPExternalKvHitCountEntry]:
        try:
            return self.master.get_external_kv_hit_counts(hashes)
        except UMBPError as e:
            log.warning("UMBP node %s: get_external_kv_hit_counts failed: %s", self.node_id, e)
            return []

    # -- memory registration -------------------------------------------------------------------------

    def register_memory(self, ptr: int, size: int) -> bool:
        assert self.engine is not None
        try:
            desc = self.engine.register_memory(ptr, size, -1, self._MemLoc.CPU)
        except Exception as e:
            log.warning("UMBP node %s: register_memory(0x%x, %d) failed: %s", self.node_id, ptr, size, e)
            return False
        self._registered[ptr] = (size, desc)
        return True

    def deregister_memory(self, ptr: int) -> None:
        entry = self._registered.pop(ptr, None)
        if entry is not None and self.engine is not None:
            self.engine.deregister_memory(entry[1])

    def _registered_for(self, ptr: int, size: int) -> tuple[Any, int] | None:
        for base, (n, desc) in self._registered.items():
            if base <= ptr and ptr + size <= base + n:
                return desc, ptr - base
        return None

    # -- the peer service (owner side) --------------------------------------------------------------

    def _peer_handler(self) -> grpc.GenericRpcHandler:
        def wrap(fn: Any) -> Any:
            def serve(raw: bytes, ctx: grpc.ServicerContext) -> dict[str, Any]:
                if self._token:
                    sent = dict(ctx.invocation_metadata() or ()).get(AUTH_METADATA_KEY, "")
                    if not hmac.compare_digest(str(sent).encode(), self._token.encode()):
                        ctx.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong umbp-auth-token")
                try:
                    msg = wire.unpack(raw, 16)
                    if not isinstance(msg, dict):
                        raise wire.WireError("the request must be a map")
                    return fn(msg)  # type: ignore[no-any-return]
                except (wire.WireError, KeyError, TypeError, ValueError) as e:
                    ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad peer request: {e}")
                raise AssertionError("unreachable")

            return serve

        methods = {
            "Resolve": grpc.unary_unary_rpc_method_handler(
                wrap(self._resolve), response_serializer=wire.pack
            ),
            "Release": grpc.unary_unary_rpc_method_handler(
                wrap(self._release), response_serializer=wire.pack
            ),
        }
        return grpc.method_handlers_generic_handler(PEER_SERVICE, methods)

    def _expire_leases(self, now: float) -> None:
        for lid in [lid for lid, le in self._leases.items() if le.deadline < now]:
            self._drop_lease(lid)

    def _drop_lease(self, lid: int) -> None:
        le = self._leases.pop(lid, None)
        if le is None:
            return
        if le.entry is not None:
            with self.client._dram.lock:
                le.entry.pins -= 1
        if le.slot is not None:
            self._free_slots.append(le.slot)

    def _resolve(self, msg: dict[str, Any]) -> dict[str, Any]:
        key = msg["key"]
        if not isinstance(key, str) or not key:
            raise ValueError("key must be a non-empty str")
        now = time.monotonic()
        c = self.client
        with self._lock:
            self._expire_leases(now)
            if len(self._leases) >= MAX_LEASES:
                return {"found": False, "busy": True}
            with c._dram.lock:
                e = c._dram.lookup(key)
                if e is not None:
                    e.pins += 1
            if e is not None:
                lid = next(self._lease_ids)
                self._leases[lid] = _Lease(e, None, now + LEASE_MS / 1000)
                return {"found": True, "where": "pool", "offset": e.offset, "size": e.size, "lease": lid}
            ssd = c._ssd
            size = ssd.size_of(key) if ssd is not None else None
            hbm = c._hbm
            if size is None and hbm is not None:
                with hbm.lock:
                    h = hbm.lookup(key)
                    size = h.size if h is not None else None
            if size is None or size > self._slot_size or not self._free_slots:
                return {"found": False, "busy": size is not None}
            slot = self._free_slots.pop()
        # copy the HBM or SSD object into the slot outside the lock (an SSD read checks its checksum)
        if not c._get(key, self._ssd_staging.ptr + slot * self._slot_size, size, local_only=True):
            with self._lock:
                self._free_slots.append(slot)
            return {"found": False}
        with self._lock:
            lid = next(self._lease_ids)
            self._leases[lid] = _Lease(None, slot, time.monotonic() + LEASE_MS / 1000)
        return {
            "found": True,
            "where": "staging",
            "offset": slot * self._slot_size,
            "size": size,
            "lease": lid,
        }

    def _release(self, msg: dict[str, Any]) -> dict[str, Any]:
        lid = msg["lease"]
        if isinstance(lid, int):
            with self._lock:
                self._drop_lease(lid)
        return {}

    # -- fetching (reader side) ----------------------------------------------------------------------

    def _peer(self, address: str) -> Any:
        stub = self._peer_stubs.get(address)
        if stub is None:
            ch = grpc.insecure_channel(address, options=[("grpc.enable_retries", 0)])
            stub = {
                m: ch.unary_unary(
                    f"/{PEER_SERVICE}/{m}",
                    request_serializer=wire.pack,
                    response_deserializer=lambda b: wire.unpack(b, 16),
                )
                for m in ("Resolve", "Release")
            }
            stub["channel"] = ch
            self._peer_stubs[address] = stub
        return stub

    def _remote_node(self, node_id: str) -> tuple[Any, Any, Any] | None:
        from mori.io import EngineDesc, MemoryDesc

        got = self._remote.get(node_id)
        if got is not None:
            return got
        info = self.master.get_node(node_id)
        if info is None:
            return None
        d = msgpack.unpackb(info["engine_desc"], raw=False)
        got = (EngineDesc.unpack(d["engine"]), MemoryDesc.unpack(d["pool"]), MemoryDesc.unpack(d["staging"]))
        assert self.engine is not None
        self.engine.register_remote_engine(got[0])
        self._remote[node_id] = got
        return got

    def fetch(self, key: str, ptr: int, size: int, offset: int, *, whole: bool) -> bool:
        """Get ``key`` (or ``size`` bytes of it from ``offset``) from the peer the master routes to."""
        try:
            route = self.master.route_get([key], exclude=[self.node_id])[0]
        except UMBPError as e:
            log.warning("UMBP node %s: route_get(%r) failed: %s", self.node_id, key, e)
            return False
        if route is None:
            return False
        node_id, peer_address, _tier, stored = route
        if (whole and stored != size) or (not whole and offset + size > stored):
            return False
        md = ((AUTH_METADATA_KEY, self._token),) if self._token else None
        timeout = (env.UMBP_RPC_TIMEOUT_MS.get() or 5000) / 1000
        try:
            remote = self._remote_node(node_id)
            if remote is None:
                return False
            stub = self._peer(peer_address)
            res = stub["Resolve"]({"key": key}, timeout=timeout, metadata=md)
        except (grpc.RpcError, UMBPError) as e:
            log.warning(
                "UMBP node %s: peer %s (%s) did not resolve %r: %s",
                self.node_id,
                node_id,
                peer_address,
                key,
                e,
            )
            self._forget(node_id)
            return False
        if not res.get("found"):
            return False
        try:
            rdesc = remote[1] if res["where"] == "pool" else remote[2]
            budget_ms = min(env.UMBP_FETCH_TIMEOUT_MS.get() or 10000, LEASE_MS // 2)
            deadline = time.monotonic() + budget_ms / 1000
            ok = self._pull(rdesc, int(res["offset"]) + offset, ptr, size, node_id, deadline)
        finally:
            with contextlib.suppress(grpc.RpcError):  # a lost release: the lease runs out by itself
                stub["Release"]({"lease": res["lease"]}, timeout=timeout, metadata=md)
        if ok and whole and self.cfg.cache_remote_fetches:
            adm = self.cfg.cache_remote_admission
            limit = self.cfg.admission_max_block_bytes
            if adm == CacheRemoteAdmission.ALWAYS or (
                adm == CacheRemoteAdmission.SIZE and (limit == 0 or size <= limit)
            ):
                self.client._promote(key, ptr, size)
        return ok

    def _forget(self, node_id: str) -> None:
        got = self._remote.pop(node_id, None)
        if got is not None and self.engine is not None:
            with contextlib.suppress(Exception):
                self.engine.deregister_remote_engine(got[0])

    def _wait(self, st: Any, node_id: str, deadline: float) -> bool:
        left_ms = int((deadline - time.monotonic()) * 1000)
        if left_ms <= 0 or not st.WaitFor(left_ms):
            log.error("UMBP node %s: transfer from peer %s did not finish in time (UMBP_FETCH_TIMEOUT_MS)", self.node_id,
                      node_id)  # fmt: skip
            self._forget(node_id)
            return False
        if not st.Succeeded():
            log.warning("UMBP node %s: transfer from peer %s failed: %s", self.node_id, node_id, st.Message())
            self._forget(node_id)
            return False
        return True

    def _pull(self, rdesc: Any, roff: int, ptr: int, size: int, node_id: str, deadline: float) -> bool:
        assert self.engine is not None
        direct = self._registered_for(ptr, size)
        if direct is not None:
            st = self.engine.read(
                direct[0], direct[1], rdesc, roff, size, self.engine.allocate_transfer_uid()
            )
            return self._wait(st, node_id, deadline)
        chunk = self.cfg.staging_buffer_size
        with self._staging_lock:
            done = 0
            while done < size:
                n = min(chunk, size - done)
                st = self.engine.read(
                    self.staging_desc, 0, rdesc, roff + done, n, self.engine.allocate_transfer_uid()
                )
                if not self._wait(st, node_id, deadline):
                    return False
                self.client._copy(
                    ptr + done, self._staging.ptr, n
                )  # the device runtime's copy with an HBM tier
                done += n
        return True

    # -- shutdown ------------------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
            if self._hb_thread is not None:
                self._hb_thread.join(timeout=10)
        master = getattr(self, "master", None)
        if master is not None:
            try:
                master.unregister_self()
            except UMBPError as e:
                log.info("UMBP node %s: unregister failed (the master expires us): %s", self.node_id, e)
            master.close()
        if self._server is not None:
            self._server.stop(grace=1).wait(5)
        for stub in self._peer_stubs.values():
            stub["channel"].close()
        if self.engine is not None:
            self.engine.shutdown()
        for buf in (self._staging, self._ssd_staging):
            if buf is not None:
                unmap_host(buf)

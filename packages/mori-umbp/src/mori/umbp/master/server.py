"""``umbp_master ADDRESS [METRICS_PORT]``: the UMBP master, a gRPC service (grpcio, asyncio).

The master is a routing *advisor*: nodes register with their capacities and peer address, send
heartbeats that carry the keys they stored or dropped (the block index is a projection of those
events), and keep their own memory. Clients ask it where a key is (``RouteGet``), where to put one
(``RoutePut``: the alive node with the most free bytes), whether keys exist (``Lookup``), and
query the external-KV index (``MatchExternalKv``, ``GetExternalKvHitCounts``). A node silent for
``UMBP_HEARTBEAT_TTL_SEC`` expires: its reports are ignored and a reaper drops its state.

State lives in memory (``UMBP_METADATA_BACKEND=inmemory``, the default: lost on restart) or in
Redis (``redis``, with ``UMBP_REDIS_URI`` and ``UMBP_REDIS_NAMESPACE``: a restarted master keeps
every registration and index entry).

Security: with ``UMBP_MASTER_AUTH_TOKEN`` set, every call must carry the token (metadata
``umbp-auth-token``) or is refused ``UNAUTHENTICATED``; a master that listens beyond loopback
without a token refuses to start unless given ``--allow-unauthenticated``. Requests are decoded
with hard limits and checked field by field (:mod:`mori.umbp.master.wire`); every table is bounded
(:mod:`mori.umbp.master.store`). Prometheus metrics are served on ``METRICS_PORT`` (0: none) on
the same host as ``ADDRESS``.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import ipaddress
import logging
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import prometheus_client as prom

from mori.umbp import env
from mori.umbp.master import wire
from mori.umbp.master.store import InMemoryStore, Limits, MetadataStore, NodeRecord, StoreFull, node_to_dict

log = logging.getLogger("mori.umbp.master")

AUTH_METADATA_KEY = "umbp-auth-token"


class Metrics:
    """The master's Prometheus metrics, in a registry of its own (nothing global is touched)."""

    def __init__(self) -> None:
        self.registry = prom.CollectorRegistry()
        self.calls = prom.Counter(
            "umbp_master_rpc",
            "RPCs served, by method and status code",
            ["method", "code"],
            registry=self.registry,
        )
        self.seconds = prom.Histogram(
            "umbp_master_rpc_seconds",
            "Time to serve one RPC, by method",
            ["method"],
            buckets=(50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 50e-3, 0.25, 1.0),
            registry=self.registry,
        )
        self.table = prom.Gauge(
            "umbp_master_table_entries", "Entries per master table", ["table"], registry=self.registry
        )
        self.external_hashes = prom.Counter(
            "umbp_master_external_kv_hashes", "Hashes received, by operation", ["op"], registry=self.registry
        )
        self.matched = prom.Counter(
            "umbp_master_external_kv_matched_hashes",
            "Hashes found by MatchExternalKv",
            registry=self.registry,
        )


class MasterService:
    def __init__(self, store: MetadataStore, limits: Limits, *, token: str, max_batch: int, hit_max_batch: int,
                 heartbeat_interval_ms: int, metrics: Metrics) -> None:  # fmt: skip
        self.store, self.limits, self.token = store, limits, token.encode()
        self.max_batch, self.hit_max_batch = max_batch, hit_max_batch
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.metrics = metrics

    # -- plumbing --------------------------------------------------------------------------------

    def handler(self) -> grpc.GenericRpcHandler:
        methods = {}
        for name in wire.SCHEMAS:
            impl = getattr(self, "rpc_" + name)
            methods[name] = grpc.unary_unary_rpc_method_handler(
                self._wrap(name, impl), request_deserializer=None, response_serializer=wire.pack
            )
        return grpc.method_handlers_generic_handler(wire.SERVICE, methods)

    def _wrap(
        self, name: str, impl: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
    ) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[dict[str, Any]]]:
        calls, seconds = self.metrics.calls, self.metrics.seconds.labels(name)
        ok = calls.labels(name, "OK")  # the usual outcome, its child looked up once

        async def serve(raw: bytes, ctx: grpc.aio.ServicerContext) -> dict[str, Any]:
            t0 = time.perf_counter()
            code = "OK"
            try:
                if self.token:
                    sent = dict(ctx.invocation_metadata() or ()).get(AUTH_METADATA_KEY, "")
                    if not hmac.compare_digest(str(sent).encode(), self.token):
                        code = "UNAUTHENTICATED"
                        await ctx.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong umbp-auth-token")
                try:
                    req = wire.check(name, wire.unpack(raw, self.max_batch), self.max_batch)
                except wire.WireError as e:
                    code = "INVALID_ARGUMENT"
                    await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
                try:
                    return await impl(req)
                except StoreFull as e:
                    code = "RESOURCE_EXHAUSTED"
                    await ctx.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
                except ValueError as e:
                    code = "INVALID_ARGUMENT"
                    await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
                except (OSError, ConnectionError) as e:  # the metadata backend failed
                    code = "UNAVAILABLE"
                    log.error("%s: metadata backend error: %s", name, e)
                    await ctx.abort(grpc.StatusCode.UNAVAILABLE, f"metadata backend error: {e}")
                raise AssertionError("unreachable")
            except Exception as e:
                if code == "OK" and not isinstance(e, asyncio.CancelledError):
                    if type(e).__module__.startswith("redis"):
                        code = "UNAVAILABLE"
                        await ctx.abort(grpc.StatusCode.UNAVAILABLE, f"metadata backend error: {e}")
                    code = "INTERNAL"
                raise
            finally:
                (ok if code == "OK" else calls.labels(name, code)).inc()
                seconds.observe(time.perf_counter() - t0)

        return serve

    # -- lifecycle -------------------------------------------------------------------------------

    async def rpc_RegisterClient(self, r: dict[str, Any]) -> dict[str, Any]:
        rec = NodeRecord(
            r["node_id"], r["node_address"], r["peer_address"], r["engine_desc"], r["tiers"], r["tags"]
        )
        await self.store.register(rec)
        log.info("registered node %s (%s)", rec.node_id, rec.node_address)
        return {"heartbeat_interval_ms": self.heartbeat_interval_ms}

    async def rpc_UnregisterClient(self, r: dict[str, Any]) -> dict[str, Any]:
        await self.store.unregister(r["node_id"])
        return {}

    async def rpc_Heartbeat(self, r: dict[str, Any]) -> dict[str, Any]:
        ok = await self.store.heartbeat(r["node_id"], r["events"], r["tiers"], r["full_sync"])
        return {"status": 1 if ok else 2}  # 2: unknown or expired; the node must register again

    async def rpc_GetNode(self, r: dict[str, Any]) -> dict[str, Any]:
        rec = await self.store.get_node(r["node_id"])
        return {"found": rec is not None, **(node_to_dict(rec) if rec is not None else {})}

    # -- routing ---------------------------------------------------------------------------------

    async def rpc_RouteGet(self, r: dict[str, Any]) -> dict[str, Any]:
        routes = await self.store.route_get(r["keys"], r["exclude"])
        return {"routes": [list(x) if x is not None else None for x in routes]}

    async def rpc_RoutePut(self, r: dict[str, Any]) -> dict[str, Any]:
        if len(r["sizes"]) != len(r["keys"]):
            raise ValueError("RoutePut: 'sizes' must have one entry per key")
        exists = await self.store.lookup(r["keys"])
        ex = set(r["exclude"])
        nodes = [n for n in await self.store.alive_nodes() if n.node_id not in ex]
        free = {n.node_id: sum(t[2] for t in n.tiers if t[0] in (1, 2)) for n in nodes}
        peer = {n.node_id: n.peer_address for n in nodes}
        out: list[list[Any]] = []
        for size, found in zip(r["sizes"], exists, strict=True):
            if found:
                out.append([2, "", "", 0])  # ALREADY_EXISTS
                continue
            fits = [nid for nid, f in free.items() if f >= size]
            if not fits:
                out.append([0, "", "", 0])  # UNAVAILABLE
                continue
            best = max(fits, key=lambda nid: free[nid])  # most available (the original's default)
            free[best] -= size
            out.append([1, best, peer[best], 2])  # ROUTED, to DRAM
        return {"routes": out}

    async def rpc_Lookup(self, r: dict[str, Any]) -> dict[str, Any]:
        return {"found": await self.store.lookup(r["keys"])}

    # -- external KV -----------------------------------------------------------------------------

    async def rpc_ReportExternalKv(self, r: dict[str, Any]) -> dict[str, Any]:
        if not r["hashes"]:
            raise ValueError("ReportExternalKv: 'hashes' must not be empty")
        self.metrics.external_hashes.labels("report").inc(len(r["hashes"]))
        return {"accepted": await self.store.report_external(r["node_id"], r["hashes"], r["tier"])}

    async def rpc_RevokeExternalKv(self, r: dict[str, Any]) -> dict[str, Any]:
        if r["hashes"]:
            self.metrics.external_hashes.labels("revoke").inc(len(r["hashes"]))
            await self.store.revoke_external(r["node_id"], r["hashes"], r["tier"])
        return {}

    async def rpc_RevokeAllExternalKvAtTier(self, r: dict[str, Any]) -> dict[str, Any]:
        await self.store.revoke_external(r["node_id"], [], r["tier"])
        return {}

    async def rpc_RevokeAllExternalKvForNode(self, r: dict[str, Any]) -> dict[str, Any]:
        await self.store.revoke_external(r["node_id"], [], None)
        return {}

    @staticmethod
    def _matches(matches: list[Any]) -> tuple[list[Any], int]:
        """One query's answer on the wire, and its matched hashes (distinct per node, summed)."""
        out, n = [], 0
        for nid, peer, tiers in matches:
            n += len(next(iter(tiers.values()))) if len(tiers) == 1 else len(set().union(*tiers.values()))
            out.append([nid, peer, [[t, hs] for t, hs in tiers.items()]])
        return out, n

    async def rpc_MatchExternalKv(self, r: dict[str, Any]) -> dict[str, Any]:
        out, n = self._matches(await self.store.match_external(r["hashes"], r["count_as_hit"]))
        self.metrics.matched.inc(n)
        return {"matches": out}

    async def rpc_MatchExternalKvBatch(self, r: dict[str, Any]) -> dict[str, Any]:
        """Several callers' MatchExternalKv in one RPC (the client's group commit): each query is
        answered, and counts its hits, exactly as its own MatchExternalKv would."""
        results, total = [], 0
        for m in await self.store.match_external_many(r["queries"]):
            out, n = self._matches(m)
            results.append(out)
            total += n
        self.metrics.matched.inc(total)  # one metric update per RPC, not per query
        return {"results": results}

    async def rpc_Ping(self, r: dict[str, Any]) -> dict[str, Any]:
        """Touches no state: what one call costs in the RPC framework alone (the benchmark's ceiling)."""
        return {}

    async def rpc_GetExternalKvHitCounts(self, r: dict[str, Any]) -> dict[str, Any]:
        if len(r["hashes"]) > self.hit_max_batch:
            raise ValueError(
                f"GetExternalKvHitCounts: {len(r['hashes'])} hashes is more than "
                f"UMBP_HIT_QUERY_MAX_BATCH={self.hit_max_batch}; split the query (the master never truncates)"
            )
        return {"entries": [[h, c] for h, c in await self.store.hit_counts(r["hashes"])]}


def _is_loopback(host: str) -> bool:
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))
        except OSError:
            return False


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"address {address!r} must be HOST:PORT")
    return host, int(port)


def make_store(limits: Limits) -> MetadataStore:
    backend = env.UMBP_METADATA_BACKEND.get()
    if backend == "redis":
        from mori.umbp.master.redis_store import RedisStore

        return RedisStore(env.UMBP_REDIS_URI.get() or "", env.UMBP_REDIS_NAMESPACE.get() or "umbp", limits)
    return InMemoryStore(limits)


async def serve(address: str, metrics_port: int, *, allow_unauthenticated: bool = False,
                ready: Callable[[], None] | None = None) -> None:  # fmt: skip
    host, _port = split_address(address)
    token = env.UMBP_MASTER_AUTH_TOKEN.get() or ""
    if not token and not _is_loopback(host) and not allow_unauthenticated:
        raise SystemExit(
            f"umbp_master: refusing to listen on {address} (beyond loopback) without authentication: set "
            "UMBP_MASTER_AUTH_TOKEN (clients send the same), or pass --allow-unauthenticated on a trusted network"
        )
    ttl = env.UMBP_HEARTBEAT_TTL_SEC.get() or 10
    limits = Limits(
        heartbeat_ttl_s=float(ttl),
        hit_ttl_s=float(env.UMBP_HIT_INDEX_TTL_SEC.get() or 7200),
        max_nodes=env.UMBP_MASTER_MAX_NODES.get() or 4096,
        max_external=env.UMBP_MASTER_MAX_EXTERNAL_KV.get() or (4 << 20),
    )
    store = make_store(limits)
    if hasattr(store, "ping"):
        await store.ping()  # a Redis that is not there fails the start, not the first call
    metrics = Metrics()
    service = MasterService(
        store, limits, token=token, max_batch=env.UMBP_MASTER_MAX_BATCH.get() or 65536,
        hit_max_batch=env.UMBP_HIT_QUERY_MAX_BATCH.get() or 4096, heartbeat_interval_ms=ttl * 1000 // 2,
        metrics=metrics,
    )  # fmt: skip

    async def table_sizes() -> None:
        for table, n in (await store.sizes()).items():
            metrics.table.labels(table).set(n)

    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", wire.MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", wire.MAX_MESSAGE_BYTES),
            ("grpc.max_concurrent_streams", 1024),
            ("grpc.so_reuseport", 0),
        ],
        maximum_concurrent_rpcs=4096,
    )
    server.add_generic_rpc_handlers((service.handler(),))
    if server.add_insecure_port(address) == 0:
        raise SystemExit(f"umbp_master: cannot listen on {address}")
    if metrics_port:
        prom.start_http_server(
            metrics_port, addr=host if host != "localhost" else "127.0.0.1", registry=metrics.registry
        )
    await server.start()
    log.info(
        "umbp_master listening on %s (metadata: %s, metrics port %s)",
        address,
        type(store).__name__,
        metrics_port,
    )
    if ready is not None:
        ready()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    gc_every = float(env.UMBP_HIT_INDEX_GC_INTERVAL_SEC.get() or 60)
    next_gc = time.monotonic() + gc_every

    async def housekeeping() -> None:
        nonlocal next_gc
        while True:
            await asyncio.sleep(min(ttl / 2, gc_every))
            try:
                dead = await store.reap()
                if dead:
                    log.info("reaped %d expired node(s)", dead)
                await table_sizes()
            except Exception as e:
                log.warning("housekeeping failed: %s", e)

    task = asyncio.create_task(housekeeping())
    await stop.wait()
    task.cancel()
    await server.stop(grace=2)
    await store.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="umbp_master", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument(
        "address", nargs="?", default="0.0.0.0:50051", help="HOST:PORT to listen on (default 0.0.0.0:50051)"
    )
    p.add_argument(
        "metrics_port", nargs="?", type=int, default=9091, help="Prometheus port; 0: none (default 9091)"
    )
    p.add_argument(
        "--allow-unauthenticated", action="store_true", help="listen beyond loopback without a token"
    )
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s umbp_master %(levelname)s %(message)s"
    )
    try:
        asyncio.run(serve(args.address, args.metrics_port, allow_unauthenticated=args.allow_unauthenticated))
    except ValueError as e:
        print(f"umbp_master: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

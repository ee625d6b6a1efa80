"""The master's state behind one interface, kept in memory or in Redis.

State: registered nodes (with the time of their last heartbeat: a node silent for
``heartbeat_ttl`` is expired, treated as unknown, and reaped), the block index (which node holds
which key at which tier, projected from the nodes' heartbeat events), the external-KV index
(hashes engines report for their own caches, per node and tier) and the hit counters.

Limits (documented in :mod:`mori.umbp.env`): at most ``max_nodes`` nodes and ``max_external``
(node, hash, tier) entries; a registration or report beyond them is refused with
:class:`StoreFull` and stores nothing. The hit index keeps at most ``max_external`` hashes; the
least recently hit go first when it is full, and every hash expires ``hit_ttl`` after its last
counted hit.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

from mori.umbp.master.wire import ADD


class StoreFull(RuntimeError):
    """A bounded table is full: the request is refused."""


@dataclass
class Limits:
    heartbeat_ttl_s: float = 10.0
    hit_ttl_s: float = 7200.0
    max_nodes: int = 4096
    max_external: int = 4 << 20


@dataclass
class NodeRecord:
    node_id: str
    node_address: str
    peer_address: str
    engine_desc: bytes
    tiers: list[tuple[int, int, int]]
    tags: list[str]
    last_seen: float = 0.0


#: one node's matches: (node_id, peer_address, {tier: [hashes]})
Match = tuple[str, str, dict[int, list[str]]]


class MetadataStore(Protocol):
    async def register(self, rec: NodeRecord) -> None: ...
    async def unregister(self, node_id: str) -> None: ...
    async def heartbeat(self, node_id: str, events: list[tuple[int, str, int, int]], tiers: list[tuple[int, int, int]],
                        full_sync: bool) -> bool: ...  # fmt: skip
    async def get_node(self, node_id: str) -> NodeRecord | None: ...
    async def route_get(
        self, keys: list[str], exclude: list[str]
    ) -> list[tuple[str, str, int, int] | None]: ...
    async def lookup(self, keys: list[str]) -> list[bool]: ...
    async def alive_nodes(self) -> list[NodeRecord]: ...
    async def report_external(self, node_id: str, hashes: list[str], tier: int) -> bool: ...
    async def revoke_external(self, node_id: str, hashes: list[str], tier: int | None) -> None: ...
    async def match_external(self, hashes: list[str], count_as_hit: bool) -> list[Match]: ...
    async def match_external_many(self, queries: list[tuple[list[str], bool]]) -> list[list[Match]]: ...
    async def hit_counts(self, hashes: list[str]) -> list[tuple[str, int]]: ...
    async def reap(self) -> int: ...
    async def sizes(self) -> dict[str, int]: ...
    async def close(self) -> None: ...


@dataclass
class _Node:
    rec: NodeRecord
    blocks: dict[str, tuple[int, int]] = field(default_factory=dict)  # key -> (tier, size)
    external: dict[int, set[str]] = field(default_factory=dict)  # tier -> hashes


class InMemoryStore:
    """Everything in this process: fast, and gone when the master stops."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._nodes: dict[str, _Node] = {}
        self._blocks: dict[str, dict[str, tuple[int, int]]] = {}  # key -> node -> (tier, size)
        self._ext: dict[str, dict[str, int]] = {}  # hash -> node -> tier bitmask
        self._ext_entries = 0
        self._hits: OrderedDict[str, list[float]] = OrderedDict()  # hash -> [count, last_hit]

    def _alive(self, node_id: str, now: float) -> _Node | None:
        n = self._nodes.get(node_id)
        if n is None or now - n.rec.last_seen > self.limits.heartbeat_ttl_s:
            return None
        return n

    async def register(self, rec: NodeRecord) -> None:
        rec.last_seen = time.monotonic()
        old = self._nodes.get(rec.node_id)
        if old is None and len(self._nodes) >= self.limits.max_nodes:
            await self.reap()
            if len(self._nodes) >= self.limits.max_nodes:
                raise StoreFull(f"the master already has {len(self._nodes)} nodes (UMBP_MASTER_MAX_NODES)")
        if old is not None:  # a re-registration starts from nothing: the node will full-sync
            self._drop(rec.node_id)
        self._nodes[rec.node_id] = _Node(rec)

    def _drop(self, node_id: str) -> None:
        n = self._nodes.pop(node_id, None)
        if n is None:
            return
        for key in n.blocks:
            holders = self._blocks.get(key)
            if holders is not None:
                holders.pop(node_id, None)
                if not holders:
                    del self._blocks[key]
        for tier, hashes in n.external.items():
            self._remove_external(node_id, hashes, tier)

    async def unregister(self, node_id: str) -> None:
        self._drop(node_id)

    async def heartbeat(self, node_id: str, events: list[tuple[int, str, int, int]], tiers: list[tuple[int, int, int]],
                        full_sync: bool) -> bool:  # fmt: skip
        now = time.monotonic()
        n = self._alive(node_id, now)
        if n is None:
            if node_id in self._nodes:
                self._drop(node_id)
            return False
        n.rec.last_seen = now
        if tiers:
            n.rec.tiers = tiers
        if full_sync:
            for key in list(n.blocks):
                self._unblock(node_id, key)
            n.blocks.clear()
        for kind, key, tier, size in events:
            if kind == ADD:
                n.blocks[key] = (tier, size)
                self._blocks.setdefault(key, {})[node_id] = (tier, size)
            else:
                n.blocks.pop(key, None)
                self._unblock(node_id, key)
        return True

    def _unblock(self, node_id: str, key: str) -> None:
        holders = self._blocks.get(key)
        if holders is not None:
            holders.pop(node_id, None)
            if not holders:
                del self._blocks[key]

    async def get_node(self, node_id: str) -> NodeRecord | None:
        n = self._alive(node_id, time.monotonic())
        return None if n is None else n.rec

    async def route_get(self, keys: list[str], exclude: list[str]) -> list[tuple[str, str, int, int] | None]:
        now, ex, out = time.monotonic(), set(exclude), []
        for key in keys:
            best = None
            for nid, (tier, size) in self._blocks.get(key, {}).items():
                if nid in ex or (n := self._alive(nid, now)) is None:
                    continue
                if best is None or tier < best[2]:  # the fastest tier
                    best = (nid, n.rec.peer_address, tier, size)
            out.append(best)
        return out

    async def lookup(self, keys: list[str]) -> list[bool]:
        now = time.monotonic()
        return [any(self._alive(nid, now) for nid in self._blocks.get(k, ())) for k in keys]

    async def alive_nodes(self) -> list[NodeRecord]:
        now = time.monotonic()
        return [n.rec for nid, n in self._nodes.items() if self._alive(nid, now)]

    async def report_external(self, node_id: str, hashes: list[str], tier: int) -> bool:
        n = self._alive(node_id, time.monotonic())
        if n is None:
            return False  # unknown or expired: ignored
        bucket = n.external.setdefault(tier, set())
        new = [h for h in dict.fromkeys(hashes) if h not in bucket]
        if self._ext_entries + len(new) > self.limits.max_external:
            raise StoreFull(
                f"the external-KV index holds {self._ext_entries} entries; {len(new)} more would pass "
                f"UMBP_MASTER_MAX_EXTERNAL_KV={self.limits.max_external}"
            )
        bit = 1 << tier
        for h in new:
            bucket.add(h)
            per = self._ext.setdefault(h, {})
            per[node_id] = per.get(node_id, 0) | bit
        self._ext_entries += len(new)
        return True

    def _remove_external(self, node_id: str, hashes: set[str] | list[str], tier: int) -> None:
        bit = 1 << tier
        for h in hashes:
            per = self._ext.get(h)
            if per is None or not per.get(node_id, 0) & bit:
                continue
            per[node_id] &= ~bit
            self._ext_entries -= 1
            if not per[node_id]:
                del per[node_id]
                if not per:
                    del self._ext[h]

    async def revoke_external(self, node_id: str, hashes: list[str], tier: int | None) -> None:
        n = self._nodes.get(node_id)
        if n is None:
            return
        for t in [tier] if tier is not None else list(n.external):
            bucket = n.external.get(t)
            if not bucket:
                continue
            if tier is None or not hashes:
                gone: set[str] | list[str] = set(bucket)
                bucket.clear()
            else:
                gone = [h for h in dict.fromkeys(hashes) if h in bucket]
                bucket.difference_update(gone)
            self._remove_external(node_id, gone, t)

    async def match_external(self, hashes: list[str], count_as_hit: bool) -> list[Match]:
        return self._match(hashes, count_as_hit, time.monotonic())

    async def match_external_many(self, queries: list[tuple[list[str], bool]]) -> list[list[Match]]:
        now = time.monotonic()
        return [self._match(hs, hit, now) for hs, hit in queries]

    def _match(self, hashes: list[str], count_as_hit: bool, now: float) -> list[Match]:
        by_node: dict[str, dict[int, list[str]]] = {}
        matched: list[str] = []
        alive: dict[str, bool] = {}
        for h in dict.fromkeys(hashes):
            per = self._ext.get(h)
            if not per:
                continue
            hit = False
            for nid, mask in per.items():
                ok = alive.get(nid)
                if ok is None:
                    ok = alive[nid] = self._alive(nid, now) is not None
                if not ok:
                    continue
                hit = True
                tiers = by_node.setdefault(nid, {})
                for t in _MASK_TIERS[mask]:
                    tiers.setdefault(t, []).append(h)
            if hit:
                matched.append(h)
        if count_as_hit and matched:
            wall = time.time()
            for h in matched:
                e = self._hits.get(h)
                if e is None:
                    if len(self._hits) >= self.limits.max_external:
                        self._hits.popitem(last=False)
                    self._hits[h] = [1, wall]
                else:
                    e[0] += 1
                    e[1] = wall
                    self._hits.move_to_end(h)
        return [(nid, self._nodes[nid].rec.peer_address, tiers) for nid, tiers in by_node.items()]

    async def hit_counts(self, hashes: list[str]) -> list[tuple[str, int]]:
        cutoff = time.time() - self.limits.hit_ttl_s
        out = []
        for h in dict.fromkeys(hashes):
            e = self._hits.get(h)
            if e is not None and e[1] >= cutoff:
                out.append((h, int(e[0])))
        return out

    async def reap(self) -> int:
        now = time.monotonic()
        dead = [nid for nid in self._nodes if self._alive(nid, now) is None]
        for nid in dead:
            self._drop(nid)
        cutoff = time.time() - self.limits.hit_ttl_s
        while self._hits:
            h, e = next(iter(self._hits.items()))
            if e[1] >= cutoff:
                break
            del self._hits[h]
        return len(dead)

    async def sizes(self) -> dict[str, int]:
        return {
            "nodes": len(self._nodes),
            "blocks": len(self._blocks),
            "external_entries": self._ext_entries,
            "hit_index": len(self._hits),
        }

    async def close(self) -> None:
        return None


TIER_BITS = (1, 2, 3)
#: tier bitmask (bit t set: held at tier t) -> its tiers, fastest first
_MASK_TIERS = tuple(tuple(t for t in TIER_BITS if m & (1 << t)) for m in range(1 << (max(TIER_BITS) + 1)))


def node_to_dict(rec: NodeRecord) -> dict[str, Any]:
    return {
        "node_id": rec.node_id,
        "node_address": rec.node_address,
        "peer_address": rec.peer_address,
        "engine_desc": rec.engine_desc,
        "tiers": [list(t) for t in rec.tiers],
        "tags": rec.tags,
    }

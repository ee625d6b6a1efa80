"""The master's state in Redis: a restarted master (or a second one) finds everything.

Every logical operation is one Lua script (one round trip, atomic on the server, idempotent
under retry: re-reporting a hash or re-applying an event leaves the same state). Times come from
the Redis server's clock (``TIME``), so several masters on one Redis agree on expiry. Keys,
under the namespace ``ns`` (``UMBP_REDIS_NAMESPACE``)::

    ns:nodes   hash  node -> msgpack node record      ns:seen   hash node -> last heartbeat (ms)
    ns:peer    hash  node -> peer address             ns:extcount  entries of the external index
    ns:ext:H   hash  node -> tier bitmask of hash H   ns:extn:N:T  set of hashes of node N at tier T
    ns:blk:K   hash  node -> "tier,size" of key K     ns:blkn:N    hash key -> "tier,size" of node N
    ns:hits    hash  hash -> count                    ns:hitts  zset hash -> last counted hit (ms)

The scripts compute key names, so this store needs one Redis (or one shard), not Redis Cluster.
"""

from __future__ import annotations

from typing import Any

import msgpack
import redis.asyncio as aioredis

from mori.umbp.master.store import Limits, Match, NodeRecord, StoreFull, node_to_dict

_COMMON = """
local ns = KEYS[1]
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function alive(node, now, ttl)
  local s = redis.call('HGET', ns .. ':seen', node)
  return s and (now - tonumber(s)) <= ttl
end
local function drop(node)
  local bk = ns .. ':blkn:' .. node
  for _, key in ipairs(redis.call('HKEYS', bk)) do
    redis.call('HDEL', ns .. ':blk:' .. key, node)
  end
  redis.call('DEL', bk)
  for t = 1, 3 do
    local sk = ns .. ':extn:' .. node .. ':' .. t
    local members = redis.call('SMEMBERS', sk)
    for _, h in ipairs(members) do
      local ek = ns .. ':ext:' .. h
      local m = tonumber(redis.call('HGET', ek, node) or '0')
      local bit = 2 ^ t
      if math.floor(m / bit) % 2 == 1 then
        m = m - bit
        redis.call('DECR', ns .. ':extcount')
      end
      if m == 0 then redis.call('HDEL', ek, node) else redis.call('HSET', ek, node, m) end
    end
    redis.call('DEL', sk)
  end
  redis.call('HDEL', ns .. ':nodes', node)
  redis.call('HDEL', ns .. ':peer', node)
  redis.call('HDEL', ns .. ':seen', node)
end
"""

_REGISTER = (
    _COMMON
    + """
local node, rec, peer, max_nodes = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
if redis.call('HEXISTS', ns .. ':nodes', node) == 1 then
  drop(node)
elseif redis.call('HLEN', ns .. ':nodes') >= max_nodes then
  return redis.error_reply('FULL nodes')
end
redis.call('HSET', ns .. ':nodes', node, rec)
redis.call('HSET', ns .. ':peer', node, peer)
redis.call('HSET', ns .. ':seen', node, now_ms())
return 1
"""
)

_UNREGISTER = (
    _COMMON
    + """
drop(ARGV[1])
return 1
"""
)

_HEARTBEAT = (
    _COMMON
    + """
local node, ttl, full, rec = ARGV[1], tonumber(ARGV[2]), ARGV[3] == '1', ARGV[4]
local now = now_ms()
if not alive(node, now, ttl) then
  if redis.call('HEXISTS', ns .. ':nodes', node) == 1 then drop(node) end
  return 0
end
redis.call('HSET', ns .. ':seen', node, now)
if rec ~= '' then redis.call('HSET', ns .. ':nodes', node, rec) end
local bk = ns .. ':blkn:' .. node
if full then
  for _, key in ipairs(redis.call('HKEYS', bk)) do redis.call('HDEL', ns .. ':blk:' .. key, node) end
  redis.call('DEL', bk)
end
local i = 5
while i <= #ARGV do
  local kind, key, val = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if kind == '0' then
    redis.call('HSET', ns .. ':blk:' .. key, node, val)
    redis.call('HSET', bk, key, val)
  else
    redis.call('HDEL', ns .. ':blk:' .. key, node)
    redis.call('HDEL', bk, key)
  end
  i = i + 3
end
return 1
"""
)

_REPORT = (
    _COMMON
    + """
local node, tier, ttl, max = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if not alive(node, now_ms(), ttl) then return 0 end
local sk = ns .. ':extn:' .. node .. ':' .. tier
local new = {}
local seen = {}
for i = 5, #ARGV do
  local h = ARGV[i]
  if not seen[h] and redis.call('SISMEMBER', sk, h) == 0 then new[#new + 1] = h end
  seen[h] = true
end
local count = tonumber(redis.call('GET', ns .. ':extcount') or '0')
if count + #new > max then return redis.error_reply('FULL external ' .. count .. ' ' .. #new) end
local bit = 2 ^ tier
for _, h in ipairs(new) do
  redis.call('SADD', sk, h)
  local ek = ns .. ':ext:' .. h
  local m = tonumber(redis.call('HGET', ek, node) or '0')
  redis.call('HSET', ek, node, m + bit)
end
redis.call('INCRBY', ns .. ':extcount', #new)
return 1
"""
)

_REVOKE = (
    _COMMON
    + """
local node, tier_arg, all = ARGV[1], tonumber(ARGV[2]), ARGV[3] == '1'
local tiers = {}
if tier_arg == 0 then tiers = {1, 2, 3} else tiers = {tier_arg} end
for _, tier in ipairs(tiers) do
  local sk = ns .. ':extn:' .. node .. ':' .. tier
  local hashes
  if all then hashes = redis.call('SMEMBERS', sk) else hashes = {} for i = 4, #ARGV do hashes[#hashes + 1] = ARGV[i] end end
  local bit = 2 ^ tier
  for _, h in ipairs(hashes) do
    if redis.call('SREM', sk, h) == 1 then
      local ek = ns .. ':ext:' .. h
      local m = tonumber(redis.call('HGET', ek, node) or '0') - bit
      if m <= 0 then redis.call('HDEL', ek, node) else redis.call('HSET', ek, node, m) end
      redis.call('DECR', ns .. ':extcount')
    end
  end
end
return 1
"""
)

# Matches of several queries (one MatchExternalKv, or the MatchExternalKvBatch of a client's group
# commit) in one script: ARGV = ttl, max_hits, then the queries as one msgpack array of
# [count_as_hit, [hashes]] (Redis's Lua has cmsgpack; one argument to pack and send instead of one
# per hash). Each query is answered, and counts its hits, as if it ran alone, in order. The reply
# is one msgpack string: [[node, peer, ...] of the live nodes seen, [hash, node, tier mask, ...]
# for each query].
_MATCH = (
    _COMMON
    + """
local ttl, max_hits = tonumber(ARGV[1]), tonumber(ARGV[2])
local queries = cmsgpack.unpack(ARGV[3])
local now = now_ms()
local live, peers = {}, {}
local results = {}
for q = 1, #queries do
  local count_hit, hashes = queries[q][1], queries[q][2]
  local out = {}
  local seen = {}
  for i = 1, #hashes do
    local h = hashes[i]
    if not seen[h] then
      seen[h] = true
      local pairs_ = redis.call('HGETALL', ns .. ':ext:' .. h)
      local hit = false
      for j = 1, #pairs_, 2 do
        local node = pairs_[j]
        if live[node] == nil then
          live[node] = alive(node, now, ttl) or false
          if live[node] then peers[#peers + 1] = node; peers[#peers + 1] = redis.call('HGET', ns .. ':peer', node) or '' end
        end
        if live[node] then
          out[#out + 1] = h; out[#out + 1] = node; out[#out + 1] = tonumber(pairs_[j + 1])
          hit = true
        end
      end
      if hit and count_hit then
        redis.call('HINCRBY', ns .. ':hits', h, 1)
        redis.call('ZADD', ns .. ':hitts', now, h)
      end
    end
  end
  if count_hit then
    local extra = redis.call('ZCARD', ns .. ':hitts') - max_hits
    if extra > 0 then
      for _, h in ipairs(redis.call('ZRANGE', ns .. ':hitts', 0, extra - 1)) do redis.call('HDEL', ns .. ':hits', h) end
      redis.call('ZREMRANGEBYRANK', ns .. ':hitts', 0, extra - 1)
    end
  end
  results[q] = out
end
return cmsgpack.pack({peers, results})
"""
)

_HITS = (
    _COMMON
    + """
local cutoff = now_ms() - tonumber(ARGV[1])
local out = {}
local seen = {}
for i = 2, #ARGV do
  local h = ARGV[i]
  if not seen[h] then
    seen[h] = true
    local ts = redis.call('ZSCORE', ns .. ':hitts', h)
    if ts and tonumber(ts) >= cutoff then
      out[#out + 1] = h; out[#out + 1] = redis.call('HGET', ns .. ':hits', h) or '0'
    end
  end
end
return out
"""
)

_ROUTE_GET = (
    _COMMON
    + """
local ttl, nex = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = now_ms()
local ex = {}
for i = 3, 2 + nex do ex[ARGV[i]] = true end
local out = {}
local live = {}
for i = 3 + nex, #ARGV do
  local pairs_ = redis.call('HGETALL', ns .. ':blk:' .. ARGV[i])
  local best, best_tier, best_val = false, 99, ''
  for j = 1, #pairs_, 2 do
    local node = pairs_[j]
    if not ex[node] then
      if live[node] == nil then live[node] = alive(node, now, ttl) or false end
      local tier = tonumber(string.match(pairs_[j + 1], '^(%d+)'))
      if live[node] and tier < best_tier then best, best_tier, best_val = node, tier, pairs_[j + 1] end
    end
  end
  if best then
    out[#out + 1] = best; out[#out + 1] = redis.call('HGET', ns .. ':peer', best) or ''; out[#out + 1] = best_val
  else
    out[#out + 1] = ''; out[#out + 1] = ''; out[#out + 1] = ''
  end
end
return out
"""
)

_LOOKUP = (
    _COMMON
    + """
local ttl = tonumber(ARGV[1])
local now = now_ms()
local out = {}
local live = {}
for i = 2, #ARGV do
  local found = 0
  for _, node in ipairs(redis.call('HKEYS', ns .. ':blk:' .. ARGV[i])) do
    if live[node] == nil then live[node] = alive(node, now, ttl) or false end
    if live[node] then found = 1 break end
  end
  out[#out + 1] = found
end
return out
"""
)

_REAP = (
    _COMMON
    + """
local ttl, hit_ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = now_ms()
local dead = 0
local seen = redis.call('HGETALL', ns .. ':seen')
for j = 1, #seen, 2 do
  if now - tonumber(seen[j + 1]) > ttl then drop(seen[j]); dead = dead + 1 end
end
local old = redis.call('ZRANGEBYSCORE', ns .. ':hitts', '-inf', now - hit_ttl)
for _, h in ipairs(old) do redis.call('HDEL', ns .. ':hits', h) end
redis.call('ZREMRANGEBYSCORE', ns .. ':hitts', '-inf', now - hit_ttl)
return dead
"""
)


def _full(e: Exception) -> bool:
    return str(e).startswith("FULL")


class RedisStore:
    def __init__(self, uri: str, namespace: str, limits: Limits) -> None:
        self.limits = limits
        self.ns = namespace
        self.r = aioredis.from_url(uri, decode_responses=False, socket_timeout=10, socket_connect_timeout=5,
                                   max_connections=64)  # fmt: skip
        self._s = {
            name: self.r.register_script(src)
            for name, src in {
                "register": _REGISTER, "unregister": _UNREGISTER, "heartbeat": _HEARTBEAT, "report": _REPORT,
                "revoke": _REVOKE, "match": _MATCH, "hits": _HITS, "route_get": _ROUTE_GET,
                "lookup": _LOOKUP, "reap": _REAP,
            }.items()
        }  # fmt: skip
        self._ttl_ms = int(limits.heartbeat_ttl_s * 1000)

    async def _run(self, name: str, args: list[Any]) -> Any:
        return await self._s[name](keys=[self.ns], args=args)

    async def ping(self) -> None:
        await self.r.ping()

    async def register(self, rec: NodeRecord) -> None:
        blob = msgpack.packb(node_to_dict(rec), use_bin_type=True)
        try:
            await self._run("register", [rec.node_id, blob, rec.peer_address, self.limits.max_nodes])
        except aioredis.ResponseError as e:
            if _full(e):
                raise StoreFull(
                    f"the master already has {self.limits.max_nodes} nodes (UMBP_MASTER_MAX_NODES)"
                ) from None
            raise

    async def unregister(self, node_id: str) -> None:
        await self._run("unregister", [node_id])

    async def heartbeat(self, node_id: str, events: list[tuple[int, str, int, int]], tiers: list[tuple[int, int, int]],
                        full_sync: bool) -> bool:  # fmt: skip
        rec = b""
        if tiers:
            node = await self.get_node(node_id)
            if node is not None:
                node.tiers = tiers
                rec = msgpack.packb(node_to_dict(node), use_bin_type=True)
        args: list[Any] = [node_id, self._ttl_ms, "1" if full_sync else "0", rec]
        for kind, key, tier, size in events:
            args += [str(kind), key, f"{tier},{size}"]
        return bool(await self._run("heartbeat", args))

    async def get_node(self, node_id: str) -> NodeRecord | None:
        blob, seen = (
            await self.r.hget(f"{self.ns}:nodes", node_id),
            await self.r.hget(f"{self.ns}:seen", node_id),
        )
        if blob is None or seen is None:
            return None
        (sec, usec) = await self.r.time()
        if sec * 1000 + usec // 1000 - int(seen) > self._ttl_ms:
            return None
        d = msgpack.unpackb(blob, raw=False)
        tiers = [(int(t[0]), int(t[1]), int(t[2])) for t in d["tiers"]]
        return NodeRecord(
            d["node_id"], d["node_address"], d["peer_address"], d["engine_desc"], tiers, d["tags"]
        )

    async def alive_nodes(self) -> list[NodeRecord]:
        out = []
        for nid in await self.r.hkeys(f"{self.ns}:nodes"):
            rec = await self.get_node(nid.decode() if isinstance(nid, bytes) else nid)
            if rec is not None:
                out.append(rec)
        return out

    async def route_get(self, keys: list[str], exclude: list[str]) -> list[tuple[str, str, int, int] | None]:
        flat = await self._run("route_get", [self._ttl_ms, len(exclude), *exclude, *keys])
        out: list[tuple[str, str, int, int] | None] = []
        for i in range(0, len(flat), 3):
            node, peer, val = flat[i].decode(), flat[i + 1].decode(), flat[i + 2].decode()
            if not node:
                out.append(None)
                continue
            tier, size = val.split(",")
            out.append((node, peer, int(tier), int(size)))
        return out

    async def lookup(self, keys: list[str]) -> list[bool]:
        if not keys:
            return []
        return [bool(x) for x in await self._run("lookup", [self._ttl_ms, *keys])]

    async def report_external(self, node_id: str, hashes: list[str], tier: int) -> bool:
        try:
            return bool(
                await self._run("report", [node_id, tier, self._ttl_ms, self.limits.max_external, *hashes])
            )
        except aioredis.ResponseError as e:
            if _full(e):
                raise StoreFull(
                    f"the external-KV index is full (UMBP_MASTER_MAX_EXTERNAL_KV={self.limits.max_external})"
                ) from None
            raise

    async def revoke_external(self, node_id: str, hashes: list[str], tier: int | None) -> None:
        everything = tier is None or not hashes
        await self._run(
            "revoke", [node_id, tier or 0, "1" if everything else "0", *([] if everything else hashes)]
        )

    async def match_external(self, hashes: list[str], count_as_hit: bool) -> list[Match]:
        return (await self.match_external_many([(hashes, count_as_hit)]))[0]

    async def match_external_many(self, queries: list[tuple[list[str], bool]]) -> list[list[Match]]:
        """Every query in one script (one round trip, one command): each is answered and counts its
        hits as its own call would, in order."""
        live = [i for i, (hs, _) in enumerate(queries) if hs]
        out: list[list[Match]] = [[] for _ in queries]
        if not live:
            return out
        packed = msgpack.packb([[queries[i][1], queries[i][0]] for i in live], use_bin_type=True)
        reply = msgpack.unpackb(
            await self._run("match", [self._ttl_ms, self.limits.max_external, packed]), raw=False
        )
        peers, flats = reply
        if len(flats) != len(live):
            raise RuntimeError(f"RedisStore.match: Redis answered {len(flats)} of {len(live)} queries")
        peer_of = {peers[i]: peers[i + 1] for i in range(0, len(peers), 2)}
        for i, flat in zip(live, flats, strict=True):
            by_node: dict[str, dict[int, list[str]]] = {}
            for j in range(0, len(flat), 3):
                h, node, mask = flat[j], flat[j + 1], flat[j + 2]
                tiers = by_node.setdefault(node, {})
                for t in (1, 2, 3):
                    if mask & (1 << t):
                        tiers.setdefault(t, []).append(h)
            out[i] = [(nid, peer_of.get(nid, ""), tiers) for nid, tiers in by_node.items()]
        return out

    async def hit_counts(self, hashes: list[str]) -> list[tuple[str, int]]:
        if not hashes:
            return []
        flat = await self._run("hits", [int(self.limits.hit_ttl_s * 1000), *hashes])
        return [(flat[i].decode(), int(flat[i + 1])) for i in range(0, len(flat), 2)]

    async def reap(self) -> int:
        return int(await self._run("reap", [self._ttl_ms, int(self.limits.hit_ttl_s * 1000)]))

    async def sizes(self) -> dict[str, int]:
        ns = self.ns
        return {
            "nodes": int(await self.r.hlen(f"{ns}:nodes")),
            "external_entries": int(await self.r.get(f"{ns}:extcount") or 0),
            "hit_index": int(await self.r.zcard(f"{ns}:hitts")),
        }

    async def close(self) -> None:
        await self.r.aclose()

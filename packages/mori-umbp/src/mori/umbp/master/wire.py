"""The master's wire format: gRPC generic handlers carrying msgpack maps, checked against a schema.

Why not protobuf: a ``.proto`` would mean either a code-generation step in the build or committed
``*_pb2.py`` files tied to the protobuf runtime version that generated them (protobuf refuses to
load gencode newer than its runtime), for eight small messages. gRPC's generic handlers take any
(de)serializer, so the service is ordinary gRPC (HTTP/2, deadlines, status codes, metadata,
interceptors, channelz) with msgpack bodies: no generated code, one dependency that mori-io
already has, and the whole schema in this one module, which is also what the fuzz tests attack.

Every request is decoded with hard limits (sizes of strings, arrays, maps, nesting) and then
checked field by field: a missing field, a field of the wrong type, an unknown field, a tier
outside :class:`UMBPTierType` or a batch larger than ``UMBP_MASTER_MAX_BATCH`` is a
:class:`WireError`, which the server answers with ``INVALID_ARGUMENT`` naming the field.
"""

from __future__ import annotations

from typing import Any

import msgpack

SERVICE = "umbp.Master"
MAX_MESSAGE_BYTES = 64 << 20
MAX_STR = 4096  #: bytes of one key, hash, node id or address
MAX_TAGS = 64


class WireError(ValueError):
    """A request that does not match its schema."""


# A schema: field -> kind. Kinds: "str", "bin", "bool", "uint", "tier", "strs" (list of str),
# "events" (heartbeat events), "tiers" (capacities), "uints" (list of uint).
SCHEMAS: dict[str, dict[str, str]] = {
    "RegisterClient": {"node_id": "str", "node_address": "str", "peer_address": "str", "engine_desc": "bin",
                       "tiers": "tiers", "tags": "strs"},
    "UnregisterClient": {"node_id": "str"},
    "Heartbeat": {"node_id": "str", "events": "events", "tiers": "tiers", "full_sync": "bool"},
    "RouteGet": {"node_id": "str", "keys": "strs", "exclude": "strs"},
    "RoutePut": {"node_id": "str", "keys": "strs", "sizes": "uints", "exclude": "strs"},
    "Lookup": {"keys": "strs"},
    "GetNode": {"node_id": "str"},
    "ReportExternalKv": {"node_id": "str", "hashes": "strs", "tier": "tier"},
    "RevokeExternalKv": {"node_id": "str", "hashes": "strs", "tier": "tier"},
    "RevokeAllExternalKvAtTier": {"node_id": "str", "tier": "tier"},
    "RevokeAllExternalKvForNode": {"node_id": "str"},
    "MatchExternalKv": {"hashes": "strs", "count_as_hit": "bool"},
    "GetExternalKvHitCounts": {"hashes": "strs"},
    "MatchExternalKvBatch": {"queries": "queries"},
    "Ping": {},
}  # fmt: skip

MAX_QUERIES = 1024  #: match queries in one MatchExternalKvBatch

#: heartbeat event kinds
ADD, REMOVE = 0, 1
TIERS = (1, 2, 3)  #: HBM, DRAM, SSD (Unknown is never stored)


def pack(obj: Any) -> bytes:
    out: bytes = msgpack.packb(obj, use_bin_type=True)
    return out


def unpack(data: bytes, max_batch: int) -> Any:
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_STR,
            max_bin_len=1 << 20,
            max_array_len=max_batch,
            max_map_len=64,
            max_ext_len=0,
        )
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise WireError(f"not a valid msgpack message: {e}") from None


def _str(method: str, name: str, v: Any) -> str:
    if not isinstance(v, str):
        raise WireError(f"{method}: field {name!r} must be a string, got {type(v).__name__}")
    return v


def _uint(method: str, name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise WireError(f"{method}: field {name!r} must be an unsigned integer, got {v!r}")
    return v


def _tier(method: str, name: str, v: Any) -> int:
    if isinstance(v, bool) or v not in TIERS:
        raise WireError(f"{method}: field {name!r} must be a tier (1 HBM, 2 DRAM, 3 SSD), got {v!r}")
    return int(v)


def _list(method: str, name: str, v: Any, max_batch: int) -> list[Any]:
    if not isinstance(v, list):
        raise WireError(f"{method}: field {name!r} must be a list, got {type(v).__name__}")
    if len(v) > max_batch:
        raise WireError(f"{method}: field {name!r} has {len(v)} items, more than the limit {max_batch}")
    return v


def _strs(method: str, name: str, v: Any, max_batch: int) -> list[str]:
    items = _list(method, name, v, max_batch)
    if all(type(s) is str for s in items):  # the common case, checked without a call per item
        return items
    return [_str(method, f"{name}[]", s) for s in items]  # raises, naming the field


def check(method: str, msg: Any, max_batch: int) -> dict[str, Any]:
    """Validate a decoded request against its schema; returns it with defaults filled in."""
    schema = SCHEMAS[method]
    if not isinstance(msg, dict):
        raise WireError(f"{method}: the request must be a map, got {type(msg).__name__}")
    unknown = set(msg) - set(schema)
    if unknown:
        raise WireError(f"{method}: unknown field(s) {sorted(unknown)!r}")
    out: dict[str, Any] = {}
    for name, kind in schema.items():
        v = msg.get(name)
        if kind == "str":
            out[name] = "" if v is None else _str(method, name, v)
        elif kind == "bin":
            if v is None:
                v = b""
            if not isinstance(v, bytes):
                raise WireError(f"{method}: field {name!r} must be bytes")
            out[name] = v
        elif kind == "bool":
            if v is None:
                v = False
            if not isinstance(v, bool):
                raise WireError(f"{method}: field {name!r} must be a bool, got {v!r}")
            out[name] = v
        elif kind == "uint":
            out[name] = 0 if v is None else _uint(method, name, v)
        elif kind == "tier":
            if v is None:
                raise WireError(f"{method}: field {name!r} is required")
            out[name] = _tier(method, name, v)
        elif kind == "strs":
            out[name] = _strs(method, name, [] if v is None else v, MAX_TAGS if name == "tags" else max_batch)
        elif kind == "uints":
            items = _list(method, name, [] if v is None else v, max_batch)
            out[name] = [_uint(method, f"{name}[]", s) for s in items]
        elif kind == "tiers":
            items = _list(method, name, [] if v is None else v, 8)
            caps = []
            for it in items:
                if not isinstance(it, list) or len(it) != 3:
                    raise WireError(
                        f"{method}: field {name!r} entries must be [tier, total_bytes, available_bytes]"
                    )
                caps.append(
                    (_tier(method, name, it[0]), _uint(method, name, it[1]), _uint(method, name, it[2]))
                )
            out[name] = caps
        elif kind == "events":
            items = _list(method, name, [] if v is None else v, max_batch)
            events = []
            for it in items:
                if not isinstance(it, list) or len(it) != 4 or it[0] not in (ADD, REMOVE):
                    raise WireError(f"{method}: field {name!r} entries must be [kind 0|1, key, tier, size]")
                events.append((it[0], _str(method, "events[].key", it[1]), _tier(method, "events[].tier", it[2]),
                               _uint(method, "events[].size", it[3])))  # fmt: skip
            out[name] = events
        elif kind == "queries":  # [[hashes, count_as_hit], ...], at most max_batch hashes in all
            items = _list(method, name, [] if v is None else v, MAX_QUERIES)
            queries, total = [], 0
            for it in items:
                if not isinstance(it, list) or len(it) != 2 or not isinstance(it[1], bool):
                    raise WireError(f"{method}: field {name!r} entries must be [hashes, count_as_hit]")
                hs = _strs(method, "queries[].hashes", it[0], max_batch)
                total += len(hs)
                if total > max_batch:
                    raise WireError(f"{method}: more than {max_batch} hashes in all queries")
                queries.append((hs, it[1]))
            out[name] = queries
        else:  # pragma: no cover - a schema typo
            raise AssertionError(kind)
    if "node_id" in schema and method not in ("RouteGet", "RoutePut") and not out["node_id"]:
        raise WireError(f"{method}: field 'node_id' must not be empty")
    return out

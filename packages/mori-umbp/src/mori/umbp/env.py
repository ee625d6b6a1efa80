"""Every ``UMBP_*`` environment variable mori-umbp reads, parsed and validated in one place.

Names and defaults are the original's. :meth:`mori.umbp.UMBPConfig.from_environment` overlays the
``UMBP_DRAM_*``/``UMBP_SSD_*``/``UMBP_ROLE`` ones on the config defaults; the master reads the
``UMBP_HEARTBEAT_*``, ``UMBP_LEASE_*``, ``UMBP_HIT_*``, ``UMBP_METADATA_BACKEND`` and
``UMBP_REDIS_*`` ones when it starts. Values are read on use, never at import. ``mori env`` lists
them (through the ``mori_env_vars`` hook in :mod:`mori.umbp.cli`). Unlike the original, a value
that does not parse is an error naming the variable, never silently the default.
"""

from __future__ import annotations

from collections.abc import Callable

from mori.core.env import EnvVar, choice, parse_bool, parse_size


def _whole(min_allowed: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text.strip())
        if value < min_allowed:
            raise ValueError(f"must be a whole number >= {min_allowed}")
        return value

    return parse


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise ValueError("must be a number in (0, 1]")
    return value


def _numa_nodes(text: str) -> list[int]:
    nodes = [int(part) for part in text.split(",") if part.strip()]
    if any(n < 0 for n in nodes):
        raise ValueError("NUMA node ids must be >= 0")
    if len(set(nodes)) != len(nodes):
        raise ValueError("NUMA node ids must not repeat")
    return nodes


def _int_or_bool(text: str) -> bool:
    # the original reads these with atoi: any non-zero number is true
    t = text.strip()
    return int(t) != 0 if t.lstrip("+-").isdigit() else parse_bool(t)


UMBP_DRAM_CAPACITY = EnvVar(
    "UMBP_DRAM_CAPACITY", "4G", "Bytes of the DRAM tier (dram.capacity_bytes).", "8G", parse_size
)
UMBP_DRAM_HIGH_WM = EnvVar(
    "UMBP_DRAM_HIGH_WM", "0.9", "DRAM fill fraction that starts eviction.", "0.9", _fraction, "(0, 1]"
)
UMBP_DRAM_LOW_WM = EnvVar(
    "UMBP_DRAM_LOW_WM",
    "0.7",
    "DRAM fill fraction eviction brings the tier down to.",
    "0.7",
    _fraction,
    "(0, 1]",
)
UMBP_DRAM_USE_HUGEPAGES = EnvVar(
    "UMBP_DRAM_USE_HUGEPAGES",
    "0",
    "Back the DRAM tier with huge pages (falls back to normal pages).",
    "1",
    _int_or_bool,
)
UMBP_DRAM_HUGEPAGE_SIZE = EnvVar(
    "UMBP_DRAM_HUGEPAGE_SIZE", "2M", "Huge page size in bytes (a power of two).", "1G", parse_size
)
UMBP_DRAM_NUMA_NODE = EnvVar(
    "UMBP_DRAM_NUMA_NODE",
    None,
    "Comma-separated NUMA nodes for the DRAM tier (recorded in the config; binding is opt-in, see the guide).",
    "0,1",
    _numa_nodes,
    "distinct ids >= 0",
)
UMBP_DRAM_NUMA_STRICT = EnvVar(
    "UMBP_DRAM_NUMA_STRICT",
    "0",
    "Fail instead of falling back when the NUMA binding fails.",
    "1",
    _int_or_bool,
)
UMBP_DRAM_PREFAULT = EnvVar(
    "UMBP_DRAM_PREFAULT",
    "1",
    "Touch every DRAM-tier page at start (no page faults on the put path).",
    "0",
    _int_or_bool,
)
UMBP_DRAM_PREFAULT_THREADS = EnvVar(
    "UMBP_DRAM_PREFAULT_THREADS", "1", "Threads that prefault the DRAM tier.", "4", _whole(1)
)
UMBP_SSD_ENABLED = EnvVar("UMBP_SSD_ENABLED", "1", "0 disables the SSD tier.", "0", _int_or_bool)
UMBP_SSD_DIR = EnvVar(
    "UMBP_SSD_DIR", "/tmp/umbp_ssd", "Directory of the SSD tier's segmented log.", "/nvme0/umbp", str
)
UMBP_SSD_CAPACITY = EnvVar("UMBP_SSD_CAPACITY", "32G", "Bytes of the SSD tier.", "512G", parse_size)
UMBP_SSD_HIGH_WM = EnvVar(
    "UMBP_SSD_HIGH_WM", "0.9", "SSD fill fraction that starts segment eviction.", "0.9", _fraction, "(0, 1]"
)
UMBP_SSD_LOW_WM = EnvVar(
    "UMBP_SSD_LOW_WM", "0.7", "SSD fill fraction segment eviction brings the tier down to.", "0.7", _fraction
)
UMBP_SSD_BACKEND = EnvVar(
    "UMBP_SSD_BACKEND",
    "file",
    "SSD backend: file (segmented log on a file system) or spdk (needs SPDK: not in this build).",
    "file",
    choice("file", "spdk", "spdk_proxy"),
    "file, spdk, spdk_proxy",
)
UMBP_SPDK_NVME_PCI = EnvVar(
    "UMBP_SPDK_NVME_PCI",
    None,
    "NVMe PCI address for SPDK; implies UMBP_SSD_BACKEND=spdk.",
    "0000:47:00.0",
    str,
)
UMBP_EVICTION_POLICY = EnvVar(
    "UMBP_EVICTION_POLICY", "lru", "Eviction policy of the local tiers.", "lru", choice("lru"), "lru"
)
UMBP_ROLE = EnvVar(
    "UMBP_ROLE",
    None,
    "leader / follower / standalone. Unset: LOCAL_RANK (or the MPI/Slurm local rank) 0 is leader, "
    "others follower; no local rank: standalone.",
    "standalone",
    choice("leader", "follower", "standalone"),
    "leader, follower, standalone",
)
UMBP_MASTER_ADDRESS = EnvVar(
    "UMBP_MASTER_ADDRESS",
    None,
    "host:port of the master (engines' integrations read it).",
    "10.0.0.1:15558",
    str,
)
UMBP_MASTER_BIN = EnvVar(
    "UMBP_MASTER_BIN",
    None,
    "Path of the umbp_master executable; importing mori.umbp sets it to the installed one when unset.",
    "/usr/local/bin/umbp_master",
    str,
)
UMBP_MASTER_AUTH_TOKEN = EnvVar(
    "UMBP_MASTER_AUTH_TOKEN",
    None,
    "Shared secret: a master with a token refuses every call without it; clients send it. Required "
    "when the master listens beyond loopback (or pass --allow-unauthenticated).",
    "s3cret-job-42",
    str,
)
UMBP_NODE_ADDRESS = EnvVar(
    "UMBP_NODE_ADDRESS", None, "This node's address as advertised to peers.", "10.0.0.2", str
)
UMBP_CACHE_REMOTE_FETCHES = EnvVar(
    "UMBP_CACHE_REMOTE_FETCHES",
    None,
    "Cache blocks fetched from peers in the local DRAM tier.",
    "false",
    parse_bool,
)
UMBP_METADATA_BACKEND = EnvVar(
    "UMBP_METADATA_BACKEND",
    "inmemory",
    "Where the master keeps its state: inmemory (lost on restart) or redis (kept across restarts).",
    "redis",
    choice("inmemory", "redis"),
    "inmemory, redis",
)
UMBP_REDIS_URI = EnvVar(
    "UMBP_REDIS_URI",
    "redis://127.0.0.1:6379/0",
    "Redis server of the redis metadata backend.",
    "redis://10.0.0.9:6379/0",
    str,
)
UMBP_REDIS_NAMESPACE = EnvVar(
    "UMBP_REDIS_NAMESPACE",
    "umbp",
    "Key prefix of the master's state in Redis (several pools can share one).",
    "pool-a",
    str,
)
UMBP_HEARTBEAT_TTL_SEC = EnvVar(
    "UMBP_HEARTBEAT_TTL_SEC", "10", "Seconds a node stays registered without a heartbeat.", "10", _whole(1)
)
UMBP_LEASE_DURATION_SEC = EnvVar(
    "UMBP_LEASE_DURATION_SEC",
    "2",
    "Seconds a routed get protects the key from eviction at the master.",
    "2",
    _whole(1),
)
UMBP_HIT_INDEX_TTL_SEC = EnvVar(
    "UMBP_HIT_INDEX_TTL_SEC",
    "7200",
    "Seconds a hash's hit count lives without a counted match.",
    "7200",
    _whole(1),
)
UMBP_HIT_INDEX_GC_INTERVAL_SEC = EnvVar(
    "UMBP_HIT_INDEX_GC_INTERVAL_SEC", "60", "Seconds between sweeps of expired hit counts.", "60", _whole(1)
)
UMBP_HIT_QUERY_MAX_BATCH = EnvVar(
    "UMBP_HIT_QUERY_MAX_BATCH",
    "4096",
    "Most hashes one get_external_kv_hit_counts call may ask about; more is an error, never truncated.",
    "4096",
    _whole(1),
)
UMBP_MASTER_MAX_NODES = EnvVar(
    "UMBP_MASTER_MAX_NODES",
    "4096",
    "Most nodes the master registers at once (more are refused).",
    "4096",
    _whole(1),
)
UMBP_MASTER_MAX_EXTERNAL_KV = EnvVar(
    "UMBP_MASTER_MAX_EXTERNAL_KV",
    "4194304",
    "Most (node, hash, tier) entries of the external-KV index; reports beyond it are refused, not stored.",
    "16777216",
    _whole(1),
)
UMBP_MASTER_MAX_BATCH = EnvVar(
    "UMBP_MASTER_MAX_BATCH",
    "65536",
    "Most hashes or keys in one report, revoke, match or route call.",
    "65536",
    _whole(1),
)
UMBP_RPC_TIMEOUT_MS = EnvVar(
    "UMBP_RPC_TIMEOUT_MS",
    "5000",
    "Deadline of every call a client makes to the master or a peer.",
    "2000",
    _whole(1),
)
UMBP_FETCH_TIMEOUT_MS = EnvVar(
    "UMBP_FETCH_TIMEOUT_MS",
    "10000",
    "Milliseconds a get may spend pulling a block from a peer; past it the get fails (the peer's lease is longer).",
    "3000",
    _whole(1),
)

ALL: list[EnvVar[object]] = [v for v in list(globals().values()) if isinstance(v, EnvVar)]

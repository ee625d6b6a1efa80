"""Every ``MORI_IO_*`` environment variable mori-io reads, parsed and validated in one place.

Values are read when an engine or backend is created, never at import. ``mori env`` lists them
(through the ``mori_env_vars`` hook in :mod:`mori.io.cli`). ``MORI_NODE_ID`` (mori-core) decides
which engines share a host.
"""

from __future__ import annotations

from mori.core.env import EnvVar, choice, parse_bool, parse_size

LOG_LEVELS = ("trace", "debug", "info", "warning", "error", "critical")


def _whole_bytes(text: str) -> int:
    n = int(text)
    if n < 0:
        raise ValueError("must be a whole number >= 0")
    return n


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError("must be a whole number larger than 0")
    return value


#: MORI_IO_CMA_THREADS' largest value (the native engine's kMaxCmaThreads)
MAX_CMA_THREADS = 64
#: MORI_IO_CMA_SPLIT_BYTES' bounds (the native engine's kSplitMinFloor; 1 GiB)
MIN_CMA_SPLIT_BYTES, MAX_CMA_SPLIT_BYTES = 4096, 1 << 30


def _cma_threads(text: str) -> int:
    value = int(text)
    if not 1 <= value <= MAX_CMA_THREADS:
        raise ValueError(f"must be a whole number from 1 to {MAX_CMA_THREADS}")
    return value


def _cma_split_bytes(text: str) -> int:
    value = parse_size(text)
    if not MIN_CMA_SPLIT_BYTES <= value <= MAX_CMA_SPLIT_BYTES:
        raise ValueError("must be a byte count from 4096 (4K) to 1G")
    return value


MORI_IO_CP_TIMEOUT_MS = EnvVar(
    "MORI_IO_CP_TIMEOUT_MS",
    "30000",
    "Milliseconds a peer may stay silent while transfers to it are pending (and connecting to it, "
    "all of its connections together, may take) before those transfers fail with ERR_BAD_STATE; "
    "also bounds how long deregister_memory waits for transfers on the region.",
    "5000",
    _positive_int,
    "a whole number of milliseconds > 0",
)
MORI_IO_AUTH_TOKEN = EnvVar(
    "MORI_IO_AUTH_TOKEN",
    None,
    "Shared secret of the engines that may talk to each other (IOEngineConfig.auth_token wins over "
    "it). Every connection starts with an HMAC-SHA256 challenge-response in both directions, so the "
    "secret never crosses the wire; an engine without it refuses engines with it and the other way "
    "round. It authenticates peers, it does not encrypt the data. Required to listen beyond loopback.",
    "s3cret-job-42",
    str,
)
MORI_IO_ALLOW_UNAUTHENTICATED = EnvVar(
    "MORI_IO_ALLOW_UNAUTHENTICATED",
    "0",
    "1 lets an engine listen beyond loopback (IOEngineConfig.host not 127.0.0.1/::1) without "
    "MORI_IO_AUTH_TOKEN, so that anyone who reaches its port can read and write its registered "
    "memory (a closed network you trust). Otherwise such an engine refuses to start.",
    "1",
    parse_bool,
    "1/0, on/off, true/false, yes/no",
)
MORI_IO_LOG_LEVEL = EnvVar(
    "MORI_IO_LOG_LEVEL",
    "warning",
    "Log threshold of the engine (native messages go to stderr).",
    "info",
    lambda text: choice(*LOG_LEVELS)(text.strip().lower()),
    ", ".join(LOG_LEVELS),
)
MORI_IO_ENABLE_NOTIFICATION = EnvVar(
    "MORI_IO_ENABLE_NOTIFICATION",
    None,
    "Overrides the backend config's enable_notification: whether targets record inbound statuses "
    "for pop_inbound_transfer_status.",
    "0",
    parse_bool,
    "1/0, on/off, true/false, yes/no",
)
MORI_IO_CHUNK_BYTES = EnvVar(
    "MORI_IO_CHUNK_BYTES",
    None,
    "Overrides TcpBackendConfig.chunk_bytes: largest piece of a transfer sent as one message; "
    "pieces are striped over the connections of a peer.",
    "4M",
    parse_size,
    "a byte count such as 262144, 1M, 4M",
)
MORI_IO_TCP_CONNS_PER_PEER = EnvVar(
    "MORI_IO_TCP_CONNS_PER_PEER",
    None,
    "Overrides TcpBackendConfig.num_connections_per_peer.",
    "8",
    _positive_int,
    "a whole number > 0",
)
MORI_IO_TCP_CMA = EnvVar(
    "MORI_IO_TCP_CMA",
    None,
    "Overrides TcpBackendConfig.enable_cma: let same-host peers move CPU bytes by cross-memory "
    "attach (process_vm_readv/writev) instead of the socket; falls back to the socket where the OS "
    "refuses.",
    "0",
    parse_bool,
    "1/0, on/off, true/false, yes/no",
)

MORI_IO_CMA_THREADS = EnvVar(
    "MORI_IO_CMA_THREADS",
    None,
    "Threads (the posting one included) that copy one large same-host transfer of the TCP "
    "backend's direct attach path (process_vm_readv/writev by the initiator): a transfer is cut "
    "into up to that many pieces of at least MORI_IO_CMA_SPLIT_BYTES, copied in parallel. "
    "Default: the number of CPUs, at most 4; 1 copies on the posting thread only. The extra "
    "threads are the engine's own (started on the first transfer that is cut, joined when the "
    "engine closes).",
    "2",
    _cma_threads,
    f"a whole number from 1 to {MAX_CMA_THREADS}",
)
MORI_IO_CMA_SPLIT_BYTES = EnvVar(
    "MORI_IO_CMA_SPLIT_BYTES",
    None,
    "Smallest piece a same-host transfer of the direct attach path is cut into for "
    "MORI_IO_CMA_THREADS threads, so transfers from twice this size are copied in parallel. "
    "Default: 64K where the target's bytes lie on 4 KiB pages (one core pins and copies those at "
    "about 25 GB/s at best), 256K where they lie on huge pages.",
    "1M",
    _cma_split_bytes,
    "a byte count from 4096 (4K) to 1G",
)


MORI_IO_RDMA_TRANSPORT = EnvVar(
    "MORI_IO_RDMA_TRANSPORT",
    None,
    "The network transport BackendType.RDMA moves bytes with: a name `mori backends` lists. Default "
    "ucx (mori-backend-ucx: RDMA verbs where NICs exist, TCP and shared memory where not); tcp runs "
    "the same backend on the built-in transport. Both engines must use the same.",
    "tcp",
    str,
)
MORI_IO_THP = EnvVar(
    "MORI_IO_THP",
    "0",
    "Opt-in tuning that changes the paging of your memory: 1 makes registration back the 2 MiB-"
    "aligned interior of registered CPU memory with transparent huge pages (MADV_HUGEPAGE, and "
    "MADV_COLLAPSE up to MORI_IO_THP_COLLAPSE_BYTES; contents unchanged), which speeds up the "
    "same-host attach path. Off by default: memory you allocate on huge pages yourself gets the "
    "same speed-up (registration sees it) without the library touching your pages.",
    "1",
    choice("0", "1"),
    "0 or 1",
)
MORI_IO_THP_COLLAPSE_BYTES = EnvVar(
    "MORI_IO_THP_COLLAPSE_BYTES",
    "1073741824",
    "With MORI_IO_THP=1: largest 2 MiB-aligned interior of a CPU region that registration collapses "
    "onto huge pages (about 1-3 ms per MiB); larger regions are only marked MADV_HUGEPAGE.",
    "268435456",
    _whole_bytes,
    "a whole number of bytes >= 0",
)
MORI_IO_SHORT_SLICE = EnvVar(
    "MORI_IO_SHORT_SLICE",
    "0",
    "Opt-in tuning of the engine's own threads: 1 makes them ask the scheduler for a 0.1 ms time "
    "slice (Linux >= 6.12, EEVDF; no privilege), so they preempt a busy-polling neighbour (a NIXL "
    "progress thread, a spinning GPU poller) when they wake instead of waiting out its slice (a "
    "scheduler tick). Off by default: the library leaves thread scheduling alone.",
    "1",
    parse_bool,
    "1/0, on/off, true/false, yes/no",
)
MORI_IO_MOVE_COPY_THREADS = EnvVar(
    "MORI_IO_MOVE_COPY_THREADS",
    "0",
    "Opt-in tuning of the engine's own threads: 1 lets a posting thread move a copy thread of the "
    "same-host path that the scheduler left on the poster's CPU to another CPU it may run on (its "
    "affinity mask is written, then given back). Off by default: the library leaves affinity alone.",
    "1",
    parse_bool,
    "1/0, on/off, true/false, yes/no",
)
MORI_IO_MAX_CONNECTIONS = EnvVar(
    "MORI_IO_MAX_CONNECTIONS",
    "1024",
    "Inbound connections an engine keeps at once (each has a thread); beyond, new ones are closed "
    "at accept and counted (counters: connections_refused).",
    "256",
    _positive_int,
    "a whole number > 0",
)
MORI_IO_MAX_HANDSHAKES = EnvVar(
    "MORI_IO_MAX_HANDSHAKES",
    "64",
    "Inbound connections still in their handshake at once; beyond, new ones are closed at accept.",
    "16",
    _positive_int,
    "a whole number > 0",
)
MORI_IO_HANDSHAKE_TIMEOUT_MS = EnvVar(
    "MORI_IO_HANDSHAKE_TIMEOUT_MS",
    "10000",
    "Milliseconds an inbound connection has for its whole handshake (at most MORI_IO_CP_TIMEOUT_MS); "
    "a connection that has not proven itself by then is dropped.",
    "2000",
    _positive_int,
    "a whole number of milliseconds > 0",
)
MORI_IO_IDLE_TIMEOUT_MS = EnvVar(
    "MORI_IO_IDLE_TIMEOUT_MS",
    "600000",
    "Milliseconds an inbound connection may stay silent before the target closes it (0: never). "
    "Initiators learn the value in the handshake and replace connections silent for half of it "
    "before use, so no transfer meets a closing connection.",
    "60000",
    _whole_bytes,
    "a whole number of milliseconds >= 0",
)
MORI_IO_MAX_INBOUND = EnvVar(
    "MORI_IO_MAX_INBOUND",
    "262144",
    "Inbound transfer statuses an engine keeps for pop_inbound_transfer_status, in all; a new one "
    "beyond it evicts the oldest (counters: inbound_dropped).",
    "65536",
    _positive_int,
    "a whole number > 0",
)
MORI_IO_MAX_INBOUND_PER_PEER = EnvVar(
    "MORI_IO_MAX_INBOUND_PER_PEER",
    "65536",
    "Inbound transfer statuses an engine keeps per initiator key; a new one beyond it evicts that "
    "initiator's oldest (counters: inbound_dropped).",
    "16384",
    _positive_int,
    "a whole number > 0",
)


#: every variable mori-io reads, in the order `mori env` prints them
def _threshold(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("must be a whole number >= 0")
    return value


MORI_IO_XGMI_SCATTER_GATHER_THRESHOLD = EnvVar(
    "MORI_IO_XGMI_SCATTER_GATHER_THRESHOLD",
    "8",
    "XGMI backend: a batch with at least this many blocks of at most 1 MiB (after merging contiguous "
    "ones) is copied by one launch of the Triton scatter-gather kernel instead of one copy per block; "
    "0 turns the kernel off.",
    "4",
    _threshold,
    "a whole number >= 0 (0 = never use the kernel)",
)


ALL: tuple[EnvVar[object], ...] = (
    MORI_IO_CP_TIMEOUT_MS,  # type: ignore[assignment]
    MORI_IO_AUTH_TOKEN,
    MORI_IO_ALLOW_UNAUTHENTICATED,
    MORI_IO_LOG_LEVEL,
    MORI_IO_ENABLE_NOTIFICATION,
    MORI_IO_CHUNK_BYTES,
    MORI_IO_TCP_CONNS_PER_PEER,
    MORI_IO_TCP_CMA,
    MORI_IO_CMA_THREADS,
    MORI_IO_CMA_SPLIT_BYTES,
    MORI_IO_RDMA_TRANSPORT,
    MORI_IO_THP,
    MORI_IO_THP_COLLAPSE_BYTES,
    MORI_IO_SHORT_SLICE,
    MORI_IO_MOVE_COPY_THREADS,
    MORI_IO_MAX_CONNECTIONS,
    MORI_IO_MAX_HANDSHAKES,
    MORI_IO_HANDSHAKE_TIMEOUT_MS,
    MORI_IO_IDLE_TIMEOUT_MS,
    MORI_IO_MAX_INBOUND,
    MORI_IO_MAX_INBOUND_PER_PEER,
    MORI_IO_XGMI_SCATTER_GATHER_THRESHOLD,
)

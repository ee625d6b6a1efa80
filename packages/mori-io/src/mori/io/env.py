"""Every ``MORI_IO_*`` environment variable mori-io reads, parsed and validated in one place.

Values are read when an engine or backend is created, never at import. ``mori env`` lists them
(through the ``mori_env_vars`` hook in :mod:`mori.io.cli`). ``MORI_NODE_ID`` (mori-core) decides
which engines share a host.
"""

from __future__ import annotations

from mori.core.env import EnvVar, choice, parse_bool, parse_size

LOG_LEVELS = ("trace", "debug", "info", "warning", "error", "critical")


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError("must be a whole number larger than 0")
    return value


MORI_IO_CP_TIMEOUT_MS = EnvVar(
    "MORI_IO_CP_TIMEOUT_MS",
    "30000",
    "Milliseconds a peer may stay silent while transfers to it are pending (and a connect or "
    "handshake may take) before those transfers fail with ERR_BAD_STATE; also bounds how long "
    "deregister_memory waits for transfers on the region.",
    "5000",
    _positive_int,
    "a whole number of milliseconds > 0",
)
MORI_IO_AUTH_TOKEN = EnvVar(
    "MORI_IO_AUTH_TOKEN",
    None,
    "Shared secret: an engine with a token refuses peers that do not present the same token, in "
    "both directions. Sent in clear text: it keeps strangers and misconfigured jobs out, it is not "
    "encryption.",
    "s3cret-job-42",
    str,
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
    "into up to that many pieces of at least 1 MiB, copied in parallel. Default: the number of "
    "CPUs, at most 4; 1 copies on the posting thread only.",
    "2",
    _positive_int,
    "a whole number > 0",
)


def _whole_bytes(text: str) -> int:
    n = int(text)
    if n < 0:
        raise ValueError(text)
    return n


MORI_IO_THP = EnvVar(
    "MORI_IO_THP",
    "1",
    "Registration backs the 2 MiB-aligned interior of registered CPU memory with transparent huge "
    "pages (MADV_HUGEPAGE, and MADV_COLLAPSE up to MORI_IO_THP_COLLAPSE_BYTES; contents unchanged), "
    "which speeds up the same-host attach path; 0 leaves the pages alone. Read by the native engine "
    "once per process, at its first registration.",
    "0",
    choice("0", "1"),
    "0 or 1 (the native engine reads it: nothing else means off)",
)
MORI_IO_THP_COLLAPSE_BYTES = EnvVar(
    "MORI_IO_THP_COLLAPSE_BYTES",
    "1073741824",
    "Largest 2 MiB-aligned interior of a CPU region that registration collapses onto huge pages "
    "(about 1-3 ms per MiB); larger regions are only marked MADV_HUGEPAGE.",
    "268435456",
    _whole_bytes,
    "a whole number of bytes >= 0 (no suffixes: the native engine reads it with strtoull)",
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
    MORI_IO_LOG_LEVEL,
    MORI_IO_ENABLE_NOTIFICATION,
    MORI_IO_CHUNK_BYTES,
    MORI_IO_TCP_CONNS_PER_PEER,
    MORI_IO_TCP_CMA,
    MORI_IO_CMA_THREADS,
    MORI_IO_THP,
    MORI_IO_THP_COLLAPSE_BYTES,
    MORI_IO_XGMI_SCATTER_GATHER_THRESHOLD,
)

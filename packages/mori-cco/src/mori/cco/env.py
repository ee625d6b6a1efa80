"""The ``MORI_*`` environment variables mori-cco reads (``mori env`` lists them)."""

from __future__ import annotations

from mori.core.env import EnvVar, choice

__all__ = ["ALL", "MORI_CCO_GDA_CONN", "MORI_SDMA_NUM_CHANNELS", "MORI_SDMA_QUEUE_DEPTH"]

#: most copy-engine queues per communicator (the original's limit)
MAX_SDMA_QUEUES = 8
#: most entries per copy-engine queue
MAX_SDMA_QUEUE_DEPTH = 4096


def _channels(text: str) -> int:
    value = int(text)
    if not 1 <= value <= MAX_SDMA_QUEUES:
        raise ValueError(f"must be an int in [1, {MAX_SDMA_QUEUES}]")
    return value


def _depth(text: str) -> int:
    value = int(text)
    if not 1 <= value <= MAX_SDMA_QUEUE_DEPTH or value & (value - 1):
        raise ValueError(f"must be a power of two in [1, {MAX_SDMA_QUEUE_DEPTH}]")
    return value


MORI_SDMA_NUM_CHANNELS = EnvVar(
    "MORI_SDMA_NUM_CHANNELS",
    "2",
    "Copy-engine queues of a communicator when CCODevCommRequirements.sdma_queue_count is 0.",
    "4",
    _channels,
    f"1-{MAX_SDMA_QUEUES}",
)
MORI_SDMA_QUEUE_DEPTH = EnvVar(
    "MORI_SDMA_QUEUE_DEPTH",
    "256",
    "Entries of each copy-engine queue's ring: a put waits for room when this many are in flight.",
    "1024",
    _depth,
    f"a power of two, 1-{MAX_SDMA_QUEUE_DEPTH}",
)
MORI_CCO_GDA_CONN = EnvVar(
    "MORI_CCO_GDA_CONN",
    None,
    "Override CCODevCommRequirements.gda_connection_type for every device communicator: none, crossnode, "
    "full (GDA also between ranks of one node) or rail. GDA needs the transport layer's proxy (issue 14).",
    "full",
    choice("none", "crossnode", "full", "rail"),
    "none, crossnode, full, rail",
)

#: every variable mori-cco reads, in the order `mori env` prints them
ALL: tuple[EnvVar[object], ...] = (MORI_SDMA_NUM_CHANNELS, MORI_SDMA_QUEUE_DEPTH, MORI_CCO_GDA_CONN)  # type: ignore[assignment]

"""Enumerations, backend configurations and the descriptors engines exchange."""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Any

import msgpack

from mori.core.errors import MoriValueError, bad_type, bad_value


class BackendType(enum.IntEnum):
    """Data paths. ``TCP`` is built in; ``XGMI`` comes from a GPU plugin; ``RDMA`` runs on a network
    transport (mori-backend-ucx's ``ucx``, or the built-in ``tcp``); ``FABRIC`` is not available in
    this build (``create_backend`` says so)."""

    Unknown = 0
    XGMI = 1
    RDMA = 2
    TCP = 3
    FABRIC = 4


class MemoryLocationType(enum.IntEnum):
    """Where registered memory lives."""

    Unknown = 0
    CPU = 1
    GPU = 2


class PollCqMode(enum.IntEnum):
    """How RDMA completion queues are polled (kept for API compatibility; TCP ignores it)."""

    POLLING = 0
    EVENT = 1


U64_MAX = (1 << 64) - 1


def _check_int(
    func: str, arg: str, value: Any, minimum: int | None = 0, maximum: int | None = U64_MAX
) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_type(func, arg, value, "int")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        lo = "" if minimum is None else f">= {minimum}"
        hi = "" if maximum is None else f"<= {maximum}" + (" (2**64 - 1)" if maximum == U64_MAX else "")
        raise bad_value(func, arg, value, "an int " + " and ".join(x for x in (lo, hi) if x))
    return value


def _check_bool(func: str, arg: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise bad_type(func, arg, value, "bool")
    return value


@dataclass(frozen=True)
class IOEngineConfig:
    """Where an engine listens and whom it lets in.

    ``host``: bind address (``""`` = every interface, the descriptor then advertises this host's
    address); ``port``: TCP port, ``0`` picks a free one. ``auth_token``: the shared secret of the
    engines that talk to each other (``None``: ``MORI_IO_AUTH_TOKEN``); peers prove they hold it by
    HMAC challenge-response, it never crosses the wire. An engine listening beyond loopback refuses
    to start without one unless ``allow_unauthenticated`` (or ``MORI_IO_ALLOW_UNAUTHENTICATED=1``):
    then anyone who reaches the port can read and write its registered memory.
    """

    host: str = ""
    port: int = 0
    auth_token: str | None = None
    allow_unauthenticated: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.host, str):
            raise bad_type("IOEngineConfig", "host", self.host, "str")
        _check_int("IOEngineConfig", "port", self.port, 0, 65535)
        if self.auth_token is not None:
            if not isinstance(self.auth_token, str):
                raise bad_type("IOEngineConfig", "auth_token", self.auth_token, "str or None")
            if not self.auth_token or len(self.auth_token.encode()) > 1024:
                raise bad_value(
                    "IOEngineConfig", "auth_token", f"<{len(self.auth_token)} characters>", "1 to 1024 bytes"
                )
        _check_bool("IOEngineConfig", "allow_unauthenticated", self.allow_unauthenticated)

    def __repr__(self) -> str:  # never print the secret
        token = None if self.auth_token is None else "<hidden>"
        return (
            f"IOEngineConfig(host={self.host!r}, port={self.port}, auth_token={token}, "
            f"allow_unauthenticated={self.allow_unauthenticated})"
        )


@dataclass(frozen=True)
class TcpBackendConfig:
    """Settings of the TCP backend (``BackendType.TCP``).

    ``num_connections_per_peer``: sockets opened to each remote engine; pieces of a transfer are
    striped over them. ``chunk_bytes``: largest piece sent as one message (bytes). ``socket_buffer_bytes``:
    SO_SNDBUF/SO_RCVBUF, ``0`` keeps the kernel's autotuning. ``enable_cma``: between engines on one
    node, CPU bytes move by cross-memory attach (``process_vm_readv``/``writev``) instead of through
    the socket: the initiator copies itself, on the posting thread (transfers from twice
    ``MORI_IO_CMA_SPLIT_BYTES`` on, 128 KiB by default on 4 KiB pages, cut over ``MORI_IO_CMA_THREADS``
    threads), after checking every block against the registration table the
    target publishes, so the status is final when ``read``/``write`` returns; where the target
    publishes no table entry (GPU memory, a full table) the target copies after its own bounds
    check, and where the OS refuses attach the bytes go through the socket. ``enable_notification``:
    targets record inbound statuses. Environment variables ``MORI_IO_TCP_CONNS_PER_PEER``,
    ``MORI_IO_CHUNK_BYTES``, ``MORI_IO_TCP_CMA`` and ``MORI_IO_ENABLE_NOTIFICATION`` override these.
    Memory on huge pages (allocated so by you, or ``MORI_IO_THP=1``) speeds the same-host path up;
    see the MORI-IO guide.
    """

    num_connections_per_peer: int = 4
    chunk_bytes: int = 1 << 20
    socket_buffer_bytes: int = 0
    enable_cma: bool = True
    enable_notification: bool = True

    def __post_init__(self) -> None:
        _check_int("TcpBackendConfig", "num_connections_per_peer", self.num_connections_per_peer, 1)
        if self.num_connections_per_peer > 64:
            raise bad_value(
                "TcpBackendConfig", "num_connections_per_peer", self.num_connections_per_peer, "1 to 64"
            )
        _check_int("TcpBackendConfig", "chunk_bytes", self.chunk_bytes, 4096)
        if self.chunk_bytes > 1 << 30:
            raise bad_value("TcpBackendConfig", "chunk_bytes", self.chunk_bytes, "4096 to 1 GiB")
        _check_int("TcpBackendConfig", "socket_buffer_bytes", self.socket_buffer_bytes)
        if self.socket_buffer_bytes > 1 << 30:
            raise bad_value("TcpBackendConfig", "socket_buffer_bytes", self.socket_buffer_bytes, "0 to 1 GiB")
        _check_bool("TcpBackendConfig", "enable_cma", self.enable_cma)
        _check_bool("TcpBackendConfig", "enable_notification", self.enable_notification)


@dataclass(frozen=True)
class RdmaBackendConfig:
    """Settings of the RDMA backend (same fields, order and defaults as the original, so code written
    for it constructs unchanged). ``enable_notification`` is applied; the transport owns its queue
    pairs, batching, workers and completion polling, so the other fields are accepted and recorded
    (see :mod:`mori.io.rdma`)."""

    qp_per_transfer: int = 1
    post_batch_size: int = -1
    num_worker_threads: int = -1
    poll_cq_mode: PollCqMode = PollCqMode.POLLING
    enable_notification: bool = True
    notif_per_qp: int = 1024
    enable_transfer_chunking: bool = False
    chunk_bytes: int = 65536
    max_chunks_per_transfer: int = 64
    num_nics_per_transfer: int = 1
    max_send_wr: int = -1
    max_cqe_num: int = -1
    max_msg_sge: int = -1


@dataclass(frozen=True)
class XgmiBackendConfig:
    """Settings of the XGMI/NVLink backend: copy streams and events per engine."""

    num_streams: int = 64
    num_events: int = 64

    def __post_init__(self) -> None:
        _check_int(type(self).__name__, "num_streams", self.num_streams, 1)
        _check_int(type(self).__name__, "num_events", self.num_events, 1)


@dataclass(frozen=True)
class FabricBackendConfig(XgmiBackendConfig):
    """Settings of the FABRIC backend (same fields as XGMI; not available in this build)."""


def _unpack_fields(cls: type, data: Any) -> dict[str, Any]:
    name = cls.__name__
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise bad_type(f"{name}.unpack", "data", data, "bytes from pack()")
    try:
        values = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
    except Exception as e:
        raise MoriValueError(f"{name}.unpack: data is not a packed {name}: {e}") from None
    names = [f.name for f in fields(cls)]
    if not isinstance(values, list) or len(values) != len(names):
        raise MoriValueError(f"{name}.unpack: data is not a packed {name} (expected {len(names)} fields)")
    out = dict(zip(names, values, strict=True))
    for f in fields(cls):
        expected = {"str": str, "int": int, "bytes": bytes}[str(f.type)]
        v = out[f.name]
        if isinstance(v, bool) or not isinstance(v, expected):
            raise MoriValueError(f"{name}.unpack: field {f.name} is {type(v).__name__}, expected {f.type}")
    return out


@dataclass(frozen=True)
class EngineDesc:
    """What a peer needs to reach an engine: exchange it out of band (``pack()`` → bytes →
    ``EngineDesc.unpack``), then ``register_remote_engine`` it."""

    key: str
    node_id: str
    hostname: str
    host: str
    port: int
    pid: int

    def pack(self) -> bytes:
        """msgpack bytes; ``EngineDesc.unpack(d.pack()) == d``."""
        data: bytes = msgpack.packb([getattr(self, f.name) for f in fields(self)], use_bin_type=True)
        return data

    @staticmethod
    def unpack(data: bytes) -> EngineDesc:
        """Inverse of :meth:`pack`; raises :class:`MoriValueError` on anything else."""
        return EngineDesc(**_unpack_fields(EngineDesc, data))


@dataclass(frozen=True)
class MemoryDesc:
    """A registered region: ``data`` is its address in the owner's process, ``size`` in bytes,
    ``id`` the owner's handle; ``ipc_handle`` carries what a GPU backend needs to map it."""

    engine_key: str
    id: int
    device_id: int
    device_bus_id: str
    data: int
    size: int
    loc: int
    numa_node: int
    ipc_handle: bytes

    def pack(self) -> bytes:
        """msgpack bytes; ``MemoryDesc.unpack(m.pack()) == m``."""
        data: bytes = msgpack.packb([getattr(self, f.name) for f in fields(self)], use_bin_type=True)
        return data

    @staticmethod
    def unpack(data: bytes) -> MemoryDesc:
        """Inverse of :meth:`pack`; raises :class:`MoriValueError` on anything else."""
        return MemoryDesc(**_unpack_fields(MemoryDesc, data))


__all__ = [
    "BackendType",
    "EngineDesc",
    "FabricBackendConfig",
    "IOEngineConfig",
    "MemoryDesc",
    "MemoryLocationType",
    "PollCqMode",
    "RdmaBackendConfig",
    "TcpBackendConfig",
    "XgmiBackendConfig",
]

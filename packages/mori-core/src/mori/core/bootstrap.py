"""Rendezvous and out-of-band collectives (allgather, barrier) among the ranks of a job.

Three ways in, all ending in a :class:`StoreBootstrap` over a torch ``Store``:

* a **unique id** (128 bytes) made by one process with :func:`get_unique_id`, which starts a torch
  ``TCPStore`` server there; every rank connects to it as a client;
* a **torch.distributed process group**: rank 0 of the group makes the unique id and broadcasts it;
* an **MPI communicator** (mpi4py): rank 0 makes the unique id and broadcasts it.

Every wait honours ``MORI_BOOTSTRAP_TIMEOUT`` and, when it fires, names the ranks that did not arrive.
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, cast

from mori.core import env
from mori.core.errors import MoriError, MoriTimeoutError, MoriValueError, bad_value, format_ranks
from mori.core.topology import advertised_host

UNIQUE_ID_BYTES = 128
_MAGIC = b"MORIUID1"
_HEADER = struct.Struct("!8sH16sB")  # magic, port, nonce, host length
_MAX_HOST = UNIQUE_ID_BYTES - _HEADER.size


@dataclass(frozen=True)
class UniqueId:
    """Decoded form of the 128-byte unique id: where the rendezvous store listens, and a nonce
    that keeps jobs sharing one store apart."""

    host: str
    port: int
    nonce: bytes

    def pack(self) -> bytes:
        host = self.host.encode()
        if len(host) > _MAX_HOST:
            raise MoriValueError(f"rendezvous host name {self.host!r} is longer than {_MAX_HOST} bytes")
        raw = _HEADER.pack(_MAGIC, self.port, self.nonce, len(host)) + host
        return raw.ljust(UNIQUE_ID_BYTES, b"\0")

    @classmethod
    def unpack(cls, uid: bytes | bytearray | memoryview) -> UniqueId:
        raw = bytes(uid)
        if len(raw) != UNIQUE_ID_BYTES:
            raise bad_value(
                "shmem_init_attr",
                "uid",
                f"<{len(raw)} bytes>",
                f"{UNIQUE_ID_BYTES} bytes from shmem_get_unique_id()",
            )
        magic, port, nonce, n = _HEADER.unpack_from(raw)
        if magic != _MAGIC or n > _MAX_HOST:
            raise bad_value("shmem_init_attr", "uid", raw[:8], "bytes made by shmem_get_unique_id()")
        return cls(raw[_HEADER.size : _HEADER.size + n].decode(), port, nonce)


# Stores this process serves, by nonce: the process that made a unique id keeps its server alive
# and, when it is also a rank, talks to it directly.
_servers: dict[bytes, Any] = {}
_servers_lock = threading.Lock()


def get_unique_id() -> bytes:
    """Start a rendezvous store in this process and return the 128-byte id that names it.

    The process must stay alive until every rank has initialised. ``MORI_SOCKET_IFNAME`` picks
    the interface whose address goes into the id.
    """
    from torch._C._distributed_c10d import TCPStore

    timeout = datetime.timedelta(seconds=env.MORI_BOOTSTRAP_TIMEOUT.require())
    server = TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    uid = UniqueId(advertised_host(), server.port, secrets.token_bytes(16))
    with _servers_lock:
        _servers[uid.nonce] = server
    return uid.pack()


def _connect(uid: UniqueId, timeout_s: float) -> Any:
    from torch._C._distributed_c10d import PrefixStore, TCPStore

    with _servers_lock:
        store = _servers.get(uid.nonce)
    if store is None:
        try:
            store = TCPStore(
                uid.host, uid.port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
            )
        except Exception as e:  # torch raises DistStoreError/RuntimeError with its own text
            raise MoriTimeoutError(
                f"could not reach the rendezvous store at {uid.host}:{uid.port} within {timeout_s:g} s "
                f"(MORI_BOOTSTRAP_TIMEOUT): is the process that called shmem_get_unique_id() alive and "
                f"reachable? ({type(e).__name__}: {e})"
            ) from e
    return PrefixStore(f"mori/{uid.nonce.hex()}", store)


class StoreBootstrap:
    """Allgather and barrier over a key-value store; every wait names the ranks that are late."""

    def __init__(self, rank: int, nranks: int, uid: bytes, *, func: str = "shmem_init_attr") -> None:
        if not isinstance(nranks, int) or nranks < 1:
            raise bad_value(func, "nranks", nranks, "an int >= 1")
        if not isinstance(rank, int) or not 0 <= rank < nranks:
            raise bad_value(func, "rank", rank, f"an int in [0, {nranks})")
        self.rank = rank
        self.nranks = nranks
        self.timeout_s: float = env.MORI_BOOTSTRAP_TIMEOUT.require()
        self._uid = UniqueId.unpack(uid)
        self._store = _connect(self._uid, self.timeout_s)
        self._round = 0
        self._closed = False
        # The first round checks that every rank agrees on the world size, and gives the job its id.
        hello = {"nranks": nranks, "pid": os.getpid(), "job": secrets.token_hex(8)}
        sizes = [json.loads(raw) for raw in self.allgather(json.dumps(hello).encode(), what="rendezvous")]
        #: 16 hex digits naming this job (rank 0's pick), the same on every rank; e.g. in heap segment names
        job = sizes[0].get("job")
        if not (isinstance(job, str) and len(job) == 16 and all(c in "0123456789abcdef" for c in job)):
            raise MoriValueError(f"{func}: rank 0 sent the job id {job!r}; expected 16 hex digits")
        self.job_id: str = job
        disagree = [r for r, hi in enumerate(sizes) if hi["nranks"] != nranks]
        if disagree:
            raise MoriValueError(
                f"{func}: ranks {format_ranks(disagree)} were started with a different nranks than {nranks}"
            )

    def allgather(self, data: bytes, *, what: str = "allgather") -> list[bytes]:
        """Every rank contributes ``data``; all receive the list in rank order. Collective."""
        self._round += 1
        r = self._round
        self._store.set(f"{r}/{self.rank}", data)
        keys = [f"{r}/{p}" for p in range(self.nranks)]
        deadline = time.monotonic() + self.timeout_s
        delay = 1e-4
        while not self._store.check(keys):
            if time.monotonic() > deadline:
                missing = [p for p, k in enumerate(keys) if not self._store.check([k])]
                if missing:
                    raise MoriTimeoutError(
                        f"{what}: ranks {format_ranks(missing)} of {self.nranks} did not arrive within "
                        f"{self.timeout_s:g} s (MORI_BOOTSTRAP_TIMEOUT); this is rank {self.rank}",
                        missing,
                    )
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        values = [bytes(self._store.get(k)) for k in keys]
        # Every rank has now finished round r-1, so nobody reads our key of round r-1 again.
        if r > 1:
            self._store.delete_key(f"{r - 1}/{self.rank}")
        return values

    def barrier(self, *, what: str = "barrier") -> None:
        self.allgather(b"", what=what)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._store = None


def from_process_group(group_name: str, *, func: str = "shmem_torch_process_group_init") -> StoreBootstrap:
    """Rank 0 of the named torch.distributed group makes a unique id and broadcasts it."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise MoriError(f"{func}: torch.distributed is not initialised; call dist.init_process_group first")
    group = _resolve_group(group_name, func)
    rank, size = group.rank(), group.size()
    box: list[Any] = [get_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return StoreBootstrap(rank, size, box[0], func=func)


def _resolve_group(group_name: str, func: str) -> Any:
    import torch.distributed as dist

    if not isinstance(group_name, str) or not group_name:
        raise bad_value(func, "group_name", group_name, "the name a process group was registered under")
    try:
        from torch._C._distributed_c10d import _resolve_process_group

        return _resolve_process_group(cast(Any, group_name))
    except (ImportError, RuntimeError, ValueError):
        if group_name in ("default", "world"):
            return dist.group.WORLD
        raise bad_value(
            func,
            "group_name",
            group_name,
            "a registered group: torch._C._distributed_c10d._register_process_group(name, group) first, "
            "or 'default' for the world group",
        ) from None


def from_mpi(comm: Any = None, *, func: str = "shmem_mpi_init") -> StoreBootstrap:
    """Rank 0 of the MPI communicator (default ``MPI.COMM_WORLD``) makes a unique id and broadcasts it."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise MoriError(f"{func}: MPI bootstrap needs mpi4py: pip install mpi4py ({e})") from None
    if comm is None:
        comm = MPI.COMM_WORLD
    if not isinstance(comm, MPI.Comm):
        raise bad_value(func, "comm", comm, "an mpi4py communicator (MPI.Comm)")
    rank, size = comm.Get_rank(), comm.Get_size()
    uid = comm.bcast(get_unique_id() if rank == 0 else None, root=0)
    return StoreBootstrap(rank, size, uid, func=func)

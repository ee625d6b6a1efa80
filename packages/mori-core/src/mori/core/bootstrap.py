"""Rendezvous and out-of-band collectives (allgather, barrier) among the ranks of a job.

Three ways in, all ending in a :class:`StoreBootstrap` over a torch ``Store``:

* a **unique id** (128 bytes) made by one process with :func:`get_unique_id`, which starts a torch
  ``TCPStore`` server there; every rank connects to it as a client;
* a **torch.distributed process group**: the ranks meet in the group's own store (no collective
  of the group, which would wait on an absent rank for torch's timeout);
* an **MPI communicator** (mpi4py): rank 0 makes the unique id and broadcasts it.

Every wait honours ``MORI_BOOTSTRAP_TIMEOUT`` and, when it fires, names the ranks that did not arrive.
A unique id serves one init: once its job has met, joining it again fails at once.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, cast

from mori.core import env
from mori.core.errors import (
    MoriBackendError,
    MoriError,
    MoriStateError,
    MoriTimeoutError,
    MoriValueError,
    bad_value,
    format_ranks,
)
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
# Nonces of unique ids this process has completed a rendezvous with: spent, never joined again.
_spent: set[bytes] = set()
_servers_lock = threading.Lock()
# Inits over each torch.distributed group in this process: each one rendezvouses under its own
# number, so a re-init after finalize never meets the keys of the last one.
_group_inits: dict[str, int] = {}

_log = logging.getLogger("mori.core.bootstrap")

# The key whose presence says a unique id's job has completed its rendezvous.
_SPENT_KEY = "spent"
# A rank alone in a store it serves warns after this long (or a quarter of the timeout, if less).
_ALONE_WARNING_S = 10.0


def get_unique_id() -> bytes:
    """Start a rendezvous store in this process and return the 128-byte id that names it.

    Exactly one process makes the id, and every rank must receive *its* bytes: a rank that makes
    an id of its own starts a store nobody else joins, and waits there alone. The process must
    stay alive until every rank has initialised (it serves the store). An id serves one init:
    after the job completed its rendezvous it is spent, and joining it again fails at once.
    ``MORI_SOCKET_IFNAME`` picks the interface whose address goes into the id; the store listens
    on that address only (not on every interface).
    """
    from torch._C._distributed_c10d import TCPStore

    timeout = datetime.timedelta(seconds=env.MORI_BOOTSTRAP_TIMEOUT.require())
    host = advertised_host()
    # torch's TCPStore binds every interface whatever host it is given; a socket bound here to the
    # configured address, handed over as its listening socket, keeps it to that interface.
    listener = socket.create_server(
        (host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET, backlog=512
    )
    try:
        server = TCPStore(
            host,
            listener.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            timeout=timeout,
            master_listen_fd=listener.fileno(),
        )
    except Exception:
        listener.close()
        raise
    listener.detach()  # the store owns the descriptor now (it closes it when it goes)
    uid = UniqueId(host, server.port, secrets.token_bytes(16))
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


def _check_rank(func: str, rank: Any, nranks: Any) -> None:
    if isinstance(nranks, bool) or not isinstance(nranks, int) or nranks < 1:
        raise bad_value(func, "nranks", nranks, "an int >= 1")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < nranks:
        raise bad_value(func, "rank", rank, f"an int in [0, {nranks})")


class StoreBootstrap:
    """Allgather and barrier among ``nranks`` ranks over a torch key-value ``Store`` (keys under a
    prefix of this job's own); every wait names the ranks that are late.

    ``where`` describes the store for messages (``"the rendezvous store at host:port"``);
    ``served_here``: this process serves the store (it made the unique id), so a rank alone in it
    is most likely one that made its own id. ``single_use``: the store belongs to one job (a unique
    id's), which marks it spent once every rank arrived; a later join fails at once.
    """

    def __init__(
        self,
        rank: int,
        nranks: int,
        store: Any,
        *,
        func: str = "shmem_init_attr",
        where: str = "the rendezvous store",
        served_here: bool = False,
        single_use: bool = False,
    ) -> None:
        _check_rank(func, rank, nranks)
        self.rank = rank
        self.nranks = nranks
        self.timeout_s: float = env.MORI_BOOTSTRAP_TIMEOUT.require()
        self._store = store
        self._where = where
        self._served_here = served_here
        self._round = 0
        self._closed = False
        if single_use:
            self._refuse_if_spent(func)
        # The first round checks that every rank agrees on the world size, and gives the job its id.
        hello = {"nranks": nranks, "pid": os.getpid(), "job": secrets.token_hex(8)}
        sizes = [
            json.loads(raw) for raw in self.allgather(json.dumps(hello).encode(), what=f"{func} rendezvous")
        ]
        if single_use:
            self._call("set", _SPENT_KEY, str(nranks).encode())
        job = sizes[0].get("job")
        if not (isinstance(job, str) and len(job) == 16 and all(c in "0123456789abcdef" for c in job)):
            raise MoriValueError(f"{func}: rank 0 sent the job id {job!r}; expected 16 hex digits")
        #: 16 hex digits naming this job (rank 0's pick), the same on every rank; e.g. in heap segment names
        self.job_id: str = job
        disagree = [r for r, hi in enumerate(sizes) if hi["nranks"] != nranks]
        if disagree:
            raise MoriValueError(
                f"{func}: ranks {format_ranks(disagree)} were started with a different nranks than {nranks}"
            )

    def _call(self, method: str, *args: Any) -> Any:
        """``store.<method>(*args)``, a failure of the store named as such."""
        try:
            return getattr(self._store, method)(*args)
        except Exception as e:  # torch's DistStoreError, DistNetworkError, RuntimeError
            raise MoriBackendError(
                f"{self._where} failed ({type(e).__name__}: {e}): has the process that serves it exited?"
            ) from e

    def _refuse_if_spent(self, func: str) -> None:
        if self._call("check", [_SPENT_KEY]):
            size = bytes(self._call("get", _SPENT_KEY)).decode()
            raise MoriValueError(
                f"{func}: this uid has already been used by a job of {size} ranks that completed its "
                f"rendezvous; a unique id serves one init: call shmem_get_unique_id() again and hand "
                f"the new id to every rank"
            )

    def _alone_hint(self, arrived_others: bool) -> str:
        if not self._served_here or arrived_others:
            return ""
        return (
            "; no other rank reached the rendezvous store this process started with "
            "shmem_get_unique_id(): did every rank get this process's id, or did each make its own? "
            "Exactly one process makes the id and hands its bytes to all ranks"
        )

    def allgather(self, data: bytes, *, what: str = "allgather") -> list[bytes]:
        """Every rank contributes ``data``; all receive the list in rank order. Collective."""
        self._round += 1
        r = self._round
        self._call("set", f"{r}/{self.rank}", data)
        keys = [f"{r}/{p}" for p in range(self.nranks)]
        others = [k for p, k in enumerate(keys) if p != self.rank]
        start = time.monotonic()
        deadline = start + self.timeout_s
        warn_at = start + min(_ALONE_WARNING_S, self.timeout_s / 4) if r == 1 and self._served_here else None
        delay = 1e-4
        while not self._call("check", keys):
            now = time.monotonic()
            if warn_at is not None and now > warn_at:
                warn_at = None
                if others and not any(self._call("check", [k]) for k in others):
                    _log.warning(
                        "%s: rank %d of %d has waited %.0f s%s",
                        what,
                        self.rank,
                        self.nranks,
                        now - start,
                        self._alone_hint(False),
                    )
            if now > deadline:
                missing = [p for p, k in enumerate(keys) if not self._call("check", [k])]
                if missing:
                    hint = self._alone_hint(len(missing) < self.nranks - 1) if r == 1 else ""
                    raise MoriTimeoutError(
                        f"{what}: ranks {format_ranks(missing)} of {self.nranks} did not arrive within "
                        f"{self.timeout_s:g} s (MORI_BOOTSTRAP_TIMEOUT) in {self._where}; this is rank "
                        f"{self.rank}{hint}",
                        missing,
                    )
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        values = [bytes(self._call("get", k)) for k in keys]
        # Every rank has now finished round r-1, so nobody reads our key of round r-1 again.
        if r > 1:
            self._call("delete_key", f"{r - 1}/{self.rank}")
        return values

    def barrier(self, *, what: str = "barrier") -> None:
        self.allgather(b"", what=what)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._store = None


def from_unique_id(rank: int, nranks: int, uid: bytes, *, func: str = "shmem_init_attr") -> StoreBootstrap:
    """Join the job whose rendezvous store the unique id ``uid`` names (see :func:`get_unique_id`)."""
    _check_rank(func, rank, nranks)
    parsed = UniqueId.unpack(uid)
    with _servers_lock:
        spent = parsed.nonce in _spent
        served_here = parsed.nonce in _servers
    if spent:
        raise MoriValueError(
            f"{func}: this uid has already been used by this process for an init; a unique id serves one "
            f"init: call shmem_get_unique_id() again and hand the new id to every rank"
        )
    timeout_s = env.MORI_BOOTSTRAP_TIMEOUT.require()
    boot = StoreBootstrap(
        rank,
        nranks,
        _connect(parsed, timeout_s),
        func=func,
        where=f"the rendezvous store at {parsed.host}:{parsed.port} (served by the process that called "
        "shmem_get_unique_id())",
        served_here=served_here,
        single_use=True,
    )
    with _servers_lock:
        _spent.add(parsed.nonce)
    return boot


def from_process_group(group_name: str, *, func: str = "shmem_torch_process_group_init") -> StoreBootstrap:
    """Rendezvous over the store of the named torch.distributed group.

    No collective of the group is used (a broadcast would wait for an absent rank for as long as
    torch's own timeout): every rank meets the others in the group's store, under keys of this
    init's own, so the wait honours ``MORI_BOOTSTRAP_TIMEOUT`` and names the ranks of the group
    that did not arrive.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise MoriError(f"{func}: torch.distributed is not initialised; call dist.init_process_group first")
    group = _resolve_group(group_name, func)
    rank, size = group.rank(), group.size()
    if rank < 0:
        raise MoriStateError(f"{func}: this process is not a member of the process group {group_name!r}")
    with _servers_lock:
        _group_inits[group_name] = seq = _group_inits.get(group_name, 0) + 1
    from torch._C._distributed_c10d import PrefixStore

    store = PrefixStore(f"mori/group/{group_name}/{seq}", _group_store(group, func))
    return StoreBootstrap(rank, size, store, func=func, where=f"the store of process group {group_name!r}")


def _group_store(group: Any, func: str) -> Any:
    """The key-value store a torch.distributed group was made with (the world's, for a subgroup
    torch did not record): every rank of the group reaches it."""
    from torch.distributed import distributed_c10d as c10d

    try:
        return c10d._get_process_group_store(group)
    except (KeyError, AttributeError):
        pass
    try:
        return c10d._get_default_store()
    except (ValueError, AttributeError, RuntimeError) as e:
        raise MoriBackendError(
            f"{func}: cannot find the store of the torch.distributed process group ({type(e).__name__}: {e})"
        ) from e


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
    return from_unique_id(rank, size, uid, func=func)

"""``BackendType.RDMA``: one-sided transfers over a network transport of mori-core's contract
(:mod:`mori.core.transport`): ``ucx`` (mori-backend-ucx: RDMA verbs where NICs exist, TCP and
shared memory where not) by default, any other by ``MORI_IO_RDMA_TRANSPORT``.

The data moves over the transport (one put or get per merged block, no copies in the engine); the
control stays on the engine's authenticated TCP connections: a target learns that a transfer into
its memory finished through a notice the initiator sends after the transfer's data is remotely
complete (``enable_notification``), credited to the key that connection authenticated.

Per transfer nothing runs in Python beyond the call: mori-core's native
:class:`~mori.core.transfer.RmaQueue` checks every block against the local registration and the
remote descriptor, merges contiguous blocks, posts them and (for a write) one flush without the
GIL, and completes the status in the thread that waits for it (``Wait``/``WaitFor``), or in its
own completion thread for statuses nobody waits for; then it sends the notice.

Memory. Registration registers the region with the transport; the descriptor's ``ipc_handle``
carries (under this backend's name, see :func:`mori.io.handles.backend_handle`) the transport's
name, the owning engine's transport address, the remote key and the region's base. A peer reaches
exactly the registered range: the transport's key bounds it (on RDMA NICs the NIC enforces it;
see the UCX plugin's notes for the other UCX transports) and this backend checks every block
against the descriptor first.

The original's ``RdmaBackendConfig`` fields are accepted (``qp_per_transfer``, ``post_batch_size``,
``num_worker_threads``, ``poll_cq_mode``, ``enable_notification``, the chunking fields and the
queue sizes) and their environment overrides read; the transport owns its queues, so the queue
fields are recorded, not applied.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import msgpack

from mori.core.errors import MoriBackendError
from mori.core.transfer import RmaQueue, TransferStatus
from mori.core.transport import (
    CAP_CUDA_MEMORY,
    MEM_CUDA,
    MEM_HOST,
    TransportEndpoint,
    TransportMemory,
    TransportRemoteKey,
    find_network_transport,
    open_transport,
)
from mori.io import env
from mori.io._types import EngineDesc, MemoryDesc, MemoryLocationType, RdmaBackendConfig
from mori.io.backend_api import Op
from mori.io.handles import backend_handle

#: the key of this backend's bytes in a descriptor's handle map
HANDLE_KEY = "RDMA"


def create_backend(engine: Any, config: RdmaBackendConfig | None) -> RdmaBackend:
    return RdmaBackend(engine, config or RdmaBackendConfig())


class RdmaBackend:
    """See the module docstring."""

    preference = 50  # above TCP (0), below a same-node GPU path (XGMI, 100)
    #: post() checks every block against both regions itself (the engine may skip its per-block checks)
    checks_ranges = True

    def __init__(self, engine: Any, config: RdmaBackendConfig) -> None:
        self.engine = engine
        self.config = config
        self.notify = _override(env.MORI_IO_ENABLE_NOTIFICATION.get(), config.enable_notification)
        name = env.MORI_IO_RDMA_TRANSPORT.get() or "ucx"
        try:
            self.transport = find_network_transport(name, "MORI_IO_RDMA_TRANSPORT")
        except Exception as e:
            hint = " (pip install mori-backend-ucx)" if name == "ucx" else ""
            raise MoriBackendError(
                f"create_backend: the RDMA backend needs the {name!r} transport{hint}: {e}"
            ) from None
        self.tp = open_transport(self.transport.ops(), self.transport.options())
        self.lock = threading.Lock()
        self.mems: dict[int, TransportMemory] = {}
        self.eps: dict[bytes, TransportEndpoint] = {}
        self.keys: dict[tuple[str, int], tuple[TransportEndpoint, TransportRemoteKey, int]] = {}
        self.timeout_ms = int(getattr(engine, "_cp_timeout_ms", 30000))
        # the data path: posts, completion (in the waiting thread, or the queue's own) and the
        # notice to the target, natively (mori.core.transfer.RmaQueue)
        self.queue = RmaQueue(self.tp, engine._native if self.notify else None, self.notify, self.timeout_ms)

    # -- routing ----------------------------------------------------------------------------------

    def supports(self, local: MemoryDesc, remote: MemoryDesc) -> bool:
        info = _parse(remote)
        if local.id not in self.mems or info is None or info["t"] != self.tp.name:
            return False
        if MemoryLocationType.GPU in (local.loc, remote.loc):
            return bool(self.tp.caps & CAP_CUDA_MEMORY)
        return True

    # -- memory ---------------------------------------------------------------------------------

    def on_register_memory(self, desc: MemoryDesc) -> bytes | None:
        gpu = desc.loc == MemoryLocationType.GPU
        if gpu and not self.tp.caps & CAP_CUDA_MEMORY:
            return None  # other backends carry it
        mem = self.tp.register(desc.data, desc.size, MEM_CUDA if gpu else MEM_HOST, desc.device_id)
        with self.lock:
            self.mems[desc.id] = mem
        packed: bytes = msgpack.packb(
            {"t": self.tp.name, "a": self.tp.address(), "k": mem.rkey, "b": desc.data}, use_bin_type=True
        )
        return packed

    def on_deregister_memory(self, desc: MemoryDesc) -> None:
        with self.lock:
            mem = self.mems.pop(desc.id, None)
        if mem is not None:
            self.queue.drain(self.timeout_ms)  # every transfer that could touch it is complete
            self.tp.flush_all().wait(self.timeout_ms)

    def on_register_remote_engine(self, desc: EngineDesc) -> None:
        pass

    def on_deregister_remote_engine(self, desc: EngineDesc) -> None:
        with self.lock:
            self.keys = {k: v for k, v in self.keys.items() if k[0] != desc.key}

    # -- transfers ------------------------------------------------------------------------------

    def _remote(self, remote: MemoryDesc) -> tuple[TransportEndpoint, TransportRemoteKey, int]:
        key = (remote.engine_key, remote.id)
        with self.lock:
            got = self.keys.get(key)
        if got is not None:
            return got
        info = _parse(remote)
        if info is None:
            raise MoriBackendError(
                f"memory {remote.id} of engine {remote.engine_key!r} has no RDMA registration"
            )
        if info["t"] != self.tp.name:
            raise MoriBackendError(
                f"memory {remote.id} of engine {remote.engine_key!r} is registered with the {info.get('t')!r} "
                f"transport, this engine uses {self.tp.name!r} (set MORI_IO_RDMA_TRANSPORT alike on both)"
            )
        addr = bytes(info["a"])
        with self.lock:
            ep = self.eps.get(addr)
        if ep is None:
            ep = self.tp.connect(addr)
            with self.lock:
                ep = self.eps.setdefault(addr, ep)
        got = (ep, ep.unpack_rkey(bytes(info["k"])), int(info["b"]))
        with self.lock:
            self.keys[key] = got
        return got

    def post(
        self,
        op: Op,
        local: MemoryDesc,
        local_offsets: Sequence[int],
        remote: MemoryDesc,
        remote_offsets: Sequence[int],
        sizes: Sequence[int],
        uid: int,
    ) -> TransferStatus:
        """One transfer through the native queue. TypeError unless offsets and sizes are lists or
        tuples of non-negative ints (the engine then names the bad argument)."""
        mem = self.mems.get(local.id)
        if mem is None:
            raise MoriBackendError(f"local memory {local.id} is not registered with the RDMA backend")
        ep, rk, base = self._remote(remote)
        st: TransferStatus = self.queue.post(
            op,
            mem,
            ep,
            rk,
            base,
            remote.size,
            local_offsets if type(local_offsets) in (list, tuple) else list(local_offsets),
            remote_offsets if type(remote_offsets) in (list, tuple) else list(remote_offsets),
            sizes if type(sizes) in (list, tuple) else list(sizes),
            uid,
            remote.engine_key,
        )
        return st

    def session_post(self, local: MemoryDesc, remote: MemoryDesc) -> Any:
        """The native half of an IOEngineSession between ``local`` and ``remote``: read, write,
        batch_read, batch_write with the offsets, sizes and uid (TypeError as :meth:`post`)."""
        mem = self.mems.get(local.id)
        if mem is None:
            raise MoriBackendError(f"local memory {local.id} is not registered with the RDMA backend")
        ep, rk, base = self._remote(remote)
        return self.queue.session(mem, ep, rk, base, remote.size, remote.engine_key)

    def close(self) -> None:
        self.queue.close()  # every pending transfer completes (or fails at its timeout) first
        with self.lock:
            self.keys.clear()
            self.eps.clear()
            self.mems.clear()


def _parse(remote: MemoryDesc) -> dict[str, Any] | None:
    """This backend's registration info in ``remote``'s handle, or None (none, or another's bytes)."""
    raw = backend_handle(remote, HANDLE_KEY)
    if raw is None:
        return None
    try:
        info = msgpack.unpackb(raw, raw=False)
    except Exception:
        return None
    ok = (
        isinstance(info, dict)
        and isinstance(info.get("t"), str)
        and isinstance(info.get("a"), bytes)
        and isinstance(info.get("k"), bytes)
        and isinstance(info.get("b"), int)
        and info["b"] == remote.data  # the descriptor names the region that was registered
    )
    return info if ok else None


def _override(value: bool | None, default: bool) -> bool:
    return default if value is None else value


__all__ = ["HANDLE_KEY", "RdmaBackend", "create_backend"]

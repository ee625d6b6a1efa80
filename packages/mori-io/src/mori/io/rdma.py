"""``BackendType.RDMA``: one-sided transfers over a network transport of mori-core's contract
(:mod:`mori.core.transport`): ``ucx`` (mori-backend-ucx: RDMA verbs where NICs exist, TCP and
shared memory where not) by default, any other by ``MORI_IO_RDMA_TRANSPORT``.

The data moves over the transport (one put or get per merged block, no copies in the engine); the
control stays on the engine's authenticated TCP connections: a target learns that a transfer into
its memory finished through a notice the initiator sends after the transfer's data is remotely
complete (``enable_notification``), credited to the key that connection authenticated.

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
from mori.core.transfer import StatusCode, TransferStatus
from mori.core.transport import (
    CAP_CUDA_MEMORY,
    MEM_CUDA,
    MEM_HOST,
    TransportEndpoint,
    TransportMemory,
    TransportRemoteKey,
    TransportRequest,
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


class _Pending:
    """One transfer: its requests, then a flush, then (with notifications) the notice. ``error``:
    why posting stopped part-way (the requests posted before still complete first)."""

    __slots__ = ("ep", "error", "notify_key", "reqs", "status", "uid")

    def __init__(
        self,
        status: TransferStatus,
        reqs: list[TransportRequest],
        ep: TransportEndpoint,
        uid: int,
        notify_key: str,
    ) -> None:
        self.status, self.reqs, self.ep, self.uid, self.notify_key = status, reqs, ep, uid, notify_key
        self.error = ""


class RdmaBackend:
    """See the module docstring."""

    preference = 50  # above TCP (0), below a same-node GPU path (XGMI, 100)

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
        self.pending: list[_Pending] = []
        self.wake = threading.Condition(self.lock)
        self.closed = False
        self.timeout_ms = int(getattr(engine, "_cp_timeout_ms", 30000))
        self.completer = threading.Thread(target=self._complete_loop, name="mori-io-rdma", daemon=True)
        self.completer.start()

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
            self.tp.flush_all().wait(self.timeout_ms)  # every operation that could touch it is complete

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
        mem = self.mems.get(local.id)
        if mem is None:
            raise MoriBackendError(f"local memory {local.id} is not registered with the RDMA backend")
        ep, rk, base = self._remote(remote)
        st = TransferStatus()
        st.set_in_progress()
        pending = _Pending(st, [], ep, uid, remote.engine_key)
        move = ep.put if op == "write" else ep.get
        try:
            for lo, ro, n in _merged(local_offsets, remote_offsets, sizes):
                pending.reqs.append(move(local.data + lo, mem, base + ro, rk, n))
        except Exception as e:  # the ones posted still complete first; the status says what failed
            pending.error = str(e)
        self._enqueue(pending)
        return st

    def _enqueue(self, p: _Pending) -> None:
        with self.wake:
            self.pending.append(p)
            self.wake.notify()

    def _complete_loop(self) -> None:
        """Completes statuses in order: every request of a transfer, a flush (remote completion),
        then the notice to the target."""
        while True:
            with self.wake:
                while not self.pending and not self.closed:
                    self.wake.wait()
                if not self.pending:
                    return
                p = self.pending.pop(0)
            code, msg = StatusCode.SUCCESS, ""
            try:
                for r in p.reqs:
                    r.wait(self.timeout_ms)
                if p.reqs:
                    p.ep.flush().wait(self.timeout_ms)
            except Exception as e:
                code, msg = StatusCode.ERR_RDMA_OP, str(e)
            if p.error and code == StatusCode.SUCCESS:
                code, msg = StatusCode.ERR_RDMA_OP, p.error
            if self.notify:
                why = self.engine._native.notice(p.notify_key, p.uid, 1, int(code))
                if why and code == StatusCode.SUCCESS:
                    code, msg = (
                        StatusCode.ERR_BAD_STATE,
                        f"the data arrived, but the target was not told: {why}",
                    )
            p.status.complete(int(code), msg)

    def close(self) -> None:
        with self.wake:
            self.closed = True
            self.wake.notify()
        self.completer.join(timeout=self.timeout_ms / 1000 + 5)
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


def _merged(loffs: Sequence[int], roffs: Sequence[int], sizes: Sequence[int]) -> list[tuple[int, int, int]]:
    """Blocks contiguous on both sides merged into one (fewer operations)."""
    out: list[tuple[int, int, int]] = []
    for lo, ro, n in zip(loffs, roffs, sizes, strict=True):
        if not n:
            continue
        if out and out[-1][0] + out[-1][2] == lo and out[-1][1] + out[-1][2] == ro:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((lo, ro, n))
    return out


def _override(value: bool | None, default: bool) -> bool:
    return default if value is None else value


__all__ = ["HANDLE_KEY", "RdmaBackend", "create_backend"]

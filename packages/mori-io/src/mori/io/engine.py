"""IOEngine, IOEngineSession and the route cache in front of the backends."""

from __future__ import annotations

import ctypes
import importlib
import itertools
import logging
import os
import socket
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from mori.core import topology, transfer
from mori.core.errors import (
    MoriBackendError,
    MoriStateError,
    MoriTimeoutError,
    MoriValueError,
    bad_type,
    bad_value,
)
from mori.core.transfer import StatusCode, TransferStatus
from mori.io import env
from mori.io._types import (
    BackendType,
    EngineDesc,
    FabricBackendConfig,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    RdmaBackendConfig,
    TcpBackendConfig,
    XgmiBackendConfig,
    _check_int,
)
from mori.io.backend_api import Backend, Op, backend_modules
from mori.io.handles import pack_handles

_log = logging.getLogger("mori.io")

#: engines of this process; a forked child inherits them without their threads (see _after_fork)
_ENGINES: weakref.WeakSet[IOEngine] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A forked child has copies of the engines but none of their threads, and mutexes or condition
    variables those threads held: destroying a native engine there could hang, and shutting its
    sockets down would cut the parent's connections. So the child keeps them alive forever (one
    extra reference each) and marks them unusable."""
    for engine in list(_ENGINES):
        native = engine.__dict__.get("_native")
        if native is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(native))
        engine._closed = True
        engine._forked = True
        engine._gen += 1


os.register_at_fork(after_in_child=_after_fork_in_child)

_LEVELS = {"trace": 5, "debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}


def set_log_level(level: str | int) -> None:
    """Log threshold of mori-io, Python and native: a name (``"trace"``, ``"debug"``, ``"info"``,
    ``"warning"``, ``"error"``, ``"critical"``, any case) or a :mod:`logging` level number."""
    if isinstance(level, str):
        if level.strip().lower() not in _LEVELS:
            raise bad_value("set_log_level", "level", level, ", ".join(_LEVELS) + " or a logging level int")
        number = _LEVELS[level.strip().lower()]
    elif isinstance(level, int) and not isinstance(level, bool):
        number = level
    else:
        raise bad_type("set_log_level", "level", level, "str or int")
    transfer.set_log_level(number)
    _log.setLevel(max(number, 1))


def _failed(code: StatusCode, message: str) -> TransferStatus:
    st = TransferStatus()
    st.complete(int(code), message)
    return st


def _check_desc(func: str, arg: str, value: Any, cls: type) -> None:
    if not isinstance(value, cls):
        raise bad_type(func, arg, value, cls.__name__)


def _in_range(desc: MemoryDesc, off: int, size: int) -> bool:
    return off + size <= desc.size


class _TcpBackend:
    """The native backend as the route cache sees it: every pair of CPU memories."""

    preference = 0

    def __init__(self, native: transfer.TcpEngine) -> None:
        self._native = native

    def supports(self, local: MemoryDesc, remote: MemoryDesc) -> bool:
        # GPU memory goes through host staging buffers, once a device plugin has installed its
        # copier (transfer.TcpEngine.set_device_copier); the remote side needs one for its GPU memory
        # too, and says so with ERR_INVALID_ARGS if it has none.
        if local.loc == MemoryLocationType.CPU and remote.loc == MemoryLocationType.CPU:
            return True
        return bool(self._native.has_device_copier())

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
        cpu = remote.loc == MemoryLocationType.CPU
        native = self._native
        if len(sizes) == 1:
            return native.post1(
                op,
                local.id,
                remote.engine_key,
                remote.id,
                local_offsets[0],
                remote_offsets[0],
                sizes[0],
                uid,
                cpu,
                remote.size,
            )
        return native.post(
            op,
            local.id,
            remote.engine_key,
            remote.id,
            local_offsets,
            remote_offsets,
            sizes,
            uid,
            cpu,
            remote.size,
        )

    def on_register_memory(self, desc: MemoryDesc) -> bytes | None:
        return None

    def on_deregister_memory(self, desc: MemoryDesc) -> None:
        pass

    def on_register_remote_engine(self, desc: EngineDesc) -> None:
        pass

    def on_deregister_remote_engine(self, desc: EngineDesc) -> None:
        pass

    def close(self) -> None:
        pass


class IOEngine:
    """One engine per process: registers local memory and moves bytes to and from the registered
    memory of remote engines with one-sided, asynchronous reads and writes.

    ``key``: a name unique among the engines that talk to each other. ``config``: where to listen.
    The engine listens as soon as it exists; ``create_backend(BackendType.TCP)`` enables the
    data path. Transfers return a :class:`TransferStatus` at once; ``Wait()`` it, or
    :meth:`wait_all`. Call :meth:`shutdown` (or use ``with``) to stop the threads; pending
    transfers then fail.
    """

    def __init__(self, key: str, config: IOEngineConfig) -> None:
        if not isinstance(key, str):
            raise bad_type("IOEngine", "key", key, "str")
        if not key or len(key) > 1024:
            raise bad_value("IOEngine", "key", key, "a non-empty str of at most 1024 characters")
        if not isinstance(config, IOEngineConfig):
            raise bad_type("IOEngine", "config", config, "IOEngineConfig")
        level = env.MORI_IO_LOG_LEVEL.get()
        if level is not None:
            set_log_level(level)
        self._cp_timeout_ms: int = env.MORI_IO_CP_TIMEOUT_MS.get() or 30000
        node = topology.node_id()
        token = config.auth_token if config.auth_token is not None else env.MORI_IO_AUTH_TOKEN.get() or ""
        if len(token.encode()) > 1024:
            raise bad_value(
                "IOEngine", "MORI_IO_AUTH_TOKEN", f"<{len(token)} characters>", "at most 1024 bytes"
            )
        try:
            self._native = transfer.TcpEngine(
                key,
                config.host,
                config.port,
                node,
                token,
                self._cp_timeout_ms,
                allow_unauthenticated=config.allow_unauthenticated
                or bool(env.MORI_IO_ALLOW_UNAUTHENTICATED.get()),
                max_connections=env.MORI_IO_MAX_CONNECTIONS.get() or 1024,
                max_handshakes=env.MORI_IO_MAX_HANDSHAKES.get() or 64,
                handshake_timeout_ms=env.MORI_IO_HANDSHAKE_TIMEOUT_MS.get() or 10000,
                idle_timeout_ms=_value(env.MORI_IO_IDLE_TIMEOUT_MS.get(), 600000),
                inbound_per_peer=env.MORI_IO_MAX_INBOUND_PER_PEER.get() or 65536,
                inbound_total=env.MORI_IO_MAX_INBOUND.get() or 262144,
                thp=env.MORI_IO_THP.get() == "1",
                thp_collapse_bytes=_value(env.MORI_IO_THP_COLLAPSE_BYTES.get(), 1 << 30),
                short_slice=bool(env.MORI_IO_SHORT_SLICE.get()),
                move_copy_threads=bool(env.MORI_IO_MOVE_COPY_THREADS.get()),
            )
        except MoriValueError as e:
            raise MoriValueError(f"IOEngine({key!r}, host={config.host!r}): {e}") from None
        except MoriBackendError as e:
            raise MoriBackendError(f"IOEngine({key!r}): {e}") from None
        host = config.host if config.host not in ("", "0.0.0.0", "::") else topology.advertised_host()
        self._desc = EngineDesc(key, node, socket.gethostname(), host, self._native.port, os.getpid())
        self._lock = threading.Lock()
        self._backends: dict[BackendType, Backend] = {}
        self._remotes: dict[str, EngineDesc] = {}
        self._local: dict[int, MemoryDesc] = {}
        self._routes: dict[tuple[int, str, int], Backend] = {}
        #: the TCP backend's GPU staging copier (mori.io.staging), False once found unavailable
        self._device_copier: Any = None
        self._failed_routes: set[tuple[int, str, int, int]] = set()
        self._uids = itertools.count()
        self._closed = False
        self._forked = False
        #: bumped whenever a route, a region or a peer goes or the engine closes (sessions recheck)
        self._gen = 0
        _ENGINES.add(self)

    # -- engine and backends ---------------------------------------------------------------------

    def get_engine_desc(self) -> EngineDesc:
        """This engine's descriptor, to hand to peers (``pack()`` it)."""
        return self._desc

    def create_backend(self, type: BackendType, config: Any = None) -> None:
        """Enable a data path. ``TCP`` takes a :class:`TcpBackendConfig` (or ``None``); ``XGMI`` a
        :class:`XgmiBackendConfig` and needs its plugin; ``RDMA`` and ``FABRIC`` are not available
        in this build and raise :class:`MoriBackendError`. Creating one twice raises."""
        self._check_open("create_backend")
        if not isinstance(type, BackendType):
            raise bad_type("create_backend", "type", type, "BackendType")
        if type in self._backends:
            raise MoriStateError(
                f"create_backend: a {type.name} backend already exists on engine {self.key!r}"
            )
        if type == BackendType.FABRIC:
            raise MoriBackendError(
                "create_backend: the FABRIC backend is not available: it needs UALink scale-up hardware and "
                "ROCm's fabric allocator, which this build does not support; use BackendType.RDMA or TCP"
            )
        if type == BackendType.Unknown:
            raise bad_value("create_backend", "type", type, "BackendType.TCP or BackendType.XGMI")
        if type == BackendType.TCP:
            if config is None:
                config = TcpBackendConfig()
            if not isinstance(config, TcpBackendConfig):
                raise bad_type("create_backend", "config", config, "TcpBackendConfig or None")
            self._native.configure_tcp(
                env.MORI_IO_TCP_CONNS_PER_PEER.get() or config.num_connections_per_peer,
                env.MORI_IO_CHUNK_BYTES.get() or config.chunk_bytes,
                config.socket_buffer_bytes,
                _override(env.MORI_IO_TCP_CMA.get(), config.enable_cma),
                _override(env.MORI_IO_ENABLE_NOTIFICATION.get(), config.enable_notification),
                env.MORI_IO_CMA_THREADS.get() or 0,
                env.MORI_IO_CMA_SPLIT_BYTES.get() or 0,
            )
            backend: Backend = _TcpBackend(self._native)
        else:
            want = RdmaBackendConfig if type == BackendType.RDMA else XgmiBackendConfig
            if config is not None and not isinstance(config, want):
                raise bad_type("create_backend", "config", config, f"{want.__name__} or None")
            module_name = backend_modules().get(type.name)
            try:
                module = importlib.import_module(module_name) if module_name else None
            except ModuleNotFoundError as e:
                raise MoriBackendError(
                    f"create_backend: the {type.name} backend is not installed ({module_name}: {e})"
                ) from None
            if module is None or not hasattr(module, "create_backend"):
                raise MoriBackendError(
                    f"create_backend: no installed module provides the {type.name} backend (entry-point group "
                    "'mori.io.backends')"
                )
            backend = module.create_backend(self, config)
            for desc in self._local.values():
                backend.on_register_memory(desc)
            for remote in self._remotes.values():
                backend.on_register_remote_engine(remote)
        with self._lock:
            self._backends[type] = backend
            self._routes.clear()
            self._gen += 1

    def remove_backend(self, type: BackendType) -> None:
        """Disable a data path; later transfers route through the others."""
        self._check_open("remove_backend")
        if not isinstance(type, BackendType):
            raise bad_type("remove_backend", "type", type, "BackendType")
        with self._lock:
            backend = self._backends.pop(type, None)
            self._routes.clear()
            self._gen += 1
        if backend is None:
            raise bad_value("remove_backend", "type", type, f"a created backend ({self._backend_names()})")
        backend.close()

    def register_remote_engine(self, desc: EngineDesc) -> None:
        """Make a peer known; connections open on the first transfer."""
        self._check_open("register_remote_engine")
        _check_desc("register_remote_engine", "desc", desc, EngineDesc)
        self._native.add_peer(desc.key, desc.host, desc.port, desc.node_id == self._desc.node_id)
        with self._lock:
            self._remotes[desc.key] = desc
            self._routes.clear()
            self._gen += 1
        for b in list(self._backends.values()):
            b.on_register_remote_engine(desc)

    def deregister_remote_engine(self, desc: EngineDesc) -> None:
        """Forget a peer: its connections close, transfers still pending to it fail."""
        self._check_open("deregister_remote_engine")
        _check_desc("deregister_remote_engine", "desc", desc, EngineDesc)
        with self._lock:
            known = self._remotes.pop(desc.key, None)
            self._routes = {k: v for k, v in self._routes.items() if k[1] != desc.key}
            self._gen += 1
        if known is None:
            return
        for b in list(self._backends.values()):
            b.on_deregister_remote_engine(desc)
        self._native.remove_peer(desc.key)

    # -- memory --------------------------------------------------------------------------------

    def register_memory(self, ptr: int, size: int, device_id: int, mem_loc: MemoryLocationType) -> MemoryDesc:
        """Register ``size`` bytes at address ``ptr`` (``device_id`` -1 for CPU memory) so peers may
        read and write them; returns the descriptor to hand them. ``ptr`` may point into a larger
        allocation (per-layer KV views)."""
        self._check_open("register_memory")
        _check_int("register_memory", "ptr", ptr, 1)
        _check_int("register_memory", "size", size, 1)
        _check_int("register_memory", "device_id", device_id, -1, (1 << 31) - 1)
        if ptr + size > 1 << 64:
            raise bad_value(
                "register_memory",
                "size",
                size,
                f"at most {(1 << 64) - ptr} at ptr={ptr:#x} (the range wraps around)",
            )
        if not isinstance(mem_loc, MemoryLocationType) or mem_loc == MemoryLocationType.Unknown:
            raise bad_value(
                "register_memory", "mem_loc", mem_loc, "MemoryLocationType.CPU or MemoryLocationType.GPU"
            )
        if mem_loc == MemoryLocationType.GPU:
            self._install_device_copier(device_id)
        try:
            mid = self._native.register_memory(ptr, size, int(mem_loc), device_id)
        except MoriValueError as e:
            raise MoriValueError(f"register_memory: {e}") from None
        desc = MemoryDesc(self.key, mid, device_id, "", ptr, size, int(mem_loc), -1, b"")
        handles: dict[str, bytes] = {}
        for t, b in list(self._backends.items()):
            handle = b.on_register_memory(desc)
            if handle:
                handles[t.name] = bytes(handle)
        if handles:
            desc = MemoryDesc(**{**desc.__dict__, "ipc_handle": pack_handles(handles)})
        with self._lock:
            self._local[mid] = desc
        return desc

    def _install_device_copier(self, device: int) -> None:
        # the TCP backend carries GPU memory once a copier is installed (mori.io.staging): the
        # first GPU registration installs one on the device plugins' GPU runtime, if there is one;
        # each GPU it copies for is added on its first registration
        from mori.io import staging, xgmi

        if self._device_copier is False:
            return
        if self._device_copier is None:
            if self._native.has_device_copier():  # another copier was installed by hand
                self._device_copier = False
                return
            try:
                self._device_copier = staging.install(self._native, xgmi.find_gpu_runtime())
            except Exception as e:  # no runtime: GPU pairs route to other backends or fail clearly
                _log.info("mori.io: the TCP backend will not carry GPU memory: %s", e)
                self._device_copier = False
                return
        if device >= 0:
            try:
                self._device_copier.add_device(device)
            except Exception as e:  # its transfers over TCP then fail with ERR_GPU_OP
                _log.warning("mori.io: the TCP backend cannot stage memory of GPU %d: %s", device, e)

    def register_torch_tensor(self, tensor: Any) -> MemoryDesc:
        """Register a contiguous torch tensor's bytes (CPU: device_id -1, GPU: its device index)."""
        if not all(hasattr(tensor, a) for a in ("data_ptr", "is_contiguous", "element_size", "device")):
            raise bad_type("register_torch_tensor", "tensor", tensor, "torch.Tensor")
        if not tensor.is_contiguous():
            raise bad_value("register_torch_tensor", "tensor", "non-contiguous tensor", "a contiguous tensor")
        size = tensor.numel() * tensor.element_size()
        if size == 0:
            raise bad_value(
                "register_torch_tensor", "tensor", "empty tensor", "a tensor with at least one byte"
            )
        if tensor.device.type == "cpu":
            return self.register_memory(tensor.data_ptr(), size, -1, MemoryLocationType.CPU)
        return self.register_memory(tensor.data_ptr(), size, tensor.device.index or 0, MemoryLocationType.GPU)

    def deregister_memory(self, desc: MemoryDesc) -> None:
        """Unregister a region. New transfers on it (local or from peers) fail with
        ``ERR_INVALID_ARGS`` at once; the call then blocks (GIL released) until transfers already
        touching it have finished, at most ``MORI_IO_CP_TIMEOUT_MS`` (then :class:`MoriTimeoutError`).
        After it returns no peer can reach the memory, so it may be freed."""
        self._check_open("deregister_memory")
        _check_desc("deregister_memory", "desc", desc, MemoryDesc)
        if desc.engine_key != self.key:
            raise bad_value(
                "deregister_memory", "desc.engine_key", desc.engine_key, f"this engine's key {self.key!r}"
            )
        with self._lock:
            known = self._local.pop(desc.id, None)
            self._routes = {k: v for k, v in self._routes.items() if k[0] != desc.id}
            self._gen += 1
        if known is None:
            raise bad_value("deregister_memory", "desc.id", desc.id, "a region registered on this engine")
        for b in list(self._backends.values()):
            b.on_deregister_memory(known)
        if not self._native.deregister_memory(desc.id, self._cp_timeout_ms):
            raise MoriTimeoutError(
                f"deregister_memory: transfers on region {desc.id} still ran after "
                f"MORI_IO_CP_TIMEOUT_MS={self._cp_timeout_ms} ms; the region is unregistered, do not free it yet"
            )

    # -- transfers -----------------------------------------------------------------------------

    def allocate_transfer_uid(self) -> int:
        """A new transfer id, unique within this engine (the target sees it in inbound statuses)."""
        return next(self._uids)

    def read(
        self,
        local_desc: MemoryDesc,
        local_offset: int,
        remote_desc: MemoryDesc,
        remote_offset: int,
        size: int,
        uid: int,
    ) -> TransferStatus:
        """Copy ``size`` bytes from ``remote_desc`` at ``remote_offset`` into ``local_desc`` at
        ``local_offset``. Returns at once; out-of-range offsets give ``Failed()`` with
        ``ERR_INVALID_ARGS``."""
        return self._post("read", local_desc, [local_offset], remote_desc, [remote_offset], [size], uid)

    def write(
        self,
        local_desc: MemoryDesc,
        local_offset: int,
        remote_desc: MemoryDesc,
        remote_offset: int,
        size: int,
        uid: int,
    ) -> TransferStatus:
        """Copy ``size`` bytes from ``local_desc`` at ``local_offset`` into ``remote_desc`` at
        ``remote_offset``; like :meth:`read` otherwise."""
        return self._post("write", local_desc, [local_offset], remote_desc, [remote_offset], [size], uid)

    def batch_read(
        self,
        local_descs: Sequence[MemoryDesc],
        local_offsets: Sequence[Sequence[int]],
        remote_descs: Sequence[MemoryDesc],
        remote_offsets: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        uids: Sequence[int],
    ) -> list[TransferStatus]:
        """For each descriptor pair ``i``, read the blocks ``(local_offsets[i][j],
        remote_offsets[i][j], sizes[i][j])`` as one transfer ``uids[i]``; one status per pair."""
        return self._batch(
            "batch_read", "read", local_descs, local_offsets, remote_descs, remote_offsets, sizes, uids
        )

    def batch_write(
        self,
        local_descs: Sequence[MemoryDesc],
        local_offsets: Sequence[Sequence[int]],
        remote_descs: Sequence[MemoryDesc],
        remote_offsets: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        uids: Sequence[int],
    ) -> list[TransferStatus]:
        """Like :meth:`batch_read`, local → remote."""
        return self._batch(
            "batch_write", "write", local_descs, local_offsets, remote_descs, remote_offsets, sizes, uids
        )

    def create_session(self, local_desc: MemoryDesc, remote_desc: MemoryDesc) -> IOEngineSession | None:
        """A prepared path between one local and one remote region (route chosen once), or
        ``None`` if the remote engine is not registered or no backend can serve the pair."""
        self._check_open("create_session")
        _check_desc("create_session", "local_desc", local_desc, MemoryDesc)
        _check_desc("create_session", "remote_desc", remote_desc, MemoryDesc)
        if local_desc.engine_key != self.key or local_desc.id not in self._local:
            return None
        if remote_desc.engine_key not in self._remotes:
            return None
        if self._route(local_desc, remote_desc) is None:
            return None
        return IOEngineSession(self, local_desc, remote_desc)

    def pop_inbound_transfer_status(self, remote_key: str, uid: int) -> TransferStatus | None:
        """As a target: the finished status of transfer ``uid`` that engine ``remote_key`` made into
        this engine's memory, removed from the table; ``None`` if not (yet) finished or unknown."""
        if not isinstance(remote_key, str):
            raise bad_type("pop_inbound_transfer_status", "remote_key", remote_key, "str")
        _check_int("pop_inbound_transfer_status", "uid", uid)
        st: TransferStatus | None = self._native.pop_inbound(remote_key, uid)
        return st

    def wait_all(self, statuses: Sequence[TransferStatus], timeout_ms: int = -1) -> StatusCode:
        """Wait (GIL released) for every status: ``SUCCESS``, the first failure's code, or
        ``IN_PROGRESS`` if ``timeout_ms`` (<0: forever) ran out."""
        statuses = list(statuses)
        for i, s in enumerate(statuses):
            if not isinstance(s, TransferStatus):
                raise bad_type("wait_all", f"statuses[{i}]", s, "TransferStatus")
        _check_int("wait_all", "timeout_ms", timeout_ms, None, (1 << 63) - 1)
        code: StatusCode = transfer.wait_all(statuses, timeout_ms)
        return code

    # -- tracing (mori.viz) ----------------------------------------------------------------------

    def enable_tracing(self, buffer: Any = None, *, capacity: int = 1024, n_rings: int | None = None) -> Any:
        """Record the scatter-gather kernel of this engine's XGMI backend (its traced variant) into
        ``buffer`` (a :class:`mori.viz.TraceBuffer` on the backend's GPU), or a new one; return it.

        Every kernel launch posted from now on records, per program, a ``kernel`` span of
        ``io.scatter_gather`` with its ``table`` and ``copy`` phases; copy-engine copies record
        nothing. ``n_rings`` and ``capacity`` size a new buffer (see
        :meth:`mori.io.xgmi.XgmiBackend.enable_tracing`). Read it with ``mori.viz.capture([buf])``
        when the GPU is idle. Not collective. Raises :class:`~mori.core.errors.MoriStateError` if
        the engine has no XGMI backend or its kernel cannot be loaded; the tracing state goes with
        the backend (:meth:`remove_backend`).
        """
        return self._tracing_backend("enable_tracing").enable_tracing(
            buffer, capacity=capacity, n_rings=n_rings
        )

    def disable_tracing(self) -> None:
        """Launch the untraced (uninstrumented) kernel again; the buffer stays readable. Does
        nothing without an XGMI backend."""
        backend = self._backends.get(BackendType.XGMI)
        if backend is not None and hasattr(backend, "disable_tracing"):
            backend.disable_tracing()

    @property
    def trace_buffer(self) -> Any:
        """The :class:`mori.viz.TraceBuffer` the XGMI kernel records into, or None (tracing off)."""
        return getattr(self._backends.get(BackendType.XGMI), "trace_buffer", None)

    def _tracing_backend(self, func: str) -> Any:
        self._check_open(func)
        backend = self._backends.get(BackendType.XGMI)
        if backend is None or not hasattr(backend, "enable_tracing"):
            raise MoriStateError(
                f"{func}: engine {self.key!r} has no XGMI backend ({self._backend_names()}); only the XGMI "
                "scatter-gather kernel records: create_backend(BackendType.XGMI) first"
            )
        return backend

    def shutdown(self) -> None:
        """Stop the engine: connections close, threads end, pending transfers fail. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._gen += 1
        _ENGINES.discard(self)
        for b in list(self._backends.values()):
            b.close()
        self._backends.clear()
        self._native.shutdown()

    def __enter__(self) -> IOEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def key(self) -> str:
        return self._desc.key

    def __repr__(self) -> str:
        return (
            f"IOEngine({self.key!r}, {self._desc.host}:{self._desc.port}, backends=[{self._backend_names()}])"
        )

    # -- internals -----------------------------------------------------------------------------

    def _backend_names(self) -> str:
        return ", ".join(t.name for t in self._backends) or "none"

    def _check_open(self, func: str) -> None:
        if self._forked:
            raise MoriStateError(
                f"{func}: engine {self.key!r} belongs to the parent process (this process was forked "
                "after creating it); create a new engine here"
            )
        if self._closed:
            raise MoriStateError(f"{func}: engine {self.key!r} was shut down")

    def _route(self, local: MemoryDesc, remote: MemoryDesc) -> Backend | None:
        key = (local.id, remote.engine_key, remote.id)
        backend = self._routes.get(key)
        if backend is not None:
            return backend
        with self._lock:
            candidates = sorted(self._backends.values(), key=lambda b: -b.preference)
            for b in candidates:
                if (*key, id(b)) in self._failed_routes:
                    continue
                if b.supports(local, remote):
                    self._routes[key] = b
                    return b
        return None

    def _validate(
        self,
        func: str,
        local: MemoryDesc,
        loffs: Sequence[int],
        remote: MemoryDesc,
        roffs: Sequence[int],
        sizes: Sequence[int],
        uid: int,
    ) -> TransferStatus | None:
        """Checks everything the initiator can; returns a failed status or None."""
        _check_desc(func, "local_desc", local, MemoryDesc)
        _check_desc(func, "remote_desc", remote, MemoryDesc)
        _check_int(func, "uid", uid)
        if not (len(loffs) == len(roffs) == len(sizes)):
            raise bad_value(
                func,
                "sizes",
                f"{len(loffs)} local offsets, {len(roffs)} remote offsets, {len(sizes)} sizes",
                "lists of equal length",
            )
        for i, (lo, ro, sz) in enumerate(zip(loffs, roffs, sizes, strict=True)):
            _check_int(func, f"local_offsets[{i}]", lo)
            _check_int(func, f"remote_offsets[{i}]", ro)
            _check_int(func, f"sizes[{i}]", sz)
            if not _in_range(local, lo, sz):
                return _failed(
                    StatusCode.ERR_INVALID_ARGS,
                    f"{func}: local offset {lo} + size {sz} is outside the local region ({local.size} bytes)",
                )
            if not _in_range(remote, ro, sz):
                return _failed(
                    StatusCode.ERR_INVALID_ARGS,
                    f"{func}: remote offset {ro} + size {sz} is outside the remote region ({remote.size} bytes)",
                )
        if local.engine_key != self.key or local.id not in self._local:
            return _failed(
                StatusCode.ERR_INVALID_ARGS, f"{func}: local_desc is not registered on engine {self.key!r}"
            )
        if remote.engine_key not in self._remotes:
            return _failed(
                StatusCode.ERR_NOT_FOUND,
                f"{func}: remote engine {remote.engine_key!r} is not registered (register_remote_engine)",
            )
        return None

    def _post(
        self,
        op: Op,
        local: MemoryDesc,
        loffs: Sequence[int],
        remote: MemoryDesc,
        roffs: Sequence[int],
        sizes: Sequence[int],
        uid: int,
        func: str | None = None,
    ) -> TransferStatus:
        if self._closed:
            self._check_open(func or op)
        # Fast path for a cached route whose backend checks ranges itself: the TCP backend's native
        # engine (local against its table, remote against the descriptor, the target against its
        # own table), or a backend that says so (``checks_ranges``, e.g. XGMI); both reject anything
        # that is not a non-negative int with TypeError, and only then does the slow path run, to
        # name the bad argument. Per-block Python checks would dominate a batch of small blocks.
        if type(local) is MemoryDesc and type(remote) is MemoryDesc:
            backend = self._routes.get((local.id, remote.engine_key, remote.id))
            if (
                backend is not None
                and (type(backend) is _TcpBackend or getattr(backend, "checks_ranges", False) is True)
                and len(loffs) == len(roffs) == len(sizes)
                and local.engine_key == self.key
                and local.id in self._local
                and remote.engine_key in self._remotes
            ):
                try:
                    return backend.post(op, local, loffs, remote, roffs, sizes, uid)
                except TypeError:
                    pass
        func = func or op
        bad = self._validate(func, local, loffs, remote, roffs, sizes, uid)
        if bad is not None:
            return bad
        return self._dispatch(func, op, local, loffs, remote, roffs, sizes, uid)

    def _dispatch(
        self,
        func: str,
        op: Op,
        local: MemoryDesc,
        loffs: Sequence[int],
        remote: MemoryDesc,
        roffs: Sequence[int],
        sizes: Sequence[int],
        uid: int,
    ) -> TransferStatus:
        last: MoriBackendError | None = None
        while True:
            backend = self._route(local, remote)
            if backend is None:
                if last is not None:
                    raise last
                return _failed(
                    StatusCode.ERR_NOT_FOUND,
                    f"{func}: no backend moves bytes between {MemoryLocationType(local.loc).name} and "
                    f"{MemoryLocationType(remote.loc).name} memory (created: {self._backend_names()})",
                )
            try:
                st: TransferStatus = backend.post(op, local, loffs, remote, roffs, sizes, uid)
                return st
            except MoriBackendError as e:  # failover: drop the route, try the next backend
                _log.warning(
                    "%s: backend %s failed (%s); trying the next one", func, type(backend).__name__, e
                )
                last = e
                with self._lock:
                    self._routes.pop((local.id, remote.engine_key, remote.id), None)
                    self._gen += 1
                    self._failed_routes.add((local.id, remote.engine_key, remote.id, id(backend)))

    def _batch(
        self,
        func: str,
        op: Op,
        local_descs: Sequence[MemoryDesc],
        local_offsets: Sequence[Sequence[int]],
        remote_descs: Sequence[MemoryDesc],
        remote_offsets: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        uids: Sequence[int],
    ) -> list[TransferStatus]:
        n = len(local_descs)
        for arg, seq in (
            ("local_offsets", local_offsets),
            ("remote_descs", remote_descs),
            ("remote_offsets", remote_offsets),
            ("sizes", sizes),
            ("uids", uids),
        ):
            if len(seq) != n:
                raise bad_value(func, arg, f"{len(seq)} entries", f"{n} entries, one per local descriptor")
        return [
            self._post(
                op,
                local_descs[i],
                list(local_offsets[i]),
                remote_descs[i],
                list(remote_offsets[i]),
                list(sizes[i]),
                uids[i],
                func,
            )
            for i in range(n)
        ]

    def _route_name(self, local: MemoryDesc, remote: MemoryDesc) -> str:
        """How bytes between this pair move now ("tcp", "tcp+cma", or a Python backend's class)."""
        backend = self._route(local, remote)
        if isinstance(backend, _TcpBackend):
            return str(
                self._native.route_of(remote.engine_key, local.id, remote.loc == MemoryLocationType.CPU)
            )
        return type(backend).__name__ if backend is not None else ""

    def _counters(self) -> dict[str, int]:
        counters: dict[str, int] = self._native.counters()
        return counters


class IOEngineSession:
    """A path between one local and one remote region, made by :meth:`IOEngine.create_session`:
    offsets are relative to those regions, each call is one transfer (one status)."""

    def __init__(self, engine: IOEngine, local: MemoryDesc, remote: MemoryDesc) -> None:
        self._engine = engine
        self._local = local
        self._remote = remote
        self._key = (local.id, remote.engine_key, remote.id)
        # Fast path while the route stays the one cached here: one native call per post, which
        # takes the caller's lists as they are (no copies) and checks every block. On the TCP
        # route the native engine checks against its table and the descriptor (the target against
        # its own); on the XGMI route the backend's native queue checks against both regions.
        # Anything the native side does not take (TypeError) goes through IOEngine._post, which
        # names the bad argument. The TCP fast path belongs to the native engine, which outlives
        # TCP backends removed and created again, so it holds while the route is a TCP backend;
        # the XGMI one belongs to its backend object. Otherwise posts go the checked way.
        self._route: Any = engine._routes.get(self._key)
        self._tcp = type(self._route) is _TcpBackend
        self._checked_gen = -1  # the engine's _gen at the last _usable() that passed
        self._fast: Any = None
        if self._tcp:
            self._fast = engine._native.session(
                local.id, remote.engine_key, remote.id, remote.loc == MemoryLocationType.CPU, remote.size
            )
        elif self._route is not None and hasattr(self._route, "session_post"):
            try:
                self._fast = self._route.session_post(local, remote)
            except MoriBackendError:  # cannot map the remote region now: the checked path fails over
                self._fast = None

    def _usable(self) -> bool:
        """The fast path still applies: engine open, both ends registered, the same route. Checked
        in full only when the engine changed since the last check that passed (``_gen``)."""
        eng = self._engine
        gen = eng._gen
        if gen == self._checked_gen:
            return True
        route = eng._routes.get(self._key)
        ok = (
            self._fast is not None
            and not eng._closed
            and (route is self._route or (self._tcp and type(route) is _TcpBackend))
            and self._local.id in eng._local
            and self._remote.engine_key in eng._remotes
        )
        self._checked_gen = gen if ok else -1
        return ok

    def allocate_transfer_uid(self) -> int:
        return self._engine.allocate_transfer_uid()

    def read(self, local_offset: int, remote_offset: int, size: int, uid: int) -> TransferStatus:
        """Remote → local, one block."""
        if self._engine._gen == self._checked_gen or self._usable():  # the first test inlines _usable's
            try:
                st: TransferStatus = self._fast.read(local_offset, remote_offset, size, uid)
                return st
            except TypeError:
                pass
        return self._engine._post(
            "read", self._local, [local_offset], self._remote, [remote_offset], [size], uid
        )

    def write(self, local_offset: int, remote_offset: int, size: int, uid: int) -> TransferStatus:
        """Local → remote, one block."""
        if self._engine._gen == self._checked_gen or self._usable():  # the first test inlines _usable's
            try:
                st: TransferStatus = self._fast.write(local_offset, remote_offset, size, uid)
                return st
            except TypeError:
                pass
        return self._engine._post(
            "write", self._local, [local_offset], self._remote, [remote_offset], [size], uid
        )

    def batch_read(
        self, local_offsets: Sequence[int], remote_offsets: Sequence[int], sizes: Sequence[int], uid: int
    ) -> TransferStatus:
        """Remote → local, many blocks as one transfer (contiguous blocks are merged)."""
        if self._engine._gen == self._checked_gen or self._usable():  # the first test inlines _usable's
            try:
                st: TransferStatus = self._fast.batch_read(local_offsets, remote_offsets, sizes, uid)
                return st
            except TypeError:
                pass
        return self._engine._post(
            "read",
            self._local,
            list(local_offsets),
            self._remote,
            list(remote_offsets),
            list(sizes),
            uid,
            "batch_read",
        )

    def batch_write(
        self, local_offsets: Sequence[int], remote_offsets: Sequence[int], sizes: Sequence[int], uid: int
    ) -> TransferStatus:
        """Local → remote, many blocks as one transfer."""
        if self._engine._gen == self._checked_gen or self._usable():  # the first test inlines _usable's
            try:
                st: TransferStatus = self._fast.batch_write(local_offsets, remote_offsets, sizes, uid)
                return st
            except TypeError:
                pass
        return self._engine._post(
            "write",
            self._local,
            list(local_offsets),
            self._remote,
            list(remote_offsets),
            list(sizes),
            uid,
            "batch_write",
        )

    def alive(self) -> bool:
        """Both regions still registered, the remote engine still known and its connections up."""
        eng = self._engine
        return (
            not eng._closed
            and self._local.id in eng._local
            and self._remote.engine_key in eng._remotes
            and bool(eng._native.peer_alive(self._remote.engine_key))
        )


def _override(value: bool | None, default: bool) -> bool:
    return default if value is None else value


def _value(value: int | None, default: int) -> int:
    return default if value is None else value


__all__ = [
    "FabricBackendConfig",
    "IOEngine",
    "IOEngineSession",
    "set_log_level",
]

"""mori.io: one-sided point-to-point transfer engine (KV-cache movement between processes and hosts).

Each process creates an :class:`IOEngine`, enables a data path with ``create_backend``, registers
memory, and hands its :class:`EngineDesc` and :class:`MemoryDesc` values (``pack()`` → bytes) to
peers out of band. A peer registers the engine descriptor and then reads from or writes to the
registered memory without the owner taking part::

    from mori.io import BackendType, IOEngine, IOEngineConfig

    engine = IOEngine("prefill-0", IOEngineConfig("127.0.0.1", 0))
    engine.create_backend(BackendType.TCP)
    mem = engine.register_torch_tensor(kv)                    # contiguous CPU tensor
    engine.register_remote_engine(EngineDesc.unpack(peer_desc_bytes))
    st = engine.write(mem, 0, MemoryDesc.unpack(peer_mem_bytes), 0, 4096, engine.allocate_transfer_uid())
    st.Wait(); assert st.Succeeded(), st.Message()

Backends: ``TCP`` (built in; any two hosts; several striped connections per peer; engines on one
node move CPU bytes by cross-memory attach, falling back to the socket), ``XGMI`` (GPU plugin, see
:mod:`mori.io.backend_api` for the contract a Python backend implements), ``RDMA``/``FABRIC`` (not
in this build: ``create_backend`` raises :class:`mori.core.errors.MoriBackendError`).

Safety: a target checks every request against its own registration table; anything outside a
registered region fails with ``ERR_INVALID_ARGS`` and touches nothing. ``deregister_memory`` makes
new transfers on the region fail, then waits for the ones in flight. A peer silent for
``MORI_IO_CP_TIMEOUT_MS`` while transfers are pending fails them with ``ERR_BAD_STATE``.
"""

from __future__ import annotations

import hashlib  # noqa: F401  (loads OpenSSL's libcrypto, which the native engine's authentication uses)

from mori.core.transfer import StatusCode, TransferStatus
from mori.io._types import (
    BackendType,
    EngineDesc,
    FabricBackendConfig,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    PollCqMode,
    RdmaBackendConfig,
    TcpBackendConfig,
    XgmiBackendConfig,
)
from mori.io.engine import IOEngine, IOEngineSession, set_log_level

__all__ = [
    "BackendType",
    "EngineDesc",
    "FabricBackendConfig",
    "IOEngine",
    "IOEngineConfig",
    "IOEngineSession",
    "MemoryDesc",
    "MemoryLocationType",
    "PollCqMode",
    "RdmaBackendConfig",
    "StatusCode",
    "TcpBackendConfig",
    "TransferStatus",
    "XgmiBackendConfig",
    "set_log_level",
]

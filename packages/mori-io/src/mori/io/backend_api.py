"""The contract between :class:`mori.io.IOEngine` and a data path written in Python (XGMI, NVLink, ...).

The engine owns one native backend (``BackendType.TCP``: sockets between any two hosts, plus
cross-memory attach between processes of one host) and any number of *Python backends*. A Python
backend is created by :meth:`IOEngine.create_backend`, which imports the module registered under
the requested type's name in the entry-point group ``mori.io.backends`` (:func:`backend_modules`;
mori-io registers ``XGMI = mori.io.xgmi`` and ``RDMA = mori.io.rdma``, plugins may add others) and
calls its factory::

    def create_backend(engine: IOEngine, config: object | None) -> Backend: ...

Routing. For every (local memory, remote memory) pair the engine asks its backends, highest
:attr:`Backend.preference` first, whether they :meth:`~Backend.supports` the pair; the first that
does is cached for the pair (the *route cache*; cleared when a backend is created or removed, a
remote engine or memory is deregistered). The native TCP backend has preference 0 and supports every
pair of CPU memories; a GPU backend should use a higher preference (XGMI uses 100).

Failover. When :meth:`Backend.post` raises :class:`mori.core.errors.MoriBackendError`, the engine
drops the cached route, skips that backend for the pair from then on, and posts through the next
backend that supports the pair; if none is left the error propagates. Statuses that fail later
(asynchronously) are not retried: the caller sees ``Failed()`` with the backend's message.

Completion. ``post`` returns a :class:`mori.io.TransferStatus`. A Python backend creates one with
``TransferStatus()`` (state ``INIT``), may call ``status.set_in_progress()``, and finishes it
exactly once with ``status.complete(code, message)`` from any thread; ``Wait``/``WaitFor``/
``wait_all`` then return. Backends without notifications (XGMI) leave the target's
``pop_inbound_transfer_status`` empty, as the spec says.

Memory registration. :meth:`Backend.on_register_memory` is called for each local registration
before its descriptor is returned to the user; whatever bytes it returns (an IPC handle, for
instance) are stored in ``MemoryDesc.ipc_handle`` and travel to peers with ``pack()``; with several
backends' bytes there, a backend reads its own with :func:`mori.io.handles.backend_handle`. A
backend must accept sub-ranges: ``desc.data`` may be an offset into a larger allocation.

GPU memory over TCP. The native TCP backend can also carry GPU memory through host staging
buffers: a device plugin installs a ``DeviceCopier`` (``csrc/engine.hpp``: device → host and
host → device C functions) with ``engine._native.set_device_copier(capsule)``, the capsule named
``"mori.io.DeviceCopier"``; after that the TCP backend ``supports`` GPU pairs (at preference 0, so a
GPU backend that supports the pair still wins).

All methods are called with the GIL held; a backend should release it (native calls, torch copies)
on its data path, and must not block in ``post`` longer than it takes to start the copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from mori.io import EngineDesc, MemoryDesc, TransferStatus


def backend_modules() -> dict[str, str]:
    """``BackendType`` name -> the module providing ``create_backend(engine, config)``, from the
    entry-point group ``mori.io.backends`` (imported on the first ``create_backend`` of that type)."""
    from importlib.metadata import entry_points

    return {ep.name: ep.value for ep in entry_points(group="mori.io.backends")}


Op = Literal["read", "write"]


@runtime_checkable
class Backend(Protocol):
    """A data path the engine routes transfers through. See the module docstring for the rules."""

    #: higher is tried first; the native TCP backend is 0
    preference: int

    def supports(self, local: MemoryDesc, remote: MemoryDesc) -> bool:
        """Whether this backend can move bytes between ``local`` (this engine's) and ``remote``
        (a registered remote engine's) memory. Called once per pair; the answer is cached."""
        ...

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
        """Start one transfer of ``len(sizes)`` blocks and return its status without waiting.

        ``read`` copies remote -> local, ``write`` local -> remote; offsets and sizes are bytes,
        already checked by the engine to lie inside both descriptors (non-negative, in range).
        Raise :class:`~mori.core.errors.MoriBackendError` only when the backend cannot serve the
        pair at all (the engine then fails over); report a failed copy through the status.
        """
        ...

    def on_register_memory(self, desc: MemoryDesc) -> bytes | None:
        """A local region was registered; return bytes for ``desc.ipc_handle`` or ``None``."""
        ...

    def on_deregister_memory(self, desc: MemoryDesc) -> None:
        """A local region is being deregistered; finish or fail transfers that touch it first."""
        ...

    def on_register_remote_engine(self, desc: EngineDesc) -> None:
        """A remote engine became known (``register_remote_engine``)."""
        ...

    def on_deregister_remote_engine(self, desc: EngineDesc) -> None:
        """A remote engine is forgotten; drop mappings of its memory."""
        ...

    def close(self) -> None:
        """The backend is removed or the engine shuts down."""
        ...


__all__ = ["Backend", "Op", "backend_modules"]

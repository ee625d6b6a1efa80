"""What backends put into ``MemoryDesc.ipc_handle``: the bytes of one backend as they are (the
original's format, the GPU IPC handle), or, when several backends registered the region, a map of
them under a prefix. A backend reads its own with :func:`backend_handle`."""

from __future__ import annotations

import msgpack

from mori.io._types import MemoryDesc

#: the prefix of a map {backend type name: bytes} (msgpack) of several backends' handles
HANDLES_MAGIC = b"MORI-HANDLES1"


def pack_handles(handles: dict[str, bytes]) -> bytes:
    if len(handles) == 1:
        return next(iter(handles.values()))
    packed: bytes = msgpack.packb(handles, use_bin_type=True)
    return HANDLES_MAGIC + packed


def backend_handle(desc: MemoryDesc, name: str) -> bytes | None:
    """The bytes backend ``name`` (a BackendType name) put into ``desc.ipc_handle``: from the map of
    several, or the single handle as it is (the backend checks it is its own)."""
    raw = desc.ipc_handle
    if not raw:
        return None
    if raw.startswith(HANDLES_MAGIC):
        try:
            handles = msgpack.unpackb(raw[len(HANDLES_MAGIC) :], raw=False)
        except Exception:
            return None
        got = handles.get(name) if isinstance(handles, dict) else None
        return bytes(got) if isinstance(got, (bytes, bytearray)) else None
    return bytes(raw)


__all__ = ["HANDLES_MAGIC", "backend_handle", "pack_handles"]

"""The unique id that names one communicator's rendezvous: 128 bytes, picklable."""

from __future__ import annotations

from typing import Any

from mori.core import bootstrap
from mori.core.errors import bad_type, bad_value

__all__ = ["UNIQUE_ID_BYTES", "UniqueId"]

#: size of a unique id in bytes (the original's and NCCL's)
UNIQUE_ID_BYTES = bootstrap.UNIQUE_ID_BYTES


class UniqueId:
    """Opaque 128-byte id of one communicator, made by :meth:`Communicator.get_unique_id()
    <mori.cco.Communicator.get_unique_id>` on one process and handed to every rank.

    It names the rendezvous store (a torch ``TCPStore`` served by the process that made the id,
    which must stay alive until every rank has called ``init``) and a random nonce that keeps
    communicators sharing one store apart. Pickles as its bytes; ``bytes(uid)`` gives them,
    :meth:`from_bytes` reads them back (e.g. after ``broadcast_object_list`` or an MPI bcast).
    Two ids are equal when their bytes are.
    """

    __slots__ = ("_raw",)

    def __init__(self, raw: bytes) -> None:
        if not isinstance(raw, bytes):
            raise bad_type("UniqueId", "raw", raw, f"bytes ({UNIQUE_ID_BYTES} of them)")
        if len(raw) != UNIQUE_ID_BYTES:
            raise bad_value(
                "UniqueId", "raw", f"<{len(raw)} bytes>", f"{UNIQUE_ID_BYTES} bytes from get_unique_id()"
            )
        # decoding checks the magic; what the id names is checked when a rank connects
        try:
            bootstrap.UniqueId.unpack(raw)
        except ValueError:
            raise bad_value(
                "UniqueId", "raw", raw[:8], "bytes made by Communicator.get_unique_id()"
            ) from None
        self._raw = raw

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> UniqueId:
        """The id whose bytes are ``data`` (exactly :data:`UNIQUE_ID_BYTES` of them, as made by
        ``get_unique_id``). Raises :class:`~mori.core.errors.MoriValueError` otherwise."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise bad_type("UniqueId.from_bytes", "data", data, f"bytes ({UNIQUE_ID_BYTES} of them)")
        raw = bytes(data)
        if len(raw) != UNIQUE_ID_BYTES:
            raise bad_value(
                "UniqueId.from_bytes",
                "data",
                f"<{len(raw)} bytes>",
                f"{UNIQUE_ID_BYTES} bytes from get_unique_id()",
            )
        try:
            bootstrap.UniqueId.unpack(raw)
        except ValueError:
            raise bad_value(
                "UniqueId.from_bytes", "data", raw[:8], "bytes made by Communicator.get_unique_id()"
            ) from None
        return cls(raw)

    def __bytes__(self) -> bytes:
        return self._raw

    def __len__(self) -> int:
        return UNIQUE_ID_BYTES

    def __reduce__(self) -> tuple[Any, ...]:
        return (UniqueId, (self._raw,))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UniqueId) and other._raw == self._raw

    def __hash__(self) -> int:
        return hash(self._raw)

    def __repr__(self) -> str:
        where = bootstrap.UniqueId.unpack(self._raw)
        return f"UniqueId(store {where.host}:{where.port}, nonce {where.nonce.hex()[:8]}...)"

"""mori-backend-nvlink's segment handle: :mod:`mori.core.gpu.handles` (the layout is there) with
magic b"MNVL", which tells a cuda heap from another backend's. The ipc field is the CUDA IPC handle."""

from __future__ import annotations

from typing import ClassVar

from mori.core.gpu.handles import IPC_SIZE, KIND_HEAP, KIND_RANGE, SIZE, VERSION, PciAddress
from mori.core.gpu.handles import SegmentHandle as _SegmentHandle

__all__ = ["KIND_HEAP", "KIND_RANGE", "PciAddress", "SegmentHandle"]
_ = (IPC_SIZE, SIZE, VERSION)  # re-exported for the tests

MAGIC = b"MNVL"


class SegmentHandle(_SegmentHandle):
    """A decoded mori-backend-nvlink handle (see :class:`mori.core.gpu.handles.SegmentHandle`)."""

    MAGIC: ClassVar[bytes] = MAGIC
    PACKAGE: ClassVar[str] = "mori-backend-nvlink"
    RUNTIME: ClassVar[str] = "cuda"

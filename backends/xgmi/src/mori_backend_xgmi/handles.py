"""mori-backend-xgmi's segment handle: :mod:`mori.core.gpu.handles` (the layout is there) with
magic b"MXGM", which tells a hip heap from another backend's. The ipc field is the HIP IPC handle."""

from __future__ import annotations

from typing import ClassVar

from mori.core.gpu.handles import IPC_SIZE, KIND_HEAP, KIND_RANGE, SIZE, VERSION, PciAddress
from mori.core.gpu.handles import SegmentHandle as _SegmentHandle

__all__ = ["KIND_HEAP", "KIND_RANGE", "PciAddress", "SegmentHandle"]
_ = (IPC_SIZE, SIZE, VERSION)  # re-exported for the tests

MAGIC = b"MXGM"


class SegmentHandle(_SegmentHandle):
    """A decoded mori-backend-xgmi handle (see :class:`mori.core.gpu.handles.SegmentHandle`)."""

    MAGIC: ClassVar[bytes] = MAGIC
    PACKAGE: ClassVar[str] = "mori-backend-xgmi"
    RUNTIME: ClassVar[str] = "hip"

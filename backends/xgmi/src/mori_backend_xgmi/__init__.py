"""mori-backend-xgmi: the ``hip`` device runtime and the ``xgmi`` transport for AMD GPUs.

Installed next to mori-core, it is found through the ``mori.backends`` entry point ``xgmi``;
select it with ``MORI_DEVICE_RUNTIME=hip`` (or ``auto``, where a GPU works). The HIP runtime is
loaded with ctypes when the runtime is first used: importing this package loads neither
``libamdhip64.so`` nor torch, and it imports on machines without ROCm.

Public classes: :class:`~mori_backend_xgmi.runtime.HipRuntime` (with ``export_range``,
``open_range`` and ``copy_engine`` beyond the mori-core contract),
:class:`~mori_backend_xgmi.transport.XgmiTransport`,
:class:`~mori_backend_xgmi.copy_engine.CopyEngine` and its
:class:`~mori_backend_xgmi.copy_engine.CopyTicket`,
:class:`~mori_backend_xgmi.handles.SegmentHandle`, and the HIP binding
:class:`~mori_backend_xgmi.driver.HipDriver` with its :class:`~mori_backend_xgmi.driver.HipError`.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from mori_backend_xgmi.copy_engine import CopyEngine, CopyTicket
from mori_backend_xgmi.driver import HipDriver, HipError, load_driver
from mori_backend_xgmi.handles import PciAddress, SegmentHandle
from mori_backend_xgmi.runtime import HipPeerSegment, HipRuntime, HipSegment
from mori_backend_xgmi.transport import XgmiTransport

try:
    __version__ = version("mori-backend-xgmi")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "CopyEngine",
    "CopyTicket",
    "HipDriver",
    "HipError",
    "HipPeerSegment",
    "HipRuntime",
    "HipSegment",
    "PciAddress",
    "SegmentHandle",
    "XgmiTransport",
    "__version__",
    "load_driver",
]

"""mori-backend-nvlink: the ``cuda`` device runtime and the ``p2p`` transport for NVIDIA GPUs.

Installed next to mori-core, it is found through the ``mori.backends`` entry point ``nvlink``;
select it with ``MORI_DEVICE_RUNTIME=cuda`` (or ``auto``, where a GPU works). The CUDA driver is
loaded with ctypes when the runtime is first used: importing this package loads neither
``libcuda.so.1`` nor ``torch.cuda``, and it imports on machines without CUDA.

Public classes: :class:`~mori_backend_nvlink.runtime.CudaRuntime` (with ``export_range``,
``open_range`` and ``copy_engine`` beyond the mori-core contract),
:class:`~mori_backend_nvlink.transport.P2PTransport`,
:class:`~mori_backend_nvlink.copy_engine.CopyEngine` and its
:class:`~mori_backend_nvlink.copy_engine.CopyTicket`,
:class:`~mori_backend_nvlink.handles.SegmentHandle`, and the driver binding
:class:`~mori_backend_nvlink.driver.CudaDriver` with its :class:`~mori_backend_nvlink.driver.CudaError`.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from mori_backend_nvlink.copy_engine import CopyEngine, CopyTicket
from mori_backend_nvlink.driver import CudaDriver, CudaError, load_driver
from mori_backend_nvlink.handles import PciAddress, SegmentHandle
from mori_backend_nvlink.runtime import CudaPeerSegment, CudaRuntime, CudaSegment
from mori_backend_nvlink.transport import P2PTransport

try:
    __version__ = version("mori-backend-nvlink")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "CopyEngine",
    "CopyTicket",
    "CudaDriver",
    "CudaError",
    "CudaPeerSegment",
    "CudaRuntime",
    "CudaSegment",
    "P2PTransport",
    "PciAddress",
    "SegmentHandle",
    "__version__",
    "load_driver",
]

"""ctypes binding of the CUDA driver API (``libcuda.so.1``), loaded at run time.

Nothing here runs at import. The vendor's :meth:`~mori.core.gpu.vendor.GpuVendor.load_driver`
opens the library the first time it is needed (``MORI_CUDA_DRIVER_LIBRARY``, default
``libcuda.so.1``), so the wheel has no link-time CUDA dependency and imports on any machine.
:class:`CudaDriver` wraps any object that has the driver's functions as attributes: the real
library, or a fake in tests. Each function is bound on first use
with its C prototype; every call is checked, and a result other than ``CUDA_SUCCESS`` raises
:class:`CudaError` naming the call, the ``CUresult`` name and the driver's description of it.

Prototypes are those of ``cuda.h`` (CUDA 12/13); the ``_v2`` names are the ones the header's
macros map the plain names to (``cuMemAlloc`` -> ``cuMemAlloc_v2``, ...). The checked-call plumbing
and the calls alike for CUDA and HIP are :class:`mori.core.gpu.driver.CtypesDriver`'s.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from ctypes import POINTER, byref, c_char_p, c_int, c_size_t, c_ubyte, c_uint, c_uint64, c_void_p
from typing import Any, ClassVar

from mori.core.gpu.driver import CtypesDriver, GpuError, IpcMemHandle

__all__ = ["CudaDriver", "CudaError"]

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_NOT_READY = 600

CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1
CU_STREAM_NON_BLOCKING = 0x1
CU_EVENT_DISABLE_TIMING = 0x2
CU_MEMHOSTALLOC_PORTABLE = 0x1
CU_MEMHOSTALLOC_DEVICEMAP = 0x2
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9

# Names of the results this backend can meet, for drivers whose cuGetErrorName fails (or fakes).
_RESULT_NAMES = {
    0: "CUDA_SUCCESS",
    1: "CUDA_ERROR_INVALID_VALUE",
    2: "CUDA_ERROR_OUT_OF_MEMORY",
    3: "CUDA_ERROR_NOT_INITIALIZED",
    4: "CUDA_ERROR_DEINITIALIZED",
    34: "CUDA_ERROR_STUB_LIBRARY",
    35: "CUDA_ERROR_INSUFFICIENT_DRIVER",
    46: "CUDA_ERROR_DEVICE_UNAVAILABLE",
    100: "CUDA_ERROR_NO_DEVICE",
    101: "CUDA_ERROR_INVALID_DEVICE",
    201: "CUDA_ERROR_INVALID_CONTEXT",
    217: "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
    304: "CUDA_ERROR_OPERATING_SYSTEM",
    400: "CUDA_ERROR_INVALID_HANDLE",
    500: "CUDA_ERROR_NOT_FOUND",
    600: "CUDA_ERROR_NOT_READY",
    700: "CUDA_ERROR_ILLEGAL_ADDRESS",
    704: "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED",
    709: "CUDA_ERROR_CONTEXT_IS_DESTROYED",
    719: "CUDA_ERROR_LAUNCH_FAILED",
    800: "CUDA_ERROR_NOT_PERMITTED",
    801: "CUDA_ERROR_NOT_SUPPORTED",
    999: "CUDA_ERROR_UNKNOWN",
}


_P = POINTER
#: C prototypes (argument types; every function returns a CUresult, an int)
PROTOTYPES: dict[str, Sequence[Any]] = {
    "cuInit": [c_uint],
    "cuDriverGetVersion": [_P(c_int)],
    "cuDeviceGetCount": [_P(c_int)],
    "cuDeviceGet": [_P(c_int), c_int],
    "cuDeviceGetPCIBusId": [c_char_p, c_int, c_int],
    "cuDeviceCanAccessPeer": [_P(c_int), c_int, c_int],
    "cuDevicePrimaryCtxRetain": [_P(c_void_p), c_int],
    "cuCtxGetCurrent": [_P(c_void_p)],
    "cuCtxSetCurrent": [c_void_p],
    "cuCtxSynchronize": [],
    "cuMemAlloc_v2": [_P(c_uint64), c_size_t],
    "cuMemFree_v2": [c_uint64],
    "cuMemsetD8Async": [c_uint64, c_ubyte, c_size_t, c_void_p],
    "cuMemGetAddressRange_v2": [_P(c_uint64), _P(c_size_t), c_uint64],
    "cuPointerGetAttribute": [c_void_p, c_int, c_uint64],
    "cuMemcpyAsync": [c_uint64, c_uint64, c_size_t, c_void_p],
    "cuMemHostAlloc": [_P(c_void_p), c_size_t, c_uint],
    "cuMemHostGetDevicePointer_v2": [_P(c_uint64), c_void_p, c_uint],
    "cuMemFreeHost": [c_void_p],
    "cuIpcGetMemHandle": [_P(IpcMemHandle), c_uint64],
    "cuIpcOpenMemHandle_v2": [_P(c_uint64), IpcMemHandle, c_uint],
    "cuIpcCloseMemHandle": [c_uint64],
    "cuStreamCreate": [_P(c_void_p), c_uint],
    "cuStreamDestroy_v2": [c_void_p],
    "cuStreamSynchronize": [c_void_p],
    "cuStreamWaitEvent": [c_void_p, c_void_p, c_uint],
    "cuEventCreate": [_P(c_void_p), c_uint],
    "cuEventRecord": [c_void_p, c_void_p],
    "cuEventQuery": [c_void_p],
    "cuEventSynchronize": [c_void_p],
    "cuEventDestroy_v2": [c_void_p],
    # function, grid x/y/z, block x/y/z, shared bytes, stream, kernel parameters, extra
    "cuLaunchKernel": [c_void_p, *[c_uint] * 7, c_void_p, c_void_p, c_void_p],
    "cuGetErrorName": [c_int, _P(c_char_p)],
    "cuGetErrorString": [c_int, _P(c_char_p)],
}
#: older names to try when a driver lacks the current one
_FALLBACKS = {"cuIpcOpenMemHandle_v2": ("cuIpcOpenMemHandle",)}


class CudaError(GpuError):
    """A CUDA driver call failed. ``call``: the function, ``code``: the CUresult, ``result``: its name."""


class CudaDriver(CtypesDriver):
    """The CUDA driver API as Python methods. ``lib``: ``ctypes.CDLL`` of libcuda, or a fake with
    the same function names (tests); ``path``: where it came from, for messages. The calls alike
    for every vendor are :class:`~mori.core.gpu.driver.CtypesDriver`'s, named by ``NAMES``."""

    NAMES: ClassVar[dict[str, str]] = {
        "init": "cuInit",
        "version": "cuDriverGetVersion",
        "device_count": "cuDeviceGetCount",
        "can_access_peer": "cuDeviceCanAccessPeer",
        "pointer_attribute": "cuPointerGetAttribute",
        "synchronize": "cuCtxSynchronize",
        "free": "cuMemFree_v2",
        "memset": "cuMemsetD8Async",
        "address_range": "cuMemGetAddressRange_v2",
        "host_alloc": "cuMemHostAlloc",
        "host_device_pointer": "cuMemHostGetDevicePointer_v2",
        "host_free": "cuMemFreeHost",
        "ipc_get": "cuIpcGetMemHandle",
        "ipc_open": "cuIpcOpenMemHandle_v2",
        "ipc_close": "cuIpcCloseMemHandle",
        "stream_create": "cuStreamCreate",
        "stream_destroy": "cuStreamDestroy_v2",
        "stream_synchronize": "cuStreamSynchronize",
        "stream_wait_event": "cuStreamWaitEvent",
        "event_create": "cuEventCreate",
        "event_record": "cuEventRecord",
        "event_query": "cuEventQuery",
        "event_synchronize": "cuEventSynchronize",
        "event_destroy": "cuEventDestroy_v2",
        "error_name": "cuGetErrorName",
        "error_string": "cuGetErrorString",
        "memcpy": "cuMemcpyAsync",
        "get_context": "cuCtxGetCurrent",
        "set_context": "cuCtxSetCurrent",
        "launch_kernel": "cuLaunchKernel",
    }
    PROTOTYPES = PROTOTYPES
    FALLBACKS = _FALLBACKS
    RESULT_NAMES = _RESULT_NAMES
    RESULT_TYPE = "CUresult"
    NO_DESCRIPTION = "no description from the driver"
    TOO_OLD = "the CUDA driver is too old for mori-backend-nvlink (needs CUDA 12 or newer)"
    ERROR = CudaError
    SUCCESS = CUDA_SUCCESS
    NOT_READY = CUDA_ERROR_NOT_READY
    PTR = c_uint64
    POINTER_ATTRIBUTE_DEVICE_ORDINAL = CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    HOST_ALLOC_FLAGS = CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP
    IPC_LAZY_ENABLE_PEER_ACCESS = CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    STREAM_NON_BLOCKING = CU_STREAM_NON_BLOCKING
    EVENT_DISABLE_TIMING = CU_EVENT_DISABLE_TIMING

    # -- devices and contexts -----------------------------------------------------------------------

    def device(self, ordinal: int) -> int:
        out = c_int()
        self.call("cuDeviceGet", byref(out), ordinal, detail=f"device ordinal {ordinal}")
        return out.value

    def pci_bus_id(self, device: int) -> str:
        buf = ctypes.create_string_buffer(64)
        self.call("cuDeviceGetPCIBusId", buf, len(buf), device)
        return buf.value.decode()

    def primary_context_retain(self, device: int) -> int:
        out = c_void_p()
        self.call("cuDevicePrimaryCtxRetain", byref(out), device)
        return out.value or 0

    def current_context(self) -> int:
        out = c_void_p()
        self.call("cuCtxGetCurrent", byref(out))
        return out.value or 0

    def set_current_context(self, ctx: int) -> None:
        self.call("cuCtxSetCurrent", ctx or None)

    def restore_context(self, prev: int) -> None:
        """Make ``prev`` (from :meth:`current_context`) current again; a thread that had no context
        keeps the one made current since: it is the one torch would pick."""
        if prev:
            self.set_current_context(prev)

    # -- memory -----------------------------------------------------------------------------------

    def mem_alloc(self, size: int) -> int:
        out = c_uint64()
        self.call("cuMemAlloc_v2", byref(out), size, detail=f"{size} bytes")
        return out.value

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Copy between any two addresses of the unified address space, in stream order."""
        self.call("cuMemcpyAsync", dst, src, nbytes, stream or None)

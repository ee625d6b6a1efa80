"""ctypes binding of the HIP runtime API (``libamdhip64.so``), loaded at run time.

Nothing here runs at import. The vendor's :meth:`~mori.core.gpu.vendor.GpuVendor.load_driver`
opens the library the first time it is needed, so the wheel has no link-time ROCm dependency and
imports on any machine. Which library: the one ``MORI_HIP_LIBRARY`` names; else a
``libamdhip64.so`` already loaded in the process (a ROCm build of torch brings its own, and two HIP
runtimes in one process do not share allocations); else the dynamic linker's and
``/opt/rocm/lib``'s. :class:`HipDriver` wraps any object that has the API's functions as
attributes: the real library, or a fake in tests. Every call is checked: a result other than
``hipSuccess`` raises :class:`HipError` naming the call, the ``hipError_t`` name and
HIP's description of it.

The methods have the same names and meaning as mori-backend-nvlink's ``CudaDriver``, so one
runtime (:class:`mori.core.gpu.runtime.GpuRuntime`) serves both; HIP has no explicit contexts (the
current device of the calling thread plays that part). The checked-call plumbing and the calls
alike for CUDA and HIP are :class:`mori.core.gpu.driver.CtypesDriver`'s.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from ctypes import POINTER, byref, c_char_p, c_int, c_size_t, c_uint, c_void_p
from typing import Any, ClassVar

from mori.core.gpu.driver import CtypesDriver, GpuError, IpcMemHandle

__all__ = ["HipDriver", "HipError"]

#: where the HIP runtime is looked for (after MORI_HIP_LIBRARY and one already loaded)
LIBRARIES = ("libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6", "/opt/rocm/lib/libamdhip64.so")

HIP_SUCCESS = 0
HIP_ERROR_NO_DEVICE = 100
HIP_ERROR_NOT_READY = 600

HIP_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1
HIP_STREAM_NON_BLOCKING = 0x1
HIP_EVENT_DISABLE_TIMING = 0x2
HIP_HOST_MALLOC_PORTABLE = 0x1
HIP_HOST_MALLOC_MAPPED = 0x2
HIP_MEMCPY_DEFAULT = 4  # direction from the unified addresses
HIP_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
#: hipExtMallocWithFlags: fine-grained, uncached device memory (coherent across GPUs and the host)
HIP_DEVICE_MALLOC_UNCACHED = 0x3


_P = POINTER
#: C prototypes (argument types; every function returns a hipError_t, an int)
PROTOTYPES: dict[str, Sequence[Any]] = {
    "hipInit": [c_uint],
    "hipDriverGetVersion": [_P(c_int)],
    "hipGetDeviceCount": [_P(c_int)],
    "hipGetDevice": [_P(c_int)],
    "hipSetDevice": [c_int],
    "hipDeviceGetPCIBusId": [c_char_p, c_int, c_int],
    "hipDeviceCanAccessPeer": [_P(c_int), c_int, c_int],
    "hipPointerGetAttribute": [c_void_p, c_int, c_void_p],
    "hipDeviceSynchronize": [],
    "hipMalloc": [_P(c_void_p), c_size_t],
    "hipExtMallocWithFlags": [_P(c_void_p), c_size_t, c_uint],
    "hipFree": [c_void_p],
    "hipMemsetAsync": [c_void_p, c_int, c_size_t, c_void_p],
    "hipMemGetAddressRange": [_P(c_void_p), _P(c_size_t), c_void_p],
    "hipMemcpyAsync": [c_void_p, c_void_p, c_size_t, c_int, c_void_p],
    "hipHostMalloc": [_P(c_void_p), c_size_t, c_uint],
    "hipHostGetDevicePointer": [_P(c_void_p), c_void_p, c_uint],
    "hipHostFree": [c_void_p],
    "hipIpcGetMemHandle": [_P(IpcMemHandle), c_void_p],
    "hipIpcOpenMemHandle": [_P(c_void_p), IpcMemHandle, c_uint],
    "hipIpcCloseMemHandle": [c_void_p],
    "hipStreamCreateWithFlags": [_P(c_void_p), c_uint],
    "hipStreamDestroy": [c_void_p],
    "hipStreamSynchronize": [c_void_p],
    "hipStreamWaitEvent": [c_void_p, c_void_p, c_uint],
    "hipEventCreateWithFlags": [_P(c_void_p), c_uint],
    "hipEventRecord": [c_void_p, c_void_p],
    "hipEventQuery": [c_void_p],
    "hipEventSynchronize": [c_void_p],
    "hipEventDestroy": [c_void_p],
    # function, grid x/y/z, block x/y/z, shared bytes, stream, kernel parameters, extra
    "hipModuleLaunchKernel": [c_void_p, *[c_uint] * 7, c_void_p, c_void_p, c_void_p],
    "hipGetErrorName": [c_int],
    "hipGetErrorString": [c_int],
}
#: functions that return a C string instead of an error code
_STRING_RESULT = {"hipGetErrorName", "hipGetErrorString"}
#: other names to try when a runtime lacks the usual one
_FALLBACKS = {"hipHostMalloc": ("hipExtHostAlloc", "hipHostAlloc")}
#: names of the results this backend can meet, for a runtime that cannot name them (or fakes)
_RESULT_NAMES = {
    0: "hipSuccess",
    1: "hipErrorInvalidValue",
    2: "hipErrorOutOfMemory",
    3: "hipErrorNotInitialized",
    4: "hipErrorDeinitialized",
    100: "hipErrorNoDevice",
    101: "hipErrorInvalidDevice",
    201: "hipErrorInvalidContext",
    217: "hipErrorPeerAccessUnsupported",
    400: "hipErrorInvalidHandle",
    500: "hipErrorNotFound",
    600: "hipErrorNotReady",
    700: "hipErrorIllegalAddress",
    719: "hipErrorLaunchFailure",
    801: "hipErrorNotSupported",
    999: "hipErrorUnknown",
}


class HipError(GpuError):
    """A HIP call failed. ``call``: the function, ``code``: the hipError_t, ``result``: its name."""


class HipDriver(CtypesDriver):
    """The HIP runtime API as Python methods. ``lib``: ``ctypes.CDLL`` of libamdhip64, or a fake
    with the same function names (tests); ``path``: where it came from, for messages. The calls
    alike for every vendor are :class:`~mori.core.gpu.driver.CtypesDriver`'s, named by ``NAMES``.
    HIP has no explicit contexts: the "context" methods the runtime uses get and set the calling
    thread's current device."""

    NAMES: ClassVar[dict[str, str]] = {
        "init": "hipInit",
        "version": "hipDriverGetVersion",
        "device_count": "hipGetDeviceCount",
        "can_access_peer": "hipDeviceCanAccessPeer",
        "pointer_attribute": "hipPointerGetAttribute",
        "synchronize": "hipDeviceSynchronize",
        "free": "hipFree",
        "memset": "hipMemsetAsync",
        "address_range": "hipMemGetAddressRange",
        "host_alloc": "hipHostMalloc",
        "host_device_pointer": "hipHostGetDevicePointer",
        "host_free": "hipHostFree",
        "ipc_get": "hipIpcGetMemHandle",
        "ipc_open": "hipIpcOpenMemHandle",
        "ipc_close": "hipIpcCloseMemHandle",
        "stream_create": "hipStreamCreateWithFlags",
        "stream_destroy": "hipStreamDestroy",
        "stream_synchronize": "hipStreamSynchronize",
        "stream_wait_event": "hipStreamWaitEvent",
        "event_create": "hipEventCreateWithFlags",
        "event_record": "hipEventRecord",
        "event_query": "hipEventQuery",
        "event_synchronize": "hipEventSynchronize",
        "event_destroy": "hipEventDestroy",
        "error_name": "hipGetErrorName",
        "error_string": "hipGetErrorString",
        "memcpy": "hipMemcpyAsync",
        "get_context": "hipGetDevice",
        "set_context": "hipSetDevice",
        "launch_kernel": "hipModuleLaunchKernel",
    }
    PROTOTYPES = PROTOTYPES
    FALLBACKS = _FALLBACKS
    STRING_RESULT = _STRING_RESULT
    RESULT_NAMES = _RESULT_NAMES
    RESULT_TYPE = "hipError_t"
    NO_DESCRIPTION = "no description from HIP"
    TOO_OLD = "the HIP runtime is too old for mori-backend-xgmi (needs ROCm 6 or newer)"
    ERROR = HipError
    SUCCESS = HIP_SUCCESS
    NOT_READY = HIP_ERROR_NOT_READY
    PTR = c_void_p
    POINTER_ATTRIBUTE_DEVICE_ORDINAL = HIP_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    HOST_ALLOC_FLAGS = HIP_HOST_MALLOC_PORTABLE | HIP_HOST_MALLOC_MAPPED
    IPC_LAZY_ENABLE_PEER_ACCESS = HIP_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    STREAM_NON_BLOCKING = HIP_STREAM_NON_BLOCKING
    EVENT_DISABLE_TIMING = HIP_EVENT_DISABLE_TIMING
    MEMCPY_KIND = HIP_MEMCPY_DEFAULT
    CONTEXT_IS_DEVICE = True

    # -- devices (the current device plays the part of CUDA's context) ----------------------------

    def current_device(self) -> int:
        out = c_int()
        self.call("hipGetDevice", byref(out))
        return out.value

    def set_device(self, device: int) -> None:
        self.call("hipSetDevice", device, detail=f"device {device}")

    def device(self, ordinal: int) -> int:
        """HIP names devices by ordinal: ``ordinal`` itself (no call)."""
        return ordinal

    def pci_bus_id(self, device: int) -> str:
        buf = ctypes.create_string_buffer(64)
        self.call("hipDeviceGetPCIBusId", buf, len(buf), device, detail=f"device {device}")
        return buf.value.decode()

    def primary_context_retain(self, device: int) -> int:
        """The device ordinal itself: what :meth:`set_current_context` makes current."""
        return device

    def current_context(self) -> int:
        return self.current_device()

    def set_current_context(self, ctx: int) -> None:
        self.set_device(ctx)

    def restore_context(self, prev: int) -> None:
        self.set_device(prev)

    # -- memory -----------------------------------------------------------------------------------

    def mem_alloc(self, size: int, *, uncached: bool = False) -> int:
        """Device memory; ``uncached``: fine-grained and uncached (``hipDeviceMallocUncached``)."""
        out = c_void_p()
        if uncached:
            self.call(
                "hipExtMallocWithFlags", byref(out), size, HIP_DEVICE_MALLOC_UNCACHED, detail=f"{size} bytes"
            )
        else:
            self.call("hipMalloc", byref(out), size, detail=f"{size} bytes")
        return out.value or 0

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Copy between any two addresses of the unified address space, in stream order."""
        self.call("hipMemcpyAsync", dst, src, nbytes, HIP_MEMCPY_DEFAULT, stream or None)

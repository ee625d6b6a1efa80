"""ctypes binding of the CUDA driver API (``libcuda.so.1``), loaded at run time.

Nothing here runs at import. :func:`load_driver` opens the library the first time it is needed
(``MORI_CUDA_DRIVER_LIBRARY``, default ``libcuda.so.1``), so the wheel has no link-time CUDA
dependency and imports on any machine. :class:`CudaDriver` wraps any object that has the driver's
functions as attributes: the real library, or a fake in tests. Each function is bound on first use
with its C prototype; every call is checked, and a result other than ``CUDA_SUCCESS`` raises
:class:`CudaError` naming the call, the ``CUresult`` name and the driver's description of it.

Prototypes are those of ``cuda.h`` (CUDA 12/13); the ``_v2`` names are the ones the header's
macros map the plain names to (``cuMemAlloc`` -> ``cuMemAlloc_v2``, ...).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from ctypes import POINTER, byref, c_char_p, c_int, c_size_t, c_ubyte, c_uint, c_uint64, c_void_p
from typing import Any

from mori.core.errors import MoriBackendError

__all__ = ["CudaDriver", "CudaError", "IpcMemHandle", "load_driver"]

DEFAULT_LIBRARY = "libcuda.so.1"

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_NOT_READY = 600

#: bytes of a CUipcMemHandle
IPC_HANDLE_SIZE = 64
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


class IpcMemHandle(ctypes.Structure):
    """``CUipcMemHandle``: 64 opaque bytes, passed by value to ``cuIpcOpenMemHandle``."""

    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_SIZE)]


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
    "cuGetErrorName": [c_int, _P(c_char_p)],
    "cuGetErrorString": [c_int, _P(c_char_p)],
}
#: older names to try when a driver lacks the current one
_FALLBACKS = {"cuIpcOpenMemHandle_v2": ("cuIpcOpenMemHandle",)}


class CudaError(MoriBackendError):
    """A CUDA driver call failed. ``call``: the function, ``code``: the CUresult, ``result``: its name."""

    def __init__(self, call: str, code: int, result: str, description: str, detail: str = "") -> None:
        message = f"{call} failed: {result} ({code}): {description}"
        super().__init__(f"{message} ({detail})" if detail else message)
        self.call = call
        self.code = code
        self.result = result
        self.description = description


class CudaDriver:
    """The CUDA driver API as Python methods. ``lib``: ``ctypes.CDLL`` of libcuda, or a fake with
    the same function names (tests); ``path``: where it came from, for messages."""

    def __init__(self, lib: Any, path: str = DEFAULT_LIBRARY) -> None:
        self.lib = lib
        self.path = path
        self._fns: dict[str, Callable[..., int]] = {}
        self._bind_lock = threading.Lock()
        self._initialised = False

    # -- plumbing ---------------------------------------------------------------------------------

    def _fn(self, name: str) -> Callable[..., int]:
        fn = self._fns.get(name)
        if fn is not None:
            return fn
        with self._bind_lock:
            for candidate in (name, *_FALLBACKS.get(name, ())):
                try:
                    found = getattr(self.lib, candidate)
                except AttributeError:
                    continue
                if hasattr(found, "argtypes"):  # a function of a real library: give it its prototype
                    found.argtypes = list(PROTOTYPES[name])
                    found.restype = c_int
                self._fns[name] = found
                return found  # type: ignore[no-any-return]
        raise MoriBackendError(
            f"{self.path} has no function {name}: the CUDA driver is too old for mori-backend-nvlink "
            f"(needs CUDA 12 or newer)"
        )

    def call(self, name: str, *args: Any, detail: str = "") -> None:
        """Call ``name(*args)``; raise :class:`CudaError` unless it returns CUDA_SUCCESS."""
        code = int(self._fn(name)(*args))
        if code != CUDA_SUCCESS:
            raise self.error(name, code, detail)

    def result_name(self, code: int) -> str:
        text = self._error_text("cuGetErrorName", code)
        return text or _RESULT_NAMES.get(code, f"CUresult {code}")

    def error(self, call: str, code: int, detail: str = "") -> CudaError:
        description = self._error_text("cuGetErrorString", code) or "no description from the driver"
        return CudaError(call, code, self.result_name(code), description, detail)

    def _error_text(self, fn: str, code: int) -> str:
        out = c_char_p()
        try:
            if int(self._fn(fn)(code, byref(out))) != CUDA_SUCCESS or not out.value:
                return ""
        except MoriBackendError:
            return ""
        return out.value.decode(errors="replace")

    # -- driver and devices ---------------------------------------------------------------------------

    def init(self) -> None:
        """``cuInit(0)``, once per driver object."""
        if not self._initialised:
            self.call("cuInit", 0)
            self._initialised = True

    def version(self) -> int:
        """Driver version as CUDA numbers it: 1000 * major + 10 * minor (13000 = 13.0)."""
        out = c_int()
        self.call("cuDriverGetVersion", byref(out))
        return out.value

    def device_count(self) -> int:
        out = c_int()
        self.call("cuDeviceGetCount", byref(out))
        return out.value

    def device(self, ordinal: int) -> int:
        out = c_int()
        self.call("cuDeviceGet", byref(out), ordinal, detail=f"device ordinal {ordinal}")
        return out.value

    def pci_bus_id(self, device: int) -> str:
        buf = ctypes.create_string_buffer(64)
        self.call("cuDeviceGetPCIBusId", buf, len(buf), device)
        return buf.value.decode()

    def can_access_peer(self, device: int, peer: int) -> bool:
        out = c_int()
        self.call("cuDeviceCanAccessPeer", byref(out), device, peer)
        return bool(out.value)

    def pointer_device(self, ptr: int) -> int:
        """Ordinal of the device that ``ptr`` was allocated on."""
        out = c_int()
        self.call("cuPointerGetAttribute", byref(out), CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
        return out.value

    # -- contexts ---------------------------------------------------------------------------------

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

    def synchronize(self) -> None:
        """Wait for all work of the current context."""
        self.call("cuCtxSynchronize")

    # -- memory -----------------------------------------------------------------------------------

    def mem_alloc(self, size: int) -> int:
        out = c_uint64()
        self.call("cuMemAlloc_v2", byref(out), size, detail=f"{size} bytes")
        return out.value

    def mem_free(self, ptr: int) -> None:
        self.call("cuMemFree_v2", ptr)

    def memset_async(self, ptr: int, value: int, nbytes: int, stream: int) -> None:
        self.call("cuMemsetD8Async", ptr, value, nbytes, stream or None)

    def address_range(self, ptr: int) -> tuple[int, int]:
        """(base, size) of the allocation that contains ``ptr``."""
        base, size = c_uint64(), c_size_t()
        self.call("cuMemGetAddressRange_v2", byref(base), byref(size), ptr, detail=f"address {ptr:#x}")
        return base.value, size.value

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Copy between any two addresses of the unified address space, in stream order."""
        self.call("cuMemcpyAsync", dst, src, nbytes, stream or None)

    def host_alloc(self, nbytes: int) -> int:
        """Pinned host memory, mapped into every context's address space (portable, device-mapped)."""
        out = c_void_p()
        self.call("cuMemHostAlloc", byref(out), nbytes, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP)
        return out.value or 0

    def host_device_pointer(self, ptr: int) -> int:
        out = c_uint64()
        self.call("cuMemHostGetDevicePointer_v2", byref(out), ptr, 0)
        return out.value

    def host_free(self, ptr: int) -> None:
        self.call("cuMemFreeHost", ptr)

    # -- IPC --------------------------------------------------------------------------------------

    def ipc_get_handle(self, ptr: int) -> bytes:
        """The 64-byte IPC handle of the allocation whose base is ``ptr``."""
        handle = IpcMemHandle()
        self.call("cuIpcGetMemHandle", byref(handle), ptr, detail=f"address {ptr:#x}")
        return ctypes.string_at(ctypes.addressof(handle), IPC_HANDLE_SIZE)

    def ipc_open_handle(self, handle: bytes, *, detail: str = "") -> int:
        """Map another process's allocation into the current context; peer access enabled lazily."""
        h = IpcMemHandle()
        ctypes.memmove(ctypes.addressof(h), handle, IPC_HANDLE_SIZE)
        out = c_uint64()
        self.call("cuIpcOpenMemHandle_v2", byref(out), h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, detail=detail)
        return out.value

    def ipc_close_handle(self, ptr: int) -> None:
        self.call("cuIpcCloseMemHandle", ptr)

    # -- streams and events -------------------------------------------------------------------------

    def stream_create(self) -> int:
        """A stream that does not synchronise with the legacy default stream."""
        out = c_void_p()
        self.call("cuStreamCreate", byref(out), CU_STREAM_NON_BLOCKING)
        return out.value or 0

    def stream_destroy(self, stream: int) -> None:
        self.call("cuStreamDestroy_v2", stream or None)

    def stream_synchronize(self, stream: int) -> None:
        self.call("cuStreamSynchronize", stream or None)

    def stream_wait_event(self, stream: int, event: int) -> None:
        self.call("cuStreamWaitEvent", stream or None, event, 0)

    def event_create(self) -> int:
        out = c_void_p()
        self.call("cuEventCreate", byref(out), CU_EVENT_DISABLE_TIMING)
        return out.value or 0

    def event_record(self, event: int, stream: int) -> None:
        self.call("cuEventRecord", event, stream or None)

    def event_query(self, event: int) -> bool:
        """True if the work before the event has completed, False if it is still running."""
        code = int(self._fn("cuEventQuery")(event))
        if code == CUDA_ERROR_NOT_READY:
            return False
        if code != CUDA_SUCCESS:
            raise self.error("cuEventQuery", code)
        return True

    def event_synchronize(self, event: int) -> None:
        self.call("cuEventSynchronize", event)

    def event_destroy(self, event: int) -> None:
        self.call("cuEventDestroy_v2", event)


_driver: CudaDriver | None = None
_driver_lock = threading.Lock()


def load_driver(path: str | None = None) -> CudaDriver:
    """The process's driver binding, loading the library on first use.

    ``path``: library to load (default: ``MORI_CUDA_DRIVER_LIBRARY``, else ``libcuda.so.1``).
    Raises :class:`~mori.core.errors.MoriBackendError` saying why it cannot be loaded.
    """
    global _driver
    from mori_backend_nvlink.env import MORI_CUDA_DRIVER_LIBRARY

    wanted = path or MORI_CUDA_DRIVER_LIBRARY.get() or DEFAULT_LIBRARY
    with _driver_lock:
        if _driver is not None and _driver.path == wanted:
            return _driver
        try:
            lib = ctypes.CDLL(wanted)
        except OSError as e:
            missing = "cannot open shared object file" in str(e) or "No such file" in str(e)
            if missing:
                raise MoriBackendError(
                    f"{wanted} not found: no NVIDIA driver on this machine (or set MORI_CUDA_DRIVER_LIBRARY)"
                ) from None
            raise MoriBackendError(f"{wanted} cannot be loaded: {e}") from None
        _driver = CudaDriver(lib, wanted)
        return _driver

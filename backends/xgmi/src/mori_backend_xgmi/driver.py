"""ctypes binding of the HIP runtime API (``libamdhip64.so``), loaded at run time.

Nothing here runs at import. :func:`load_driver` opens the library the first time it is needed,
so the wheel has no link-time ROCm dependency and imports on any machine. Which library: the one
``MORI_HIP_LIBRARY`` names; else a ``libamdhip64.so`` already loaded in the process (a ROCm build
of torch brings its own, and two HIP runtimes in one process do not share allocations); else the
dynamic linker's and ``/opt/rocm/lib``'s. :class:`HipDriver` wraps any object that has the API's
functions as attributes: the real library, or a fake in tests. Every call is checked: a result
other than ``hipSuccess`` raises :class:`HipError` naming the call, the ``hipError_t`` name and
HIP's description of it.

The methods have the same names and meaning as mori-backend-nvlink's ``CudaDriver``, so the two
runtimes read alike; HIP has no explicit contexts (the current device of the calling thread
plays that part).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable, Sequence
from ctypes import POINTER, byref, c_char_p, c_int, c_size_t, c_uint, c_void_p
from typing import Any

from mori.core.errors import MoriBackendError

__all__ = ["HipDriver", "HipError", "IpcMemHandle", "load_driver"]

DEFAULT_LIBRARY = "libamdhip64.so"
_SEARCH = ("libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6", "/opt/rocm/lib/libamdhip64.so")

HIP_SUCCESS = 0
HIP_ERROR_NO_DEVICE = 100
HIP_ERROR_NOT_READY = 600

#: bytes of a hipIpcMemHandle_t
IPC_HANDLE_SIZE = 64
HIP_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1
HIP_STREAM_NON_BLOCKING = 0x1
HIP_EVENT_DISABLE_TIMING = 0x2
HIP_HOST_MALLOC_PORTABLE = 0x1
HIP_HOST_MALLOC_MAPPED = 0x2
HIP_MEMCPY_DEFAULT = 4  # direction from the unified addresses
HIP_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
#: hipExtMallocWithFlags: fine-grained, uncached device memory (coherent across GPUs and the host)
HIP_DEVICE_MALLOC_UNCACHED = 0x3

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


class IpcMemHandle(ctypes.Structure):
    """``hipIpcMemHandle_t``: 64 opaque bytes, passed by value to ``hipIpcOpenMemHandle``."""

    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_SIZE)]


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
    "hipGetErrorName": [c_int],
    "hipGetErrorString": [c_int],
}
#: functions that return a C string instead of an error code
_STRING_RESULT = {"hipGetErrorName", "hipGetErrorString"}
#: other names to try when a runtime lacks the usual one
_FALLBACKS = {"hipHostMalloc": ("hipExtHostAlloc", "hipHostAlloc")}


class HipError(MoriBackendError):
    """A HIP call failed. ``call``: the function, ``code``: the hipError_t, ``result``: its name."""

    def __init__(self, call: str, code: int, result: str, description: str, detail: str = "") -> None:
        message = f"{call} failed: {result} ({code}): {description}"
        super().__init__(f"{message} ({detail})" if detail else message)
        self.call = call
        self.code = code
        self.result = result
        self.description = description


class HipDriver:
    """The HIP runtime API as Python methods. ``lib``: ``ctypes.CDLL`` of libamdhip64, or a fake
    with the same function names (tests); ``path``: where it came from, for messages."""

    def __init__(self, lib: Any, path: str = DEFAULT_LIBRARY) -> None:
        self.lib = lib
        self.path = path
        self._fns: dict[str, Callable[..., Any]] = {}
        self._bind_lock = threading.Lock()
        self._initialised = False

    # -- plumbing ---------------------------------------------------------------------------------

    def _fn(self, name: str) -> Callable[..., Any]:
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
                    found.restype = c_char_p if name in _STRING_RESULT else c_int
                self._fns[name] = found
                return found  # type: ignore[no-any-return]
        raise MoriBackendError(
            f"{self.path} has no function {name}: the HIP runtime is too old for mori-backend-xgmi "
            f"(needs ROCm 6 or newer)"
        )

    def call(self, name: str, *args: Any, detail: str = "") -> None:
        """Call ``name(*args)``; raise :class:`HipError` unless it returns hipSuccess."""
        code = int(self._fn(name)(*args))
        if code != HIP_SUCCESS:
            raise self.error(name, code, detail)

    def result_name(self, code: int) -> str:
        return self._error_text("hipGetErrorName", code) or _RESULT_NAMES.get(code, f"hipError_t {code}")

    def error(self, call: str, code: int, detail: str = "") -> HipError:
        description = self._error_text("hipGetErrorString", code) or "no description from HIP"
        return HipError(call, code, self.result_name(code), description, detail)

    def _error_text(self, fn: str, code: int) -> str:
        try:
            text = self._fn(fn)(code)
        except MoriBackendError:
            return ""
        if not text:
            return ""
        return text.decode(errors="replace") if isinstance(text, bytes) else str(text)

    # -- runtime and devices --------------------------------------------------------------------

    def init(self) -> None:
        """``hipInit(0)``, once per driver object."""
        if not self._initialised:
            self.call("hipInit", 0)
            self._initialised = True

    def version(self) -> int:
        """Driver version as HIP numbers it (e.g. 60443483 for 6.4)."""
        out = c_int()
        self.call("hipDriverGetVersion", byref(out))
        return out.value

    def device_count(self) -> int:
        out = c_int()
        self.call("hipGetDeviceCount", byref(out))
        return out.value

    def current_device(self) -> int:
        out = c_int()
        self.call("hipGetDevice", byref(out))
        return out.value

    def set_device(self, device: int) -> None:
        self.call("hipSetDevice", device, detail=f"device {device}")

    def pci_bus_id(self, device: int) -> str:
        buf = ctypes.create_string_buffer(64)
        self.call("hipDeviceGetPCIBusId", buf, len(buf), device, detail=f"device {device}")
        return buf.value.decode()

    def can_access_peer(self, device: int, peer: int) -> bool:
        out = c_int()
        self.call("hipDeviceCanAccessPeer", byref(out), device, peer)
        return bool(out.value)

    def pointer_device(self, ptr: int) -> int:
        """Ordinal of the device that ``ptr`` was allocated on."""
        out = c_int()
        self.call("hipPointerGetAttribute", byref(out), HIP_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
        return out.value

    def synchronize(self) -> None:
        """Wait for all work on the current device."""
        self.call("hipDeviceSynchronize")

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

    def mem_free(self, ptr: int) -> None:
        self.call("hipFree", ptr)

    def memset_async(self, ptr: int, value: int, nbytes: int, stream: int) -> None:
        self.call("hipMemsetAsync", ptr, value, nbytes, stream or None)

    def address_range(self, ptr: int) -> tuple[int, int]:
        """(base, size) of the allocation that contains ``ptr``."""
        base, size = c_void_p(), c_size_t()
        self.call("hipMemGetAddressRange", byref(base), byref(size), ptr, detail=f"address {ptr:#x}")
        return base.value or 0, size.value

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Copy between any two addresses of the unified address space, in stream order."""
        self.call("hipMemcpyAsync", dst, src, nbytes, HIP_MEMCPY_DEFAULT, stream or None)

    def host_alloc(self, nbytes: int) -> int:
        """Pinned host memory, mapped into every device's address space."""
        out = c_void_p()
        self.call("hipHostMalloc", byref(out), nbytes, HIP_HOST_MALLOC_PORTABLE | HIP_HOST_MALLOC_MAPPED)
        return out.value or 0

    def host_device_pointer(self, ptr: int) -> int:
        out = c_void_p()
        self.call("hipHostGetDevicePointer", byref(out), ptr, 0)
        return out.value or 0

    def host_free(self, ptr: int) -> None:
        self.call("hipHostFree", ptr)

    # -- IPC --------------------------------------------------------------------------------------

    def ipc_get_handle(self, ptr: int) -> bytes:
        """The 64-byte IPC handle of the allocation whose base is ``ptr``."""
        handle = IpcMemHandle()
        self.call("hipIpcGetMemHandle", byref(handle), ptr, detail=f"address {ptr:#x}")
        return ctypes.string_at(ctypes.addressof(handle), IPC_HANDLE_SIZE)

    def ipc_open_handle(self, handle: bytes, *, detail: str = "") -> int:
        """Map another process's allocation on the current device; peer access enabled lazily."""
        h = IpcMemHandle()
        ctypes.memmove(ctypes.addressof(h), handle, IPC_HANDLE_SIZE)
        out = c_void_p()
        self.call("hipIpcOpenMemHandle", byref(out), h, HIP_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, detail=detail)
        return out.value or 0

    def ipc_close_handle(self, ptr: int) -> None:
        self.call("hipIpcCloseMemHandle", ptr)

    # -- streams and events -------------------------------------------------------------------------

    def stream_create(self) -> int:
        """A stream that does not synchronise with the null stream."""
        out = c_void_p()
        self.call("hipStreamCreateWithFlags", byref(out), HIP_STREAM_NON_BLOCKING)
        return out.value or 0

    def stream_destroy(self, stream: int) -> None:
        self.call("hipStreamDestroy", stream or None)

    def stream_synchronize(self, stream: int) -> None:
        self.call("hipStreamSynchronize", stream or None)

    def stream_wait_event(self, stream: int, event: int) -> None:
        self.call("hipStreamWaitEvent", stream or None, event, 0)

    def event_create(self) -> int:
        out = c_void_p()
        self.call("hipEventCreateWithFlags", byref(out), HIP_EVENT_DISABLE_TIMING)
        return out.value or 0

    def event_record(self, event: int, stream: int) -> None:
        self.call("hipEventRecord", event, stream or None)

    def event_query(self, event: int) -> bool:
        """True if the work before the event has completed, False if it is still running."""
        code = int(self._fn("hipEventQuery")(event))
        if code == HIP_ERROR_NOT_READY:
            return False
        if code != HIP_SUCCESS:
            raise self.error("hipEventQuery", code)
        return True

    def event_synchronize(self, event: int) -> None:
        self.call("hipEventSynchronize", event)

    def event_destroy(self, event: int) -> None:
        self.call("hipEventDestroy", event)


def _loaded_hip() -> str | None:
    """Path of a libamdhip64 already mapped into this process (torch's own copy, usually)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and "/libamdhip64.so" in parts[5]:
                    return parts[5].strip()
    except OSError:
        pass
    return None


_driver: HipDriver | None = None
_driver_lock = threading.Lock()


def load_driver(path: str | None = None) -> HipDriver:
    """The process's HIP binding, loading the library on first use (see the module docstring).

    Raises :class:`~mori.core.errors.MoriBackendError` saying why it cannot be loaded.
    """
    global _driver
    from mori_backend_xgmi.env import MORI_HIP_LIBRARY

    explicit = path or MORI_HIP_LIBRARY.get()
    with _driver_lock:
        if _driver is not None and (explicit is None or _driver.path == explicit):
            return _driver
        if explicit is None:
            with contextlib.suppress(ImportError):  # a ROCm torch loads its own libamdhip64: use that one
                import torch  # noqa: F401
        candidates = [explicit] if explicit else [p for p in (_loaded_hip(), *_SEARCH) if p]
        errors: list[str] = []
        for candidate in candidates:
            try:
                lib = ctypes.CDLL(candidate)
            except OSError as e:
                errors.append(str(e))
                continue
            _driver = HipDriver(lib, candidate)
            return _driver
        if all("cannot open shared object file" in e or "No such file" in e for e in errors):
            name = explicit or DEFAULT_LIBRARY
            raise MoriBackendError(f"{name} not found: no ROCm on this machine (or set MORI_HIP_LIBRARY)")
        raise MoriBackendError(f"{explicit or DEFAULT_LIBRARY} cannot be loaded: {'; '.join(errors)}")

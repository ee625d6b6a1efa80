"""What a GPU runtime needs of its driver: :class:`GpuDriver`, and :class:`CtypesDriver`, the
plumbing shared by the ctypes bindings of the device plugins (CUDA driver API, HIP runtime API).

A binding subclass names its C functions in ``NAMES`` (operation -> function), gives their
prototypes in ``PROTOTYPES`` and its flag values as class attributes, and writes the methods whose
calls differ between vendors (allocation, copies, contexts or current devices, error texts).
Nothing here loads a library: a binding wraps any object that has the functions as attributes
(``ctypes.CDLL`` of the real library, or a fake in tests). Every call is checked; a result other
than success raises the binding's :class:`GpuError` subclass naming the call, the result's name
and the driver's description of it.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from ctypes import byref, c_char_p, c_int, c_size_t, c_void_p
from typing import Any, ClassVar, Protocol

from mori.core.errors import MoriBackendError

__all__ = ["CtypesDriver", "GpuDriver", "GpuError", "IpcMemHandle"]

#: bytes of an IPC memory handle (CUipcMemHandle, hipIpcMemHandle_t)
IPC_HANDLE_SIZE = 64


#: the base class of every C function object of ctypes (a library's functions, callbacks)
_C_FUNCTION: Any = ctypes.CFUNCTYPE(None).__base__


class _ByRef:
    """What ``ctypes.byref(obj)`` gives a fake library function: the object as ``._obj``."""

    __slots__ = ("_obj",)

    def __init__(self, obj: Any) -> None:
        self._obj = obj


class IpcMemHandle(ctypes.Structure):
    """An IPC memory handle: 64 opaque bytes, passed by value to the open call."""

    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_SIZE)]


class GpuError(MoriBackendError):
    """A driver call failed. ``call``: the function, ``code``: the result code, ``result``: its name."""

    def __init__(self, call: str, code: int, result: str, description: str, detail: str = "") -> None:
        message = f"{call} failed: {result} ({code}): {description}"
        super().__init__(f"{message} ({detail})" if detail else message)
        self.call = call
        self.code = code
        self.result = result
        self.description = description


class GpuDriver(Protocol):
    """The operations :class:`~mori.core.gpu.runtime.GpuRuntime` and
    :class:`~mori.core.gpu.copy_engine.CopyEngine` use. ``device`` values are what the driver
    names a GPU by (CUDA: a CUdevice; HIP: the ordinal); a "context" is what :meth:`set_current_context`
    makes current (CUDA: a primary context; HIP: a device ordinal)."""

    path: str

    def init(self) -> None: ...
    def version(self) -> int: ...
    def device_count(self) -> int: ...
    def device(self, ordinal: int) -> int: ...
    def pci_bus_id(self, device: int) -> str: ...
    def can_access_peer(self, device: int, peer: int) -> bool: ...
    def pointer_device(self, ptr: int) -> int: ...
    def primary_context_retain(self, device: int) -> int: ...
    def current_context(self) -> int: ...
    def set_current_context(self, ctx: int) -> None: ...
    def restore_context(self, prev: int) -> None: ...
    def synchronize(self) -> None: ...
    def mem_alloc(self, size: int, **options: Any) -> int: ...
    def mem_free(self, ptr: int) -> None: ...
    def memset_async(self, ptr: int, value: int, nbytes: int, stream: int) -> None: ...
    def address_range(self, ptr: int) -> tuple[int, int]: ...
    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None: ...
    def host_alloc(self, nbytes: int) -> int: ...
    def host_device_pointer(self, ptr: int) -> int: ...
    def host_free(self, ptr: int) -> None: ...
    def ipc_get_handle(self, ptr: int) -> bytes: ...
    def ipc_open_handle(self, handle: bytes, *, detail: str = "") -> int: ...
    def ipc_close_handle(self, ptr: int) -> None: ...
    def stream_create(self) -> int: ...
    def stream_destroy(self, stream: int) -> None: ...
    def stream_synchronize(self, stream: int) -> None: ...
    def stream_wait_event(self, stream: int, event: int) -> None: ...
    def event_create(self) -> int: ...
    def event_record(self, event: int, stream: int) -> None: ...
    def event_query(self, event: int) -> bool: ...
    def event_synchronize(self, event: int) -> None: ...
    def event_destroy(self, event: int) -> None: ...


#: what a device's active() returns
ActiveFactory = Callable[[], AbstractContextManager[None]]


class CtypesDriver:
    """Checked calls into a driver library and the operations whose calls are alike for every
    vendor. ``lib``: ``ctypes.CDLL`` of the library, or a fake with the same function names;
    ``path``: where it came from, for messages. Subclasses set the class attributes below."""

    #: operation -> C function name (init, version, device_count, can_access_peer, pointer_attribute,
    #: synchronize, free, memset, address_range, host_device_pointer, host_free, ipc_get, ipc_open,
    #: ipc_close, stream_create, stream_destroy, stream_synchronize, stream_wait_event, event_create,
    #: event_record, event_query, event_synchronize, event_destroy, error_name, error_string)
    NAMES: ClassVar[dict[str, str]] = {}
    #: C prototypes (argument types) by function name
    PROTOTYPES: ClassVar[dict[str, Sequence[Any]]] = {}
    #: other names to try when a library lacks the usual one
    FALLBACKS: ClassVar[Mapping[str, Sequence[str]]] = {}
    #: functions that return a C string instead of a result code
    STRING_RESULT: ClassVar[Collection[str]] = frozenset()
    #: result names for libraries whose own naming call fails (or fakes)
    RESULT_NAMES: ClassVar[dict[int, str]] = {}
    #: how messages name a result code that has no name ("CUresult", "hipError_t")
    RESULT_TYPE: ClassVar[str] = "result"
    #: description when the library gives none
    NO_DESCRIPTION: ClassVar[str] = "no description from the driver"
    #: message end when a function is missing (which versions are needed)
    TOO_OLD: ClassVar[str] = "the driver is too old"
    ERROR: ClassVar[type[GpuError]] = GpuError
    SUCCESS: ClassVar[int] = 0
    NOT_READY: ClassVar[int] = 600
    #: ctypes type of a device pointer written by the driver
    PTR: ClassVar[Any] = c_void_p
    POINTER_ATTRIBUTE_DEVICE_ORDINAL: ClassVar[int] = 9
    HOST_ALLOC_FLAGS: ClassVar[int] = 0x1 | 0x2  # portable | device-mapped
    IPC_LAZY_ENABLE_PEER_ACCESS: ClassVar[int] = 0x1
    STREAM_NON_BLOCKING: ClassVar[int] = 0x1
    EVENT_DISABLE_TIMING: ClassVar[int] = 0x2
    #: HIP's ``kind`` argument of the async copy (hipMemcpyDefault); None: CUDA's form, without one
    MEMCPY_KIND: ClassVar[int | None] = None
    #: whether the ``get_context``/``set_context`` functions take a device ordinal (HIP) rather
    #: than a context handle (CUDA)
    CONTEXT_IS_DEVICE: ClassVar[bool] = False
    #: operations native code may call through :meth:`native_calls` (optional ones may be missing)
    NATIVE_OPS: ClassVar[tuple[str, ...]] = (
        "memcpy",
        "event_record",
        "stream_wait_event",
        "event_query",
        "event_synchronize",
        "event_create",
        "event_destroy",
        "get_context",
        "set_context",
        "stream_create",
        "stream_synchronize",
        "stream_destroy",
        "host_alloc",
        "host_free",
    )
    NATIVE_OPTIONAL: ClassVar[tuple[str, ...]] = ("launch_kernel", "error_name")

    def __init__(self, lib: Any, path: str) -> None:
        self.lib = lib
        self.path = path
        self._fns: dict[str, Callable[..., Any]] = {}
        self._bind_lock = threading.Lock()
        self._initialised = False
        self._callbacks: list[Any] = []  # C callbacks over a fake library's functions (native_calls)
        self._error_names: dict[int, Any] = {}

    # -- plumbing ---------------------------------------------------------------------------------

    def _fn(self, name: str) -> Callable[..., Any]:
        fn = self._fns.get(name)
        if fn is not None:
            return fn
        with self._bind_lock:
            for candidate in (name, *self.FALLBACKS.get(name, ())):
                try:
                    found = getattr(self.lib, candidate)
                except AttributeError:
                    continue
                if hasattr(found, "argtypes"):  # a function of a real library: give it its prototype
                    found.argtypes = list(self.PROTOTYPES[name])
                    found.restype = c_char_p if name in self.STRING_RESULT else c_int
                self._fns[name] = found
                return found  # type: ignore[no-any-return]
        raise MoriBackendError(f"{self.path} has no function {name}: {self.TOO_OLD}")

    def native_calls(self) -> dict[str, Any]:
        """The driver functions of :data:`NATIVE_OPS` for native code that calls the driver without
        Python (mori.io's XGMI queue): operation -> address of the C function, plus this vendor's
        conventions (``memcpy_kind``, ``context_is_device``, ``error_name_returns_string``,
        ``not_ready``, ``event_flags``, ``stream_flags``, ``host_alloc_flags``) and ``names`` (operation -> C name, for messages). A real
        library's functions are passed as they are; a fake library's (tests) through ctypes
        callbacks this driver keeps alive. Optional operations (:data:`NATIVE_OPTIONAL`) are left
        out when the library lacks them; a missing required one raises :class:`MoriBackendError`."""
        out: dict[str, Any] = {
            "memcpy_kind": -1 if self.MEMCPY_KIND is None else self.MEMCPY_KIND,
            "context_is_device": self.CONTEXT_IS_DEVICE,
            "error_name_returns_string": self.NAMES["error_name"] in self.STRING_RESULT,
            "not_ready": self.NOT_READY,
            "event_flags": self.EVENT_DISABLE_TIMING,
            "stream_flags": self.STREAM_NON_BLOCKING,
            "host_alloc_flags": self.HOST_ALLOC_FLAGS,
            "names": {},
        }
        for op in self.NATIVE_OPS + self.NATIVE_OPTIONAL:
            name = self.NAMES[op]
            try:
                fn = self._fn(name)
            except MoriBackendError:
                if op in self.NATIVE_OPTIONAL:
                    continue
                raise
            key = "memcpy_async" if op == "memcpy" else op
            out[key] = self._address(name, fn)
            out["names"][key] = name
        return out

    def _address(self, name: str, fn: Any) -> int:
        if isinstance(fn, _C_FUNCTION):  # a function of a real library
            return int(ctypes.cast(fn, c_void_p).value or 0)
        if name == self.NAMES["error_name"]:
            return self._error_name_callback()
        string = name in self.STRING_RESULT
        proto = ctypes.CFUNCTYPE(c_void_p if string else c_int, *self.PROTOTYPES[name])

        def call(*args: Any) -> Any:  # a fake: out-arguments as byref() gives them (``._obj``)
            return fn(*(_ByRef(a.contents) if isinstance(a, ctypes._Pointer) else a for a in args))

        cb = proto(call)
        self._callbacks.append(cb)
        return int(ctypes.cast(cb, c_void_p).value or 0)

    def _error_name_callback(self) -> int:
        # a fake's names, from result_name(), in buffers that live as long as this driver
        def text(code: int) -> int:
            buf = self._error_names.get(code)
            if buf is None:
                buf = self._error_names[code] = ctypes.create_string_buffer(self.result_name(code).encode())
            return ctypes.addressof(buf)

        if self.NAMES["error_name"] in self.STRING_RESULT:
            cb: Any = ctypes.CFUNCTYPE(c_void_p, c_int)(text)
        else:

            def name_out(code: int, out: Any) -> int:
                out[0] = text(code)
                return self.SUCCESS

            cb = ctypes.CFUNCTYPE(c_int, c_int, ctypes.POINTER(c_void_p))(name_out)
        self._callbacks.append(cb)
        return int(ctypes.cast(cb, c_void_p).value or 0)

    def call(self, name: str, *args: Any, detail: str = "") -> None:
        """Call ``name(*args)``; raise the binding's :class:`GpuError` unless it returns success."""
        code = int(self._fn(name)(*args))
        if code != self.SUCCESS:
            raise self.error(name, code, detail)

    def _op(self, op: str, *args: Any, detail: str = "") -> None:
        self.call(self.NAMES[op], *args, detail=detail)

    def result_name(self, code: int) -> str:
        return self._error_text(self.NAMES["error_name"], code) or self.RESULT_NAMES.get(
            code, f"{self.RESULT_TYPE} {code}"
        )

    def error(self, call: str, code: int, detail: str = "") -> GpuError:
        description = self._error_text(self.NAMES["error_string"], code) or self.NO_DESCRIPTION
        return self.ERROR(call, code, self.result_name(code), description, detail)

    def _error_text(self, fn: str, code: int) -> str:
        """The text the library's naming call ``fn`` gives ``code`` ("" if it fails): returned as
        the result (``fn`` in ``STRING_RESULT``, HIP's form) or through an out-pointer (CUDA's)."""
        try:
            if fn in self.STRING_RESULT:
                text = self._fn(fn)(code)
            else:
                out = c_char_p()
                text = out.value if int(self._fn(fn)(code, byref(out))) == self.SUCCESS else None
        except MoriBackendError:
            return ""
        if not text:
            return ""
        return text.decode(errors="replace") if isinstance(text, bytes) else str(text)

    def _out_int(self, op: str, *args: Any, detail: str = "") -> int:
        out = c_int()
        self._op(op, byref(out), *args, detail=detail)
        return out.value

    def _out_handle(self, op: str, *args: Any) -> int:
        out = c_void_p()
        self._op(op, byref(out), *args)
        return out.value or 0

    def _out_ptr(self, op: str, *args: Any, detail: str = "") -> int:
        out = self.PTR()
        self._op(op, byref(out), *args, detail=detail)
        return int(out.value or 0)

    # -- driver and devices -----------------------------------------------------------------------

    def init(self) -> None:
        """Initialise the library (``cuInit(0)`` / ``hipInit(0)``), once per driver object."""
        if not self._initialised:
            self._op("init", 0)
            self._initialised = True

    def version(self) -> int:
        """Driver version as the vendor numbers it."""
        return self._out_int("version")

    def device_count(self) -> int:
        return self._out_int("device_count")

    def can_access_peer(self, device: int, peer: int) -> bool:
        return bool(self._out_int("can_access_peer", device, peer))

    def pointer_device(self, ptr: int) -> int:
        """Ordinal of the device that ``ptr`` was allocated on."""
        return self._out_int("pointer_attribute", self.POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)

    def synchronize(self) -> None:
        """Wait for all work of the current context (CUDA) or device (HIP)."""
        self._op("synchronize")

    # -- memory -----------------------------------------------------------------------------------

    def mem_free(self, ptr: int) -> None:
        self._op("free", ptr)

    def memset_async(self, ptr: int, value: int, nbytes: int, stream: int) -> None:
        self._op("memset", ptr, value, nbytes, stream or None)

    def address_range(self, ptr: int) -> tuple[int, int]:
        """(base, size) of the allocation that contains ``ptr``."""
        base, size = self.PTR(), c_size_t()
        self._op("address_range", byref(base), byref(size), ptr, detail=f"address {ptr:#x}")
        return int(base.value or 0), size.value

    def host_alloc(self, nbytes: int) -> int:
        """Pinned host memory, mapped into every device's address space (portable, device-mapped)."""
        return self._out_handle("host_alloc", nbytes, self.HOST_ALLOC_FLAGS)

    def host_device_pointer(self, ptr: int) -> int:
        return self._out_ptr("host_device_pointer", ptr, 0)

    def host_free(self, ptr: int) -> None:
        self._op("host_free", ptr)

    # -- IPC --------------------------------------------------------------------------------------

    def ipc_get_handle(self, ptr: int) -> bytes:
        """The 64-byte IPC handle of the allocation whose base is ``ptr``."""
        handle = IpcMemHandle()
        self._op("ipc_get", byref(handle), ptr, detail=f"address {ptr:#x}")
        return ctypes.string_at(ctypes.addressof(handle), IPC_HANDLE_SIZE)

    def ipc_open_handle(self, handle: bytes, *, detail: str = "") -> int:
        """Map another process's allocation here (current context or device); peer access enabled
        lazily."""
        h = IpcMemHandle()
        ctypes.memmove(ctypes.addressof(h), handle, IPC_HANDLE_SIZE)
        return self._out_ptr("ipc_open", h, self.IPC_LAZY_ENABLE_PEER_ACCESS, detail=detail)

    def ipc_close_handle(self, ptr: int) -> None:
        self._op("ipc_close", ptr)

    # -- streams and events -------------------------------------------------------------------------

    def stream_create(self) -> int:
        """A stream that does not synchronise with the legacy default (null) stream."""
        return self._out_handle("stream_create", self.STREAM_NON_BLOCKING)

    def stream_destroy(self, stream: int) -> None:
        self._op("stream_destroy", stream or None)

    def stream_synchronize(self, stream: int) -> None:
        self._op("stream_synchronize", stream or None)

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._op("stream_wait_event", stream or None, event, 0)

    def event_create(self) -> int:
        return self._out_handle("event_create", self.EVENT_DISABLE_TIMING)

    def event_record(self, event: int, stream: int) -> None:
        self._op("event_record", event, stream or None)

    def event_query(self, event: int) -> bool:
        """True if the work before the event has completed, False if it is still running."""
        name = self.NAMES["event_query"]
        code = int(self._fn(name)(event))
        if code == self.NOT_READY:
            return False
        if code != self.SUCCESS:
            raise self.error(name, code)
        return True

    def event_synchronize(self, event: int) -> None:
        self._op("event_synchronize", event)

    def event_destroy(self, event: int) -> None:
        self._op("event_destroy", event)

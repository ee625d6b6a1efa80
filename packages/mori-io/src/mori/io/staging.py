"""GPU memory over the TCP backend: the engine's ``DeviceCopier`` built on the GPU runtime.

The native TCP backend moves GPU memory through host staging buffers once something installs a
``DeviceCopier`` (``csrc/engine.hpp``: two C functions, device -> host and host -> device, called
from the engine's threads without the GIL). :func:`install` builds one on the usable GPU runtime
of the installed device plugins (CUDA from mori-backend-nvlink, HIP from mori-backend-xgmi), so
a plain ``IOEngine`` with only the TCP backend can serve and move GPU regions between hosts. The
engine installs it on its first GPU registration.

Each copy makes the region's GPU current on the calling thread (CUDA: its primary context), queues
one copy on a stream of that thread and GPU, and waits for it: the engine pipelines by running
pieces on several connections at once, not by overlapping within one piece. The C entry points
are ctypes callbacks: each takes the GIL for the few driver calls of a piece (1 MiB by default).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any

__all__ = ["install"]

_log = logging.getLogger("mori.io")

_CAPSULE_NAME = b"mori.io.DeviceCopier"
# int to_host(void* ctx, void* host_dst, uintptr_t device_src, uint64_t nbytes, int device)
_TO_HOST = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int
)
# int from_host(void* ctx, uintptr_t device_dst, const void* host_src, uint64_t nbytes, int device)
_FROM_HOST = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int
)


class _DeviceCopierStruct(ctypes.Structure):
    _fields_ = [("to_host", _TO_HOST), ("from_host", _FROM_HOST), ("ctx", ctypes.c_void_p)]


class RuntimeCopier:
    """Synchronous device <-> host copies through one GPU runtime's driver (any thread)."""

    def __init__(self, runtime: Any) -> None:
        st = runtime._state if runtime._state is not None else runtime._bind()
        self.drv = st.drv
        self._contexts: dict[int, int] = {st.index: st.ctx}
        self._lock = threading.Lock()
        self._local = threading.local()  # per thread: {device: stream}
        self.copies = 0  # pieces copied (tests, diagnostics)
        # the C entry points: kept here, alive as long as the engine that holds this copier
        self._to_host = _TO_HOST(lambda _ctx, dst, src, n, dev: self._copy(dst or 0, src, n, dev))
        self._from_host = _FROM_HOST(lambda _ctx, dst, src, n, dev: self._copy(dst, src or 0, n, dev))

    def _context(self, device: int) -> int:
        with self._lock:
            ctx = self._contexts.get(device)
            if ctx is None:
                ctx = self._contexts[device] = self.drv.primary_context_retain(self.drv.device(device))
            return ctx

    def _copy(self, dst: int, src: int, nbytes: int, device: int) -> int:
        drv = self.drv
        try:
            ctx = self._context(device)
            prev = drv.current_context()
            if prev != ctx:
                drv.set_current_context(ctx)
            try:
                streams = getattr(self._local, "streams", None)
                if streams is None:
                    streams = self._local.streams = {}
                stream = streams.get(device)
                if stream is None:
                    stream = streams[device] = drv.stream_create()
                drv.memcpy_async(dst, src, nbytes, stream)
                drv.stream_synchronize(stream)
            finally:
                if prev != ctx:
                    drv.restore_context(prev)
        except Exception as e:  # the engine fails the transfer with ERR_GPU_OP
            _log.warning("mori.io: staging copy of %d bytes on GPU %d failed: %s", nbytes, device, e)
            return 1
        self.copies += 1
        return 0

    def capsule(self) -> Any:
        """A ``"mori.io.DeviceCopier"`` capsule over a copy of the C struct (the engine copies it)."""
        self._struct = _DeviceCopierStruct(self._to_host, self._from_host, None)
        new = ctypes.pythonapi.PyCapsule_New
        new.restype = ctypes.py_object
        new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(self._struct), _CAPSULE_NAME, None)


def install(native: Any, runtime: Any) -> RuntimeCopier:
    """Install a :class:`RuntimeCopier` on ``runtime`` into the native engine ``native``; the caller
    keeps the returned copier alive as long as the engine."""
    copier = RuntimeCopier(runtime)
    native.set_device_copier(copier.capsule())
    return copier

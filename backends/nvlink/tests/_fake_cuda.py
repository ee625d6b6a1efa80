"""A fake ``libcuda.so.1`` for tests without a GPU: the driver functions the backend calls, in Python.

"Device memory" is host memory: each allocation is a memfd, mapped with mmap; an IPC open maps the
same memfd again, at another address, exactly as CUDA IPC maps the same physical memory at a new
virtual address. Several :class:`FakeCudaLib` objects sharing one :class:`FakeWorld` play several
processes on one node. Functions take the ctypes arguments the real ones get (``byref`` pointers,
structures by value) and return CUresult codes; ``fail[name] = code`` makes a function fail.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
from typing import Any

SUCCESS, INVALID_VALUE, OUT_OF_MEMORY, NO_DEVICE, INVALID_DEVICE = 0, 1, 2, 100, 101
INVALID_CONTEXT, NOT_FOUND, NOT_READY = 201, 500, 600
NAMES = {
    0: "CUDA_SUCCESS",
    1: "CUDA_ERROR_INVALID_VALUE",
    2: "CUDA_ERROR_OUT_OF_MEMORY",
    100: "CUDA_ERROR_NO_DEVICE",
    101: "CUDA_ERROR_INVALID_DEVICE",
    201: "CUDA_ERROR_INVALID_CONTEXT",
    500: "CUDA_ERROR_NOT_FOUND",
    600: "CUDA_ERROR_NOT_READY",
}
TEXTS = {
    1: "invalid argument",
    2: "out of memory",
    100: "no CUDA-capable device is detected",
    101: "invalid device ordinal",
    201: "invalid device context",
    500: "named symbol not found",
    600: "device not ready",
}
_IPC = struct.Struct("<8sQQ40x")  # b"fakeipc\0", world allocation id, exporter id


class Memory:
    """One allocation: a memfd that any number of mappings alias."""

    def __init__(self, size: int, device: int, owner: int) -> None:
        self.fd = os.memfd_create("fake-gpu-memory")
        os.ftruncate(self.fd, size)
        self.size = size
        self.device = device
        self.owner = owner  # id of the FakeCudaLib ("process") that allocated it
        self.freed = False


class Mapping:
    def __init__(self, memory: Memory) -> None:
        self.memory = memory
        self._map = mmap.mmap(memory.fd, memory.size)
        self._anchor = ctypes.c_char.from_buffer(self._map)
        self.addr = ctypes.addressof(self._anchor)

    def close(self) -> None:
        del self._anchor
        self._map.close()


class FakeWorld:
    """What the OS and the kernel driver share between the fake processes of one node."""

    def __init__(self) -> None:
        self.memory: dict[int, Memory] = {}
        self.next_id = 1

    def close(self) -> None:
        for memory in self.memory.values():
            os.close(memory.fd)
        self.memory.clear()

    def add(self, memory: Memory) -> int:
        mid = self.next_id
        self.next_id += 1
        self.memory[mid] = memory
        return mid


class FakeCudaLib:
    """One process's view of the driver. ``devices``: PCI bus ids of the visible GPUs (ordinal =
    index); ``peer_access``: whether cuDeviceCanAccessPeer says yes; ``init_result``: what cuInit
    returns."""

    _ids = 0

    def __init__(
        self,
        world: FakeWorld | None = None,
        devices: tuple[str, ...] = ("0000:1b:00.0", "0000:2c:00.0"),
        *,
        peer_access: bool = True,
        init_result: int = SUCCESS,
    ) -> None:
        FakeCudaLib._ids += 1
        self.id = FakeCudaLib._ids
        self.world = world or FakeWorld()
        self.devices = devices
        self.peer_access = peer_access
        self.init_result = init_result
        self.fail: dict[str, int] = {}
        self.hide: set[str] = set()
        self.calls: list[str] = []
        self.current = 0
        self.allocs: dict[int, tuple[int, Mapping]] = {}  # addr -> (world id, mapping)
        self.opened: dict[int, Mapping] = {}  # IPC mappings by address
        self.host: dict[int, Any] = {}
        self.streams: set[int] = set()
        self.events: set[int] = set()
        self.not_ready: set[int] = set()  # events cuEventQuery reports as not ready
        self._next = 0x1000

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("cu") and name in object.__getattribute__(self, "hide"):
            raise AttributeError(name)  # a function this (older) driver does not have
        return object.__getattribute__(self, name)

    def _handle(self) -> int:
        self._next += 0x10
        return self._next

    def _enter(self, name: str) -> int:
        self.calls.append(name)
        return self.fail.get(name, SUCCESS)

    def _find(self, ptr: int) -> tuple[int, int, Mapping] | None:
        """(world id or 0, base, mapping) of the allocation or IPC mapping containing ptr."""
        for base, (mid, m) in self.allocs.items():
            if base <= ptr < base + m.memory.size:
                return mid, base, m
        for base, m in self.opened.items():
            if base <= ptr < base + m.memory.size:
                return 0, base, m
        return None

    # -- init, devices, contexts ----------------------------------------------------------------

    def cuInit(self, flags: int) -> int:
        return self._enter("cuInit") or self.init_result

    def cuDriverGetVersion(self, out: Any) -> int:
        out._obj.value = 13000
        return self._enter("cuDriverGetVersion")

    def cuDeviceGetCount(self, out: Any) -> int:
        out._obj.value = len(self.devices)
        return self._enter("cuDeviceGetCount")

    def cuDeviceGet(self, out: Any, ordinal: int) -> int:
        if not 0 <= ordinal < len(self.devices):
            return INVALID_DEVICE
        out._obj.value = ordinal
        return self._enter("cuDeviceGet")

    def cuDeviceGetPCIBusId(self, buf: Any, length: int, device: int) -> int:
        buf.value = self.devices[device].upper().encode()
        return self._enter("cuDeviceGetPCIBusId")

    def cuDeviceCanAccessPeer(self, out: Any, device: int, peer: int) -> int:
        out._obj.value = int(self.peer_access)
        return self._enter("cuDeviceCanAccessPeer")

    def cuDevicePrimaryCtxRetain(self, out: Any, device: int) -> int:
        out._obj.value = 0xC000 + device
        return self._enter("cuDevicePrimaryCtxRetain")

    def cuCtxGetCurrent(self, out: Any) -> int:
        out._obj.value = self.current or None
        return self._enter("cuCtxGetCurrent")

    def cuCtxSetCurrent(self, ctx: Any) -> int:
        self.current = ctx or 0
        return self._enter("cuCtxSetCurrent")

    def cuCtxSynchronize(self) -> int:
        return self._enter("cuCtxSynchronize")

    def _device(self) -> int:
        return self.current - 0xC000 if self.current else 0

    # -- memory -------------------------------------------------------------------------------

    def cuMemAlloc_v2(self, out: Any, size: int) -> int:
        rc = self._enter("cuMemAlloc_v2")
        if rc:
            return rc
        if not self.current:
            return INVALID_CONTEXT
        m = Mapping(Memory(size, self._device(), self.id))
        self.allocs[m.addr] = (self.world.add(m.memory), m)
        out._obj.value = m.addr
        return SUCCESS

    def cuMemFree_v2(self, ptr: int) -> int:
        rc = self._enter("cuMemFree_v2")
        if rc:
            return rc
        if ptr not in self.allocs:
            return INVALID_VALUE
        _, m = self.allocs.pop(ptr)
        m.memory.freed = True
        m.close()
        return SUCCESS

    def cuMemsetD8Async(self, ptr: int, value: int, n: int, stream: Any) -> int:
        ctypes.memset(ptr, value, n)
        return self._enter("cuMemsetD8Async")

    def cuMemGetAddressRange_v2(self, base: Any, size: Any, ptr: int) -> int:
        found = self._find(ptr)
        if found is None:
            return NOT_FOUND
        base._obj.value = found[1]
        size._obj.value = found[2].memory.size
        return self._enter("cuMemGetAddressRange_v2")

    def cuPointerGetAttribute(self, out: Any, attribute: int, ptr: int) -> int:
        found = self._find(ptr)
        if found is None or attribute != 9:
            return INVALID_VALUE
        out._obj.value = found[2].memory.device
        return self._enter("cuPointerGetAttribute")

    def cuMemcpyAsync(self, dst: int, src: int, n: int, stream: Any) -> int:
        rc = self._enter("cuMemcpyAsync")
        if rc:
            return rc
        ctypes.memmove(dst, src, n)
        return SUCCESS

    def cuMemHostAlloc(self, out: Any, n: int, flags: int) -> int:
        buf = (ctypes.c_uint8 * n)()
        self.host[ctypes.addressof(buf)] = buf
        out._obj.value = ctypes.addressof(buf)
        return self._enter("cuMemHostAlloc")

    def cuMemHostGetDevicePointer_v2(self, out: Any, ptr: int, flags: int) -> int:
        out._obj.value = ptr
        return self._enter("cuMemHostGetDevicePointer_v2")

    def cuMemFreeHost(self, ptr: int) -> int:
        self.host.pop(ptr, None)
        return self._enter("cuMemFreeHost")

    # -- IPC --------------------------------------------------------------------------------------

    def cuIpcGetMemHandle(self, handle: Any, ptr: int) -> int:
        rc = self._enter("cuIpcGetMemHandle")
        if rc:
            return rc
        if ptr not in self.allocs:  # only the base of an allocation of this process
            return INVALID_VALUE
        data = _IPC.pack(b"fakeipc", self.allocs[ptr][0], self.id)
        ctypes.memmove(ctypes.addressof(handle._obj), data, len(data))
        return SUCCESS

    def cuIpcOpenMemHandle_v2(self, out: Any, handle: Any, flags: int) -> int:
        rc = self._enter("cuIpcOpenMemHandle_v2")
        if rc:
            return rc
        magic, mid, exporter = _IPC.unpack(bytes(handle))
        memory = self.world.memory.get(mid)
        if magic != b"fakeipc\0" or memory is None or memory.freed:
            return INVALID_VALUE
        if exporter == self.id:  # the real driver refuses handles of the calling process
            return INVALID_CONTEXT
        m = Mapping(memory)
        self.opened[m.addr] = m
        out._obj.value = m.addr
        return SUCCESS

    def cuIpcCloseMemHandle(self, ptr: int) -> int:
        rc = self._enter("cuIpcCloseMemHandle")
        if rc:
            return rc
        m = self.opened.pop(ptr, None)
        if m is None:
            return INVALID_VALUE
        m.close()
        return SUCCESS

    # -- streams and events ---------------------------------------------------------------------

    def cuStreamCreate(self, out: Any, flags: int) -> int:
        s = self._handle()
        self.streams.add(s)
        out._obj.value = s
        return self._enter("cuStreamCreate")

    def cuStreamDestroy_v2(self, stream: int) -> int:
        self.streams.discard(stream)
        return self._enter("cuStreamDestroy_v2")

    def cuStreamSynchronize(self, stream: Any) -> int:
        return self._enter("cuStreamSynchronize")

    def cuStreamWaitEvent(self, stream: Any, event: int, flags: int) -> int:
        return self._enter("cuStreamWaitEvent")

    def cuEventCreate(self, out: Any, flags: int) -> int:
        e = self._handle()
        self.events.add(e)
        out._obj.value = e
        return self._enter("cuEventCreate")

    def cuEventRecord(self, event: int, stream: Any) -> int:
        return self._enter("cuEventRecord")

    def cuEventQuery(self, event: int) -> int:
        rc = self._enter("cuEventQuery")
        return rc or (NOT_READY if event in self.not_ready else SUCCESS)

    def cuEventSynchronize(self, event: int) -> int:
        self.not_ready.discard(event)
        return self._enter("cuEventSynchronize")

    def cuEventDestroy_v2(self, event: int) -> int:
        self.events.discard(event)
        return self._enter("cuEventDestroy_v2")

    # -- errors ---------------------------------------------------------------------------------

    def cuGetErrorName(self, code: int, out: Any) -> int:
        if code not in NAMES:
            return INVALID_VALUE
        out._obj.value = NAMES[code].encode()
        return SUCCESS

    def cuGetErrorString(self, code: int, out: Any) -> int:
        if code not in TEXTS:
            return INVALID_VALUE
        out._obj.value = TEXTS[code].encode()
        return SUCCESS

    def close(self) -> None:
        for _, m in list(self.allocs.values()):
            m.close()
        for m in list(self.opened.values()):
            m.close()
        self.allocs.clear()
        self.opened.clear()

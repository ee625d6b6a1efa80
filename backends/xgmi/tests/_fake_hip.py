"""A fake ``libamdhip64.so`` for tests without ROCm: the HIP functions the backend calls, in Python.

"Device memory" is host memory: each allocation is a memfd, mapped with mmap; an IPC open maps the
same memfd again, at another address, exactly as HIP IPC maps the same physical memory at a new
virtual address. Several :class:`FakeHipLib` objects sharing one :class:`FakeWorld` play several
processes on one node. Functions take the ctypes arguments the real ones get (``byref`` pointers,
structures by value) and return hipError_t codes; ``fail[name] = code`` makes a function fail and
``hide`` removes functions (an older ROCm).
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
    0: "hipSuccess",
    1: "hipErrorInvalidValue",
    2: "hipErrorOutOfMemory",
    100: "hipErrorNoDevice",
    101: "hipErrorInvalidDevice",
    201: "hipErrorInvalidContext",
    500: "hipErrorNotFound",
    600: "hipErrorNotReady",
}
TEXTS = {
    1: "invalid argument",
    2: "out of memory",
    100: "no ROCm-capable device is detected",
    101: "invalid device ordinal",
    201: "invalid device context",
    500: "named symbol not found",
    600: "device not ready",
}
_IPC = struct.Struct("<8sQQ40x")  # b"fakeipc\0", world allocation id, exporter id
HIP_MEMCPY_DEFAULT = 4


class Memory:
    """One allocation: a memfd that any number of mappings alias."""

    def __init__(self, size: int, device: int, owner: int, flags: int) -> None:
        self.fd = os.memfd_create("fake-gpu-memory")
        os.ftruncate(self.fd, size)
        self.size = size
        self.device = device
        self.owner = owner  # id of the FakeHipLib ("process") that allocated it
        self.flags = flags  # hipExtMallocWithFlags flags (0 for hipMalloc)
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


class FakeHipLib:
    """One process's view of HIP. ``devices``: PCI bus ids of the visible GPUs (ordinal = index);
    ``peer_access``: whether hipDeviceCanAccessPeer says yes; ``init_result``: what hipInit returns."""

    _ids = 0

    def __init__(
        self,
        world: FakeWorld | None = None,
        devices: tuple[str, ...] = ("0000:0c:00.0", "0000:22:00.0"),
        *,
        peer_access: bool = True,
        init_result: int = SUCCESS,
    ) -> None:
        FakeHipLib._ids += 1
        self.id = FakeHipLib._ids
        self.world = world or FakeWorld()
        self.devices = devices
        self.peer_access = peer_access
        self.init_result = init_result
        self.fail: dict[str, int] = {}
        self.hide: set[str] = set()
        self.calls: list[str] = []
        self.device = 0  # the calling thread's current device
        self.allocs: dict[int, tuple[int, Mapping]] = {}  # addr -> (world id, mapping)
        self.opened: dict[int, Mapping] = {}  # IPC mappings by address
        self.host: dict[int, Any] = {}
        self.streams: set[int] = set()
        self.events: set[int] = set()
        self.not_ready: set[int] = set()  # events hipEventQuery reports as not ready
        self._next = 0x1000

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("hip") and name in object.__getattribute__(self, "hide"):
            raise AttributeError(name)  # a function this (older) HIP does not have
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

    # -- runtime and devices ----------------------------------------------------------------------

    def hipInit(self, flags: int) -> int:
        return self._enter("hipInit") or self.init_result

    def hipDriverGetVersion(self, out: Any) -> int:
        out._obj.value = 60443483
        return self._enter("hipDriverGetVersion")

    def hipGetDeviceCount(self, out: Any) -> int:
        if not self.devices:
            return NO_DEVICE
        out._obj.value = len(self.devices)
        return self._enter("hipGetDeviceCount")

    def hipGetDevice(self, out: Any) -> int:
        out._obj.value = self.device
        return self._enter("hipGetDevice")

    def hipSetDevice(self, device: int) -> int:
        if not 0 <= device < len(self.devices):
            return INVALID_DEVICE
        self.device = device
        return self._enter("hipSetDevice")

    def hipDeviceGetPCIBusId(self, buf: Any, length: int, device: int) -> int:
        if not 0 <= device < len(self.devices):
            return INVALID_DEVICE
        buf.value = self.devices[device].encode()
        return self._enter("hipDeviceGetPCIBusId")

    def hipDeviceCanAccessPeer(self, out: Any, device: int, peer: int) -> int:
        out._obj.value = int(self.peer_access)
        return self._enter("hipDeviceCanAccessPeer")

    def hipPointerGetAttribute(self, out: Any, attribute: int, ptr: int) -> int:
        found = self._find(ptr)
        if found is None or attribute != 9:
            return INVALID_VALUE
        out._obj.value = found[2].memory.device
        return self._enter("hipPointerGetAttribute")

    def hipDeviceSynchronize(self) -> int:
        return self._enter("hipDeviceSynchronize")

    # -- memory -------------------------------------------------------------------------------

    def _alloc(self, name: str, out: Any, size: int, flags: int) -> int:
        rc = self._enter(name)
        if rc:
            return rc
        m = Mapping(Memory(size, self.device, self.id, flags))
        self.allocs[m.addr] = (self.world.add(m.memory), m)
        out._obj.value = m.addr
        return SUCCESS

    def hipMalloc(self, out: Any, size: int) -> int:
        return self._alloc("hipMalloc", out, size, 0)

    def hipExtMallocWithFlags(self, out: Any, size: int, flags: int) -> int:
        return self._alloc("hipExtMallocWithFlags", out, size, flags)

    def hipFree(self, ptr: int) -> int:
        rc = self._enter("hipFree")
        if rc:
            return rc
        if ptr not in self.allocs:
            return INVALID_VALUE
        _, m = self.allocs.pop(ptr)
        m.memory.freed = True
        m.close()
        return SUCCESS

    def hipMemsetAsync(self, ptr: int, value: int, n: int, stream: Any) -> int:
        ctypes.memset(ptr, value, n)
        return self._enter("hipMemsetAsync")

    def hipMemGetAddressRange(self, base: Any, size: Any, ptr: int) -> int:
        found = self._find(ptr)
        if found is None:
            return NOT_FOUND
        base._obj.value = found[1]
        size._obj.value = found[2].memory.size
        return self._enter("hipMemGetAddressRange")

    def hipMemcpyAsync(self, dst: int, src: int, n: int, kind: int, stream: Any) -> int:
        rc = self._enter("hipMemcpyAsync")
        if rc:
            return rc
        if kind != HIP_MEMCPY_DEFAULT:
            return INVALID_VALUE
        ctypes.memmove(dst, src, n)
        return SUCCESS

    def hipHostMalloc(self, out: Any, n: int, flags: int) -> int:
        buf = (ctypes.c_uint8 * n)()
        self.host[ctypes.addressof(buf)] = buf
        out._obj.value = ctypes.addressof(buf)
        return self._enter("hipHostMalloc")

    def hipHostGetDevicePointer(self, out: Any, ptr: int, flags: int) -> int:
        out._obj.value = ptr
        return self._enter("hipHostGetDevicePointer")

    def hipHostFree(self, ptr: int) -> int:
        self.host.pop(ptr, None)
        return self._enter("hipHostFree")

    # -- IPC --------------------------------------------------------------------------------------

    def hipIpcGetMemHandle(self, handle: Any, ptr: int) -> int:
        rc = self._enter("hipIpcGetMemHandle")
        if rc:
            return rc
        if ptr not in self.allocs:  # only the base of an allocation of this process
            return INVALID_VALUE
        data = _IPC.pack(b"fakeipc", self.allocs[ptr][0], self.id)
        ctypes.memmove(ctypes.addressof(handle._obj), data, len(data))
        return SUCCESS

    def hipIpcOpenMemHandle(self, out: Any, handle: Any, flags: int) -> int:
        rc = self._enter("hipIpcOpenMemHandle")
        if rc:
            return rc
        magic, mid, exporter = _IPC.unpack(bytes(handle))
        memory = self.world.memory.get(mid)
        if magic != b"fakeipc\0" or memory is None or memory.freed:
            return INVALID_VALUE
        if exporter == self.id:  # HIP refuses handles of the calling process
            return INVALID_CONTEXT
        m = Mapping(memory)
        self.opened[m.addr] = m
        out._obj.value = m.addr
        return SUCCESS

    def hipIpcCloseMemHandle(self, ptr: int) -> int:
        rc = self._enter("hipIpcCloseMemHandle")
        if rc:
            return rc
        m = self.opened.pop(ptr, None)
        if m is None:
            return INVALID_VALUE
        m.close()
        return SUCCESS

    # -- streams and events ---------------------------------------------------------------------

    def hipStreamCreateWithFlags(self, out: Any, flags: int) -> int:
        s = self._handle()
        self.streams.add(s)
        out._obj.value = s
        return self._enter("hipStreamCreateWithFlags")

    def hipStreamDestroy(self, stream: int) -> int:
        self.streams.discard(stream)
        return self._enter("hipStreamDestroy")

    def hipStreamSynchronize(self, stream: Any) -> int:
        return self._enter("hipStreamSynchronize")

    def hipStreamWaitEvent(self, stream: Any, event: int, flags: int) -> int:
        return self._enter("hipStreamWaitEvent")

    def hipEventCreateWithFlags(self, out: Any, flags: int) -> int:
        e = self._handle()
        self.events.add(e)
        out._obj.value = e
        return self._enter("hipEventCreateWithFlags")

    def hipEventRecord(self, event: int, stream: Any) -> int:
        return self._enter("hipEventRecord")

    def hipEventQuery(self, event: int) -> int:
        rc = self._enter("hipEventQuery")
        return rc or (NOT_READY if event in self.not_ready else SUCCESS)

    def hipEventSynchronize(self, event: int) -> int:
        self.not_ready.discard(event)
        return self._enter("hipEventSynchronize")

    def hipEventDestroy(self, event: int) -> int:
        self.events.discard(event)
        return self._enter("hipEventDestroy")

    # -- errors: HIP returns the strings themselves ------------------------------------------------

    def hipGetErrorName(self, code: int) -> bytes:
        return NAMES.get(code, "hipErrorUnknown").encode()

    def hipGetErrorString(self, code: int) -> bytes:
        return TEXTS.get(code, "unknown error").encode()

    def close(self) -> None:
        for _, m in list(self.allocs.values()):
            m.close()
        for m in list(self.opened.values()):
            m.close()
        self.allocs.clear()
        self.opened.clear()

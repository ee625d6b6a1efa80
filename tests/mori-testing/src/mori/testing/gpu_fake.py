"""A fake GPU driver library for tests without a GPU: what the device plugins' bindings call, in Python.

"Device memory" is host memory: each allocation is a memfd, mapped with mmap; an IPC open maps the
same memfd again, at another address, exactly as CUDA/HIP IPC maps the same physical memory at a
new virtual address. Several fake libraries sharing one :class:`FakeWorld` play several processes on
one node. Functions take the ctypes arguments the real ones get (``byref`` pointers, structures by
value) and return result codes; ``fail[name] = code`` makes a function fail and ``hide`` removes
functions (an older driver).

:class:`FakeGpuLib` holds the behaviour; a backend's fake (``FakeCudaLib``, ``FakeHipLib``) names
its driver binding in ``DRIVER`` (the C names of the operations alike for every vendor come from
its ``NAMES``) and writes the functions whose API differs.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import struct
from typing import Any, ClassVar

from mori.core.gpu.driver import CtypesDriver

__all__ = ["FakeGpuLib", "FakeWorld", "Mapping", "Memory"]

SUCCESS, INVALID_VALUE, OUT_OF_MEMORY, NO_DEVICE, INVALID_DEVICE = 0, 1, 2, 100, 101
INVALID_CONTEXT, NOT_FOUND, NOT_READY = 201, 500, 600
#: the results the fakes describe (and name, with the driver's names; their naming calls fail for
#: any other, as a real driver's may)
TEXTS = {
    INVALID_VALUE: "invalid argument",
    OUT_OF_MEMORY: "out of memory",
    NO_DEVICE: "no GPU is detected",
    INVALID_DEVICE: "invalid device ordinal",
    INVALID_CONTEXT: "invalid device context",
    NOT_FOUND: "named symbol not found",
    NOT_READY: "device not ready",
}
#: driver operation (a key of CtypesDriver.NAMES) -> the fake's operation doing it
OPS = {
    "init": "op_init",
    "version": "op_version",
    "can_access_peer": "op_can_access_peer",
    "pointer_attribute": "op_pointer_attribute",
    "synchronize": "op_plain",
    "free": "op_free",
    "memset": "op_memset",
    "address_range": "op_address_range",
    "memcpy": "op_memcpy",
    "host_alloc": "op_host_alloc",
    "host_device_pointer": "op_host_device_pointer",
    "host_free": "op_host_free",
    "ipc_get": "op_ipc_get",
    "ipc_open": "op_ipc_open",
    "ipc_close": "op_ipc_close",
    "stream_create": "op_stream_create",
    "stream_destroy": "op_stream_destroy",
    "stream_synchronize": "op_plain",
    "stream_wait_event": "op_plain",
    "event_create": "op_event_create",
    "event_record": "op_plain",
    "event_query": "op_event_query",
    "event_synchronize": "op_event_synchronize",
    "event_destroy": "op_event_destroy",
}
_IPC = struct.Struct("<8sQQ40x")  # b"fakeipc\0", world allocation id, exporter id


class Memory:
    """One allocation: a memfd that any number of mappings alias."""

    def __init__(self, size: int, device: int, owner: int, flags: int = 0) -> None:
        self.fd = os.memfd_create("fake-gpu-memory")
        os.ftruncate(self.fd, size)
        self.size = size
        self.device = device
        self.owner = owner  # id of the fake library ("process") that allocated it
        self.flags = flags  # allocation flags (HIP's hipExtMallocWithFlags; 0 otherwise)
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


class FakeGpuLib:
    """One process's view of the driver. ``devices``: PCI bus ids of the visible GPUs (ordinal =
    index); ``peer_access``: whether the peer-access query says yes; ``init_result``: what the init
    call returns. Subclasses set ``DRIVER`` (the binding whose C names they answer to), ``PREFIX``
    (of the function names), ``DEVICES`` (the default ``devices``), ``VERSION`` (what the version
    call reports), and :meth:`_alloc_device`."""

    DRIVER: ClassVar[type[CtypesDriver]] = CtypesDriver
    PREFIX: ClassVar[str] = ""
    #: C name -> the fake's operation (from DRIVER.NAMES and OPS)
    FUNCS: ClassVar[dict[str, str]] = {}
    DEVICES: ClassVar[tuple[str, ...]] = ()
    VERSION: ClassVar[int] = 0
    _ids = 0

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls.FUNCS = {cls.DRIVER.NAMES[op]: fake for op, fake in OPS.items()}

    def result_name(self, code: int) -> str | None:
        """The name the fake's naming call gives ``code``; None: the call fails for it."""
        return self.DRIVER.RESULT_NAMES.get(code) if code == SUCCESS or code in TEXTS else None

    def __init__(
        self,
        world: FakeWorld | None = None,
        devices: tuple[str, ...] | None = None,
        *,
        peer_access: bool = True,
        init_result: int = SUCCESS,
    ) -> None:
        FakeGpuLib._ids += 1
        self.id = FakeGpuLib._ids
        self.world = world or FakeWorld()
        self.devices = self.DEVICES if devices is None else devices
        self.peer_access = peer_access
        self.init_result = init_result
        self.fail: dict[str, int] = {}
        self.hide: set[str] = set()
        self.calls: list[str] = []
        self.allocs: dict[int, tuple[int, Mapping]] = {}  # addr -> (world id, mapping)
        self.opened: dict[int, Mapping] = {}  # IPC mappings by address
        self.host: dict[int, Any] = {}
        self.streams: set[int] = set()
        self.events: set[int] = set()
        self.not_ready: set[int] = set()  # events the event query reports as not ready
        self._next = 0x1000

    def __getattribute__(self, name: str) -> Any:
        prefix = type(self).PREFIX
        if prefix and name.startswith(prefix) and name in object.__getattribute__(self, "hide"):
            raise AttributeError(name)  # a function this (older) driver does not have
        return object.__getattribute__(self, name)

    def __getattr__(self, name: str) -> Any:
        # the functions named in FUNCS: the operation, told the name it was called by
        funcs = type(self).FUNCS
        if name in funcs and name not in self.hide:
            return functools.partial(getattr(self, funcs[name]), name)
        raise AttributeError(name)

    def _handle(self) -> int:
        self._next += 0x10
        return self._next

    def enter(self, name: str) -> int:
        """Record a call of the C function ``name`` and return its result: what ``fail`` says, else
        success (a backend's fake functions start with it)."""
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

    def _alloc_device(self) -> int | None:
        """The device an allocation goes to now; None: the call must fail (no context)."""
        raise NotImplementedError

    # -- operations (the first argument is the C function's name) --------------------------------

    def op_init(self, name: str, flags: int) -> int:
        return self.enter(name) or self.init_result

    def op_version(self, name: str, out: Any) -> int:
        out._obj.value = self.VERSION
        return self.enter(name)

    def op_plain(self, name: str, *args: Any) -> int:
        return self.enter(name)

    def op_can_access_peer(self, name: str, out: Any, device: int, peer: int) -> int:
        out._obj.value = int(self.peer_access)
        return self.enter(name)

    def op_pointer_attribute(self, name: str, out: Any, attribute: int, ptr: int) -> int:
        found = self._find(ptr)
        if found is None or attribute != 9:
            return INVALID_VALUE
        out._obj.value = found[2].memory.device
        return self.enter(name)

    def op_alloc(self, name: str, out: Any, size: int, flags: int = 0) -> int:
        rc = self.enter(name)
        if rc:
            return rc
        device = self._alloc_device()
        if device is None:
            return INVALID_CONTEXT
        m = Mapping(Memory(size, device, self.id, flags))
        self.allocs[m.addr] = (self.world.add(m.memory), m)
        out._obj.value = m.addr
        return SUCCESS

    def op_free(self, name: str, ptr: int) -> int:
        rc = self.enter(name)
        if rc:
            return rc
        if ptr not in self.allocs:
            return INVALID_VALUE
        _, m = self.allocs.pop(ptr)
        m.memory.freed = True
        m.close()
        return SUCCESS

    def op_memset(self, name: str, ptr: int, value: int, n: int, stream: Any) -> int:
        ctypes.memset(ptr, value, n)
        return self.enter(name)

    def op_address_range(self, name: str, base: Any, size: Any, ptr: int) -> int:
        found = self._find(ptr)
        if found is None:
            return NOT_FOUND
        base._obj.value = found[1]
        size._obj.value = found[2].memory.size
        return self.enter(name)

    def op_memcpy(self, name: str, dst: int, src: int, n: int, stream: Any) -> int:
        rc = self.enter(name)
        if rc:
            return rc
        ctypes.memmove(dst, src, n)
        return SUCCESS

    def op_host_alloc(self, name: str, out: Any, n: int, flags: int) -> int:
        buf = (ctypes.c_uint8 * n)()
        self.host[ctypes.addressof(buf)] = buf
        out._obj.value = ctypes.addressof(buf)
        return self.enter(name)

    def op_host_device_pointer(self, name: str, out: Any, ptr: int, flags: int) -> int:
        out._obj.value = ptr
        return self.enter(name)

    def op_host_free(self, name: str, ptr: int) -> int:
        self.host.pop(ptr, None)
        return self.enter(name)

    def op_ipc_get(self, name: str, handle: Any, ptr: int) -> int:
        rc = self.enter(name)
        if rc:
            return rc
        if ptr not in self.allocs:  # only the base of an allocation of this process
            return INVALID_VALUE
        data = _IPC.pack(b"fakeipc", self.allocs[ptr][0], self.id)
        ctypes.memmove(ctypes.addressof(handle._obj), data, len(data))
        return SUCCESS

    def op_ipc_open(self, name: str, out: Any, handle: Any, flags: int) -> int:
        rc = self.enter(name)
        if rc:
            return rc
        magic, mid, exporter = _IPC.unpack(bytes(handle))
        memory = self.world.memory.get(mid)
        if magic != b"fakeipc\0" or memory is None or memory.freed:
            return INVALID_VALUE
        if exporter == self.id:  # the real drivers refuse handles of the calling process
            return INVALID_CONTEXT
        m = Mapping(memory)
        self.opened[m.addr] = m
        out._obj.value = m.addr
        return SUCCESS

    def op_ipc_close(self, name: str, ptr: int) -> int:
        rc = self.enter(name)
        if rc:
            return rc
        m = self.opened.pop(ptr, None)
        if m is None:
            return INVALID_VALUE
        m.close()
        return SUCCESS

    def op_stream_create(self, name: str, out: Any, flags: int) -> int:
        s = self._handle()
        self.streams.add(s)
        out._obj.value = s
        return self.enter(name)

    def op_stream_destroy(self, name: str, stream: int) -> int:
        self.streams.discard(stream)
        return self.enter(name)

    def op_event_create(self, name: str, out: Any, flags: int) -> int:
        e = self._handle()
        self.events.add(e)
        out._obj.value = e
        return self.enter(name)

    def op_event_query(self, name: str, event: int) -> int:
        rc = self.enter(name)
        return rc or (NOT_READY if event in self.not_ready else SUCCESS)

    def op_event_synchronize(self, name: str, event: int) -> int:
        self.not_ready.discard(event)
        return self.enter(name)

    def op_event_destroy(self, name: str, event: int) -> int:
        self.events.discard(event)
        return self.enter(name)

    def close(self) -> None:
        for _, m in list(self.allocs.values()):
            m.close()
        for m in list(self.opened.values()):
            m.close()
        self.allocs.clear()
        self.opened.clear()

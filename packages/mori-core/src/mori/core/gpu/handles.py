"""What one process sends another so that it can map a range of its GPU memory: a segment handle.

A handle is 112 bytes, little-endian::

    magic    4s   the backend's (``SegmentHandle.MAGIC``: b"MNVL" for CUDA, b"MXGM" for HIP)
    version  B    1
    kind     B    KIND_HEAP (a rank's heap segment) or KIND_RANGE (export_range of any allocation)
    flags    H    0 (reserved)
    pid      I    exporting process
    ordinal  i    exporting process's device ordinal (for messages: ordinals differ between
                  processes with different CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES)
    pci      IBBBx  PCI domain, bus, device, function of that GPU: how the importer finds it
    addr     Q    the range's address in the exporting process
    offset   Q    offset of the range from the base of the allocation the IPC handle names
    size     Q    bytes in the range
    ipc      64s  the driver's IPC memory handle of the allocation (CUipcMemHandle, hipIpcMemHandle_t;
                  ``SegmentHandle.IPC_SIZE`` bytes, 64 for both)

The importer opens ``ipc`` (one mapping per allocation per process) and adds ``offset``. Each
vendor's handle class is made from its descriptor (:attr:`mori.core.gpu.vendor.GpuVendor.handle_class`):
its ``MAGIC``, IPC handle size and the names its messages use.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar

from mori.core.errors import MoriValueError

__all__ = ["KIND_HEAP", "KIND_RANGE", "PciAddress", "SegmentHandle"]

VERSION = 1
KIND_HEAP = 0
KIND_RANGE = 1
_KINDS = {KIND_HEAP: "heap segment", KIND_RANGE: "exported range"}
IPC_SIZE = 64


def _layout(ipc_size: int) -> struct.Struct:
    return struct.Struct(f"<4sBBHIiIBBBxQQQ{ipc_size}s")


SIZE = _layout(IPC_SIZE).size


@dataclass(frozen=True, order=True)
class PciAddress:
    """Where a GPU sits on the PCI bus: the same in every process, unlike a device ordinal."""

    domain: int
    bus: int
    device: int
    function: int

    @classmethod
    def parse(cls, text: str) -> PciAddress:
        """``"0000:1b:00.0"`` (any width of hex domain, upper or lower case) -> PciAddress."""
        try:
            domain, bus, rest = text.strip().split(":")
            device, function = rest.split(".")
            return cls(int(domain, 16), int(bus, 16), int(device, 16), int(function, 16))
        except ValueError:
            raise MoriValueError(
                f"not a PCI bus id: {text!r} (expected domain:bus:device.function)"
            ) from None

    def __str__(self) -> str:
        return f"{self.domain:04x}:{self.bus:02x}:{self.device:02x}.{self.function:x}"


@dataclass(frozen=True)
class SegmentHandle:
    """A decoded handle (see the module docstring for the fields). Subclasses set ``MAGIC`` (4
    bytes), ``PACKAGE`` (the distribution, for messages), ``RUNTIME`` (the runtime's name) and
    ``IPC_SIZE`` (bytes of the driver's IPC handle); ``SIZE`` is then the packed handle's size."""

    MAGIC: ClassVar[bytes] = b"MGPU"
    PACKAGE: ClassVar[str] = "mori-core"
    RUNTIME: ClassVar[str] = "gpu"
    IPC_SIZE: ClassVar[int] = IPC_SIZE
    _STRUCT: ClassVar[struct.Struct] = _layout(IPC_SIZE)
    SIZE: ClassVar[int] = SIZE

    def __init_subclass__(cls, **kw: object) -> None:
        super().__init_subclass__(**kw)
        cls._STRUCT = _layout(cls.IPC_SIZE)
        cls.SIZE = cls._STRUCT.size

    kind: int
    pid: int
    ordinal: int
    pci: PciAddress
    addr: int
    offset: int
    size: int
    ipc: bytes

    def pack(self) -> bytes:
        if len(self.ipc) != self.IPC_SIZE:
            raise MoriValueError(f"IPC handle has {len(self.ipc)} bytes, expected {self.IPC_SIZE}")
        return self._STRUCT.pack(
            self.MAGIC,
            VERSION,
            self.kind,
            0,
            self.pid,
            self.ordinal,
            self.pci.domain,
            self.pci.bus,
            self.pci.device,
            self.pci.function,
            self.addr,
            self.offset,
            self.size,
            self.ipc,
        )

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview, *, what: str = "segment handle") -> SegmentHandle:
        """Decode ``data``; raise :class:`~mori.core.errors.MoriValueError` naming ``what`` if it is
        not a handle of this backend and version."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise MoriValueError(f"{what}: expected bytes, got {type(data).__name__}")
        data = bytes(data)
        if len(data) != cls.SIZE or data[:4] != cls.MAGIC:
            raise MoriValueError(
                f"{what} is not a {cls.PACKAGE} handle: expected {cls.SIZE} bytes starting with {cls.MAGIC!r}, "
                f"got {len(data)} bytes starting with {data[:4]!r} (do all ranks use the {cls.RUNTIME} runtime?)"
            )
        _magic, version, kind, _flags, pid, ordinal, dom, bus, dev, fn, addr, offset, size, ipc = (
            cls._STRUCT.unpack(data)
        )
        if version != VERSION:
            raise MoriValueError(
                f"{what} has format version {version}; this {cls.PACKAGE} reads version {VERSION}: "
                f"install the same version on every rank"
            )
        if kind not in _KINDS:
            raise MoriValueError(f"{what} has unknown kind {kind}")
        return cls(kind, pid, ordinal, PciAddress(dom, bus, dev, fn), addr, offset, size, ipc)

    def describe(self) -> str:
        return (
            f"{_KINDS[self.kind]} of {self.size} bytes at {self.addr:#x} in pid {self.pid} "
            f"(GPU {self.pci}, ordinal {self.ordinal} there)"
        )

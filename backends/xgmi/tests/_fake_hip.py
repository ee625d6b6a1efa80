"""A fake ``libamdhip64.so`` for tests without ROCm: :class:`mori.testing.gpu_fake.FakeGpuLib` with the
HIP runtime's function names, its current device, its allocation flags and its error-string calls
(see that module)."""

from __future__ import annotations

import ctypes
from typing import Any

from mori_backend_xgmi.driver import HIP_MEMCPY_DEFAULT, HipDriver

from mori.testing.gpu_fake import (
    INVALID_DEVICE,
    INVALID_VALUE,
    NO_DEVICE,
    SUCCESS,
    TEXTS,
    FakeGpuLib,
    FakeWorld,
)

__all__ = ["FakeHipLib", "FakeWorld"]


class FakeHipLib(FakeGpuLib):
    """One process's view of HIP (see :class:`~mori.testing.gpu_fake.FakeGpuLib`). ``device``: the
    calling thread's current device."""

    DRIVER = HipDriver
    PREFIX = "hip"
    DEVICES = ("0000:0c:00.0", "0000:22:00.0")
    VERSION = 60443483

    def __init__(
        self, world: FakeWorld | None = None, devices: tuple[str, ...] | None = None, **kw: Any
    ) -> None:
        super().__init__(world, devices, **kw)
        self.device = 0  # the calling thread's current device

    def _alloc_device(self) -> int | None:
        return self.device

    # -- runtime and devices ----------------------------------------------------------------------

    def hipGetDeviceCount(self, out: Any) -> int:
        if not self.devices:
            return NO_DEVICE
        out._obj.value = len(self.devices)
        return self.enter("hipGetDeviceCount")

    def hipGetDevice(self, out: Any) -> int:
        out._obj.value = self.device
        return self.enter("hipGetDevice")

    def hipSetDevice(self, device: int) -> int:
        if not 0 <= device < len(self.devices):
            return INVALID_DEVICE
        self.device = device
        return self.enter("hipSetDevice")

    def hipDeviceGetPCIBusId(self, buf: Any, length: int, device: int) -> int:
        if not 0 <= device < len(self.devices):
            return INVALID_DEVICE
        buf.value = self.devices[device].encode()
        return self.enter("hipDeviceGetPCIBusId")

    # -- memory: two allocation calls, and copies take a direction ----------------------------------

    def hipMalloc(self, out: Any, size: int) -> int:
        return self.op_alloc("hipMalloc", out, size, 0)

    def hipExtMallocWithFlags(self, out: Any, size: int, flags: int) -> int:
        return self.op_alloc("hipExtMallocWithFlags", out, size, flags)

    def hipMemcpyAsync(self, dst: int, src: int, n: int, kind: int, stream: Any) -> int:
        rc = self.enter("hipMemcpyAsync")
        if rc:
            return rc
        if kind != HIP_MEMCPY_DEFAULT:
            return INVALID_VALUE
        ctypes.memmove(dst, src, n)
        return SUCCESS

    # -- errors: HIP returns the strings themselves ------------------------------------------------

    def hipGetErrorName(self, code: int) -> bytes:
        return (self.result_name(code) or "hipErrorUnknown").encode()

    def hipGetErrorString(self, code: int) -> bytes:
        return TEXTS.get(code, "unknown error").encode()

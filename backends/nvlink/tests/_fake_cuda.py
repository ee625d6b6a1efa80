"""A fake ``libcuda.so.1`` for tests without a GPU: :class:`mori.testing.gpu_fake.FakeGpuLib` with the
CUDA driver's function names, its contexts and its error-name calls (see that module)."""

from __future__ import annotations

from typing import Any

from mori_backend_nvlink.driver import CudaDriver

from mori.testing.gpu_fake import INVALID_DEVICE, INVALID_VALUE, SUCCESS, TEXTS, FakeGpuLib, FakeWorld

__all__ = ["FakeCudaLib", "FakeWorld"]


class FakeCudaLib(FakeGpuLib):
    """One process's view of the CUDA driver (see :class:`~mori.testing.gpu_fake.FakeGpuLib`).
    ``current``: the calling thread's current context (0: none; device ``d``'s primary context is
    ``0xC000 + d``)."""

    DRIVER = CudaDriver
    PREFIX = "cu"
    DEVICES = ("0000:1b:00.0", "0000:2c:00.0")
    VERSION = 13000

    def __init__(
        self, world: FakeWorld | None = None, devices: tuple[str, ...] | None = None, **kw: Any
    ) -> None:
        super().__init__(world, devices, **kw)
        self.current = 0

    def _alloc_device(self) -> int | None:
        return self._device() if self.current else None

    def _device(self) -> int:
        return self.current - 0xC000 if self.current else 0

    # -- devices and contexts --------------------------------------------------------------------

    def cuDeviceGetCount(self, out: Any) -> int:
        out._obj.value = len(self.devices)
        return self.enter("cuDeviceGetCount")

    def cuDeviceGet(self, out: Any, ordinal: int) -> int:
        if not 0 <= ordinal < len(self.devices):
            return INVALID_DEVICE
        out._obj.value = ordinal
        return self.enter("cuDeviceGet")

    def cuDeviceGetPCIBusId(self, buf: Any, length: int, device: int) -> int:
        buf.value = self.devices[device].upper().encode()
        return self.enter("cuDeviceGetPCIBusId")

    def cuDevicePrimaryCtxRetain(self, out: Any, device: int) -> int:
        out._obj.value = 0xC000 + device
        return self.enter("cuDevicePrimaryCtxRetain")

    def cuCtxGetCurrent(self, out: Any) -> int:
        out._obj.value = self.current or None
        return self.enter("cuCtxGetCurrent")

    def cuCtxSetCurrent(self, ctx: Any) -> int:
        self.current = ctx or 0
        return self.enter("cuCtxSetCurrent")

    def cuMemAlloc_v2(self, out: Any, size: int) -> int:
        return self.op_alloc("cuMemAlloc_v2", out, size)

    # -- errors: the names come back through an out-pointer ---------------------------------------

    def cuGetErrorName(self, code: int, out: Any) -> int:
        name = self.result_name(code)
        if name is None:
            return INVALID_VALUE
        out._obj.value = name.encode()
        return SUCCESS

    def cuGetErrorString(self, code: int, out: Any) -> int:
        if code not in TEXTS:
            return INVALID_VALUE
        out._obj.value = TEXTS[code].encode()
        return SUCCESS

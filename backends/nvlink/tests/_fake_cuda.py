"""A fake ``libcuda.so.1`` for tests without a GPU: :class:`mori.testing.gpu_fake.FakeGpuLib` with the
CUDA driver's function names, its contexts and its error-name calls (see that module)."""

from __future__ import annotations

from typing import Any, ClassVar

from mori.testing.gpu_fake import (
    INVALID_DEVICE,
    INVALID_VALUE,
    NO_DEVICE,
    NOT_FOUND,
    NOT_READY,
    OUT_OF_MEMORY,
    SUCCESS,
    FakeGpuLib,
    FakeWorld,
    Mapping,
    Memory,
)

__all__ = ["FakeCudaLib", "FakeWorld", "Mapping", "Memory"]
_ = (NO_DEVICE, NOT_FOUND, NOT_READY, OUT_OF_MEMORY)

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


class FakeCudaLib(FakeGpuLib):
    """One process's view of the CUDA driver (see :class:`~mori.testing.gpu_fake.FakeGpuLib`).
    ``current``: the calling thread's current context (0: none; device ``d``'s primary context is
    ``0xC000 + d``)."""

    PREFIX = "cu"
    DEVICES = ("0000:1b:00.0", "0000:2c:00.0")
    VERSION = 13000
    FUNCS: ClassVar[dict[str, str]] = {
        "cuInit": "op_init",
        "cuDriverGetVersion": "op_version",
        "cuDeviceCanAccessPeer": "op_can_access_peer",
        "cuPointerGetAttribute": "op_pointer_attribute",
        "cuCtxSynchronize": "op_plain",
        "cuMemAlloc_v2": "op_alloc",
        "cuMemFree_v2": "op_free",
        "cuMemsetD8Async": "op_memset",
        "cuMemGetAddressRange_v2": "op_address_range",
        "cuMemcpyAsync": "op_memcpy",
        "cuMemHostAlloc": "op_host_alloc",
        "cuMemHostGetDevicePointer_v2": "op_host_device_pointer",
        "cuMemFreeHost": "op_host_free",
        "cuIpcGetMemHandle": "op_ipc_get",
        "cuIpcOpenMemHandle_v2": "op_ipc_open",
        "cuIpcCloseMemHandle": "op_ipc_close",
        "cuStreamCreate": "op_stream_create",
        "cuStreamDestroy_v2": "op_stream_destroy",
        "cuStreamSynchronize": "op_plain",
        "cuStreamWaitEvent": "op_plain",
        "cuEventCreate": "op_event_create",
        "cuEventRecord": "op_plain",
        "cuEventQuery": "op_event_query",
        "cuEventSynchronize": "op_event_synchronize",
        "cuEventDestroy_v2": "op_event_destroy",
    }

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
        return self._enter("cuDeviceGetCount")

    def cuDeviceGet(self, out: Any, ordinal: int) -> int:
        if not 0 <= ordinal < len(self.devices):
            return INVALID_DEVICE
        out._obj.value = ordinal
        return self._enter("cuDeviceGet")

    def cuDeviceGetPCIBusId(self, buf: Any, length: int, device: int) -> int:
        buf.value = self.devices[device].upper().encode()
        return self._enter("cuDeviceGetPCIBusId")

    def cuDevicePrimaryCtxRetain(self, out: Any, device: int) -> int:
        out._obj.value = 0xC000 + device
        return self._enter("cuDevicePrimaryCtxRetain")

    def cuCtxGetCurrent(self, out: Any) -> int:
        out._obj.value = self.current or None
        return self._enter("cuCtxGetCurrent")

    def cuCtxSetCurrent(self, ctx: Any) -> int:
        self.current = ctx or 0
        return self._enter("cuCtxSetCurrent")

    # -- errors: the names come back through an out-pointer ---------------------------------------

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

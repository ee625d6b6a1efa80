"""Pieces that need no GPU: segment handles, driver error reporting, DLPack views."""

from __future__ import annotations

import ctypes
import gc
from types import ModuleType
from typing import Any

import pytest
from mori_backend_nvlink.driver import CudaDriver, CudaError
from mori_backend_nvlink.handles import KIND_HEAP, KIND_RANGE, SIZE, PciAddress, SegmentHandle

from mori.core.errors import MoriBackendError, MoriValueError
from mori.core.gpu import dlpack as _dlpack

# -- handles ------------------------------------------------------------------------------------------


def _handle(**kw: Any) -> SegmentHandle:
    fields: dict[str, Any] = {
        "kind": KIND_RANGE,
        "pid": 4_000_000_000,
        "ordinal": 7,
        "pci": PciAddress.parse("0000:1B:00.0"),
        "addr": 0x7F00_1234_5000,
        "offset": 12345,
        "size": 2**40 + 3,
        "ipc": bytes(range(64)),
    }
    fields.update(kw)
    return SegmentHandle(**fields)


def test_handle_round_trip() -> None:
    h = _handle()
    data = h.pack()
    assert len(data) == SIZE == 112 and data[:4] == b"MNVL"
    assert SegmentHandle.unpack(data) == h
    assert SegmentHandle.unpack(bytearray(data)) == h
    assert SegmentHandle.unpack(_handle(kind=KIND_HEAP, offset=0).pack()).kind == KIND_HEAP


def test_pci_addresses_compare_by_value() -> None:
    a = PciAddress.parse("0000:1b:00.0")
    assert a == PciAddress.parse("00000000:1B:00.0") and str(a) == "0000:1b:00.0"
    assert a != PciAddress.parse("0000:1b:00.1")
    with pytest.raises(MoriValueError, match="not a PCI bus id"):
        PciAddress.parse("GPU-1234")


def test_foreign_or_corrupt_handles_are_refused_clearly() -> None:
    with pytest.raises(MoriValueError, match=r"PE 3's heap is not a mori-backend-nvlink handle.*b'/mor'"):
        SegmentHandle.unpack(b"/mori-heap.123.abc.3", what="PE 3's heap")
    newer = bytearray(_handle().pack())
    newer[4] = 9
    with pytest.raises(MoriValueError, match="format version 9"):
        SegmentHandle.unpack(bytes(newer))
    odd = bytearray(_handle().pack())
    odd[5] = 5
    with pytest.raises(MoriValueError, match="unknown kind 5"):
        SegmentHandle.unpack(bytes(odd))
    with pytest.raises(MoriValueError, match="expected bytes"):
        SegmentHandle.unpack("MNVL")  # type: ignore[arg-type]
    with pytest.raises(MoriValueError, match="63 bytes"):
        _handle(ipc=b"x" * 63).pack()


# -- driver -------------------------------------------------------------------------------------------


def test_failed_calls_name_the_call_and_the_result(fake: ModuleType) -> None:
    lib = fake.FakeCudaLib()
    drv = CudaDriver(lib, "fake-libcuda.so.1")
    drv.init()
    lib.current = drv.primary_context_retain(drv.device(0))
    lib.fail["cuMemAlloc_v2"] = 2
    with pytest.raises(CudaError) as info:
        drv.mem_alloc(4096)
    e = info.value
    assert str(e) == "cuMemAlloc_v2 failed: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory (4096 bytes)"
    assert (e.call, e.code, e.result) == ("cuMemAlloc_v2", 2, "CUDA_ERROR_OUT_OF_MEMORY")
    assert isinstance(e, MoriBackendError)
    with pytest.raises(
        CudaError, match=r"cuDeviceGet failed: CUDA_ERROR_INVALID_DEVICE \(101\).*device ordinal 5"
    ):
        drv.device(5)


def test_results_the_driver_cannot_name_still_read_well(fake: ModuleType) -> None:
    lib = fake.FakeCudaLib()
    drv = CudaDriver(lib, "fake")
    lib.fail["cuCtxSynchronize"] = 719  # the fake has no text for it: cuGetErrorName fails
    with pytest.raises(CudaError, match=r"cuCtxSynchronize failed: CUDA_ERROR_LAUNCH_FAILED \(719\)"):
        drv.synchronize()
    lib.fail["cuCtxSynchronize"] = 12345
    with pytest.raises(CudaError, match=r"CUresult 12345 \(12345\): no description from the driver"):
        drv.synchronize()


def test_missing_functions_and_older_names(fake: ModuleType) -> None:
    lib = fake.FakeCudaLib()
    lib.hide.add("cuMemHostAlloc")
    with pytest.raises(
        MoriBackendError, match="fake has no function cuMemHostAlloc: the CUDA driver is too old"
    ):
        CudaDriver(lib, "fake").host_alloc(64)

    class OldDriver:
        """Has only the pre-_v2 name of cuIpcOpenMemHandle."""

        def __init__(self) -> None:
            self.seen: list[bytes] = []

        def cuIpcOpenMemHandle(self, out: Any, handle: Any, flags: int) -> int:
            self.seen.append(bytes(handle))
            out._obj.value = 0xABC000
            return 0

    old = OldDriver()
    assert CudaDriver(old, "old").ipc_open_handle(b"h" * 64) == 0xABC000
    assert old.seen == [b"h" * 64]


def test_event_query_distinguishes_not_ready_from_errors(fake: ModuleType) -> None:
    lib = fake.FakeCudaLib()
    drv = CudaDriver(lib, "fake")
    ev = drv.event_create()
    assert drv.event_query(ev)
    lib.not_ready.add(ev)
    assert not drv.event_query(ev)
    lib.fail["cuEventQuery"] = 400
    with pytest.raises(CudaError, match="cuEventQuery failed"):
        drv.event_query(ev)


# -- DLPack views ---------------------------------------------------------------------------------------


def test_byte_view_shares_memory_and_releases_its_record() -> None:
    import torch

    buf = (ctypes.c_uint8 * 64)()
    before = len(_dlpack._alive)
    t = _dlpack.byte_view(ctypes.addressof(buf), 64, _dlpack.KDL_CPU, 0)
    assert t.dtype == torch.uint8 and t.shape == (64,) and t.data_ptr() == ctypes.addressof(buf)
    t.view(torch.int64)[1] = -2
    assert bytes(buf[8:16]) == b"\xfe" + b"\xff" * 7
    buf[0] = 9
    assert int(t[0]) == 9
    assert len(_dlpack._alive) == before + 1
    del t
    gc.collect()
    assert len(_dlpack._alive) == before
    assert _dlpack.byte_view(0, 0, _dlpack.KDL_CPU, 0).numel() == 0

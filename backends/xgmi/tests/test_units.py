"""Pieces that need no GPU: segment handles, HIP error reporting, library lookup, DLPack views."""

from __future__ import annotations

import ctypes
import gc
from types import ModuleType
from typing import Any

import pytest
from mori_backend_xgmi import driver
from mori_backend_xgmi.driver import HipDriver, HipError
from mori_backend_xgmi.handles import KIND_HEAP, KIND_RANGE, SIZE, PciAddress, SegmentHandle

from mori.core.errors import MoriBackendError, MoriValueError
from mori.core.gpu import dlpack as _dlpack

# -- handles ------------------------------------------------------------------------------------------


def _handle(**kw: Any) -> SegmentHandle:
    fields: dict[str, Any] = {
        "kind": KIND_RANGE,
        "pid": 4_000_000_000,
        "ordinal": 7,
        "pci": PciAddress.parse("0000:0C:00.0"),
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
    assert len(data) == SIZE == 112 and data[:4] == b"MXGM"
    assert SegmentHandle.unpack(data) == h
    assert SegmentHandle.unpack(_handle(kind=KIND_HEAP, offset=0).pack()).kind == KIND_HEAP


def test_foreign_or_corrupt_handles_are_refused_clearly() -> None:
    with pytest.raises(MoriValueError, match=r"PE 3's heap is not a mori-backend-xgmi handle.*b'MNVL'"):
        SegmentHandle.unpack(b"MNVL" + bytes(108), what="PE 3's heap")  # a cuda rank's handle
    newer = bytearray(_handle().pack())
    newer[4] = 2
    with pytest.raises(MoriValueError, match="format version 2"):
        SegmentHandle.unpack(bytes(newer))
    with pytest.raises(MoriValueError, match="not a PCI bus id"):
        PciAddress.parse("0000:0c")


# -- HIP binding --------------------------------------------------------------------------------------


def test_failed_calls_name_the_call_and_the_result(fake: ModuleType) -> None:
    lib = fake.FakeHipLib()
    drv = HipDriver(lib, "fake-libamdhip64.so")
    lib.fail["hipMalloc"] = 2
    with pytest.raises(HipError) as info:
        drv.mem_alloc(4096)
    e = info.value
    assert str(e) == "hipMalloc failed: hipErrorOutOfMemory (2): out of memory (4096 bytes)"
    assert (e.call, e.code, e.result) == ("hipMalloc", 2, "hipErrorOutOfMemory")
    assert isinstance(e, MoriBackendError)
    with pytest.raises(HipError, match=r"hipSetDevice failed: hipErrorInvalidDevice \(101\).*device 5"):
        drv.set_device(5)
    lib.fail["hipDeviceSynchronize"] = 719
    with pytest.raises(
        HipError, match=r"hipDeviceSynchronize failed: hipErrorUnknown \(719\): unknown error"
    ):
        drv.synchronize()


def test_uncached_allocations_use_the_extended_allocator(fake: ModuleType) -> None:
    lib = fake.FakeHipLib()
    drv = HipDriver(lib, "fake")
    ptr = drv.mem_alloc(4096, uncached=True)
    assert lib.calls[-1] == "hipExtMallocWithFlags" and lib.allocs[ptr][1].memory.flags == 3
    drv.mem_free(ptr)


def test_missing_functions_and_other_names(fake: ModuleType) -> None:
    lib = fake.FakeHipLib()
    lib.hide.add("hipIpcGetMemHandle")
    with pytest.raises(
        MoriBackendError, match="fake has no function hipIpcGetMemHandle: the HIP runtime is too old"
    ):
        HipDriver(lib, "fake").ipc_get_handle(4096)

    class NewerHip:
        """Has hipExtHostAlloc, not the deprecated hipHostMalloc."""

        def hipExtHostAlloc(self, out: Any, n: int, flags: int) -> int:
            out._obj.value = 0x1000 + n
            return 0

    assert HipDriver(NewerHip(), "newer").host_alloc(64) == 0x1040


def test_event_query_distinguishes_not_ready_from_errors(fake: ModuleType) -> None:
    lib = fake.FakeHipLib()
    drv = HipDriver(lib, "fake")
    ev = drv.event_create()
    assert drv.event_query(ev)
    lib.not_ready.add(ev)
    assert not drv.event_query(ev)
    lib.fail["hipEventQuery"] = 400
    with pytest.raises(HipError, match="hipEventQuery failed"):
        drv.event_query(ev)


def test_library_lookup(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    missing = str(tmp_path / "libamdhip64.so")
    monkeypatch.setenv("MORI_HIP_LIBRARY", missing)
    monkeypatch.setattr(driver, "_driver", None)
    with pytest.raises(MoriBackendError, match=f"{missing} not found: no ROCm on this machine"):
        driver.load_driver()
    garbage = tmp_path / "garbage.so"
    garbage.write_bytes(b"not an ELF file")
    monkeypatch.setenv("MORI_HIP_LIBRARY", str(garbage))
    with pytest.raises(MoriBackendError, match=r"garbage\.so cannot be loaded"):
        driver.load_driver()
    monkeypatch.setenv("MORI_HIP_LIBRARY", "libc.so.6")  # any library loads; HIP calls would fail later
    assert driver.load_driver().path == "libc.so.6"
    assert driver._loaded_hip() is None  # no ROCm in this process


# -- DLPack views ---------------------------------------------------------------------------------------


def test_byte_view_shares_memory_and_releases_its_record() -> None:
    import torch

    buf = (ctypes.c_uint8 * 64)()
    before = len(_dlpack._alive)
    t = _dlpack.byte_view(ctypes.addressof(buf), 64, _dlpack.KDL_CPU, 0)
    assert t.dtype == torch.uint8 and t.data_ptr() == ctypes.addressof(buf)
    t.view(torch.int32)[0] = -1
    assert bytes(buf[:4]) == b"\xff" * 4
    del t
    gc.collect()
    assert len(_dlpack._alive) == before

"""mori.core.gpu as vendor-neutral code: a vendor descriptor makes the plugin, its handles and its
messages; the DLPack views; the one wrapping of Triton's private kernel loading."""

from __future__ import annotations

import ctypes
import dataclasses
import gc
from typing import Any

import pytest

from mori.core.env import EnvVar
from mori.core.errors import MoriBackendError
from mori.core.gpu import dlpack
from mori.core.gpu.driver import CtypesDriver, GpuError
from mori.core.gpu.runtime import GpuRuntime
from mori.core.gpu.transport import GpuP2PTransport
from mori.core.gpu.vendor import GpuVendor, GpuVendorPlugin, loaded_library
from mori.core.kernels import launch_config


class MadeUpError(GpuError):
    pass


class MadeUpDriver(CtypesDriver):
    ERROR = MadeUpError


MADE_UP_LIBRARY = EnvVar("MORI_MADE_UP_LIBRARY", None, "test", "/x.so", str)
HEAP_TYPE = EnvVar("MORI_MADE_UP_HEAP", "a", "test", "b", str)

VENDOR = GpuVendor(
    runtime="mu",
    transport="mulink",
    distribution="mori-backend-madeup",
    runtime_description="made-up GPUs",
    transport_description="made-up links",
    driver_class=MadeUpDriver,
    library_env=MADE_UP_LIBRARY,
    libraries=("libmadeup.so.1",),
    missing="no made-up GPU driver",
    prefer_loaded=None,
    handle_magic=b"MMUP",
    ipc_name="MU IPC",
    gpu_noun="MU device",
    no_device_result="MU_NO_DEVICE",
    device_count_call="muDeviceCount",
    torch_flavour="MU",
    heap_allocation="one muAlloc",
    alloc_functions="muAlloc",
    async_pool="muAllocAsync",
    available="{count} MU device(s), driver {version} ({path})",
    peer_access_query="muCanAccessPeer({index}, {other})",
    torch_version="mu",
    dlpack_device=dlpack.KDL_CUDA,
    env_vars=(HEAP_TYPE,),
)


def test_a_descriptor_makes_the_whole_plugin() -> None:
    plugin = GpuVendorPlugin(VENDOR)
    (runtime,) = plugin.mori_device_runtimes()
    (transport,) = plugin.mori_transports()
    assert isinstance(runtime, GpuRuntime) and runtime is plugin.runtime
    assert (runtime.name, runtime.description, runtime.package) == (
        "mu",
        "made-up GPUs",
        "mori-backend-madeup",
    )
    assert runtime.error_class is MadeUpError and runtime.handle_class is VENDOR.handle_class
    assert isinstance(transport, GpuP2PTransport)
    assert (transport.name, transport.description) == ("mulink", "made-up links")
    assert plugin.mori_env_vars() == [MADE_UP_LIBRARY, HEAP_TYPE]
    assert "no made-up GPU driver" in runtime.probe().reason  # the library is not there


def test_handles_carry_the_vendors_magic_and_name() -> None:
    cls = VENDOR.handle_class
    assert (cls.MAGIC, cls.PACKAGE, cls.RUNTIME, cls.SIZE) == (b"MMUP", "mori-backend-madeup", "mu", 112)
    wider = dataclasses.replace(VENDOR, ipc_handle_size=128).handle_class
    assert wider.SIZE == 112 + 64
    with pytest.raises(ValueError, match="handle_magic=b'MU' is not 4 bytes"):
        dataclasses.replace(VENDOR, handle_magic=b"MU")


def test_a_missing_library_is_said_once_per_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    vendor = dataclasses.replace(VENDOR)
    with pytest.raises(
        MoriBackendError,
        match=r"libmadeup.so.1 not found: no made-up GPU driver \(or set MORI_MADE_UP_LIBRARY\)",
    ):
        vendor.load_driver()
    monkeypatch.setenv("MORI_MADE_UP_LIBRARY", "libc.so.6")
    assert vendor.load_driver().path == "libc.so.6"


def test_loaded_library_reads_the_process_maps() -> None:
    found = loaded_library("libc.so")
    assert found is not None and "/libc.so" in found
    assert loaded_library("libmadeup.so") is None


def test_byte_view_shares_memory_and_releases_its_record() -> None:
    import torch

    buf = (ctypes.c_uint8 * 64)()
    before = len(dlpack._alive)
    t = dlpack.byte_view(ctypes.addressof(buf), 64, dlpack.KDL_CPU, 3)  # the host is device 0
    assert t.dtype == torch.uint8 and t.shape == (64,) and t.data_ptr() == ctypes.addressof(buf)
    t.view(torch.int64)[1] = -2
    assert bytes(buf[8:16]) == b"\xfe" + b"\xff" * 7
    buf[0] = 9
    assert int(t[0]) == 9
    assert len(dlpack._alive) == before + 1
    del t
    gc.collect()
    assert len(dlpack._alive) == before
    assert dlpack.byte_view(0, 0, dlpack.KDL_CPU, 0).numel() == 0


def test_launch_config_takes_plain_launches_only() -> None:
    class Meta:
        num_warps, shared, warp_size = 4, 0, 32
        global_scratch_size = profile_scratch_size = 0
        num_ctas = 1
        launch_cooperative_grid = launch_pdl = False

    class Compiled:
        metadata: Any = Meta()
        function = 0

        def _init_handles(self) -> None:  # what Triton's CompiledKernel does: load, set function
            self.function = 0xF00

    assert launch_config(Compiled()) == (0xF00, 128, 0)
    Meta.warp_size = 64  # AMD's wavefronts
    assert launch_config(Compiled())[1] == 256
    Meta.global_scratch_size = 256
    with pytest.raises(MoriBackendError, match="global_scratch_size=256"):
        launch_config(Compiled())

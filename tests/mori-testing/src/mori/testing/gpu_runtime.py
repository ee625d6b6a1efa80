"""What the GPU device plugins' tests share: their fixtures and the tests of the runtime, transport,
copy engine, segment handles and driver binding on a fake driver (the real code paths without a GPU).

A plugin is one :class:`~mori.core.gpu.vendor.GpuVendor` descriptor, so its tests differ only in
data. A backend's ``conftest.py`` describes itself with a :class:`GpuBackend` (its ``VENDOR``, its
fake library and what its driver does there) in a ``gpu_backend`` fixture and imports the fixtures
below; its ``test_runtime.py`` imports the ``test_*`` functions, which pytest then runs there. Each fake runtime plays one process of a node (its own pid and fake library, one shared
"world"); "device memory" is host memory, so results are checked by reading it. Host atomics run
the real Triton kernel in the interpreter.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import importlib
import importlib.util
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import pytest

from mori.core.backend import (
    OP_ADD,
    OP_AND,
    OP_FETCH,
    OP_OR,
    OP_SET,
    OP_SWAP,
    OP_XOR,
    WORD_INT32,
    WORD_INT64,
    WORD_UINT32,
    WORD_UINT64,
    PeerInfo,
)
from mori.core.errors import MoriBackendError, MoriStateError, MoriValueError
from mori.core.gpu import dlpack as _dlpack
from mori.core.gpu import runtime as gpu_runtime_module
from mori.core.gpu.driver import CtypesDriver, GpuDriver
from mori.core.gpu.handles import KIND_HEAP, KIND_RANGE, PciAddress
from mori.core.gpu.runtime import GpuDevice, GpuRuntime
from mori.core.gpu.transport import GpuP2PTransport
from mori.core.gpu.vendor import GpuVendor
from mori.testing import load_module_file
from mori.testing.gpu_fake import FakeGpuLib, FakeWorld

__all__ = [
    "FakeRuntime",
    "GpuBackend",
    "test_a_gpu_not_visible_here_is_left_to_the_driver",
    "test_atomic_argument_errors_match_the_cpu_runtime",
    "test_atomics_every_op_and_word",
    "test_copy_engine_round_robin_tickets_and_quiet",
    "test_copy_is_ordered_after_the_current_stream_and_synchronous",
    "test_driver_failures_surface_as_backend_errors",
    "test_export_a_sub_range_and_open_it_in_another_process",
    "test_a_missing_function_says_the_driver_is_too_old",
    "test_event_query_distinguishes_not_ready_from_errors",
    "test_export_range_errors",
    "test_failed_calls_name_the_call_and_the_result",
    "test_foreign_or_corrupt_handles_are_refused_clearly",
    "test_handle_round_trip",
    "test_library_lookup",
    "test_fence_synchronises_the_context_and_access_needs_a_device",
    "test_native_calls_hand_over_the_c_functions_and_the_conventions",
    "test_heap_segment_is_aligned_zeroed_and_exported",
    "test_only_the_static_heap_is_supported",
    "test_opening_a_foreign_handle_fails_clearly",
    "test_out_of_memory_says_what_to_change",
    "test_overlapping_copies_behave_like_memmove",
    "test_peers_map_each_others_heaps",
    "test_probe_reports_why_it_cannot_work",
    "test_probe_with_a_gpu_checks_torch_and_triton",
    "test_transport_connects_only_what_load_store_reaches",
    "test_wait_until_polls_with_a_timeout_and_wakes_up",
]

Make = Callable[..., Any]
MiB = 1 << 20


@dataclass(frozen=True)
class GpuBackend:
    """What the shared tests need to know of one GPU plugin beyond its descriptor (the vendor's
    names and messages, the driver's ``NAMES``): its fake library and what its driver does there."""

    #: the plugin's descriptor (its ``VENDOR``)
    vendor: GpuVendor
    #: the fake library class (a FakeGpuLib)
    fake_lib: type[FakeGpuLib]
    #: probe()'s reason when the fake counts no device
    no_devices_reason: str
    #: the C function the heap is allocated with (by default)
    heap_alloc_call: str
    #: what a failed copy's error says (a regex)
    memcpy_failure: str
    #: what the driver's native_calls() reports for native code: (memcpy_kind, context_is_device,
    #: error_name_returns_string); CUDA's forms by default
    native_conventions: tuple[int, bool, bool] = (-1, False, False)

    @property
    def driver_class(self) -> type[CtypesDriver]:
        return self.vendor.driver_class

    @property
    def library(self) -> str:
        """The real library's (first) name."""
        return self.vendor.libraries[0]

    @property
    def fake_path(self) -> str:
        """The path the fake runtimes' driver names."""
        return f"fake-{self.library}"

    def runtime(self, load: Callable[[], Any]) -> GpuRuntime:
        """The plugin's runtime on the driver ``load`` returns."""
        return GpuRuntime(self.vendor, load)

    def transport(self, runtime: GpuRuntime) -> GpuP2PTransport:
        """The plugin's same-node transport over ``runtime``."""
        return GpuP2PTransport(runtime)

    @property
    def usable_reason(self) -> str:
        """probe()'s reason on the fake library, ``libfake.so``."""
        v = self.vendor
        return v.available.format(count=2, version=v.version_text(self.fake_lib.VERSION), path="libfake.so")

    @property
    def no_peer_access(self) -> str:
        """What can_reach says without peer access between the fake's GPUs 1 and 0."""
        return f"{self.vendor.peer_access_query.format(index=1, other=0)} = 0"

    def call(self, op: str) -> str:
        """The C function of the driver operation ``op``."""
        return str(self.driver_class.NAMES[op])

    @property
    def no_gpu_reason(self) -> str:
        v = self.vendor
        return f"no {v.gpu_noun} ({self.call('init')}: {v.no_device_result})"

    @property
    def copy_calls(self) -> list[str]:
        """The calls of one host copy, in order."""
        names = ("event_record", "stream_wait_event", "memcpy", "stream_synchronize")
        return [*map(self.call, names)]

    @property
    def context_calls(self) -> tuple[str, str]:
        """The calls that make the GPU current (left out when checking call sequences)."""
        return self.call("get_context"), self.call("set_context")


class FakeRuntime(GpuRuntime):
    """A plugin's runtime on a fake driver library ``lib`` (see :class:`GpuBackend`): what needs
    torch.cuda (current device and stream, views, the kernel launch) is done on the CPU instead;
    everything else is the real code. ``device``: the torch device index it plays; ``pid``: the
    process id it plays (default: this one's); ``kernels``: the host-atomic kernel module compiled for
    the interpreter (:func:`interpreted_atomics`), needed for atomics."""

    def __init__(
        self, backend: GpuBackend, lib: Any, *, device: int = 0, pid: int | None = None, kernels: Any = None
    ) -> None:
        # views are CPU tensors: "device memory" is host memory
        vendor = dataclasses.replace(backend.vendor, dlpack_device=_dlpack.KDL_CPU)
        # as GpuRuntime's default loader: a vendor's binding is a CtypesDriver subclass with the
        # GpuDriver methods the base lacks
        super().__init__(vendor, load=lambda: cast("GpuDriver", backend.driver_class(lib, backend.fake_path)))
        self.lib = lib
        self.device = device
        self.kernels = kernels
        self._fake_pid = pid

    @property
    def pid(self) -> int:
        return self._fake_pid or os.getpid()

    def current_device_index(self) -> int:
        return self.device

    def current_stream(self, index: int) -> int:
        return 0

    def launch_atomic(
        self, st: GpuDevice, addr: int, dtype: str, op: int, operands: tuple[int, int, int, int]
    ) -> None:
        import torch

        assert self.kernels is not None, "pass kernels=interpreted_atomics to use atomics"
        torch_dtype = getattr(torch, dtype)
        size = torch.empty(0, dtype=torch_dtype).element_size()

        def word_at(a: int) -> Any:
            return torch.frombuffer((ctypes.c_uint8 * size).from_address(a), dtype=torch.uint8).view(
                torch_dtype
            )

        self.kernels.host_atomic_kernel[(1,)](word_at(addr), word_at(st.pinned_device), *operands, OP=op)


def backend_fixture(package: str, tests: Path, fake: str, **fields: Any) -> Any:
    """The session fixture ``gpu_backend`` of a plugin's ``conftest.py``: a :class:`GpuBackend` of
    the ``VENDOR`` of ``package`` (from the plugin's ``src`` next to ``tests`` when it is not
    installed), its fake library the class ``fake`` (``"_fake_cuda.py:FakeCudaLib"``) of a file in
    ``tests``, and the other :class:`GpuBackend` fields."""
    source_tree(package, tests.parent / "src")

    @pytest.fixture(scope="session")
    def gpu_backend() -> GpuBackend:
        file, cls = fake.split(":")
        module = load_module_file(f"{package}_tests_{Path(file).stem}", str(tests / file))
        vendor = importlib.import_module(package).VENDOR
        return GpuBackend(vendor=vendor, fake_lib=getattr(module, cls), **fields)

    return gpu_backend


def source_tree(package: str, src: Path) -> None:
    """Put ``src`` on the import path when ``package`` is not installed (a plugin's tests run from
    a bare checkout too); the installed package wins otherwise."""
    if importlib.util.find_spec(package) is None:
        sys.path.insert(0, str(src))


# -- fixtures (a backend's conftest imports them and defines gpu_backend) -------------------------------


@pytest.fixture(scope="session")
def interpreted_atomics() -> ModuleType:
    """The host-atomic kernel module compiled for the Triton interpreter (runs on CPU memory)."""
    pytest.importorskip("triton", reason="the host-atomic kernel needs Triton")
    return load_interpreted("mori.core.gpu.atomics", "mori_gpu_atomics_interpreted")


def load_interpreted(module: str, alias: str) -> ModuleType:
    """A second copy of the kernel module ``module``, imported as ``alias`` with
    ``TRITON_INTERPRET=1`` so that its kernels run on CPU memory (the process keeps compiled ones)."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # triton.jit picks the interpreter when it decorates
    try:
        return load_module_file(alias, spec.origin)
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


@pytest.fixture
def runtimes(gpu_backend: GpuBackend) -> Iterator[Make]:
    """Make fake runtimes: ``make(device=0, pid=None, world=None, **lib_kwargs)``. Runtimes made
    with the same ``world`` are processes of one node; give them different ``pid``s."""
    made: list[Any] = []
    worlds: list[Any] = []

    def make(
        *, device: int = 0, pid: int | None = None, world: Any = None, kernels: Any = None, **kw: Any
    ) -> Any:
        if world is None:
            world = FakeWorld()
            worlds.append(world)
        lib = gpu_backend.fake_lib(world, **kw)
        made.append(lib)
        return FakeRuntime(gpu_backend, lib, device=device, pid=pid, kernels=kernels)

    yield make
    for lib in made:
        lib.close()
    for world in worlds:
        world.close()


@pytest.fixture
def world() -> Iterator[FakeWorld]:
    w = FakeWorld()
    yield w
    w.close()


# -- the shared tests ---------------------------------------------------------------------------------------


def _peer(
    rank: int, seg: Any, *, node: str = "node-a", runtime: str = "gpu", size: int = 4 * MiB
) -> PeerInfo:
    return PeerInfo(rank, node, "host", 1000 + rank, runtime, size, seg.handle)


def _bytes(addr: int, n: int) -> bytes:
    return ctypes.string_at(addr, n)


def _fill(addr: int, data: bytes) -> None:
    ctypes.memmove(addr, data, len(data))


# -- native code's view of the driver --------------------------------------------------------------------


def test_native_calls_hand_over_the_c_functions_and_the_conventions(gpu_backend: GpuBackend) -> None:
    """What native code (mori.io's XGMI queue and staging copier) gets: a real library's functions
    as their addresses, a fake's through C callbacks, and how this vendor's calls differ."""
    libc = ctypes.CDLL(None)

    class Lib:
        def __getattr__(self, name: str) -> Any:
            return libc["labs"]  # a fresh C function object per name, like a real library's

    calls = gpu_backend.driver_class(Lib(), "libc").native_calls()
    labs = ctypes.cast(libc["labs"], ctypes.c_void_p).value
    get_context, set_context = gpu_backend.context_calls
    for key, name in {
        "memcpy_async": gpu_backend.call("memcpy"),
        "get_context": get_context,
        "set_context": set_context,
        "launch_kernel": gpu_backend.call("launch_kernel"),
        "error_name": gpu_backend.call("error_name"),
        "host_alloc": gpu_backend.call("host_alloc"),
    }.items():
        assert calls[key] == labs and calls["names"][key] == name
    conventions = (calls["memcpy_kind"], calls["context_is_device"], calls["error_name_returns_string"])
    assert conventions == gpu_backend.native_conventions
    assert calls["not_ready"] == 600 and calls["event_flags"] == 2
    # a fake library: callbacks that reach its Python functions; no kernel launch there
    lib = gpu_backend.fake_lib()
    calls = gpu_backend.driver_class(lib, "fake").native_calls()
    assert "launch_kernel" not in calls and calls["event_create"]
    out = ctypes.c_void_p()
    create = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint)(
        calls["event_create"]
    )
    assert create(ctypes.byref(out), 2) == 0 and out.value in lib.events


# -- availability -------------------------------------------------------------------------------------


def test_probe_reports_why_it_cannot_work(gpu_backend: GpuBackend) -> None:
    b = gpu_backend
    library = b.library

    def missing() -> Any:
        raise MoriBackendError(f"{library} not found: {b.vendor.missing}")

    assert b.runtime(missing).probe().reason.startswith(f"{library} not found")
    no_gpu = b.fake_lib(init_result=100)
    avail = b.runtime(lambda: b.driver_class(no_gpu, "fake")).probe()
    assert not avail.usable and avail.reason == b.no_gpu_reason
    none = b.fake_lib(devices=())
    assert b.runtime(lambda: b.driver_class(none, "fake")).probe().reason == b.no_devices_reason

    def broken() -> Any:
        raise RuntimeError("boom")

    assert b.runtime(broken).probe().reason == "RuntimeError: boom"  # never raises


def test_probe_with_a_gpu_checks_torch_and_triton(gpu_backend: GpuBackend) -> None:
    import torch

    b = gpu_backend
    avail = b.runtime(lambda: b.driver_class(b.fake_lib(), "libfake.so")).probe()
    if not b.vendor.torch_build_ok(torch):
        assert (
            not avail.usable
            and avail.reason == f"torch {torch.__version__} is not a {b.vendor.torch_flavour} build"
        )
    else:
        assert avail.usable and avail.reason == b.usable_reason


# -- heap segments --------------------------------------------------------------------------------------


def test_heap_segment_is_aligned_zeroed_and_exported(runtimes: Make, gpu_backend: GpuBackend) -> None:
    rt = runtimes(pid=1000)
    seg = rt.create_segment(4 * MiB, "t.0")
    assert seg.addr % (2 * MiB) == 0 and seg.size == 4 * MiB
    assert _bytes(seg.addr, 4096) == bytes(4096) and _bytes(seg.addr + 4 * MiB - 64, 64) == bytes(64)
    h = gpu_backend.vendor.handle_class.unpack(seg.handle)
    assert (h.kind, h.pid, h.ordinal, h.pci, h.addr, h.size) == (
        KIND_HEAP,
        1000,
        0,
        PciAddress.parse(gpu_backend.fake_lib.DEVICES[0]),
        seg.addr,
        4 * MiB,
    )
    assert rt.device_index == 0
    seg.close()
    seg.close()  # twice is harmless
    assert rt.lib.allocs == {} or all(a != seg.addr for a in rt.lib.allocs)


def test_only_the_static_heap_is_supported(
    runtimes: Make, gpu_backend: GpuBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MORI_SHMEM_MODE", "vmm_heap")
    with pytest.raises(
        MoriValueError,
        match=rf"MORI_SHMEM_MODE='vmm_heap' is not supported by the {gpu_backend.vendor.runtime} runtime",
    ):
        runtimes().create_segment(4 * MiB, "t.0")


def test_out_of_memory_says_what_to_change(runtimes: Make, gpu_backend: GpuBackend) -> None:
    rt = runtimes()
    rt.lib.fail[gpu_backend.heap_alloc_call] = 2
    with pytest.raises(
        MoriBackendError,
        match=r"cannot allocate the 4194304-byte symmetric heap on cuda:0.*MORI_SHMEM_HEAP_SIZE",
    ):
        rt.create_segment(4 * MiB, "t.0")


def test_peers_map_each_others_heaps(runtimes: Make, world: Any) -> None:
    a = runtimes(pid=1000, device=0, world=world)
    b = runtimes(pid=1001, device=1, world=world)
    sa, sb = a.create_segment(4 * MiB, "t.0"), b.create_segment(4 * MiB, "t.1")
    pa = b.open_peer_segment(_peer(0, sa))  # b maps a's heap
    assert pa.addr != sa.addr and pa.size == 4 * MiB
    _fill(pa.addr + 100, b"written by b")  # a store through b's mapping lands in a's memory
    assert _bytes(sa.addr + 100, 12) == b"written by b"
    # views are tensors over the mapped memory (CPU tensors here, cuda:<index> on a GPU)
    view = b.byte_view(pa.addr + 100, 12)
    assert bytes(view.tolist()) == b"written by b"
    # a second open of the same allocation shares the mapping
    again = b.open_peer_segment(_peer(0, sa))
    assert again.addr == pa.addr and len(b.lib.opened) == 1
    again.close()
    assert len(b.lib.opened) == 1
    pa.close()
    assert b.lib.opened == {}
    sa.close()
    sb.close()


def test_opening_a_foreign_handle_fails_clearly(runtimes: Make, gpu_backend: GpuBackend) -> None:
    rt = runtimes(pid=1000)
    rt.create_segment(4 * MiB, "t.0")

    class CpuSegment:
        handle = b"/mori-heap.77.abc.1"

    package = gpu_backend.vendor.distribution
    with pytest.raises(MoriValueError, match=f"the heap handle of PE 1 is not a {package} handle"):
        rt.open_peer_segment(_peer(1, CpuSegment()))


def test_transport_connects_only_what_load_store_reaches(
    runtimes: Make, world: Any, gpu_backend: GpuBackend
) -> None:
    peer = functools.partial(_peer, runtime=gpu_backend.vendor.runtime)
    a = runtimes(pid=1000, device=0, world=world)
    b = runtimes(pid=1001, device=1, world=world, peer_access=False)
    c = runtimes(pid=1002, device=0, world=world)
    sa, sb, sc = (r.create_segment(4 * MiB, f"t.{i}") for i, r in enumerate((a, b, c)))
    me_a, me_b, me_c = peer(0, sa), peer(1, sb), peer(2, sc)
    t = gpu_backend.transport(a)
    # same node, same GPU (two ranks sharing one): mapped
    assert a.can_reach(me_c) == (True, "same GPU")
    seg = t.connect(a, me_a, me_c)
    assert seg is not None and seg.addr != sc.addr
    # another GPU with peer access
    assert a.can_reach(me_b) == (True, f"peer access to GPU {gpu_backend.fake_lib.DEVICES[1]}")
    assert t.connect(a, me_a, me_b) is not None
    # without peer access, another node, another runtime: not this transport's peer
    tb = gpu_backend.transport(b)
    assert tb.connect(b, me_b, me_a) is None and gpu_backend.no_peer_access in tb.unreachable[0]
    assert t.connect(a, me_a, peer(2, sc, node="node-b")) is None and "node-b" in t.unreachable[2]
    assert t.connect(a, me_a, peer(2, sc, runtime="another")) is None

    class Other:
        name = "cpu"

    other: Any = Other()  # not a DeviceRuntime: a runtime of another kind, by its name only
    assert t.connect(other, me_a, me_c) is None


def test_a_gpu_not_visible_here_is_left_to_the_driver(
    runtimes: Make, world: Any, gpu_backend: GpuBackend
) -> None:
    peer = functools.partial(_peer, runtime=gpu_backend.vendor.runtime)
    a = runtimes(pid=1000, device=0, world=world, devices=gpu_backend.fake_lib.DEVICES[:1])
    b = runtimes(pid=1001, device=1, world=world)
    sa, sb = a.create_segment(4 * MiB, "t.0"), b.create_segment(4 * MiB, "t.1")
    ok, why = a.can_reach(peer(1, sb))
    assert ok and "not visible" in why
    seg = gpu_backend.transport(a).connect(a, peer(0, sa), peer(1, sb))
    assert seg is not None
    seg.close()
    a.lib.fail[gpu_backend.call("ipc_open")] = 217
    t = gpu_backend.transport(a)
    assert t.connect(a, peer(0, sa), peer(1, sb)) is None and "could not map it" in t.unreachable[1]


# -- exported ranges (shmem_buffer_register) ------------------------------------------------------------


def test_export_a_sub_range_and_open_it_in_another_process(
    runtimes: Make, world: Any, gpu_backend: GpuBackend
) -> None:
    a = runtimes(pid=1000, device=0, world=world)
    b = runtimes(pid=1001, device=1, world=world)
    a.create_segment(4 * MiB, "t.0")
    st = a.bound_device()
    with st.active():
        tensor = st.drv.mem_alloc(1 * MiB)  # what torch's allocator would hand out
    _fill(tensor + 12345, bytes(range(200)))
    handle = a.export_range(tensor + 12345, 200)
    h = gpu_backend.vendor.handle_class.unpack(handle)
    assert (h.kind, h.offset, h.size, h.addr, h.pid) == (KIND_RANGE, 12345, 200, tensor + 12345, 1000)
    seg = b.open_range(handle)  # b had no heap yet: binds to its device
    assert seg.size == 200 and _bytes(seg.addr, 200) == bytes(range(200))
    _fill(seg.addr, b"\xff")
    assert _bytes(tensor + 12345, 1) == b"\xff"
    # this process's own export is not mapped again
    own = a.open_range(handle)
    assert own.addr == tensor + 12345
    own.close()
    seg.close()
    assert b.lib.opened == {}


def test_export_range_errors(runtimes: Make, gpu_backend: GpuBackend) -> None:
    rt = runtimes(pid=1000)
    seg = rt.create_segment(4 * MiB, "t.0")
    st = rt.bound_device()
    with st.active():
        tensor = st.drv.mem_alloc(4096)
    with pytest.raises(MoriValueError, match=r"\[0x[0-9a-f]+, \+16\) runs past the end of its allocation"):
        rt.export_range(tensor + 4088, 16)
    host = (ctypes.c_uint8 * 64)()
    with pytest.raises(
        MoriValueError, match=f"is not GPU memory allocated with {gpu_backend.vendor.alloc_functions}"
    ):
        rt.export_range(ctypes.addressof(host), 64)
    with pytest.raises(MoriValueError, match="size=0"):
        rt.export_range(seg.addr, 0)
    with pytest.raises(MoriValueError, match="not an exported range"):
        rt.open_range(seg.handle)
    rt.lib.fail[gpu_backend.call("ipc_get")] = 1
    with pytest.raises(MoriBackendError, match=f"cannot be shared with {gpu_backend.vendor.ipc_name}"):
        rt.export_range(seg.addr, 64)


# -- copies ---------------------------------------------------------------------------------------------


def test_copy_is_ordered_after_the_current_stream_and_synchronous(
    runtimes: Make, gpu_backend: GpuBackend
) -> None:
    rt = runtimes()
    seg = rt.create_segment(4 * MiB, "t.0")
    _fill(seg.addr, b"0123456789")
    rt.lib.calls.clear()
    rt.copy(seg.addr + 1000, seg.addr, 10)
    assert _bytes(seg.addr + 1000, 10) == b"0123456789"
    calls = [c for c in rt.lib.calls if c not in gpu_backend.context_calls]
    assert calls == gpu_backend.copy_calls
    rt.copy(seg.addr, seg.addr, 0)
    with pytest.raises(ValueError, match="null address"):
        rt.copy(0, seg.addr, 4)


@pytest.mark.parametrize("shift", [-37, -1, 1, 5, 300])
def test_overlapping_copies_behave_like_memmove(
    runtimes: Make, monkeypatch: pytest.MonkeyPatch, shift: int
) -> None:
    monkeypatch.setattr(gpu_runtime_module, "SCRATCH_MAX", 64)  # many chunks through the scratch buffer
    rt = runtimes()
    seg = rt.create_segment(4 * MiB, "t.0")
    data = bytes((i * 7 + 3) % 256 for i in range(1000))
    base = seg.addr + 4096
    _fill(base, data)
    expect = bytearray(data + bytes(400))
    n = 600
    expect[100 + shift : 100 + shift + n] = expect[100 : 100 + n]
    rt.copy(base + 100 + shift, base + 100, n)
    assert _bytes(base, 1000) == bytes(expect[:1000])


# -- atomics and waits ------------------------------------------------------------------------------------


_ALL_WORDS = [
    (WORD_INT32, -(2**31), 2**31 - 1),
    (WORD_UINT32, 0, 2**32 - 1),
    (WORD_INT64, -(2**63), 2**63 - 1),
    (WORD_UINT64, 0, 2**64 - 1),
]


@pytest.mark.parametrize(("word", "lo", "hi"), _ALL_WORDS)
def test_atomics_every_op_and_word(
    runtimes: Make, interpreted_atomics: ModuleType, word: int, lo: int, hi: int
) -> None:
    rt = runtimes(kernels=interpreted_atomics)
    seg = rt.create_segment(4 * MiB, "t.0")
    w = seg.addr + 64
    bits = 32 if word in (WORD_INT32, WORD_UINT32) else 64
    mask = (1 << bits) - 1

    def wrap(v: int) -> int:  # what a word of this type holds after v is stored
        v &= mask
        return v - (1 << bits) if lo < 0 and v > hi else v

    assert rt.atomic_rmw(w, OP_SET, word, 5) == 0
    assert rt.atomic_rmw(w, OP_FETCH, word, 0) == 5
    assert rt.atomic_rmw(w, OP_ADD, word, 3) == 5
    assert rt.atomic_rmw(w, OP_SWAP, word, 0b1100) == 8
    assert rt.atomic_rmw(w, OP_AND, word, 0b1010) == 0b1100
    assert rt.atomic_rmw(w, OP_OR, word, 0b0101) == 0b1000
    assert rt.atomic_rmw(w, OP_XOR, word, 0b0011) == 0b1101
    assert rt.atomic_rmw(w, OP_FETCH, word, 0) == 0b1110
    assert rt.atomic_compare_swap(w, word, 1, 2) == 0b1110  # no swap
    assert rt.atomic_compare_swap(w, word, 0b1110, hi) == 0b1110  # swap to the largest value
    assert rt.atomic_rmw(w, OP_ADD, word, 1) == hi  # and wrap around
    assert rt.atomic_rmw(w, OP_FETCH, word, 0) == wrap(hi + 1) == lo
    assert rt.atomic_rmw(w, OP_SET, word, lo) == lo
    assert rt.atomic_compare_swap(w, word, lo, -1 if lo < 0 else hi) == lo
    assert rt.atomic_rmw(w, OP_FETCH, word, 0) == (-1 if lo < 0 else hi)
    # the words around it are untouched
    assert _bytes(seg.addr, 64) == bytes(64) and _bytes(w + bits // 8, 64) == bytes(64)


def test_atomic_argument_errors_match_the_cpu_runtime(runtimes: Make) -> None:
    rt = runtimes()
    seg = rt.create_segment(4 * MiB, "t.0")
    with pytest.raises(ValueError, match="value 4294967296 does not fit the atomic word"):
        rt.atomic_rmw(seg.addr, OP_SET, WORD_UINT32, 2**32)
    with pytest.raises(ValueError, match="value -1 does not fit the atomic word"):
        rt.atomic_compare_swap(seg.addr, WORD_UINT64, -1, 0)
    with pytest.raises(ValueError, match="is not aligned to 8 bytes"):
        rt.atomic_rmw(seg.addr + 4, OP_ADD, WORD_INT64, 1)
    with pytest.raises(ValueError, match="address is 0"):
        rt.atomic_rmw(0, OP_ADD, WORD_INT64, 1)
    with pytest.raises(ValueError, match="unknown atomic op 9"):
        rt.atomic_rmw(seg.addr, 9, WORD_INT64, 1)
    with pytest.raises(ValueError, match="unknown word type 4"):
        rt.atomic_rmw(seg.addr, OP_ADD, 4, 1)
    with pytest.raises(ValueError, match="unknown comparison 6"):
        rt.wait_until(seg.addr, 6, WORD_INT64, 1, 0)


def test_wait_until_polls_with_a_timeout_and_wakes_up(runtimes: Make) -> None:
    rt = runtimes()
    seg = rt.create_segment(4 * MiB, "t.0")
    w = seg.addr + 8
    ctypes.c_int64.from_address(w).value = 10
    for cmp, value in ((0, 10), (1, 3), (2, 9), (3, 10), (4, 11), (5, 10)):
        assert rt.wait_until(w, cmp, WORD_INT64, value, 1.0) == (True, 10)
    t0 = time.monotonic()
    assert rt.wait_until(w, 2, WORD_INT64, 10, 0.2) == (False, 10)
    assert 0.2 <= time.monotonic() - t0 < 1.0

    def later() -> None:
        time.sleep(0.1)
        ctypes.c_uint32.from_address(w).value = 2**32 - 1

    thread = threading.Thread(target=later)
    thread.start()
    t0 = time.monotonic()
    assert rt.wait_until(w, 0, WORD_UINT32, 2**32 - 1, 5.0) == (True, 2**32 - 1)
    assert time.monotonic() - t0 >= 0.09
    thread.join()
    with pytest.raises(ValueError, match="does not fit"):
        rt.wait_until(w, 0, WORD_INT32, 2**31, 0)


def test_fence_synchronises_the_context_and_access_needs_a_device(
    runtimes: Make, gpu_backend: GpuBackend
) -> None:
    rt = runtimes()
    rt.fence()  # nothing to order yet
    with pytest.raises(
        MoriStateError, match=f"byte_view: the {gpu_backend.vendor.runtime} runtime has no device yet"
    ):
        rt.byte_view(4096, 8)
    rt.create_segment(4 * MiB, "t.0")
    rt.lib.calls.clear()
    rt.fence()
    assert gpu_backend.call("synchronize") in rt.lib.calls


def test_driver_failures_surface_as_backend_errors(runtimes: Make, gpu_backend: GpuBackend) -> None:
    rt = runtimes()
    seg = rt.create_segment(4 * MiB, "t.0")
    rt.lib.fail[gpu_backend.call("memcpy")] = 700
    with pytest.raises(gpu_backend.vendor.error_class, match=gpu_backend.memcpy_failure):
        rt.copy(seg.addr, seg.addr + 64, 8)


# -- copy engine ------------------------------------------------------------------------------------------


def test_copy_engine_round_robin_tickets_and_quiet(runtimes: Make, gpu_backend: GpuBackend) -> None:
    rt = runtimes()
    seg = rt.create_segment(4 * MiB, "t.0")
    engine = rt.copy_engine()
    assert engine is rt.copy_engine() and engine.streams == 4
    _fill(seg.addr, bytes(range(256)))
    tickets = [engine.copy_async(seg.addr + 4096 * (i + 1), seg.addr, 256) for i in range(5)]
    assert [t.stream for t in tickets] == [0, 1, 2, 3, 0]
    assert all(_bytes(seg.addr + 4096 * (i + 1), 256) == bytes(range(256)) for i in range(5))
    rt.lib.not_ready.update(rt.lib.events)  # every copy still in flight
    assert not tickets[0].done()
    tickets[0].wait()
    assert tickets[0].completed and tickets[0].done()
    with tickets[1] as t:
        assert t is tickets[1]
    assert tickets[1].completed
    engine.quiet()
    assert all(t.completed for t in tickets)
    assert repr(tickets[0]) == "CopyTicket(256 bytes on stream 0, completed)"
    events = len(rt.lib.events)
    rt.lib.calls.clear()
    reused = engine.copy_async(seg.addr + 8192, seg.addr, 16, after_current_stream=False)
    assert len(rt.lib.events) == events, "a retired ticket's event is reused"
    assert gpu_backend.copy_calls[1] not in rt.lib.calls
    reused.wait()
    with pytest.raises(MoriValueError, match="overlap"):
        engine.copy_async(seg.addr + 8, seg.addr, 16)
    with pytest.raises(MoriValueError, match="nbytes=-1"):
        engine.copy_async(seg.addr, seg.addr + 64, -1)
    engine.close()
    with pytest.raises(MoriStateError, match="closed"):
        engine.copy_async(seg.addr + 64, seg.addr, 8)


# -- segment handles -----------------------------------------------------------------------------------


def _handle(gpu_backend: GpuBackend, **kw: Any) -> Any:
    fields: dict[str, Any] = {
        "kind": KIND_RANGE,
        "pid": 4_000_000_000,
        "ordinal": 7,
        "pci": PciAddress.parse(gpu_backend.fake_lib.DEVICES[0].upper()),
        "addr": 0x7F00_1234_5000,
        "offset": 12345,
        "size": 2**40 + 3,
        "ipc": bytes(range(gpu_backend.vendor.ipc_handle_size)),
    }
    fields.update(kw)
    return gpu_backend.vendor.handle_class(**fields)


def test_handle_round_trip(gpu_backend: GpuBackend) -> None:
    cls = gpu_backend.vendor.handle_class
    h = _handle(gpu_backend)
    data = h.pack()
    assert len(data) == cls.SIZE == 112 and data[:4] == gpu_backend.vendor.handle_magic
    assert cls.unpack(data) == h and cls.unpack(bytearray(data)) == h
    assert cls.unpack(_handle(gpu_backend, kind=KIND_HEAP, offset=0).pack()).kind == KIND_HEAP


def test_foreign_or_corrupt_handles_are_refused_clearly(gpu_backend: GpuBackend) -> None:
    cls = gpu_backend.vendor.handle_class
    package = gpu_backend.vendor.distribution
    with pytest.raises(MoriValueError, match=rf"PE 3's heap is not a {package} handle.*b'/mor'"):
        cls.unpack(b"/mori-heap.123.abc.3", what="PE 3's heap")  # a cpu rank's heap name
    with pytest.raises(MoriValueError, match=rf"not a {package} handle.*b'MGPU'"):
        cls.unpack(b"MGPU" + bytes(cls.SIZE - 4))  # another vendor's magic
    newer = bytearray(_handle(gpu_backend).pack())
    newer[4] = 9
    with pytest.raises(MoriValueError, match="format version 9"):
        cls.unpack(bytes(newer))
    odd = bytearray(_handle(gpu_backend).pack())
    odd[5] = 5
    with pytest.raises(MoriValueError, match="unknown kind 5"):
        cls.unpack(bytes(odd))
    with pytest.raises(MoriValueError, match="expected bytes"):
        not_bytes: Any = "MNVL"  # what an untyped caller may pass
        cls.unpack(not_bytes)
    with pytest.raises(MoriValueError, match="63 bytes"):
        _handle(gpu_backend, ipc=b"x" * 63).pack()


# -- the driver binding --------------------------------------------------------------------------------


def test_failed_calls_name_the_call_and_the_result(gpu_backend: GpuBackend) -> None:
    drv = gpu_backend.driver_class(gpu_backend.fake_lib(), "fake")
    sync = gpu_backend.call("synchronize")
    drv.lib.fail[sync] = 2
    with pytest.raises(gpu_backend.vendor.error_class) as info:
        drv.synchronize()
    e = info.value
    name = gpu_backend.driver_class.RESULT_NAMES[2]
    assert str(e) == f"{sync} failed: {name} (2): out of memory"
    assert (e.call, e.code, e.result) == (sync, 2, name) and isinstance(e, MoriBackendError)
    drv.lib.fail[sync] = 12345  # a code neither the driver nor MORI can name
    with pytest.raises(gpu_backend.vendor.error_class, match=rf"^{sync} failed: .* \(12345\): "):
        drv.synchronize()


def test_a_missing_function_says_the_driver_is_too_old(gpu_backend: GpuBackend) -> None:
    lib = gpu_backend.fake_lib()
    lib.hide.add(gpu_backend.call("event_create"))
    drv = gpu_backend.driver_class(lib, "fake")
    with pytest.raises(
        MoriBackendError,
        match=f"fake has no function {gpu_backend.call('event_create')}: {re.escape(drv.TOO_OLD)}",
    ):
        drv.event_create()


def test_event_query_distinguishes_not_ready_from_errors(gpu_backend: GpuBackend) -> None:
    lib = gpu_backend.fake_lib()
    drv = gpu_backend.driver_class(lib, "fake")
    ev = drv.event_create()
    assert drv.event_query(ev)
    lib.not_ready.add(ev)
    assert not drv.event_query(ev)
    lib.fail[gpu_backend.call("event_query")] = 400
    with pytest.raises(gpu_backend.vendor.error_class, match=f"{gpu_backend.call('event_query')} failed"):
        drv.event_query(ev)


def test_library_lookup(gpu_backend: GpuBackend, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    vendor = dataclasses.replace(gpu_backend.vendor)  # a fresh cache of loaded drivers
    env = vendor.library_env.name
    missing = str(tmp_path / gpu_backend.library)
    monkeypatch.setenv(env, missing)
    with pytest.raises(MoriBackendError, match=rf"{missing} not found: {vendor.missing} \(or set {env}\)"):
        vendor.load_driver()
    garbage = tmp_path / "garbage.so"
    garbage.write_bytes(b"not an ELF file")
    monkeypatch.setenv(env, str(garbage))
    with pytest.raises(MoriBackendError, match=r"garbage\.so cannot be loaded"):
        vendor.load_driver()
    monkeypatch.setenv(env, "libc.so.6")  # any library loads; driver calls would fail later
    drv = vendor.load_driver()
    assert isinstance(drv, vendor.driver_class) and drv.path == "libc.so.6"
    assert vendor.load_driver() is drv, "loaded once per process"

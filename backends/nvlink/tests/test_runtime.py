"""The cuda runtime, transport and copy engine on a fake driver: the real code paths without a GPU.

Each fake runtime plays one process of a node (its own pid and fake library, one shared "world");
"device memory" is host memory, so results are checked by reading it. Host atomics run the real
Triton kernel in the interpreter.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
from mori_backend_nvlink import runtime as rt_module
from mori_backend_nvlink.driver import CudaDriver, CudaError
from mori_backend_nvlink.handles import KIND_HEAP, KIND_RANGE, PciAddress, SegmentHandle
from mori_backend_nvlink.transport import P2PTransport

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

Make = Callable[..., Any]
MiB = 1 << 20


def _peer(
    rank: int, seg: Any, *, node: str = "node-a", runtime: str = "cuda", size: int = 4 * MiB
) -> PeerInfo:
    return PeerInfo(rank, node, "host", 1000 + rank, runtime, size, seg.handle)


def _bytes(addr: int, n: int) -> bytes:
    return ctypes.string_at(addr, n)


def _fill(addr: int, data: bytes) -> None:
    ctypes.memmove(addr, data, len(data))


# -- availability -------------------------------------------------------------------------------------


def test_probe_reports_why_it_cannot_work(fake: ModuleType) -> None:
    def missing() -> CudaDriver:
        raise MoriBackendError("libcuda.so.1 not found: no NVIDIA driver on this machine")

    assert rt_module.CudaRuntime(load=missing).probe().reason.startswith("libcuda.so.1 not found")
    no_gpu = fake.FakeCudaLib(init_result=100)
    avail = rt_module.CudaRuntime(load=lambda: CudaDriver(no_gpu)).probe()
    assert not avail.usable and avail.reason == "no CUDA device (cuInit: CUDA_ERROR_NO_DEVICE)"
    none = fake.FakeCudaLib(devices=())
    assert (
        rt_module.CudaRuntime(load=lambda: CudaDriver(none)).probe().reason
        == "no CUDA device (cuDeviceGetCount = 0)"
    )

    def broken() -> CudaDriver:
        raise RuntimeError("boom")

    assert rt_module.CudaRuntime(load=broken).probe().reason == "RuntimeError: boom"  # never raises


def test_probe_with_a_gpu_checks_torch_and_triton(fake: ModuleType) -> None:
    import torch

    avail = rt_module.CudaRuntime(load=lambda: CudaDriver(fake.FakeCudaLib(), "libfake.so")).probe()
    if torch.version.cuda is None:
        assert not avail.usable and avail.reason == f"torch {torch.__version__} is not a CUDA build"
    else:
        assert avail.usable and avail.reason == "2 CUDA device(s), driver 13.0 (libfake.so)"


# -- heap segments --------------------------------------------------------------------------------------


def test_heap_segment_is_aligned_zeroed_and_exported(runtimes: Make) -> None:
    rt = runtimes(pid=1000)
    seg = rt.create_segment(4 * MiB, "t.0")
    assert seg.addr % (2 * MiB) == 0 and seg.size == 4 * MiB
    assert _bytes(seg.addr, 4096) == bytes(4096) and _bytes(seg.addr + 4 * MiB - 64, 64) == bytes(64)
    h = SegmentHandle.unpack(seg.handle)
    assert (h.kind, h.pid, h.ordinal, h.pci, h.addr, h.size) == (
        KIND_HEAP,
        1000,
        0,
        PciAddress.parse("0000:1b:00.0"),
        seg.addr,
        4 * MiB,
    )
    assert rt.device_index == 0
    seg.close()
    seg.close()  # twice is harmless
    assert rt.lib.allocs == {} or all(a != seg.addr for a in rt.lib.allocs)


def test_only_the_static_heap_is_supported(runtimes: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MORI_SHMEM_MODE", "vmm_heap")
    with pytest.raises(
        MoriValueError, match=r"MORI_SHMEM_MODE='vmm_heap' is not supported by the cuda runtime"
    ):
        runtimes().create_segment(4 * MiB, "t.0")


def test_out_of_memory_says_what_to_change(runtimes: Make) -> None:
    rt = runtimes()
    rt.lib.fail["cuMemAlloc_v2"] = 2
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


def test_opening_a_foreign_handle_fails_clearly(runtimes: Make) -> None:
    rt = runtimes(pid=1000)
    rt.create_segment(4 * MiB, "t.0")

    class CpuSegment:
        handle = b"/mori-heap.77.abc.1"

    with pytest.raises(MoriValueError, match="the heap handle of PE 1 is not a mori-backend-nvlink handle"):
        rt.open_peer_segment(_peer(1, CpuSegment()))


def test_p2p_transport_connects_only_what_load_store_reaches(runtimes: Make, world: Any) -> None:
    a = runtimes(pid=1000, device=0, world=world)
    b = runtimes(pid=1001, device=1, world=world, peer_access=False)
    c = runtimes(pid=1002, device=0, world=world)
    sa, sb, sc = (r.create_segment(4 * MiB, f"t.{i}") for i, r in enumerate((a, b, c)))
    me_a, me_b, me_c = _peer(0, sa), _peer(1, sb), _peer(2, sc)
    t = P2PTransport(a)
    # same node, same GPU (two ranks sharing one): mapped
    assert a.can_reach(me_c) == (True, "same GPU")
    seg = t.connect(a, me_a, me_c)
    assert seg is not None and seg.addr != sc.addr
    # another GPU with peer access
    assert a.can_reach(me_b) == (True, "peer access to GPU 0000:2c:00.0")
    assert t.connect(a, me_a, me_b) is not None
    # without peer access, another node, another runtime: not this transport's peer
    tb = P2PTransport(b)
    assert (
        tb.connect(b, me_b, me_a) is None and "cuDeviceCanAccessPeer(cuda:1, cuda:0) = 0" in tb.unreachable[0]
    )
    assert t.connect(a, me_a, _peer(2, sc, node="node-b")) is None and "node-b" in t.unreachable[2]
    assert t.connect(a, me_a, _peer(2, sc, runtime="hip")) is None

    class Other:
        name = "cpu"

    assert t.connect(Other(), me_a, me_c) is None  # type: ignore[arg-type]


def test_a_gpu_not_visible_here_is_left_to_the_driver(runtimes: Make, world: Any) -> None:
    a = runtimes(pid=1000, device=0, world=world, devices=("0000:1b:00.0",))
    b = runtimes(pid=1001, device=1, world=world)
    sa, sb = a.create_segment(4 * MiB, "t.0"), b.create_segment(4 * MiB, "t.1")
    ok, why = a.can_reach(_peer(1, sb))
    assert ok and "not visible" in why
    seg = P2PTransport(a).connect(a, _peer(0, sa), _peer(1, sb))
    assert seg is not None
    seg.close()
    a.lib.fail["cuIpcOpenMemHandle_v2"] = 217
    t = P2PTransport(a)
    assert t.connect(a, _peer(0, sa), _peer(1, sb)) is None and "could not map it" in t.unreachable[1]


# -- exported ranges (shmem_buffer_register) ------------------------------------------------------------


def test_export_a_sub_range_and_open_it_in_another_process(runtimes: Make, world: Any) -> None:
    a = runtimes(pid=1000, device=0, world=world)
    b = runtimes(pid=1001, device=1, world=world)
    a.create_segment(4 * MiB, "t.0")
    st = a._state
    with st.active():
        tensor = st.drv.mem_alloc(1 * MiB)  # what torch's allocator would hand out
    _fill(tensor + 12345, bytes(range(200)))
    handle = a.export_range(tensor + 12345, 200)
    h = SegmentHandle.unpack(handle)
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


def test_export_range_errors(runtimes: Make) -> None:
    rt = runtimes(pid=1000)
    seg = rt.create_segment(4 * MiB, "t.0")
    with rt._state.active():
        tensor = rt._state.drv.mem_alloc(4096)
    with pytest.raises(MoriValueError, match=r"\[0x[0-9a-f]+, \+16\) runs past the end of its allocation"):
        rt.export_range(tensor + 4088, 16)
    host = (ctypes.c_uint8 * 64)()
    with pytest.raises(MoriValueError, match="is not GPU memory allocated with cudaMalloc"):
        rt.export_range(ctypes.addressof(host), 64)
    with pytest.raises(MoriValueError, match="size=0"):
        rt.export_range(seg.addr, 0)
    with pytest.raises(MoriValueError, match="not an exported range"):
        rt.open_range(seg.handle)
    rt.lib.fail["cuIpcGetMemHandle"] = 1
    with pytest.raises(MoriBackendError, match="cannot be shared with CUDA IPC"):
        rt.export_range(seg.addr, 64)


# -- copies ---------------------------------------------------------------------------------------------


def test_copy_is_ordered_after_the_current_stream_and_synchronous(runtimes: Make) -> None:
    rt = runtimes()
    seg = rt.create_segment(4 * MiB, "t.0")
    _fill(seg.addr, b"0123456789")
    rt.lib.calls.clear()
    rt.copy(seg.addr + 1000, seg.addr, 10)
    assert _bytes(seg.addr + 1000, 10) == b"0123456789"
    calls = [c for c in rt.lib.calls if not c.startswith("cuCtx")]
    assert calls == ["cuEventRecord", "cuStreamWaitEvent", "cuMemcpyAsync", "cuStreamSynchronize"]
    rt.copy(seg.addr, seg.addr, 0)
    with pytest.raises(ValueError, match="null address"):
        rt.copy(0, seg.addr, 4)


@pytest.mark.parametrize("shift", [-37, -1, 1, 5, 300])
def test_overlapping_copies_behave_like_memmove(
    runtimes: Make, monkeypatch: pytest.MonkeyPatch, shift: int
) -> None:
    monkeypatch.setattr(rt_module, "SCRATCH_MAX", 64)  # many chunks through the scratch buffer
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


def test_fence_synchronises_the_context_and_access_needs_a_device(runtimes: Make) -> None:
    rt = runtimes()
    rt.fence()  # nothing to order yet
    with pytest.raises(MoriStateError, match="byte_view: the cuda runtime has no device yet"):
        rt.byte_view(4096, 8)
    rt.create_segment(4 * MiB, "t.0")
    rt.lib.calls.clear()
    rt.fence()
    assert "cuCtxSynchronize" in rt.lib.calls


def test_calls_run_in_the_gpus_primary_context_and_restore_the_callers(runtimes: Make) -> None:
    rt = runtimes(device=1)
    seg = rt.create_segment(4 * MiB, "t.0")
    assert rt.lib.current == 0xC001  # no context was current: ours stays (it is the one torch picks)
    rt.lib.current = 0xBEEF  # another library's context
    rt.copy(seg.addr + 64, seg.addr, 8)
    assert rt.lib.current == 0xBEEF
    sets = [c for c in rt.lib.calls if c == "cuCtxSetCurrent"]
    assert len(sets) >= 3


def test_driver_failures_surface_as_backend_errors(runtimes: Make) -> None:
    rt = runtimes()
    seg = rt.create_segment(4 * MiB, "t.0")
    rt.lib.fail["cuMemcpyAsync"] = 700
    with pytest.raises(CudaError, match=r"cuMemcpyAsync failed: CUresult 700|CUDA_ERROR_ILLEGAL_ADDRESS"):
        rt.copy(seg.addr, seg.addr + 64, 8)


# -- copy engine ------------------------------------------------------------------------------------------


def test_copy_engine_round_robin_tickets_and_quiet(runtimes: Make) -> None:
    rt = runtimes()
    seg = rt.create_segment(4 * MiB, "t.0")
    engine = rt.copy_engine()
    assert engine is rt.copy_engine() and engine.streams == 4
    _fill(seg.addr, bytes(range(256)))
    tickets = [engine.copy_async(seg.addr + 4096 * (i + 1), seg.addr, 256) for i in range(5)]
    assert [t.stream for t in tickets] == [0, 1, 2, 3, 0]
    assert all(_bytes(seg.addr + 4096 * (i + 1), 256) == bytes(range(256)) for i in range(5))
    rt.lib.not_ready.add(tickets[0]._event)
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
    assert "cuStreamWaitEvent" not in rt.lib.calls
    reused.wait()
    with pytest.raises(MoriValueError, match="overlap"):
        engine.copy_async(seg.addr + 8, seg.addr, 16)
    with pytest.raises(MoriValueError, match="nbytes=-1"):
        engine.copy_async(seg.addr, seg.addr + 64, -1)
    engine.close()
    with pytest.raises(MoriStateError, match="closed"):
        engine.copy_async(seg.addr + 64, seg.addr, 8)

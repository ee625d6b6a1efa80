"""The GPU tests of the SHMEM host API on GPU memory and the Triton device API, across processes,
on real GPUs, whichever vendor's: the runtime is the installed device plugin's that serves this
machine's torch (:func:`machine_gpu_runtime`: ``cuda`` on NVIDIA GPUs, ``hip`` on AMD ones).

A test module marked ``gpu`` gives a :class:`GpuShmemBackend` in a ``gpu_shmem`` fixture
(:func:`machine_backend`) and imports the ``test_*`` functions, which pytest then runs there; each
skips (with the reason) where torch sees no GPU or fewer than it needs, and fails where a GPU is
there but no installed plugin serves it.

Every rank selects its GPU before ``shmem_init`` (``before_init=_set_device``): rank r uses GPU
``r % GPUS``, so 4 and 8 ranks on 2 GPUs put several ranks on one GPU. Rank functions are module
level (the launcher imports them in the ranks) and import torch and mori inside.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from mori.testing import shmem_ranks

__all__ = [
    "GpuShmemBackend",
    "cuda_memory_transport",
    "machine_backend",
    "machine_gpu_runtime",
    "test_atomics_waits_and_barriers",
    "test_device_api_atomics_on_two_gpus",
    "test_device_api_put_get_on_two_gpus",
    "test_device_api_put_signal_on_two_gpus",
    "test_device_api_wait_until_and_barrier_on_two_gpus",
    "test_exported_sub_range_opened_by_another_process",
    "test_heap_pointers_and_views",
    "test_put_get_exact_bytes_and_signals",
]

HEAP = "256M"
TIMEOUT = 180.0  # first runs compile Triton kernels in every rank
_GPUS_VAR = "MORI_TEST_GPUS"
_KERNELS_VAR = "MORI_TEST_DEVICE_KERNELS"

#: (ranks, GPUs they share)
CONFIGS = [
    pytest.param(2, 1, id="1gpu-2ranks"),
    pytest.param(2, 2, id="2gpus-2ranks"),
    pytest.param(4, 2, id="2gpus-4ranks"),
    pytest.param(8, 2, id="2gpus-8ranks"),
]


@dataclass(frozen=True)
class GpuShmemBackend:
    """What the GPU tests need to know: the device runtime's name (``MORI_DEVICE_RUNTIME``), the test
    kernels over the device API (packages/mori-core/tests/_device_kernels.py) and the environment
    every rank of the exported-range test gets in addition (allocator settings)."""

    runtime: str
    kernels: Path
    export_env: dict[str, str]


#: torch's caching allocator must hand out plain allocations for export_range (CUDA and ROCm names)
EXPORT_ENV = {
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False",
    "PYTORCH_HIP_ALLOC_CONF": "expandable_segments:False",
}


def cuda_memory_transport() -> str | None:
    """The network transport that moves CUDA memory on this machine (``"ucx"`` when its plugin
    is installed and its UCX has CUDA support), or None (also without a GPU; tcp moves host memory
    only). For the skip condition of tests that send GPU heaps through the proxy."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        from mori.core.transport import CAP_CUDA_MEMORY, find_network_transport, open_transport

        t = find_network_transport("ucx")
        return "ucx" if open_transport(t.ops(), t.options()).caps & CAP_CUDA_MEMORY else None
    except Exception:
        return None


def machine_gpu_runtime() -> str:
    """The name of the installed GPU device runtime that serves this machine's torch (its vendor's
    build, ``torch.cuda.is_available()``); skips the test where torch sees no GPU, fails it where no
    installed device plugin serves the one it sees."""
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip(f"needs a GPU: torch {torch.__version__} has torch.cuda.is_available() = False")
    from mori.core.gpu.runtime import GpuRuntime
    from mori.core.plugins import get_plugins

    found = [f.backend for f in get_plugins().runtimes() if isinstance(f.backend, GpuRuntime)]
    for rt in found:
        if rt.vendor.torch_build_ok(torch):
            return rt.name
    names = ", ".join(f"{rt.name} ({rt.package})" for rt in found) or "none"
    pytest.fail(
        f"no installed GPU device plugin serves torch {torch.__version__}; installed GPU runtimes: {names}"
    )


def machine_backend(kernels: Path) -> GpuShmemBackend:
    """The :class:`GpuShmemBackend` of this machine (:func:`machine_gpu_runtime`)."""
    return GpuShmemBackend(runtime=machine_gpu_runtime(), kernels=kernels, export_env=EXPORT_ENV)


def _need(gpus: int) -> None:
    import torch

    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs, torch sees {torch.cuda.device_count()}")


def _set_device(rank: int, nranks: int) -> None:
    import torch

    torch.cuda.set_device(rank % int(os.environ[_GPUS_VAR]))


def _run(
    backend: GpuShmemBackend, fn: Any, nranks: int, gpus: int, *args: Any, env: dict[str, str] | None = None
) -> list[Any]:
    _need(gpus)
    full = {
        "MORI_DEVICE_RUNTIME": backend.runtime,
        "MORI_SHMEM_HEAP_SIZE": HEAP,
        _GPUS_VAR: str(gpus),
        _KERNELS_VAR: str(backend.kernels),
        **(env or {}),
    }
    return shmem_ranks(fn, nranks, *args, timeout=TIMEOUT, env=full, before_init=_set_device)


def _device() -> Any:
    import torch

    return torch.device("cuda", torch.cuda.current_device())


def _pattern(seed: int, nbytes: int, dtype: Any = None) -> Any:
    """Deterministic bytes (any rank can rebuild another's), made on this rank's GPU, viewed as dtype."""
    import torch

    i = torch.arange(nbytes, dtype=torch.int64, device=_device())
    data = ((i * 2654435761 + seed * 40503) >> 7).remainder(251).to(torch.uint8)
    return data if dtype is None else data.view(dtype)


def _int(t: Any) -> int:
    """A one-element tensor as an int; uint64 as its int64 bits."""
    import torch

    return int(t.reshape(()).view(torch.int64)) if t.dtype == torch.uint64 else int(t.reshape(()))


# -- host API: heap, pointers, views ---------------------------------------------------------------


def _heap_and_views(rank: int, n: int) -> None:
    import torch

    import mori.shmem as sh
    from mori.shmem.context import current

    dev = _device()
    right, left = (rank + 1) % n, (rank - 1) % n
    info = sh.shmem_heap_info()
    assert info["runtime"] == os.environ["MORI_DEVICE_RUNTIME"] and all(info["peers_reachable"]), info
    assert current("test").runtime.device_index == dev.index
    # malloc / align / free
    a = sh.shmem_malloc(1000)
    b = sh.shmem_malloc_align(4096, 12)
    c = sh.shmem_malloc_align(2 << 20, 100)
    assert a % 256 == 0 and b % 4096 == 0 and c % (2 << 20) == 0 and len({a, b, c}) == 3
    sh.shmem_free(b)
    sh.shmem_free(c)
    d = sh.shmem_ext_malloc_with_flags(64)
    # every peer is load/store reachable; its copy of a is at its own address here
    ptrs = [sh.shmem_ptr_p2p(a, rank, p) for p in range(n)]
    assert ptrs[rank] == a and all(ptrs) and len(set(ptrs)) == n, ptrs
    assert sh.shmem_ptr_p2p(4096, rank, right) == 0
    # views on self and on every peer are tensors on this GPU over that PE's memory
    t = sh.shmem_tensor_view(a, 250, torch.int32)
    assert t.device == dev and t.data_ptr() == a and getattr(t, "__symm_tensor__", False)
    t.fill_(rank * 10)
    sh.shmem_barrier_all()
    for p in range(n):
        v = sh.shmem_tensor_view(a, 250, torch.int32, pe=p)
        assert v.device == dev and v.data_ptr() == ptrs[p]
        assert bool((v == p * 10).all()), f"PE {rank} reading PE {p}: {v[:4].tolist()}"
    x = sh.mori_shmem_create_tensor((4, 8), torch.float32)
    assert x.device == dev and x.shape == (4, 8)
    x.fill_(float(rank))
    sh.shmem_barrier_all()
    for p in range(n):
        assert bool((sh.symm_mori_shmem_tensor(x, p) == p).all())
    col = sh.symm_mori_shmem_tensor(x[:, 3], right)
    assert col.stride() == (8,) and col.device == dev and bool((col == right).all())
    sh.shmem_barrier_all()
    sh.symm_mori_shmem_tensor(x, right)[rank % 4, 0] = 100.0 + rank  # a store into the peer's memory
    sh.shmem_barrier_all()
    assert float(x[left % 4, 0]) == 100.0 + left
    views = sh.mori_shmem_create_tensor_list_intra_node(16, torch.int64)
    assert len(views) == n and all(v.device == dev for v in views)
    views[rank].fill_(rank)
    sh.shmem_barrier_all()
    assert [int(v[0]) for v in views] == list(range(n))
    raw = sh.shmem_tensor_view(views[rank].data_ptr(), (2, 8), torch.int64, pe=right)
    assert bool((raw == right).all())
    sh.shmem_barrier_all()
    sh.mori_shmem_free_tensor(views[rank])
    sh.mori_shmem_free_tensor(x)
    sh.shmem_free(d)
    sh.shmem_free(a)
    try:
        from mori.shmem import device as shd
    except ImportError:
        return
    ctx = shd.shmem_device_context()
    assert ctx.device == dev and ctx.tolist()[:2] == [rank, n]


@pytest.mark.parametrize(("nranks", "gpus"), CONFIGS)
def test_heap_pointers_and_views(gpu_shmem: GpuShmemBackend, nranks: int, gpus: int) -> None:
    _run(gpu_shmem, _heap_and_views, nranks, gpus)


# -- host API: put / get / signals -------------------------------------------------------------------

SIZES = [0, 1, 7, 8, 4095, 65536 + 3, 1 << 20, 64 << 20]


def _put_get_signal(rank: int, n: int) -> None:
    import torch

    import mori.shmem as sh
    from mori.core.errors import MoriValueError

    right, left = (rank + 1) % n, (rank - 1) % n
    big = max(SIZES)
    src, dst, got = (sh.shmem_malloc(big + 1) for _ in range(3))
    src_v, dst_v, got_v = (sh.shmem_tensor_view(x, big + 1, torch.uint8) for x in (src, dst, got))
    src_v.copy_(_pattern(rank, big + 1))
    left_pattern = _pattern(left, big + 1)
    for nb in SIZES:
        dst_v.fill_(0)
        got_v.fill_(0)
        sh.shmem_barrier_all()
        sh.shmem_putmem(dst, src, nb, right)  # push my bytes to the right neighbour's dst
        sh.shmem_quiet()
        sh.shmem_barrier_all()
        assert torch.equal(dst_v[:nb], left_pattern[:nb]), f"put of {nb} B from PE {left}"
        assert int(dst_v[nb]) == 0, f"put of {nb} B wrote past its end"
        sh.shmem_getmem(got, src, nb, left)  # pull the left neighbour's src
        assert torch.equal(got_v[:nb], left_pattern[:nb]), f"get of {nb} B from PE {left}"
        assert int(got_v[nb]) == 0, f"get of {nb} B wrote past its end"
    sh.shmem_barrier_all()
    # a put to self with overlapping ranges behaves like memmove
    head = sh.shmem_tensor_view(src, 16, torch.uint8)
    before = head.clone()
    sh.shmem_putmem(src + 4, src, 8, rank)
    assert torch.equal(head[4:12], before[:8])
    sh.shmem_barrier_all()

    # registered local memory as the local side: a GPU tensor, and pageable host memory
    local = _pattern(1000 + rank, 4096)
    with pytest.raises(MoriValueError, match="shmem_buffer_register"):
        sh.shmem_putmem(dst, local.data_ptr(), 4096, right)
    sh.shmem_buffer_register(local.data_ptr(), 4096)
    sh.shmem_putmem(dst, local.data_ptr(), 4096, right)
    host = torch.zeros(4096, dtype=torch.uint8)
    sh.shmem_buffer_register(host.data_ptr(), 4096)
    sh.shmem_barrier_all()
    assert torch.equal(dst_v[:4096], _pattern(1000 + left, 4096))
    sh.shmem_getmem(host.data_ptr(), dst, 4096, right)  # the right neighbour's dst holds my bytes
    assert torch.equal(host, local.cpu())
    sh.shmem_buffer_deregister(local.data_ptr(), 4096)
    sh.shmem_buffer_deregister(host.data_ptr(), 4096)
    sh.shmem_barrier_all()
    for x in (got, dst, src):
        sh.shmem_free(x)

    # put with signal around the ring; the receiver waits on the host, then reads the data
    nb = 4096
    s_src, s_dst, sig, counter = (
        sh.shmem_malloc(nb),
        sh.shmem_malloc(nb),
        sh.shmem_malloc(8),
        sh.shmem_malloc(8),
    )
    s_src_v = sh.shmem_tensor_view(s_src, nb // 8, torch.int64)
    s_dst_v = sh.shmem_tensor_view(s_dst, nb // 8, torch.int64)
    sh.shmem_atomic_set(sig, 0, rank, dtype="uint64")
    sh.shmem_atomic_set(counter, 0, rank, dtype="uint64")
    sh.shmem_barrier_all()
    for r in range(1, 6):
        s_src_v.fill_(rank * 1000 + r)
        sh.shmem_putmem_signal(s_dst, s_src, nb, sig, r, sh.SIGNAL_SET, right)
        assert sh.shmem_wait_until(sig, sh.SHMEM_CMP_GE, r, dtype="uint64", timeout=30) == r
        assert bool((s_dst_v == left * 1000 + r).all()), f"round {r}: data arrived after its signal"
        sh.shmem_barrier_all()
    sh.shmem_putmem_signal(s_dst, s_src, 8, counter, rank + 1, sh.SIGNAL_ADD, 0)
    sh.shmem_signal_op(counter, 100, sh.SIGNAL_ADD, 0)
    sh.shmem_barrier_all()
    if rank == 0:
        assert sh.shmem_signal_fetch(counter) == sum(range(1, n + 1)) + 100 * n
    sh.shmem_barrier_all()


@pytest.mark.parametrize(("nranks", "gpus"), CONFIGS)
def test_put_get_exact_bytes_and_signals(gpu_shmem: GpuShmemBackend, nranks: int, gpus: int) -> None:
    _run(gpu_shmem, _put_get_signal, nranks, gpus)


# -- host API: atomics, waits, barriers -----------------------------------------------------------------


def _atomics_waits_barriers(rank: int, n: int) -> dict[str, float]:
    import torch

    import mori.shmem as sh
    from mori.core.errors import MoriTimeoutError, MoriValueError

    right = (rank + 1) % n
    word = sh.shmem_malloc(8)
    flag = sh.shmem_malloc(8)
    for dtype in ("int32", "uint32", "int64", "uint64"):
        sh.shmem_atomic_set(word, 0, rank, dtype=dtype)
        sh.shmem_barrier_all()
        # contended fetch-add on PE 0's word: the total is exact, each PE's fetched values grow
        iters = 40
        fetched = [sh.shmem_atomic_fetch_add(word, 1, 0, dtype=dtype) for _ in range(iters)]
        sh.shmem_atomic_add(word, 2, 0, dtype=dtype)
        sh.shmem_barrier_all()
        assert sh.shmem_atomic_fetch(word, 0, dtype=dtype) == n * (iters + 2), dtype
        assert fetched == sorted(fetched) and len(set(fetched)) == iters
        sh.shmem_barrier_all()
        # swap and compare-swap on the right neighbour's word
        sh.shmem_atomic_set(word, 5, rank, dtype=dtype)
        sh.shmem_barrier_all()
        assert sh.shmem_atomic_swap(word, 9, right, dtype=dtype) == 5
        sh.shmem_barrier_all()
        assert sh.shmem_atomic_compare_swap(word, 1, 2, right, dtype=dtype) == 9  # no swap
        assert sh.shmem_atomic_compare_swap(word, 9, 3, right, dtype=dtype) == 9  # swap
        sh.shmem_barrier_all()
        assert sh.shmem_atomic_fetch(word, rank, dtype=dtype) == 3
        # exactly one PE wins a compare-swap race
        sh.shmem_atomic_set(flag, 0, rank, dtype=dtype)
        sh.shmem_barrier_all()
        won = sh.shmem_atomic_compare_swap(flag, 0, rank + 1, 0, dtype=dtype) == 0
        sh.shmem_barrier_all()
        assert won == (sh.shmem_atomic_fetch(flag, 0, dtype=dtype) == rank + 1)
        sh.shmem_barrier_all()
    # edges: unsigned wrap-around, negatives, argument errors
    sh.shmem_atomic_set(word, 2**32 - 1, rank, dtype="uint32")
    assert sh.shmem_atomic_fetch_add(word, 1, rank, dtype=torch.uint32) == 2**32 - 1
    assert sh.shmem_atomic_fetch(word, rank, dtype="uint32") == 0
    sh.shmem_atomic_set(word, 2**64 - 1, rank, dtype="uint64")
    assert sh.shmem_atomic_fetch(word, rank, dtype="int64") == -1
    sh.shmem_atomic_set(word, -5, rank, dtype="int64")
    assert sh.shmem_atomic_fetch(word, rank, dtype=torch.int64) == -5
    with pytest.raises(MoriValueError, match="does not fit"):
        sh.shmem_atomic_set(word, 2**32, rank, dtype="uint32")
    with pytest.raises(MoriValueError, match="not aligned"):
        sh.shmem_atomic_add(word + 2, 1, rank, dtype="int32")
    with pytest.raises(MoriValueError, match="dtype='float32'"):
        sh.shmem_atomic_add(word, 1, rank, dtype="float32")
    with pytest.raises(MoriValueError, match="not inside the symmetric heap"):
        sh.shmem_atomic_add(64, 1, rank)
    sh.shmem_barrier_all()

    # waits: every comparison, a timeout, and a wake-up by a peer 200 ms later
    out: dict[str, float] = {}
    sh.shmem_atomic_set(word, 10, rank)
    sh.shmem_barrier_all()
    for cmp, value in ((sh.SHMEM_CMP_EQ, 10), (sh.SHMEM_CMP_NE, 3), (sh.SHMEM_CMP_GT, 9)):
        assert sh.shmem_wait_until(word, cmp, value, timeout=5) == 10
    for cmp, value in ((sh.SHMEM_CMP_GE, 10), (sh.SHMEM_CMP_LT, 11), (sh.SHMEM_CMP_LE, 10)):
        assert sh.shmem_wait_until(word, cmp, value, timeout=5) == 10
    t0 = time.monotonic()
    with pytest.raises(MoriTimeoutError, match=r"is 10, still not > 10 after 0.3 s"):
        sh.shmem_wait_until(word, sh.SHMEM_CMP_GT, 10, timeout=0.3)
    out["timeout_s"] = time.monotonic() - t0
    sh.shmem_barrier_all()
    if rank == 0:
        t0 = time.monotonic()
        sh.shmem_wait_until(word, sh.SHMEM_CMP_EQ, 77, timeout=30)
        out["woke_after_s"] = time.monotonic() - t0
    elif rank == 1:
        time.sleep(0.2)
        sh.shmem_atomic_set(word, 77, 0)
    sh.shmem_barrier_all()

    # barriers: everyone's increment is visible after each one
    sh.shmem_atomic_set(word, 0, rank)
    sh.shmem_barrier_all()
    t0 = time.monotonic()
    rounds = 10
    for i in range(rounds):
        sh.shmem_atomic_add(word, 1, 0)
        sh.shmem_barrier_all()
        if rank == 0:
            assert sh.shmem_atomic_fetch(word, 0) == n * (i + 1)
        sh.shmem_barrier_all()
    out["barrier_ms"] = (time.monotonic() - t0) / (2 * rounds) * 1e3
    return out


@pytest.mark.parametrize(("nranks", "gpus"), CONFIGS)
def test_atomics_waits_and_barriers(gpu_shmem: GpuShmemBackend, nranks: int, gpus: int) -> None:
    results = _run(gpu_shmem, _atomics_waits_barriers, nranks, gpus)
    assert all(0.25 <= r["timeout_s"] < 3.0 for r in results)
    assert 0.15 <= results[0]["woke_after_s"] < 10.0


# -- buffers outside the heap: export a sub-range, open it in another process ------------------------------


def _register_and_export(rank: int, n: int) -> None:
    import torch

    import mori.shmem as sh
    from mori.core.gpu.runtime import GpuRuntime
    from mori.shmem.context import current

    runtime = current("test").runtime
    assert isinstance(runtime, GpuRuntime), f"ranges are exported by a GPU runtime, not {runtime.name}"
    dev = _device()
    right, left = (rank + 1) % n, (rank - 1) % n
    size, off, length = 3 << 20, 1_000_003, 12_345
    tensor = torch.empty(size, dtype=torch.uint8, device=dev)  # torch's caching allocator
    tensor.copy_(_pattern(500 + rank, size))
    handle = runtime.export_range(tensor.data_ptr() + off, length)
    # exchange the handles through the symmetric heap
    slot = sh.shmem_malloc(256)
    sh.shmem_tensor_view(slot, len(handle), torch.uint8).copy_(torch.tensor(list(handle), dtype=torch.uint8))
    sh.shmem_barrier_all()
    theirs = bytes(sh.shmem_tensor_view(slot, len(handle), torch.uint8, pe=right).tolist())
    seg = runtime.open_range(theirs)
    assert seg.size == length
    view = runtime.byte_view(seg.addr, seg.size)
    assert view.device == dev
    assert torch.equal(view, _pattern(500 + right, size)[off : off + length]), "the right neighbour's range"
    view[:16].fill_(rank + 1)  # a store into the right neighbour's tensor
    torch.cuda.synchronize()
    sh.shmem_barrier_all()
    assert bool((tensor[off : off + 16] == left + 1).all())
    # the mapped range as the local side of a put (registered), into the right neighbour's heap
    buf = sh.shmem_malloc(length)
    sh.shmem_buffer_register(seg.addr, length)
    sh.shmem_putmem(buf, seg.addr, length, right)  # right's own bytes (first 16 are rank + 1) back to it
    sh.shmem_barrier_all()
    want = _pattern(500 + rank, size)[off : off + length].clone()
    want[:16] = left + 1
    assert torch.equal(sh.shmem_tensor_view(buf, length, torch.uint8), want)
    sh.shmem_buffer_deregister(seg.addr, length)
    del view
    seg.close()
    sh.shmem_barrier_all()  # nobody maps my tensor any more
    own = runtime.open_range(handle)  # this process's own export is its own address
    assert own.addr == tensor.data_ptr() + off
    own.close()


@pytest.mark.parametrize(("nranks", "gpus"), [CONFIGS[0], CONFIGS[1], CONFIGS[2]])
def test_exported_sub_range_opened_by_another_process(
    gpu_shmem: GpuShmemBackend, nranks: int, gpus: int
) -> None:
    _run(gpu_shmem, _register_and_export, nranks, gpus, env=gpu_shmem.export_env)


# -- device API (Triton) on two GPUs ---------------------------------------------------------------------

_GUARD = 64


def _test_kernels() -> Any:
    """mori-core's test kernels over the device API (the backend's ``kernels``, passed to the ranks)."""
    from mori.testing import load_module_file

    return load_module_file("mori_core_test_device_kernels", os.environ[_KERNELS_VAR])


def _device_put_get(rank: int, n: int) -> None:
    import torch

    import mori.shmem as sh
    from mori.shmem import kernels as K

    dev = _device()
    right, left = (rank + 1) % n, (rank - 1) % n
    cases = [
        ("uint8", 1, 0),
        ("uint8", 7, 1),
        ("uint8", 1001, 3),
        ("int16", 33, 2),
        ("int32", 257, 4),
        ("float32", 100, 8),
        ("int64", 13, 8),
        ("bfloat16", 999, 0),
        ("uint8", (8 << 20) + 5, 0),
        ("int64", 1 << 20, 0),
    ]
    for case, (name, numel, offset) in enumerate(cases):
        dtype = getattr(torch, name)
        nbytes = numel * dtype.itemsize
        total = nbytes + 2 * _GUARD
        dst_raw = sh.mori_shmem_create_tensor(total, torch.uint8)
        src_raw = sh.mori_shmem_create_tensor(total, torch.uint8)
        dst_raw.fill_(0xAB)
        start = _GUARD + offset - (offset % dtype.itemsize)
        dst = dst_raw[start : start + nbytes].view(dtype)
        src_sym = src_raw[start : start + nbytes].view(dtype)
        src_sym.copy_(_pattern(1000 * rank + case, nbytes, dtype))
        sh.shmem_barrier_all()
        K.put(dst, _pattern(1000 * rank + case, nbytes, dtype), right)
        sh.shmem_barrier_all()  # its fence completes my kernel before I arrive
        assert torch.equal(dst_raw[start : start + nbytes], _pattern(1000 * left + case, nbytes)), (
            f"put {name}[{numel}] from PE {left}"
        )
        assert bool((dst_raw[:start] == 0xAB).all()) and bool((dst_raw[start + nbytes :] == 0xAB).all())
        local_raw = torch.full((total,), 0xCD, dtype=torch.uint8, device=dev)
        K.get(local_raw[start : start + nbytes].view(dtype), src_sym, right, block=256, max_programs=7)
        assert torch.equal(local_raw[start : start + nbytes], _pattern(1000 * right + case, nbytes)), (
            f"get {name}[{numel}] from PE {right}"
        )
        assert bool((local_raw[:start] == 0xCD).all()) and bool((local_raw[start + nbytes :] == 0xCD).all())
        sh.shmem_barrier_all()
        sh.mori_shmem_free_tensor(src_raw)
        sh.mori_shmem_free_tensor(dst_raw)


def _device_put_signal(rank: int, n: int) -> None:
    import torch

    import mori.shmem as sh
    from mori.shmem import device as shd
    from mori.shmem import kernels as K

    tk = _test_kernels()
    dev = _device()
    ctx = shd.shmem_device_context()
    assert ctx.device == dev
    right, left = (rank + 1) % n, (rank - 1) % n
    # host wrapper, several programs, a new value each round; the receiver waits on the host
    data = sh.mori_shmem_create_tensor(301, torch.int32)
    sig = sh.mori_shmem_create_tensor(1, torch.uint64)
    sig.zero_()
    sh.shmem_barrier_all()
    for rnd in range(3):
        K.put_signal(
            data, _pattern(rank * 10 + rnd, 301 * 4, torch.int32), sig, 100 + rnd, sh.SIGNAL_SET, right
        )
        assert (
            sh.shmem_wait_until(sig.data_ptr(), sh.SHMEM_CMP_EQ, 100 + rnd, dtype="uint64", timeout=30)
            == 100 + rnd
        )
        assert torch.equal(data.view(torch.uint8), _pattern(left * 10 + rnd, 301 * 4)), f"round {rnd}"
        sh.shmem_barrier_all()
    # a large transfer over many programs, signalled once by the last one
    bulk = sh.mori_shmem_create_tensor(4 << 20, torch.int64)
    K.put_signal(bulk, _pattern(77 + rank, 32 << 20, torch.int64), sig, 1, sh.SIGNAL_ADD, right)
    sh.shmem_wait_until(sig.data_ptr(), sh.SHMEM_CMP_EQ, 103, dtype="uint64", timeout=30)
    assert torch.equal(bulk.view(torch.uint8), _pattern(77 + left, 32 << 20)), "bulk data before its signal"
    sh.shmem_barrier_all()
    # in kernels: send (three orderings) to the right, receive by waiting on the device
    cases = [
        (torch.uint8, 333, shd.SIGNAL_SET.value, tk.ORDER_PUT_SIGNAL.value, torch.uint64),
        (torch.uint8, 64, shd.SIGNAL_ADD.value, tk.ORDER_QUIET.value, torch.uint64),
        (torch.int64, 45, shd.SIGNAL_ADD.value, tk.ORDER_FENCE.value, torch.int64),
    ]
    for i, (dtype, numel, op, order, sig_dtype) in enumerate(cases):
        nbytes = numel * dtype.itemsize
        inbox = sh.mori_shmem_create_tensor(numel, dtype)
        s = sh.mori_shmem_create_tensor(1, sig_dtype)
        s.zero_()
        sh.shmem_barrier_all()
        src = _pattern(700 + 10 * rank + i, nbytes, dtype)
        tk.send_kernel[(1,)](inbox, src, s, ctx, numel, 7, right, SIG_OP=op, ORDER=order, BLOCK=64)
        out = torch.zeros(numel, dtype=dtype, device=dev)
        tk.recv_kernel[(1,)](s, inbox, out, numel, 7, BLOCK=64)
        assert torch.equal(out.view(torch.uint8), _pattern(700 + 10 * left + i, nbytes)), f"device case {i}"
        assert _int(s) == 7
        sh.shmem_barrier_all()


def _device_atomics(rank: int, n: int) -> dict[str, Any]:
    import torch

    import mori.shmem as sh
    from mori.shmem import device as shd

    tk = _test_kernels()
    dev = _device()
    ctx = shd.shmem_device_context()
    right, left = (rank + 1) % n, (rank - 1) % n

    def op(word: Any, code: Any, value: int = 0, cond: int = 0, pe: int = right) -> int:
        o = torch.zeros(1, dtype=word.dtype, device=dev)
        tk.atomic_kernel[(1,)](word, o, ctx, value, cond, pe, OP=code.value)
        return _int(o)

    for dtype in (torch.int32, torch.int64, torch.uint64):
        words = sh.mori_shmem_create_tensor(n, dtype)
        words.zero_()
        sh.shmem_barrier_all()
        w = words[rank : rank + 1]
        op(w, tk.OP_SET, 5)
        assert op(w, tk.OP_FETCH) == 5
        op(w, tk.OP_ADD, 3)
        assert op(w, tk.OP_FETCH_ADD, 2) == 8
        assert op(w, tk.OP_SWAP, 42) == 10
        assert op(w, tk.OP_COMPARE_SWAP, value=7, cond=41) == 42
        assert op(w, tk.OP_COMPARE_SWAP, value=7, cond=42) == 42
        assert op(w, tk.OP_FETCH) == 7
        sh.shmem_barrier_all()
        assert _int(words[left]) == 7
        assert all(_int(words[q]) == 0 for q in range(n) if q != left)
        sh.shmem_barrier_all()
    contended = 64
    ctr = sh.mori_shmem_create_tensor(1, torch.int64)
    ctr.zero_()
    ctr32 = sh.mori_shmem_create_tensor(1, torch.int32)
    ctr32.zero_()
    flag = sh.mori_shmem_create_tensor(1, torch.int64)
    flag.zero_()
    sh.shmem_barrier_all()
    fetched = torch.zeros(contended, dtype=torch.int64, device=dev)
    tk.atomic_kernel[(contended,)](ctr, fetched, ctx, 1, 0, 0, OP=tk.OP_FETCH_ADD.value)
    tk.cas_increment_kernel[(contended,)](ctr32, ctx, 0)
    got = op(flag, tk.OP_COMPARE_SWAP, value=rank + 1, cond=0, pe=0)
    sh.shmem_barrier_all()
    totals = (int(ctr), int(ctr32), int(flag)) if rank == 0 else None
    return {"fetched": fetched.tolist(), "cas": got, "totals": totals, "contended": contended}


def _device_wait_and_barrier(rank: int, n: int) -> None:
    import torch

    import mori.shmem as sh
    from mori.shmem import device as shd
    from mori.shmem import kernels as K
    from mori.shmem import layout
    from mori.shmem.context import current

    tk = _test_kernels()
    dev = _device()
    ctx = shd.shmem_device_context()
    partner = rank ^ 1
    left = (rank - 1) % n
    # wait_until in a kernel, released by the partner's host atomics (one value that must not
    # release it, then one that must)
    waits = [
        ("EQ", 0, 4, 5, 5),
        ("NE", 0, None, 3, 0),
        ("GT", 0, 4, 5, 4),
        ("GE", 0, 4, 5, 5),
        ("LT", 10, 11, 3, 5),
        ("LE", 10, 6, 5, 5),
    ]
    ready = sh.mori_shmem_create_tensor(1, torch.int64)
    ready.zero_()
    expected = 0
    for dtype in (torch.int32, torch.int64, torch.uint64):
        words = sh.mori_shmem_create_tensor(len(waits), dtype)
        inits = torch.tensor([w[1] for w in waits]).to(dtype).to(dev)
        words.copy_(inits)
        sh.shmem_barrier_all()
        name = str(dtype).removeprefix("torch.")
        for waiter in (0, 1):
            for i, (cmp, _, early, final, against) in enumerate(waits):
                if rank % 2 == waiter:
                    out = torch.zeros(1, dtype=dtype, device=dev)
                    sh.shmem_atomic_add(ready.data_ptr(), 1, partner)
                    tk.wait_kernel[(1,)](words[i : i + 1], out, against, CMP=getattr(sh, f"SHMEM_CMP_{cmp}"))
                    assert _int(out) == final, f"{name} {cmp} {against}: returned {_int(out)}, not {final}"
                else:
                    expected += 1
                    sh.shmem_wait_until(ready.data_ptr(), sh.SHMEM_CMP_GE, expected, timeout=30)
                    addr = words[i : i + 1].data_ptr()
                    if early is not None:
                        sh.shmem_atomic_set(addr, early, partner, dtype=name)
                    time.sleep(0.02)
                    sh.shmem_atomic_set(addr, final, partner, dtype=name)
            sh.shmem_barrier_all()
            words.copy_(inits)
            sh.shmem_barrier_all()

    # device barrier: in one kernel, and through the host wrapper
    rounds = 20
    word = sh.mori_shmem_create_tensor(1, torch.int64)
    word.fill_(-1)
    sh.shmem_barrier_all()
    out = torch.full((rounds,), -7, dtype=torch.int64, device=dev)
    tk.barrier_ring_kernel[(1,)](word, out, ctx, ROUNDS=rounds)
    assert out.tolist() == [r * 1000 + left for r in range(rounds)], out.tolist()
    right_word = sh.symm_mori_shmem_tensor(word, (rank + 1) % n)
    for r in range(rounds):
        right_word.fill_(10**6 + r * 1000 + rank)
        K.barrier()
        assert int(word) == 10**6 + r * 1000 + left, f"round {r}: {int(word)}"
        K.barrier()
    # shmem_barrier_on_stream: the same device barrier, on the current stream or a given one
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch: Stream.__new__ is unannotated
    for r in range(5):
        right_word.fill_(2 * 10**6 + r * 1000 + rank)
        sh.shmem_barrier_on_stream()
        assert int(word) == 2 * 10**6 + r * 1000 + left, f"barrier_on_stream round {r}: {int(word)}"
        side.wait_stream(torch.cuda.current_stream())
        sh.shmem_barrier_on_stream(side)
        torch.cuda.current_stream().wait_stream(side)
    runtime = current("test").runtime
    base = sh.shmem_heap_info()["base"]
    epoch = int(runtime.byte_view(base + layout.DEVICE_BARRIER_EPOCH_OFF, 8).view(torch.int64))
    slots = runtime.byte_view(base + layout.DEVICE_BARRIER_OFF, 8 * n).view(torch.int64).tolist()
    assert epoch == 4 * rounds + 10 and slots == [4 * rounds + 10] * n, (epoch, slots)
    sh.shmem_barrier_all()


def test_device_api_put_get_on_two_gpus(gpu_shmem: GpuShmemBackend) -> None:
    _run(gpu_shmem, _device_put_get, 2, 2)


def test_device_api_put_signal_on_two_gpus(gpu_shmem: GpuShmemBackend) -> None:
    _run(gpu_shmem, _device_put_signal, 2, 2)


def test_device_api_atomics_on_two_gpus(gpu_shmem: GpuShmemBackend) -> None:
    res = _run(gpu_shmem, _device_atomics, 2, 2)
    c = res[0]["contended"]
    fetched = sorted(v for r in res for v in r["fetched"])
    assert fetched == list(range(2 * c)), "every fetch_add saw a distinct previous value"
    ctr, ctr32, flag = res[0]["totals"]
    assert ctr == 2 * c and ctr32 == 2 * c
    winners = [r for r in range(2) if res[r]["cas"] == 0]
    assert len(winners) == 1 and flag == winners[0] + 1


def test_device_api_wait_until_and_barrier_on_two_gpus(gpu_shmem: GpuShmemBackend) -> None:
    _run(gpu_shmem, _device_wait_and_barrier, 2, 2)

"""mori.cco and mori.ccl on GPUs of any vendor (marked ``gpu``; skipped, with the reason, elsewhere).

Two ranks; rank r uses GPU ``r % MORI_TEST_GPUS`` (default: every GPU torch sees), so one GPU
runs both ranks (they must share it under MPS, or their kernels, which wait for each other, never
run at once). The runtime is the installed device plugin's that serves this machine's torch
(:func:`~mori.testing.gpu_shmem.machine_gpu_runtime`: ``cuda`` from mori-backend-nvlink on NVIDIA
GPUs, ``hip`` from mori-backend-xgmi on AMD ones). Every result is checked exactly
against values computed on the host; the CUDA-graph test replays captured collectives hundreds
of times, with inputs changed between replays, and checks every output.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from mori.cco import CCODevCommRequirements, Communicator, UniqueId
from mori.testing import run_ranks
from mori.testing.gpu_shmem import machine_gpu_runtime

pytestmark = pytest.mark.gpu

HEAP = 512 << 20
TRANSIT = 64 << 20


def _ranks(fn: Any, *args: Any) -> list[Any]:
    runtime = machine_gpu_runtime()  # skips without a GPU, fails without a plugin serving it
    gpus = int(os.environ.get("MORI_TEST_GPUS", torch.cuda.device_count()))
    env = {
        "MORI_DEVICE_RUNTIME": runtime,
        "MORI_BOOTSTRAP_TIMEOUT": "120",
        "CUDA_MODULE_LOADING": "EAGER",
        "MORI_TEST_GPUS": str(gpus),
    }
    return run_ranks(fn, 2, Communicator.get_unique_id(), *args, env=env, timeout=600)


def _device(rank: int) -> torch.device:
    torch.cuda.set_device(rank % int(os.environ["MORI_TEST_GPUS"]))
    return torch.device("cuda", torch.cuda.current_device())


def _values(rank: int, case: int, numel: int, dtype: torch.dtype, dev: Any) -> torch.Tensor:
    """Small integers, exact in every dtype and in every sum of two ranks."""
    i = torch.arange(numel, dtype=torch.int64)
    v = (i * 7 + case * 13 + rank * 5) % 61 - 30
    if dtype == torch.uint32:
        v = v + 30
    return v.to(dtype).to(dev)


def _kernels() -> Any:
    import importlib.util
    import sys
    from pathlib import Path

    name = "mori_cco_test_kernels"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("_kernels.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _cco(rank: int, n: int, uid: UniqueId) -> None:
    dev = _device(rank)
    k = _kernels()
    with Communicator.init(n, rank, uid, per_rank_vmm=HEAP) as c:
        assert (
            c.device == str(dev) and c.runtime_name == os.environ["MORI_DEVICE_RUNTIME"] and c.lsa_size == n
        )
        dc = c.create_dev_comm(CCODevCommRequirements(lsa_barrier_count=4, barrier_count=1))
        out = torch.zeros(4, dtype=torch.int64, device=dev)
        k.identity_kernel[(1,)](out, dc.tensor)
        assert out.tolist() == [rank, n, n, rank]
        words = 4 * n * 64
        m = c.alloc_mem(words * 4)
        buf = c.tensor(m.ptr, words * 4).view(torch.int32)
        w = c.register_window(m.ptr, words * 4)
        k.lsa_rounds_kernel[(4,)](w.table, buf, dc.tensor, 50, SLOT=64)
        torch.cuda.synchronize()
        c.barrier()
        assert not bool((buf == -1).any()), "a round saw a wrong value"
        count = torch.zeros(1, dtype=torch.int64, device=dev)
        k.world_barrier_kernel[(1,)](count, dc.tensor, 100)
        torch.cuda.synchronize()
        assert int(count) == 100

        # a window over torch's own allocation (exported with the runtime's IPC)
        t = torch.full((1 << 20,), rank + 1, dtype=torch.int32, device=dev)
        tw = c.register_window(t.data_ptr(), t.numel() * 4)
        torch.cuda.synchronize()
        c.barrier()
        assert int(tw.view((rank + 1) % n, torch.int32)[12345]) == (rank + 1) % n + 1

        # copy-engine queue: host puts, then a kernel's puts, both counted on the same signal
        size = 1 << 20
        src_m, dst_m = c.alloc_mem(size), c.alloc_mem(size)
        c.tensor(src_m.ptr, size).copy_(_values(rank, 1, size, torch.uint8, dev))
        c.tensor(dst_m.ptr, size).zero_()
        torch.cuda.synchronize()
        src, dst = c.register_window(src_m.ptr, size), c.register_window(dst_m.ptr, size)
        q = dc.sdma_queue(0)
        left, right = (rank - 1) % n, (rank + 1) % n
        q.put(right, dst, 0, src, 0, size)
        q.quiet()
        q.wait_signal(left, 1, timeout=60)
        assert torch.equal(dst.view(), _values(left, 1, size, torch.uint8, dev))
        k.sdma_kernel[(1,)](dst.table, src.table, dc.tensor, size // 4, 4, 5, 0, 0)
        torch.cuda.synchronize()
        assert q.signal(left) == 5
        c.barrier()


def test_communicator_windows_barriers_and_queues_on_gpus() -> None:
    _ranks(_cco)


def _collectives(rank: int, n: int, uid: UniqueId) -> set[str]:
    import mori.ccl as ccl

    dev = _device(rank)
    paths: set[str] = set()
    with Communicator.init(n, rank, uid, per_rank_vmm=HEAP) as c:
        for case, dtype in enumerate(ccl.allreduce.DTYPES):
            ar = ccl.AllreduceSdma(rank, n, dtype=dtype, comm=c, transit_buffer_size=TRANSIT)
            for count in (1, 1000, 262144, 262145, 5_000_000):
                x = _values(rank, case, count, dtype, dev)
                out = torch.empty_like(x)
                ar(x, out, count)
                shift = 30 if dtype == torch.uint32 else 0  # _values' uint32 offset, int64 here
                want = sum(_values(r, case, count, torch.int64, "cpu") + shift for r in range(n))
                got = (
                    out.cpu().view(torch.int32).to(torch.int64)
                    if dtype == torch.uint32
                    else out.cpu().to(torch.int64)
                )
                assert torch.equal(got, want), (dtype, count, ar.last_path)
                paths.add(ar.last_path)
            ar.close()
        ag = ccl.AllgatherSdma(rank, n, comm=c, transit_buffer_size=TRANSIT)
        a2 = ccl.All2allSdma(rank, n, comm=c, transit_buffer_size=TRANSIT)
        for words in (1, 1000, 300_000, 5_000_000):  # small, large kernel, copy engine (>= 16 MiB)
            x = _values(rank, 3, words, torch.int32, dev)
            out = torch.empty(n * words, dtype=torch.int32, device=dev)
            ag(x, out, words)
            want = torch.cat([_values(r, 3, words, torch.int32, "cpu") for r in range(n)])
            assert torch.equal(out.cpu(), want), (words, ag.last_path)
            paths.add(ag.last_path)
            y = _values(rank, 4, n * (words // n + 1), torch.int32, dev)
            blk = words // n + 1
            got = torch.empty_like(y)
            a2(y, got, blk)
            want = torch.cat(
                [_values(r, 4, n * blk, torch.int32, "cpu")[rank * blk : (rank + 1) * blk] for r in range(n)]
            )
            assert torch.equal(got.cpu(), want), (words, a2.last_path)
            paths.add(a2.last_path)
        h = ccl.HierAllGather(rank, n, comm=c, ranks_per_node=1, transit_buffer_size=TRANSIT)
        x = _values(rank, 5, 4096, torch.bfloat16, dev)
        out = torch.empty(n * 4096, dtype=torch.bfloat16, device=dev)
        h(out, x)
        assert torch.equal(
            out.cpu(), torch.cat([_values(r, 5, 4096, torch.bfloat16, "cpu") for r in range(n)])
        )
        paths.add(h.last_path)
        # async on a side stream, then the parameter-contiguous layout
        big = _values(rank, 6, 1 << 20, torch.int32, dev)
        res = torch.empty(n << 20, dtype=torch.int32, device=dev)
        ag.start_async(big, res, 1 << 20)
        ag.wait_async()
        assert torch.equal(
            res.cpu(), torch.cat([_values(r, 6, 1 << 20, torch.int32, "cpu") for r in range(n)])
        )
        shards = [_values(rank, 7 + i, s, torch.float32, dev) for i, s in enumerate((3, 1000, 77))]
        outs = [torch.empty(n * s.numel(), device=dev) for s in shards]
        for s, o in zip(shards, outs, strict=True):
            ag.enqueue_param_contiguous(s, o)
        ag.start_async_param_contiguous()
        ag.wait_async()
        for i, o in enumerate(outs):
            s = shards[i].numel()
            assert torch.equal(
                o.cpu(), torch.cat([_values(r, 7 + i, s, torch.float32, "cpu") for r in range(n)])
            )
        paths.add(ag.last_path)
        c.barrier()
    return paths


def test_every_collective_on_gpus_exact() -> None:
    paths = _ranks(_collectives)[0]
    assert {"triton:oneshot", "triton:rsag", "triton:small", "triton:large", "copy-engine:large"} <= paths, (
        paths
    )


def _graphs(rank: int, n: int, uid: UniqueId) -> None:
    import mori.ccl as ccl

    dev = _device(rank)
    with Communicator.init(n, rank, uid, per_rank_vmm=HEAP) as c:
        ar = ccl.AllreduceSdma(rank, n, dtype=torch.float32, comm=c, transit_buffer_size=TRANSIT)
        ag = ccl.AllgatherSdma(rank, n, comm=c, transit_buffer_size=TRANSIT)
        small, large = 4096, 3 << 20  # one-shot and reduce-scatter + all-gather
        xs, xl = torch.zeros(small, device=dev), torch.zeros(large, device=dev)
        os_, ol = torch.empty_like(xs), torch.empty_like(xl)
        g_in = torch.zeros(5000, dtype=torch.int32, device=dev)
        g_out = torch.empty(n * 5000, dtype=torch.int32, device=dev)
        for _ in range(2):  # load the kernels (and make the front door's collective) outside the capture
            ar(xs, os_, small)
            ar(xl, ol, large)
            ag(g_in, g_out, 5000)
            torch.ops.mori_ccl.all_reduce(xs, c.name)
        torch.cuda.synchronize()
        c.barrier()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ar(xs, os_, small)
            ar(xl, ol, large)
            ag(g_in, g_out, 5000)
            s = torch.ops.mori_ccl.all_reduce(xs, c.name)
        for i in range(300):
            xs.fill_(rank + i)
            xl.fill_(2 * rank - i)
            g_in.fill_(1000 * i + rank)
            graph.replay()
            if i % 25 == 0 or i > 290:
                torch.cuda.synchronize()
                assert bool((os_ == sum(r + i for r in range(n))).all()), (i, "small")
                assert bool((ol == sum(2 * r - i for r in range(n))).all()), (i, "large")
                assert bool((s == os_).all()), i
                want = torch.arange(n, device=dev).repeat_interleave(5000) + 1000 * i
                assert torch.equal(g_out, want.to(torch.int32)), i
        torch.cuda.synchronize()
        compiled = torch.compile(lambda t: torch.ops.mori_ccl.all_reduce(t * 2, c.name) + 1, fullgraph=True)
        t = torch.full((1000,), float(rank), device=dev)
        assert bool((compiled(t) == 2 * sum(range(n)) + 1).all())
        c.barrier()


def test_collectives_in_a_cuda_graph_replayed_300_times() -> None:
    _ranks(_graphs)

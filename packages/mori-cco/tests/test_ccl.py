"""mori.ccl collectives on CPU ranks against torch.distributed over gloo, on 2, 4 and 8 ranks.

Every rank contributes different values (seeded by rank and case). Integer results must equal
gloo's exactly; float sums must equal the documented order (float32 accumulation in rank order,
rounded once), which is exact to check, and agree with gloo within rounding. The host path runs
at every world size; the Triton kernels run under the interpreter (``TRITON_INTERPRET=1``) on fewer
ranks and smaller sizes (the interpreter is slow). Small ``oneshot_max``/``small_cap`` and transit
sizes put both protocols (small halves, large region) in reach of small tensors.
"""

from __future__ import annotations

import importlib.util
import socket
from typing import Any

import pytest
import torch

import mori.ccl as ccl
from mori.cco import Communicator, UniqueId
from mori.core.errors import MoriStateError, MoriTypeError, MoriValueError
from mori.testing import run_ranks, shmem_ranks

ENV = {"MORI_DEVICE_RUNTIME": "cpu", "MORI_BOOTSTRAP_TIMEOUT": "60"}
INTERPRET = {**ENV, "TRITON_INTERPRET": "1"}
HEAP = 32 << 20
SMALL = 4096  # bytes: calls staging more use the large protocol
TRANSIT = 256 << 10
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ranks(fn: Any, n: int, *args: Any, env: dict[str, str] = ENV, timeout: float = 150) -> list[Any]:
    return run_ranks(fn, n, Communicator.get_unique_id(), _port(), *args, env=env, timeout=timeout)


def _gloo(rank: int, n: int, port: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)


def _values(rank: int, case: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * case + rank)
    if dtype.is_floating_point:
        return (torch.randn(numel, generator=g) * 100).to(dtype)
    return (
        torch.randint(-(2**31), 2**31 - 1, (numel,), generator=g, dtype=torch.int64)
        .to(torch.int32)
        .view(dtype)
    )


def _gathered(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    """Every rank's ``x``, through gloo (as bytes, any dtype)."""
    import torch.distributed as dist

    raw = x.reshape(-1).view(torch.uint8)
    out = [torch.empty_like(raw) for _ in range(n)]
    dist.all_gather(out, raw)
    return [o.view(torch.uint8).view(x.dtype) for o in out]


def _check_allreduce(
    obj: ccl.AllreduceSdma, rank: int, n: int, count: int, case: int, *, inplace: bool = False
) -> str:
    import torch.distributed as dist

    dtype = obj.dtype
    x = _values(rank, case, count, dtype)
    if dtype == torch.uint32:  # torch fills no uint32 on CPU
        out = torch.full((count + 3,), 7, dtype=torch.int32).view(dtype)
    else:
        out = torch.full((count + 3,), 7, dtype=dtype)
    keep = out[count:].clone()
    if inplace:
        data = x.clone()
        obj.allreduce_inplace(data, count)
        got = data
    else:
        obj(x, out, count)
        got = out[:count]
        assert torch.equal(out[count:].view(torch.uint8), keep.view(torch.uint8)), "wrote past count"
    everyone = _gathered(x, n)
    if dtype.is_floating_point:
        # the documented order, in float32 with one rounding: rank order, except host:rsag, whose
        # chunk r is summed in the ring order r, r-1, ..., r-n+1
        acc = torch.zeros(count, dtype=torch.float32)
        if obj.last_path == "host:rsag":
            chunk = obj._chunk(count)
            for r in range(n):
                lo, hi = min(r * chunk, count), min((r + 1) * chunk, count)
                for s in range(n):
                    acc[lo:hi] += everyone[(r - s) % n][lo:hi].float()
        else:
            for t in everyone:
                acc += t.float()
        assert torch.equal(got.view(torch.uint8), acc.to(dtype).view(torch.uint8)), (
            dtype,
            count,
            obj.last_path,
        )
        ref = x.clone().float()
        dist.all_reduce(ref)  # gloo's own order: same sum within rounding of the summands
        scale = torch.stack([t.float().abs() for t in everyone]).sum(0) if count else ref
        tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}[dtype]
        assert bool(((got.float() - ref).abs() <= tol * scale + 1e-6).all()), (dtype, count)
    else:
        ref = x.view(torch.int32).to(torch.int64) if dtype == torch.uint32 else x.to(torch.int64)
        if dtype == torch.uint32:
            ref = ref & 0xFFFFFFFF
        dist.all_reduce(ref)
        mask = 0xFFFFFFFF
        mine = got.view(torch.int32).to(torch.int64) & mask
        assert torch.equal(mine, ref & mask), (dtype, count, obj.last_path)
    return obj.last_path


def _check_allgather(obj: ccl.AllgatherSdma, rank: int, n: int, words: int, case: int) -> str:
    x = _values(rank, case, words, torch.int32)
    out = torch.full((n * words + 5,), -3, dtype=torch.int32)
    obj(x, out, words)
    assert torch.equal(out[: n * words], torch.cat(_gathered(x, n))), (words, obj.last_path)
    assert bool((out[n * words :] == -3).all()), "wrote past the output"
    return obj.last_path


def _check_all2all(obj: ccl.All2allSdma, rank: int, n: int, words: int, case: int) -> str:
    import torch.distributed as dist

    x = _values(rank, case, n * words, torch.int32)
    out = torch.empty(n * words, dtype=torch.int32)
    seconds = obj(x, out, words)
    assert isinstance(seconds, float) and seconds >= 0
    ref = torch.empty_like(out)
    dist.all_to_all_single(ref, x)
    assert torch.equal(out, ref), (words, obj.last_path)
    return obj.last_path


# -- every collective, host path, 2/4/8 ranks, and the kernels under the interpreter --------------------


def _all(rank: int, n: int, uid: UniqueId, port: int, impl: str, counts: list[int]) -> set[str]:
    import torch.distributed as dist

    _gloo(rank, n, port)
    paths: set[str] = set()
    kw: dict[str, Any] = {"transit_buffer_size": TRANSIT, "impl": impl}
    with Communicator.init(n, rank, uid, per_rank_vmm=HEAP) as c:
        for case, dtype in enumerate(ccl.allreduce.DTYPES):
            ar = ccl.AllreduceSdma(rank, n, dtype=dtype, comm=c, oneshot_max=SMALL, **kw)
            for count in counts:
                paths.add(_check_allreduce(ar, rank, n, count, 10 * case + count % 7))
            paths.add(_check_allreduce(ar, rank, n, counts[-1], 99, inplace=True))
            ar.close()
        ag = ccl.AllgatherSdma(rank, n, comm=c, small_cap=SMALL, **kw)
        a2 = ccl.All2allSdma(rank, n, comm=c, small_cap=SMALL, **kw)
        for words in counts:
            paths.add(_check_allgather(ag, rank, n, words, words))
            paths.add(_check_all2all(a2, rank, n, max(1, words // n), words))
        if impl == "triton":
            # the copy-engine path, here with torch copies on CPU tensors
            ce = ccl.AllgatherSdma(rank, n, comm=c, small_cap=SMALL, copy_engine_min=0, **kw)
            paths.add(_check_allgather(ce, rank, n, counts[-1], 5))
            ce.close()
            # one-shot with programs whose slices hold whole blocks (the unmasked loop) and a tail
            big = ccl.AllreduceSdma(rank, n, dtype=torch.bfloat16, comm=c, oneshot_max=1 << 20, **kw)
            paths.add(_check_allreduce(big, rank, n, 2 * 8192 + 77, 6))
            big.close()

        # torch.distributed.all_gather_into_tensor semantics, [n * d0, d1] and [n, d0, d1] outputs
        agt = ccl.AllGatherIntoTensor(rank, n, comm=c, small_cap=SMALL, **kw)
        x = _values(rank, 3, 6 * 10, torch.bfloat16).view(6, 10)
        for shape in ((n * 6, 10), (n, 6, 10)):
            out = torch.empty(shape, dtype=torch.bfloat16)
            agt(out, x)
            assert torch.equal(out.reshape(-1), torch.cat([t.reshape(-1) for t in _gathered(x, n)]))
        with pytest.raises(MoriValueError, match=r"output.dtype"):
            agt(torch.empty(n * 60, dtype=torch.float32), x)
        with pytest.raises(MoriValueError, match="multiple of 4 bytes"):
            agt(torch.empty(n * 3, dtype=torch.int8), torch.zeros(3, dtype=torch.int8))
        paths.add("AllGatherIntoTensor:" + agt.last_path)

        # FSDP layout: three parameters, each gathered contiguous
        shards = [_values(rank, 40 + i, s, torch.float32) for i, s in enumerate((5, 130, 1))]
        outs = [torch.empty(n * s.numel()) for s in shards]
        for s, o in zip(shards, outs, strict=True):
            ag.enqueue_param_contiguous(s, o)
        assert ag.start_async_param_contiguous() and ag.wait_async()
        for s, o in zip(shards, outs, strict=True):
            assert torch.equal(o, torch.cat(_gathered(s, n)))
        paths.add(ag.last_path)
        assert not ag.start_async_param_contiguous()  # nothing queued

        # the hierarchical all-gather: emulated nodes of every size that divides n, and its reference
        x = _values(rank, 7, 33 * 2, torch.float16)
        everyone = _gathered(x, n)
        for rpn in sorted({1, 2, n} & set(range(1, n + 1))):
            if n % rpn:
                continue
            h = ccl.HierAllGather(rank, n, comm=c, ranks_per_node=rpn, **kw)
            out = torch.empty(n * x.numel(), dtype=torch.float16)
            h(out, x)
            ref = ccl.hier_allgather_reference(everyone, rpn)[rank]
            assert torch.equal(out, ref) and torch.equal(out, torch.cat(everyone)), rpn
            paths.add(h.last_path)
            h.close()
        ag.close()
        a2.close()
        agt.close()
        c.barrier()
    dist.destroy_process_group()
    return paths


HOST_COUNTS = [1, 100, 1024, 1025, 4099]


@pytest.mark.parametrize("nranks", [2, 4, 8])
def test_every_collective_matches_gloo_host_path(nranks: int) -> None:
    counts = HOST_COUNTS if nranks < 8 else [1, 1025]
    paths = _ranks(_all, nranks, "host", counts)[0]
    assert {
        "host:oneshot",
        "host:rsag",
        "host:small",
        "host:large",
        "host:param-contiguous",
        "host:hier",
    } <= paths


@needs_triton
@pytest.mark.parametrize("nranks", [2, 3])
def test_every_collective_matches_gloo_triton_kernels(nranks: int) -> None:
    # 20001: slices of several whole blocks (BLOCK = 4096) and a tail, in every kernel
    counts = [1, 1024, 1500, 20001] if nranks == 2 else [3, 1100]
    paths = _ranks(_all, nranks, "triton", counts, env=INTERPRET, timeout=280)[0]
    want = {"triton:oneshot", "triton:rsag", "triton:small", "triton:large", "copy-engine:hier"}
    assert want <= paths, paths
    if nranks == 2:
        assert {"copy-engine:large", "copy-engine:param-contiguous"} <= paths, paths


# -- many calls in a row on one object (the original's replay bug class) -----------------------------------


def _replays(rank: int, n: int, uid: UniqueId, port: int, impl: str, calls: int) -> None:
    import torch.distributed as dist

    _gloo(rank, n, port)
    with Communicator.init(n, rank, uid, per_rank_vmm=HEAP) as c:
        ar = ccl.AllreduceSdma(
            rank, n, dtype=torch.int32, comm=c, oneshot_max=SMALL, transit_buffer_size=TRANSIT, impl=impl
        )
        ag = ccl.AllgatherSdma(rank, n, comm=c, small_cap=SMALL, transit_buffer_size=TRANSIT, impl=impl)
        sizes = [1024, 1025, 16, 3000, 1024, 1024, 7, 2048]
        for i in range(calls):  # small/large protocols interleaved; results checked every time
            _check_allreduce(ar, rank, n, sizes[i % len(sizes)], i)
            _check_allgather(ag, rank, n, sizes[(i + 3) % len(sizes)], i)
        assert ar.ch.calls() == calls and ag.ch.calls() == calls
        c.barrier()
    dist.destroy_process_group()


def test_many_calls_in_a_row_host_path() -> None:
    _ranks(_replays, 4, "host", 48)


@needs_triton
def test_many_calls_in_a_row_triton_kernels() -> None:
    _ranks(_replays, 2, "triton", 16, env=INTERPRET, timeout=280)


# -- async, in place, output transit, several objects and communicators, errors ----------------------------


def _misc(rank: int, n: int, uid: UniqueId, port: int, uid2: UniqueId) -> None:
    import torch.distributed as dist

    _gloo(rank, n, port)
    kw: dict[str, Any] = {"transit_buffer_size": TRANSIT}
    with (
        Communicator.init(n, rank, uid, per_rank_vmm=HEAP) as c,
        Communicator.init(n, rank, uid2, per_rank_vmm=HEAP) as c2,
    ):
        a = ccl.AllreduceSdma(rank, n, dtype=torch.float32, comm=c, **kw)
        b = ccl.AllreduceSdma(rank, n, dtype=torch.float32, comm=c2, **kw)  # another communicator
        g = ccl.AllgatherSdma(rank, n, comm=c, **kw)  # another object on the same one
        x = _values(rank, 1, 5000, torch.float32)
        expect = torch.zeros(5000)
        for t in _gathered(x, n):
            expect += t
        out_a, out_b = torch.empty(5000), torch.empty(5000)
        a.start_async(x, out_a, 5000)
        assert a.is_async_in_progress()
        with pytest.raises(MoriStateError, match="async call is already in progress"):
            a.start_async(x, out_a, 5000)
        with pytest.raises(MoriStateError, match="async call is in progress"):
            a(x, out_a, 5000)
        b(x, out_b, 5000)  # the other communicator works meanwhile
        _check_allgather(g, rank, n, 300, 2)
        assert a.wait_async() and not a.is_async_in_progress() and not a.wait_async()
        assert torch.equal(out_a, expect) and torch.equal(out_b, expect)

        # no copy to the user: the result stays in the output transit buffer
        t = ccl.AllgatherSdma(rank, n, comm=c, copy_output_to_user=False, **kw)
        with pytest.raises(MoriStateError, match="no call has produced a result"):
            t.get_output_transit_buffer()
        y = _values(rank, 2, 64, torch.int32)
        t(y, None, 64)
        assert torch.equal(t.get_output_transit_buffer(torch.int32)[: n * 64], torch.cat(_gathered(y, n)))
        t.reset_flags()
        t(y, None, 64)
        assert torch.equal(t.get_output_transit_buffer(torch.int32)[: n * 64], torch.cat(_gathered(y, n)))

        # bad arguments get named errors
        with pytest.raises(
            MoriValueError, match=r"dtype=torch.float64 is not allowed; expected uint32, int32"
        ):
            ccl.AllreduceSdma(rank, n, dtype=torch.float64, comm=c)
        with pytest.raises(MoriTypeError, match="dtype has type str"):
            ccl.AllreduceSdma(rank, n, dtype="float32", comm=c)  # type: ignore[arg-type]
        with pytest.raises(MoriValueError, match="mode='lazy'"):
            ccl.AllreduceSdma(rank, n, mode="lazy", comm=c)
        with pytest.raises(MoriValueError, match="impl='cuda'"):
            ccl.AllgatherSdma(rank, n, impl="cuda", comm=c)
        with pytest.raises(MoriValueError, match="my_pe/npes"):
            ccl.AllgatherSdma((rank + 1) % n, n, comm=c)
        with pytest.raises(MoriTypeError, match="comm has type str"):
            ccl.AllgatherSdma(rank, n, comm="world")
        with pytest.raises(
            MoriValueError,
            match=r"inp='\(100,\) torch.float32 \(400 bytes\)' is not allowed; expected at least 4000 bytes",
        ):
            a(torch.zeros(100), out_a, 1000)
        with pytest.raises(MoriValueError, match="contiguous"):
            a(torch.zeros(2000)[::2], out_a, 10)
        with pytest.raises(MoriValueError, match="count=-1"):
            a(x, out_a, -1)
        with pytest.raises(MoriValueError, match="stream=7 is not allowed; expected None on the cpu runtime"):
            a(x, out_a, 10, 7)
        with pytest.raises(MoriValueError, match="transit buffer's 262144 bytes"):
            a(torch.zeros(70000), torch.zeros(70000), 70000)
        with pytest.raises(MoriValueError, match="transit_buffer_size=0"):
            ccl.AllgatherSdma(rank, n, comm=c, transit_buffer_size=0)
        with pytest.raises(MoriValueError, match="multiple of 4 bytes"):
            g.enqueue_param_contiguous(torch.zeros(3, dtype=torch.int8), torch.zeros(3 * n, dtype=torch.int8))
        with pytest.raises(MoriValueError, match="ranks_per_node=3"):
            ccl.HierAllGather(rank, n, comm=c, ranks_per_node=3, **kw)
        for obj in (a, b, g, t):
            obj.close()
        with pytest.raises(MoriStateError, match="was closed"):
            a(x, out_a, 10)
        c.barrier()
    dist.destroy_process_group()


def test_async_output_transit_several_objects_and_named_errors() -> None:
    _ranks(_misc, 2, Communicator.get_unique_id())


# -- the original's call shape: a collective over mori.shmem ---------------------------------------------


def _shmem_shape(rank: int, n: int) -> None:
    with ccl.AllreduceSdma(rank, n, transit_buffer_size=1 << 20, dtype=torch.int32) as ar:
        x = torch.arange(1000, dtype=torch.int32) * (rank + 1)
        out = torch.empty_like(x)
        ar(x, out, 1000)
        assert (
            torch.equal(out, torch.arange(1000, dtype=torch.int32) * (n * (n + 1) // 2))
            and ar.comm.nranks == n
        )
    with ccl.AllgatherSdma(rank, n, transit_buffer_size=1 << 20) as ag:
        x = torch.full((10,), rank, dtype=torch.int32)
        out = torch.empty(10 * n, dtype=torch.int32)
        ag(x, out, 10)
        assert torch.equal(out, torch.arange(n, dtype=torch.int32).repeat_interleave(10))


def test_collectives_in_the_original_call_shape_over_shmem() -> None:
    shmem_ranks(_shmem_shape, 2, heap="16M", env={"MORI_BOOTSTRAP_TIMEOUT": "30"})


def test_the_original_call_shape_needs_shmem_or_a_communicator(clean_env: Any) -> None:
    with pytest.raises(MoriStateError, match=r"mori.shmem is not initialised"):
        ccl.AllgatherSdma(0, 2)
    with pytest.raises(MoriValueError, match="my_pe=2"):
        ccl.AllgatherSdma(2, 2)


# -- the reference itself ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "rpn"), [(1, 1), (4, 1), (4, 2), (4, 4), (6, 2), (6, 3), (8, 2)])
def test_hier_allgather_reference_is_all_gather_into_tensor(n: int, rpn: int) -> None:
    inputs = [torch.randn(3, 5) + 10 * r for r in range(n)]
    for out in ccl.hier_allgather_reference(inputs, rpn):
        assert torch.equal(out, torch.cat([t.reshape(-1) for t in inputs]))
    with pytest.raises(MoriValueError, match="ranks_per_node=5"):
        ccl.hier_allgather_reference(inputs, 5)


def test_size_of_and_data_types() -> None:
    assert [ccl.size_of(d) for d in ccl.DataType] == [1, 1, 2, 2, 4, 4, 8, 8, 2, 2, 4, 8]
    assert ccl.size_of(torch.bfloat16) == 2
    with pytest.raises(MoriTypeError, match="dtype has type str"):
        ccl.size_of("float32")  # type: ignore[arg-type]

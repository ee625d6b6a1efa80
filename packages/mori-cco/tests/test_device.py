"""mori.cco.device under the Triton interpreter on CPU tensors, across processes: identity, LSA
pointers and barriers over many rounds, world barriers, copy-engine puts/gets/signals posted by
kernels (and a refused request), host and device arriving at the same barrier.

Triton is imported only inside the rank functions, after the launcher set ``TRITON_INTERPRET=1``
there. The kernels live in ``_kernels.py``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from mori.cco import CCODevCommRequirements, Communicator, UniqueId
from mori.core.errors import MoriBackendError
from mori.testing import run_ranks

# Not importorskip: importing triton here would import it in the ranks too (they import this module
# to find the rank functions) before the launcher sets TRITON_INTERPRET=1, and Triton's own jitted
# helpers (tl.zeros, ...) would then not run in the interpreter.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="the device API needs Triton (pip install mori-core[triton])",
)

ENV = {"MORI_DEVICE_RUNTIME": "cpu", "MORI_BOOTSTRAP_TIMEOUT": "30", "TRITON_INTERPRET": "1"}
HEAP = 8 << 20


def _kernels() -> ModuleType:
    name = "mori_cco_test_kernels"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("_kernels.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _ranks(fn: Any, n: int) -> list[Any]:
    return run_ranks(fn, n, Communicator.get_unique_id(), env=ENV, timeout=120)


PROGRAMS, ROUNDS, SLOT = 2, 5, 64


def _lsa(rank: int, n: int, uid: UniqueId) -> None:
    k = _kernels()
    with Communicator.init(n, rank, uid, per_rank_vmm=HEAP) as c:
        dc = c.create_dev_comm(CCODevCommRequirements(lsa_barrier_count=PROGRAMS, barrier_count=1))
        out = torch.zeros(4, dtype=torch.int64)
        k.identity_kernel[(1,)](out, dc.tensor)
        assert out.tolist() == [rank, n, n, rank]

        words = PROGRAMS * n * SLOT
        m = c.alloc_mem(words * 4)
        buf = c.tensor(m.ptr, words * 4).view(torch.int32)
        buf.fill_(-7)
        w = c.register_window(m.ptr, words * 4)
        for _ in range(2):  # two launches: the barriers' epochs carry over
            k.lsa_rounds_kernel[(PROGRAMS,)](w.table, buf, dc.tensor, ROUNDS, SLOT=SLOT)
        c.barrier()
        last = (ROUNDS - 1) * 1000 + torch.arange(n, dtype=torch.int32).repeat_interleave(SLOT)
        for p in range(PROGRAMS):
            assert torch.equal(buf[p * n * SLOT : (p + 1) * n * SLOT], last), (
                p,
                buf.view(PROGRAMS, n, SLOT)[p, :, 0],
            )
        assert [dc.lsa_barrier_epoch(p) for p in range(PROGRAMS)] == [4 * ROUNDS] * PROGRAMS

        count = torch.zeros(1, dtype=torch.int64)
        k.world_barrier_kernel[(1,)](count, dc.tensor, 20)
        assert int(count) == 20

        # host and device arrive at the same barrier
        dc2 = c.create_dev_comm(CCODevCommRequirements(lsa_barrier_count=1))
        if rank == 0:
            k.arrive_kernel[(1,)](dc2.tensor)
            dc2.lsa_barrier_wait(0, timeout=20)
        else:
            dc2.lsa_barrier_arrive(0)
            k.wait_kernel[(1,)](dc2.tensor)
        c.barrier()


@pytest.mark.parametrize("nranks", [2, 3])
def test_lsa_pointers_and_barriers_over_many_rounds(nranks: int) -> None:
    _ranks(_lsa, nranks)


def _sdma(rank: int, n: int, uid: UniqueId) -> None:
    k = _kernels()
    piece, puts = 96, 8
    with Communicator.init(n, rank, uid, per_rank_vmm=HEAP) as c:
        dc = c.create_dev_comm(CCODevCommRequirements(sdma_queue_count=2, lsa_barrier_count=1))
        size = piece * puts
        src_m, dst_m = c.alloc_mem(size), c.alloc_mem(size)
        c.tensor(src_m.ptr, size).copy_(((torch.arange(size) * 5 + rank) % 256).to(torch.uint8))
        c.tensor(dst_m.ptr, size).zero_()
        src, dst = c.register_window(src_m.ptr, size), c.register_window(dst_m.ptr, size)
        left, right = (rank - 1) % n, (rank + 1) % n
        k.sdma_kernel[(1,)](dst.table, src.table, dc.tensor, piece, puts, puts, 1, 0)
        assert torch.equal(dst.view(), ((torch.arange(size) * 5 + left) % 256).to(torch.uint8))
        out = torch.zeros(2, dtype=torch.int64)
        k.sdma_signal_kernel[(1,)](out, dc.tensor, 1, left)
        assert out.tolist() == [puts, 0] and dc.sdma_queue(1).signal(left) == puts
        # host and kernels share the queue: a host put counts on the same signal
        c.barrier()
        dc.sdma_queue(1).put(right, dst, 0, src, 0, 16)
        dc.sdma_queue(1).quiet()
        dc.sdma_queue(1).wait_signal(left, puts + 1, timeout=20)
        c.barrier()
        # a get from the right neighbour
        c.tensor(dst_m.ptr, size).zero_()
        k.sdma_get_kernel[(1,)](dst.table, src.table, dc.tensor, size, 0)
        assert torch.equal(dst.view(), ((torch.arange(size) * 5 + right) % 256).to(torch.uint8))
        # a request outside every window: the copy thread refuses it, quiet names it
        c.barrier()
        k.sdma_kernel[(1,)](dst.table, src.table, dc.tensor, piece, 1, puts + 2, 1, 1 << 44)
        with pytest.raises(MoriBackendError, match=r"queue 1 request #\d+: .*dst=0x.* is neither"):
            dc.sdma_queue(1).quiet()
        c.barrier()


def test_copy_engine_queues_posted_by_kernels() -> None:
    _ranks(_sdma, 2)

"""The torch front door: torch.distributed-style calls, the torch.ops.mori_ccl custom ops, and the
ops inside torch.compile (a full graph: no graph break), checked against gloo on 2 ranks."""

from __future__ import annotations

import socket
from typing import Any

import pytest
import torch

from mori.cco import Communicator, UniqueId
from mori.core.errors import MoriTypeError, MoriValueError
from mori.testing import run_ranks

ENV = {"MORI_DEVICE_RUNTIME": "cpu", "MORI_BOOTSTRAP_TIMEOUT": "60"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _front_door(rank: int, n: int, uid: UniqueId, port: int) -> None:
    import torch.distributed as dist

    import mori.ccl.torch_ops as ops

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    with Communicator.init(n, rank, uid, per_rank_vmm=64 << 20) as c:
        g = torch.Generator().manual_seed(rank)
        for shape, dtype in (((7, 5), torch.int32), ((300_000,), torch.float32), ((3, 4), torch.bfloat16)):
            x = (torch.randn(shape, generator=g) * 50).to(dtype)
            mine, ref = x.clone(), x.clone().float()
            ops.all_reduce(mine, group=c)
            dist.all_reduce(ref)
            if dtype == torch.int32:
                assert torch.equal(mine, ref.to(dtype))
            else:
                assert torch.allclose(mine.float(), ref, rtol=2e-2, atol=1e-3)
        assert ops.last_path(c) == "host:oneshot"
        big = torch.full((300_000,), float(rank + 1))
        ops.all_reduce(big, "sum", group=c.name)  # by name; > 1 MiB: the large protocol
        assert (
            torch.equal(big, torch.full((300_000,), float(n * (n + 1) // 2)))
            and ops.last_path(c) == "host:rsag"
        )

        x = torch.arange(6, dtype=torch.float16).view(2, 3) + 10 * rank
        out = torch.empty(2 * n, 3, dtype=torch.float16)
        ops.all_gather_into_tensor(out, x, group=c)
        ref_list = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(ref_list, x)
        assert torch.equal(out, torch.cat(ref_list))
        y = torch.arange(4 * n, dtype=torch.int32) + 100 * rank
        got = torch.empty_like(y)
        ops.all_to_all_single(got, y, group=c)
        ref = torch.empty_like(y)
        dist.all_to_all_single(ref, y)
        assert torch.equal(got, ref)

        # the custom ops, eagerly and under torch.compile
        z = torch.arange(12, dtype=torch.float32).view(3, 4) * (rank + 1)
        s = n * (n + 1) // 2
        assert torch.equal(torch.ops.mori_ccl.all_reduce(z, c.name), torch.arange(12.0).view(3, 4) * s)
        gathered = torch.ops.mori_ccl.all_gather_into_tensor(z, c.name)
        assert gathered.shape == (3 * n, 4) and torch.equal(gathered[3 * rank : 3 * rank + 3], z)
        swapped = torch.ops.mori_ccl.all_to_all_single(y, c.name)
        assert torch.equal(swapped, ref)

        def step(t: torch.Tensor, name: str) -> torch.Tensor:
            u = torch.ops.mori_ccl.all_reduce(t * 2 + 1, name)
            v = torch.ops.mori_ccl.all_gather_into_tensor(u.relu(), name)
            return v.sum(0) - torch.ops.mori_ccl.all_to_all_single(t.reshape(-1), name)[: t.shape[1]]

        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
        t = torch.randn(n, 4, generator=g)
        assert torch.allclose(compiled(t, c.name), step(t, c.name))

        # named errors
        with pytest.raises(MoriValueError, match="op='max' is not allowed"):
            ops.all_reduce(torch.zeros(4), "max", group=c)
        with pytest.raises(MoriValueError, match=r"tensor.dtype=torch.float64"):
            ops.all_reduce(torch.zeros(4, dtype=torch.float64), group=c)
        with pytest.raises(MoriTypeError, match="group has type int"):
            ops.all_reduce(torch.zeros(4), group=3)
        with pytest.raises(MoriValueError, match="name of a live communicator"):
            ops.all_reduce(torch.zeros(4), group="nope")
        with pytest.raises(MoriValueError, match="whole number of uint32 words"):
            ops.all_gather_into_tensor(
                torch.zeros(n, dtype=torch.int8), torch.zeros(1, dtype=torch.int8), group=c
            )
        with pytest.raises(MoriValueError, match="multiple of"):
            ops.all_to_all_single(torch.zeros(n + 1), torch.zeros(n + 1), group=c)
        ops.close(c)
        c.barrier()
    dist.destroy_process_group()


def test_torch_front_door_calls_custom_ops_and_torch_compile() -> None:
    run_ranks(_front_door, 2, Communicator.get_unique_id(), _port(), env=ENV, timeout=150)


def test_custom_ops_are_registered_with_fake_kernels() -> None:
    import mori.ccl.torch_ops  # noqa: F401  (registers torch.ops.mori_ccl)

    for name in ("all_reduce", "all_gather_into_tensor", "all_to_all_single"):
        op: Any = getattr(torch.ops.mori_ccl, name)
        assert op.default._schema.name == f"mori_ccl::{name}"

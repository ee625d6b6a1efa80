"""The inter-node kernel types on their Triton kernels (mori.ep.internode_kernels).

Under the Triton interpreter on CPU heaps, 2 emulated nodes (``MORI_NODE_ID`` per rank) x 2 ranks
and 2 x 1, over ``tcp`` with ``MORI_SHMEM_PROXY_ATOMICS=rma``: the proxy then refuses every remote
read-modify-write (``SIGNAL_ADD``, atomic adds) as a GPU heap on ``ucx`` without RDMA does, so only
the GPU-legal protocol (puts and ``SIGNAL_SET`` across nodes) can pass. Each rank runs the kernel
path and the host path (:mod:`mori.ep.internode`) on the same inputs: dispatched rows are checked
bit-exactly against every source's inputs (and the reference routing), combine against the
reference sum (test_dispatch_combine's tolerance) and bit for bit against the host path, whose
fp32 summation order the kernels follow. Several calls in a row advance the epochs. A lying peer
(a dispatch stream header with more rows than a stream can hold) is rejected by name and nothing
is read beyond the stream. The ``cuda`` test runs the same on one GPU shared by the ranks.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any

import pytest
import torch

import mori.shmem as shmem
from mori.core.errors import MoriValueError
from mori.ep import EpDispatchCombineKernelType, EpDispatchCombineOp
from mori.testing import shmem_ranks
from mori.testing.gpu_shmem import cuda_memory_transport

KT = EpDispatchCombineKernelType
_pkg = __name__.rpartition(".")[0]
td = importlib.import_module(f"{_pkg}.test_dispatch_combine" if _pkg else "test_dispatch_combine")

TIMEOUT = 240
RMA_ENV = {
    "TRITON_INTERPRET": "1",
    "MORI_SHMEM_TRANSPORT": "tcp",
    "MORI_SHMEM_PROXY_ATOMICS": "rma",
    "MORI_BOOTSTRAP_TIMEOUT": "60",
}


def _set_node(g: int, rank: int, nranks: int) -> None:
    os.environ["MORI_NODE_ID"] = f"node{rank // g}"


def _ops(rank: int, world: int, g: int, kt: KT, **kw: Any) -> tuple[EpDispatchCombineOp, EpDispatchCombineOp]:
    cfg = {"kernel_type": kt, "gpu_per_node": g, **kw}
    kern = EpDispatchCombineOp(td._config(rank, world, **cfg), impl="triton")
    host = None
    if kern.buffers.device.type == "cpu":
        host = EpDispatchCombineOp(td._config(rank, world, **cfg), impl="host")
    assert kern._ikern is not None and kern._kern is None, "the inter-node kernels run this op"
    if world > g:  # the proxy runs with the GPU's restriction: remote read-modify-writes refused
        import ctypes

        from mori.shmem import layout
        from mori.shmem.context import current

        net = current("test").network
        assert net is not None
        flag = ctypes.c_int64.from_address(net.ring.host_addr + layout.RING_RMA_SIGNALS).value
        assert flag == 1, "the proxy is not in rma_signals mode"
    return kern, host  # type: ignore[return-value]


def _round(
    kern: EpDispatchCombineOp,
    host: EpDispatchCombineOp | None,
    seed: int,
    pattern: str,
    dtype: torch.dtype,
    *,
    weights: bool = True,
    scales: bool = True,
) -> int:
    rank, world = kern.rank, kern.world_size
    all_in = [td._inputs(seed, s, world, pattern, dtype, td.K) for s in range(world)]
    me = td._dev(kern, all_in[rank])
    w = me["w"] if weights else None
    s = me["s"] if scales else None
    outs = kern.dispatch(me["x"], w, s, me["idx"], call_local_expert_count=True)
    if weights and scales:
        total = td._check_dispatch(kern, outs, all_in, counted=True)
    else:  # (no weights: zeros are received; no scales: none)
        total = int(outs[4].cpu()[0])
        ref = td.reference_dispatch([d["idx"] for d in all_in], td.E_LOCAL, td.M)[rank]
        pos = kern.get_dispatch_src_token_pos().cpu()
        assert torch.equal(pos.long().sort().values, ref), "received rows differ from the reference"
        src_rank, src_tok = kern.decode_send_flat_idx(pos.long())
        for p in range(world):
            rows = (src_rank == p).nonzero().flatten()
            got = outs[0].cpu()[:total][rows]
            assert torch.equal(td._bits(got), td._bits(all_in[p]["x"][src_tok[rows]])), (
                f"tokens from rank {p}"
            )
        assert not outs[1].cpu()[:total].any(), "no weights: the received weights are zeros"
    y = outs[0][:total].to(dtype)  # identity experts
    got = kern.combine(y, outs[1][:total] if weights else None, me["idx"])
    if weights:
        td._check_combine(kern, got, all_in[rank], dtype)
    else:
        out = got[0].cpu()
        expect = td.reference_combine(all_in[rank]["x"].to(dtype), all_in[rank]["idx"], td.E_LOCAL, world)
        tol = td.TOL[dtype]
        torch.testing.assert_close(out[: all_in[rank]["n"]].float(), expect, rtol=tol, atol=tol)
        assert got[1] is None
    if host is not None:  # the host path on the same inputs: the same sums, bit for bit
        hs = host.dispatch(me["x"], w, s, me["idx"])
        htotal = int(hs[4][0])
        assert htotal == total, "the host path received another number of rows"
        hgot = host.combine(hs[0][:htotal].to(dtype), hs[1][:htotal] if weights else None, me["idx"])
        n = all_in[rank]["n"]
        a, b = got[0].cpu()[:n].float(), hgot[0][:n].float()
        assert torch.equal(a, b), (
            f"combine differs from the host path: {(a != b).sum()} {(a - b).abs().max()} {a[a != b][:4]} {b[a != b][:4]}"
        )
        if weights:
            assert torch.equal(got[1].cpu()[:n], hgot[1][:n]), "combined weights differ from the host path"
    return total


def _scenarios(rank: int, world: int, g: int, kt: KT, rounds: int) -> list[int]:
    """``rounds`` dispatch/combine pairs on one op (the epochs advance), then one without weights
    and scales."""
    kern, host = _ops(rank, world, g, kt)
    cases = [("random", torch.bfloat16), ("spread", torch.bfloat16), ("round_robin", torch.float32)]
    if world < td.K:  # (spread routing puts the K experts of a token on K ranks)
        cases.pop(1)
    totals = [_round(kern, host, 10 * i + int(kt), *cases[i % len(cases)]) for i in range(rounds)]
    totals.append(_round(kern, host, 77, "random", torch.bfloat16, weights=False, scales=False))
    shmem.shmem_quiet()  # a request the proxy refused (or failed) would raise here
    return totals


def _launch(fn: Any, world: int, g: int, *args: Any) -> Any:
    return shmem_ranks(
        fn,
        world,
        g,
        *args,
        env=RMA_ENV,
        before_init=functools.partial(_set_node, g),
        timeout=TIMEOUT,
    )


def test_v1_two_nodes_of_two_ranks_under_rma_signals() -> None:
    got = _launch(_scenarios, 4, 2, KT.InterNodeV1, 3)
    assert all(len(t) == 4 for t in got) and sum(map(sum, got)) > 0


def test_internode_two_nodes_of_two_ranks_under_rma_signals() -> None:
    got = _launch(_scenarios, 4, 2, KT.InterNode, 2)
    assert all(len(t) == 3 for t in got) and sum(map(sum, got)) > 0


def test_v1ll_two_nodes_of_one_rank_under_rma_signals() -> None:
    got = _launch(_scenarios, 2, 1, KT.InterNodeV1LL, 2)
    assert all(len(t) == 3 for t in got) and sum(map(sum, got)) > 0


def _lying_peer(rank: int, world: int, g: int) -> str:
    """Rank 2 (node 1) claims M + 1 more rows than its stream to rank 0 (its relay) holds."""
    kern, _host = _ops(rank, world, g, KT.InterNodeV1)
    _round(kern, None, 1, "random", torch.bfloat16)  # one honest call first: epoch 1
    all_in = [td._inputs(5, s, world, "spread", torch.bfloat16, td.K) for s in range(world)]
    me = td._dev(kern, all_in[rank])
    assert kern._ikern is not None
    if rank == 2:
        kern._ikern.forge = td.M + 1
    if rank != 0:
        kern.dispatch(me["x"], me["w"], me["s"], me["idx"])
        return "sent"
    with pytest.raises(
        MoriValueError, match=r"rank 2 \(node 1\) sent a bad stream for call 2: a stream header"
    ):
        kern.dispatch(me["x"], me["w"], me["s"], me["idx"])
    # the forged stream was dropped whole: every other row arrived, none of rank 2's
    total = int(kern._ikern.total_recv[0])
    pos = kern.buffers.recv_src[:total].long()
    ref = td.reference_dispatch([d["idx"] for d in all_in], td.E_LOCAL, td.M)[0]
    span = world * td.M
    assert torch.equal(pos.sort().values, ref[ref // span != 2]), "rows other than rank 2's are missing"
    return "rejected"


def test_forged_stream_row_count_is_rejected_by_name() -> None:
    assert _launch(_lying_peer, 4, 2) == ["rejected", "sent", "sent", "sent"]


# -- on a GPU: the same kernels compiled, the far leg through the proxy over ucx -------------------


def _on_gpu(rank: int, world: int, g: int, kt: KT) -> list[int]:
    kern, _ = _ops(rank, world, g, kt)
    assert kern.buffers.device.type == "cuda"
    assert kern._ikern is not None
    totals = []
    for seed, (pattern, dtype) in enumerate([("random", torch.bfloat16), ("round_robin", torch.float32)] * 2):
        totals.append(_round(kern, None, seed, pattern, dtype))
        assert kern._ikern.dispatch_error("dispatch") is None and kern._ikern.combine_error("combine") is None
    return totals


@pytest.mark.cuda  # NVIDIA-only: the proxy moves the heap's CUDA memory through ucx's CUDA support
@pytest.mark.skipif(
    cuda_memory_transport() is None, reason="needs an NVIDIA GPU and a transport that moves CUDA memory (ucx)"
)
@pytest.mark.parametrize("kt", [KT.InterNodeV1, KT.InterNode])
def test_two_nodes_of_one_rank_on_one_gpu(kt: KT) -> None:
    """2 emulated nodes x 1 rank sharing one GPU: the stream legs go through the proxy (ucx)."""
    env = {
        "TRITON_INTERPRET": "0",
        "CUDA_MODULE_LOADING": "EAGER",
        "MORI_DEVICE_RUNTIME": "cuda",
        "MORI_SHMEM_TRANSPORT": "ucx",
        "MORI_BOOTSTRAP_TIMEOUT": "60",
    }
    got = shmem_ranks(
        _on_gpu,
        2,
        1,
        kt,
        heap="256M",
        env=env,
        before_init=functools.partial(_set_node, 1),
        timeout=TIMEOUT,
    )
    assert all(len(t) == 4 for t in got)


def test_internode_path_reads_no_private_attribute_of_the_op() -> None:
    from pathlib import Path

    import mori.ep.internode_path as internode_path

    tp = importlib.import_module(f"{_pkg}.test_kernel_path_privacy" if _pkg else "test_kernel_path_privacy")
    assert tp.private_op_accesses(Path(internode_path.__file__).read_text()) == []

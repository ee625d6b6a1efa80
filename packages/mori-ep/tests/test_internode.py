"""Inter-node EP (InterNode, InterNodeV1, InterNodeV1LL) across emulated nodes, host path.

Each rank gets ``MORI_NODE_ID = node<rank // ranks_per_node>`` before init: ranks of one node
share memory, ranks of different nodes reach each other only through the network transport
(``tcp``, built in, and ``ucx`` when installed). The single-node suite's scenarios
(test_dispatch_combine.py: bit-exact rows, combine == x * U, local expert counts, zero-copy,
``max_total_recv_tokens`` with spread routing, routing replay, fp8/fp4 combine wire, fp8 fnuz
dispatch) and the disagreement attacks (test_agreement.py) run unchanged on each inter-node kernel
type at 2 nodes x 2 ranks and 2 x 4. Then what only inter-node has: with V1/V1LL a token crosses
to another node once per destination node, with InterNode once per destination rank, counted by
the operator; configs that do not match the nodes fail by name. One launch per layout and
transport runs many scenarios (spawning ranks dominates on a small machine).
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any

import pytest
import torch

import mori.shmem as shmem
from mori.core.errors import MoriBackendError, MoriStateError, MoriValueError
from mori.ep import EpDispatchCombineKernelType, EpDispatchCombineOp
from mori.ep.reference import dest_ranks
from mori.testing import shmem_ranks
from mori.testing.gpu_shmem import machine_gpu_runtime

KT = EpDispatchCombineKernelType
_pkg = __name__.rpartition(".")[0]
td = importlib.import_module(f"{_pkg}.test_dispatch_combine" if _pkg else "test_dispatch_combine")
ta = importlib.import_module(f"{_pkg}.test_agreement" if _pkg else "test_agreement")

#: generous: 8 ranks on a shared 2-core machine; waits inside the job give up at half of it, naming
#: the rank they waited for
TIMEOUT = 300


def _family(kt: KT, g: int) -> dict[str, Any]:
    """The suite's kernel family for inter-node type ``kt`` with ``g`` ranks per node."""
    ll = KT.InterNodeV1LL if kt != KT.InterNodeV1LL else KT.InterNodeV1
    others = tuple(k for k in (KT.InterNode, KT.InterNodeV1, KT.InterNodeV1LL) if k != kt)
    return {"kernel_type": kt, "ll": ll, "quant_also": others, "config": {"gpu_per_node": g}}


def _set_node(g: int, rank: int, nranks: int) -> None:
    os.environ["MORI_NODE_ID"] = f"node{rank // g}"


def _network_transports() -> list[str]:
    from mori.core.transport import find_network_transport

    out = ["tcp"]
    try:  # mori-backend-ucx, when installed and usable here
        find_network_transport("ucx")
        out.append("ucx")
    except Exception:
        pass
    return out


def _launch(
    fn: Any, world: int, g: int, transport: str, *args: Any, env: dict[str, str] | None = None
) -> Any:
    return shmem_ranks(
        fn,
        world,
        g,
        *args,
        env={"MORI_SHMEM_TRANSPORT": transport, **(env or {})},
        before_init=functools.partial(_set_node, g),
        timeout=TIMEOUT,
    )


def _is_split(rank: int, world: int, g: int) -> None:
    """The far ranks really are reached over the network transport, the near ones by stores."""
    from mori.shmem.context import current

    transport = os.environ["MORI_SHMEM_TRANSPORT"]
    ctx = current("test")
    far = [p for p in range(world) if p // g != rank // g]
    assert ctx.network is not None and ctx.network.tp.name == transport
    assert sorted(ctx.network.peers) == far


# -- the single-node suite, on each inter-node kernel type ---------------------------------------------


def _suite(rank: int, world: int, g: int, kinds: list[str], full: bool) -> str:
    _is_split(rank, world, g)
    for name in kinds:
        fam = _family(KT[name], g)
        td._scenarios(rank, world, "host", 3 if full else 2, fam=fam)
        if KT[name] == KT.InterNodeV1:
            td._replay(rank, world, "host", fam=fam)
        if full:
            td._fnuz(rank, world, "host", fam=fam)
    if full:
        td._quant(rank, world, "host", fam=_family(KT[kinds[0]], g))
    shmem.shmem_barrier_all()
    return "ok"


LAYOUTS = [pytest.param(4, 2, id="2x2"), pytest.param(8, 4, id="2x4")]


@pytest.mark.parametrize("transport", _network_transports())
@pytest.mark.parametrize(("world", "g"), LAYOUTS)
def test_suite_across_nodes(world: int, g: int, transport: str) -> None:
    # every type on 2 x 2 over tcp; the rest keeps CI short: V1 (hierarchical) and InterNode
    # (direct) at 2 x 2 over ucx and 2 x 4 over tcp, V1 at 2 x 4 over ucx (V1LL shares V1's path);
    # the quantised combines and fnuz dispatch at 2 x 2
    kinds = {
        (4, "tcp"): ["InterNodeV1", "InterNode", "InterNodeV1LL"],
        (4, "ucx"): ["InterNodeV1", "InterNode"],
        (8, "tcp"): ["InterNodeV1", "InterNode"],
        (8, "ucx"): ["InterNodeV1"],
    }[(world, transport)]
    env = {"MORI_FP8_COMBINE_SCALE_DIM": "4"}
    assert _launch(_suite, world, g, transport, kinds, world == 4, env=env) == ["ok"] * world


def _agreement(rank: int, world: int, g: int) -> list[str]:
    return ta._attacks(rank, world, "host", {"kernel_type": KT.InterNodeV1, "gpu_per_node": g})


def test_disagreeing_ranks_fail_by_name_across_nodes() -> None:
    res = _launch(_agreement, 4, 2, "tcp")
    assert len(res[0]) == 7
    ta._check(res, 4)


# -- tokens cross once per node (V1) or once per rank (InterNode) ----------------------------------------


def _expected_rows(kt: KT, all_idx: list[torch.Tensor], world: int, g: int, rank: int) -> tuple[int, int]:
    """(dispatch, combine) wire rows ``rank`` sends to other nodes in one call."""
    dest = [dest_ranks(idx, td.E_LOCAL, world) for idx in all_idx]  # [N, world] bool per source
    node = rank // g
    nodes = world // g
    if kt == KT.InterNode:
        disp = sum(int(dest[rank][:, p].sum()) for p in range(world) if p // g != node)
        comb = sum(int(dest[s][:, rank].sum()) for s in range(world) if s // g != node)
        return disp, comb
    by_node = [d.view(d.shape[0], nodes, g).any(2) for d in dest]  # [N, nodes] per source
    disp = sum(int(by_node[rank][:, b].sum()) for b in range(nodes) if b != node)
    # as the relay of its local index: every other node's rank with that index sent it its tokens
    srcs = [a * g + rank % g for a in range(nodes) if a != node]
    comb = sum(int(by_node[s][:, node].sum()) for s in srcs)
    return disp, comb


def _traffic(rank: int, world: int, g: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pattern, k in (("random", td.K), ("spread", world)):
        for kt in (KT.InterNode, KT.InterNodeV1, KT.InterNodeV1LL):
            op = td._op("host", rank, world, _family(kt, g), num_experts_per_token=k)
            all_in = [td._inputs(5, s, world, pattern, torch.bfloat16, k) for s in range(world)]
            me = all_in[rank]
            before = op.inter_node_traffic()
            outs = op.dispatch(me["x"], me["w"], me["s"], me["idx"])
            total = td._check_dispatch(op, outs, all_in)
            mid = op.inter_node_traffic()
            got = op.combine(outs[0][:total], outs[1], me["idx"])
            td._check_combine(op, got, me, torch.bfloat16)
            after = op.inter_node_traffic()
            disp, comb = _expected_rows(kt, [d["idx"] for d in all_in], world, g, rank)
            assert mid["dispatch_rows"] - before["dispatch_rows"] == disp, (kt.name, pattern)
            assert after["combine_rows"] - mid["combine_rows"] == comb, (kt.name, pattern)
            # bytes: rows x the wire row (token, weights, scales, ids, source token, 8-byte aligned)
            nb, kb, sb = td.H * 2, 4 * k, td.SCALE_DIM * 4
            stride = nb + 2 * ((kb + 7) // 8 * 8) + sb + 8
            assert mid["dispatch_bytes"] - before["dispatch_bytes"] == disp * stride
            cstride = nb + (kb + 7) // 8 * 8
            assert after["combine_bytes"] - mid["combine_bytes"] == comb * cstride
            out[f"{kt.name}/{pattern}"] = (disp, comb, me["n"])
            assert after["nodes"] == world // g and after["ranks_per_node"] == g
            assert after["streams_per_call"] == (world - g if kt == KT.InterNode else world // g - 1)
    shmem.shmem_barrier_all()
    return out


@pytest.mark.parametrize(("world", "g"), LAYOUTS)
def test_tokens_cross_once_per_node(world: int, g: int) -> None:
    res = _launch(_traffic, world, g, "tcp")
    for rank, r in enumerate(res):
        # spread: every token has an expert on every rank, so it crosses once per other node with
        # V1 and V1LL, once per rank of the other nodes with InterNode
        d1, _, n = r["InterNodeV1/spread"]
        d0, _, _ = r["InterNode/spread"]
        assert d1 == n * (world // g - 1) and d0 == n * (world - g), (rank, r)
        assert r["InterNodeV1LL/spread"] == r["InterNodeV1/spread"]
        if n:
            assert d0 == g * d1
    # summed over the job, combine moves as many rows back as dispatch sent
    for key in res[0]:
        assert sum(r[key][0] for r in res) == sum(r[key][1] for r in res), key


# -- configs that do not match the nodes, and the RDMA knobs ------------------------------------------


def _config_errors(rank: int, world: int, g: int) -> str:
    cfg = td._config
    # a single-node kernel type across nodes
    for kt in (KT.IntraNode, KT.IntraNodeLL, KT.AsyncLL):
        with pytest.raises(MoriBackendError, match=rf"kernel_type {kt.name} .*ranks .* on other nodes"):
            EpDispatchCombineOp(cfg(rank, world, kernel_type=kt))
    # gpu_per_node larger than the nodes: ranks of one config node out of reach
    with pytest.raises(MoriValueError, match=r"config\.gpu_per_node=4 .*loads and stores cannot reach"):
        EpDispatchCombineOp(cfg(rank, world, kernel_type=KT.InterNodeV1, gpu_per_node=4))
    # gpu_per_node that does not divide world_size
    with pytest.raises(MoriValueError, match=r"config\.gpu_per_node=3 .*a divisor of world_size = 4"):
        EpDispatchCombineOp(cfg(rank, world, kernel_type=KT.InterNodeV1, gpu_per_node=3))
    with pytest.raises(MoriValueError, match=r"config\.rdma_block_num=80 .*fewer than block_num = 80"):
        EpDispatchCombineOp(cfg(rank, world, kernel_type=KT.InterNodeV1, gpu_per_node=2, rdma_block_num=80))
    # their Triton kernels (test_internode_kernels.py) have no combine wire quantisation yet
    with pytest.raises(MoriBackendError, match=r"quant_type='fp8_direct_cast' on the kernel path"):
        EpDispatchCombineOp(
            cfg(
                rank,
                world,
                kernel_type=KT.InterNodeV1,
                gpu_per_node=2,
                quant_type="fp8_direct_cast",
                use_external_inp_buf=True,
            ),
            impl="triton",
        )
    # the original's RDMA knobs: accepted, validated, recorded
    saved = os.environ.get("MORI_NUM_QP_PER_PE")
    try:
        os.environ["MORI_NUM_QP_PER_PE"] = "0"
        with pytest.raises(MoriValueError, match="MORI_NUM_QP_PER_PE='0' is not valid"):
            EpDispatchCombineOp(cfg(rank, world, kernel_type=KT.InterNode, gpu_per_node=2))
        os.environ["MORI_NUM_QP_PER_PE"] = "2"
        op = EpDispatchCombineOp(
            cfg(rank, world, kernel_type=KT.InterNodeV1, gpu_per_node=2, num_qp_per_pe=3, rdma_block_num=16)
        )
    finally:
        if saved is None:
            os.environ.pop("MORI_NUM_QP_PER_PE", None)
        else:
            os.environ["MORI_NUM_QP_PER_PE"] = saved
    t = op.inter_node_traffic()
    assert (t["num_qp_per_pe"], t["MORI_NUM_QP_PER_PE"], t["rdma_block_num"]) == (3, 2, 16)
    x = torch.randn(3, td.H).bfloat16()
    idx = torch.full((3, td.K), -1, dtype=torch.int32)
    outs = op.dispatch(x, None, None, idx, rdma_block_num=8)  # per call: validated, unused
    with pytest.raises(MoriValueError, match="rdma_block_num=-3"):
        op.dispatch(x, None, None, idx, rdma_block_num=-3)
    assert int(outs[4][0]) == 0
    op.combine(outs[0][:0], None, idx)
    # routing handles: InterNodeV1 only (as the original), and only from an inter-node op
    v0 = EpDispatchCombineOp(cfg(rank, world, kernel_type=KT.InterNode, gpu_per_node=2))
    with pytest.raises(MoriValueError, match="return_routing"):
        v0.dispatch(x, None, None, idx, return_routing=True)
    single = EpDispatchCombineOp(cfg(rank, world, kernel_type=KT.InterNodeV1, gpu_per_node=2))
    h = single.dispatch(x, None, None, idx, return_routing=True)[5]
    assert len(h.tensors()) == 6 and h.relay is not None
    single.combine(x[:0], None, idx)
    with pytest.raises(MoriValueError, match="tensors"):
        type(h).from_tensors(h.tensors()[:4], 3)
    with pytest.raises(MoriStateError, match="only for kernel_type AsyncLL; this op has InterNodeV1"):
        op.dispatch_recv()
    shmem.shmem_barrier_all()
    return "ok"


def test_config_must_match_the_nodes() -> None:
    assert _launch(_config_errors, 4, 2, "tcp") == ["ok"] * 4


def _one_node(rank: int, world: int, g: int) -> str:
    # 4 ranks of one machine, 2 per node by the config: the "other node" legs are puts that the
    # SHMEM layer turns into copies; same results, and the traffic to the other node is counted
    fam = _family(KT.InterNodeV1, 2)
    for it in range(2):
        op = td._op("host", rank, world, fam)
        td._round(op, 100 + it, "random", torch.bfloat16, torch.bfloat16)
        assert op.inter_node_traffic()["messages"] > 0
    shmem.shmem_barrier_all()
    return "ok"


def test_config_nodes_smaller_than_the_machine() -> None:
    assert _launch(_one_node, 4, 4, "tcp") == ["ok"] * 4


@pytest.mark.gpu
def test_gpu_heap_runs_the_inter_node_kernels() -> None:
    runtime = machine_gpu_runtime()  # skips without a GPU, fails without a plugin serving it
    env = {"MORI_DEVICE_RUNTIME": runtime, "MORI_SHMEM_HEAP_SIZE": "256M"}
    got = shmem_ranks(_gpu_builds, 2, env=env, timeout=TIMEOUT, before_init=_first_gpu)
    assert got == ["ok", "ok"]


def _first_gpu(rank: int, world: int) -> None:
    torch.cuda.set_device(rank % torch.cuda.device_count())


def _gpu_builds(rank: int, world: int) -> str:
    # one node here; the runs across nodes are in test_internode_kernels.py
    for kt in (KT.InterNode, KT.InterNodeV1, KT.InterNodeV1LL):
        op = EpDispatchCombineOp(td._config(rank, world, kernel_type=kt, gpu_per_node=1))
        assert op._ikern is not None and op._kern is None, (
            "impl='auto' runs the inter-node kernels on a GPU heap"
        )
        with pytest.raises(MoriBackendError, match=r"quant_type='fp8_direct_cast' on the kernel path"):
            EpDispatchCombineOp(
                td._config(
                    rank,
                    world,
                    kernel_type=kt,
                    gpu_per_node=1,
                    quant_type="fp8_direct_cast",
                    use_external_inp_buf=True,
                ),
                impl="triton",
            )
    return "ok"

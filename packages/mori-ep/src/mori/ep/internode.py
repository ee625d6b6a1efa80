"""Inter-node kernel types on the host path: ``InterNode``, ``InterNodeV1``, ``InterNodeV1LL``.

Ranks are grouped into nodes by the config: node ``= rank // gpu_per_node`` (``gpu_per_node`` is
capped at ``world_size``; ``world_size`` must be a multiple of it). Ranks of one node must be
load/store reachable (the same ``MORI_NODE_ID``); ranks of other nodes are reached through the
SHMEM host API, which takes the network transport (``tcp`` or ``ucx``) for a peer it cannot map.
Same semantics as the single-node types (:mod:`mori.ep.op`): rows bit-exact, combine an fp32 sum
over each token's distinct destination ranks, routing replay (InterNodeV1), the fp8/fp4 combine
wire formats, ``max_total_recv_tokens``.

Legs. A destination rank on this rank's node gets its rows as in the single-node path (one
fetch-add on its slot counter, stores through a view of its buffers). Tokens for other nodes
travel as *streams*: a stream is one contiguous put of packed wire rows (token bytes, K weights,
scales, K expert ids, source token) from this rank's staging buffer into the receiving rank's
inbound buffer, then one signal word set to ``epoch << 32 | rows``. The receiver *fans out* each
row to the ranks of its node that host one of the row's experts (their slot counters, their
buffers, through views) before it signals "done" to its node.

* ``InterNodeV1`` / ``InterNodeV1LL`` (hierarchical): one stream per destination *node*, to the
  rank of that node with this rank's local index (the relay), carrying every token with at least
  one expert on that node, once; the relay fans out to every rank of its node. Combine runs the
  other way: each rank pushes its output rows for tokens of other nodes into the relay's staging
  (shared memory), the relay sums them in fp32 per token, casts (or quantises, with a
  ``quant_type``) once and sends one row per token back: tokens cross the network once per node
  in both phases. The node's partial sum is rounded to the wire format once more than on one node.
  V1LL is the same path on the CPU (the original's low-latency kernels differ in GPU launch shape).
* ``InterNode`` (the original's baseline): one stream per destination *rank* on another node, no
  relay: a token crosses once per destination rank.

Traffic to other nodes is counted (:meth:`InterNodeHost.traffic`, exposed as
:meth:`mori.ep.EpDispatchCombineOp.inter_node_traffic`): rows and bytes of the streams per phase,
and every message (put, signal, atomic) to another node, control included.

Where it runs. This module is the host path (the ``cpu`` runtime, ``impl="auto"`` or ``"host"``).
On a GPU heap (and with ``impl="triton"`` under the interpreter on CPU heaps) the same protocol runs
on Triton kernels (:mod:`mori.ep.internode_kernels`, launched by
:class:`mori.ep.internode_path.InterNodeKernels`): they use this class's stream buffers and
signal words, the same wire rows and the same fp32 summation order (the results are the same
bits), and across nodes only puts and ``SIGNAL_SET`` of epoch-tagged words (plus "inbound buffer
free" words of their own, also set by ``SIGNAL_SET``), which a GPU heap on ``ucx`` without RDMA allows. The kernels do not do combine wire
quantisation or routing replay yet. They ran on one H200 (2 emulated nodes x 1 rank over ucx);
nothing has run on a real NIC: emulated nodes on one machine only (``tcp``, ``ucx``; the kernels
also under the interpreter with ``MORI_SHMEM_PROXY_ATOMICS=rma``).

The original's RDMA knobs are accepted, validated and recorded, and change nothing here: each
stream is one host transport operation (one ``put_signal_block`` from one program in the
kernels), so there are no GPU blocks to split (``rdma_block_num``) and no queue pairs to rotate
(``num_qp_per_pe``, ``MORI_NUM_QP_PER_PE``).

Every peer is untrusted: row counts, source token ids and replayed layouts read from a stream are
checked before use; a wait that times out names the rank that did not send.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

import mori.shmem as shmem
from mori.core.env import EnvVar
from mori.core.errors import MoriStateError, MoriTimeoutError, MoriValueError, bad_value, format_ranks
from mori.ep.config import EpDispatchCombineConfig, EpDispatchCombineKernelType

if TYPE_CHECKING:
    from mori.ep.op import EpDispatchCombineOp, EpDispatchRoutingHandle

__all__ = ["MORI_NUM_QP_PER_PE", "InterNodeHost", "check_config", "check_nodes"]

KT = EpDispatchCombineKernelType


def _qp_count(text: str) -> int:
    n = int(text)
    if n < 1:
        raise ValueError("must be >= 1")
    return n


MORI_NUM_QP_PER_PE = EnvVar(
    "MORI_NUM_QP_PER_PE",
    "4",
    "RDMA queue pairs per peer (the original's shmem setting, code default 4). Accepted, validated "
    "and recorded by the inter-node EP kernel types; the host path sends each stream as one "
    "transport operation and uses no queue pairs, so it changes nothing yet.",
    "2",
    _qp_count,
    "an int >= 1",
)

_HIER = (KT.InterNodeV1, KT.InterNodeV1LL)


def _pad8(n: int) -> int:
    return (n + 7) // 8 * 8


def ranks_per_node(config: EpDispatchCombineConfig) -> int:
    """``gpu_per_node``, capped at ``world_size`` (a job smaller than one node is one node)."""
    return min(config.gpu_per_node, config.world_size)


def check_config(func: str, config: EpDispatchCombineConfig) -> None:
    """Reject configs the inter-node types cannot run, naming the field (every rank alike)."""
    g = ranks_per_node(config)
    if config.world_size % g:
        raise bad_value(
            func,
            "config.gpu_per_node",
            config.gpu_per_node,
            f"a divisor of world_size = {config.world_size} (node = rank // gpu_per_node; every node "
            "has the same number of ranks)",
        )
    if config.kernel_type in _HIER and config.rdma_block_num and config.rdma_block_num >= config.block_num:
        raise bad_value(
            func,
            "config.rdma_block_num",
            config.rdma_block_num,
            f"0 or fewer than block_num = {config.block_num} (the RDMA blocks are part of the grid)",
        )
    MORI_NUM_QP_PER_PE.get()  # a bad value fails here, by name


def check_nodes(func: str, config: EpDispatchCombineConfig, far: Sequence[int]) -> Exception | None:
    """The error to raise if a rank of this rank's node (by ``gpu_per_node``) is out of reach."""
    g = ranks_per_node(config)
    mine = config.rank // g
    bad = [p for p in far if p // g == mine]
    if not bad:
        return None
    return bad_value(
        func,
        "config.gpu_per_node",
        config.gpu_per_node,
        f"the ranks per node of this job: ranks {format_ranks(bad)} are in node {mine} of rank "
        f"{config.rank} by gpu_per_node, but loads and stores cannot reach them (another MORI_NODE_ID)",
    )


class InterNodeHost:
    """The streams of one inter-node operator (host path). Collective to build: allocates the
    inbound, staging and relay buffers and the stream signal words (zeroed by the operator)."""

    def __init__(self, op: EpDispatchCombineOp) -> None:
        cfg = op.config
        self.op = op
        w, me = op.world_size, op.rank
        g = ranks_per_node(cfg)
        self.g, self.nodes = g, w // g
        self.node = me // g
        self.hier = cfg.kernel_type in _HIER
        #: ranks of this rank's node (the direct legs), this rank included
        self.local = [self.node * g + i for i in range(g)]
        if self.hier:
            #: (receiving rank, ranks it fans out to) of each outbound stream
            self.out_streams = [
                (b * g + me % g, [b * g + i for i in range(g)]) for b in range(self.nodes) if b != self.node
            ]
            #: sources of the inbound streams; the ranks this rank fans their rows out to
            self.in_src = [a * g + me % g for a in range(self.nodes) if a != self.node]
            self.fan = list(self.local)
            self.n_slots = self.nodes
        else:
            self.out_streams = [(p, [p]) for p in range(w) if p // g != self.node]
            self.in_src = [p for p in range(w) if p // g != self.node]
            self.fan = [me]
            self.n_slots = w
        m, k = op.buffers.m, op.buffers.k
        self.row_bytes = op.buffers.row_bytes
        # the widest wire row of either phase
        disp = _pad8(op.buffers.row_bytes) + 2 * _pad8(4 * k) + _pad8(op.buffers.scale_bytes) + 8
        comb = _pad8(op.buffers.row_bytes) + _pad8(4 * k) + _pad8(4 * op.buffers.quant_scale_dim)
        self.wire_max = max(disp, comb)
        bufs = op.buffers

        def create(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            # collective, in this order on every rank; held (zeroed, freed) with the op's buffers
            return bufs.add(shmem.mori_shmem_create_tensor(shape, dtype))

        nfan = len(self.fan)
        #: inbound streams by sender slot: dispatch rows at a relay, combine rows at a source
        self.xin = create((self.n_slots, m * self.wire_max), torch.uint8)
        #: outbound staging (registered heap memory, the source of the puts), one per stream
        self.xout = create((max(1, len(self.out_streams)), m * self.wire_max), torch.uint8)
        #: combine contributions of the node's ranks at a relay: [slot, token, fan index]
        self.cst = create((self.n_slots, m, nfan, _pad8(op.buffers.row_bytes)), torch.uint8)
        self.cst_w = create((self.n_slots, m, nfan, k), torch.float32)
        #: stream signal words by sender slot: dispatch [0, n_slots), combine [n_slots, 2 n_slots)
        self.sig = create((2 * self.n_slots,), torch.int64)
        self.p_cst = {q: self.cst if q == me else shmem.symm_mori_shmem_tensor(self.cst, q) for q in self.fan}
        self.p_cst_w = {
            q: self.cst_w if q == me else shmem.symm_mori_shmem_tensor(self.cst_w, q) for q in self.fan
        }
        self._traffic = {
            "dispatch_rows": 0,
            "dispatch_bytes": 0,
            "combine_rows": 0,
            "combine_bytes": 0,
            "messages": 0,
        }
        self.num_qp_per_pe = cfg.num_qp_per_pe
        self.env_num_qp_per_pe = MORI_NUM_QP_PER_PE.get()

    # -- addressing ------------------------------------------------------------------------------

    def slot_of(self, sender: int) -> int:
        """Index of ``sender``'s stream in the receiver's inbound buffer and signal words."""
        return sender // self.g if self.hier else sender

    def fan_index(self, q: int) -> int:
        return q % self.g if self.hier else 0

    def relay_for(self, src: int) -> int:
        """The rank of this node that received (and combines) ``src``'s stream."""
        return self.node * self.g + src % self.g if self.hier else self.op.rank

    def is_far(self, p: int) -> bool:
        return p // self.g != self.node

    def count_control(self, p: int) -> None:
        if self.is_far(p):
            self._traffic["messages"] += 1

    def traffic(self) -> dict[str, Any]:
        """Cumulative traffic of this rank to ranks of other nodes since the operator was built."""
        op = self.op
        return {
            **self._traffic,
            "kernel_type": op.config.kernel_type.name,
            "nodes": self.nodes,
            "ranks_per_node": self.g,
            "streams_per_call": len(self.out_streams),
            "num_qp_per_pe": self.num_qp_per_pe,
            "MORI_NUM_QP_PER_PE": self.env_num_qp_per_pe,
            "rdma_block_num": op.config.rdma_block_num,
        }

    # -- streams ---------------------------------------------------------------------------------

    def _send(self, phase: str, rows: torch.Tensor | None, n: int, to: int, word: int, epoch: int) -> None:
        """Put the ``n`` packed rows ``rows`` (contiguous, in this rank's staging buffer) into
        ``to``'s inbound buffer at this rank's slot, then set ``to``'s signal word ``word`` to
        ``epoch << 32 | n``."""
        me = self.op.rank
        if n:
            assert rows is not None
            nbytes = rows.numel()
            dest = self.xin[self.slot_of(me)].data_ptr()
            shmem.shmem_putmem(dest, rows.data_ptr(), nbytes, to)
            if self.is_far(to):
                self._traffic[f"{phase}_rows"] += n
                self._traffic[f"{phase}_bytes"] += nbytes
                self._traffic["messages"] += 1
        shmem.shmem_fence()  # the rows are visible before the signal
        shmem.shmem_signal_op(self.sig.data_ptr() + 8 * word, (epoch << 32) | n, shmem.SIGNAL_SET, to)
        self.count_control(to)

    def _recv(self, func: str, src: int, word: int, epoch: int) -> int:
        """Wait for ``src``'s stream of call ``epoch`` on signal word ``word``; return its row count."""
        addr = self.sig.data_ptr() + 8 * word
        try:
            got = shmem.shmem_wait_until(addr, shmem.SHMEM_CMP_GE, epoch << 32, dtype="int64")
        except MoriTimeoutError as e:
            raise MoriTimeoutError(
                f"{func}: rank {self.op.rank} waited for the stream of call {epoch} from rank {src} "
                f"(node {src // self.g}); it did not arrive ({e})",
                [src],
            ) from None
        if got >> 32 != epoch or (got & 0xFFFFFFFF) > self.op.buffers.m:
            raise MoriValueError(
                f"{func}: rank {src} sent a stream header {got:#x} for call {epoch}; expected call "
                f"{epoch} with at most {self.op.buffers.m} rows"
            )
        return got & 0xFFFFFFFF

    # -- dispatch --------------------------------------------------------------------------------

    def dispatch_layout(self, nb: int, has_w: bool, sb: int) -> tuple[int, int, int, int, int]:
        """Byte offsets of a dispatch wire row: (weights, scales, ids, source token, row stride)."""
        k = self.op.buffers.k
        off_w = _pad8(nb)
        off_s = off_w + (_pad8(4 * k) if has_w else 0)
        off_i = off_s + _pad8(sb)
        off_t = off_i + _pad8(4 * k)
        return off_w, off_s, off_i, off_t, off_t + 8

    def dispatch(
        self,
        func: str,
        input: torch.Tensor,
        weights: torch.Tensor | None,
        scales: torch.Tensor | None,
        indices: torch.Tensor,
        routing: EpDispatchRoutingHandle | None,
        dest: torch.Tensor | None,
        dest_slot: torch.Tensor,
        counter: int,
        epoch: int,
        overflow: list[int],
    ) -> dict[str, Any]:
        """The streams and fan-out of one dispatch (after the direct legs). Returns ``relay`` (the
        relay tables of :class:`~mori.ep.op.EpDispatchRoutingHandle`) and ``error`` (a bad stream's
        error, to raise after the "done" signal, or None)."""
        from mori.ep.op import _words

        op = self.op
        n, h = input.shape
        m, k, me = op.buffers.m, op.buffers.k, op.rank
        nb = h * input.element_size()
        sb = 0 if scales is None else scales.shape[1] * scales.element_size()
        off_w, off_s, off_i, off_t, stride = self.dispatch_layout(nb, weights is not None, sb)
        inp_b = input.contiguous().view(torch.uint8)
        sc_b = None if scales is None else scales.contiguous().view(torch.uint8)
        for si, (to, members) in enumerate(self.out_streams):
            if routing is None:
                assert dest is not None
                sel = dest[:, members]
                toks = sel.any(1).nonzero().flatten()
                j = torch.arange(toks.numel(), dtype=torch.int32)
                for mi, p in enumerate(members):
                    hit = sel[toks, mi]
                    dest_slot[p, toks[hit]] = j[hit]
            else:
                toks = (dest_slot[members, :n] >= 0).any(0).nonzero().flatten()
            c = toks.numel()
            rows = None
            if c:
                rows = self.xout[si, : c * stride].view(c, stride)
                _, (dst, src) = _words(nb, rows, inp_b)
                op._copy_rows(dst, slice(0, c), src, toks)
                if weights is not None:
                    rows[:, off_w : off_w + 4 * k].view(torch.float32).copy_(weights[toks])
                if sc_b is not None:
                    rows[:, off_s : off_s + sb].copy_(sc_b[toks])
                rows[:, off_i : off_i + 4 * k].view(torch.int32).copy_(indices[toks])
                rows[:, off_t : off_t + 4].view(torch.int32).copy_(toks.to(torch.int32)[:, None])
            self._send("dispatch", rows, c, to, self.slot_of(me), epoch)

        # relay: fan every inbound stream's rows out to the ranks of this node that host their experts
        nfan = len(self.fan)
        relay_cnt = torch.zeros(self.n_slots, dtype=torch.int64)
        relay_tok = torch.full((self.n_slots, m), -1, dtype=torch.int32)
        relay_slot = torch.full((self.n_slots, m, nfan), -1, dtype=torch.int32)
        if routing is not None:
            assert routing.relay is not None
            want_cnt, want_tok, want_slot = routing.relay
        e_total = op.buffers.e_local * op.world_size
        # a bad stream is skipped and reported after this rank signalled "done" (by the operator),
        # so its node does not wait for it
        errors: list[Exception] = []
        for src_rank in self.in_src:
            slot = self.slot_of(src_rank)
            try:
                c = self._recv(func, src_rank, slot, epoch)
            except MoriValueError as e:
                errors.append(e)
                continue
            rows = self.xin[slot, : c * stride].view(c, stride)
            tok = rows[:, off_t : off_t + 4].view(torch.int32).flatten().clone()
            if c and (int(tok.min()) < 0 or int(tok.max()) >= m or bool((tok[1:] <= tok[:-1]).any())):
                errors.append(
                    MoriValueError(
                        f"{func}: rank {src_rank} sent source token ids outside [0, {m}) or out of order "
                        "in its stream"
                    )
                )
                continue
            if routing is not None and (c != int(want_cnt[slot]) or not torch.equal(tok, want_tok[slot, :c])):
                errors.append(
                    MoriStateError(
                        f"{func}: rank {src_rank} replayed a different layout than the routing handle's "
                        f"({c} rows, the handle has {int(want_cnt[slot])}); replay the same dispatch on "
                        "every rank"
                    )
                )
                continue
            relay_cnt[slot] = c
            relay_tok[slot, :c] = tok
            if c == 0:
                continue
            ids = rows[:, off_i : off_i + 4 * k].view(torch.int32)
            owner = torch.where((ids >= 0) & (ids < e_total), ids // op.buffers.e_local, -1)
            src_pos = tok + src_rank * op.world_size * m
            for fi, q in enumerate(self.fan):
                if routing is None:
                    js = (owner == q).any(1).nonzero().flatten()
                    cq = js.numel()
                    if cq == 0:
                        continue
                    off = shmem.shmem_atomic_fetch_add(op._ctrl_addr(counter), cq, q)
                    if off + cq > op.buffers.r:
                        overflow.append(q)
                        continue
                    relay_slot[slot, js, fi] = torch.arange(off, off + cq, dtype=torch.int32)
                    slots: Any = slice(off, off + cq)  # (a contiguous range: copies, no scatter)
                else:
                    js = (want_slot[slot, :c, fi] >= 0).nonzero().flatten()
                    if js.numel() == 0:
                        continue
                    slots = want_slot[slot, js, fi].long()
                    if int(slots.max()) >= op.buffers.r:
                        raise MoriStateError(
                            f"{func}: the routing handle names rows beyond the receive buffers"
                        )
                _, (dst, src) = _words(nb, op._p_tok[q], rows)
                op._copy_rows(dst, slots, src, js)
                if weights is not None:
                    op._p_w[q][slots] = rows[:, off_w : off_w + 4 * k].view(torch.float32)[js]
                else:
                    op._p_w[q][slots] = 0.0
                if sb:
                    op._p_scales[q][:, :sb][slots] = rows[:, off_s : off_s + sb][js]
                op._p_idx[q][slots] = ids[js]
                op._p_src[q][slots] = src_pos[js]
        if routing is not None:
            relay_slot = want_slot
        return {"relay": (relay_cnt, relay_tok, relay_slot), "error": errors[0] if errors else None}

    # -- combine ---------------------------------------------------------------------------------

    def combine_layout(self, nbw: int, has_w: bool, nblk: int) -> tuple[int, int, int]:
        """Byte offsets of a combine wire row: (weights, block scales, row stride)."""
        off_w = _pad8(nbw)
        off_s = off_w + (_pad8(4 * self.op.buffers.k) if has_w else 0)
        return off_w, off_s, off_s + _pad8(4 * nblk)

    def contribute(
        self,
        input: torch.Tensor,
        weights: torch.Tensor | None,
        rows: torch.Tensor,
        src_rank: torch.Tensor,
        src_tok: torch.Tensor,
    ) -> None:
        """Push this rank's output rows ``rows`` (sources on other nodes) into their relays' staging."""
        from mori.ep.op import _words

        op = self.op
        h = input.shape[1]
        nb = h * input.element_size()
        inp_b = input.view(torch.uint8)
        fi = self.fan_index(op.rank)
        relays = torch.tensor([self.relay_for(int(s)) for s in range(self.op.world_size)])[src_rank]
        slots = torch.tensor([self.slot_of(int(s)) for s in range(self.op.world_size)])[src_rank]
        m = self.op.buffers.m
        for v in self.fan:
            sel = (relays == v).nonzero().flatten()
            if sel.numel() == 0:
                continue
            flat = slots[sel] * m + src_tok[sel]
            cst = self.p_cst[v].view(self.n_slots * m, len(self.fan), -1)[:, fi, :]
            _, (dst, src) = _words(nb, cst, inp_b)
            op._copy_rows(dst, flat, src, rows[sel])
            if weights is not None:
                self.p_cst_w[v].view(self.n_slots * m, len(self.fan), -1)[:, fi, :][flat] = weights[rows[sel]]

    def zero_absent(self, handle: EpDispatchRoutingHandle) -> None:
        """Zero this relay's staging rows that no rank of its node writes in the coming combine
        (a token of a stream that fan member ``f`` did not receive), before the ready signal."""
        assert handle.relay is not None
        cnt, tok, slot_tab = handle.relay
        for src_rank in self.in_src:
            slot = self.slot_of(src_rank)
            c = int(cnt[slot])
            if c == 0:
                continue
            toks = tok[slot, :c].long()
            for fi in range(len(self.fan)):
                js = (slot_tab[slot, :c, fi] < 0).nonzero().flatten()
                if js.numel():
                    self.cst[slot, :, fi].index_fill_(0, toks[js], 0)
                    self.cst_w[slot, :, fi].index_fill_(0, toks[js], 0.0)

    def relay_combine(
        self,
        func: str,
        input: torch.Tensor,
        weights: torch.Tensor | None,
        handle: EpDispatchRoutingHandle,
        epoch: int,
    ) -> None:
        """As a relay: sum the node's contributions per token of every inbound stream, send them back."""
        op = self.op
        assert handle.relay is not None
        cnt, tok, _ = handle.relay
        h = input.shape[1]
        nb = h * input.element_size()
        quant = op.config.quant_type
        nbw = {"none": nb, "fp4_blockwise": h // 2}.get(quant, h)
        nblk = h // op.buffers.quant_block if op.buffers.quant_block else 0
        off_w, off_s, stride = self.combine_layout(
            nbw, weights is not None, nblk if quant.endswith("blockwise") else 0
        )
        k = op.buffers.k
        for si, src_rank in enumerate(self.in_src):
            slot = self.slot_of(src_rank)
            c = int(cnt[slot])
            rows = None
            if c:
                toks = tok[slot, :c].long()
                # every token's contributions summed in fp32 in fan order, over whole blocks of
                # rows: a rank that did not receive a token of the stream has a zeroed row there
                # (zero_absent); the rows of tokens not in the stream are summed and not sent
                span = int(toks[-1]) + 1  # (toks ascend)
                part = self.cst[slot, :span, :, :nb].view(input.dtype)
                # (inbound stream ``si`` goes back from staging buffer ``si``: the lists mirror each
                # other, and the dispatch's staging rows are sent and free)
                rows = self.xout[si, : c * stride].view(c, stride)
                acc_w = None
                if weights is not None:
                    acc_w = self.cst_w[slot, :span].sum(1).index_select(0, toks)
                if quant == "none" and len(self.fan) == 2 and span == c:
                    # two ranks per node, every token: one element-wise add, computed in fp32 and
                    # rounded once, is bit for bit the fp32 sum cast to the wire dtype
                    torch.add(part[:, 0], part[:, 1], out=rows[:, :nb].view(input.dtype))
                    if acc_w is not None:
                        rows[:, off_w : off_w + 4 * k].view(torch.float32).copy_(acc_w)
                    self._send("combine", rows, c, src_rank, self.n_slots + self.slot_of(op.rank), epoch)
                    continue
                acc_all = op._scratch("relay_acc", span * h, torch.float32).view(span, h)
                acc_all.copy_(part[:, 0])
                for fi in range(1, len(self.fan)):
                    acc_all.add_(part[:, fi])
                if span == c:  # every token up to the last one: no gather
                    acc = acc_all
                else:
                    acc = op._scratch("relay_rows", c * h, torch.float32).view(c, h)
                    torch.index_select(acc_all, 0, toks, out=acc)
                if quant == "none":
                    rows[:, :nb].view(input.dtype).copy_(acc)
                else:
                    q, sc = op._quantise(acc.to(torch.bfloat16))
                    rows[:, :nbw].copy_(q)
                    if sc is not None:
                        rows[:, off_s : off_s + 4 * sc.shape[1]].view(torch.float32).copy_(sc)
                if acc_w is not None:
                    rows[:, off_w : off_w + 4 * k].view(torch.float32).copy_(acc_w)
            self._send("combine", rows, c, src_rank, self.n_slots + self.slot_of(op.rank), epoch)

    def finish_combine(
        self,
        func: str,
        handle: EpDispatchRoutingHandle,
        out_dtype: torch.dtype,
        h: int,
        acc: torch.Tensor,
        acc_w: torch.Tensor | None,
        epoch: int,
    ) -> None:
        """As a source: add every node's summed rows (one stream per outbound stream) into ``acc``."""
        from mori.ep import fp4

        op = self.op
        quant = op.config.quant_type
        nbw = {"none": h * torch.empty(0, dtype=out_dtype).element_size(), "fp4_blockwise": h // 2}.get(
            quant, h
        )
        nblk = h // op.buffers.quant_block if op.buffers.quant_block else 0
        blk = nblk if quant.endswith("blockwise") else 0
        off_w, off_s, stride = self.combine_layout(nbw, acc_w is not None, blk)
        n = handle.num_tokens
        for to, members in self.out_streams:
            toks = (handle.dest_slot[members, :n] >= 0).any(0).nonzero().flatten()
            slot = self.slot_of(to)
            c = self._recv(func, to, self.n_slots + slot, epoch)
            if c != toks.numel():
                raise MoriValueError(
                    f"{func}: rank {to} sent {c} combined rows; this rank sent it {toks.numel()} tokens"
                )
            if c == 0:
                continue
            rows = self.xin[slot, : c * stride].view(c, stride)
            if quant == "none":
                if int(toks[-1]) == c - 1:  # the first c tokens, all of them: add in place
                    acc[:c].add_(rows[:, :nbw].view(out_dtype))
                    if acc_w is not None:
                        acc_w[:c].add_(rows[:, off_w : off_w + 4 * op.buffers.k].view(torch.float32))
                    continue
                vals = op._scratch("stream_rows", c * h, torch.float32).view(c, h)
                vals.copy_(rows[:, :nbw].view(out_dtype))
            elif quant == "fp4_blockwise":
                sc = rows[:, off_s : off_s + 4 * nblk].contiguous().view(torch.float32)
                vals = fp4.dequantise(rows[:, :nbw].contiguous(), sc, op.buffers.quant_block)
            else:
                vals = rows[:, :nbw].contiguous().view(torch.float8_e4m3fn).float()
                if quant == "fp8_blockwise":
                    sc = rows[:, off_s : off_s + 4 * nblk].contiguous().view(torch.float32)
                    vals = (vals.view(c, nblk, op.buffers.quant_block) * sc[:, :, None]).view(c, h)
            acc.index_add_(0, toks, vals)
            if acc_w is not None:
                acc_w.index_add_(
                    0, toks, rows[:, off_w : off_w + 4 * op.buffers.k].contiguous().view(torch.float32)
                )

"""Triton kernels of :mod:`mori.ep.deepep_handle` (imported on first use; see there for what
each output means). Their loops are ``while`` loops: Triton's interpreter (``TRITON_INTERPRET=1``,
NumPy 2) cannot run a ``for ... in range(...)`` whose bound is not a constant."""

# mypy: disable-error-code="no-untyped-def,untyped-decorator"

from __future__ import annotations

import triton
import triton.language as tl

from mori.core.kernels import aot_variants
from mori.ep.layout import pow2_at_least as _p2

__all__ = ["recv_side_kernel", "send_side_kernel"]


def _send_variants() -> list[dict[str, object]]:
    return [
        {
            "signature": {
                "addrs_ptr": "*i64",
                "offset": "i32",
                "epoch": "i64",
                "per_rank_ptr": "*i32",
                "per_expert_ptr": "*i32",
                "n_experts": "i32",
                "w0": "i32",
                "w1": "i32",
                "w2": "i32",
                "w3": "i32",
                "w4": "i32",
                "w5": "i32",
                "w6": "i32",
                "in_rank_ptr": "*u8",
                "n_tok": "i32",
                "table_ptr": "*i64",
                "table_stride": "i32",
                "rank": "i32",
                "m": "i32",
                "per": "i32",
                "dest_ptr": "*i32",
                "total_ptr": "*i32",
                "send_head_ptr": "*i32",
                "chan_ptr": "*i32",
                "n_chan": "i32",
            },
            "constexprs": {
                "W": w,
                "W_P2": _p2(w),
                "E_P2": _p2(e),
                "C_P2": _p2(c + 1),
                "BLOCK": 1024,
                "PUT": put,
            },
            "aligned": ("addrs_ptr", "per_rank_ptr", "per_expert_ptr", "table_ptr", "dest_ptr"),
            "num_warps": 4,
            "label": f"W={w} E={e} C={c}" + ("" if put else " no put"),
        }
        for w, e, c, put in ((2, 256, 33, True), (8, 256, 10, True), (8, 288, 12, True), (8, 256, 10, False))
    ]


@aot_variants(_send_variants())
@triton.jit
def send_side_kernel(
    addrs_ptr,  # int64 [W]: the address of every rank's table (this call's half), in this process
    offset,  # elements from a table's start to this rank's row
    epoch,  # this call's number (> 0), stored last in the row: the row is complete
    per_rank_ptr,  # int32 [W]: tokens this rank sends to each rank
    per_expert_ptr,  # int32 [n_experts]
    n_experts,  # entries of per_expert_ptr to put (0: the header alone)
    w0,  # seven words every rank's call must have alike (compared on the host)
    w1,
    w2,
    w3,
    w4,
    w5,
    w6,
    in_rank_ptr,  # uint8 [n_tok, W]: token t goes to rank p
    n_tok,
    table_ptr,  # int64 [W, table_stride]: this rank's table: row s = rank s's [n, sent to 0..W-1, ...]
    table_stride,
    rank,
    m,  # the operator's tokens per rank, >= n_tok
    per,  # tokens per channel, ceil(n_tok / n_chan) (at least 1)
    dest_ptr,  # out int32 [W, m]
    total_ptr,  # out int32 [1]
    send_head_ptr,  # out int32 [n_tok, W]
    chan_ptr,  # out int32 [W, n_chan]
    n_chan,
    W: tl.constexpr,
    W_P2: tl.constexpr,
    E_P2: tl.constexpr,
    C_P2: tl.constexpr,  # > n_chan: the last bin collects the tokens not sent
    BLOCK: tl.constexpr,
    PUT: tl.constexpr,  # the all-gather too (else the table is complete already)
):
    """With ``PUT``, program ``p`` first writes this rank's row ``[n_tok, per_rank, w0..w6, epoch,
    per_expert]`` (int64) into rank ``p``'s table, the epoch last with a release, then waits
    (acquire, no timeout, as the shmem barrier) until every other rank's row of this rank's table
    carries ``epoch``: the all-gather, without a barrier launch. A table is written again two
    calls later, after every rank's row of the call between has arrived, so after this rank read it.

    Then program ``p`` scans column ``p`` of ``in_rank`` in steps of ``BLOCK`` tokens, carrying the
    running count: a sent token's index among those for ``p`` is the inclusive count minus one;
    its row on ``p`` adds the tokens that lower ranks send ``p`` (the table's column ``1 + p`` over
    rows ``< rank``). A histogram of the sent tokens' channels, summed at the end, is the channel
    prefix. Program 0 also stores the rows this rank receives (column ``1 + rank``, summed). This
    rank's own numbers come from its inputs, not its row, which program ``rank`` writes."""
    p = tl.program_id(0)
    srcs = tl.arange(0, W_P2)
    if PUT:
        row = tl.load(addrs_ptr + p).to(tl.pointer_type(tl.int64)) + offset
        one = tl.arange(0, 1)
        # (an int argument equal to 1 arrives as a constant: adding it to a tensor works for both)
        tl.store(row + one, tl.zeros([1], tl.int64) + n_tok)
        tl.store(row + 1 + srcs, tl.load(per_rank_ptr + srcs, mask=srcs < W).to(tl.int64), mask=srcs < W)
        es = tl.arange(0, E_P2)
        ok = es < n_experts
        # (the per-expert counts after the fixed header: where the epoch lies does not depend on
        # the number of experts, so ranks that disagree on it still find each other's rows)
        tl.store(row + 9 + W + es, tl.load(per_expert_ptr + es, mask=ok).to(tl.int64), mask=ok)
        ws = tl.arange(0, 8)
        words = tl.zeros([8], tl.int64) + tl.where(
            ws == 0,
            w0,
            tl.where(
                ws == 1,
                w1,
                tl.where(
                    ws == 2, w2, tl.where(ws == 3, w3, tl.where(ws == 4, w4, tl.where(ws == 5, w5, w6)))
                ),
            ),
        )
        tl.store(row + 1 + W + ws, words, mask=ws < 7)
        tl.debug_barrier()  # every thread's stores before the flag
        tl.atomic_xchg(row + 8 + W, epoch, sem="release", scope="sys")
        s = 0
        while s < W:
            if s != rank:
                flag = table_ptr + s * table_stride + 8 + W
                seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
                while seen < epoch:
                    seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
            s += 1
        tl.debug_barrier()  # no thread reads the table before the waits
    peer = (srcs < W) & (srcs != rank)
    to_p = tl.load(table_ptr + srcs * table_stride + 1 + p, mask=peer & (srcs < rank), other=0, volatile=True)
    base = tl.sum(to_p, axis=0)
    if p == 0:
        to_me = tl.load(table_ptr + srcs * table_stride + 1 + rank, mask=peer, other=0, volatile=True)
        own = tl.load(per_rank_ptr + rank).to(tl.int64)
        tl.store(total_ptr, (tl.sum(to_me, axis=0) + own).to(tl.int32))
    carry = tl.full([], 0, tl.int32)
    hist = tl.zeros([C_P2], tl.int32)
    start = 0
    while start < m:
        t = start + tl.arange(0, BLOCK)
        x = tl.load(in_rank_ptr + t.to(tl.int64) * W + p, mask=t < n_tok, other=0).to(tl.int32)
        within = tl.cumsum(x, axis=0) + carry - 1
        tl.store(dest_ptr + p * m + t, tl.where(x > 0, within + base, -1).to(tl.int32), mask=t < m)
        tl.store(send_head_ptr + t.to(tl.int64) * W + p, tl.where(x > 0, within, -1), mask=t < n_tok)
        hist += tl.histogram(tl.where(x > 0, t // per, C_P2 - 1), C_P2)
        carry += tl.sum(x, axis=0)
        start += BLOCK
    c = tl.arange(0, C_P2)
    tl.store(chan_ptr + p * n_chan + c, tl.cumsum(hist, axis=0), mask=c < n_chan)


def _recv_variants() -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for w, c, k, idx_t in ((2, 33, 8, "*i64"), (8, 10, 8, "*i64"), (8, 12, 9, "*i32")):
        out.append(
            {
                "signature": {
                    "table_ptr": "*i64",
                    "table_stride": "i32",
                    "rank": "i32",
                    "pos_ptr": "*i32",
                    "max_send": "i32",
                    "n_chan": "i32",
                    "total": "i32",
                    "rows": "i32",
                    "prefix_ptr": "*i32",
                    "rchan_ptr": "*i32",
                    "src_idx_ptr": "*i32",
                    "pos_copy_ptr": "*i32",
                    "slot_ptr": "*i32",
                    "slot_copy_ptr": "*i32",
                    "m": "i32",
                    "gidx_ptr": "*i32",
                    "gidx_stride": "i32",
                    "gw_ptr": "*fp32",
                    "gw_stride": "i32",
                    "out_idx_ptr": idx_t,
                    "out_w_ptr": "*fp32",
                    "e_local": "i32",
                },
                "constexprs": {
                    "W": w,
                    "W_P2": _p2(w),
                    "C_P2": _p2(c + 1),
                    "K": k,
                    "K_P2": _p2(k),
                    "HAS_TOPK": True,
                    "HAS_SLOT": True,
                    "BLOCK": 256,
                },
                "aligned": (
                    "table_ptr",
                    "prefix_ptr",
                    "slot_ptr",
                    "slot_copy_ptr",
                    "gidx_ptr",
                    "gw_ptr",
                    "out_idx_ptr",
                    "out_w_ptr",
                ),
                "num_warps": 4,
                "label": f"W={w} C={c} K={k} {idx_t[1:]}",
            }
        )
    return out


@aot_variants(_recv_variants())
@triton.jit
def recv_side_kernel(
    table_ptr,  # int64 [W, table_stride], as in send_side_kernel
    table_stride,
    rank,
    pos_ptr,  # int32 [total]: flat source position of each received row
    max_send,  # source token = position % max_send
    n_chan,
    total,  # rows received
    rows,  # output rows (>= total; padding past total)
    prefix_ptr,  # out int32 [W, W]
    rchan_ptr,  # out int32 [W, n_chan]
    src_idx_ptr,  # out int32 [total]
    pos_copy_ptr,  # out int32 [total]: a copy of pos (the operator overwrites its own next call)
    slot_ptr,  # int32 [W, m]: the operator's receive slot table (read when HAS_SLOT)
    slot_copy_ptr,  # out int32 [W, m]: its copy
    m,
    gidx_ptr,  # int32 [>= total, gidx_stride]: received global expert ids (K used)
    gidx_stride,
    gw_ptr,  # float32 [>= total, gw_stride]: their weights
    gw_stride,
    out_idx_ptr,  # out [rows, K] (int64 or int32): local expert ids, -1 elsewhere
    out_w_ptr,  # out float32 [rows, K]
    e_local,
    W: tl.constexpr,
    W_P2: tl.constexpr,
    C_P2: tl.constexpr,  # > n_chan: the last bin collects masked rows
    K: tl.constexpr,
    K_P2: tl.constexpr,
    HAS_TOPK: tl.constexpr,
    HAS_SLOT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program ``s < W`` takes the rows that came from rank ``s`` (they start after the rows of
    lower ranks, in ``s``'s token order): its row of the rank prefix matrix, each row's source
    token (and a copy of its position), a histogram of the rows' channels on ``s`` (whose
    exclusive sum, plus the segment's start, is the first row of each channel), with top-k the
    rows' local expert ids and weights, and with ``HAS_SLOT`` a copy of row ``s`` of the slot
    table. Program ``W`` fills the padding rows ``[total, rows)``."""
    s = tl.program_id(0)
    srcs = tl.arange(0, W_P2)
    ks = tl.arange(0, K_P2)
    if s < W:
        col = tl.load(table_ptr + srcs * table_stride + 1 + rank, mask=srcs < W, other=0)
        seg = tl.sum(tl.where(srcs < s, col, 0), axis=0)
        cnt = tl.sum(tl.where(srcs == s, col, 0), axis=0)
        n_s = tl.load(table_ptr + s * table_stride)
        per = tl.maximum((n_s + n_chan - 1) // n_chan, 1)
        blk = tl.load(
            table_ptr + srcs[:, None] * table_stride + 1 + srcs[None, :],
            mask=(srcs[:, None] <= s) & (srcs[None, :] < W),
            other=0,
        )
        tl.store(prefix_ptr + s * W + srcs, tl.sum(blk, axis=0).to(tl.int32), mask=srcs < W)
        hist = tl.zeros([C_P2], tl.int32)
        start = 0
        while start < cnt:
            i = start + tl.arange(0, BLOCK)
            ok = i < cnt
            r = seg + i
            pos = tl.load(pos_ptr + r, mask=ok, other=0)
            tl.store(pos_copy_ptr + r, pos, mask=ok)
            idx = pos % max_send
            tl.store(src_idx_ptr + r, idx, mask=ok)
            hist += tl.histogram(tl.where(ok, (idx // per).to(tl.int32), C_P2 - 1), C_P2)
            if HAS_TOPK:
                km = ok[:, None] & (ks < K)[None, :]
                g = tl.load(gidx_ptr + r[:, None] * gidx_stride + ks[None, :], mask=km, other=-1)
                local = g - rank * e_local
                mine = (g >= 0) & (local >= 0) & (local < e_local)
                wv = tl.load(gw_ptr + r[:, None] * gw_stride + ks[None, :], mask=km, other=0.0)
                tl.store(out_idx_ptr + r[:, None] * K + ks[None, :], tl.where(mine, local, -1), mask=km)
                tl.store(out_w_ptr + r[:, None] * K + ks[None, :], tl.where(mine, wv, 0.0), mask=km)
            start += BLOCK
        c = tl.arange(0, C_P2)
        first = seg + tl.cumsum(hist, axis=0) - hist
        tl.store(rchan_ptr + s * n_chan + c, first.to(tl.int32), mask=c < n_chan)
        if HAS_SLOT:
            start = 0
            while start < m:
                t = start + tl.arange(0, BLOCK)
                v = tl.load(slot_ptr + s * m + t, mask=t < m)
                tl.store(slot_copy_ptr + s * m + t, v, mask=t < m)
                start += BLOCK
    elif HAS_TOPK:
        start = tl.zeros([], tl.int32) + total  # (a tensor even when total arrives as the constant 1)
        while start < rows:
            r = start + tl.arange(0, BLOCK)
            km = (r < rows)[:, None] & (ks < K)[None, :]
            tl.store(
                out_idx_ptr + r[:, None] * K + ks[None, :], tl.full([BLOCK, K_P2], -1, tl.int32), mask=km
            )
            tl.store(out_w_ptr + r[:, None] * K + ks[None, :], tl.zeros([BLOCK, K_P2], tl.float32), mask=km)
            start += BLOCK

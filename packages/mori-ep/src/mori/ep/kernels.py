"""Triton kernels of the intra-node EP dispatch/combine, on :mod:`mori.shmem.device`.

One source for NVIDIA and AMD GPUs (and the CPU under ``TRITON_INTERPRET=1``, where tests run them
at small sizes). The protocol is the host path's (``mori.ep.op``): the same symmetric buffers, the
same epochs, the same order. Four kernels, two per phase, so that ``AsyncLL`` can split them and so
that no program ever waits for a later program of its own launch (the interpreter runs programs one
after another):

``dispatch_send_kernel`` (grid = SM budget)
    1. program 0 tells every peer "my receive buffers are free for call ``e``" (``READY_D``);
       every program waits until every peer said so: nothing is written into a buffer its owner
       may still read;
    2. each program owns a contiguous range of tokens; a first pass over their ids counts the rows
       it will send to each destination rank, one ``atomic_fetch_add`` per destination on that
       rank's slot counter reserves them (contiguous rows; ``dest_slot`` remembers them for
       combine); a routing replay reads the slots instead;
    3. a second pass loads each token row once and stores it (plus its weights, scales, ids and
       flat source position) into every destination's receive buffers;
    4. a system-scope fence and a ticket: the last program to finish tells every peer "call ``e``
       of mine is complete" (``DONE_D``) and advances the epoch.

``dispatch_recv_kernel`` (one program) waits for every peer's ``DONE_D``, reads the slot counter
into ``total_recv`` and sets it back to zero. A peer cannot reserve rows of the next call before
this rank's next ``dispatch_send_kernel`` said "free", so the reset cannot race with it.

``combine_send_kernel`` (grid = SM budget): the same handshake (``READY_C``), then every received
row goes back to its source rank's staging buffer at ``[this rank, source token]``; fence, ticket,
``DONE_C``.

``combine_recv_kernel`` (grid = SM budget) waits for every peer's ``DONE_C``, then sums in fp32,
for each of its tokens, the staged rows of the ranks it was sent to (``dest_slot >= 0``) and casts
once to the output dtype.

Epochs live in the control words on the device, so the kernels take no per-call host value: a
CUDA graph of them replays correctly. Control words (int64, symmetric, ``W`` = world size):
``[0, W)`` READY_D, ``[W, 2W)`` DONE_D, ``[2W, 3W)`` READY_C, ``[3W, 4W)`` DONE_C, then SLOT,
EPOCH_D, EPOCH_C, TICKET_D, TICKET_C (local words).

Token rows travel as words (int32, int16 or uint8, the widest that the row size allows), so one
kernel serves every dtype of the same width class; combine's reduction reads them typed.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from mori.core.kernels import aot_variants, device_function
from mori.shmem import device as shd

__all__ = [
    "N_CTRL_EXTRA",
    "combine_recv_kernel",
    "combine_send_kernel",
    "dispatch_recv_kernel",
    "dispatch_send_kernel",
]

#: control words after the 4 * world_size signal words
N_CTRL_EXTRA = 5


@device_function
@triton.jit
def _ctrl_offsets(W: tl.constexpr):
    # READY_D, DONE_D, READY_C, DONE_C, SLOT, EPOCH_D, EPOCH_C, TICKET_D, TICKET_C
    return 0, W, 2 * W, 3 * W, 4 * W, 4 * W + 1, 4 * W + 2, 4 * W + 3, 4 * W + 4


@device_function
@triton.jit
def _handshake(ctrl_ptr, ready_off, epoch, ctx_ptr, W: tl.constexpr):
    # program 0 tells every peer that this rank is ready for call `epoch`; every program waits
    # until every peer said the same
    me = shd.my_pe(ctx_ptr)
    if tl.program_id(0) == 0:
        for q in tl.static_range(W):
            shd.signal_op(ctrl_ptr + ready_off + me, 1, shd.SIGNAL_ADD, q, ctx_ptr)
    for q in tl.static_range(W):
        shd.wait_until(ctrl_ptr + ready_off + q, shd.SHMEM_CMP_GE, epoch)


@device_function
@triton.jit
def _finish(ctrl_ptr, ticket_off, epoch_off, done_off, epoch, ctx_ptr, W: tl.constexpr):
    # every program: fence its stores, take a ticket; the last one advances the epoch and tells
    # every peer that this rank's call `epoch` is complete. The release of each ticket and the
    # acquire of the last one chain every program's stores before the peers' signals.
    shd.fence(ctx_ptr)
    ticket = tl.atomic_add(ctrl_ptr + ticket_off, 1, sem="acq_rel", scope="sys")
    if ticket == tl.num_programs(0) - 1:
        tl.store(ctrl_ptr + ticket_off, 0)
        tl.store(ctrl_ptr + epoch_off, epoch)
        me = shd.my_pe(ctx_ptr)
        for q in tl.static_range(W):
            shd.signal_op(ctrl_ptr + done_off + me, 1, shd.SIGNAL_ADD, q, ctx_ptr)


@device_function
@triton.jit
def _dest_ranks(idx_ptr, toks, tmask, n_experts, E_LOCAL, K: tl.constexpr, K_P2: tl.constexpr):
    # [BT, K_P2] destination rank of each (token, k); -1 for -1 ids, ids out of range and padding
    ks = tl.arange(0, K_P2)
    m = tmask[:, None] & (ks[None, :] < K)
    ids = tl.load(idx_ptr + toks[:, None] * K + ks[None, :], mask=m, other=-1)
    valid = (ids >= 0) & (ids < n_experts)
    return tl.where(valid, ids // E_LOCAL, -1)


@device_function
@triton.jit
def _pick(vec, lanes, p):
    # vec[p] of a small vector (a scalar)
    return tl.sum(tl.where(lanes == p, vec, 0), axis=0)


def _dispatch_variants() -> list[dict[str, Any]]:
    sig = {
        "inp_ptr": "*i32",
        "inp_stride": "i64",
        "w_ptr": "*fp32",
        "sc_ptr": "*u8",
        "sc_stride": "i64",
        "idx_ptr": "*i32",
        "n_tok": "i32",
        "recv_tok_ptr": "*i32",
        "recv_w_ptr": "*fp32",
        "recv_sc_ptr": "*u8",
        "recv_idx_ptr": "*i32",
        "recv_src_ptr": "*i32",
        "dest_slot_ptr": "*i32",
        "ctrl_ptr": "*i64",
        "ctx_ptr": "*i64",
        "row_words": "i32",
        "recv_row_words": "i32",
        "sc_bytes": "i32",
        "recv_sc_bytes": "i32",
        "M": "i32",
        "R": "i32",
        "E_LOCAL": "i32",
    }
    aligned = ("inp_ptr", "recv_tok_ptr", "ctrl_ptr", "ctx_ptr", "dest_slot_ptr")
    out = []
    for w, has_sc, replay, word in (
        (2, 0, 0, "*i32"),
        (2, 1, 0, "*i32"),
        (8, 1, 0, "*i32"),
        (2, 0, 1, "*i16"),
    ):
        out.append(
            {
                "signature": {**sig, "inp_ptr": word, "recv_tok_ptr": word},
                "constexprs": {
                    "W": w,
                    "K": 8,
                    "K_P2": 8,
                    "W_P2": w,
                    "HAS_W": 1,
                    "HAS_SC": has_sc,
                    "REPLAY": replay,
                    "BT": 4,
                    "BLOCK": 1024,
                    "SC_BLOCK": 64,
                },
                "aligned": aligned,
                "num_warps": 16,
                "label": f"W={w} K=8 {word[1:]} scales={has_sc} replay={replay}",
            }
        )
    return out


@aot_variants(_dispatch_variants())
@triton.jit
def dispatch_send_kernel(
    # this rank's tokens: rows of words [N, >= row_words], weights fp32 [N, K], scales bytes
    # [N, >= sc_bytes], expert ids int32 [N, K]; N = n_tok
    inp_ptr,
    inp_stride,
    w_ptr,
    sc_ptr,
    sc_stride,
    idx_ptr,
    n_tok,
    # symmetric receive buffers (this rank's addresses): rows [R, recv_row_words] words, weights
    # [R, K] fp32, scales [R, recv_sc_bytes] bytes, ids [R, K] int32, flat source positions [R]
    recv_tok_ptr,
    recv_w_ptr,
    recv_sc_ptr,
    recv_idx_ptr,
    recv_src_ptr,
    # int32 [W, M]: slot of token t on rank p (written here, or read when REPLAY), -1 if not sent
    dest_slot_ptr,
    # symmetric int64 control words, shmem context
    ctrl_ptr,
    ctx_ptr,
    row_words,
    recv_row_words,
    sc_bytes,
    recv_sc_bytes,
    M,
    R,
    E_LOCAL,
    W: tl.constexpr,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    W_P2: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_SC: tl.constexpr,
    REPLAY: tl.constexpr,
    BT: tl.constexpr,
    BLOCK: tl.constexpr,
    SC_BLOCK: tl.constexpr,
):
    """Reserve rows on every destination rank and store this rank's tokens there (see module)."""
    READY_D, DONE_D, _rc, _dc, SLOT, EPOCH_D, _ec, TICKET_D, _tc = _ctrl_offsets(W)
    pid = tl.program_id(0)
    me = shd.my_pe(ctx_ptr)
    epoch = tl.load(ctrl_ptr + EPOCH_D) + 1
    _handshake(ctrl_ptr, READY_D, epoch, ctx_ptr, W)

    per = tl.cdiv(n_tok, tl.num_programs(0))
    t_begin = pid * per
    t_end = tl.minimum(t_begin + per, n_tok)
    offs_t = tl.arange(0, BT)
    lanes = tl.arange(0, W_P2)
    n_experts = E_LOCAL * W

    # pass 1: rows per destination, then one reservation per destination
    base = tl.zeros([W_P2], dtype=tl.int32)
    if not REPLAY:
        counts = tl.zeros([W_P2], dtype=tl.int32)
        t0 = t_begin
        while t0 < t_end:
            toks = t0 + offs_t
            dst = _dest_ranks(idx_ptr, toks, toks < t_end, n_experts, E_LOCAL, K, K_P2)
            for p in tl.static_range(W):
                has = tl.max((dst == p).to(tl.int32), axis=1)
                counts += tl.where(lanes == p, tl.sum(has, axis=0), 0)
            t0 += BT
        for p in tl.static_range(W):
            c = _pick(counts, lanes, p)
            if c > 0:
                b = shd.atomic_fetch_add(ctrl_ptr + SLOT, c.to(tl.int64), p, ctx_ptr)
                base += tl.where(lanes == p, b.to(tl.int32), 0)

    # pass 2: each token row is loaded once and stored to every rank it goes to
    ks = tl.arange(0, K_P2)
    kmask = ks < K
    cols0 = tl.arange(0, BLOCK)
    scs = tl.arange(0, SC_BLOCK)
    t0 = t_begin
    while t0 < t_end:
        toks = t0 + offs_t
        tmask = toks < t_end
        dst = _dest_ranks(idx_ptr, toks, tmask, n_experts, E_LOCAL, K, K_P2)
        slots = tl.full([BT, W_P2], -1, dtype=tl.int32)
        for p in tl.static_range(W):
            has = tl.max((dst == p).to(tl.int32), axis=1)
            if REPLAY:
                slot = tl.load(dest_slot_ptr + p * M + toks, mask=tmask, other=-1)
            else:
                slot = tl.where(has > 0, _pick(base, lanes, p) + tl.cumsum(has, axis=0) - has, -1)
                base += tl.where(lanes == p, tl.sum(has, axis=0), 0)
                tl.store(dest_slot_ptr + p * M + toks, slot, mask=tmask)
            slots = tl.where(lanes[None, :] == p, slot[:, None], slots)
        ok_all = (slots >= 0) & (slots < R) & tmask[:, None]
        # metadata: weights, ids, flat source position, scales
        m2 = tmask[:, None] & kmask[None, :]
        ids = tl.load(idx_ptr + toks[:, None] * K + ks[None, :], mask=m2)
        if HAS_W:
            wts = tl.load(w_ptr + toks[:, None] * K + ks[None, :], mask=m2)
        else:
            wts = tl.zeros([BT, K_P2], dtype=tl.float32)
        src = (me * W * M + toks).to(tl.int32)
        for p in tl.static_range(W):
            slot = tl.sum(tl.where(lanes[None, :] == p, slots, 0), axis=1)
            ok = tl.sum(tl.where(lanes[None, :] == p, ok_all.to(tl.int32), 0), axis=1) > 0
            mk = ok[:, None] & kmask[None, :]
            tl.store(shd.ptr_p2p(recv_idx_ptr, p, ctx_ptr) + slot[:, None] * K + ks[None, :], ids, mask=mk)
            tl.store(shd.ptr_p2p(recv_w_ptr, p, ctx_ptr) + slot[:, None] * K + ks[None, :], wts, mask=mk)
            tl.store(shd.ptr_p2p(recv_src_ptr, p, ctx_ptr) + slot, src, mask=ok)
            if HAS_SC:
                c = 0
                while c < sc_bytes:
                    cs = c + scs
                    cm = cs < sc_bytes
                    v = tl.load(
                        sc_ptr + toks[:, None] * sc_stride + cs[None, :], mask=tmask[:, None] & cm[None, :]
                    )
                    dst_sc = (
                        shd.ptr_p2p(recv_sc_ptr, p, ctx_ptr) + slot[:, None] * recv_sc_bytes + cs[None, :]
                    )
                    tl.store(dst_sc, v, mask=ok[:, None] & cm[None, :])
                    c += SC_BLOCK
        # token rows, one column block at a time: one load, a store per destination
        c = 0
        while c < row_words:
            cols = c + cols0
            cm = cols < row_words
            data = tl.load(
                inp_ptr + toks[:, None] * inp_stride + cols[None, :], mask=tmask[:, None] & cm[None, :]
            )
            for p in tl.static_range(W):
                slot = tl.sum(tl.where(lanes[None, :] == p, slots, 0), axis=1)
                ok = tl.sum(tl.where(lanes[None, :] == p, ok_all.to(tl.int32), 0), axis=1) > 0
                dst_row = shd.ptr_p2p(recv_tok_ptr, p, ctx_ptr) + slot.to(tl.int64)[:, None] * recv_row_words
                tl.store(dst_row + cols[None, :], data, mask=ok[:, None] & cm[None, :])
            c += BLOCK
        t0 += BT

    _finish(ctrl_ptr, TICKET_D, EPOCH_D, DONE_D, epoch, ctx_ptr, W)


@aot_variants(
    [
        {
            "signature": {"ctrl_ptr": "*i64", "total_ptr": "*i32", "replay_total_ptr": "*i32"},
            "constexprs": {"W": w, "REPLAY": replay},
            "aligned": ("ctrl_ptr",),
            "label": f"W={w} replay={replay}",
        }
        for w, replay in ((2, 0), (8, 0), (2, 1))
    ]
)
@triton.jit
def dispatch_recv_kernel(ctrl_ptr, total_ptr, replay_total_ptr, W: tl.constexpr, REPLAY: tl.constexpr):
    """One program: wait for every peer's dispatch, publish ``total_recv``, reset the slot counter."""
    _rd, DONE_D, _rc, _dc, SLOT, EPOCH_D, _ec, _td, _tc = _ctrl_offsets(W)
    epoch = tl.load(ctrl_ptr + EPOCH_D)
    for q in tl.static_range(W):
        shd.wait_until(ctrl_ptr + DONE_D + q, shd.SHMEM_CMP_GE, epoch)
    if REPLAY:
        total = tl.load(replay_total_ptr)
    else:
        total = tl.atomic_xchg(ctrl_ptr + SLOT, 0, sem="acq_rel", scope="sys").to(tl.int32)
    tl.store(total_ptr, total)


def _combine_send_variants() -> list[dict[str, Any]]:
    sig = {
        "inp_ptr": "*i32",
        "inp_stride": "i64",
        "w_ptr": "*fp32",
        "n_inp_rows": "i32",
        "recv_src_ptr": "*i32",
        "total_ptr": "*i32",
        "stage_tok_ptr": "*i32",
        "stage_w_ptr": "*fp32",
        "ctrl_ptr": "*i64",
        "ctx_ptr": "*i64",
        "row_words": "i32",
        "stage_row_words": "i32",
        "M": "i32",
    }
    return [
        {
            "signature": {**sig, "inp_ptr": word, "stage_tok_ptr": word},
            "constexprs": {"W": w, "K": 8, "K_P2": 8, "HAS_W": has_w, "BT": 4, "BLOCK": 1024},
            "aligned": ("inp_ptr", "stage_tok_ptr", "ctrl_ptr", "ctx_ptr"),
            "num_warps": 16,
            "label": f"W={w} {word[1:]} weights={has_w}",
        }
        for w, has_w, word in ((2, 0, "*i32"), (2, 1, "*i32"), (8, 1, "*i32"), (2, 0, "*i16"))
    ]


@aot_variants(_combine_send_variants())
@triton.jit
def combine_send_kernel(
    # expert outputs, row i for received row i: words [>= total, >= row_words]; weights fp32 [., K]
    inp_ptr,
    inp_stride,
    w_ptr,
    n_inp_rows,
    # int32 [R] flat source positions of the received rows, int32 [1] how many
    recv_src_ptr,
    total_ptr,
    # symmetric staging (this rank's addresses): rows [W * M, stage_row_words] words, weights [W * M, K]
    stage_tok_ptr,
    stage_w_ptr,
    ctrl_ptr,
    ctx_ptr,
    row_words,
    stage_row_words,
    M,
    W: tl.constexpr,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    HAS_W: tl.constexpr,
    BT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Store every received row into its source rank's staging buffer at [this rank, token]."""
    _rd, _dd, READY_C, DONE_C, _s, _ed, EPOCH_C, _td, TICKET_C = _ctrl_offsets(W)
    pid = tl.program_id(0)
    me = shd.my_pe(ctx_ptr)
    epoch = tl.load(ctrl_ptr + EPOCH_C) + 1
    _handshake(ctrl_ptr, READY_C, epoch, ctx_ptr, W)

    total = tl.minimum(tl.load(total_ptr), n_inp_rows)
    span = W * M
    offs = tl.arange(0, BT)
    cols0 = tl.arange(0, BLOCK)
    ks = tl.arange(0, K_P2)
    step = tl.num_programs(0) * BT
    r0 = pid * BT
    while r0 < total:
        rows = r0 + offs
        rmask = rows < total
        pos = tl.load(recv_src_ptr + rows, mask=rmask, other=0)
        src_rank = pos // span
        stage_row = me * M + pos % span
        dst_rows = shd.ptr_p2p(stage_tok_ptr + stage_row.to(tl.int64) * stage_row_words, src_rank, ctx_ptr)
        c = 0
        while c < row_words:
            cols = c + cols0
            m = rmask[:, None] & (cols < row_words)[None, :]
            data = tl.load(inp_ptr + rows.to(tl.int64)[:, None] * inp_stride + cols[None, :], mask=m)
            tl.store(dst_rows[:, None] + cols[None, :], data, mask=m)
            c += BLOCK
        if HAS_W:
            mk = rmask[:, None] & (ks < K)[None, :]
            wts = tl.load(w_ptr + rows[:, None] * K + ks[None, :], mask=mk)
            dst_w = shd.ptr_p2p(stage_w_ptr + stage_row * K, src_rank, ctx_ptr)
            tl.store(dst_w[:, None] + ks[None, :], wts, mask=mk)
        r0 += step

    _finish(ctrl_ptr, TICKET_C, EPOCH_C, DONE_C, epoch, ctx_ptr, W)


def _combine_recv_variants() -> list[dict[str, Any]]:
    sig = {
        "out_ptr": "*bf16",
        "out_w_ptr": "*fp32",
        "stage_ptr": "*bf16",
        "stage_w_ptr": "*fp32",
        "dest_slot_ptr": "*i32",
        "ctrl_ptr": "*i64",
        "n_tok": "i32",
        "h": "i32",
        "stage_row_elems": "i32",
        "M": "i32",
    }
    return [
        {
            "signature": {**sig, "out_ptr": dt, "stage_ptr": dt},
            "constexprs": {"W": w, "K": 8, "K_P2": 8, "HAS_W": has_w, "BT": 4, "BLOCK": 1024},
            "aligned": ("out_ptr", "stage_ptr", "ctrl_ptr", "dest_slot_ptr"),
            "num_warps": 16,
            "label": f"W={w} {dt[1:]} weights={has_w}",
        }
        for w, has_w, dt in ((2, 0, "*bf16"), (2, 1, "*bf16"), (8, 1, "*bf16"), (2, 0, "*fp32"))
    ]


@aot_variants(_combine_recv_variants())
@triton.jit
def combine_recv_kernel(
    # outputs: tokens [>= n_tok, h] (out dtype), weights fp32 [>= n_tok, K]
    out_ptr,
    out_w_ptr,
    # this rank's staging buffer, typed like the output: [W * M, stage_row_elems]; weights [W * M, K]
    stage_ptr,
    stage_w_ptr,
    # int32 [W, M] from the dispatch: token t was sent to rank p iff dest_slot[p, t] >= 0
    dest_slot_ptr,
    ctrl_ptr,
    n_tok,
    h,
    stage_row_elems,
    M,
    W: tl.constexpr,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    HAS_W: tl.constexpr,
    BT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Wait for every peer's combine, then sum each token's staged rows in fp32 (fixed rank order)."""
    _rd, _dd, _rc, DONE_C, _s, _ed, EPOCH_C, _td, _tc = _ctrl_offsets(W)
    epoch = tl.load(ctrl_ptr + EPOCH_C)
    for q in tl.static_range(W):
        shd.wait_until(ctrl_ptr + DONE_C + q, shd.SHMEM_CMP_GE, epoch)

    offs = tl.arange(0, BT)
    cols0 = tl.arange(0, BLOCK)
    ks = tl.arange(0, K_P2)
    step = tl.num_programs(0) * BT
    t0 = tl.program_id(0) * BT
    while t0 < n_tok:
        toks = t0 + offs
        tmask = toks < n_tok
        c = 0
        while c < h:
            cols = c + cols0
            cm = cols < h
            acc = tl.zeros([BT, BLOCK], dtype=tl.float32)
            for p in tl.static_range(W):
                sent = tl.load(dest_slot_ptr + p * M + toks, mask=tmask, other=-1) >= 0
                row = (p * M + toks).to(tl.int64) * stage_row_elems
                v = tl.load(
                    stage_ptr + row[:, None] + cols[None, :], mask=sent[:, None] & cm[None, :], other=0.0
                )
                acc += v.to(tl.float32)
            out = out_ptr + toks.to(tl.int64)[:, None] * h + cols[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=tmask[:, None] & cm[None, :])
            c += BLOCK
        if HAS_W:
            mk = tmask[:, None] & (ks < K)[None, :]
            acc_w = tl.zeros([BT, K_P2], dtype=tl.float32)
            for p in tl.static_range(W):
                sent = tl.load(dest_slot_ptr + p * M + toks, mask=tmask, other=-1) >= 0
                row = p * M + toks
                acc_w += tl.load(
                    stage_w_ptr + row[:, None] * K + ks[None, :], mask=mk & sent[:, None], other=0.0
                )
            tl.store(out_w_ptr + toks[:, None] * K + ks[None, :], acc_w, mask=mk)
        t0 += step

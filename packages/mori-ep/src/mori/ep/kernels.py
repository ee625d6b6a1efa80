# Jitted functions carry no Python annotations (Triton reads them), so mypy may not ask for them:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Triton kernels of the intra-node EP dispatch/combine, on :mod:`mori.shmem.device`.

One source for NVIDIA and AMD GPUs (and the CPU under ``TRITON_INTERPRET=1``, where tests run them
at small sizes). The protocol is the host path's (``mori.ep.op``): the same symmetric buffers, the
same epochs, the same order. Three kernels; no program ever waits for a later program of its own
launch unless every program is resident (a GPU launch capped at the SM count): the interpreter runs
programs one after another.

``dispatch_kernel`` (grid = SM budget)
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

    5. ``RECV``: that last program then waits for every peer's ``DONE_D``, reads the slot counter
       into ``total_recv`` and sets it back to zero (no other program of the launch waits, so this
       is safe in any order, interpreter included). A peer cannot reserve rows of the next call
       before this rank's next dispatch said "free", so the reset cannot race with it.

``dispatch_recv_kernel`` (one program) is step 5 alone, for ``AsyncLL``'s ``dispatch_recv``.

``combine_kernel`` (grid = SM budget) gathers: the rows peers will read are in the registered
combine input (zero-copy, or copied / fp8-quantised there first), the last program says so
(``DONE_C``); then each program sums, for each of its tokens, the rows of the ranks it was sent to,
read over NVLink / xGMI from the peers' registered buffers (its own from its input). One launch on
a GPU; STAGE and REDUCE launches under the interpreter and for AsyncLL.

``combine_push_kernel`` (grid = SM budget), for any other input: each rank stores the rows it holds
for a peer's tokens straight into that peer's staging at ``[this rank, token]``, chunk by chunk
in the peer's token order (``recv_slot``, written by every dispatch), with one flag per chunk;
each program reduces its chunks as the flags arrive, pushing its next chunk meanwhile.

Both combines end with ``READY_C``: the last program tells every peer "I have read what you
published" and waits until every peer said the same, so the next combine may overwrite it.

Epochs live in the control words on the device, so the kernels take no per-call host value
that changes from call to call: a CUDA graph of them replays correctly. Control words (int64,
symmetric, ``W`` = world size): ``[0, W)`` READY_D, ``[W, 2W)`` DONE_D, ``[2W, 3W)`` READY_C,
``[3W, 4W)`` DONE_C, then SLOT, EPOCH_D, EPOCH_C, TICKET_D, TICKET_C, the combine's read ticket,
ERR_D (local words), and DESC_D ``[2][W]``.

Ranks agree on each dispatch (see :mod:`mori.ep.agreement`): before its ready signal, program 0
of ``dispatch_kernel`` stores the call's descriptor (dtype, hidden size, scale bytes, weights,
replay; one word packed by the host) into every peer's ``DESC_D[epoch % 2][me]``; after the
handshake each program compares the W words. If any differs, every rank sends no row (and
publishes ``total_recv = 0``) and stores the epoch into ERR_D, from which the host names the
fields. A peer is at most one call ahead, so two descriptor rows by parity never mix calls.

Token rows travel as words (int32, int16 or uint8, the widest that the row size allows), so one
kernel serves every dtype of the same width class; combine's reduction reads them typed.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from mori.core.kernels import aot_variants, device_function
from mori.shmem import device as shd
from mori.viz import device as vd
from mori.viz.slots import declare_slots

__all__ = [
    "err_d_word",
    "combine_kernel",
    "combine_push_kernel",
    "ctrl_words",
    "desc_d_words",
    "dispatch_recv_kernel",
    "dispatch_kernel",
]


def ctrl_words(world: int) -> int:
    """int64 control words of one operator: the 4 * W signal words, six local words, ERR_D and the
    dispatch descriptors DESC_D[2][W] (see the module docstring)."""
    return 6 * world + 7


def err_d_word(world: int) -> int:
    """Index of ERR_D: the epoch of the last dispatch whose ranks disagreed (0: none)."""
    return 4 * world + 6


def desc_d_words(world: int, epoch: int) -> slice:
    """The W descriptor words of dispatch ``epoch`` (two alternate, by parity)."""
    base = 4 * world + 7 + (epoch % 2) * world
    return slice(base, base + world)


#: the protocol phases the kernels record when their TRACE constexpr is on (mori.viz)
DISPATCH = declare_slots(
    "ep.dispatch", ["kernel", "wait_ready", "reserve", "send", "fence", "done", "receive"]
)
COMBINE = declare_slots("ep.combine", ["kernel", "stage", "fence", "done", "wait", "reduce", "release"])
PUSH = declare_slots("ep.combine_push", ["kernel", "push", "reduce", "flag", "fence", "done", "release"])


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
def _post_desc(ctrl_ptr, desc, epoch, ctx_ptr, W: tl.constexpr):
    # program 0 stores this call's descriptor into every peer's DESC_D[epoch % 2][me], before the
    # ready signal of _handshake (a release by the same thread: a peer that saw the signal sees it)
    me = shd.my_pe(ctx_ptr)
    desc_off = 4 * W + 7 + (epoch % 2) * W
    if tl.program_id(0) == 0:
        for q in tl.static_range(W):
            shd.signal_op(ctrl_ptr + desc_off + me, desc, shd.SIGNAL_SET, q, ctx_ptr)


@device_function
@triton.jit
def _peers_disagree(ctrl_ptr, desc, epoch, W: tl.constexpr):
    # after _handshake: whether any peer posted another descriptor for call `epoch` (every rank
    # compares the same W words, so every rank decides alike)
    desc_off = 4 * W + 7 + (epoch % 2) * W
    bad = desc != desc
    for q in tl.static_range(W):
        bad = bad | (tl.load(ctrl_ptr + desc_off + q, volatile=True) != desc)
    return bad


@device_function
@triton.jit
def _finish(
    ctrl_ptr,
    ticket_off,
    epoch_off,
    done_off,
    epoch,
    ctx_ptr,
    tr,
    W: tl.constexpr,
    FENCE: tl.constexpr,
    DONE: tl.constexpr,
):
    # every program: fence its stores, take a ticket; the last one advances the epoch and tells
    # every peer that this rank's call `epoch` is complete. The release of each ticket and the
    # acquire of the last one chain every program's stores before the peers' signals.
    # Returns whether this program was the last, and the trace state (phases FENCE, DONE).
    tr = vd.begin(tr, FENCE)
    shd.fence(ctx_ptr)
    ticket = tl.atomic_add(ctrl_ptr + ticket_off, 1, sem="acq_rel", scope="sys")
    last = ticket == tl.num_programs(0) - 1
    tr = vd.end(tr, FENCE)
    if last:
        tr = vd.begin(tr, DONE)
        tl.store(ctrl_ptr + ticket_off, 0)
        tl.store(ctrl_ptr + epoch_off, epoch)
        me = shd.my_pe(ctx_ptr)
        for q in tl.static_range(W):
            shd.signal_op(ctrl_ptr + done_off + me, 1, shd.SIGNAL_ADD, q, ctx_ptr)
        tr = vd.end(tr, DONE)
    return last, tr


@device_function
@triton.jit
def _publish_total(ctrl_ptr, total_ptr, replay_total_ptr, epoch, W: tl.constexpr, REPLAY: tl.constexpr):
    # wait for every peer's dispatch `epoch`, then publish total_recv and reset the slot counter
    # (0 rows when the ranks disagreed on the call: ERR_D holds its epoch)
    _rd, DONE_D, _rc, _dc, SLOT, _ed, _ec, _td, _tc = _ctrl_offsets(W)
    for q in tl.static_range(W):
        shd.wait_until(ctrl_ptr + DONE_D + q, shd.SHMEM_CMP_GE, epoch)
    if REPLAY:
        total = tl.load(replay_total_ptr)
    else:
        total = tl.atomic_xchg(ctrl_ptr + SLOT, 0, sem="acq_rel", scope="sys").to(tl.int32)
    disagreed = tl.load(ctrl_ptr + 4 * W + 6, volatile=True) == epoch
    tl.store(total_ptr, tl.where(disagreed, 0, total))


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
        "recv_slot_ptr": "*i32",
        "total_ptr": "*i32",
        "replay_total_ptr": "*i32",
        "ctrl_ptr": "*i64",
        "ctx_ptr": "*i64",
        "desc": "i64",
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
                    "RECV": 1,
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


@aot_variants(vd.traced_variants(_dispatch_variants()))
@triton.jit
def dispatch_kernel(
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
    # symmetric int32 [W, M]: the same table seen from the receiver: recv_slot[s, t] on rank p is
    # the row of p's receive buffers holding rank s's token t, -1 if none (every entry written)
    recv_slot_ptr,
    # int32 [1] total_recv (written when RECV), int32 [1] the routing handle's (read when REPLAY)
    total_ptr,
    replay_total_ptr,
    # symmetric int64 control words, shmem context
    ctrl_ptr,
    ctx_ptr,
    # this call's descriptor (dtype, hidden size, scales, weights, replay; packed on the host):
    # every rank must pass the same one, or the call moves no row and ERR_D records it
    desc,
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
    RECV: tl.constexpr,
    BT: tl.constexpr,
    BLOCK: tl.constexpr,
    SC_BLOCK: tl.constexpr,
    # trace buffer (mori.viz) when TRACE; None otherwise
    trace_ptr=None,
    TRACE: tl.constexpr = False,
):
    """Reserve rows on every destination rank and store this rank's tokens there (see module)."""
    READY_D, DONE_D, _rc, _dc, SLOT, EPOCH_D, _ec, TICKET_D, _tc = _ctrl_offsets(W)
    tr = vd.open_trace(trace_ptr, TRACE)
    tr = vd.begin(tr, DISPATCH.kernel)
    pid = tl.program_id(0)
    me = shd.my_pe(ctx_ptr)
    epoch = tl.load(ctrl_ptr + EPOCH_D) + 1
    tr = vd.begin(tr, DISPATCH.wait_ready)
    _post_desc(ctrl_ptr, desc, epoch, ctx_ptr, W)
    _handshake(ctrl_ptr, READY_D, epoch, ctx_ptr, W)
    # ranks that disagree on the call send nothing (every rank sees the same descriptors)
    n_send = n_tok
    if _peers_disagree(ctrl_ptr, desc, epoch, W):
        tl.store(ctrl_ptr + 4 * W + 6, epoch)  # ERR_D: the host names the fields
        n_send = 0
    tr = vd.next_span(tr, DISPATCH.reserve)

    per = tl.cdiv(n_send, tl.num_programs(0))
    t_begin = pid * per
    t_end = tl.minimum(t_begin + per, n_send)
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
    tr = vd.next_span(tr, DISPATCH.send)
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
        for p in tl.static_range(W):
            slot = tl.sum(tl.where(lanes[None, :] == p, tl.where(ok_all, slots, -1), 0), axis=1)
            tl.store(shd.ptr_p2p(recv_slot_ptr, p, ctx_ptr) + me * M + toks, slot, mask=tmask)
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
    # tokens this rank does not send this call: no row anywhere (recv_slot is complete every call;
    # dest_slot too, unless it is a routing handle's)
    per_tail = tl.cdiv(M - n_send, tl.num_programs(0))
    t0 = n_send + pid * per_tail
    t_end = tl.minimum(t0 + per_tail, M)
    while t0 < t_end:
        toks = t0 + cols0
        for p in tl.static_range(W):
            tl.store(shd.ptr_p2p(recv_slot_ptr, p, ctx_ptr) + me * M + toks, -1, mask=toks < t_end)
            if not REPLAY:
                tl.store(dest_slot_ptr + p * M + toks, -1, mask=toks < t_end)
        t0 += BLOCK

    tr = vd.end(tr, DISPATCH.send)
    last, tr = _finish(
        ctrl_ptr, TICKET_D, EPOCH_D, DONE_D, epoch, ctx_ptr, tr, W, DISPATCH.fence, DISPATCH.done
    )
    if RECV:  # noqa: SIM102  (a constexpr and a tensor: Triton takes no `and` here)
        if last:  # every other program of this launch is done: nothing waits for this one
            tr = vd.begin(tr, DISPATCH.receive)
            _publish_total(ctrl_ptr, total_ptr, replay_total_ptr, epoch, W, REPLAY)
            tr = vd.end(tr, DISPATCH.receive)
    tr = vd.end(tr, DISPATCH.kernel)
    vd.close_trace(tr)


@aot_variants(
    vd.traced_variants(
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
)
@triton.jit
def dispatch_recv_kernel(
    ctrl_ptr,
    total_ptr,
    replay_total_ptr,
    W: tl.constexpr,
    REPLAY: tl.constexpr,
    trace_ptr=None,
    TRACE: tl.constexpr = False,
):
    """One program (AsyncLL's receive half): wait for every peer's dispatch, publish
    ``total_recv``, reset the slot counter."""
    _rd, _dd, _rc, _dc, _s, EPOCH_D, _ec, _td, _tc = _ctrl_offsets(W)
    tr = vd.open_trace(trace_ptr, TRACE)
    tr = vd.begin(tr, DISPATCH.receive)
    _publish_total(ctrl_ptr, total_ptr, replay_total_ptr, tl.load(ctrl_ptr + EPOCH_D), W, REPLAY)
    tr = vd.end(tr, DISPATCH.receive)
    vd.close_trace(tr)


@device_function
@triton.jit
def _release_reads(ctrl_ptr, epoch, ctx_ptr, W: tl.constexpr):
    # every program of combine `epoch` has read what it needed: the last one says so to every peer
    # (READY_C), then waits until every peer has read what this rank published, so that the next
    # combine may overwrite it (nothing of this launch waits for that program)
    _rd, _dd, READ_C, _dc, _s, _ed, _ec, _td, _tc = _ctrl_offsets(W)
    TICKET_R = 4 * W + 5
    me = shd.my_pe(ctx_ptr)
    shd.fence(ctx_ptr)
    ticket = tl.atomic_add(ctrl_ptr + TICKET_R, 1, sem="acq_rel", scope="sys")
    if ticket == tl.num_programs(0) - 1:
        tl.store(ctrl_ptr + TICKET_R, 0)
        for q in tl.static_range(W):
            shd.signal_op(ctrl_ptr + READ_C + me, 1, shd.SIGNAL_ADD, q, ctx_ptr)
        for q in tl.static_range(W):
            shd.wait_until(ctrl_ptr + READ_C + q, shd.SHMEM_CMP_GE, epoch)


#: largest finite float8_e4m3fn value: the fp8 wire saturates there; blockwise scales map to it
_FP8_MAX = tl.constexpr(448.0)


@device_function
@triton.jit
def _round_e4m3(x):
    # fp32 -> the nearest float8_e4m3fn value (ties to even), saturated at +-448, still in fp32, so
    # that the cast after it is exact. Done by hand because Triton 3.6's interpreter rounds wrongly
    # when the rounding carries into the exponent (7.9 -> 4.0), and so that every target rounds
    # alike: the quantum is 2^(exponent - 3) (3 mantissa bits), 2^-9 below the normal range.
    bits = x.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    quantum = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2**23: adding and subtracting it rounds to an integer, ties to even
    r = ((x / quantum + magic) - magic) * quantum
    return tl.minimum(tl.maximum(r, -_FP8_MAX), _FP8_MAX)


#: largest e2m1 magnitude: fp4 blockwise scales map a block's max |x| to it
_E2M1_MAX = tl.constexpr(6.0)


@device_function
@triton.jit
def _e2m1_code(x):
    # fp32 -> e2m1 code (int32 0..15, sign in bit 3): round to nearest, ties to even, saturating at
    # +-6; no hardware conversion (the same bits on every target, as mori.ep.fp4.encode): count the
    # midpoints of the grid 0, .5, 1, 1.5, 2, 3, 4, 6 below |x| (a tie rounds to the even code)
    a = tl.abs(x)
    code = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
    code += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
    code += (a > 5.0).to(tl.int32)
    return tl.where((x < 0) & (code > 0), code | 8, code)


@device_function
@triton.jit
def _e2m1_value(code):
    # e2m1 code (int32 0..15) -> fp32: exponent 0 is subnormal (0 or 0.5), else 2^(e-1) * (1 + m/2)
    e = (code >> 1) & 3
    m = (code & 1).to(tl.float32)
    mag = tl.where(e == 0, m * 0.5, tl.exp2((e - 1).to(tl.float32)) * (1.0 + m * 0.5))
    return tl.where((code & 8) != 0, -mag, mag)


#: what one launch of combine_kernel does (host-side flags): publish this rank's rows (STAGE),
#: gather and sum every token's rows (REDUCE), or both (GPU: one launch)
STAGE = 1
REDUCE = 2


def _combine_variants() -> list[dict[str, Any]]:
    sig = {
        "inp_ptr": "*i32",
        "inp_stride": "i64",
        "own_ptr": "*bf16",
        "own_stride": "i64",
        "w_ptr": "*fp32",
        "n_inp_rows": "i32",
        "recv_src_ptr": "*i32",
        "total_ptr": "*i32",
        "cinp_ptr": "*i32",
        "cinp_row_words": "i32",
        "cinp_typed_ptr": "*bf16",
        "cinp_row_elems": "i32",
        "cw_ptr": "*fp32",
        "cq_ptr": "*fp8e4nv",
        "cq_row": "i32",
        "cs_ptr": "*fp32",
        "n_scales": "i32",
        "dest_slot_ptr": "*i32",
        "out_ptr": "*bf16",
        "out_w_ptr": "*fp32",
        "ctrl_ptr": "*i64",
        "ctx_ptr": "*i64",
        "n_tok": "i32",
        "h": "i32",
        "row_words": "i32",
        "M": "i32",
    }
    out = []
    for w, has_w, copy, dt, phases, quant in (
        (2, 0, 1, "*bf16", 3, 0),
        (2, 1, 0, "*bf16", 3, 0),
        (8, 1, 1, "*bf16", 3, 0),
        (2, 1, 1, "*fp32", 1, 0),
        (2, 1, 1, "*fp32", 2, 0),
        (2, 0, 1, "*bf16", 3, 1),
        (8, 1, 1, "*bf16", 3, 2),
        (2, 1, 1, "*bf16", 3, 3),
    ):
        cq = "*u8" if quant == 3 else "*fp8e4nv"
        out.append(
            {
                "signature": {**sig, "own_ptr": dt, "cinp_typed_ptr": dt, "out_ptr": dt, "cq_ptr": cq},
                "constexprs": {
                    "W": w,
                    "K": 8,
                    "K_P2": 8,
                    "HAS_W": has_w,
                    "COPY": copy,
                    "DO_STAGE": int(bool(phases & STAGE)),
                    "DO_REDUCE": int(bool(phases & REDUCE)),
                    "QUANT": quant,
                    "QB": {2: 128, 3: 32}.get(quant, 1),
                    "BT": 4,
                    "BLOCK": 2048,
                },
                "aligned": (
                    "inp_ptr",
                    "own_ptr",
                    "cinp_ptr",
                    "cinp_typed_ptr",
                    "out_ptr",
                    "ctrl_ptr",
                    "ctx_ptr",
                ),
                "num_warps": 16,
                "label": f"W={w} {dt[1:]} weights={has_w} copy={copy} phases={phases} quant={quant}",
            }
        )
    return out


@aot_variants(vd.traced_variants(_combine_variants()))
@triton.jit
def combine_kernel(
    # expert outputs, row i for received row i: words [>= total, >= row_words] (copied to the
    # registered buffer when COPY) and typed like the output (this rank's own rows are read there)
    inp_ptr,
    inp_stride,
    own_ptr,
    own_stride,
    # combine weights fp32 [>= total, K]; rows available in the input
    w_ptr,
    n_inp_rows,
    # int32 [R] flat source positions of the received rows, int32 [1] how many
    recv_src_ptr,
    total_ptr,
    # the registered combine input (symmetric) as words and typed like the output, and the
    # registered combine weights fp32 [R, K] (symmetric)
    cinp_ptr,
    cinp_row_words,
    cinp_typed_ptr,
    cinp_row_elems,
    cw_ptr,
    # wire quantisation (QUANT > 0): the registered buffer as fp8 e4m3fn rows of cq_row bytes (as
    # uint8 with packed fp4 for QUANT = 3), and fp32 block scales [R, n_scales] (symmetric; QUANT
    # = 2 or 3)
    cq_ptr,
    cq_row,
    cs_ptr,
    n_scales,
    # int32 [W, M] from the dispatch: token t went to rank p iff dest_slot[p, t] >= 0, as row
    # dest_slot[p, t] of p's receive buffer, hence of p's combine input
    dest_slot_ptr,
    # outputs: tokens [>= n_tok, h], weights fp32 [>= n_tok, K]
    out_ptr,
    out_w_ptr,
    ctrl_ptr,
    ctx_ptr,
    n_tok,
    h,
    row_words,
    M,
    W: tl.constexpr,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    HAS_W: tl.constexpr,
    COPY: tl.constexpr,
    DO_STAGE: tl.constexpr,
    DO_REDUCE: tl.constexpr,
    QUANT: tl.constexpr,
    QB: tl.constexpr,
    BT: tl.constexpr,
    BLOCK: tl.constexpr,
    # trace buffer (mori.viz) when TRACE; None otherwise
    trace_ptr=None,
    TRACE: tl.constexpr = False,
):
    """Combine by gathering: every rank reads each of its tokens' rows where they are.

    STAGE: rows that other ranks will read are put in the registered (symmetric) combine input,
    unless they are there already (zero-copy: ``COPY`` = 0), with their weights; the last program
    tells every peer "my rows for call e are readable" (``DONE_C``). REDUCE: once every peer said
    so, each program sums, in fp32 and in rank order, each of its tokens' rows: its own straight
    from the input, the others' read from the peers' registered buffers (loads over NVLink /
    xGMI), casts once, then the last program tells every peer "I have read yours" (``READY_C``)
    and waits until every peer has read this rank's, so the buffer may be rewritten afterwards.
    One launch on a GPU, where every program is resident; two under the interpreter (programs
    run one after another) and for AsyncLL's split.

    ``QUANT`` (bf16 input, copied): the rows peers read cross the wire as fp8 e4m3fn, saturating
    (1: ``fp8_direct_cast``), or with blocks of ``QB`` elements whose max ``|x|`` exceeds 448
    divided by ``max|x| / 448`` first, the fp32 scales stored beside the row (2:
    ``fp8_blockwise``), or as e2m1 packed two a byte (low nibble first), each block of ``QB``
    divided by ``max|x| / 6`` (1 if all zero) with its fp32 scale (3: ``fp4_blockwise``, rounded
    in software, :func:`_e2m1_code`); the reader dequantises. Rows that stay on this rank are not
    quantised.
    """
    _rd, _dd, _rc, DONE_C, _s, _ed, EPOCH_C, _td, TICKET_C = _ctrl_offsets(W)
    tr = vd.open_trace(trace_ptr, TRACE)
    tr = vd.begin(tr, COMBINE.kernel)
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BT
    me = shd.my_pe(ctx_ptr)
    offs = tl.arange(0, BT)
    ks = tl.arange(0, K_P2)
    cols0 = tl.arange(0, BLOCK)
    if DO_STAGE:
        tr = vd.begin(tr, COMBINE.stage)
        epoch = tl.load(ctrl_ptr + EPOCH_C) + 1
        total = tl.minimum(tl.load(total_ptr), n_inp_rows)
        span = W * M
        r0 = pid * BT
        while r0 < total:
            rows = r0 + offs
            rmask = rows < total
            if QUANT:  # rows of other ranks, quantised to fp8 on the way into the registered buffer
                pos = tl.load(recv_src_ptr + rows, mask=rmask, other=0)
                cmask = rmask & (pos // span != me)
                rows64 = rows.to(tl.int64)
                c = 0
                while c < h:
                    cols = c + cols0
                    m = cmask[:, None] & (cols < h)[None, :]
                    x = tl.load(own_ptr + rows64[:, None] * own_stride + cols[None, :], mask=m, other=0.0)
                    x = x.to(tl.float32)
                    if QUANT >= 2:  # blockwise: one fp32 scale per QB values
                        xb = tl.reshape(x, [BT, BLOCK // QB, QB])
                        amax = tl.max(tl.abs(xb), axis=2)
                        if QUANT == 2:
                            sc = tl.where(amax > _FP8_MAX, amax / _FP8_MAX, 1.0)
                        else:
                            sc = tl.where(amax > 0, amax / _E2M1_MAX, 1.0)
                        x = tl.reshape(xb / sc[:, :, None], [BT, BLOCK])
                        bidx = c // QB + tl.arange(0, BLOCK // QB)
                        ms = cmask[:, None] & (bidx < n_scales)[None, :]
                        tl.store(cs_ptr + rows64[:, None] * n_scales + bidx[None, :], sc, mask=ms)
                    if QUANT == 3:  # two e2m1 codes a byte: element 2i low, 2i + 1 high
                        lo, hi = tl.split(tl.reshape(_e2m1_code(x), [BT, BLOCK // 2, 2]))
                        pcols = c // 2 + tl.arange(0, BLOCK // 2)
                        mp = cmask[:, None] & (pcols < h // 2)[None, :]
                        byte = (lo | (hi << 4)).to(tl.uint8)
                        tl.store(cq_ptr + rows64[:, None] * cq_row + pcols[None, :], byte, mask=mp)
                    else:
                        q = _round_e4m3(x).to(cq_ptr.dtype.element_ty)
                        tl.store(cq_ptr + rows64[:, None] * cq_row + cols[None, :], q, mask=m)
                    c += BLOCK
            elif COPY:  # rows of other ranks only: this rank's own are read from the input
                pos = tl.load(recv_src_ptr + rows, mask=rmask, other=0)
                cmask = rmask & (pos // span != me)
                c = 0
                while c < row_words:
                    cols = c + cols0
                    m = cmask[:, None] & (cols < row_words)[None, :]
                    data = tl.load(inp_ptr + rows.to(tl.int64)[:, None] * inp_stride + cols[None, :], mask=m)
                    tl.store(
                        cinp_ptr + rows.to(tl.int64)[:, None] * cinp_row_words + cols[None, :], data, mask=m
                    )
                    c += BLOCK
            if HAS_W:
                mk = rmask[:, None] & (ks < K)[None, :]
                wts = tl.load(w_ptr + rows[:, None] * K + ks[None, :], mask=mk)
                tl.store(cw_ptr + rows[:, None] * K + ks[None, :], wts, mask=mk)
            r0 += step
        tr = vd.end(tr, COMBINE.stage)
        _, tr = _finish(
            ctrl_ptr, TICKET_C, EPOCH_C, DONE_C, epoch, ctx_ptr, tr, W, COMBINE.fence, COMBINE.done
        )
    if DO_REDUCE:
        if DO_STAGE:
            target = epoch
        else:  # advanced by the last program of the STAGE launch
            target = tl.load(ctrl_ptr + EPOCH_C)
        tr = vd.begin(tr, COMBINE.wait)
        for q in tl.static_range(W):
            shd.wait_until(ctrl_ptr + DONE_C + q, shd.SHMEM_CMP_GE, target)
        tr = vd.next_span(tr, COMBINE.reduce)
        t0 = pid * BT
        while t0 < n_tok:
            toks = t0 + offs
            tmask = toks < n_tok
            c = 0
            while c < h:
                cols = c + cols0
                cm = cols < h
                acc = tl.zeros([BT, BLOCK], dtype=tl.float32)
                for p in tl.static_range(W):
                    slot = tl.load(dest_slot_ptr + p * M + toks, mask=tmask, other=-1).to(tl.int64)
                    if p == me:
                        m = ((slot >= 0) & (slot < n_inp_rows))[:, None] & cm[None, :]
                        v = tl.load(own_ptr + slot[:, None] * own_stride + cols[None, :], mask=m, other=0.0)
                        v = v.to(tl.float32)  # (every branch yields fp32: Triton wants one type)
                    elif QUANT == 3:
                        pcols = c // 2 + tl.arange(0, BLOCK // 2)
                        mp = (slot >= 0)[:, None] & (pcols < h // 2)[None, :]
                        src_q = shd.ptr_p2p(cq_ptr + slot * cq_row, p, ctx_ptr)
                        byte = tl.load(src_q[:, None] + pcols[None, :], mask=mp, other=0).to(tl.int32)
                        pair = tl.join(_e2m1_value(byte & 15), _e2m1_value(byte >> 4))
                        v = tl.reshape(pair, [BT, BLOCK])
                        mr = (slot >= 0)[:, None] & cm[None, :]
                        src_s = shd.ptr_p2p(cs_ptr + slot * n_scales, p, ctx_ptr)
                        v = v * tl.load(src_s[:, None] + (cols // QB)[None, :], mask=mr, other=0.0)
                    elif QUANT:
                        mr = (slot >= 0)[:, None] & cm[None, :]
                        src_q = shd.ptr_p2p(cq_ptr + slot * cq_row, p, ctx_ptr)
                        v = tl.load(src_q[:, None] + cols[None, :], mask=mr, other=0.0).to(tl.float32)
                        if QUANT == 2:
                            src_s = shd.ptr_p2p(cs_ptr + slot * n_scales, p, ctx_ptr)
                            v = v * tl.load(src_s[:, None] + (cols // QB)[None, :], mask=mr, other=1.0)
                    else:
                        src = shd.ptr_p2p(cinp_typed_ptr + slot * cinp_row_elems, p, ctx_ptr)
                        v = tl.load(
                            src[:, None] + cols[None, :], mask=(slot >= 0)[:, None] & cm[None, :], other=0.0
                        ).to(tl.float32)
                    acc += v
                out = out_ptr + toks.to(tl.int64)[:, None] * h + cols[None, :]
                tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=tmask[:, None] & cm[None, :])
                c += BLOCK
            if HAS_W:
                mk = tmask[:, None] & (ks < K)[None, :]
                acc_w = tl.zeros([BT, K_P2], dtype=tl.float32)
                for p in tl.static_range(W):
                    slot = tl.load(dest_slot_ptr + p * M + toks, mask=tmask, other=-1)
                    src_w = shd.ptr_p2p(cw_ptr + slot * K, p, ctx_ptr)
                    acc_w += tl.load(src_w[:, None] + ks[None, :], mask=mk & (slot >= 0)[:, None], other=0.0)
                tl.store(out_w_ptr + toks[:, None] * K + ks[None, :], acc_w, mask=mk)
            t0 += step
        tr = vd.next_span(tr, COMBINE.release)
        _release_reads(ctrl_ptr, target, ctx_ptr, W)
        tr = vd.end(tr, COMBINE.release)
    tr = vd.end(tr, COMBINE.kernel)
    vd.close_trace(tr)


def _combine_push_variants() -> list[dict[str, Any]]:
    sig = {
        "inp_ptr": "*i32",
        "inp_stride": "i64",
        "own_ptr": "*bf16",
        "own_stride": "i64",
        "w_ptr": "*fp32",
        "n_inp_rows": "i32",
        "recv_slot_ptr": "*i32",
        "dest_slot_ptr": "*i32",
        "stage_ptr": "*i32",
        "stage_row_words": "i32",
        "stage_typed_ptr": "*bf16",
        "stage_row_elems": "i32",
        "stage_w_ptr": "*fp32",
        "flag_ptr": "*i64",
        "n_chunks": "i32",
        "out_ptr": "*bf16",
        "out_w_ptr": "*fp32",
        "ctrl_ptr": "*i64",
        "ctx_ptr": "*i64",
        "n_tok": "i32",
        "h": "i32",
        "row_words": "i32",
        "M": "i32",
    }
    out = []
    # W=8 with one tile per chunk (CT == BT): the chunk loop of CT // BT tiles is unrolled W times,
    # and at CT=16, BT=4 that variant alone took 69 s per target to compile (14 s at CT=BT=4); the
    # loop over several tiles is compiled by the W=2 CT=16 BT=8 variant
    for w, has_w, dt, phases, ct, bt in (
        (2, 0, "*bf16", 3, 16, 16),
        (2, 1, "*bf16", 3, 16, 8),
        (2, 0, "*bf16", 3, 1, 1),
        (8, 1, "*bf16", 3, 4, 4),
        (2, 1, "*fp32", 1, 16, 4),
        (2, 1, "*fp32", 2, 16, 4),
    ):
        out.append(
            {
                "signature": {**sig, "own_ptr": dt, "stage_typed_ptr": dt, "out_ptr": dt},
                "constexprs": {
                    "W": w,
                    "K": 8,
                    "K_P2": 8,
                    "HAS_W": has_w,
                    "DO_PUSH": int(bool(phases & STAGE)),
                    "DO_REDUCE": int(bool(phases & REDUCE)),
                    "CT": ct,
                    "BT": bt,
                    "BLOCK": 2048,
                },
                "aligned": (
                    "inp_ptr",
                    "own_ptr",
                    "stage_ptr",
                    "stage_typed_ptr",
                    "out_ptr",
                    "ctrl_ptr",
                    "ctx_ptr",
                ),
                "num_warps": 16,
                "label": f"W={w} {dt[1:]} weights={has_w} phases={phases} CT={ct} BT={bt}",
            }
        )
    return out


@device_function
@triton.jit
def _push_chunk(
    c,
    inp_ptr,
    inp_stride,
    w_ptr,
    n_inp_rows,
    recv_slot_ptr,
    stage_ptr,
    stage_row_words,
    stage_w_ptr,
    ctx_ptr,
    row_words,
    M,
    W: tl.constexpr,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    HAS_W: tl.constexpr,
    CT: tl.constexpr,
    BT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # every peer's rows of chunk c: from this rank's input to the peer's staging at [me, t]
    me = shd.my_pe(ctx_ptr)
    ks = tl.arange(0, K_P2)
    cols0 = tl.arange(0, BLOCK)
    for p in tl.static_range(W):
        if p != me:
            for b in tl.static_range(CT // BT):
                toks = c * CT + b * BT + tl.arange(0, BT)
                row = tl.load(recv_slot_ptr + p * M + toks, mask=toks < M, other=-1)
                ok = (row >= 0) & (row < n_inp_rows)
                row64 = row.to(tl.int64)
                dst_row = shd.ptr_p2p(stage_ptr, p, ctx_ptr) + (me * M + toks).to(tl.int64) * stage_row_words
                col = 0
                while col < row_words:
                    cols = col + cols0
                    m = ok[:, None] & (cols < row_words)[None, :]
                    data = tl.load(inp_ptr + row64[:, None] * inp_stride + cols[None, :], mask=m)
                    tl.store(dst_row[:, None] + cols[None, :], data, mask=m)
                    col += BLOCK
                if HAS_W:
                    mk = ok[:, None] & (ks < K)[None, :]
                    wts = tl.load(w_ptr + row64[:, None] * K + ks[None, :], mask=mk)
                    dst_w = shd.ptr_p2p(stage_w_ptr, p, ctx_ptr) + (me * M + toks)[:, None] * K
                    tl.store(dst_w + ks[None, :], wts, mask=mk)


@device_function
@triton.jit
def _reduce_chunk(
    c,
    epoch,
    own_ptr,
    own_stride,
    w_ptr,
    n_inp_rows,
    dest_slot_ptr,
    stage_typed_ptr,
    stage_row_elems,
    stage_w_ptr,
    flag_ptr,
    n_chunks,
    out_ptr,
    out_w_ptr,
    ctx_ptr,
    n_tok,
    h,
    M,
    W: tl.constexpr,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    HAS_W: tl.constexpr,
    CT: tl.constexpr,
    BT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # wait for the peers holding one of chunk c's tokens, then sum own rows and staged rows
    me = shd.my_pe(ctx_ptr)
    ks = tl.arange(0, K_P2)
    cols0 = tl.arange(0, BLOCK)
    for p in tl.static_range(W):
        if p != me:
            toks = c * CT + tl.arange(0, CT)
            sent = tl.load(dest_slot_ptr + p * M + toks, mask=toks < n_tok, other=-1)
            if tl.max(sent, axis=0) >= 0:
                shd.wait_until(flag_ptr + p * n_chunks + c, shd.SHMEM_CMP_GE, epoch)
    for b in tl.static_range(CT // BT):
        toks = c * CT + b * BT + tl.arange(0, BT)
        tmask = toks < n_tok
        col = 0
        while col < h:
            cols = col + cols0
            cm = cols < h
            acc = tl.zeros([BT, BLOCK], dtype=tl.float32)
            for p in tl.static_range(W):
                slot = tl.load(dest_slot_ptr + p * M + toks, mask=tmask, other=-1)
                # `me` is a runtime value, so this `if` is a real branch: each side loads its rows
                # and yields values, never a pointer. The two sides' pointers have different bases
                # (the input, the staging), both small tensors on AMD (tt.pointer_range=32, every
                # launch under 2 GiB), and Triton 3.6's AMD pointer canonicalisation cannot merge
                # two small-tensor bases at an `if` (it aborts, CanonicalizePointers.cpp). Only
                # the side taken runs, so the memory traffic is that of one load, as before.
                if p == me:
                    m = ((slot >= 0) & (slot < n_inp_rows))[:, None] & cm[None, :]
                    src = own_ptr + slot.to(tl.int64)[:, None] * own_stride
                    v = tl.load(src + cols[None, :], mask=m, other=0.0).to(tl.float32)
                else:
                    m = (slot >= 0)[:, None] & cm[None, :]
                    src = stage_typed_ptr + (p * M + toks).to(tl.int64)[:, None] * stage_row_elems
                    v = tl.load(src + cols[None, :], mask=m, other=0.0).to(tl.float32)
                acc += v
            out = out_ptr + toks.to(tl.int64)[:, None] * h + cols[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=tmask[:, None] & cm[None, :])
            col += BLOCK
        if HAS_W:
            mk = tmask[:, None] & (ks < K)[None, :]
            acc_w = tl.zeros([BT, K_P2], dtype=tl.float32)
            for p in tl.static_range(W):
                slot = tl.load(dest_slot_ptr + p * M + toks, mask=tmask, other=-1)
                if p == me:  # loads in the branches, as above
                    mw = mk & ((slot >= 0) & (slot < n_inp_rows))[:, None]
                    wts = tl.load(w_ptr + slot[:, None] * K + ks[None, :], mask=mw, other=0.0)
                else:
                    mw = mk & (slot >= 0)[:, None]
                    wts = tl.load(stage_w_ptr + (p * M + toks)[:, None] * K + ks[None, :], mask=mw, other=0.0)
                acc_w += wts
            tl.store(out_w_ptr + toks[:, None] * K + ks[None, :], acc_w, mask=mk)


@device_function
@triton.jit
def _flag_chunk(c, epoch, flag_ptr, n_chunks, ctx_ptr, W: tl.constexpr):
    # this program's stores of chunk c reach every peer before the peer sees the flag
    me = shd.my_pe(ctx_ptr)
    shd.fence(ctx_ptr)
    for p in tl.static_range(W):
        if p != me:
            shd.signal_op(flag_ptr + me * n_chunks + c, epoch, shd.SIGNAL_SET, p, ctx_ptr)


@aot_variants(vd.traced_variants(_combine_push_variants()))
@triton.jit
def combine_push_kernel(
    # expert outputs, row i for received row i: as words [>= n_inp_rows, >= row_words] and typed
    # like the output; combine weights fp32 [>= n_inp_rows, K]
    inp_ptr,
    inp_stride,
    own_ptr,
    own_stride,
    w_ptr,
    n_inp_rows,
    # int32 [W, M] of the dispatch: recv_slot[s, t] = the received row holding rank s's token t
    # (-1: none); dest_slot[p, t] = the row of rank p holding this rank's token t (-1: not sent)
    recv_slot_ptr,
    dest_slot_ptr,
    # symmetric staging [W, M] rows (words and typed views) and weights [W, M, K]: rank p's row
    # for this rank's token t lands at [p, t]
    stage_ptr,
    stage_row_words,
    stage_typed_ptr,
    stage_row_elems,
    stage_w_ptr,
    # symmetric int64 [W, n_chunks]: flag[p, c] = the combine epoch once rank p's rows of chunk c
    # (tokens [c * CT, (c + 1) * CT)) are in this rank's staging
    flag_ptr,
    n_chunks,
    # outputs: tokens [>= n_tok, h], weights fp32 [>= n_tok, K]
    out_ptr,
    out_w_ptr,
    ctrl_ptr,
    ctx_ptr,
    n_tok,
    h,
    row_words,
    M,
    W: tl.constexpr,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    HAS_W: tl.constexpr,
    DO_PUSH: tl.constexpr,
    DO_REDUCE: tl.constexpr,
    CT: tl.constexpr,
    BT: tl.constexpr,
    BLOCK: tl.constexpr,
    # trace buffer (mori.viz) when TRACE; None otherwise
    trace_ptr=None,
    TRACE: tl.constexpr = False,
):
    """Combine by pushing, for an expert output outside the registered buffer.

    Tokens are cut into chunks of ``CT`` (the same on every rank); program ``i`` takes chunks
    ``i, i + G, ...``. PUSH: for each peer ``s``, the rows this rank holds for ``s``'s tokens of the
    chunk go from the input straight to ``s``'s staging (NVLink / xGMI stores, in ``s``'s token
    order, so ``s`` can reduce a chunk as soon as it lands), then a fence and one flag per peer.
    REDUCE: once every peer that holds one of the chunk's tokens flagged it, sum in fp32 and rank
    order this rank's own rows (from the input) and the staged ones; cast once. A GPU launch does
    both per chunk, so the NVLink stores of some programs overlap the local reductions of others;
    the interpreter and AsyncLL's split run PUSH and REDUCE as two launches. Epochs and the
    READY_C / DONE_C counters advance exactly as in :func:`combine_kernel`, so the two kernels
    may alternate on one operator.
    """
    _rd, _dd, _rc, DONE_C, _s, _ed, EPOCH_C, _td, TICKET_C = _ctrl_offsets(W)
    tr = vd.open_trace(trace_ptr, TRACE)
    tr = vd.begin(tr, PUSH.kernel)
    step = tl.num_programs(0)
    if DO_PUSH:
        epoch = tl.load(ctrl_ptr + EPOCH_C) + 1
    else:  # advanced by the last program of the PUSH launch
        epoch = tl.load(ctrl_ptr + EPOCH_C)
    # software pipeline: chunk c + step is pushed (its NVLink stores in flight) while chunk c is
    # reduced, then fenced and flagged. A peer flags c only after reducing c - step, which waited
    # for this rank's flag of c - step: the chain starts with every program's first push. That first
    # push stays outside the loop on purpose: starting the loop a step early instead (its first round
    # only pushing) measured 3.5 % slower at 24 SMs on 2xH200 (combine 323 vs 334 GB/s, A/B in one
    # session, docs/benchmarks/ep.md), the same at 132 SMs.
    c = tl.program_id(0)
    if DO_PUSH:  # noqa: SIM102  (a constexpr and a tensor: Triton takes no `and` here)
        if c < n_chunks:
            tr = vd.begin(tr, PUSH.push)
            _push_chunk(
                c,
                inp_ptr,
                inp_stride,
                w_ptr,
                n_inp_rows,
                recv_slot_ptr,
                stage_ptr,
                stage_row_words,
                stage_w_ptr,
                ctx_ptr,
                row_words,
                M,
                W,
                K,
                K_P2,
                HAS_W,
                CT,
                BT,
                BLOCK,
            )
            tr = vd.next_span(tr, PUSH.flag)
            _flag_chunk(c, epoch, flag_ptr, n_chunks, ctx_ptr, W)
            tr = vd.end(tr, PUSH.flag)
    while c < n_chunks:
        nxt = c + step
        if DO_PUSH:  # noqa: SIM102
            if nxt < n_chunks:
                tr = vd.begin(tr, PUSH.push)
                _push_chunk(
                    nxt,
                    inp_ptr,
                    inp_stride,
                    w_ptr,
                    n_inp_rows,
                    recv_slot_ptr,
                    stage_ptr,
                    stage_row_words,
                    stage_w_ptr,
                    ctx_ptr,
                    row_words,
                    M,
                    W,
                    K,
                    K_P2,
                    HAS_W,
                    CT,
                    BT,
                    BLOCK,
                )
                tr = vd.end(tr, PUSH.push)
        if DO_REDUCE:
            tr = vd.begin(tr, PUSH.reduce)
            _reduce_chunk(
                c,
                epoch,
                own_ptr,
                own_stride,
                w_ptr,
                n_inp_rows,
                dest_slot_ptr,
                stage_typed_ptr,
                stage_row_elems,
                stage_w_ptr,
                flag_ptr,
                n_chunks,
                out_ptr,
                out_w_ptr,
                ctx_ptr,
                n_tok,
                h,
                M,
                W,
                K,
                K_P2,
                HAS_W,
                CT,
                BT,
                BLOCK,
            )
            tr = vd.end(tr, PUSH.reduce)
        if DO_PUSH:  # noqa: SIM102
            if nxt < n_chunks:
                tr = vd.begin(tr, PUSH.flag)
                _flag_chunk(nxt, epoch, flag_ptr, n_chunks, ctx_ptr, W)
                tr = vd.end(tr, PUSH.flag)
        c = nxt
    if DO_PUSH:
        _, tr = _finish(ctrl_ptr, TICKET_C, EPOCH_C, DONE_C, epoch, ctx_ptr, tr, W, PUSH.fence, PUSH.done)
    if DO_REDUCE:
        tr = vd.begin(tr, PUSH.release)
        _release_reads(ctrl_ptr, epoch, ctx_ptr, W)
        tr = vd.end(tr, PUSH.release)
    tr = vd.end(tr, PUSH.kernel)
    vd.close_trace(tr)

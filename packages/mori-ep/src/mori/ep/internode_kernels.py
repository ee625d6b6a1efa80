# Jitted functions carry no Python annotations (Triton reads them), so mypy may not ask for them:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Triton kernels of the inter-node EP kernel types (``InterNode``, ``InterNodeV1``, ``InterNodeV1LL``).

The wire protocol is the host path's (:mod:`mori.ep.internode`): a *stream* is one put of packed
wire rows from this rank's staging (``xout``) into the receiver's inbound buffer (``xin``) at this
rank's slot, then ONE signal word set to ``epoch << 32 | rows``. Across nodes the kernels use only
puts and ``SIGNAL_SET`` of epoch-tagged words (what a GPU heap on ``ucx`` without RDMA allows: the
proxy's ``rma_signals`` mode refuses ``SIGNAL_ADD`` and other read-modify-writes to another
node); inside a node they use loads, stores and atomics on the peers' memory (P2P), as the
single-node kernels do.

Every launch has one program (its waits are on other ranks only, so the interpreter runs it) and
the host passes no per-call value that changes from call to call: the epochs live in the control
words ``xctrl`` on the device (a CUDA graph of the launches replays correctly). Four kernels:

``xd_send_kernel`` (dispatch, 1)
    1. epoch ``e = EPOCH_D + 1``; tell the ranks of this node "my receive buffers are free for
       call ``e``" (``READY_D``, an add, P2P) and every rank that sends a stream here "my inbound
       buffer is free" (``RDY_D[slot of me]`` set to ``e`` on it, through the proxy); wait for the
       same from every rank of the node and every receiver of a stream of mine;
    2. token by token, in ascending order: for each rank of this node that hosts one of its
       experts, reserve a receive row (a fetch-add on that rank's slot counter) and store the row,
       its weights, scales, ids and flat source position there; for each outbound stream whose
       member ranks host one of its experts, pack a wire row into the stream's staging;
    3. per stream: one put with ``SIGNAL_SET`` ``e << 32 | rows`` (a stream of 0 rows is the
       signal alone); then quiet (the staging is the put's source).

``xd_fan_kernel`` (dispatch, 1)
    4. per inbound stream: wait for its signal word of call ``e``; check the header (call ``e``,
       at most ``M`` rows) and every row's source token (in ``[0, M)``, strictly ascending). A bad
       stream is skipped (no row of it is read beyond its checked range) and flagged in ``ERR``;
    5. fan each row out to the ranks of this node that host one of its experts, as in step 2
       (``relay_slot`` remembers the rows for combine); a reservation beyond the receive buffers
       is not written and flagged in ``OVF``;
    6. fence, ``DONE_D`` to the ranks of the node, wait for theirs, then the slot counter
       (clamped to ``R``) is ``total_recv`` and is reset; ``EPOCH_D = e``.

``xc_stage_kernel`` (combine, 1)
    1. epoch ``c = EPOCH_C + 1``; ``READY_C`` within the node (the staging buffers were summed);
       ``RDY_C[slot of me]`` set to ``c`` on every receiver of a stream of mine (my inbound buffer
       may take its combined rows); wait for the node's ``READY_C``;
    2. every received row goes back by a store: to its source's staging at ``[me, token]`` if the
       source is on this node, else to the relay of its source's stream (a rank of this node)
       at ``cst[slot, token, fan index of me]``; fence, ``DONE_C`` to the node.

``xc_reduce_kernel`` (combine, 1)
    3. wait for the node's ``DONE_C``; as a relay, per inbound stream (after its sender's
       ``RDY_C``): each row is the fp32 sum, in fan order, of the node's contributions of that
       token (only the ranks it was fanned out to), cast once to the dtype; one put with
       ``SIGNAL_SET`` ``c << 32 | rows`` back to its sender;
    4. per outbound stream: wait for its combined rows of call ``c`` and check that the count is
       the one this rank sent (else skip it, flag ``ERR``); every token's fp32 sum of its node's
       rows (in the order of the node's ranks) plus each stream's row (in stream order), cast
       once into ``out``: the host path's order, so the results are the same bits;
       ``EPOCH_C = c``; quiet.

Control words ``xctrl`` (int64, symmetric; ``W`` world size, ``S`` stream slots): ``[0, W)``
READY_D, ``[W, 2W)`` DONE_D, ``[2W, 3W)`` READY_C, ``[3W, 4W)`` DONE_C (adds from this node's ranks
only), SLOT ``[2]`` (by epoch parity), EPOCH_D, EPOCH_C, ERR (the epoch of the last bad stream),
ERR_SRC (its sender, plus ``1 << 32`` for a bad header, ``2 << 32`` for a bad source token), OVF (the epoch of the last overflow), ERR_C (the combine epoch of the last
bad combined stream), one spare, then RDY_D ``[S]`` and RDY_C ``[S]`` (sets from other nodes).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mori.core.kernels import aot_variants, device_function
from mori.shmem import device as shd

__all__ = [
    "xc_reduce_kernel",
    "xc_stage_kernel",
    "xctrl_words",
    "xd_fan_kernel",
    "xd_send_kernel",
    "XCTRL",
]


def xctrl_words(world: int, slots: int) -> int:
    """int64 control words of one inter-node operator (see the module docstring)."""
    return 4 * world + 8 + 2 * slots


#: offsets of the local words after the 4 W signal words (see the module docstring)
XCTRL = {"SLOT": 0, "EPOCH_D": 2, "EPOCH_C": 3, "ERR": 4, "ERR_SRC": 5, "OVF": 6, "ERR_C": 7}


@device_function
@triton.jit
def _slot_of(x, G: tl.constexpr, HIER: tl.constexpr):
    # the slot of sender x in a receiver's inbound buffer and signal words
    if HIER:
        s = x // G
    else:
        s = x
    return s


@device_function
@triton.jit
def _copy(dst_ptr, src_ptr, n, BLOCK: tl.constexpr):
    # n elements, BLOCK per step, masked at the end (nothing past n is touched)
    offs = tl.arange(0, BLOCK)
    i = tl.cast(0, tl.int64)
    while i < n:
        mask = i + offs < n
        tl.store(dst_ptr + i + offs, tl.load(src_ptr + i + offs, mask=mask), mask=mask)
        i += BLOCK


@device_function
@triton.jit
def _store_row(
    # destination rank p's receive buffers (this rank's addresses; translated here) and the row
    recv_tok_ptr,
    recv_w_ptr,
    recv_sc_ptr,
    recv_idx_ptr,
    recv_src_ptr,
    pos,
    p,
    ctx_ptr,
    # the row's sources: token bytes, weights fp32 [K] (or unused), scale bytes, ids int32 [K]
    tok_src,
    w_src,
    sc_src,
    ids,
    src_pos,
    nb,
    row_bytes,
    sb,
    scale_bytes,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    HAS_W: tl.constexpr,
    BLOCK: tl.constexpr,
):
    kk = tl.arange(0, K_P2)
    km = kk < K
    row = tl.cast(pos, tl.int64)
    _copy(shd.ptr_p2p(recv_tok_ptr + row * row_bytes, p, ctx_ptr), tok_src, nb, BLOCK)
    if HAS_W:
        w = tl.load(w_src + kk, mask=km, other=0.0)
    else:
        w = tl.zeros([K_P2], dtype=tl.float32)
    tl.store(shd.ptr_p2p(recv_w_ptr + row * K + kk, p, ctx_ptr), w, mask=km)
    if sb > 0:
        _copy(shd.ptr_p2p(recv_sc_ptr + row * scale_bytes, p, ctx_ptr), sc_src, sb, BLOCK)
    tl.store(shd.ptr_p2p(recv_idx_ptr + row * K + kk, p, ctx_ptr), ids, mask=km)
    tl.store(shd.ptr_p2p(recv_src_ptr + row, p, ctx_ptr), src_pos)


@device_function
@triton.jit
def _cast_to(acc, ptr):
    # fp32 -> the element type of ptr, rounded to nearest even. bf16 is rounded here by hand: the
    # Triton interpreter truncates fp32 -> bf16 (a GPU rounds to nearest even), and the results
    # must be the host path's bits on both (NaN stays a quiet NaN)
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = acc.to(tl.uint32, bitcast=True)
        up = bits + 0x7FFF + ((bits >> 16) & 1)
        up = tl.where(acc != acc, bits | 0x400000, up)
        out = (up >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = acc.to(ptr.dtype.element_ty)
    return out


def _dispatch_variants() -> list[dict[str, object]]:
    sig = {
        "inp_ptr": "*u8",
        "inp_stride": "i64",
        "w_ptr": "*fp32",
        "sc_ptr": "*u8",
        "sc_stride": "i64",
        "idx_ptr": "*i32",
        "n": "i32",
        "recv_tok_ptr": "*u8",
        "recv_w_ptr": "*fp32",
        "recv_sc_ptr": "*u8",
        "recv_idx_ptr": "*i32",
        "recv_src_ptr": "*i32",
        "dest_slot_ptr": "*i32",
        "xtok_ptr": "*i32",
        "xrow_ptr": "*i32",
        "xcnt_ptr": "*i32",
        "local_ptr": "*i32",
        "strm_to_ptr": "*i32",
        "strm_mem_ptr": "*i32",
        "in_src_ptr": "*i32",
        "xout_ptr": "*u8",
        "xout_stride": "i64",
        "xin_ptr": "*u8",
        "xin_stride": "i64",
        "sig_ptr": "*i64",
        "xctrl_ptr": "*i64",
        "ctx_ptr": "*i64",
        "forge": "i64",
        "nb": "i32",
        "row_bytes": "i32",
        "sb": "i32",
        "scale_bytes": "i32",
        "M": "i32",
        "R": "i32",
        "E_LOCAL": "i32",
        "off_w": "i32",
        "off_s": "i32",
        "off_i": "i32",
        "off_t": "i32",
        "stride": "i32",
    }
    out: list[dict[str, object]] = []
    for hier, g, memb, ns in ((True, 2, 2, 1), (False, 2, 1, 2)):
        out.append(
            {
                "signature": sig,
                "constexprs": {
                    "W": 4,
                    "G": g,
                    "NS": ns,
                    "NS_P2": 2,
                    "MEMB": memb,
                    "K": 2,
                    "K_P2": 2,
                    "HIER": hier,
                    "HAS_W": True,
                    "BLOCK": 256,
                },
                "label": f"{'V1' if hier else 'InterNode'} 2x2 K=2",
            }
        )
    return out


@aot_variants(_dispatch_variants())
@triton.jit
def xd_send_kernel(
    # this rank's tokens: rows of bytes [N, >= nb], weights fp32 [N, K], scale bytes [N, >= sb],
    # expert ids int32 [N, K] (-1: none), N
    inp_ptr,
    inp_stride,
    w_ptr,
    sc_ptr,
    sc_stride,
    idx_ptr,
    n,
    # receive buffers (symmetric; this rank's addresses): bytes [R, row_bytes], fp32 [R, K],
    # bytes [R, scale_bytes], int32 [R, K], int32 [R]
    recv_tok_ptr,
    recv_w_ptr,
    recv_sc_ptr,
    recv_idx_ptr,
    recv_src_ptr,
    # local tables written here: dest_slot int32 [W, M] (receive row at rank p, -1), xtok int32
    # [NS, M] (token of stream row j), xrow int32 [NS, M] (stream row of token t, -1), xcnt [NS]
    dest_slot_ptr,
    xtok_ptr,
    xrow_ptr,
    xcnt_ptr,
    # topology tables (int32): ranks of this node [G], stream receivers [NS], stream members
    # [NS, MEMB], stream senders to this rank [NS]
    local_ptr,
    strm_to_ptr,
    strm_mem_ptr,
    in_src_ptr,
    # stream buffers (symmetric bytes): staging [NS, stride_x], inbound [S, stride_x]; stream
    # signal words int64 [2 S]; control words; shmem context
    xout_ptr,
    xout_stride,
    xin_ptr,
    xin_stride,
    sig_ptr,
    xctrl_ptr,
    ctx_ptr,
    # added to every stream header's row count (0; a test makes this rank a lying peer with it)
    forge,
    # sizes in bytes (token row, receive row, scales, receive scales), M, R, experts per rank
    nb,
    row_bytes,
    sb,
    scale_bytes,
    M,
    R,
    E_LOCAL,
    # dispatch wire row: byte offsets of weights, scales, ids, source token; row stride
    off_w,
    off_s,
    off_i,
    off_t,
    stride,
    W: tl.constexpr,
    G: tl.constexpr,
    NS: tl.constexpr,
    NS_P2: tl.constexpr,
    MEMB: tl.constexpr,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    HIER: tl.constexpr,
    HAS_W: tl.constexpr,
    BLOCK: tl.constexpr,
):
    me = shd.my_pe(ctx_ptr)
    SLOT = 4 * W
    e = tl.load(xctrl_ptr + SLOT + 2, volatile=True) + 1
    my_slot = _slot_of(me, G, HIER)
    rdy_d = 4 * W + 8
    # 1. handshake: within the node by adds (P2P), across nodes by epoch-tagged sets
    for q in tl.static_range(G):
        shd.signal_op(xctrl_ptr + me, 1, shd.SIGNAL_ADD, tl.load(local_ptr + q), ctx_ptr)
    for s in tl.static_range(NS):
        shd.signal_op(xctrl_ptr + rdy_d + my_slot, e, shd.SIGNAL_SET, tl.load(in_src_ptr + s), ctx_ptr)
    for q in tl.static_range(G):
        shd.wait_until(xctrl_ptr + tl.load(local_ptr + q), shd.SHMEM_CMP_GE, e)
    for s in tl.static_range(NS):
        to = tl.load(strm_to_ptr + s)
        shd.wait_until(xctrl_ptr + rdy_d + _slot_of(to, G, HIER), shd.SHMEM_CMP_GE, e)

    # 2. route every token, in ascending order
    kk = tl.arange(0, K_P2)
    km = kk < K
    sv = tl.arange(0, NS_P2)
    cnts = tl.zeros([NS_P2], dtype=tl.int32)
    ovf = tl.cast(0, tl.int32)
    ctr = xctrl_ptr + SLOT + e % 2
    # dest_slot / xrow of the tokens past n: none (combine reads the first n only; kept tidy)
    t = tl.cast(0, tl.int64)
    while t < M:
        for p in tl.static_range(W):
            tl.store(dest_slot_ptr + p * M + t, -1)
        for s in tl.static_range(NS):
            tl.store(xrow_ptr + s * M + t, -1)
        t += 1
    t = tl.cast(0, tl.int64)
    while t < n:
        ids = tl.load(idx_ptr + t * K + kk, mask=km, other=-1)
        owner = tl.where((ids >= 0) & (ids < E_LOCAL * W), ids // E_LOCAL, -1)
        src_pos = (me * W * M + t).to(tl.int32)
        for q in tl.static_range(G):
            p = tl.load(local_ptr + q)
            if tl.sum((owner == p).to(tl.int32)) > 0:
                pos = shd.atomic_fetch_add(ctr, 1, p, ctx_ptr)
                if pos < R:
                    tl.store(dest_slot_ptr + p * M + t, pos.to(tl.int32))
                    _store_row(
                        recv_tok_ptr,
                        recv_w_ptr,
                        recv_sc_ptr,
                        recv_idx_ptr,
                        recv_src_ptr,
                        pos,
                        p,
                        ctx_ptr,
                        inp_ptr + t * inp_stride,
                        w_ptr + t * K,
                        sc_ptr + t * sc_stride,
                        ids,
                        src_pos,
                        nb,
                        row_bytes,
                        sb,
                        scale_bytes,
                        K,
                        K_P2,
                        HAS_W,
                        BLOCK,
                    )
                else:
                    ovf = ovf + 1
        for s in tl.static_range(NS):
            hit = tl.cast(0, tl.int32)
            for mi in tl.static_range(MEMB):
                hit += tl.sum((owner == tl.load(strm_mem_ptr + s * MEMB + mi)).to(tl.int32))
            if hit > 0:
                j = tl.sum(tl.where(sv == s, cnts, 0))
                row = xout_ptr + s * xout_stride + tl.cast(j, tl.int64) * stride
                _copy(row, inp_ptr + t * inp_stride, nb, BLOCK)
                if HAS_W:
                    tl.store(
                        (row + off_w).to(tl.pointer_type(tl.float32)) + kk,
                        tl.load(w_ptr + t * K + kk, mask=km),
                        mask=km,
                    )
                if sb > 0:
                    _copy(row + off_s, sc_ptr + t * sc_stride, sb, BLOCK)
                tl.store((row + off_i).to(tl.pointer_type(tl.int32)) + kk, ids, mask=km)
                tl.store((row + off_t).to(tl.pointer_type(tl.int32)), t.to(tl.int32))
                tl.store(xtok_ptr + s * M + j, t.to(tl.int32))
                tl.store(xrow_ptr + s * M + t, j)
                for mi in tl.static_range(MEMB):
                    p = tl.load(strm_mem_ptr + s * MEMB + mi)
                    if tl.sum((owner == p).to(tl.int32)) > 0:  # (the token's row in the stream)
                        tl.store(dest_slot_ptr + p * M + t, j)
                cnts = cnts + (sv == s).to(tl.int32)
        t += 1
    if ovf > 0:
        tl.store(xctrl_ptr + SLOT + 6, e)

    # 3. the streams: one put with its header each, after this program's stores
    shd.fence(ctx_ptr)
    for s in tl.static_range(NS):
        to = tl.load(strm_to_ptr + s)
        c = tl.sum(tl.where(sv == s, cnts, 0))
        tl.store(xcnt_ptr + s, c)
        header = (e << 32) | (tl.cast(c, tl.int64) + forge)
        if c > 0:
            shd.put_signal_block(
                xin_ptr + my_slot * xin_stride,
                xout_ptr + s * xout_stride,
                sig_ptr + my_slot,
                tl.cast(c, tl.int64) * stride,
                header,
                to,
                ctx_ptr,
                shd.SIGNAL_SET,
                BLOCK,
            )
        else:
            shd.signal_op(sig_ptr + my_slot, header, shd.SIGNAL_SET, to, ctx_ptr)
    shd.quiet(ctx_ptr)


def _fan_variants() -> list[dict[str, object]]:
    sig = {
        n: t
        for n, t in _dispatch_variants()[0]["signature"].items()  # type: ignore[attr-defined]
        if n.startswith("recv_")
        or n in ("xin_ptr", "xin_stride", "sig_ptr", "xctrl_ptr", "ctx_ptr")
        or n in ("nb", "row_bytes", "sb", "scale_bytes", "M", "R", "E_LOCAL")
        or n.startswith("off_")
        or n in ("stride", "local_ptr", "in_src_ptr")
    }
    sig.update(
        {
            "relay_cnt_ptr": "*i32",
            "relay_tok_ptr": "*i32",
            "relay_slot_ptr": "*i32",
            "total_ptr": "*i32",
            "fan_ptr": "*i32",
        }
    )
    return [
        {
            "signature": sig,
            "constexprs": {
                "W": 4,
                "G": 2,
                "NS": ns,
                "F": f,
                "K": 2,
                "K_P2": 2,
                "HIER": hier,
                "HAS_W": True,
                "BLOCK": 256,
            },
            "label": f"{'V1' if hier else 'InterNode'} 2x2 K=2",
        }
        for hier, ns, f in ((True, 1, 2), (False, 2, 1))
    ]


@aot_variants(_fan_variants())
@triton.jit
def xd_fan_kernel(
    # receive buffers (symmetric; this rank's addresses), as in xd_send_kernel
    recv_tok_ptr,
    recv_w_ptr,
    recv_sc_ptr,
    recv_idx_ptr,
    recv_src_ptr,
    # local tables written here: relay_cnt int32 [S], relay_tok int32 [S, M], relay_slot int32
    # [S, M, F]; total_recv int32 [1]
    relay_cnt_ptr,
    relay_tok_ptr,
    relay_slot_ptr,
    total_ptr,
    # topology tables (int32): fan-out ranks [F], ranks of this node [G], stream senders [NS]
    fan_ptr,
    local_ptr,
    in_src_ptr,
    # inbound stream buffer (bytes [S, stride_x]), stream signal words, control words, context
    xin_ptr,
    xin_stride,
    sig_ptr,
    xctrl_ptr,
    ctx_ptr,
    # as in xd_send_kernel
    nb,
    row_bytes,
    sb,
    scale_bytes,
    M,
    R,
    E_LOCAL,
    off_w,
    off_s,
    off_i,
    off_t,
    stride,
    W: tl.constexpr,
    G: tl.constexpr,
    NS: tl.constexpr,
    F: tl.constexpr,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    HIER: tl.constexpr,
    HAS_W: tl.constexpr,
    BLOCK: tl.constexpr,
):
    me = shd.my_pe(ctx_ptr)
    SLOT = 4 * W
    e = tl.load(xctrl_ptr + SLOT + 2, volatile=True) + 1
    ctr = xctrl_ptr + SLOT + e % 2
    kk = tl.arange(0, K_P2)
    km = kk < K
    ovf = tl.cast(0, tl.int32)
    for s in tl.static_range(NS):
        src = tl.load(in_src_ptr + s)
        slot = _slot_of(src, G, HIER)
        # 4. the header: call e, at most M rows (an untrusted peer: checked before any use)
        v = shd.wait_until(sig_ptr + slot, shd.SHMEM_CMP_GE, e << 32)
        c = v & 0xFFFFFFFF
        bad = (((v >> 32) != e) | (c > M)).to(tl.int32)
        c = tl.where(bad == 0, c, 0)
        kind = bad.to(tl.int64)  # 1: the header, 2: a source token
        base = xin_ptr + slot * xin_stride
        # every row's source token in [0, M), strictly ascending
        prev = tl.cast(-1, tl.int64)
        j = tl.cast(0, tl.int64)
        while j < c:
            tok = tl.load((base + j * stride + off_t).to(tl.pointer_type(tl.int32))).to(tl.int64)
            if (tok <= prev) | (tok >= M):
                bad = bad + 1
                kind = tl.cast(2, tl.int64)
                c = j  # (ends the scan)
            prev = tok
            j += 1
        if bad > 0:
            c = tl.cast(0, tl.int64)
            tl.store(xctrl_ptr + SLOT + 4, e)
            tl.store(xctrl_ptr + SLOT + 5, src.to(tl.int64) | (kind << 32))
        tl.store(relay_cnt_ptr + slot, c.to(tl.int32))
        # 5. fan out
        j = tl.cast(0, tl.int64)
        while j < c:
            row = base + j * stride
            tok = tl.load((row + off_t).to(tl.pointer_type(tl.int32)))
            ids = tl.load((row + off_i).to(tl.pointer_type(tl.int32)) + kk, mask=km, other=-1)
            owner = tl.where((ids >= 0) & (ids < E_LOCAL * W), ids // E_LOCAL, -1)
            tl.store(relay_tok_ptr + slot * M + j, tok)
            for fi in tl.static_range(F):
                q = tl.load(fan_ptr + fi)
                got = tl.cast(-1, tl.int32)
                if tl.sum((owner == q).to(tl.int32)) > 0:
                    pos = shd.atomic_fetch_add(ctr, 1, q, ctx_ptr)
                    if pos < R:
                        got = pos.to(tl.int32)
                        _store_row(
                            recv_tok_ptr,
                            recv_w_ptr,
                            recv_sc_ptr,
                            recv_idx_ptr,
                            recv_src_ptr,
                            pos,
                            q,
                            ctx_ptr,
                            row,
                            (row + off_w).to(tl.pointer_type(tl.float32)),
                            row + off_s,
                            ids,
                            (src * W * M + tok).to(tl.int32),
                            nb,
                            row_bytes,
                            sb,
                            scale_bytes,
                            K,
                            K_P2,
                            HAS_W,
                            BLOCK,
                        )
                    else:
                        ovf = ovf + 1
                tl.store(relay_slot_ptr + (slot * M + j) * F + fi, got)
            j += 1
    if ovf > 0:
        tl.store(xctrl_ptr + SLOT + 6, e)
    # 6. done within the node; then this rank's row count
    shd.fence(ctx_ptr)
    for q in tl.static_range(G):
        shd.signal_op(xctrl_ptr + W + me, 1, shd.SIGNAL_ADD, tl.load(local_ptr + q), ctx_ptr)
    for q in tl.static_range(G):
        shd.wait_until(xctrl_ptr + W + tl.load(local_ptr + q), shd.SHMEM_CMP_GE, e)
    total = tl.atomic_xchg(ctr, 0, sem="acq_rel", scope="sys")
    if total > R:
        tl.store(xctrl_ptr + SLOT + 6, e)
    tl.store(total_ptr, tl.minimum(total, R).to(tl.int32))
    tl.store(xctrl_ptr + SLOT + 2, e)


def _combine_variants(kernel: str) -> list[dict[str, object]]:
    common = {
        "stage_ptr": "*bf16",
        "stage_row": "i64",
        "stage_w_ptr": "*fp32",
        "cst_ptr": "*bf16",
        "cst_row": "i64",
        "cst_w_ptr": "*fp32",
        "local_ptr": "*i32",
        "strm_to_ptr": "*i32",
        "in_src_ptr": "*i32",
        "xctrl_ptr": "*i64",
        "ctx_ptr": "*i64",
        "H": "i32",
        "M": "i32",
    }
    if kernel == "stage":
        sig = {
            "inp_ptr": "*bf16",
            "inp_stride": "i64",
            "w_ptr": "*fp32",
            "total_ptr": "*i32",
            "recv_src_ptr": "*i32",
            **common,
        }
    else:
        sig = {
            "out_ptr": "*bf16",
            "out_w_ptr": "*fp32",
            "n": "i32",
            "dest_slot_ptr": "*i32",
            "xrow_ptr": "*i32",
            "xcnt_ptr": "*i32",
            "relay_cnt_ptr": "*i32",
            "relay_tok_ptr": "*i32",
            "relay_slot_ptr": "*i32",
            "xout_ptr": "*bf16",
            "xout_f32_ptr": "*fp32",
            "xin_ptr": "*bf16",
            "xin_f32_ptr": "*fp32",
            "xs": "i64",
            "xs_f32": "i64",
            "cstride": "i64",
            "cstride_f32": "i64",
            "off_wf": "i64",
            "sig_ptr": "*i64",
            **common,
        }
    return [
        {
            "signature": sig,
            "constexprs": {
                "W": 4,
                "G": 2,
                "S": s,
                "NS": ns,
                "NS_P2": 2,
                "F": f,
                "K": 2,
                "K_P2": 2,
                "HIER": hier,
                "HAS_W": True,
                "BLOCK": 256,
            },
            "label": f"{'V1' if hier else 'InterNode'} 2x2 bf16 K=2",
        }
        for hier, s, ns, f in ((True, 2, 1, 2), (False, 4, 2, 1))
    ]


@aot_variants(_combine_variants("stage"))
@triton.jit
def xc_stage_kernel(
    # expert outputs (typed) [>= total, >= H] for the received rows, their weights fp32 [., K]
    inp_ptr,
    inp_stride,
    w_ptr,
    # rows received by the last dispatch (int32 [1]) and their flat source positions int32 [R]
    total_ptr,
    recv_src_ptr,
    # combine staging (symmetric, typed): [W, M, stage_row] and fp32 [W, M, K]; relay staging
    # (symmetric, typed): [S, M, F, cst_row] and fp32 [S, M, F, K]
    stage_ptr,
    stage_row,
    stage_w_ptr,
    cst_ptr,
    cst_row,
    cst_w_ptr,
    # topology tables (int32): ranks of this node [G], stream receivers [NS], stream senders [NS]
    local_ptr,
    strm_to_ptr,
    in_src_ptr,
    # control words, shmem context; elements per row, M
    xctrl_ptr,
    ctx_ptr,
    H,
    M,
    W: tl.constexpr,
    G: tl.constexpr,
    S: tl.constexpr,
    NS: tl.constexpr,
    NS_P2: tl.constexpr,
    F: tl.constexpr,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    HIER: tl.constexpr,
    HAS_W: tl.constexpr,
    BLOCK: tl.constexpr,
):
    me = shd.my_pe(ctx_ptr)
    SLOT = 4 * W
    ce = tl.load(xctrl_ptr + SLOT + 3, volatile=True) + 1
    my_slot = _slot_of(me, G, HIER)
    rdy_c = 4 * W + 8 + S
    node = me // G
    # 1. handshake: staging free within the node (adds), inbound buffer free across (sets)
    for q in tl.static_range(G):
        shd.signal_op(xctrl_ptr + 2 * W + me, 1, shd.SIGNAL_ADD, tl.load(local_ptr + q), ctx_ptr)
    for s in tl.static_range(NS):
        shd.signal_op(xctrl_ptr + rdy_c + my_slot, ce, shd.SIGNAL_SET, tl.load(strm_to_ptr + s), ctx_ptr)
    for q in tl.static_range(G):
        shd.wait_until(xctrl_ptr + 2 * W + tl.load(local_ptr + q), shd.SHMEM_CMP_GE, ce)
    # 2. every received row back by a store (a source position out of range is skipped)
    kk = tl.arange(0, K_P2)
    km = kk < K
    total = tl.load(total_ptr)
    r = tl.cast(0, tl.int64)
    while r < total:
        pos = tl.load(recv_src_ptr + r).to(tl.int64)
        src = pos // (W * M)
        t = pos % (W * M)
        if (pos >= 0) & (src < W) & (t < M):
            # (each branch copies: a pointer chosen between branches breaks AMD's pointer
            # canonicalisation)
            if src // G == node:
                _copy(
                    shd.ptr_p2p(stage_ptr + (me * M + t) * stage_row, src, ctx_ptr),
                    inp_ptr + r * inp_stride,
                    H,
                    BLOCK,
                )
                if HAS_W:
                    dst_w = shd.ptr_p2p(stage_w_ptr + (me * M + t) * K, src, ctx_ptr)
                    tl.store(dst_w + kk, tl.load(w_ptr + r * K + kk, mask=km), mask=km)
            else:
                if HIER:
                    v = node * G + src % G
                    cell = (src // G * M + t) * F + me % G
                else:
                    v = me
                    cell = src * M + t
                _copy(shd.ptr_p2p(cst_ptr + cell * cst_row, v, ctx_ptr), inp_ptr + r * inp_stride, H, BLOCK)
                if HAS_W:
                    dst_w = shd.ptr_p2p(cst_w_ptr + cell * K, v, ctx_ptr)
                    tl.store(dst_w + kk, tl.load(w_ptr + r * K + kk, mask=km), mask=km)
        r += 1
    shd.fence(ctx_ptr)
    for q in tl.static_range(G):
        shd.signal_op(xctrl_ptr + 3 * W + me, 1, shd.SIGNAL_ADD, tl.load(local_ptr + q), ctx_ptr)


@aot_variants(_combine_variants("reduce"))
@triton.jit
def xc_reduce_kernel(
    # outputs: typed [M, H] (row stride H), fp32 [M, K]; tokens of the last dispatch
    out_ptr,
    out_w_ptr,
    n,
    # the last dispatch's tables (local, int32): dest_slot [W, M], xrow [NS, M], xcnt [NS],
    # relay_cnt [S], relay_tok [S, M], relay_slot [S, M, F]
    dest_slot_ptr,
    xrow_ptr,
    xcnt_ptr,
    relay_cnt_ptr,
    relay_tok_ptr,
    relay_slot_ptr,
    # stream buffers typed and as fp32 (symmetric): staging [NS, xs], inbound [S, xs]; elements
    # per slot, per combine wire row, and the weights' offset in a row (fp32 elements)
    xout_ptr,
    xout_f32_ptr,
    xin_ptr,
    xin_f32_ptr,
    xs,
    xs_f32,
    cstride,
    cstride_f32,
    off_wf,
    sig_ptr,
    # as in xc_stage_kernel
    stage_ptr,
    stage_row,
    stage_w_ptr,
    cst_ptr,
    cst_row,
    cst_w_ptr,
    local_ptr,
    strm_to_ptr,
    in_src_ptr,
    xctrl_ptr,
    ctx_ptr,
    H,
    M,
    W: tl.constexpr,
    G: tl.constexpr,
    S: tl.constexpr,
    NS: tl.constexpr,
    NS_P2: tl.constexpr,
    F: tl.constexpr,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    HIER: tl.constexpr,
    HAS_W: tl.constexpr,
    BLOCK: tl.constexpr,
):
    me = shd.my_pe(ctx_ptr)
    SLOT = 4 * W
    ce = tl.load(xctrl_ptr + SLOT + 3, volatile=True) + 1
    my_slot = _slot_of(me, G, HIER)
    rdy_c = 4 * W + 8 + S
    offs = tl.arange(0, BLOCK)
    kk = tl.arange(0, K_P2)
    km = kk < K
    sv = tl.arange(0, NS_P2)
    for q in tl.static_range(G):
        shd.wait_until(xctrl_ptr + 3 * W + tl.load(local_ptr + q), shd.SHMEM_CMP_GE, ce)
    # 3. as a relay: one summed row per row of each inbound stream, back to its sender
    for s in tl.static_range(NS):
        src = tl.load(in_src_ptr + s)
        slot = _slot_of(src, G, HIER)
        c = tl.load(relay_cnt_ptr + slot).to(tl.int64)
        shd.wait_until(xctrl_ptr + rdy_c + slot, shd.SHMEM_CMP_GE, ce)
        j = tl.cast(0, tl.int64)
        while j < c:
            tok = tl.load(relay_tok_ptr + slot * M + j).to(tl.int64)
            h0 = tl.cast(0, tl.int64)
            while h0 < H:
                hm = h0 + offs < H
                acc = tl.zeros([BLOCK], dtype=tl.float32)
                for fi in tl.static_range(F):
                    if tl.load(relay_slot_ptr + (slot * M + j) * F + fi) >= 0:
                        cell = (slot * M + tok) * F + fi
                        acc += tl.load(cst_ptr + cell * cst_row + h0 + offs, mask=hm, other=0.0).to(
                            tl.float32
                        )
                dst = xout_ptr + s * xs + j * cstride + h0 + offs
                tl.store(dst, _cast_to(acc, xout_ptr), mask=hm)
                h0 += BLOCK
            if HAS_W:
                accw = tl.zeros([K_P2], dtype=tl.float32)
                for fi in tl.static_range(F):
                    if tl.load(relay_slot_ptr + (slot * M + j) * F + fi) >= 0:
                        cell = (slot * M + tok) * F + fi
                        accw += tl.load(cst_w_ptr + cell * K + kk, mask=km, other=0.0)
                tl.store(xout_f32_ptr + s * xs_f32 + j * cstride_f32 + off_wf + kk, accw, mask=km)
            j += 1
        shd.fence(ctx_ptr)
        header = (ce << 32) | c
        if c > 0:
            shd.put_signal_block(
                xin_ptr + my_slot * xs,
                xout_ptr + s * xs,
                sig_ptr + S + my_slot,
                c * cstride,
                header,
                src,
                ctx_ptr,
                shd.SIGNAL_SET,
                BLOCK,
            )
        else:
            shd.signal_op(sig_ptr + S + my_slot, header, shd.SIGNAL_SET, src, ctx_ptr)
    # 4. as a source: the combined streams (checked: call ce, the row count this rank sent)
    okv = tl.zeros([NS_P2], dtype=tl.int32)
    for s in tl.static_range(NS):
        to = tl.load(strm_to_ptr + s)
        v = shd.wait_until(sig_ptr + S + _slot_of(to, G, HIER), shd.SHMEM_CMP_GE, ce << 32)
        good = ((v >> 32) == ce) & ((v & 0xFFFFFFFF) == tl.load(xcnt_ptr + s).to(tl.int64))
        okv = okv + ((sv == s) & good).to(tl.int32)
        if not good:
            tl.store(xctrl_ptr + SLOT + 7, ce)
    t = tl.cast(0, tl.int64)
    while t < n:
        h0 = tl.cast(0, tl.int64)
        while h0 < H:
            hm = h0 + offs < H
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for q in tl.static_range(G):
                p = tl.load(local_ptr + q)
                if tl.load(dest_slot_ptr + p * M + t) >= 0:
                    acc += tl.load(stage_ptr + (p * M + t) * stage_row + h0 + offs, mask=hm, other=0.0).to(
                        tl.float32
                    )
            for s in tl.static_range(NS):
                j = tl.load(xrow_ptr + s * M + t).to(tl.int64)
                ok = tl.sum(tl.where(sv == s, okv, 0))
                if (j >= 0) & (ok > 0):
                    slot = _slot_of(tl.load(strm_to_ptr + s), G, HIER)
                    acc += tl.load(xin_ptr + slot * xs + j * cstride + h0 + offs, mask=hm, other=0.0).to(
                        tl.float32
                    )
            tl.store(out_ptr + t * H + h0 + offs, _cast_to(acc, out_ptr), mask=hm)
            h0 += BLOCK
        if HAS_W:
            accw = tl.zeros([K_P2], dtype=tl.float32)
            for q in tl.static_range(G):
                p = tl.load(local_ptr + q)
                if tl.load(dest_slot_ptr + p * M + t) >= 0:
                    accw += tl.load(stage_w_ptr + (p * M + t) * K + kk, mask=km, other=0.0)
            for s in tl.static_range(NS):
                j = tl.load(xrow_ptr + s * M + t).to(tl.int64)
                ok = tl.sum(tl.where(sv == s, okv, 0))
                if (j >= 0) & (ok > 0):
                    slot = _slot_of(tl.load(strm_to_ptr + s), G, HIER)
                    accw += tl.load(
                        xin_f32_ptr + slot * xs_f32 + j * cstride_f32 + off_wf + kk, mask=km, other=0.0
                    )
            tl.store(out_w_ptr + t * K + kk, accw, mask=km)
        t += 1
    tl.store(xctrl_ptr + SLOT + 3, ce)
    shd.quiet(ctx_ptr)

"""The bookkeeping of the DeepEP layer's normal dispatch: where each row goes, and the handle.

A normal dispatch (:meth:`mori.ep.deepep.Buffer.dispatch`) all-gathers every rank's counts into a
table (int64 ``[W, width]``, row ``s`` = rank ``s``'s ``[num_tokens, sent to rank 0..W-1, 7 words
that every rank's call must have alike, epoch, per-expert counts]``)
and then needs, on this rank:

* before the operator runs (:func:`send_side`): ``dest`` int32 [W, M], the receive row on rank
  ``p`` of this rank's token ``t`` (``-1``: not sent), DeepEP's order: rows grouped by source
  rank, by source token within one, so row = (tokens ranks ``< rank`` send to ``p``) + (index of
  ``t`` among this rank's tokens for ``p``); the rows this rank receives (int32 [1]);
  ``send_head`` int32 [N, W] (that index, ``-1`` if not sent) and ``channel_prefix_matrix``
  int32 [W, C] (tokens of channels ``0..c`` sent to ``p``; a channel is a contiguous
  ``ceil(N / C)`` of the tokens);
* after it (:func:`recv_side`): ``rank_prefix_matrix`` int32 [W, W] (inclusive prefix of the
  table's sent counts over source ranks), ``recv_channel_prefix_matrix`` int32 [W, C] (first
  received row of channel ``c`` of rank ``s``), ``recv_src_idx`` int32 [total] (each received
  row's token on its source) and, with top-k, the received expert ids as local ids (``-1``:
  another rank's expert, and padding rows) with their weights (0 there).

On a GPU each side is one Triton launch (:mod:`mori.ep.deepep_handle_kernels`, relaunched
without Triton's per-call dispatch, :class:`mori.core.relaunch.Relaunch`) that reads the table
where the all-gather left it, on the device; the send side's launch does the all-gather itself
first (:class:`Put`: its puts into every rank's table, then a wait for the peers' rows, in place
of a barrier launch). The receive side also copies what combine needs of the operator's tables.
On the CPU runtime the same results come from torch operations on the host copy. About sixty
small torch launches were there before: on an H200 host they cost 2 ms per dispatch, eight times
the operator's own dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mori.core.relaunch import Relaunch
from mori.ep.layout import IMPLS, pow2_at_least

__all__ = [
    "IMPLS",
    "WORDS",
    "Put",
    "RecvSide",
    "SendSide",
    "header_width",
    "recv_side",
    "send_side",
    "uses_kernels",
]

_BLOCK = 1024  #: tokens (send side) or rows (receive side) per step of one program
#: words of a table row between the sent counts and the epoch (what every rank's call must have alike)
WORDS = 7


def header_width(world: int) -> int:
    """Columns of a table row before its per-expert counts: ``[n, sent to 0..W-1, *WORDS words,
    epoch]``."""
    return world + 2 + WORDS


def uses_kernels(impl: str, device: torch.device) -> bool:
    """Whether ``impl`` on ``device`` takes the Triton kernels."""
    if impl not in IMPLS:
        raise ValueError(f"deepep_handle: impl={impl!r} is not one of {IMPLS}")
    return impl == "triton" or (impl == "auto" and device.type != "cpu")


# the kernels of mori.ep.deepep_handle_kernels, imported on the first launch (so the CPU runtime
# never imports Triton here and tests may set TRITON_INTERPRET first)
_SEND_SIDE = Relaunch("mori.ep.deepep_handle_kernels:send_side_kernel")
_RECV_SIDE = Relaunch("mori.ep.deepep_handle_kernels:recv_side_kernel")


@dataclass
class Put:
    """The all-gather that :func:`send_side` also does (kernels only): this rank's row ``[n,
    per_rank, *words, epoch, per_expert]`` (int64) into every rank's table, then the wait for
    every other rank's row of this rank's table. The epoch's column, ``W + 8``, does not depend on
    the number of experts."""

    addrs: torch.Tensor  #: int64 [W]: every rank's table (this call's half), as mapped here
    offset: int  #: elements from a table's start to this rank's row
    epoch: int  #: this call's number (> 0, growing): the last word of a complete row
    per_rank: torch.Tensor  #: int32 [W] on the device
    per_expert: torch.Tensor  #: int32 [E] on the device (E = 0: the row's header alone)
    words: list[int]  #: seven ints


@dataclass
class SendSide:
    dest: torch.Tensor  #: int32 [W, M]
    total: torch.Tensor  #: int32 [1]
    send_head: torch.Tensor  #: int32 [N, W]
    channel_prefix: torch.Tensor  #: int32 [W, C]


@dataclass
class RecvSide:
    rank_prefix: torch.Tensor  #: int32 [W, W]
    recv_channel_prefix: torch.Tensor  #: int32 [W, C]
    recv_src_idx: torch.Tensor  #: int32 [total]
    recv_idx: torch.Tensor | None  #: [rows, K] of the caller's id dtype
    recv_w: torch.Tensor | None  #: float32 [rows, K]
    recv_src_pos: torch.Tensor  #: int32 [total]: a copy of the operator's
    recv_slot: torch.Tensor | None  #: int32 [W, M]: a copy of the operator's slot table, or None


def send_side(
    in_rank: torch.Tensor,
    table: torch.Tensor,
    host: torch.Tensor | None,
    rank: int,
    m: int,
    channels: int,
    impl: str = "auto",
    put: Put | None = None,
    per_rank: torch.Tensor | None = None,
) -> SendSide:
    """See the module docstring. ``in_rank`` bool [N, W] on the device; ``table`` this rank's
    int64 [W, width] table on the device (the last column: each row's epoch), ``host`` its CPU copy
    (the torch path only); ``m`` >= N the operator's tokens per rank; ``channels`` >= 1. On the
    kernels ``put`` makes the same launch do the all-gather first (``host`` is not made yet
    then), else ``per_rank`` (int32 [W], this rank's own counts) is needed."""
    n, w = in_rank.shape
    dev = in_rank.device
    if uses_kernels(impl, dev):
        # one allocation, split in one call (each torch call costs microseconds of host time)
        out = torch.empty(w * m + 1 + n * w + w * channels, dtype=torch.int32, device=dev)
        dest, total, send_head, chan = out.split_with_sizes([w * m, 1, n * w, w * channels])
        dest, send_head, chan = dest.view(w, m), send_head.view(n, w), chan.view(w, channels)
        if put is not None:
            if len(put.words) != WORDS:
                raise ValueError(
                    f"deepep_handle.send_side: put.words has {len(put.words)} entries, not {WORDS}"
                )
            addrs, offset, epoch, own, per_expert, words = (
                put.addrs, put.offset, put.epoch, put.per_rank, put.per_expert, put.words
            )  # fmt: skip
        elif per_rank is None:
            raise ValueError("deepep_handle.send_side: the kernels need put or per_rank")
        else:  # (every pointer must still point into an allocation)
            addrs, offset, epoch, own, per_expert, words = table, 0, 0, per_rank, per_rank, [0] * WORDS
        e = int(per_expert.shape[0]) if put is not None else 0
        if e == 0:  # (every pointer must still point into an allocation)
            per_expert = own
        _SEND_SIDE(
            (w,),
            addrs,
            offset,
            epoch,
            own,
            per_expert,
            e,
            *words,
            in_rank.view(torch.uint8),
            n,
            table,
            table.stride(0),
            rank,
            m,
            max(1, -(-n // channels)),
            dest,
            total,
            send_head,
            chan,
            channels,
            W=w,
            W_P2=pow2_at_least(w),
            E_P2=pow2_at_least(max(e, 1)),
            C_P2=pow2_at_least(channels + 1),
            BLOCK=_BLOCK,
            PUT=put is not None,
            num_warps=4,
        )
        return SendSide(dest, total, send_head, chan)
    if host is None:
        raise ValueError("deepep_handle.send_side: the torch path needs the table's host copy")
    sent = host[:, 1 : 1 + w]  # [source, destination]
    offs = (sent[:rank].sum(0)).to(device=dev, dtype=torch.int32)
    cols = in_rank.t().to(torch.int32)
    within = torch.cumsum(cols, dim=1, dtype=torch.int32) - 1  # [W, N]
    dest = torch.full((w, m), -1, dtype=torch.int32, device=dev)
    dest[:, :n] = torch.where(in_rank.t(), within + offs[:, None], -1)
    total = torch.tensor([int(sent[:, rank].sum())], dtype=torch.int32, device=dev)
    send_head = torch.where(in_rank, within.t(), -1).contiguous()
    per = max(1, -(-n // channels))
    ch = torch.arange(n, device=dev) // per
    send = torch.zeros(w, channels, dtype=torch.int32, device=dev)
    send.index_add_(1, ch, cols)
    return SendSide(dest, total, send_head, torch.cumsum(send, 1, dtype=torch.int32))


def recv_side(
    table: torch.Tensor,
    host: torch.Tensor,
    rank: int,
    recv_src_pos: torch.Tensor,
    max_send: int,
    channels: int,
    rows: int,
    topk: tuple[torch.Tensor, torch.Tensor, int, torch.dtype] | None,
    impl: str = "auto",
    recv_slot: torch.Tensor | None = None,
) -> RecvSide:
    """See the module docstring. ``recv_src_pos`` int32 [total]: the operator's flat source
    position of each received row (``% max_send`` is the source token); ``rows`` >= total the
    output rows (padding rows past total); ``topk``: ``(recv_idx int32 [>= total, K] global
    expert ids, recv_w float32 [>= total, K], experts per rank, the id dtype to return)``, both
    operator buffers, or None (no top-k); ``recv_slot``: the operator's int32 [W, M] slot table
    to copy too, or None. The copies of ``recv_src_pos`` and ``recv_slot`` (what combine needs of
    this dispatch once the operator's next dispatch overwrites its tables) come from the same
    launch on a GPU."""
    w = table.shape[0]
    total = int(recv_src_pos.shape[0])
    dev = recv_src_pos.device
    k = 0 if topk is None else int(topk[0].shape[1])
    if uses_kernels(impl, dev):
        # (one element more, and at least one row: an empty output still points into an allocation,
        # which Triton's launcher checks of every pointer it is given)
        slots = 0 if recv_slot is None else recv_slot.numel()
        out = torch.empty(w * w + w * channels + 2 * total + slots + 1, dtype=torch.int32, device=dev)
        # (the copies first, so they start 16-byte aligned like the operator's own tables: the
        # combine kernels read them, and Triton specialises a pointer on its alignment)
        slot_part, pos_copy, prefix, rchan, src_idx, _ = out.split_with_sizes(
            [slots, total, w * w, w * channels, total, 1]
        )
        prefix, rchan = prefix.view(w, w), rchan.view(w, channels)
        slot_copy = None if recv_slot is None else slot_part.view(recv_slot.shape)
        recv_idx = recv_w = None
        if topk is not None:
            gidx, gw, e_local, idx_dtype = topk
            recv_idx = torch.empty(max(rows, 1), k, dtype=idx_dtype, device=dev)
            recv_w = torch.empty(max(rows, 1), k, dtype=torch.float32, device=dev)
            if rows == 0:
                recv_idx, recv_w = recv_idx[:0], recv_w[:0]
        _RECV_SIDE(
            (w + 1,),
            table,
            table.stride(0),
            rank,
            recv_src_pos,
            max_send,
            channels,
            total,
            rows,
            prefix,
            rchan,
            src_idx,
            pos_copy,
            src_idx if recv_slot is None else recv_slot,
            src_idx if slot_copy is None else slot_copy,
            0 if recv_slot is None else recv_slot.shape[1],
            *(
                (gidx, gidx.stride(0), gw, gw.stride(0), recv_idx, recv_w, e_local)
                if topk
                else (src_idx, 0, src_idx, 0, src_idx, src_idx, 1)
            ),
            W=w,
            W_P2=pow2_at_least(w),
            C_P2=pow2_at_least(channels + 1),
            K=max(k, 1),
            K_P2=pow2_at_least(max(k, 1)),
            HAS_TOPK=topk is not None,
            HAS_SLOT=recv_slot is not None,
            BLOCK=_BLOCK // 4,
            num_warps=4,
        )
        return RecvSide(prefix, rchan, src_idx, recv_idx, recv_w, pos_copy, slot_copy)
    sent = host[:, 1 : 1 + w]
    prefix = torch.cumsum(sent, dim=0).to(device=dev, dtype=torch.int32)
    src_idx = (recv_src_pos.to(torch.int64) % max_send).to(torch.int32)
    # rows of source s are its tokens in order; their channel on s
    counts = sent[:, rank].to(dev)
    src_rank = torch.repeat_interleave(torch.arange(w, device=dev), counts, output_size=total)
    per_src = torch.clamp(-(-host[:, 0] // channels), min=1).to(dev)
    rch = src_idx.to(torch.int64) // per_src[src_rank]
    cnt = torch.zeros(w * channels, dtype=torch.int64, device=dev)
    cnt.index_add_(0, src_rank * channels + rch, torch.ones_like(rch))
    cnt = cnt.view(w, channels)
    seg = torch.cumsum(counts, 0) - counts
    rchan = (seg[:, None] + torch.cumsum(cnt, 1) - cnt).to(torch.int32)
    recv_idx = recv_w = None
    if topk is not None:
        gidx, gw, e_local, idx_dtype = topk
        glob = gidx[:total]
        local = glob.to(torch.int64) - rank * e_local
        mine = (glob >= 0) & (local >= 0) & (local < e_local)
        recv_idx = torch.full((rows, k), -1, dtype=idx_dtype, device=dev)
        recv_idx[:total] = torch.where(mine, local, -1).to(idx_dtype)
        recv_w = torch.zeros(rows, k, dtype=torch.float32, device=dev)
        recv_w[:total] = torch.where(mine, gw[:total], 0.0)
    return RecvSide(
        prefix,
        rchan,
        src_idx,
        recv_idx,
        recv_w,
        recv_src_pos.clone(),
        None if recv_slot is None else recv_slot.clone(),
    )

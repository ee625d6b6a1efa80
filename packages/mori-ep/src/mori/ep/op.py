"""The EP dispatch/combine operator on the host (CPU runtime): one node, symmetric-heap buffers.

Protocol (the same buffers, signals and order as the intra-node GPU kernels; here every step is a
vectorised torch operation on views of the peers' symmetric buffers, never a loop over tokens):

dispatch, on every rank ``r`` with ``N`` tokens:
  1. ``dest[t, p]`` = token ``t`` has at least one expert on rank ``p`` (expert ``e`` lives on rank
     ``e // E_local``; ``-1`` ids are skipped). A token goes once per distinct destination rank.
  2. For each destination ``p``: reserve ``n_p`` contiguous rows of ``p``'s receive buffers with one
     ``shmem_atomic_fetch_add`` on ``p``'s slot counter, then store the rows (token bytes, its K
     weights, scales, K expert ids and its flat source position ``r * world * M + t``) straight
     into ``p``'s buffers.
  3. Signal every rank (``disp_sig[r] += 1`` on each peer, after the stores), then wait until
     every peer's word in our ``disp_sig`` reached this call's epoch. Our slot counter then holds
     ``total_recv``; it is read and set back to zero here. Two counters alternate by epoch
     parity: a peer can be at most one dispatch ahead of us, so it never touches the counter we
     are resetting. Signals only grow (epochs), so nothing else needs a reset or a barrier.

combine, the reverse: each received row ``i`` (source ``(s, t)``) is stored into rank ``s``'s
staging buffer at ``[r, t]``; after every peer signalled, rank ``s`` sums, in fp32, the staged rows
of each token over its distinct destination ranks and casts once to the input dtype. Combine is
an unweighted sum: gating weights are the expert side's business.

Combine wire quantisation (``config.quant_type``, bf16 combine input, not zero-copy): with
``fp8_direct_cast`` each row is cast (saturating) to float8_e4m3fn before it is stored, so the
staging buffer holds fp8; with ``fp8_blockwise`` each row is cut into ``MORI_FP8_COMBINE_SCALE_DIM``
blocks (default 56, read when the op is built), a block whose max ``|x|`` exceeds 448 is divided by
``max|x| / 448`` first, and the fp32 scales travel with the row; with ``fp4_blockwise`` each
block of 32 values is divided by ``max|x| / 6``, rounded to e2m1 in software (exact, the same bits
on every target: :mod:`mori.ep.fp4`) and packed two a byte, with its fp32 scale. The source
dequantises, sums in fp32 and casts once to bf16.

Overwrite safety: each call starts by telling every peer "my buffers are free" (an epoch signal)
and writes into a peer's buffers only after that peer said so for this call. A dispatch's outputs
therefore stay valid until this rank's next dispatch, and a combine's staging rows until it has
summed them, even when several dispatches (routing handles for several layers) run back to back.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, TypeAlias

import torch

import mori.shmem as shmem
from mori.core.errors import (
    MoriBackendError,
    MoriStateError,
    MoriTimeoutError,
    MoriTypeError,
    MoriValueError,
    bad_type,
    bad_value,
    format_ranks,
)
from mori.ep import agreement, fp4, internode, tuning
from mori.ep.buffers import EpBuffers
from mori.ep.config import QUANT_TYPES, EpDispatchCombineConfig, EpDispatchCombineKernelType
from mori.ep.internode_path import InterNodeKernels
from mori.ep.kernel_path import KernelPath, kernels_requested

__all__ = ["EpDispatchCombineOp", "EpDispatchRoutingHandle"]

KT = EpDispatchCombineKernelType
#: kernel types this runtime implements (all on the same host path)
_AVAILABLE = (KT.IntraNode, KT.IntraNodeLL, KT.AsyncLL, KT.InterNode, KT.InterNodeV1, KT.InterNodeV1LL)
#: kernel types whose ranks may sit on several nodes (host path only: see mori.ep.internode)
_INTER_NODE = (KT.InterNode, KT.InterNodeV1, KT.InterNodeV1LL)
#: implementations: "auto" (Triton kernels on a GPU heap, the host path on the cpu runtime),
#: "host" (vectorised torch; cpu runtime only), "triton" (the kernels; on the cpu runtime only under
#: TRITON_INTERPRET=1, which is how CI runs them)
IMPLS = ("auto", "host", "triton")
#: kernel types that may use a routing handle (as in the original: IntraNode and InterNodeV1)
_ROUTING_KERNELS = (KT.IntraNode, KT.InterNodeV1)
#: the error for inter-node kernel types where tokens would have to leave a GPU by themselves
_NO_INTERNODE_KERNELS = (
    "the inter-node Triton kernels (mori.ep.internode_kernels) implement quant_type='none' and no "
    "routing replay yet (issue 19); on the cpu runtime (MORI_DEVICE_RUNTIME=cpu) the host path runs "
    "them with impl='auto' or impl='host'"
)


def _float8_types() -> tuple[torch.dtype, ...]:
    return tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz") if hasattr(torch, n))


def _float4_types() -> tuple[torch.dtype, ...]:
    return (torch.float4_e2m1fn_x2,) if hasattr(torch, "float4_e2m1fn_x2") else ()


#: token dtypes dispatch accepts (bytes are moved unchanged; float4_e2m1fn_x2 packs two values a
#: byte, so its hidden size counts bytes: half the values)
DISPATCH_DTYPES: tuple[torch.dtype, ...] = (
    torch.bfloat16,
    torch.float16,
    torch.float32,
    *_float8_types(),
    *_float4_types(),
)
#: token dtypes combine accepts (summed in fp32, cast once)
COMBINE_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)


_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _words(nb: int, *byte_rows: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    """View 2-D byte tensors (contiguous rows) as rows of the widest integer word dividing ``nb``,
    their row lengths, strides and addresses; return (word bytes, the views cut to ``nb`` bytes).
    Row gathers and scatters of 8-byte words run several times faster than of single bytes."""
    w = next(
        w
        for w in (8, 4, 2, 1)
        if nb % w == 0
        and all(t.shape[-1] % w == 0 and t.stride(-2) % w == 0 and t.data_ptr() % w == 0 for t in byte_rows)
    )
    return w, [t.view(_WORD_DTYPES[w])[:, : nb // w] for t in byte_rows]


def _peer_view(t: torch.Tensor, me: int, p: int) -> torch.Tensor | None:
    """View of PE ``p``'s copy of the symmetric tensor ``t``; None if loads and stores cannot reach
    ``p`` (another node)."""
    if shmem.shmem_ptr_p2p(t.data_ptr(), me, p) == 0:
        return None
    return shmem.symm_mori_shmem_tensor(t, p)


def _names(dtypes: Sequence[torch.dtype]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


#: combine wire formats this runtime implements (fp4 in software, see mori.ep.fp4)
COMBINE_QUANT_TYPES = ("none", "fp8_direct_cast", "fp8_blockwise", "fp4_blockwise")
#: largest finite float8_e4m3fn value: the fp8 wire saturates there; blockwise scales map to it
FP8_MAX = 448.0
#: env var with the number of fp8_blockwise scales per row (read when an op is built)
SCALE_DIM_ENV = "MORI_FP8_COMBINE_SCALE_DIM"
DEFAULT_FP8_COMBINE_SCALE_DIM = 56


def _fp8_combine_scale_dim(func: str, hidden_dim: int) -> int:
    """Scales per row for fp8_blockwise combine, from :data:`SCALE_DIM_ENV` (default 56)."""
    raw = os.environ.get(SCALE_DIM_ENV, "").strip()
    if not raw:
        value: Any = DEFAULT_FP8_COMBINE_SCALE_DIM
    else:
        try:
            value = int(raw)
        except ValueError:
            value = raw
    if not isinstance(value, int) or value < 1 or hidden_dim % value != 0:
        raise MoriValueError(
            f"{func}: environment variable {SCALE_DIM_ENV}={raw or value!r} is not allowed with "
            f"quant_type='fp8_blockwise'; expected a positive int that divides hidden_dim = {hidden_dim} "
            f"(blocks of hidden_dim / {SCALE_DIM_ENV} elements; default {DEFAULT_FP8_COMBINE_SCALE_DIM})"
        )
    return value


def _dispatch_words(
    input: torch.Tensor,
    weights: torch.Tensor | None,
    scales: torch.Tensor | None,
    routing: EpDispatchRoutingHandle | None,
) -> list[int]:
    """The words of :data:`mori.ep.agreement.DISPATCH_FIELDS` for one dispatch call."""
    sb = 0 if scales is None else scales.shape[1] * scales.element_size()
    return [
        agreement.dtype_code(input.dtype),
        input.shape[1],
        sb,
        agreement.dtype_code(None if scales is None else scales.dtype),
        int(weights is not None),
        int(routing is not None),
    ]


def _combine_words(input: torch.Tensor, weights: torch.Tensor | None, external: bool) -> list[int]:
    """The words of :data:`mori.ep.agreement.COMBINE_FIELDS` for one combine call."""
    return [agreement.dtype_code(input.dtype), input.shape[1], int(weights is not None), int(external)]


class EpDispatchRoutingHandle:
    """Snapshot of one dispatch's routing: enough to replay it or to combine with it later.

    Made by ``dispatch(..., return_routing=True)``. ``dispatch(..., routing=handle)`` sends a new
    payload to exactly the same receive rows (no slot reservation; every rank must replay its own
    handle of the same dispatch, together); ``combine(..., routing=handle)`` returns the expert
    outputs of that dispatch even after later dispatches (several layers can share one operator,
    provided each layer's combine input was taken before the receive buffers were overwritten).

    Attributes:
        dest_slot: int32 [world_size, M]: row of rank ``p``'s receive buffers that holds this rank's
            token ``t``, ``-1`` if the token was not sent to ``p``.
        total_recv: int32 [1]: rows this rank received.
        recv_src_pos: int32 [total_recv]: flat source position ``src_rank * world_size * M +
            src_tok`` of every received row.
        num_tokens: ``N``, the number of tokens this rank dispatched.
        relay: inter-node kernel types only, else None: ``(relay_cnt int64 [S], relay_tok int32
            [S, M], relay_slot int32 [S, M, F])``, this rank's part as the receiver of streams from
            other nodes (see :mod:`mori.ep.internode`): rows of stream ``s``, the source token of
            each row, and the receive row of each of the ``F`` ranks it fanned out to (``-1``: not
            sent there). For ranks on other nodes ``dest_slot`` holds the token's row in the
            stream to that rank's node (``>= 0``: sent), not a receive row.
    """

    def __init__(
        self,
        dest_slot: torch.Tensor,
        total_recv: torch.Tensor,
        recv_src_pos: torch.Tensor,
        num_tokens: int,
        recv_slot: torch.Tensor | None = None,
        *,
        relay: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        self.dest_slot = dest_slot
        self.relay = relay
        self.total_recv = total_recv
        self.recv_src_pos = recv_src_pos
        self.num_tokens = int(num_tokens)
        #: int32 [world_size, M] (GPU kernels only): row of this rank's receive buffers holding
        #: rank ``s``'s token ``t``, ``-1`` if none. It lets combine push rows in their source's
        #: token order; a handle without it (e.g. rebuilt by :meth:`from_tensors`) combines by
        #: copying into the registered buffer first, which is slower.
        self.recv_slot = recv_slot

    @property
    def num_recv(self) -> int:
        """``total_recv[0]`` as an int."""
        return int(self.total_recv[0])

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """``(dest_slot, total_recv, recv_src_pos)``, then the three :attr:`relay` tensors for an
        inter-node handle; rebuild with :meth:`from_tensors`."""
        return (self.dest_slot, self.total_recv, self.recv_src_pos, *(self.relay or ()))

    @classmethod
    def from_tensors(
        cls, tensors: Sequence[torch.Tensor], cur_rank_num_token: int
    ) -> EpDispatchRoutingHandle:
        """Rebuild a handle from :meth:`tensors` and the number of tokens this rank dispatched."""
        func = "EpDispatchRoutingHandle.from_tensors"
        if len(tensors) not in (3, 6) or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise bad_value(
                func,
                "tensors",
                tensors,
                "(dest_slot, total_recv, recv_src_pos[, relay_cnt, relay_tok, relay_slot]) from tensors()",
            )
        dest_slot, total, pos = tensors[:3]
        relay = None
        if len(tensors) == 6:
            cnt, tok, slot = tensors[3:]
            s, m = dest_slot.shape[0], dest_slot.shape[1]
            if (
                cnt.dim() != 1
                or cnt.dtype != torch.int64
                or tok.dtype != torch.int32
                or tuple(tok.shape) != (cnt.shape[0], m)
                or slot.dtype != torch.int32
                or slot.dim() != 3
                or tuple(slot.shape[:2]) != (cnt.shape[0], m)
                or cnt.shape[0] > s
            ):
                raise bad_value(
                    func,
                    "tensors[3:]",
                    [tuple(t.shape) for t in tensors[3:]],
                    "the relay tensors of tensors()",
                )
            relay = (cnt, tok, slot)
        if dest_slot.dim() != 2 or dest_slot.dtype != torch.int32:
            raise bad_value(func, "tensors[0]", tuple(dest_slot.shape), "dest_slot int32 [world_size, M]")
        if total.shape != (1,) or total.dtype != torch.int32:
            raise bad_value(func, "tensors[1]", tuple(total.shape), "total_recv int32 [1]")
        if pos.dim() != 1 or pos.dtype != torch.int32 or pos.shape[0] < int(total[0]):
            raise bad_value(func, "tensors[2]", tuple(pos.shape), "recv_src_pos int32 [>= total_recv]")
        n = cur_rank_num_token
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= dest_slot.shape[1]:
            raise bad_value(func, "cur_rank_num_token", n, f"an int in [0, {dest_slot.shape[1]}]")
        return cls(dest_slot, total, pos, n, relay=relay)

    def __repr__(self) -> str:
        return f"EpDispatchRoutingHandle(num_tokens={self.num_tokens}, total_recv={self.num_recv})"


#: the arguments of :meth:`KernelPath.combine` but ``phases``: (input, weights, out, out_w, n_tok,
#: routing, block_num, warp_per_block), kept when the reduce is a second launch (combine_recv)
_CombineArgs: TypeAlias = tuple[
    torch.Tensor,
    torch.Tensor | None,
    torch.Tensor,
    torch.Tensor | None,
    int,
    EpDispatchRoutingHandle | None,
    int,
    int,
]


class EpDispatchCombineOp:
    """MoE expert-parallel dispatch and combine between the ranks of one node (CPU runtime).

    The constructor is **collective** (every rank of ``mori.shmem`` must build one with the same
    config, in the same order): it allocates the symmetric buffers (:attr:`buffers`, a
    :class:`~mori.ep.buffers.EpBuffers`), zeroes them and ends with a barrier, so no peer writes
    before every rank is ready. ``mori.shmem`` must be initialised with
    ``shmem_npes() == config.world_size`` and ``shmem_mype() == config.rank``.

    ``dispatch`` and ``combine`` are collective and host-blocking (they return when this rank's
    results are complete); they self-reset, so dispatch/combine pairs repeat with no barrier and no
    :meth:`reset`. Launch arguments (``block_num``, ``rdma_block_num``, ``warp_per_block``) are
    validated (``-1`` = config default, else a positive int) and otherwise unused on the CPU runtime.

    Available kernel types: ``IntraNode``, ``IntraNodeLL`` (the same host path) and ``AsyncLL``
    (``dispatch``/``dispatch_send`` only send; ``dispatch_recv`` waits and finalises; likewise
    combine), on the ranks of one node; ``InterNode``, ``InterNodeV1`` and ``InterNodeV1LL``
    across nodes (``config.gpu_per_node`` ranks each) on the cpu runtime's host path, the legs to
    other nodes through the SHMEM network transport (:mod:`mori.ep.internode`). On a GPU heap
    (``impl="auto"``) and with ``impl="triton"`` they run on their Triton kernels
    (:mod:`mori.ep.internode_kernels`: device-initiated streams through the SHMEM proxy; each call
    returns once its kernels ended), without combine wire quantisation or routing replay yet
    (:class:`~mori.core.errors.MoriBackendError`).
    """

    def __init__(self, config: EpDispatchCombineConfig, *, impl: str = "auto") -> None:
        func = "EpDispatchCombineOp"
        if not isinstance(config, EpDispatchCombineConfig):
            raise bad_type(func, "config", config, "an EpDispatchCombineConfig")
        if impl not in IMPLS:
            raise bad_value(func, "impl", impl, f"one of {', '.join(repr(i) for i in IMPLS)}")
        if not shmem.shmem_is_initialized():
            raise MoriStateError(
                f"{func}: mori.shmem is not initialised; call shmem_init_attr or "
                "shmem_torch_process_group_init first"
            )
        if config.kernel_type not in _AVAILABLE:
            raise MoriBackendError(
                f"{func}: kernel_type {config.kernel_type.name} is not available here; available: "
                f"{', '.join(k.name for k in _AVAILABLE)}"
            )
        inter = config.kernel_type in _INTER_NODE
        if inter:
            internode.check_config(func, config)
        if config.quant_type not in COMBINE_QUANT_TYPES:
            raise MoriBackendError(
                f"{func}: quant_type={config.quant_type!r} is not implemented on the CPU runtime; use one "
                f"of {', '.join(repr(q) for q in COMBINE_QUANT_TYPES)}"
            )
        if config.quant_type != "none" and not config.use_external_inp_buf:
            raise bad_value(
                func,
                "config.use_external_inp_buf",
                False,
                f"True with quant_type={config.quant_type!r} (wire quantisation needs the push combine, "
                "not zero-copy)",
            )
        npes, mype = shmem.shmem_npes(), shmem.shmem_mype()
        if config.world_size != npes:
            raise bad_value(func, "config.world_size", config.world_size, f"shmem_npes() = {npes}")
        if config.rank != mype:
            raise bad_value(func, "config.rank", config.rank, f"shmem_mype() = {mype}")
        self.rank, self.world_size = mype, npes
        self._inter: internode.InterNodeHost | None = None  # the inter-node legs (made below)
        self._scratch_bufs: dict[str, torch.Tensor] = {}
        # every rank's wire-shaping config, compared before any other symmetric allocation (whose
        # sizes depend on it): a difference is reported by field name on every rank
        # (rows: 0 the config, 1-2 dispatch calls and 3-4 combine calls by parity; every row is
        # written whole by its owner before it is read, so the table needs no zeroing)
        self._agree = shmem.mori_shmem_create_tensor((5, npes, agreement.ROW_WORDS), torch.int64)
        # (None: a PE that loads and stores cannot reach, on another node: its words go by a put)
        self._p_agree: list[torch.Tensor | None] = [
            self._agree if p == mype else _peer_view(self._agree, mype, p) for p in range(npes)
        ]
        far = [p for p in range(npes) if self._p_agree[p] is None]
        problem: Exception | None = None
        if inter and kernels_requested(self._agree.device, impl) and config.quant_type != "none":
            problem = MoriBackendError(
                f"{func}: kernel_type {config.kernel_type.name} with quant_type={config.quant_type!r} on the "
                f"kernel path: {_NO_INTERNODE_KERNELS}"
            )
        elif far and not inter:
            problem = MoriBackendError(
                f"{func}: kernel_type {config.kernel_type.name} moves tokens by loads and stores between "
                f"the ranks of one node, but ranks {format_ranks(far)} are on other nodes (MORI_NODE_ID) "
                "for this rank; use kernel_type InterNode, InterNodeV1 or InterNodeV1LL"
            )
        elif inter:
            problem = internode.check_nodes(func, config, far)
        if problem is not None:
            shmem.mori_shmem_free_tensor(self._agree)  # (collective: every rank of a split job raises)
            raise problem
        self._agree_on_config(func, config, impl)
        # blockwise combine quantisation: scales per row (fp8: MORI_FP8_COMBINE_SCALE_DIM) and
        # elements per block
        quant_scale_dim = quant_block = 0
        if config.quant_type == "fp8_blockwise":
            quant_scale_dim = _fp8_combine_scale_dim(func, config.hidden_dim)
            quant_block = config.hidden_dim // quant_scale_dim
        elif config.quant_type == "fp4_blockwise":
            if config.hidden_dim % fp4.FP4_BLOCK:
                raise bad_value(
                    func,
                    "config.hidden_dim",
                    config.hidden_dim,
                    f"a multiple of {fp4.FP4_BLOCK} with quant_type='fp4_blockwise' (blocks of "
                    f"{fp4.FP4_BLOCK} values, one fp32 scale each)",
                )
            quant_block = fp4.FP4_BLOCK
            quant_scale_dim = config.hidden_dim // fp4.FP4_BLOCK
        if config.max_token_type_size not in (1, 2, 4):
            raise bad_value(func, "config.max_token_type_size", config.max_token_type_size, "1, 2 or 4")

        self.config = config
        self.rank, self.world_size = config.rank, config.world_size
        #: the symmetric buffers (sizes and tensors), shared by the host path, the kernel path
        #: and the inter-node legs; collective: every rank allocates the same tensors in order
        self.buffers = EpBuffers(config, quant_scale_dim=quant_scale_dim, quant_block=quant_block)
        w = self.world_size
        self._ikern: InterNodeKernels | None = None
        if inter:  # collective: its streams' buffers and signal words (added to self.buffers)
            self._inter = internode.InterNodeHost(self)
            if kernels_requested(self.buffers.device, impl):  # collective: its control words
                self._ikern = InterNodeKernels(self, self._inter)
        self.buffers.zero()

        def peers(t: torch.Tensor) -> list[Any]:
            # (an empty buffer, e.g. scales with scale_dim = 0, has no address to translate; a
            # peer on another node has no view: None)
            return [t if p == self.rank or t.numel() == 0 else _peer_view(t, self.rank, p) for p in range(w)]

        self._p_tok, self._p_w = peers(self.buffers.recv_tok), peers(self.buffers.recv_w)
        self._p_scales, self._p_idx = peers(self.buffers.recv_scales), peers(self.buffers.recv_idx)
        self._p_src = peers(self.buffers.recv_src)
        self._p_stage_tok, self._p_stage_w = peers(self.buffers.stage_tok), peers(self.buffers.stage_w)
        self._p_stage_sc = None if self.buffers.stage_sc is None else peers(self.buffers.stage_sc)

        self._disp_epoch = 0
        self._comb_epoch = 0
        dev = self.buffers.recv_tok.device
        if impl == "host" and dev.type != "cpu":
            raise bad_value(
                func,
                "impl",
                impl,
                f"'auto' or 'triton' on the {dev.type} heap (the host path runs on the cpu runtime)",
            )
        self._kern: KernelPath | None = None
        if kernels_requested(dev, impl) and not inter:
            qb = self.buffers.quant_block
            if qb and (qb & (qb - 1) or qb > 2048):
                raise MoriBackendError(
                    f"{func}: quant_type={config.quant_type!r} with blocks of {qb} elements (hidden_dim / "
                    f"{SCALE_DIM_ENV}) is implemented on the host path only; the Triton kernels need a "
                    "power-of-two block of at most 2048 elements"
                )
            self._kern = KernelPath(self)  # collective: allocates its control words
        self._total_recv = (
            self._kern.total_recv
            if self._kern
            else self._ikern.total_recv
            if self._ikern
            else torch.zeros(1, dtype=torch.int32)
        )
        #: int32 [num_experts_per_rank]: received (token, k) pairs per local expert; filled by a
        #: dispatch with ``call_local_expert_count=True``
        self.local_expert_count = torch.zeros(self.buffers.e_local, dtype=torch.int32, device=dev)
        self._last: EpDispatchRoutingHandle | None = None  # routing of the last finished dispatch
        self._pending_dispatch: dict[str, Any] | None = None  # sent, not yet received
        self._pending_combine: dict[str, Any] | None = None
        shmem.shmem_barrier_all()  # every rank's buffers are zeroed before anyone writes

    # -- agreement between ranks (see mori.ep.agreement) --------------------------------------------

    def _agree_on_config(self, func: str, config: EpDispatchCombineConfig, impl: str) -> None:
        """Compare every rank's wire-shaping config; raise on every rank if they differ. Collective."""
        raw_sd = os.environ.get(SCALE_DIM_ENV, "").strip()
        scale_dim = -1
        if config.quant_type == "fp8_blockwise" and raw_sd:
            scale_dim = int(raw_sd) if raw_sd.lstrip("-").isdigit() else -2
        raw_chunk = os.environ.get(tuning.MORI_EP_PUSH_CHUNK.name, "").strip()
        chunk = int(raw_chunk) if raw_chunk.isdigit() else (0 if not raw_chunk else -2)
        values = [
            config.world_size,
            config.hidden_dim,
            config.scale_dim,
            config.scale_type_size,
            config.max_token_type_size,
            config.max_num_inp_token_per_rank,
            config.num_experts_per_rank,
            config.num_experts_per_token,
            config.max_total_recv_tokens,
            int(config.use_external_inp_buf),
            int(config.kernel_type),
            config.gpu_per_node,
            QUANT_TYPES.index(config.quant_type),
            config.block_num,
            config.warp_num_per_block,
            scale_dim,
            chunk,
            int(kernels_requested(self._agree.device, impl)),
        ]
        err = self._exchange(func, "config", agreement.CONFIG_FIELDS, 0, values, barrier=True)
        if err is not None:
            shmem.mori_shmem_free_tensor(self._agree)  # (every rank raises here: the free is collective)
            raise err

    def _post_call_words(self, row: int, values: Sequence[int]) -> None:
        """Write this call's words into every peer's agreement table (before the ready signal);
        a peer on another node gets them by a put from this rank's own row."""
        words = torch.tensor(values, dtype=torch.int64, device=self._agree.device)
        own = self._agree[row, self.rank, : len(values)]
        own.copy_(words)
        for p, peer in enumerate(self._p_agree):
            if peer is None:
                shmem.shmem_putmem(own.data_ptr(), own.data_ptr(), 8 * len(values), p)
                if self._inter is not None:
                    self._inter.count_control(p)
            elif p != self.rank:
                peer[row, self.rank, : len(values)] = words

    def _exchange(
        self,
        func: str,
        what: str,
        fields: Sequence[agreement.Field],
        row: int,
        values: Sequence[int],
        *,
        barrier: bool,
    ) -> MoriValueError | None:
        """``barrier``: post ``values``, synchronise and compare (the constructor); otherwise only
        compare the words the peers posted before a ready signal this rank has waited for."""
        if barrier:
            self._post_call_words(row, values)
            if self._agree.device.type == "cuda":
                torch.cuda.synchronize(self._agree.device)
            shmem.shmem_barrier_all()
        return agreement.mismatch(func, what, fields, self._agree[row].cpu(), self.rank)

    # -- sizes -----------------------------------------------------------------------------------

    def max_num_tokens_to_recv(self) -> int:
        """``R``: rows of the receive buffers (and of dispatch's outputs)."""
        return self.buffers.r

    def max_num_tokens_to_recv_per_rank(self) -> int:
        return self.config.max_num_tokens_to_recv_per_rank()

    def max_num_tokens_to_send(self) -> int:
        """``world_size * M``: the span of flat source positions."""
        return self.world_size * self.buffers.m

    def max_num_tokens_to_send_per_rank(self) -> int:
        return self.buffers.m

    def reset(self) -> None:
        """No-op, kept for API compatibility: dispatch and combine reset their own state."""

    # -- tracing (mori.viz) ----------------------------------------------------------------------

    def enable_tracing(self, buffer: Any = None, *, capacity: int = 4096, n_rings: int | None = None) -> Any:
        """Record the phases of every following dispatch and combine kernel (their traced variants)
        into ``buffer`` (a :class:`mori.viz.TraceBuffer` on this operator's device), or a new one;
        return it.

        For a new buffer, ``n_rings``: programs that record (default: 256, or the config's
        ``block_num`` if larger; programs beyond it record nothing); ``capacity``: events per
        program (a power of two; a full ring keeps the newest). Read it with
        ``mori.viz.capture([buf])`` when the device is idle. Not collective; a CUDA graph captured
        while tracing keeps recording when replayed. Only the Triton kernels record: raises
        :class:`~mori.core.errors.MoriStateError` on the host path.
        """
        if self._kern is None:
            raise MoriStateError(
                "enable_tracing: this operator runs the host path; tracing records the Triton kernels "
                "(impl='triton', or a GPU heap)"
            )
        from mori.viz import TraceBuffer

        if buffer is None:
            rings = n_rings if n_rings is not None else max(256, self.config.block_num)
            buffer = TraceBuffer(rings, capacity, device=self._kern.device, rank=self.rank, name="ep")
        elif not isinstance(buffer, TraceBuffer) or buffer.device != self._kern.device:
            raise bad_type(
                "enable_tracing", "buffer", buffer, f"None or a mori.viz.TraceBuffer on {self._kern.device}"
            )
        self._kern.trace = buffer
        return buffer

    def disable_tracing(self) -> None:
        """Launch the untraced kernels again (the buffer of :meth:`enable_tracing` stays readable)."""
        if self._kern is not None:
            self._kern.trace = None

    @property
    def trace_buffer(self) -> Any:
        """The :class:`mori.viz.TraceBuffer` the kernels record into, or None (tracing off)."""
        return self._kern.trace if self._kern is not None else None

    # -- control words ---------------------------------------------------------------------------

    def _ctrl_addr(self, i: int) -> int:
        return self.buffers.ctrl.data_ptr() + 8 * i

    def _signal_all(self, base: int, ranks: Sequence[int] | None = None) -> None:
        """``ctrl[base + this rank] += 1`` on every rank of ``ranks`` (default: all)."""
        shmem.shmem_quiet()  # the stores above are visible before any peer sees the signal
        for p in range(self.world_size) if ranks is None else ranks:
            shmem.shmem_signal_op(self._ctrl_addr(base + self.rank), 1, shmem.SIGNAL_ADD, p)
            if self._inter is not None:
                self._inter.count_control(p)

    def _wait_all(self, func: str, base: int, epoch: int, ranks: Sequence[int] | None = None) -> None:
        """Wait until the word of every rank of ``ranks`` (default: all) reached ``epoch``."""
        for p in range(self.world_size) if ranks is None else ranks:
            try:
                shmem.shmem_wait_until(self._ctrl_addr(base + p), shmem.SHMEM_CMP_GE, epoch, dtype="uint64")
            except MoriTimeoutError as e:
                seen = self.buffers.ctrl[base : base + self.world_size].tolist()
                waited = range(self.world_size) if ranks is None else ranks
                missing = [q for q in waited if seen[q] < epoch]
                raise MoriTimeoutError(
                    f"{func}: rank {self.rank} waited for call {epoch} of every rank; ranks "
                    f"{format_ranks(missing)} did not arrive ({e})",
                    missing,
                ) from None

    # -- validation ------------------------------------------------------------------------------

    def _launch_args(self, func: str, **args: Any) -> None:
        for name, v in args.items():
            low = 0 if name == "rdma_block_num" else 1
            if isinstance(v, bool) or not isinstance(v, int) or (v != -1 and v < low):
                raise bad_value(func, name, v, f"-1 (config default) or an int >= {low}")

    def _tensor(self, func: str, name: str, t: Any, dtypes: Sequence[torch.dtype], ndim: int) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise bad_type(func, name, t, "a torch.Tensor")
        if t.dtype not in dtypes:
            raise bad_value(func, f"{name}.dtype", t.dtype, _names(dtypes))
        if t.dim() != ndim:
            raise bad_value(func, f"{name}.shape", list(t.shape), f"{ndim} dimensions")
        if t.device != self.buffers.recv_tok.device:
            raise bad_value(
                func, f"{name}.device", t.device, f"{self.buffers.recv_tok.device} (the runtime's)"
            )
        return t

    def _check_indices(self, func: str, indices: Any, n: int | None) -> torch.Tensor:
        t = self._tensor(func, "indices", indices, (torch.int32,), 2)
        if (n is not None and t.shape[0] != n) or t.shape[1] != self.buffers.k:
            rows = "N" if n is None else str(n)
            raise bad_value(func, "indices.shape", list(t.shape), f"[{rows}, {self.buffers.k}] (K = top-k)")
        if t.shape[0] > self.buffers.m:
            raise bad_value(
                func,
                "indices.shape[0]",
                t.shape[0],
                f"at most max_num_inp_token_per_rank = {self.buffers.m}",
            )
        e_total = self.buffers.e_local * self.world_size
        # (values are checked where that costs no device synchronisation; the kernels skip ids
        # outside [0, e_total) like -1)
        if t.device.type == "cpu" and t.numel() and bool(((t < -1) | (t >= e_total)).any()):
            bad = t[(t < -1) | (t >= e_total)][0].item()
            raise bad_value(func, "indices", f"contains {bad}", f"expert ids in [0, {e_total}) or -1 (none)")
        return t

    def _check_dispatch_args(
        self,
        func: str,
        input: Any,
        weights: Any,
        scales: Any,
        indices: Any,
        routing: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        cfg = self.config
        input = self._tensor(func, "input", input, DISPATCH_DTYPES, 2)
        n, h = input.shape
        if n > self.buffers.m:
            raise bad_value(
                func, "input.shape[0]", n, f"at most max_num_inp_token_per_rank = {self.buffers.m}"
            )
        if h > cfg.hidden_dim or h * input.element_size() > self.buffers.row_bytes:
            raise bad_value(
                func,
                "input.shape[1]",
                h,
                f"at most hidden_dim = {cfg.hidden_dim} with elements of at most "
                f"max_token_type_size = {cfg.max_token_type_size} bytes",
            )
        indices = self._check_indices(func, indices, n)
        if weights is not None:
            weights = self._tensor(func, "weights", weights, (torch.float32,), 2)
            if tuple(weights.shape) != (n, self.buffers.k):
                raise bad_value(
                    func, "weights.shape", list(weights.shape), f"[{n}, {self.buffers.k}] or None"
                )
        if scales is not None:
            if self.buffers.scale_bytes == 0:
                raise bad_value(
                    func, "scales", "a tensor", "None (the config has scale_dim * scale_type_size = 0)"
                )
            if not isinstance(scales, torch.Tensor):
                raise bad_type(func, "scales", scales, "a torch.Tensor or None")
            if scales.dim() != 2 or scales.shape[0] != n or scales.shape[1] > cfg.scale_dim:
                raise bad_value(func, "scales.shape", list(scales.shape), f"[{n}, <= {cfg.scale_dim}]")
            if scales.element_size() != cfg.scale_type_size:
                raise bad_value(
                    func,
                    "scales.dtype",
                    scales.dtype,
                    f"a dtype of scale_type_size = {cfg.scale_type_size} bytes",
                )
            self._tensor(func, "scales", scales, (scales.dtype,), 2)
        if routing is not None:
            if not isinstance(routing, EpDispatchRoutingHandle):
                raise bad_type(func, "routing", routing, "an EpDispatchRoutingHandle or None")
            self._check_routing(func, routing)
            if routing.num_tokens != n:
                raise bad_value(
                    func, "input.shape[0]", n, f"{routing.num_tokens}, the token count of the routing handle"
                )
        return input, weights, scales, indices

    def _check_routing(self, func: str, routing: EpDispatchRoutingHandle) -> None:
        if self.config.kernel_type not in _ROUTING_KERNELS:
            raise bad_value(
                func,
                "routing",
                "a handle",
                f"None: routing handles need kernel_type {', '.join(k.name for k in _ROUTING_KERNELS)}, "
                f"this op has {self.config.kernel_type.name}",
            )
        if (
            tuple(routing.dest_slot.shape) != (self.world_size, self.buffers.m)
            or routing.dest_slot.device != self.buffers.recv_tok.device
            or (routing.relay is None) != (self._inter is None)
            or (
                self._inter is not None
                and routing.relay is not None
                and tuple(routing.relay[2].shape)
                != (self._inter.n_slots, self.buffers.m, len(self._inter.fan))
            )
        ):
            raise bad_value(func, "routing", routing, "a handle made by an op with the same config")

    # -- dispatch --------------------------------------------------------------------------------

    def dispatch(
        self,
        input: torch.Tensor,
        weights: torch.Tensor | None,
        scales: torch.Tensor | None,
        indices: torch.Tensor,
        block_num: int = -1,
        rdma_block_num: int = -1,
        warp_per_block: int = -1,
        call_local_expert_count: bool = False,
        *,
        routing: EpDispatchRoutingHandle | None = None,
        return_routing: bool = False,
    ) -> tuple[Any, ...]:
        """Send every token to each distinct rank that hosts one of its experts. Collective.

        Args:
            input: [N, H] tokens (bf16, fp16, fp32 or fp8), ``N <= M``, ``H <= hidden_dim``.
            weights: [N, K] float32 gating weights, forwarded unchanged; or None (then the
                received weights are zeros).
            scales: [N, S] per-token scales, ``S <= scale_dim``, elements of ``scale_type_size``
                bytes; or None. Must be None if the config has no scales.
            indices: [N, K] int32 global expert ids; ``-1`` means no selection.
            block_num, rdma_block_num, warp_per_block: launch geometry; validated, unused on CPU.
            call_local_expert_count: also fill :attr:`local_expert_count`.
            routing: replay this handle's layout with a new payload (every rank must replay its
                handle of the same dispatch). IntraNode only.
            return_routing: also return the :class:`EpDispatchRoutingHandle` of this dispatch.

        Returns:
            ``(out [R, H], out_weights [R, K] float32, out_scales [R, S] | None,
            out_indices [R, K] int32, total_recv [1] int32)`` (+ handle if ``return_routing``).
            ``R = max_num_tokens_to_recv()``; the outputs are views of internal buffers: only the
            first ``total_recv[0]`` rows are valid, in no particular order, and the next dispatch
            overwrites them. With ``AsyncLL`` this call only sends: the outputs are valid after
            :meth:`dispatch_recv`.
        """
        func = "EpDispatchCombineOp.dispatch"
        self._launch_args(
            func, block_num=block_num, rdma_block_num=rdma_block_num, warp_per_block=warp_per_block
        )
        if not isinstance(call_local_expert_count, bool):
            raise bad_value(func, "call_local_expert_count", call_local_expert_count, "True or False")
        if not isinstance(return_routing, bool):
            raise bad_value(func, "return_routing", return_routing, "True or False")
        if return_routing and self.config.kernel_type not in _ROUTING_KERNELS:
            raise bad_value(
                func,
                "return_routing",
                True,
                f"False: routing handles need kernel_type "
                f"{', '.join(k.name for k in _ROUTING_KERNELS)}, this op has {self.config.kernel_type.name}",
            )
        if self._pending_dispatch is not None:
            raise MoriStateError(
                f"{func}: the previous dispatch was sent but not received; call dispatch_recv"
            )
        if self._pending_combine is not None:
            raise MoriStateError(f"{func}: the previous combine was sent but not received; call combine_recv")
        input, weights, scales, indices = self._check_dispatch_args(
            func, input, weights, scales, indices, routing
        )
        if self._ikern is not None:
            if routing is not None or return_routing:
                raise MoriBackendError(
                    f"{func}: routing handles with kernel_type {self.config.kernel_type.name}: "
                    f"{_NO_INTERNODE_KERNELS}"
                )
            self._ikern.dispatch(input, weights, scales, indices)
            self._pending_dispatch = {"n": input.shape[0], "count": call_local_expert_count}
            outputs = self._dispatch_outputs(input, scales)
        elif self._kern is not None:
            fused = self.config.kernel_type != KT.AsyncLL  # AsyncLL waits in dispatch_recv
            self._kern.dispatch_send(
                input, weights, scales, indices, routing, block_num, warp_per_block, recv=fused
            )
            self._pending_dispatch = {
                "routing": routing,
                "n": input.shape[0],
                "count": call_local_expert_count,
            }
            outputs = self._dispatch_outputs(input, scales)
        else:
            outputs = self._dispatch_send(input, weights, scales, indices, routing, call_local_expert_count)
        if self.config.kernel_type != KT.AsyncLL:
            self._dispatch_recv(func)
        if return_routing:
            last = self._last
            assert last is not None
            if self._kern is not None:  # snapshot the live tables (device copies, no sync)
                last = EpDispatchRoutingHandle(
                    last.dest_slot.clone(),
                    last.total_recv.clone(),
                    last.recv_src_pos.clone(),
                    num_tokens=last.num_tokens,
                    recv_slot=None if last.recv_slot is None else last.recv_slot.clone(),
                )
                self._last = last
            return (*outputs, last)
        return outputs

    #: the original's name for the send half; the same call as :meth:`dispatch`
    dispatch_send = dispatch

    def dispatch_recv(
        self, block_num: int = -1, warp_per_block: int = -1, call_local_expert_count: bool = False
    ) -> None:
        """AsyncLL only: wait for every rank's dispatch and finalise this rank's outputs."""
        func = "EpDispatchCombineOp.dispatch_recv"
        self._async_only(func)
        self._launch_args(func, block_num=block_num, warp_per_block=warp_per_block)
        if not isinstance(call_local_expert_count, bool):
            raise bad_value(func, "call_local_expert_count", call_local_expert_count, "True or False")
        if self._pending_dispatch is None:
            raise MoriStateError(f"{func}: no dispatch was sent; call dispatch_send first")
        if call_local_expert_count:
            self._pending_dispatch["count"] = True
        self._dispatch_recv(func)

    def _async_only(self, func: str) -> None:
        if self.config.kernel_type != KT.AsyncLL:
            raise MoriStateError(
                f"{func}: only for kernel_type AsyncLL; this op has {self.config.kernel_type.name}, "
                "whose dispatch/combine already return complete results"
            )

    def _dispatch_send(
        self,
        input: torch.Tensor,
        weights: torch.Tensor | None,
        scales: torch.Tensor | None,
        indices: torch.Tensor,
        routing: EpDispatchRoutingHandle | None,
        count: bool,
    ) -> tuple[Any, ...]:
        w, m, rank = self.world_size, self.buffers.m, self.rank
        n, h = input.shape
        self._disp_epoch += 1
        counter = 2 * w + self._disp_epoch % 2
        # this call's words (dtype, hidden size, ...) go with the ready signal and are compared
        # after it, before any row moves
        row = 1 + self._disp_epoch % 2
        self._post_call_words(row, _dispatch_words(input, weights, scales, routing))
        # our receive buffers are free again (their last outputs are given up by this call); a
        # peer writes into ours only after we said so
        self._signal_all(2 * w + 2)
        self._wait_all("EpDispatchCombineOp.dispatch", 2 * w + 2, self._disp_epoch)
        err = self._exchange(
            "EpDispatchCombineOp.dispatch",
            "each dispatch call's arguments",
            agreement.DISPATCH_FIELDS,
            row,
            (),
            barrier=False,
        )
        direct = None if self._inter is None else self._inter.local  # ranks reached by stores
        if err is not None:
            self._signal_all(0, direct)  # "done", with nothing sent: the epochs stay in step
            raise err
        nb = h * input.element_size()
        inp_b = input.contiguous().view(torch.uint8)
        sb = 0 if scales is None else scales.shape[1] * scales.element_size()
        sc_b = None if scales is None else scales.contiguous().view(torch.uint8)
        wts = weights if weights is not None else torch.zeros(n, self.buffers.k, dtype=torch.float32)
        src_pos = (
            (torch.arange(n, dtype=torch.int32) + rank * w * m) if n else torch.zeros(0, dtype=torch.int32)
        )

        if routing is None:
            # dest[t, p]: token t has at least one expert on rank p
            dest = torch.zeros(n, w + 1, dtype=torch.bool)
            ranks = torch.where(indices >= 0, indices // self.buffers.e_local, w).long()
            dest.scatter_(1, ranks, True)
            dest = dest[:, :w]
            dest_slot = torch.full((w, m), -1, dtype=torch.int32)
        else:
            dest_slot = routing.dest_slot
        overflow: list[int] = []
        for p in range(w) if direct is None else direct:
            if routing is None:
                toks = dest[:, p].nonzero().flatten()
                cnt = toks.numel()
                if cnt == 0:
                    continue
                off = shmem.shmem_atomic_fetch_add(self._ctrl_addr(counter), cnt, p)
                if off + cnt > self.buffers.r:
                    overflow.append(p)
                    continue
                dest_slot[p, toks] = torch.arange(off, off + cnt, dtype=torch.int32)
                slots: Any = slice(off, off + cnt)  # (a contiguous range: copies, no scatter)
            else:
                toks = (dest_slot[p, :n] >= 0).nonzero().flatten()
                if toks.numel() == 0:
                    continue
                slots = dest_slot[p, toks].long()
            _, (dst, src) = _words(nb, self._p_tok[p], inp_b)
            self._copy_rows(dst, slots, src, toks)
            self._p_w[p][slots] = wts[toks]
            if sc_b is not None:
                self._p_scales[p][:, :sb][slots] = sc_b[toks]
            self._p_idx[p][slots] = indices[toks]
            self._p_src[p][slots] = src_pos[toks]
        relay = stream_error = None
        if self._inter is not None:  # the streams to other nodes, then this rank's relay fan-out
            got = self._inter.dispatch(
                "EpDispatchCombineOp.dispatch",
                input,
                weights,
                scales,
                indices,
                routing,
                None if routing is not None else dest,
                dest_slot,
                counter,
                self._disp_epoch,
                overflow,
            )
            relay, stream_error = got["relay"], got["error"]
        self._signal_all(0, direct)
        self._pending_dispatch = {
            "relay": relay,
            "epoch": self._disp_epoch,
            "counter": counter,
            "dest_slot": dest_slot,
            "routing": routing,
            "n": n,
            "count": count,
        }
        if stream_error is not None:
            self._pending_dispatch = None
            self._last = None  # the rows of the bad stream are missing: nothing to combine
            raise stream_error
        if overflow:
            raise MoriValueError(
                f"EpDispatchCombineOp.dispatch: ranks {format_ranks(overflow)} would receive more than "
                f"max_num_tokens_to_recv() = {self.buffers.r} rows; raise max_total_recv_tokens (the op is "
                "unusable after this error)"
            )
        return self._dispatch_outputs(input, scales)

    def _dispatch_outputs(self, input: torch.Tensor, scales: torch.Tensor | None) -> tuple[Any, ...]:
        nb = input.shape[1] * input.element_size()
        out = self.buffers.recv_tok[:, :nb].view(input.dtype)
        out_s = None
        if scales is not None:
            out_s = self.buffers.recv_scales[:, : scales.shape[1] * scales.element_size()].view(scales.dtype)
        return out, self.buffers.recv_w, out_s, self.buffers.recv_idx, self._total_recv

    def _dispatch_recv(self, func: str) -> None:
        pend = self._pending_dispatch
        assert pend is not None
        self._pending_dispatch = None
        if self._ikern is not None:
            self._last = None
            if pend["count"]:
                self._ikern.local_expert_count()
            if not self._ikern.is_gpu:  # (on a GPU reading the error words would synchronise)
                err = self._ikern.dispatch_error(func)
                if err is not None:
                    raise err
            self._last = EpDispatchRoutingHandle(
                self._ikern.dest_slot, self._total_recv, self.buffers.recv_src, pend["n"]
            )
            return
        if self._kern is not None:
            routing = pend["routing"]
            self._kern.dispatch_recv(routing, pend["count"], launch=self.config.kernel_type == KT.AsyncLL)
            if not self._kern.is_gpu:  # (on a GPU reading the error word would synchronise)
                err = self._kern.disagreement(func)
                if err is not None:
                    self._last = None  # the call sent nothing: there is no dispatch to combine
                    raise err
            if routing is not None:
                self._last = routing
            else:
                # the live tables: valid until the next dispatch (return_routing snapshots them)
                self._last = EpDispatchRoutingHandle(
                    self._kern.dest_slot,
                    self._total_recv,
                    self.buffers.recv_src,
                    pend["n"],
                    self._kern.recv_slot,
                )
            return
        self._wait_all(func, 0, pend["epoch"], None if self._inter is None else self._inter.local)
        addr = self._ctrl_addr(pend["counter"])
        total = shmem.shmem_atomic_fetch(addr, self.rank)
        shmem.shmem_atomic_set(addr, 0, self.rank)  # self-reset; see the module docstring
        routing = pend["routing"]
        if routing is not None:
            if total != 0:
                raise MoriStateError(
                    f"{func}: a peer reserved rows during a routing replay; replay on every rank"
                )
            total = routing.num_recv
        if total > self.buffers.r:
            raise MoriValueError(
                f"{func}: rank {self.rank} would receive {total} rows, more than max_num_tokens_to_recv() = "
                f"{self.buffers.r}; raise max_total_recv_tokens (the op is unusable after this error)"
            )
        self._total_recv[0] = total
        if routing is not None:
            self._last = routing
        else:
            self._last = EpDispatchRoutingHandle(
                pend["dest_slot"],
                self._total_recv.clone(),
                self.buffers.recv_src[:total].clone(),
                pend["n"],
                relay=pend["relay"],
            )
        if pend["count"]:
            idx = self.buffers.recv_idx[:total]
            local = idx - self.rank * self.buffers.e_local
            mine = (idx >= 0) & (local >= 0) & (local < self.buffers.e_local)
            self.local_expert_count.copy_(
                torch.bincount(local[mine].long(), minlength=self.buffers.e_local).to(torch.int32)
            )

    # -- combine ---------------------------------------------------------------------------------

    def get_registered_combine_input_buffer(self, dtype: torch.dtype, hidden_dim: int = -1) -> torch.Tensor:
        """[R, hidden_dim] view of the registered (symmetric) combine input buffer.

        For zero-copy combine (``use_external_inp_buf=False``): write the expert outputs of the
        received rows there and pass this tensor as combine's ``input``. ``hidden_dim=-1`` means
        the config's.
        """
        func = "EpDispatchCombineOp.get_registered_combine_input_buffer"
        if not isinstance(dtype, torch.dtype) or dtype not in COMBINE_DTYPES:
            raise bad_value(func, "dtype", dtype, _names(COMBINE_DTYPES))
        h = self.config.hidden_dim if hidden_dim == -1 else hidden_dim
        if isinstance(h, bool) or not isinstance(h, int) or not 1 <= h <= self.config.hidden_dim:
            raise bad_value(func, "hidden_dim", hidden_dim, f"-1 or an int in [1, {self.config.hidden_dim}]")
        if h * dtype.itemsize > self.buffers.row_bytes:
            raise bad_value(
                func,
                "hidden_dim",
                hidden_dim,
                f"at most {self.buffers.row_bytes // dtype.itemsize} for {dtype}",
            )
        return self.buffers.comb_inp[:, : h * dtype.itemsize].view(dtype)

    def combine(
        self,
        input: torch.Tensor,
        weights: torch.Tensor | None,
        indices: torch.Tensor,
        block_num: int = -1,
        rdma_block_num: int = -1,
        warp_per_block: int = -1,
        use_external_inp_buf: int = -1,
        call_reset: bool = False,
        *,
        routing: EpDispatchRoutingHandle | None = None,
    ) -> tuple[Any, ...]:
        """Return every received row to its source rank and sum there. Collective.

        Args:
            input: [>= total_recv, H] expert outputs, row ``i`` for received row ``i`` (bf16, fp16
                or fp32; may differ from the dispatch dtype; bf16 only with a ``quant_type``
                other than ``"none"``, and for ``fp8_blockwise`` ``H`` a multiple of the block,
                ``hidden_dim / MORI_FP8_COMBINE_SCALE_DIM``). With zero-copy it must be the
                tensor from :meth:`get_registered_combine_input_buffer`.
            weights: [>= total_recv, K] float32, summed back the same way; or None. Give it on
                every rank or on none.
            indices: [N, K] int32: this rank's own dispatch ``indices`` (not ``out_indices``);
                only its shape is checked.
            block_num, rdma_block_num, warp_per_block: launch geometry; validated, unused on CPU.
            use_external_inp_buf: -1 = the config's; 1/True: ``input`` is any tensor; 0/False:
                zero-copy from the registered buffer (not allowed with wire quantisation).
            call_reset: accepted for compatibility; nothing needs resetting.
            routing: combine the dispatch this handle was made by (default: the last dispatch).

        Returns:
            ``(out [M, H], out_weights [M, K] float32 | None)``: first ``N`` rows valid; ``out[t]``
            is the fp32 sum of the outputs of token ``t``'s distinct destination ranks (unweighted),
            cast to ``input.dtype``. With ``AsyncLL`` they are filled by :meth:`combine_recv`.
        """
        func = "EpDispatchCombineOp.combine"
        self._launch_args(
            func, block_num=block_num, rdma_block_num=rdma_block_num, warp_per_block=warp_per_block
        )
        if not isinstance(call_reset, bool):
            raise bad_value(func, "call_reset", call_reset, "True or False")
        if self._pending_dispatch is not None:
            raise MoriStateError(f"{func}: the dispatch was sent but not received; call dispatch_recv first")
        if self._pending_combine is not None:
            raise MoriStateError(f"{func}: the previous combine was sent but not received; call combine_recv")
        if routing is not None:
            if not isinstance(routing, EpDispatchRoutingHandle):
                raise bad_type(func, "routing", routing, "an EpDispatchRoutingHandle or None")
            self._check_routing(func, routing)
        handle = routing if routing is not None else self._last
        if handle is None:
            raise MoriStateError(f"{func}: no dispatch to combine; call dispatch first")
        if use_external_inp_buf not in (-1, 0, 1) or type(use_external_inp_buf) not in (int, bool):
            raise bad_value(
                func, "use_external_inp_buf", use_external_inp_buf, "-1 (config), 0/False or 1/True"
            )
        external = (
            self.config.use_external_inp_buf if use_external_inp_buf == -1 else bool(use_external_inp_buf)
        )
        quant = self.config.quant_type
        if quant != "none" and not external:
            raise bad_value(
                func,
                "use_external_inp_buf",
                use_external_inp_buf,
                f"-1 or 1/True with quant_type={quant!r} (no zero-copy combine with wire quantisation)",
            )
        # total_recv lives on the device with the kernels: checked only where that costs no sync
        total = handle.num_recv if self._kern is None and self._ikern is None else 0
        input = self._tensor(func, "input", input, COMBINE_DTYPES, 2)
        h = input.shape[1]
        if input.shape[0] < total:
            raise bad_value(func, "input.shape[0]", input.shape[0], f">= total_recv = {total}")
        if h > self.config.hidden_dim or h * input.element_size() > self.buffers.row_bytes:
            raise bad_value(
                func,
                "input.shape[1]",
                h,
                f"at most hidden_dim = {self.config.hidden_dim} with elements of at most "
                f"max_token_type_size = {self.config.max_token_type_size} bytes ({input.dtype} has "
                f"{input.element_size()})",
            )
        if input.stride(1) != 1:
            raise bad_value(func, "input.stride()", input.stride(), "rows with contiguous elements")
        if not external and input.data_ptr() != self.buffers.comb_inp.data_ptr():
            raise bad_value(
                func,
                "input",
                "a tensor outside the registered buffer",
                "the tensor from get_registered_combine_input_buffer() when use_external_inp_buf is False",
            )
        if quant != "none":
            if input.dtype != torch.bfloat16:
                raise bad_value(func, "input.dtype", input.dtype, f"bfloat16 with quant_type={quant!r}")
            if self.buffers.quant_block and h % self.buffers.quant_block:
                raise bad_value(
                    func,
                    "input.shape[1]",
                    h,
                    f"a multiple of the {quant} block of {self.buffers.quant_block} elements",
                )
        if weights is not None:
            weights = self._tensor(func, "weights", weights, (torch.float32,), 2)
            if weights.shape[0] < total or weights.shape[1] != self.buffers.k:
                raise bad_value(
                    func, "weights.shape", list(weights.shape), f"[>= {total}, {self.buffers.k}] or None"
                )
        self._check_indices(func, indices, handle.num_tokens)
        if self._ikern is not None:
            if routing is not None:
                raise MoriBackendError(
                    f"{func}: routing handles with kernel_type {self.config.kernel_type.name}: "
                    f"{_NO_INTERNODE_KERNELS}"
                )
            out = torch.empty(self.buffers.m, h, dtype=input.dtype, device=input.device)
            out_w = None
            if weights is not None:
                out_w = torch.empty(self.buffers.m, self.buffers.k, dtype=torch.float32, device=out.device)
            self._ikern.combine(input, weights, out, out_w, handle.num_tokens)
            if not self._ikern.is_gpu:
                err = self._ikern.combine_error(func)
                if err is not None:
                    raise err
            return out, out_w
        if self._kern is not None:
            out = torch.empty(self.buffers.m, h, dtype=input.dtype, device=input.device)
            out_w = None
            if weights is not None:
                out_w = torch.empty(self.buffers.m, self.buffers.k, dtype=torch.float32, device=out.device)
            kern = self._kern.kernels
            args: _CombineArgs = (
                input,
                weights,
                out,
                out_w,
                handle.num_tokens,
                routing,
                block_num,
                warp_per_block,
            )
            # one launch on a GPU; the interpreter (and AsyncLL's split) reduces in a second one
            fused = self._kern.is_gpu and self.config.kernel_type != KT.AsyncLL
            self._kern.combine(*args, phases=kern.STAGE | kern.REDUCE if fused else kern.STAGE)
            self._pending_combine = {"kernel_args": None if fused else args}
            if self.config.kernel_type != KT.AsyncLL:
                self._combine_recv(func)
            return out, out_w

        # push each received row to its source rank's staging buffer at [this rank, source token]
        w, rank = self.world_size, self.rank
        nb = h * input.element_size()
        span = w * self.buffers.m
        pos = handle.recv_src_pos[:total].long()
        src_rank, src_tok = pos // span, pos % span
        scales: torch.Tensor | None = None
        if quant == "none":
            inp_b = input[:total].view(torch.uint8)
        else:  # the wire holds fp8 (one byte per element) or packed fp4, plus fp32 block scales
            inp_b, scales = self._quantise(input[:total])
            nb = h // 2 if quant == "fp4_blockwise" else h
        self._comb_epoch += 1
        row = 3 + self._comb_epoch % 2
        self._post_call_words(row, _combine_words(input, weights, external))
        # rows no peer writes in this call are zeroed, so the sums can add whole blocks of rows
        # (our staging is free: the previous combine was summed)
        if quant == "none":
            n_tok = handle.num_tokens
            for p in range(w) if self._inter is None else self._inter.local:
                absent = (handle.dest_slot[p, :n_tok] < 0).nonzero().flatten()
                if absent.numel():
                    self.buffers.stage_tok[p].index_fill_(0, absent, 0)
                    self.buffers.stage_w[p].index_fill_(0, absent, 0.0)
        if self._inter is not None:
            self._inter.zero_absent(handle)
        self._signal_all(3 * w + 2)  # our staging buffer is free
        self._wait_all(func, 3 * w + 2, self._comb_epoch)
        err = self._exchange(
            func, "each combine call's arguments", agreement.COMBINE_FIELDS, row, (), barrier=False
        )
        direct = None if self._inter is None else self._inter.local
        if err is not None:
            self._signal_all(w, direct)  # "done", with nothing staged: the epochs stay in step
            raise err
        for p in range(w) if direct is None else direct:
            rows = (src_rank == p).nonzero().flatten()
            if rows.numel() == 0:
                continue
            toks = src_tok[rows]
            _, (dst, src) = _words(nb, self._p_stage_tok[p][rank], inp_b)
            self._copy_rows(dst, toks, src, rows)
            if scales is not None:
                assert self._p_stage_sc is not None
                self._p_stage_sc[p][rank, :, : scales.shape[1]][toks] = scales[rows]
            if weights is not None:
                self._p_stage_w[p][rank][toks] = weights[rows]
        if self._inter is not None:
            # rows of sources on other nodes: into their relays' staging, summed and sent there
            far = (src_rank // self._inter.g != self._inter.node).nonzero().flatten()
            self._inter.contribute(input[:total], weights, far, src_rank[far], src_tok[far])
        self._signal_all(w, direct)
        if self._inter is not None:  # as a relay: the node's contributions are in; send the sums
            self._wait_all(func, w, self._comb_epoch, self._inter.fan)
            self._inter.relay_combine(func, input, weights, handle, self._comb_epoch)
        out = torch.zeros(self.buffers.m, h, dtype=input.dtype)
        out_w = None if weights is None else torch.zeros(self.buffers.m, self.buffers.k, dtype=torch.float32)
        self._pending_combine = {"epoch": self._comb_epoch, "handle": handle, "out": out, "out_w": out_w}
        if self.config.kernel_type != KT.AsyncLL:
            self._combine_recv(func)
        return out, out_w

    def _quantise(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """bf16 rows -> (fp8 e4m3fn bytes [n, h] uint8, fp32 block scales [n, h / block] or None).

        fp8_direct_cast: a saturating cast. fp8_blockwise: each block of ``hidden_dim /
        MORI_FP8_COMBINE_SCALE_DIM`` elements whose max ``|x|`` exceeds 448 is divided by the
        scale ``max|x| / 448`` (else 1) before the cast.
        """
        x = rows.float()
        scales = None
        if self.config.quant_type == "fp4_blockwise":
            return fp4.quantise(x, self.buffers.quant_block)
        if self.buffers.quant_block:
            n, h = x.shape
            blocks = x.view(n, h // self.buffers.quant_block, self.buffers.quant_block)
            amax = blocks.abs().amax(dim=2)
            scales = torch.where(amax > FP8_MAX, amax / FP8_MAX, torch.ones_like(amax))
            x = (blocks / scales[:, :, None]).view(n, h)
        q = x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return q.view(torch.uint8), scales

    #: the original's name for the send half; the same call as :meth:`combine`
    combine_send = combine

    def combine_recv(self, block_num: int = -1, warp_per_block: int = -1) -> None:
        """AsyncLL only: wait for every rank's combine and fill the outputs of :meth:`combine_send`."""
        func = "EpDispatchCombineOp.combine_recv"
        self._async_only(func)
        self._launch_args(func, block_num=block_num, warp_per_block=warp_per_block)
        if self._pending_combine is None:
            raise MoriStateError(f"{func}: no combine was sent; call combine_send first")
        self._combine_recv(func)

    def _combine_recv(self, func: str) -> None:
        pend = self._pending_combine
        assert pend is not None
        self._pending_combine = None
        if self._kern is not None:
            args: _CombineArgs | None = pend["kernel_args"]
            if args is not None:
                self._kern.combine(*args, phases=self._kern.kernels.REDUCE)
            return
        direct = None if self._inter is None else self._inter.local
        self._wait_all(func, self.world_size, pend["epoch"], direct)
        handle: EpDispatchRoutingHandle = pend["handle"]
        out, out_w = pend["out"], pend["out_w"]
        n, h = handle.num_tokens, out.shape[1]
        quant = self.config.quant_type
        nb = {"none": h * out.element_size(), "fp4_blockwise": h // 2}.get(quant, h)
        acc = self._scratch("acc", n * h, torch.float32).view(n, h)
        fresh = True  # acc holds nothing yet: the first whole block is copied, not added to zeros
        acc_w = None if out_w is None else torch.zeros(n, self.buffers.k, dtype=torch.float32)
        for p in range(self.world_size) if direct is None else direct:  # fixed order: deterministic
            toks = (handle.dest_slot[p, :n] >= 0).nonzero().flatten()
            if toks.numel() == 0:
                continue
            if quant == "none":  # (rows of tokens not sent to p were zeroed: add them all)
                block = _words(nb, self.buffers.stage_tok[p])[1][0][:n].view(out.dtype)
                if fresh:
                    acc.copy_(block)
                else:
                    acc.add_(block)
                fresh = False
                if acc_w is not None:
                    acc_w.add_(self.buffers.stage_w[p][:n])
                continue
            if fresh:
                acc.zero_()
                fresh = False
            if quant == "fp4_blockwise":
                assert self.buffers.stage_sc is not None
                packed = self.buffers.stage_tok[p, :, :nb][toks]
                rows = fp4.dequantise(
                    packed,
                    self.buffers.stage_sc[p, :, : h // self.buffers.quant_block][toks],
                    self.buffers.quant_block,
                )
            else:  # dequantise the fp8 wire rows (and their block scales) to fp32
                rows = _words(nb, self.buffers.stage_tok[p])[1][0][toks].view(torch.float8_e4m3fn).float()
                if self.buffers.stage_sc is not None:
                    nblk = h // self.buffers.quant_block
                    sc = self.buffers.stage_sc[p, :, :nblk][toks]
                    rows = (rows.view(-1, nblk, self.buffers.quant_block) * sc[:, :, None]).view(-1, h)
            acc.index_add_(0, toks, rows)
            if acc_w is not None:
                acc_w.index_add_(0, toks, self.buffers.stage_w[p][toks])
        if fresh:
            acc.zero_()
        if self._inter is not None:  # then every other node's sum, node by node
            self._inter.finish_combine(func, handle, out.dtype, h, acc, acc_w, pend["epoch"])
        out[:n].copy_(acc)  # (cast once)
        if out_w is not None and acc_w is not None:
            out_w[:n] = acc_w

    def _scratch(self, key: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat host buffer kept between calls (a fresh tensor of tens of MB costs its page
        faults on every call, more than the arithmetic)."""
        buf = self._scratch_bufs.get(key)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = torch.empty(max(numel, 1), dtype=dtype)
            self._scratch_bufs[key] = buf
        return buf[:numel]

    def _copy_rows(self, dst: torch.Tensor, at: Any, src: torch.Tensor, idx: torch.Tensor) -> None:
        """``dst[at] = src[idx]`` (``at`` a slice or an int64 index tensor) by row copies:
        ``index_select`` / ``index_copy_`` run several times faster than advanced indexing."""
        if isinstance(at, slice) and dst[at].is_contiguous():
            torch.index_select(src, 0, idx, out=dst[at])
            return
        g = self._scratch("copy_rows", idx.numel() * src.shape[1], src.dtype).view(idx.numel(), src.shape[1])
        torch.index_select(src, 0, idx, out=g)
        if isinstance(at, slice):
            dst[at].copy_(g)
        else:
            dst.index_copy_(0, at, g)

    def _rows32(self, words: torch.Tensor, toks: torch.Tensor, dtype: torch.dtype, h: int) -> torch.Tensor:
        """fp32 [len(toks), h]: rows ``toks`` of ``words`` (rows of 8/4/2/1-byte words holding
        ``h`` elements of ``dtype``), gathered and converted in reusable buffers."""
        c = toks.numel()
        g = self._scratch("gather", c * words.shape[1], words.dtype).view(c, words.shape[1])
        torch.index_select(words, 0, toks, out=g)
        f = self._scratch("rows32", c * h, torch.float32).view(c, h)
        f.copy_(g.view(dtype))
        return f

    # -- introspection ---------------------------------------------------------------------------

    def raise_if_ranks_disagreed(self, func: str = "EpDispatchCombineOp.dispatch") -> None:
        """Raise the :class:`~mori.core.errors.MoriValueError` naming what the ranks disagreed on
        in the last dispatch (its dtype, hidden size, scales, weights or replay), if they did.

        The host path and the kernels on the CPU runtime raise from ``dispatch`` itself. On a GPU
        the kernels detect it without a host synchronisation (they then move no row and report
        ``total_recv = 0``); this call reads the result, which synchronises the device, as does
        :meth:`get_dispatch_src_token_pos`, which calls it.
        """
        if self._kern is not None:
            err = self._kern.disagreement(func)
            if err is not None:
                raise err

    def inter_node_traffic(self) -> dict[str, Any]:
        """What this rank sent to ranks of other nodes since the operator was built (inter-node
        kernel types only): ``dispatch_rows`` / ``combine_rows`` (wire rows of the streams: with
        InterNodeV1/V1LL one per token and destination node, with InterNode one per token and
        destination rank), ``dispatch_bytes`` / ``combine_bytes`` (their bytes), ``messages``
        (every put, signal and atomic to another node, control included), the node layout and the
        recorded RDMA settings (``num_qp_per_pe``, ``MORI_NUM_QP_PER_PE``, ``rdma_block_num``,
        unused on the host path). Not collective."""
        if self._inter is None:
            raise MoriStateError(
                "EpDispatchCombineOp.inter_node_traffic: only for kernel_type InterNode, InterNodeV1 or "
                f"InterNodeV1LL; this op has {self.config.kernel_type.name}"
            )
        return self._inter.traffic()

    def get_dispatch_src_token_pos(self) -> torch.Tensor:
        """int32 [total_recv]: flat source position ``src_rank * world_size * M + src_tok`` of each
        received row of the last dispatch (decode with :meth:`decode_send_flat_idx`)."""
        if self._last is None or self._pending_dispatch is not None:
            raise MoriStateError("EpDispatchCombineOp.get_dispatch_src_token_pos: no finished dispatch")
        self.raise_if_ranks_disagreed("EpDispatchCombineOp.get_dispatch_src_token_pos")
        return self._last.recv_src_pos[: self._last.num_recv].clone()

    def decode_send_flat_idx(self, pos: Any) -> tuple[Any, Any]:
        """Flat source position (int or int tensor) -> ``(src_rank, src_tok)``."""
        span = self.world_size * self.buffers.m
        if isinstance(pos, torch.Tensor):
            if pos.dtype.is_floating_point or pos.dtype == torch.bool:
                raise MoriTypeError(
                    f"EpDispatchCombineOp.decode_send_flat_idx: pos has dtype {pos.dtype}; expected an int tensor"
                )
            return pos // span, pos % span
        if isinstance(pos, bool) or not isinstance(pos, int) or not 0 <= pos < span:
            raise bad_value("EpDispatchCombineOp.decode_send_flat_idx", "pos", pos, f"an int in [0, {span})")
        return pos // span, pos % span

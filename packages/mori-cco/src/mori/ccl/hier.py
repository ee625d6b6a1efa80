"""Hierarchical all-gather: :class:`HierAllGather` and its pure-Python specification
:func:`hier_allgather_reference`.

PEs form nodes of ``R = ranks_per_node`` consecutive PEs (``G = npes / R`` nodes); PE ``r`` is
local rank ``l = r % R`` of node ``g = r // R``. Two phases (the 2-D all-gather):

1. **inter-node ring** among the PEs with the same local rank: ``G - 1`` steps; in step ``s`` every
   PE copies what its ring predecessor (local rank ``l`` of node ``g - 1``) got in step ``s - 1``
   (its own input for ``s = 1``) into its slot ``s``. Afterwards slot ``s`` of PE ``(g, l)`` holds
   the input of PE ``(g - s, l)`` (nodes modulo ``G``).
2. **intra-node**: every PE copies slot ``s`` of every PE ``(g, l')`` of its node, the input of
   PE ``(g - s, l')``, into its place in the output.

The output equals ``torch.distributed.all_gather_into_tensor`` bit for bit. Every step is ordered
by the channel's READY barrier. Here the ring runs over the LSA team (nodes emulated by
``ranks_per_node`` on one host); across real nodes it needs GDA, which comes with the transport
layer (issue 14): the constructor refuses a communicator that spans nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mori.ccl.allgather import WORD, as_bytes
from mori.ccl.base import Collective
from mori.core.errors import bad_type, bad_value

__all__ = ["HierAllGather", "hier_allgather_reference"]


def _layout(func: str, npes: int, ranks_per_node: Any) -> tuple[int, int]:
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise bad_value(func, "ranks_per_node", ranks_per_node, "None or an int >= 1 that divides npes")
    if npes % ranks_per_node:
        raise bad_value(func, "ranks_per_node", ranks_per_node, f"a divisor of npes ({npes})")
    return ranks_per_node, npes // ranks_per_node


def hier_allgather_reference(inputs: Sequence[torch.Tensor], ranks_per_node: int) -> list[torch.Tensor]:
    """What :class:`HierAllGather` computes, step by step in plain Python: ``inputs[r]`` is PE
    ``r``'s input (all the same shape and dtype); returns every PE's 1-D output."""
    func = "hier_allgather_reference"
    n = len(inputs)
    if n == 0:
        raise bad_value(func, "inputs", inputs, "one tensor per PE")
    r_per, g_count = _layout(func, n, ranks_per_node)
    first = inputs[0]
    for t in inputs:
        if not isinstance(t, torch.Tensor) or t.shape != first.shape or t.dtype != first.dtype:
            raise bad_type(
                func, "inputs", t, f"tensors of shape {tuple(first.shape)} and dtype {first.dtype}"
            )
    c = first.numel()
    # phase 1: slots[r][s], the ring steps one after another
    slots: list[list[torch.Tensor]] = [[inputs[r].reshape(-1).clone()] for r in range(n)]
    for s in range(1, g_count):
        for r in range(n):
            g, local = divmod(r, r_per)
            prev = ((g - 1) % g_count) * r_per + local
            slots[r].append(slots[prev][s - 1].clone())
    # phase 2: each PE takes every slot of every PE of its node
    outs = []
    for r in range(n):
        g = r // r_per
        out = torch.empty(n * c, dtype=first.dtype)
        for l2 in range(r_per):
            peer = g * r_per + l2
            for s in range(g_count):
                src = ((g - s) % g_count) * r_per + l2
                out[src * c : (src + 1) * c] = slots[peer][s]
        outs.append(out)
    return outs


class HierAllGather(Collective):
    """Hierarchical all-gather (see the module docstring) with ``all_gather_into_tensor`` semantics.

    ``ranks_per_node``: PEs per node (None: the PEs that share this PE's node id; it must divide
    ``npes``). ``inter_num_qp``: accepted for the original's call shape (RDMA queue pairs of the
    inter-node leg; unused until GDA). Other arguments as :class:`~mori.ccl.base.Collective`; the
    transit buffer must hold ``npes / ranks_per_node`` inputs.
    """

    NAME = "HierAllGather"

    def __init__(
        self,
        my_pe: int,
        npes: int,
        input_buffer_size: int | None = None,
        output_buffer_size: int | None = None,
        transit_buffer_size: int | None = None,
        *,
        ranks_per_node: int | None = None,
        inter_num_qp: int = 4,
        **kwargs: Any,
    ) -> None:
        func = self.NAME
        if isinstance(inter_num_qp, bool) or not isinstance(inter_num_qp, int) or inter_num_qp < 1:
            raise bad_value(func, "inter_num_qp", inter_num_qp, "an int >= 1")
        self.inter_num_qp = inter_num_qp
        super().__init__(my_pe, npes, input_buffer_size, output_buffer_size, transit_buffer_size, **kwargs)
        if ranks_per_node is None:
            ids = self.comm.node_ids()
            ranks_per_node = sum(1 for i in ids if i == ids[my_pe])
        self.ranks_per_node, self.nodes = _layout(func, npes, ranks_per_node)

    def _check(self, func: str, output: Any, input: Any) -> tuple[torch.Tensor, torch.Tensor]:
        for arg, t in (("output", output), ("input", input)):
            if not isinstance(t, torch.Tensor):
                raise bad_type(func, arg, t, "a torch.Tensor")
        if output.dtype != input.dtype:
            raise bad_value(func, "output.dtype", output.dtype, f"input's dtype ({input.dtype})")
        if output.numel() != self.npes * input.numel():
            raise bad_value(
                func,
                "output",
                f"{output.numel()} elements",
                f"npes * input.numel() = {self.npes * input.numel()}",
            )
        nbytes = input.numel() * input.element_size()
        if nbytes % WORD:
            raise bad_value(func, "input", f"{nbytes} bytes", "a multiple of 4 bytes (uint32 words)")
        a = as_bytes(self._tensor(func, "input", input, min_bytes=nbytes))
        o = as_bytes(self._tensor(func, "output", output, min_bytes=nbytes * self.npes))
        self._check_limits(func, nbytes, nbytes * self.npes, nbytes * self.nodes)
        return a, o

    def __call__(self, output: torch.Tensor, input: torch.Tensor, stream: Any = None) -> None:
        """Gather every PE's ``input`` into ``output`` (PE order). Collective."""
        func = f"{self.NAME}.__call__"
        a, o = self._check(func, output, input)
        self._run(func, stream, lambda: self._body(a, o))

    def start_async(self, output: torch.Tensor, input: torch.Tensor, stream: Any = None) -> None:
        """:meth:`__call__`, asynchronously; finish with ``wait_async``."""
        func = f"{self.NAME}.start_async"
        a, o = self._check(func, output, input)
        self._start_async(func, stream, lambda: self._body(a, o))

    def _body(self, inp: torch.Tensor, out: torch.Tensor) -> str:
        c = inp.numel()
        if c == 0:
            return "empty"
        ch = self.ch
        host = self.impl == "host"
        r_per, g_count = self.ranks_per_node, self.nodes
        g, local = divmod(ch.rank, r_per)
        off = ch.large_off

        def sync() -> None:
            if host:
                ch.devcomm.lsa_barrier_sync(ch.ready(0))
            else:
                self._sync(self.kernels.PHASE_READY)

        if host:
            ch.devcomm.lsa_barrier_wait(ch.done)
        else:
            self._sync(self.kernels.PHASE_WAIT_DONE)
        ch.view(ch.rank, off, c).copy_(inp)
        prev = ((g - 1) % g_count) * r_per + local
        for s in range(1, g_count):  # phase 1: the ring
            sync()
            ch.view(ch.rank, off + s * c, c).copy_(ch.view(prev, off + (s - 1) * c, c))
        sync()
        for l2 in range(r_per):  # phase 2: within the node
            peer = g * r_per + l2
            for s in range(g_count):
                src = ((g - s) % g_count) * r_per + l2
                out[src * c : (src + 1) * c].copy_(ch.view(peer, off + s * c, c))
        if host:
            ch.devcomm.lsa_barrier_arrive(ch.done)
            return "host:hier"
        self._sync(self.kernels.PHASE_FINISH)
        return "copy-engine:hier"

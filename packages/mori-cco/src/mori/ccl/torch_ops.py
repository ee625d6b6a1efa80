"""The torch front door of mori.ccl: ``torch.distributed``-style calls on tensors, and torch custom
ops that ``torch.compile`` traces (no graph break) and CUDA graphs capture.

Calls (collective; ``group`` is a :class:`mori.cco.Communicator` or its ``name``)::

    mori.ccl.torch_ops.all_reduce(t, group=comm)                 # in place, like dist.all_reduce
    mori.ccl.torch_ops.all_gather_into_tensor(out, t, group=comm)
    mori.ccl.torch_ops.all_to_all_single(out, t, group=comm)

Custom ops (functional: they return a new tensor, which is what ``torch.compile`` wants)::

    torch.ops.mori_ccl.all_reduce(t, comm.name)                  # sum over ranks, t's shape
    torch.ops.mori_ccl.all_gather_into_tensor(t, comm.name)      # [nranks * t.shape[0], ...]
    torch.ops.mori_ccl.all_to_all_single(t, comm.name)           # t's shape, blocks exchanged

They run the collectives of :mod:`mori.ccl` (host path on CPU ranks, kernels on GPUs), made once per
(communicator, kind, dtype) on first use, with staging sized to the call (grown, collectively, when
a later call is larger: every rank makes the same calls, so every rank grows at the same call).
Staging comes from the communicator's heap (``per_rank_vmm`` must leave room). Sums only
(``op="sum"`` / ``ReduceOp.SUM``); all-reduce dtypes as :class:`~mori.ccl.AllreduceSdma`; the
moves take any dtype whose bytes are whole uint32 words. :func:`last_path` says what ran.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from mori.ccl.allgather import All2allSdma, AllgatherSdma, as_bytes
from mori.ccl.allreduce import DTYPES, AllreduceSdma
from mori.cco import Communicator
from mori.core.errors import bad_type, bad_value

__all__ = ["all_gather_into_tensor", "all_reduce", "all_to_all_single", "close", "last_path"]

#: smallest staging a front-door collective gets (grown to powers of two above)
MIN_TRANSIT = 1 << 20

_objects: dict[tuple[str, str, str], Any] = {}
_lock = threading.Lock()
_last: dict[str, str] = {}


def _comm(func: str, group: Any) -> Communicator:
    if isinstance(group, Communicator):
        return group
    if isinstance(group, str):
        return Communicator.by_name(group)
    raise bad_type(func, "group", group, "a mori.cco.Communicator or its name")


def _transit(nbytes: int) -> int:
    size = MIN_TRANSIT
    while size < nbytes:
        size *= 2
    return size


def _collective(kind: str, comm: Communicator, dtype: torch.dtype, nbytes: int) -> Any:
    key = (comm.name, kind, str(dtype))
    with _lock:
        obj = _objects.get(key)
        if obj is not None and (obj.ch.closed or obj.comm.closed):
            obj = None
        if obj is not None and obj.ch.large_cap < nbytes:
            obj.close()  # every rank makes the same call, so every rank grows here
            obj = None
        if obj is None:
            args: dict[str, Any] = {"transit_buffer_size": _transit(nbytes), "comm": comm}
            if kind == "all_reduce":
                obj = AllreduceSdma(comm.rank, comm.nranks, dtype=dtype, **args)
            elif kind == "all_gather":
                obj = AllgatherSdma(comm.rank, comm.nranks, **args)
            else:
                obj = All2allSdma(comm.rank, comm.nranks, **args)
            _objects[key] = obj
        return obj


def _sum_op(func: str, op: Any) -> None:
    import torch.distributed as dist

    if op in ("sum", dist.ReduceOp.SUM):
        return
    raise bad_value(func, "op", op, "'sum' or torch.distributed.ReduceOp.SUM (mori.ccl sums only)")


def _words(func: str, arg: str, t: torch.Tensor) -> int:
    nbytes = t.numel() * t.element_size()
    if nbytes % 4:
        raise bad_value(func, arg, f"{nbytes} bytes", "a whole number of uint32 words (bytes % 4 == 0)")
    return nbytes // 4


def _contiguous(func: str, arg: str, t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise bad_type(func, arg, t, "a torch.Tensor")
    if not t.is_contiguous():
        raise bad_value(func, arg, f"a tensor with strides {t.stride()}", "a contiguous tensor")
    return t


def all_reduce(tensor: torch.Tensor, op: Any = "sum", *, group: Any) -> None:
    """Sum ``tensor`` over every rank of ``group``, in place. Collective."""
    func = "mori.ccl.torch_ops.all_reduce"
    _sum_op(func, op)
    t = _contiguous(func, "tensor", tensor)
    if t.dtype not in DTYPES:
        raise bad_value(
            func, "tensor.dtype", t.dtype, ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
        )
    comm = _comm(func, group)
    obj = _collective("all_reduce", comm, t.dtype, t.numel() * t.element_size())
    obj.allreduce_inplace(t.reshape(-1), t.numel())
    _last[comm.name] = obj.last_path


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, *, group: Any) -> None:
    """``output`` = every rank's ``input``, concatenated in rank order (``dist.all_gather_into_tensor``).
    Collective."""
    func = "mori.ccl.torch_ops.all_gather_into_tensor"
    comm = _comm(func, group)
    a = _contiguous(func, "input", input)
    o = _contiguous(func, "output", output)
    if o.dtype != a.dtype or o.numel() != comm.nranks * a.numel():
        raise bad_value(func, "output", f"{o.dtype}[{o.numel()}]", f"{a.dtype}[{comm.nranks * a.numel()}]")
    words = _words(func, "input", a)
    obj = _collective("all_gather", comm, torch.uint8, words * 4)
    obj(as_bytes(a), as_bytes(o), words)
    _last[comm.name] = obj.last_path


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, *, group: Any) -> None:
    """Block ``q`` of this rank's ``input`` goes to rank ``q``; block ``p`` of ``output`` comes from
    rank ``p`` (``dist.all_to_all_single`` with equal splits). Collective."""
    func = "mori.ccl.torch_ops.all_to_all_single"
    comm = _comm(func, group)
    a = _contiguous(func, "input", input)
    o = _contiguous(func, "output", output)
    if o.dtype != a.dtype or o.numel() != a.numel():
        raise bad_value(
            func, "output", f"{o.dtype}[{o.numel()}]", f"input's dtype and size ({a.dtype}[{a.numel()}])"
        )
    words = _words(func, "input", a)
    if words % comm.nranks:
        raise bad_value(
            func, "input", f"{words} uint32 words", f"a multiple of {comm.nranks} words (one block per rank)"
        )
    obj = _collective("all_to_all", comm, torch.uint8, words * 4)
    obj(as_bytes(a), as_bytes(o), words // comm.nranks)
    _last[comm.name] = obj.last_path


def last_path(group: Any) -> str:
    """What the last front-door call on ``group`` ran (``"host:oneshot"``, ``"triton:rsag"``, ...)."""
    return _last.get(_comm("mori.ccl.torch_ops.last_path", group).name, "")


def close(group: Any) -> None:
    """Free the front door's collectives of ``group`` (collective). Destroying the communicator
    frees them too."""
    comm = _comm("mori.ccl.torch_ops.close", group)
    with _lock:
        for key in [k for k in _objects if k[0] == comm.name]:
            _objects.pop(key).close()


# -- custom ops -----------------------------------------------------------------------------------------


@torch.library.custom_op("mori_ccl::all_reduce", mutates_args=())
def _all_reduce_op(input: torch.Tensor, group: str) -> torch.Tensor:
    out = input.contiguous().clone()
    all_reduce(out, group=group)
    return out


@_all_reduce_op.register_fake
def _(input: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(input, memory_format=torch.contiguous_format)


@torch.library.custom_op("mori_ccl::all_gather_into_tensor", mutates_args=())
def _all_gather_op(input: torch.Tensor, group: str) -> torch.Tensor:
    n = Communicator.by_name(group).nranks
    a = input.contiguous()
    out = a.new_empty((n * a.shape[0], *a.shape[1:]) if a.dim() else (n,))
    all_gather_into_tensor(out, a, group=group)
    return out


@_all_gather_op.register_fake
def _(input: torch.Tensor, group: str) -> torch.Tensor:
    n = Communicator.by_name(group).nranks
    return input.new_empty((n * input.shape[0], *input.shape[1:]) if input.dim() else (n,))


@torch.library.custom_op("mori_ccl::all_to_all_single", mutates_args=())
def _all_to_all_op(input: torch.Tensor, group: str) -> torch.Tensor:
    a = input.contiguous()
    out = torch.empty_like(a)
    all_to_all_single(out, a, group=group)
    return out


@_all_to_all_op.register_fake
def _(input: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(input, memory_format=torch.contiguous_format)

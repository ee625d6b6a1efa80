"""torch views of symmetric memory: a PE's own copy and its peers' copies, without copies.

Tensors live on the runtime's device (CPU for the ``cpu`` runtime). A view of a peer's copy reads
and writes that peer's memory directly (loads and stores through the shared mapping).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from mori.core.errors import MoriValueError, bad_type, bad_value
from mori.shmem import api
from mori.shmem.context import current

if TYPE_CHECKING:
    import torch


def _shape(func: str, shape: int | Sequence[int]) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise bad_value(func, "shape", shape, "a sequence of ints >= 0")
    return dims


def shmem_tensor_view(
    addr: int, shape: int | Sequence[int], dtype: torch.dtype, pe: int | None = None
) -> torch.Tensor:
    """A contiguous tensor over the symmetric object at ``addr`` (this PE's address), on PE ``pe``
    (default: this PE). Not collective; no copy."""
    import torch

    func = "shmem_tensor_view"
    ctx = current(func)
    if not isinstance(dtype, torch.dtype):
        raise bad_type(func, "dtype", dtype, "a torch.dtype")
    dims = _shape(func, shape)
    nbytes = math.prod(dims) * dtype.itemsize
    target = ctx.my_pe if pe is None else ctx.check_pe(func, pe)
    raw = ctx.remote_addr(func, "addr", addr, nbytes, target)
    t = ctx.runtime.byte_view(raw, nbytes).view(dtype).view(dims)
    t.__symm_tensor__ = True  # type: ignore[attr-defined]
    return t


def mori_shmem_create_tensor(shape: int | Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Allocate a symmetric tensor (collective, like :func:`~mori.shmem.shmem_malloc`). Contents are
    undefined until written. Free with :func:`mori_shmem_free_tensor`."""
    import torch

    func = "mori_shmem_create_tensor"
    if not isinstance(dtype, torch.dtype):
        raise bad_type(func, "dtype", dtype, "a torch.dtype")
    dims = _shape(func, shape)
    addr = api.shmem_malloc(max(1, math.prod(dims) * dtype.itemsize))
    return shmem_tensor_view(addr, dims, dtype)


def mori_shmem_free_tensor(tensor: torch.Tensor) -> None:
    """Free a tensor from :func:`mori_shmem_create_tensor`. Collective."""
    if not getattr(tensor, "__symm_tensor__", False):
        raise MoriValueError("mori_shmem_free_tensor: tensor was not made by mori_shmem_create_tensor")
    api.shmem_free(tensor.data_ptr())


def symm_mori_shmem_tensor(tensor: torch.Tensor, peer: int) -> torch.Tensor:
    """View of PE ``peer``'s copy of a symmetric tensor (same shape, dtype and strides). Raises if
    the peer is not load/store reachable. Not collective."""
    func = "symm_mori_shmem_tensor"
    ctx = current(func)
    ctx.check_pe(func, peer, "peer")
    span = (
        (sum((s - 1) * st for s, st in zip(tensor.shape, tensor.stride(), strict=True)) + 1)
        if tensor.numel()
        else 0
    )
    nbytes = span * tensor.element_size()
    raw = ctx.remote_addr(func, "tensor", tensor.data_ptr(), nbytes, peer)
    import torch

    base = ctx.runtime.byte_view(raw, nbytes).view(tensor.dtype)
    t = torch.as_strided(base, tensor.shape, tensor.stride())
    t.__symm_tensor__ = True  # type: ignore[attr-defined]
    return t


def mori_shmem_create_tensor_list_intra_node(
    shape: int | Sequence[int], dtype: torch.dtype
) -> list[torch.Tensor]:
    """Allocate a symmetric tensor (collective) and return views of every PE's copy, in PE order.

    Every PE must be load/store reachable (ranks of one node)."""
    t = mori_shmem_create_tensor(shape, dtype)
    ctx = current("mori_shmem_create_tensor_list_intra_node")
    return [t if p == ctx.my_pe else symm_mori_shmem_tensor(t, p) for p in range(ctx.n_pes)]

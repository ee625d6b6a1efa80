"""``torch.distributed.all_gather_into_tensor`` semantics on mori's all-gather:
:class:`AllGatherIntoTensor`, with the original's :class:`DataType` enum and :func:`size_of`."""

from __future__ import annotations

import enum
from typing import Any

import torch

from mori.ccl.allgather import WORD, AllgatherSdma, as_bytes
from mori.core.errors import bad_type, bad_value

__all__ = ["AllGatherIntoTensor", "DataType", "size_of"]


class DataType(enum.IntEnum):
    """Element types (the original's names)."""

    Int8 = 0
    UInt8 = 1
    Int16 = 2
    UInt16 = 3
    Int32 = 4
    UInt32 = 5
    Int64 = 6
    UInt64 = 7
    Float16 = 8
    BFloat16 = 9
    Float32 = 10
    Float64 = 11


_SIZES = {
    DataType.Int8: 1,
    DataType.UInt8: 1,
    DataType.Int16: 2,
    DataType.UInt16: 2,
    DataType.Int32: 4,
    DataType.UInt32: 4,
    DataType.Int64: 8,
    DataType.UInt64: 8,
    DataType.Float16: 2,
    DataType.BFloat16: 2,
    DataType.Float32: 4,
    DataType.Float64: 8,
}
_TORCH = {
    DataType.Int8: torch.int8,
    DataType.UInt8: torch.uint8,
    DataType.Int16: torch.int16,
    DataType.UInt16: torch.uint16,
    DataType.Int32: torch.int32,
    DataType.UInt32: torch.uint32,
    DataType.Int64: torch.int64,
    DataType.UInt64: torch.uint64,
    DataType.Float16: torch.float16,
    DataType.BFloat16: torch.bfloat16,
    DataType.Float32: torch.float32,
    DataType.Float64: torch.float64,
}


def size_of(dtype: DataType | torch.dtype) -> int:
    """Bytes of one element of ``dtype`` (a :class:`DataType` or a torch dtype)."""
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    if not isinstance(dtype, DataType):
        raise bad_type("size_of", "dtype", dtype, "a DataType or a torch.dtype")
    return _SIZES[dtype]


def torch_dtype(dtype: DataType) -> torch.dtype:
    """The torch dtype of a :class:`DataType`."""
    return _TORCH[DataType(dtype)]


class AllGatherIntoTensor:
    """``output = concat over PEs (in PE order) of input``, like ``all_gather_into_tensor``.

    ``output``: contiguous, same dtype as ``input``, ``npes * input.numel()`` elements (any shape,
    e.g. ``[npes * d0, ...]`` or ``[npes, ...]``); ``input``: contiguous, its bytes a multiple of
    4 (uint32 words). Sync (:meth:`__call__`) or async (:meth:`start_async` + :meth:`wait_async`).
    ``auto_register`` is accepted for the original's call shape: inputs are always staged, nothing
    needs registering. Other arguments as :class:`~mori.ccl.AllgatherSdma`.
    """

    NAME = "AllGatherIntoTensor"

    def __init__(
        self,
        my_pe: int,
        npes: int,
        input_buffer_size: int | None = None,
        output_buffer_size: int | None = None,
        transit_buffer_size: int | None = None,
        *,
        auto_register: bool = True,
        **kwargs: Any,
    ) -> None:
        if not isinstance(auto_register, bool):
            raise bad_type(self.NAME, "auto_register", auto_register, "a bool")
        self.auto_register = auto_register
        self._ag = AllgatherSdma(
            my_pe, npes, input_buffer_size, output_buffer_size, transit_buffer_size, **kwargs
        )
        self.npes = npes

    @property
    def last_path(self) -> str:
        return self._ag.last_path

    @property
    def impl(self) -> str:
        return self._ag.impl

    def _check(self, func: str, output: Any, input: Any) -> int:
        for arg, t in (("output", output), ("input", input)):
            if not isinstance(t, torch.Tensor):
                raise bad_type(func, arg, t, "a torch.Tensor")
        if output.dtype != input.dtype:
            raise bad_value(func, "output.dtype", output.dtype, f"input's dtype ({input.dtype})")
        if output.numel() != self.npes * input.numel():
            raise bad_value(
                func,
                "output",
                f"{tuple(output.shape)} ({output.numel()} elements)",
                f"npes * input.numel() = {self.npes * input.numel()} elements",
            )
        nbytes = int(input.numel() * input.element_size())
        if nbytes % WORD:
            raise bad_value(func, "input", f"{nbytes} bytes", "a multiple of 4 bytes (uint32 words)")
        return nbytes // WORD

    def __call__(self, output: torch.Tensor, input: torch.Tensor, stream: Any = None) -> None:
        """Gather into ``output``. Collective."""
        words = self._check(f"{self.NAME}.__call__", output, input)
        self._ag(as_bytes(input), as_bytes(output), words, stream)

    def start_async(self, output: torch.Tensor, input: torch.Tensor, stream: Any = None) -> None:
        """:meth:`__call__`, asynchronously; finish with :meth:`wait_async`."""
        words = self._check(f"{self.NAME}.start_async", output, input)
        self._ag.start_async(as_bytes(input), as_bytes(output), words, stream)

    def wait_async(self, stream: Any = None) -> bool:
        return self._ag.wait_async(stream)

    def is_async_in_progress(self) -> bool:
        return self._ag.is_async_in_progress()

    def close(self) -> None:
        self._ag.close()

    def __enter__(self) -> AllGatherIntoTensor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

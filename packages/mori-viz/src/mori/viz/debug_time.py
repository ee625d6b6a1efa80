"""The original's names for an operator's trace buffer, as ``mori.cpp`` re-exports them.

Code written for the original reads an operator's profiler buffer with
``mori.cpp.get_debug_time_buf(op._handle)`` and its per-warp write offsets with
``get_debug_time_offset``, and looks slot names up in ``ALL_PROFILER_SLOTS``. Here an operator's
buffer is the :class:`~mori.viz.TraceBuffer` that ``op.enable_tracing()`` returned (``op.trace_buffer``);
these functions take the operator (or its ``_handle``, for the original's spelling, where it has one)
and return views of that buffer, and ``ALL_PROFILER_SLOTS`` is a live view of :func:`slot_table`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from mori.core.errors import MoriStateError, bad_type
from mori.viz import layout
from mori.viz.buffer import TraceBuffer
from mori.viz.slots import SlotInfo, slot_table

__all__ = ["ALL_PROFILER_SLOTS", "get_debug_time_buf", "get_debug_time_offset"]


def _buffer(func: str, op: Any) -> TraceBuffer:
    if isinstance(op, TraceBuffer):
        return op
    if not hasattr(op, "trace_buffer"):
        raise bad_type(
            func, "op", op, "an operator with tracing (e.g. mori.ops.EpDispatchCombineOp) or a TraceBuffer"
        )
    buf = op.trace_buffer
    if buf is None:
        raise MoriStateError(
            f"{func}: tracing is off for {type(op).__name__}; call op.enable_tracing() first"
        )
    return buf  # type: ignore[no-any-return]


def get_debug_time_buf(op: Any) -> Any:
    """The whole trace buffer of ``op`` (int64 tensor ``[words]``, on the operator's device): the
    header, the ring table and the events (layout: :mod:`mori.viz.layout`). A view, not a copy."""
    return _buffer("get_debug_time_buf", op).tensor


def get_debug_time_offset(op: Any) -> Any:
    """Events written so far by each ring of ``op``'s trace buffer (int64 tensor ``[n_rings]``,
    a strided view into the buffer; ring ``r`` holds its newest ``min(offset[r], capacity)``)."""
    buf = _buffer("get_debug_time_offset", op)
    start = layout.HEADER_WORDS
    return buf.tensor[start : start + layout.RING_WORDS * buf.n_rings : layout.RING_WORDS]


class _AllSlots(Mapping[int, SlotInfo]):
    """Every slot declared in this process so far, id -> ``(group, name)``; read at each access."""

    def __getitem__(self, slot: int) -> SlotInfo:
        return slot_table()[slot]

    def __iter__(self) -> Iterator[int]:
        return iter(slot_table())

    def __len__(self) -> int:
        return len(slot_table())

    def __repr__(self) -> str:
        return f"ALL_PROFILER_SLOTS({dict(slot_table())!r})"


ALL_PROFILER_SLOTS: Mapping[int, SlotInfo] = _AllSlots()

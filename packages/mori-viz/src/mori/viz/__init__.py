"""mori.viz: warp-level traces of MORI kernels (and of the host code around them) in Perfetto.

Kernels record spans and instants into per-program rings of a trace buffer with the
``@triton.jit`` helpers of :mod:`mori.viz.device`, compiled out entirely when their ``TRACE``
constexpr is off. The host reads the buffers, aligns every rank's device clock to the host clock,
adds host-side spans (:func:`span`, native threads through ``mori_viz/host_trace.h``) and writes one
trace for ui.perfetto.dev: Chrome trace JSON or Perfetto's protobuf format
(:func:`export_to_perfetto`). ``mori viz export | summary | plot`` work on saved traces.

The names below are imported on first use, so that ``import mori.viz`` stays cheap (no torch, no
Triton) for the ``mori`` command.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mori.viz.buffer import TraceBuffer
    from mori.viz.debug_time import ALL_PROFILER_SLOTS, get_debug_time_buf, get_debug_time_offset
    from mori.viz.export import ExportReport, export_to_perfetto
    from mori.viz.host import HostRing, instant, record_host, span, stop_host_recording, traced
    from mori.viz.slots import declare_slots, slot_table
    from mori.viz.trace import RankTrace, capture, load_traces

__all__ = [
    "ALL_PROFILER_SLOTS",
    "ExportReport",
    "HostRing",
    "RankTrace",
    "TraceBuffer",
    "capture",
    "declare_slots",
    "export_to_perfetto",
    "get_debug_time_buf",
    "get_debug_time_offset",
    "instant",
    "load_traces",
    "record_host",
    "slot_table",
    "span",
    "stop_host_recording",
    "traced",
]

_WHERE = {
    "ALL_PROFILER_SLOTS": "mori.viz.debug_time",
    "ExportReport": "mori.viz.export",
    "HostRing": "mori.viz.host",
    "RankTrace": "mori.viz.trace",
    "TraceBuffer": "mori.viz.buffer",
    "capture": "mori.viz.trace",
    "declare_slots": "mori.viz.slots",
    "export_to_perfetto": "mori.viz.export",
    "get_debug_time_buf": "mori.viz.debug_time",
    "get_debug_time_offset": "mori.viz.debug_time",
    "instant": "mori.viz.host",
    "load_traces": "mori.viz.trace",
    "record_host": "mori.viz.host",
    "slot_table": "mori.viz.slots",
    "span": "mori.viz.host",
    "stop_host_recording": "mori.viz.host",
    "traced": "mori.viz.host",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'mori.viz' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

"""mori.kernel_profiler: the original's name for the host API of MORI-VIZ, the warp-level kernel
profiler; every name is :mod:`mori.viz`'s (distribution ``mori-viz``).

``mori.kernel_profiler.export_to_perfetto(trace_buffer, filename, slot_map=None, gpu_freq_ghz=None,
validate_pairs=True, sanitize_orphans=True)`` turns a kernel's trace buffer into a Chrome trace file
for ui.perfetto.dev. This module is an alias: it forwards each name to ``mori.viz`` when first
used, and says ``pip install mori-viz`` when that is not installed.
"""

from __future__ import annotations

from typing import Any

from mori._forward import component, forward

#: mori.viz's host API (dir() lists every public name of mori.viz)
HOST_API = ("export_to_perfetto",)
__all__ = [*HOST_API]


def __getattr__(name: str) -> Any:
    if name.startswith("__"):  # dunder probes (copy, pickle, inspect) get the ordinary error
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}", name=name)
    if name in HOST_API:  # the host API: an ImportError that says why it is unavailable
        return forward("mori.viz", name, f"{__name__}.{name}")
    return getattr(component("mori.viz", f"{__name__}.{name}"), name)


def __dir__() -> list[str]:
    try:
        viz = component("mori.viz", __name__)
    except ModuleNotFoundError:
        return sorted([*globals(), *HOST_API])
    return sorted({*globals(), *HOST_API, *getattr(viz, "__all__", [])})

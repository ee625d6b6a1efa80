"""mori.viz: warp-level kernel profiler. PLACEHOLDER: nothing is implemented yet.

mori-viz 0.1.0 is an empty placeholder. The VIZ component is not implemented yet; this module
provides none of its names, and accessing any of them raises :class:`AttributeError`. Progress is
tracked in the project's issues.

What it will be: kernels record begin, end and instant events per warp into a trace buffer in
device memory; the host converts that buffer into a Chrome trace file that the Perfetto UI shows
as one timeline row per warp.

Planned public names: ``export_to_perfetto``.
"""

from __future__ import annotations

from mori.core.placeholder import placeholder_getattr

__all__: list[str] = []
__status__ = "placeholder"

__getattr__ = placeholder_getattr(__name__, "mori-viz", "VIZ")

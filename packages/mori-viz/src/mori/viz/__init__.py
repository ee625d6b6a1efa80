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

from typing import NoReturn

__all__: list[str] = []
__status__ = "placeholder"

_DISTRIBUTION = "mori-viz"
_COMPONENT = "VIZ"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(_DISTRIBUTION)
    except PackageNotFoundError:  # a source tree that is not installed
        return "0+unknown"


def __getattr__(name: str) -> NoReturn:
    if name.startswith("_"):  # dunder probes (copy, inspect, pytest) get the ordinary error
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}", name=name)
    raise AttributeError(
        f"{__name__}.{name} is not available: {_DISTRIBUTION} {_version()} is a placeholder; "
        f"the {_COMPONENT} component is not implemented yet (see the project's issues)",
        name=name,
    )

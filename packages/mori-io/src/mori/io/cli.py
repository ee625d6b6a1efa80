"""mori-io's extension of the ``mori`` command: its variables in ``mori env``; ``mori bench io``
when :mod:`mori.io.bench` is present."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

from mori.core.bench import BenchSuite
from mori.core.env import EnvVar
from mori.core.plugins import hookimpl


@hookimpl
def mori_env_vars() -> Sequence[EnvVar[object]]:
    from mori.io import env

    return env.ALL


@hookimpl
def mori_bench_suites() -> Sequence[BenchSuite]:
    if importlib.util.find_spec("mori.io.bench") is None:
        return []
    from mori.io import bench  # type: ignore[attr-defined,unused-ignore]

    doc = bench.__doc__.splitlines()[0] if bench.__doc__ else ""
    return [BenchSuite("io", doc, bench.add_arguments, bench.run)]

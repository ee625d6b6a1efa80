"""mori-cco's extension of the ``mori`` command: its variables in ``mori env`` and the
``mori bench cco`` suite (:mod:`mori.ccl.bench`)."""

from __future__ import annotations

from collections.abc import Sequence

from mori.core.bench import BenchSuite
from mori.core.env import EnvVar
from mori.core.plugins import hookimpl


@hookimpl
def mori_env_vars() -> Sequence[EnvVar[object]]:
    from mori.cco import env

    return env.ALL


@hookimpl
def mori_bench_suites() -> Sequence[BenchSuite]:
    from mori.ccl import bench

    doc = bench.__doc__.splitlines()[0] if bench.__doc__ else ""
    return [BenchSuite("cco", doc, bench.add_arguments, bench.run)]

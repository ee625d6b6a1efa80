"""mori-ep's extension of the ``mori`` command: its variables in ``mori env`` and the
``mori bench ep`` suite (:mod:`mori.ep.bench`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mori.core.bench import BenchSuite
from mori.core.env import EnvVar
from mori.core.plugins import hookimpl

__all__ = ["mori_bench_suites", "mori_env_vars"]


@hookimpl
def mori_bench_suites() -> Sequence[BenchSuite]:
    from mori.ep import bench

    doc = bench.__doc__.splitlines()[0] if bench.__doc__ else ""
    return [BenchSuite("ep", doc, bench.add_arguments, bench.run)]


@hookimpl
def mori_env_vars() -> Sequence[EnvVar[Any]]:
    from mori.ep import deepep, internode, tuning

    return [
        tuning.MORI_EP_LAUNCH_CONFIG_MODE,
        tuning.MORI_EP_TUNING_CONFIG,
        tuning.MORI_EP_PUSH_CHUNK,
        deepep.MORI_EP_DEEPEP_RECV_VIEWS,
        internode.MORI_NUM_QP_PER_PE,
    ]

"""mori-core's own extension of the ``mori`` command: ``mori bench shmem`` and ``mori demo``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from mori.core.bench import BenchSuite
from mori.core.plugins import hookimpl


@hookimpl
def mori_bench_suites() -> Sequence[BenchSuite]:
    from mori.shmem import bench

    return [
        BenchSuite(
            "shmem", bench.__doc__.splitlines()[0] if bench.__doc__ else "", bench.add_arguments, bench.run
        )
    ]


@hookimpl
def mori_add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from mori.shmem import demo

    p = subparsers.add_parser("demo", help=demo.__doc__.splitlines()[0] if demo.__doc__ else "")
    demo.add_arguments(p)
    p.set_defaults(func=demo.run)

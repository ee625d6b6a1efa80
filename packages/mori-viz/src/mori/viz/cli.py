"""mori-viz's extension of the ``mori`` command: ``mori viz export | summary | plot`` over saved
rank traces (``*.mviz.npz`` files, or directories of them), and ``mori bench viz`` (the cost of
tracing)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from mori.core.bench import BenchSuite
from mori.core.plugins import hookimpl

__all__ = ["add_commands", "mori_add_commands", "mori_bench_suites"]


def _inputs(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "inputs", nargs="+", metavar="TRACE", help="saved rank traces: *.mviz.npz files or directories"
    )
    p.add_argument(
        "--gpu-freq-ghz",
        type=float,
        default=None,
        help="the device trace clock's rate in GHz (default: fitted from the clock pairs, else nominal)",
    )
    p.add_argument(
        "--no-validate",
        action="store_true",
        help="do not check that every end closes the innermost open span",
    )
    p.add_argument(
        "--keep-orphans", action="store_true", help="keep unpaired begins/ends instead of dropping them"
    )


def _timeline(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from mori.viz.timeline import build_timeline
    from mori.viz.trace import load_traces

    traces = load_traces(args.inputs)
    return traces, build_timeline(
        traces,
        gpu_freq_ghz=args.gpu_freq_ghz,
        validate_pairs=not args.no_validate,
        sanitize_orphans=not args.keep_orphans,
    )


def _cmd_export(args: argparse.Namespace) -> int:
    from mori.viz.export import export_to_perfetto
    from mori.viz.trace import load_traces

    report = export_to_perfetto(
        load_traces(args.inputs),
        args.output,
        gpu_freq_ghz=args.gpu_freq_ghz,
        validate_pairs=not args.no_validate,
        sanitize_orphans=not args.keep_orphans,
        format=args.format,
    )
    print(report.summary())
    print("open it at https://ui.perfetto.dev (Open trace file)")
    return 0


def _cmd_summary(args: argparse.Namespace) -> int:
    from mori.viz.analysis import format_summary, summarize

    _, tl_ = _timeline(args)
    rows = summarize(tl_)
    print(format_summary(tl_, rows))
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps(
                {"clock": tl_.clock, "alignment": tl_.alignment, "phases": [r.to_json() for r in rows]},
                indent=2,
            )
            + "\n"
        )
        print(f"wrote {out}")
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from mori.viz.plot import plot_gantt

    _, tl_ = _timeline(args)
    out = plot_gantt(tl_, args.output, launch=args.launch, max_tracks=args.max_tracks)
    print(f"wrote {out}")
    return 0


#: modules whose slot declarations ``mori viz slots`` lists by default (those that are installed)
SLOT_MODULES = ("mori.viz.examples", "mori.ep.kernels")


def _cmd_slots(args: argparse.Namespace) -> int:
    import importlib

    from mori.core.errors import MoriValueError
    from mori.viz.slots import slot_table

    modules = args.modules or [m for m in SLOT_MODULES if _installed(m)]
    for m in modules:
        try:
            importlib.import_module(m)
        except ImportError as e:
            raise MoriValueError(f"mori viz slots: cannot import {m}: {e}") from e
    table = sorted(slot_table().items(), key=lambda kv: (kv[1].group, kv[0]))
    print(f"{'id':>5}  slot")
    for sid, info in table:
        print(f"{sid:>5}  {info}")
    print(f"{len(table)} slots declared by {', '.join(modules) or 'no module'}")
    return 0


def _installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a namespace component that is not installed
        return False


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``viz`` and its sub-commands to ``mori``."""
    viz = subparsers.add_parser(
        "viz", help="read kernel traces: export to Perfetto, per-phase statistics, Gantt chart"
    )
    sub = viz.add_subparsers(dest="viz_command", metavar="COMMAND")

    p = sub.add_parser("export", help="write one Perfetto trace (Chrome JSON or protobuf) of every rank")
    _inputs(p)
    p.add_argument(
        "-o", "--output", default="trace.json", help="output file: .json, or .pftrace for protobuf"
    )
    p.add_argument("--format", choices=("json", "proto"), default=None, help="default: from the file name")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("summary", help="per-phase span statistics per rank")
    _inputs(p)
    p.add_argument("--json", default=None, metavar="FILE", help="also write the table as JSON")
    p.set_defaults(func=_cmd_summary)

    p = sub.add_parser("plot", help="a Gantt chart PNG (needs matplotlib)")
    _inputs(p)
    p.add_argument("-o", "--output", default="trace.png", help="PNG file")
    p.add_argument("--launch", type=int, default=None, help="only this launch (graph replay) number")
    p.add_argument("--max-tracks", type=int, default=64, help="most rows (default 64)")
    p.set_defaults(func=_cmd_plot)

    p = sub.add_parser("slots", help="list the declared slots (id and group/name) of kernel modules")
    p.add_argument(
        "modules",
        nargs="*",
        metavar="MODULE",
        help=f"modules to import (default: those of {', '.join(SLOT_MODULES)} that are installed)",
    )
    p.set_defaults(func=_cmd_slots)

    def usage(_args: argparse.Namespace) -> int:
        viz.print_help()
        return 2

    viz.set_defaults(func=usage)


@hookimpl
def mori_bench_suites() -> Sequence[BenchSuite]:
    from mori.viz import bench

    doc = bench.__doc__.splitlines()[0] if bench.__doc__ else ""
    return [BenchSuite("viz", doc, bench.add_arguments, bench.run)]


@hookimpl
def mori_add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    add_commands(subparsers)


def main(argv: Sequence[str] | None = None) -> int:
    """``mori viz ...`` without the rest of ``mori`` (for tests and ``python -m``)."""
    parser = argparse.ArgumentParser(prog="mori")
    add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["viz", *(argv or [])])
    return int(args.func(args))

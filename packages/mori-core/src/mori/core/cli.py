"""The ``mori`` command. Core adds ``backends``, ``env`` and ``bench``; plugins and feature
packages add sub-commands through the ``mori_add_commands`` hook and benchmarks through
``mori_bench_suites``."""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Sequence

from mori.core import __version__, env
from mori.core.bench import BenchSuite
from mori.core.errors import MoriError
from mori.core.plugins import BACKEND_GROUP, Found, Plugins, get_plugins


def _header() -> str:
    try:
        import importlib.metadata as md

        torch_v = md.version("torch")
    except Exception:
        torch_v = "not installed"
    return f"mori-core {__version__}, python {platform.python_version()}, torch {torch_v}"


def _cmd_backends(args: argparse.Namespace) -> int:
    plugins = get_plugins()
    print(_header())
    sections: list[tuple[str, list[Found]]] = [
        ("device runtimes", plugins.runtimes()),
        ("transports", plugins.transports()),
        ("nic providers", plugins.nic_providers()),
    ]
    for title, found in sections:
        print(f"{title}:")
        if not found:
            print("  (none installed)")
        for f in found:
            state = "available" if f.availability.usable else "unavailable"
            origin = f"{f.plugin.distribution} {f.plugin.version}"
            print(f"  {f.backend.name:<12} {origin:<24} {state:<12} {f.availability.reason}")
    broken = [r for r in plugins.records if r.error]
    if broken:
        print("plugins that failed to load:")
        for r in broken:
            print(f"  {r.name:<12} {r.distribution} {r.version} ({r.group} = {r.value}): {r.error}")
    if args.verbose:
        print("plugins:")
        for r in plugins.records:
            print(f"  {r.name:<12} {r.group:<16} {r.value:<28} {r.distribution} {r.version}")
    return 0


def _cmd_env(args: argparse.Namespace) -> int:
    plugins = get_plugins()
    variables = list(env.ALL)
    for extra in plugins.call("mori_env_vars"):
        variables.extend(extra)
    bad = 0
    for var in variables:
        raw = var.raw()
        try:
            var.get()
            status = ""
        except MoriError as e:
            status = f"  INVALID: {e}"
            bad += 1
        shown = f"{raw!r}" if raw is not None else f"(unset, default {var.default!r})"
        print(f"{var.name}={shown}{status}")
        if args.verbose:
            print(f"    {var.doc} Example: {var.example}.")
    return 1 if bad else 0


def _suites(plugins: Plugins) -> dict[str, BenchSuite]:
    suites: dict[str, BenchSuite] = {}
    for group in plugins.call("mori_bench_suites"):
        for suite in group:
            suites[suite.name] = suite
    return suites


def _installed(dist: str) -> bool:
    try:
        import importlib.metadata as md

        md.distribution(dist)
    except Exception:
        return False
    return True


def _add_missing_suites(
    bench_sub: argparse._SubParsersAction[argparse.ArgumentParser], found: dict[str, BenchSuite]
) -> None:
    """``mori bench ep`` without mori-ep: say which distribution to install, not "invalid choice".

    A component's suite has the component's name (``mori-ep`` -> ``ep``)."""
    import mori

    for component, dist in sorted(mori.COMPONENTS.items()):
        if component in found or dist == "mori-core" or dist != f"mori-{component}":
            continue
        why = (
            f"{dist} is installed but registered no '{component}' suite: `mori backends` lists plugins that failed to load"
            if _installed(dist)
            else f"provided by {dist}, which is not installed: pip install {dist}"
        )
        # no option prefix: whatever follows (``--tokens 8``) is taken, not refused as unknown
        sp = bench_sub.add_parser(component, help=f"({why})", add_help=False, prefix_chars="\0")
        sp.add_argument("rest", nargs="*", help=argparse.SUPPRESS)

        def missing(_args: argparse.Namespace, why: str = why, component: str = component) -> int:
            print(f"mori bench {component}: {why}", file=sys.stderr)
            return 2

        sp.set_defaults(func=missing)


def build_parser(plugins: Plugins | None = None) -> argparse.ArgumentParser:
    plugins = plugins or get_plugins()
    parser = argparse.ArgumentParser(prog="mori", description="MORI: GPU and CPU communication framework.")
    parser.add_argument("--version", action="version", version=_header())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "backends", help=f"list plugins found in the '{BACKEND_GROUP}' group and whether they work here"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="also list every plugin entry point")
    p.set_defaults(func=_cmd_backends)

    p = sub.add_parser(
        "env", help="list MORI_* variables, their values and defaults; exit 1 if one is invalid"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="also print what each variable does")
    p.set_defaults(func=_cmd_env)

    bench = sub.add_parser("bench", help="run a benchmark suite")
    bench_sub = bench.add_subparsers(dest="suite", metavar="SUITE")
    for suite in sorted(_suites(plugins).values(), key=lambda s: s.name):
        sp = bench_sub.add_parser(suite.name, help=suite.help)
        suite.add_arguments(sp)
        sp.set_defaults(func=suite.run)

    def list_suites(_args: argparse.Namespace) -> int:
        bench.print_help()
        return 2

    bench.set_defaults(func=list_suites)
    _add_missing_suites(bench_sub, _suites(plugins))

    plugins.call("mori_add_commands", subparsers=sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args))
    except MoriError as e:
        print(f"mori: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

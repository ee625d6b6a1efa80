"""``mori jit``: ``precompile`` (compile every kernel variant into Triton's cache) and ``cache``."""

from __future__ import annotations

import argparse
import sys

from mori.core.plugins import hookimpl


def _precompile(args: argparse.Namespace) -> int:
    from mori.jit import precompile

    targets = [t.strip() for t in args.targets.split(",") if t.strip()] if args.targets else None
    report = precompile(targets, progress=sys.stderr)
    for r in report.results:
        if r.status == "failed":
            print(f"  {r.target} {r.kernel} [{r.variant}]: {r.detail}", file=sys.stderr)
    return 0 if report.ok else 1


def _cache(args: argparse.Namespace) -> int:
    from mori.jit import cache_dir

    path = cache_dir()
    entries = [p for p in path.iterdir() if p.is_dir()] if path.is_dir() else []
    size = sum(f.stat().st_size for e in entries for f in e.iterdir() if f.is_file())
    print(
        f"{path}: {len(entries)} compiled kernels, {size / 2**20:.1f} MiB (Triton's cache, shared by all kernels)"
    )
    return 0


@hookimpl
def mori_add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    jit = subparsers.add_parser("jit", help="compile MORI's kernels ahead of their first launch")
    sub = jit.add_subparsers(dest="jit_command", metavar="COMMAND")
    p = sub.add_parser(
        "precompile", help="compile every kernel variant for this GPU (or --targets) into the cache"
    )
    p.add_argument(
        "--targets", help="comma-separated targets such as cuda:90,hip:gfx942 (default: this machine's GPU)"
    )
    p.set_defaults(func=_precompile)
    p = sub.add_parser("cache", help="where the compiled kernels are, and how many")
    p.set_defaults(func=_cache)

    def usage(_args: argparse.Namespace) -> int:
        jit.print_help()
        return 2

    jit.set_defaults(func=usage)

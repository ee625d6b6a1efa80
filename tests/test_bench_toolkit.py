"""Every ``mori bench`` suite is written with one toolkit, ``mori.core.bench`` (issue 22 item 3).

What the toolkit does once must not come back as a suite's own copy: a copy is how ``--plot none``
drew ``none.png`` in one suite while the others meant "no plot". These checks read the suites'
sources (every ``bench*.py`` of every distribution) and their ``mori`` plugin entry points.
"""

from __future__ import annotations

import ast
import importlib.metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLKIT = ROOT / "packages" / "mori-core" / "src" / "mori" / "core" / "bench.py"


def _suites() -> list[Path]:
    found = sorted(ROOT.glob("packages/*/src/mori/**/bench*.py"))
    return [p for p in found if p != TOOLKIT]


#: calls only the toolkit makes: saving a figure, choosing matplotlib's backend, binding a port,
#: asking whether a stream is a terminal
TOOLKIT_ONLY = {"savefig", "use", "bind", "isatty"}


def _calls(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            names.add(node.func.attr)
    return names


def test_the_suites_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in _suites()}
    assert "packages/mori-ep/src/mori/ep/bench.py" in names and len(names) >= 6, names


@pytest.mark.parametrize("path", _suites(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_suite_leaves_plots_ports_and_terminals_to_the_toolkit(path: Path) -> None:
    own = _calls(path) & TOOLKIT_ONLY
    assert not own, (
        f"{path.name} calls {sorted(own)} itself: use mori.core.bench (draw_plot, free_port, Progress)"
    )
    # the value of --plot is read in one place, mori.core.bench.plot_path
    reads = [
        ast.unparse(n)
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, (ast.Compare, ast.BoolOp, ast.IfExp))
        and any(isinstance(a, ast.Attribute) and a.attr == "plot" for a in ast.walk(n))
    ]
    assert not reads, f"{path.name} reads --plot itself ({reads}): use mori.core.bench.plot_path"


@pytest.mark.parametrize("path", [p for p in _suites() if p.name == "bench.py"], ids=lambda p: p.parent.name)
def test_every_suite_shows_progress_through_the_toolkit(path: Path) -> None:
    assert "bench.Progress(" in path.read_text(), f"{path} shows no progress line (mori.core.bench.Progress)"


def test_plugin_hooks_live_in_cli_modules_not_in_bench_modules() -> None:
    for path in _suites():
        hooks = [
            n.name
            for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.FunctionDef)
            and any(ast.unparse(d).endswith("hookimpl") for d in n.decorator_list)
        ]
        assert not hooks, (
            f"{path.relative_to(ROOT)} implements plugin hooks {hooks}: move them to its cli module"
        )
    for ep in importlib.metadata.entry_points(group="mori.extensions"):
        assert "bench" not in ep.value.split("."), f"entry point {ep.name} = {ep.value} names a bench module"

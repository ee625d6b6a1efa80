"""docs/benchmarks keeps one current record per benchmark and machine, each linked from a page.

The naming rule is written at the top of docs/benchmarks/index.md: a record is
``SUITE-MACHINE.EXT`` with MACHINE one of the machines that page lists and EXT json, txt or png.
A name can exist only once in a directory, so a file that follows the rule is the only one of its
benchmark, machine and extension: the naming test is what enforces "at most one record". The
other checks read each JSON record, so that a file cannot carry a name its content contradicts,
and follow the links, so that every record is reachable and no page points at a removed one.
Earlier runs live in git, not in the tree.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "benchmarks"
INDEX = RECORDS / "index.md"
EXTENSIONS = ("json", "txt", "png")
# Markdown inline links: [text](target); the target up to the first space or ')'.
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _machines() -> set[str]:
    """The machine names of index.md's table: the first column of rows under `| machine |`."""
    names: set[str] = set()
    in_table = False
    for line in INDEX.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| machine |"):
            in_table = True
        elif in_table and line.startswith("|"):
            if not set(cells[0]) <= set("-: "):
                names.add(cells[0].strip("`"))
        else:
            in_table = False
    return names


def _records() -> list[Path]:
    return sorted(p for p in RECORDS.iterdir() if p.is_file() and p.suffix != ".md")


def _split(name: str, machines: set[str]) -> tuple[str, str, str] | None:
    """(suite, machine, ext) of a name that follows the rule, else None."""
    m = re.fullmatch(r"([a-z][a-z0-9_]*)-(.+)\.([a-z]+)", name)
    if m is None or m.group(2) not in machines or m.group(3) not in EXTENSIONS:
        return None
    return m.group(1), m.group(2), m.group(3)


def test_index_lists_the_machines() -> None:
    # The rule refers to this table: without it every name would be rejected for the wrong reason.
    assert {"cpu", "cuda-h200x2"} <= _machines()


def test_every_record_follows_the_naming_rule() -> None:
    machines = _machines()
    records = _records()
    assert records, "docs/benchmarks holds no record at all"
    bad = [p.name for p in records if _split(p.name, machines) is None]
    assert not bad, (
        f"docs/benchmarks holds files outside the rule SUITE-MACHINE.{{{','.join(EXTENSIONS)}}} "
        f"(machines: {sorted(machines)}): {bad}. Keep one current record per benchmark and machine; "
        "earlier runs and ablations belong in git history (see docs/benchmarks/index.md)"
    )


def test_every_table_and_plot_has_its_json_record() -> None:
    # The JSON is the record; a table or a plot without it cannot be checked against anything.
    machines = _machines()
    names = {p.name for p in _records()}
    orphans = []
    for name in sorted(names):
        key = _split(name, machines)
        if key is not None and key[2] != "json" and f"{key[0]}-{key[1]}.json" not in names:
            orphans.append(name)
    assert not orphans, f"tables or plots without their SUITE-MACHINE.json: {orphans}"


def test_no_page_is_named_like_a_record() -> None:
    # A table kept as SUITE-MACHINE.md would be a second table of the record, outside the rule.
    machines = _machines()
    stems = [p.name for p in RECORDS.glob("*.md") if _split(p.stem + ".txt", machines) is not None]
    assert not stems, f"pages named like records (keep the table as SUITE-MACHINE.txt): {stems}"


def _json_records(path: Path) -> list[dict[str, Any]]:
    data = json.loads(path.read_text())
    records = data if isinstance(data, list) else [data]
    assert records and all(isinstance(r, dict) for r in records), (
        f"{path.name}: not a record or a list of them"
    )
    return records


@pytest.mark.parametrize("path", [p for p in _records() if p.suffix == ".json"], ids=lambda p: p.name)
def test_json_record_matches_its_name(path: Path) -> None:
    key = _split(path.name, _machines())
    assert key is not None, f"{path.name} breaks the naming rule"
    suite, machine, _ = key
    for record in _json_records(path):
        for field in ("suite", "git_sha", "time_utc", "machine", "config", "rows"):
            assert field in record, f"{path.name}: a record without {field!r}"
        assert record["suite"] == suite, f"{path.name} holds a record of suite {record['suite']!r}"
        # A suite without a --device option (umbp) runs on the host: its records are CPU records.
        device = record["config"].get("device", "cpu")
        assert (device == "cpu") == (machine == "cpu"), (
            f"{path.name} is named for machine {machine!r} but was run with --device {device!r}"
        )
        assert record["rows"], f"{path.name}: a record without rows"


def _pages() -> list[Path]:
    return sorted(RECORDS.glob("*.md"))


def test_every_record_is_linked_from_a_page() -> None:
    linked = {t.split("#")[0] for page in _pages() for t in LINK.findall(page.read_text())}
    unlinked = [p.name for p in _records() if p.name not in linked]
    assert not unlinked, f"records no page in docs/benchmarks links to: {unlinked}"


def _link_sources() -> list[Path]:
    """Every Markdown file that may link into docs/benchmarks: README, docs, package READMEs."""
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    files += [*ROOT.glob("packages/*/README.md"), *ROOT.glob("backends/*/README.md")]
    return sorted(f for f in files if f.is_file() and "_build" not in f.parts)


def test_links_into_docs_benchmarks_resolve() -> None:
    broken = []
    for source in _link_sources():
        for target in LINK.findall(source.read_text()):
            path = target.split("#")[0]
            if "://" in path or not path:
                continue
            resolved = (source.parent / path).resolve()
            if RECORDS in (resolved, *resolved.parents) and not resolved.exists():
                broken.append(f"{source.relative_to(ROOT)} -> {target}")
    assert not broken, f"links to files that are not in docs/benchmarks: {broken}"


def _bench_sources() -> list[Path]:
    """Benchmark code of every distribution (its sources and bench scripts; not its tests)."""
    found = (*ROOT.glob("packages/*/**/*bench*.py"), *ROOT.glob("backends/*/**/*bench*.py"))
    skip = {"tests", "build", "_build", ".nox"}
    return sorted(p for p in found if not skip & set(p.relative_to(ROOT).parts))


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def test_no_bench_writes_into_docs_benchmarks_by_default() -> None:
    # A bench's default output goes to bench-results/ (ignored by git); a path into docs/benchmarks
    # in its code would make every run a candidate record. Docstrings may name the pages.
    sources = _bench_sources()
    assert sources, "no bench module found under packages/ or backends/"
    offenders = []
    for source in sources:
        tree = ast.parse(source.read_text())
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docs
                and "docs/benchmarks" in node.value
            ):
                offenders.append(f"{source.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not offenders, f"bench code that names docs/benchmarks as a path: {offenders}"

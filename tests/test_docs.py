"""The documentation tells the truth about what is installed.

Every page under ``docs/`` and the README are read as text and compared with the packages of this
environment: a component whose module imports and is not a placeholder (``__status__ ==
"placeholder"``, :mod:`mori.core.placeholder`) must not be called "not implemented" or a
placeholder, must be in the components tables, and a page that says it is not written yet must
name the issue that tracks it. ``docs/benchmarks/`` (the benchmark records, kept by the benchmark
runs and their own test, ``tests/test_benchmark_records.py``) is left out.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"

#: module that proves a component exists -> the words a page uses for it
COMPONENT_WORDS: dict[str, list[str]] = {
    "mori.shmem": ["SHMEM", "mori.shmem"],
    "mori.ep": ["EP", "mori.ep", "mori-ep", "mori.ops"],
    "mori.io": ["IO", "mori.io", "mori-io"],
    "mori.cco": ["CCO", "CCL", "mori.cco", "mori.ccl", "mori-cco"],
    "mori.umbp": ["UMBP", "mori.umbp", "mori-umbp"],
    "mori.viz": ["VIZ", "mori.viz", "mori-viz"],
    "mori.jit": ["JIT framework", "mori.jit"],
    "mori_backend_nvlink": ["GPU runtimes", "GPU backends", "nvlink"],
    "mori_backend_xgmi": ["GPU runtimes", "GPU backends", "xgmi"],
    "mori_backend_ucx": ["ucx", "UCX transport"],
}

#: phrases that say a whole component is missing
MISSING = re.compile(
    r"not implemented|is a placeholder|are placeholders|placeholders? for now|not written yet|"
    r"none of which exists?",
    re.IGNORECASE,
)
#: a page that is a placeholder
PLACEHOLDER_PAGE = re.compile(r"^(Not written yet|Not measured yet)\b", re.IGNORECASE | re.MULTILINE)
ISSUE = re.compile(r"\bissues? \d+")


def _available(module: str) -> bool:
    """The module imports and is not a placeholder."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return False
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return False
    return getattr(mod, "__status__", "") != "placeholder"


def _pages() -> list[Path]:
    pages = [README]
    for p in sorted(DOCS.rglob("*.md")):
        if p.relative_to(DOCS).parts[0] in ("_build", "benchmarks"):
            continue
        pages.append(p)
    return pages


def _names(word: str, text: str) -> bool:
    return re.search(rf"(?<![\w.-]){re.escape(word)}(?![\w-])", text) is not None


def false_claims(text: str, available: set[str]) -> list[str]:
    """The lines of ``text`` (a paragraph or table row each) that call an available component missing."""
    found = []
    # a claim is judged within its paragraph (lines joined) or its table row
    for block in re.split(r"\n\s*\n|\n(?=\|)", text):
        flat = " ".join(block.split())
        for m in MISSING.finditer(flat):
            sentence = flat[max(0, flat.rfind(". ", 0, m.start()) + 1) : m.end()]
            named = [
                module
                for module in sorted(available)
                if any(_names(w, sentence) for w in COMPONENT_WORDS[module])
            ]
            if named:
                found.append(f"{sentence.strip()!r} (installed: {', '.join(named)})")
    return found


@pytest.fixture(scope="module")
def available() -> set[str]:
    return {m for m in COMPONENT_WORDS if _available(m)}


def test_the_checker_flags_a_false_claim(available: set[str]) -> None:
    # the check below can fail: a page saying an installed component is missing is caught
    if "mori.ep" not in available:
        pytest.skip("mori-ep is not installed here")
    assert false_claims("Not written yet: the EP component is not implemented.", available)
    assert false_claims("| EP | `mori.ep` | mori-ep | not implemented |", available)
    assert not false_claims("Not yet: the multi-node kernel types of EP (issue 19).", available)
    assert not false_claims("The FABRIC backend is not implemented.", available)


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_page_calls_an_installed_component_missing(page: Path, available: set[str]) -> None:
    claims = false_claims(page.read_text(encoding="utf-8"), available)
    assert not claims, f"{page.relative_to(ROOT)} says of installed components: " + "; ".join(claims)


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_placeholder_pages_name_their_issue(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    if PLACEHOLDER_PAGE.search(text):
        assert ISSUE.search(text), f"{page.relative_to(ROOT)} is a placeholder but names no issue"


def _components_table(text: str) -> dict[str, str]:
    """``module -> state`` from a Markdown table with a module (or import) and a status column."""
    rows: dict[str, str] = {}
    header: list[str] = []
    for line in text.splitlines():
        if not line.startswith("|"):
            header = []
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not header:
            header = [c.lower() for c in cells]
            continue
        if set(cells[0]) <= {"-", ":"}:
            continue
        col = next((i for i, h in enumerate(header) if h in ("module", "import")), None)
        state = next((i for i, h in enumerate(header) if h in ("state", "status")), None)
        if col is None or state is None or len(cells) <= max(col, state):
            continue
        for module in re.findall(r"`(mori\.\w+)`", cells[col]):
            rows[module] = cells[state]
    return rows


@pytest.mark.parametrize("page", [README, DOCS / "index.md"], ids=["README.md", "docs/index.md"])
def test_components_tables_list_every_installed_component_as_there(page: Path, available: set[str]) -> None:
    table = _components_table(page.read_text(encoding="utf-8"))
    assert table, f"{page.relative_to(ROOT)} has no components table (columns module/import and state/status)"
    for module in sorted(m for m in available if m.startswith("mori.") and m != "mori.jit"):
        assert module in table, (
            f"{page.relative_to(ROOT)}: installed {module} is missing from the components table"
        )
        state = table[module]
        assert not re.match(r"(not implemented|placeholder|not yet|missing|planned)", state, re.IGNORECASE), (
            f"{page.relative_to(ROOT)}: installed {module} is described as {state!r}"
        )


#: every public module has a reference page generated from its docstrings
PUBLIC_MODULES = [
    "mori.core",
    "mori.shmem",
    "mori.ep",
    "mori.ops",
    "mori.ep.deepep",
    "mori.io",
    "mori.cco",
    "mori.ccl",
    "mori.umbp",
    "mori.viz",
]


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_public_module_has_an_api_reference(module: str) -> None:
    text = "\n".join(p.read_text(encoding="utf-8") for p in _pages())
    directive = re.compile(
        rf"^\.\. (automodule|py:module|autoclass|autofunction):: {re.escape(module)}(\.[A-Z]\w*)?\s*$",
        re.MULTILINE,
    )
    assert directive.search(text), f"no docs page documents {module} (automodule, py:module or autoclass)"

"""No distribution reaches into another one's private names: every package uses only public APIs
across package boundaries.

Every ``.py`` file of every distribution of this repository (``packages/*``, ``backends/*``,
``tests/*``: a directory with a ``pyproject.toml``; sources and tests alike) is parsed with ``ast``.
In a file of distribution D, these are reach-ins when the name belongs to another distribution E:

* an import of a private module or name: ``from mori.X import _name``, ``from mori.X._mod import
  name``, ``import mori.X._mod``;
* an attribute of a module bound by an import: ``mori.X._name``, ``alias._name``;
* an attribute ``obj._name`` (``obj`` anything, ``self`` too) whose name D never defines but E does
  (a ``def``, a class, an assignment, ``self._name = ...``): ``runtime._state``, ``rt._bind()``.

Private means one leading underscore (dunders are public protocol). There is no exception, not
even mori-core's native module ``mori.core._core``: it is private by design (the Python layer,
``mori.core.transfer`` and the rest, re-exports and documents it), and no other distribution
imports it. Names of third-party packages are not judged here; where MORI cannot avoid one
(torch's raw current-stream getter, Triton's kernel loading) it is wrapped in one documented place
in mori-core (``mori.core.gpu.runtime.torch_stream_getter``, ``mori.core.kernels.launch_config``),
which :func:`test_third_party_privates_are_used_in_one_place` checks.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {"build", "dist", "__pycache__", ".nox", "_build", "node_modules"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@dataclass
class Distribution:
    name: str
    root: Path
    #: dotted module (or package) names of its ``src``
    modules: set[str] = field(default_factory=set)
    #: every name its files define (functions, classes, assignments, attributes assigned)
    defined: set[str] = field(default_factory=set)

    def files(self) -> list[Path]:
        return [
            p for p in sorted(self.root.rglob("*.py")) if not SKIP_DIRS & set(p.relative_to(self.root).parts)
        ]


def _distributions() -> list[Distribution]:
    found = []
    for group in ("packages", "backends", "tests"):
        for d in sorted((ROOT / group).iterdir()):
            if (d / "pyproject.toml").is_file():
                found.append(Distribution(d.name, d))
    for dist in found:
        src = dist.root / "src"
        for p in src.rglob("*.py") if src.is_dir() else ():
            rel = p.relative_to(src).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            if parts == ("mori",) and dist.name != "mori-core":
                continue  # mori/__init__.py is mori-core's (the others leave it out of their wheels)
            dist.modules.add(".".join(parts))
        for p in dist.files():
            dist.defined |= _definitions(ast.parse(p.read_text(), str(p)))
    return found


def _definitions(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        names.add(n.id)
                    elif isinstance(n, ast.Attribute):
                        names.add(n.attr)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    return names


DISTRIBUTIONS = _distributions()


def _owner(module: str) -> Distribution | None:
    """The distribution of ``module`` (its longest known prefix), None if it is not MORI's."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        for dist in DISTRIBUTIONS:
            if prefix in dist.modules:
                return dist
    return None


def reach_ins(dist: Distribution, tree: ast.AST) -> list[str]:
    """The reach-ins of ``tree`` (a file of ``dist``) into other distributions (see the module docstring)."""
    found: list[str] = []
    aliases: dict[str, str] = {}  # local name -> the MORI module it is bound to

    def other(module: str) -> Distribution | None:
        owner = _owner(module)
        return owner if owner is not None and owner is not dist else None

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if other(a.name) and any(_private(p) for p in a.name.split(".")):
                    found.append(f"line {node.lineno}: import {a.name}")
                if a.asname:
                    aliases[a.asname] = a.name
                else:
                    aliases[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if other(full) and any(_private(p) for p in full.split(".")):
                    found.append(f"line {node.lineno}: from {node.module} import {a.name}")
                if _owner(full) is not None and full in _owner(full).modules:  # type: ignore[union-attr]
                    aliases[a.asname or a.name] = full
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _private(node.attr):
            continue
        chain: list[str] = []
        base: ast.expr = node.value
        while isinstance(base, ast.Attribute):
            chain.insert(0, base.attr)
            base = base.value
        if isinstance(base, ast.Name) and base.id in aliases:
            module = ".".join([aliases[base.id], *chain])
            if other(module):
                found.append(f"line {node.lineno}: {module}.{node.attr}")
            continue
        if node.attr not in dist.defined:
            owners = [d.name for d in DISTRIBUTIONS if d is not dist and node.attr in d.defined]
            if owners:
                found.append(f"line {node.lineno}: .{node.attr} (defined only in {', '.join(owners)})")
    return found


@pytest.mark.parametrize("dist", DISTRIBUTIONS, ids=lambda d: d.name)
def test_no_private_names_across_distributions(dist: Distribution) -> None:
    problems = []
    for path in dist.files():
        for problem in reach_ins(dist, ast.parse(path.read_text(), str(path))):
            problems.append(f"{path.relative_to(ROOT)} {problem}")
    assert not problems, "private names of other distributions:\n" + "\n".join(problems)


def test_the_checker_finds_each_kind_of_reach_in() -> None:
    io = next(d for d in DISTRIBUTIONS if d.name == "mori-io")
    code = (
        "from mori.core.gpu.runtime import _halves\n"
        "from mori.core._core import transfer_get_log_level\n"
        "import mori.core._core\n"
        "from mori.core.gpu import dlpack as _dl\n"
        "import mori.core.gpu.runtime\n"
        "_dl._alive\n"
        "mori.core.gpu.runtime._WORDS\n"
        "runtime._bind()\n"
        "from mori.io import _log\n"  # its own: fine
        "self._lock\n"  # defined in mori-io too: fine
    )
    found = reach_ins(io, ast.parse(code))
    assert [f.split(":")[0] for f in found] == [f"line {n}" for n in (1, 2, 3, 6, 7, 8)], found
    assert "(defined only in mori-core)" in found[-1]


#: third-party private names MORI needs -> the one mori-core module allowed to use them
THIRD_PARTY = {
    "_cuda_getCurrentRawStream": "packages/mori-core/src/mori/core/gpu/runtime.py",
    "_init_handles": "packages/mori-core/src/mori/core/kernels.py",
}


def test_third_party_privates_are_used_in_one_place() -> None:
    uses: dict[str, set[str]] = {name: set() for name in THIRD_PARTY}
    for dist in DISTRIBUTIONS:
        if dist.root.name != dist.name:
            continue
        for path in dist.files():
            if "tests" in path.relative_to(dist.root).parts:
                continue  # a test's fake may define the method it stands in for
            text = path.read_text()
            for name in THIRD_PARTY:
                if name in text:
                    uses[name].add(str(path.relative_to(ROOT)))
    assert uses == {name: {place} for name, place in THIRD_PARTY.items()}

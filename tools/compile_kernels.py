#!/usr/bin/env python3
"""Compile every Triton kernel of the repo ahead of time for every GPU target (``nox -s kernels``).

Needs the Triton wheel (and torch, which the kernel modules import), no GPU and no CUDA torch:
``triton.compile`` with an explicit target runs entirely on the CPU.

Discovery, built so that a kernel cannot be skipped silently:

1. every ``*.py`` under ``packages/``, ``backends/`` and ``tests/`` (build trees and caches
   excluded) that mentions ``jit`` is parsed, and every function decorated with ``triton.jit``,
   ``jit``, ``triton.autotune`` or ``triton.heuristics`` is listed, nested ones included;
2. the module is imported (by its dotted name under a ``src/`` directory, else from its path),
   and every module-level Triton function defined in it is added (``k = triton.jit(f)`` too);
3. each function must be either a device function (``@device_function`` from
   :mod:`mori.core.kernels`: compiled through the kernels that call it) or a kernel with at least
   one ``@aot(...)`` variant naming every argument; anything else, a decorated function that is
   not reachable at module level, or a module that fails to import is an error;
4. the kernels' call graph (calls by module-level name, followed through device functions) must
   reach every device function: one that no kernel calls would never be compiled, so it is an
   error too.

Every variant of every kernel is compiled for each target (a fresh Triton cache unless
``--cache``) by :func:`mori.jit.compile_variant`, the compile a launch with the variant's argument
types makes (what ``mori jit precompile`` runs too), on ``-j`` worker processes at once (default:
the CPUs this process may run on; each worker compiles for one target only, see
:func:`compile_all`; ``-j 1`` compiles one after another). A table kernel x target is printed, a
row as soon as it and the rows above it are compiled (so always in the same order), and the exit
status is 1 if anything failed.

    python tools/compile_kernels.py                        # all four targets
    python tools/compile_kernels.py --targets cuda:90,hip:gfx942 -j 4 --out build/kernels
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import os
import re
import signal
import sys
import tempfile
import textwrap
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

# Must be unset before triton is imported: under the interpreter triton.jit makes functions that
# cannot be compiled.
os.environ.pop("TRITON_INTERPRET", None)

ROOT = Path(__file__).resolve().parent.parent
SEARCH_DIRS = ("packages", "backends", "tests")
SKIP_DIRS = {
    ".git",
    ".nox",
    ".venv",
    "venv",
    "build",
    "dist",
    "__pycache__",
    "_build",
    "node_modules",
    ".tox",
}
JIT_DECORATORS = {"jit", "autotune", "heuristics"}

#: name -> (backend, arch, warp size) as GPUTarget takes them
TARGETS: dict[str, tuple[str, int | str, int]] = {
    "cuda:90": ("cuda", 90, 32),
    "cuda:100": ("cuda", 100, 32),
    "hip:gfx942": ("hip", "gfx942", 64),
    "hip:gfx950": ("hip", "gfx950", 64),
}


@dataclass
class Found:
    """A Triton function found by discovery, with what was decided about it."""

    module: str  # dotted name (or the synthetic one of a file imported by path)
    path: Path
    name: str
    line: int
    kind: str = "?"  # kernel / device / error
    error: str = ""
    variants: list[Any] = field(default_factory=list)  # AotSpec
    jit: Any = None  # the JITFunction
    callers: int = 0  # device functions: how many kernels reach it


@dataclass(frozen=True)
class Task:
    module: str
    path: str
    name: str
    variant: int
    target: str


#: what a compile gave: (ok, message, seconds)
Result = tuple[bool, str, float]


# -- discovery ----------------------------------------------------------------------------------------


def python_files(root: Path) -> Iterator[Path]:
    for top in SEARCH_DIRS:
        base = root / top
        if not base.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info"))
            for f in sorted(filenames):
                if f.endswith(".py"):
                    yield Path(dirpath) / f


def _decorator_name(node: ast.expr) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return ""


def jit_functions(source: str, path: Path) -> list[tuple[str, int, bool]]:
    """(name, line, at module level) of every function with a Triton decorator."""
    tree = ast.parse(source, filename=str(path))
    out: list[tuple[str, int, bool]] = []
    top = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
            _decorator_name(d) in JIT_DECORATORS for d in node.decorator_list
        ):
            out.append((node.name, node.lineno, id(node) in top))
    return out


def module_name(path: Path) -> str | None:
    """Dotted module name if the file lives under a ``src/`` directory, else None."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    if "src" not in parts:
        return None
    rest = list(parts[parts.index("src") + 1 :])
    if rest and rest[-1] == "__init__":
        rest.pop()
    return ".".join(rest) or None


def import_file(path: Path) -> Any:
    name = module_name(path)
    if name is not None:
        return importlib.import_module(name)
    # tests and scripts: import by path, under a name that cannot clash with a real module
    rel = path.relative_to(ROOT).with_suffix("")
    synthetic = "_mori_kernels_." + ".".join(p.replace("-", "_") for p in rel.parts)
    if synthetic in sys.modules:
        return sys.modules[synthetic]
    spec = importlib.util.spec_from_file_location(synthetic, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[synthetic] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[synthetic]
        raise
    return module


def _triton_function(obj: Any) -> Any:
    """The JITFunction inside ``obj`` (itself, or under autotune/heuristics), or None."""
    from triton.runtime.jit import JITFunction

    for _ in range(8):
        if isinstance(obj, JITFunction):
            return obj
        obj = getattr(obj, "fn", None)
        if obj is None:
            return None
    return None


def _python_function(jit: Any) -> Any:
    return getattr(jit, "fn", None)


def classify(found: Found, obj: Any, *, decorated: bool = True) -> None:
    from mori.core.kernels import aot_specs, is_device_function

    jit = _triton_function(obj)
    if jit is None:
        found.kind, found.error = (
            "error",
            "decorated with triton but the module attribute is not a Triton function",
        )
        return
    found.jit = jit
    fn = _python_function(jit)
    if decorated and fn is not None and fn.__name__ != found.name:
        found.kind, found.error = (
            "error",
            f"module attribute {found.name!r} is another function ({fn.__name__})",
        )
        return
    device, specs = is_device_function(obj), aot_specs(obj)
    if device and specs:
        found.kind, found.error = "error", "marked both @device_function and @aot: pick one"
    elif device:
        found.kind = "device"
    elif specs:
        found.kind, found.variants = "kernel", specs
        bad = [check_spec(jit, s) for s in specs]
        if any(bad):
            found.kind, found.error = "error", "; ".join(b for b in bad if b)
    else:
        found.kind = "error"
        found.error = (
            "no AOT variants: add @aot(signature=..., constexprs=...) above @triton.jit, or mark "
            "a function that is only called from kernels with @device_function (mori.core.kernels)"
        )


def check_spec(jit: Any, spec: Any) -> str:
    """Empty if the variant names every argument of the kernel exactly once, else the problem."""
    import inspect

    params = inspect.signature(jit.fn).parameters
    constexpr = {n for n, p in params.items() if "constexpr" in str(p.annotation)}
    runtime = [n for n in params if n not in constexpr]
    # a runtime argument a launch leaves None is a constexpr to Triton (the untraced variants'
    # trace_ptr): declared as such, it belongs in constexprs with the value None
    none = {n for n in runtime if n in spec.constexprs and spec.constexprs[n] is None}
    problems = []
    missing = [n for n in runtime if n not in spec.signature and n not in none]
    missing += [
        n for n in constexpr if n not in spec.constexprs and params[n].default is inspect.Parameter.empty
    ]
    extra = [n for n in [*spec.signature, *spec.constexprs] if n not in params]
    wrong = [n for n in spec.signature if n in constexpr]
    wrong += [n for n in spec.constexprs if n in runtime and n not in none]
    bad_align = [n for n in spec.aligned if n not in spec.signature]
    if missing:
        problems.append(f"variant {spec.describe()!r} lacks {missing}")
    if extra:
        problems.append(f"variant {spec.describe()!r} names unknown arguments {extra}")
    if wrong:
        problems.append(f"variant {spec.describe()!r}: {wrong} in the wrong group (signature vs constexprs)")
    if bad_align:
        problems.append(f"variant {spec.describe()!r}: aligned names {bad_align}, not in the signature")
    return "; ".join(problems)


def discover(root: Path) -> tuple[list[Found], list[str]]:
    """Every Triton function in the repo, classified; and errors that belong to no function."""
    found: list[Found] = []
    errors: list[str] = []
    for path in python_files(root):
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            errors.append(f"{path.relative_to(root)}: cannot read: {e}")
            continue
        if "jit" not in source:
            continue
        try:
            decorated = jit_functions(source, path)
        except SyntaxError as e:
            errors.append(f"{path.relative_to(root)}: syntax error: {e}")
            continue
        if not decorated and not re.search(
            r"\btriton\.jit\s*\(|\bfrom\s+triton\s+import\b[^\n]*\bjit\b", source
        ):
            continue  # mentions jit, but makes no Triton function: do not import it
        name = module_name(path) or str(path.relative_to(root))
        try:
            module = import_file(path)
        except BaseException as e:  # report and go on: one broken module must not hide the others
            if decorated:
                errors.append(f"{path.relative_to(root)}: import failed: {type(e).__name__}: {e}")
            continue
        seen: set[str] = set()
        for fname, line, top_level in decorated:
            f = Found(name, path, fname, line)
            found.append(f)
            seen.add(fname)
            if not top_level or not hasattr(module, fname):
                f.kind = "error"
                f.error = (
                    "not a module-level name, so it cannot be compiled ahead of time: move it to module level"
                )
                continue
            classify(f, getattr(module, fname))
        # Triton functions made without a decorator (k = triton.jit(f)) and defined in this file
        for attr, obj in sorted(vars(module).items()):
            jit = _triton_function(obj)
            code = getattr(_python_function(jit), "__code__", None) if jit is not None else None
            if code is None or attr in seen or Path(code.co_filename).resolve() != path.resolve():
                continue
            f = Found(name, path, attr, code.co_firstlineno)
            found.append(f)
            seen.add(attr)
            classify(f, obj, decorated=False)
    count_callers(found)
    return found, errors


def _resolve(node: ast.expr, scope: dict[str, Any]) -> Any:
    if isinstance(node, ast.Name):
        return scope.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _resolve(node.value, scope)
        return getattr(base, node.attr, None) if base is not None else None
    return None


def callees(jit: Any) -> list[Any]:
    """The Triton functions that ``jit``'s body calls by a module-level name (``f(...)``, ``mod.f(...)``)."""
    tree = ast.parse(textwrap.dedent(jit.src))
    scope = jit.fn.__globals__
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            inner = _triton_function(_resolve(node.func, scope))
            if inner is not None and inner is not jit:
                out.append(inner)
    return out


def count_callers(found: list[Found]) -> None:
    """Set ``callers`` of every device function; one that no kernel reaches is never compiled."""
    by_id = {id(f.jit): f for f in found if f.jit is not None}
    for kernel in (f for f in found if f.kind == "kernel"):
        reached: set[int] = set()
        todo = [kernel.jit]
        while todo:
            for callee in callees(todo.pop()):
                if id(callee) not in reached:
                    reached.add(id(callee))
                    todo.append(callee)
        for i in reached:
            if i in by_id:
                by_id[i].callers += 1
    for f in found:
        if f.kind == "device" and f.callers == 0:
            f.kind = "error"
            f.error = (
                "device function that no kernel calls, so it is never compiled: call it from a kernel "
                "with @aot variants (a test kernel will do)"
            )


# -- compiling ----------------------------------------------------------------------------------------


def compile_one(task: Task, out_dir: str | None) -> tuple[Task, bool, str, float]:
    """Compile one variant for one target; (task, ok, message, seconds). Runs in a worker."""
    t0 = time.perf_counter()
    try:
        from mori.core.kernels import aot_specs
        from mori.jit import compile_variant

        module = import_file(Path(task.path))
        obj = getattr(module, task.name)
        spec = aot_specs(obj)[task.variant]
        # the call a launch with these argument types makes, so the code is the code a launch gets
        kernel = compile_variant(obj, spec, task.target)
        backend = TARGETS[task.target][0]
        binary = "cubin" if backend == "cuda" else "hsaco"
        if binary not in kernel.asm or not kernel.asm[binary]:
            return task, False, f"no {binary} produced", time.perf_counter() - t0
        if out_dir:
            dest = Path(out_dir) / task.target.replace(":", "_")
            dest.mkdir(parents=True, exist_ok=True)
            (dest / f"{task.name}.{task.variant}.{binary}").write_bytes(kernel.asm[binary])
        return task, True, f"{len(kernel.asm[binary])} bytes", time.perf_counter() - t0
    except BaseException as e:
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        return task, False, last[:2000], time.perf_counter() - t0


def default_jobs() -> int:
    """How many CPUs this process may run on (its affinity mask, which taskset or a container's
    cpuset narrows), else the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS)
        return os.cpu_count() or 1


def _worker(conn: Connection, tasks: list[Task], out_dir: str | None, parent: int) -> None:
    """A worker process: compile ``tasks[i]`` for each index the parent sends, until it sends None."""
    try:
        while True:
            while not conn.poll(1.0):
                if os.getppid() != parent:  # the parent was killed: nobody is waiting for results
                    return
            i = conn.recv()
            if i is None:
                return
            _, ok, msg, secs = compile_one(tasks[i], out_dir)
            conn.send((i, ok, msg, secs))
    except (EOFError, OSError, KeyboardInterrupt):  # the parent is gone, or interrupted
        pass


def _died(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            how = signal.Signals(-exitcode).name
        except ValueError:
            how = f"signal {-exitcode}"
        return f"the compiling process was killed by {how}"
    return f"the compiling process exited with status {exitcode} while compiling"


@dataclass
class _Worker:
    process: Any  # a multiprocessing Process
    conn: Connection
    target: str
    current: int | None = None  # the index of the task it was sent last


def compile_all(
    tasks: list[Task],
    targets: list[str],
    jobs: int,
    out_dir: str | None,
    done: Callable[[Task, Result], None],
) -> None:
    """Compile every task on at most ``jobs`` worker processes at once; ``done`` gets each result.

    A process compiles for one target only: one that compiled for gfx950 and then for gfx942
    emitted gfx950-only fp8 conversions (v_cvt_scalef32_pk_fp8_f32) into the gfx942 code, which
    then failed to link (Triton 3.6). So each worker is started for one target and is handed that
    target's tasks one at a time, in order, by this process; when its target has none left it
    exits, and its slot goes to a new worker for the target with the most tasks left per worker.
    All targets overlap, a slow variant (a W=8 combine takes minutes) holds up one worker only,
    and ``jobs=1`` compiles everything one after another (one process per target in turn).

    A worker that dies (a crash inside LLVM, the OOM killer) fails the task it was compiling, and
    a new one takes its place: nothing waits for it forever.
    """
    import multiprocessing as mp
    from multiprocessing.connection import wait

    # fork: the workers inherit the imported modules (nothing has been compiled yet, so no
    # compiler threads exist to be lost); spawn where fork is not available (they import them)
    ctx: Any = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    todo = {t: deque(i for i, task in enumerate(tasks) if task.target == t) for t in targets}
    workers: dict[Connection, _Worker] = {}

    def give(w: _Worker) -> bool:
        """Send ``w`` its target's next task, or None (stop) if none is left; False for None.
        A task sent to a worker that just died is failed with it (the EOF that follows says so)."""
        queue = todo[w.target]
        w.current = queue.popleft() if queue else None
        with contextlib.suppress(OSError):
            w.conn.send(w.current)
        return w.current is not None

    def retire(w: _Worker) -> None:
        del workers[w.conn]
        w.conn.close()
        w.process.join()

    def fill() -> None:
        while len(workers) < jobs:
            left = [t for t in targets if todo[t]]
            if not left:
                return
            busy = Counter(w.target for w in workers.values())
            target = max(left, key=lambda t: len(todo[t]) / (1 + busy[t]))  # the first on a tie
            mine, theirs = ctx.Pipe()
            process = ctx.Process(
                target=_worker,
                args=(theirs, tasks, out_dir, os.getpid()),
                name=f"compile-{target}",
                daemon=True,
            )
            sys.stdout.flush()  # a forked child flushes what it inherited when it exits
            sys.stderr.flush()
            process.start()
            theirs.close()
            w = workers[mine] = _Worker(process, mine, target)
            give(w)

    try:
        fill()
        while workers:
            for conn in wait(list(workers)):
                w = workers[conn]  # type: ignore[index]
                try:
                    i, ok, msg, secs = w.conn.recv()
                except (EOFError, OSError):  # it died: every worker here has a task in flight
                    retire(w)
                    if w.current is not None:
                        done(tasks[w.current], (False, _died(w.process.exitcode), 0.0))
                    fill()
                    continue
                done(tasks[i], (ok, msg, secs))
                if not give(w):
                    retire(w)
                    fill()
    finally:
        for w in workers.values():  # only when interrupted
            w.process.terminate()
        for w in workers.values():
            w.process.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--targets",
        default=",".join(TARGETS),
        help=f"comma-separated targets among {', '.join(TARGETS)} (default: all)",
    )
    parser.add_argument(
        "-j",
        "--jobs",
        type=int,
        default=default_jobs(),
        help="compiles at once, each in a worker process (default: the CPUs this process may use, %(default)s)",
    )
    parser.add_argument(
        "--out", help="also write each cubin / hsaco to OUT/<target>/<kernel>.<variant>.<ext>"
    )
    parser.add_argument(
        "--cache", action="store_true", help="use Triton's cache (default: a fresh empty one)"
    )
    args = parser.parse_args(argv)

    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        parser.error(f"--targets: unknown {unknown or 'empty list'}; choose among {', '.join(TARGETS)}")
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")

    t0 = time.perf_counter()
    # One cache directory for the whole run, shared by the workers: Triton writes every entry
    # to a temporary file and renames it into place, so concurrent processes are safe, and two
    # processes never compile the same key (each task is compiled once).
    with tempfile.TemporaryDirectory(prefix="mori-triton-cache-") as tmp:
        if not args.cache:
            os.environ["TRITON_CACHE_DIR"] = tmp  # before triton is imported: it reads it then
        try:
            import triton
        except ImportError:
            print("compile_kernels: triton is not installed; nothing was compiled", file=sys.stderr)
            return 1
        found, errors = discover(ROOT)
        table = Table(found, errors, targets)
        tasks = [task for row in table.rows for task in row.tasks]  # in the table's order
        table.header(triton.__version__)
        results: dict[Task, Result] = {}

        def done(task: Task, result: Result) -> None:
            results[task] = result
            table.advance(results)

        compile_all(tasks, targets, min(args.jobs, max(1, len(tasks))), args.out, done)

    failed = table.finish(results, time.perf_counter() - t0)
    return 1 if failed else 0


def _label(f: Found) -> str:
    if f.path.is_relative_to(ROOT) and module_name(f.path) is None:
        return f"{f.path.relative_to(ROOT)}::{f.name}"  # imported by path (tests)
    return f"{f.module}.{f.name}"


@dataclass
class Row:
    label: str
    found: Found
    spec: Any = None  # the AotSpec of a kernel's row; None: a row of a function in error
    tasks: list[Task] = field(default_factory=list)  # one per target


class Table:
    """The table kernel [variant] x target, the device functions and the errors.

    A row is printed as soon as it and every row above it are compiled, so the table shows
    progress and its order is the same whatever order the compiles finish in."""

    def __init__(self, found: list[Found], errors: list[str], targets: list[str]) -> None:
        self.found, self.errors, self.targets = found, errors, targets
        self.rows: list[Row] = []
        self.devices: list[str] = []
        for f in sorted(found, key=lambda f: (f.module, f.line)):
            label = _label(f)
            if f.kind == "kernel":
                for i, spec in enumerate(f.variants):
                    tasks = [Task(f.module, str(f.path), f.name, i, t) for t in targets]
                    self.rows.append(Row(f"{label} [{spec.describe()}]", f, spec, tasks))
            elif f.kind == "device":
                self.devices.append(f"{label} ({f.callers})")
            else:
                self.rows.append(Row(label, f))
        self.width = max([len(r.label) for r in self.rows] + [len("kernel [variant]")])
        self.cw = max(10, *(len(t) for t in targets))
        self.printed = 0

    def header(self, version: str) -> None:
        n_kernels = sum(f.kind == "kernel" for f in self.found)
        targets = self.targets
        print(f"Triton {version}: {n_kernels} kernels, {len(self.rows)} rows, {len(targets)} targets")
        print(f"{'kernel [variant]':<{self.width}}  " + "  ".join(f"{t:<{self.cw}}" for t in targets))
        print("-" * (self.width + (self.cw + 2) * len(targets)), flush=True)

    def advance(self, results: dict[Task, Result], *, missing: Result | None = None) -> None:
        """Print the rows, from the first not printed yet, whose compiles are all in ``results``
        (with ``missing``: every row left, a compile not in ``results`` counted as ``missing``)."""
        start = self.printed
        while self.printed < len(self.rows):
            row = self.rows[self.printed]
            if missing is None and any(t not in results for t in row.tasks):
                break
            if row.spec is None:
                cells = ["ERROR"] * len(self.targets)
            else:
                got = [results.get(t, missing) for t in row.tasks]
                cells = [f"ok {r[2]:4.1f}s" if r and r[0] else "ERROR" for r in got]
            print(f"{row.label:<{self.width}}  " + "  ".join(f"{c:<{self.cw}}" for c in cells))
            self.printed += 1
        if self.printed > start:
            sys.stdout.flush()

    def finish(self, results: dict[Task, Result], seconds: float) -> bool:
        """Print the rest of the table and the errors; True if anything failed."""
        self.advance(results, missing=(False, "not compiled", 0.0))
        details: list[str] = []
        for row in self.rows:
            f = row.found
            if row.spec is None:
                where = f.path.relative_to(ROOT) if f.path.is_relative_to(ROOT) else f.path
                details.append(f"{row.label} ({where}:{f.line}): {f.error}")
                continue
            for task in row.tasks:
                ok, msg, _ = results.get(task, (False, "not compiled", 0.0))
                if not ok:
                    details.append(f"{row.label} on {task.target}: {msg}")
        details += self.errors

        devices = self.devices
        if devices:
            print(
                f"\n{len(devices)} device functions, compiled inside the kernels that call them (how many):"
            )
            print(textwrap.fill(", ".join(devices), width=110, initial_indent="  ", subsequent_indent="  "))
        n_ok = sum(ok for ok, _, _ in results.values())
        print(f"\n{n_ok}/{len(results)} compiles ok in {seconds:.1f} s")
        if details:
            print(f"\n{len(details)} error(s):", file=sys.stderr)
            for d in details:
                print(f"  {d}", file=sys.stderr)
        return bool(details)


if __name__ == "__main__":
    sys.exit(main())

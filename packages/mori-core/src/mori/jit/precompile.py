"""``precompile()``: compile every kernel variant of the installed MORI packages before it is needed.

Every kernel of MORI lists its ahead-of-time variants (:func:`mori.core.kernels.aot`): the argument
types, alignments and constants of a typical launch. :func:`precompile` finds every such kernel in
the ``mori.*`` modules of the installed distributions and compiles each variant for this machine's
GPU (or the targets given) through :func:`mori.jit.compile_variant`, i.e. exactly as its launch
would, into Triton's cache (:func:`mori.jit.cache_dir`): a later launch with matching arguments
loads the code instead of compiling it. Variants already in the cache are counted, not rebuilt.

Not precompiled: kernels that call :mod:`mori.ir.triton` (their code holds this process's context
address, so they are compiled in each process at their first launch) and launches whose arguments
do not match a declared variant (another dtype, an unaligned pointer, an integer divisible by 16
where the variant's is not...), which compile at their first launch as usual.

``MORI_PRECOMPILE=1`` runs :func:`precompile` when ``mori`` is imported; ``mori jit precompile``
runs it from the command line.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
import traceback
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from mori.core.errors import bad_value
from mori.core.kernels import AotSpec, aot_specs

__all__ = ["Kernel", "PrecompileReport", "Result", "find_kernels", "kernels_in", "precompile"]


@dataclass(frozen=True)
class Kernel:
    """A kernel with ahead-of-time variants, found in an installed ``mori.*`` module."""

    module: str
    name: str
    obj: Any  # what the module holds (a JITFunction, or an autotuner around one)
    variants: tuple[AotSpec, ...]
    #: why it is not precompiled ("" if it is)
    skip: str = ""

    @property
    def label(self) -> str:
        return f"{self.module}.{self.name}"


@dataclass(frozen=True)
class Result:
    """One variant for one target: ``status`` is ``compiled``, ``cached``, ``failed`` or ``skipped``."""

    kernel: str
    variant: str
    target: str
    status: str
    seconds: float = 0.0
    detail: str = ""


@dataclass
class PrecompileReport:
    """What :func:`precompile` did; ``results`` has one entry per variant and target."""

    targets: list[str]
    cache_dir: Path
    results: list[Result] = field(default_factory=list)
    #: modules that could not be imported: ``(module, error)``
    import_errors: list[tuple[str, str]] = field(default_factory=list)
    note: str = ""
    seconds: float = 0.0

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    @property
    def ok(self) -> bool:
        """No variant failed and every module imported."""
        return not self.count("failed") and not self.import_errors

    def summary(self) -> str:
        if self.note:
            return f"mori.jit.precompile: {self.note}"
        counts = ", ".join(f"{self.count(s)} {s}" for s in ("compiled", "cached", "skipped", "failed"))
        errors = f", {len(self.import_errors)} modules failed to import" if self.import_errors else ""
        return (
            f"mori.jit.precompile: {len(self.results)} kernel variants for {', '.join(self.targets)}: "
            f"{counts}{errors} in {self.seconds:.1f} s (cache {self.cache_dir})"
        )


# -- discovery ----------------------------------------------------------------------------------------


def _kernel_modules() -> Iterator[str]:
    """Dotted names of the ``mori.*`` modules, in every installed distribution, that define Triton
    kernels (their source mentions ``triton.jit``), without importing the others."""
    import mori

    seen: set[str] = set()
    for root in sorted({str(Path(p)) for p in mori.__path__}):
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "_")) and d != "tests")
            for f in sorted(filenames):
                if not f.endswith(".py"):
                    continue
                path = Path(dirpath, f)
                try:
                    text = path.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                if "triton.jit" not in text and "@jit" not in text:
                    continue
                parts = path.relative_to(root).with_suffix("").parts
                name = ".".join(["mori", *parts[:-1]] + ([] if parts[-1] == "__init__" else [parts[-1]]))
                if name not in seen:
                    seen.add(name)
                    yield name


def _uses_ir_context(jit: Any) -> bool:
    # a kernel that calls mori.ir.triton has its context constant among the globals Triton tracks
    from mori.ir.triton.context import CONTEXT

    _ = jit.cache_key
    return any(repr(v) == repr(CONTEXT) for (name, _), (v, _) in jit.used_global_vals.items())


def kernels_in(module: Any) -> list[Kernel]:
    """The kernels with ahead-of-time variants that ``module`` defines (not those it imports)."""
    from mori.jit.compile import triton_function

    found: list[Kernel] = []
    for attr, obj in vars(module).items():
        jit = triton_function(obj)
        specs = aot_specs(obj)
        if jit is None or not specs or getattr(jit.fn, "__module__", None) != module.__name__:
            continue
        skip = (
            "calls mori.ir.triton (compiled per process at its first launch)" if _uses_ir_context(jit) else ""
        )
        found.append(Kernel(module.__name__, attr, obj, tuple(specs), skip))
    return found


def find_kernels(import_errors: list[tuple[str, str]] | None = None) -> list[Kernel]:
    """Every kernel with ahead-of-time variants defined in an installed ``mori.*`` module, in
    module order. Modules that fail to import are skipped and listed in ``import_errors``."""
    found: list[Kernel] = []
    for name in _kernel_modules():
        try:
            module = importlib.import_module(name)
        except Exception as e:  # one broken module must not hide the others
            if import_errors is not None:
                import_errors.append((name, f"{type(e).__name__}: {e}"))
            continue
        found += kernels_in(module)
    return found


# -- compiling ----------------------------------------------------------------------------------------


def _this_machine() -> tuple[list[str], str]:
    """Targets of this machine's GPU, or ``([], why there are none)``."""
    try:
        import triton
    except ImportError:
        return [], "Triton is not installed, so there are no kernels to compile"
    if triton.knobs.runtime.interpret:
        return [], "TRITON_INTERPRET is set: kernels run under the interpreter, which compiles nothing"
    try:
        target = triton.runtime.driver.active.get_current_target()
    except Exception as e:  # no GPU driver: Triton raises RuntimeError("0 active drivers ...")
        return (
            [],
            f"no GPU here ({type(e).__name__}: {e}); MORI's kernels run under the Triton interpreter on CPU",
        )
    return [f"{target.backend}:{target.arch}"], ""


def precompile(
    targets: Iterable[str] | None = None,
    *,
    kernels: Iterable[Kernel] | None = None,
    progress: TextIO | None = sys.stderr,
) -> PrecompileReport:
    """Compile every variant of every MORI kernel for ``targets`` into Triton's cache.

    ``targets``: ``"cuda:90"``, ``"hip:gfx942"``, ...; default: this machine's GPU (none on a machine
    without one: the report says so and nothing is compiled). ``kernels``: default
    :func:`find_kernels`. ``progress``: where a line per compiled or failed variant and a summary
    go (None: silent). Never raises for a kernel that fails to compile: the report lists it.
    """
    from mori.jit.cache import cache_dir
    from mori.jit.compile import is_cached, parse_target, source_of

    t0 = time.perf_counter()
    if targets is None:
        chosen, note = _this_machine()
    else:
        chosen = [targets] if isinstance(targets, str) else list(targets)
        for t in chosen:
            parse_target(t)  # raises for a bad one, before any work
        note = "" if chosen else "no targets given"
    if not chosen and targets is not None:
        raise bad_value("precompile", "targets", targets, "a non-empty list such as ['cuda:90']")
    report = PrecompileReport(chosen, cache_dir(), note=note)
    if not chosen:
        _say(progress, report.summary())
        return report
    found = list(kernels) if kernels is not None else find_kernels(report.import_errors)
    for module, error in report.import_errors:
        _say(progress, f"mori.jit.precompile: cannot import {module}: {error}")
    todo = sum(len(k.variants) for k in found) * len(chosen)
    done = 0
    for target in chosen:
        for k in found:
            for spec in k.variants:
                done += 1
                if k.skip:
                    report.results.append(Result(k.label, spec.describe(), target, "skipped", detail=k.skip))
                    continue
                start = time.perf_counter()
                try:
                    src, options = source_of(k.obj, spec, target)
                    if is_cached(src, target, options):
                        status = "cached"
                    else:
                        import triton

                        triton.compile(src, target=parse_target(target), options=options)
                        status = "compiled"
                    result = Result(k.label, spec.describe(), target, status, time.perf_counter() - start)
                except Exception as e:
                    last = traceback.format_exception_only(type(e), e)[-1].strip()
                    result = Result(
                        k.label, spec.describe(), target, "failed", time.perf_counter() - start, last
                    )
                report.results.append(result)
                if result.status != "cached":
                    extra = f": {result.detail}" if result.detail else ""
                    _say(
                        progress,
                        f"[{done:>{len(str(todo))}}/{todo}] {target} {k.label} [{result.variant}] "
                        f"{result.status} {result.seconds:.1f} s{extra}",
                    )
    report.seconds = time.perf_counter() - t0
    _say(progress, report.summary())
    return report


def _say(out: TextIO | None, line: str) -> None:
    if out is not None:
        print(line, file=out, flush=True)

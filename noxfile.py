"""Every MORI workflow: ``nox`` runs the CI set (tests-cpu, lint, build, kernels, docs, demo).

``nox -l`` lists the sessions, ``nox -s NAME -- ARGS`` runs one and hands ARGS to its tool.
Sessions use the venv backend with pip, never uv: uv ignores the local CPU torch wheel and pulls a
multi-GB CUDA build. Local distributions are found by globbing ``packages/*``, ``tests/*`` and
``backends/*`` for a ``pyproject.toml``, so a new package or backend joins every session by itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import time
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import nox
from nox.command import CommandFailed
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

nox.needs_version = ">=2025.2.9"  # dependency_groups, default=, Session.cache_dir
nox.options.default_venv_backend = "venv"
nox.options.error_on_external_run = True

ROOT = Path(__file__).resolve().parent
PYPROJECT = nox.project.load_toml(ROOT / "pyproject.toml")
#: from the trove classifiers; sessions run on the interpreter that runs nox (``-P 3.12`` for another)
PYTHONS = nox.project.python_versions(PYPROJECT)

# The torch every session installs: on these machines a local CPU wheel (no CUDA downloads). pip
# honours PIP_INDEX_URL / PIP_EXTRA_INDEX_URL, which is how tests-rocm gets a ROCm build of it.
TORCH = "torch==2.13.0"
# The CPU torch wheel does not depend on numpy but warns "Failed to initialize NumPy" on import;
# under pytest's filterwarnings=error that warning fails every test module that imports torch.
NUMPY = "numpy"
TEST_DEPS = nox.project.dependency_groups(PYPROJECT, "test")
LINT_DEPS = nox.project.dependency_groups(PYPROJECT, "lint")
DOCS_DEPS = nox.project.dependency_groups(PYPROJECT, "docs")
KERNEL_DEPS = nox.project.dependency_groups(PYPROJECT, "kernels")  # the pinned Triton

#: what ``nox -s build`` imports from the full install: the architecture of record (DESIGN.md),
#: plus every ``mori.<x>`` package found in the built wheels
COMPONENTS = ["core", "shmem", "ep", "io", "cco", "ccl", "umbp", "viz"]

DOCS_DIR = ROOT / "docs"
COMPILE_KERNELS = ROOT / "tools" / "compile_kernels.py"
DIST_DIR = ROOT / "dist"

# What never ends up in a wheel, so does not change its cache key: build trees and tests at the top
# of a distribution, caches anywhere.
_NOT_IN_WHEEL_TOP = {"build", "dist", "tests", "_skbuild"}
_NOT_IN_WHEEL = {"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".nox", ".git"}


@dataclass(frozen=True)
class Dist:
    """One local distribution: a directory with a ``pyproject.toml``."""

    name: str
    path: Path
    kind: str  # "core", "package", "test-helper" or "backend"
    native: bool  # built by scikit-build-core (C++): slow to build, wheel is platform-specific

    @property
    def rel(self) -> str:
        return self.path.relative_to(ROOT).as_posix()


def _discover() -> list[Dist]:
    """mori-core first, then packages/*, tests/* and backends/*, each sorted by directory."""
    found: list[Dist] = []
    for pattern, kind in (
        ("packages/*/pyproject.toml", "package"),
        ("tests/*/pyproject.toml", "test-helper"),
        ("backends/*/pyproject.toml", "backend"),
    ):
        for pyproject in sorted(ROOT.glob(pattern)):
            meta = nox.project.load_toml(pyproject)
            name = meta["project"]["name"]
            backend = meta.get("build-system", {}).get("build-backend", "")
            found.append(
                Dist(
                    name,
                    pyproject.parent,
                    "core" if name == "mori-core" else kind,
                    backend.startswith("scikit_build_core"),
                )
            )
    if not any(d.kind == "core" for d in found):
        raise RuntimeError("noxfile: packages/mori-core/pyproject.toml (distribution 'mori-core') not found")
    return sorted(found, key=lambda d: d.kind != "core")


DISTS = _discover()
CORE = next(d for d in DISTS if d.kind == "core")
#: what a user installs: everything but the test helpers
RUNTIME_DISTS = [d for d in DISTS if d.kind != "test-helper"]
_CORE_META = nox.project.load_toml(CORE.path / "pyproject.toml")["project"]
MPI_DEPS = _CORE_META["optional-dependencies"]["mpi"]


def _mypy_roots(dists: Sequence[Dist]) -> tuple[list[Path], list[Path]]:
    """(MYPYPATH, targets) of mypy --strict: every distribution's ``src/`` and the top-level
    packages in it (``mori``, a backend's ``mori_backend_*``), so a new distribution is checked by
    itself. ``mori`` is a namespace spread over the distributions: each ``src/`` is a package base."""
    paths: list[Path] = []
    targets: list[Path] = []
    for dist in dists:
        src = dist.path / "src"
        found = sorted(
            p for p in src.glob("*") if p.is_dir() and p.name.isidentifier() and not p.name.startswith("__")
        )
        if not found:
            raise RuntimeError(f"noxfile: {dist.rel} has no package under src/ for mypy to check")
        paths.append(src)
        targets.extend(found)
    return paths, targets


def _third_party(dists: Sequence[Dist]) -> list[str]:
    """The declared dependencies of ``dists`` that are not local distributions, torch left out (pinned above)."""
    local = {canonicalize_name(d.name) for d in DISTS} | {"torch"}
    found: list[str] = []
    for dist in dists:
        for req in nox.project.load_toml(dist.path / "pyproject.toml")["project"].get("dependencies", []):
            if canonicalize_name(Requirement(req).name) not in local and req not in found:
                found.append(req)
    return found


# mypy --strict covers every distribution (config: [tool.mypy] in the root pyproject): mori-core
# (mori.core, mori.shmem, mori.ir, mori.jit and the namespace's top-level modules), every other
# package, the test helpers and the backends' plugins. It runs with their third-party dependencies
# installed, and pytest, which the test helpers (mori.testing) import: a missing one would be Any.
MYPY_PATH, MYPY_TARGETS = _mypy_roots(DISTS)
MYPY_DEPS = [
    *_third_party(DISTS),
    *(r for r in TEST_DEPS if canonicalize_name(Requirement(r).name) == "pytest"),
]

# ---------------------------------------------------------------------------------------------
# Wheels, built once and reused: a wheel is cached under the nox cache directory by a hash of its
# sources and the interpreter, so mori-core's native build (30-60 s) runs once per change of its
# sources, not once per session. The C++ build tree is kept there too, so a rebuild is incremental.
# ---------------------------------------------------------------------------------------------


def _source_key(dist: Dist, python_tag: str) -> str:
    digest = hashlib.sha256(python_tag.encode())
    for dirpath, dirnames, filenames in os.walk(dist.path):
        top = Path(dirpath) == dist.path
        dirnames[:] = sorted(
            d
            for d in dirnames
            if d not in _NOT_IN_WHEEL and not d.endswith(".egg-info") and not (top and d in _NOT_IN_WHEEL_TOP)
        )
        for filename in sorted(filenames):
            if filename.endswith((".pyc", ".pyo")):
                continue
            path = Path(dirpath, filename)
            digest.update(path.relative_to(dist.path).as_posix().encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Serialise wheel builds of concurrent nox runs (``nox -j``) that share the cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _python_tag(session: nox.Session) -> str:
    out = session.run(
        "python", "-c", "import sys; print(sys.implementation.cache_tag)", silent=True, log=False
    )
    return str(out).strip()


def _builder(session: nox.Session, dist: Dist, tag: str) -> Path:
    """A venv with the build requirements of a native distribution, kept in the nox cache.

    Building without isolation against the same, unchanging files lets CMake recompile only what
    changed: after an edit of Python code the wheel takes ~1 s instead of ~25 s.
    """
    requires = nox.project.load_toml(dist.path / "pyproject.toml")["build-system"]["requires"]
    spec = "\n".join(sorted([*requires, *(tool for tool in ("cmake", "ninja") if not shutil.which(tool))]))
    venv = session.cache_dir.resolve() / "builders" / f"{dist.name}-{tag}"
    stamp = venv / "nox-requirements.txt"
    if not stamp.is_file() or stamp.read_text() != spec:
        shutil.rmtree(venv, ignore_errors=True)
        session.run("python", "-m", "venv", str(venv))
        session.run(str(venv / "bin" / "python"), "-m", "pip", "install", *spec.split("\n"), external=True)
        stamp.write_text(spec)
    return venv


def _test_hooks(dist: Dist) -> bool:
    """Whether ``dist``'s native build has test-only hooks behind the CMake option MORI_TEST_HOOKS."""
    cmake = dist.path / "CMakeLists.txt"
    return dist.native and cmake.is_file() and "MORI_TEST_HOOKS" in cmake.read_text()


def _wheels(session: nox.Session, dists: Sequence[Dist], *, test_build: bool = False) -> list[str]:
    """Return one wheel per distribution, building only those whose sources changed.

    ``test_build``: native distributions with test-only hooks are built with them (the tests'
    wheels), cached apart from the release builds every other session installs.
    """
    cache = session.cache_dir.resolve() / "wheels"
    tag = _python_tag(session)
    wheels: list[str] = []
    with _locked(cache / ".lock"):
        for dist in dists:
            hooks = test_build and _test_hooks(dist)
            flavour = f"{tag}-test" if hooks else tag
            key = f"{dist.name}-{flavour}-{_source_key(dist, tag)}"
            slot = cache / key
            found = sorted(slot.glob("*.whl")) if slot.is_dir() else []
            if found:
                session.log(f"{dist.name}: reusing {found[0].relative_to(cache)} (sources unchanged)")
            else:
                for stale in cache.glob(f"{dist.name}-{flavour}-*"):
                    if hooks or not stale.name.startswith(f"{dist.name}-{tag}-test-"):
                        shutil.rmtree(stale)
                tmp = cache / f".tmp-{key}"
                shutil.rmtree(tmp, ignore_errors=True)
                wheel = ["-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(tmp)]
                if dist.native:
                    builder = _builder(session, dist, tag) / "bin" / "python"
                    build_dir = session.cache_dir.resolve() / "cmake-build" / f"{dist.name}-{flavour}"
                    no_isolation = ["--no-build-isolation", "--config-settings", f"build-dir={build_dir}"]
                    if hooks:
                        no_isolation += ["--config-settings", "cmake.define.MORI_TEST_HOOKS=ON"]
                    session.run(str(builder), *wheel, *no_isolation, dist.rel, external=True)
                else:
                    session.run("python", *wheel, dist.rel)
                tmp.rename(slot)
                found = sorted(slot.glob("*.whl"))
            if len(found) != 1:
                session.error(f"{dist.name}: expected one wheel in {slot}, found {[p.name for p in found]}")
            wheels.append(str(found[0]))
    return wheels


def _install_dists(
    session: nox.Session, dists: Sequence[Dist], *deps: str, compile_: bool = False, test_build: bool = False
) -> None:
    """Install ``deps`` (third-party) and the local distributions from their cached wheels.

    Byte-compiling torch at install time costs ~15 s; it pays off only where many processes
    import it (the tests), so other sessions install with --no-compile. ``test_build``: see _wheels.
    """
    wheels = _wheels(session, dists, test_build=test_build)
    opts = [] if compile_ else ["--no-compile"]
    # pip is silent under nox: one line per step, torch (the long one) on its own
    first = [d for d in deps if d == TORCH]
    if first:
        _install_step(session, f"{TORCH} (the longest step: minutes on a fresh cache)", *opts, *first)
    rest = [d for d in deps if d != TORCH]
    _install_step(session, f"{len(rest)} requirements and {len(wheels)} local wheels", *opts, *rest, *wheels)
    # A reused venv (nox -r) holds the same version numbers, which pip would keep: force ours in.
    _install_step(
        session, "the local wheels again, forced", "--no-deps", "--force-reinstall", "--quiet", *wheels
    )
    session.log("installed " + ", ".join(d.name for d in dists))


def _install_step(session: nox.Session, what: str, *args: str) -> None:
    """``session.install(*args)`` between a line saying what it installs and one saying how long it took."""
    session.log(f"install: {what} ...")
    t0 = time.monotonic()
    session.install(*args)
    session.log(f"install: {what}: done in {time.monotonic() - t0:.0f} s")


def _check_python(session: nox.Session) -> None:
    version = str(_python_tag(session)).removeprefix("cpython-")
    dotted = f"{version[0]}.{version[1:]}"
    if dotted not in PYTHONS:
        session.warn(f"python {dotted} is not among the versions the project declares: {', '.join(PYTHONS)}")


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------

ARCHES: dict[str, str] = {
    # arch -> pytest marker expression
    "cpu": "not gpu and not cuda and not rocm",
    "cuda": "cuda or gpu",
    "rocm": "rocm or gpu",
}


def _exit_code(e: CommandFailed) -> int | None:
    """The failed command's exit status: an attribute since nox 2026.7.11, in the message before."""
    code = getattr(e, "return_code", None)
    if code is None and str(e).startswith("Returned code "):
        code = int(str(e).removeprefix("Returned code "))
    return code


def _nvidia_gpus() -> tuple[list[str], str]:
    """(GPUs found, how they were looked for)."""
    smi = shutil.which("nvidia-smi")
    if smi:
        res = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60, check=False)
        gpus = [line.strip() for line in res.stdout.splitlines() if line.startswith("GPU ")]
        return gpus, f"`nvidia-smi -L` exited {res.returncode} listing {len(gpus)} GPU(s)"
    proc = Path("/proc/driver/nvidia/gpus")
    gpus = sorted(p.name for p in proc.iterdir()) if proc.is_dir() else []
    return gpus, f"nvidia-smi is not on PATH and {proc} lists {len(gpus)} GPU(s)"


def _amd_gpus() -> tuple[list[str], str]:
    if not Path("/dev/kfd").exists():
        return [], "/dev/kfd does not exist (no amdgpu kernel driver)"
    gpus = []
    for props in sorted(Path("/sys/class/kfd/kfd/topology/nodes").glob("*/properties")):
        fields = dict(line.split(maxsplit=1) for line in props.read_text().splitlines() if " " in line)
        if int(fields.get("simd_count", "0")) > 0:  # CPU nodes have no SIMDs
            gpus.append(props.parent.name)
    return gpus, f"/dev/kfd exists and the KFD topology lists {len(gpus)} GPU node(s)"


def _has_path_arg(args: Sequence[str]) -> bool:
    """Whether the user named tests to run (a path or node id) rather than only options."""
    return any(not a.startswith("-") and Path(ROOT, a.split("::")[0]).exists() for a in args)


def _test_dirs() -> list[str]:
    dirs = [d.path / "tests" for d in DISTS if (d.path / "tests").is_dir()]
    loose = ROOT / "tests"  # tests that belong to no package, next to the test helpers
    dist_dirs = {d.path for d in DISTS}
    if loose.is_dir() and any(p for p in loose.rglob("test_*.py") if not dist_dirs & set(p.parents)):
        dirs.append(loose)
    return [p.relative_to(ROOT).as_posix() for p in dirs]


def _tests(session: nox.Session, arch: str) -> None:
    if arch == "cuda":
        gpus, how = _nvidia_gpus()
        if not gpus:
            session.skip(f"no NVIDIA GPU on this machine: {how}")
        session.log(f"NVIDIA GPUs: {'; '.join(gpus)}")
    elif arch == "rocm":
        gpus, how = _amd_gpus()
        if not gpus:
            session.skip(f"no AMD GPU on this machine: {how}")
        session.log(f"AMD GPU nodes: {', '.join(gpus)}")
    _check_python(session)

    deps = [TORCH, NUMPY, *TEST_DEPS, *KERNEL_DEPS]
    mpirun = shutil.which("mpirun")
    if mpirun:
        deps += MPI_DEPS
    else:
        session.log("mpirun is not on PATH: mpi4py is not installed and the tests marked mpi will skip")
    # the tests' build of mori-core has its test-only hooks (mori.core.test_hooks)
    _install_dists(session, DISTS, *deps, compile_=True, test_build=True)

    if arch != "cpu":  # the GPU is there: torch must see it, or the run would prove nothing
        probe = "import torch; assert torch.cuda.is_available() and torch.cuda.device_count() > 0"
        if arch == "rocm":
            probe += "; assert torch.version.hip, 'torch is not a ROCm build'"
        try:
            session.run("python", "-c", probe)
        except CommandFailed:
            session.error(
                f"torch in this session cannot use the {arch} GPU; point pip at a matching build of "
                f"{TORCH} (PIP_INDEX_URL / PIP_EXTRA_INDEX_URL, e.g. https://download.pytorch.org/whl/...)"
            )

    targets = [] if _has_path_arg(session.posargs) else _test_dirs()
    if not targets and not session.posargs:
        session.error("no tests/ directory found in any distribution")
    try:
        # the slowest tests in the log: what to look at when CI nears its 30-minute budget
        session.run("pytest", "-m", ARCHES[arch], "--durations=25", *targets, *session.posargs)
    except CommandFailed as e:
        if _exit_code(e) != 5:
            raise
        # pytest exit code 5: nothing was collected or everything was deselected.
        if arch == "cpu":
            session.error(
                f"pytest ran no test (exit code 5): -m {ARCHES[arch]!r} {' '.join(session.posargs)}"
            )
        session.skip(f"no test is marked for {arch} (-m {ARCHES[arch]!r} {' '.join(session.posargs)})")
    where = ", ".join(targets) if targets else "the paths given after --"
    session.log(
        f"tests-{arch}: pytest -m {ARCHES[arch]!r} over {where}; mpi tests: "
        + ("enabled (mpi4py installed, mpirun at " + mpirun + ")" if mpirun else "skipped, no mpirun")
    )


def _register_tests(arch: str) -> None:
    """One session per device arch. nox would name a parametrized session ``tests(cpu)``; the
    names here are ``tests-cpu`` etc., the ones the README and CI use."""

    def tests(session: nox.Session) -> None:
        _tests(session, arch)

    tests.__doc__ = {
        "cpu": "Run every package's tests on the CPU, GPU-marked ones deselected (pytest args after --).",
        "cuda": "Run the tests marked cuda or gpu on an NVIDIA GPU; skips where there is none.",
        "rocm": "Run the tests marked rocm or gpu on an AMD GPU; skips where there is none.",
    }[arch]
    tags = ["tests"] if arch == "cpu" else ["tests", "gpu"]
    nox.session(name=f"tests-{arch}", default=arch == "cpu", tags=tags)(tests)


for _arch in ARCHES:
    _register_tests(_arch)


# ---------------------------------------------------------------------------------------------
# lint
# ---------------------------------------------------------------------------------------------


@nox.session
def lint(session: nox.Session) -> None:
    """Ruff (check + format --check) over the repo, mypy --strict on every distribution (ruff check args after --)."""
    # torch, pluggy and the rest give mypy the real types of what the code passes around.
    _install_step(session, f"{TORCH} (the longest step)", "--no-compile", TORCH)
    _install_step(
        session, "ruff, mypy and the distributions' dependencies", "--no-compile", *LINT_DEPS, *MYPY_DEPS
    )
    failed: list[str] = []
    for name, cmd in (
        ("ruff check", ["ruff", "check", ".", *session.posargs]),
        ("ruff format", ["ruff", "format", "--check", "."]),
    ):
        try:
            session.run(*cmd)
        except CommandFailed:
            failed.append(name)
    # Triton kernel modules are checked too: jitted functions carry no annotations (Triton reads
    # them), so those modules start with `# mypy: disable-error-code="no-untyped-def,untyped-decorator"`
    # and everything else in them, host code included, gets the strict treatment.
    try:
        session.run(
            "mypy",
            *(p.relative_to(ROOT).as_posix() for p in MYPY_TARGETS),
            env={"MYPYPATH": os.pathsep.join(map(str, MYPY_PATH))},
        )
    except CommandFailed:
        failed.append("mypy")
    if failed:
        session.error("failed: " + ", ".join(failed))
    session.log(
        "lint: ruff check, ruff format --check and mypy --strict "
        f"({', '.join(p.relative_to(ROOT).as_posix() for p in MYPY_TARGETS)}) passed"
    )


# ---------------------------------------------------------------------------------------------
# build
# ---------------------------------------------------------------------------------------------


def _venv(session: nox.Session, name: str) -> Path:
    """A clean virtual environment, not the session's, with torch from the local CPU wheel."""
    path = Path(session.create_tmp()).resolve() / name
    shutil.rmtree(path, ignore_errors=True)
    session.run("python", "-m", "venv", str(path))
    # --no-compile: these venvs import torch a handful of times, byte-compiling it costs more.
    session.log(f"venv {name}: installing {TORCH} ...")
    _pip(session, path, "install", "--quiet", "--no-compile", TORCH)
    return path


def _pip(session: nox.Session, venv: Path, *args: str) -> None:
    session.run(str(venv / "bin" / "python"), "-m", "pip", *args, external=True)


def _in_venv(session: nox.Session, venv: Path, *args: str) -> None:
    """Run a command of ``venv`` from outside the repo, as a user of the installed packages would."""
    env = {"VIRTUAL_ENV": str(venv), "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    with session.chdir(venv):
        session.run(str(venv / "bin" / args[0]), *args[1:], env=env, external=True)


def _script(session: nox.Session, venv: Path, name: str, code: str) -> None:
    """Run ``code`` with the python of ``venv``, saved as ``name`` so that the log stays readable."""
    (venv / name).write_text(code.lstrip(), encoding="utf-8")
    _in_venv(session, venv, "python", name)


def _wheel_modules(wheel: Path) -> set[str]:
    """Packages a wheel ships: ``mori.<x>`` in the namespace, and top-level ones (backend plugins)."""
    with zipfile.ZipFile(wheel) as zf:
        parts = [name.split("/") for name in zf.namelist()]
    found = {f"mori.{p[1]}" for p in parts if len(p) == 3 and p[0] == "mori" and p[2] == "__init__.py"}
    found |= {p[0] for p in parts if len(p) == 2 and p[0] != "mori" and p[1] == "__init__.py"}
    return found


_CHECK_IMPORTS = """
import importlib, importlib.metadata, warnings
# torch warns this on import when numpy is missing: the distributions must declare what they use
warnings.filterwarnings("error", message="Failed to initialize NumPy")
import torch
for module in {modules!r}:
    importlib.import_module(module)
    print("import", module, "ok")
# a plugin that does not load would only be reported by `mori backends`, not fail it
for group in ("mori.backends", "mori.extensions"):
    for ep in importlib.metadata.entry_points(group=group):
        ep.load()
        print(f"entry point {{group}}:{{ep.name}} = {{ep.value}} ({{ep.dist.name}}) loads")
"""

_CHECK_MISSING = """
import importlib, sys
import mori
missing = {missing!r}
for module, dist in missing.items():
    for how in ("import", "attribute"):
        try:
            importlib.import_module(module) if how == "import" else getattr(mori, module.split(".")[1])
        except ModuleNotFoundError as e:
            assert f"pip install {{dist}}" in str(e), f"{{how}} {{module}}: message lacks 'pip install {{dist}}': {{e}}"
            print(f"{{how}} {{module}}: ModuleNotFoundError: {{e}}")
        else:
            sys.exit(f"{{how}} {{module}} worked, but {{dist}} is not installed")
"""

_CHECK_RELEASE = """
import mori.core._core, mori.core.test_hooks
# the wheel users get carries no test-only hooks (CMake option MORI_TEST_HOOKS, off)
assert not hasattr(mori.core._core, "_testing"), "mori-core's wheel carries the test hooks"
assert mori.core.test_hooks.AVAILABLE is False
print("mori-core's native module has no test hooks")
"""

_CHECK_EDITABLE = """
import mori.shmem, mori.ep
for m in (mori.shmem, mori.ep):
    assert {root!r} in m.__file__, f"{{m.__name__}} comes from {{m.__file__}}, not the source tree"
    print(m.__name__, "->", m.__file__)
"""


@nox.session
def build(session: nox.Session) -> None:
    """Build sdist + wheel of every distribution into dist/, then install them in clean venvs."""
    session.install("build")
    shutil.rmtree(DIST_DIR, ignore_errors=True)
    built: dict[str, Path] = {}
    for dist in DISTS:  # sdist, then the wheel from the sdist: proves the sdist is complete
        out = Path(session.create_tmp()).resolve() / "out" / dist.name
        shutil.rmtree(out, ignore_errors=True)
        session.run("python", "-m", "build", "--outdir", str(out), dist.rel, *session.posargs)
        wheels, sdists = sorted(out.glob("*.whl")), sorted(out.glob("*.tar.gz"))
        if len(wheels) != 1 or len(sdists) != 1:
            session.error(
                f"{dist.name}: expected one wheel and one sdist, got {[p.name for p in out.iterdir()]}"
            )
        DIST_DIR.mkdir(exist_ok=True)
        for artefact in (*wheels, *sdists):
            shutil.move(artefact, DIST_DIR / artefact.name)
        built[dist.name] = DIST_DIR / wheels[0].name

    # The namespace: only mori-core may ship mori/__init__.py (a second copy would overwrite it),
    # and mori-core's wheel must carry the native module.
    for name, wheel in built.items():
        with zipfile.ZipFile(wheel) as zf:
            files = zf.namelist()
        if name != CORE.name and "mori/__init__.py" in files:
            session.error(f"{wheel.name} ships mori/__init__.py, which belongs to mori-core")
        if name == CORE.name and not any(f.startswith("mori/core/_core.") for f in files):
            session.error(f"{wheel.name} lacks the native module mori/core/_core.*")

    # 1. Everything, from the built wheels.
    full = _venv(session, "full")
    _pip(session, full, "install", "--quiet", "--no-compile", *(str(w) for w in built.values()))
    _pip(session, full, "check")
    modules = sorted({f"mori.{c}" for c in COMPONENTS}.union(*(_wheel_modules(w) for w in built.values())))
    _script(session, full, "check_imports.py", _CHECK_IMPORTS.format(modules=modules))
    _in_venv(session, full, "mori", "backends")

    # 2. mori-core alone: its components work, the others name the distribution to install.
    core_only = _venv(session, "core-only")
    _pip(session, core_only, "install", "--quiet", "--no-compile", str(built[CORE.name]))
    _pip(session, core_only, "check")
    _script(
        session, core_only, "check_imports.py", _CHECK_IMPORTS.format(modules=["mori.core", "mori.shmem"])
    )
    _in_venv(session, core_only, "mori", "backends")
    _script(session, core_only, "check_release.py", _CHECK_RELEASE)
    # every component the full install has that mori-core does not provide
    others = {
        m: d.name
        for d in RUNTIME_DISTS
        if d is not CORE
        for m in _wheel_modules(built[d.name])
        if m.startswith("mori.")
    }
    _script(
        session, core_only, "check_missing.py", _CHECK_MISSING.format(missing=dict(sorted(others.items())))
    )

    # 3. Editable installs of mori-core (scikit-build-core) and mori-ep (hatchling), with build
    #    isolation, as a developer would run them.
    editable = _venv(session, "editable")
    _pip(session, editable, "install", "--quiet", "--no-compile", "-e", CORE.rel)
    ep = next((d for d in DISTS if d.name == "mori-ep"), None)
    viz = next((d for d in DISTS if d.name == "mori-viz"), None)
    if ep is None or viz is None:
        session.error(
            "packages/mori-ep or mori-viz is missing: the editable check installs them with mori-core"
        )
    # mori-ep needs mori-viz (its kernels' trace helpers), which is on no index: install it first
    _pip(session, editable, "install", "--quiet", "--no-compile", "-e", viz.rel)
    _pip(session, editable, "install", "--quiet", "--no-compile", "-e", ep.rel)
    _script(session, editable, "check_editable.py", _CHECK_EDITABLE.format(root=str(ROOT / "packages")))
    _script(session, editable, "check_missing.py", _CHECK_MISSING.format(missing={"mori.io": "mori-io"}))

    session.log(
        f"build: {len(built)} wheels + {len(built)} sdists in {DIST_DIR.relative_to(ROOT)}/: "
        + ", ".join(sorted(p.name for p in DIST_DIR.iterdir()))
    )
    session.log(f"build: clean venv with every wheel imports {', '.join(modules)} and runs `mori backends`")
    session.log(
        f"build: clean venv with mori-core only imports mori.shmem, runs `mori backends`, and "
        f"{', '.join(sorted(others))} name their distribution"
    )
    session.log("build: editable mori-core + mori-ep import mori.shmem and mori.ep from the source tree")


# ---------------------------------------------------------------------------------------------
# kernels, docs, demo, bench
# ---------------------------------------------------------------------------------------------


@nox.session
def kernels(session: nox.Session) -> None:
    """Compile every Triton kernel for sm_90, sm_100, gfx942, gfx950 on the CPU (tool args after --)."""
    if not COMPILE_KERNELS.is_file():
        session.error(f"{COMPILE_KERNELS.relative_to(ROOT)} is missing: it is what compiles the kernels")
    # the tool imports every module with a @triton.jit function, test modules included
    _install_dists(session, DISTS, TORCH, NUMPY, *KERNEL_DEPS, *TEST_DEPS)
    session.run("python", COMPILE_KERNELS.relative_to(ROOT).as_posix(), *session.posargs)
    session.log("kernels: every @triton.jit kernel compiled ahead of time (table above)")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the Sphinx + MyST site into docs/_build/html, warnings as errors (sphinx args after --)."""
    if not (DOCS_DIR / "conf.py").is_file():
        session.error(
            f"{(DOCS_DIR / 'conf.py').relative_to(ROOT)} is missing: there is no documentation to build"
        )
    _install_dists(session, RUNTIME_DISTS, TORCH, NUMPY, *KERNEL_DEPS, *DOCS_DEPS)
    out = DOCS_DIR / "_build" / "html"  # the path in `sphinx` below
    # Sphinx rebuilds only changed pages, so warnings of the others would not be shown again.
    shutil.rmtree(out, ignore_errors=True)
    sphinx = ["python", "-m", "sphinx", "-W", "--keep-going", "-b", "html", "docs", "docs/_build/html"]
    session.run(*sphinx, *session.posargs)
    session.log(f"docs: site built without warnings, open {out / 'index.html'}")


@nox.session
def demo(session: nox.Session) -> None:
    """Run `mori demo`, the main CPU job on 4 local ranks (its args after --)."""
    _install_dists(session, RUNTIME_DISTS, TORCH, NUMPY)
    session.run("mori", "demo", *session.posargs)
    session.log(f"demo: `{' '.join(['mori', 'demo', *session.posargs])}` finished")


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """Run `mori bench` with the args after -- (e.g. `nox -s bench -- shmem`); opt-in."""
    if not session.posargs:
        session.error("name a suite: nox -s bench -- SUITE [options] (`nox -s bench -- --help` lists them)")
    _install_dists(session, RUNTIME_DISTS, TORCH, NUMPY)
    session.run("mori", "bench", *session.posargs)


if __name__ == "__main__":
    nox.main()

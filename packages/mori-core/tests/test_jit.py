"""mori.jit: precompile into Triton's cache exactly what launches look up, MORI_PRECOMPILE,
MORI_JIT_CACHE_DIR and MORI_DISABLE_JIT, on this CPU (Triton compiles for an explicit GPU target
without the GPU).

The launch side is Triton's own: a driver that only names a target (``cuda:90``) lets
``kernel.warmup(...)`` run the whole launch path of ``JITFunction.run`` (binder, cache lookup,
compile, launch check) without a GPU. Those tests run in fresh processes, from a script file
(Triton reads TRITON_INTERPRET once, and needs a kernel's source).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("mori.jit compiles Triton kernels (pip install mori-core[triton])", allow_module_level=True)

_PRELUDE = """
import os, sys, json
os.environ.pop("TRITON_INTERPRET", None)
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

class TargetOnly:  # a driver that only names a target: warmup compiles for it here
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_active_torch_device(self): return torch.device("cpu")

driver.set_active(TargetOnly())
cache = os.environ["TRITON_CACHE_DIR"]

def entries():  # compiled kernels: directories holding a kernel's IR (a cache lookup may leave an
    # empty one; on a GPU the driver's launcher stubs, shared objects, land beside them)
    if not os.path.isdir(cache):
        return []
    return sorted(
        d for d in os.listdir(cache) if any(f.endswith(".ttir") for f in os.listdir(os.path.join(cache, d)))
    )


def contents():  # every cache directory and its files, for a failure's message
    return {d: sorted(os.listdir(os.path.join(cache, d))) for d in sorted(os.listdir(cache))}
"""

_PRECOMPILE_THEN_LAUNCH = """
from mori.jit import find_kernels, precompile
from mori.shmem.kernels import barrier_kernel, put_kernel
kernels = [k for k in find_kernels() if k.module == "mori.shmem.kernels" and k.name in ("barrier_kernel", "put_kernel")]
report = precompile(kernels=kernels)  # "this machine": the stand-in driver's cuda:90
variants = sum(len(k.variants) for k in kernels)
assert report.targets == ["cuda:90"] and report.count("compiled") == variants and report.ok, report.summary()
n_mori = len(entries())
assert n_mori == variants

# a launch whose arguments match a declared variant finds its code: nothing new in the cache
barrier_kernel.warmup(torch.int64, grid=(1,))
put_kernel.warmup(torch.int32, torch.int32, torch.int64, 2**33 + 7, 2**33 + 7, 7, BLOCK=1024, grid=(1,))
assert len(entries()) == n_mori, "a precompiled variant was compiled again at its launch"

# MORI_DISABLE_JIT: a launch that needs new code (here a 16-byte aligned pe, not the declared
# variant) raises instead of compiling; the precompiled ones still launch
os.environ["MORI_DISABLE_JIT"] = "1"
from mori.core.errors import MoriStateError
from mori.jit.cache import install_disable_jit_hook
install_disable_jit_hook()
try:
    put_kernel.warmup(torch.int32, torch.int32, torch.int64, 2**33 + 7, 2**33 + 7, 16, BLOCK=1024, grid=(1,))
except MoriStateError as e:
    assert "mori.shmem.kernels.put_kernel" in str(e) and "MORI_DISABLE_JIT=1" in str(e), e
else:
    raise AssertionError("MORI_DISABLE_JIT=1 let a MORI kernel compile")
assert len(entries()) == n_mori
barrier_kernel.warmup(torch.int64, grid=(1,))  # in the cache: fine

# a user's kernel is not MORI's: it compiles
@triton.jit
def user_kernel(x_ptr):
    triton.language.store(x_ptr, 1)

user_kernel.warmup(torch.int32, grid=(1,))
assert len(entries()) == n_mori + 1
print("ok", variants)
"""

_PRECOMPILE_AT_IMPORT = """
class NoGpu:  # so that this check runs the same on a GPU machine
    def get_current_target(self): raise RuntimeError("0 active drivers")

driver.set_active(NoGpu())
os.environ["MORI_PRECOMPILE"] = "1"
import mori  # runs precompile(), which finds no GPU and says so
from mori.jit import precompile
report = precompile(progress=None)
assert report.results == [] and report.targets == [] and "no GPU here" in report.note, report.note
print("ok")
"""


def _run(tmp_path: Path, body: str, **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "check.py"
    script.write_text(_PRELUDE + body)
    full = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "MORI_"))}
    full.update({"TRITON_CACHE_DIR": str(tmp_path / "cache"), **env})
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=full
    )


def test_precompiled_variants_are_what_launches_look_up(tmp_path: Path) -> None:
    run = _run(tmp_path, _PRECOMPILE_THEN_LAUNCH)
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout + run.stderr[-4000:]
    n = int(run.stdout.split()[1])
    # progress: one line per compiled variant, then the summary
    lines = run.stderr.strip().splitlines()
    assert len(lines) == n + 1 and lines[0].startswith(f"[1/{n}] cuda:90 mori.shmem.kernels.put_kernel"), (
        lines
    )
    assert all(" compiled " in line for line in lines[:-1]), lines
    assert lines[-1].startswith(f"mori.jit.precompile: {n} kernel variants for cuda:90"), lines[-1]
    assert f" {n} compiled, 0 cached, 0 skipped, 0 failed" in lines[-1], lines[-1]


def test_mori_precompile_runs_at_import(tmp_path: Path) -> None:
    run = _run(tmp_path, _PRECOMPILE_AT_IMPORT)
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout + run.stderr[-3000:]
    assert "mori.jit.precompile: no GPU here" in run.stderr, run.stderr


def test_precompile_twice_compiles_nothing_and_skips_ir_kernels(tmp_path: Path, monkeypatch: Any) -> None:
    """In this process: explicit targets and kernels; the second run finds everything cached;
    kernels that call mori.ir.triton are skipped with the reason."""
    import io

    from mori.core.errors import MoriValueError
    from mori.jit import find_kernels, kernels_in, precompile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    found = [k for k in find_kernels() if k.module == "mori.shmem.kernels" and k.name == "barrier_kernel"]
    assert len(found) == 1 and not found[0].skip
    spec = importlib.util.spec_from_file_location(
        "mori_test_ir_kernels_jit", Path(__file__).with_name("_ir_kernels.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ir = {k.name: k for k in kernels_in(module)}
    assert ir["basic_kernel"].skip.startswith("calls mori.ir.triton") and ir["exp_kernel"].skip == ""

    kernels = [*found, ir["basic_kernel"]]
    out = io.StringIO()
    first = precompile(["hip:gfx942"], kernels=kernels, progress=out)
    assert (first.count("compiled"), first.count("skipped"), first.count("failed")) == (1, 1, 0), (
        out.getvalue()
    )
    assert first.ok and first.cache_dir == tmp_path / "cache"
    files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    second = precompile(["hip:gfx942"], kernels=kernels, progress=None)
    assert (second.count("compiled"), second.count("cached")) == (0, 1)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == files
    with pytest.raises(MoriValueError, match="target"):
        precompile(["sm_90"], kernels=kernels, progress=None)
    with pytest.raises(MoriValueError, match="targets"):
        precompile([], kernels=kernels, progress=None)


def test_parse_target() -> None:
    from mori.core.errors import MoriValueError
    from mori.jit import TARGETS, parse_target

    assert [(t.backend, t.arch, t.warp_size) for t in map(parse_target, TARGETS)] == [
        ("cuda", 90, 32),
        ("cuda", 100, 32),
        ("hip", "gfx942", 64),
        ("hip", "gfx950", 64),
    ]
    assert parse_target("hip:gfx1250").warp_size == 32
    for bad in ("cuda", "cuda:sm90", "rocm:gfx942", "hip:942", 90):
        with pytest.raises(MoriValueError, match="target"):
            parse_target(bad)


def test_cache_dir_and_mori_jit_cache_dir(tmp_path: Path) -> None:
    """MORI_JIT_CACHE_DIR becomes Triton's cache directory at `import mori` (for child processes too),
    unless TRITON_CACHE_DIR is set, which wins."""
    mine = tmp_path / "mine"
    show = "import os, mori, mori.jit; print(os.environ.get('TRITON_CACHE_DIR'), mori.jit.cache_dir())"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "MORI_"))}
    env["MORI_JIT_CACHE_DIR"] = str(mine)
    for triton_dir, want in ((None, mine), (tmp_path / "theirs", tmp_path / "theirs")):
        if triton_dir is not None:
            env["TRITON_CACHE_DIR"] = str(triton_dir)
        run = subprocess.run(
            [sys.executable, "-c", show], capture_output=True, text=True, timeout=120, env=env
        )
        assert run.returncode == 0 and run.stdout.split() == [str(want)] * 2, run.stdout + run.stderr


def test_env_vars_are_listed_and_checked(capsys: Any, monkeypatch: Any) -> None:
    from mori.core.cli import main

    monkeypatch.setenv("MORI_DISABLE_JIT", "sometimes")
    assert main(["env"]) == 1
    out = capsys.readouterr().out
    for name in ("MORI_PRECOMPILE", "MORI_JIT_CACHE_DIR", "MORI_DISABLE_JIT"):
        assert name in out
    assert "MORI_DISABLE_JIT='sometimes'  INVALID" in out


def test_bad_setting_does_not_break_import() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "MORI_"))}
    env["MORI_PRECOMPILE"] = "maybe"
    run = subprocess.run(
        [sys.executable, "-c", "import mori; print('imported')"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert run.returncode == 0 and run.stdout.strip() == "imported", run.stderr
    assert "MORI_PRECOMPILE='maybe' is not valid" in run.stderr


def test_mori_jit_command(capsys: Any, tmp_path: Path, monkeypatch: Any) -> None:
    from mori.core.cli import main

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    (tmp_path / "abc").mkdir()
    (tmp_path / "abc" / "k.cubin").write_bytes(b"x" * 2048)
    assert main(["jit", "cache"]) == 0
    assert f"{tmp_path}: 1 compiled kernels" in capsys.readouterr().out
    assert main(["jit", "precompile", "--targets", "cuda:sm90"]) == 1
    assert "target='cuda:sm90' is not allowed" in capsys.readouterr().err


def _gpu() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu  # any vendor: the target is whatever Triton's active driver reports
@pytest.mark.skipif(not _gpu(), reason="needs a GPU (torch.cuda.is_available() is False)")
def test_precompile_for_this_gpu_is_what_a_real_launch_loads(tmp_path: Path) -> None:
    """On a GPU: precompile() picks this GPU's target, and a real launch of a precompiled variant
    (Triton's own driver) compiles nothing."""
    body = """
driver.reset_active()  # the real GPU driver, not the prelude's stand-in
os.environ["MORI_PRECOMPILE"] = "0"
from mori.jit import find_kernels, precompile
from mori.shmem.kernels import barrier_kernel
kernels = [k for k in find_kernels() if k.name == "barrier_kernel"]
report = precompile(kernels=kernels, progress=None)
target = driver.active.get_current_target()
assert report.targets == [f"{target.backend}:{target.arch}"] and report.count("compiled") == 1, report.summary()
n, before = len(entries()), contents()
heap = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda")  # a one-PE "heap" with the barrier words
ctx = torch.tensor([0, 1, heap.data_ptr()], dtype=torch.int64, device="cuda")
barrier_kernel[(1,)](ctx)  # a real launch: a barrier of one PE
torch.cuda.synchronize()
new = {d: f for d, f in contents().items() if d not in before}
assert len(entries()) == n, f"the launch compiled its kernel again: {new}"
print("ok")
"""
    run = _run(tmp_path, body)
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout + run.stderr[-3000:]

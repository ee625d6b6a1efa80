"""The examples the README and the guides point to run as written, on CPU ranks.

``examples/*_torchrun.py`` under ``torchrun --standalone --nproc-per-node 2`` (the README's GPU
quickstart, here on the ``cpu`` runtime), and ``docs/examples/shmem_ring.py`` as a plain script.
Each must exit 0 and print what every rank checked.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(argv: list[str], tmp_path: Path, heap: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MORI_", "TRITON_"))}
    env.update({"MORI_DEVICE_RUNTIME": "cpu", "MORI_BOOTSTRAP_TIMEOUT": "120", "OMP_NUM_THREADS": "1"})
    if heap:
        env["MORI_SHMEM_HEAP_SIZE"] = heap
    res = subprocess.run(
        argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert res.returncode == 0, f"{' '.join(argv)} exited {res.returncode}:\n{res.stdout}\n{res.stderr}"
    return res.stdout


def _torchrun(script: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script]


@pytest.mark.slow
def test_shmem_torchrun_example(tmp_path: Path) -> None:
    out = _run(_torchrun(str(ROOT / "examples" / "shmem_torchrun.py")), tmp_path)
    for rank, left in ((0, 1), (1, 0)):
        assert f"rank {rank}/2 (cpu): got rank {left}'s 8192 bytes after its signal" in out


@pytest.mark.slow
def test_ep_torchrun_example(tmp_path: Path) -> None:
    out = _run(_torchrun(str(ROOT / "examples" / "ep_torchrun.py")), tmp_path)
    for rank in (0, 1):
        assert f"rank {rank}/2 (cpu): sent 64 tokens, received" in out and "combine checked" in out


@pytest.mark.slow
def test_shmem_ring_docs_example(tmp_path: Path) -> None:
    out = _run([sys.executable, str(ROOT / "docs" / "examples" / "shmem_ring.py")], tmp_path)
    assert sum(f"PE {pe}/4: received PE {(pe - 1) % 4}'s message" in out for pe in range(4)) == 4


@pytest.mark.slow
def test_the_readme_shmem_snippet_runs_under_torchrun(tmp_path: Path) -> None:
    # the README's only Python block, as written, on 2 CPU ranks
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    assert len(blocks) == 1, f"expected one python block in the README, found {len(blocks)}"
    script = tmp_path / "readme_snippet.py"
    script.write_text(blocks[0] + 'print(f"rank {me}: done", flush=True)\n', encoding="utf-8")
    out = _run(_torchrun(str(script)), tmp_path, heap="64M")
    assert "rank 0: done" in out and "rank 1: done" in out

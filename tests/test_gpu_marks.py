"""A GPU test says which GPUs it needs: ``gpu`` (any vendor) unless it is truly NVIDIA-only.

The ``cuda`` marker keeps a test off AMD machines (the noxfile's tests-rocm session selects ``rocm
or gpu``), so a test file under ``packages/*/tests`` or ``backends/*/tests`` that marks one with
``pytest.mark.cuda`` says why on the same line, in a comment (CUDA IPC specifics, ucx's CUDA memory
support, cupy, ...). The vendor backends' own tests (``backends/nvlink``, ``backends/xgmi``) are
vendor-specific by nature and are not judged. A vendor-neutral GPU test is marked ``gpu`` and takes
the runtime from :func:`mori.testing.gpu_shmem.machine_gpu_runtime`.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENDOR_BACKENDS = {"nvlink", "xgmi"}
MARK = re.compile(r"\bpytest\.mark\.cuda\b")


def _test_files() -> list[Path]:
    files = sorted(ROOT.glob("packages/*/tests/**/*.py")) + sorted(ROOT.glob("backends/*/tests/**/*.py"))
    return [f for f in files if not _vendor(f)]


def _vendor(path: Path) -> bool:
    rel = path.relative_to(ROOT).parts
    return rel[0] == "backends" and rel[1] in VENDOR_BACKENDS


def _unjustified(text: str) -> list[tuple[int, str]]:
    """The lines of ``text`` that use ``pytest.mark.cuda`` with no comment after the mark."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        m = MARK.search(line)
        if m and not line[m.end() :].split("#", 1)[1:]:
            found.append((n, line.strip()))
    return found


def test_the_check_sees_a_missing_reason() -> None:
    assert _unjustified("@pytest.mark.cuda\ndef test_x(): ...") == [(1, "@pytest.mark.cuda")]
    assert _unjustified("pytestmark = pytest.mark.cuda") == [(1, "pytestmark = pytest.mark.cuda")]
    assert _unjustified("@pytest.mark.cuda  # NVIDIA only: CUDA IPC handles") == []
    assert _unjustified("@pytest.mark.gpu\ndef test_y(): ...") == []


def test_every_cuda_mark_outside_the_vendor_backends_says_why() -> None:
    files = _test_files()
    assert any("mori-core" in f.parts for f in files), "no test file found: the globs are wrong"
    bad = [
        f"{f.relative_to(ROOT)}:{n}: {line}"
        for f in files
        for n, line in _unjustified(f.read_text(encoding="utf-8"))
    ]
    assert not bad, (
        "pytest.mark.cuda keeps these tests off AMD GPUs; mark a vendor-neutral test gpu (runtime from "
        "mori.testing.gpu_shmem.machine_gpu_runtime()), or say on the same line why it is NVIDIA-only:\n"
        + "\n".join(bad)
    )

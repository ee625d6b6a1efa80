"""mori.core.relaunch: a kernel relaunched from its cached compiled form computes what a plain
Triton launch computes, for every specialisation Triton would make (ints equal to 1 or multiples
of 16, pointers aligned to 16 bytes or not), and the launcher names a missing argument."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from mori.testing import load_module_file, run_ranks

pytest.importorskip("triton")


def _relaunch(rank: int, world: int, device: str) -> int:
    from mori.core.relaunch import Relaunch

    kernels = load_module_file("mori_test_relaunch_kernels", Path(__file__).with_name("_relaunch_kernels.py"))
    launch = Relaunch(kernels.shift_kernel)
    dev = torch.device(device)
    base = torch.arange(200, dtype=torch.float32, device=dev)
    out = torch.zeros(200, dtype=torch.float32, device=dev)
    # n = 1, 16, 17, 64, 100; offsets 0 (aligned) and 1 (4 bytes: not 16-aligned); add 1, 16, 3;
    # BLOCK 64 and 128 (a constexpr: keyed by its value, never by its divisibility)
    for n, off, add, block in itertools.product((1, 16, 17, 64, 100), (0, 1, 0), (1, 16, 3), (64, 128)):
        out.zero_()
        launch((-(-n // block),), base[off : off + n], out[off : off + n], n, add, BLOCK=block, num_warps=1)
        want = base[off : off + n] + add
        assert torch.equal(out[off : off + n].cpu(), want.cpu()), (n, off, add, block)
        assert int((out != 0).sum()) <= n, "stored past n"
    with pytest.raises(TypeError, match="BLOCK"):
        launch((1,), base, out, 1, 1)
    if dev.type == "cuda":  # tensors go to the launcher as addresses: a host tensor is refused first
        with pytest.raises(ValueError, match="argument 0 is on cpu, not a GPU"):
            launch((1,), base.cpu(), out, 1, 1, BLOCK=64, num_warps=1)
    return len(launch._compiled)


def test_relaunch_under_the_interpreter() -> None:
    assert run_ranks(_relaunch, 1, "cpu", env={"TRITON_INTERPRET": "1"}, timeout=120) == [0]


@pytest.mark.gpu
def test_relaunch_on_a_gpu_caches_one_kernel_per_specialisation() -> None:
    if not torch.cuda.is_available():
        pytest.skip(f"needs a GPU: torch {torch.__version__} sees none")
    (compiled,) = run_ranks(_relaunch, 1, "cuda", env={"TRITON_INTERPRET": "0"}, timeout=300)
    # n: 1 / multiple of 16 / other; add: 1 / 16 / other; two alignments of x and y; two BLOCKs
    assert 8 <= compiled <= 36

"""The device helpers compiled, on one GPU (marked ``gpu``; skipped where torch sees none): the
timer instruction of the target, what the rings hold, clock pairs by ping, a CUDA graph of traced
launches, and an export. ``nox -s tests-cuda`` / ``tests-rocm`` run it."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

# (find_spec, not importorskip: spawned ranks import this module before they set TRITON_INTERPRET,
# and Triton chooses the interpreter for its own jitted helpers, such as tl.cdiv, when it is imported)
if importlib.util.find_spec("triton") is None:
    pytest.skip("the device helpers need Triton", allow_module_level=True)


def _gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _on_one_gpu(rank: int, n: int, out_dir: str) -> dict[str, Any]:
    import numpy as np
    import torch

    from mori import viz
    from mori.viz import examples as ex

    dev = torch.device("cuda", 0)
    buf = viz.TraceBuffer(n_rings=8, capacity=1024, device=dev)
    pair = buf.clock_pairs[0]
    assert pair.method == "ping", f"pinned-memory ping did not work here: {pair}"
    assert pair.error_ns < 100_000, f"ping bracket of {pair.error_ns} ns"

    n_el = 8 * ex.COPY_BLOCK * 3
    src = torch.arange(n_el, dtype=torch.int32, device=dev)
    dst = torch.zeros_like(src)
    g = torch.cuda.CUDAGraph()
    ex.phased_copy_kernel[(8,)](dst, src, n_el, buf.tensor, TRACE=True, PER_CHUNK=True, BLOCK=ex.COPY_BLOCK)
    torch.cuda.synchronize()
    buf.reset()
    with torch.cuda.graph(g):
        for _ in range(3):
            ex.phased_copy_kernel[(8,)](
                dst, src, n_el, buf.tensor, TRACE=True, PER_CHUNK=True, BLOCK=ex.COPY_BLOCK
            )
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(dst, src)
    data = buf.read()
    per_launch = 6 + 2 * 3
    assert data.written.tolist() == [6 * per_launch] * 8, "2 replays x 3 launches per program"
    for r in range(8):
        ev = data.events[data.events["ring"] == r]
        assert (np.diff(ev["ts"]) >= 0).all()
        assert ev["launch"].tolist() == [i // per_launch for i in range(6 * per_launch)]
    trace = viz.capture([buf], host=False)
    assert len(trace.sources[0].clock_pairs) == 2
    report = viz.export_to_perfetto(trace, Path(out_dir) / "gpu.json")  # JSON: no perfetto package needed
    # per program and launch: kernel, split, copy and 3 chunks
    return {"spans": report.spans, "dropped": report.orphans_dropped, "pair": pair.to_json()}


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu(), reason="needs a GPU (torch.cuda.is_available() is False)")
def test_traced_kernels_on_one_gpu(tmp_path: Path) -> None:
    from mori.testing import run_ranks

    (res,) = run_ranks(_on_one_gpu, 1, str(tmp_path), timeout=300.0, env={"TRITON_INTERPRET": "0"})
    assert res["spans"] == 8 * 6 * 6 and res["dropped"] == 0, res

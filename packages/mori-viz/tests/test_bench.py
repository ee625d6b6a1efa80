"""``mori bench viz`` runs end to end on the CPU (the Triton interpreter; tiny sizes): both
variants of every example kernel give the same output, the traced ones record exactly the
expected events (the bench checks that itself and fails otherwise), and the record and trace are
written. Its timings on the interpreter mean nothing and are not looked at."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

# (find_spec, not importorskip: spawned ranks import this module before they set TRITON_INTERPRET,
# and Triton chooses the interpreter for its own jitted helpers, such as tl.cdiv, when it is imported)
if importlib.util.find_spec("triton") is None:
    pytest.skip("the example kernels need Triton", allow_module_level=True)

from mori.core import cli as mori_cli


def test_bench_viz_runs_on_the_interpreter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "viz", "--device", "cpu", "--mib", "0.0625", "--programs", "2", "--events", "4"]
    args += [
        "--iters",
        "1",
        "--warmup",
        "0",
        "--trace",
        str(tmp_path / "t"),
        "--json",
        str(tmp_path / "r.json"),
    ]
    assert mori_cli.main(args) == 0
    out = capsys.readouterr().out
    assert "Triton interpreter" in out and "clock pair: same-clock" in out
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [r["case"] for r in rows] == ["copy/phases", "copy/chunks", "record"]
    # 64 KiB = 16384 int32 by 2 programs of 2 chunks of 4096: 6 events each, + 2 per chunk
    assert [r["events_per_launch"] for r in rows] == [12, 12 + 2 * 2 * 2, 8]
    assert (tmp_path / "t" / "rank0.mviz.npz").is_file()
    doc = json.loads((tmp_path / "t" / "viz-bench.json").read_text())
    assert {e["name"] for e in doc["traceEvents"] if e["ph"] == "X"} >= {"kernel", "split", "copy", "chunk"}

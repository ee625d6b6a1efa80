"""``mori bench cco`` runs end to end on CPU ranks (tiny sizes), and its formulas are nccl-tests'."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mori.ccl.bench import busbw_factor
from mori.core.errors import MoriValueError


def test_busbw_factors_are_the_nccl_tests_formulas() -> None:
    assert busbw_factor("allreduce", 4) == pytest.approx(1.5)
    assert busbw_factor("allreduce", 8) == pytest.approx(1.75)
    assert busbw_factor("allgather", 4) == pytest.approx(0.75)
    assert busbw_factor("alltoall", 2) == pytest.approx(0.5)


def test_mori_bench_cco_writes_a_record_with_the_baseline(tmp_path: Path) -> None:
    out = tmp_path / "cco.json"
    cmd = [sys.executable, "-m", "mori.core.cli", "bench", "cco", "--ranks", "2", "--sizes", "4K,2M"]
    cmd += ["--iters", "2", "--warmup", "0", "--target-ms", "1", "--json", str(out), "--plot", "none"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "busbw" in res.stdout and "xgloo" in res.stdout and "#wrong" in res.stdout
    record = json.loads(out.read_text())
    assert record["suite"] == "cco" and record["config"]["ranks"] == 2
    rows = record["rows"]
    assert {(r["collective"], r["size"]) for r in rows} == {
        (c, s) for c in ("allreduce", "allgather", "alltoall") for s in (4096, 2 << 20)
    }
    for r in rows:
        assert r["wrong"] == 0 and r["mori"]["time_us"] > 0 and r["baselines"]["gloo"]["time_us"] > 0
        assert r["mori"]["busbw"] == pytest.approx(r["mori"]["algbw"] * busbw_factor(r["collective"], 2))
    paths = {r["path"] for r in rows}
    assert {"host:oneshot", "host:rsag", "host:small", "host:large"} <= paths


def test_bench_rejects_sizes_it_cannot_split() -> None:
    import argparse

    from mori.ccl import bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    with pytest.raises(MoriValueError, match="multiples of 8 bytes for allgather with 2 ranks"):
        bench.run(p.parse_args(["--ranks", "2", "--sizes", "4100"]))


def test_mori_bench_cco_trace_writes_per_rank_traces(tmp_path: Path) -> None:
    # --trace under the interpreter: every size's checked call of the Triton kernels, per rank
    import os

    from mori import viz

    cmd = [sys.executable, "-m", "mori.core.cli", "bench", "cco", "--ranks", "2", "--sizes", "4K,64K"]
    cmd += ["--collectives", "allreduce", "--impl", "triton", "--iters", "1", "--warmup", "0"]
    cmd += ["--target-ms", "1", "--no-baseline", "--json", str(tmp_path / "cco.json"), "--plot", "none"]
    cmd += ["--trace", str(tmp_path / "tr")]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    traces = viz.load_traces(tmp_path / "tr" / "allreduce")
    assert [t.rank for t in traces] == [0, 1]
    from mori.viz.timeline import build_timeline

    tl = build_timeline(traces)
    names = {tl.slot_label(s.slot) for s in tl.spans}
    # both sizes are under the one-shot limit: the one-shot kernel's phases, on both ranks
    assert {("stage", "ccl.allreduce"), ("ready", "ccl.allreduce"), ("reduce", "ccl.allreduce")} <= names
    assert {tl.tracks[s.track].rank for s in tl.spans} == {0, 1}

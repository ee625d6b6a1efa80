"""`mori bench umbp` runs end to end at a tiny size and writes a record with every figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_bench_umbp_smoke(tmp_path: Path) -> None:
    out = tmp_path / "umbp.json"
    res = subprocess.run(
        [sys.executable, "-m", "mori.core.cli", "bench", "umbp", "--count", "8", "--size", "64K", "--ssd-count", "4",
         "--batches", "1,4", "--reps", "1", "--master", "inmemory", "--ops", "match,ping", "--seconds", "0.3",
         "--procs", "1", "--threads", "1,4", "--hashes", "200", "--ssd-dir", str(tmp_path / "ssd"), "--json", str(out)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    rec = json.loads(out.read_text())
    rows = rec["rows"]
    dram = [r for r in rows if r.get("tier") == "dram"]
    ssd = [r for r in rows if r.get("tier") == "ssd"]
    master = [r for r in rows if "op" in r]
    assert [r["batch"] for r in dram] == [1, 4] and all(r["verified"] for r in dram)
    assert {(r["durability"], r["batch"]) for r in ssd} == {
        ("strict", 1),
        ("strict", 4),
        ("relaxed", 1),
        ("relaxed", 4),
    }
    assert all(r["put_gbps"]["median"] > 0 and r["memcpy_gbps"]["median"] > 0 for r in dram)
    assert {(r["op"], r["threads"]) for r in master} == {("match", 1), ("match", 4), ("ping", 1), ("ping", 4)}
    assert all(r["ops_per_s"]["median"] > 0 for r in master)
    assert "memcpy" in res.stdout and "ops/s" in res.stdout

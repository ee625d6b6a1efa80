"""MORI_EP_LAUNCH_CONFIG_MODE=AUTO tables: rule and file matching, fallbacks that say so, and the
table writer of tools/ep_tune.py (keep-best merge) on synthetic bench records."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from mori.ep import tuning

TOOL = Path(__file__).resolve().parents[3] / "tools" / "ep_tune.py"


def _rule(tokens: int, hidden: int, topk: int | None, blocks: int, **kw: Any) -> dict[str, Any]:
    r = {
        "dtype": "bfloat16",
        "num_tokens": tokens,
        "hidden_dim": hidden,
        "block_num": blocks,
        "warp_per_block": 16,
    }
    if topk is not None:
        r["topk"] = topk
    r.update(kw)
    return r


@pytest.fixture
def tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tuning, "TABLES", tmp_path)
    monkeypatch.setenv("MORI_EP_LAUNCH_CONFIG_MODE", "AUTO")
    monkeypatch.delenv("MORI_EP_TUNING_CONFIG", raising=False)
    tuning._load.cache_clear()
    tuning._said.clear()
    return tmp_path


def _write(path: Path, rules: list[dict[str, Any]]) -> None:
    path.write_text(json.dumps({"about": "test", "rules": rules}))


def _lookup(**kw: Any) -> tuning.LaunchRule | None:
    args: dict[str, Any] = dict(
        arch="sm90",
        model="H200",
        kernel="IntraNode",
        world=2,
        phase="dispatch",
        dtype="bfloat16",
        num_tokens=100,
        hidden_dim=7168,
        topk=8,
    )
    args.update(kw)
    return tuning.lookup(**args)


def test_rule_matching(tables: Path) -> None:
    _write(
        tables / "sm90_H200_IntraNode_ep2_dispatch.json",
        [
            _rule(128, 7168, 8, 80),
            _rule(128, 7168, 6, 60),
            _rule(128, 4096, 8, 40),
            _rule(4096, 7168, 8, 132, tile_elems=16384),
            _rule(128, 7168, 8, 10, dtype="float8_e4m3fn"),
        ],
    )
    assert _lookup().block_num == 80  # smallest ceiling >= 100 tokens, exact hidden and topk
    assert _lookup(topk=6).block_num == 60
    assert _lookup(topk=9).block_num == 80  # nearest topk
    assert _lookup(hidden_dim=5120).block_num == 40  # nearest hidden (4096), then topk 8
    rule = _lookup(num_tokens=9000)  # past every ceiling: the largest
    assert rule is not None and (rule.block_num, rule.tile_elems) == (132, 16384)
    assert "4096 tokens, hidden 7168, topk 8" in rule.source
    assert _lookup(dtype="float8_e4m3fn").block_num == 10
    assert _lookup(topk=None).block_num == 80


def test_combine_keys_and_quant_stand_in(tables: Path, caplog: pytest.LogCaptureFixture) -> None:
    _write(
        tables / "sm90_H200_IntraNode_ep2_combine.json",
        [
            _rule(4096, 7168, None, 100, zero_copy=False),
            _rule(4096, 7168, None, 120, zero_copy=True),
            _rule(4096, 7168, None, 50, zero_copy=False, quant_type="fp8_blockwise"),
            _rule(4096, 7168, None, 7, phase="dispatch"),  # another phase's rule is ignored
        ],
    )
    assert _lookup(phase="combine").block_num == 100
    assert _lookup(phase="combine", zero_copy=True).block_num == 120
    assert _lookup(phase="combine", quant_type="fp8_blockwise").block_num == 50
    with caplog.at_level(logging.WARNING, logger="mori.ep.tuning"):
        assert _lookup(phase="combine", quant_type="fp4_blockwise").block_num == 100
    assert "no quant_type=fp4_blockwise rule; using its quant_type=none rules" in caplog.text


def test_file_fallbacks_say_so(tables: Path, caplog: pytest.LogCaptureFixture) -> None:
    _write(tables / "sm90_H100_IntraNode_ep2_dispatch.json", [_rule(4096, 7168, 8, 11)])
    _write(tables / "sm90_H200_IntraNode_ep8_dispatch.json", [_rule(4096, 7168, 8, 88)])
    _write(tables / "sm90_H200_IntraNode_ep2_dispatch.json", [_rule(4096, 7168, 8, 22)])
    with caplog.at_level(logging.WARNING, logger="mori.ep.tuning"):
        assert _lookup().block_num == 22  # exact: nothing said
        assert caplog.text == ""
        assert _lookup(model="H20").block_num == 11  # same arch, same EP size, another model
        assert (
            "uses sm90_H100_IntraNode_ep2_dispatch.json (another sm90 model (H20 has no table))"
            in caplog.text
        )
        assert _lookup(world=6).block_num == 88  # H200's nearest EP size
        assert "ep6 dispatch uses sm90_H200_IntraNode_ep8_dispatch.json (the nearest EP size" in caplog.text
        assert _lookup(world=4).block_num == 22  # (a tie, 2 and 8: by file name)
        assert _lookup(world=16).block_num == 88
        assert _lookup(arch="sm100") is None  # nothing for the arch: the config's values
        assert "no tuned table for sm100 H200 IntraNode ep2 dispatch" in caplog.text
        assert _lookup(dtype="float16") is None
        assert "has no rule for dispatch float16" in caplog.text
    n = caplog.text.count("no tuned table for sm100")
    _lookup(arch="sm100")
    assert caplog.text.count("no tuned table for sm100") == n, "said once"


def test_manual_mode_ignores_tables(tables: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(tables / "sm90_H200_IntraNode_ep2_dispatch.json", [_rule(4096, 7168, 8, 22)])
    monkeypatch.setenv("MORI_EP_LAUNCH_CONFIG_MODE", "MANUAL")
    assert _lookup() is None


def test_shipped_tables_load() -> None:
    for path in sorted(tuning.TABLES.glob("*.json")):
        rules = json.loads(path.read_text())["rules"]
        assert rules and all(
            {"dtype", "num_tokens", "block_num", "warp_per_block"} <= set(r) for r in rules
        ), path


def _tool() -> Any:
    spec = importlib.util.spec_from_file_location("ep_tune", TOOL)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _record(warps: int, lat: dict[tuple[str, int, int], float], zero_copy: bool = False) -> dict[str, Any]:
    rows = []
    for (phase, tokens, sms), us in lat.items():
        for dd in ("bf16", "fp8"):
            rows.append(
                {
                    "phase": phase,
                    "tokens": tokens,
                    "dispatch_dtype": dd,
                    "sms": sms,
                    "verified": True,
                    "latency_us": {"median": us + (1 if dd == "fp8" else 0)},
                    "gbps_original": 100.0,
                }
            )
    tune = {
        "hidden": 7168,
        "topk": 8,
        "warps": warps,
        "tile_d": 16384,
        "tile_c": 32768,
        "zero_copy": zero_copy,
    }
    return {"tune": tune, "rows": rows}


def test_tune_keeps_the_fastest(tmp_path: Path) -> None:
    tool = _tool()
    a = _record(16, {("dispatch", 128, 32): 20.0, ("dispatch", 128, 64): 15.0, ("combine", 128, 32): 30.0})
    b = _record(8, {("dispatch", 128, 32): 14.0, ("combine", 128, 32): 40.0})
    best = tool.best_rules([a, b])
    d = best["dispatch"][("bfloat16", False, 128, 7168, 8)]
    assert (d["block_num"], d["warp_per_block"], d["latency_us"]) == (32, 8, 14.0)
    assert best["dispatch"][("float8_e4m3fn", False, 128, 7168, 8)]["latency_us"] == 15.0
    c = best["combine"][("bfloat16", False, 128, 7168, 8)]
    assert (c["block_num"], c["warp_per_block"], c["tile_elems"], c["zero_copy"]) == (32, 16, 32768, False)
    # keep-best merge with an existing table: a slower new rule does not replace a faster one
    path = tmp_path / "t.json"
    _write(path, [{**d, "latency_us": 10.0, "block_num": 99}])
    tool.merge(path, best["dispatch"], "about", replace=False)
    rules = {(r["dtype"], r["num_tokens"]): r for r in json.loads(path.read_text())["rules"]}
    assert rules[("bfloat16", 128)]["block_num"] == 99 and rules[("float8_e4m3fn", 128)]["block_num"] == 32
    tool.merge(path, best["dispatch"], "about", replace=True)
    rules = {(r["dtype"], r["num_tokens"]): r for r in json.loads(path.read_text())["rules"]}
    assert rules[("bfloat16", 128)]["block_num"] == 32, "--replace drops the old rule"
    # the merged table is one the lookup reads
    tuning._load.cache_clear()
    assert tuning._load(str(path))

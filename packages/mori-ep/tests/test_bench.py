"""``mori bench ep``: the bandwidth formulas, the all_to_all_single baseline, a tiny CPU run, bad options.

The baseline must be a real dispatch/combine (it is what our figures are divided by), so it is
checked row by row against the pure-torch reference on 3 gloo ranks.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

from mori.core import cli
from mori.core.launch import run_ranks
from mori.ep import bench, bench_a2a
from mori.ep.reference import dest_ranks, reference_combine

# -- formulas -------------------------------------------------------------------------------------------

#: 2 ranks, 4 experts (2 per rank), top-2, hidden 256; -1 = no expert
ROUTING = [
    torch.tensor([[0, 1], [0, 2], [3, -1], [2, 3]], dtype=torch.int32),  # dest {0}, {0,1}, {1}, {1}
    torch.tensor([[1, 2], [-1, -1], [3, 2]], dtype=torch.int32),  # dest {0,1}, {}, {1}
]


def test_recv_rows_counts_token_destination_pairs_including_local() -> None:
    # rank 0 gets r0 t0, t1 and r1 t0 = 3; rank 1 gets r0 t1, t2, t3 and r1 t0, t2 = 5
    assert bench.recv_rows(ROUTING, 2) == [3, 5]


def test_bandwidth_formulas_equal_hand_computed_values() -> None:
    h = 256
    assert bench.bytes_original(5, h, 2) == 5 * 256 * 2 == 2560  # bf16
    assert bench.bytes_original(5, h, 1) == 1280  # fp8: scales not counted
    assert bench.bytes_deepep(5, h, "dispatch", "bf16") == 2560
    # fp8 with hidden/128 = 2 fp32 scales: 5 * (256 + 8); DeepEP writes it bf16 bytes * (1 + 4/128) / 2
    assert bench.bytes_deepep(5, h, "dispatch", "fp8", 2) == 1320 == 2560 * (1 + 4 / 128) / 2
    assert bench.bytes_deepep(5, h, "combine", "fp8", 2) == 2560  # combine: its dispatch's bytes in bf16
    assert bench.gbps(2560, 1e-6) == pytest.approx(2.56)
    with pytest.raises(ValueError, match="dtype='fp16'"):
        bench.bytes_deepep(5, h, "dispatch", "fp16")


def _fake_case(rank: int, dtype: str, samples: dict[str, list[float]], base: dict[str, list[float]]) -> Any:
    def m(s: list[float]) -> dict[str, Any]:
        return {"samples": s, "mode": "test"}

    return {
        "tokens": 4,
        "dtype": dtype,
        "scale_dim": 2 if dtype == "fp8" else 0,
        "recv_rows": [3, 5][rank],
        "verified": True,
        "ours": [{"sms": 24, "dispatch": m(samples["dispatch"]), "combine": m(samples["combine"])}],
        "baseline": {
            "verified": True,
            "dispatch": m(base["dispatch"]),
            "dispatch_cached": m(base["dispatch"]),
            "combine": m(base["combine"]),
        },
    }


def test_rows_from_known_routing_and_times() -> None:
    """The row builder: slowest-rank samples, per-rank bandwidth by both formulas, mean, ratio."""
    spec = {"hidden": 256, "topk": 2, "sms": [24], "warps": -1, "kernel_type": "IntraNode", "ranks": 2}
    spec["device"] = "cpu"
    us = 1e-6
    r0 = {"dispatch": [1 * us, 3 * us, 2 * us], "combine": [4 * us, 4 * us, 4 * us]}
    r1 = {"dispatch": [2 * us, 1 * us, 2 * us], "combine": [2 * us, 2 * us, 2 * us]}
    base = {"dispatch": [8 * us] * 3, "combine": [16 * us] * 3}
    results = [
        {"device_name": "t", "torch": "t", "cases": [_fake_case(r, "fp8", s, base)]}
        for r, s in enumerate((r0, r1))
    ]
    rows = bench._rows(spec, results)
    disp, comb = rows
    assert (disp["phase"], disp["dtype"], comb["dtype"]) == ("dispatch", "fp8", "bf16")
    assert disp["samples_us"] == pytest.approx([2, 3, 2])  # the slowest rank's, per measurement
    assert disp["latency_us"]["median"] == pytest.approx(2)
    # per-rank medians 2 us and 2 us; rows 3 and 5; fp8: 1 B per element, DeepEP adds 2 scales x 4 B
    assert disp["bytes_original_per_rank"] == [768, 1280]
    assert disp["bytes_deepep_per_rank"] == [792, 1320]
    assert disp["gbps_original"] == pytest.approx((768 / 2e-6 + 1280 / 2e-6) / 2 / 1e9)
    assert disp["gbps_deepep"] == pytest.approx((792 / 2e-6 + 1320 / 2e-6) / 2 / 1e9)
    # combine: bf16 rows, rank medians 4 us and 2 us
    assert comb["bytes_deepep_per_rank"] == comb["bytes_original_per_rank"] == [1536, 2560]
    assert comb["gbps_deepep"] == pytest.approx((1536 / 4e-6 + 2560 / 2e-6) / 2 / 1e9)
    assert disp["ratio"] == pytest.approx(4.0) and comb["ratio"] == pytest.approx(4.0)
    assert disp["baseline"]["cached"]["latency_us"]["median"] == pytest.approx(8)
    assert disp["original_ll_scale"] == pytest.approx([4 * 2 / 3, 4 * 2 / 5])


def test_plot_is_drawn_or_skipped_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = {"hidden": 256, "topk": 2, "sms": [-1], "warps": -1, "kernel_type": "IntraNode", "ranks": 2}
    spec["device"] = "cpu"
    times = {"dispatch": [1e-6, 2e-6], "combine": [3e-6, 3e-6]}
    results = [{"cases": [_fake_case(r, "bf16", times, times)]} for r in range(2)]
    path = tmp_path / "ep.png"
    bench._plot(path, bench._rows(spec, results), {"ranks": 2, "device_name": "t", "hidden": 256})
    out = capsys.readouterr().out
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib not installed: no plot" in out and not path.exists()
    else:
        assert path.stat().st_size > 0 and f"wrote {path}" in out


def test_fp8_quantisation_round_trip() -> None:
    x = (torch.randn(5, 256) * 3).to(torch.bfloat16)
    q, s = bench.quantise_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 2) and s.dtype == torch.float32
    torch.testing.assert_close(bench.dequantise_fp8(q, s).float(), x.float(), rtol=0.07, atol=1e-3)


def test_random_routing_is_seeded_distinct_and_in_range() -> None:
    a = bench.random_routing(64, 32, 8, seed=1, rank=0)
    assert a.dtype == torch.int32 and a.shape == (64, 8)
    assert torch.equal(a, bench.random_routing(64, 32, 8, seed=1, rank=0))
    assert not torch.equal(a, bench.random_routing(64, 32, 8, seed=1, rank=1))
    assert all(len(set(row)) == 8 for row in a.tolist()) and int(a.min()) >= 0 and int(a.max()) < 32


# -- the baseline is a real dispatch/combine --------------------------------------------------------------

W, N, H, E_LOCAL, K = 3, 24, 256, 2, 3


def _inputs(src: int, fp8: bool) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(50 + src)
    x = (torch.randn(N, H, generator=gen) * 2).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(W * E_LOCAL, generator=gen)[:K] for _ in range(N)]).to(torch.int32)
    idx[torch.rand(N, K, generator=gen) < 0.25] = -1  # sentinels, some tokens with none
    s = None
    if fp8:
        x, s = bench.quantise_fp8(x)
    return {"x": x, "w": torch.rand(N, K, generator=gen), "s": s, "idx": idx}


def _baseline_rank(rank: int, world: int, port: int) -> bool:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for fp8 in (False, True):
            mine = _inputs(rank, fp8)
            layout, rx, rw, ri, rs = bench_a2a.a2a_dispatch(
                mine["x"], mine["w"], mine["s"], mine["idx"], E_LOCAL
            )
            # expected rows: every source's tokens with an expert here, by source, in token order
            exp_tok = []
            for s in range(world):
                src = _inputs(s, fp8)
                rows = dest_ranks(src["idx"], E_LOCAL, world)[:, rank].nonzero().flatten()
                exp_tok.append({k: None if v is None else v[rows] for k, v in src.items()})
            cat = {
                k: None if exp_tok[0][k] is None else torch.cat([e[k] for e in exp_tok]) for k in exp_tok[0]
            }
            assert torch.equal(rx.view(torch.uint8), cat["x"].view(torch.uint8)), "token rows"
            assert torch.equal(rw, cat["w"]) and torch.equal(ri, cat["idx"]), "weights / expert ids"
            assert (rs is None) == (not fp8) and (rs is None or torch.equal(rs, cat["s"])), "scales"
            # identity experts: combine returns x * U (U = distinct destination ranks)
            y = bench.dequantise_fp8(rx, rs) if rs is not None else rx
            x_ref = bench.dequantise_fp8(mine["x"], mine["s"]) if fp8 else mine["x"]
            want = reference_combine(x_ref, mine["idx"], E_LOCAL, world)
            got = bench_a2a.a2a_combine(y.to(torch.bfloat16), layout, N)
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
            # the cached variant (split sizes known) moves the same rows
            _, rx2, _, _, _ = bench_a2a.a2a_dispatch(
                mine["x"], mine["w"], mine["s"], mine["idx"], E_LOCAL, layout=layout
            )
            assert torch.equal(rx2.view(torch.uint8), rx.view(torch.uint8))
        return True
    finally:
        dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_all_to_all_baseline_dispatch_and_combine_match_the_reference() -> None:
    assert run_ranks(_baseline_rank, W, _port(), timeout=60) == [True] * W


# -- the command ----------------------------------------------------------------------------------------

TINY = ["--tokens", "16", "--hidden", "256", "--experts", "8", "--topk", "4", "--iters", "2", "--warmup", "0"]


def test_cpu_bench_runs_end_to_end_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ep.json"
    rc = cli.main(
        ["bench", "ep", *TINY, "--ranks", "2", "--json", str(path), "--plot", str(tmp_path / "p.png")]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "GB/s orig" in out and "GB/s DeepEP" in out and "gloo a2a us" in out
    assert "ours True, baseline True" in out
    record = json.loads(path.read_text())
    assert record["suite"] == "ep" and "git_sha" in record and "machine" in record
    cfg = record["config"]
    assert (cfg["device"], cfg["ranks"], cfg["tokens"], cfg["hidden"], cfg["dtype"]) == (
        "cpu",
        2,
        [16],
        256,
        ["bf16", "fp8"],
    )
    rows = record["rows"]
    assert [(r["phase"], r["dispatch_dtype"]) for r in rows] == [
        ("dispatch", "bf16"),
        ("combine", "bf16"),
        ("dispatch", "fp8"),
        ("combine", "fp8"),
    ]
    for r in rows:
        assert r["verified"] and r["baseline"]["verified"]
        assert r["latency_us"]["median"] > 0 and r["latency_us"]["n"] == 2 and len(r["samples_us"]) == 2
        assert r["latency_us"]["p10"] <= r["latency_us"]["median"] <= r["latency_us"]["p90"]
        assert r["gbps_original"] > 0 and r["gbps_deepep"] > 0 and r["ratio"] > 0
        assert (
            r["baseline"]["latency_us"]["median"] > 0 and "all_to_all_single (gloo)" in r["baseline"]["name"]
        )
        assert "perf_counter" in r["timing"] and r["sms"] == -1
        elem = 1 if r["dtype"] == "fp8" else 2
        assert r["bytes_original_per_rank"] == [n * 256 * elem for n in r["recv_rows_per_rank"]]
        # every token goes to one rank or both: at least 2 x 16 rows in all, at most 2 x 16 per rank
        assert sum(r["recv_rows_per_rank"]) >= 32 and max(r["recv_rows_per_rank"]) <= 32
    disp_fp8 = rows[2]
    assert disp_fp8["bytes_deepep_per_rank"] == [n * (256 + 2 * 4) for n in disp_fp8["recv_rows_per_rank"]]
    assert "cached" in rows[0]["baseline"]


def test_cpu_bench_on_emulated_nodes_counts_inter_node_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mori.ep.bench import random_routing
    from mori.ep.reference import dest_ranks

    path = tmp_path / "ep.json"
    argv = ["bench", "ep", *TINY, "--dtype", "bf16", "--ranks", "4", "--nodes", "2", "--json", str(path)]
    rc = cli.main([*argv, "--plot", "none"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "InterNodeV1) on 4 ranks in 2 emulated nodes" in out and "ours True, baseline True" in out
    record = json.loads(path.read_text())
    assert record["config"]["nodes"] == 2 and record["config"]["kernel_type"] == "InterNodeV1"
    # a token crosses once per other node with an expert on it (2 ranks per node, 2 experts each)
    idx = [random_routing(16, 8, 4, 123, r) for r in range(4)]
    by_node = [dest_ranks(i, 2, 4).view(16, 2, 2).any(2) for i in idx]
    want = [int(by_node[r][:, 1 - r // 2].sum()) for r in range(4)]
    for r in record["rows"]:
        assert r["verified"] and r["baseline"]["verified"] and r["nodes"] == 2
        assert r["transport"] in ("tcp", "ucx")
        assert r["inter_node_messages_per_rank"] and min(r["inter_node_messages_per_rank"]) > 0
        if r["phase"] == "dispatch":
            # wire row: 256 bf16 + 4 weights + 4 ids (8-byte aligned) + the source token
            assert r["inter_node_rows_per_rank"] == want
            assert r["inter_node_bytes_per_rank"] == [n * (512 + 16 + 16 + 8) for n in want]
        else:  # each rank, as the relay of its local index, sends back what the other node sent it
            assert r["inter_node_rows_per_rank"] == [want[(q + 2) % 4] for q in range(4)]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ranks", "4", "--nodes", "3"], "--nodes=3 is not allowed; expected a divisor of --ranks = 4"),
        (
            ["--ranks", "4", "--nodes", "2", "--kernel-type", "IntraNode"],
            "--kernel-type='IntraNode' is not allowed; expected one of InterNode, InterNodeV1",
        ),
        (
            ["--ranks", "4", "--nodes", "2", "--device", "cuda"],
            "1 with --device cuda (the bench runs the inter-node kernel types on the cpu runtime only",
        ),
        (["--hidden", "200", "--dtype", "fp8"], "--hidden=200 is not allowed; expected a multiple of 128"),
        (
            ["--experts", "9", "--ranks", "2"],
            "--experts=9 is not allowed; expected a multiple of --ranks = 2",
        ),
        (["--topk", "10"], "--topk=10 is not allowed; expected an int in [1, 9]"),
        (["--tokens", "0"], "--tokens=[0] is not allowed"),
        (["--ranks", "0"], "--ranks=0 is not allowed; expected an int >= 1"),
        (["--sms", "0"], "--sms=[0] is not allowed; expected block counts >= 1, or -1"),
        (["--iters", "0"], "--iters=0 is not allowed"),
    ],
)
def test_bad_values_fail_with_the_option_named(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench", "ep", *argv]) == 1
    err = capsys.readouterr().err
    assert "mori bench ep: " in err and message in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dtype", "fp16"], "expected a comma-separated subset of bf16,fp8"),
        (["--tokens", "4096,x"], "expected comma-separated integers"),
        (["--device", "tpu"], "invalid choice: 'tpu'"),
    ],
)
def test_malformed_options_are_argparse_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "ep", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cuda_without_a_gpu_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "ep", "--device", "cuda"]) == 1
    assert "torch sees no CUDA device" in capsys.readouterr().err

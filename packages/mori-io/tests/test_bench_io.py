"""``mori bench io``: its figures computed by hand, its options, UCX log parsing, and a tiny real run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from mori.core.cli import build_parser
from mori.core.errors import MoriError
from mori.io import bench, bench_nixl, bench_peer


def test_points_keep_what_fits_the_buffers() -> None:
    got = bench.points(["write", "read"], [4096, 1 << 20, 4096], [1, 128], 1 << 20)
    expected = [
        (op, block, batch)
        for op in ("write", "read")
        for block, batch in ((4096, 1), (4096, 128), (1 << 20, 1))
    ]
    assert got == expected


def test_iterations_by_bytes_clamped() -> None:
    assert bench.iterations(4096, 0) == bench.MAX_ITERS
    assert bench.iterations(64 << 20, 0) == bench.MIN_ITERS
    assert bench.iterations(1 << 20, 0) == bench.BYTES_PER_REP // (1 << 20)
    assert bench.iterations(1 << 30, 7) == 7


def test_summarize_by_hand() -> None:
    # two reps of 4 iterations of 1 MB: rep 1 takes 1 ms each, rep 2 2 ms each
    reps = [([1e-3] * 4, [1e-4] * 4), ([2e-3] * 4, [3e-4] * 4)]
    s = bench.summarize(1_000_000, reps)
    assert s["gbps_reps"] == pytest.approx([1.0, 0.5])
    assert s["gbps"] == pytest.approx(0.75)  # median of two reps
    assert (s["gbps_min"], s["gbps_max"]) == pytest.approx((0.5, 1.0))
    assert s["avg_lat_us"] == pytest.approx(1500)
    assert s["p99_lat_us"] == pytest.approx(2000)
    assert s["avg_post_us"] == pytest.approx(200)
    assert s["iterations"] == 8
    with pytest.raises(ValueError):
        bench.summarize(1, [([], [])])


def test_time_transfers_measures_post_and_completion() -> None:
    posted: list[int] = []
    waited: list[int] = []

    def post_one() -> int:
        posted.append(1)
        return len(posted)

    lat, post = bench.time_transfers(post_one, waited.append, 5)
    assert len(lat) == len(post) == 5 and waited == [1, 2, 3, 4, 5]
    assert all(p <= lt for p, lt in zip(post, lat, strict=True))


def test_ucx_transports_are_read_from_ucx_logs(tmp_path: Path) -> None:
    line = (
        "[1796052259.18] [vm:6836 :0] ucp_worker.c:1997 UCX INFO   init intra-node cfg#1 "
        "rma_am(tcp/lo)  amo_am(tcp/lo)  am(tcp/lo cma/memory)  ka(tcp/lo)"
    )
    (tmp_path / "ucx.1.log").write_text(
        "[x] ucp_worker.c:1 UCX INFO   init self cfg#0 rma_am(tcp/lo)\n" + line + "\n"
    )
    (tmp_path / "ucx.2.log").write_text(line.replace("init", "target") + "\n")
    assert bench_nixl.ucx_transports(str(tmp_path)) == [
        "rma_am(tcp/lo) amo_am(tcp/lo) am(tcp/lo cma/memory) ka(tcp/lo)"
    ]
    assert bench_nixl.ucx_transports(str(tmp_path / "none")) == []


def test_markdown_table_has_every_row_and_the_ratio() -> None:
    fig = {
        "gbps": 2.0,
        "gbps_min": 1.5,
        "gbps_max": 2.5,
        "avg_lat_us": 10.0,
        "p99_lat_us": 20.0,
        "avg_post_us": 1.0,
    }
    rows = [
        {"op": "write", "block": 4096, "batch": 32, "mori": fig, "nixl": {**fig, "gbps": 1.0}, "ratio": 2.0}
    ]
    md = bench.markdown_table(rows, "NIXL", "nixl").splitlines()
    assert len(md) == 3 and md[0].startswith("| op | block | batch | mori GB/s")
    assert (
        md[2]
        == "| write | 4 KiB | 32 | 2.00 | 1.50-2.50 | 10.0 | 20.0 | 1.0 | 1.00 | 1.50-2.50 | 10.0 | 20.0 | 1.0 | 2.00 |"
    )


def test_the_suite_is_registered_and_parses_its_options() -> None:
    parser = build_parser()
    args = parser.parse_args(
        ["bench", "io", "--blocks", "4K,1M", "--batches", "1,32", "--ops", "read", "--max-bytes", "64M"]
    )
    assert (args.blocks, args.batches, args.ops, args.max_bytes) == (
        [4096, 1 << 20],
        [1, 32],
        ["read"],
        64 << 20,
    )
    assert args.func is bench.run
    for bad in (["--blocks", "4Q"], ["--batches", "0"], ["--ops", "copy"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["bench", "io", *bad])


def test_plot_is_skipped_with_a_message_without_matplotlib(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fig = {"gbps": 1.0}
    rows = [{"op": "write", "block": 4096, "batch": 1, "mori": fig, "nixl": fig}]
    drew = bench.plot(tmp_path / "p.png", rows, "NIXL", "nixl")
    if importlib.util.find_spec("matplotlib") is None:
        assert not drew and "matplotlib not installed" in capsys.readouterr().out
    else:
        assert drew and (tmp_path / "p.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.parametrize(("nixl", "mode"), [("off", "engine"), ("on", "session")])
def test_a_tiny_cpu_run_end_to_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], nixl: str, mode: str
) -> None:
    if nixl == "on" and importlib.util.find_spec("nixl") is None:
        pytest.skip("nixl is not installed (pip install nixl): the baseline is optional")
    out = tmp_path / "io.json"
    argv = [
        "bench",
        "io",
        "--blocks",
        "4K,64K",
        "--batches",
        "1,4",
        "--max-bytes",
        "1M",
        "--iters",
        "3",
        "--reps",
        "2",
    ]
    argv += ["--mode", mode, "--nixl", nixl, "--json", str(out), "--plot", str(tmp_path / "io.png")]
    args = build_parser().parse_args(argv)
    assert bench.run(args) == 0
    text = capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["suite"] == "io" and record["config"]["verified"]["mori"] is True
    assert record["config"]["mode"] == mode
    rows = record["rows"]
    assert [(r["op"], r["block"], r["batch"]) for r in rows] == bench.points(
        ["write", "read"], [4096, 65536], [1, 4], 1 << 20
    )
    for r in rows:
        assert r["mori"]["iterations"] == 6 and r["mori"]["gbps"] > 0
        assert r["mori"]["gbps_min"] <= r["mori"]["gbps"] <= r["mori"]["gbps_max"]
    if nixl == "on":
        assert record["config"]["verified"]["nixl"] is True
        assert all(r["ratio"] == pytest.approx(r["mori"]["gbps"] / r["nixl"]["gbps"]) for r in rows)
        assert record["config"]["ucx_transports"], "UCX's log named no transport"
    else:
        assert "NIXL baseline: unavailable (disabled (--nixl off))" in text
        assert all("nixl" not in r for r in rows)


def test_a_missing_nixl_is_reported_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    import torch

    monkeypatch.setitem(sys.modules, "nixl", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "nixl._api", None)
    agent, why = bench_nixl.make_nixl("x", torch.zeros(16, dtype=torch.uint8))
    assert agent is None and why.startswith("nixl is not importable") and "pip install nixl" in why


def test_cuda_without_two_gpus_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has 2 GPUs")
    args = build_parser().parse_args(["bench", "io", "--device", "cuda", "--json", "/dev/null"])
    with pytest.raises(SystemExit, match="needs 2 GPUs"):
        bench.run(args)


def test_pipelined_timing_and_stream_figures_by_hand() -> None:
    posted: list[int] = []
    waited: list[int] = []

    def post() -> int:
        posted.append(1)
        return len(posted)

    assert bench.time_pipelined(post, waited.append, 4) > 0
    assert posted == [1] * 4 and waited == [1, 2, 3, 4]  # all posted before any wait
    waited.clear()
    bench.time_pipelined(post, waited.append, 3, wait_each=False)
    assert waited == [7]  # only the last one
    fig = bench.summarize(1_000_000, [([1e-3] * 2, [1e-4] * 2)])
    out = bench.with_stream_figures(fig, 1_000_000, 10, [0.002, 0.004, 0.005])
    assert out["gbps"] == pytest.approx(2.5) and (out["gbps_min"], out["gbps_max"]) == pytest.approx(
        (2.0, 5.0)
    )
    assert out["sw_gbps"] == pytest.approx(1.0) and out["avg_lat_us"] == fig["avg_lat_us"]


def _dies() -> None:
    raise SystemExit(3)


def test_a_target_that_dies_is_reported_at_once() -> None:
    import multiprocessing as mp
    import time

    ctx = mp.get_context("spawn")
    parent, _child = ctx.Pipe()
    proc = ctx.Process(target=_dies)
    proc.start()
    t0 = time.monotonic()
    with pytest.raises(
        bench_peer.BenchPeerError, match="exited with code 3 while the initiator waited for its first"
    ):
        bench_peer.await_target(parent, proc, 60.0)
    assert time.monotonic() - t0 < 30
    proc.join()


def _silent() -> None:
    import time

    time.sleep(120)


def test_a_silent_target_fails_after_the_timeout() -> None:
    import multiprocessing as mp
    import time

    ctx = mp.get_context("spawn")
    parent, _child = ctx.Pipe()
    proc = ctx.Process(target=_silent)
    proc.start()
    peer = bench_peer.Peer("target", parent, proc, 1.0)
    t0 = time.monotonic()
    try:
        with pytest.raises(bench_peer.BenchPeerError, match=r"did not answer within 1 s \(--timeout\)"):
            peer.ask("digest", 0, 8)
        assert 1.0 <= time.monotonic() - t0 < 10
        assert isinstance(bench_peer.BenchPeerError("x"), MoriError)  # `mori` prints it as an error, exit 1
    finally:
        peer.stop(failed=True)
    assert not proc.is_alive()


def test_timeout_option() -> None:
    parser = build_parser()
    assert parser.parse_args(["bench", "io"]).timeout == bench_peer.PEER_TIMEOUT_S
    assert parser.parse_args(["bench", "io", "--timeout", "2.5"]).timeout == 2.5
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "io", "--timeout", "0"])


@pytest.mark.slow
@pytest.mark.parametrize("cma", ["on", "off"])
def test_a_target_killed_mid_run_fails_in_seconds(cma: str, tmp_path: Path) -> None:
    # `mori bench io` as a user runs it; once it has measured, its target process is killed: the
    # command must exit 1 within seconds with the named error, not wait on its pipe forever.
    import os
    import signal
    import subprocess
    import sys
    import time

    argv = [sys.executable, "-m", "mori.core.cli", "bench", "io", "--nixl", "off", "--tcp-cma", cma]
    argv += ["--blocks", "4K,64K", "--batches", "1,4", "--max-bytes", "1M", "--iters", "20"]
    argv += ["--reps", "100000", "--timeout", "60", "--json", str(tmp_path / "io.json")]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # "rep 1/100000: mori done": the target is up and transfers ran
            if "rep 1/" in line:
                break
        else:
            pytest.fail(
                f"the bench ended before measuring: {proc.wait()} {proc.stderr.read() if proc.stderr else ''}"
            )
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        targets = [c for c in children if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text()]
        assert len(targets) == 1, f"expected one spawned target among {children}"
        t0 = time.monotonic()
        os.kill(int(targets[0]), signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, err
    assert (
        "mori: error: mori bench io: the target process exited with code -9 while the initiator waited" in err
    )
    assert elapsed < 20, f"took {elapsed:.1f} s to notice"


def test_plot_none_draws_no_plot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # `mori bench io --plot none` drew `none.png` into the working directory (matplotlib adds the
    # extension) and a run committed it. The measurement is replaced by known rows: the question is
    # only what run() draws.
    fig = {"gbps": 1.0, "gbps_min": 1.0, "gbps_max": 1.0, "avg_lat_us": 1.0, "p99_lat_us": 1.0}
    rows = [{"op": "write", "block": 4096, "batch": 1, "mori": {**fig, "avg_post_us": 1.0}}]
    monkeypatch.setattr(bench, "run_cpu", lambda args: ({"verified": {"mori": True}}, rows))
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["bench", "io", "--json", str(tmp_path / "io.json"), "--plot", "none"])
    assert bench.run(args) == 0
    assert json.loads((tmp_path / "io.json").read_text())["rows"] == rows
    assert list(tmp_path.rglob("*.png")) == [] and "png" not in capsys.readouterr().out


def test_the_record_says_when_an_engine_setting_is_overridden(monkeypatch: pytest.MonkeyPatch) -> None:
    """A record taken with a tuning variable set must not claim the library's defaults."""
    for name in ("MORI_IO_THP", "MORI_IO_CMA_THREADS", "MORI_IO_CMA_SPLIT_BYTES", "MORI_IO_CHUNK_BYTES"):
        monkeypatch.delenv(name, raising=False)
    assert bench._manners() == "at the library's defaults: no opt-in tuning set"
    monkeypatch.setenv("MORI_IO_CMA_SPLIT_BYTES", "1M")
    assert bench._manners() == "NOT at the library's defaults: MORI_IO_CMA_SPLIT_BYTES=1M"

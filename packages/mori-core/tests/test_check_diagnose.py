"""``mori check`` and ``mori diagnose``: on this machine, on fake sysfs trees, and against a peer
served on loopback (reachability, authentication, the tcp probe, exit codes)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mori.core import check, cli, diagnose, nic
from mori.core.backend import NicProvider
from mori.core.plugins import Plugins, hookimpl
from mori.testing.fake_sysfs import CLASS_ETH, INTEL, eight_gpus_eight_nics, no_nic

MLX5 = nic.NicVendor(
    name="t-mlx5",
    family="mlx5",
    description="",
    drivers=("mlx5_core",),
    pci_vendors=(0x15B3,),
    name_prefixes=("mlx5_",),
    libraries=("libmlx5",),
    firmware_minimums=("28.40.0",),
    quirks={"q1": "a documented quirk"},
)


class _OneNic:
    @hookimpl
    def mori_nic_providers(self) -> list[NicProvider]:
        return [nic.VendorNicProvider(MLX5)]


class _Plugins(Plugins):
    """The installed plugins with their NIC plugins replaced by one made-up vendor: core must
    handle any descriptor, and the test must not depend on which NIC plugins are installed."""

    def __init__(self) -> None:
        super().__init__()
        for impl in self.pm.hook.mori_nic_providers.get_hookimpls():
            self.pm.unregister(impl.plugin)
        self.pm.register(_OneNic(), name="t-mlx5")


def _msgs(report: check.CheckReport, level: str) -> list[str]:
    return [f.message for f in report.findings if f.level == level]


def test_check_on_this_machine_exits_zero_and_names_every_nic_plugin(
    capsys: pytest.CaptureFixture[str], clean_env: pytest.MonkeyPatch
) -> None:
    rc = cli.main(["check"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "peers on this node: shm" in out and "peers on other nodes: tcp" in out
    assert "components installed (each uses the heap and transports above): " in out
    if not Path("/sys/class/infiniband").is_dir():
        assert "no RDMA device" in out
        for name, fam in (("cx7", "mlx5"), ("thor2", "bnxt_re"), ("pollara", "ionic")):
            assert f"{name}: not usable: no {fam} device in /sys/class/infiniband" in out
    assert re.search(r"^0 problem\(s\), \d+ warning\(s\)$", out, re.M)


def test_check_json_and_invalid_env_is_a_problem(
    capsys: pytest.CaptureFixture[str], clean_env: pytest.MonkeyPatch
) -> None:
    clean_env.setenv("MORI_RDMA_SL", "99")
    rc = cli.main(["check", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 1 and data["problems"] >= 1
    assert any(f["level"] == "problem" and "MORI_RDMA_SL='99'" in f["message"] for f in data["findings"])


def test_check_on_a_fake_eight_nic_node(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    fs = eight_gpus_eight_nics(tmp_path, inactive=(3,))
    fs.pci(
        "0000:09:00.0", parent="0000:00:01.0", vendor=INTEL, device=0x1593, pci_class=CLASS_ETH, driver="ice"
    )
    fs.rdma("irdma0", "0000:09:00.0")
    r = check.run_check(str(tmp_path), _Plugins())
    warns, oks = _msgs(r, check.WARN), _msgs(r, check.OK)
    assert any("irdma0" in w and "no installed NIC plugin claims it" in w for w in warns)
    assert any(w == "mlx5_3: no ACTIVE port (cable, switch port, or subnet manager)" for w in warns)
    assert any("mlx5_0: firmware 28.39.1002 is below mlx5's minimum 28.40.0" in w for w in warns)
    assert any(o.startswith("GPU 3: nvidia PCI 0000:14:00.0, NUMA 0; NIC mlx5_2:1 (PIX") for o in oks)
    assert any(
        o.startswith("RDMA ports for the network transports: mlx5_0:1, mlx5_1:1, mlx5_2:1, mlx5_4:1")
        for o in oks
    )
    assert "t-mlx5 quirk q1: a documented quirk" in _msgs(r, check.INFO)
    assert r.exit_code() == 0 and r.exit_code(strict=True) == 1  # warnings fail only --strict


def test_check_problems_missing_library_and_unknown_device(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    eight_gpus_eight_nics(tmp_path, library=False)
    clean_env.setenv("MORI_RDMA_DEVICES", "mlx5_0,mlx5_42")
    r = check.run_check(str(tmp_path), _Plugins())
    problems = _msgs(r, check.PROBLEM)
    assert any(p == "mlx5_0: t-mlx5 needs libmlx5 (rdma-core), which is not installed" for p in problems)
    assert any(p.startswith("MORI_RDMA_DEVICES names mlx5_42: not on this machine") for p in problems)
    assert r.exit_code() == 1


def test_check_gid_index_must_name_a_used_entry(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    eight_gpus_eight_nics(tmp_path)
    clean_env.setenv("MORI_IB_GID_INDEX", "3")
    r = check.run_check(str(tmp_path), _Plugins())
    assert "mlx5_0:1: GID 3 = 0000:0000:0000:0000:0000:ffff:0a00:0001 RoCE v2" in _msgs(r, check.INFO)
    assert not [p for p in _msgs(r, check.PROBLEM) if "GID" in p]
    clean_env.setenv("MORI_IB_GID_INDEX", "2")  # the empty entry
    r = check.run_check(str(tmp_path), _Plugins())
    assert any(
        p.startswith("mlx5_0:1: MORI_IB_GID_INDEX=2 is an empty GID entry") for p in _msgs(r, check.PROBLEM)
    )
    assert r.exit_code() == 1


def test_check_on_a_node_without_nics(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    no_nic(tmp_path)
    r = check.run_check(str(tmp_path), _Plugins())
    assert not r.problems
    assert any(m.startswith("no RDMA device") for m in _msgs(r, check.INFO))
    assert any(m.startswith("GPU 1: nvidia PCI 0000:02:00.0, NUMA 0") for m in _msgs(r, check.OK))
    assert r.host["gpus"] == 2 and r.host["numa_nodes"] == [0]


def test_check_usage_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli.main(["check", "--root", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["check", "--bogus"])
    assert e.value.code == 2


# -- diagnose -----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[tuple[int, subprocess.Popen[str]]]:
    """A ``mori diagnose --serve --once`` on loopback in its own process (env from the marker)."""
    extra: dict[str, str] = getattr(request, "param", {})
    envs = {k: v for k, v in os.environ.items() if not k.startswith("MORI_")}
    envs.update(extra)
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mori.core.cli",
            "diagnose",
            "--serve",
            f"127.0.0.1:{port}",
            "--once",
            "--timeout",
            "10",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=envs,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert f"serving on 127.0.0.1:{port}" in line, line
    yield port, proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)
    proc.stdout.close()


def test_diagnose_against_a_peer_on_loopback(
    server: tuple[int, subprocess.Popen[str]],
    capsys: pytest.CaptureFixture[str],
    clean_env: pytest.MonkeyPatch,
) -> None:
    port, proc = server
    rc = cli.main(
        ["diagnose", "--peer", f"127.0.0.1:{port}", "--timeout", "10", "--size", "1048576", "--rounds", "20"]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "a transfer would take: same node: load/store (shm" in out
    assert "read back identical" in out and "0 problem(s); exit 0" in out
    assert proc.stdout is not None
    assert "verified True" in proc.stdout.read()
    assert proc.wait(timeout=30) == 0


@pytest.mark.parametrize("server", [{"MORI_NODE_ID": "node-b"}], indirect=True)
def test_diagnose_across_emulated_nodes_takes_the_network_transport(
    server: tuple[int, subprocess.Popen[str]], clean_env: pytest.MonkeyPatch
) -> None:
    port, _ = server
    clean_env.setenv("MORI_NODE_ID", "node-a")
    r = diagnose.diagnose("127.0.0.1", port, timeout=10, size=1 << 20, rounds=10)
    assert r.exit_code == 0, r.problems
    assert r.route == "other node: network transport " + r.local["network_transport"]
    assert r.probe["path"] == "TCP" and r.probe["verified"] and r.probe["bandwidth_gbps"] > 0
    assert r.remote["node_id"] == "node-b"


@pytest.mark.parametrize("server", [{"MORI_AUTH_TOKEN": "job-secret"}], indirect=True)
def test_diagnose_authentication(
    server: tuple[int, subprocess.Popen[str]], clean_env: pytest.MonkeyPatch
) -> None:
    port, proc = server
    r = diagnose.diagnose("127.0.0.1", port, timeout=10)
    assert r.exit_code == 1 and "requires MORI_AUTH_TOKEN" in r.problems[0]
    assert proc.wait(timeout=30) == 0  # --once: a refused peer ends the session too


@pytest.mark.parametrize("server", [{"MORI_AUTH_TOKEN": "job-secret"}], indirect=True)
def test_diagnose_wrong_and_right_token(
    server: tuple[int, subprocess.Popen[str]], clean_env: pytest.MonkeyPatch
) -> None:
    port, proc = server
    clean_env.setenv("MORI_AUTH_TOKEN", "not-the-secret")
    r = diagnose.diagnose("127.0.0.1", port, timeout=10)
    assert r.exit_code == 1 and "authentication failed" in r.problems[0]
    assert proc.stdout is not None and "refused: authentication failed" in proc.stdout.read()


@pytest.mark.parametrize("server", [{"MORI_AUTH_TOKEN": "job-secret"}], indirect=True)
def test_diagnose_with_the_right_token(
    server: tuple[int, subprocess.Popen[str]], clean_env: pytest.MonkeyPatch
) -> None:
    port, _ = server
    clean_env.setenv("MORI_AUTH_TOKEN", "job-secret")
    r = diagnose.diagnose("127.0.0.1", port, timeout=10, size=4096, rounds=5)
    assert r.exit_code == 0, r.problems
    assert r.probe["verified"]


def test_diagnose_unreachable_peer_exits_3_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    port = _free_port()  # nothing listens there
    assert cli.main(["diagnose", "--peer", f"127.0.0.1:{port}", "--timeout", "2"]) == 3
    assert f"peer 127.0.0.1:{port} unreachable" in capsys.readouterr().out


def test_diagnose_silent_peer_times_out_naming_it() -> None:
    with socket.socket() as s:  # accepts (the kernel does) but never speaks
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        t = time.monotonic()
        r = diagnose.diagnose("127.0.0.1", port, timeout=1)
        assert time.monotonic() - t < 10
    assert (
        r.exit_code == 3
        and f"127.0.0.1:{port}" in r.problems[0]
        and "did not answer within 1 s" in r.problems[0]
    )


def test_diagnose_not_a_diagnose_server_is_refused() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        import threading

        def talk() -> None:
            c, _ = s.accept()
            with c:
                c.sendall(b"\xff\xff\xff\xffHTTP/1.1 400 Bad Request\r\n\r\n")

        th = threading.Thread(target=talk)
        th.start()
        r = diagnose.diagnose("127.0.0.1", port, timeout=5)
        th.join()
    assert r.exit_code == 1 and "not a mori diagnose peer" in r.problems[0]


@pytest.mark.parametrize(
    ("argv", "err"),
    [
        (["diagnose"], "exactly one of --peer"),
        (["diagnose", "--peer", "h:1", "--serve", "1"], "exactly one of --peer"),
        (["diagnose", "--peer", "nohost"], "--peer='nohost' is not allowed; expected HOST:PORT"),
        (["diagnose", "--peer", "h:99999"], "expected HOST:PORT"),
        (["diagnose", "--peer", "h:1", "--timeout", "0"], "--timeout=0.0 is not allowed"),
        (["diagnose", "--peer", "h:1", "--size", "1"], "--size=1 is not allowed"),
    ],
)
def test_diagnose_usage_errors_exit_2(argv: list[str], err: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == 2
    assert err in capsys.readouterr().err


def test_serving_beyond_loopback_needs_the_token(
    capsys: pytest.CaptureFixture[str], clean_env: pytest.MonkeyPatch
) -> None:
    assert cli.main(["diagnose", "--serve", "0.0.0.0:0", "--once"]) == 2
    assert "set MORI_AUTH_TOKEN" in capsys.readouterr().err

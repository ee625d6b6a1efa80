"""Plugins: built-ins and a third-party package found through entry points and actually used."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mori.core.backend import Availability, NetworkTransport, Transport
from mori.core.errors import MoriBackendError
from mori.core.plugins import Plugins, hookimpl, select

FIXTURE = Path(__file__).parent / "fixtures" / "mori-plugin-filemap"


def test_builtins_come_through_the_entry_point_group() -> None:
    plugins = Plugins()  # a fresh manager: discovery is per instance
    runtimes = {f.backend.name: f for f in plugins.runtimes()}
    transports = {f.backend.name: f for f in plugins.transports()}
    assert runtimes["cpu"].availability.usable and runtimes["cpu"].plugin.distribution == "mori-core"
    assert transports["shm"].plugin.group == "mori.backends"
    assert select("device runtime", plugins.runtimes(), "cpu").backend.name == "cpu"


def test_unknown_backend_name_is_not_found() -> None:
    plugins = Plugins()
    with pytest.raises(
        MoriBackendError, match="device runtime 'cpux' not found: misspelled or not installed"
    ):
        select("device runtime", plugins.runtimes(), "cpux")


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The fixture plugin, installed the way a user would (pip), into a directory of its own."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(FIXTURE),
        ],
        check=True,
    )
    yield target


def _run(
    plugin_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    full = {
        **os.environ,
        **(env or {}),
        "PYTHONPATH": os.pathsep.join([str(plugin_path), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=full, timeout=120)


def test_third_party_plugin_is_listed_with_its_availability(plugin_path: Path) -> None:
    out = _run(plugin_path, "-m", "mori.core.cli", "backends")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    filemap = next(line for line in lines if line.strip().startswith("filemap"))
    assert "mori-plugin-filemap 0.1.0" in filemap and "available" in filemap
    fakenic = next(line for line in lines if line.strip().startswith("fakenic"))
    assert "unavailable" in fakenic and "no /sys/class/infiniband/fakenic0 device" in fakenic
    broken = next(line for line in lines if line.strip().startswith("broken"))
    assert "ModuleNotFoundError" in broken  # a broken entry point is shown, not fatal
    cpu = next(line for line in lines if line.strip().startswith("cpu"))
    assert "mori-core" in cpu and "available" in cpu


def test_third_party_plugin_extends_the_command_line_and_env(plugin_path: Path, tmp_path: Path) -> None:
    out = _run(plugin_path, "-m", "mori.core.cli", "env", "-v", env={"MORI_FILEMAP_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert f"MORI_FILEMAP_DIR='{tmp_path}'" in out.stdout
    out = _run(plugin_path, "-m", "mori.core.cli", "filemap-ls", env={"MORI_FILEMAP_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr


_JOB = """
import json, os, sys
import torch
import mori.shmem as shmem
from mori.core.launch import shmem_ranks

def body(rank, nranks):
    info = shmem.shmem_heap_info()
    buf = shmem.shmem_malloc(4096)
    shmem.shmem_tensor_view(buf, 4096, torch.uint8).fill_(0xA0 + rank)
    shmem.shmem_barrier_all()
    peer = 1 - rank
    shmem.shmem_putmem(buf, buf + 1024, 16, peer)  # through the plugin's peer mapping
    shmem.shmem_barrier_all()
    files = sorted(os.listdir(os.environ["MORI_FILEMAP_DIR"]))
    offset = buf - info["base"]
    mine = [f for f in files if f.endswith("." + str(rank))][0]
    with open(os.path.join(os.environ["MORI_FILEMAP_DIR"], mine), "rb") as f:
        f.seek(offset)
        on_disk = f.read(32)
    shmem.shmem_barrier_all()
    return {"runtime": info["runtime"], "files": len(files), "head": on_disk[:16].hex(), "tail": on_disk[16:].hex()}

if __name__ == "__main__":
    print(json.dumps(shmem_ranks(body, 2, timeout=60)))
"""


def test_third_party_runtime_backs_the_heap_when_selected(plugin_path: Path, tmp_path: Path) -> None:
    heaps = tmp_path / "heaps"
    job = tmp_path / "job.py"  # rank functions must be importable: a file, not -c
    job.write_text(_JOB)
    out = _run(plugin_path, str(job), env={"MORI_DEVICE_RUNTIME": "filemap", "MORI_FILEMAP_DIR": str(heaps)})
    assert out.returncode == 0, out.stderr
    r0, r1 = json.loads(out.stdout.strip().splitlines()[-1])
    assert r0["runtime"] == r1["runtime"] == "filemap"
    assert r0["files"] == r1["files"] == 2
    # each heap file holds, at the allocation's offset, the bytes the peer put and its own beyond
    assert r0["head"] == "a1" * 16 and r0["tail"] == "a0" * 16
    assert r1["head"] == "a0" * 16 and r1["tail"] == "a1" * 16
    assert list(heaps.iterdir()) == []  # finalize removed the files


def test_selecting_an_uninstalled_runtime_fails_clearly(plugin_path: Path) -> None:
    out = _run(
        plugin_path,
        "-c",
        "from mori.core.launch import shmem_ranks\nshmem_ranks(print, 2, timeout=30)",
        env={"MORI_DEVICE_RUNTIME": "no-such-runtime"},
    )
    assert out.returncode != 0
    assert (
        "device runtime 'no-such-runtime' not found: misspelled or not installed (installed: " in out.stderr
    )
    installed = out.stderr.split("(installed: ")[-1].split(")")[0].split(", ")
    assert "cpu" in installed and "filemap" in installed


class _CountingNetwork(NetworkTransport):
    """A network transport that counts its probes (a real one loads a library there)."""

    name = "counting"
    probes = 0

    def probe(self) -> Availability:
        type(self).probes += 1
        return Availability(True, "counted")

    def ops(self) -> object:
        raise AssertionError("a single-node job opened the network transport")


class _CountingPlugin:
    @hookimpl
    def mori_transports(self) -> list[Transport]:
        return [_CountingNetwork()]


def test_a_single_node_job_never_probes_a_network_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    # A network library's probe loads it (UCX maps shared memory and starts threads; with a full
    # /dev/shm it crashed the process): a job whose peers all share memory must not pay for it.
    import mori.shmem as shmem
    from mori.core import plugins as plugins_module

    found = Plugins()
    found.pm.register(_CountingPlugin(), name="counting")
    monkeypatch.setattr(plugins_module, "_plugins", found)
    monkeypatch.setattr(_CountingNetwork, "probes", 0)
    monkeypatch.setenv("MORI_DEVICE_RUNTIME", "cpu")
    monkeypatch.setenv("MORI_SHMEM_HEAP_SIZE", "64M")
    shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, 0, 1, shmem.shmem_get_unique_id())
    try:
        assert _CountingNetwork.probes == 0
    finally:
        shmem.shmem_finalize()
    entry = next(f for f in found.transports() if f.backend.name == "counting")
    assert entry.availability.reason == "counted" and entry.availability.usable
    assert entry.availability.usable and _CountingNetwork.probes == 1, "probed once, on first read"

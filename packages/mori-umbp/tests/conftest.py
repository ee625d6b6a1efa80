"""Fixtures of the mori-umbp tests: a real redis-server of their own, the master as a process."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # helpers.py, standins/


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


class RedisServer:
    """A redis-server on a free loopback port with its data in a temporary directory."""

    def __init__(self, workdir: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not installed: apt-get install -y redis-server (CI's .ci/run does)")
        self.exe, self.dir = exe, workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def uri(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--save", "", "--appendonly", "no", "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        if not wait_port(self.port):
            self.stop()
            pytest.fail(f"redis-server did not listen on 127.0.0.1:{self.port} within 15 s")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()


class Master:
    """``umbp_master`` (the installed console script) as a child process."""

    def __init__(self, env: dict[str, str] | None = None, port: int | None = None) -> None:
        self.port = port or free_port()
        self.metrics_port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        exe = os.environ.get("UMBP_MASTER_BIN") or shutil.which("umbp_master")
        cmd = [exe] if exe else [sys.executable, "-m", "mori.umbp.master.server"]
        self.proc = subprocess.Popen(
            [*cmd, self.address, str(self.metrics_port)],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        if not wait_port(self.port):
            err = self.stop()
            pytest.fail(f"umbp_master did not listen on {self.address} within 15 s: {err}")

    def stop(self) -> str:
        if self.proc is None:
            return ""
        self.proc.terminate()
        try:
            _, err = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        self.proc = None
        return err.decode(errors="replace")[-2000:]

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.communicate()
            self.proc = None


@pytest.fixture
def master() -> Iterator[Master]:
    m = Master()
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture(scope="module")
def shared_master() -> Iterator[Master]:
    m = Master()
    try:
        yield m
    finally:
        m.stop()

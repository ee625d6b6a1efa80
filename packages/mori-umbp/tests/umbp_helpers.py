"""Helpers of the mori-umbp tests: byte buffers with addresses, client configs, and a real
redis-server and ``umbp_master`` as child processes (on free loopback ports, temporary dirs)."""

from __future__ import annotations

import ctypes
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mori.umbp as umbp


class Buf:
    """``n`` bytes of ctypes memory: ``.ptr``, ``.fill(byte)``, ``.bytes()``."""

    def __init__(self, n: int, data: bytes | None = None) -> None:
        self.n = n
        self.raw = (ctypes.c_ubyte * n)()
        self.ptr = ctypes.addressof(self.raw)
        if data is not None:
            ctypes.memmove(self.ptr, data, n)

    def fill(self, value: int) -> Buf:
        ctypes.memset(self.ptr, value, self.n)
        return self

    def bytes(self) -> bytes:
        return ctypes.string_at(self.ptr, self.n)


def rand_buf(n: int) -> Buf:
    return Buf(n, os.urandom(n))


def local_config(
    dram: int = 4 << 20, ssd_dir: object = None, ssd_capacity: int = 16 << 20
) -> umbp.UMBPConfig:
    cfg = umbp.UMBPConfig()
    cfg.dram.capacity_bytes = dram
    cfg.ssd.enabled = ssd_dir is not None
    if ssd_dir is not None:
        cfg.ssd.storage_dir = str(ssd_dir)
        cfg.ssd.capacity_bytes = ssd_capacity
    return cfg


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

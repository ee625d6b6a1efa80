"""Fixtures of the mori-umbp tests: a real redis-server of their own, the master as a process."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # umbp_helpers.py

from umbp_helpers import Master, RedisServer


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()


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

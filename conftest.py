"""Fixtures for every package's tests (this is the workspace root, pytest's rootdir)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Rank functions live in the test modules, which pytest's importlib mode names after their path
# from here (``packages.mori-core.tests.test_x``); spawned ranks import them by that name, so this
# directory must be on every process's path whatever the working directory.
sys.path.insert(0, str(Path(__file__).parent))

SHM_DIR = Path("/dev/shm")


def _orphaned_heap_segments() -> set[str]:
    """Heap segments whose creator is gone: nobody will ever unlink them (leaks).

    Proven by the creator's lock, not a pid (another job, maybe in another PID namespace that
    shares /dev/shm, may legitimately be running).
    """
    from mori.core.backends.cpu import stale_segments

    return set(stale_segments()) if SHM_DIR.is_dir() else set()


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_leaks() -> Iterator[None]:
    """Fails the session if the test suite left heap segments in /dev/shm."""
    before = _orphaned_heap_segments()
    yield
    leaked = _orphaned_heap_segments() - before
    assert not leaked, f"shared-memory heap segments leaked by the test suite: {sorted(leaked)}"


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No MORI_* variables from the caller's environment leak into a test."""
    for key in list(os.environ):
        if key.startswith("MORI_"):
            monkeypatch.delenv(key)
    return monkeypatch

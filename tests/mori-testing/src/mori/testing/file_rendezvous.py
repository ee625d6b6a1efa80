"""A rendezvous through files in a shared directory, for tests whose processes exchange a few
bytes (descriptors, digests) outside the library under test."""

from __future__ import annotations

import time
from pathlib import Path

__all__ = ["get", "put"]


def put(d: Path, name: str, data: bytes) -> None:
    """Publish ``data`` as ``d/name``, atomically (written aside, then renamed)."""
    (d / f"{name}.tmp").write_bytes(data)
    (d / f"{name}.tmp").rename(d / name)


def get(d: Path, name: str, timeout: float = 60.0) -> bytes:
    """The bytes of ``d/name`` once it appears; TimeoutError naming it after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (d / name).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rendezvous file {name} never appeared")
        time.sleep(0.01)
    return (d / name).read_bytes()

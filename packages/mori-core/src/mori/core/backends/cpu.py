"""The ``cpu`` device runtime: the symmetric heap in POSIX shared memory, one segment per rank."""

from __future__ import annotations

import os
from collections.abc import Sequence

from mori.core import _core
from mori.core.backend import (
    Availability,
    DeviceRuntime,
    HeapSegment,
    HostMemoryRuntime,
    PeerInfo,
    PeerSegment,
)
from mori.core.plugins import hookimpl

SEGMENT_PREFIX = "mori-heap."
SHM_DIR = "/dev/shm"


def segment_name(tag: str) -> str:
    # The owner's pid is part of the name so a later job can remove what a killed job left
    # before its peers had mapped (and unlinked) it: see sweep_stale_segments.
    return f"/{SEGMENT_PREFIX}{os.getpid()}.{tag}"


def sweep_stale_segments() -> list[str]:
    """Remove heap segments whose owner process no longer exists. Returns the names removed."""
    removed: list[str] = []
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for entry in entries:
        if not entry.startswith(SEGMENT_PREFIX):
            continue
        pid_text = entry[len(SEGMENT_PREFIX) :].split(".", 1)[0]
        if not pid_text.isdigit():
            continue
        try:
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            if _core.shm_unlink("/" + entry):
                removed.append(entry)
        except PermissionError:
            pass  # alive, another user's
    return removed


class ShmSegment(HeapSegment):
    def __init__(self, size: int, tag: str) -> None:
        self.name = segment_name(tag)
        self.size = size
        self.addr = _core.shm_create(self.name, size)
        self.handle = self.name.encode()
        self._linked = True

    def seal(self) -> None:
        if self._linked:
            _core.shm_unlink(self.name)
            self._linked = False

    def close(self) -> None:
        self.seal()
        if self.addr:
            _core.shm_unmap(self.addr, self.size)
            self.addr = 0


class MappedPeerSegment(PeerSegment):
    def __init__(self, name: str, size: int) -> None:
        self.size = size
        self.addr = _core.shm_open(name, size)

    def close(self) -> None:
        if self.addr:
            _core.shm_unmap(self.addr, self.size)
            self.addr = 0


class CpuRuntime(HostMemoryRuntime):
    name = "cpu"
    description = "host memory; the symmetric heap lives in POSIX shared memory (/dev/shm)"
    priority = 0

    def probe(self) -> Availability:
        if not os.path.isdir(SHM_DIR) or not os.access(SHM_DIR, os.W_OK):
            return Availability(False, f"{SHM_DIR} is missing or not writable")
        st = os.statvfs(SHM_DIR)
        return Availability(True, f"{st.f_bavail * st.f_frsize / 2**30:.1f} GiB free in {SHM_DIR}")

    def create_segment(self, size: int, tag: str) -> HeapSegment:
        sweep_stale_segments()
        return ShmSegment(size, tag)

    def open_peer_segment(self, peer: PeerInfo) -> PeerSegment:
        return MappedPeerSegment(peer.segment_handle.decode(), peer.heap_size)


@hookimpl
def mori_device_runtimes() -> Sequence[DeviceRuntime]:
    return [CpuRuntime()]

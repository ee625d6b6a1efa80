"""The ``cpu`` device runtime: the symmetric heap in POSIX shared memory, one segment per rank."""

from __future__ import annotations

import os
import re
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
from mori.core.errors import MoriOutOfMemoryError
from mori.core.plugins import hookimpl

SEGMENT_PREFIX = "mori-heap."
SHM_DIR = "/dev/shm"
# Names of mori-core before the creator's lock (pid first, then 12 hex digits): their creators
# hold no lock, so whether one is dead cannot be proven; they are left alone.
_UNLOCKED_NAME = re.compile(re.escape(SEGMENT_PREFIX) + r"\d+\.[0-9a-f]{12}\.\d+$")


def segment_name(tag: str) -> str:
    """``/mori-heap.<job>.<pe>.<pid>`` for the tag ``<job>.<pe>`` the shmem context gives.

    Every segment of one job starts with ``mori-heap.<job>.``, so a job's names can be listed
    apart from those of other jobs on the host; the pid is there for people reading /dev/shm.
    """
    return f"/{SEGMENT_PREFIX}{tag}.{os.getpid()}"


def _candidates() -> list[str]:
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return []
    return sorted(e for e in entries if e.startswith(SEGMENT_PREFIX) and not _UNLOCKED_NAME.match(e))


def stale_segments() -> list[str]:
    """Heap segments left named in /dev/shm by a creator that is gone; removes nothing.

    Proven by the creator's lock (see ``csrc/shm_segment.cpp``), not by a pid: a segment of a
    live process in another PID namespace that shares /dev/shm is never stale.
    """
    return [e for e in _candidates() if _core.shm_is_stale("/" + e)]


def sweep_stale_segments() -> list[str]:
    """Remove the heap segments :func:`stale_segments` finds. Returns the names removed."""
    return [e for e in _candidates() if _core.shm_unlink_if_stale("/" + e)]


def _human(n: int) -> str:
    """``4294967296`` -> ``"4 GiB"``, ``1610612736`` -> ``"1.5 GiB"``."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n // size} {unit}" if n % size == 0 else f"{n / size:.1f} {unit}"
    return f"{n} B"


def _require_room(size: int) -> None:
    """A heap larger than the free space of /dev/shm would be accepted (tmpfs segments are sparse)
    and kill the process with SIGBUS once it is touched past that space: refuse it up front."""
    st = os.statvfs(SHM_DIR)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    if size > free:
        raise MoriOutOfMemoryError(
            f"MORI_SHMEM_HEAP_SIZE={_human(size)} ({size} bytes) does not fit in {SHM_DIR}: "
            f"{_human(free)} free of {_human(total)}, and every rank on this host needs a "
            f"heap of its own there. Lower MORI_SHMEM_HEAP_SIZE (e.g. MORI_SHMEM_HEAP_SIZE=256M), or "
            f"give {SHM_DIR} more room (a container's is often 64 MiB: docker run --shm-size=16g, or "
            f"an emptyDir with medium: Memory on Kubernetes)"
        )


class ShmSegment(HeapSegment):
    def __init__(self, size: int, tag: str) -> None:
        self.name = segment_name(tag)
        self.size = size
        self._shm = _core.SharedMemory.create(self.name, size)
        self.addr = self._shm.addr
        self.handle = self.name.encode()

    def seal(self) -> None:
        self._shm.unlink()

    def close(self) -> None:
        self._shm.close()
        self.addr = 0


class MappedPeerSegment(PeerSegment):
    def __init__(self, name: str, size: int) -> None:
        self.size = size
        self._shm = _core.SharedMemory.open(name, size)
        self.addr = self._shm.addr

    def close(self) -> None:
        self._shm.close()
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
        _require_room(size)
        return ShmSegment(size, tag)

    def open_peer_segment(self, peer: PeerInfo) -> PeerSegment:
        return MappedPeerSegment(peer.segment_handle.decode(), peer.heap_size)


@hookimpl
def mori_device_runtimes() -> Sequence[DeviceRuntime]:
    return [CpuRuntime()]

"""The symmetric heap across processes: collective allocation, translation, registration, cleanup."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import mori.shmem as shmem
from mori.core.backend import PeerInfo
from mori.core.backends.cpu import SEGMENT_PREFIX, CpuRuntime, stale_segments, sweep_stale_segments
from mori.core.errors import (
    MoriOutOfMemoryError,
    MoriStateError,
    MoriTimeoutError,
    MoriValueError,
)
from mori.testing import RankError, run_ranks, shmem_ranks


def _offsets(rank: int, nranks: int) -> list[int]:
    base = shmem.shmem_heap_info()["base"]
    a = shmem.shmem_malloc(100)
    b = shmem.shmem_malloc_align(1 << 16, 5000)
    c = shmem.shmem_ext_malloc_with_flags(1)
    shmem.shmem_free(a)
    d = shmem.shmem_malloc(64)  # first fit reuses a's block
    assert d == a
    assert a % 256 == 0 and b % (1 << 16) == 0 and c % 256 == 0
    return [x - base for x in (a, b, c, d)]


@pytest.mark.parametrize("nranks", [2, 4])
def test_malloc_is_symmetric_and_aligned(nranks: int) -> None:
    offsets = shmem_ranks(_offsets, nranks)
    assert all(o == offsets[0] for o in offsets)


def _ptr_p2p(rank: int, nranks: int) -> list[Any]:
    import torch

    buf = shmem.shmem_malloc(4096)
    shmem.shmem_tensor_view(buf, 1024, torch.int32).fill_(rank)
    shmem.shmem_barrier_all()
    seen = []
    for pe in range(nranks):
        addr = shmem.shmem_ptr_p2p(buf, rank, pe)
        assert addr != 0
        assert (addr == buf) == (pe == rank)
        import ctypes

        seen.append(ctypes.c_int32.from_address(addr + 4 * 100).value)  # loads reach the peer's copy
    # not in the heap -> 0, as the original
    assert shmem.shmem_ptr_p2p(12345, rank, 0) == 0
    assert shmem.shmem_ptr_p2p(buf + 1 << 40, rank, 0) == 0
    with pytest.raises(MoriValueError, match="dest_pe=99"):
        shmem.shmem_ptr_p2p(buf, rank, 99)
    with pytest.raises(MoriValueError, match="my_pe"):
        shmem.shmem_ptr_p2p(buf, (rank + 1) % nranks, 0)
    shmem.shmem_barrier_all()
    return seen


@pytest.mark.parametrize("nranks", [2, 4])
def test_ptr_p2p_reaches_every_peer_on_the_node(nranks: int) -> None:
    for seen in shmem_ranks(_ptr_p2p, nranks):
        assert seen == list(range(nranks))


def _allocation_errors(rank: int, nranks: int) -> None:
    info = shmem.shmem_heap_info()
    with pytest.raises(MoriOutOfMemoryError, match=r"cannot allocate .*raise MORI_SHMEM_HEAP_SIZE"):
        shmem.shmem_malloc(info["size"])  # more than the user part of the heap
    with pytest.raises(MoriValueError, match="size=0"):
        shmem.shmem_malloc(0)
    with pytest.raises(MoriValueError, match="size=-5"):
        shmem.shmem_malloc(-5)
    with pytest.raises(MoriValueError, match="alignment=3"):
        shmem.shmem_malloc_align(3, 64)
    with pytest.raises(MoriValueError, match="flags=1"):
        shmem.shmem_ext_malloc_with_flags(64, 1)
    a = shmem.shmem_malloc(1024)
    with pytest.raises(MoriValueError, match=r"not returned by shmem_malloc .*points 8 bytes into the block"):
        shmem.shmem_free(a + 8)
    with pytest.raises(MoriValueError, match="not inside the symmetric heap"):
        shmem.shmem_free(16)  # foreign pointer
    with pytest.raises(MoriValueError, match="expected an address"):
        shmem.shmem_free("a")  # type: ignore[arg-type]
    shmem.shmem_free(a)
    with pytest.raises(MoriValueError, match="double free"):
        shmem.shmem_free(a)
    # the heap still works after all those errors
    b = shmem.shmem_malloc(1024)
    assert b == a
    shmem.shmem_barrier_all()


@pytest.mark.parametrize("nranks", [2, 4])
def test_allocation_errors(nranks: int) -> None:
    shmem_ranks(_allocation_errors, nranks, heap="4M")


def _non_collective_malloc(rank: int, nranks: int) -> str:
    try:
        shmem.shmem_malloc(1024 if rank == 0 else 4096)
    except MoriStateError as e:
        return str(e)
    return "no error"


def test_non_collective_malloc_is_detected_on_every_pe() -> None:
    for msg in shmem_ranks(_non_collective_malloc, 2):
        assert "shmem_malloc is collective" in msg and "size 1024" in msg and "size 4096" in msg


def _register(rank: int, nranks: int) -> None:
    import torch

    t = torch.zeros(1000, dtype=torch.uint8)
    assert shmem.shmem_buffer_register(t.data_ptr(), 1000) == 0
    with pytest.raises(MoriValueError, match="overlaps the registered buffer"):
        shmem.shmem_buffer_register(t.data_ptr() + 10, 10)
    with pytest.raises(MoriValueError, match="size=0"):
        shmem.shmem_buffer_register(t.data_ptr(), 0)
    with pytest.raises(MoriValueError, match="ptr=0"):
        shmem.shmem_buffer_register(0, 10)
    # a registered buffer is local only: peers cannot load it
    assert shmem.shmem_ptr_p2p(t.data_ptr(), rank, (rank + 1) % nranks) == 0
    with pytest.raises(MoriValueError, match="not a registered buffer"):
        shmem.shmem_buffer_deregister(t.data_ptr(), 999)
    assert shmem.shmem_buffer_deregister(t.data_ptr(), 1000) == 0
    with pytest.raises(MoriValueError, match="not a registered buffer"):
        shmem.shmem_buffer_deregister(t.data_ptr(), 1000)


def test_buffer_register_and_deregister() -> None:
    shmem_ranks(_register, 2)


class _Libc:
    """mmap/mprotect/munmap through ctypes: memory laid out page by page, holes included."""

    PROT_NONE, PROT_READ, PROT_WRITE = 0, 1, 2
    MAP_PRIVATE, MAP_ANONYMOUS, MAP_NORESERVE = 0x02, 0x20, 0x4000

    def __init__(self) -> None:
        import ctypes

        self.lib = ctypes.CDLL(None, use_errno=True)
        self.lib.mmap.restype = ctypes.c_void_p
        self.lib.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        self.lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.lib.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def mmap(self, size: int, flags: int = 0) -> int:
        prot = self.PROT_READ | self.PROT_WRITE
        addr = self.lib.mmap(None, size, prot, self.MAP_PRIVATE | self.MAP_ANONYMOUS | flags, -1, 0)
        assert addr not in (None, 2**64 - 1), "mmap failed"
        return int(addr)

    def munmap(self, addr: int, size: int) -> None:
        assert self.lib.munmap(addr, size) == 0

    def mprotect(self, addr: int, size: int, prot: int) -> None:
        assert self.lib.mprotect(addr, size, prot) == 0


def _register_unusable_memory(rank: int, nranks: int) -> None:
    import mmap

    libc, page = _Libc(), mmap.PAGESIZE
    base = libc.mmap(4 * page)  # pages: [read-write][unmapped][no access][read-only]
    libc.munmap(base + page, page)
    libc.mprotect(base + 2 * page, page, libc.PROT_NONE)
    libc.mprotect(base + 3 * page, page, libc.PROT_READ)
    hole = base + page
    with pytest.raises(MoriValueError, match=rf"\[{hole:#x}, \+{page}\).* {hole:#x} is not mapped"):
        shmem.shmem_buffer_register(hole, page)
    with pytest.raises(MoriValueError, match=f"{hole:#x} is not mapped"):
        shmem.shmem_buffer_register(base + 8, page)  # starts mapped, runs into the hole
    with pytest.raises(MoriValueError, match=f"{base + 2 * page:#x} is not readable and writable"):
        shmem.shmem_buffer_register(base + 2 * page, 16)
    with pytest.raises(MoriValueError, match=f"{base + 3 * page:#x} is not readable and writable"):
        shmem.shmem_buffer_register(base + 3 * page, 16)
    with pytest.raises(MoriValueError, match="runs past the end of the address space"):
        shmem.shmem_buffer_register(2**64 - 16, 4096)
    with pytest.raises(MoriValueError, match="ptr=18446744073709551616"):
        shmem.shmem_buffer_register(2**64, 1)
    # nothing was registered: a put from the hole is refused with a named error, not a crash
    dst = shmem.shmem_malloc(page)
    with pytest.raises(MoriValueError, match="shmem_buffer_register"):
        shmem.shmem_putmem(dst, hole, 64, (rank + 1) % nranks)
    # the usable page registers and works as a source
    assert shmem.shmem_buffer_register(base, page) == 0
    shmem.shmem_putmem(dst, base, page, (rank + 1) % nranks)
    shmem.shmem_buffer_deregister(base, page)
    # a large range is checked by its mappings, not page by page: 1 GiB reserved, never touched
    big = libc.mmap(1 << 30, libc.MAP_NORESERVE)
    assert shmem.shmem_buffer_register(big, 1 << 30) == 0
    shmem.shmem_buffer_deregister(big, 1 << 30)
    shmem.shmem_barrier_all()
    for addr in (base, base + 2 * page, base + 3 * page):
        libc.munmap(addr, page)
    libc.munmap(big, 1 << 30)


def test_buffer_register_refuses_memory_a_put_could_not_read() -> None:
    shmem_ranks(_register_unusable_memory, 2)


def test_heap_size_must_be_valid_and_symmetric() -> None:
    with pytest.raises(RankError, match="MORI_SHMEM_HEAP_SIZE='6X' is not valid"):
        shmem_ranks(_identity, 2, env={"MORI_SHMEM_HEAP_SIZE": "6X"})
    uid = shmem.shmem_get_unique_id()
    for msg in run_ranks(_asymmetric_heap, 2, uid, timeout=60):
        assert "MORI_SHMEM_HEAP_SIZE differs between ranks" in msg
    with pytest.raises(RankError, match="MORI_SHMEM_MODE='vmm_heap' is not supported by the cpu runtime"):
        shmem_ranks(_identity, 2, env={"MORI_SHMEM_MODE": "vmm_heap"})


def _identity(rank: int, nranks: int) -> int:
    return shmem.shmem_mype()


def _asymmetric_heap(rank: int, nranks: int, uid: bytes) -> str:
    os.environ["MORI_SHMEM_HEAP_SIZE"] = "8M" if rank == 0 else "16M"
    try:
        shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, rank, nranks, uid)
    except MoriValueError as e:
        return str(e)
    return "no error"


def _disable_p2p(rank: int, nranks: int) -> None:
    import torch

    from mori.shmem.context import current

    buf = shmem.shmem_malloc(64)
    peer = (rank + 1) % nranks
    assert shmem.shmem_ptr_p2p(buf, rank, peer) == 0  # no load/store mapping of the peer
    assert shmem.shmem_ptr_p2p(buf, rank, rank) == buf
    ctx = current("test")
    assert ctx.network is not None and peer in ctx.network.peers  # the network path instead
    mine = shmem.shmem_tensor_view(buf, (64,), torch.uint8)
    mine.fill_(rank + 1)
    shmem.shmem_barrier_all()
    shmem.shmem_putmem(buf + 32, buf, 8, peer)  # our first 8 bytes into the peer's [32, 40)
    shmem.shmem_barrier_all()
    assert bool((mine[32:40] == peer + 1).all()) and bool((mine[40:] == rank + 1).all())


def test_disable_p2p_takes_the_network_path() -> None:
    """MORI_DISABLE_P2P forces the proxy/network path, as in the original: no PE maps another's
    heap, and one-sided calls between them go through the network transport."""
    shmem_ranks(_disable_p2p, 2, env={"MORI_DISABLE_P2P": "1"})


def _never_runs(rank: int, nranks: int) -> None:
    raise AssertionError("init should have failed")


def test_unreachable_peers_without_a_network_transport_fail_init_clearly() -> None:
    """PEs that nothing reaches (no mapping, and the network transport named does not exist) make
    init fail at once, naming the setting, instead of failing later at a call."""
    from mori.testing import RankError

    with pytest.raises(RankError, match="MORI_SHMEM_TRANSPORT='none-such' is not allowed"):
        shmem_ranks(_never_runs, 2, env={"MORI_DISABLE_P2P": "1", "MORI_SHMEM_TRANSPORT": "none-such"})


def _own_heap_names(rank: int, nranks: int) -> tuple[list[str], list[str]]:
    from mori.shmem.context import current

    shmem.shmem_barrier_all()
    job = shmem.shmem_heap_info()["job_id"]
    # the names every PE actually created carry the job's prefix
    prefix = f"/{SEGMENT_PREFIX}{job}."
    names = [i.segment_handle.decode() for i in current("test").peer_infos]
    assert all(n.startswith(prefix) for n in names), names
    return sorted(p.name for p in Path("/dev/shm").glob(f"{SEGMENT_PREFIX}{job}.*")), names


def test_segments_are_unlinked_once_every_peer_mapped() -> None:
    # After init no name of this job is left in /dev/shm: the memory dies with the last process
    # mapping it. Another job's segment (here one mid-init, still named) must not matter.
    other = CpuRuntime().create_segment(1 << 20, f"{secrets.token_hex(8)}.0")
    try:
        results = shmem_ranks(_own_heap_names, 4)
        assert [left for left, _ in results] == [[]] * 4
        assert all(names == results[0][1] for _, names in results)  # one job: one set of names
        assert Path("/dev/shm", other.name.lstrip("/")).exists()
    finally:
        other.close()


_KILLED_RANK = """
import os, sys, time
import mori.shmem as shmem
shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, int(sys.argv[1]), 2, bytes.fromhex(sys.argv[2]))
a = shmem.shmem_malloc(1 << 20)
print("ready", flush=True)
time.sleep(600)
"""


def test_killed_ranks_leave_nothing_in_dev_shm(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("MORI_SHMEM_HEAP_SIZE", "8M")
    clean_env.setenv("MORI_BOOTSTRAP_TIMEOUT", "30")
    uid = shmem.shmem_get_unique_id().hex()
    procs = [
        subprocess.Popen([sys.executable, "-c", _KILLED_RANK, str(r), uid], stdout=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait()
            if p.stdout is not None:
                p.stdout.close()
    # each killed rank's segment name carries its pid (mori-heap.<job>.<pe>.<pid>); none may be left
    assert [
        n
        for n in os.listdir("/dev/shm")
        for p in procs
        if n.startswith(SEGMENT_PREFIX) and n.endswith(f".{p.pid}")
    ] == []


def test_stale_segments_are_proven_dead_by_their_lock() -> None:
    # A segment's creator holds a lock on it until its name is gone; a name nobody holds the lock
    # of is stale (its creator died before the peers mapped it), whatever its pid says.
    runtime = CpuRuntime()
    alive = runtime.create_segment(1 << 20, f"{secrets.token_hex(8)}.0")
    alive_name = alive.name.lstrip("/")
    dead = f"{SEGMENT_PREFIX}{secrets.token_hex(8)}.1.{os.getpid()}"  # our own pid, and yet dead
    Path("/dev/shm", dead).write_bytes(b"x")
    fresh = f"{SEGMENT_PREFIX}{secrets.token_hex(8)}.2.1"  # size 0: a creator may be about to lock it
    Path("/dev/shm", fresh).touch()
    old_format = f"{SEGMENT_PREFIX}1.{secrets.token_hex(6)}.3"  # an older mori's: no lock to judge by
    Path("/dev/shm", old_format).write_bytes(b"x")
    try:
        assert dead in stale_segments() and alive_name not in stale_segments()
        removed = sweep_stale_segments()
        assert dead in removed
        assert not {alive_name, fresh, old_format} & set(removed)
        assert not Path("/dev/shm", dead).exists()
        assert all(Path("/dev/shm", n).exists() for n in (alive_name, fresh, old_format))
        alive.seal()  # unlinking drops the lock, after the name is gone
        assert not Path("/dev/shm", alive_name).exists()
    finally:
        alive.close()
        for n in (dead, fresh, old_format):
            Path("/dev/shm", n).unlink(missing_ok=True)


def _slow_barrier(rank: int, nranks: int, uid: bytes) -> str:
    os.environ.update(MORI_BOOTSTRAP_TIMEOUT="3", MORI_SHMEM_HEAP_SIZE="8M")
    shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, rank, nranks, uid)
    if rank == nranks - 1:
        time.sleep(6)  # longer than the barrier timeout; exits without finalize
        return "late"
    try:
        shmem.shmem_barrier_all()
    except MoriTimeoutError as e:
        assert e.missing == [nranks - 1]
        return str(e)
    return "passed"


def test_barrier_timeout_names_missing_pes() -> None:
    uid = shmem.shmem_get_unique_id()
    out = run_ranks(_slow_barrier, 3, uid, timeout=60)
    for msg in out[:2]:
        assert "shmem_barrier_all: PEs 2 of 3 did not arrive within 3 s" in msg


def _other_pid_namespace() -> list[str]:
    """The command prefix that runs a process in a new PID namespace sharing /dev/shm, or skip."""
    cmd = ["unshare", "--pid", "--fork", "--mount-proc"]
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    probe = subprocess.run([*cmd, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare --pid is not permitted here: {probe.stderr.strip()}")
    return cmd


_HOLD_A_SEGMENT = """
import sys, time
from mori.core.backends.cpu import CpuRuntime
seg = CpuRuntime().create_segment(1 << 20, sys.argv[1])
print(seg.name, flush=True)
time.sleep(600)
"""

_INIT_ONE_RANK = """
import mori.shmem as shmem
shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, 0, 1, shmem.shmem_get_unique_id())
shmem.shmem_finalize()
print("init ok", flush=True)
"""


def test_init_in_another_pid_namespace_removes_only_dead_segments(clean_env: pytest.MonkeyPatch) -> None:
    # Another job's mori init runs in a new PID namespace that shares /dev/shm (a container
    # without its own /dev/shm): pid numbers mean nothing across it. A live job's segment that
    # its peers have not mapped yet must survive that init; one whose owner was killed must not.
    cmd = _other_pid_namespace()
    runtime = CpuRuntime()
    live = runtime.create_segment(1 << 20, f"{secrets.token_hex(8)}.0")
    killed = subprocess.Popen(
        [sys.executable, "-c", _HOLD_A_SEGMENT, f"{secrets.token_hex(8)}.1"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert killed.stdout is not None
        dead_name = killed.stdout.readline().strip()
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        killed.stdout.close()
        assert Path("/dev/shm", dead_name.lstrip("/")).exists()  # killed before its peers mapped it
        env = {**os.environ, "MORI_SHMEM_HEAP_SIZE": "8M", "MORI_DEVICE_RUNTIME": "cpu"}
        out = subprocess.run(
            [*cmd, sys.executable, "-c", _INIT_ONE_RANK], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0 and "init ok" in out.stdout, out.stderr
        assert Path("/dev/shm", live.name.lstrip("/")).exists(), "a live job's segment was removed"
        assert not Path("/dev/shm", dead_name.lstrip("/")).exists(), "a dead owner's segment was kept"
        # and a peer of the live job can still map it
        info = PeerInfo(1, "n", "h", os.getpid(), "cpu", live.size, segment_handle=live.handle)
        peer = runtime.open_peer_segment(info)
        peer.close()
    finally:
        live.close()
        Path("/dev/shm", dead_name.lstrip("/")).unlink(missing_ok=True)


def test_a_heap_larger_than_dev_shm_is_refused_at_init(clean_env: pytest.MonkeyPatch) -> None:
    # tmpfs accepts a sparse segment of any size; touching past its free space is a SIGBUS later.
    free = shutil.disk_usage("/dev/shm").free
    clean_env.setenv("MORI_SHMEM_HEAP_SIZE", str(free + (1 << 30)))
    clean_env.setenv("MORI_DEVICE_RUNTIME", "cpu")
    clean_env.setenv("MORI_BOOTSTRAP_TIMEOUT", "10")
    with pytest.raises(MoriOutOfMemoryError, match=r"MORI_SHMEM_HEAP_SIZE=.* does not fit in /dev/shm"):
        shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, 0, 1, shmem.shmem_get_unique_id())
    assert not shmem.shmem_is_initialized()


_INIT_DEFAULT_HEAP = """
import mori.shmem as shmem
from mori.core.errors import MoriOutOfMemoryError
try:
    shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, 0, 1, shmem.shmem_get_unique_id())
    buf = shmem.shmem_malloc(64 << 20)
    import torch
    shmem.shmem_tensor_view(buf, 64 << 20, torch.uint8).fill_(1)  # past a 16 MiB /dev/shm: SIGBUS
    print("no error")
except MoriOutOfMemoryError as e:
    print(e)
"""


def test_a_container_sized_dev_shm_gets_a_clear_error(clean_env: pytest.MonkeyPatch) -> None:
    # A container's /dev/shm is often 64 MiB; the default heap is 4 GiB. Played with a 16 MiB
    # tmpfs mounted over /dev/shm in a mount namespace of its own.
    cmd = ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs -o size=16m tmpfs /dev/shm && exec "$@"', "sh"]
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    probe = subprocess.run([*cmd, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare --mount / mount tmpfs is not permitted here: {probe.stderr.strip()}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MORI_")}
    env.update(MORI_DEVICE_RUNTIME="cpu", MORI_BOOTSTRAP_TIMEOUT="10")
    out = subprocess.run(
        [*cmd, sys.executable, "-c", _INIT_DEFAULT_HEAP], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, f"rc {out.returncode}: {out.stderr[-2000:]}"
    message = out.stdout.strip()
    assert "MORI_SHMEM_HEAP_SIZE=4 GiB (4294967296 bytes) does not fit in /dev/shm" in message, message
    assert "16 MiB free" in message and "--shm-size" in message, message

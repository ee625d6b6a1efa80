"""The direct path of the TCP backend: a same-host initiator copies CPU bytes itself
(process_vm_readv/writev), checked against the registration table the target publishes, with no
socket round trip per transfer (csrc/table.hpp)."""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from mori.core import test_hooks
from mori.core.errors import MoriStateError, MoriTimeoutError
from mori.io import EngineDesc, MemoryDesc, MemoryLocationType, StatusCode, TcpBackendConfig
from mori.testing import run_ranks
from mori.testing.file_rendezvous import get as _get
from mori.testing.file_rendezvous import put as _put


def _pair(make, cfg: TcpBackendConfig | None = None, n: int = 4 << 20):
    a, b = make("a", cfg), make("b", cfg)
    a.register_remote_engine(b.get_engine_desc())
    x = torch.randint(0, 256, (n,), dtype=torch.uint8)
    y = torch.zeros(n, dtype=torch.uint8)
    return a, b, x, y, a.register_torch_tensor(x), b.register_torch_tensor(y)


def test_transfer_completes_inside_the_post_call(make) -> None:
    a, b, x, y, mx, my = _pair(make)
    st = a.write(mx, 0, my, 0, 1 << 20, 1)
    # no socket round trip: the status is final when write() returns
    assert st.WaitFor(0) and st.Succeeded(), st.Message()
    assert torch.equal(y[: 1 << 20], x[: 1 << 20])
    assert a._counters()["direct_copies"] == 1
    assert b._counters()["served_cma"] == 0 and b._counters()["served_socket"] == 0
    inbound = b.pop_inbound_transfer_status("a", 1)
    assert inbound is not None and inbound.Succeeded()


@pytest.mark.parametrize("op", ["read", "write"])
def test_large_transfers_split_over_threads_are_byte_exact(
    monkeypatch: pytest.MonkeyPatch, make, op: str
) -> None:
    monkeypatch.setenv("MORI_IO_CMA_THREADS", "3")
    a, _b, x, y, mx, my = _pair(make, n=24 << 20)
    if op == "read":
        y.copy_(torch.randint(0, 256, y.shape, dtype=torch.uint8))
    # one odd-sized block, then a batch of uneven, non-contiguous blocks (pieces cut inside blocks)
    sizes = [(7 << 20) + 13, 3, 1 << 20, (2 << 20) + 4097, 65536 - 1, (3 << 20) + 1]
    lo, ro, at_l, at_r = [], [], 5, 1000
    for s in sizes:
        lo.append(at_l)
        ro.append(at_r)
        at_l += s + 17
        at_r += s + 4096 + 3
    src, dst = (x, y) if op == "write" else (y, x)
    st = getattr(a, op)(mx, 11, my, 22, sizes[0], 1)
    assert st.WaitFor(0) and st.Succeeded(), st.Message()
    s_off, d_off = (11, 22) if op == "write" else (22, 11)
    assert torch.equal(dst[d_off : d_off + sizes[0]], src[s_off : s_off + sizes[0]])
    (bst,) = getattr(a, f"batch_{op}")([mx], [lo], [my], [ro], [sizes], [2])
    assert bst.WaitFor(0) and bst.Succeeded(), bst.Message()
    for lo_, ro_, n in zip(lo, ro, sizes, strict=True):
        s_off, d_off = (lo_, ro_) if op == "write" else (ro_, lo_)
        assert torch.equal(dst[d_off : d_off + n], src[s_off : s_off + n])
    assert a._counters()["direct_copies"] == 2


@pytest.mark.parametrize("op", ["read", "write"])
def test_small_pieces_over_threads_are_byte_exact(monkeypatch: pytest.MonkeyPatch, make, op: str) -> None:
    """Pieces of MORI_IO_CMA_SPLIT_BYTES (here the smallest, 4 KiB) over 3 threads: odd sizes,
    a batch whose bytes do not divide by the thread count, blocks cut inside, every byte lands
    and nothing beside the blocks moves."""
    monkeypatch.setenv("MORI_IO_CMA_THREADS", "3")
    monkeypatch.setenv("MORI_IO_CMA_SPLIT_BYTES", "4K")
    a, _b, x, y, mx, my = _pair(make, n=2 << 20)
    if op == "read":
        y.copy_(torch.randint(0, 256, y.shape, dtype=torch.uint8))
    src, dst = (x, y) if op == "write" else (y, x)
    before = dst.clone()
    splits0 = a._counters()["direct_split"]
    uid = 1
    for n in (8191, 8192, 12289, 65537, (1 << 20) + 7):  # 1 piece (below 2 x 4 KiB), 2, 3 (uneven), 3, 3
        st = getattr(a, op)(mx, 3, my, 5, n, uid)
        uid += 1
        assert st.WaitFor(0) and st.Succeeded(), (n, st.Message())
        s_off, d_off = (3, 5) if op == "write" else (5, 3)
        assert torch.equal(dst[d_off : d_off + n], src[s_off : s_off + n]), n
        assert torch.equal(dst[:d_off], before[:d_off]) and torch.equal(dst[d_off + n :], before[d_off + n :])
        before = dst.clone()
    # 7 blocks of 4097 bytes with gaps: 28679 bytes in 7 pieces of 4097 cut over 3 threads
    sizes = [4097] * 7
    lo = [100 + i * 5000 for i in range(7)]
    ro = [7 + i * 4999 * 2 for i in range(7)]
    (bst,) = getattr(a, f"batch_{op}")([mx], [lo], [my], [ro], [sizes], [uid])
    assert bst.WaitFor(0) and bst.Succeeded(), bst.Message()
    for lo_, ro_, n in zip(lo, ro, sizes, strict=True):
        s_off, d_off = (lo_, ro_) if op == "write" else (ro_, lo_)
        assert torch.equal(dst[d_off : d_off + n], src[s_off : s_off + n])
    assert a._counters()["direct_split"] - splits0 == 5, (
        "every transfer here but the first is cut over threads"
    )


def _tasks() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _copy_threads() -> set[str]:
    """This process's threads named as the engine names its copy threads."""
    found = set()
    for t in _tasks():
        try:
            if Path(f"/proc/self/task/{t}/comm").read_text().strip() == "mori-io-copy":
                found.add(t)
        except FileNotFoundError:  # ended meanwhile
            pass
    return found


def test_copy_threads_are_bounded_and_joined_at_shutdown(monkeypatch: pytest.MonkeyPatch, make) -> None:
    """MORI_IO_CMA_THREADS=3: at most 2 copy threads of the engine's own (named mori-io-copy)
    beside the posting one, started by the first cut transfer, whatever the number of posting
    threads; all joined by shutdown()."""
    monkeypatch.setenv("MORI_IO_CMA_THREADS", "3")
    monkeypatch.setenv("MORI_IO_CMA_SPLIT_BYTES", "4K")
    a, b, x, y, mx, my = _pair(make, n=4 << 20)
    _connected(a, mx, my)
    assert not _copy_threads(), "no copy thread before a transfer is cut"
    errors: list[str] = []

    def post(k: int) -> None:
        for i in range(50):
            st = a.write(mx, k << 16, my, k << 16, 60000, 1000 + k * 100 + i)
            if not (st.WaitFor(0) and st.Succeeded()):
                errors.append(st.Message())

    ths = [threading.Thread(target=post, args=(k,)) for k in range(4)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    assert not errors, errors[:3]
    for k in range(4):
        assert torch.equal(y[k << 16 : (k << 16) + 60000], x[k << 16 : (k << 16) + 60000])
    copiers = _copy_threads()
    assert 1 <= len(copiers) <= 2, f"copy threads started: {len(copiers)}"
    a.shutdown()
    assert not _copy_threads(), "copy threads still running after shutdown"
    b.shutdown()


def test_shutdown_while_cut_transfers_run(monkeypatch: pytest.MonkeyPatch, make) -> None:
    """Posting threads keep copying cut transfers while the engine shuts down: every status
    completes (succeeded, or failed with a message), nothing crashes, no thread is left."""
    monkeypatch.setenv("MORI_IO_CMA_THREADS", "3")
    monkeypatch.setenv("MORI_IO_CMA_SPLIT_BYTES", "4K")
    a, b, x, y, mx, my = _pair(make, n=8 << 20)
    _connected(a, mx, my)
    before = _tasks()
    stop = threading.Event()
    seen: dict[str, int] = {"ok": 0, "failed": 0, "open": 0}
    landed: set[int] = set()
    lock = threading.Lock()

    def post(k: int) -> None:
        i = 0
        while not stop.is_set() and i < 20000:
            i += 1
            try:
                st = a.write(mx, 0, my, k << 20, 1 << 20, 5000 + k * 100000 + i)
            except MoriStateError:  # posted after shutdown() returned
                return
            key = "open" if not st.WaitFor(30_000) else "ok" if st.Succeeded() else "failed"
            with lock:
                seen[key] += 1
                if key == "ok":
                    landed.add(k)
            if key == "failed":
                assert st.Message()
                return

    ths = [threading.Thread(target=post, args=(k,)) for k in range(3)]
    for t in ths:
        t.start()
    time.sleep(0.2)
    during = _tasks() - before  # the posting threads and the engine's copy threads
    assert 1 <= len(_copy_threads()) <= 2
    a.shutdown()
    stop.set()
    for t in ths:
        t.join(60)
        assert not t.is_alive()
    assert seen["open"] == 0, seen
    assert seen["ok"] > 0, seen
    for k in landed:  # every write carries the same bytes: even one cut short by shutdown leaves them
        assert torch.equal(y[k << 20 : (k + 1) << 20], x[: 1 << 20])
    b.shutdown()
    assert not (_tasks() & during), "threads left after shutdown"
    assert not _copy_threads()


def test_forged_descriptor_is_stopped_by_the_owners_table(make) -> None:
    """The initiator checks blocks against the entry the target wrote, not the descriptor."""
    a, b, _x, y, mx, my = _pair(make, n=1 << 20)
    n = y.numel()
    forged = MemoryDesc(**{**my.__dict__, "size": n * 4})
    before = y.clone()
    for i, st in enumerate(
        (
            a.write(mx, 0, forged, n - 8, 16, 1),
            a.read(mx, 0, forged, n, 8, 2),
            a.create_session(mx, forged).batch_write([0, 0], [0, n - 1], [4, 4], 3),
        )
    ):
        assert st.WaitFor(0), "a refused direct transfer completes inside the post call"
        assert st.Code() == StatusCode.ERR_INVALID_ARGS, (i, st.Message())
        assert "per its own registration table" in st.Message()
    assert torch.equal(y, before), "bytes moved despite the bounds check"
    # the target learns of the refused transfer too
    inbound = b.pop_inbound_transfer_status("a", 1)
    assert inbound is not None and inbound.Code() == StatusCode.ERR_INVALID_ARGS
    assert a._counters()["direct_copies"] == 0


def _connected(a, mx, my) -> None:
    """One transfer first: the connections and the grant exist, so what a test times is the copy."""
    st = a.write(mx, 0, my, 0, 8, 999)
    assert st.WaitFor(30_000) and st.Succeeded(), st.Message()


def test_deregister_waits_for_a_copy_in_flight(make) -> None:
    a, b, x, y, mx, my = _pair(make)
    _connected(a, mx, my)
    test_hooks.direct_delay_ms(a._native, 400)  # the copy sleeps after its bounds check
    result: dict[str, object] = {}

    def post() -> None:
        result["st"] = a.write(mx, 0, my, 0, x.numel(), 1)
        result["done_at"] = time.monotonic()

    th = threading.Thread(target=post)
    th.start()
    time.sleep(0.1)  # the copy has read the table entry and is sleeping
    t0 = time.monotonic()
    b.deregister_memory(my)
    returned_at = time.monotonic()
    # deregister_memory returned only once the copy was over ...
    assert returned_at - t0 > 0.15, "deregister_memory did not wait for the copy in flight"
    snapshot = y.clone()
    th.join()
    st = result["st"]
    assert isinstance(st, type(a.write(mx, 0, my, 0, 0, 2)))
    assert st.Succeeded(), st.Message()
    assert result["done_at"] <= returned_at + 0.05
    # ... the bytes were all there when it returned, and nothing touches them afterwards
    assert torch.equal(snapshot, x)
    test_hooks.direct_delay_ms(a._native, 0)
    y.zero_()
    late = a.write(mx, 0, my, 0, 4096, 3)
    late.Wait()
    assert late.Code() == StatusCode.ERR_INVALID_ARGS and "not registered" in late.Message()
    assert int(y.count_nonzero()) == 0


def test_deregister_times_out_while_a_copy_hangs(monkeypatch: pytest.MonkeyPatch, make) -> None:
    monkeypatch.setenv("MORI_IO_CP_TIMEOUT_MS", "300")
    a, b, _x, _y, mx, my = _pair(make, n=4096)
    _connected(a, mx, my)
    test_hooks.direct_delay_ms(a._native, 1500)
    th = threading.Thread(target=lambda: a.write(mx, 0, my, 0, 4096, 1))
    th.start()
    time.sleep(0.1)
    with pytest.raises(MoriTimeoutError, match="do not free it yet"):
        b.deregister_memory(my)
    th.join()


def test_refused_attach_falls_back_to_the_target(make) -> None:
    """The OS refuses the initiator's probe (as with EPERM): the target moves the bytes."""
    a, b = make("a"), make("b")
    a.register_remote_engine(b.get_engine_desc())
    test_hooks.refuse_direct(a._native, True)  # before the first connection
    x = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    y = torch.zeros_like(x)
    mx, my = a.register_torch_tensor(x), b.register_torch_tensor(y)
    st = a.write(mx, 0, my, 0, x.numel(), 1)
    st.Wait()
    assert st.Succeeded(), st.Message()
    assert torch.equal(x, y)
    c = a._counters()
    assert c["direct_refused"] >= 1 and c["direct_copies"] == 0
    assert b._counters()["served_cma"] > 0
    assert a._route_name(mx, my) == "tcp+cma"
    assert b.pop_inbound_transfer_status("a", 1) is not None


def test_target_that_grants_no_table_is_served_the_old_way(make) -> None:
    a, b = make("a"), make("b")
    a.register_remote_engine(b.get_engine_desc())
    test_hooks.refuse_cma(b._native, True)  # no grant, and target-side attach refused: the socket
    x = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    y = torch.zeros_like(x)
    mx, my = a.register_torch_tensor(x), b.register_torch_tensor(y)
    st = a.read(mx, 0, my, 0, x.numel(), 1)
    st.Wait()
    assert st.Succeeded(), st.Message()
    assert a._counters()["direct_copies"] == 0 and b._counters()["served_socket"] > 0


def test_many_inbound_statuses_overflow_the_ring_and_still_arrive(make) -> None:
    """More transfers than the slot's ring holds (4096), nobody popping: the doorbell drains it."""
    a, b, _x, _y, mx, my = _pair(make, n=1 << 16)
    sess = a.create_session(mx, my)
    count = 10_000
    for uid in range(count):
        st = sess.write(0, 0, 64, uid)
        assert st.WaitFor(0) and st.Succeeded(), st.Message()
    deadline = time.monotonic() + 10
    missing = set(range(count))
    while missing and time.monotonic() < deadline:
        missing = {u for u in missing if b.pop_inbound_transfer_status("a", u) is None}
        time.sleep(0.05)
    assert not missing, f"{len(missing)} inbound statuses never arrived"
    assert b._counters()["inbound_pending"] == 0


def test_notifications_off_records_nothing(make) -> None:
    a, b, _x, _y, mx, my = _pair(make, TcpBackendConfig(enable_notification=False), n=4096)
    st = a.write(mx, 0, my, 0, 4096, 5)
    assert st.WaitFor(0) and st.Succeeded()
    assert a._counters()["direct_copies"] == 1
    assert b.pop_inbound_transfer_status("a", 5) is None


def test_gpu_memory_is_not_published(make) -> None:
    """Only CPU regions enter the table; others keep the target-side path (staging)."""
    a, b = make("a"), make("b")
    a.register_remote_engine(b.get_engine_desc())
    for e in (a, b):  # the route needs a copier on the initiator too
        test_hooks.install_copier(e._native)
    x = torch.randint(0, 256, (8192,), dtype=torch.uint8)
    y = torch.zeros_like(x)
    mx = a.register_torch_tensor(x)
    my = b.register_memory(y.data_ptr(), y.numel(), 0, MemoryLocationType.GPU)
    st = a.write(mx, 0, my, 0, 8192, 1)
    st.Wait()
    assert st.Succeeded(), st.Message()
    assert torch.equal(x, y) and a._counters()["direct_copies"] == 0


# -- two processes -----------------------------------------------------------------------------


GUARD = 4096  # bytes on either side of the target's region that must never change


def _cross(rank: int, nranks: int, d: str) -> dict[str, object]:
    from mori.io import BackendType, IOEngine, IOEngineConfig

    d_ = Path(d)
    with IOEngine(f"p{rank}", IOEngineConfig("127.0.0.1", 0)) as e:
        e.create_backend(BackendType.TCP, TcpBackendConfig())
        if rank == 0:  # target: a region inside a larger allocation, guards around it
            big = torch.zeros((1 << 20) + 2 * GUARD, dtype=torch.uint8)
            region = big[GUARD : GUARD + (1 << 20)]
            m = e.register_torch_tensor(region)
            _put(d_, "target", e.get_engine_desc().pack().hex().encode() + b"|" + m.pack().hex().encode())
            _get(d_, "wrote", 120)
            g = torch.Generator().manual_seed(7)
            expect = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=g)
            ok = torch.equal(region, expect)
            guards = int(big[:GUARD].count_nonzero()) + int(big[GUARD + (1 << 20) :].count_nonzero())
            inbound = {u: e.pop_inbound_transfer_status("p1", u) for u in (1, 2, 3)}
            codes = {u: (int(s.Code()) if s is not None else None) for u, s in inbound.items()}
            e.deregister_memory(m)
            _put(d_, "deregistered", b"1")
            _get(d_, "finished", 120)
            after = int(big[:GUARD].count_nonzero()) + int(big[GUARD + (1 << 20) :].count_nonzero())
            return {
                "bytes_ok": ok,
                "guards": guards,
                "codes": codes,
                "unchanged": torch.equal(region, expect),
                "after": after,
            }
        desc_hex, mem_hex = _get(d_, "target").decode().split("|")
        e.register_remote_engine(EngineDesc.unpack(bytes.fromhex(desc_hex)))
        remote = MemoryDesc.unpack(bytes.fromhex(mem_hex))
        g = torch.Generator().manual_seed(7)
        src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=g)
        back = torch.zeros(1 << 20, dtype=torch.uint8)
        ms, mb = e.register_torch_tensor(src), e.register_torch_tensor(back)
        st = e.write(ms, 0, remote, 0, 1 << 20, 1)  # single block
        assert st.WaitFor(0) and st.Succeeded(), st.Message()
        offs = list(range(0, 1 << 20, 8192))
        (bst,) = e.batch_read([mb], [offs], [remote], [offs], [[4096] * len(offs)], [2])  # batch
        assert bst.WaitFor(0) and bst.Succeeded(), bst.Message()
        for o in offs:
            assert torch.equal(back[o : o + 4096], src[o : o + 4096])
        forged = MemoryDesc(**{**remote.__dict__, "size": remote.size + 2 * GUARD})
        bad = e.write(ms, 0, forged, (1 << 20) - 16, 64, 3)  # would spill into the guard
        assert bad.WaitFor(0) and bad.Code() == StatusCode.ERR_INVALID_ARGS, bad.Message()
        assert "per its own registration table" in bad.Message()
        counters = e._counters()
        _put(d_, "wrote", b"1")
        _get(d_, "deregistered", 120)
        late = e.write(ms, 0, remote, 0, 4096, 4)
        late.Wait()
        _put(d_, "finished", b"1")
        return {"direct": counters["direct_copies"], "late": int(late.Code()), "late_msg": late.Message()}


def test_two_processes_direct_path(tmp_path: Path) -> None:
    target, initiator = run_ranks(_cross, 2, str(tmp_path), timeout=180)
    if initiator["direct"] == 0:
        pytest.skip("the OS refuses cross-memory attach between these processes (ptrace scope)")
    assert initiator["direct"] == 2
    assert target["bytes_ok"] and target["guards"] == 0
    assert target["codes"] == {1: 0, 2: 0, 3: int(StatusCode.ERR_INVALID_ARGS)}
    # after deregistration the initiator reaches nothing: the target's table no longer has it
    assert initiator["late"] == int(StatusCode.ERR_INVALID_ARGS) and "not registered" in initiator["late_msg"]
    assert target["unchanged"] and target["after"] == 0


_VICTIM = """
import sys, time, torch
from mori.io import BackendType, IOEngine, IOEngineConfig
e = IOEngine("victim", IOEngineConfig("127.0.0.1", 0))
e.create_backend(BackendType.TCP)
buf = torch.zeros(8 << 20, dtype=torch.uint8)
m = e.register_torch_tensor(buf)
print(e.get_engine_desc().pack().hex(), m.pack().hex(), flush=True)
time.sleep(600)
"""


def test_killed_target_fails_direct_transfers(monkeypatch: pytest.MonkeyPatch, make) -> None:
    monkeypatch.setenv("MORI_IO_CP_TIMEOUT_MS", "1500")
    proc = subprocess.Popen([sys.executable, "-c", _VICTIM], stdout=subprocess.PIPE, text=True)
    try:
        desc_hex, mem_hex = proc.stdout.readline().split()
        a = make("survivor")
        a.register_remote_engine(EngineDesc.unpack(bytes.fromhex(desc_hex)))
        remote = MemoryDesc.unpack(bytes.fromhex(mem_hex))
        x = torch.ones(8 << 20, dtype=torch.uint8)
        mx = a.register_torch_tensor(x)
        st = a.write(mx, 0, remote, 0, 8 << 20, 1)
        st.Wait()
        assert st.Succeeded(), st.Message()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        after = a.write(mx, 0, remote, 0, 4096, 2)
        assert after.WaitFor(20_000), "a transfer to a dead peer hangs"
        assert after.Code() == StatusCode.ERR_BAD_STATE and "victim" in after.Message(), after.Message()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()


def _thp_available() -> bool:
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in mode and tuple(int(x) for x in os.uname().release.split(".")[:2]) >= (6, 1)


def _huge_kib(addr: int, size: int) -> int:
    """AnonHugePages (KiB) of this process's mappings overlapping [addr, addr + size)."""
    total, overlaps = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            overlaps = lo < addr + size and addr < hi
        elif overlaps and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


def test_registration_puts_cpu_memory_on_huge_pages_without_changing_it(
    monkeypatch: pytest.MonkeyPatch, make
) -> None:
    """Opted in (MORI_IO_THP=1), register_memory backs the 2 MiB-aligned interior of CPU memory with
    transparent huge pages (MADV_HUGEPAGE + MADV_COLLAPSE): the bytes stay what they were, and
    transfers that the initiator then cuts into 256 KiB pieces over threads arrive byte-exact."""
    monkeypatch.setenv("MORI_IO_THP", "1")
    a = make("a")
    b = make("b")
    a.register_remote_engine(b.get_engine_desc())
    n = 12 << 20
    x = torch.randint(0, 256, (n,), dtype=torch.uint8)
    y = torch.randint(0, 256, (n,), dtype=torch.uint8)
    x0, y0 = x.clone(), y.clone()
    mx, my = a.register_torch_tensor(x), b.register_torch_tensor(y)
    assert torch.equal(x, x0) and torch.equal(y, y0)
    if _thp_available():
        assert _huge_kib(y.data_ptr(), n) >= 4096, "registered CPU memory is not on huge pages"
    # 512 KiB and odd sizes: split over 2 threads when the target's entry says "huge"
    sizes = [512 << 10, (768 << 10) + 5, (1 << 20) - 3, 300000]
    at, offs = 7, []
    for s in sizes:
        offs.append(at)
        at += s + 4099
    for i, (off, s) in enumerate(zip(offs, sizes, strict=True)):
        st = a.write(mx, off, my, off + 1, s, 10 + i)
        assert st.WaitFor(0) and st.Succeeded(), st.Message()
        assert torch.equal(y[off + 1 : off + 1 + s], x[off : off + s])
        st = a.read(mx, off + 2, my, off + 1, s, 20 + i)
        assert st.WaitFor(0) and st.Succeeded(), st.Message()
        assert torch.equal(x[off + 2 : off + 2 + s], y[off + 1 : off + 1 + s])
    assert a._counters()["direct_copies"] == 2 * len(sizes)


def _huge_page_buffer(n: int) -> tuple[mmap.mmap, torch.Tensor]:
    """``n`` bytes the way a tuning user allocates them: an anonymous mapping marked
    MADV_HUGEPAGE and touched, so the kernel backs it with 2 MiB pages where it can."""
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    t.zero_()
    return m, t


@pytest.mark.parametrize("how", ["caller", "MORI_IO_THP=1"])
def test_transfers_are_cut_over_threads_by_the_page_size_of_the_target(
    monkeypatch: pytest.MonkeyPatch, make, how: str
) -> None:
    """The table gives the part of a region on huge pages (the caller's own huge pages, or the
    ones MORI_IO_THP=1 makes); a transfer counts as on huge pages where at most an eighth of its
    bytes lie outside it, and is then cut over threads into pieces of 256 KiB or more; on 4 KiB
    pages (a region's unaligned head), where one core copies at about half the speed, into
    pieces of 64 KiB or more. So a 256 KiB transfer is cut exactly where it counts as on 4 KiB
    pages. Every transfer arrives byte-exact either way."""
    huge = 2 << 20
    monkeypatch.setenv("MORI_IO_CMA_THREADS", "2")  # whatever this machine's CPU count
    if how == "MORI_IO_THP=1":
        monkeypatch.setenv("MORI_IO_THP", "1")
    a, b = make("a"), make("b")
    a.register_remote_engine(b.get_engine_desc())
    x = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8)
    mx = a.register_torch_tensor(x)
    if how == "caller":
        _mapping, y = _huge_page_buffer(16 << 20)  # the mapping must outlive the test's transfers
    else:
        y = torch.zeros(16 << 20, dtype=torch.uint8)
    # a region whose first 2 MiB boundary lies 1 MiB in: its head [0, 1 MiB) stays on 4 KiB pages
    first = (y.data_ptr() + 2 * huge - 1) // huge * huge
    start = first - (1 << 20)
    my = b.register_memory(start, 8 << 20, -1, MemoryLocationType.CPU)
    base = start - y.data_ptr()
    n = 256 << 10
    cases = [  # (offset in the region, counts as on huge pages when the interior is on them)
        (0, False),  # all on the head
        ((1 << 20) - (n // 2), False),  # half on the head
        ((1 << 20) - (n // 8), True),  # an eighth on the head
        (3 << 20, True),  # all in the interior
    ]
    on_huge = _thp_available()
    if on_huge:
        assert _huge_kib(first, 6 << 20) >= 4096, "the region's interior is not on huge pages"
    for i, (off, huge_case) in enumerate(cases):
        cut = not (huge_case and on_huge)
        before = a._counters()["direct_split"]
        st = a.write(mx, 0, my, off, n, 40 + i)
        assert st.WaitFor(0) and st.Succeeded(), st.Message()
        assert torch.equal(y[base + off : base + off + n], x[:n])
        split = a._counters()["direct_split"] - before
        assert split == int(cut), f"offset {off}: cut over threads {split} times, expected {cut}"


def _cpu_of() -> int:
    """The CPU the calling thread last ran on (field 39 of its stat)."""
    return int(Path("/proc/thread-self/stat").read_text().rsplit(")", 1)[1].split()[36])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to move between")
def test_move_off_cpu_moves_a_thread_and_gives_its_mask_back() -> None:
    allowed = os.sched_getaffinity(0)
    here = _cpu_of()
    assert test_hooks.move_off_cpu(0, here) is True
    assert _cpu_of() != here
    assert os.sched_getaffinity(0) == allowed
    os.sched_setaffinity(0, {here})
    try:
        assert test_hooks.move_off_cpu(0, here) is False, "moved off the only CPU it may run on"
        assert os.sched_getaffinity(0) == {here}
    finally:
        os.sched_setaffinity(0, allowed)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to move between")
@pytest.mark.parametrize("opted_in", [True, False], ids=["MORI_IO_MOVE_COPY_THREADS=1", "default"])
def test_a_copy_thread_on_the_posting_cpu_is_moved_off_it(
    monkeypatch: pytest.MonkeyPatch, make, opted_in: bool
) -> None:
    """A copy thread is of use only beside the poster: opted in, the poster moves one last seen on
    its own CPU (the scheduler can leave both there for milliseconds), and the thread keeps its
    mask. By default the library never writes a thread's affinity."""
    monkeypatch.setenv("MORI_IO_CMA_THREADS", "2")
    if opted_in:
        monkeypatch.setenv("MORI_IO_MOVE_COPY_THREADS", "1")
    allowed = os.sched_getaffinity(0)
    a, b = make("a"), make("b")
    a.register_remote_engine(b.get_engine_desc())
    x = torch.randint(0, 256, (16 << 20,), dtype=torch.uint8)
    y = torch.zeros(16 << 20, dtype=torch.uint8)
    mx, my = a.register_torch_tensor(x), b.register_torch_tensor(y)
    n = 4 << 20  # cut over threads whatever the pages
    here = _cpu_of()
    before = set(os.listdir("/proc/self/task"))
    os.sched_setaffinity(0, {here})  # the copy thread starts here, on the poster's CPU
    try:
        st = a.write(mx, 0, my, 0, n, 1)  # starts the copy thread
        assert st.WaitFor(0) and st.Succeeded(), st.Message()
        new = [int(t) for t in set(os.listdir("/proc/self/task")) - before]
        assert new, "no copy thread was started"
        moves = 0
        for i in range(2, 200 if opted_in else 40):
            for t in new:  # pin every new thread back here, then let it go anywhere
                try:
                    os.sched_setaffinity(t, {here})
                    os.sched_setaffinity(t, allowed)
                except ProcessLookupError:  # a thread that ended (the handshake's first connection)
                    pass
            time.sleep(0.002)  # let it spin (and publish its CPU) beside the poster
            st = a.write(mx, 0, my, 0, n, i)
            assert st.WaitFor(0) and st.Succeeded(), st.Message()
            moves = a._counters()["copy_thread_moves"]
            if moves:
                break
        if opted_in:
            assert moves >= 1, "the copy thread was never moved off the posting CPU"
        else:
            assert moves == 0, "the library moved a thread without being asked to"
        assert torch.equal(y[:n], x[:n])
        alive = [t for t in new if os.path.exists(f"/proc/self/task/{t}")]
        assert all(os.sched_getaffinity(t) == allowed for t in alive)
    finally:
        os.sched_setaffinity(0, allowed)


_NO_THP = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_direct import _huge_kib
from mori.io import BackendType, IOEngine, IOEngineConfig
e = IOEngine("plain", IOEngineConfig("127.0.0.1", 0))
e.create_backend(BackendType.TCP)
buf = torch.randint(0, 256, (12 << 20,), dtype=torch.uint8)
before = _huge_kib(buf.data_ptr(), buf.numel())
e.register_torch_tensor(buf)
print(before, _huge_kib(buf.data_ptr(), buf.numel()))
"""


@pytest.mark.skipif(not _thp_available(), reason="no transparent huge pages here")
@pytest.mark.parametrize("value", [None, "0"], ids=["default", "MORI_IO_THP=0"])
def test_registration_leaves_the_callers_pages_alone(value: str | None) -> None:
    """By default (and with MORI_IO_THP=0) registration does not change how the caller's memory
    is paged: the huge pages under a buffer are the same before and after."""
    env = {k: v for k, v in os.environ.items() if k != "MORI_IO_THP"}
    if value is not None:
        env["MORI_IO_THP"] = value
    out = subprocess.run(
        [sys.executable, "-c", _NO_THP, str(Path(__file__).parent)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    before, after = out.stdout.split()[-2:]
    assert after == before, out.stdout + out.stderr


def _sched_runtime(tid: int) -> int:
    """sched_attr.sched_runtime of a thread (its scheduler slice, in ns, on EEVDF kernels)."""
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(56)
    nr = {"x86_64": 315, "aarch64": 275}.get(os.uname().machine)
    if nr is None or libc.syscall(nr, tid, buf, 56, 0) != 0:
        pytest.skip("sched_getattr is not available here")
    return int(struct.unpack_from("<Q", buf.raw, 24)[0])  # size, policy, flags, nice, priority, runtime


@pytest.mark.parametrize("opted_in", [False, True], ids=["default", "MORI_IO_SHORT_SLICE=1"])
def test_engine_threads_keep_the_schedulers_defaults(
    monkeypatch: pytest.MonkeyPatch, make, opted_in: bool
) -> None:
    """The engine's threads (connections, progress, copy pool) run with the scheduling the process
    gives them; only MORI_IO_SHORT_SLICE=1 makes them ask for a 0.1 ms slice."""
    if opted_in:
        monkeypatch.setenv("MORI_IO_SHORT_SLICE", "1")
    monkeypatch.setenv("MORI_IO_CMA_THREADS", "2")
    main = _sched_runtime(0)
    before = set(os.listdir("/proc/self/task"))
    cfg = TcpBackendConfig(enable_cma=False, num_connections_per_peer=2)
    a, b = make("a", cfg), make("b", cfg)
    a.register_remote_engine(b.get_engine_desc())
    x = torch.ones(1 << 20, dtype=torch.uint8)
    y = torch.zeros(1 << 20, dtype=torch.uint8)
    st = a.write(a.register_torch_tensor(x), 0, b.register_torch_tensor(y), 0, 1 << 20, 1)
    assert st.WaitFor(30_000) and st.Succeeded(), st.Message()
    new = [int(t) for t in set(os.listdir("/proc/self/task")) - before]
    assert len(new) >= 4, "expected the connections' threads"
    slices = {t: _sched_runtime(t) for t in new}
    if opted_in:
        assert sum(v == 100_000 for v in slices.values()) >= 4, slices
    else:
        assert all(v == main for v in slices.values()), f"main thread {main}, engine threads {slices}"


def test_a_post_from_inside_list_conversion_keeps_both_lists(make) -> None:
    """The native post converts its lists into per-thread buffers; an ``__index__`` that posts
    from inside that conversion (only the native API takes such objects) gets buffers of its own,
    and both transfers move their own blocks."""
    a, b, x, y, mx, my = _pair(make, n=1 << 20)
    native = a._native
    inner: list = []

    def post(loffs, roffs, sizes, uid):
        return native.post("write", mx.id, "b", my.id, loffs, roffs, sizes, uid, True, my.size)

    class Posting:
        def __index__(self) -> int:
            inner.append(post([0, 8192], [4096, 12288], [4096, 4096], 7))
            return 65536

    st = post([Posting(), 131072], [262144, 393216], [4096, 8192], 8)
    assert st.WaitFor(0) and st.Succeeded(), st.Message()
    assert len(inner) == 1 and inner[0].WaitFor(0) and inner[0].Succeeded(), inner[0].Message()
    assert torch.equal(y[4096:8192], x[0:4096]) and torch.equal(y[12288:16384], x[8192:12288])
    assert torch.equal(y[262144:266240], x[65536:69632])
    assert torch.equal(y[393216:401408], x[131072:139264])
    assert b.pop_inbound_transfer_status("a", 8) is not None

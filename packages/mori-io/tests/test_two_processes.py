"""Two engines in two processes: the transfer matrix, sub-range registration, inbound statuses,
attach failover, and peers that die or hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mori.testing import run_ranks
from mori.testing.file_rendezvous import get as _get
from mori.testing.file_rendezvous import put as _put

REGION = 8 << 20
SUB_OFFSET = 12345  # the target registers a view starting this far into a larger allocation
SUB_SIZE = 1 << 20
# (size, count) per case; blocks are laid out back to back with a 64-byte gap
CASES = [(8, 1), (8, 4096), (4096, 128), (65536, 16), ((1 << 20) + 5, 1), (4 << 20, 1)]


def _pattern(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _layout(size: int, count: int) -> list[tuple[int, int, int]]:
    return [(i * (size + 64), i * (size + 64), size) for i in range(count)]


def _peer(rank: int, nranks: int, d: str, cma: bool) -> dict[str, int]:
    from mori.io import BackendType, EngineDesc, IOEngine, IOEngineConfig, MemoryDesc, TcpBackendConfig

    d_ = Path(d)
    cfg = TcpBackendConfig(num_connections_per_peer=2, chunk_bytes=512 << 10, enable_cma=cma)
    with IOEngine(f"rank{rank}", IOEngineConfig("127.0.0.1", 0)) as e:
        e.create_backend(BackendType.TCP, cfg)
        if rank == 0:  # target: a readable region, a writable region and a sub-range view
            readable = _pattern(1, REGION)
            writable = torch.zeros(REGION, dtype=torch.uint8)
            big = torch.zeros(4 << 20, dtype=torch.uint8)
            view = big[SUB_OFFSET : SUB_OFFSET + SUB_SIZE]
            descs = [e.register_torch_tensor(t) for t in (readable, writable, view)]
            _put(
                d_,
                "target",
                b"|".join(
                    [e.get_engine_desc().pack().hex().encode()] + [m.pack().hex().encode() for m in descs]
                ),
            )
            uids = [int(u) for u in _get(d_, "done", 120).decode().split(",")]
            statuses = {u: e.pop_inbound_transfer_status("rank1", u) for u in uids}
            missing = [u for u, s in statuses.items() if s is None or not s.Succeeded()]
            assert not missing, f"no successful inbound status for uids {missing}"
            expect = torch.zeros(REGION, dtype=torch.uint8)
            src = _pattern(2, REGION)
            for size, count in CASES:
                for lo, ro, n in _layout(size, count):
                    expect[ro : ro + n] = src[lo : lo + n]
            assert torch.equal(writable, expect), "written bytes differ"
            sub = _pattern(3, SUB_SIZE)
            assert torch.equal(view, sub), "sub-range bytes differ"
            assert (
                int(big[:SUB_OFFSET].count_nonzero()) == 0
                and int(big[SUB_OFFSET + SUB_SIZE :].count_nonzero()) == 0
            )
            return e._counters()
        parts = _get(d_, "target").split(b"|")
        desc = EngineDesc.unpack(bytes.fromhex(parts[0].decode()))
        readable, writable, view = (MemoryDesc.unpack(bytes.fromhex(p.decode())) for p in parts[1:])
        e.register_remote_engine(desc)
        src = _pattern(2, REGION)
        dst = torch.zeros(REGION, dtype=torch.uint8)
        ms, md = e.register_torch_tensor(src), e.register_torch_tensor(dst)
        uids: list[int] = []
        expect = torch.zeros(REGION, dtype=torch.uint8)
        remote_pattern = _pattern(1, REGION)
        for i, (size, count) in enumerate(CASES):
            blocks = _layout(size, count)
            lo, ro, sz = (list(x) for x in zip(*blocks, strict=True))
            # alternate API shapes: engine batch, session batch, session single, engine single
            for op, local, remote in (("write", ms, writable), ("read", md, readable)):
                uid = e.allocate_transfer_uid()
                uids.append(uid)
                if count == 1 and i % 2:
                    st = getattr(e, op)(local, lo[0], remote, ro[0], sz[0], uid)
                elif count == 1:
                    st = getattr(e.create_session(local, remote), op)(lo[0], ro[0], sz[0], uid)
                elif i % 2:
                    (st,) = getattr(e, f"batch_{op}")([local], [lo], [remote], [ro], [sz], [uid])
                else:
                    st = getattr(e.create_session(local, remote), f"batch_{op}")(lo, ro, sz, uid)
                st.Wait()
                assert st.Succeeded(), f"{op} {size}x{count}: {st.Message()}"
            for l_, r_, n in blocks:
                expect[l_ : l_ + n] = remote_pattern[r_ : r_ + n]
        assert torch.equal(dst, expect), "read bytes differ"
        sub = _pattern(3, SUB_SIZE)
        msub = e.register_torch_tensor(sub)
        uid = e.allocate_transfer_uid()
        uids.append(uid)
        st = e.write(msub, 0, view, 0, SUB_SIZE, uid)
        st.Wait()
        assert st.Succeeded(), st.Message()
        over = e.write(msub, 0, view, 1, SUB_SIZE, e.allocate_transfer_uid())
        over.Wait()
        assert over.Failed(), "a write past the end of the sub-range succeeded"
        _put(d_, "done", ",".join(map(str, uids)).encode())
        return {
            "route_cma": int(e._route_name(ms, writable) == "tcp+cma"),
            "failovers": e._counters()["failovers"],
            "direct_copies": e._counters()["direct_copies"],
            "direct_refused": e._counters()["direct_refused"],
        }


@pytest.mark.parametrize("cma", [False, True], ids=["socket", "cma"])
def test_matrix_across_processes(tmp_path: Path, cma: bool) -> None:
    target, initiator = run_ranks(_peer, 2, str(tmp_path), cma, timeout=180)
    if cma and initiator["direct_refused"] == 0:
        # the initiator attached to the target itself (direct path, checked against the target's
        # published table): the target served no request
        assert initiator["route_cma"] == 1 and initiator["direct_copies"] > 0
        assert target["served_cma"] == 0 and target["served_socket"] == 0
    elif cma and initiator["failovers"] == 0:
        # the direct path was refused, the target attached instead: every request was served by it
        assert initiator["route_cma"] == 1
        assert target["served_cma"] > 0 and target["served_socket"] == 0
    elif cma:
        # the OS refused attach: the initiator failed over and the socket carried the bytes
        assert initiator["route_cma"] == 0 and target["served_socket"] > 0
    else:
        assert target["served_cma"] == 0 and target["served_socket"] > 0
        assert initiator["direct_copies"] == 0


_TARGET_SCRIPT = """
import sys, time, torch
from mori.io import BackendType, IOEngine, IOEngineConfig
e = IOEngine("victim", IOEngineConfig("127.0.0.1", 0))
e.create_backend(BackendType.TCP)
buf = torch.zeros(64 << 20, dtype=torch.uint8)
m = e.register_torch_tensor(buf)
print(e.get_engine_desc().pack().hex(), m.pack().hex(), flush=True)
time.sleep(600)
"""


@pytest.fixture
def victim(monkeypatch: pytest.MonkeyPatch):
    """A target engine in a child process that the test may kill or stop."""
    monkeypatch.setenv("MORI_IO_CP_TIMEOUT_MS", "1500")
    proc = subprocess.Popen([sys.executable, "-c", _TARGET_SCRIPT], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().split()
        assert len(line) == 2, "victim did not start"
        yield proc, line
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_peer_that_dies_or_hangs_fails_transfers_within_the_timeout(victim, make, how: str) -> None:
    from mori.io import EngineDesc, MemoryDesc, StatusCode, TcpBackendConfig

    proc, (desc_hex, mem_hex) = victim
    a = make("survivor", TcpBackendConfig(enable_cma=False, chunk_bytes=64 << 10))
    a.register_remote_engine(EngineDesc.unpack(bytes.fromhex(desc_hex)))
    remote = MemoryDesc.unpack(bytes.fromhex(mem_hex))
    x = torch.ones(64 << 20, dtype=torch.uint8)
    mx = a.register_torch_tensor(x)
    st = a.write(mx, 0, remote, 0, 4096, 1)
    st.Wait()
    assert st.Succeeded(), st.Message()
    inflight = [a.write(mx, 0, remote, 0, 64 << 20, 10 + i) for i in range(4)]
    os.kill(proc.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    t0 = time.monotonic()
    after = a.write(mx, 0, remote, 0, 64 << 20, 2)
    for s in [*inflight, after]:
        assert s.WaitFor(20_000), "a transfer to a dead peer hangs"
    elapsed = time.monotonic() - t0
    failed = [s for s in [*inflight, after] if s.Failed()]
    assert after.Failed(), "a transfer posted after the peer died succeeded"
    for s in failed:
        assert s.Code() == StatusCode.ERR_BAD_STATE and "victim" in s.Message(), s.Message()
    if how == "stopped":
        assert all("MORI_IO_CP_TIMEOUT_MS=1500" in s.Message() for s in failed), [s.Message() for s in failed]
    assert elapsed < 1.5 * 3 + 5

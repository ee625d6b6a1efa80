"""Two engines in one process: the read/write x single/batch x session matrix, bytes compared exactly."""

from __future__ import annotations

import random

import pytest
import torch

from mori.core import test_hooks
from mori.io import StatusCode, TransferStatus

Block = tuple[int, int, int]  # local offset, remote offset, size

MODES = ["single", "batch", "session", "session_batch"]


def _blocks(n: int, size: int, total: int, seed: int) -> list[Block]:
    """``n`` non-overlapping blocks of ``size`` bytes at shuffled, non-contiguous slots."""
    slots = total // (size * 2)
    assert slots >= n
    rng = random.Random(seed)
    lslots, rslots = rng.sample(range(slots), n), rng.sample(range(slots), n)
    return [(ls * size * 2, rs * size * 2, size) for ls, rs in zip(lslots, rslots, strict=True)]


def _transfer(pair, op: str, mode: str, blocks: list[Block], uid: int) -> list[tuple[TransferStatus, int]]:
    """Post the blocks in the given mode; returns (status, uid) pairs."""
    a = pair.a
    loffs, roffs, sizes = (list(x) for x in zip(*blocks, strict=True))
    if mode == "single":
        assert len(blocks) == 1
        return [(getattr(a, op)(pair.src_desc, loffs[0], pair.dst_desc, roffs[0], sizes[0], uid), uid)]
    if mode == "batch":
        # two descriptor pairs (the same regions twice): one status per pair
        half = max(1, len(blocks) // 2)
        groups = [slice(0, half), slice(half, len(blocks))] if len(blocks) > 1 else [slice(0, 1)]
        uids = [uid + i for i in range(len(groups))]
        statuses = getattr(a, f"batch_{op}")(
            [pair.src_desc] * len(groups),
            [loffs[g] for g in groups],
            [pair.dst_desc] * len(groups),
            [roffs[g] for g in groups],
            [sizes[g] for g in groups],
            uids,
        )
        assert len(statuses) == len(groups)
        return list(zip(statuses, uids, strict=True))
    sess = a.create_session(pair.src_desc, pair.dst_desc)
    assert sess is not None and sess.alive()
    if mode == "session":
        assert len(blocks) == 1
        return [(getattr(sess, op)(loffs[0], roffs[0], sizes[0], uid), uid)]
    return [(getattr(sess, f"batch_{op}")(loffs, roffs, sizes, uid), uid)]


def _check(pair, op: str, mode: str, blocks: list[Block], uid: int) -> None:
    local, remote = pair.src, pair.dst
    if op == "read":  # bytes flow remote -> local: random bytes on the target, zeros here
        local.zero_()
        remote.copy_(torch.randint(0, 256, remote.shape, dtype=torch.uint8))
    else:
        remote.zero_()
    before_local, before_remote = local.clone(), remote.clone()
    for st, _ in (posted := _transfer(pair, op, mode, blocks, uid)):
        assert st.WaitFor(60_000), "transfer did not finish"
        assert st.Succeeded() and st.Code() == StatusCode.SUCCESS, st.Message()
    expect_local, expect_remote = before_local.clone(), before_remote.clone()
    for lo, ro, n in blocks:
        if op == "read":
            expect_local[lo : lo + n] = before_remote[ro : ro + n]
        else:
            expect_remote[ro : ro + n] = before_local[lo : lo + n]
    assert torch.equal(local, expect_local)
    assert torch.equal(remote, expect_remote)
    # the target learns of each transfer through its inbound status, exactly once
    for _, u in posted:
        inbound = pair.b.pop_inbound_transfer_status("a", u)
        assert inbound is not None and inbound.Succeeded(), f"no inbound status for uid {u}"
        assert pair.b.pop_inbound_transfer_status("a", u) is None


@pytest.mark.parametrize("op", ["read", "write"])
@pytest.mark.parametrize("mode", ["single", "session"])
@pytest.mark.parametrize("size", [8, 4096, (1 << 20) + 3])
def test_single_block(pair, op: str, mode: str, size: int) -> None:
    _check(pair, op, mode, [(5, 11, size)], uid=100)


@pytest.mark.parametrize("op", ["read", "write"])
@pytest.mark.parametrize("mode", ["batch", "session_batch"])
@pytest.mark.parametrize(("count", "size"), [(1, 8), (64, 8192), (128, 4096), (4096, 8), (4096, 1024)])
def test_batch(pair, op: str, mode: str, count: int, size: int) -> None:
    _check(pair, op, mode, _blocks(count, size, pair.src.numel(), seed=count * 7 + size), uid=200)


@pytest.mark.parametrize("op", ["read", "write"])
def test_64_mib_block(make, path: str, op: str) -> None:
    from mori.io import TcpBackendConfig

    cfg = TcpBackendConfig(enable_cma=path == "cma")
    a, b = make("a", cfg), make("b", cfg)
    a.register_remote_engine(b.get_engine_desc())
    n = 64 << 20
    x = torch.randint(0, 256, (n,), dtype=torch.uint8)
    y = torch.zeros(n, dtype=torch.uint8)
    mx, my = a.register_torch_tensor(x), b.register_torch_tensor(y)
    if op == "read":
        x, y = y, x
        y.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
    st = getattr(a, op)(mx, 0, my, 0, n, a.allocate_transfer_uid())
    st.Wait()
    assert st.Succeeded(), st.Message()
    assert torch.equal(x, y)


def test_contiguous_blocks_merge_and_arrive(pair) -> None:
    blocks = [(i * 100, 4096 + i * 100, 100) for i in range(1000)]  # one run of 100 kB on both sides
    _check(pair, "write", "session_batch", blocks, uid=7)


def test_zero_length_transfer_succeeds_and_notifies(pair) -> None:
    st = pair.a.write(pair.src_desc, 0, pair.dst_desc, 0, 0, 9)
    st.Wait()
    assert st.Succeeded(), st.Message()
    assert pair.b.pop_inbound_transfer_status("a", 9) is not None


def test_sub_range_registration(make) -> None:
    """Per-layer views: registered regions that start inside larger allocations."""
    a, b = make("a"), make("b")
    a.register_remote_engine(b.get_engine_desc())
    big_a = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    big_b = torch.zeros(1 << 20, dtype=torch.uint8)
    la = a.register_torch_tensor(big_a[4096:8192])
    lb = b.register_torch_tensor(big_b[65536 + 17 : 65536 + 17 + 4096])
    assert lb.data == big_b.data_ptr() + 65536 + 17
    st = a.write(la, 0, lb, 0, 4096, 1)
    st.Wait()
    assert st.Succeeded(), st.Message()
    assert torch.equal(big_b[65536 + 17 : 65536 + 17 + 4096], big_a[4096:8192])
    assert (
        int(big_b[: 65536 + 17].count_nonzero()) == 0 and int(big_b[65536 + 17 + 4096 :].count_nonzero()) == 0
    )
    # the region ends where it was told to, not where the allocation does
    st = a.write(la, 0, lb, 1, 4096, 2)
    st.Wait()
    assert st.Code() == StatusCode.ERR_INVALID_ARGS


def test_wait_all_and_waitfor(pair) -> None:
    sts = [pair.a.write(pair.src_desc, i * 4096, pair.dst_desc, i * 4096, 4096, i) for i in range(32)]
    assert pair.a.wait_all(sts, timeout_ms=60_000) == StatusCode.SUCCESS
    assert all(s.WaitFor(0) and s.Succeeded() and not s.InProgress() and not s.Init() for s in sts)
    bad = pair.a.write(pair.src_desc, 0, pair.dst_desc, pair.dst.numel(), 1, 99)
    assert pair.a.wait_all([*sts, bad]) == StatusCode.ERR_INVALID_ARGS


def test_route_uses_attach_only_when_enabled(pair, path: str) -> None:
    assert pair.a._route_name(pair.src_desc, pair.dst_desc) == ("tcp+cma" if path == "cma" else "tcp")
    _check(pair, "write", "single", [(0, 0, 1 << 20)], uid=3)
    counters = pair.b._counters()
    if path == "cma":  # the initiator attached itself (direct path): the target served nothing
        assert pair.a._counters()["direct_copies"] > 0
        assert counters["served_socket"] == 0 and counters["served_cma"] == 0
    else:
        assert counters["served_socket"] > 0 and counters["served_cma"] == 0
        assert pair.a._counters()["direct_copies"] == 0


def test_attach_refused_fails_over_to_socket(make) -> None:
    a, b = make("a"), make("b")
    a.register_remote_engine(b.get_engine_desc())
    test_hooks.refuse_cma(b._native, True)
    x = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    y = torch.zeros_like(x)
    mx, my = a.register_torch_tensor(x), b.register_torch_tensor(y)
    assert a._route_name(mx, my) == "tcp+cma"
    st = a.write(mx, 0, my, 0, x.numel(), 1)
    st.Wait()
    assert st.Succeeded(), st.Message()
    assert torch.equal(x, y)
    assert a._counters()["failovers"] >= 1
    assert a._route_name(mx, my) == "tcp"
    # the target counts a transfer once, however it arrived
    assert b.pop_inbound_transfer_status("a", 1) is not None


def test_self_transfer_through_own_engine(make) -> None:
    a = make("solo")
    a.register_remote_engine(a.get_engine_desc())
    x = torch.arange(4096, dtype=torch.int32)  # 16 KiB
    mx = a.register_torch_tensor(x)
    st = a.write(mx, 0, mx, 8192, 8192, 1)  # first half onto the second
    st.Wait()
    assert st.Succeeded(), st.Message()
    assert torch.equal(x[2048:], torch.arange(2048, dtype=torch.int32))


def test_many_python_threads_share_one_engine(pair) -> None:
    """Posting from several threads at once: every transfer lands, none is lost or mixed up."""
    import threading

    block, per_thread, nthreads = 4096, 64, 4
    pair.dst.zero_()
    errors: list[str] = []

    def worker(t: int) -> None:
        sess = pair.a.create_session(pair.src_desc, pair.dst_desc)
        for i in range(per_thread):
            off = (t * per_thread + i) * block
            st = (
                sess.write(off, off, block, t * 1000 + i)
                if i % 2
                else pair.a.write(pair.src_desc, off, pair.dst_desc, off, block, t * 1000 + i)
            )
            if not st.WaitFor(60_000) or not st.Succeeded():
                errors.append(st.Message())

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(nthreads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    n = nthreads * per_thread * block
    assert torch.equal(pair.dst[:n], pair.src[:n])
    assert int(pair.dst[n:].count_nonzero()) == 0


def test_environment_overrides_the_tcp_config(monkeypatch: pytest.MonkeyPatch, make) -> None:
    from mori.io import TcpBackendConfig

    monkeypatch.setenv("MORI_IO_TCP_CMA", "0")
    monkeypatch.setenv("MORI_IO_ENABLE_NOTIFICATION", "0")
    a, b = make("a", TcpBackendConfig(enable_cma=True)), make("b")
    a.register_remote_engine(b.get_engine_desc())
    x, y = torch.ones(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    mx, my = a.register_torch_tensor(x), b.register_torch_tensor(y)
    assert a._route_name(mx, my) == "tcp"
    st = a.write(mx, 0, my, 0, 64, 5)
    st.Wait()
    assert st.Succeeded() and torch.equal(x, y)
    assert b.pop_inbound_transfer_status("a", 5) is None, "notifications were turned off"

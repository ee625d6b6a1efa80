"""Many transfers and many engines: no growth in memory, file descriptors or threads."""

from __future__ import annotations

import gc
import os
import threading

import pytest
import torch

from mori.io import BackendType, IOEngine, IOEngineConfig, StatusCode, TcpBackendConfig

TRANSFERS = 100_000


def _fds() -> int:
    # Objects of earlier tests in this process (pipes and sockets of finished launches) may still
    # hold descriptors until the garbage collector runs, which it may do in the middle of a soak:
    # collect first, so that only what this test keeps open is counted.
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _run(pair, start: int, count: int) -> None:
    a, b = pair.a, pair.b
    sess = a.create_session(pair.src_desc, pair.dst_desc)
    offs = [i * 8192 for i in range(16)]
    i = start
    while i < start + count:
        window = []
        for _ in range(50):
            kind = i % 4
            if kind == 0:
                st = a.write(pair.src_desc, (i % 64) * 4096, pair.dst_desc, (i % 64) * 4096, 4096, i)
            elif kind == 1:
                st = a.read(pair.src_desc, 0, pair.dst_desc, 0, 512, i)
            elif kind == 2:
                st = sess.batch_write(offs, offs, [1024] * 16, i)
            else:  # out of range: the failure path must not leak either
                st = sess.write(0, pair.dst.numel() - 4, 8, i)
            window.append((kind, i, st))
            i += 1
        for kind, uid, st in window:
            assert st.WaitFor(60_000)
            if kind == 3:
                assert st.Code() == StatusCode.ERR_INVALID_ARGS
            else:
                assert st.Succeeded(), st.Message()
                assert b.pop_inbound_transfer_status("a", uid) is not None


def test_many_transfers_do_not_grow_memory_or_descriptors(pair) -> None:
    _run(pair, 0, 2_000)  # warm up: connections, thread stacks, allocator pools
    fds, threads, rss = _fds(), _threads(), _rss_bytes()
    _run(pair, 2_000, TRANSFERS)
    assert _fds() == fds
    assert _threads() == threads
    grown = _rss_bytes() - rss
    assert grown < 16 << 20, f"resident memory grew by {grown / 2**20:.1f} MiB over {TRANSFERS} transfers"
    counters = pair.b._counters()
    assert counters["inbound_pending"] == 0


@pytest.mark.parametrize("cma", [False, True], ids=["socket", "cma"])
def test_engines_and_connections_come_and_go_without_leaks(cma: bool) -> None:
    def cycle(n: int) -> None:
        for _ in range(n):
            cfg = TcpBackendConfig(num_connections_per_peer=2, enable_cma=cma)
            with (
                IOEngine("x", IOEngineConfig("127.0.0.1", 0)) as a,
                IOEngine("y", IOEngineConfig("127.0.0.1", 0)) as b,
            ):
                a.create_backend(BackendType.TCP, cfg)
                b.create_backend(BackendType.TCP, cfg)
                a.register_remote_engine(b.get_engine_desc())
                x = torch.ones(4096, dtype=torch.uint8)
                y = torch.zeros(4096, dtype=torch.uint8)
                mx, my = a.register_torch_tensor(x), b.register_torch_tensor(y)
                st = a.write(mx, 0, my, 0, 4096, 1)
                st.Wait()
                assert st.Succeeded(), st.Message()
                a.deregister_remote_engine(b.get_engine_desc())  # closes a's connections mid-life
                a.register_remote_engine(b.get_engine_desc())
                st = a.read(mx, 0, my, 0, 4096, 2)
                st.Wait()
                assert st.Succeeded(), st.Message()

    cycle(3)
    fds, threads = _fds(), threading.active_count()
    native_threads = _threads()
    cycle(30)
    assert _fds() == fds
    assert threading.active_count() == threads
    assert _threads() == native_threads


def _child_exits(desc_bytes: bytes, mem_bytes: bytes) -> str:
    """Runs in a forked child that inherited a live engine pair: the copies are unusable, and
    dropping them (their native engines included) neither hangs nor shuts the parent's sockets."""
    import gc

    from mori.core.errors import MoriStateError
    from mori.io import MemoryLocationType

    engine = _inherited[0]
    try:
        engine.register_memory(4096, 1, -1, MemoryLocationType.CPU)
        msg = "no error"
    except MoriStateError as e:
        msg = str(e)
    # drop every reference this process's Python code holds to the native engine
    engine.__dict__.pop("_native")
    engine._backends.clear()
    engine._routes.clear()
    gc.collect()
    return msg


_inherited: list[IOEngine] = []


def test_forked_child_neither_hangs_nor_breaks_the_parent(pair) -> None:
    import multiprocessing as mp
    import warnings

    st = pair.a.write(pair.src_desc, 0, pair.dst_desc, 0, 8, 76)  # connections are up
    assert st.WaitFor(30_000) and st.Succeeded(), st.Message()
    sess = pair.a.create_session(pair.src_desc, pair.dst_desc)
    connections = pair.b._counters()["inbound_connections"]
    _inherited[:] = [pair.a]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork with threads alive
            ctx = mp.get_context("fork")
            with ctx.Pool(1) as pool:
                msg = pool.apply(_child_exits, (b"", b""))
    finally:
        _inherited.clear()
    assert "belongs to the parent process" in msg
    # the parent's connections survived the child: no reconnection was needed
    assert sess.alive()
    st = pair.a.write(pair.src_desc, 0, pair.dst_desc, 0, 4096, 77)
    assert st.WaitFor(30_000) and st.Succeeded(), st.Message()
    assert torch.equal(pair.dst[:4096], pair.src[:4096])
    assert pair.b._counters()["inbound_connections"] == connections

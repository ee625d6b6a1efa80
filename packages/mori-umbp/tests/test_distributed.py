"""Distributed mode: peers fetch blocks from each other over mori-io, routed by the master;
and what happens when a peer or a writer dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from umbp_helpers import Buf, Master, rand_buf

import mori.umbp as umbp
import mori.umbp.distributed as dist_mod


def node_config(address: str, node_id: str, *, dram: int = 8 << 20, ssd_dir: object = None, cache: bool = True
                ) -> umbp.UMBPConfig:  # fmt: skip
    cfg = umbp.UMBPConfig()
    cfg.dram.capacity_bytes = dram
    cfg.ssd.enabled = ssd_dir is not None
    if ssd_dir is not None:
        cfg.ssd.storage_dir = str(ssd_dir)
        cfg.ssd.capacity_bytes = 16 << 20
    d = umbp.UMBPDistributedConfig()
    d.master_config.master_address = address
    d.master_config.node_id = node_id
    d.master_config.node_address = "127.0.0.1"
    d.io_engine.host = "127.0.0.1"
    d.cache_remote_fetches = cache
    d.staging_buffer_size = 1 << 20
    cfg.distributed = d
    return cfg


def test_a_peer_fetches_another_nodes_block_and_caches_it(master: Master) -> None:
    a = umbp.UMBPClient(node_config(master.address, "node-a"))
    b = umbp.UMBPClient(node_config(master.address, "node-b"))
    try:
        assert a.get_deployment_mode() == umbp.UMBPDeploymentMode.Distributed
        data = rand_buf(3 << 20)  # larger than b's 1 MiB staging buffer: chunked through it
        assert a.put_from_ptr("blk", data.ptr, data.n)
        assert a.flush()  # ships the ADD event to the master
        assert b.exists("blk"), "the master knows a holds it"
        out = Buf(data.n)
        assert b.get_into_ptr("blk", out.ptr, data.n)
        assert out.bytes() == data.bytes()
        assert b.stats()["dram_objects"] == 1, "cache_remote_fetches keeps a local copy"
        assert not b.get_into_ptr("blk-missing", out.ptr, data.n)
        assert not b.get_into_ptr("blk", Buf(16).ptr, 16), "a size that does not match is a miss"
    finally:
        b.close()
        a.close()


def test_zero_copy_into_registered_memory_and_no_caching(master: Master) -> None:
    a = umbp.UMBPClient(node_config(master.address, "zc-a"))
    b = umbp.UMBPClient(node_config(master.address, "zc-b", cache=False))
    try:
        keys = [f"zc-{i}" for i in range(8)]
        bufs = [rand_buf(64 << 10) for _ in keys]
        assert a.batch_put_from_ptr(keys, [x.ptr for x in bufs], [x.n for x in bufs]) == [True] * 8
        a.flush()
        host = Buf(8 * (64 << 10))
        assert b.register_memory(host.ptr, host.n)
        ptrs = [host.ptr + i * (64 << 10) for i in range(8)]
        assert b.batch_get_into_ptr(keys, ptrs, [64 << 10] * 8) == [True] * 8
        assert host.bytes() == b"".join(x.bytes() for x in bufs)
        assert b.stats()["dram_objects"] == 0
        assert b.batch_exists_consecutive([*keys, "nope"]) == 8
    finally:
        b.close()
        a.close()


def test_a_block_on_the_owners_ssd_is_served_through_staging(master: Master, tmp_path: Path) -> None:
    a = umbp.UMBPClient(node_config(master.address, "ssd-a", dram=64 << 10, ssd_dir=tmp_path / "a"))
    b = umbp.UMBPClient(node_config(master.address, "ssd-b"))
    try:
        bufs = [rand_buf(16 << 10) for _ in range(10)]
        for i, x in enumerate(bufs):
            assert a.put_from_ptr(f"s{i}", x.ptr, x.n)
        a.flush()
        assert a.stats()["ssd_objects"] >= 4
        out = Buf(16 << 10)
        assert b.get_into_ptr("s0", out.ptr, out.n), "s0 was demoted to a's SSD"
        assert out.bytes() == bufs[0].bytes()
    finally:
        b.close()
        a.close()


def test_master_restart_with_a_live_node_reregisters(master: Master) -> None:
    a = umbp.UMBPClient(node_config(master.address, "rr-a"))
    try:
        data = rand_buf(4096)
        assert a.put_from_ptr("rr", data.ptr, 4096)
        a.flush()
        master.stop()
        master.start()  # in-memory: the new master knows nothing
        q = umbp.UMBPMasterClient(master.address)
        assert q.batch_lookup(["rr"]) == [False]
        a.flush()  # the heartbeat hears "unknown", registers again and full-syncs
        assert q.batch_lookup(["rr"]) == [True]
    finally:
        a.close()


_OWNER = textwrap.dedent(
    """
    import sys, time, ctypes
    import mori.umbp as umbp
    sys.path.insert(0, {tests!r})
    from test_distributed import node_config
    cfg = node_config({address!r}, "owner")
    c = umbp.UMBPClient(cfg)
    data = (ctypes.c_ubyte * (1 << 20))(*([7] * (1 << 20)))
    assert c.put_from_ptr("victim", ctypes.addressof(data), 1 << 20)
    c.flush()
    print("ready", flush=True)
    time.sleep(600)
    """
)


def start_owner(master: Master) -> subprocess.Popen[str]:
    code = _OWNER.format(tests=str(Path(__file__).parent), address=master.address)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "ready"
    return p


def test_peer_killed_mid_fetch_gives_an_error_not_a_hang(
    master: Master, monkeypatch: pytest.MonkeyPatch
) -> None:
    owner = start_owner(master)
    reader = umbp.UMBPClient(node_config(master.address, "reader"))
    real_pull = dist_mod.DistributedNode._pull

    def kill_then_pull(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        owner.kill()  # after Resolve answered, before the bytes move
        owner.wait()
        return real_pull(self, *args, **kwargs)

    monkeypatch.setattr(dist_mod.DistributedNode, "_pull", kill_then_pull)
    monkeypatch.setenv("UMBP_FETCH_TIMEOUT_MS", "5000")
    try:
        out = Buf(1 << 20)
        t0 = time.monotonic()
        assert not reader.get_into_ptr("victim", out.ptr, out.n)
        assert time.monotonic() - t0 < 8, "the get must fail within its deadline, not hang"
        monkeypatch.setattr(dist_mod.DistributedNode, "_pull", real_pull)
        t0 = time.monotonic()
        assert not reader.get_into_ptr("victim", out.ptr, out.n), "the peer is gone: still a miss"
        assert time.monotonic() - t0 < 8
    finally:
        reader.close()
        if owner.poll() is None:
            owner.kill()
        owner.communicate()


def test_a_hung_peer_times_out(master: Master, monkeypatch: pytest.MonkeyPatch) -> None:
    owner = start_owner(master)
    monkeypatch.setenv("UMBP_RPC_TIMEOUT_MS", "1500")
    reader = umbp.UMBPClient(node_config(master.address, "reader-2"))
    try:
        os.kill(owner.pid, signal.SIGSTOP)
        out = Buf(1 << 20)
        t0 = time.monotonic()
        assert not reader.get_into_ptr("victim", out.ptr, out.n)
        assert time.monotonic() - t0 < 6
    finally:
        reader.close()
        owner.kill()
        owner.communicate()


_DYING_WRITER = textwrap.dedent(
    """
    import sys, time, ctypes, os
    import mori.umbp as umbp, mori.umbp.client as cm, mori.umbp.ssd as sm
    sys.path.insert(0, {tests!r})
    from test_distributed import node_config
    cfg = node_config({address!r}, "dying", ssd_dir={ssd!r})
    cfg.role = umbp.UMBPRole.SharedSSDLeader
    cfg.copy_pipeline.async_enabled = False
    c = umbp.UMBPClient(cfg)
    data = (ctypes.c_ubyte * (1 << 20))(*([9] * (1 << 20)))
    assert c.put_from_ptr("complete", ctypes.addressof(data), 1 << 20)
    c.flush()
    real = sm.os.pwritev
    def torn(fd, parts, off):
        flat = b"".join(bytes(p) for p in parts)
        os.pwrite(fd, flat[: len(flat) // 2], off)  # half the record reaches the file
        print("tearing", flush=True)
        time.sleep(600)
    sm.os.pwritev = torn
    if {mode!r} == "dram":
        realmm = cm._memmove
        def half(dst, src, n):
            realmm(dst, src, n // 2)
            print("tearing", flush=True)
            time.sleep(600)
        cm._memmove = half
    c.put_from_ptr("torn", ctypes.addressof(data), 1 << 20)
    """
)


@pytest.mark.parametrize("mode", ["dram", "ssd"])
def test_a_writer_killed_mid_put_leaves_nothing_visible(master: Master, tmp_path: Path, mode: str) -> None:
    code = _DYING_WRITER.format(tests=str(Path(__file__).parent), address=master.address, ssd=str(tmp_path / "ssd"),
                                mode=mode)  # fmt: skip
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "tearing"
    p.kill()
    p.communicate()
    q = umbp.UMBPMasterClient(master.address)
    assert q.batch_lookup(["complete", "torn"]) == [True, False], "the master never heard of the torn put"
    # the SSD tier of the dead writer, opened again: the complete object is there, the torn one is not
    cfg = umbp.UMBPConfig()
    cfg.dram.capacity_bytes = 4 << 20
    cfg.ssd.storage_dir = str(tmp_path / "ssd")
    cfg.ssd.capacity_bytes = 16 << 20
    c = umbp.UMBPClient(cfg)
    try:
        assert c.exists("complete") and not c.exists("torn")
        out = Buf(1 << 20)
        assert c.get_into_ptr("complete", out.ptr, out.n) and out.bytes() == bytes([9]) * (1 << 20)
        assert c.stats()["ssd_dropped_records"] == (1 if mode == "ssd" else 0)
    finally:
        c.close()


def test_a_peer_resolve_never_starts_a_fetch_of_its_own(master: Master, tmp_path: Path) -> None:
    """A node asked for a key it no longer holds answers 'not found'; it must not go and fetch the
    key from another peer (two nodes could bounce one request between them for ever)."""
    a = umbp.UMBPClient(node_config(master.address, "loop-a", ssd_dir=tmp_path / "a"))
    b = umbp.UMBPClient(node_config(master.address, "loop-b"))
    try:
        data = rand_buf(4096)
        assert b.put_from_ptr("elsewhere", data.ptr, 4096)
        b.flush()
        node = a._node

        def no_fetch(*args, **kwargs):  # type: ignore[no-untyped-def]
            raise AssertionError("Resolve started a fetch")

        node.fetch = no_fetch
        assert node._resolve({"key": "elsewhere"}) == {"found": False, "busy": False}
    finally:
        b.close()
        a.close()

"""The local data plane: the original's pointer-client tests, then first write wins, visibility,
eviction, promotion, argument errors."""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import pytest
from umbp_helpers import Buf, local_config, rand_buf

import mori.umbp as umbp
import mori.umbp.client as client_mod


class MockPageFirstKVCache:
    """A page-first K/V host buffer, as in the original's test of the pointer API."""

    def __init__(self, num_pages: int = 4, element_size: int = 1024) -> None:
        self.element_size = element_size
        self.buf = Buf(num_pages * 2 * element_size)

    def get_page_buffer_meta(self, indices: list[int]) -> tuple[list[int], list[int]]:
        ptrs = []
        for page in indices:
            k = self.buf.ptr + page * 2 * self.element_size
            ptrs += [k, k + self.element_size]
        return ptrs, [self.element_size] * len(ptrs)

    def fill_page(self, page: int, k: int, v: int) -> None:
        off = page * 2 * self.element_size
        ctypes.memset(self.buf.ptr + off, k, self.element_size)
        ctypes.memset(self.buf.ptr + off + self.element_size, v, self.element_size)

    def read(self, page: int, part: int) -> bytes:
        off = page * 2 * self.element_size + part * self.element_size
        return ctypes.string_at(self.buf.ptr + off, self.element_size)


def expanded(keys: list[str]) -> list[str]:
    return [f"{k}_{p}" for k in keys for p in ("k", "v")]


@pytest.fixture
def client() -> umbp.UMBPClient:
    c = umbp.UMBPClient(local_config())
    yield c
    c.close()


def test_put_get_round_trip(client: umbp.UMBPClient) -> None:
    data, out = Buf(256, b"Z" * 256), Buf(256)
    assert client.put_from_ptr("legacy_key", data.ptr, 256)
    assert client.exists("legacy_key")
    assert client.get_into_ptr("legacy_key", out.ptr, 256)
    assert out.bytes() == data.bytes()
    assert client.clear()
    assert not client.exists("legacy_key")


def test_ranges_round_trip_and_ragged_call_fails_whole(client: umbp.UMBPClient) -> None:
    a, b, c = Buf(4, b"AAAA"), Buf(4, b"BBBB"), Buf(4, b"CCCC")
    assert client.batch_put_ranges_from_ptr(
        ["r"], [12], [[b.ptr, c.ptr, a.ptr]], [[4, 4, 4]], [[4, 8, 0]]
    ) == [True]
    prefix, suffix = Buf(4), Buf(4)
    assert client.batch_get_ranges_into_ptr(["r"], [[suffix.ptr, prefix.ptr]], [[4, 4]], [[8, 0]]) == [True]
    assert (prefix.bytes(), suffix.bytes()) == (b"AAAA", b"CCCC")
    ragged = client.batch_get_ranges_into_ptr(
        ["r", "missing"], [[prefix.ptr], [suffix.ptr]], [[4, 4], [4]], [[0], [0]]
    )
    assert ragged == [False, False]
    # pieces that leave a hole or run past the object are refused
    assert client.batch_put_ranges_from_ptr(["hole"], [12], [[a.ptr, b.ptr]], [[4, 4]], [[0, 8]]) == [False]
    assert client.batch_get_ranges_into_ptr(["r"], [[prefix.ptr]], [[4]], [[10]]) == [False]


def test_paged_kv_batch_round_trip(client: umbp.UMBPClient) -> None:
    pool = MockPageFirstKVCache(num_pages=4, element_size=256)
    for page in range(4):
        pool.fill_page(page, ord("A") + page, ord("a") + page)
    keys = expanded([f"hash_{i}" for i in range(4)])
    ptrs, sizes = pool.get_page_buffer_meta([0, 1, 2, 3])
    assert client.batch_put_from_ptr(keys, ptrs, sizes) == [True] * 8
    for page in range(4):
        pool.fill_page(page, 0, 0)
    assert client.batch_get_into_ptr(keys, ptrs, sizes) == [True] * 8
    for page in range(4):
        assert pool.read(page, 0) == bytes([ord("A") + page]) * 256
        assert pool.read(page, 1) == bytes([ord("a") + page]) * 256
    assert client.batch_exists_consecutive([*keys, "missing_k"]) == 8
    assert client.batch_exists_consecutive(["missing", *keys]) == 0
    assert client.batch_exists([keys[0], "nope", keys[1]]) == [True, False, True]
    assert client.clear()
    assert client.batch_exists_consecutive(keys) == 0


def test_first_write_wins(client: umbp.UMBPClient) -> None:
    first, second, out = Buf(256).fill(ord("A")), Buf(256).fill(ord("X")), Buf(256)
    assert client.put_from_ptr("dedup", first.ptr, 256)
    assert client.put_from_ptr("dedup", second.ptr, 256)  # reports success, keeps the first value
    assert client.get_into_ptr("dedup", out.ptr, 256)
    assert out.bytes() == b"A" * 256


def test_get_of_the_wrong_size_is_a_miss(client: umbp.UMBPClient) -> None:
    data = rand_buf(512)
    assert client.put_from_ptr("sized", data.ptr, 512)
    assert not client.get_into_ptr("sized", Buf(256).ptr, 256)
    assert not client.get_into_ptr("sized", Buf(1024).ptr, 1024)


def test_a_put_is_invisible_until_its_copy_completes(monkeypatch: pytest.MonkeyPatch) -> None:
    c = umbp.UMBPClient(local_config())
    entered, release = threading.Event(), threading.Event()
    real = client_mod._memmove

    def slow_memmove(dst: int, src: int, n: int) -> int:
        entered.set()
        assert release.wait(10)
        return real(dst, src, n)

    monkeypatch.setattr(client_mod, "_memmove", slow_memmove)
    data = rand_buf(4096)
    result: list[bool] = []
    writer = threading.Thread(target=lambda: result.append(c.put_from_ptr("slow", data.ptr, 4096)))
    writer.start()
    assert entered.wait(10)
    # mid-copy: the key is neither visible nor readable
    assert not c.exists("slow")
    assert c.batch_exists_consecutive(["slow"]) == 0
    monkeypatch.setattr(client_mod, "_memmove", real)
    assert not c.get_into_ptr("slow", Buf(4096).ptr, 4096)
    release.set()
    writer.join(10)
    assert result == [True] and c.exists("slow")
    out = Buf(4096)
    assert c.get_into_ptr("slow", out.ptr, 4096) and out.bytes() == data.bytes()
    c.close()


def test_concurrent_puts_of_one_key_store_one_value() -> None:
    c = umbp.UMBPClient(local_config())
    bufs = [Buf(8192).fill(i) for i in range(8)]
    barrier = threading.Barrier(8)

    def put(b: Buf) -> None:
        barrier.wait()
        assert c.put_from_ptr("contended", b.ptr, 8192)

    threads = [threading.Thread(target=put, args=(b,)) for b in bufs]
    [t.start() for t in threads]
    [t.join(10) for t in threads]
    out = Buf(8192)
    assert c.get_into_ptr("contended", out.ptr, 8192)
    assert len(set(out.bytes())) == 1  # one writer's bytes, never a mix
    assert c.stats()["dram_objects"] == 1
    c.close()


def test_lru_eviction_without_ssd_drops_the_least_recently_used() -> None:
    c = umbp.UMBPClient(local_config(dram=64 * 1024))
    bufs = [Buf(8192).fill(i) for i in range(6)]
    for i in range(6):
        assert c.put_from_ptr(f"k{i}", bufs[i].ptr, 8192)
    assert c.get_into_ptr("k0", Buf(8192).ptr, 8192)  # k0 is now the most recent
    for i in range(6, 10):
        assert c.put_from_ptr(f"k{i}", Buf(8192).fill(i).ptr, 8192)
    used = c.stats()["dram_used_bytes"]
    assert used <= 0.9 * 64 * 1024
    assert c.exists("k0"), "the recently read object must survive"
    assert not c.exists("k1"), "the least recently used object must be evicted first"
    assert c.exists("k9")
    c.close()


def test_deeper_prefix_blocks_are_evicted_first() -> None:
    c = umbp.UMBPClient(local_config(dram=64 * 1024))
    keys = [f"d{i}" for i in range(6)]
    bufs = [Buf(8192).fill(i) for i in range(6)]
    assert (
        c.batch_put_from_ptr_with_depth(keys, [b.ptr for b in bufs], [8192] * 6, [0, 5, 1, 2, 3, 4])
        == [True] * 6
    )
    assert c.put_from_ptr("new", Buf(8192).ptr, 8192)
    assert c.put_from_ptr("new2", Buf(8192).ptr, 8192)
    assert not c.exists("d1"), "depth 5 is the tail of the prefix: evicted first"
    assert c.exists("d0")
    c.close()


def test_eviction_demotes_to_ssd_and_a_hit_promotes_back(tmp_path: Path) -> None:
    c = umbp.UMBPClient(local_config(dram=64 * 1024, ssd_dir=tmp_path / "ssd"))
    bufs = [rand_buf(8192) for _ in range(12)]
    for i, b in enumerate(bufs):
        assert c.put_from_ptr(f"k{i}", b.ptr, 8192)
    stats = c.stats()
    assert stats["ssd_objects"] >= 4, stats  # demoted, not lost
    for i, b in enumerate(bufs):  # every object is still there, from one tier or the other
        out = Buf(8192)
        assert c.get_into_ptr(f"k{i}", out.ptr, 8192), i
        assert out.bytes() == b.bytes()
    c.close()


def test_object_larger_than_dram_goes_to_ssd(tmp_path: Path) -> None:
    c = umbp.UMBPClient(local_config(dram=16 * 1024, ssd_dir=tmp_path / "ssd"))
    big = rand_buf(64 * 1024)
    assert c.put_from_ptr("big", big.ptr, big.n)
    out = Buf(big.n)
    assert c.get_into_ptr("big", out.ptr, big.n) and out.bytes() == big.bytes()
    c.close()
    c2 = umbp.UMBPClient(local_config(dram=16 * 1024))
    assert not c2.put_from_ptr("big", big.ptr, big.n)  # no SSD: it cannot be stored, and says so
    c2.close()


def test_ssd_objects_survive_a_restart(tmp_path: Path) -> None:
    data = rand_buf(4096)
    c = umbp.UMBPClient(local_config(dram=4096 * 2, ssd_dir=tmp_path / "ssd"))
    for i in range(4):
        assert c.put_from_ptr(f"k{i}", data.ptr, 4096)
    c.close()  # flushes; DRAM is gone, the demoted objects are on SSD
    c = umbp.UMBPClient(local_config(dram=1 << 20, ssd_dir=tmp_path / "ssd"))
    assert c.exists("k0")
    out = Buf(4096)
    assert c.get_into_ptr("k0", out.ptr, 4096) and out.bytes() == data.bytes()
    c.close()


def test_leader_copies_every_write_to_ssd_and_follower_reads_it(tmp_path: Path) -> None:
    lead_cfg = local_config(ssd_dir=tmp_path / "shared")
    lead_cfg.role = umbp.UMBPRole.SharedSSDLeader
    leader = umbp.UMBPClient(lead_cfg)
    fol_cfg = local_config(ssd_dir=tmp_path / "shared")
    fol_cfg.role = umbp.UMBPRole.SharedSSDFollower
    follower = umbp.UMBPClient(fol_cfg)
    data = rand_buf(4096)
    assert not follower.put_from_ptr("x", data.ptr, 4096), "a follower never writes"
    assert leader.put_from_ptr("mla_k", data.ptr, 4096)
    assert leader.flush()  # the async copy pipeline has written it through
    out = Buf(4096)
    assert follower.exists("mla_k")
    assert follower.get_into_ptr("mla_k", out.ptr, 4096) and out.bytes() == data.bytes()
    follower.close()
    leader.close()


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda c: c.put_from_ptr("", 1, 1), "key"),
        (lambda c: c.put_from_ptr("k", 0, 1), "ptr"),
        (lambda c: c.put_from_ptr("k", 1, 0), "size"),
        (lambda c: c.put_from_ptr(b"k", 1, 1), "key"),
        (lambda c: c.get_into_ptr("k", -5, 1), "ptr"),
        (lambda c: c.batch_put_from_ptr(["a", "b"], [1], [1, 1]), "ptrs"),
        (lambda c: c.batch_get_into_ptr(["a"], [1], [1, 2]), "sizes"),
        (lambda c: c.exists("k" * 5000), "key"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(client: umbp.UMBPClient, call, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match) as e:
        call(client)
    assert isinstance(e.value, RuntimeError), "the original raises RuntimeError: code catches that"


def test_a_closed_client_refuses_calls() -> None:
    c = umbp.UMBPClient(local_config())
    c.close()
    c.close()  # idempotent
    with pytest.raises(umbp.UMBPError, match="closed"):
        c.put_from_ptr("k", Buf(8).ptr, 8)


def test_unsupported_modes_fail_clearly() -> None:
    cfg = local_config()
    cfg.standalone_process = umbp.UMBPStandaloneProcessConfig()
    with pytest.raises(umbp.UMBPUnsupportedError, match="standalone"):
        umbp.UMBPClient(cfg)
    cfg = local_config(ssd_dir="/tmp/never-created-umbp")
    cfg.ssd.ssd_backend = "spdk"
    with pytest.raises(umbp.UMBPUnsupportedError, match="SPDK"):
        umbp.UMBPClient(cfg)


def test_local_mode_reports_and_registration(client: umbp.UMBPClient) -> None:
    assert not client.is_distributed()
    assert client.get_deployment_mode() == umbp.UMBPDeploymentMode.Local
    b = Buf(4096)
    assert client.register_memory(b.ptr, 4096) and client.deregister_memory(b.ptr)
    assert not client.deregister_memory(b.ptr)
    assert client.report_external_kv_blocks(["h"], umbp.UMBPTierType.DRAM) is False
    assert client.match_external_kv(["h"]) == []

"""The SSD tier's segmented log: checksums, torn and corrupt records, durability, segments."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from umbp_helpers import Buf, rand_buf

import mori.umbp as umbp
import mori.umbp.ssd as ssd_mod
from mori.umbp.ssd import HEADER_SIZE, SsdTier


def ssd_config(
    path: Path, *, capacity: int = 16 << 20, segment: int = 1 << 20, strict: bool = True
) -> umbp.UMBPSsdConfig:
    cfg = umbp.UMBPSsdConfig()
    cfg.storage_dir = str(path)
    cfg.capacity_bytes = capacity
    cfg.segment_size_bytes = segment
    cfg.durability.mode = umbp.UMBPDurabilityMode.Strict if strict else umbp.UMBPDurabilityMode.Relaxed
    return cfg


def segments(path: Path) -> list[Path]:
    return sorted(path.glob("segment-*.log"))


def test_round_trip_and_restart(tmp_path: Path) -> None:
    data = [rand_buf(3000 + i) for i in range(5)]
    t = SsdTier(ssd_config(tmp_path))
    assert t.put_many([(f"k{i}", b.ptr, b.n) for i, b in enumerate(data)]) == [True] * 5
    t.close()
    t = SsdTier(ssd_config(tmp_path))
    for i, b in enumerate(data):
        out = Buf(b.n)
        assert t.get(f"k{i}", out.ptr, b.n) and out.bytes() == b.bytes()
    t.close()


def test_torn_tail_record_is_dropped_on_restart(tmp_path: Path) -> None:
    a, b = rand_buf(4096), rand_buf(4096)
    t = SsdTier(ssd_config(tmp_path))
    assert t.put_many([("a", a.ptr, 4096), ("b", b.ptr, 4096)]) == [True, True]
    t.close()
    seg = segments(tmp_path)[-1]
    full = seg.stat().st_size
    os.truncate(seg, full - 100)  # a crash in the middle of writing b
    t = SsdTier(ssd_config(tmp_path))
    assert t.exists("a") and not t.exists("b")
    assert t.dropped_records == 1
    assert seg.stat().st_size == HEADER_SIZE + 1 + 4096, "the torn tail is cut off"
    out = Buf(4096)
    assert t.get("a", out.ptr, 4096) and out.bytes() == a.bytes()
    c = Buf(4096).fill(7)  # the log goes on after the cut
    assert t.put_many([("c", c.ptr, 4096)]) == [True]
    t.close()
    t = SsdTier(ssd_config(tmp_path))
    assert t.exists("a") and t.exists("c") and not t.exists("b")
    t.close()


def test_tail_record_with_garbage_data_is_dropped_on_restart(tmp_path: Path) -> None:
    a = rand_buf(4096)
    t = SsdTier(ssd_config(tmp_path))
    assert t.put_many([("a", a.ptr, 4096), ("b", a.ptr, 4096)]) == [True, True]
    t.close()
    seg = segments(tmp_path)[-1]
    with open(seg, "r+b") as f:  # the header of b made it, its data did not
        f.seek(seg.stat().st_size - 10)
        f.write(b"\0" * 10)
    t = SsdTier(ssd_config(tmp_path))
    assert t.exists("a") and not t.exists("b")
    t.close()


def test_corrupted_record_is_never_served(tmp_path: Path) -> None:
    cfg = ssd_config(tmp_path, segment=8192)  # a and b end up in different segments
    a, b = rand_buf(6000), rand_buf(6000)
    t = SsdTier(cfg)
    assert t.put_many([("a", a.ptr, 6000)]) == [True]
    assert t.put_many([("b", b.ptr, 6000)]) == [True]
    first = segments(tmp_path)[0]
    with open(first, "r+b") as f:  # flip one byte of a's value on disk
        f.seek(HEADER_SIZE + 1 + 3000)
        byte = f.read(1)
        f.seek(HEADER_SIZE + 1 + 3000)
        f.write(bytes([byte[0] ^ 0xFF]))
    out = Buf(6000)
    assert not t.get("a", out.ptr, 6000), "a record that fails its checksum is a miss"
    assert not t.exists("a"), "and is forgotten"
    assert t.get("b", out.ptr, 6000) and out.bytes() == b.bytes()
    t.close()


def test_strict_fsyncs_each_batch_relaxed_does_not(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = os.fsync
    monkeypatch.setattr(ssd_mod.os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
    data = rand_buf(1024)
    strict = SsdTier(ssd_config(tmp_path / "s", strict=True))
    assert strict.put_many([("first", data.ptr, 1024)]) == [True]  # creates the segment (+ a directory fsync)
    calls.clear()
    assert strict.put_many([("a", data.ptr, 1024), ("b", data.ptr, 1024)]) == [True, True]
    assert len(calls) == 1, "one fsync for the batch, before it is acknowledged"
    relaxed = SsdTier(ssd_config(tmp_path / "r", strict=False))
    calls.clear()
    assert relaxed.put_many([("a", data.ptr, 1024)]) == [True]
    assert calls == []
    relaxed.flush()
    assert calls, "flush makes a relaxed tier durable"
    strict.close()
    relaxed.close()


def test_segments_roll_over_and_the_oldest_are_evicted_at_the_watermark(tmp_path: Path) -> None:
    cfg = ssd_config(tmp_path, capacity=64 * 1024, segment=16 * 1024)
    t = SsdTier(cfg)
    data = rand_buf(4000)
    for i in range(40):
        assert t.put_many([(f"k{i}", data.ptr, 4000)]) == [True]
    assert len(segments(tmp_path)) > 1
    assert t.file_bytes() <= 0.9 * 64 * 1024 + 16 * 1024
    assert not t.exists("k0"), "the oldest segment went first"
    assert t.exists("k39")
    t.close()


def test_first_write_wins_on_ssd(tmp_path: Path) -> None:
    t = SsdTier(ssd_config(tmp_path))
    a, b = Buf(64).fill(1), Buf(64).fill(2)
    assert t.put_many([("k", a.ptr, 64), ("k", b.ptr, 64)]) == [True, True]
    assert t.put_many([("k", b.ptr, 64)]) == [True]
    out = Buf(64)
    assert t.get("k", out.ptr, 64) and out.bytes() == bytes([1]) * 64
    assert t.file_bytes() == HEADER_SIZE + 1 + 64, "one record only"
    t.close()

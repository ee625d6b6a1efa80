"""UMBPHostMemAllocator: page-aligned mappings, huge pages demoted when absent, idempotent free."""

from __future__ import annotations

import ctypes
import os

import pytest

import mori.umbp as umbp

PAGE = os.sysconf("SC_PAGE_SIZE")
B = umbp.UMBPHostBufferBacking


def touch(h: umbp.UMBPHostBuffer, value: int) -> None:
    data = (ctypes.c_ubyte * h.requested_size).from_address(h.ptr)
    data[0] = data[h.requested_size - 1] = value
    assert data[0] == value == data[h.requested_size - 1]


def test_anonymous_round_trip() -> None:
    a = umbp.UMBPHostMemAllocator()
    h = a.alloc(12345, B.Anonymous, hugepage_size=2 << 20, numa_node=-1, prefault=True)
    assert h and h.ptr and h.requested_size == 12345 and h.actual_backing == B.Anonymous
    assert h.actual_alignment == PAGE and h.ptr % PAGE == 0
    assert h.mapped_size >= 12345 and h.mapped_size % PAGE == 0
    assert a.mapped_size_for(h.ptr) == h.mapped_size
    touch(h, 0x5A)
    a.free(h)
    assert not h and h.ptr == 0 and h.requested_size == 0 and h.mapped_size == 0
    a.free(h)  # idempotent
    assert not h


def test_hugetlb_request_is_writable_even_when_demoted() -> None:
    a = umbp.UMBPHostMemAllocator()
    h = a.alloc(64 * 1024, B.AnonymousHugetlb, hugepage_size=2 << 20)
    assert h.actual_backing in (B.Anonymous, B.AnonymousHugetlb)
    assert h.actual_alignment == (2 << 20 if h.actual_backing == B.AnonymousHugetlb else PAGE)
    assert h.ptr % h.actual_alignment == 0
    touch(h, 0xA5)
    a.free(h)
    assert not h


def test_shared_memory_is_visible_through_dev_shm_and_removed_on_free() -> None:
    a = umbp.UMBPHostMemAllocator()
    h = a.alloc(8192, B.AnonymousShm)
    path = h.shm_name
    assert path.startswith("/dev/shm/") and os.path.exists(path)
    ctypes.memmove(h.ptr, b"shared!", 7)
    with open(path, "rb") as f:
        assert f.read(7) == b"shared!"
    a.free(h)
    assert not os.path.exists(path)


def test_bad_arguments_and_foreign_buffers_are_refused() -> None:
    a, other = umbp.UMBPHostMemAllocator(), umbp.UMBPHostMemAllocator()
    with pytest.raises(ValueError, match="size"):
        a.alloc(0)
    with pytest.raises(ValueError, match="hugepage_size"):
        a.alloc(4096, B.AnonymousHugetlb, hugepage_size=3 << 20)
    with pytest.raises(ValueError, match="numa_node"):
        a.alloc(4096, numa_node=1)
    h = a.alloc(4096)
    with pytest.raises(ValueError, match="buf"):
        other.free(h)  # not its buffer: left alone
    assert h
    a.free(h)

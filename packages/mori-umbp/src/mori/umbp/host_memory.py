"""Host memory for UMBP: page-aligned mappings (anonymous, huge pages, POSIX shared memory).

:class:`UMBPHostMemAllocator` is the original's allocator for staging and KV host buffers;
the DRAM tier's pool is one such mapping. Mappings come from ``mmap(2)`` through libc, so the
pointer stays valid until :meth:`UMBPHostMemAllocator.free`, and nothing of the caller's other
memory is touched (no ``mlockall``, no madvise of memory we did not map).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import os
import secrets
import threading
from dataclasses import dataclass

from mori.umbp.config import UMBPHostBufferBacking
from mori.umbp.errors import UMBPError, bad_arg

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
_MAP_HUGETLB = 0x40000
_MAP_HUGE_SHIFT = 26
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)


def _round_up(n: int, unit: int) -> int:
    return (n + unit - 1) // unit * unit


@dataclass
class UMBPHostBuffer:
    """One mapping: ``ptr`` and sizes in bytes. False (and all zero) once freed."""

    ptr: int = 0
    requested_size: int = 0
    mapped_size: int = 0
    actual_backing: UMBPHostBufferBacking = UMBPHostBufferBacking.Anonymous
    actual_alignment: int = 0
    #: the /dev/shm name of an AnonymousShm buffer (another process maps it by this name)
    shm_name: str = ""

    def __bool__(self) -> bool:
        return self.ptr != 0


def _mmap(length: int, flags: int, fd: int = -1) -> int | None:
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    addr = _libc.mmap(None, length, prot, flags, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        return None
    return int(addr)


def map_host(
    size: int,
    backing: UMBPHostBufferBacking = UMBPHostBufferBacking.Anonymous,
    *,
    hugepage_size: int = 2 << 20,
    prefault: bool = True,
    shm_name: str = "",
) -> UMBPHostBuffer:
    """Map ``size`` bytes. Huge pages that the system cannot give demote to normal pages."""
    if backing == UMBPHostBufferBacking.AnonymousHugetlb:
        length = _round_up(size, hugepage_size)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_HUGETLB
        flags |= (hugepage_size.bit_length() - 1) << _MAP_HUGE_SHIFT
        addr = _mmap(length, flags | (_MAP_POPULATE if prefault else 0))
        if addr is not None:
            return UMBPHostBuffer(addr, size, length, backing, hugepage_size)
        backing = UMBPHostBufferBacking.Anonymous  # no huge pages free: demote, as the original
    length = _round_up(size, PAGE_SIZE)
    if backing == UMBPHostBufferBacking.AnonymousShm:
        name = shm_name or f"umbp-{os.getpid()}-{secrets.token_hex(6)}"
        path = "/dev/shm/" + name.lstrip("/")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, length)
            addr = _mmap(length, mmap.MAP_SHARED | (_MAP_POPULATE if prefault else 0), fd)
        finally:
            os.close(fd)
        if addr is None:
            os.unlink(path)
            raise UMBPError(
                f"mmap of {length} bytes of shared memory {path} failed: {os.strerror(ctypes.get_errno())}"
            )
        return UMBPHostBuffer(addr, size, length, backing, PAGE_SIZE, path)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (_MAP_POPULATE if prefault else 0)
    addr = _mmap(length, flags)
    if addr is None:
        raise UMBPError(f"mmap of {length} bytes of host memory failed: {os.strerror(ctypes.get_errno())}")
    return UMBPHostBuffer(addr, size, length, backing, PAGE_SIZE)


def unmap_host(buf: UMBPHostBuffer) -> None:
    """Unmap ``buf`` and zero it; a second call does nothing."""
    if not buf:
        return
    _libc.munmap(buf.ptr, buf.mapped_size)
    if buf.shm_name:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(buf.shm_name)
    buf.ptr = buf.requested_size = buf.mapped_size = buf.actual_alignment = 0
    buf.shm_name = ""


class UMBPHostMemAllocator:
    """Allocates page-aligned host buffers (the original's ``UMBPHostMemAllocator``).

    ``alloc`` returns a :class:`UMBPHostBuffer`; ``free`` unmaps it and invalidates the handle,
    and is idempotent. Thread-safe. ``numa_node`` is recorded, binding is not done by this build
    (``numa_node`` other than -1 raises unless the caller accepts that with ``-1``).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[int, UMBPHostBuffer] = {}

    def alloc(
        self,
        size: int,
        backing: UMBPHostBufferBacking = UMBPHostBufferBacking.Anonymous,
        hugepage_size: int = 2 << 20,
        numa_node: int = -1,
        prefault: bool = True,
    ) -> UMBPHostBuffer:
        f = "UMBPHostMemAllocator.alloc"
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise bad_arg(f, "size", size, "an int > 0 (bytes)")
        if not isinstance(backing, UMBPHostBufferBacking):
            raise bad_arg(f, "backing", backing, "a UMBPHostBufferBacking")
        if hugepage_size <= 0 or hugepage_size & (hugepage_size - 1):
            raise bad_arg(f, "hugepage_size", hugepage_size, "a power of two")
        if numa_node != -1:
            raise bad_arg(f, "numa_node", numa_node, "-1 (NUMA binding is not in this build)")
        buf = map_host(size, backing, hugepage_size=hugepage_size, prefault=prefault)
        with self._lock:
            self._live[buf.ptr] = buf
        return buf

    def free(self, buf: UMBPHostBuffer) -> None:
        with self._lock:
            if not buf or self._live.get(buf.ptr) is not buf:
                if buf:  # not ours: leave the memory alone, but say so
                    raise bad_arg("UMBPHostMemAllocator.free", "buf", buf, "a buffer this allocator returned")
                return
            del self._live[buf.ptr]
        unmap_host(buf)

    def mapped_size_for(self, ptr: int) -> int:
        """Mapped bytes of the live buffer at ``ptr``, 0 if none (SGLang's registration uses it)."""
        with self._lock:
            buf = self._live.get(ptr)
            return buf.mapped_size if buf else 0

"""The buffers of ``mori bench io --device cpu`` (``--buffers``): on 4 KiB pages from torch's
allocator, or on 2 MiB transparent huge pages (:func:`cpu_buffer`); the share of a buffer the kernel
maps with huge pages (:func:`huge_fraction`); the digest the processes compare bytes by
(:func:`digest`)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

__all__ = ["cpu_buffer", "digest", "huge_fraction"]


def cpu_buffer(nbytes: int, kind: str) -> Any:
    """A uint8 tensor of ``nbytes`` zeros: ``pages`` from torch's allocator, ``huge`` in an anonymous
    mapping marked MADV_HUGEPAGE and touched, so the kernel backs it with 2 MiB pages where it can.
    The mapping lives as long as the tensor (torch keeps the buffer object alive)."""
    import mmap

    import torch

    if kind == "pages":
        return torch.zeros(nbytes, dtype=torch.uint8)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    t.zero_()  # fault every page in now, on huge pages
    return t


def huge_fraction(t: Any) -> float:
    """The share of a tensor's bytes the kernel maps with huge pages now (from /proc/self/smaps)."""
    addr, size = t.data_ptr(), t.numel() * t.element_size()
    huge, overlaps = 0, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            overlaps = max(0, min(hi, addr + size) - max(lo, addr))
        elif overlaps and head == "AnonHugePages:":
            huge += min(int(line.split()[1]) * 1024, overlaps)
    return huge / size if size else 0.0


def digest(data: Any) -> str:
    """A 16-byte BLAKE2b digest (hex) of ``data``'s bytes: two processes compare buffers by it."""
    return hashlib.blake2b(bytes(data), digest_size=16).hexdigest()

"""Deterministic allocator for the user part of the symmetric heap.

Every rank runs the same sequence of collective ``shmem_malloc``/``shmem_free`` calls, so every
rank computes the same offsets: that is what makes the heap symmetric. The allocator is first-fit
over a sorted free list with coalescing; it knows offsets only, never addresses.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

MIN_ALIGN = 256


@dataclass(frozen=True)
class Block:
    offset: int
    size: int


class HeapAllocator:
    def __init__(self, start: int, end: int) -> None:
        self.start = start
        self.end = end
        self._free: list[tuple[int, int]] = [(start, end - start)]  # (offset, size), sorted, coalesced
        self.live: dict[int, int] = {}  # offset -> size
        self.freed: set[int] = set()  # offsets freed and not handed out again: double-free detection

    def allocate(self, size: int, align: int = MIN_ALIGN) -> Block | None:
        """First fit. Returns None when no free range fits (the caller reports the error)."""
        align = max(align, MIN_ALIGN)
        size = -(-size // MIN_ALIGN) * MIN_ALIGN
        for i, (off, length) in enumerate(self._free):
            start = -(-off // align) * align
            if start + size > off + length:
                continue
            del self._free[i]
            if start > off:
                self._insert(off, start - off)
            if start + size < off + length:
                self._insert(start + size, off + length - start - size)
            self.live[start] = size
            self.freed.discard(start)
            return Block(start, size)
        return None

    def release(self, offset: int) -> int:
        """Free the block at ``offset``; returns its size. KeyError if it is not live."""
        size = self.live.pop(offset)
        self.freed.add(offset)
        self._insert(offset, size)
        return size

    def containing(self, offset: int) -> Block | None:
        """The live block that holds ``offset``, if any."""
        starts = sorted(self.live)
        i = bisect.bisect_right(starts, offset) - 1
        if i >= 0 and offset < starts[i] + self.live[starts[i]]:
            return Block(starts[i], self.live[starts[i]])
        return None

    @property
    def free_bytes(self) -> int:
        return sum(length for _, length in self._free)

    @property
    def largest_free(self) -> int:
        return max((length for _, length in self._free), default=0)

    def _insert(self, off: int, length: int) -> None:
        i = bisect.bisect_left(self._free, (off, 0))
        self._free.insert(i, (off, length))
        # coalesce with the right neighbour, then the left one
        if i + 1 < len(self._free) and off + length == self._free[i + 1][0]:
            self._free[i] = (off, length + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
            del self._free[i]

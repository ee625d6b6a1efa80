"""First-fit allocator of byte ranges inside one pool (the DRAM tier's, the HBM tier's).

Free ranges are kept sorted by offset and merged with their neighbours on free, so a pool that
empties is one free range again. Every allocation is rounded up to ``ALIGN`` bytes. Not
thread-safe: the tier that owns the arena holds its lock.
"""

from __future__ import annotations

import bisect

ALIGN = 64  #: bytes; keeps every object on its own cache lines


class Arena:
    def __init__(self, size: int) -> None:
        self.size = size
        self._starts: list[int] = [0]
        self._lengths: list[int] = [size]
        self.used = 0

    @staticmethod
    def rounded(n: int) -> int:
        return (n + ALIGN - 1) // ALIGN * ALIGN

    def alloc(self, n: int) -> int | None:
        """Offset of ``n`` free bytes (rounded up to ALIGN), or None when no free range is large enough."""
        n = self.rounded(n)
        for i, length in enumerate(self._lengths):
            if length >= n:
                off = self._starts[i]
                if length == n:
                    del self._starts[i]
                    del self._lengths[i]
                else:
                    self._starts[i] += n
                    self._lengths[i] -= n
                self.used += n
                return off
        return None

    def free(self, off: int, n: int) -> None:
        n = self.rounded(n)
        i = bisect.bisect_left(self._starts, off)
        if (i < len(self._starts) and self._starts[i] < off + n) or (
            i > 0 and self._starts[i - 1] + self._lengths[i - 1] > off
        ):
            raise RuntimeError(f"Arena.free: range [{off}, {off + n}) is already free")
        self.used -= n
        merge_prev = i > 0 and self._starts[i - 1] + self._lengths[i - 1] == off
        merge_next = i < len(self._starts) and off + n == self._starts[i]
        if merge_prev and merge_next:
            self._lengths[i - 1] += n + self._lengths[i]
            del self._starts[i]
            del self._lengths[i]
        elif merge_prev:
            self._lengths[i - 1] += n
        elif merge_next:
            self._starts[i] = off
            self._lengths[i] += n
        else:
            self._starts.insert(i, off)
            self._lengths.insert(i, n)

    def largest_free(self) -> int:
        return max(self._lengths, default=0)

    def reset(self) -> None:
        self._starts, self._lengths, self.used = [0], [self.size], 0

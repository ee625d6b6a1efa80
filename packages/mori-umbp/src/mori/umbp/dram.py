"""The DRAM tier: objects in one host mapping, LRU order, high/low-watermark eviction.

The pool is mapped once at start (prefaulted by default, so a put never takes a page fault) and
split by an :class:`mori.umbp.arena.Arena`. An object is *reserved* (space taken, invisible),
filled outside the lock, then *committed* (visible); a reader *pins* an object for the time of
its copy so eviction never frees bytes that are being read. Eviction looks at the
``candidate_window`` least recently used unpinned objects and takes the one with the greatest
prefix depth first (the tail of a prefix is the least likely to be reused), until the tier is
below ``low_watermark``; the owner decides what happens to the victim (demotion to SSD).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from mori.umbp.arena import Arena
from mori.umbp.config import UMBPDramConfig, UMBPHostBufferBacking
from mori.umbp.host_memory import UMBPHostBuffer, map_host, unmap_host


@dataclass
class DramEntry:
    offset: int
    size: int
    depth: int = -1
    pins: int = 0
    committed: bool = False


class DramTier:
    """``region``: ``(base address, bytes, release)`` of memory allocated elsewhere (the HBM tier's
    device memory); None maps host memory as ``cfg`` says."""

    def __init__(
        self,
        cfg: UMBPDramConfig,
        candidate_window: int = 16,
        region: tuple[int, int, Callable[[], None]] | None = None,
    ) -> None:
        self.cfg = cfg
        self.window = candidate_window
        self.lock = threading.Condition(threading.Lock())
        self._lru: OrderedDict[str, DramEntry] = OrderedDict()
        self._release: Callable[[], None] | None = None
        self.buffer: UMBPHostBuffer
        if region is not None:
            self.base, self.capacity, self._release = region
            self.buffer = UMBPHostBuffer()
            self._arena = Arena(self.capacity)
            return
        if cfg.use_shared_memory:
            backing = UMBPHostBufferBacking.AnonymousShm
        elif cfg.use_hugepages:
            backing = UMBPHostBufferBacking.AnonymousHugetlb
        else:
            backing = UMBPHostBufferBacking.Anonymous
        self.buffer = map_host(
            cfg.capacity_bytes,
            backing,
            hugepage_size=cfg.hugepage_size,
            prefault=cfg.prefault,
            shm_name=cfg.shm_name.lstrip("/") + f"-{id(self):x}" if cfg.use_shared_memory else "",
        )
        self.base = self.buffer.ptr
        self.capacity = cfg.capacity_bytes
        self._arena = Arena(cfg.capacity_bytes)

    # everything below is called with self.lock held

    def lookup(self, key: str) -> DramEntry | None:
        e = self._lru.get(key)
        return e if e is not None and e.committed else None

    def is_reserved(self, key: str) -> bool:
        e = self._lru.get(key)
        return e is not None and not e.committed

    def reserve(
        self, key: str, size: int, depth: int, on_evict: Callable[[str, DramEntry], None]
    ) -> DramEntry | None:
        """Space for ``key`` (invisible until :meth:`commit`), evicting as needed; None if it cannot fit."""
        need = Arena.rounded(size)
        if need > self.capacity:
            return None
        high = self.cfg.high_watermark * self.capacity
        if self._arena.used + need > high:
            self._evict(self.cfg.low_watermark * self.capacity - need, on_evict)
        off = self._arena.alloc(size)
        while off is None:  # fragmented: evict more, one at a time
            if not self._evict_one(on_evict):
                return None
            off = self._arena.alloc(size)
        e = DramEntry(off, size, depth)
        self._lru[key] = e
        return e

    def commit(self, key: str) -> None:
        e = self._lru[key]
        e.committed = True
        self._lru.move_to_end(key)
        self.lock.notify_all()

    def abort(self, key: str) -> None:
        e = self._lru.pop(key, None)
        if e is not None:
            self._arena.free(e.offset, e.size)
        self.lock.notify_all()

    def touch(self, key: str) -> None:
        if key in self._lru:
            self._lru.move_to_end(key)

    def remove(self, key: str) -> bool:
        e = self._lru.get(key)
        if e is None or not e.committed or e.pins:
            return False
        del self._lru[key]
        self._arena.free(e.offset, e.size)
        return True

    def _evict_one(self, on_evict: Callable[[str, DramEntry], None]) -> bool:
        window = self.window
        candidates: list[tuple[str, DramEntry]] = []
        for key, e in self._lru.items():
            if e.committed and not e.pins:
                candidates.append((key, e))
                if len(candidates) >= window:
                    break
        if not candidates:
            return False
        key, victim = max(candidates, key=lambda kv: kv[1].depth)  # first of the deepest
        on_evict(key, victim)
        del self._lru[key]
        self._arena.free(victim.offset, victim.size)
        return True

    def _evict(self, target_used: float, on_evict: Callable[[str, DramEntry], None]) -> None:
        while self._arena.used > max(target_used, 0) and self._evict_one(on_evict):
            pass

    def used_bytes(self) -> int:
        return self._arena.used

    def sizes(self) -> list[tuple[str, int]]:
        return [(k, e.size) for k, e in self._lru.items() if e.committed]

    def keys(self) -> list[str]:
        return [k for k, e in self._lru.items() if e.committed]

    def __len__(self) -> int:
        return sum(1 for e in self._lru.values() if e.committed)

    def clear(self) -> int:
        """Drop every unpinned object; returns how many stayed (pinned or being written)."""
        kept = 0
        for key in list(self._lru):
            e = self._lru[key]
            if e.pins or not e.committed:
                kept += 1
                continue
            del self._lru[key]
            self._arena.free(e.offset, e.size)
        return kept

    def close(self) -> None:
        self._lru.clear()
        self._arena.reset()
        if self._release is not None:
            self._release()
            self._release = None
        unmap_host(self.buffer)

"""The SSD tier: an append-only segmented log with a checksum on every record.

Layout under ``storage_dir``: ``segment-00000001.log``, ``segment-00000002.log``, ... Each file
holds records back to back; a record is a 32-byte header, the key (UTF-8), the value::

    magic "UMBR" | version u16 | flags u16 | key_len u32 | value_len u64 | data_crc u32 | header_crc u32 | pad u32

``data_crc`` is CRC-32 over key and value, ``header_crc`` CRC-32 over the 24 header bytes before
it. A record is visible (in the in-memory index) only once all its bytes are written, and with
strict durability only after ``fsync``. Every read checks ``data_crc`` after the bytes landed in
the caller's buffer and reports a miss on mismatch, so a torn or corrupted record is never served.
On open, the segments are scanned: the first record of a segment whose header or (in the last
segment, where a crash can tear a write) data does not check out ends that segment, and the file
is truncated there, so a torn tail is dropped on restart.

Capacity: when the live bytes pass ``high_watermark * capacity_bytes``, whole oldest segments are
deleted until they are below ``low_watermark`` (objects in them are gone: this is a cache).

I/O is ``pwritev``/``preadv`` straight between the caller's memory and the file (no bounce
buffer), issued from the calling thread or, for a batch, a pool of ``min(queue_depth, 8)`` threads
after a ``POSIX_FADV_WILLNEED`` for every record of the batch (the kernel reads ahead for all of
them at once); the syscalls release the GIL. ``UMBPIoBackend.IoUring`` is accepted and served by this path.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import struct
import threading
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from mori.umbp.config import UMBPDurabilityMode, UMBPSsdConfig
from mori.umbp.errors import UMBPUnsupportedError

log = logging.getLogger("mori.umbp.ssd")

MAGIC = b"UMBR"
VERSION = 1
_HEAD = struct.Struct("<4sHHIQI")  # 24 bytes covered by header_crc
_TAIL = struct.Struct("<II")  # header_crc, pad
HEADER_SIZE = _HEAD.size + _TAIL.size  # 32
MAX_KEY_BYTES = 4096
_SEGMENT_RE = re.compile(r"^segment-(\d{8})\.log$")


def _view(ptr: int, size: int) -> memoryview:
    return memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")


def encode_header(key: bytes, value_len: int, data_crc: int, flags: int = 0) -> bytes:
    head = _HEAD.pack(MAGIC, VERSION, flags, len(key), value_len, data_crc)
    return head + _TAIL.pack(zlib.crc32(head), 0)


def decode_header(raw: bytes) -> tuple[int, int, int, int] | None:
    """(flags, key_len, value_len, data_crc), or None when the header is not a valid record header."""
    if len(raw) != HEADER_SIZE:
        return None
    head = raw[: _HEAD.size]
    magic, version, flags, key_len, value_len, data_crc = _HEAD.unpack(head)
    (header_crc, _pad) = _TAIL.unpack(raw[_HEAD.size :])
    if magic != MAGIC or version != VERSION or zlib.crc32(head) != header_crc:
        return None
    if key_len == 0 or key_len > MAX_KEY_BYTES:
        return None
    return flags, key_len, value_len, data_crc


@dataclass
class _Loc:
    segment: int
    offset: int  #: of the record header
    size: int  #: value bytes
    data_crc: int
    key_len: int


class _Segment:
    def __init__(self, ident: int, path: str, fd: int, size: int) -> None:
        self.ident, self.path, self.fd, self.size = ident, path, fd, size
        self.live = 0  #: bytes of records still in the index
        self.keys: set[str] = set()


class SsdTier:
    """One process's view of a segmented log. ``read_only`` (a SharedSSDFollower) never writes,
    truncates or deletes, and follows what the writer appends (:meth:`refresh`)."""

    def __init__(self, cfg: UMBPSsdConfig, *, read_only: bool = False) -> None:
        if cfg.ssd_backend in ("spdk", "spdk_proxy"):
            raise UMBPUnsupportedError(
                f"ssd.ssd_backend={cfg.ssd_backend!r} needs SPDK, which this build does not include; "
                "use ssd_backend='file' (a segmented log on a file system)"
            )
        self.cfg = cfg
        self.read_only = read_only
        self.dir = cfg.storage_dir
        self.capacity = cfg.capacity_bytes
        self.strict = cfg.durability.mode == UMBPDurabilityMode.Strict
        self._lock = threading.Lock()
        self._index: dict[str, _Loc] = {}
        self._segments: dict[int, _Segment] = {}
        self._active: _Segment | None = None
        self._writing = 0  #: records reserved but not yet published
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, min(cfg.io.queue_depth, 8)), thread_name_prefix="umbp-ssd"
        )
        self.dropped_records = 0  #: torn or corrupt records found by scans (a metric)
        os.makedirs(self.dir, exist_ok=True)
        self._scan_all()

    # -- scanning --------------------------------------------------------------------------------

    def _segment_ids(self) -> list[int]:
        return sorted(int(m.group(1)) for name in os.listdir(self.dir) if (m := _SEGMENT_RE.match(name)))

    def _open_segment(self, ident: int) -> _Segment:
        path = os.path.join(self.dir, f"segment-{ident:08d}.log")
        flags = os.O_RDONLY if self.read_only else os.O_RDWR
        fd = os.open(path, flags | os.O_CLOEXEC)
        return _Segment(ident, path, fd, 0)

    def _scan_segment(self, seg: _Segment, start: int, *, is_last: bool) -> None:
        """Index the records of ``seg`` from ``start``; stop (and truncate, when allowed) at the first bad one."""
        end = os.fstat(seg.fd).st_size
        off = start
        while off + HEADER_SIZE <= end:
            hdr = decode_header(os.pread(seg.fd, HEADER_SIZE, off))
            if hdr is None:
                break
            flags, key_len, value_len, data_crc = hdr
            rec_end = off + HEADER_SIZE + key_len + value_len
            if rec_end > end:
                break  # torn: the write did not finish
            key_raw = os.pread(seg.fd, key_len, off + HEADER_SIZE)
            if is_last or self.read_only:
                # a crash tears only the tail, and a follower may see a record being written:
                # check the data of these records before they become visible
                crc = zlib.crc32(key_raw)
                pos, left = off + HEADER_SIZE + key_len, value_len
                while left:
                    chunk = os.pread(seg.fd, min(left, 8 << 20), pos)
                    if not chunk:
                        break
                    crc = zlib.crc32(chunk, crc)
                    pos += len(chunk)
                    left -= len(chunk)
                if left or crc != data_crc:
                    break
            try:
                key = key_raw.decode()
            except UnicodeDecodeError:
                break
            if flags == 0:
                self._index_record(key, _Loc(seg.ident, off, value_len, data_crc, key_len), seg)
            off = rec_end
        if off < end:
            if self.read_only:
                seg.size = off  # maybe being written: look again on the next refresh
                return
            self.dropped_records += 1
            log.warning(
                "UMBP SSD tier: %s has a torn or corrupt record at byte %d of %d; dropping the rest of the segment",
                seg.path,
                off,
                end,
            )
            os.ftruncate(seg.fd, off)
            if self.strict:
                os.fsync(seg.fd)
        seg.size = off

    def _index_record(self, key: str, loc: _Loc, seg: _Segment) -> None:
        old = self._index.get(key)
        if old is not None:
            self._forget(key, old)
        self._index[key] = loc
        seg.live += HEADER_SIZE + loc.key_len + loc.size
        seg.keys.add(key)

    def _forget(self, key: str, loc: _Loc) -> None:
        seg = self._segments.get(loc.segment)
        if seg is not None:
            seg.live -= HEADER_SIZE + loc.key_len + loc.size
            seg.keys.discard(key)

    def _scan_all(self) -> None:
        ids = self._segment_ids()
        for i, ident in enumerate(ids):
            seg = self._open_segment(ident)
            self._segments[ident] = seg
            self._scan_segment(seg, 0, is_last=i == len(ids) - 1)
        if ids and not self.read_only:
            self._active = self._segments[ids[-1]]

    def refresh(self) -> None:
        """Follow a writer: index what it appended and forget the segments it deleted (followers)."""
        with self._lock:
            ids = self._segment_ids()
            for ident in list(self._segments):
                if ident not in ids:
                    seg = self._segments.pop(ident)
                    for key in seg.keys:
                        if (loc := self._index.get(key)) is not None and loc.segment == ident:
                            del self._index[key]
                    os.close(seg.fd)
            for ident in ids:
                known = self._segments.get(ident)
                if known is None:
                    try:
                        known = self._open_segment(ident)
                    except FileNotFoundError:
                        continue
                    self._segments[ident] = known
                self._scan_segment(known, known.size, is_last=True)

    # -- queries ---------------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return key in self._index

    def size_of(self, key: str) -> int | None:
        loc = self._index.get(key)
        return None if loc is None else loc.size

    def live_bytes(self) -> int:
        with self._lock:
            return sum(s.live for s in self._segments.values())

    def file_bytes(self) -> int:
        with self._lock:
            return sum(s.size for s in self._segments.values())

    def __len__(self) -> int:
        return len(self._index)

    # -- writes ----------------------------------------------------------------------------------

    def _reserve(self, record_len: int) -> tuple[_Segment, int]:
        seg = self._active
        if seg is None or (seg.size > 0 and seg.size + record_len > self.cfg.segment_size_bytes):
            ident = max(self._segments, default=0) + 1
            path = os.path.join(self.dir, f"segment-{ident:08d}.log")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            seg = _Segment(ident, path, fd, 0)
            self._segments[ident] = seg
            self._active = seg
            if self.strict:
                dfd = os.open(self.dir, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
        off = seg.size
        seg.size += record_len
        return seg, off

    def _evict_for(self, incoming: int) -> None:
        """Delete oldest segments while live bytes + ``incoming`` would pass the high watermark."""
        high = self.cfg.high_watermark * self.capacity
        low = self.cfg.low_watermark * self.capacity
        total = sum(s.size for s in self._segments.values())
        if total + incoming <= high:
            return
        for ident in sorted(self._segments):
            if total + incoming <= low:
                break
            seg = self._segments[ident]
            if seg is self._active:
                continue
            for key in seg.keys:
                loc = self._index.get(key)
                if loc is not None and loc.segment == ident:
                    del self._index[key]
            total -= seg.size
            del self._segments[ident]
            os.close(seg.fd)
            os.unlink(seg.path)

    def put_many(self, items: Sequence[tuple[str, int, int]]) -> list[bool]:
        """Append ``(key, ptr, size)`` records; a key already present is kept (first write wins).

        Returns one bool per item. Records become visible together once written (and, strict,
        fsynced); a record that does not fit the tier at all is refused.
        """
        if self.read_only:
            return [False] * len(items)
        out = [False] * len(items)
        jobs: list[tuple[int, str, bytes, int, int, _Segment, int]] = []
        with self._lock:
            seen: set[str] = set()
            for i, (key, ptr, size) in enumerate(items):
                if key in self._index or key in seen:
                    out[i] = True
                    continue
                kb = key.encode()
                rec = HEADER_SIZE + len(kb) + size
                if rec > self.cfg.segment_size_bytes and rec > self.capacity * self.cfg.high_watermark:
                    continue
                self._evict_for(rec)
                seg, off = self._reserve(rec)
                jobs.append((i, key, kb, ptr, size, seg, off))
                seen.add(key)
            self._writing += len(jobs)

        def write(job: tuple[int, str, bytes, int, int, _Segment, int]) -> tuple[int, int] | None:
            i, _key, kb, ptr, size, seg, off = job
            data = _view(ptr, size)
            crc = zlib.crc32(data, zlib.crc32(kb))
            parts: list[bytes | memoryview] = [encode_header(kb, size, crc), kb, data]
            want = HEADER_SIZE + len(kb) + size
            done = os.pwritev(seg.fd, parts, off)
            while done < want:  # short write: finish it
                flat = b"".join(bytes(p) for p in parts)
                done += os.pwrite(seg.fd, flat[done:], off + done)
            return i, crc

        try:
            results = list(self._pool.map(write, jobs)) if len(jobs) > 1 else [write(j) for j in jobs]
            if self.strict and jobs:
                for fd in {j[5].fd for j in jobs}:
                    os.fsync(fd)
        except OSError as e:
            log.error("UMBP SSD tier: write failed (%s); the batch's records stay invisible", e)
            with self._lock:
                self._writing -= len(jobs)
            return out
        with self._lock:
            for job, res in zip(jobs, results, strict=True):
                i, key, kb, _ptr, size, seg, off = job
                assert res is not None
                if seg.ident in self._segments:  # not evicted meanwhile
                    self._index_record(key, _Loc(seg.ident, off, size, res[1], len(kb)), seg)
                    out[i] = True
            self._writing -= len(jobs)
        return out

    # -- reads -----------------------------------------------------------------------------------

    def _read_into(self, key: str, loc: _Loc, ptr: int, size: int, offset: int = 0) -> bool:
        seg = self._segments.get(loc.segment)
        if seg is None:
            return False
        base = loc.offset + HEADER_SIZE + loc.key_len
        if offset == 0 and size == loc.size:
            view = _view(ptr, size)
            got = os.preadv(seg.fd, [view], base)
            if got != size:
                return False
            ok = zlib.crc32(view, zlib.crc32(key.encode())) == loc.data_crc
        else:  # a range: the checksum covers the whole record, so read it all into a bounce buffer
            whole = os.pread(seg.fd, loc.size, base)
            ok = len(whole) == loc.size and zlib.crc32(whole, zlib.crc32(key.encode())) == loc.data_crc
            if ok:
                ctypes.memmove(ptr, whole[offset : offset + size], size)
        if not ok:
            self.dropped_records += 1
            log.error("UMBP SSD tier: record of %r in %s fails its checksum; not served", key, seg.path)
            with self._lock:
                if self._index.get(key) is loc:
                    del self._index[key]
                    self._forget(key, loc)
        return ok

    def get(self, key: str, ptr: int, size: int) -> bool:
        loc = self._index.get(key)
        if loc is None or loc.size != size:
            return False
        return self._read_into(key, loc, ptr, size)

    def get_range(self, key: str, ptr: int, size: int, offset: int) -> bool:
        loc = self._index.get(key)
        if loc is None or offset < 0 or size <= 0 or offset + size > loc.size:
            return False
        return self._read_into(key, loc, ptr, size, offset)

    def get_many(self, items: Sequence[tuple[str, int, int]]) -> list[bool]:
        if len(items) <= 1:
            return [self.get(*it) for it in items]
        # ask the kernel for every record of the batch at once (asynchronous readahead), then read
        for key, _ptr, _size in items:
            loc = self._index.get(key)
            seg = self._segments.get(loc.segment) if loc is not None else None
            if loc is not None and seg is not None:
                os.posix_fadvise(
                    seg.fd, loc.offset, HEADER_SIZE + loc.key_len + loc.size, os.POSIX_FADV_WILLNEED
                )
        return list(self._pool.map(lambda it: self.get(*it), items))

    # -- whole-tier ------------------------------------------------------------------------------

    def flush(self) -> None:
        with self._lock:
            fds = [s.fd for s in self._segments.values()]
        if not self.read_only:
            for fd in fds:
                os.fsync(fd)

    def clear(self) -> None:
        with self._lock:
            self._index.clear()
            if self.read_only:
                return
            for seg in self._segments.values():
                os.close(seg.fd)
                os.unlink(seg.path)
            self._segments.clear()
            self._active = None

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            for seg in self._segments.values():
                os.close(seg.fd)
            self._segments.clear()
            self._index.clear()
            self._active = None

"""``UMBPClient``: the data plane. Put and get KV-cache blocks by key from raw pointers.

Keys are strings; values are byte ranges of the caller's memory (``ptr``, ``size`` in bytes).
A put copies the bytes into the DRAM tier (evicting least recently used objects to the SSD tier
when DRAM passes its high watermark) and makes the key visible only once every byte is in;
a second put of a key that exists keeps the first value and reports success (first write wins).
A get copies the bytes into the caller's memory from DRAM, else from SSD (and promotes the
object back to DRAM), else, in distributed mode, from the peer the master routes it to.

Every call is host-blocking and thread-safe; copies run with the GIL released. Pointers are
trusted as the original trusts them: a pointer that is not ``size`` bytes of mapped memory
crashes the process, as ``memcpy`` would.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from mori.umbp.config import UMBPConfig, UMBPDeploymentMode, UMBPRole, UMBPTierType
from mori.umbp.dram import DramEntry, DramTier
from mori.umbp.errors import UMBPError, UMBPUnsupportedError, bad_arg
from mori.umbp.ssd import MAX_KEY_BYTES, SsdTier

log = logging.getLogger("mori.umbp")

_memmove = ctypes.memmove


def check_key(func: str, key: Any) -> str:
    if not isinstance(key, str) or not key or len(key.encode()) > MAX_KEY_BYTES:
        raise bad_arg(func, "key", key, f"a non-empty str of at most {MAX_KEY_BYTES} UTF-8 bytes")
    return key


def _check_ptr(func: str, name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise bad_arg(func, name, v, "an address: an int > 0")
    return v


def _check_size(func: str, name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise bad_arg(func, name, v, "a size in bytes: an int > 0")
    return v


def _check_lists(func: str, **lists: Any) -> int:
    n: int | None = None
    for name, value in lists.items():
        if not isinstance(value, (list, tuple)):
            try:
                value = list(value)
            except TypeError:
                raise bad_arg(func, name, value, "a list") from None
        if n is None:
            n = len(value)
        elif len(value) != n:
            raise bad_arg(func, name, f"<{len(value)} items>", f"{n} items, one per key")
    return n or 0


class UMBPClient:
    """The UMBP data plane (the original's ``mori.umbp.UMBPClient``).

    ``config.distributed`` set: this client also registers with the master at
    ``master_config.master_address`` (raising :class:`mori.umbp.errors.UMBPUnavailableError`, a
    RuntimeError, if it cannot), reports what it holds, serves its blocks to peers over mori-io
    and fetches theirs. Close it with :meth:`close` (or a ``with`` block).
    """

    def __init__(self, config: UMBPConfig) -> None:
        if not isinstance(config, UMBPConfig):
            raise bad_arg("UMBPClient", "config", config, "a UMBPConfig")
        config.validate()
        if config.standalone_process is not None:
            raise UMBPUnsupportedError(
                "UMBPClient: standalone-process mode (config.standalone_process) is not in this build; "
                "run each engine process with its own local tiers, or use distributed mode"
            )
        if config.backend_policy_path:
            raise UMBPUnsupportedError(
                "UMBPClient: backend_policy_path (the standalone server's JSON tier policy) is not in this "
                "build; configure the tiers through config.dram and config.ssd"
            )
        self.config = config
        self.role = config.resolve_role()
        self._closed = False
        self._dram = DramTier(config.dram, config.eviction.candidate_window)
        self._hbm: Any = None
        self._ssd: SsdTier | None = None
        self._copy_q: queue.Queue[str | None] | None = None
        self._copy_threads: list[threading.Thread] = []
        self._inflight = 0
        self._registered: dict[int, int] = {}  # ptr -> size
        try:
            if config.hbm.capacity_bytes > 0:
                from mori.umbp.hbm import HbmTier

                self._hbm = HbmTier(config.hbm, config.eviction.candidate_window)
            if config.ssd.enabled:
                self._ssd = SsdTier(config.ssd, read_only=self.role == UMBPRole.SharedSSDFollower)
            if (
                self.role == UMBPRole.SharedSSDLeader
                and self._ssd is not None
                and config.copy_pipeline.async_enabled
            ):
                self._copy_q = queue.Queue(maxsize=config.copy_pipeline.queue_depth)
                for i in range(config.copy_pipeline.worker_threads):
                    t = threading.Thread(target=self._copy_worker, name=f"umbp-copy-{i}", daemon=True)
                    t.start()
                    self._copy_threads.append(t)
            self._node: Any = None
            if config.distributed is not None:
                from mori.umbp.distributed import DistributedNode

                self._node = DistributedNode(self, config.distributed)
        except BaseException:
            self._release()
            raise

    # -- lifecycle ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Flush, leave the master (distributed), free the tiers. A second call does nothing."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._release()

    def _release(self) -> None:
        self._closed = True
        if self._copy_q is not None:
            for _ in self._copy_threads:
                self._copy_q.put(None)
            for t in self._copy_threads:
                t.join(timeout=30)
        node = getattr(self, "_node", None)
        if node is not None:
            node.close()
            self._node = None
        if self._ssd is not None:
            self._ssd.close()
        if self._hbm is not None:
            self._hbm.close()
        self._dram.close()

    def __enter__(self) -> UMBPClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # the original's binding closes the client on destruction
        try:
            if not self._closed:
                self.close()
        except Exception:
            pass

    def _copy(self, dst: int, src: int, n: int) -> None:
        """Copy between the caller's memory and a host tier. With an HBM tier the caller's pointers
        may be device memory, so the device runtime copies (it handles host and device alike)."""
        if self._hbm is not None:
            self._hbm.copy(dst, src, n)
        else:
            _memmove(dst, src, n)

    def _check_open(self, func: str) -> None:
        if self._closed:
            raise UMBPError(f"UMBPClient.{func}: the client is closed")

    def is_distributed(self) -> bool:
        return self._node is not None

    def get_deployment_mode(self) -> UMBPDeploymentMode:
        return UMBPDeploymentMode.Distributed if self._node is not None else UMBPDeploymentMode.Local

    # -- eviction / copies ---------------------------------------------------------------------------

    def _demote(self, key: str, e: DramEntry) -> None:
        """Called (DRAM lock held) for an object leaving DRAM: keep it on SSD when there is one."""
        if self._ssd is not None and not self._ssd.read_only and not self._ssd.exists(key):
            self._ssd.put_many([(key, self._dram.base + e.offset, e.size)])
        if self._node is not None:
            self._node.on_evicted(key, e.size, on_ssd=self._ssd is not None and self._ssd.exists(key))

    def _demote_hbm(self, key: str, e: DramEntry) -> None:
        """Called (HBM lock held) for an object leaving HBM: it moves down to DRAM."""
        dram = self._dram
        with dram.lock:
            if self._dram.lookup(key) is not None or dram.is_reserved(key):
                return
            entry = dram.reserve(key, e.size, e.depth, self._demote)
        if entry is None:
            if self._ssd is not None and not self._ssd.read_only:
                staging = ctypes.create_string_buffer(e.size)
                self._hbm.copy(ctypes.addressof(staging), self._hbm.base + e.offset, e.size)
                self._ssd.put_many([(key, ctypes.addressof(staging), e.size)])
            return
        self._hbm.copy(dram.base + entry.offset, self._hbm.base + e.offset, e.size)
        with dram.lock:
            dram.commit(key)
        if self._node is not None:
            self._node.on_evicted(key, e.size, on_ssd=False, tier=UMBPTierType.HBM)
            self._node.on_stored(key, e.size)

    def _copy_worker(self) -> None:
        assert self._copy_q is not None
        while (key := self._copy_q.get()) is not None:
            try:
                self._copy_to_ssd(key)
            finally:
                with self._dram.lock:
                    self._inflight -= 1
                    self._dram.lock.notify_all()

    def _copy_to_ssd(self, key: str) -> None:
        with self._dram.lock:
            e = self._dram.lookup(key)
            if e is None or self._ssd is None:
                return
            e.pins += 1
        try:
            self._ssd.put_many([(key, self._dram.base + e.offset, e.size)])
        finally:
            with self._dram.lock:
                e.pins -= 1

    def _after_commit(self, key: str, size: int) -> None:
        if self.role == UMBPRole.SharedSSDLeader and self._ssd is not None:
            if self._copy_q is not None:
                with self._dram.lock:
                    self._inflight += 1
                try:
                    self._copy_q.put_nowait(key)
                    return
                except queue.Full:
                    with self._dram.lock:
                        self._inflight -= 1
            self._copy_to_ssd(key)
        if self._node is not None:
            self._node.on_stored(key, size)

    # -- puts ------------------------------------------------------------------------------------------

    def _exists_locally(self, key: str) -> bool:
        if self._dram.lookup(key) is not None or (self._ssd is not None and self._ssd.exists(key)):
            return True
        return self._hbm is not None and self._hbm.lookup(key) is not None

    def _put_hbm(self, key: str, ptr: int, size: int, depth: int) -> bool | None:
        """Put into the HBM tier; None when the object does not fit there (the caller goes on to DRAM)."""
        hbm = self._hbm
        while True:
            with self._dram.lock:
                if self._exists_locally(key):
                    return True
            with hbm.lock:
                if hbm.lookup(key) is not None:
                    return True
                if hbm.is_reserved(key):
                    hbm.lock.wait(timeout=1.0)
                    continue
                entry = hbm.reserve(key, size, depth, self._demote_hbm)
            break
        if entry is None:
            return None
        try:
            hbm.copy(hbm.base + entry.offset, ptr, size)
        except BaseException:
            with hbm.lock:
                hbm.abort(key)
            raise
        with hbm.lock:
            hbm.commit(key)
        if self._node is not None:
            self._node.on_stored(key, size, tier=UMBPTierType.HBM)
        return True

    def _put(self, key: str, ptr: int, size: int, depth: int) -> bool:
        if self._hbm is not None and self.role != UMBPRole.SharedSSDFollower:
            done = self._put_hbm(key, ptr, size, depth)
            if done is not None:
                return done
        dram = self._dram
        while True:
            with dram.lock:
                if self._exists_locally(key):
                    dram.touch(key)
                    return True
                if dram.is_reserved(key):  # another thread is writing it: its result is ours
                    dram.lock.wait(timeout=1.0)
                    continue
                if self.role == UMBPRole.SharedSSDFollower:
                    return False  # followers never write; the leader stores for them
                entry = dram.reserve(key, size, depth, self._demote)
            break
        if entry is None:  # larger than the DRAM tier: straight to SSD, if any
            if self._ssd is None:
                return False
            ok = self._ssd.put_many([(key, ptr, size)])[0]
            if ok and self._node is not None:
                self._node.on_stored(key, size, tier=UMBPTierType.SSD)
            return ok
        try:
            self._copy(dram.base + entry.offset, ptr, size)
        except BaseException:
            with dram.lock:
                dram.abort(key)
            raise
        with dram.lock:
            dram.commit(key)
        self._after_commit(key, size)
        return True

    def put_from_ptr(self, key: str, ptr: int, size: int) -> bool:
        """Store ``size`` bytes at ``ptr`` under ``key``; True if stored or already present."""
        f = "UMBPClient.put_from_ptr"
        self._check_open("put_from_ptr")
        return self._put(check_key(f, key), _check_ptr(f, "ptr", ptr), _check_size(f, "size", size), -1)

    def batch_put_from_ptr(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[bool]:
        """One :meth:`put_from_ptr` per key; one bool per key."""
        return self.batch_put_from_ptr_with_depth(keys, ptrs, sizes, None)

    def batch_put_from_ptr_with_depth(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int], depths: Sequence[int] | None
    ) -> list[bool]:
        """As :meth:`batch_put_from_ptr`; ``depths[i]`` is the block's depth in its prefix (0 = first
        block): among the least recently used objects, deeper ones are evicted first."""
        f = (
            "UMBPClient.batch_put_from_ptr_with_depth"
            if depths is not None
            else "UMBPClient.batch_put_from_ptr"
        )
        self._check_open("batch_put_from_ptr")
        if depths is None:
            n = _check_lists(f, keys=keys, ptrs=ptrs, sizes=sizes)
            depths = [-1] * n
        else:
            n = _check_lists(f, keys=keys, ptrs=ptrs, sizes=sizes, depths=depths)
        items = [
            (check_key(f, k), _check_ptr(f, "ptrs[i]", p), _check_size(f, "sizes[i]", s), int(d))
            for k, p, s, d in zip(keys, ptrs, sizes, depths, strict=True)
        ]
        out = [self._put(k, p, s, d) for k, p, s, d in items]
        if self._node is not None:
            self._node.maybe_flush_events()
        return out

    def batch_put_ranges_from_ptr(
        self,
        keys: Sequence[str],
        total_sizes: Sequence[int],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        offsets: Sequence[Sequence[int]],
    ) -> list[bool]:
        """Store objects gathered from pieces: object ``i`` has ``total_sizes[i]`` bytes and piece
        ``j`` of it is ``sizes[i][j]`` bytes at ``ptrs[i][j]``, placed at ``offsets[i][j]``. The
        pieces must cover the object exactly once. A ragged call (inner lists of unequal
        lengths) fails whole: every result False."""
        f = "UMBPClient.batch_put_ranges_from_ptr"
        self._check_open("batch_put_ranges_from_ptr")
        n = _check_lists(f, keys=keys, total_sizes=total_sizes, ptrs=ptrs, sizes=sizes, offsets=offsets)
        if any(not (len(p) == len(s) == len(o)) for p, s, o in zip(ptrs, sizes, offsets, strict=True)):
            return [False] * n
        out = []
        for key, total, ps, ss, os_ in zip(keys, total_sizes, ptrs, sizes, offsets, strict=True):
            check_key(f, key)
            _check_size(f, "total_sizes[i]", total)
            pieces = sorted(zip(os_, ss, ps, strict=True))
            pos, ok = 0, True
            for off, size, ptr in pieces:
                _check_ptr(f, "ptrs[i][j]", ptr)
                _check_size(f, "sizes[i][j]", size)
                if off != pos:
                    ok = False
                pos = off + size
            if not ok or pos != total:
                out.append(False)
                continue
            out.append(self._put_gathered(key, total, pieces))
        return out

    def _put_gathered(self, key: str, total: int, pieces: list[tuple[int, int, int]]) -> bool:
        staging = ctypes.create_string_buffer(total) if total > self._dram.capacity else None
        if staging is not None:
            for off, size, ptr in pieces:
                self._copy(ctypes.addressof(staging) + off, ptr, size)
            return self._put(key, ctypes.addressof(staging), total, -1)
        dram = self._dram
        while True:
            with dram.lock:
                if self._exists_locally(key):
                    return True
                if dram.is_reserved(key):
                    dram.lock.wait(timeout=1.0)
                    continue
                if self.role == UMBPRole.SharedSSDFollower:
                    return False
                entry = dram.reserve(key, total, -1, self._demote)
                if entry is None:
                    return False
            break
        for off, size, ptr in pieces:
            self._copy(dram.base + entry.offset + off, ptr, size)
        with dram.lock:
            dram.commit(key)
        self._after_commit(key, total)
        return True

    # -- gets ------------------------------------------------------------------------------------------

    @staticmethod
    def _read_pinned(
        tier: Any, copy: Callable[[int, int, int], object], key: str, ptr: int, size: int, offset: int
    ) -> bool | None:
        """Copy ``key`` (or its range at ``offset``) out of a memory tier (HBM or DRAM) with
        ``copy(dst, src, size)``, the entry pinned during the copy so that eviction leaves it: True;
        False for a size or range the object does not have; None if the tier does not hold it."""
        with tier.lock:
            e = tier.lookup(key)
            if e is None:
                return None
            if (offset < 0 and e.size != size) or (offset >= 0 and offset + size > e.size):
                return False
            e.pins += 1
            tier.touch(key)
        try:
            copy(ptr, tier.base + e.offset + max(offset, 0), size)
        finally:
            with tier.lock:
                e.pins -= 1
        return True

    def _get(self, key: str, ptr: int, size: int, offset: int = -1, *, local_only: bool = False) -> bool:
        """``offset`` -1: the whole object (``size`` must equal its size); else a byte range of it.
        ``local_only``: never ask a peer (a peer's own Resolve must not start a fetch of its own)."""
        hbm = self._hbm
        if hbm is not None:
            got = self._read_pinned(hbm, hbm.copy, key, ptr, size, offset)
            if got is not None:
                return got
        got = self._read_pinned(self._dram, self._copy, key, ptr, size, offset)
        if got is not None:
            return got
        ssd = self._ssd
        if ssd is not None:
            # with an HBM tier ``ptr`` may be device memory, which the kernel cannot read a file into
            bounce = ctypes.create_string_buffer(size) if self._hbm is not None else None
            dst = ctypes.addressof(bounce) if bounce is not None else ptr
            ok = ssd.get(key, dst, size) if offset < 0 else ssd.get_range(key, dst, size, offset)
            if not ok and ssd.read_only:
                ssd.refresh()  # a follower: the leader may have stored it since
                ok = ssd.get(key, dst, size) if offset < 0 else ssd.get_range(key, dst, size, offset)
            if ok:
                if bounce is not None:
                    self._copy(ptr, dst, size)
                if offset < 0 and self.config.eviction.auto_promote_on_read:
                    self._promote(key, dst, size)
                return True
        if self._node is not None and not local_only:
            return bool(self._node.fetch(key, ptr, size, max(offset, 0), whole=offset < 0))
        return False

    def _promote(self, key: str, ptr: int, size: int) -> None:
        """Copy an object just read from SSD (now at ``ptr``) back into DRAM."""
        dram = self._dram
        with dram.lock:
            if dram.lookup(key) is not None or dram.is_reserved(key):
                return
            entry = dram.reserve(key, size, -1, self._demote)
            if entry is None:
                return
        self._copy(dram.base + entry.offset, ptr, size)
        with dram.lock:
            dram.commit(key)
        if self._node is not None:
            self._node.on_stored(key, size)

    def get_into_ptr(self, key: str, ptr: int, size: int) -> bool:
        """Copy the object ``key`` (exactly ``size`` bytes) to ``ptr``; False if absent or of another size."""
        f = "UMBPClient.get_into_ptr"
        self._check_open("get_into_ptr")
        return self._get(check_key(f, key), _check_ptr(f, "ptr", ptr), _check_size(f, "size", size))

    def batch_get_into_ptr(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[bool]:
        f = "UMBPClient.batch_get_into_ptr"
        self._check_open("batch_get_into_ptr")
        _check_lists(f, keys=keys, ptrs=ptrs, sizes=sizes)
        items = [
            (check_key(f, k), _check_ptr(f, "ptrs[i]", p), _check_size(f, "sizes[i]", s))
            for k, p, s in zip(keys, ptrs, sizes, strict=True)
        ]
        return [self._get(k, p, s) for k, p, s in items]

    def batch_get_ranges_into_ptr(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        offsets: Sequence[Sequence[int]],
    ) -> list[bool]:
        """Scatter byte ranges of stored objects: piece ``j`` of key ``i`` is ``sizes[i][j]`` bytes
        from offset ``offsets[i][j]`` of the object into ``ptrs[i][j]``. A ragged call fails whole."""
        f = "UMBPClient.batch_get_ranges_into_ptr"
        self._check_open("batch_get_ranges_into_ptr")
        n = _check_lists(f, keys=keys, ptrs=ptrs, sizes=sizes, offsets=offsets)
        if any(not (len(p) == len(s) == len(o)) for p, s, o in zip(ptrs, sizes, offsets, strict=True)):
            return [False] * n
        out = []
        for key, ps, ss, os_ in zip(keys, ptrs, sizes, offsets, strict=True):
            check_key(f, key)
            ok = True
            for p, s, o in zip(ps, ss, os_, strict=True):
                _check_ptr(f, "ptrs[i][j]", p)
                _check_size(f, "sizes[i][j]", s)
                if isinstance(o, bool) or not isinstance(o, int) or o < 0:
                    raise bad_arg(f, "offsets[i][j]", o, "an int >= 0")
                if not self._get(key, p, s, o):
                    ok = False
                    break
            out.append(ok)
        return out

    # -- existence -------------------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        check_key("UMBPClient.exists", key)
        self._check_open("exists")
        return self.batch_exists([key])[0]

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        f = "UMBPClient.batch_exists"
        self._check_open("batch_exists")
        keys = [check_key(f, k) for k in keys]
        with self._dram.lock:
            out = [self._exists_locally(k) for k in keys]
        if self._ssd is not None and self._ssd.read_only and not all(out):
            self._ssd.refresh()
            out = [o or self._ssd.exists(k) for o, k in zip(out, keys, strict=True)]
        if self._node is not None and not all(out):
            missing = [k for k, o in zip(keys, out, strict=True) if not o]
            remote = dict(zip(missing, self._node.lookup(missing), strict=True))
            out = [o or remote[k] for k, o in zip(keys, out, strict=True)]
        return out

    def batch_exists_consecutive(self, keys: Sequence[str]) -> int:
        """How many keys from the start exist (the length of the leading run of hits)."""
        hits = self.batch_exists(keys)
        return hits.index(False) if False in hits else len(hits)

    # -- whole-client ------------------------------------------------------------------------------

    def clear(self) -> bool:
        """Drop every object of this client (DRAM, SSD unless a follower) and, in distributed mode,
        everything the master knows of this node, external-KV entries included."""
        self._check_open("clear")
        self._drain_copies()
        with self._dram.lock:
            keys = self._dram.keys()
            self._dram.clear()
        if self._hbm is not None:
            with self._hbm.lock:
                keys += self._hbm.keys()
                self._hbm.clear()
        if self._ssd is not None:
            self._ssd.clear()
        if self._node is not None:
            self._node.on_cleared(keys)
        return True

    def _drain_copies(self) -> None:
        with self._dram.lock:
            while self._inflight:
                self._dram.lock.wait(timeout=1.0)

    def flush(self) -> bool:
        """Finish pending SSD copies, make the SSD tier durable, ship pending events to the master."""
        self._check_open("flush")
        self._drain_copies()
        if self._ssd is not None:
            self._ssd.flush()
        if self._node is not None:
            self._node.flush()
        return True

    # -- memory registration -------------------------------------------------------------------------

    def register_memory(self, ptr: int, size: int) -> bool:
        """Register caller memory for zero-copy transfers with peers (distributed mode). Local mode
        needs none and returns True."""
        f = "UMBPClient.register_memory"
        self._check_open("register_memory")
        _check_ptr(f, "ptr", ptr)
        _check_size(f, "size", size)
        if self._node is not None and not self._node.register_memory(ptr, size):
            return False
        self._registered[ptr] = size
        return True

    def deregister_memory(self, ptr: int) -> bool:
        self._check_open("deregister_memory")
        if self._registered.pop(ptr, None) is None:
            return False
        if self._node is not None:
            self._node.deregister_memory(ptr)
        return True

    # -- external KV index (own node) ----------------------------------------------------------------

    def report_external_kv_blocks(self, hashes: Sequence[str], tier: UMBPTierType) -> bool:
        """Tell the master this node holds ``hashes`` at ``tier`` (an engine's own cache). False in
        local mode or when the master cannot be reached; empty ``hashes`` does nothing, True."""
        if self._node is None:
            return False
        return bool(self._node.external("report", list(hashes), tier))

    def revoke_external_kv_blocks(self, hashes: Sequence[str], tier: UMBPTierType) -> bool:
        if self._node is None:
            return False
        return bool(self._node.external("revoke", list(hashes), tier))

    def revoke_all_external_kv_blocks_at_tier(self, tier: UMBPTierType) -> bool:
        if self._node is None:
            return False
        return bool(self._node.external("revoke_all", [], tier))

    def match_external_kv(self, hashes: Sequence[str], count_as_hit: bool = False) -> list[Any]:
        """The master's :meth:`mori.umbp.UMBPMasterClient.match_external_kv`; [] in local mode or on errors."""
        if self._node is None:
            return []
        return list(self._node.match_external_kv(list(hashes), count_as_hit))

    def get_external_kv_hit_counts(self, hashes: Sequence[str]) -> list[Any]:
        if self._node is None:
            return []
        return list(self._node.get_external_kv_hit_counts(list(hashes)))

    # -- introspection ---------------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Object counts and bytes per tier."""
        with self._dram.lock:
            out = {"dram_objects": len(self._dram), "dram_used_bytes": self._dram.used_bytes()}
        if self._hbm is not None:
            with self._hbm.lock:
                out["hbm_objects"] = len(self._hbm)
                out["hbm_used_bytes"] = self._hbm.used_bytes()
        if self._ssd is not None:
            out["ssd_objects"] = len(self._ssd)
            out["ssd_file_bytes"] = self._ssd.file_bytes()
            out["ssd_dropped_records"] = self._ssd.dropped_records
        return out

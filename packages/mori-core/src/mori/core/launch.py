"""Run a function on N local ranks (processes): the launcher behind ``mori demo``, ``mori bench``
and the multi-rank tests.

Ranks are fresh processes from a forkserver whose parent has already imported torch, so starting
eight ranks costs well under a second. Functions passed in must be importable (module level).
The first rank error is re-raised with that rank's traceback; a rank that does not finish in time
is killed and named.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from mori.core.errors import MoriError

_CTX: Any = None


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "mori.shmem"])
    return _CTX


class RankError(MoriError):
    """A rank raised: the message holds the rank number and its traceback."""


def _entry(
    fn: Callable[..., Any], rank: int, nranks: int, args: tuple[Any, ...], env: Mapping[str, str], out: Any
) -> None:
    os.environ.update(env)
    try:
        out.put((rank, True, fn(rank, nranks, *args)))
    except BaseException as e:  # report everything, including SystemExit from a rank
        out.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_ranks(
    fn: Callable[..., Any],
    nranks: int,
    *args: Any,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, nranks, *args)`` on ``nranks`` processes; return results in rank order.

    Raises :class:`RankError` with the first failing rank's traceback, or :class:`TimeoutError`
    naming the ranks that had not finished after ``timeout`` seconds (all ranks are then killed).
    """
    ctx = _context()
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=_entry, args=(fn, r, nranks, args, dict(env or {}), out), name=f"rank{r}", daemon=True
        )
        for r in range(nranks)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    # After the first failure the others get a short grace to report theirs, then all are killed:
    # peers of a failed rank usually block on it.
    first_failure_at: float | None = None
    try:
        while len(results) + len(failures) < nranks:
            try:
                rank, ok, value = out.get(timeout=0.1)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if p.exitcode not in (None, 0) and r not in results and r not in failures:
                        failures[r] = f"process exited with code {p.exitcode} before reporting"
                now = time.monotonic()
                if failures and first_failure_at is None:
                    first_failure_at = now
                if first_failure_at is not None and now > first_failure_at + 10.0:
                    break
                if now > deadline:
                    missing = [r for r in range(nranks) if r not in results and r not in failures]
                    raise TimeoutError(
                        f"ranks {missing} of {nranks} did not finish within {timeout:g} s"
                    ) from None
                continue
            if ok:
                results[rank] = value
            else:
                failures.setdefault(rank, value)
                first_failure_at = first_failure_at or time.monotonic()
    finally:
        for p in procs:
            p.join(timeout=0.5 if failures else 5)
            if p.is_alive():
                p.kill()
                p.join()
            p.close()  # its sentinel pipe, now, not whenever the garbage collector gets to it
        out.close()
        out.join_thread()
    if failures:
        first = min(failures)
        raise RankError(f"rank {first} of {nranks} failed:\n{failures[first]}")
    return [results[r] for r in range(nranks)]


def _shmem_entry(
    rank: int,
    nranks: int,
    uid: bytes,
    heap: str,
    before_init: Callable[[int, int], None] | None,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
) -> Any:
    os.environ.setdefault("MORI_SHMEM_HEAP_SIZE", heap)
    if before_init is not None:
        before_init(rank, nranks)
    import mori.shmem as shmem

    shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, rank, nranks, uid)
    try:
        return fn(rank, nranks, *args)
    finally:
        if shmem.shmem_is_initialized():
            shmem.shmem_finalize()


def shmem_ranks(
    fn: Callable[..., Any],
    nranks: int,
    *args: Any,
    heap: str = "64M",
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    before_init: Callable[[int, int], None] | None = None,
) -> list[Any]:
    """:func:`run_ranks` with mori.shmem initialised (unique-id bootstrap) around ``fn`` on every rank.

    The unique id is made here, in the calling process, which serves the rendezvous store.
    ``heap`` is the per-rank heap size unless ``MORI_SHMEM_HEAP_SIZE`` is set in ``env``.
    ``before_init(rank, nranks)``, if given, runs on each rank first (e.g. to pick its GPU).
    """
    import mori.shmem as shmem

    # Waits inside the job give up well before the launcher does, so the error names the late rank.
    merged = {"MORI_BOOTSTRAP_TIMEOUT": str(max(5, int(timeout / 2))), **(env or {})}
    saved = {k: os.environ.get(k) for k in merged}
    os.environ.update(merged)  # the store's timeout is read here
    try:
        uid = shmem.shmem_get_unique_id()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return run_ranks(_shmem_entry, nranks, uid, heap, before_init, fn, args, timeout=timeout, env=merged)

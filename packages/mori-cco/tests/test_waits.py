"""The host waits of mori.cco.waits: polite (poll, yield, then sleep on a futex) and plain."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from mori.cco import waits
from mori.cco.sdma import host_runtime
from mori.core.backend import OP_SET, WORD_INT64


@pytest.mark.parametrize("polite", [True, False])
@pytest.mark.parametrize("woken", [True, False])
def test_wait_ge_returns_once_a_writer_stores_and_times_out_otherwise(polite: bool, woken: bool) -> None:
    rt = host_runtime()
    word = torch.zeros(1, dtype=torch.int64)
    addr = word.data_ptr()

    def writer() -> None:
        time.sleep(0.02)  # past the polite wait's yielding phase: the waiter sleeps on the futex
        rt.atomic_rmw(addr, OP_SET, WORD_INT64, 5)
        if woken:
            waits.wake(addr)

    t = threading.Thread(target=writer)
    start = time.monotonic()
    t.start()
    ok, seen = waits.wait_ge(rt, addr, 5, 10.0, polite=polite)
    elapsed = time.monotonic() - start
    t.join()
    assert (ok, seen) == (True, 5)
    # a writer that does not wake costs at most one sleep (SLEEP_S) more; 0.5 s is a wide margin
    # for a loaded machine, far below the 10 s a missed store would take
    assert elapsed < 0.5, elapsed
    ok, seen = waits.wait_ge(rt, addr, 6, 0.05, polite=polite)
    assert (ok, seen) == (False, 5)


def test_oversubscribed_compares_ranks_with_usable_cpus() -> None:
    import os

    cpus = len(os.sched_getaffinity(0))
    assert waits.oversubscribed(cpus + 1) and not waits.oversubscribed(cpus)

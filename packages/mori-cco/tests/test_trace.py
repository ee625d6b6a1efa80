"""Traces of mori.ccl's kernels (mori.viz) on CPU ranks under the Triton interpreter: the phases
each program records, the cross-rank order the LSA barriers impose on them, and that a collective
with tracing off records nothing."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from mori.cco import Communicator, UniqueId
from mori.core.errors import MoriStateError
from mori.testing import run_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")

INTERPRET = {"MORI_DEVICE_RUNTIME": "cpu", "MORI_BOOTSTRAP_TIMEOUT": "60", "TRITON_INTERPRET": "1"}
SMALL = 4096  # bytes: the 16 KiB call below takes the large protocol (reduce-scatter + all-gather)
COUNT = 4096
RSAG = ["wait_done", "stage", "ready", "reduce", "ready2", "pull", "done"]


def _traced_allreduce(rank: int, n: int, uid: UniqueId, out_dir: str) -> int:
    import mori.ccl as ccl
    from mori import viz

    with Communicator.init(n, rank, uid, per_rank_vmm=32 << 20) as c:
        ar = ccl.AllreduceSdma(
            rank,
            n,
            dtype=torch.float32,
            comm=c,
            oneshot_max=SMALL,
            transit_buffer_size=1 << 20,
            impl="triton",
        )
        buf = ar.enable_tracing(capacity=64)
        assert ar.trace_buffer is buf and buf.n_rings == ar.ch.programs
        x = torch.full((COUNT,), float(rank + 1))
        out = torch.empty_like(x)
        ar(x, out, COUNT)
        assert ar.last_path == "triton:rsag" and torch.equal(out, torch.full_like(x, n * (n + 1) / 2))
        written = buf.read().written.tolist()
        ar.disable_tracing()
        ar(x, out, COUNT)  # untraced: the buffer keeps what it had
        assert buf.read().written.tolist() == written
        viz.capture([buf], host=False).save(Path(out_dir) / f"rank{rank}.mviz.npz")
        ar.close()
        host = ccl.AllreduceSdma(
            rank, n, dtype=torch.float32, comm=c, transit_buffer_size=1 << 20, impl="host"
        )
        with pytest.raises(MoriStateError, match="impl='triton'"):
            host.enable_tracing()
        host.close()
    return ar.ch.programs


def test_an_allreduce_trace_holds_every_phase_in_barrier_order(tmp_path: Path) -> None:
    from mori import viz
    from mori.viz.timeline import build_timeline

    programs = run_ranks(
        _traced_allreduce, 2, Communicator.get_unique_id(), str(tmp_path), env=INTERPRET, timeout=240
    )[0]
    tl = build_timeline(viz.load_traces(tmp_path))
    phase: dict[tuple[int, int, str], Any] = {}  # (rank, program, slot name) -> span
    for s in tl.spans:
        name, group = tl.slot_label(s.slot)
        assert group == "ccl.allreduce", (name, group)
        track = tl.tracks[s.track]
        assert (track.rank, track.ring, name) not in phase, "one call: each phase once per program"
        phase[(track.rank, track.ring, name)] = s
    assert set(phase) == {(r, k, p) for r in (0, 1) for k in range(programs) for p in [*RSAG, "kernel"]}
    for k in range(programs):
        for me in (0, 1):
            ks = phase[(me, k, "kernel")]
            assert all(
                ks.start_ns <= phase[(me, k, p)].start_ns <= phase[(me, k, p)].end_ns <= ks.end_ns
                for p in RSAG
            )
            for peer in (0, 1):
                # READY(k): nobody reduces before every rank staged its slice k; READY2(k): nobody
                # pulls a sum before its owner finished reducing it
                assert phase[(me, k, "reduce")].start_ns >= phase[(peer, k, "stage")].end_ns
                assert phase[(me, k, "pull")].start_ns >= phase[(peer, k, "reduce")].end_ns

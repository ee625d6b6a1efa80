"""Traced EP kernels (mori.viz) on 2 CPU ranks under the Triton interpreter: the results are the
untraced ones, every program records the protocol's phases in order, only the last program of a
launch records "done" and "receive", an untraced call records nothing, and across ranks a rank's
"receive" ends after every peer's "done" began (its signal is what the receive waits for)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

# (find_spec, not importorskip: spawned ranks import this module before they set TRITON_INTERPRET,
# and Triton chooses the interpreter for its own jitted helpers when it is imported)
if importlib.util.find_spec("triton") is None or importlib.util.find_spec("mori.viz") is None:
    pytest.skip("the traced EP kernels need Triton and mori-viz", allow_module_level=True)

from mori.testing import shmem_ranks

INTERPRET = {"TRITON_INTERPRET": "1"}
TRACED_ROUNDS = 2


def _cases() -> ModuleType:
    """test_dispatch_combine.py (its inputs and checks), loaded by path: tests are not a package."""
    name = "mori_ep_test_dispatch_combine"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).with_name("test_dispatch_combine.py")
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _traced(rank: int, world: int, out_dir: str) -> None:
    import torch

    from mori import viz

    tdc = _cases()
    op = tdc._op("triton", rank, world)
    buf = op.enable_tracing(capacity=1024)
    assert op.trace_buffer is buf and buf.rank == rank
    for it in range(TRACED_ROUNDS):  # _round checks every received row and every combined token
        tdc._round(op, 100 + it, "random", torch.bfloat16, torch.bfloat16)
    op.disable_tracing()
    written = buf.read().written.copy()
    tdc._round(op, 110, "random", torch.bfloat16, torch.bfloat16)
    assert (buf.read().written == written).all(), "an untraced call recorded events"
    viz.capture([buf], host=False, world_size=world).save(Path(out_dir) / f"rank{rank}")


def _spans(tl: Any, group: str) -> list[tuple[int, int, int, str, int, int]]:
    """(rank, ring, launch, phase, start, end) of every span of ``group``."""
    out = []
    for s in tl.spans:
        name, g = tl.slot_label(s.slot)
        if g == group:
            t = tl.tracks[s.track]
            out.append((t.rank, t.ring, s.launch, name, s.start_ns, s.end_ns))
    return out


def test_traced_dispatch_and_combine(tmp_path: Path) -> None:
    from mori import viz
    from mori.viz.timeline import build_timeline

    shmem_ranks(_traced, 2, str(tmp_path), env=INTERPRET, timeout=300)
    traces = viz.load_traces(tmp_path)
    # every begin has its end, in nesting order: nothing dropped, nothing lost
    tl = build_timeline(traces, sanitize_orphans=False)
    assert not tl.dropped and not tl.lost
    dispatch = _spans(tl, "ep.dispatch")
    programs = 3  # _op gives the kernels block_num=3
    # a ring's launch number counts every traced launch of its program (dispatch and combine): the
    # dispatch calls are the launches its dispatch spans carry, in order, the same on both ranks
    calls = {r: sorted({d[2] for d in dispatch if d[0] == r}) for r in (0, 1)}
    assert len(calls[0]) == TRACED_ROUNDS and calls[0] == calls[1]
    for rank in (0, 1):
        mine = [d for d in dispatch if d[0] == rank]
        for phase in ("kernel", "wait_ready", "reserve", "send", "fence"):
            assert sum(d[3] == phase for d in mine) == TRACED_ROUNDS * programs, (rank, phase)
        for phase in ("done", "receive"):  # the last program of each launch only
            got = [d for d in mine if d[3] == phase]
            assert sorted(d[2] for d in got) == calls[rank], (rank, phase)
        # per program and launch, the phases follow each other in protocol order
        for ring in range(programs):
            for launch in calls[rank]:
                seq = sorted(
                    (d[4], d[3]) for d in mine if d[1] == ring and d[2] == launch and d[3] != "kernel"
                )
                names = [n for _, n in seq]
                assert names[:4] == ["wait_ready", "reserve", "send", "fence"], names
    # each call: a rank's receive ends after the peer's done began (the peer's DONE_D signal)
    for rank in (0, 1):
        for launch in calls[rank]:
            (recv,) = [d for d in dispatch if d[0] == rank and d[3] == "receive" and d[2] == launch]
            (peer_done,) = [d for d in dispatch if d[0] == 1 - rank and d[3] == "done" and d[2] == launch]
            assert recv[5] > peer_done[4], (
                f"rank {rank} launch {launch}: receive ended before the peer's done"
            )
    # combine: every program records its phases (push combine, two launches under the interpreter)
    combine = _spans(tl, "ep.combine_push") + _spans(tl, "ep.combine")
    assert {d[3] for d in combine} >= {"kernel", "release"}
    # and the export of it all is valid
    report = viz.export_to_perfetto(traces, tmp_path / "ep.pftrace")
    assert report.spans == len(tl.spans) and report.orphans_dropped == 0

"""Hand-made rank traces for the host-side tests: events exactly as a writer would leave them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from mori.viz import layout
from mori.viz.buffer import EVENT_DTYPE
from mori.viz.clock import ClockPair, HostEpoch
from mori.viz.slots import slot_table
from mori.viz.trace import RankTrace, Source

B, E, INS, N = layout.BEGIN, layout.END, layout.INSTANT, layout.NEXT


#: the default wall-clock epoch of a synthetic trace
EPOCH = HostEpoch(1_700_000_000_000_000_000, 0, 0)


def events(rings: Mapping[int, Sequence[tuple[int, int, int]]], launch: int = 0) -> np.ndarray:
    """``{ring: [(ts, kind, slot), ...]}`` -> EVENT_DTYPE, seq in list order."""
    rows = [
        (ring, seq, ts, kind, slot, 0, launch)
        for ring, evs in sorted(rings.items())
        for seq, (ts, kind, slot) in enumerate(evs)
    ]
    return np.array(rows, dtype=EVENT_DTYPE)


def device_source(
    rings: Mapping[int, Sequence[tuple[int, int, int]]],
    pairs: Sequence[ClockPair] = (ClockPair(0, 0, 0, "same-clock"),),
    *,
    name: str = "dev",
    n_rings: int | None = None,
    nominal_ghz: float = 1.0,
    lost: Sequence[int] | None = None,
) -> Source:
    n = n_rings if n_rings is not None else (max(rings) + 1 if rings else 1)
    return Source(
        name,
        "device",
        [f"program {r}" for r in range(n)],
        events(rings),
        np.array(lost if lost is not None else [0] * n, dtype=np.int64),
        list(pairs),
        nominal_ghz,
        "synthetic",
    )


def rank_trace(
    rank: int,
    sources: Sequence[Source],
    *,
    host_id: str = "host-a",
    epoch: HostEpoch = EPOCH,
    world_size: int = 2,
) -> RankTrace:
    return RankTrace(
        rank,
        world_size,
        host_id.split(":")[0],
        host_id,
        1000 + rank,
        epoch,
        {k: str(v) for k, v in slot_table().items()},
        list(sources),
    )

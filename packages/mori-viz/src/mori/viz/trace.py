"""A rank's trace: everything one process recorded, with what is needed to read it elsewhere.

:func:`capture` takes the device buffers and the host rings of this process and returns a
:class:`RankTrace`: the events of each *source* (a :class:`~mori.viz.buffer.TraceBuffer`, or the
host), the clock pairs that map each device's ticks to the host clock, this process's wall-clock
epoch, and the slot table. :meth:`RankTrace.save` writes it to one ``.npz`` file (no pickles),
which :func:`load_traces` reads back (``mori viz`` works on such files and directories of them).
"""

from __future__ import annotations

import json
import os
import platform
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mori.core.errors import MoriValueError, bad_type, bad_value
from mori.viz.buffer import EVENT_DTYPE, RingData, TraceBuffer
from mori.viz.clock import ClockModel, ClockPair, HostEpoch, host_epoch
from mori.viz.slots import slot_table

__all__ = ["TRACE_SUFFIX", "RankTrace", "Source", "capture", "load_traces"]

#: file name ending of saved rank traces
TRACE_SUFFIX = ".mviz.npz"
FORMAT = "mori.viz.rank-trace/1"
#: most sources (buffers + host) in one rank trace, and tracks in one source
MAX_SOURCES = 64


@dataclass
class Source:
    """The events of one trace buffer (``kind="device"``) or of the host rings (``"host"``).

    ``ring_names[r]`` names ring ``r``'s track; ``events`` are :data:`EVENT_DTYPE` sorted by
    (ring, seq) with timestamps in the source's ticks; ``lost[r]`` counts ring ``r``'s events
    that were overwritten. Device sources map ticks to the host clock through ``clock_pairs``
    (``nominal_ghz``: the trace clock's nominal rate); host sources are on the host clock already.
    """

    name: str
    kind: str
    ring_names: list[str]
    events: np.ndarray
    lost: np.ndarray
    clock_pairs: list[ClockPair] = field(default_factory=list)
    nominal_ghz: float = 1.0
    device: str = ""

    def clock_model(self, override_ghz: float | None = None) -> ClockModel:
        """How this source's ticks map to host ns (``override_ghz``: the device clock's rate,
        instead of the one fitted from the pairs or the nominal one)."""
        if self.kind == "host":
            return ClockModel.identity()
        if not self.clock_pairs:
            raise MoriValueError(
                f"source {self.name!r}: no clock pairs, so its device time cannot be put on the host clock"
            )
        return ClockModel.from_pairs(self.clock_pairs, self.nominal_ghz, override_ghz)


@dataclass
class RankTrace:
    """What one rank recorded (see the module docstring)."""

    rank: int
    world_size: int
    hostname: str
    host_id: str  # hostname + boot id: ranks with the same host_id share CLOCK_MONOTONIC
    pid: int
    epoch: HostEpoch
    slots: dict[int, str]
    sources: list[Source]

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the trace to ``path`` (``.mviz.npz`` is appended if missing); returns the path."""
        out = Path(path)
        if not out.name.endswith(TRACE_SUFFIX):
            out = out.with_name(out.name + TRACE_SUFFIX)
        out.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "format": FORMAT,
            "rank": self.rank,
            "world_size": self.world_size,
            "hostname": self.hostname,
            "host_id": self.host_id,
            "pid": self.pid,
            "epoch": self.epoch.to_json(),
            "slots": {str(k): v for k, v in sorted(self.slots.items())},
            "sources": [
                {
                    "name": s.name,
                    "kind": s.kind,
                    "ring_names": s.ring_names,
                    "clock_pairs": [p.to_json() for p in s.clock_pairs],
                    "nominal_ghz": s.nominal_ghz,
                    "device": s.device,
                }
                for s in self.sources
            ],
        }
        arrays: dict[str, np.ndarray] = {"meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)}
        for i, s in enumerate(self.sources):
            arrays[f"events_{i}"] = s.events
            arrays[f"lost_{i}"] = s.lost.astype(np.int64)
        tmp = out.with_name(out.name + ".tmp")
        with tmp.open("wb") as fh:
            np.savez_compressed(fh, **arrays)  # type: ignore[arg-type,unused-ignore]
        tmp.replace(out)
        return out

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RankTrace:
        """Read a trace written by :meth:`save`. Raises MoriValueError naming the file if it is
        not one (the file is read without unpickling anything)."""
        p = Path(path)
        try:
            with np.load(p, allow_pickle=False) as z:
                meta = json.loads(bytes(z["meta"]).decode())
                if not isinstance(meta, dict) or meta.get("format") != FORMAT:
                    raise MoriValueError(f"{p}: not a mori.viz rank trace ({FORMAT})")
                srcs = meta["sources"]
                if not isinstance(srcs, list) or len(srcs) > MAX_SOURCES:
                    raise MoriValueError(f"{p}: bad source list")
                sources = []
                for i, s in enumerate(srcs):
                    events = z[f"events_{i}"]
                    if events.dtype != EVENT_DTYPE:
                        raise MoriValueError(f"{p}: source {i} events have dtype {events.dtype}")
                    names = [str(n) for n in s["ring_names"]]
                    if events.size and int(events["ring"].max()) >= len(names):
                        raise MoriValueError(f"{p}: source {i} has events of rings it does not name")
                    sources.append(
                        Source(
                            str(s["name"]),
                            str(s["kind"]),
                            names,
                            events,
                            z[f"lost_{i}"].astype(np.int64),
                            [ClockPair.from_json(c) for c in s["clock_pairs"]],
                            float(s["nominal_ghz"]),
                            str(s.get("device", "")),
                        )
                    )
                return cls(
                    int(meta["rank"]),
                    int(meta["world_size"]),
                    str(meta["hostname"]),
                    str(meta["host_id"]),
                    int(meta["pid"]),
                    HostEpoch.from_json(meta["epoch"]),
                    {int(k): str(v) for k, v in meta["slots"].items()},
                    sources,
                )
        except MoriValueError:
            raise
        except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
            raise MoriValueError(f"{p}: cannot read a mori.viz rank trace: {type(e).__name__}: {e}") from e


def _host_id() -> str:
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}:{boot}"


def _device_label(buf: TraceBuffer) -> str:
    if buf.device.type == "cpu":
        return "cpu (Triton interpreter)"
    try:
        import torch

        return f"{torch.cuda.get_device_name(buf.device)} ({buf.device})"
    except Exception:
        return str(buf.device)


def _device_source(buf: TraceBuffer, data: RingData) -> Source:
    return Source(
        buf.name,
        "device",
        [f"program {r}" for r in range(buf.n_rings)],
        data.events,
        data.lost,
        list(buf.clock_pairs),
        buf.nominal_ghz,
        _device_label(buf),
    )


def _host_source(rings: Sequence[Any]) -> Source:
    parts, lost = [], []
    for i, ring in enumerate(rings):
        d = ring.read()
        ev = d.events.copy()
        ev["ring"] = i
        parts.append(ev)
        lost.append(int(d.lost[0]))
    events = np.concatenate(parts) if parts else np.empty(0, dtype=EVENT_DTYPE)
    return Source("host", "host", [r.name for r in rings], events, np.array(lost, dtype=np.int64))


def capture(
    buffers: Iterable[TraceBuffer] = (),
    *,
    host: bool = True,
    rank: int | None = None,
    world_size: int | None = None,
    calibrate: bool = True,
) -> RankTrace:
    """Everything this process recorded: the events of ``buffers`` and, with ``host``, of the
    host rings (the Python threads' of the recording in effect, :func:`mori.viz.record_host`, and
    every native thread's), as a :class:`RankTrace`.

    ``calibrate``: measure one more clock pair per buffer first (so the pairs span the trace).
    ``rank`` / ``world_size``: default the buffers' rank (or ``shmem_mype()``) and
    ``shmem_npes()`` when mori.shmem is initialised, else 0 and 1. The devices must be idle.
    """
    func = "capture"
    bufs = list(buffers)
    for b in bufs:
        if not isinstance(b, TraceBuffer):
            raise bad_type(func, "buffers", b, "TraceBuffer objects")
    if len({b.name for b in bufs}) != len(bufs):
        raise bad_value(func, "buffers", [b.name for b in bufs], "buffers with distinct names")
    if len(bufs) + 1 > MAX_SOURCES:
        raise bad_value(func, "buffers", f"{len(bufs)} buffers", f"at most {MAX_SOURCES - 1}")
    from mori.viz.buffer import _shmem

    shmem = _shmem()
    if rank is None:
        rank = bufs[0].rank if bufs else (int(shmem.shmem_mype()) if shmem is not None else 0)
    if world_size is None:
        world_size = int(shmem.shmem_npes()) if shmem is not None else max(1, rank + 1)
    sources = []
    for b in bufs:
        if calibrate:
            b.calibrate()
        sources.append(_device_source(b, b.read()))
    if host:
        from mori.viz.host import native_rings, recorder

        rec = recorder()
        rings = rec.rings() if rec is not None else native_rings()
        if rings:
            sources.append(_host_source(rings))
    return RankTrace(
        rank,
        world_size,
        socket.gethostname() or platform.node(),
        _host_id(),
        os.getpid(),
        host_epoch(),
        {k: str(v) for k, v in slot_table().items()},
        sources,
    )


def load_traces(paths: Iterable[str | os.PathLike[str]] | str | os.PathLike[str]) -> list[RankTrace]:
    """Read saved rank traces: files, or directories (every ``*.mviz.npz`` in them), sorted by rank."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[Path] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            found = sorted(path.glob(f"*{TRACE_SUFFIX}"))
            if not found:
                raise MoriValueError(f"load_traces: {path} holds no *{TRACE_SUFFIX} file")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise MoriValueError(f"load_traces: {path} does not exist")
    traces = [RankTrace.load(f) for f in files]
    return sorted(traces, key=lambda t: t.rank)


def merge_slots(traces: Sequence[RankTrace], extra: Mapping[int, str] | None = None) -> dict[int, str]:
    """One slot table for several traces (later traces and ``extra`` win on a conflict)."""
    table: dict[int, str] = {}
    for t in traces:
        table.update(t.slots)
    if extra:
        table.update({int(k): str(v) for k, v in extra.items()})
    return table

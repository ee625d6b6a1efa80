"""Trace buffers: the memory that kernels record into, and reading it back.

:class:`TraceBuffer` allocates a buffer (layout: :mod:`mori.viz.layout`) on the device that runs
the kernels and keeps what the host needs to read it: the clock pairs that put its timestamps on
the host clock, the rank, a name. :func:`parse_rings` turns the words of any buffer (a device
buffer copied to the host, or a host ring) into an array of events.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from mori.core.errors import MoriValueError, bad_type, bad_value
from mori.viz import layout
from mori.viz.clock import ClockPair, measure_pair, nominal_ghz

if TYPE_CHECKING:
    import torch

__all__ = ["EVENT_DTYPE", "RingData", "TraceBuffer", "parse_rings"]

#: one parsed event: ring, its index in the ring's history, raw timestamp, and the meta fields
EVENT_DTYPE = np.dtype(
    [
        ("ring", np.uint32),
        ("seq", np.int64),
        ("ts", np.int64),
        ("kind", np.uint8),
        ("slot", np.uint16),
        ("warp", np.uint16),
        ("launch", np.uint32),
    ]
)

#: most bytes one buffer may take
MAX_BUFFER_BYTES = 4 << 30


@dataclass(frozen=True)
class RingData:
    """What :func:`parse_rings` found: the events of every ring, oldest first per ring, and per
    ring how many events were written ever and how many of them were overwritten."""

    events: np.ndarray  # EVENT_DTYPE [n_events], sorted by (ring, seq)
    written: np.ndarray  # int64 [n_rings]
    lost: np.ndarray  # int64 [n_rings]
    capacity: int


def _check_sizes(func: str, n_rings: object, capacity: object) -> tuple[int, int]:
    if isinstance(n_rings, bool) or not isinstance(n_rings, int):
        raise bad_type(func, "n_rings", n_rings, f"an int in [1, {layout.MAX_RINGS}]")
    if not 1 <= n_rings <= layout.MAX_RINGS:
        raise bad_value(func, "n_rings", n_rings, f"an int in [1, {layout.MAX_RINGS}]")
    if isinstance(capacity, bool) or not isinstance(capacity, int):
        raise bad_type(func, "capacity", capacity, "a power of two int")
    if not 2 <= capacity <= layout.MAX_CAPACITY or capacity & (capacity - 1):
        raise bad_value(func, "capacity", capacity, f"a power of two in [2, {layout.MAX_CAPACITY}]")
    nbytes = layout.buffer_words(n_rings, capacity) * 8
    if nbytes > MAX_BUFFER_BYTES:
        raise bad_value(
            func,
            "n_rings * capacity",
            f"{n_rings} * {capacity} ({nbytes} bytes)",
            f"at most {MAX_BUFFER_BYTES >> 30} GiB per buffer",
        )
    return n_rings, capacity


def init_header(words: Any, n_rings: int, capacity: int) -> None:
    """Write the header of a fresh buffer into ``words`` (a torch tensor or numpy array)."""
    words[layout.H_MAGIC] = layout.MAGIC
    words[layout.H_VERSION] = layout.VERSION
    words[layout.H_RINGS] = n_rings
    words[layout.H_CAPACITY] = capacity


def parse_rings(words: np.ndarray, *, what: str = "trace buffer") -> RingData:
    """Parse the int64 words of a trace buffer (see :mod:`mori.viz.layout`).

    Raises :class:`~mori.core.errors.MoriValueError` naming ``what`` if the words are not a trace
    buffer of this layout version (magic, version, sizes) or a ring's count is negative.
    """
    words = np.asarray(words)
    if words.dtype != np.int64 or words.ndim != 1:
        raise MoriValueError(
            f"{what}: expected a 1-D int64 array, got {words.dtype} with shape {words.shape}"
        )
    if words.size < layout.HEADER_WORDS or int(words[layout.H_MAGIC]) != layout.MAGIC:
        raise MoriValueError(f"{what}: not a mori.viz trace buffer (no MORIVIZ1 header)")
    if int(words[layout.H_VERSION]) != layout.VERSION:
        raise MoriValueError(
            f"{what}: layout version {int(words[layout.H_VERSION])}, this mori.viz reads {layout.VERSION}"
        )
    n_rings, capacity = int(words[layout.H_RINGS]), int(words[layout.H_CAPACITY])
    try:
        _check_sizes("parse_rings", n_rings, capacity)
    except MoriValueError as e:
        raise MoriValueError(f"{what}: bad header: {e}") from None
    if words.size != layout.buffer_words(n_rings, capacity):
        raise MoriValueError(
            f"{what}: {words.size} words, but a buffer of {n_rings} rings x {capacity} events has "
            f"{layout.buffer_words(n_rings, capacity)}"
        )
    table = words[layout.HEADER_WORDS : layout.events_offset(n_rings)].reshape(n_rings, layout.RING_WORDS)
    written = table[:, 0].copy()
    if (written < 0).any():
        bad = np.nonzero(written < 0)[0][:8].tolist()
        raise MoriValueError(f"{what}: rings {bad} have negative event counts (corrupted buffer)")
    kept = np.minimum(written, capacity)
    lost = written - kept
    ev = words[layout.events_offset(n_rings) :].reshape(n_rings, capacity, layout.EVENT_WORDS)
    total = int(kept.sum())
    out = np.empty(total, dtype=EVENT_DTYPE)
    if total:
        rings = np.repeat(np.arange(n_rings, dtype=np.int64), kept)
        # index within each ring's kept events: 0..kept-1, then its place in the history
        starts = np.cumsum(kept) - kept
        within = np.arange(total, dtype=np.int64) - np.repeat(starts, kept)
        seq = np.repeat(lost, kept) + within
        pos = seq & (capacity - 1)
        ts = ev[rings, pos, 0]
        meta = ev[rings, pos, 1].view(np.uint64)
        out["ring"] = rings
        out["seq"] = seq
        out["ts"] = ts
        out["kind"] = (meta & np.uint64(3)).astype(np.uint8)
        out["slot"] = ((meta >> np.uint64(layout.SLOT_SHIFT)) & np.uint64(layout.MAX_SLOT)).astype(np.uint16)
        out["warp"] = ((meta >> np.uint64(layout.WARP_SHIFT)) & np.uint64(0xFFFF)).astype(np.uint16)
        out["launch"] = (meta >> np.uint64(layout.LAUNCH_SHIFT)).astype(np.uint32)
    return RingData(out, written, lost, capacity)


def _shmem() -> Any:
    """mori.shmem if it is initialised in this process, else None."""
    import mori.shmem as shmem

    return shmem if shmem.shmem_is_initialized() else None


def _default_device() -> torch.device:
    import torch

    shmem = _shmem()
    if shmem is not None and shmem.shmem_heap_info()["runtime"] == "cpu":
        return torch.device("cpu")
    # the shmem heap's GPU is the current one; without shmem, the current GPU if there is one
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def _default_rank() -> int:
    shmem = _shmem()
    return int(shmem.shmem_mype()) if shmem is not None else 0


class TraceBuffer:
    """A trace buffer on a device: ``n_rings`` rings of ``capacity`` events (16 bytes each).

    Pass :attr:`tensor` to instrumented kernels as their ``trace_ptr`` (with ``TRACE=True``);
    program ``p`` of a launch records into ring ``p`` (programs ``>= n_rings`` record nothing), and
    each ring keeps its newest ``capacity`` events. ``device``: a torch device (default: the
    shmem runtime's heap device when :mod:`mori.shmem` is initialised, else the current GPU, else
    the CPU, for kernels under ``TRITON_INTERPRET=1``). ``rank``: the rank shown in traces
    (default: ``shmem_mype()`` when initialised, else 0). ``name``: the source's name in traces.
    ``calibrate``: measure a clock pair now (:meth:`calibrate`), so that a trace read later has one
    from its start and one from its end.
    Memory: ``16 * n_rings * capacity`` bytes plus a small header; at most 4 GiB.
    """

    def __init__(
        self,
        n_rings: int = 256,
        capacity: int = 4096,
        *,
        device: Any = None,
        rank: int | None = None,
        name: str = "device",
        calibrate: bool = True,
    ) -> None:
        import torch

        func = "TraceBuffer"
        self.n_rings, self.capacity = _check_sizes(func, n_rings, capacity)
        if not isinstance(name, str) or not name or len(name) > 64 or not name.isprintable():
            raise bad_value(func, "name", name, "a printable str of 1 to 64 characters")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
            raise bad_value(func, "rank", rank, "None or an int >= 0")
        self.device = torch.device(device) if device is not None else _default_device()
        self.rank = _default_rank() if rank is None else rank
        self.name = name
        self.nominal_ghz = nominal_ghz(self.device)
        words = torch.zeros(layout.device_words(self.n_rings, self.capacity), dtype=torch.int64)
        init_header(words, self.n_rings, self.capacity)
        #: the buffer, int64 ``[words]``: the ``trace_ptr`` argument of instrumented kernels
        self.tensor = words.to(self.device)
        #: clock pairs measured so far (host clock <-> this device's trace clock), oldest first
        self.clock_pairs: list[ClockPair] = []
        if calibrate:
            self.calibrate()

    def calibrate(self, barrier: Callable[[], object] | None = None) -> ClockPair:
        """Measure a clock pair (:func:`mori.viz.clock.measure_pair`) and keep it.

        ``barrier``: called first, e.g. ``mori.shmem.shmem_barrier_all``, so that every rank
        calibrates at about the same time (collective then). Synchronises the device.
        """
        if barrier is not None:
            barrier()
        pair = measure_pair(self.device)
        self.clock_pairs.append(pair)
        return pair

    def reset(self) -> None:
        """Forget every recorded event (zero the ring table; the device must be idle)."""
        start = layout.HEADER_WORDS
        self.tensor[start : layout.events_offset(self.n_rings)].zero_()

    def words(self) -> np.ndarray:
        """A host copy of the buffer, without the allocation's padding (synchronises with the
        device; :attr:`tensor` is :func:`mori.viz.layout.device_words` long)."""
        n = layout.buffer_words(self.n_rings, self.capacity)
        return np.array(self.tensor[:n].detach().to("cpu").numpy(), dtype=np.int64)

    def read(self) -> RingData:
        """The events recorded so far (see :func:`parse_rings`); the device must be idle."""
        return parse_rings(self.words(), what=f"TraceBuffer {self.name!r}")

    def __repr__(self) -> str:
        return (
            f"TraceBuffer(name={self.name!r}, n_rings={self.n_rings}, capacity={self.capacity}, "
            f"device={self.device}, rank={self.rank})"
        )

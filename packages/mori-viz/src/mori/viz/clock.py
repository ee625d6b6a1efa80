"""Clocks: how device timestamps of every rank land on one timeline.

Three clocks are involved:

* the **trace clock** of a device (:func:`mori.viz.device.timestamp`): ``%globaltimer`` on NVIDIA
  (ns), the 100 MHz wall clock on AMD, ``CLOCK_MONOTONIC`` under the Triton interpreter;
* the **host clock** of a process: ``CLOCK_MONOTONIC`` (``time.monotonic_ns``), which every
  process of one host shares; host spans (Python and native threads) are stamped with it;
* the **wall clock** ``CLOCK_REALTIME``, the only one that several hosts share (as well as NTP or
  PTP keeps them).

A :class:`ClockPair` ties a device's trace clock to the host clock: a trace-clock reading and the
host time at which it was taken, within ``± error_ns``. On a GPU it is measured by *ping*: a
one-program kernel spins on a word in pinned host memory; the host notes its clock, sets the word,
and polls for the kernel's answer (the trace clock, written back to pinned memory), noting its
clock again; the reading was taken between the two host readings. The best of several rounds
(the narrowest bracket, typically 1-3 µs over PCIe) is kept. Where pinned memory cannot be used,
*launch* brackets a whole kernel launch and synchronisation (tens of µs). Under the interpreter
the trace clock *is* the host clock, so the pair is exact (*same-clock*).

A trace keeps pairs taken when its buffer was made, at every :meth:`TraceBuffer.calibrate` (e.g.
right after a barrier, so that all ranks calibrate together) and when it is read; the export maps
device ticks to host time by the line through the first and last pair when they are far enough
apart to measure the device clock's rate better than 100 ppm (AMD's clock rate is known only
nominally, and crystals drift), else by the nominal rate through the best pair. Ranks of one host
then share the host clock; ranks of several hosts are put on the wall clock through a
:class:`HostEpoch` (a ``CLOCK_REALTIME``/``CLOCK_MONOTONIC`` pair) per process.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mori.core.errors import MoriTimeoutError, bad_value

if TYPE_CHECKING:
    import torch

__all__ = [
    "ClockModel",
    "ClockPair",
    "HostEpoch",
    "host_epoch",
    "host_ns",
    "measure_pair",
    "ping_rounds",
]

#: pairs whose brackets add up to less than this fraction of their distance give the rate
RATE_FIT_MAX_ERROR = 1e-4
#: how long one ping round may take before ping is given up for launch brackets
PING_ROUND_TIMEOUT_S = 1.0


def host_ns() -> int:
    """The host clock: ``CLOCK_MONOTONIC`` in ns (the clock host spans and the interpreter use)."""
    return time.monotonic_ns()


@dataclass(frozen=True)
class ClockPair:
    """A trace-clock reading ``ticks`` taken at host time ``host_ns`` ± ``error_ns``."""

    host_ns: int
    ticks: int
    error_ns: int
    method: str  # "same-clock", "ping" or "launch"

    def to_json(self) -> dict[str, Any]:
        return {
            "host_ns": self.host_ns,
            "ticks": self.ticks,
            "error_ns": self.error_ns,
            "method": self.method,
        }

    @classmethod
    def from_json(cls, d: Any) -> ClockPair:
        return cls(int(d["host_ns"]), int(d["ticks"]), int(d["error_ns"]), str(d["method"]))


@dataclass(frozen=True)
class HostEpoch:
    """``CLOCK_REALTIME`` = ``realtime_ns`` when ``CLOCK_MONOTONIC`` = ``monotonic_ns`` (± error_ns)."""

    realtime_ns: int
    monotonic_ns: int
    error_ns: int

    def to_json(self) -> dict[str, Any]:
        return {"realtime_ns": self.realtime_ns, "monotonic_ns": self.monotonic_ns, "error_ns": self.error_ns}

    @classmethod
    def from_json(cls, d: Any) -> HostEpoch:
        return cls(int(d["realtime_ns"]), int(d["monotonic_ns"]), int(d["error_ns"]))


def host_epoch(samples: int = 5) -> HostEpoch:
    """Measure this process's :class:`HostEpoch` (the narrowest of ``samples`` brackets)."""
    best: HostEpoch | None = None
    for _ in range(max(1, samples)):
        m0 = time.monotonic_ns()
        r = time.time_ns()
        m1 = time.monotonic_ns()
        e = HostEpoch(r, (m0 + m1) // 2, (m1 - m0 + 1) // 2)
        if best is None or e.error_ns < best.error_ns:
            best = e
    assert best is not None
    return best


@dataclass(frozen=True)
class ClockModel:
    """Device ticks -> host ns: ``host = host0 + (ticks - ticks0) * ns_per_tick``."""

    host0: int
    ticks0: int
    ns_per_tick: float
    error_ns: int  # bound on the error of a mapped time near the pairs (the pairs' brackets)
    fitted: bool  # whether the rate comes from the pairs (else the nominal or the given one)

    @classmethod
    def identity(cls) -> ClockModel:
        return cls(0, 0, 1.0, 0, False)

    @classmethod
    def from_pairs(
        cls, pairs: Sequence[ClockPair], nominal_ghz: float, override_ghz: float | None = None
    ) -> ClockModel:
        """The mapping for a device with these pairs (see the module docstring)."""
        if not pairs:
            raise bad_value("ClockModel.from_pairs", "pairs", [], "at least one clock pair")
        best = min(pairs, key=lambda p: p.error_ns)
        if override_ghz is not None:
            return cls(best.host_ns, best.ticks, 1.0 / override_ghz, best.error_ns, False)
        first, last = pairs[0], pairs[-1]
        span = last.host_ns - first.host_ns
        if (
            len(pairs) >= 2
            and last.ticks != first.ticks
            and span > 0
            and (first.error_ns + last.error_ns) <= RATE_FIT_MAX_ERROR * span
        ):
            rate = span / (last.ticks - first.ticks)
            # keep the fitted rate only if it is a plausible clock: within 10% of the nominal one
            if abs(rate * nominal_ghz - 1.0) < 0.1:
                return cls(first.host_ns, first.ticks, rate, max(first.error_ns, last.error_ns), True)
        return cls(best.host_ns, best.ticks, 1.0 / nominal_ghz, best.error_ns, False)

    def to_host(self, ticks: Any) -> Any:
        """Host ns of ``ticks`` (an int or an int64 numpy array; the result has the same kind)."""
        import numpy as np

        if isinstance(ticks, np.ndarray):
            delta = (ticks - self.ticks0).astype(np.float64) * self.ns_per_tick
            return self.host0 + np.rint(delta).astype(np.int64)
        return self.host0 + round((int(ticks) - self.ticks0) * self.ns_per_tick)


# -- measuring pairs --------------------------------------------------------------------------------


def _device_kind(device: torch.device) -> str:
    if device.type == "cpu":
        return "cpu"
    import torch

    return "hip" if getattr(torch.version, "hip", None) else "cuda"


def nominal_ghz(device: torch.device) -> float:
    """Nominal rate of the trace clock on ``device``, in ticks per ns."""
    return 0.1 if _device_kind(device) == "hip" else 1.0


def measure_pair(device: torch.device, *, method: str = "auto", samples: int = 8) -> ClockPair:
    """A :class:`ClockPair` for the trace clock of ``device`` (a torch device).

    ``method``: ``"auto"`` (``same-clock`` on the CPU, else ``ping``, falling back to ``launch``),
    or one of those three. Launches small kernels on the current stream of ``device`` and
    synchronises it: not graph-capturable, call it outside captures. Not collective.
    """
    func = "measure_pair"
    if method not in ("auto", "same-clock", "ping", "launch"):
        raise bad_value(func, "method", method, "'auto', 'same-clock', 'ping' or 'launch'")
    if isinstance(samples, bool) or not isinstance(samples, int) or not 1 <= samples <= 64:
        raise bad_value(func, "samples", samples, "an int in [1, 64]")
    kind = _device_kind(device)
    if method == "auto":
        method = "same-clock" if kind == "cpu" else "ping"
    if method == "same-clock":
        if kind != "cpu":
            raise bad_value(
                func, "method", method, f"'ping' or 'launch' on {device}: its clock is not the host's"
            )
        t = host_ns()
        return ClockPair(t, t, 0, "same-clock")
    if method == "ping" and kind != "cpu":
        try:
            return _ping(device, samples)
        except _PingUnavailable:
            pass
    return _launch(device, samples)


class _PingUnavailable(Exception):
    pass


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        import torch

        torch.cuda.synchronize(device)


def _launch(device: torch.device, samples: int) -> ClockPair:
    import torch

    from mori.viz.device import clock_kernel

    out = torch.zeros(1, dtype=torch.int64, device=device)
    clock_kernel[(1,)](out)  # compile and load first
    _sync(device)
    best: ClockPair | None = None
    for _ in range(samples):
        t0 = host_ns()
        clock_kernel[(1,)](out)
        _sync(device)
        t1 = host_ns()
        pair = ClockPair((t0 + t1) // 2, int(out.item()), (t1 - t0 + 1) // 2, "launch")
        if best is None or pair.error_ns < best.error_ns:
            best = pair
    assert best is not None
    return best


def ping_rounds(
    flag: Any, out: Any, rounds: int, *, timeout_s: float = PING_ROUND_TIMEOUT_S
) -> ClockPair | None:
    """The host side of a ping calibration while :func:`~mori.viz.device.clock_ping_kernel` runs
    on ``flag`` / ``out`` (int64 numpy views of host-visible memory, ``out`` zeroed, ``rounds``
    long): round ``i`` notes the host clock, sets ``flag = i + 1``, waits for ``out[i]``, notes the
    clock again. Returns the narrowest bracket's pair, or None if a round got no answer within
    ``timeout_s``. Always leaves ``flag = rounds``, which lets the kernel finish."""
    best: ClockPair | None = None
    try:
        for i in range(rounds):
            t0 = host_ns()
            flag[0] = i + 1
            deadline = time.monotonic() + timeout_s
            while out[i] == 0:
                if time.monotonic() > deadline:
                    return None
            t1 = host_ns()
            pair = ClockPair((t0 + t1) // 2, int(out[i]), (t1 - t0 + 1) // 2, "ping")
            if best is None or pair.error_ns < best.error_ns:
                best = pair
        return best
    finally:
        flag[0] = rounds


def _ping(device: torch.device, samples: int) -> ClockPair:
    import torch

    from mori.viz.device import clock_ping_kernel

    try:
        flag = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        out = torch.zeros(samples, dtype=torch.int64, pin_memory=True)
    except RuntimeError as e:  # no pinned memory here
        raise _PingUnavailable(str(e)) from e
    with torch.cuda.device(device):
        # compile and load the kernel with a run that needs no host help (flag already >= 1)
        flag[0] = 1
        try:
            clock_ping_kernel[(1,)](flag, out, 1)
            torch.cuda.synchronize(device)
        except Exception as e:  # e.g. a runtime or Triton build that refuses host memory
            raise _PingUnavailable(f"{type(e).__name__}: {e}") from e
        flag.zero_()
        out.zero_()
        clock_ping_kernel[(1,)](flag, out, samples)
        best = ping_rounds(flag.numpy(), out.numpy(), samples)
        _wait_done(device, timeout_s=10.0)
    if best is None:
        raise _PingUnavailable("the ping kernel did not answer")
    return best


def _wait_done(device: torch.device, timeout_s: float) -> None:
    import torch

    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(device))
    deadline = time.monotonic() + timeout_s
    while not event.query():  # type: ignore[no-untyped-call]
        if time.monotonic() > deadline:
            raise MoriTimeoutError(
                f"measure_pair: the clock kernel on {device} did not finish within {timeout_s} s after "
                "it was released; the device does not see host writes to pinned memory"
            )
        time.sleep(0.0001)

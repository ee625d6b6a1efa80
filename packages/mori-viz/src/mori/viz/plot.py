"""A Gantt chart of a timeline: what ``mori viz plot`` draws (PNG, with matplotlib).

One row per track (rank, then program or thread), one bar per span coloured by its slot, nested
spans drawn thinner on top of their parents, instants as ticks; optionally one launch only (a
graph replay) and at most ``max_tracks`` rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mori.core.errors import MoriValueError, bad_value
from mori.viz.timeline import Timeline

__all__ = ["plot_gantt"]

#: most rows one chart draws
MAX_TRACKS = 512


def _matplotlib() -> Any:
    # the object API with the Agg canvas: no pyplot, so the process's matplotlib backend and
    # figure list (a caller's own plots) are left alone
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Rectangle
    except ImportError as e:
        raise MoriValueError(
            "mori viz plot needs matplotlib: pip install 'mori-viz[plot]' (or matplotlib)"
        ) from e
    return matplotlib, Figure, FigureCanvasAgg, Rectangle


def plot_gantt(
    tl_: Timeline,
    path: str | Path,
    *,
    launch: int | None = None,
    max_tracks: int = 64,
    title: str | None = None,
) -> Path:
    """Draw ``tl_`` into the PNG ``path``; ``launch``: only that launch's spans (and the time axis
    starts at its first event); ``max_tracks``: the first rows only (by rank, device first)."""
    func = "plot_gantt"
    if isinstance(max_tracks, bool) or not isinstance(max_tracks, int) or not 1 <= max_tracks <= MAX_TRACKS:
        raise bad_value(func, "max_tracks", max_tracks, f"an int in [1, {MAX_TRACKS}]")
    spans = [s for s in tl_.spans if launch is None or s.launch == launch]
    instants = [i for i in tl_.instants if launch is None or i.launch == launch]
    if not spans and not instants:
        raise MoriValueError(
            f"{func}: nothing to draw" + (f" in launch {launch}" if launch is not None else "")
        )
    used = sorted(
        {s.track for s in spans} | {i.track for i in instants},
        key=lambda t: (
            tl_.tracks[t].rank,
            tl_.tracks[t].kind != "device",
            tl_.tracks[t].source,
            tl_.tracks[t].ring,
        ),
    )[:max_tracks]
    row = {t: n for n, t in enumerate(used)}
    t0 = min([s.start_ns for s in spans if s.track in row] + [i.ts_ns for i in instants if i.track in row])
    matplotlib, Figure, FigureCanvasAgg, Rectangle = _matplotlib()
    slots = sorted({s.slot for s in spans if s.track in row} | {i.slot for i in instants if i.track in row})
    cmap = matplotlib.colormaps["tab20"]
    color = {s: cmap(k % 20) for k, s in enumerate(slots)}
    fig = Figure(figsize=(14, max(2.5, 0.28 * len(used) + 1.5)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for s in sorted(spans, key=lambda s: s.depth):  # parents first, children on top of them
        if s.track not in row:
            continue
        h = max(0.2, 0.8 - 0.2 * s.depth)
        ax.barh(
            row[s.track],
            (s.end_ns - s.start_ns) / 1000.0,
            left=(s.start_ns - t0) / 1000.0,
            height=h,
            color=color[s.slot],
            edgecolor="white",
            linewidth=0.3,
        )
    for i in instants:
        if i.track in row:
            x = (i.ts_ns - t0) / 1000.0
            ax.plot([x, x], [row[i.track] - 0.45, row[i.track] + 0.45], color=color[i.slot], linewidth=1.2)
    ax.ticklabel_format(axis="x", style="plain", useOffset=False)
    ax.set_yticks(range(len(used)))
    ax.set_yticklabels([f"r{tl_.tracks[t].rank} {tl_.tracks[t].name}" for t in used], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(
        "µs" + (f" from the start of launch {launch}" if launch is not None else " from the first event")
    )
    handles = [Rectangle((0, 0), 1, 1, color=color[s]) for s in slots]
    ax.legend(
        handles,
        ["/".join(reversed(tl_.slot_label(s))) for s in slots],
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
    )
    ax.set_title(title or f"mori.viz trace ({len(used)} of {len(tl_.tracks)} tracks)")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    return out

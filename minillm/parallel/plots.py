"""Chapter 14's pipeline timeline: which stage ran which micro-batch when, drawn from the measured events.

What it adds: `plot_timeline(events)` draws one row per stage and one bar per `StageEvent` (labelled with its
micro-batch), on a time axis starting at the first event, so the bubble shows as the empty space at the start of
the later stages and at the end of the earlier ones. The events come from `run_gpipe` or `pipelined_decode` on
every rank (one clock for every process on a machine); nothing here runs a rank.
"""

from __future__ import annotations

from minillm.parallel.pipeline import StageEvent, bubble_fraction, check_events, measured_bubble


def plot_timeline(events: list[StageEvent], m: int | None = None, ax=None, title: str = ""):
    """Draw every stage's events (stage x time, in ms); with `m` micro-batches given, the title adds the measured
    bubble against (p - 1) / (m + p - 1). Returns the axis."""
    import matplotlib.pyplot as plt

    check_events(events)
    if not isinstance(title, str):
        raise TypeError(f"title must be a str, got {type(title).__name__}")
    if ax is not None and not callable(getattr(ax, "barh", None)):
        raise TypeError(f"ax must be a matplotlib Axes, got {type(ax).__name__}")
    p = max(e.stage for e in events) + 1
    t0 = min(e.start for e in events)
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.6 * p + 1.2))
    colors = plt.get_cmap("tab10")
    for e in events:
        start, width = (e.start - t0) * 1e3, (e.end - e.start) * 1e3
        ax.barh(e.stage, width, left=start, height=0.7, color=colors(e.micro_batch % 10), edgecolor="black")
        ax.text(start + width / 2, e.stage, f"F{e.micro_batch}", ha="center", va="center", fontsize=8)
    ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
    ax.invert_yaxis()
    ax.set_xlabel("time since the first stage started (ms)")
    if m is not None:
        measured = measured_bubble(events, p)
        title = (title + ": " if title else "") + (f"p={p} stages, m={m} micro-batches; idle {100 * measured:.0f}% "
                                                   f"(formula (p-1)/(m+p-1) = {100 * bubble_fraction(p, m):.0f}%)")
    if title:
        ax.set_title(title, fontsize=10)
    return ax

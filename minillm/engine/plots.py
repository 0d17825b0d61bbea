"""Chapter 06's scheduling timeline: which request the scheduler ran in each step, and how.

What it adds: `plot_schedule` draws requests against engine steps, one cell per (request, step) the request was
scheduled in, coloured by what it fed (a prompt chunk or one decode token) and labelled with the token count. The
caller records `LLM.last_schedule` after each `step()` (see the chapter's notebook); nothing here touches an engine.
"""

from __future__ import annotations

from typing import Any

from minillm.core.config import check_instance, short_repr
from minillm.engine.scheduler import SchedulerOutput


def schedule_row(schedule: SchedulerOutput) -> dict[str, int]:
    """One step's decision as {request id: tokens fed} (1 = a decode token, more = a prompt chunk)."""
    check_instance("schedule", schedule, SchedulerOutput, "a SchedulerOutput (LLM.last_schedule)")
    return {s.request.request_id: s.num_new_tokens for s in schedule.scheduled}


def plot_schedule(rows: list[dict[str, int]], ax=None, title: str = ""):
    """Draw the recorded steps (`schedule_row` of each) as a request x step grid on `ax`; returns the axis."""
    _check_rows(rows)
    if not isinstance(title, str):
        raise TypeError(f"title must be a str, got {type(title).__name__} {short_repr(title)}")
    if ax is not None and not callable(getattr(ax, "add_patch", None)):
        raise TypeError(f"ax must be a matplotlib Axes or None, got {type(ax).__name__}")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    requests = sorted({rid for row in rows for rid in row}, key=lambda r: (len(r), r))
    if ax is None:
        _, ax = plt.subplots(figsize=(0.45 * len(rows) + 2, 0.45 * len(requests) + 1))
    colors = {"prompt": "tab:orange", "decode": "tab:blue"}
    for step, row in enumerate(rows):
        for y, rid in enumerate(requests):
            n = row.get(rid)
            if n is None:
                continue
            ax.add_patch(Rectangle((step, y), 0.9, 0.8, facecolor=colors["prompt" if n > 1 else "decode"]))
            if n > 1:
                ax.text(step + 0.45, y + 0.4, str(n), ha="center", va="center", fontsize=7, color="white")
    ax.set_xlim(-0.2, len(rows))
    ax.set_ylim(-0.2, len(requests))
    ax.invert_yaxis()
    ax.set_yticks([y + 0.4 for y in range(len(requests))], requests)
    ax.set_xlabel("engine step")
    ax.legend([Patch(color=c) for c in colors.values()], ["prompt chunk (tokens)", "decode (1 token)"],
              loc="upper right", fontsize="small")
    if title:
        ax.set_title(title)
    return ax


def _check_rows(rows: Any) -> None:
    """rows: a list of `schedule_row` dicts, {request id (str): tokens fed (int >= 1)}; a TypeError / ValueError
    naming the first entry that is not one."""
    if not isinstance(rows, list):
        raise TypeError(f"rows must be a list of schedule_row dicts, got {type(rows).__name__} {short_repr(rows)}")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise TypeError(f"rows[{i}] must be a dict {{request id: tokens}}, got {type(row).__name__} "
                            f"{short_repr(row)}")
        for rid, n in row.items():
            if not isinstance(rid, str) or type(n) is not int or n < 0:
                raise ValueError(f"rows[{i}] must map request ids (str) to tokens fed (ints), got "
                                 f"{short_repr(rid)}: {short_repr(n)}")

"""Point labels that do not overlap: a small, deterministic stand-in for adjustText in the notebooks' scatter plots.

A quality-versus-size frontier puts several methods at nearly the same point (int8 weight-only and W8A8 hold the same
bytes; 2:4 magnitude and 2:4 Wanda too), and a fixed offset stacks their names on top of each other.
`label_points(ax, xs, ys, labels)` tries a few offsets around each point, nearest first, and keeps the first one whose
text box overlaps no label placed before it, no marker and nothing outside the axes, and lies nearer to its own
point than to any other (or, when every candidate fails, the one that fails least). It works in display
coordinates, so call it once the axes' limits and scales are final (after `set_yscale`, `set_xlim`,
`tight_layout`). What it leaves out: moving the points themselves, leader lines, and labels drawn by other calls.
"""

from __future__ import annotations

from typing import Any, Sequence

# Candidate offsets in points from the data point, nearest first, with the text's alignment for each: right of the
# point, left of it, above, below, then the same further out.
CANDIDATES: tuple[tuple[float, float, str, str], ...] = tuple(
    (sx * r, sy * r, ha, va)
    for r in (1.0, 2.2, 3.6)
    for sx, sy, ha, va in ((5, 3, "left", "bottom"), (5, -3, "left", "top"), (-5, 3, "right", "bottom"),
                           (-5, -3, "right", "top"), (0, 6, "center", "bottom"), (0, -6, "center", "top"))
)


def overlap(a: Any, b: Any) -> float:
    """Area (display pixels²) shared by two matplotlib `Bbox`es; 0 when they do not touch."""
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return max(w, 0.0) * max(h, 0.0)


def distance(box: Any, x: float, y: float) -> float:
    """Distance (display pixels) from the point (x, y) to the nearest point of the `Bbox` `box`; 0 inside it."""
    dx = max(box.x0 - x, 0.0, x - box.x1)
    dy = max(box.y0 - y, 0.0, y - box.y1)
    return (dx * dx + dy * dy) ** 0.5


def label_points(ax: Any, xs: Sequence[float], ys: Sequence[float], labels: Sequence[str], fontsize: float = 8,
                 marker_px: float = 6.0) -> list[Any]:
    """Annotate point i of `ax` at (xs[i], ys[i]) with labels[i], each at the candidate offset that collides least.

    xs, ys, labels: equal-length sequences (data coordinates, strings). marker_px: half the side of the square kept
    free around every point (display pixels), so no label covers another point's marker. Returns the annotations,
    in the order of `labels`. Deterministic: the same figure, points and labels give the same placement.
    """
    if not (len(xs) == len(ys) == len(labels)):
        raise ValueError(f"xs, ys and labels must have one entry per point, got lengths {len(xs)}, {len(ys)}, "
                         f"{len(labels)}")
    if not all(isinstance(s, str) for s in labels):
        raise TypeError(f"labels must be strings, got {[type(s).__name__ for s in labels]}")
    from matplotlib.transforms import Bbox

    fig = ax.figure
    fig.canvas.draw()  # subtle: text extents need a renderer and the final axes transform
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    centres = ax.transData.transform(list(zip(xs, ys)))  # (n, 2) display pixels
    markers = [Bbox.from_extents(cx - marker_px, cy - marker_px, cx + marker_px, cy + marker_px) for cx, cy in centres]
    placed, boxes = [], []
    for i, (x, y, text) in enumerate(zip(xs, ys, labels)):
        blocked = markers[:i] + markers[i + 1:] + boxes  # a label may touch its own marker, nothing else
        best, best_cost = None, None
        for dx, dy, ha, va in CANDIDATES:
            ann = ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy), ha=ha, va=va,
                              fontsize=fontsize)
            box = ann.get_window_extent(renderer)
            outside = box.width * box.height - overlap(box, frame)
            # subtle: a label nearer to another point than to its own reads as that point's name, so it costs as
            # much as covering a label of the same size
            own = distance(box, *centres[i])
            ambiguous = any(distance(box, *c) < own for j, c in enumerate(centres) if j != i)
            cost = sum(overlap(box, b) for b in blocked) + 4 * outside + ambiguous * box.width * box.height
            if best_cost is None or cost < best_cost:
                if best is not None:
                    best.remove()
                best, best_cost, best_box = ann, cost, box
            else:
                ann.remove()
            if cost == 0:
                break
        boxes.append(best_box)
        placed.append(best)
    return placed

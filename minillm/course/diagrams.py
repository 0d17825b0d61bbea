"""The explanatory diagrams of chapters 08-13: each chapter's idea drawn by code, one function per diagram.

`python -m minillm.course.diagrams` writes them all to `chapters/figures/` (`--only 09-int4-groups` draws one):

    08-draft-verify    a speculative round: γ drafted tokens, one target forward over γ+1 positions, the accepted
                       prefix, the resampled (or bonus) token
    09-int4-groups     group-wise int4: a row split in groups, one scale per group, two 4-bit codes per byte
    10-two-four        the 2:4 pattern: each group of 4 weights keeps 2, stored as values plus 2-bit indices
    11-distillation    teacher and student, distributions softened by the temperature, the T²·KL term and the
                       hard-label term
    12-flash-tiles     the flash-attention loop: a Q tile against each K/V tile, running max and sum, rescale
    13-fused-step      the decode step as ~150 eager PyTorch calls against one C++ call over all layers

The numbers a diagram shows (a scale, a code, a packed byte) are computed here with plain `torch` from a small
seeded example, not typed in. Every file is saved with fixed metadata, so drawing again with the same matplotlib
gives the same bytes, and records `minillm-diagrams`, a digest of this module's source: `tests/test_figures.py`
tells a diagram drawn by an older version of this code from a current one. What it leaves out: measured
results (those are the notebooks' plots, copied by `minillm.course.figures`).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from minillm.core.io import atomic_save_figure

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
FIGURES = REPO_ROOT / "chapters" / "figures"
PNG_KEY = "minillm-diagrams"
DPI = 130

# One palette for every diagram: context, draft / student, target / teacher, accepted, rejected, dropped.
GREY, BLUE, PURPLE, GREEN, ORANGE, LIGHT = "#d9d9d9", "#cfe3f7", "#e4d7f5", "#cdebc5", "#f9d3a9", "#f2f2f2"
EDGE = "#2a5d8f"


def source_digest() -> str:
    """First 16 hex digits of the SHA-256 of this module's source: stored in every diagram it draws."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def new_figure(width: float, height: float) -> tuple[Any, Any]:
    """A figure of `width` x `height` inches with one axis-free canvas in data units = inches (so text and boxes
    keep their proportions), origin at the bottom left."""
    import matplotlib

    matplotlib.use("Agg")  # subtle: the module never needs a display, and the Agg renderer is deterministic
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(width, height), dpi=DPI)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.axis("off")
    return fig, ax


def box(ax: Any, x: float, y: float, w: float, h: float, text: str = "", face: str = LIGHT, edge: str = EDGE,
        size: float = 9, style: str = "-", weight: str = "normal", color: str = "black", hatch: str | None = None,
        rounded: bool = False) -> None:
    """A rectangle with its lower-left corner at (x, y), `w` x `h` (inches), and `text` centred in it."""
    from matplotlib.patches import FancyBboxPatch, Rectangle

    if rounded:
        patch = FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0,rounding_size=0.08", facecolor=face,
                               edgecolor=edge, linestyle=style, linewidth=1.0, hatch=hatch)
    else:
        patch = Rectangle((x, y), w, h, facecolor=face, edgecolor=edge, linestyle=style, linewidth=1.0, hatch=hatch)
    ax.add_patch(patch)
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, weight=weight, color=color)


def arrow(ax: Any, start: tuple[float, float], end: tuple[float, float], color: str = "#444444", style: str = "-|>",
          rad: float = 0.0, lw: float = 1.0, ls: str = "-") -> None:
    """An arrow from `start` to `end` (inches); `rad` bends it (matplotlib's arc3 connection)."""
    from matplotlib.patches import FancyArrowPatch

    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=10, color=color, linewidth=lw,
                                 linestyle=ls, connectionstyle=f"arc3,rad={rad}", shrinkA=1, shrinkB=1))


def save(fig: Any, path: Path) -> Path:
    """Write `fig` to `path` with fixed metadata (no version, no date: the same drawing gives the same bytes)."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_save_figure(fig, path, metadata={"Software": "minillm.course.diagrams", PNG_KEY: source_digest()})
    plt.close(fig)
    return path


def draw_draft_verify(path: Path) -> Path:
    """Chapter 08: one speculative round with γ = 4. The draft proposes d1..d4 one forward at a time; one target
    forward over the γ+1 positions [x_n, d1..d4] gives p1..p5, where p_i judges d_i; d1 and d2 are accepted, d3 is
    rejected and replaced by a token resampled from norm(max(0, p3 - q3)), d4 is dropped unseen. Had all four been
    accepted, p5 would have given a bonus token."""
    fig, ax = new_figure(10.6, 5.4)
    w, h, step = 0.8, 0.42, 1.05  # token box size; distance between columns
    col = [2.0 + i * step for i in range(8)]  # columns: …, x_{n-1}, x_n, then positions n+1 .. n+5
    y_draft, y_in, y_target, y_out, y_accept = 4.5, 3.4, 2.8, 2.05, 1.0
    for y, text in ((y_draft, "1. draft\nγ = 4 cheap forwards\nof the draft model,\none token each"),
                    (y_in, "2. verify\nONE forward of the\ntarget over\nγ+1 = 5 positions"),
                    (y_accept, "3. accept a prefix,\nresample at the\nfirst rejection")):
        ax.text(0.15, y + h / 2, text, ha="left", va="center", fontsize=9)
    for i, t in enumerate(["…", "x$_{n-1}$", "x$_n$"]):
        box(ax, col[i], y_draft, w, h, t, face=GREY)
    for i in range(4):
        box(ax, col[3 + i], y_draft, w, h, f"d$_{i + 1}$", face=BLUE)
        arrow(ax, (col[2 + i] + w / 2, y_draft + h), (col[3 + i] + w / 2, y_draft + h), rad=-0.5, color=EDGE)
        ax.text(col[2 + i] + w / 2 + step / 2, y_draft + h + 0.3, f"q$_{i + 1}$", fontsize=8, color=EDGE,
                ha="center")
    # the verify forward: its inputs, the target as one wide box, its outputs one position to the right
    for i, t in enumerate(["x$_n$"] + [f"d$_{i + 1}$" for i in range(4)]):
        box(ax, col[2 + i], y_in, w, h, t, face=GREY if i == 0 else BLUE)
        arrow(ax, (col[2 + i] + w / 2, y_in), (col[2 + i] + w / 2, y_target + 0.36), color="#7a4fb0")
        arrow(ax, (col[2 + i] + w / 2, y_target), (col[3 + i] + w / 2, y_out + h), color="#7a4fb0")
    box(ax, col[2], y_target, col[6] + w - col[2], 0.36, "target model: one cached forward, 5 rows", face=PURPLE,
        size=8, rounded=True, edge="#7a4fb0")
    for i in range(5):
        box(ax, col[3 + i], y_out, w, h, f"p$_{i + 1}$", face=PURPLE, edge="#7a4fb0")
    ax.text(col[3] - 0.15, y_out + h / 2, "p$_i$ judges d$_i$;\np$_5$ follows d$_4$", fontsize=8, ha="right",
            va="center")
    # acceptance: d1, d2 kept, d3 rejected -> r3 resampled, d4 dropped, the bonus only if all four are kept
    box(ax, col[3], y_accept, w, h, "d$_1$ ✓", face=GREEN)
    box(ax, col[4], y_accept, w, h, "d$_2$ ✓", face=GREEN)
    box(ax, col[5], y_accept, w, h, "r$_3$", face=ORANGE, weight="bold")
    box(ax, col[6], y_accept, w, h, "d$_4$", face="white", edge="#999999", color="#999999", style="--")
    box(ax, col[7], y_accept, w, h, "bonus", face="white", edge="#999999", color="#999999", style="--", size=8)
    for i in range(5):
        arrow(ax, (col[3 + i] + w / 2, y_out), (col[3 + i] + w / 2, y_accept + h), color="#999999")
    ax.text(col[5] + w, y_accept - 0.08, "d$_3$ ✗, so resample r$_3$ ~ norm(max(0, p$_3$ − q$_3$))", fontsize=7.5,
            ha="right", va="top", color="#a35200")
    for i, text in ((6, "dropped:\ndrafted after d$_3$"), (7, "from p$_5$, only if\nall γ are kept")):
        ax.text(col[i] + w / 2, y_accept - 0.08, text, fontsize=7.5, ha="center", va="top", color="#777777")
    ax.text(0.15, 0.22, "emitted this round: d$_1$ d$_2$ r$_3$, 3 tokens for one target forward (greedy: accept "
            "while d$_i$ = argmax p$_i$); both caches roll back to the kept tokens", fontsize=9, va="center")
    return save(fig, path)


def draw_int4_groups(path: Path) -> Path:
    """Chapter 09: one row of 16 weights, group size g = 8. Each group gets its own scale s = max|w| / 7, each weight
    the code q = round(w / s) in [-7, 7], and two codes share a byte (element 2i in the low nibble, 2i+1 in the high,
    negatives as 4-bit two's complement). The numbers are computed here from a seeded row with one outlier."""
    g = torch.Generator().manual_seed(9)
    row = torch.randn(16, generator=g) * 0.05  # (16,) one row of a weight
    row[11] = 0.31  # an outlier: it stretches the scale of its own group only
    groups = row.view(2, 8)  # (groups, g)
    scales = groups.abs().amax(-1, keepdim=True) / 7  # (groups, 1): symmetric int4, qmax = 7
    codes = torch.round(groups / scales).clamp(-7, 7).to(torch.int8).view(16)  # (16,)
    nibbles = [int(c) & 0xF for c in codes]
    packed = [nibbles[2 * i] | (nibbles[2 * i + 1] << 4) for i in range(8)]  # (8,) bytes

    fig, ax = new_figure(10.6, 4.6)
    w = 0.5
    xs = [1.55 + i * (w + 0.02) + (0.3 if i >= 8 else 0) for i in range(16)]
    y_w, y_q, y_b = 3.35, 2.1, 0.85
    ax.text(0.1, y_w + 0.21, "fp32 row\n(16 × 4 B)", fontsize=9, va="center")
    ax.text(0.1, y_q + 0.21, "int4 codes\nq = round(w / s)", fontsize=9, va="center")
    ax.text(0.1, y_b + 0.21, "packed bytes\n(8 × 1 B)", fontsize=9, va="center")
    for i in range(16):
        box(ax, xs[i], y_w, w, 0.42, f"{row[i]:+.3f}", face=ORANGE if i == 11 else LIGHT, size=6.5)
        box(ax, xs[i], y_q, w, 0.42, f"{int(codes[i]):+d}", face=BLUE, size=8)
        arrow(ax, (xs[i] + w / 2, y_w), (xs[i] + w / 2, y_q + 0.42), color="#999999")
    for k in range(2):
        left, right = xs[8 * k], xs[8 * k + 7] + w
        ax.plot([left, left, right, right], [y_w + 0.5, y_w + 0.6, y_w + 0.6, y_w + 0.5], color=EDGE, lw=1)
        ax.text((left + right) / 2, y_w + 0.68, f"group {k + 1} (g = 8): s$_{k + 1}$ = max|w| / 7 = "
                f"{scales[k, 0]:.4f}", ha="center", va="bottom", fontsize=8.5, color=EDGE)
    for i in range(8):
        bx = (xs[2 * i] + xs[2 * i + 1] + w) / 2 - 0.45  # a byte drawn high nibble first, as binary is written
        box(ax, bx, y_b, 0.45, 0.42, f"{nibbles[2 * i + 1]:04b}", face=PURPLE, size=7, edge="#7a4fb0")
        box(ax, bx + 0.45, y_b, 0.45, 0.42, f"{nibbles[2 * i]:04b}", face=BLUE, size=7)
        ax.text(bx + 0.45, y_b - 0.08, f"0x{packed[i]:02X}", ha="center", va="top", fontsize=7.5)
        arrow(ax, (xs[2 * i] + w / 2, y_q), (bx + 0.675, y_b + 0.42), color="#999999")
        arrow(ax, (xs[2 * i + 1] + w / 2, y_q), (bx + 0.225, y_b + 0.42), color="#999999")
    ax.text(0.1, 0.38, "byte i = high nibble (element 2i+1, purple) | low nibble (element 2i, blue); a negative code "
            "is stored as its 4-bit two's complement (−2 → 1110)", fontsize=8.5, va="center")
    ax.text(0.1, 0.12, f"64 B of fp32 → 8 B of codes + 2 scales × 4 B = 16 B. The outlier ({row[11]:.2f}) coarsens "
            "the step of its own group only: group 1 keeps its fine scale.", fontsize=8.5, va="center")
    return save(fig, path)


def draw_two_four(path: Path) -> Path:
    """Chapter 10: one row of 16 weights in 4 groups of 4 consecutive inputs. Each group keeps its 2 largest
    magnitudes; the row is stored as its 8 kept values plus a 2-bit index per value (its position 0-3 in the
    group): 8 values and 16 bits of metadata instead of 16 values."""
    g = torch.Generator().manual_seed(10)
    row = torch.randn(16, generator=g)  # (16,) one row of a weight, along the input dimension
    groups = row.view(4, 4)  # (groups, 4)
    keep = groups.abs().topk(2, dim=-1).indices.sort(-1).values  # (groups, 2): the kept positions, in order
    kept = torch.gather(groups, 1, keep)  # (groups, 2)

    fig, ax = new_figure(10.6, 4.3)
    w, x0 = 0.48, 1.5
    xs = [x0 + i * (w + 0.02) + (i // 4) * 0.3 for i in range(16)]
    y_w, y_v, y_i = 3.05, 1.75, 0.9
    ax.text(0.1, y_w + 0.21, "dense row\n(16 weights)", fontsize=9, va="center")
    ax.text(0.1, y_v + 0.21, "kept values\n(8: half)", fontsize=9, va="center")
    ax.text(0.1, y_i + 0.21, "2-bit index\nper value", fontsize=9, va="center")
    for k in range(4):
        left, right = xs[4 * k], xs[4 * k + 3] + w
        ax.plot([left, left, right, right], [y_w + 0.5, y_w + 0.6, y_w + 0.6, y_w + 0.5], color=EDGE, lw=1)
        ax.text((left + right) / 2, y_w + 0.66, f"group {k + 1}: keep the 2 largest |w|", ha="center", va="bottom", fontsize=8,
                color=EDGE)
        for j in range(4):
            i = 4 * k + j
            kept_here = j in keep[k].tolist()
            box(ax, xs[i], y_w, w, 0.42, f"{row[i]:+.2f}", face=GREEN if kept_here else "white", size=7.5,
                edge=EDGE if kept_here else "#999999", color="black" if kept_here else "#999999",
                style="-" if kept_here else "--")
            ax.text(xs[i] + w / 2, y_w - 0.06, str(j), ha="center", va="top", fontsize=7, color="#777777")
        for n in range(2):
            vx = (xs[4 * k] + xs[4 * k + 3] + w) / 2 - w - 0.01 + n * (w + 0.02)
            box(ax, vx, y_v, w, 0.42, f"{kept[k, n]:+.2f}", face=GREEN, size=7.5)
            box(ax, vx, y_i, w, 0.42, f"{int(keep[k, n]):02b}", face=PURPLE, size=8, edge="#7a4fb0")
            src = xs[4 * k + int(keep[k, n])] + w / 2
            arrow(ax, (src, y_w - 0.2), (vx + w / 2, y_v + 0.42), color="#999999")
    ax.text(0.1, 0.42, "The score can be the magnitude |w| (shown) or Wanda's |w| · ‖x‖; the groups run along the "
            "input dimension, the one a matmul reduces over.", fontsize=9, va="center")
    ax.text(0.1, 0.16, "fp16: 16 × 2 B = 32 B dense → 8 × 2 B + 8 × 2 bit = 18 B (9/16). Sparse tensor cores read "
            "this format and do half the multiplies.", fontsize=9, va="center")
    return save(fig, path)


def draw_distillation(path: Path) -> Path:
    """Chapter 11: the same tokens go through the teacher (frozen) and the student. Both logit vectors are divided
    by the temperature T before the softmax, which flattens them (the bars: one seeded logit vector at T = 1 and
    T = 4). The soft term is T² · KL(p_T ‖ q_T), the hard term the cross-entropy with the next token at T = 1; the
    loss mixes them with weight w, and only the student gets gradients."""
    fig, ax = new_figure(10.6, 5.0)
    g = torch.Generator().manual_seed(11)
    teacher = torch.randn(8, generator=g) * 2.2  # (V,) logits over a toy vocabulary of 8
    student = teacher * 0.6 + torch.randn(8, generator=g) * 0.9
    box(ax, 0.15, 2.0, 1.35, 0.8, "tokens\nx$_1$ … x$_t$", face=GREY)
    box(ax, 2.0, 3.2, 1.6, 0.8, "teacher (base)\nfrozen", face=PURPLE, edge="#7a4fb0", rounded=True)
    box(ax, 2.0, 0.8, 1.6, 0.8, "student (draft)\ntrained", face=BLUE, rounded=True)
    arrow(ax, (1.5, 2.55), (2.0, 3.55))
    arrow(ax, (1.5, 2.25), (2.0, 1.2))
    box(ax, 4.0, 3.3, 1.3, 0.6, "z$_t$ / T", face="white", edge="#7a4fb0")
    box(ax, 4.0, 0.9, 1.3, 0.6, "z$_s$ / T", face="white")
    arrow(ax, (3.6, 3.6), (4.0, 3.6))
    arrow(ax, (3.6, 1.2), (4.0, 1.2))
    # two small bar charts per model: the softmax at T = 1 and at T = 4
    for y, logits, colour, name in ((3.05, teacher, "#7a4fb0", "p$_T$"), (0.65, student, EDGE, "q$_T$")):
        for k, temp in enumerate((1.0, 4.0)):
            inset = fig.add_axes(((5.75 + 1.35 * k) / 10.6, y / 5.0, 1.15 / 10.6, 0.95 / 5.0))
            inset.bar(range(8), torch.softmax(logits / temp, -1).tolist(), color=colour, width=0.75)
            inset.set_ylim(0, 1)
            inset.set_xticks([])
            inset.set_yticks([0, 1] if k == 0 else [])
            inset.tick_params(labelsize=6, length=2)
            inset.set_title(f"{name}, T = {temp:g}", fontsize=7.5, pad=2)
        arrow(ax, (5.3, y + 0.55), (5.7, y + 0.55))
    ax.text(6.4, 2.42, "a higher T flattens both:\nthe teacher's near-misses get mass", fontsize=8, ha="center",
            va="center", color="#555555")
    box(ax, 8.55, 2.65, 1.95, 0.95, "soft: T² · KL(p$_T$ ‖ q$_T$)\n(forward; reverse KL\nswaps p and q)",
        face=ORANGE, size=8, rounded=True, edge="#a35200")
    box(ax, 8.55, 1.3, 1.95, 0.8, "hard: CE(z$_s$, next token)\nat T = 1", face=GREEN, size=8, rounded=True,
        edge="#3c7d2f")
    arrow(ax, (8.1, 3.55), (8.55, 3.25))
    arrow(ax, (8.1, 1.2), (8.55, 2.8))
    # the hard term reads the student's logits at T = 1: a path under the bar charts
    ax.plot([2.8, 2.8, 9.52], [0.8, 0.3, 0.3], color="#3c7d2f", lw=1)
    arrow(ax, (9.52, 0.3), (9.52, 1.3), color="#3c7d2f")
    ax.text(5.2, 0.36, "z$_s$ at T = 1, against the true next token", fontsize=8, color="#3c7d2f", va="bottom")
    ax.text(9.52, 4.15, "loss = (1 − w) · hard + w · soft", fontsize=8.5, ha="center", va="center", weight="bold")
    ax.text(9.52, 3.87, "gradients reach the student only", fontsize=8, ha="center", va="center", color="#555555")
    ax.text(0.15, 4.6, "The T² keeps the soft term's gradient the same size at every T\n(its gradient on z$_s$ is "
            "T · (q$_T$ − p$_T$)).", fontsize=9, va="center")
    return save(fig, path)


def draw_flash_tiles(path: Path) -> Path:
    """Chapter 12: the score matrix S = Q Kᵀ of 8 x 8 tiles is never built. A block owns one Q tile (a band of
    rows) and walks the K/V tiles left to right; for each it computes one tile of scores, folds it into every
    row's running max m and sum l, rescales the partial output o by exp(m_old - m_new) and adds the tile's
    exp(S - m_new) V. After the last tile, o / l is the row's attention output."""
    fig, ax = new_figure(10.6, 5.0)
    n, cell, x0, y0 = 8, 0.42, 1.3, 0.55  # tiles per side, tile size (inches), lower-left of the score matrix
    qi, current = 3, 4  # the Q tile this block owns; the K/V tile it is at now
    top = y0 + n * cell
    for r in range(n):
        for c in range(n):
            y = top - (r + 1) * cell
            if r == qi:
                face = GREEN if c < current else (ORANGE if c == current else BLUE)
            else:
                face = "white"
            box(ax, x0 + c * cell, y, cell, cell, face=face, edge="#bbbbbb")
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x0, y0), n * cell, n * cell, fill=False, edgecolor=EDGE, linewidth=1.2))
    ax.add_patch(Rectangle((x0, top - (qi + 1) * cell), n * cell, cell, fill=False, edgecolor="black", linewidth=1.6))
    # Q tiles down the left, K tiles across the top
    for r in range(n):
        box(ax, x0 - 0.5, top - (r + 1) * cell, 0.38, cell, f"Q$_{r + 1}$" if r == qi else "",
            face=ORANGE if r == qi else LIGHT, size=8, edge="#bbbbbb")
    for c in range(n):
        box(ax, x0 + c * cell, top + 0.12, cell, 0.38, f"K$_{c + 1}$V$_{c + 1}$" if c == current else "",
            face=ORANGE if c == current else LIGHT, size=7, edge="#bbbbbb")
    ax.text(x0 + n * cell / 2, top + 0.65, "keys and values, one tile at a time →", ha="center", fontsize=9)
    ax.text(x0 - 0.75, top - (qi + 0.5) * cell, "queries\nof this\nblock", ha="right", va="center", fontsize=8)
    arrow(ax, (x0 + 0.1, top - qi * cell + 0.06), (x0 + current * cell + cell / 2, top - qi * cell + 0.06),
          color="#3c7d2f", lw=1.4)
    ax.text(x0 + n * cell / 2, y0 - 0.25, "S = Q Kᵀ / √hs: T × T, never stored whole", ha="center", va="center",
            fontsize=8.5, color="#555555")
    # legend of the band's colours
    lx = x0 + n * cell + 0.35
    for k, (face, text) in enumerate(((GREEN, "tiles already folded in"), (ORANGE, "the tile being folded now"),
                                      (BLUE, "tiles still to come"))):
        box(ax, lx, top - 0.35 - 0.27 * k, 0.25, 0.2, face=face, edge="#bbbbbb")
        ax.text(lx + 0.35, top - 0.25 - 0.27 * k, text, fontsize=8, va="center")
    # the per-tile update, as the kernel runs it for every row of the Q tile
    ax.text(lx, top - 1.12, "for each K/V tile j, for every row of the Q tile:", fontsize=9, va="center", weight="bold")
    steps = [("s = q · K$_j$ᵀ / √hs", "the scores of this tile only"),
             ("m$_{new}$ = max(m, max(s))", "running max"),
             ("a = exp(m − m$_{new}$)", "rescales what was summed so far"),
             ("l = a · l + Σ exp(s − m$_{new}$)", "running sum"),
             ("o = a · o + exp(s − m$_{new}$) · V$_j$", "running output, not yet divided"),
             ("m = m$_{new}$", "")]
    for k, (code, why) in enumerate(steps):
        y = top - 1.41 - 0.27 * k
        ax.text(lx + 0.2, y, code, fontsize=8.5, va="center")
        ax.text(lx + 2.75, y, why, fontsize=8, va="center", color="#555555")
    ax.text(lx, top - 1.41 - 0.27 * len(steps) - 0.05, "after the last tile:  output = o / l", fontsize=9,
            va="center", weight="bold")
    ax.text(lx, 0.05, "Extra memory per row: m, l and o, plus one tile\nof scores per block, instead of a T × T matrix.",
            fontsize=8.5, va="bottom", color="#555555")
    return save(fig, path)


def draw_fused_step(path: Path) -> Path:
    """Chapter 13: one decode step of `base` (6 blocks). Eager PyTorch runs it as a chain of separate calls, each
    paying Python, the dispatcher and a fresh output tensor (drawn as the grey gap before each call); the fused step
    is one call into C++ whose loops run every layer with no PyTorch in between, so only the matrix-vector products
    and the attention remain."""
    fig, ax = new_figure(10.6, 4.3)
    # The ~25 PyTorch calls of one eager block at batch 1, in order; the heavy ones read a weight matrix or the cache.
    block_ops = ["ln_1", "c_attn", "split", "view", "transpose", "view", "transpose", "view", "transpose", "write k",
                 "write v", "slice k", "slice v", "sdpa", "transpose", "contiguous", "view", "c_proj", "add", "ln_2",
                 "c_fc", "gelu", "c_proj", "add"]
    heavy = {"c_attn": 0.09, "sdpa": 0.04, "c_proj": 0.08, "c_fc": 0.12}  # widths in inches, schematic
    call, small, x_start = 0.022, 0.006, 1.75  # a call's overhead, a small op's work, where both rows start
    y_eager, y_fused, h = 2.75, 1.45, 0.4

    def ops(x: float, y: float, eager: bool) -> float:
        """Draw the 6 blocks and the head from x on row y; returns where they end."""
        if not eager:
            box(ax, x, y, call, h, face="#7f7f7f", edge="none")  # the one call into C++
            x += call
        for layer in range(6):
            ax.plot([x, x], [y - 0.08, y - 0.02], color="#777777", lw=0.8)
            ax.text(x + 0.02, y - 0.05, f"block {layer + 1}", fontsize=6.5, va="center", color="#777777")
            for op in block_ops:
                if eager:
                    box(ax, x, y, call, h, face="#7f7f7f", edge="none")
                    x += call
                wd = heavy.get(op, small)
                box(ax, x, y, wd, h, face=BLUE if op in heavy else PURPLE, edge="none")
                x += wd
        if eager:
            box(ax, x, y, call, h, face="#7f7f7f", edge="none")
            x += call
        box(ax, x, y, 0.22, h, face=BLUE, edge="none")  # the tied head, the largest single product
        ax.text(x + 0.27, y + h / 2, "head", fontsize=7.5, va="center")
        return x + 0.22

    ax.text(0.1, y_eager + h / 2, "eager PyTorch\n~25 calls per block", fontsize=9, va="center")
    eager_end = ops(x_start, y_eager, True)
    ax.text(x_start, y_eager + h + 0.08, "each grey bar is one PyTorch call (Python, dispatch, a new output "
            "tensor): ln_1, c_attn, split, views, cache writes, attention, c_proj, add, ln_2, c_fc, gelu, …",
            fontsize=7.5, va="bottom")
    ax.text(0.1, y_fused + h / 2, "fused C++ step\none call per step", fontsize=9, va="center")
    fused_end = ops(x_start, y_fused, False)
    ax.annotate("", (eager_end, y_fused + h / 2), (fused_end + 0.6, y_fused + h / 2),
                arrowprops=dict(arrowstyle="<->", color="#a35200"))
    ax.text((eager_end + fused_end + 0.6) / 2, y_fused + h / 2 + 0.08, "what the calls cost", fontsize=8,
            ha="center", va="bottom", color="#a35200")
    ax.text(x_start, y_fused - 0.2, "FusedDecoder.step(token, pos, slot): every block's layernorm, GEMVs, "
            "attention over the cache and gelu in plain C++ loops", fontsize=7.5, va="top")
    for k, (face, text) in enumerate((("#7f7f7f", "a call: Python, dispatch, a new tensor"),
                                      (BLUE, "reads weights or the cache (GEMV, attention)"),
                                      (PURPLE, "small ops: norms, views, adds, gelu"))):
        box(ax, 0.15 + 3.5 * k, 0.25, 0.25, 0.2, face=face, edge="none")
        ax.text(0.5 + 3.5 * k, 0.35, text, fontsize=8, va="center")
    ax.text(0.1, 4.0, "One decode step of base (6 blocks, batch 1), schematic: the bars show the order of the work, "
            "their widths are not measured.", fontsize=9, va="center", color="#555555")
    return save(fig, path)


# name -> (drawing function); the file is chapters/figures/<name>.png and chapter <name[:2]> shows it.
DIAGRAMS: dict[str, Callable[[Path], Path]] = {
    "08-draft-verify": draw_draft_verify,
    "09-int4-groups": draw_int4_groups,
    "10-two-four": draw_two_four,
    "11-distillation": draw_distillation,
    "12-flash-tiles": draw_flash_tiles,
    "13-fused-step": draw_fused_step,
}


def draw(name: str, directory: Path = FIGURES) -> Path:
    """Draw the diagram `name` (a key of `DIAGRAMS`) into `directory/<name>.png`; returns the path."""
    if name not in DIAGRAMS:
        raise ValueError(f"name must be one of {sorted(DIAGRAMS)}, got {name!r}")
    return DIAGRAMS[name](Path(directory) / f"{name}.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm.course.diagrams", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=FIGURES, help="folder to write to (default chapters/figures)")
    parser.add_argument("--only", action="append", choices=sorted(DIAGRAMS), help="draw only this one (repeatable)")
    args = parser.parse_args(argv)
    for name in args.only or DIAGRAMS:
        print(f"wrote {draw(name, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

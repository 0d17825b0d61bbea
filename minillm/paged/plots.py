"""Chapter 05's picture of block tables: `draw_block_tables` (draw.py) as a figure instead of text.

What it adds: `plot_block_tables` draws every sequence's logical blocks left to right, each box labelled with its
physical block id and filled slot by slot (dark = a token, light = reserved and empty), coloured by physical block
so a block shared by two sequences shows up in the same colour in both rows; the pool's reference counts form the
bottom row. It reads the manager's public state only and changes nothing.
"""

from __future__ import annotations

from minillm.core.config import check_instance, check_label
from minillm.paged.block_manager import BlockManager


def plot_block_tables(manager: BlockManager, ax=None, title: str = ""):
    """Draw the manager's block tables and pool on `ax` (a new figure if None); returns the axis."""
    import matplotlib.pyplot as plt
    from matplotlib.axes import Axes
    from matplotlib.patches import Rectangle

    check_instance("manager", manager, BlockManager, "a BlockManager")
    check_instance("ax", ax, (Axes, type(None)), "a matplotlib Axes or None")
    check_label("title", title)
    bs, nb = manager.block_size, manager.num_blocks
    seqs = list(manager.seq_ids)
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 0.8 + 0.6 * (len(seqs) + 1)))
    cmap = plt.get_cmap("tab10")
    rows = len(seqs) + 1
    for r, sid in enumerate(seqs):
        y = rows - 1 - r
        n = manager.num_tokens(sid)
        for i, b in enumerate(manager.block_table(sid)):
            filled = max(0, min(bs, n - i * bs))
            for s in range(bs):  # one small square per slot
                x = i * (bs + 1) + s
                ax.add_patch(Rectangle((x, y), 1, 0.8, facecolor=cmap(b % 10), alpha=1.0 if s < filled else 0.25,
                                       edgecolor="white"))
            ax.text(i * (bs + 1) + bs / 2, y + 0.4, str(b), ha="center", va="center", color="black",
                    fontweight="bold")
        ax.text(-0.5, y + 0.4, f"{sid} ({n} tok)", ha="right", va="center")
    refs = manager.allocator.ref_counts
    for b in range(nb):  # the pool: one box per physical block, its reference count inside
        used = refs[b] > 0
        ax.add_patch(Rectangle((b * 1.5, -0.2), 1.3, 0.8, facecolor=cmap(b % 10) if used else "white",
                               edgecolor="gray", alpha=1.0 if used else 0.6))
        ax.text(b * 1.5 + 0.65, 0.2, str(refs[b]) if used else "-", ha="center", va="center",
                color="white" if used else "gray")
    ax.text(-0.5, 0.2, "pool refs", ha="right", va="center")
    width = max([nb * 1.5] + [len(manager.block_table(s)) * (bs + 1) for s in seqs])
    ax.set_xlim(-6, width + 0.5)
    ax.set_ylim(-0.4, rows)
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=9, loc="left")
    return ax

"""A text picture of block tables and the pool, for the notebook and the chapter: who holds which block, how full.

Each sequence prints its logical blocks in order, as `[physical id: fill]` with `#` for a slot holding a token and
`.` for a reserved empty slot; the pool line gives every block's reference count (`-` = free). It reads the
manager's public state only and changes nothing.
"""

from __future__ import annotations

from collections.abc import Hashable

from minillm.core.config import check_instance, check_label
from minillm.paged.block_manager import BlockManager


def draw_block_tables(manager: BlockManager, title: str = "") -> str:
    check_instance("manager", manager, BlockManager, "a BlockManager")
    check_label("title", title)
    bs = manager.block_size
    lines = [title] if title else []
    for sid in manager.seq_ids:
        n = manager.num_tokens(sid)
        cells = []
        for i, b in enumerate(manager.block_table(sid)):
            filled = min(bs, n - i * bs)
            cells.append(f"[{b:>2}:{'#' * filled}{'.' * (bs - filled)}]")
        lines.append(f"  seq {_name(sid):>4} ({n:>2} tokens) " + " ".join(cells))
    refs = manager.allocator.ref_counts
    lines.append("  pool refs  " + " ".join(f"{b}:{r if r else '-'}" for b, r in enumerate(refs)))
    return "\n".join(lines)


def _name(sid: Hashable) -> str:
    return sid if isinstance(sid, str) else repr(sid)

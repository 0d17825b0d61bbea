"""Markdown tables: the form every benchmark prints its report in and every chapter text quotes it in.

`markdown_table(["path", "tok/s"], [["eager", "588"], ["fused", "1,027"]])` gives

    | path | tok/s |
    |---|---:|
    | eager | 588 |
    | fused | 1,027 |

with a newline at the end. The cells are strings, formatted by the caller (the report's units and digits are
its own; anything else is written as `str` writes it); a row may hold one cell more than the header (a note after
the last column).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

RULES = {"l": "---", "r": "---:", "c": ":---:"}  # a column's rule under the header: left, right or centered


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]], align: str | None = None) -> str:
    """A Markdown table ending with a newline: the header, one rule per column, one line per row. `align` holds one
    letter per column, l (left), r (right) or c (centered); by default the first column is left-aligned (names)
    and the others right-aligned (numbers)."""
    if align is None:
        align = "l" + "r" * (len(header) - 1)
    if len(align) != len(header) or set(align) - set(RULES):
        raise ValueError(f"align must hold one of l, r, c per column ({len(header)}), got {align!r}")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(RULES[a] for a in align) + "|"]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]  # str: a cell the caller left a number
    return "\n".join(lines) + "\n"

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

import re
from collections.abc import Iterable, Sequence

from minillm.core.config import short_repr

RULES = {"l": "---", "r": "---:", "c": ":---:"}  # a column's rule under the header: left, right or centered


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]], align: str | None = None) -> str:
    """A Markdown table ending with a newline: the header, one rule per column, one line per row. `align` holds one
    letter per column, l (left), r (right) or c (centered); by default the first column is left-aligned (names)
    and the others right-aligned (numbers). A row holds one cell per column, or one more (a note after the last
    column); a "|" inside a cell is escaped ("\\|", unless it is already); a cell with a line break, a row of
    another length or a header that is not a list of strings is a ValueError/TypeError naming it (a table that
    would render wrong)."""
    if isinstance(header, (str, bytes)) or not isinstance(header, Sequence) or not all(
            isinstance(h, str) for h in header):
        raise TypeError(f"header must be a list of str (the column names), got {short_repr(header)}")
    if not header:
        raise ValueError("header must name at least one column, got an empty list")
    if align is None:
        align = "l" + "r" * (len(header) - 1)
    if not isinstance(align, str) or len(align) != len(header) or set(align) - set(RULES):
        raise ValueError(f"align must hold one of l, r, c per column ({len(header)}), got {align!r}")
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Iterable):
        raise TypeError(f"rows must be a list of rows (each a list of cells), got {type(rows).__name__}")
    lines = ["| " + " | ".join(_cell(h, "header", i) for i, h in enumerate(header)) + " |",
             "|" + "|".join(RULES[a] for a in align) + "|"]
    for r, row in enumerate(rows):
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence) or len(row) not in (len(header),
                                                                                            len(header) + 1):
            raise ValueError(f"rows[{r}] must hold {len(header)} cells (or one more, a note), got {short_repr(row)}")
        lines.append("| " + " | ".join(_cell(c, f"rows[{r}]", i) for i, c in enumerate(row)) + " |")
    return "\n".join(lines) + "\n"


def _cell(value: object, where: str, i: int) -> str:
    """One cell as the table writes it: `str(value)` (a caller's number too) with "|" escaped; a line break would end
    the row, so it is a ValueError naming the cell."""
    try:
        text = str(value)
    except Exception as e:  # an int past Python's digit limit, a __str__ that raises
        raise ValueError(f"{where}[{i}] cannot be written as text: {type(e).__name__}: {str(e)[:80]}") from e
    if "\n" in text or "\r" in text:
        raise ValueError(f"{where}[{i}] must be one line, got {short_repr(text)}")
    return re.sub(r"(?<!\\)\|", r"\\|", text)  # a "|" the caller escaped already stays as it is

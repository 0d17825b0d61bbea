"""The tour's shared pieces: one results row, the context every chapter entry receives, and the table printer.

A chapter's entry lives in `minillm/<chapter>/tour.py` and exposes `TITLE` and `run(ctx) -> list[Row]`. Each row
states a check against the naive baseline (passed, failed, or skipped with the reason it could not run, and its
evidence) and one measured number. The printed table fits 120 columns (long cells wrap inside their column); the
JSON (`rows_to_json`) keeps every field in full.
"""

from __future__ import annotations

import json
import math
import os
import textwrap
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from minillm.core.config import check_instance, check_int, short_repr


@dataclass
class Row:
    chapter: str  # "01" .. "15"
    technique: str  # what the optimized path is, e.g. "incremental BPE training"
    baseline: str  # what it is checked and measured against, e.g. "naive recount trainer"
    optimized: str  # the optimized path's name
    check: str  # the evidence of the check, e.g. "identical merges, 512/512"
    check_passed: bool
    metric: str  # what `value` measures, e.g. "speed-up", "encode MB/s"
    value: float
    unit: str = ""  # "x", "MB/s", "%", ...
    device: str = "cpu"
    details: dict[str, Any] = field(default_factory=dict)  # anything else worth keeping in the JSON
    # The check could not run here (e.g. a reference file is missing): `check` says why, the row is reported as SKIP
    # and neither passes nor fails the tour. A row is never both skipped and passed.
    skipped: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.check_passed, bool):
            raise TypeError(f"Row.check_passed must be a bool, got {type(self.check_passed).__name__}")
        if not isinstance(self.skipped, bool):
            raise TypeError(f"Row.skipped must be a bool, got {type(self.skipped).__name__}")
        if self.skipped and self.check_passed:
            raise ValueError(f"row {self.technique!r} is marked both skipped and passed; a check that did not run "
                             "did not pass")
        self.value = float(self.value)

    @property
    def status(self) -> str:
        """"PASS", "FAIL" or "SKIP"."""
        return "SKIP" if self.skipped else "PASS" if self.check_passed else "FAIL"

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TourContext:
    device: torch.device
    quick: bool = False  # smaller workloads, for a fast smoke run
    corpus_path: str | os.PathLike | None = None  # None = the embedded default corpus
    seed: int = 0
    # torch intra-op threads for the whole tour. One by default: the models are small, so a second thread buys
    # little on an idle machine and, on a shared one, OpenMP threads waiting for each other make small ops many
    # times slower. Baseline and optimized paths always share the setting, so the ratios stay fair.
    threads: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.threads, int) or isinstance(self.threads, bool) or self.threads < 1:
            raise ValueError(f"threads must be a positive int, got {short_repr(self.threads)}")


def check_rows(rows: object) -> list[Row] | tuple[Row, ...]:
    """`rows` if it is a list (or tuple) of Row; a TypeError naming the first entry that is not one (a str would be
    read one character at a time)."""
    if not isinstance(rows, (list, tuple)):
        raise TypeError(f"rows must be a list of Row, got {type(rows).__name__} {short_repr(rows)}")
    for i, row in enumerate(rows):
        check_instance(f"rows[{i}]", row, Row, "a Row")
    return rows


def format_value(value: float, unit: str) -> str:
    if math.isnan(value):
        return "n/a"
    if unit == "x":
        return f"{value:.2f}x"
    if abs(value) >= 100:
        text = f"{value:,.0f}"
    elif abs(value) >= 1:
        text = f"{value:.2f}"
    else:
        text = f"{value:.3g}"
    return f"{text} {unit}".strip()


# Column widths of the printed table: 2 + 26 + 20 + 4 + 36 + 22 characters and five 2-space gaps = 120.
TABLE_COLUMNS = (("ch", 2), ("technique", 26), ("baseline", 20), ("", 4), ("check", 36), ("measured", 22))


def format_table(rows: list[Row], width: int = 120) -> str:
    """A plain-text table that fits `width` columns: chapter, technique, baseline, status, check, measured gain.

    Long cells wrap inside their column, so nothing runs past the terminal's edge; the optimized path's name and the
    details are in the JSON. `width` scales the three text columns (at least the header's widths).
    """
    check_rows(rows)
    width = check_int("width", width)
    if width > 1000:  # each line is padded to about `width` characters
        raise ValueError(f"width must be at most 1000 columns, got {width}")
    fixed = sum(w for _, w in TABLE_COLUMNS) + 2 * (len(TABLE_COLUMNS) - 1)
    scale = max(0.5, (width - (fixed - 26 - 20 - 36)) / (26 + 20 + 36)) if width != 120 else 1.0
    widths = [w if name in ("ch", "", "measured") else max(len(name), int(w * scale)) for name, w in TABLE_COLUMNS]
    header = [name for name, _ in TABLE_COLUMNS]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    for r in rows:
        cells = [r.chapter, r.technique, r.baseline, r.status, r.check, f"{r.metric}: {format_value(r.value, r.unit)}"]
        wrapped = [textwrap.wrap(str(c), w, break_long_words=True, break_on_hyphens=False) or [""]
                   for c, w in zip(cells, widths)]
        for i in range(max(len(c) for c in wrapped)):
            parts = [(c[i] if i < len(c) else "").ljust(w) for c, w in zip(wrapped, widths)]
            lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def summary_line(rows: list[Row]) -> str:
    """"31 passed, 1 skipped, 0 failed": the tour's closing count."""
    check_rows(rows)
    counts = {s: sum(r.status == s for r in rows) for s in ("PASS", "SKIP", "FAIL")}
    return f"{counts['PASS']} passed, {counts['SKIP']} skipped, {counts['FAIL']} failed"


def rows_to_json(rows: list[Row]) -> str:
    return json.dumps([r.to_dict() for r in check_rows(rows)], indent=2)

"""The tour's shared pieces: one results row, the context every chapter entry receives, and the table printer.

A chapter's entry lives in `minillm/<chapter>/tour.py` and exposes `TITLE` and `run(ctx) -> list[Row]`. Each row
states a check against the naive baseline (passed or failed, with its evidence) and one measured number.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch


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

    def __post_init__(self) -> None:
        if not isinstance(self.check_passed, bool):
            raise TypeError(f"Row.check_passed must be a bool, got {type(self.check_passed).__name__}")
        self.value = float(self.value)

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
            raise ValueError(f"threads must be a positive int, got {self.threads!r}")


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


def format_table(rows: list[Row]) -> str:
    """A plain-text table: chapter, technique, baseline, optimized, check, measured gain."""
    header = ["ch", "technique", "baseline", "optimized", "check", "measured"]
    body = [
        [
            r.chapter,
            r.technique,
            r.baseline,
            r.optimized,
            ("PASS " if r.check_passed else "FAIL ") + r.check,
            f"{r.metric}: {format_value(r.value, r.unit)}",
        ]
        for r in rows
    ]
    widths = [max(len(str(line[i])) for line in [header] + body) for i in range(len(header))]
    fmt = lambda line: "  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip()  # noqa: E731
    sep = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(header), sep] + [fmt(line) for line in body])


def rows_to_json(rows: list[Row]) -> str:
    return json.dumps([r.to_dict() for r in rows], indent=2)

"""`minillm tour`: every chapter's check against its naive baseline and its measured gain, in one table.

Each built chapter of the manifest (`minillm.chapters`) has a tour entry in its own package, `minillm/<package>/tour.py`,
with `TITLE` and `run(ctx) -> list[Row]`. A chapter whose entry raises is reported as a failed row (the tour goes on
with the others) and the tour exits non-zero.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import time
import traceback
from types import ModuleType

import torch
from tqdm.auto import tqdm

from minillm import chapters
from minillm.chapters import normalize
from minillm.core.rows import Row, TourContext, format_table, rows_to_json

__all__ = ["Row", "TourContext", "available_chapters", "run_tour", "format_table", "rows_to_json"]


def available_chapters() -> dict[str, ModuleType]:
    """{"01": tour module, ...} for every built chapter of the manifest, in chapter order."""
    return {c.number: importlib.import_module(c.tour) for c in chapters.built()}


# Hugging Face's loggers: the library's root, and its continuous-batching manager's own (not under the root).
HF_LOGGERS = ("transformers", "ContinuousBatchingLogger")


@contextlib.contextmanager
def quiet_third_party_logs():
    """Silence Hugging Face's advice-level log lines (e.g. about `eos_token_id`) while the tour prints its table.

    The tour runs `transformers` only as a reference; its warnings are about its own defaults and would interleave
    with our rows. Errors still show. Restores the previous level afterwards.
    """
    loggers = [logging.getLogger(name) for name in HF_LOGGERS]
    levels, env = [lg.level for lg in loggers], os.environ.get("TRANSFORMERS_VERBOSITY")
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"  # read when transformers configures its logger on import
    for lg in loggers:  # and set directly, in case it was imported already
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        if env is None:
            os.environ.pop("TRANSFORMERS_VERBOSITY", None)
        else:
            os.environ["TRANSFORMERS_VERBOSITY"] = env


def run_tour(ctx: TourContext, chapters: list[str] | None = None, progress: bool = True) -> tuple[list[Row], dict]:
    """Run the selected chapters (all by default). Returns the rows and {chapter: seconds}."""
    entries = available_chapters()
    # subtle: `chapters` is the argument here, shadowing the manifest module; hence the imported `normalize`.
    selected = [normalize(c) for c in chapters] if chapters else list(entries)
    missing = [c for c in selected if c not in entries]
    if missing:
        raise ValueError(f"no tour entry for chapter(s) {missing}; available: {sorted(entries)}")
    rows: list[Row] = []
    seconds: dict[str, float] = {}
    threads_before = torch.get_num_threads()
    torch.set_num_threads(ctx.threads)
    try:
        with quiet_third_party_logs(), tqdm(total=len(selected), unit="chapter", desc="tour",
                                            disable=not progress) as bar:
            for ch in selected:
                bar.set_postfix_str(f"{ch} {entries[ch].TITLE}")
                t0 = time.perf_counter()
                rows.extend(_run_chapter(ch, entries[ch], ctx))
                seconds[ch] = time.perf_counter() - t0
                bar.update(1)
    finally:
        torch.set_num_threads(threads_before)
    return rows, seconds


def _run_chapter(ch: str, module: ModuleType, ctx: TourContext) -> list[Row]:
    """The chapter's rows; an entry that raises becomes one failed row, so it cannot hide the others' results."""
    try:
        return list(module.run(ctx))
    except Exception as exc:
        return [
            Row(
                chapter=ch,
                technique=module.TITLE,
                baseline="-",
                optimized="-",
                check=f"error: {type(exc).__name__}: {exc}",
                check_passed=False,
                metric="error",
                value=float("nan"),
                device=str(ctx.device),
                details={"traceback": traceback.format_exc()},
            )
        ]

"""Timing done one way everywhere: warm-up, repeats, the median, and baseline/candidate interleaved.

Every speed-up minillm prints is a ratio of two medians measured side by side in one process by `compare`, so
a machine that is busier during one half of the run cannot flatter or punish the other half. Nothing here is
ever asserted in a test; tests check correctness, benchmarks report these numbers.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from minillm.core.config import check_int, plain_number, short_repr
from minillm.core.device import synchronize


@dataclass
class Timing:
    times: list[float] = field(default_factory=list)  # seconds, one per repeat, in order

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def min(self) -> float:
        return min(self.times)

    def to_dict(self) -> dict[str, Any]:
        return {"median_s": self.median, "min_s": self.min, "times_s": list(self.times)}


@dataclass
class Comparison:
    baseline: Timing
    candidate: Timing

    @property
    def speedup(self) -> float:
        """baseline median / candidate median: above 1 means the candidate is faster."""
        return self.baseline.median / self.candidate.median

    def to_dict(self) -> dict[str, Any]:
        return {"baseline": self.baseline.to_dict(), "candidate": self.candidate.to_dict(), "speedup": self.speedup}


# The most untimed or timed calls one measurement makes: past it a count is a typo (2**64 repeats would fill memory
# with their times before the median), not a benchmark.
MAX_REPEATS = 100_000


def _check_count(name: str, count: Any, what: str, minimum: int = 1) -> int:
    count = check_int(name, count, minimum)
    if count > MAX_REPEATS:
        raise ValueError(f"{name} must be at most {MAX_REPEATS}{what}, got {count}")
    return count


def check_calls(name: str, calls: Any) -> int:
    """`calls` (how many times one timed repeat calls the op) as the plain int it holds, in [1, MAX_REPEATS]; a
    TypeError / ValueError naming `name` otherwise (2**63 calls would collect outputs until memory ran out)."""
    return _check_count(name, calls, " calls per timed repeat")


def check_repeats(name: str, repeats: Any) -> int:
    """`repeats` (how many times a benchmark runs what it measures: timed repeats, or a sampling test's draws) as
    the plain int it holds, in [1, MAX_REPEATS]; a TypeError / ValueError naming `name` otherwise, before any setup
    (2**40 repeats is a loop that never ends, not a benchmark)."""
    return _check_count(name, repeats, "")


def check_warmup(name: str, warmup: Any) -> int:
    """`warmup` (untimed calls before the timed ones) as the plain int it holds, in [0, MAX_REPEATS]; a TypeError /
    ValueError naming `name` otherwise."""
    return _check_count(name, warmup, "", minimum=0)


def _check(warmup: int, repeats: int) -> None:
    warmup, repeats = plain_number(warmup), plain_number(repeats)  # an int subclass's comparisons are not consulted
    if not isinstance(warmup, int) or isinstance(warmup, bool) or not 0 <= warmup <= MAX_REPEATS:
        raise ValueError(f"warmup must be an int in [0, {MAX_REPEATS}], got {short_repr(warmup)}")
    if not isinstance(repeats, int) or isinstance(repeats, bool) or not 1 <= repeats <= MAX_REPEATS:
        raise ValueError(f"repeats must be an int in [1, {MAX_REPEATS}], got {short_repr(repeats)}")


def time_once(fn: Callable[[], Any], device: torch.device | str | None = None) -> tuple[float, Any]:
    """Run fn once; return (seconds, result). On CUDA the clock stops only after the GPU is done."""
    if device is not None:
        synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device is not None:
        synchronize(device)
    return time.perf_counter() - t0, out


def measure(fn: Callable[[], Any], warmup: int = 1, repeats: int = 5, device: torch.device | str | None = None) -> Timing:
    """Median-of-repeats timing of a zero-argument callable, after `warmup` untimed calls."""
    _check(warmup, repeats)
    for _ in range(warmup):
        fn()
    return Timing([time_once(fn, device)[0] for _ in range(repeats)])


def interleave(fns: Sequence[Callable[[], Any]], warmup: int = 1, repeats: int = 5,
               device: torch.device | str | None = None) -> list[Timing]:
    """Time several callables in turn (a, b, c, a, b, c, ...), one Timing each, so all see the same machine."""
    _check(warmup, repeats)
    if len(fns) == 0:
        raise ValueError("interleave needs at least one callable")
    for _ in range(warmup):
        for fn in fns:
            fn()
    timings = [Timing() for _ in fns]
    for _ in range(repeats):
        for fn, t in zip(fns, timings):
            t.times.append(time_once(fn, device)[0])
    return timings


def compare(
    baseline_fn: Callable[[], Any],
    candidate_fn: Callable[[], Any],
    warmup: int = 1,
    repeats: int = 5,
    device: torch.device | str | None = None,
) -> Comparison:
    """Time baseline and candidate alternately (b, c, b, c, ...) so both see the same machine conditions."""
    base, cand = interleave([baseline_fn, candidate_fn], warmup, repeats, device)
    return Comparison(base, cand)

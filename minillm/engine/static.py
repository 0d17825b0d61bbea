"""The baseline: chapter 04's static batching run over a whole workload, batch after batch, with token timings.

`run_static` takes requests in arrival order, `batch_size` at a time, and runs each group through
`minillm.kvcache.generate.generate_static_batch` to completion before the next group starts: a group lives as
long as its longest request, finished rows keep computing, and nobody joins mid-way. That is the request-level
scheduling Orca replaced (Yu et al. 2022, §2.2). Its per-token timestamps feed the same metrics as the engine's.
What it leaves out: arrival times (it is an offline baseline: every request is there at t=0).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

from minillm.core.config import short_repr
from minillm.kvcache.generate import generate_static_batch
from minillm.core.model import GPT
from minillm.core.sampling import SamplingParams


@dataclass
class StaticResult:
    output_token_ids: list[list[int]]  # per request, in input order
    token_times: list[list[float]] = field(default_factory=list)  # perf_counter() per output token
    start_time: float = 0.0
    num_batches: int = 0


def run_static(
    model: GPT,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    batch_size: int,
    tokenizer=None,
    eos_id: int | None = None,
) -> StaticResult:
    """All requests, `batch_size` at a time in order, each batch with `generate_static_batch` to its end."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {short_repr(batch_size)}")
    n = len(prompts)
    params_list = [params] * n if isinstance(params, SamplingParams) else list(params)
    if len(params_list) != n:
        raise ValueError(f"got {len(params_list)} SamplingParams for {n} prompts")
    outputs: list[list[int]] = []
    times: list[list[float]] = [[] for _ in range(n)]
    start = time.perf_counter()
    num_batches = 0
    for lo in range(0, n, batch_size):
        hi = min(n, lo + batch_size)

        def on_token(row: int, token: int, lo: int = lo) -> None:
            times[lo + row].append(time.perf_counter())

        outputs += generate_static_batch(model, list(prompts[lo:hi]), params_list[lo:hi], tokenizer, eos_id,
                                         on_token=on_token)
        num_batches += 1
    return StaticResult(outputs, times, start, num_batches)

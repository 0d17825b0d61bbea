"""One driver that serves a workload to any engine over time: chapters 06 and 07 measure through it.

Adds `drive(engine, workload)`: each request joins at its arrival time (open loop, as a server sees them: a closed
loop would hide queueing) or all at t=0 (`realtime=False`, offline), and the engine is stepped until every request
finished. An engine is anything with `add_request(prompt_ids, params, request_id=, arrival_time=)`, `step()` and
`has_unfinished()` that streams outputs carrying `request_id`, `finished`, `output_token_ids`, `token_times` and
`arrival_time` (chapter 06's `LLM`, chapter 07's `DisaggregatedLLM`). What it leaves out: closed-loop clients and
request-rate sweeps (chapter 15). `engine_tokens(engine, prompts, params)` is the offline shortcut: every prompt
at once through the engine's `generate`, its output ids back.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from minillm.bench.workload import WorkloadRequest
from minillm.core.metrics import RequestTimes, summarize


class RunStats:
    """Throughput and latency of one run, for any result with `output_token_ids` (per request), `times`
    (`RequestTimes` per request), `duration_s` (wall) and `cpu_s` (process CPU time)."""

    output_token_ids: list[list[int]]
    times: list[RequestTimes]
    duration_s: float
    cpu_s: float

    @property
    def output_tokens(self) -> int:
        return sum(len(o) for o in self.output_token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.duration_s

    @property
    def tokens_per_cpu_s(self) -> float:
        """Output tokens per CPU-second: on a shared, busy machine wall time measures the neighbours too."""
        return self.output_tokens / self.cpu_s

    def summary(self) -> dict[str, Any]:
        return summarize(self.times, duration_s=self.duration_s)


@dataclass
class DriveResult(RunStats):
    outputs: dict[str, Any]  # request id -> final output, in workload order
    times: list[RequestTimes]  # per request, workload order: arrival and every token's timestamp
    start: float  # perf_counter at t = 0 of the workload
    duration_s: float  # wall time from t = 0 until the last request finished
    cpu_s: float  # process CPU time of the run (all threads): the work done, whatever the contention

    @property
    def output_token_ids(self) -> list[list[int]]:
        return [list(o.output_token_ids) for o in self.outputs.values()]


def drive(engine: Any, workload: Sequence[WorkloadRequest], realtime: bool = True,
          step: Callable[[float], list[Any]] | None = None) -> DriveResult:
    """Feed `workload` to `engine` over time and step it until every request finished.

    `step(seconds_until_next_arrival)` runs one engine step and returns its outputs; by default `engine.step()`.
    A caller passes its own to wait on a worker for at most that long, or to record each step for a timeline.
    """
    step = step or (lambda _wait: engine.step())
    pending = sorted(workload, key=lambda r: r.arrival_time)  # subtle: stable, so equal arrivals keep their order
    finals: dict[str, Any] = {}
    c0 = time.process_time()
    t0 = time.perf_counter()
    i = 0
    while i < len(pending) or engine.has_unfinished():
        now = time.perf_counter()
        while i < len(pending) and (not realtime or t0 + pending[i].arrival_time <= now):
            r = pending[i]
            engine.add_request(r.prompt_token_ids, r.params, request_id=r.request_id,
                               arrival_time=t0 + r.arrival_time if realtime else t0)
            i += 1
        until_next = (t0 + pending[i].arrival_time - time.perf_counter()) if i < len(pending) else math.inf
        if not engine.has_unfinished():
            time.sleep(max(0.0, until_next))
            continue
        for out in step(until_next):
            if out.finished:
                finals[out.request_id] = out
    duration, cpu = time.perf_counter() - t0, time.process_time() - c0
    outputs = {r.request_id: finals[r.request_id] for r in workload}
    times = [RequestTimes(o.arrival_time, list(o.token_times), len(o.prompt_token_ids)) for o in outputs.values()]
    return DriveResult(outputs, times, t0, duration, cpu)


def engine_tokens(engine: Any, prompts: Sequence[list[int]], params: Any) -> list[list[int]]:
    """Each prompt's output ids from any engine with `generate(prompts, params)` (chapter 06's `LLM`), all offline:
    what chapters 09 and 10 compare token for token with `generate_ids` of the same model (the engine contract)."""
    return [list(o.output_token_ids) for o in engine.generate(prompts, params)]

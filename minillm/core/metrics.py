"""Serving metrics with vLLM's definitions: TTFT, ITL, TPOT, E2E latency, throughputs, peak memory.

Adds per-request timestamps (`RequestTimes`), the derived latencies, percentile summaries and throughputs computed
exactly as vLLM's serving benchmark does (`vllm bench serve`, `calculate_metrics` in benchmarks/serve.py), and a
peak-memory probe. What it leaves out: goodput against SLOs and request-rate sweeps (chapters 06 and 15).

One request, seen by the client (every timestamp is taken when a token reaches the caller):

    arrival        t_1          t_2     t_3   ...    t_n
      |────TTFT────|──ITL_1─────|─ITL_2─|─ ... ─|      TTFT = t_1 − arrival
      |──────────────────────── E2E ───────────────|   E2E  = t_n − arrival
                                                       TPOT = (E2E − TTFT) / (n − 1) = mean(ITL), 0 when n ≤ 1

TPOT is a per-request mean; ITL is every gap of every request pooled, so their medians and p99s differ.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch

from minillm.core.config import check_float, check_instance, short_repr

PERCENTILES = (50, 90, 99)


@dataclass
class RequestTimes:
    arrival: float  # when the request was sent, seconds on any clock (time.perf_counter in minillm)
    token_times: list[float] = field(default_factory=list)  # when each output token reached the caller, same clock
    prompt_len: int = 0  # input tokens, for total-token throughput

    def record(self, now: float | None = None) -> None:
        """Stamp the arrival of one more output token (now, by default)."""
        self.token_times.append(time.perf_counter() if now is None else now)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times)

    def _need_tokens(self) -> None:
        if not self.token_times:
            raise ValueError("this request produced no tokens: TTFT and E2E latency are undefined")

    @property
    def ttft(self) -> float:
        """Time to first token: first token's arrival − request arrival (prefill plus one sampling step)."""
        self._need_tokens()
        return self.token_times[0] - self.arrival

    @property
    def e2e(self) -> float:
        """End-to-end latency: last token's arrival − request arrival (vLLM's `latency`, reported as E2EL)."""
        self._need_tokens()
        return self.token_times[-1] - self.arrival

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies: the n − 1 gaps between consecutive tokens (the first token is TTFT's, not here)."""
        # BEGIN SOLUTION
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]
        # END SOLUTION

    @property
    def tpot(self) -> float:
        """Time per output token after the first: (E2E − TTFT) / (n − 1), and 0 when n ≤ 1 (as vLLM sets it).

        Written as a difference of the last and first token times divided by n − 1, so TTFT + (n − 1)·TPOT gives
        E2E back exactly whenever the arithmetic is exact (fractions, or dyadic floats with n − 1 a power of two).
        """
        # BEGIN SOLUTION
        n = len(self.token_times)
        if n <= 1:
            return 0.0
        return (self.e2e - self.ttft) / (n - 1)
        # END SOLUTION


def timed_stream(stream: Iterable[int], times: RequestTimes) -> Iterator[int]:
    """Pass tokens through, stamping each one's arrival in `times` as the caller receives it."""
    check_instance("times", times, RequestTimes, "a RequestTimes")
    if isinstance(stream, (str, bytes)) or not isinstance(stream, Iterable):
        raise TypeError(f"stream must be an iterable of token ids, got {type(stream).__name__} {short_repr(stream)}")
    for token in stream:
        times.record()
        yield token


def check_requests(requests: object) -> Sequence[RequestTimes]:
    """`requests` if it is a list or tuple of RequestTimes; a TypeError naming the first entry that is not one."""
    if not isinstance(requests, (list, tuple)):
        raise TypeError(f"requests must be a list of RequestTimes, got {type(requests).__name__} "
                        f"{short_repr(requests)}")
    for i, r in enumerate(requests):
        check_instance(f"requests[{i}]", r, RequestTimes, "a RequestTimes")
    return requests


def _stats(values: Sequence[float], name: str, percentiles: Sequence[float]) -> dict[str, float]:
    """vLLM's summary of one metric in milliseconds: mean, median, std, and the requested percentiles."""
    ms = np.asarray([float(v) for v in values], dtype=np.float64) * 1000.0
    if ms.size == 0:  # vLLM reports 0 when nothing was measured (e.g. TPOT when every request has one token)
        ms = np.zeros(1)
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(ms.std())}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p))  # linear interpolation, numpy's and vLLM's default
    return out


def throughput(requests: Sequence[RequestTimes], duration_s: float) -> dict[str, float]:
    """Requests/s, output tokens/s and (input + output) tokens/s over a run of `duration_s` seconds."""
    check_requests(requests)
    duration_s = check_float("duration_s", duration_s, 0.0, include_minimum=False)
    total_out = sum(r.num_output_tokens for r in requests)
    total_in = sum(r.prompt_len for r in requests)
    return {
        "request_throughput": len(requests) / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
    }


def summarize(
    requests: Sequence[RequestTimes], duration_s: float | None = None, percentiles: Sequence[float] = PERCENTILES
) -> dict[str, Any]:
    """The serving benchmark's numbers for a set of completed requests, keyed as vLLM keys them.

    `duration_s` is the benchmark's wall time; by default the span from the first arrival to the last token.
    TPOT statistics cover the requests with more than one output token; ITL statistics pool all gaps.
    """
    if len(check_requests(requests)) == 0:
        raise ValueError("summarize needs at least one request")
    if duration_s is None:
        duration_s = float(max(r.token_times[-1] for r in requests if r.token_times) - min(r.arrival for r in requests))
    out: dict[str, Any] = {
        "completed": len(requests),
        "total_input": sum(r.prompt_len for r in requests),
        "total_output": sum(r.num_output_tokens for r in requests),
        "duration_s": duration_s,
        **throughput(requests, duration_s),
    }
    out.update(_stats([r.ttft for r in requests], "ttft", percentiles))
    out.update(_stats([r.tpot for r in requests if r.num_output_tokens > 1], "tpot", percentiles))
    out.update(_stats([gap for r in requests for gap in r.itl], "itl", percentiles))
    out.update(_stats([r.e2e for r in requests], "e2el", percentiles))
    return out


class PeakMemory:
    """Peak memory of the code inside `with PeakMemory(device) as pm:`; then `pm.bytes` and `pm.source`.

    CUDA: `torch.cuda.max_memory_allocated` (tensors only, reset on entry). CPU: the process's peak resident set
    (weights, activations, the Python heap, everything): Linux's VmHWM, reset on entry through /proc/self/clear_refs;
    where that is not possible, `resource.getrusage` ru_maxrss, the peak since the process started. tracemalloc is
    not used: it sees only Python's allocator, not the memory PyTorch allocates for tensors.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.bytes: int | None = None
        self.source = ""
        self._reset_ok = False

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            try:  # writing "5" resets the peak RSS (VmHWM) to the current RSS (Linux >= 4.0)
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
                self._reset_ok = _vm_hwm() is not None
            except OSError:
                self._reset_ok = False
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = int(torch.cuda.max_memory_allocated(self.device))
            self.source = "torch.cuda.max_memory_allocated"
        elif self._reset_ok:
            self.bytes = _vm_hwm()
            self.source = "peak RSS (VmHWM, reset on entry)"
        else:
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            self.bytes = int(rss if sys.platform == "darwin" else rss * 1024)  # macOS reports bytes, Linux KiB
            self.source = "peak RSS (ru_maxrss, since process start)"


def _vm_hwm() -> int | None:
    """VmHWM from /proc/self/status in bytes, or None off Linux."""
    if not os.path.exists("/proc/self/status"):
        return None
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # "VmHWM:   123456 kB"
    return None

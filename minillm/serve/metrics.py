"""What `/metrics` says, in Prometheus' text format, through `prometheus-client`.

Each server has its own `CollectorRegistry` (two servers in one process, as in the tests, never mix counts). The
names follow vLLM's where they mean the same thing (`vllm:time_to_first_token_seconds` is
`minillm_time_to_first_token_seconds` here), so a dashboard built for one reads the other with a prefix changed.

- counted by the server: requests by outcome, prompt and generated tokens, and three latency histograms observed
  when a request ends — TTFT (arrival to first token), ITL (each gap between consecutive tokens) and E2E (arrival
  to the last output), all from the engine's own timestamps, so they exclude the network;
- read from the engine's last snapshot at scrape time: running, waiting and swapped requests, KV blocks in use and
  in all, steps, preemptions, prefix-cache hits; and the admission queue: requests and tokens in flight.

Outcomes: "stop", "length" (finished), "error" (failed alone), "abort" (aborted by the server), "timeout",
"disconnected", and the refused ones "invalid" (400), "context_length_exceeded" (400), "overloaded" (429),
"unavailable" (503).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from minillm.core.config import check_choice, check_float, check_instance
from minillm.engine.request import RequestOutput

disable_created_metrics()  # no "_created" timestamp series beside every counter: vLLM's /metrics has none either

OUTCOMES = ("stop", "length", "error", "abort", "timeout", "disconnected", "invalid", "context_length_exceeded",
            "overloaded", "unavailable")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)


class _EngineCollector:
    """Gauges and counters read from the engine's last snapshot when Prometheus scrapes."""

    def __init__(self, server: Any):
        self.server = server

    def collect(self) -> Any:
        snap, eng = self.server.engine.snapshot, self.server.engine
        gauges = {
            "num_requests_running": ("requests the engine is running", snap.running),
            "num_requests_waiting": ("requests waiting in the engine's queue", snap.waiting),
            "num_requests_swapped": ("requests preempted to CPU memory", snap.swapped),
            "kv_blocks_used": ("KV blocks held by requests", snap.num_blocks - snap.num_free_blocks),
            "kv_blocks_total": ("KV blocks in the pool", snap.num_blocks),
            "kv_cache_usage_ratio": ("fraction of KV blocks held",
                                     (snap.num_blocks - snap.num_free_blocks) / max(snap.num_blocks, 1)),
            "queued_requests": ("samples in flight: accepted by the server, not finished", eng.queued_requests),
            "queued_tokens": ("tokens (prompt + max_tokens) of the samples in flight", eng.queued_tokens),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"minillm_{name}", doc, value=value)
        counters = {
            "engine_steps": ("engine steps run", snap.num_steps),
            "num_preemptions": ("preemptions (recompute or swap)", snap.num_preemptions),
            "prefix_cache_hits": ("KV blocks reused from the prefix cache", snap.prefix_cache_hits),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"minillm_{name}", doc, value=value)


class ServerMetrics:
    """The server's Prometheus metrics; `render()` is the `/metrics` body."""

    def __init__(self, server: Any):
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter("minillm_requests", "HTTP requests to the completion endpoints, by outcome",
                                ["outcome"], registry=reg)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # every outcome appears, at 0, from the start
        self.prompt_tokens = Counter("minillm_prompt_tokens", "prompt tokens of accepted requests", registry=reg)
        self.generation_tokens = Counter("minillm_generation_tokens", "tokens generated", registry=reg)
        self.ttft = Histogram("minillm_time_to_first_token_seconds", "arrival to the first output token",
                              buckets=LATENCY_BUCKETS, registry=reg)
        self.itl = Histogram("minillm_inter_token_latency_seconds", "between consecutive output tokens",
                             buckets=LATENCY_BUCKETS, registry=reg)
        self.e2e = Histogram("minillm_e2e_request_latency_seconds", "arrival to the final output",
                             buckets=LATENCY_BUCKETS, registry=reg)
        reg.register(_EngineCollector(server))

    def outcome(self, name: str) -> None:
        """Count one finished HTTP request under `name`, one of OUTCOMES (another would be a new series)."""
        self.requests.labels(check_choice("name", name, OUTCOMES)).inc()

    def observe_output(self, out: Any) -> None:
        """Every output: its new tokens count at once (a dashboard shows tokens/s while requests run)."""
        check_instance("out", out, RequestOutput, "an engine RequestOutput")
        self.generation_tokens.inc(len(out.new_token_ids))

    def observe_final(self, out: Any, end: float) -> None:
        """A sample's final output: its latencies (engine timestamps, perf_counter seconds)."""
        check_instance("out", out, RequestOutput, "an engine RequestOutput")
        end = check_float("end", end)
        if out.ttft is not None:
            self.ttft.observe(out.ttft)
        for gap in out.itl:
            self.itl.observe(gap)
        self.e2e.observe(max(end - out.arrival_time, 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def parse_metrics(text: str) -> dict[str, float]:
    """A `/metrics` body as {"name{labels}": value} (tests and the dashboard test compare against it)."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a /metrics body as a str (decode bytes first), got {type(text).__name__}")
    values: dict[str, float] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                values[name] = float(value)
            except ValueError:
                raise ValueError(f"text line {number} is not `name{{labels}} value`: {line!r:.120}") from None
            if not name:
                raise ValueError(f"text line {number} is not `name{{labels}} value`: {line!r:.120}")
    return values

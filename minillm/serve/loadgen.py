"""`minillm bench-serve`: a load generator for an OpenAI-compatible server, in the manner of vLLM's serving benchmark.

What it adds: the client side of chapter 15. Chapter 06 measured the engine offline (every prompt handed over at
once, timed inside the process); a server is measured from outside, by a client that sends requests over HTTP at
a chosen pace and times what comes back on the wire:

    Workload (seeded prompts + output lengths)
      -> arrivals: Poisson or gamma gaps at a rate, all at once (rate inf), and/or at most C in flight
      -> client: one streamed /v1/completions request each (openai.AsyncOpenAI, or raw httpx reading the SSE)
      -> RequestRecord per request: send time, the time of every chunk carrying text, tokens, success, error type
      -> metrics, pure functions of the records: TTFT, TPOT, ITL, E2E (mean, std, p50, p90, p99), throughput,
         errors by type, goodput in vLLM's sense (req/s meeting every SLO) and DistServe's (the highest rate at
         which 90% of requests meet them, found by `goodput_search`)

The definitions, written once (every time in seconds; `send` is when the request left the client, after any wait
for a concurrency slot; `chunk[k]` is when the k-th chunk with non-empty text arrived; n is the request's output
tokens, from the server's `usage` when it sends one, else the count of text chunks):
    TTFT = chunk[0] - send                 time to first token: queueing + prefill + the network, as a user sees it
    E2E  = chunk[-1] - send                end-to-end latency, to the last token's text
    TPOT = (E2E - TTFT) / (n - 1)          time per output token after the first, one value per request, n >= 2
    ITL  = chunk[k+1] - chunk[k]           inter-token latency: every gap, pooled over all requests (a chunk may
                                           carry several tokens when the server holds text back, e.g. a partial
                                           UTF-8 character; then one gap spans them, as in vLLM's ITL)
    request throughput      = successful requests / duration
    output token throughput = output tokens of successful requests / duration
    total token throughput  = (prompt + output tokens) of successful requests / duration
    duration                = from the first scheduled arrival to the end of the last request
    goodput (vLLM)          = successful requests meeting every given SLO / duration, in req/s
    SLO attainment          = the fraction of all requests (failed ones included, as misses) meeting every SLO
    goodput (DistServe)     = the highest request rate whose SLO attainment is >= 90%
Latency statistics are over successful requests only; a failed request counts in the errors, by type: its HTTP
status ("429", "503"), "timeout", "stream:<code>" for an error event inside a 200 stream, the exception's class
name ("APIConnectionError"), or "cancelled" / "not_sent" for what the run's own time limit cut short.

Every request asks for greedy decoding, max_tokens = its output length and vLLM's `ignore_eos: true`, so each
generates exactly that many tokens and the work is fixed in advance: two servers, or a server and the offline
engine (`offline_throughput`), compare on equal terms.

What it leaves out (vLLM's benchmark has them): datasets from real traces (ShareGPT, sonnet, Azure), chat and
multimodal requests, ramping the rate up during a run, per-request sampling parameters, and a profiler hook. With
`--serve` the server runs as `minillm serve` in a child process (`ServerProcess`), as it would be deployed: the
client and the server do not share an interpreter, though on a small machine they still share its cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Sequence
import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import numpy as np
import openai
import torch

from minillm.bench.cli import threads_argument
from minillm.bench.models import load_model
from minillm.core.config import check_choice, check_instance, check_label, number_kind, reads_report, short_repr
from minillm.core.corpus import SEPARATOR
from minillm.core.device import DEVICE_CHOICES, resolve_device
from minillm.core.io import atomic_write_text, check_output_file
from minillm.core.sampling import SamplingParams, seed_argument
from minillm.engine import LLM, EngineConfig
from minillm.gpt.dataset import default_eval_tokens
from minillm.serve import plots
from minillm.serve.cli import ServerProcess
from minillm.tokenizer import load_tokenizer

DATASETS = ("default", "shared-prefix")
BACKENDS = ("openai", "http")
DEFAULT_CONTEXT = 256  # tokens: the shipped models' context window (a server's /v1/models says its own)
DEFAULT_INPUT_LEN = (80, 160)  # prompt tokens, drawn uniformly in [lo, hi]
DEFAULT_OUTPUT_LEN = 64  # tokens generated per request
DEFAULT_PREFIX_LEN = 64  # tokens every shared-prefix prompt starts with
GOODPUT_ATTAINMENT = 0.9  # DistServe's target: 90% of requests meet every SLO
WINDOW_TRIES = 1000  # random corpus windows tried per prompt before giving up (only separator-free ones are kept)


# ============================================================================================ argument checks


MAX_REQUESTS = 10**7  # a workload's most requests: far past any benchmark, short of numpy's MemoryError


def _check_int(name: str, value: Any, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {number_kind(value)}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def _check_positive(name: str, value: Any, allow_inf: bool = False) -> float:
    """A real number > 0 (inf only when `allow_inf`); NaN, bools and strings refused, naming `name`."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {number_kind(value)}")
    if math.isnan(value) or value <= 0 or (math.isinf(value) and not allow_inf):
        raise ValueError(f"{name} must be a positive {'number' if allow_inf else 'finite number'}, got "
                         f"{short_repr(value)}")
    return float(value)


def _check_len_range(name: str, value: Any) -> tuple[int, int]:
    """An int n (meaning [n, n]) or a pair (lo, hi) of ints with 1 <= lo <= hi."""
    pair = (value, value) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise TypeError(f"{name} must be an int or a (lo, hi) pair of ints, got {short_repr(value)}")
    lo, hi = (_check_int(name, v, 1) for v in pair)
    if lo > hi:
        raise ValueError(f"{name} must have lo <= hi, got {short_repr(value)}")
    return lo, hi


# ============================================================================================ workloads


@dataclass
class Workload:
    """What a benchmark sends: one prompt and one fixed output length per request, drawn from `seed`."""

    dataset: str  # "default" or "shared-prefix"
    prompts: list[str]  # the prompt texts, in request order
    prompt_lens: list[int]  # tokens of each prompt by the shipped tokenizer: what the server will count
    output_lens: list[int]  # max_tokens of each request; with ignore_eos exactly that many tokens are generated
    seed: int
    shared_prefix_len: int = 0  # tokens every prompt starts with (the longest common token prefix, measured)

    def __post_init__(self) -> None:
        if not isinstance(self.dataset, str):
            raise TypeError(f"Workload.dataset must be a str naming where the prompts came from, got {self.dataset!r}")
        for name in ("prompts", "prompt_lens", "output_lens"):
            if not isinstance(getattr(self, name), list):
                raise TypeError(f"Workload.{name} must be a list, got {type(getattr(self, name)).__name__}")
        n = len(self.prompts)
        if n == 0 or len(self.prompt_lens) != n or len(self.output_lens) != n:
            raise ValueError(f"a workload needs as many prompt_lens and output_lens as prompts (>= 1), got "
                             f"{n} prompts, {len(self.prompt_lens)} prompt_lens, {len(self.output_lens)} output_lens")
        for i, prompt in enumerate(self.prompts):
            if not isinstance(prompt, str) or not prompt:
                raise TypeError(f"Workload.prompts[{i}] must be a non-empty str (a prompt's text), got "
                                f"{short_repr(prompt)}")
        for i, (prompt_len, output_len) in enumerate(zip(self.prompt_lens, self.output_lens)):
            _check_int(f"Workload.prompt_lens[{i}]", prompt_len, 1)
            _check_int(f"Workload.output_lens[{i}]", output_len, 1)  # max_tokens: a request asks for one or more
        _check_int("Workload.seed", self.seed, 0)
        _check_int("Workload.shared_prefix_len", self.shared_prefix_len, 0)

    def __len__(self) -> int:
        return len(self.prompts)


def _fit_text(tokenizer: Any, text: str, max_len: int) -> tuple[str, int]:
    """`text` cut until it encodes to at most `max_len` tokens; returns (text, its token count).

    Decoding a window of token ids and encoding the text again gives back about as many ids, not always the same
    number (merges at the edges, a multi-byte character torn at a window's edge): the count that matters is the
    server's, which encodes the text with this same tokenizer.
    """
    ids = tokenizer.encode(text)
    while len(ids) > max_len:
        if max_len < 1:
            raise ValueError("a prompt could not be cut to fit the context")
        text = tokenizer.decode(ids[:max_len]).strip("\ufffd")
        ids = tokenizer.encode(text)
        max_len -= 1  # subtle: if the cut text re-encodes longer again, cut one more token next time
    return text, len(ids)


def _text_window(tokens: np.ndarray, length: int, separator_id: int | None, rng: np.random.Generator,
                 tokenizer: Any) -> str:
    """A random stretch of `length` corpus tokens inside one file (no `<|endoftext|>`), decoded to text."""
    for _ in range(WINDOW_TRIES):
        start = int(rng.integers(0, len(tokens) - length))
        window = tokens[start:start + length]  # (length,) token ids
        if separator_id is None or not (window == separator_id).any():
            # a window's first or last character may be torn (U+FFFD): dropped, so the prompt is clean text
            text = tokenizer.decode(window.tolist()).strip("\ufffd")
            if text.strip():
                return text
    raise ValueError(f"found no stretch of {length} tokens inside one corpus file in {WINDOW_TRIES} tries")


def _corpus(tokenizer: Any) -> tuple[np.ndarray, int | None]:
    """The default corpus' validation tokens (shipped tokenizer) and the separator's id."""
    tokens = default_eval_tokens().numpy()  # (N,) int64
    return tokens, getattr(tokenizer, "special_tokens", {}).get(SEPARATOR)


def _check_tokenizer(tokenizer: Any) -> Any:
    """`tokenizer` (None: the shipped one), or a TypeError unless it can encode and decode."""
    if tokenizer is None:
        return load_tokenizer()
    if not (callable(getattr(tokenizer, "encode", None)) and callable(getattr(tokenizer, "decode", None))):
        raise TypeError(f"tokenizer must have encode(text) and decode(ids) (the shipped tokenizer's), got "
                        f"{type(tokenizer).__name__}")
    return tokenizer


def _check_fits(input_len: tuple[int, int], output_len: int, context_length: int) -> None:
    _check_int("context_length", context_length, 2)  # one prompt token and one generated, at least
    if input_len[1] + output_len > context_length:
        raise ValueError(f"input_len up to {input_len[1]} + output_len {output_len} exceeds the context of "
                         f"{context_length} tokens: every prompt must fit with its output")


def default_dataset(num_prompts: int, input_len: int | tuple[int, int] = DEFAULT_INPUT_LEN,
                    output_len: int = DEFAULT_OUTPUT_LEN, seed: int = 0, tokenizer: Any = None,
                    context_length: int = DEFAULT_CONTEXT) -> Workload:
    """`num_prompts` prompts cut at random from the default corpus (the stdlib's validation files).

    Each prompt's length is drawn uniformly in `input_len` (tokens), then measured with the shipped tokenizer and
    cut if needed so that prompt + `output_len` fits `context_length`. Same arguments, same prompts.
    """
    _check_int("num_prompts", num_prompts, 1)
    if num_prompts > MAX_REQUESTS:
        raise ValueError(f"num_prompts must be at most {MAX_REQUESTS}, got {num_prompts}")
    lo, hi = _check_len_range("input_len", input_len)
    _check_int("output_len", output_len, 1)
    _check_int("seed", seed, 0)
    _check_fits((lo, hi), output_len, context_length)
    tokenizer = _check_tokenizer(tokenizer)
    tokens, sep = _corpus(tokenizer)
    rng = np.random.default_rng([seed, 0])
    prompts, lens = [], []
    for length in rng.integers(lo, hi + 1, size=num_prompts):
        text, n = _fit_text(tokenizer, _text_window(tokens, int(length), sep, rng, tokenizer),
                            min(int(length), context_length - output_len))
        prompts.append(text)
        lens.append(n)
    return Workload("default", prompts, lens, [output_len] * num_prompts, seed)


def common_prefix_len(token_lists: Sequence[Sequence[int]]) -> int:
    """How many leading tokens every list shares (what a prefix cache can reuse, in whole blocks)."""
    if isinstance(token_lists, (str, bytes)) or not isinstance(token_lists, Sequence) or not all(
            isinstance(t, Sequence) and not isinstance(t, (str, bytes)) for t in token_lists):
        raise TypeError(f"token_lists must be a list of token id lists, got {short_repr(token_lists)}")
    if not token_lists:
        raise ValueError("token_lists is empty: the common prefix of no lists is undefined")
    first = token_lists[0]
    n = min(len(t) for t in token_lists)
    for i in range(n):
        if any(t[i] != first[i] for t in token_lists):
            return i
    return n


def shared_prefix_dataset(num_prompts: int, input_len: int | tuple[int, int] = DEFAULT_INPUT_LEN,
                          output_len: int = DEFAULT_OUTPUT_LEN, prefix_len: int = DEFAULT_PREFIX_LEN, seed: int = 0,
                          tokenizer: Any = None, context_length: int = DEFAULT_CONTEXT) -> Workload:
    """One common prefix of `prefix_len` corpus tokens, then a distinct corpus suffix per prompt.

    The whole prompt's length is drawn in `input_len` (so prefix_len must be below its lower end); the suffixes
    come from other places of the corpus. With the server's prefix cache on (`minillm serve
    --enable-prefix-caching`), the prefix's full blocks are computed once and shared. The shared length is
    measured on the token ids (`shared_prefix_len`): the tokenizer may merge the prefix's last token with the
    suffix's first, so it can be a token short of `prefix_len`.
    """
    _check_int("num_prompts", num_prompts, 1)
    if num_prompts > MAX_REQUESTS:
        raise ValueError(f"num_prompts must be at most {MAX_REQUESTS}, got {num_prompts}")
    lo, hi = _check_len_range("input_len", input_len)
    _check_int("output_len", output_len, 1)
    _check_int("prefix_len", prefix_len, 1)
    _check_int("seed", seed, 0)
    if prefix_len >= lo:
        raise ValueError(f"prefix_len {prefix_len} must be below input_len's lower end {lo}: every prompt needs a "
                         f"suffix of its own")
    _check_fits((lo, hi), output_len, context_length)
    tokenizer = _check_tokenizer(tokenizer)
    tokens, sep = _corpus(tokenizer)
    rng = np.random.default_rng([seed, 1])
    prefix, _ = _fit_text(tokenizer, _text_window(tokens, prefix_len, sep, rng, tokenizer), prefix_len)
    prompts, lens, ids = [], [], []
    for length in rng.integers(lo, hi + 1, size=num_prompts):
        suffix = _text_window(tokens, int(length) - prefix_len, sep, rng, tokenizer)
        text, n = _fit_text(tokenizer, prefix + suffix, min(int(length), context_length - output_len))
        prompts.append(text)
        lens.append(n)
        ids.append(tokenizer.encode(text))
    return Workload("shared-prefix", prompts, lens, [output_len] * num_prompts, seed, common_prefix_len(ids))


def make_workload(dataset: str = "default", num_prompts: int = 64, input_len: int | tuple[int, int] = DEFAULT_INPUT_LEN,
                  output_len: int = DEFAULT_OUTPUT_LEN, seed: int = 0, prefix_len: int = DEFAULT_PREFIX_LEN,
                  tokenizer: Any = None, context_length: int = DEFAULT_CONTEXT) -> Workload:
    """The workload of one of DATASETS ("default" or "shared-prefix")."""
    if dataset == "default":
        return default_dataset(num_prompts, input_len, output_len, seed, tokenizer, context_length)
    if dataset == "shared-prefix":
        return shared_prefix_dataset(num_prompts, input_len, output_len, prefix_len, seed, tokenizer, context_length)
    raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")


# ============================================================================================ arrivals


def interarrival_gaps(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """`n` seeded gaps (seconds) between consecutive requests, as vLLM draws them; shape (n,).

    Gamma-distributed with shape k = `burstiness` and scale 1 / (rate * k): the mean gap is 1/rate whatever k, and
    the coefficient of variation is 1/sqrt(k). k = 1 is the exponential distribution (a Poisson process); k < 1 is
    burstier (many short gaps, a few long ones), k > 1 more regular. rate = inf: every gap is 0 (all at once).
    """
    _check_int("n", n, 0)
    if n > MAX_REQUESTS:  # one float per request: 2**40 of them would be numpy's MemoryError
        raise ValueError(f"n must be at most {MAX_REQUESTS} requests, got {n}")
    rate = _check_positive("rate", rate, allow_inf=True)
    burstiness = _check_positive("burstiness", burstiness)
    _check_int("seed", seed, 0)
    if math.isinf(rate):
        return np.zeros(n)
    rng = np.random.default_rng([seed, 2])
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """When each of `n` requests is released, in seconds after the start: the first at 0, then the gaps summed."""
    gaps = interarrival_gaps(n, rate, burstiness, seed)  # (n,)
    return [0.0] + np.cumsum(gaps[:-1]).tolist() if n else []


# ============================================================================================ records and metrics


@dataclass
class SLO:
    """Service-level objectives, in seconds; None leaves that latency unbounded. A request meets the SLO when it
    succeeded and every bound given holds: TTFT <= ttft_s, TPOT <= tpot_s, E2E <= e2e_s."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s", "e2e_s"):
            if getattr(self, name) is not None:
                setattr(self, name, _check_positive(f"SLO.{name}", getattr(self, name)))

    @property
    def empty(self) -> bool:
        return self.ttft_s is None and self.tpot_s is None and self.e2e_s is None


@dataclass
class RequestRecord:
    """What the client saw of one request. Times are seconds after the run's start (time.perf_counter based)."""

    index: int  # which prompt of the workload
    prompt_len: int  # prompt tokens (the server's usage.prompt_tokens when it sent one, else the workload's count)
    max_tokens: int  # the output length asked for
    scheduled_s: float = 0.0  # when the arrival process released it
    send_s: float | None = None  # when it was sent (later than scheduled_s while waiting for a concurrency slot)
    chunk_s: list[float] = field(default_factory=list)  # arrival of each chunk carrying non-empty text
    done_s: float | None = None  # when the response ended: [DONE] read, or the error
    text: str = ""  # the generated text, the chunks joined
    output_tokens: int = 0  # from usage.completion_tokens when present, else the number of text chunks
    success: bool = False
    error: str | None = None  # "429", "timeout", "stream:<code>", "APIConnectionError", "cancelled", ...
    error_message: str = ""

    def __post_init__(self) -> None:
        """Types and times checked once, when a record is made (by the client, by hand, or read back from JSON):
        the metrics below trust them."""
        _check_int("RequestRecord.index", self.index, -1)  # -1: the warm-up request
        for name in ("prompt_len", "max_tokens", "output_tokens"):
            _check_int(f"RequestRecord.{name}", getattr(self, name), 0)
        for name in ("scheduled_s", "send_s", "done_s"):
            value = getattr(self, name)
            if value is not None or name == "scheduled_s":
                _check_time(f"RequestRecord.{name}", value)
        if not isinstance(self.chunk_s, list):
            raise TypeError(f"RequestRecord.chunk_s must be a list of times, got {type(self.chunk_s).__name__}")
        for i, t in enumerate(self.chunk_s):
            _check_time(f"RequestRecord.chunk_s[{i}]", t)
        if any(b < a for a, b in zip(self.chunk_s, self.chunk_s[1:])):
            raise ValueError(f"RequestRecord.chunk_s must be in arrival order (non-decreasing), got {self.chunk_s}")
        if self.chunk_s and self.send_s is not None and self.chunk_s[0] < self.send_s:
            raise ValueError(f"RequestRecord.chunk_s[0]={self.chunk_s[0]} is before send_s={self.send_s}: a chunk "
                             "cannot arrive before its request was sent")
        if not isinstance(self.success, bool):
            raise TypeError(f"RequestRecord.success must be a bool, got {self.success!r}")
        for name in ("text", "error_message"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"RequestRecord.{name} must be a str, got {type(getattr(self, name)).__name__}")
        if self.error is not None and not isinstance(self.error, str):
            raise TypeError(f"RequestRecord.error must be a str or None, got {self.error!r}")


def _check_time(name: str, value: Any) -> None:
    """A time in seconds: a finite real number (bools, strings, NaN and inf refused, naming `name`)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__} {short_repr(value)}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number of seconds, got {value}")


def _check_record(rec: Any) -> RequestRecord:
    if not isinstance(rec, RequestRecord):
        raise TypeError(f"rec must be a RequestRecord, got {type(rec).__name__}")
    return rec


def request_ttft(rec: RequestRecord) -> float | None:
    """TTFT = first text chunk - send, in seconds; None when no text chunk arrived."""
    _check_record(rec)
    return rec.chunk_s[0] - rec.send_s if rec.chunk_s and rec.send_s is not None else None


def request_e2e(rec: RequestRecord) -> float | None:
    """E2E = last text chunk - send, in seconds; None when no text chunk arrived."""
    _check_record(rec)
    return rec.chunk_s[-1] - rec.send_s if rec.chunk_s and rec.send_s is not None else None


def request_tpot(rec: RequestRecord) -> float | None:
    """TPOT = (E2E - TTFT) / (n - 1) for n >= 2 output tokens, in seconds; None for n < 2 (no second token)."""
    ttft, e2e = request_ttft(rec), request_e2e(rec)
    if ttft is None or e2e is None or rec.output_tokens < 2:
        return None
    return (e2e - ttft) / (rec.output_tokens - 1)


def request_itls(rec: RequestRecord) -> list[float]:
    """ITL: the gaps between consecutive text chunks of one request, in seconds; len(chunk_s) - 1 of them."""
    _check_record(rec)
    return np.diff(np.asarray(rec.chunk_s, dtype=np.float64)).tolist() if len(rec.chunk_s) > 1 else []


def _check_records(records: Any) -> list[RequestRecord]:
    if isinstance(records, (str, bytes)) or not isinstance(records, Sequence):
        raise TypeError(f"records must be a sequence of RequestRecord, got {type(records).__name__}")
    for i, rec in enumerate(records):
        if not isinstance(rec, RequestRecord):
            raise TypeError(f"records[{i}] must be a RequestRecord, got {type(rec).__name__}")
    return list(records)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile of `values`, q in [0, 100], by linear interpolation between the closest ranks.

    Sorted x_0 <= ... <= x_{n-1}: the value sits at the fractional rank h = (n - 1) * q / 100; with i = floor(h),
    it is x_i + (h - i) * (x_{i+1} - x_i) (x_{n-1} itself at h = n - 1). This is `numpy.percentile(values, q)`'s
    default method ("linear"): p50 of [1, 2, 3, 4] is 2.5, p90 is 3.7. Empty values, NaN or inf in them, or q
    outside [0, 100] are a ValueError. (A graded exercise, `minillm assignment 15`.)
    """
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
        raise TypeError(f"values must be a sequence of numbers, got {type(values).__name__}")
    if len(values) == 0:
        raise ValueError("values is empty: a percentile of nothing is undefined")
    if not all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) for v in values):
        raise TypeError(f"values must all be numbers, got {list(values)[:5]!r}...")
    if not all(math.isfinite(v) for v in values):
        raise ValueError("values must all be finite numbers (got NaN or inf)")
    if not isinstance(q, (int, float, np.integer, np.floating)) or isinstance(q, bool) or not 0 <= q <= 100:
        raise ValueError(f"q must be a number in [0, 100], got {short_repr(q)}")
    # BEGIN SOLUTION
    xs = sorted(float(v) for v in values)
    h = (q / 100.0) * (len(xs) - 1)  # the fractional rank, in [0, n - 1]
    i = math.floor(h)
    j = min(i + 1, len(xs) - 1)
    t = h - i  # how far from x_i toward x_j
    a, b = xs[i], xs[j]
    # subtle: interpolate from the nearer end, as numpy does, so t close to 1 lands exactly on b
    return a + (b - a) * t if t < 0.5 else b - (b - a) * (1.0 - t)
    # END SOLUTION


def goodput(records: Sequence[RequestRecord], slo: SLO, duration: float) -> float:
    """vLLM's goodput: the requests per second that succeeded AND met every bound `slo` gives, over `duration` s.

    A request meets `slo` when ttft_s is None or TTFT <= ttft_s, tpot_s is None or TPOT <= tpot_s, and e2e_s is
    None or E2E <= e2e_s (see `request_ttft`, `request_tpot`, `request_e2e`). A failed request never counts,
    however fast it failed. A request with one output token has no TPOT (nothing after its first token), so it
    meets any TPOT bound trivially; one with no text chunk has no TTFT or E2E and misses those bounds.
    An SLO with no bound counts every successful request. (A graded exercise, `minillm assignment 15`.)
    """
    records = _check_records(records)
    if not isinstance(slo, SLO):
        raise TypeError(f"slo must be an SLO, got {type(slo).__name__}")
    duration = _check_positive("duration", duration)
    # BEGIN SOLUTION
    good = 0
    for rec in records:
        if not rec.success:
            continue
        ttft, tpot, e2e = request_ttft(rec), request_tpot(rec), request_e2e(rec)
        if slo.ttft_s is not None and (ttft is None or ttft > slo.ttft_s):
            continue
        if slo.tpot_s is not None and tpot is not None and tpot > slo.tpot_s:  # tpot None: one token, met
            continue
        if slo.e2e_s is not None and (e2e is None or e2e > slo.e2e_s):
            continue
        good += 1
    return good / duration
    # END SOLUTION


def slo_attainment(records: Sequence[RequestRecord], slo: SLO) -> float:
    """The fraction of `records` (failed ones included, as misses) that meet `slo`: DistServe's attainment.

    It is `goodput` over a duration of 1 s (a count of good requests) divided by the number of requests.
    """
    records = _check_records(records)
    if not records:
        raise ValueError("records is empty: the attainment of no requests is undefined")
    return goodput(records, slo, 1.0) / len(records)


def latency_stats(values: Sequence[float], scale: float = 1.0) -> dict[str, float] | None:
    """mean, std (population), p50, p90, p99 of `values` times `scale` (1e3: seconds to ms); None when empty."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
        raise TypeError(f"values must be a sequence of numbers, got {type(values).__name__}")
    scale = _check_positive("scale", scale)
    if len(values) == 0:
        return None
    x = np.asarray(values, dtype=np.float64) * scale  # (len(values),)
    xs = x.tolist()
    return {"mean": float(x.mean()), "std": float(x.std()), "p50": percentile(xs, 50), "p90": percentile(xs, 90),
            "p99": percentile(xs, 99)}


def latency_samples(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Per-latency lists over the successful requests, in seconds: ttft_s, tpot_s (n >= 2 only), itl_s (pooled
    gaps of every request), e2e_s."""
    ok = [r for r in _check_records(records) if r.success and r.chunk_s and r.send_s is not None]
    return {
        "ttft_s": [request_ttft(r) for r in ok],
        "tpot_s": [t for t in (request_tpot(r) for r in ok) if t is not None],
        "itl_s": [gap for r in ok for gap in request_itls(r)],
        "e2e_s": [request_e2e(r) for r in ok],
    }


def compute_metrics(records: Sequence[RequestRecord], duration: float, slo: SLO | None = None) -> dict[str, Any]:
    """Every metric of the module docstring from `records` over `duration` seconds; latencies in ms.

    Keys: completed, failed, errors ({type: count}), duration_s, total_input_tokens, total_output_tokens,
    request_throughput (req/s), output_throughput and total_token_throughput (tok/s), ttft_ms, tpot_ms, itl_ms,
    e2e_ms (each {mean, std, p50, p90, p99} or None when there is no value), and with `slo`: goodput (req/s,
    vLLM's) and slo_attainment (fraction of all requests).
    """
    records = _check_records(records)
    duration = _check_positive("duration", duration)
    ok = [r for r in records if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    samples = latency_samples(records)
    metrics: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": dict(sorted(Counter(r.error or "unknown" for r in records if not r.success).items())),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    for name in ("ttft", "tpot", "itl", "e2e"):
        metrics[f"{name}_ms"] = latency_stats(samples[f"{name}_s"], 1e3)
    if slo is not None:
        metrics["goodput"] = goodput(records, slo, duration)
        metrics["slo_attainment"] = slo_attainment(records, slo) if records else 0.0
    return metrics


def run_duration(records: Sequence[RequestRecord]) -> float:
    """From the run's start (the first arrival, t = 0) to the end of the last request, in seconds."""
    ends = [r.done_s for r in _check_records(records) if r.done_s is not None]
    return max(ends) if ends else 0.0


def records_from_report(report: dict[str, Any]) -> list[RequestRecord]:
    """The RequestRecords of a `run_benchmark` report (read back from JSON, metrics can be recomputed)."""
    if not isinstance(report, dict) or not isinstance(report.get("records"), list):
        raise ValueError(f"report must be a run_benchmark report (a dict with a 'records' list), got "
                         f"{type(report).__name__}")
    fields = {f.name for f in dataclasses.fields(RequestRecord)}
    required = {"index", "prompt_len", "max_tokens"}
    records = []
    for i, r in enumerate(report["records"]):
        if not isinstance(r, dict) or set(r) - fields or required - set(r):
            wrong = (f"unknown {sorted(set(r) - fields)}, missing {sorted(required - set(r))}"
                     if isinstance(r, dict) else type(r).__name__)
            raise ValueError(f"report's records[{i}] must be a dict of RequestRecord fields, got {wrong}")
        records.append(RequestRecord(**r))
    return records


# ============================================================================================ goodput search


@dataclass
class GoodputSearch:
    """DistServe's goodput: the highest rate tried whose SLO attainment reached `target` (None: none did)."""

    rate: float | None
    target: float  # the attainment asked for, 0.9
    tried: list[tuple[float, float]]  # (rate, attainment) in the order run
    capped: bool = False  # the bracket's upper end passed: the true goodput may lie above it


def goodput_search(run_at_rate: Callable[[float], Sequence[RequestRecord]], slo: SLO,
                   rates: Sequence[float] | None = None, bracket: tuple[float, float] | None = None,
                   target: float = GOODPUT_ATTAINMENT, steps: int = 5) -> GoodputSearch:
    """DistServe's goodput: the highest request rate at which at least `target` of the requests meet `slo`.

    `run_at_rate(rate)` runs the workload at that rate and returns its records. Give either `rates` (each is run,
    in increasing order; the answer is the highest that passed) or a `bracket` (lo, hi) searched by bisection,
    assuming attainment falls as the rate rises: lo is run (failing: the answer is None), then hi (passing: the
    answer is hi, `capped`), then `steps` midpoints, keeping the highest that passed. Each step halves the
    uncertainty; `steps` runs of the workload leave it at (hi - lo) / 2**steps.
    """
    if not callable(run_at_rate):
        raise TypeError(f"run_at_rate must be callable, got {type(run_at_rate).__name__}")
    if not isinstance(slo, SLO):
        raise TypeError(f"slo must be an SLO, got {type(slo).__name__}")
    if slo.empty:
        raise ValueError("slo sets no bound: give at least one of ttft_s, tpot_s, e2e_s")
    if not isinstance(target, (int, float)) or isinstance(target, bool) or not 0 < target <= 1:
        raise ValueError(f"target must be a fraction in (0, 1], got {target!r}")
    if (rates is None) == (bracket is None):
        raise ValueError("give exactly one of rates (a list to try) or bracket (lo, hi) to bisect")
    tried: list[tuple[float, float]] = []

    def passes(rate: float) -> bool:
        tried.append((rate, slo_attainment(run_at_rate(rate), slo)))
        return tried[-1][1] >= target

    if rates is not None:
        if isinstance(rates, (str, bytes)) or not isinstance(rates, Sequence) or not rates:
            raise ValueError(f"rates must be a non-empty list of request rates, got {rates!r}")
        ordered = sorted(_check_positive(f"rates[{i}]", r) for i, r in enumerate(rates))
        best = None
        for rate in ordered:
            if passes(rate):
                best = rate
        return GoodputSearch(best, target, tried)
    if not isinstance(bracket, (tuple, list)) or len(bracket) != 2:
        raise ValueError(f"bracket must be a (lo, hi) pair of rates, got {bracket!r}")
    lo, hi = _check_positive("bracket lo", bracket[0]), _check_positive("bracket hi", bracket[1])
    if lo >= hi:
        raise ValueError(f"bracket must have lo < hi, got {bracket!r}")
    _check_int("steps", steps, 0)
    if not passes(lo):
        return GoodputSearch(None, target, tried)
    if passes(hi):
        return GoodputSearch(hi, target, tried, capped=True)
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if passes(mid) else (lo, mid)
    return GoodputSearch(lo, target, tried)


# ============================================================================================ the client


class StreamError(Exception):
    """An error event inside a 200 stream (`data: {"error": {...}}`): the server gave up on the request."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def error_type(exc: BaseException) -> str:
    """How a failed request is counted: its HTTP status ("429"), "timeout", "stream:<code>", or the class name."""
    if not isinstance(exc, BaseException):
        raise TypeError(f"exc must be the exception a request raised, got {type(exc).__name__} {short_repr(exc)}")
    if isinstance(exc, openai.APIStatusError):
        return str(exc.status_code)
    if isinstance(exc, httpx.HTTPStatusError):
        return str(exc.response.status_code)
    if isinstance(exc, (openai.APITimeoutError, httpx.TimeoutException, asyncio.TimeoutError)):
        return "timeout"
    if isinstance(exc, StreamError):
        return f"stream:{exc.code}"
    if isinstance(exc, openai.APIError) and isinstance(exc.body, dict):  # an error event the openai client raised
        return f"stream:{exc.body.get('code') or exc.body.get('type') or 'error'}"
    return type(exc).__name__


def request_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """The /v1/completions body every benchmark request sends: greedy, streamed, fixed length (ignore_eos)."""
    model, prompt = check_label("model", model), check_instance("prompt", prompt, str, "the prompt text")
    max_tokens = _check_int("max_tokens", max_tokens, 1)
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}


def _on_text(rec: RequestRecord, text: str | None, t0: float) -> None:
    """A chunk arrived: keep its time if it carries text (role-only and finish-only chunks carry none)."""
    if text:
        rec.chunk_s.append(time.perf_counter() - t0)
        rec.text += text


async def _openai_stream(client: openai.AsyncOpenAI, model: str, prompt: str, rec: RequestRecord, t0: float,
                         timeout: float) -> int | None:
    """Stream one completion with the official client; returns usage.completion_tokens (None if not sent)."""
    # the same body as `request_body`: ignore_eos is vLLM's extension, so it travels in extra_body
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=rec.max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, timeout=timeout)
    completion_tokens = None
    async for chunk in stream:
        if chunk.choices:
            _on_text(rec, chunk.choices[0].text, t0)
        if chunk.usage is not None:
            completion_tokens = chunk.usage.completion_tokens
            rec.prompt_len = chunk.usage.prompt_tokens
    return completion_tokens


async def _http_stream(client: httpx.AsyncClient, base_url: str, model: str, prompt: str, rec: RequestRecord,
                       t0: float, timeout: float) -> int | None:
    """Stream one completion with raw httpx, reading the SSE lines ourselves; returns usage.completion_tokens."""
    url = base_url.rstrip("/") + "/v1/completions"
    completion_tokens = None
    async with client.stream("POST", url, json=request_body(model, prompt, rec.max_tokens),
                             timeout=timeout) as response:
        if response.status_code != 200:
            await response.aread()
            raise httpx.HTTPStatusError(f"{response.status_code}: {response.text[:200]}", request=response.request,
                                        response=response)
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separator lines, comments, event names
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("error"):
                error = chunk["error"]
                raise StreamError(str(error.get("code") or error.get("type")), str(error.get("message")))
            if chunk.get("choices"):
                _on_text(rec, chunk["choices"][0].get("text"), t0)
            if chunk.get("usage"):
                completion_tokens = chunk["usage"]["completion_tokens"]
                rec.prompt_len = chunk["usage"]["prompt_tokens"]
    return completion_tokens


@dataclass
class _Run:
    """The shared state of one benchmark run (one event loop)."""

    base_url: str
    model: str
    backend: str
    timeout: float
    t0: float = 0.0  # time.perf_counter() at the run's start
    client: Any = None  # openai.AsyncOpenAI or httpx.AsyncClient
    in_flight: int = 0
    peak_in_flight: int = 0

    async def send(self, rec: RequestRecord, prompt: str) -> None:
        """Send one request and fill `rec`; never raises except on cancellation (recorded as "cancelled")."""
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        rec.send_s = time.perf_counter() - self.t0
        try:
            if self.backend == "openai":
                coro = _openai_stream(self.client, self.model, prompt, rec, self.t0, self.timeout)
            else:
                coro = _http_stream(self.client, self.base_url, self.model, prompt, rec, self.t0, self.timeout)
            # the client's own timeout bounds each read; this bounds the whole request, however slowly it streams
            usage_tokens = await asyncio.wait_for(coro, self.timeout)
            rec.output_tokens = usage_tokens if usage_tokens is not None else len(rec.chunk_s)
            rec.success = True
        except asyncio.CancelledError:
            rec.error, rec.error_message = "cancelled", "the run's time limit ended it"
            raise
        except Exception as exc:  # noqa: BLE001 - every failure is a counted outcome, never a crash of the run
            rec.error = error_type(exc)
            rec.error_message = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            rec.done_s = time.perf_counter() - self.t0
            self.in_flight -= 1


def _make_client(backend: str, base_url: str, timeout: float) -> Any:
    if backend == "openai":
        # max_retries=0: the client would otherwise retry a 429 or a 5xx silently (twice by default, with
        # backoff); a retried request would then be counted once, as a success with a long TTFT, and the
        # server's refusals would vanish from the errors.
        return openai.AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="unused", max_retries=0,
                                  timeout=timeout)
    return httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None,
                                                                  max_keepalive_connections=None))


async def _close_client(client: Any) -> None:
    if isinstance(client, httpx.AsyncClient):
        await client.aclose()
    else:
        await client.close()


async def _drive(run: _Run, workload: Workload, arrivals: list[float], concurrency: int | None, warmup: bool,
                 max_duration: float) -> list[RequestRecord]:
    """Release each request at its arrival time (and, with `concurrency`, only into a free slot); the records."""
    records = [RequestRecord(i, workload.prompt_lens[i], workload.output_lens[i], arrivals[i])
               for i in range(len(workload))]
    run.client = _make_client(run.backend, run.base_url, run.timeout)
    try:
        if warmup:
            await _warmup(run, workload)
        slots = asyncio.Semaphore(concurrency) if concurrency is not None else None
        run.t0 = time.perf_counter()

        async def one(rec: RequestRecord) -> None:
            await asyncio.sleep(max(0.0, run.t0 + rec.scheduled_s - time.perf_counter()))
            if slots is None:
                await run.send(rec, workload.prompts[rec.index])
            else:
                async with slots:  # waiting here is the client's queue: not part of the request's latency
                    await run.send(rec, workload.prompts[rec.index])

        tasks = [asyncio.create_task(one(rec)) for rec in records]
        _, pending = await asyncio.wait(tasks, timeout=max_duration)
        for task in pending:  # past the run's bound: what is left ends as "cancelled" (never sent: "not_sent")
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for rec in records:
            if rec.send_s is None:
                rec.error, rec.error_message = "not_sent", "the run's time limit came before its turn"
    finally:
        await _close_client(run.client)
    return records


async def _warmup(run: _Run, workload: Workload) -> None:
    """One short request before the clock starts: the first forward pass is slow, and a wrong URL or model name
    should fail in a second, not after the whole run."""
    rec = RequestRecord(-1, workload.prompt_lens[0], min(2, workload.output_lens[0]))
    run.t0 = time.perf_counter()
    await run.send(rec, workload.prompts[0])
    if not rec.success:
        raise RuntimeError(f"the server at {run.base_url} did not answer a test request: {rec.error_message}")
    run.peak_in_flight = 0


def server_info(base_url: str, timeout: float = 10.0) -> tuple[str, int | None]:
    """The served model's id and context length (max_model_len, if the server says) from GET /v1/models."""
    if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
        raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
    _check_positive("timeout", timeout)
    try:
        response = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=timeout)
        response.raise_for_status()
        first = response.json()["data"][0]
    except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as exc:  # TypeError: a body of odd shape
        raise RuntimeError(f"could not list the models at {base_url}/v1/models: {type(exc).__name__}: {exc}") from exc
    return first["id"], first.get("max_model_len")


def _run_sync(coro: Any) -> Any:
    """Run `coro` to completion on a new event loop: here, or in a helper thread when this thread already runs a
    loop (a Jupyter notebook does), where asyncio.run would refuse."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate  # JSON has no infinity; vLLM writes "inf" too


def run_benchmark(base_url: str, workload: Workload, *, model: str | None = None, rate: float = math.inf,
                  burstiness: float = 1.0, concurrency: int | None = None, backend: str = "openai",
                  timeout: float = 60.0, slo: SLO | None = None, seed: int | None = None, warmup: bool = True,
                  max_duration: float | None = None) -> dict[str, Any]:
    """Send `workload` to the server at `base_url` and measure it; returns a JSON-able report (blocking; safe to
    call from a notebook, whose event loop is left alone).

    Requests are released at `rate` req/s (gamma gaps of shape `burstiness`; inf: all at once), and with
    `concurrency` at most that many are in flight (the rest wait in the client). Each request is bounded by
    `timeout` seconds; the run by `max_duration` (default: the last arrival + timeout per round of `concurrency`
    requests + 10 s), after which what is left is cancelled. The arrivals are drawn from `seed` (default: the
    workload's). The report: "config", "metrics" (`compute_metrics`), "samples" (`latency_samples`, for plots),
    "records" (every RequestRecord, chunk times included, so the metrics can be recomputed), "peak_in_flight".
    """
    if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
        raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
    if not isinstance(workload, Workload):
        raise TypeError(f"workload must be a Workload, got {type(workload).__name__}")
    rate = _check_positive("rate", rate, allow_inf=True)
    burstiness = _check_positive("burstiness", burstiness)
    if concurrency is not None:
        _check_int("concurrency", concurrency, 1)
    backend = check_choice("backend", backend, BACKENDS)
    timeout = _check_positive("timeout", timeout)
    if slo is not None and not isinstance(slo, SLO):
        raise TypeError(f"slo must be an SLO or None, got {type(slo).__name__}")
    seed = workload.seed if seed is None else _check_int("seed", seed, 0)
    if model is not None and (not isinstance(model, str) or not model):
        raise TypeError(f"model must be the served model's name (a non-empty str) or None, got {model!r}")
    if not isinstance(warmup, bool):
        raise TypeError(f"warmup must be a bool, got {type(warmup).__name__} {short_repr(warmup)}")
    if max_duration is not None:
        max_duration = _check_positive("max_duration", max_duration)
    model = model if model is not None else server_info(base_url, timeout)[0]
    arrivals = arrival_times(len(workload), rate, burstiness, seed)
    if max_duration is None:
        rounds = 1 if concurrency is None else math.ceil(len(workload) / concurrency)
        max_duration = arrivals[-1] + timeout * rounds + 10.0
    run = _Run(base_url, model, backend, timeout)
    records = _run_sync(_drive(run, workload, arrivals, concurrency, warmup, max_duration))
    duration = max(run_duration(records), 1e-9)
    config = {"base_url": base_url, "model": model, "backend": backend, "dataset": workload.dataset,
              "num_prompts": len(workload), "request_rate": _rate_json(rate), "burstiness": burstiness,
              "max_concurrency": concurrency, "seed": seed, "timeout_s": timeout,
              "shared_prefix_len": workload.shared_prefix_len, "slo": asdict(slo) if slo is not None else None}
    return {"config": config, "metrics": compute_metrics(records, duration, slo), "samples": latency_samples(records),
            "records": [asdict(r) for r in records], "peak_in_flight": run.peak_in_flight}


def offline_throughput(llm: Any, workload: Workload) -> dict[str, float]:
    """The offline engine on the same prompts (chapter 06's measure): all handed to `llm.generate` at once.

    Greedy, max_new_tokens = each output length, ignore_eos, as the benchmark's requests. Output tokens/s = total
    new tokens / wall time; a two-token warm-up runs first, untimed. Keys: output_tokens, wall_s,
    output_throughput (tok/s), request_throughput (req/s).
    """
    if not isinstance(workload, Workload):
        raise TypeError(f"workload must be a Workload, got {type(workload).__name__}")
    if not callable(getattr(llm, "generate", None)):
        raise TypeError(f"llm must be an offline engine with generate(prompts, params) (an LLM), got "
                        f"{type(llm).__name__}")
    llm.generate(workload.prompts[:1], SamplingParams.greedy(2, ignore_eos=True))
    params = [SamplingParams.greedy(n, ignore_eos=True) for n in workload.output_lens]
    start = time.perf_counter()
    outs = llm.generate(workload.prompts, params)
    wall = time.perf_counter() - start
    tokens = sum(len(o.output_token_ids) for o in outs)
    return {"output_tokens": tokens, "wall_s": wall, "output_throughput": tokens / wall,
            "request_throughput": len(outs) / wall}


# ============================================================================================ the result table


def _fmt(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


@reads_report
def format_result(report: dict[str, Any]) -> str:
    """The report as vLLM's "Serving Benchmark Result" table."""
    if not isinstance(report, dict) or not isinstance(report.get("metrics"), dict) \
            or not isinstance(report.get("config"), dict):
        raise ValueError("report must be a run_benchmark report (a dict with 'metrics' and 'config')")
    m, cfg = report["metrics"], report["config"]
    width = 50
    rows = [("Successful requests:", m["completed"]), ("Failed requests:", m["failed"])]
    rows += [(f"  {kind}:", count) for kind, count in m["errors"].items()]
    rows += [("Request rate configured (RPS):", cfg["request_rate"]),
             ("Maximum request concurrency:", cfg["max_concurrency"]),
             ("Benchmark duration (s):", m["duration_s"]), ("Total input tokens:", m["total_input_tokens"]),
             ("Total generated tokens:", m["total_output_tokens"]),
             ("Request throughput (req/s):", m["request_throughput"]),
             ("Output token throughput (tok/s):", m["output_throughput"]),
             ("Total token throughput (tok/s):", m["total_token_throughput"])]
    if "goodput" in m:
        rows += [("Request goodput (req/s):", m["goodput"]), ("SLO attainment (%):", 100 * m["slo_attainment"])]
    lines = [" Serving Benchmark Result ".center(width, "=")]
    lines += [f"{k:<40}{_fmt(v):<10}" for k, v in rows]
    titles = {"ttft": ("Time to First Token", "TTFT"), "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
              "itl": ("Inter-token Latency", "ITL"), "e2e": ("End-to-end Latency", "E2E")}
    for key, (title, short) in titles.items():
        lines.append(f" {title} ".center(width, "-"))
        stats = m[f"{key}_ms"] or {}
        for stat, label in (("mean", "Mean"), ("p50", "Median"), ("p90", "P90"), ("p99", "P99")):
            lines.append(f"{f'{label} {short} (ms):':<40}{_fmt(stats.get(stat)):<10}")
    lines.append("=" * width)
    return "\n".join(lines)


# ============================================================================================ the command


def parse_len_range(text: str, flag: str) -> tuple[int, int]:
    """"64" -> (64, 64); "32:160" -> (32, 160); anything else a ValueError naming `flag`."""
    flag = check_label("flag", flag)
    if not isinstance(text, str):
        raise TypeError(f"{flag} must be given as text, N or LO:HI, got {type(text).__name__} {text!r}")
    try:
        parts = [int(p) for p in text.split(":")]
    except ValueError:
        raise ValueError(f"{flag} must be N or LO:HI (token counts), got {text!r}") from None
    if len(parts) not in (1, 2) or min(parts) < 1 or parts[0] > parts[-1]:
        raise ValueError(f"{flag} must be N or LO:HI with 1 <= LO <= HI, got {text!r}")
    return parts[0], parts[-1]


def parse_rates(text: str, flag: str = "--goodput-search") -> list[float]:
    """"1,2,4" -> [1.0, 2.0, 4.0]: positive finite request rates, or a ValueError naming `flag`."""
    flag = check_label("flag", flag)
    if not isinstance(text, str):
        raise TypeError(f"{flag} must be a comma-separated str of request rates, got {type(text).__name__}")
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be a comma-separated list of request rates, got {text!r}") from None
    if not rates or not all(math.isfinite(r) and r > 0 for r in rates):
        raise ValueError(f"{flag} must list positive finite request rates, got {text!r}")
    return rates


def _slo_from_args(args: argparse.Namespace) -> SLO | None:
    values = {}
    for flag, name in (("slo_ttft_ms", "ttft_s"), ("slo_tpot_ms", "tpot_s"), ("slo_e2e_ms", "e2e_s")):
        ms = getattr(args, flag)
        if ms is not None:
            if not math.isfinite(ms) or ms <= 0:
                raise ValueError(f"--{flag.replace('_', '-')} must be a positive number of ms, got {ms}")
            values[name] = ms / 1e3
    return SLO(**values) if values else None


def _check_args(args: argparse.Namespace) -> None:
    """Every flag checked before any work, each error naming its flag."""
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.output_len < 1:
        raise ValueError(f"--output-len must be >= 1, got {args.output_len}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}")
    if not (math.isfinite(args.burstiness) and args.burstiness > 0):
        raise ValueError(f"--burstiness must be a positive number, got {args.burstiness}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise ValueError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.prefix_len < 1:
        raise ValueError(f"--prefix-len must be >= 1, got {args.prefix_len}")
    if args.context_length is not None and args.context_length < 2:
        raise ValueError(f"--context-length must be >= 2, got {args.context_length}")
    if args.num_blocks < 1:
        raise ValueError(f"--num-blocks must be >= 1, got {args.num_blocks}")
    if args.compare_offline and not args.serve:
        raise ValueError("--compare-offline needs --serve (the offline engine runs the same model in this process)")
    if not args.serve and not args.base_url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url must be an http(s) URL, got {args.base_url!r}")
    check_output_file(args.json, "--json", (".json",))
    check_output_file(args.plot, "--plot", (".png",))


def _bench(args: argparse.Namespace, base_url: str, model: str | None, slo: SLO | None,
           workload: Workload) -> dict[str, Any]:
    """The run(s) the flags ask for against `base_url`: one report, or the goodput search's."""
    kwargs = dict(model=model, burstiness=args.burstiness, concurrency=args.max_concurrency, backend=args.backend,
                  timeout=args.timeout, slo=slo, seed=args.seed)
    if not args.goodput_search:
        report = run_benchmark(base_url, workload, rate=args.request_rate, **kwargs)
        print(format_result(report))
        return report
    rates = parse_rates(args.goodput_search)
    runs: list[dict[str, Any]] = []

    def run_at_rate(rate: float) -> list[RequestRecord]:
        runs.append(run_benchmark(base_url, workload, rate=rate, **kwargs))
        m = runs[-1]["metrics"]
        print(f"rate {rate:8.2f} req/s: {m['request_throughput']:7.2f} req/s served, "
              f"{m['output_throughput']:8.1f} tok/s, SLO attainment {100 * m['slo_attainment']:5.1f}%, "
              f"goodput (vLLM) {m['goodput']:6.2f} req/s", flush=True)
        return records_from_report(runs[-1])

    found = goodput_search(run_at_rate, slo, rates=rates)
    answer = "none of the rates" if found.rate is None else f"{found.rate:g} req/s"
    print(f"goodput (DistServe: the highest rate with >= {100 * found.target:.0f}% of requests meeting the SLO): "
          f"{answer}")
    return {"goodput_search": asdict(found), "runs": runs}


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    try:
        return _bench_serve(args)
    except RuntimeError as exc:  # the server is unreachable or refused the test request: one line, no traceback
        print(f"minillm bench-serve: error: {exc}", file=sys.stderr)
        return 1


def _bench_serve(args: argparse.Namespace) -> int:
    """The command's work (`_cmd_bench_serve` turns a server that cannot be reached into an exit code)."""
    _check_args(args)
    slo = _slo_from_args(args)
    if args.goodput_search and slo is None:
        raise ValueError("--goodput-search needs an SLO: give --slo-ttft-ms, --slo-tpot-ms and/or --slo-e2e-ms")
    if args.goodput_search:
        parse_rates(args.goodput_search)
    input_len = parse_len_range(args.input_len, "--input-len")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer()

    def workload_for(context: int) -> Workload:
        return make_workload(args.dataset, args.num_prompts, input_len, args.output_len, args.seed, args.prefix_len,
                             tokenizer, context)

    if args.serve:
        name = args.model or "base"
        loaded = load_model(name, resolve_device(args.device))
        config = EngineConfig(num_blocks=args.num_blocks, enable_prefix_caching=args.enable_prefix_caching)
        workload = workload_for(loaded.model.config.block_size)
        flags = ["--model", name, "--device", args.device, "--num-blocks", str(args.num_blocks),
                 "--engine-core", args.engine_core]
        flags += ["--enable-prefix-caching"] if args.enable_prefix_caching else []
        # subtle: the server gets a process (and an interpreter) of its own, as deployed; in this process it would
        # share the GIL with the client, and both would slow down.
        with ServerProcess(flags, threads=args.threads) as url:
            print(f"minillm serve on {url} ({loaded.label}, {config.num_blocks} KV blocks)", flush=True)
            result = _bench(args, url, name, slo, workload)
        if args.compare_offline and "metrics" in result:
            result["offline"] = offline_throughput(LLM(loaded.model, loaded.tokenizer, config), workload)
            ratio = result["metrics"]["output_throughput"] / result["offline"]["output_throughput"]
            result["serving_over_offline"] = ratio
            print(f"offline engine on the same prompts: {result['offline']['output_throughput']:.1f} output tok/s; "
                  f"serving reached {100 * ratio:.1f}% of it")
    else:
        model, context = args.model, None
        if model is None or args.context_length is None:
            served, context = server_info(args.base_url, args.timeout)
            model = model or served
        context = args.context_length or context or DEFAULT_CONTEXT
        result = _bench(args, args.base_url, model, slo, workload_for(context))
    if args.json:
        atomic_write_text(args.json, json.dumps(result, indent=1) + "\n")
        print(f"report written to {args.json}")
    if args.plot:
        if "runs" in result:
            plots.plot_frontier(result["runs"], slo, path=args.plot)
        else:
            plots.plot_latency_cdfs(result, slo=slo, path=args.plot)
        print(f"plot written to {args.plot}")
    return 0


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    check_instance("subparsers", subparsers, argparse._SubParsersAction, "an ArgumentParser's add_subparsers()")
    p = subparsers.add_parser("bench-serve", help="chapter 15: load-test an OpenAI-compatible server "
                                                  "(TTFT, TPOT, ITL, E2E, throughput, goodput)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    p.add_argument("--model", default=None, help="the model name to request (default: the server's first; "
                                                  "with --serve: the shipped model to serve, base)")
    p.add_argument("--backend", default="openai", choices=BACKENDS,
                   help="openai: the official AsyncOpenAI client; http: raw httpx reading the SSE stream")
    p.add_argument("--timeout", type=_float, default=60.0, help="seconds per request (default 60)")
    d = p.add_argument_group("the workload")
    d.add_argument("--dataset", default="default", choices=DATASETS,
                   help="default: prompts cut from the default corpus; shared-prefix: one common prefix + suffixes")
    d.add_argument("--num-prompts", type=int, default=64, help="requests to send (default 64)")
    d.add_argument("--input-len", default=f"{DEFAULT_INPUT_LEN[0]}:{DEFAULT_INPUT_LEN[1]}",
                   help="prompt tokens, N or LO:HI drawn uniformly (default %(default)s)")
    d.add_argument("--output-len", type=int, default=DEFAULT_OUTPUT_LEN,
                   help="tokens generated per request, fixed by ignore_eos (default %(default)s)")
    d.add_argument("--prefix-len", type=int, default=DEFAULT_PREFIX_LEN,
                   help="shared-prefix: tokens of the common prefix (default %(default)s)")
    d.add_argument("--context-length", type=int, default=None,
                   help="the server's context window (default: its /v1/models max_model_len, else 256)")
    d.add_argument("--seed", type=seed_argument, default=0, help="seed of the prompts and the arrivals (default 0)")
    a = p.add_argument_group("the arrivals")
    a.add_argument("--request-rate", type=_float, default=math.inf,
                   help="requests per second (default inf: all at once)")
    a.add_argument("--burstiness", type=_float, default=1.0,
                   help="gamma shape of the gaps: 1 = Poisson, < 1 burstier, > 1 more regular (default 1)")
    a.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    s = p.add_argument_group("service-level objectives and goodput")
    s.add_argument("--slo-ttft-ms", type=_float, default=None, help="TTFT bound (ms)")
    s.add_argument("--slo-tpot-ms", type=_float, default=None, help="TPOT bound (ms)")
    s.add_argument("--slo-e2e-ms", type=_float, default=None, help="E2E bound (ms)")
    s.add_argument("--goodput-search", metavar="RATES", default=None,
                   help="run at each rate (comma list, e.g. 1,2,4,8) and report DistServe's goodput: the highest "
                        "rate at which >= 90%% of requests meet the SLO")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", default=None, help="write the report (records included) as JSON")
    o.add_argument("--plot", metavar="PATH", default=None,
                   help="PNG: the latency CDFs; with --goodput-search, the throughput-latency frontier")
    v = p.add_argument_group("a server of its own (one command, loopback only)")
    v.add_argument("--serve", action="store_true",
                   help="start `minillm serve` with the shipped model in a child process on a loopback port, "
                        "bench it, and stop it")
    v.add_argument("--device", default="cpu", choices=DEVICE_CHOICES, help="--serve: where the model runs")
    v.add_argument("--num-blocks", type=int, default=512, help="--serve: KV blocks in the pool (default 512)")
    v.add_argument("--enable-prefix-caching", action="store_true", help="--serve: chapter 05's prefix cache")
    v.add_argument("--threads", type=threads_argument, default=None, help="torch threads (default: torch's choice)")
    v.add_argument("--engine-core", default="process", choices=("process", "thread"),
                   help="--serve: the engine core in a process of its own (default) or on the server's thread")
    v.add_argument("--compare-offline", action="store_true",
                   help="--serve: also time the offline engine on the same prompts and print the ratio")
    p.set_defaults(handler=_cmd_bench_serve)


__all__ = ["BACKENDS", "DATASETS", "GoodputSearch", "RequestRecord", "SLO", "Workload", "add_commands",
           "arrival_times", "common_prefix_len", "compute_metrics", "default_dataset", "error_type",
           "format_result", "goodput", "goodput_search", "interarrival_gaps", "latency_samples", "latency_stats",
           "make_workload", "offline_throughput", "percentile", "records_from_report", "request_e2e",
           "request_itls", "request_tpot", "request_ttft", "run_benchmark", "run_duration", "server_info",
           "shared_prefix_dataset", "slo_attainment"]

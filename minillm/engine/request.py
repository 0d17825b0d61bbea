"""A request's life inside the engine: its status (an `Enum`), its tokens, how many have their KV in the pool.

One number drives everything, as in vLLM's V1 scheduler: `num_computed_tokens`, the tokens of `all_token_ids`
(prompt + outputs so far) whose keys and values are already in the KV pool. A step feeds the next
`num_tokens - num_computed_tokens` tokens (or a chunk of them); when a step reaches the last known token, its
logits give the next output token. Prefill, chunked prefill, decode and recomputation after preemption are then
the same operation with different chunk sizes. The request's lifecycle proper (validated prompt, capped params,
its generator, the stop rules, the output tokens) is the `RequestState` every loop in minillm shares
(`minillm.core.stopping`); a `Request` holds one and adds the engine's bookkeeping around it. Parallel samples
(`n > 1`) are n `Request`s: sample 0 under the user's id, samples 1..n-1 under internal ids, each with its `index`
and the user's id (`parent_id`), so every output names the request and the sample. What it leaves out: beam search.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Sequence

import torch

from minillm.core.config import check_float, check_int, short_repr
from minillm.core.sampling import SamplingParams
from minillm.core.stopping import RequestState, StopChecker


class RequestStatus(Enum):
    WAITING = "waiting"  # in the waiting queue: not admitted yet, or preempted by recomputation (holds no blocks)
    RUNNING = "running"  # admitted: holds KV blocks for its computed tokens, gets work every step it fits the budget
    SWAPPED = "swapped"  # preempted by swapping: its KV blocks sit in CPU memory, no GPU/pool blocks held
    FINISHED_STOPPED = "stop"  # hit eos or a stop string
    FINISHED_LENGTH = "length"  # reached max_new_tokens or the context window
    FINISHED_ABORTED = "abort"  # removed by `abort` (or rejected while queued)
    FINISHED_ERROR = "error"  # its sampling or stop check raised: this request failed, the others went on

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
                        RequestStatus.FINISHED_ERROR)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]  # == state.prompt_ids
    params: SamplingParams  # == state.params: validated, max_new_tokens capped by the context window
    prompt: str | None = None  # the text, when the prompt came as a string
    arrival_time: float = field(default_factory=time.perf_counter)
    # Its lifecycle, from `start_request` (see `minillm.engine.frontend`). None only for a request built by hand
    # to drive the scheduler alone (its tests): it then gets a bare state with no eos, no window and no generator.
    state: RequestState | None = None

    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens of all_token_ids whose K/V are in the pool (0 while WAITING)
    num_block_tokens: int = 0  # tokens the block manager has slots for (== blocks held * bs, minus slack)
    num_preemptions: int = 0
    finish_reason: str | None = None
    num_streamed: int = 0  # output tokens already handed out by `step()` (the rest are the next delta)
    num_streamed_chars: int = 0  # characters of output text already handed out (held back: see StopChecker)
    num_swapped_blocks: int = 0  # host blocks its KV occupies while SWAPPED (the executor holds the bytes)
    token_times: list[float] = field(default_factory=list)  # perf_counter() when each output token was ready
    first_scheduled_time: float | None = None
    # Parallel sampling (params.n > 1): this is sample `index` of the request the user added as `parent_id` (its
    # outputs carry that id and this index; None: the request is the user's own, sample 0). Samples 1..n-1 wait in
    # sample 0's `held` until its first token is sampled; then they fork its blocks (`LLM._fork_held`).
    index: int = 0
    parent_id: str | None = None
    held: list[Request] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.state is None:
            self.state = RequestState(list(self.prompt_token_ids), self.params, None, StopChecker(None, self.params))

    @property
    def output_id(self) -> str:
        """The id its outputs carry: the user's request id (for every sample of an n > 1 request)."""
        return self.request_id if self.parent_id is None else self.parent_id

    @property
    def output_token_ids(self) -> list[int]:
        """The accepted output tokens (the state's list: add to it only through `accept`)."""
        return self.state.output_ids

    @property
    def generator(self) -> torch.Generator | None:
        """The request's own RNG, seeded from params.seed: the same draws alone or batched."""
        return self.state.generator

    def accept(self, tokens: Sequence[int], now: float) -> bool:
        """Append sampled tokens through the state's stop rules, time-stamp each, finish the request if it is over.

        Returns True when it finished (status FINISHED_STOPPED for eos or a stop string, FINISHED_LENGTH for max
        tokens or the window). Freeing its blocks is the caller's part (the scheduler's I8). `tokens` must be a list
        (or tuple) and `now` a finite clock reading (a TypeError / ValueError naming them: the caller's bug); a bad
        token inside the list fails this request alone (finish_reason "error"), as every sampled token does.
        """
        if type(tokens) is not list and not isinstance(tokens, tuple):  # cheap: once per request per step
            raise TypeError(f"tokens must be a list of token ids, got {type(tokens).__name__} {short_repr(tokens)}")
        if type(now) is not float or not -math.inf < now < math.inf:  # NaN fails the comparison
            now = check_float("now", now)
        before = len(self.state.output_ids)
        done = self.state.accept_or_fail(tokens, f"request {self.request_id!r}")
        self.token_times.extend([now] * (len(self.state.output_ids) - before))
        if done:
            self.finish()
        return done

    def fail(self, message: str) -> None:
        """Finish this request with finish_reason "error" (its sampling raised); the caller frees its blocks."""
        self.state.fail(message)
        self.finish()

    @property
    def error(self) -> str | None:
        """Why the request failed (finish_reason "error"), else None."""
        return self.state.error

    def finish(self) -> None:
        """Copy the state's finish reason into the engine's status (the state finished on arrival or in `accept`)."""
        assert self.state.finished, "finish() before the request's state finished"
        self.finish_reason = self.state.finish_reason
        self.status = {"length": RequestStatus.FINISHED_LENGTH, "error": RequestStatus.FINISHED_ERROR}.get(
            self.finish_reason, RequestStatus.FINISHED_STOPPED)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list (a decode reads one token of thousands)."""
        p = len(self.prompt_token_ids)
        if type(start) is not int or type(end) is not int or not 0 <= start <= end <= self.num_tokens:  # cheap
            start, end = check_int("start", start, 0), check_int("end", end, 0)  # the error naming the argument
            if end < start:
                raise ValueError(f"end must be >= start, got start={start}, end={end}")
            if end > self.num_tokens:  # a slice would quietly return fewer tokens than asked for
                raise ValueError(f"end={end} is past the {self.num_tokens} tokens of request {self.request_id!r}")
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K/V must still be computed before the next output token can be sampled (>= 1 if alive)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True while more than the last sampled token is uncomputed: a prompt, or a recomputation after preemption."""
        return self.num_uncomputed_tokens > 1 or not self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def max_kv_tokens(self) -> int:
        """The most tokens this request can ever hold in the pool: prompt + max_new_tokens - 1 (the last sampled
        token is never fed back). Never beyond the context window: `start_request` capped max_new_tokens there."""
        return self.num_prompt_tokens + self.params.max_new_tokens - 1


@dataclass
class RequestOutput:
    """What `step()` streams and `generate()` returns: the new tokens since the last step and everything so far."""

    request_id: str  # the id the user added the request under (every sample of an n > 1 request shares it)
    prompt: str | None
    prompt_token_ids: list[int]
    new_token_ids: list[int]  # the delta: tokens produced since this request's previous RequestOutput
    output_token_ids: list[int]  # every output token so far
    finished: bool
    finish_reason: str | None  # "length", "stop", "abort", "error" once finished, else None
    text: str | None = None  # the output text streamed so far (at the end: cut before a matched stop string)
    new_text: str | None = None  # the text delta: whole characters, never any part of a stop string
    arrival_time: float = 0.0
    token_times: list[float] = field(default_factory=list)  # perf_counter() per output token
    num_preemptions: int = 0
    error: str | None = None  # finish_reason "error": what failed, naming the request (the others went on)
    index: int = 0  # which sample of its request (0 .. params.n - 1): outputs are keyed by (request_id, index)

    @property
    def ttft(self) -> float | None:
        """Time to first token (seconds): arrival to the first output token."""
        return self.token_times[0] - self.arrival_time if self.token_times else None

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies (seconds) between consecutive output tokens."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

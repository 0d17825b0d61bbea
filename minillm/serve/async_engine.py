"""The engine seen from an event loop: requests admitted (or refused at once), outputs routed to their HTTP handler.

What it adds to chapter 06's `EngineCore` (the engine on its own thread behind an inbox and an outbox): the other
side of the outbox, for asyncio. The core's thread calls `_from_engine` with every output; that hands the output
to the event loop (`call_soon_threadsafe`), which puts it on the queue of the HTTP request it belongs to. The event
loop never runs a model step, and the engine's thread never touches a socket.

    HTTP handler (event loop)                      engine thread (EngineCore.run_forever)
    submit() --admission--> core.add_request ----> inbox --> step() --> on_output(out)
    stream.get() <-- queue <-- _route(out) <-- call_soon_threadsafe <------------'
                                                    on_step(core) --> snapshot (state for /metrics, /dashboard)

Admission is bounded twice, so an overloaded server answers 429 at once instead of queueing without end: by the
requests in flight (accepted and not finished, each of n samples counted) and by their tokens (prompt + max_tokens
per sample). A request's share is given back when its last final output arrives, however it ended, so an aborted
or disconnected request frees its place exactly once. The core can also run in a process of its own
(`minillm.serve.engine_process`, what `minillm serve` does): the same class, with the inbox and the outbox a pipe.
What it leaves out: priorities between requests.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from minillm.core.config import check_float, check_instance, check_int, short_repr
from minillm.core.sampling import SamplingParams
from minillm.engine.core import EngineCore
from minillm.engine.llm import LLM
from minillm.engine.request import RequestOutput
from minillm.serve.protocol import RequestError

SNAPSHOT_EVERY_S = 0.05  # how often a busy engine publishes its state (an idle one after its last step)


@dataclass
class RequestStream:
    """The engine requests of one HTTP request (several prompts x n samples) and the queue of their outputs."""

    request_ids: list[str]  # one engine request per prompt
    n: int  # samples per prompt
    cost: tuple[int, int]  # (requests, tokens) counted against the admission bounds
    arrival: float  # time.perf_counter() when the server got it
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finals: int = 0  # final outputs the engine delivered (all delivered: `done`, its admission share given back)
    taken: int = 0  # final outputs the handler has taken from the queue (all taken: `ended`)

    @property
    def expected(self) -> int:
        return len(self.request_ids) * self.n

    @property
    def done(self) -> bool:
        """The engine has finished every sample (their outputs may still wait in the queue)."""
        return self.finals >= self.expected

    @property
    def ended(self) -> bool:
        """The handler has taken every sample's final output: nothing more will come."""
        return self.taken >= self.expected

    async def get(self) -> RequestOutput:
        """The next output (counting the finals taken)."""
        out = await self.queue.get()
        if out.finished:
            self.taken += 1
        return out


@dataclass
class Snapshot:
    """The engine's state after a step, read on the engine's thread (nothing mutates it meanwhile)."""

    time: float = 0.0
    running: int = 0
    waiting: int = 0
    swapped: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_steps: int = 0
    num_preemptions: int = 0
    prefix_cache_hits: int = 0  # blocks handed out again by content (chapter 05's prefix cache)
    owners: list[str | None] = field(default_factory=list)  # per block: the request holding it, or None
    shared: list[bool] = field(default_factory=list)  # per block: held by more than one sequence
    cached: list[bool] = field(default_factory=list)  # per block: free but still holding a cached prefix


def engine_snapshot(engine: Any) -> Snapshot:
    """The scheduler's queues and the block pool, by owner, of an `LLM` (or `SpeculativeLLM`)."""
    check_instance("engine", engine, LLM, "an engine LLM (or SpeculativeLLM)")
    stats = engine.stats()
    manager = engine.block_manager
    alloc = manager.allocator
    owners: list[str | None] = [None] * manager.num_blocks
    for seq_id in manager.seq_ids:
        owner = str(seq_id).split("#")[0]  # parallel samples "rid#i" are drawn as their request
        for block in manager.block_table(seq_id):
            owners[block] = owner
    shared = [alloc.ref_count(b) > 1 for b in range(manager.num_blocks)]
    block_hash = getattr(alloc, "block_hash", None)
    cached = [owners[b] is None and block_hash is not None and block_hash(b) is not None
              for b in range(manager.num_blocks)]
    return Snapshot(time.time(), stats["running"], stats["waiting"], stats["swapped"], stats["num_blocks"],
                    stats["num_free_blocks"], stats["num_steps"], stats["num_preemptions"],
                    getattr(alloc, "num_hits", 0), owners, shared, cached)


class AsyncEngine:
    """An `EngineCore` on its own thread, driven from one asyncio event loop.

    Where the core runs is three methods, `start`/`stop` and `_add`/`_abort_id`; a subclass that overrides them
    (`ProcessAsyncEngine`) keeps the admission and the routing here."""

    def __init__(self, engine: Any, max_queued_requests: int = 256, max_queued_tokens: int = 1 << 20):
        self._init_routing(max_queued_requests, max_queued_tokens)
        self.engine = engine
        # first: the core refuses anything but an engine with a front end (a bare model, a name) with a TypeError
        self.core = EngineCore(engine, on_output=self._from_engine, on_step=self._on_step)
        self.context_length = engine.model.config.block_size  # prompt + output tokens the model can hold
        self.vocab_size = engine.model.config.vocab_size
        self.parallel_sampling, self.max_request_tokens = engine_limits(engine)
        self.snapshot = engine_snapshot(engine)  # replaced as a whole, never mutated: safe to read anywhere

    def _init_routing(self, max_queued_requests: int, max_queued_tokens: int) -> None:
        for name, value in (("max_queued_requests", max_queued_requests), ("max_queued_tokens", max_queued_tokens)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {short_repr(value)}")
        self.max_queued_requests = max_queued_requests
        self.max_queued_tokens = max_queued_tokens
        self.queued_requests = 0  # in flight: accepted, not yet given every final output (event loop only)
        self.queued_tokens = 0
        self._streams: dict[str, RequestStream] = {}  # engine request id -> its HTTP request's stream
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: list[RequestOutput] = []  # outputs from the engine thread not yet routed (either thread)
        self._pending_lock = threading.Lock()
        self._last_snapshot = 0.0
        self.on_output: list[Any] = []  # callbacks(stream, output) on every output routed (metrics), event loop
        self.on_final: list[Any] = []  # callbacks(stream, output) on each final output (metrics), event loop

    # ------------------------------------------------------------------------------------------ event loop

    def start(self) -> None:
        """Start the engine's thread; outputs are delivered to the running event loop."""
        self._loop = asyncio.get_running_loop()
        self.core.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is left (each gets its final output) and end the engine's thread."""
        self.core.stop(timeout)

    @property
    def error(self) -> str | None:
        """What broke the engine's loop (it then serves nothing more), or None while it is fine."""
        exc = self.core.error
        return None if exc is None else f"the engine loop failed: {type(exc).__name__}: {exc}"

    def _add(self, request_id: str, prompt: str | list[int], params: SamplingParams, arrival: float) -> None:
        """Hand one prompt to the core (ValueError/TypeError: refused; RuntimeError: the core is stopped)."""
        self.core.add_request(prompt, params, request_id=request_id, arrival_time=arrival)

    def _abort_id(self, request_id: str) -> None:
        self.core.abort(request_id)

    def submit(self, prompts: Sequence[str | list[int]], params: SamplingParams, tokens: int,
               arrival: float | None = None) -> RequestStream:
        """Admit one HTTP request's prompts (each sampled params.n times) or refuse it now.

        `tokens` is the request's cost in tokens (prompt + max_tokens, summed over its samples). Over either
        bound: RequestError 429 "queue_full". A prompt the engine refuses: RequestError 400 naming why. Arguments
        of the wrong kind (the server's bug, not the client's) are a TypeError / ValueError naming them.
        """
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise TypeError(f"prompts must be a non-empty list of prompts (str or token ids), got "
                            f"{short_repr(prompts)}")
        check_instance("params", params, SamplingParams, "SamplingParams")
        tokens = check_int("tokens", tokens)
        if arrival is not None:
            arrival = check_float("arrival", arrival)
        cost = (len(prompts) * params.n, tokens)
        self._check_alone(prompts, params, cost)
        if (self.queued_requests + cost[0] > self.max_queued_requests
                or self.queued_tokens + cost[1] > self.max_queued_tokens):
            raise RequestError(f"the server is at capacity ({self.queued_requests} of {self.max_queued_requests} "
                               f"requests, {self.queued_tokens} of {self.max_queued_tokens} tokens in flight); "
                               f"retry later", None, "queue_full", status=429, type="rate_limit_error")
        base = f"req-{next(self._ids)}"
        stream = RequestStream([f"{base}.{i}" for i in range(len(prompts))], params.n, cost,
                               arrival if arrival is not None else time.perf_counter())
        added: list[str] = []
        try:
            for rid, prompt in zip(stream.request_ids, prompts):
                self._streams[rid] = stream  # before the engine can answer: its outputs need somewhere to go
                self._add(rid, prompt, params, stream.arrival)
                added.append(rid)
        except (ValueError, TypeError, RuntimeError) as exc:
            for rid in stream.request_ids:
                if rid not in added:
                    self._streams.pop(rid, None)
            if added:  # a batch refused halfway: the accepted part ends too, and gives its place back on arrival
                stream.finals = stream.taken = (len(stream.request_ids) - len(added)) * params.n
                self.queued_requests += len(added) * params.n
                stream.cost = (len(added) * params.n, 0)
                for rid in added:
                    self._abort_id(rid)
            if isinstance(exc, RuntimeError):  # the engine is stopped or gone: the server, not the request
                code = "engine_failed" if self.error is not None else "engine_stopped"
                raise RequestError(str(exc), None, code, status=503, type="service_unavailable") from exc
            raise RequestError(str(exc), "prompt") from exc
        self.queued_requests += cost[0]
        self.queued_tokens += cost[1]
        return stream

    def _check_alone(self, prompts: Sequence[str | list[int]], params: SamplingParams,
                     cost: tuple[int, int]) -> None:
        """A request that could never run, even on an idle server, is a 400 now (a 429 would be retried forever):
        more samples or tokens than the admission bounds, n > 1 on an engine without parallel sampling, a prompt
        whose worst case exceeds what the engine can hold. The engine would refuse the last two too, but in its
        own process only after the response had started."""
        if cost[0] > self.max_queued_requests or cost[1] > self.max_queued_tokens:
            raise RequestError(f"this request alone ({cost[0]} samples, {cost[1]} tokens of prompt + max_tokens) "
                               f"exceeds what the server admits at once ({self.max_queued_requests} samples, "
                               f"{self.max_queued_tokens} tokens); send fewer prompts, a smaller n or max_tokens",
                               "n" if params.n > 1 else "prompt", "request_too_large")
        if params.n > 1 and not self.parallel_sampling:
            raise RequestError(f"n={params.n}: this server's engine runs one sample per request (no parallel "
                               f"sampling, e.g. speculative decoding); send n=1", "n", "unsupported_parameter")
        if self.max_request_tokens is None:
            return
        for prompt in prompts:
            if isinstance(prompt, list) and len(prompt) + params.max_new_tokens - 1 > self.max_request_tokens:
                raise RequestError(f"a prompt of {len(prompt)} tokens with max_tokens={params.max_new_tokens} needs "
                                   f"up to {len(prompt) + params.max_new_tokens - 1} tokens of KV cache, more than "
                                   f"this server's engine can hold for one request ({self.max_request_tokens}); "
                                   f"lower max_tokens", "max_tokens", "request_too_large")

    def abort(self, stream: RequestStream) -> None:
        """Abort every engine request of `stream` that has not ended (its final outputs still arrive)."""
        check_instance("stream", stream, RequestStream, "a RequestStream (submit's)")
        for rid in stream.request_ids:
            if rid in self._streams:
                self._abort_id(rid)

    def abort_all(self) -> int:
        """Abort every request in flight (a drain that ran out of time); returns how many HTTP requests."""
        streams = {id(s): s for s in self._streams.values()}
        for stream in streams.values():
            self.abort(stream)
        return len(streams)

    @property
    def num_in_flight(self) -> int:
        """HTTP requests not yet given every final output."""
        return len({id(s) for s in self._streams.values()})

    def _route(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return  # subtle: cannot happen for ids submitted here; outputs of requests added elsewhere are dropped
        stream.queue.put_nowait(out)
        for callback in self.on_output:
            callback(stream, out)
        if out.finished:
            stream.finals += 1
            for callback in self.on_final:
                callback(stream, out)
            if stream.done:
                for rid in stream.request_ids:
                    self._streams.pop(rid, None)
                self.queued_requests -= stream.cost[0]
                self.queued_tokens -= stream.cost[1]

    # ------------------------------------------------------------------------------------------ engine thread

    def _from_engine(self, out: RequestOutput) -> None:
        """Hand one output to the event loop (the core's `on_output`, on its thread)."""
        self._hand_over([out])

    def _hand_over(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs to the event loop from another thread. A step's outputs travel together: the first one
        pending schedules one `_flush` on the loop, which takes every output pending by then (one wake-up of the
        loop per step, not one per request: each `call_soon_threadsafe` writes to the loop's self-pipe and wakes
        it)."""
        with self._pending_lock:
            scheduled = bool(self._pending)
            self._pending.extend(outputs)
            if scheduled or not self._pending:
                return  # a flush is already scheduled and will take these too
        loop = self._loop
        if loop is None or loop.is_closed():
            return  # the server is gone; nobody is waiting for this output
        try:
            loop.call_soon_threadsafe(self._flush)
        except RuntimeError:
            pass  # the loop closed between the check and the call

    def _flush(self) -> None:
        with self._pending_lock:
            outputs, self._pending = self._pending, []
        for out in outputs:
            self._route(out)

    def _on_step(self, core: EngineCore) -> None:
        now = time.perf_counter()
        idle = not self.engine.has_unfinished()
        if idle or now - self._last_snapshot >= SNAPSHOT_EVERY_S:
            self._last_snapshot = now
            self.snapshot = engine_snapshot(self.engine)


def engine_limits(engine: Any) -> tuple[bool, int | None]:
    """(parallel sampling?, the most KV tokens one request may need, or None if the engine does not say)."""
    limit = getattr(engine, "max_request_tokens", None)
    return bool(getattr(engine, "supports_parallel_sampling", False)), limit() if callable(limit) else None


def wait_until(predicate: Any, timeout: float, interval: float = 0.01) -> bool:
    """Poll `predicate()` until it is true or `timeout` seconds pass (threads, tests); returns the last value."""
    if not callable(predicate):
        raise TypeError(f"predicate must be a function of no arguments, got {type(predicate).__name__}")
    # subtle: a NaN deadline is never passed: it would poll forever
    timeout = check_float("timeout", timeout, minimum=0.0)
    interval = check_float("interval", interval, minimum=0.0)
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return bool(predicate())
        time.sleep(interval)
    return True

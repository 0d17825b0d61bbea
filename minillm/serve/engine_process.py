"""The engine core in a process of its own, so that the model's steps and the HTTP event loop never wait for one
interpreter lock: what `minillm serve` runs by default (`--engine-core process`), as vLLM v1 does.

Why a process: on a thread (`AsyncEngine`), the engine's step and the event loop share one GIL. torch releases it
inside its kernels, but a small model's step is mostly Python (scheduling, sampling, detokenizing), and the event
loop's parsing, JSON and SSE writes for dozens of streams take the lock away from it. In its own process the core
has an interpreter and a core of the CPU to itself; what crosses is plain data over a pipe:

    server process (event loop)                              engine process (chapter 07's worker loop)
    submit --admission--> AddRequest(ids, params) --pipe-->  EngineWorker.handle -> EngineCore inbox
    abort  -------------> Abort(request_id) -------pipe-->   step(): EngineCore.step() -> its outputs
    reader thread <----- StepOutputs(outputs, snapshot) <--  (one message per step; a snapshot every 50 ms)
      -> _hand_over -> event loop -> each request's queue (the same routing as the thread's)

The worker runs on chapter 07's process layer (`minillm.engine.process`): the ready handshake, heartbeats, and a
death detector. The child builds its own engine from `build_engine`'s arguments (the shipped weights are on its
disk too), so no weights cross. If the engine process dies or raises, every request in flight gets a final
"error" output at once, `/health` turns 503, and new requests get 503: the server does not hang. What it leaves
out: restarting a dead engine, and several engine processes behind one server (vLLM's data parallelism).
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import signal
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from minillm.bench.models import load_model
from minillm.core.config import check_choice, check_float, check_instance, short_repr
from minillm.core.device import resolve_device
from minillm.core.sampling import SamplingParams
from minillm.engine import LLM, EngineConfig
from minillm.engine.core import EngineCore
from minillm.engine.process import Inbox, WorkerDiedError, WorkerHandle, receive, stop_all, wait_ready
from minillm.engine.request import RequestOutput
from minillm.quant.linear import QuantConfig, quantize_model
from minillm.serve.async_engine import SNAPSHOT_EVERY_S, AsyncEngine, Snapshot, engine_limits, engine_snapshot
from minillm.speculative.engine import METHODS as SPECULATIVE_METHODS
from minillm.speculative.engine import SpeculativeConfig, SpeculativeLLM

QUANTIZE_CHOICES = ("none", "int8", "int4")
ENGINE_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))
BUILD_ARGUMENTS = frozenset({"model", "device", "speculative", "draft", "gamma", "quantize", "seed"})


def build_engine(model: str = "base", device: str = "cpu", *, speculative: str = "none", draft: str = "draft",
                 gamma: int = 4, quantize: str = "none", seed: int = 0, **engine_config: Any) -> tuple[Any, Any]:
    """The engine `minillm serve` runs, and its tokenizer: `LLM` or `SpeculativeLLM` over `model` (a shipped
    name), with `engine_config` passed to `EngineConfig` (enable_prefix_caching, attention_backend, kv_dtype,
    tensor_parallel_size, num_blocks, ...). `quantize` "int8"/"int4" replaces the linears (chapter 09);
    `speculative` "prompt-lookup" or "draft-model" (with the shipped `draft`) turns on chapter 08."""
    quantize = check_choice("quantize", quantize, QUANTIZE_CHOICES)
    if speculative != "none" and speculative not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative must be 'none' or one of {SPECULATIVE_METHODS}, got {speculative!r}")
    unknown = sorted(set(engine_config) - ENGINE_CONFIG_FIELDS)
    if unknown:
        raise TypeError(f"build_engine got unknown arguments {unknown}: besides its own it takes EngineConfig's "
                        f"fields {sorted(ENGINE_CONFIG_FIELDS)}")
    # every argument that needs no weights is checked before any are loaded
    config = EngineConfig(**engine_config)
    spec = SpeculativeConfig(method=speculative, gamma=gamma) if speculative != "none" else None
    dev = resolve_device(device)
    loaded = load_model(model, dev, seed)
    target = loaded.model
    if quantize != "none":
        target = quantize_model(target, QuantConfig(quantize, group_size=32)).eval()
    if spec is None:
        return LLM(target, loaded.tokenizer, config), loaded.tokenizer
    draft_model = load_model(draft, dev, seed).model if speculative == "draft-model" else None
    return SpeculativeLLM(target, loaded.tokenizer, config, speculative=spec, draft=draft_model), loaded.tokenizer


# ------------------------------------------------------------------------------------------------- messages


@dataclass
class EngineInit:
    """The engine process's first message: `build_engine`'s keyword arguments (names and numbers only)."""

    build: dict[str, Any] = field(default_factory=dict)
    num_threads: int = 0  # torch intra-op threads in the engine process (0 = torch's default)
    role: str = "engine"
    heartbeat_s: float = 0.5


@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.perf_counter() in the server (CLOCK_MONOTONIC: the same clock in both processes)


@dataclass
class Abort:
    request_id: str


@dataclass
class AbortAll:
    """Abort every live request (a stop); each still gets its final output."""


@dataclass
class EngineInfo:
    """The engine process's first reply after Ready: what the server needs to know about the model."""

    context_length: int
    vocab_size: int
    parallel_sampling: bool  # n > 1 allowed (chapter 06's engine; not speculative decoding)
    max_request_tokens: int | None  # the most KV tokens one request may need (`LLM.max_request_tokens`)
    snapshot: Snapshot


@dataclass
class StepOutputs:
    """One step's outputs, and the engine's state when one is due (every SNAPSHOT_EVERY_S, and when idle)."""

    outputs: list[RequestOutput]
    snapshot: Snapshot | None


# ------------------------------------------------------------------------------------------------- the child


class EngineWorker:
    """The engine process's `WorkerCore`: an `EngineCore` stepped by the worker loop instead of its own thread."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.ready: list[RequestOutput] = []  # outputs not yet sent
        self.core = EngineCore(engine, on_output=self.ready.append)
        self.info_sent = False
        self.last_snapshot = 0.0

    def handle(self, msg: Any) -> None:
        if isinstance(msg, AddRequest):
            try:
                self.core.add_request(msg.prompt_token_ids, msg.params, msg.request_id, msg.arrival_time)
            except (ValueError, TypeError) as exc:  # refused: the server is owed a final output per sample
                self.ready += [RequestOutput(msg.request_id, None, msg.prompt_token_ids, [], [], True, "error",
                                             error=f"request {msg.request_id!r} was refused: {exc}", index=i)
                               for i in range(msg.params.n)]
        elif isinstance(msg, Abort):
            self.core.abort(msg.request_id)
        elif isinstance(msg, AbortAll):
            for rid in list(self.core.live):
                self.core.abort(rid)
        else:
            raise TypeError(f"the engine process got an unknown message {type(msg).__name__}")

    def has_work(self) -> bool:
        return not self.info_sent or bool(self.ready) or self.core.has_work()

    def step(self) -> list[tuple[str, Any]]:
        if not self.info_sent:
            self.info_sent = True
            config = self.engine.model.config
            return [("ctrl", EngineInfo(config.block_size, config.vocab_size, *engine_limits(self.engine),
                                        engine_snapshot(self.engine)))]
        if self.core.has_work():
            self.core.step()
        now = time.perf_counter()
        snapshot = None
        if not self.engine.has_unfinished() or now - self.last_snapshot >= SNAPSHOT_EVERY_S:
            self.last_snapshot = now
            snapshot = engine_snapshot(self.engine)
        outputs, self.ready[:] = list(self.ready), []
        return [("ctrl", StepOutputs(outputs, snapshot))]


def engine_setup(init: EngineInit, inbox: Inbox) -> tuple[EngineWorker, dict]:
    """The engine role's setup (run in the child by `minillm.engine.process.worker_main`)."""
    check_instance("init", init, EngineInit, "the engine's EngineInit")
    # Ctrl-C in a terminal reaches the whole process group: the server drains, then stops this process itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    engine, _ = build_engine(**init.build)
    return EngineWorker(engine), {}


# ------------------------------------------------------------------------------------------------- the parent


class EngineProcess:
    """The engine process, started and ready: `EngineProcess(dict(model="base", num_blocks=512), threads=1)`.

    Blocks until the child has built its engine and said what it holds (`info`: context length, vocabulary,
    limits, state), or raises WorkerDiedError with the child's traceback. `stop()` ends it for sure (also at interpreter exit)."""

    def __init__(self, build: dict[str, Any] | None = None, threads: int | None = None, timeout: float = 300.0,
                 liveness_timeout_s: float = 60.0):
        if build is not None and not isinstance(build, dict):
            raise TypeError(f"build must be a dict of build_engine's keyword arguments, got {type(build).__name__}")
        build = dict(build or {})
        bad = [k for k, v in build.items() if not isinstance(v, (str, int, float, bool, type(None)))]
        if bad:
            raise TypeError(f"build arguments must be names and numbers (plain data for the child), got {bad}")
        unknown = sorted(set(build) - BUILD_ARGUMENTS - ENGINE_CONFIG_FIELDS)
        if unknown:  # here, not in the child: a misspelt name would cost a process start to report
            raise TypeError(f"build has unknown arguments {unknown}: build_engine takes {sorted(BUILD_ARGUMENTS)} "
                            f"and EngineConfig's fields {sorted(ENGINE_CONFIG_FIELDS)}")
        if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
            raise ValueError(f"threads must be a positive int or None, got {short_repr(threads)}")
        timeout = check_float("timeout", timeout, minimum=0.0, include_minimum=False)
        liveness_timeout_s = check_float("liveness_timeout_s", liveness_timeout_s, minimum=0.0, include_minimum=False)
        self.liveness_timeout_s = liveness_timeout_s
        ctx = multiprocessing.get_context("spawn")
        # Not daemonic: a tensor-parallel engine starts rank processes of its own, which a daemon may not.
        self.handle = WorkerHandle(ctx, EngineInit(build, threads or 0), engine_setup, daemon=False)
        self._finalizer = weakref.finalize(self, stop_all, [self.handle])
        self._send_lock = threading.Lock()
        try:
            wait_ready([self.handle], timeout)
            info = self._first_info(timeout)
        except BaseException:
            self.stop()
            raise
        self.info = info  # what the engine said about its model and limits

    def _first_info(self, timeout: float) -> EngineInfo:
        deadline = time.monotonic() + timeout
        failures: dict[str, str] = {}
        while time.monotonic() < deadline:
            got, failed = receive([self.handle], 0.5, self.liveness_timeout_s, failures)
            for _, msg in got:
                if isinstance(msg, EngineInfo):
                    return msg
            if failed:
                raise WorkerDiedError(failed)
        raise WorkerDiedError(f"the engine process said nothing about its model within {timeout} s")

    def send(self, msg: Any) -> None:
        """Send to the engine from any thread (one message at a time); WorkerDiedError if it is gone."""
        with self._send_lock:
            self.handle.send(msg)

    def stop(self) -> None:
        """Shutdown message, then SIGTERM, then SIGKILL (chapter 07's escalation)."""
        with self._send_lock:
            self._finalizer()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ProcessAsyncEngine(AsyncEngine):
    """`AsyncEngine` whose core is an `EngineProcess`: the same admission and routing, the transport a pipe.

    A reader thread receives each step's outputs and hands them to the event loop; it also watches the child, and
    if it dies (or raises, or stops sending heartbeats) every request in flight gets a final "error" output."""

    def __init__(self, process: EngineProcess, max_queued_requests: int = 256, max_queued_tokens: int = 1 << 20):
        check_instance("process", process, EngineProcess, "a started EngineProcess")
        self._init_routing(max_queued_requests, max_queued_tokens)
        self.process = process
        self.engine = None  # the engine lives in the other process
        info = process.info
        self.context_length, self.vocab_size = info.context_length, info.vocab_size
        self.parallel_sampling, self.max_request_tokens = info.parallel_sampling, info.max_request_tokens
        self.snapshot = info.snapshot
        self._owed: dict[str, set[int]] = {}  # request id -> sample indices still owed a final output (event loop)
        self._error: str | None = None
        self._closing = threading.Event()
        self._reader = threading.Thread(target=self._read, name="minillm-engine-reader", daemon=True)

    @property
    def error(self) -> str | None:
        return self._error

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._reader.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is left (each gets its final output), then end the engine process and the reader."""
        if self._error is None and self._reader.is_alive():
            try:
                self.process.send(AbortAll())
                deadline = time.monotonic() + min(timeout, 10.0)
                while self._owed and time.monotonic() < deadline and self._loop is not None \
                        and not self._loop.is_closed():
                    time.sleep(0.01)
            except WorkerDiedError:
                pass
        self._closing.set()
        self.process.stop()
        self._reader.join(timeout)

    def _add(self, request_id: str, prompt: str | list[int], params: SamplingParams, arrival: float) -> None:
        if self._error is not None or self._closing.is_set():
            raise RuntimeError(f"the engine is not serving: {self._error or 'it is stopping'}")
        if not isinstance(prompt, list):
            raise TypeError(f"the engine process takes token ids, got {type(prompt).__name__}")
        try:
            self.process.send(AddRequest(request_id, prompt, params, arrival))
        except WorkerDiedError as exc:
            raise RuntimeError(str(exc)) from exc
        self._owed[request_id] = set(range(params.n))

    def _abort_id(self, request_id: str) -> None:
        try:
            self.process.send(Abort(request_id))
        except WorkerDiedError:
            pass  # the reader fails every request of a dead engine

    def _route(self, out: RequestOutput) -> None:
        if out.finished:
            owed = self._owed.get(out.request_id)
            if owed is None or out.index not in owed:
                return  # already ended (an error sent for a dead engine, then the engine's own late output)
            owed.discard(out.index)
            if not owed:
                del self._owed[out.request_id]
        super()._route(out)

    def _read(self) -> None:
        """The reader thread: every message from the engine process, until it stops or fails."""
        failures: dict[str, str] = {}
        while not self._closing.is_set():
            got, failed = receive([self.process.handle], 0.5, self.process.liveness_timeout_s, failures)
            outputs: list[RequestOutput] = []
            for _, msg in got:
                if isinstance(msg, StepOutputs):
                    outputs += msg.outputs
                    if msg.snapshot is not None:
                        self.snapshot = msg.snapshot
            if outputs:
                self._hand_over(outputs)
            if failed and not self._closing.is_set():
                self._error = f"the engine process failed: {failed}"
                last = self.snapshot  # its queues and its pool went with it: nothing runs, nothing is held
                self.snapshot = Snapshot(time.time(), num_blocks=last.num_blocks, num_free_blocks=last.num_blocks,
                                         num_steps=last.num_steps, num_preemptions=last.num_preemptions,
                                         prefix_cache_hits=last.prefix_cache_hits, owners=[None] * last.num_blocks,
                                         shared=[False] * last.num_blocks, cached=[False] * last.num_blocks)
                self._call_on_loop(self._fail_all)
                return

    def _call_on_loop(self, fn: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn)
            except RuntimeError:
                pass  # the loop closed between the check and the call

    def _fail_all(self) -> None:
        """On the event loop: a final "error" output for every sample still owed one (its engine is gone)."""
        for rid, owed in sorted(self._owed.items()):
            for index in sorted(owed):
                self._route(RequestOutput(rid, None, [], [], [], True, "error", error=f"request {rid!r}: "
                                          f"{self._error}", index=index))

"""`EngineCore`: the engine behind an inbox and an outbox, so that another thread (a server's) can drive it.

What it adds to chapter 06's `LLM` (or any engine with its front end: chapter 08's `SpeculativeLLM`): thread
safety at the engine's edge. `add_request` and `abort` may be called from any thread; they are checked at once
(a bad request raises in the caller's thread, as `LLM.add_request` does) and queued, and the thread that owns the
loop applies them between steps, so the scheduler's queues are only ever touched by that one thread. The loop,
`run_forever` (or `start()`, which runs it on a thread of its own), steps the engine while it has work and sleeps
on an event while it has none; every output goes to `on_output` (by default the `outputs` queue). Every request
the core accepted gets exactly one final output per sample (n of them, told apart by `index`, for n > 1), however
it ended: finished, aborted, failed alone, refused when its turn came, or cut off by `stop()`, which aborts what
is left and delivers those outputs before it returns.
This is the shape of vLLM v1's `EngineCore` (an input queue, a busy loop, an output queue) at this project's size.
What it leaves out: a separate process for the core (a server here runs it on a thread; the GIL is released
inside torch's kernels), and priorities between requests (the scheduler's order is first come, first served).

    caller threads                              the loop's thread
    add_request ─check─▶ inbox ─┐               ┌─▶ step(): inbox applied, engine.step() ─▶ on_output(o)
    abort ─────────────▶ inbox ─┴─▶ wake ───────┘      (one per request and step; finished ones leave `live`)
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from minillm.core.config import check_float
from minillm.core.sampling import SamplingParams
from minillm.engine.frontend import sample_id
from minillm.engine.request import RequestOutput


class EngineCore:
    """Owns an engine (`LLM`, `SpeculativeLLM`, ...) and lets any thread add and abort requests on it.

    Only the loop's thread (the caller of `step`/`run_forever`, or the thread `start()` makes) touches the engine
    after construction; do not call the engine's own `add_request`/`step` meanwhile. `check_invariants` runs the
    scheduler's invariant checks after every step (tests). `idle_wait_s` bounds how long an idle loop sleeps
    before it looks at the stop flag again. `on_step(core)`, if given, runs on the loop's thread after every step
    (a server reads the engine's state there, where nothing mutates it meanwhile).
    """

    def __init__(self, engine: Any, on_output: Callable[[RequestOutput], None] | None = None,
                 check_invariants: bool = False, idle_wait_s: float = 0.1,
                 on_step: Callable[[EngineCore], None] | None = None):
        for name in ("_new_request", "_admit", "step", "abort", "has_unfinished"):
            if not callable(getattr(engine, name, None)):
                raise TypeError(f"EngineCore needs an engine with a front end (LLM, SpeculativeLLM), got "
                                f"{type(engine).__name__} without {name}()")
        for name, fn in (("on_output", on_output), ("on_step", on_step)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be a function or None, got {type(fn).__name__} {fn!r}")
        if not isinstance(check_invariants, bool):
            raise TypeError(f"check_invariants must be a bool, got {type(check_invariants).__name__}")
        # subtle: the loop's Event.wait would raise on NaN, and spin on 0 or a negative wait, inside its thread
        idle_wait_s = check_float("idle_wait_s", idle_wait_s, minimum=0.0, include_minimum=False)
        self.engine = engine
        self.outputs: queue.Queue[RequestOutput] = queue.Queue()
        self.on_output = on_output if on_output is not None else self.outputs.put
        self.check_invariants = check_invariants
        self.on_step = on_step
        self.idle_wait_s = idle_wait_s
        self._lock = threading.Lock()  # guards _inbox, live and _closed
        self._inbox: deque[tuple[str, Any]] = deque()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        # ids accepted and not yet given every final output -> the sample indices still owed one (n > 1: several)
        self.live: dict[str, set[int]] = {}
        self.num_steps = 0
        self.error: BaseException | None = None  # what broke the loop, if something did

    # ------------------------------------------------------------------------------------------ any thread

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Check one request now (ValueError/TypeError as `LLM.add_request`) and queue it; return its id."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine core is stopped: it takes no more requests")
            if request_id is None:
                request_id = f"core-{next(self._ids)}"
                while self._taken(request_id):
                    request_id = f"core-{next(self._ids)}"
            elif isinstance(request_id, str) and self._taken(request_id):
                raise ValueError(f"request_id {request_id!r} is already in use")
            # subtle: only reads the engine (config, tokenizer; its id table, which this lock's `live` already
            # covers): the loop's thread may be stepping meanwhile.
            req = self.engine._new_request(prompt, params, request_id, arrival_time)
            clash = [sample_id(req.request_id, i) for i in range(1, req.params.n)
                     if sample_id(req.request_id, i) in self.live]
            if clash:
                raise ValueError(f"request_id {req.request_id!r} with n={req.params.n} would name its samples "
                                 f"{clash}, already in use")
            self.live[req.request_id] = set(range(req.params.n))
            self._inbox.append(("add", req))
        self._wake.set()
        return req.request_id

    def _taken(self, request_id: str) -> bool:
        """A live id, or the internal id of a live request's parallel sample ("rid#i"), or, for "rid#i", the live
        request "rid" whose sample it would be. Called with the lock held."""
        base, _, index = request_id.rpartition("#")
        return request_id in self.live or (index.isdigit() and base in self.live) or any(
            request_id == sample_id(rid, i) for rid, owed in self.live.items() for i in owed)

    def abort(self, request_id: str) -> bool:
        """Queue an abort; True if the request is still live (its final output, "abort", follows), else False."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__} {request_id!r}")
        with self._lock:
            if request_id not in self.live:
                return False
            self._inbox.append(("abort", request_id))
        self._wake.set()
        return True

    @property
    def num_live(self) -> int:
        with self._lock:
            return len(self.live)

    # ------------------------------------------------------------------------------------------ the loop's thread

    def has_work(self) -> bool:
        with self._lock:
            queued = bool(self._inbox)
        return queued or self.engine.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Apply the inbox, run one engine step if there is work, and hand out its outputs; return them too."""
        outputs = self._apply_inbox()
        if self.engine.has_unfinished():
            outputs += self.engine.step()
            self.num_steps += 1
            if self.check_invariants:
                self.engine.scheduler.check_invariants()
        self._deliver(outputs)
        if self.on_step is not None:
            self.on_step(self)
        return outputs

    def run_forever(self) -> None:
        """Step while there is work, sleep while there is none, until `stop()`; then end every live request.

        If a step raises (a bug, not one request's failure: those end that request alone), every live request
        gets a final output with finish_reason "error", the exception is kept in `error`, and the loop ends."""
        try:
            while not self._stopping.is_set():
                self._wake.clear()  # subtle: before looking for work, so a request added meanwhile wakes us
                if not self.has_work():
                    self._wake.wait(self.idle_wait_s)
                    continue
                self.step()
            self._drain()
        except BaseException as exc:  # noqa: BLE001 - every caller waiting on an output must hear of it
            self.error = exc
            self._fail_all(f"the engine loop failed: {type(exc).__name__}: {exc}")
            with self._lock:
                self._closed = True

    def start(self) -> EngineCore:
        """Run `run_forever` on a daemon thread of its own; returns self."""
        if self._thread is not None:
            raise RuntimeError("the engine core was already started")
        self._thread = threading.Thread(target=self.run_forever, name="minillm-engine-core", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 30.0) -> None:
        """Refuse new requests, abort the live ones (each gets its final output), and end the loop's thread."""
        if timeout is not None:
            timeout = check_float("timeout", timeout, minimum=0.0)
        with self._lock:
            self._closed = True
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"the engine core's thread did not stop within {timeout} s")
        elif self.error is None:
            self._drain()  # nobody ran the loop on a thread: end the live requests here

    def __enter__(self) -> EngineCore:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------------ internals

    def _apply_inbox(self) -> list[RequestOutput]:
        """Admit and abort, in the order they were asked for; an admission that fails ends that request alone."""
        with self._lock:
            commands, self._inbox = self._inbox, deque()
        failed: list[RequestOutput] = []
        for kind, item in commands:
            if kind == "abort":
                self.engine.abort(item)  # its final output comes with the next engine step
                continue
            try:
                self.engine._admit(item)
            except Exception as exc:  # noqa: BLE001 - one request refused when its turn came; the others go on
                for sample in self.engine._samples(item):  # every sample of it: each is owed its final output
                    if not sample.is_finished:
                        sample.state.fail(f"request {item.request_id!r} could not be admitted: "
                                          f"{type(exc).__name__}: {exc}")
                        sample.finish()
                    failed.append(self.engine._output(sample))
        return failed

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                with self._lock:
                    owed = self.live.get(out.request_id, set())
                    owed.discard(out.index)
                    if not owed:
                        self.live.pop(out.request_id, None)
            self.on_output(out)

    def _drain(self) -> None:
        """Abort everything still live and step until each has had its final output."""
        self._deliver(self._apply_inbox())  # admit what was accepted, so that it ends like the rest
        with self._lock:
            live = sorted(self.live)
        for rid in live:
            self.engine.abort(rid)
        while self.engine.has_unfinished():
            self._deliver(self.engine.step())
        self._fail_all("the engine core stopped before this request ended")  # none should be left; if one is

    def _fail_all(self, message: str) -> None:
        """A final "error" output for every id still live (the engine cannot give them one any more)."""
        with self._lock:
            live, self.live = sorted(self.live.items()), {}
            self._inbox.clear()
        for rid, owed in live:
            for index in sorted(owed):
                self.on_output(RequestOutput(request_id=rid, prompt=None, prompt_token_ids=[], new_token_ids=[],
                                             output_token_ids=[], finished=True, finish_reason="error",
                                             error=f"request {rid!r}: {message}", index=index))

"""The front end every engine shares: check a request, give it an id, start its lifecycle, stream its outputs.

Adds `FrontEnd`, the base of chapter 06's `LLM` and chapter 07's `DisaggregatedLLM`: `add_request` validates its
arguments once (params re-validated, n, the prompt through `minillm.core.stopping.start_request`, the request id,
whether it could ever fit), builds the engine's `Request` around the `RequestState`, and hands it to the
subclass's `_enqueue`; `_output` builds the `RequestOutput` deltas; `generate` is the offline loop over `step`
(vLLM's `LLM.generate`). Parallel sampling (`SamplingParams.n > 1`, only where `supports_parallel_sampling`): the
request is built as n `Request`s, sample 0 under the user's id and samples 1..n-1 under internal ids
(`sample_id(rid, i)` = "rid#i", reserved like any id in use), held by sample 0 until the subclass forks them;
every sample streams its own outputs under the user's id and its `index`. What it leaves out: how requests are
run. A subclass supplies `_enqueue(request)`, `step()` and `abort(request_id)`, and may refine `_check_fits`
(will the request ever fit the KV pool?) and `_check_usable` (is the engine still able to serve?).

    add_request ─▶ _new_request (checks, start_request, ids; n > 1: samples 1..n-1 held by sample 0)
                ─▶ _admit ─▶ finished on arrival? ─yes─▶ pending output (one per sample)
                                   └──no──▶ _enqueue(sample 0) (the subclass; it starts the held samples)
    generate    ─▶ _new_request for every prompt first (one bad prompt rejects the call, nothing queued)
                ─▶ _admit each ─▶ step() until every one has its final RequestOutput
                   (other requests' outputs are held back, merged per request, for the caller's next step();
                    a loop whose steps stop making progress raises instead of spinning forever)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import threading
import time
from typing import Any, Callable, Iterator, Sequence, TypeVar

import numpy as np
import torch

from minillm.core.config import GPTConfig, check_int, short_repr
from minillm.core.sampling import SamplingParams
from minillm.core.stopping import check_eos_id, check_tokenizer_arg, default_eos, start_request
from minillm.engine.request import Request, RequestOutput


_F = TypeVar("_F", bound=Callable[..., Any])


def one_thread(method: _F) -> _F:
    """Run the engine method `method` holding its engine's `exclusive()` guard: a call made while another thread
    is inside one of the engine's guarded methods is a ValueError, raised before the method touches anything."""

    @functools.wraps(method)
    def guarded(self: "FrontEnd", *args: Any, **kwargs: Any) -> Any:
        with self.exclusive():
            return method(self, *args, **kwargs)

    return guarded  # type: ignore[return-value]


def sample_id(request_id: str, index: int) -> str:
    """The engine's id of sample `index` of the user's request `request_id`: its own id for sample 0, else "rid#i"
    (internal: outputs carry the user's id and the index; the front end never lets a user take one while in use)."""
    if not isinstance(request_id, str) or type(index) is not int or index < 0:  # one cheap test: ids are made often
        FrontEnd._check_id(request_id)
        check_int("index", index, 0)
    return request_id if index == 0 else f"{request_id}#{index}"


class FrontEnd:
    """Request validation, ids, outputs and `generate`, shared by `LLM` and `DisaggregatedLLM`.

    Subclasses call `_init_front_end` in their constructor and implement `_enqueue`, `step` and `abort`.
    `_requests` holds the requests the engine still owes an output, by engine id (a parallel sample's internal id
    included; their ids cannot be reused meanwhile); `_groups` the samples of each user's n > 1 request while any
    of them is unfinished (its id cannot be reused meanwhile either); `_pending` the outputs to hand out at the
    next `step()` (aborts, requests finished on arrival).

    One thread at a time: `generate`, `add_request`, `step` and `abort` hold the engine (`exclusive`), and one of
    them called from another thread meanwhile is a ValueError at once. Build one engine per thread, or let one
    thread drive it for many (`minillm.engine.core.EngineCore`, what the server does).
    """

    request_cls: type[Request] = Request  # what `_new_request` builds (DisaggregatedLLM adds a field or two)
    # `generate` raises once this many steps in a row made no progress (`_progress` unchanged, no output) while its
    # requests are unfinished: a leak (blocks never freed) then fails loudly instead of looping forever. None: off
    # (DisaggregatedLLM, whose steps wait on other processes and have liveness timeouts of their own).
    stall_steps: int | None = None
    # Whether the engine runs SamplingParams.n > 1 (n samples of one prompt). Off here, so an engine that does not
    # fork samples (chapter 07's DisaggregatedLLM, chapter 08's SpeculativeLLM) refuses n > 1 with a ValueError
    # naming n; chapter 06's LLM turns it on.
    supports_parallel_sampling: bool = False

    def _init_front_end(self, model_config: GPTConfig, tokenizer: Any, eos_id: int | None,
                        device: torch.device | str) -> None:
        self.model_config = model_config
        self.tokenizer = check_tokenizer_arg(tokenizer)
        check_eos_id(eos_id, model_config.vocab_size)
        self.eos_id = default_eos(tokenizer, eos_id)
        self.state_device = torch.device(device)  # where each request's generator lives (where it is sampled)
        self._requests: dict[str, Request] = {}
        self._groups: dict[str, list[Request]] = {}  # user id -> its n > 1 samples, while any is unfinished
        self._pending: list[RequestOutput] = []
        self._counter = itertools.count()
        self._busy = threading.Lock()  # held by the thread inside a guarded method (`exclusive`)
        self._owner: int | None = None  # that thread's id, so that its nested calls (generate -> step) go through

    @contextlib.contextmanager
    def exclusive(self) -> Iterator["FrontEnd"]:
        """Holds this engine for the calling thread while it runs a request-changing call (`generate`,
        `add_request`, `step`, `abort`: the `one_thread` methods), which that thread may nest (`generate` calls
        `step`). The same call from another thread meanwhile is a ValueError, at once, before it touches anything:
        the engine's queues, block tables and pending outputs are one batch's state, and two threads stepping it
        failed in the middle of a step (a q-shape error in the paged cache, an AssertionError), losing that
        thread's requests, while the running call now finishes with its right tokens. Non-blocking: it never
        waits (as `FusedCPUDecoder.exclusive`); waiting would only hide a second engine's worth of work queued
        behind the first."""
        me = threading.get_ident()
        if self._owner == me:  # only this thread sets _owner to its own id: it holds the engine already
            yield self
            return
        if not self._busy.acquire(blocking=False):
            raise ValueError(f"this {type(self).__name__} is already running generate/step/add_request/abort in "
                             "another thread: an engine runs one call at a time (it holds one batch); build one "
                             "engine per thread, or let one thread drive it (minillm.engine.core.EngineCore takes "
                             "requests from any thread)")
        self._owner = me
        try:
            yield self
        finally:
            self._owner = None
            self._busy.release()

    # ------------------------------------------------------------------------------------------ the subclass's part

    def _enqueue(self, req: Request) -> None:
        raise NotImplementedError

    def step(self) -> list[RequestOutput]:
        raise NotImplementedError

    def abort(self, request_id: str) -> bool:
        raise NotImplementedError

    def _check_usable(self) -> None:
        """Raise if the engine can take no more work (a closed or broken DisaggregatedLLM)."""

    @staticmethod
    def _check_id(request_id: Any) -> None:
        """`abort` and friends take the str a request was added under; anything else is a TypeError naming it."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__} {request_id!r}")

    def _check_fits(self, req: Request) -> None:
        """Raise ValueError if `req` could never run, even alone (its worst case exceeds the KV pool)."""

    def _progress(self) -> object:
        """A value that changes whenever a step did work (the LLM's forward count); see `stall_steps`."""
        return None

    # ------------------------------------------------------------------------------------------ requests

    def _encode(self, prompt: Any) -> tuple[str | None, Any]:
        """(the text or None, token ids): a string goes through the tokenizer; ids are checked by start_request."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise TypeError("prompt is a string but the engine has no tokenizer: pass token ids or a tokenizer")
            if not callable(getattr(self.tokenizer, "encode", None)):
                raise TypeError(f"prompt is a string but the engine's tokenizer ({type(self.tokenizer).__name__}) has "
                                "no encode(text) method: pass token ids, or a tokenizer that encodes")
            ids = self.tokenizer.encode(prompt)
            if not isinstance(ids, (list, tuple)):  # start_request checks each id; here, that there is a list
                raise TypeError(f"the engine's tokenizer ({type(self.tokenizer).__name__}) must encode text to a list "
                                f"of token ids, got {type(ids).__name__} {short_repr(ids)}")
            return prompt, list(ids)
        if not isinstance(prompt, (list, tuple, torch.Tensor, np.ndarray)):
            raise TypeError(f"prompt must be a str or a list of int token ids, got {type(prompt).__name__}")
        return None, prompt

    def _in_use(self, request_id: str, reserved: Any = ()) -> bool:
        """Whether an engine id is taken: a request still owed an output (a parallel sample's internal id too),
        a user's n > 1 request with a sample unfinished, or an id in `reserved`."""
        return request_id in self._requests or request_id in self._groups or request_id in reserved

    def _new_request(self, prompt: Any, params: SamplingParams | None, request_id: str | None,
                     arrival_time: float | None, reserved: Any = ()) -> Request:
        """Check everything about one request and build it; nothing is queued yet (so `generate` can check all).
        `reserved`: ids already given to requests built but not admitted yet (generate's batch, samples included).

        With params.n > 1 the result is sample 0, holding samples 1..n-1 in `held` (`_new_sample`)."""
        self._check_usable()
        if arrival_time is not None and (not isinstance(arrival_time, (int, float)) or isinstance(arrival_time, bool)
                                         or not math.isfinite(arrival_time)):
            raise TypeError(f"arrival_time must be a finite number (time.perf_counter() seconds) or None, got "
                            f"{type(arrival_time).__name__} {arrival_time!r}")
        params = SamplingParams.greedy() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__} {params!r}")
        params = dataclasses.replace(params)  # re-runs __post_init__: a field mutated into nonsense is caught now
        if params.n != 1 and not self.supports_parallel_sampling:
            raise ValueError(f"{type(self).__name__} runs one sample per request (no parallel sampling); "
                             f"got n={params.n}")
        n = params.n
        text, ids = self._encode(prompt)
        # The same prompt checks, window cap and stop rules as chapter 04's `generate`, so the tokens match it alone.
        state = start_request(self.model_config, ids, params, self.tokenizer, self.eos_id, device=self.state_device)
        if request_id is None:
            # subtle: skip ids in use, so a user who named a request "req-0" does not make generate() fail
            request_id = f"req-{next(self._counter)}"
            while any(self._in_use(sample_id(request_id, i), reserved) for i in range(n)):
                request_id = f"req-{next(self._counter)}"
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__} {request_id!r}")
        if self._in_use(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        for i in range(1, n):  # the samples' internal ids must be free too, or two requests would share one
            if self._in_use(sample_id(request_id, i)):
                raise ValueError(f"request_id {request_id!r} with n={n} names its samples {request_id!r}#1.."
                                 f"#{n - 1}, and {sample_id(request_id, i)!r} is already in use")
        req = self.request_cls(request_id, state.prompt_ids, state.params, prompt=text, state=state,
                               arrival_time=time.perf_counter() if arrival_time is None else arrival_time)
        self._check_fits(req)  # every sample has sample 0's worst case; they need not fit the pool all at once
        req.held = [self._new_sample(req, i) for i in range(1, n)]
        return req

    def _new_sample(self, first: Request, index: int) -> Request:
        """Sample `index` of `first`'s request (chapter 05's seeding: `RequestState.fork(params.seed + index)`, the
        generator an independent request seeded `params.seed + index` would have; unseeded stays unseeded)."""
        seed = first.params.seed
        state = first.state.fork(seed + index if seed is not None else None)
        if first.state.finished:  # max_new_tokens 0: every sample is finished on arrival, as sample 0 is
            state.stop_checker.finish_reason = first.state.finish_reason
        return self.request_cls(sample_id(first.request_id, index), state.prompt_ids, state.params,
                                prompt=first.prompt, state=state, arrival_time=first.arrival_time, index=index,
                                parent_id=first.request_id)

    @staticmethod
    def _samples(req: Request) -> list[Request]:
        """Sample 0 and the samples it still holds (just `[req]` for n == 1, or once the held ones were started)."""
        return [req, *req.held]

    def _admit(self, req: Request) -> None:
        """Queue a checked request, or, with nothing to generate (max_new_tokens 0), finish it on arrival (each of
        its samples, one final output each). Held samples are registered here and started by the subclass."""
        samples = self._samples(req)
        if req.state.finished:
            for r in samples:
                r.finish()
                self._pending.append(self._output(r))
            req.held = []
            return
        # subtle: checked again, since EngineCore builds requests ahead and admits them later, when an id built
        # in between (another request's sample, say) may have taken one of these
        for r in samples:
            if self._in_use(r.request_id):
                raise ValueError(f"request_id {r.request_id!r} is already in use")
        for r in samples:
            self._requests[r.request_id] = r
        if req.held:
            self._groups[req.request_id] = samples
        self._enqueue(req)

    def _forget(self, req: Request) -> None:
        """`req` has its final output: drop it from `_requests`, and its group once every sample of it is done."""
        del self._requests[req.request_id]
        group = self._groups.get(req.output_id)
        if group is not None and all(r.is_finished for r in group):
            del self._groups[req.output_id]

    @one_thread
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Queue one request; return its id. Everything is checked here, so a bad request never disturbs a batch.

        Rejected with ValueError/TypeError: a params object that is not a valid `SamplingParams` (re-validated
        here, so one mutated after construction is caught too), n > 1 on an engine without parallel sampling
        (`supports_parallel_sampling`: chapter 07's and chapter 08's engines), an empty or out-of-vocabulary
        prompt, a prompt longer than the context window, stop strings without a tokenizer, a duplicate id (or,
        for n > 1, one of its samples' internal ids "id#1".."id#{n-1}" in use), and a request that could never
        fit the engine's KV pool even if it ran alone (`_check_fits`).

        With n > 1 the n samples stream separately, each `RequestOutput` carrying this id and its `index`.
        """
        req = self._new_request(prompt, params, request_id, arrival_time)
        self._admit(req)
        return req.request_id

    # ------------------------------------------------------------------------------------------ outputs

    def _output(self, req: Request) -> RequestOutput:
        """The request's delta since its last output, plus everything so far.

        Text streams as the stop checker allows (`StopChecker.streamable_length`): whole characters only, never
        a tail that could still become a stop string, and never any part of one that matched; `text` is what has
        been streamed so far (at the end, vLLM's output text: the stop string and what follows it cut off)."""
        new = req.output_token_ids[req.num_streamed :]
        req.num_streamed = len(req.output_token_ids)
        text = new_text = None
        if self.tokenizer is not None:
            checker = req.state.stop_checker
            end = max(checker.streamable_length(), req.num_streamed_chars)  # what was streamed stays streamed
            text = checker.text[:end]
            new_text = text[req.num_streamed_chars :]
            req.num_streamed_chars = end
        return RequestOutput(
            request_id=req.output_id, index=req.index, prompt=req.prompt, prompt_token_ids=list(req.prompt_token_ids),
            new_token_ids=list(new), output_token_ids=list(req.output_token_ids), finished=req.is_finished,
            finish_reason=req.finish_reason, text=text, new_text=new_text, arrival_time=req.arrival_time,
            token_times=list(req.token_times), num_preemptions=req.num_preemptions, error=req.error,
        )

    def _merge(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """One output per request and sample (`(request_id, index)`): consecutive deltas of one sample joined (in
        the order first seen), the newer output's totals kept. What `step()` returns after `generate` held other
        requests' outputs back."""
        merged: dict[tuple[str, int], RequestOutput] = {}
        for out in outputs:
            key = (out.request_id, out.index)
            old = merged.get(key)
            if old is not None:
                out = dataclasses.replace(out, new_token_ids=old.new_token_ids + out.new_token_ids,
                                          new_text=None if out.new_text is None else old.new_text + out.new_text)
            merged[key] = out
        return list(merged.values())

    @one_thread
    def generate(self, prompts: Sequence[Any] | str, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion; their final `RequestOutput`s, in prompt order.

        One output per prompt when n == 1. A prompt whose params have n > 1 contributes its n final outputs, in
        `index` order 0..n-1, at its place in the flat list: prompts [a, b] with n = 1 for a and n = 3 for b give
        [a, b#0, b#1, b#2] (`out.request_id` and `out.index` say which is which).

        Every request is validated before any is queued, so one bad prompt rejects the call ("prompts[i]: ...")
        and leaves the engine as it was; so does a call made while another thread runs this engine (`exclusive`).
        Requests added with `add_request` keep running alongside; their outputs produced meanwhile are held back, one
        merged delta per request and sample, for the caller's next `step()`.
        """
        self._check_usable()  # a closed engine says so once, not as prompts[0]'s error
        if isinstance(prompts, (str, torch.Tensor, np.ndarray)) or (  # one prompt of ids (an array is one too)
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], (int, np.integer))
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(params, SamplingParams) or params is None:
            params_list = [params] * len(prompts)
        else:
            params_list = list(params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        reqs: list[Request] = []
        reserved: set[str] = set()  # the batch's ids, every sample's included
        for i, (prompt, p) in enumerate(zip(prompts, params_list)):
            try:
                reqs.append(self._new_request(prompt, p, None, None, reserved=reserved))
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"prompts[{i}]: {exc}") from None
            reserved.update(r.request_id for r in self._samples(reqs[-1]))
        keys = [(r.output_id, r.index) for req in reqs for r in self._samples(req)]  # (request_id, index), in order
        for req in reqs:
            self._admit(req)
        wanted, final = set(keys), {}
        held: list[RequestOutput] = []  # other requests' outputs: the caller's next step() hands them out
        stalled, mark = 0, self._progress()
        try:
            while len(final) < len(wanted):
                outs = self.step()
                for out in outs:
                    key = (out.request_id, out.index)
                    if key not in wanted:
                        held.append(out)
                    elif out.finished:
                        final[key] = out
                if self.stall_steps is not None:
                    now = self._progress()
                    stalled = 0 if (outs or now != mark) else stalled + 1
                    mark = now
                    if stalled >= self.stall_steps:
                        stuck = [rid if i == 0 else f"{rid} sample {i}" for rid, i in keys if (rid, i) not in final]
                        raise RuntimeError(
                            f"generate() made no progress for {stalled} steps with requests {stuck} unfinished "
                            f"(stats: {self._stall_report()}): the engine is stuck, likely leaked KV blocks")
        finally:
            self._pending[:0] = held
        return [final[key] for key in keys]

    def _stall_report(self) -> Any:
        """What `generate` prints when it is stuck (the LLM's queue lengths and free blocks)."""
        return None

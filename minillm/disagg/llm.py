"""`DisaggregatedLLM`: chapter 06's `generate` surface, served by a prefill process and a decode process.

It adds the coordinator of a disaggregated server. The user's process tokenizes, hands prompts to the prefill
worker, receives the first token from it and every later token from the decode worker, checks stop strings, and
watches both workers; the KV of each prompt goes from worker to worker, never through here. What it leaves out:
more than one worker per role (DistServe and Splitwise size the two pools separately), restarting a dead worker,
and prefix caching.

    user ──generate()──► DisaggregatedLLM ──PrefillRequest──► prefill worker (own pool, own device)
                           ▲        ▲                               │ KVHandoff: first token + KV bytes
                           │        └──────FirstTokens──────────────┤ (pipe "peer")
                           │                                        ▼
                           └──────────DecodeTokens──────────── decode worker (own pool, own device)

Failure model: the two workers are one serving instance. If either dies (its process sentinel fires), raises
(WorkerFailed) or falls silent for `liveness_timeout_s` (no heartbeat), every unfinished request fails with a
`WorkerDiedError` that names the worker, how it ended and the request ids, and the instance refuses new work.
Nothing ever waits without a timeout. `close()` (or leaving a `with` block, or garbage collection, or interpreter
exit, through `weakref.finalize`) stops both processes: Shutdown, then SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing import get_context
from multiprocessing.connection import wait
from typing import Any

import torch

from minillm.disagg.config import DisaggConfig
from minillm.disagg.decode_worker import max_kv_tokens
from minillm.disagg.messages import (
    Abort,
    CrashAfter,
    DecodeTokens,
    FirstTokens,
    Heartbeat,
    PrefillRequest,
    StepRecord,
    TransferRecord,
    WorkerFailed,
    WorkerInit,
)
from minillm.disagg.worker import WorkerDiedError, WorkerHandle, model_to_bytes, wait_ready
from minillm.engine.request import RequestOutput
from minillm.naive.generate import StopChecker, _default_eos, validate_prompt
from minillm.core.model import GPT
from minillm.paged import num_blocks_for
from minillm.core.sampling import SamplingParams


@dataclass
class _Req:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    stop_checker: StopChecker
    output_token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    num_streamed: int = 0
    error: str | None = None
    wid: str = ""  # the id the workers know it by: unique for the engine's life, unlike a user's request_id


def _shutdown(handles: list[WorkerHandle]) -> None:
    """Stop every worker for sure; module-level so `weakref.finalize` holds no reference to the engine."""
    for h in handles:  # ask all first, so they exit in parallel
        h.request_stop()
    for h in handles:
        h.stop()


class DisaggregatedLLM:
    """Prefill and decode in two processes; `generate`, `add_request`, `step`, `abort` as chapter 06's `LLM`."""

    def __init__(self, model: GPT, tokenizer: Any = None, config: DisaggConfig | None = None,
                 eos_id: int | None = None):
        from minillm.core.device import resolve_device

        if not isinstance(model, GPT):
            raise TypeError(f"model must be a minillm GPT, got {type(model).__name__}")
        config = DisaggConfig() if config is None else config
        if not isinstance(config, DisaggConfig):
            raise TypeError(f"config must be a DisaggConfig, got {type(config).__name__}")
        self.config = config
        self.model_config = model.config
        self.tokenizer = tokenizer
        self.eos_id = _default_eos(tokenizer, eos_id)
        ctx_window = model.config.block_size
        devices = {role: str(resolve_device(getattr(config, f"{role}_device") or config.device))
                   for role in ("prefill", "decode")}
        self.devices = devices
        cfg_dict, weights = model_to_bytes(model)
        common = dict(config=cfg_dict, weights=weights, block_size=config.block_size, eos_id=self.eos_id,
                      heartbeat_s=config.heartbeat_s, num_threads=config.num_threads,
                      max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens)
        # The prefill pool only holds the prompts of one step: the token budget (or one full window) plus one
        # partly filled block per prompt.
        prefill_blocks = num_blocks_for(max(config.max_num_batched_tokens, ctx_window), config.block_size) \
            + config.max_num_seqs
        ctx = get_context("spawn")
        peer_recv, peer_send = ctx.Pipe(duplex=False)  # prefill -> decode, the KV hand-off
        self._handles: list[WorkerHandle] = []
        self._finalizer = weakref.finalize(self, _shutdown, self._handles)  # also runs at interpreter exit
        self.prefill = WorkerHandle(ctx, WorkerInit(role="prefill", device=devices["prefill"],
                                                    num_blocks=prefill_blocks, **common), peer_send)
        self._handles.append(self.prefill)
        self.decode = WorkerHandle(ctx, WorkerInit(role="decode", device=devices["decode"],
                                                   num_blocks=config.num_blocks, **common), peer_recv)
        self._handles.append(self.decode)
        peer_recv.close()  # the workers hold the only ends now: a dead prefill worker reads as EOF in decode
        peer_send.close()
        try:
            wait_ready(self._handles, config.startup_timeout_s)
        except BaseException:
            self.close()
            raise
        self._reqs: dict[str, _Req] = {}  # unfinished requests (and finished ones not yet handed out) by user id
        self._pending: list[RequestOutput] = []  # outputs for the next step(): aborts, empty requests
        self._ids = itertools.count()
        self._wids = itertools.count()
        self._by_wid: dict[str, str] = {}  # worker id -> user request id (kept: late messages still map)
        self._broken: WorkerDiedError | None = None
        self.timeline: list[StepRecord] = []  # every model step of both workers, in arrival order
        self.transfers: list[TransferRecord] = []  # every KV hand-off the decode worker received

    # ----------------------------------------------------------------------------------------------- lifecycle
    @property
    def worker_pids(self) -> dict[str, int | None]:
        return {h.role: h.process.pid for h in self._handles}

    def close(self) -> None:
        """Stop both workers (idempotent). Unfinished requests are dropped."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> "DisaggregatedLLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _inject_crash(self, role: str, after_steps: int = 0) -> None:
        """Test hook: make the `role` worker die (os._exit) after `after_steps` more model steps."""
        handle = {h.role: h for h in self._handles}.get(role)
        if handle is None:
            raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
        handle.send(CrashAfter(after_steps))

    # ----------------------------------------------------------------------------------------------- requests
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Queue one request; returns its id. `arrival_time` (perf_counter) defaults to now.

        Checked here, with chapter 06's rules and messages (`validate_prompt`): n > 1, an empty, out-of-vocabulary
        or too long prompt, a duplicate id, and a request the decode pool could never hold.
        """
        req = self._prepare(prompt, params, request_id, arrival_time)
        self._submit(req)
        return req.request_id

    def _prepare(self, prompt: Any, params: SamplingParams | None, request_id: str | None,
                 arrival_time: float | None) -> _Req:
        self._check_usable()
        params = SamplingParams.greedy() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__} {params!r}")
        params = dataclasses.replace(params)  # re-validates a params object mutated after construction
        if params.n != 1:
            raise ValueError(f"DisaggregatedLLM serves one sample per request; got n={params.n}")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings {params.stop!r} need a tokenizer")
        text = prompt if isinstance(prompt, str) else None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise TypeError("prompt is a string but the engine has no tokenizer: pass token ids or a tokenizer")
            prompt = list(self.tokenizer.encode(prompt))
        elif isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        elif not isinstance(prompt, (list, tuple)):
            raise TypeError(f"prompt must be a str or a list of int token ids, got {type(prompt).__name__}")
        cfg = self.model_config
        ids, max_new = validate_prompt(prompt, params, cfg.vocab_size, cfg.block_size)
        params = dataclasses.replace(params, max_new_tokens=max_new)  # the window cap, as chapters 04 and 06
        worst = num_blocks_for(max_kv_tokens(len(ids), max_new, cfg.block_size), self.config.block_size)
        if worst > self.config.num_blocks:
            raise ValueError(f"request needs up to {worst} KV blocks but the decode pool has num_blocks="
                             f"{self.config.num_blocks}: it could never run")
        rid = f"req-{next(self._ids)}" if request_id is None else request_id
        if not isinstance(rid, str):
            raise TypeError(f"request_id must be a str, got {type(rid).__name__} {rid!r}")
        if rid in self._reqs:
            raise ValueError(f"request_id {rid!r} is already in use")
        return _Req(rid, text, ids, params, time.perf_counter() if arrival_time is None else arrival_time,
                    StopChecker(self.tokenizer, params, self.eos_id))

    def _submit(self, req: _Req) -> None:
        # subtle: workers see a fresh id per request, never the user's. A user may reuse an id once its request
        # finished, and a late Abort (sent after a stop string, crossing the worker's own finish) must not hit
        # the newcomer.
        req.wid = f"w{next(self._wids)}"
        self._by_wid[req.wid] = req.request_id
        if req.params.max_new_tokens == 0:  # nothing to generate: finished on arrival, never sent
            req.finished, req.finish_reason = True, "length"
            self._pending.append(self._output(req))
        else:
            self._reqs[req.request_id] = req
            self.prefill.send(PrefillRequest(req.wid, req.prompt_token_ids, req.params))

    def abort(self, request_id: str) -> bool:
        """Stop a request; its final output (finish_reason "abort") comes with the next `step()`. Returns False if
        the id is unknown or already finished (as chapter 06's `LLM.abort`)."""
        req = self._reqs.get(request_id)
        if req is None or req.finished:
            return False
        req.finished, req.finish_reason = True, "abort"
        del self._reqs[request_id]
        self._pending.append(self._output(req))
        for h in self._handles:
            h.send(Abort([req.wid]))
        return True

    def has_unfinished(self) -> bool:
        return any(not r.finished for r in self._reqs.values())

    # ----------------------------------------------------------------------------------------------- the loop
    def step(self, timeout: float | None = None) -> list[RequestOutput]:
        """Wait up to `timeout` s (default: one heartbeat) for worker messages; return the requests that moved.

        Raises WorkerDiedError when a worker died, raised or fell silent; the requests it held are failed.
        """
        self._check_usable()
        timeout = self.config.heartbeat_s if timeout is None else max(0.0, timeout)
        if self._pending:
            timeout = 0.0  # outputs are already waiting: hand them out without sleeping
        waitables: list[Any] = [h.conn for h in self._handles] + [h.process.sentinel for h in self._handles]
        wait(waitables, timeout=timeout)
        moved: dict[str, None] = {}
        for h in self._handles:
            while True:
                try:
                    if not h.conn.poll():
                        break
                    msg = h.conn.recv()
                except (EOFError, OSError):
                    break  # the process is gone; its sentinel says how, below
                h.last_seen = time.monotonic()
                self._on_message(h, msg, moved)
        for h in self._handles:
            if not h.process.is_alive():
                h.process.join(1.0)
                self._fail(f"the {h.describe()}")
            if time.monotonic() - h.last_seen > self.config.liveness_timeout_s:
                self._fail(f"the {h.role} worker (pid {h.process.pid}) sent nothing, not even a heartbeat, for "
                           f"{time.monotonic() - h.last_seen:.1f} s (liveness_timeout_s="
                           f"{self.config.liveness_timeout_s}): it looks hung")
        outputs, self._pending = self._pending, []
        for rid in moved:
            req = self._reqs[rid]
            outputs.append(self._output(req))
            if req.finished:  # handed out for the last time: the id is free again, as in chapter 06
                del self._reqs[rid]
        return outputs

    def _on_message(self, h: WorkerHandle, msg: Any, moved: dict[str, None]) -> None:
        now = time.perf_counter()
        if isinstance(msg, Heartbeat):
            return
        if isinstance(msg, WorkerFailed):
            self._fail(f"the {msg.role} worker raised:\n{msg.traceback}")
        if isinstance(msg, FirstTokens):
            self.timeline.append(self._user_ids(msg.step))
            items = msg.items
        elif isinstance(msg, DecodeTokens):
            self.timeline.append(self._user_ids(msg.step))
            self.transfers.extend(dataclasses.replace(t, request_id=self._by_wid.get(t.request_id, t.request_id))
                                  for t in msg.transfers)
            items = msg.items
        else:
            raise WorkerDiedError(f"unexpected message {type(msg).__name__} from the {h.role} worker")
        for wid, token, worker_done in items:
            rid = self._by_wid.get(wid)
            req = self._reqs.get(rid) if rid is not None else None
            if req is None or req.wid != wid or req.finished:
                continue  # aborted or stopped here while the worker was still producing
            req.output_token_ids.append(token)
            req.token_times.append(now)
            moved[rid] = None
            # The same finish rule as chapter 06's scheduler: the stop checker (eos, stop strings, length), then the
            # context window. The workers apply the id-level part; stop strings only the coordinator can see.
            stop = req.stop_checker.update(token)
            reason = req.stop_checker.finish_reason if stop else None
            if not stop and len(req.prompt_token_ids) + len(req.output_token_ids) > self.model_config.block_size:
                stop, reason = True, "length"
            if stop:
                req.finished, req.finish_reason = True, reason
                if not worker_done:  # a stop string: the decode worker would go on, so tell it to stop
                    for handle in self._handles:
                        handle.send(Abort([wid]))
            elif worker_done:
                raise WorkerDiedError(f"the {h.role} worker finished request {rid!r} but the coordinator did not")

    def _user_ids(self, step: StepRecord) -> StepRecord:
        return dataclasses.replace(step, request_ids=[self._by_wid.get(w, w) for w in step.request_ids])

    def _output(self, req: _Req) -> RequestOutput:
        new = req.output_token_ids[req.num_streamed:]
        req.num_streamed = len(req.output_token_ids)
        tok = self.tokenizer
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=list(req.prompt_token_ids),
            new_token_ids=list(new),
            output_token_ids=list(req.output_token_ids),
            finished=req.finished,
            finish_reason=req.finish_reason,
            text=(req.stop_checker.output_text() if req.finished else tok.decode(req.output_token_ids))
            if tok is not None else None,
            new_text=tok.decode(new) if tok is not None else None,
            arrival_time=req.arrival_time,
            token_times=list(req.token_times),
        )

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise WorkerDiedError(f"this DisaggregatedLLM is unusable: {self._broken}")
        if self.closed:
            raise ValueError("this DisaggregatedLLM is closed")

    def _fail(self, what: str) -> None:
        failed = [r.request_id for r in self._reqs.values() if not r.finished]
        for rid in failed:
            r = self._reqs[rid]
            r.finished, r.finish_reason, r.error = True, "abort", what
        self._broken = WorkerDiedError(f"{what}; {len(failed)} unfinished request(s) failed: {failed}")
        raise self._broken

    # ----------------------------------------------------------------------------------------------- offline
    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order (as chapter 06's `LLM.generate`)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
            plist = params
        else:
            plist = [params] * len(prompts)  # type: ignore[list-item]
        reqs: list[_Req] = []
        for i, (p, sp) in enumerate(zip(prompts, plist)):  # validate every prompt before any is sent
            try:
                reqs.append(self._prepare(p, sp, None, None))
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"prompts[{i}]: {exc}") from None
        for req in reqs:
            self._submit(req)
        ids = [r.request_id for r in reqs]
        wanted, final = set(ids), {}
        while len(final) < len(wanted):
            for out in self.step():
                if out.finished and out.request_id in wanted:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]

"""`DisaggregatedLLM`: chapter 06's `generate` surface, served by a prefill process and a decode process.

It adds the coordinator of a disaggregated server. The user's process tokenizes, hands prompts to the prefill
worker, receives the first token from it and every later token from the decode worker, checks stop strings, and
watches both workers. Request checks, ids, `RequestOutput`s and `generate` are chapter 06's `FrontEnd`, and each
request's tokens go through the same `RequestState.accept` as in every other loop; the KV of each prompt goes from worker to worker, never through here. What it leaves out:
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
from dataclasses import dataclass
from multiprocessing import get_context
from typing import Any

from minillm.core.config import short_repr
from minillm.core.device import place_with_model
from minillm.core.model import GPT, require_model
from minillm.disagg.config import DisaggConfig
from minillm.core.formats import model_to_bytes, sha256
from minillm.disagg.messages import (
    Abort,
    DecodeTokens,
    FirstTokens,
    PrefillRequest,
    StepRecord,
    TransferRecord,
    WorkerInit,
)
from minillm.disagg.worker import setup_decode, setup_prefill
from minillm.engine.process import CrashAfter, WorkerDiedError, WorkerHandle, receive, stop_all, wait_ready
from minillm.engine.frontend import FrontEnd, one_thread
from minillm.engine.request import Request, RequestOutput, RequestStatus
from minillm.paged import num_blocks_for


@dataclass
class _Req(Request):
    """The coordinator's view of a request: the engine's `Request` (its state, times, status), plus the id the
    workers know it by and why it failed, if a worker died."""

    worker_error: str | None = None  # the worker death that failed it (finish_reason "abort")
    wid: str = ""  # unique for the engine's life, unlike a user's request_id

    @property
    def error(self) -> str | None:
        return self.worker_error or self.state.error


class DisaggregatedLLM(FrontEnd):
    """Prefill and decode in two processes; `generate`, `add_request`, `step`, `abort` as chapter 06's `LLM`."""

    request_cls = _Req

    def __init__(self, model: GPT, tokenizer: Any = None, config: DisaggConfig | None = None,
                 eos_id: int | None = None):
        model_config = require_model(model, "DisaggregatedLLM")
        config = DisaggConfig() if config is None else config
        if not isinstance(config, DisaggConfig):
            raise TypeError(f"config must be a DisaggConfig, got {type(config).__name__}")
        self.config = config
        # The coordinator never samples (the workers do), so its requests' generators live on the CPU, unused.
        self._init_front_end(model_config, tokenizer, eos_id, "cpu")
        ctx_window = model_config.block_size
        devices = {role: str(place_with_model(getattr(config, f"{role}_device") or config.device, model.device))
                   for role in ("prefill", "decode")}
        self.devices = devices
        weights = model_to_bytes(model)  # any format: plain, quantized, pruned (minillm.core.formats)
        common = dict(model=weights, model_sha256=sha256(weights), block_size=config.block_size, eos_id=self.eos_id,
                      heartbeat_s=config.heartbeat_s, num_threads=config.num_threads,
                      max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens)
        # The prefill pool only holds the prompts of one step: the token budget (or one full window) plus one
        # partly filled block per prompt.
        prefill_blocks = num_blocks_for(max(config.max_num_batched_tokens, ctx_window), config.block_size) \
            + config.max_num_seqs
        ctx = get_context("spawn")
        peer_recv, peer_send = ctx.Pipe(duplex=False)  # prefill -> decode, the KV hand-off
        self._handles: list[WorkerHandle] = []
        self._finalizer = weakref.finalize(self, stop_all, self._handles)  # also runs at interpreter exit
        self.prefill = WorkerHandle(ctx, WorkerInit(role="prefill", device=devices["prefill"],
                                                    num_blocks=prefill_blocks, **common), setup_prefill, peer_send)
        self._handles.append(self.prefill)
        self.decode = WorkerHandle(ctx, WorkerInit(role="decode", device=devices["decode"],
                                                   num_blocks=config.num_blocks, **common), setup_decode, peer_recv)
        self._handles.append(self.decode)
        peer_recv.close()  # the workers hold the only ends now: a dead prefill worker reads as EOF in decode
        peer_send.close()
        try:
            wait_ready(self._handles, config.startup_timeout_s)
        except BaseException:
            self.close()
            raise
        # self._requests (the front end's) holds unfinished requests and finished ones not yet handed out
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
    def _check_usable(self) -> None:
        if self._broken is not None:
            raise WorkerDiedError(f"this DisaggregatedLLM is unusable: {self._broken}")
        if self.closed:
            raise ValueError("this DisaggregatedLLM is closed")

    def _check_fits(self, req: Request) -> None:
        worst = num_blocks_for(req.max_kv_tokens, self.config.block_size)
        if worst > self.config.num_blocks:
            raise ValueError(f"request needs up to {worst} KV blocks but the decode pool has num_blocks="
                             f"{self.config.num_blocks}: it could never run")

    def _enqueue(self, req: _Req) -> None:
        # subtle: workers see a fresh id per request, never the user's. A user may reuse an id once its request
        # finished, and a late Abort (sent after a stop string, crossing the worker's own finish) must not hit
        # the newcomer.
        req.wid = f"w{next(self._wids)}"
        self._by_wid[req.wid] = req.request_id
        self.prefill.send(PrefillRequest(req.wid, req.prompt_token_ids, req.params))

    @one_thread
    def abort(self, request_id: str) -> bool:
        """Stop a request; its final output (finish_reason "abort") comes with the next `step()`. Returns False if
        the id is unknown or already finished (as chapter 06's `LLM.abort`)."""
        self._check_id(request_id)
        req = self._requests.get(request_id)
        if req is None or req.is_finished:
            return False
        req.status, req.finish_reason = RequestStatus.FINISHED_ABORTED, "abort"
        del self._requests[request_id]
        self._pending.append(self._output(req))
        for h in self._handles:
            h.send(Abort([req.wid]))
        return True

    def has_unfinished(self) -> bool:
        """True while a request is unfinished or an output is still to be handed out (see `LLM.has_unfinished`)."""
        return any(not r.is_finished for r in self._requests.values()) or bool(self._pending)

    # ----------------------------------------------------------------------------------------------- the loop
    @one_thread
    def step(self, timeout: float | None = None) -> list[RequestOutput]:
        """Wait up to `timeout` s (default: one heartbeat) for worker messages; return the requests that moved.

        Raises WorkerDiedError when a worker died, raised or fell silent; the requests it held are failed.
        """
        self._check_usable()
        if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool)
                                    or timeout != timeout):
            raise TypeError(f"timeout must be a number of seconds or None, got {type(timeout).__name__} "
                            f"{short_repr(timeout)}")
        timeout = self.config.heartbeat_s if timeout is None else max(0.0, timeout)
        if self._pending:
            timeout = 0.0  # outputs are already waiting: hand them out without sleeping
        messages, failure = receive(self._handles, timeout, self.config.liveness_timeout_s)
        moved: dict[str, None] = {}
        for h, msg in messages:
            self._on_message(h, msg, moved)
        if failure is not None:
            self._fail(failure)
        outputs, self._pending = self._pending, []
        for rid in moved:
            req = self._requests[rid]
            outputs.append(self._output(req))
            if req.is_finished:  # handed out for the last time: the id is free again, as in chapter 06
                del self._requests[rid]
        return self._merge(outputs)

    def _on_message(self, h: WorkerHandle, msg: Any, moved: dict[str, None]) -> None:
        now = time.perf_counter()
        if isinstance(msg, FirstTokens):
            self.timeline.append(self._user_ids(msg.step))
            self._on_errors(h, msg.errors, now, moved)
            items = msg.items
        elif isinstance(msg, DecodeTokens):
            self.timeline.append(self._user_ids(msg.step))
            self.transfers.extend(dataclasses.replace(t, request_id=self._by_wid.get(t.request_id, t.request_id))
                                  for t in msg.transfers)
            self._on_errors(h, msg.errors, now, moved)
            items = msg.items
        else:
            raise WorkerDiedError(f"unexpected message {type(msg).__name__} from the {h.role} worker")
        for wid, token, worker_done in items:
            rid = self._by_wid.get(wid)
            req = self._requests.get(rid) if rid is not None else None
            if req is None or req.wid != wid or req.is_finished:
                continue  # aborted or stopped here while the worker was still producing
            moved[rid] = None
            # The one stop rule of every loop (`RequestState.accept`): eos, stop strings, max tokens, the window.
            # The workers apply the same rule without stop strings; those only the coordinator can see.
            if req.accept([token], now):
                if not worker_done:  # a stop string: the decode worker would go on, so tell it to stop
                    for handle in self._handles:
                        handle.send(Abort([wid]))
            elif worker_done:
                raise WorkerDiedError(f"the {h.role} worker finished request {rid!r} but the coordinator did not")

    def _on_errors(self, h: WorkerHandle, errors: list[tuple[str, str]], now: float, moved: dict[str, None]) -> None:
        """Requests a worker failed alone (their sampling, start or hand-off raised): finish each with finish_reason
        "error" and a message naming it; the worker, and every other request, go on."""
        for wid, message in errors:
            rid = self._by_wid.get(wid)
            req = self._requests.get(rid) if rid is not None else None
            if req is None or req.wid != wid or req.is_finished:
                continue
            # Nothing to tell the other worker: a prefill failure sends no hand-off, and a decode failure comes
            # after prefill let the request go.
            req.fail(f"request {rid!r} failed in the {h.role} worker: {message}")
            moved[rid] = None

    def _user_ids(self, step: StepRecord) -> StepRecord:
        return dataclasses.replace(step, request_ids=[self._by_wid.get(w, w) for w in step.request_ids])

    def _fail(self, what: str) -> None:
        failed = [r.request_id for r in self._requests.values() if not r.is_finished]
        for rid in failed:
            r = self._requests[rid]
            r.status, r.finish_reason, r.worker_error = RequestStatus.FINISHED_ABORTED, "abort", what
        self._broken = WorkerDiedError(f"{what}; {len(failed)} unfinished request(s) failed: {failed}")
        raise self._broken

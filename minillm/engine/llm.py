"""`LLM`: the continuous-batching engine behind a vLLM-like surface: `generate`, and `add_request`/`step` beneath.

It wires the pieces together: requests come in through `add_request` (the `FrontEnd` it shares with chapter 07's
`DisaggregatedLLM` validates them there and starts their `RequestState`, so a bad one never reaches a running
batch), the `Scheduler` picks each step's work (iteration-level, Orca §3.2), `plan` turns that choice into a
`StepInput` (plain data), the `ModelRunner` (the in-process executor) moves its blocks and runs one forward over it,
the `Sampler` draws each sampling request's token from the returned logits, and `step` streams each request's new
tokens as `RequestOutput` deltas. `generate` is the
front end's offline loop over `step` (vLLM's `LLM.generate`). Chapter 04's static batching stays the baseline:
`minillm.kvcache.generate.generate_static_batch` (and `minillm.engine.static.run_static` for a whole workload).

Parallel sampling (`SamplingParams.n > 1`, chapter 05's `PagedGenerator` inside the engine): sample 0 runs the
prompt alone while samples 1..n-1 are held; the step that samples its first token forks them (`_fork_held`): each
shares the prompt's blocks (`BlockManager.fork`), draws its first token from the same logits row with its own
generator, and joins the scheduler (`Scheduler.add_forked`); the first write into a shared block copies it
(copy-on-write pairs in the step). From then on every sample is an independent request that streams its own
outputs under the user's id and its `index`. One thread drives an engine: `generate`, `add_request`, `step` and
`abort` called while another thread is inside one of them are a ValueError (`FrontEnd.exclusive`); a server takes
requests from many threads through `minillm.engine.core.EngineCore`, whose loop alone steps it. What it leaves
out: an async front end and HTTP (chapter 15), beam search, and multiple devices.

    add_request ─▶ waiting ─admit─▶ running ─step─▶ ... ─finish─▶ (blocks freed) ─▶ RequestOutput(finished)
                      ▲               │ preempt (recompute)
                      └───────────────┘ or ─▶ swapped ─swap in─▶ running
    n > 1: sample 0 as above; samples 1..n-1 held ─(sample 0's first token)─fork─▶ running (or, batch full, waiting)
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from minillm.core.device import place_with_model
from minillm.core.model import GPT, require_model
from minillm.core.sampling import SamplingParams, sample_next
from minillm.engine.config import EngineConfig
from minillm.engine.executor import executor_factory
from minillm.engine.frontend import FrontEnd, one_thread
from minillm.engine.model_runner import ModelRunner
from minillm.engine.request import Request, RequestOutput, RequestStatus
from minillm.engine.sampler import Sampler
from minillm.engine.scheduler import Scheduler, SchedulerOutput
from minillm.engine.step import plan
from minillm.engine.swap import SwappedKV, SwapSpace
from minillm.core.config import check_float_tensor, short_repr, tensor_kind
from minillm.paged import BlockManager


class LLM(FrontEnd):
    stall_steps = 100  # generate() raises after this many steps in a row without a forward or an output
    supports_parallel_sampling = True  # n > 1: the samples fork sample 0's blocks after its prompt (`_fork_held`)
    # The three parts `__init__` builds, each a hook a subclass may replace (chapter 08 swaps the scheduler, which
    # adds draft tokens to the step, and the sampler, which runs the acceptance rule on them):
    runner_cls: type[ModelRunner] = ModelRunner  # the executor: owns the KV pool, runs a StepInput -> logits
    scheduler_cls: type[Scheduler] = Scheduler  # built as scheduler_cls(config, block_manager, **_scheduler_kwargs())
    sampler_cls: type[Sampler] = Sampler  # logits of the sampled rows -> tokens, on the requests' own generators

    def __init__(self, model: GPT, tokenizer: Any = None, config: EngineConfig | None = None,
                 eos_id: int | None = None):
        model_config = require_model(model, "LLM")
        config = config if config is not None else EngineConfig()
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        config.check()  # subtle: a field set after construction (num_blocks = 10**9) was never checked
        window = model_config.block_size
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < window:
            # Without chunks a whole prompt (or a recomputed prompt + outputs) must fit one step's budget; with a
            # budget below the window, a long one could never be scheduled and would block the queue forever.
            raise ValueError(
                f"max_num_batched_tokens={config.max_num_batched_tokens} is below the context window {window}: "
                "enable chunked prefill or raise the budget"
            )
        if config.enable_prefix_caching and config.preemption_mode == "swap":
            raise ValueError("enable_prefix_caching with preemption_mode='swap' is not supported: a swapped-in "
                             "block could overwrite a shared cached block")
        self.device = place_with_model(config.device, model.device)
        if model.device != self.device:
            raise ValueError(f"model is on {model.device} but EngineConfig.device is {config.device!r} "
                             f"({self.device}): move the model there or leave device='auto'")
        self._init_front_end(model_config, tokenizer, eos_id, self.device)
        self.model = model.eval()
        self.config = config
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        # the executor: runner_cls in this process, or chapter 14's over EngineConfig.tensor_parallel_size ranks
        self.runner = executor_factory(config, self.runner_cls)(
            model, config.num_blocks, config.block_size, device=self.device, kv_dtype=config.kv_dtype,
            attention_backend=config.attention_backend)
        self.scheduler = self.scheduler_cls(config, self.block_manager, **self._scheduler_kwargs())
        self.scheduler.vocab_size = model_config.vocab_size  # sampled tokens are checked against it
        self.sampler = self.sampler_cls()
        self.num_steps = 0
        self.last_schedule = None

    def _scheduler_kwargs(self) -> dict[str, Any]:
        """Extra constructor arguments for `scheduler_cls` (chapter 08's drafter and γ); none for chapter 06's."""
        return {}

    def close(self) -> None:
        """Release the executor (chapter 14's ranks; nothing in one process). Idempotent; `with LLM(...)` calls it.
        A closed engine takes no more requests or steps, whatever its executor (a ValueError saying it is closed),
        so a program that works in one process does not start failing when it runs on ranks."""
        self._closed = True
        self.runner.close()

    @property
    def closed(self) -> bool:
        """Whether `close` was called."""
        return getattr(self, "_closed", False)

    def _check_usable(self) -> None:
        if self.closed:
            raise ValueError(f"this {type(self).__name__} is closed: build a new one")

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def swap_space(self) -> SwapSpace:
        """The executor's host swap space: swapped-out KV by request id, and chapter 07's prefilled arrivals."""
        return self.runner.swap_space

    # ------------------------------------------------------------------------------------------------ requests

    def max_request_tokens(self) -> int:
        """The most KV tokens (prompt + max_new_tokens - 1) one request may need and still run alone: what
        `_check_fits` allows, for a front end that checks requests before they reach the engine (a server)."""
        limit = self.config.num_blocks * self.config.block_size
        if not self.config.enable_chunked_prefill:
            limit = min(limit, self.config.max_num_batched_tokens)
        return limit

    def _check_fits(self, req: Request) -> None:
        """A request that could never fit the KV pool (or, without chunked prefill, one step's token budget) even
        if it ran alone is rejected now: queued, it would wait forever."""
        need_blocks = -(-req.max_kv_tokens // self.config.block_size)
        if need_blocks > self.config.num_blocks:
            raise ValueError(
                f"request {req.request_id!r} needs up to {req.max_kv_tokens} tokens of KV = {need_blocks} blocks, "
                f"but the pool has {self.config.num_blocks}: it could never run (lower max_new_tokens or grow "
                f"num_blocks)"
            )
        if not self.config.enable_chunked_prefill and req.max_kv_tokens > self.config.max_num_batched_tokens:
            raise ValueError(
                f"request {req.request_id!r} may need to (re)compute {req.max_kv_tokens} tokens in one step, more "
                f"than max_num_batched_tokens={self.config.max_num_batched_tokens} without chunked prefill"
            )

    def _enqueue(self, req: Request) -> None:
        self.scheduler.add(req)

    @one_thread
    def add_prefilled_request(self, prompt: str | Sequence[int], params: SamplingParams | None, first_token_id: int,
                              kv: torch.Tensor, request_id: str | None = None, arrival_time: float | None = None,
                              generator_state: torch.Tensor | None = None) -> str:
        """Queue a request whose prompt was prefilled elsewhere (chapter 07's prefill worker): it arrives with the
        prompt's K/V and its first output token, and only decodes here.

        `kv` is (n_layer, 2, T, nh, hs), layer-major, K before V, token order (chapter 07's hand-off payload) for
        the T prompt tokens. The request enters as SWAPPED: the scheduler admits it by the same rules as a swapped
        request (free blocks, batch limit, FCFS) and copies its KV into the pool, so it never jumps the queue.
        `generator_state` (from `torch.Generator.get_state()` after the first draw) keeps seeded sampling exact.
        A cache that keeps more per block than float K/V (attention_backend="paged-int8": int8 codes and their
        scales) is refused with a ValueError: the hand-off carries no scales, and guessing them would be silent.
        """
        cache = self.swap_space.cache
        if len(cache.block_tensors()) != len(cache.k_pools) + len(cache.v_pools):
            raise ValueError(f"add_prefilled_request needs a KV cache of float K/V pools only; "
                             f"EngineConfig.attention_backend={self.config.attention_backend!r} "
                             f"({type(cache).__name__}) keeps more per block (e.g. int8 scales), which chapter 07's "
                             f"(n_layer, 2, T, nh, hs) K/V hand-off does not carry")
        if not isinstance(first_token_id, int) or isinstance(first_token_id, bool):  # True is an int, not a token
            raise TypeError(f"first_token_id must be an int token id, got {type(first_token_id).__name__} "
                            f"{short_repr(first_token_id)}")
        if generator_state is not None and (not isinstance(generator_state, torch.Tensor)
                                            or generator_state.dtype != torch.uint8):
            raise TypeError(f"generator_state must be a uint8 tensor from torch.Generator.get_state() or None, got "
                            f"{tensor_kind(generator_state)}")
        # Every add_request check, then this arrival's own, all before anything is queued: a bad argument leaves
        # the engine as it was, with nothing to roll back.
        req = self._new_request(prompt, params, request_id, arrival_time)
        rid = req.request_id
        if req.held:  # the other samples would need the prompt's logits, which stayed with the prefill worker
            raise ValueError(f"add_prefilled_request runs one sample per request; got n={req.params.n}")
        if req.state.finished:  # max_new_tokens == 0: finished on arrival
            self._admit(req)
            return rid
        cfg, T = self.model_config, req.num_prompt_tokens
        want = (cfg.n_layer, 2, T, cfg.n_head, cfg.head_size)
        if not isinstance(kv, torch.Tensor) or tuple(kv.shape) != want:
            raise ValueError(f"kv must be a tensor of shape {want} (n_layer, 2, T, nh, hs), got "
                             f"{tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__}")
        check_float_tensor("kv", kv)  # a float tensor with values (not meta, not sparse)
        if not bool(torch.isfinite(kv).all()):  # one pass over the payload: a NaN would decode tokens from garbage
            raise ValueError("kv holds NaN or infinite values: it is no prefill's K/V (a damaged hand-off?)")
        if not 0 <= first_token_id < cfg.vocab_size:
            raise ValueError(f"first_token_id must be a token id in [0, {cfg.vocab_size}), got "
                             f"{short_repr(first_token_id)}")
        if generator_state is not None and req.generator is not None:
            try:
                req.generator.set_state(generator_state)
            except RuntimeError as exc:  # torch's message names neither the argument nor the request
                raise ValueError(f"generator_state is not a state of a {req.generator.device} torch.Generator "
                                 f"({generator_state.numel()} bytes): {exc}") from None
        req.num_computed_tokens = req.num_block_tokens = T
        if req.accept([first_token_id], time.perf_counter()):  # the first token already ends it
            self._pending.append(self._output(req))
            return rid

        bs = self.config.block_size
        n_blocks = -(-T // bs)
        pad = n_blocks * bs - T

        def blocks(x: torch.Tensor) -> torch.Tensor:  # (T, nh, hs) -> (n_blocks, bs, nh, hs), zero-padded
            x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) if pad else x
            return x.reshape(n_blocks, bs, *x.shape[1:]).to("cpu", self.runner.kv_dtype)

        # The cache's block_tensors() order: every layer's K pool, then every layer's V pool (checked above).
        self.swap_space.put(rid, SwappedKV([blocks(kv[l, 0]) for l in range(cfg.n_layer)]
                                           + [blocks(kv[l, 1]) for l in range(cfg.n_layer)], n_blocks))
        self._requests[rid] = req
        self.scheduler.add_swapped(req, n_blocks)  # admitted like a swapped request; its swap-in is step data
        return rid

    @one_thread
    def abort(self, request_id: str) -> bool:
        """Stop a request now and free everything it holds; its final output (finish_reason "abort") comes with the
        next `step()`. With n > 1, every unfinished sample of it, held or running, each with its own final output
        (a sample's internal id is not the user's to abort: False). Returns False if the id is unknown or already
        finished."""
        self._check_id(request_id)
        group = self._groups.get(request_id)
        if group is None:
            req = self._requests.get(request_id)
            if req is None or req.parent_id is not None:
                return False
            group = [req]
        held = group[0].held
        aborted = False
        for r in group:
            if r.is_finished:  # its final output was handed out already
                continue
            if any(r is h for h in held):  # sample 0 still runs its prompt: this one holds nothing yet
                r.status, r.finish_reason = RequestStatus.FINISHED_ABORTED, "abort"
            elif self.scheduler.abort(r.request_id) is None:
                continue
            self._forget(r)
            self._pending.append(self._output(r))
            aborted = True
        group[0].held = []
        return aborted

    @property
    def num_held(self) -> int:
        """Parallel samples waiting for their sample 0's first token (in no scheduler queue yet)."""
        return sum(len(group[0].held) for group in self._groups.values())

    def has_unfinished(self) -> bool:
        """True while a request is queued, running or held (a parallel sample not forked yet), or an output is still
        to be handed out (an abort's, one finished on arrival): a loop `while llm.has_unfinished(): llm.step()`
        delivers every final output."""
        return self.scheduler.has_unfinished() or bool(self._pending) or self.num_held > 0

    @property
    def num_unfinished(self) -> int:
        return self.scheduler.num_unfinished + self.num_held

    # ------------------------------------------------------------------------------------------------ stepping

    @one_thread
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, plan, execute (byte moves + one forward), sample, update; the outputs of every
        request that advanced.

        A request appears when it produced a token or finished; prompt chunks that produce nothing stay silent.
        """
        self._check_usable()
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        self.last_schedule = sched  # kept for inspection (tests, the notebook's schedule plot)
        if sched.is_empty:
            return self._merge(outputs)
        step = plan(sched, self.block_manager)  # plain data: what a second rank would be sent
        if not sched.scheduled:  # only bytes to move (a swap-out whose request could not be rescheduled, discards)
            self.runner.execute(step)
            return self._merge(outputs)
        now_first = time.perf_counter()
        for s in sched.scheduled:
            if s.request.first_scheduled_time is None:
                s.request.first_scheduled_time = now_first
        logits = self.runner.execute(step)  # (R, V): the sampled rows, in entry order
        tokens = self.sampler.sample(sched, logits)
        now = time.perf_counter()
        started = self._fork_held(sched, tokens, logits, now)  # n > 1: before update may free sample 0's blocks
        finished = self.scheduler.update(sched, tokens, now)
        self.scheduler.add_forked([r for r in started if not r.is_finished])
        if self.config.enable_prefix_caching:
            for s in sched.scheduled:
                if not s.request.is_finished:  # publish newly computed full blocks for other requests to hit
                    self.block_manager.mark_computed(s.request.request_id, s.request.num_computed_tokens)
        self.num_steps += 1
        for s, tok in zip(sched.scheduled, tokens):
            if tok is not None or s.request.is_finished:  # a token, or its sampling failed (finish_reason "error")
                outputs.append(self._output(s.request))
        outputs += [self._output(r) for r in started]  # each sample's first token (or its end)
        for req in finished + [r for r in started if r.is_finished]:
            self._forget(req)
        return self._merge(outputs)

    # ------------------------------------------------------------------------------------------------ n > 1

    def _fork_held(self, sched: SchedulerOutput, tokens: list[int | None], logits: torch.Tensor,
                   now: float) -> list[Request]:
        """Start the held samples of every request whose first token this step sampled; return them.

        Sample 0 of an n > 1 request ran the prompt alone; its last prompt row of `logits` (R, V) is the
        distribution of every sample's first token (chapter 05's `PagedGenerator` prefills once for all n). Each
        held sample forks sample 0's blocks and draws from that same row with its own generator
        (`_start_sample`). If sample 0's sampling failed, its held samples fail with it, one final output each.
        Called between `Sampler.sample` and `Scheduler.update`, while sample 0 still holds its blocks (its
        first token may finish it, and `update` then frees them: the samples keep their references).
        """
        started: list[Request] = []
        end = 0  # rows of `logits` used by the entries so far
        for s, tok in zip(sched.scheduled, tokens):
            first = s.request
            end += len(s.sample_rows())
            if not first.held or not s.samples:  # nothing held, or a prompt chunk short of the prompt's end
                continue
            samples, first.held = first.held, []
            for r in samples:
                if tok is None:  # the Sampler failed sample 0 (its state is finished with an error)
                    assert first.state.finished
                    r.fail(f"request {first.request_id!r} sample {r.index} never started: sample 0 failed "
                           f"before the samples forked ({first.error})")
                else:
                    self._start_sample(first, r, logits[end - 1 : end], now)  # (1, V): sample 0's last row
                started.append(r)
        return started

    def _start_sample(self, first: Request, req: Request, row: torch.Tensor, now: float) -> None:
        """Give held sample `req` the prompt `first` (sample 0) just computed, and its first token from `row` (1, V).

        Its blocks are sample 0's (`BlockManager.fork`: ref counts + 1, nothing copied); its first decode appends
        to the shared last block, and `append_slot` copies that block first (copy-on-write pairs in the step). Its
        token is drawn by `sample_next` with its own generator (seeded params.seed + index), as `Sampler` would;
        a token that finishes it (eos, max_new_tokens 1, a stop string) frees its blocks at once (I8)."""
        self.block_manager.fork(first.request_id, req.request_id)
        req.num_computed_tokens = req.num_block_tokens = first.num_prompt_tokens
        req.first_scheduled_time = first.first_scheduled_time
        try:
            tok = int(sample_next(row, req.params, req.generator))  # (1, V) -> (1,)
        except Exception as exc:  # noqa: BLE001 - one sample's failure is its own, as in `Sampler`
            req.fail(f"request {req.request_id!r} failed in sampling: {type(exc).__name__}: {exc}")
        else:
            req.accept([tok], now)
        if req.is_finished:
            self.block_manager.free(req.request_id)
            req.num_block_tokens = 0

    # ------------------------------------------------------------------------------------------------ hooks

    def _progress(self) -> object:
        return self.runner.num_forward_calls

    def _stall_report(self) -> Any:
        return self.stats()

    def stats(self) -> dict[str, Any]:
        """Counters for benchmarks and tests: steps, forwards, preemptions, free blocks, queue lengths."""
        return {
            "num_steps": self.num_steps,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_free_blocks": self.block_manager.num_free_blocks,
            "num_blocks": self.config.num_blocks,
            "waiting": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            "swapped": len(self.scheduler.swapped),
            "held": self.num_held,
        }

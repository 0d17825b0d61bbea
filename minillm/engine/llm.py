"""`LLM`: the continuous-batching engine behind a vLLM-like surface: `generate`, and `add_request`/`step` beneath.

It wires the pieces together: requests come in through `add_request` (validated there, so a bad one never reaches
a running batch), the `Scheduler` picks each step's work (iteration-level, Orca §3.2), the `ModelRunner` runs one
forward over it and samples, and `step` streams each request's new tokens as `RequestOutput` deltas. `generate`
is the offline loop over `step` (vLLM's `LLM.generate`). Chapter 04's static batching stays the baseline:
`minillm.kvcache.generate.generate_static_batch` (and `minillm.engine.static.run_static` for a whole workload).
What it leaves out: an async front end and HTTP (chapter 15), parallel samples n > 1, and multiple devices.

    add_request ─▶ waiting ─admit─▶ running ─step─▶ ... ─finish─▶ (blocks freed) ─▶ RequestOutput(finished)
                      ▲               │ preempt (recompute)
                      └───────────────┘ or ─▶ swapped ─swap in─▶ running
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any, Sequence

import torch

from minillm.core.device import resolve_device
from minillm.engine.config import EngineConfig
from minillm.engine.model_runner import ModelRunner
from minillm.engine.request import Request, RequestOutput, RequestStatus
from minillm.engine.scheduler import Scheduler
from minillm.engine.swap import SwapSpace
from minillm.naive.generate import StopChecker, validate_prompt
from minillm.core.model import GPT
from minillm.paged import BlockManager
from minillm.core.sampling import SamplingParams, make_generator


class LLM:
    def __init__(self, model: GPT, tokenizer: Any = None, config: EngineConfig | None = None,
                 eos_id: int | None = None):
        if not isinstance(model, GPT):
            raise TypeError(f"model must be a minillm GPT, got {type(model).__name__}")
        config = config if config is not None else EngineConfig()
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        window = model.config.block_size
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
        self.device = resolve_device(config.device)
        if model.device != self.device:
            raise ValueError(f"model is on {model.device} but EngineConfig.device resolves to {self.device}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.eos_id = eos_id
        self.config = config
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.runner = ModelRunner(model, config.num_blocks, config.block_size, device=self.device,
                                  kv_dtype=config.kv_dtype, attention_backend=config.attention_backend)
        # Always there: besides swap preemption it parks the KV of requests prefilled elsewhere (chapter 07).
        self.swap_space = SwapSpace(self.runner.cache, config.num_swap_blocks)
        self.scheduler = Scheduler(config, self.block_manager, self.swap_space)
        self._requests: dict[str, Request] = {}  # unfinished requests by id
        self._pending: list[RequestOutput] = []  # outputs to hand out at the next step (aborts, empty requests)
        self._counter = itertools.count()
        self.num_steps = 0
        self.last_schedule = None

    # ------------------------------------------------------------------------------------------------ requests

    def _encode(self, prompt: Any) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise TypeError("prompt is a string but the engine has no tokenizer: pass token ids or a tokenizer")
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist() if prompt.dim() == 1 else prompt
        return None, prompt

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Queue one request; return its id. Everything is checked here, so a bad request never disturbs a batch.

        Rejected with ValueError/TypeError: a params object that is not a valid `SamplingParams` (re-validated
        here, so one mutated after construction is caught too), n > 1, an empty or out-of-vocabulary prompt, a
        prompt longer than the context window, a duplicate id, and a request that could never fit the KV pool
        (or, without chunked prefill, one step's token budget) even if it ran alone.
        """
        params = SamplingParams.greedy() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__} {params!r}")
        params = dataclasses.replace(params)  # re-runs __post_init__: a field mutated into nonsense is caught now
        if params.n != 1:
            raise ValueError(f"the engine runs one sample per request; got n={params.n}")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings {params.stop!r} need a tokenizer")
        text, ids = self._encode(prompt)
        cfg = self.model.config
        ids, max_new = validate_prompt(ids, params, cfg.vocab_size, cfg.block_size)
        if request_id is None:
            request_id = f"req-{next(self._counter)}"
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__} {request_id!r}")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        # Same window cap and stop rules as chapter 04's `generate`, so the engine's tokens match it alone.
        params = dataclasses.replace(params, max_new_tokens=max_new)
        req = Request(
            request_id=request_id, prompt_token_ids=ids, params=params, prompt=text,
            arrival_time=time.perf_counter() if arrival_time is None else arrival_time,
            generator=make_generator(params.seed, self.device),
            stop_checker=StopChecker(self.tokenizer, params, self.eos_id),
            max_tokens_total=cfg.block_size,
        )
        need_blocks = -(-req.max_kv_tokens // self.config.block_size)
        if need_blocks > self.config.num_blocks:
            raise ValueError(
                f"request {request_id!r} needs up to {req.max_kv_tokens} tokens of KV = {need_blocks} blocks, but the "
                f"pool has {self.config.num_blocks}: it could never run (lower max_new_tokens or grow num_blocks)"
            )
        if not self.config.enable_chunked_prefill and req.max_kv_tokens > self.config.max_num_batched_tokens:
            raise ValueError(
                f"request {request_id!r} may need to (re)compute {req.max_kv_tokens} tokens in one step, more than "
                f"max_num_batched_tokens={self.config.max_num_batched_tokens} without chunked prefill"
            )
        if max_new == 0:  # nothing to generate: finished on arrival, never scheduled
            req.status, req.finish_reason = RequestStatus.FINISHED_LENGTH, "length"
            self._pending.append(self._output(req))
            return request_id
        self._requests[request_id] = req
        self.scheduler.add(req)
        return request_id

    def add_prefilled_request(self, prompt: str | Sequence[int], params: SamplingParams | None, first_token_id: int,
                              kv: torch.Tensor, request_id: str | None = None, arrival_time: float | None = None,
                              generator_state: torch.Tensor | None = None) -> str:
        """Queue a request whose prompt was prefilled elsewhere (chapter 07's prefill worker): it arrives with the
        prompt's K/V and its first output token, and only decodes here.

        `kv` is (n_layer, 2, T, nh, hs), layer-major, K before V, token order (chapter 07's hand-off payload) for
        the T prompt tokens. The request enters as SWAPPED: the scheduler admits it by the same rules as a swapped
        request (free blocks, batch limit, FCFS) and copies its KV into the pool, so it never jumps the queue.
        `generator_state` (from `torch.Generator.get_state()` after the first draw) keeps seeded sampling exact.
        """
        rid = self.add_request(prompt, params, request_id=request_id, arrival_time=arrival_time)
        req = self._requests.get(rid)
        if req is None:  # max_new_tokens == 0: finished on arrival
            return rid
        cfg, T = self.model.config, req.num_prompt_tokens
        want = (cfg.n_layer, 2, T, cfg.n_head, cfg.head_size)
        if not isinstance(kv, torch.Tensor) or tuple(kv.shape) != want:
            self.scheduler.abort(rid)
            del self._requests[rid]
            raise ValueError(f"kv must be a tensor of shape {want} (n_layer, 2, T, nh, hs), got "
                             f"{tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__}")
        if not isinstance(first_token_id, int) or not 0 <= first_token_id < cfg.vocab_size:
            self.scheduler.abort(rid)
            del self._requests[rid]
            raise ValueError(f"first_token_id must be a token id in [0, {cfg.vocab_size}), got {first_token_id!r}")
        from minillm.engine.swap import SwappedKV

        bs = self.config.block_size
        n_blocks = -(-T // bs)
        pad = n_blocks * bs - T

        def blocks(x: torch.Tensor) -> torch.Tensor:  # (T, nh, hs) -> (n_blocks, bs, nh, hs), zero-padded
            x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) if pad else x
            return x.reshape(n_blocks, bs, *x.shape[1:]).to("cpu", self.runner.dtype)

        self.scheduler.waiting.remove(req)
        req.swapped_kv = SwappedKV([blocks(kv[l, 0]) for l in range(cfg.n_layer)],
                                   [blocks(kv[l, 1]) for l in range(cfg.n_layer)], n_blocks)
        self.swap_space.num_used += n_blocks  # not limited by the swap capacity: it is an arrival, not a victim
        if generator_state is not None and req.generator is not None:
            req.generator.set_state(generator_state)
        req.num_computed_tokens = req.num_block_tokens = T
        req.output_token_ids.append(first_token_id)
        req.token_times.append(time.perf_counter())
        if req.stop_checker.update(first_token_id):
            self.swap_space.discard(req)
            req.finish_reason = req.stop_checker.finish_reason
            req.status = RequestStatus.FINISHED_LENGTH if req.finish_reason == "length" else (
                RequestStatus.FINISHED_STOPPED)
            del self._requests[rid]
            self._pending.append(self._output(req))
            return rid
        req.status = RequestStatus.SWAPPED
        self.scheduler.swapped.append(req)
        return rid

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free everything it holds; its final output (finish_reason "abort") comes with the
        next `step()`. Returns False if the id is unknown or already finished."""
        req = self.scheduler.abort(request_id)
        if req is None:
            return False
        del self._requests[request_id]
        self._pending.append(self._output(req))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished(self) -> int:
        return self.scheduler.num_unfinished

    # ------------------------------------------------------------------------------------------------ stepping

    def _output(self, req: Request) -> RequestOutput:
        new = req.output_token_ids[req.num_streamed :]
        req.num_streamed = len(req.output_token_ids)
        text = new_text = None
        if self.tokenizer is not None:
            text = req.stop_checker.output_text() if req.finish_reason == "stop" else self.tokenizer.decode(
                req.output_token_ids)
            new_text = self.tokenizer.decode(new)
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=list(req.prompt_token_ids),
            new_token_ids=new, output_token_ids=list(req.output_token_ids), finished=req.is_finished,
            finish_reason=req.finish_reason, text=text, new_text=new_text, arrival_time=req.arrival_time,
            token_times=list(req.token_times), num_preemptions=req.num_preemptions,
        )

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, one forward, sample, update; the outputs of every request that advanced.

        A request appears when it produced a token or finished; prompt chunks that produce nothing stay silent.
        """
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        self.last_schedule = sched  # kept for inspection (tests, the notebook's schedule plot)
        if sched.is_empty:
            return outputs
        now_first = time.perf_counter()
        for s in sched.scheduled:
            if s.request.first_scheduled_time is None:
                s.request.first_scheduled_time = now_first
        tokens = self.runner.run(sched, self.block_manager)
        now = time.perf_counter()
        finished = self.scheduler.update(sched, tokens, now)
        if self.config.enable_prefix_caching:
            for s in sched.scheduled:
                if not s.request.is_finished:  # publish newly computed full blocks for other requests to hit
                    self.block_manager.mark_computed(s.request.request_id, s.request.num_computed_tokens)
        self.num_steps += 1
        for s, tok in zip(sched.scheduled, tokens):
            if tok is not None:
                outputs.append(self._output(s.request))
        for req in finished:
            del self._requests[req.request_id]
        return outputs

    def generate(self, prompts: Sequence[Any] | str, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion; one final `RequestOutput` per prompt, in order.

        Every request is validated before any is queued, so one bad prompt rejects the call and leaves the engine
        as it was.
        """
        if isinstance(prompts, (str, torch.Tensor)) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(params, SamplingParams) or params is None:
            params_list = [params] * len(prompts)
        else:
            params_list = list(params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params_list):
                ids.append(self.add_request(prompt, p))
        except (TypeError, ValueError) as exc:
            for rid in ids:
                self.abort(rid)
            self._pending = [o for o in self._pending if o.request_id not in set(ids)]
            raise type(exc)(f"prompts[{len(ids)}]: {exc}") from None
        final: dict[str, RequestOutput] = {}
        wanted = set(ids)
        for out in self._pending:
            if out.finished and out.request_id in wanted:
                final[out.request_id] = out
        self._pending = [o for o in self._pending if o.request_id not in wanted]
        while len(final) < len(wanted):
            for out in self.step():
                if out.finished and out.request_id in wanted:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]

    # ------------------------------------------------------------------------------------------------ hooks

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
        }

"""The prefill worker's model work: run prompts, sample each one's first token, pack its KV, hand it off.

Adds the prefill half of a disaggregated server (DistServe, Zhong et al. OSDI 2024; Splitwise, Patel et al.
ISCA 2024): this process only ever runs prompts, so its steps are long and compute-bound, and no decode step ever
waits behind them. What it leaves out: chunking a prompt longer than the token budget (a prompt always runs in
one step here), prefix caching, and overlapping the KV transfer with the next layer's compute.

One step (`PrefillCore.step`):

    waiting prompts --FCFS, <= max_num_batched_tokens--> start_request (the lifecycle every loop shares),
      allocate blocks in this worker's pool
      --> chapter 06's ModelRunner.run: one ragged forward over all of them, logits at each prompt's last token
          only, sample_next with the request's own generator: the FIRST token is sampled here, as vLLM's
          disaggregated prefill does, so TTFT never includes the transfer
      --> RequestState.accept decides whether that token already ends the request (eos, max tokens, the window)
      --> FirstTokens to the coordinator;  KVHandoff (pack_kv bytes + generator state) to the decode worker
      --> free the blocks: the prefill pool only holds prompts while they run

What it reuses from chapter 06: the `ModelRunner` (KV pool built by backend name, the forward, the sampling) and
the engine's `Request`, fed a `SchedulerOutput` built here. Not the `Scheduler`: its admission, chunking and
preemption answer a mixed workload, and this worker's whole policy is the FCFS batch of `_take_batch`.
Stop strings are the coordinator's (it has the tokenizer); this worker's states check token ids only.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Any

import torch

from minillm.core.config import check_device, check_instance
from minillm.core.model import GPT, require_model
from minillm.core.sampling import SamplingParams
from minillm.core.stopping import start_request
from minillm.disagg.kv_transfer import pack_kv, payload_to_bytes
from minillm.disagg.messages import Abort, FirstTokens, KVHandoff, PrefillRequest, StepRecord, WorkerInit
from minillm.engine.model_runner import ModelRunner
from minillm.engine.request import Request
from minillm.engine.scheduler import ScheduledRequest, SchedulerOutput, check_request_id
from minillm.paged import BlockManager, num_blocks_for


def start_worker_request(model: GPT, request_id: str, prompt_ids: list[int], params, eos_id: int | None,
                         device: torch.device) -> Request:
    """An engine `Request` for a worker, started like every other loop's (`start_request`), but without stop
    strings: a worker has no tokenizer, so only the coordinator can see them (and sends `Abort`)."""
    config = require_model(model, "start_worker_request")
    check_request_id(request_id)
    check_instance("params", params, SamplingParams, "a SamplingParams")
    state = start_request(config, prompt_ids, dataclasses.replace(params, stop=()), None, eos_id,
                          device=check_device("device", device))
    return Request(request_id, state.prompt_ids, state.params, state=state)


class PrefillCore:
    def __init__(self, model: GPT, init: WorkerInit):
        require_model(model, "PrefillCore")
        check_instance("init", init, WorkerInit, "the prefill worker's WorkerInit")
        self.model = model
        self.init = init
        self.device = torch.device(init.device)
        self.blocks = BlockManager(init.num_blocks, init.block_size)
        self.runner = ModelRunner(model, init.num_blocks, init.block_size, device=self.device,
                                  kv_dtype=init.kv_dtype)
        self.waiting: deque[PrefillRequest] = deque()

    @property
    def cache(self):
        """The KV pool (the model runner's): `k_pools` / `v_pools` per layer, (nb, bs, nh, hs) each."""
        return self.runner.cache

    def handle(self, msg: Any) -> None:
        if isinstance(msg, PrefillRequest):
            self.waiting.append(msg)
        elif isinstance(msg, Abort):
            gone = set(msg.request_ids)
            self.waiting = deque(r for r in self.waiting if r.request_id not in gone)
        else:
            raise TypeError(f"prefill worker got an unexpected message {type(msg).__name__}")

    def has_work(self) -> bool:
        return bool(self.waiting)

    def _take_batch(self) -> list[PrefillRequest]:
        """FCFS prompts while they fit the token budget, the sequence limit and the pool (the first always runs)."""
        batch: list[PrefillRequest] = []
        tokens = blocks = 0
        while self.waiting:
            r = self.waiting[0]
            n, nb = len(r.prompt_ids), num_blocks_for(len(r.prompt_ids), self.init.block_size)
            if batch and (tokens + n > self.init.max_num_batched_tokens or len(batch) >= self.init.max_num_seqs
                          or blocks + nb > self.blocks.num_free_blocks):
                break
            batch.append(self.waiting.popleft())
            tokens, blocks = tokens + n, blocks + nb
        return batch

    def step(self) -> list[tuple[str, Any]]:
        batch = self._take_batch()
        start = time.perf_counter()
        errors: list[tuple[str, str]] = []  # requests failed alone: reported to the coordinator, the rest go on
        reqs, kept = [], []
        for r in batch:
            try:
                reqs.append(start_worker_request(self.model, r.request_id, r.prompt_ids, r.params, self.init.eos_id,
                                                 self.device))
                kept.append(r)
            except Exception as exc:  # noqa: BLE001 - this request's alone (the coordinator validated it already)
                errors.append((r.request_id, f"could not start: {type(exc).__name__}: {exc}"))
        for req in reqs:
            self.blocks.allocate(req.request_id, req.prompt_token_ids)  # the coordinator sized the pool for one
        # Every prompt whole, from position 0: each scheduled request samples (its last token ends its prompt).
        sched = SchedulerOutput([ScheduledRequest(req, req.num_prompt_tokens, 0) for req in reqs])
        tokens = self.runner.run(sched, self.blocks)  # exactly one draw per request, as colocated
        items, out = [], []
        for req, r, token in zip(reqs, kept, tokens):
            try:
                if token is None:  # its sampling raised (ModelRunner.sample failed it alone)
                    errors.append((req.request_id, req.state.error))
                    continue
                done = req.state.accept_or_fail([token], f"request {req.request_id!r}")  # eos, one token, window
                if req.state.error is not None:
                    errors.append((req.request_id, req.state.error))
                    continue
                if not done:
                    table = self.blocks.block_table(req.request_id)
                    payload = pack_kv(self.cache.k_pools, self.cache.v_pools, table, req.num_prompt_tokens)
                    header, data = payload_to_bytes(payload)  # (L, 2, T, nh, hs) -> bytes
                    gen = req.generator
                    state = bytes(gen.get_state().numpy().tobytes()) if gen is not None else None
                    out.append(("peer", KVHandoff(req.request_id, list(req.prompt_token_ids), token, r.params,
                                                  state, header, data, time.perf_counter())))
                items.append((req.request_id, token, done))
            except Exception as exc:  # noqa: BLE001 - packing one request's KV failed: that request fails
                errors.append((req.request_id, f"hand-off failed: {type(exc).__name__}: {exc}"))
            finally:
                self.blocks.free(req.request_id)
        end = time.perf_counter()
        num_tokens = sum(req.num_prompt_tokens for req in reqs)
        step = StepRecord("prefill", "prefill", start, end, num_tokens, [req.request_id for req in reqs])
        # The coordinator hears about the first tokens before the decode worker gets the KV: TTFT excludes transfer.
        return [("ctrl", FirstTokens(items, step, errors))] + out

"""The decode worker's model work: admit handed-off prompts into its own pool, then decode them all, step by step.

Adds the decode half of a disaggregated server: this process never runs a prompt, so every one of its steps is a
batch of one-token decodes and its inter-token latency does not depend on prompt arrivals (DistServe calls what it avoids
"prefill-decoding interference"). What it leaves out: preemption. Admission reserves each request's
worst case (prompt + max_new_tokens - 1 KV slots, capped by the context window) up front, so a running request
never runs out of blocks; the price is a smaller batch than chapter 06's optimistic scheduler would run.

One step (`DecodeCore.step`):

    hand-offs received (FCFS) --admit_handoffs: fits max_num_seqs and the unreserved blocks?-->
      start_request (the lifecycle every loop shares), accept the first token, allocate blocks under this
      pool's block table, unpack_kv the bytes into them, restore the generator
      --> every running request appends its last token's slot (chapter 05's append_slot)
      --> chapter 06's ModelRunner.run: one forward over S new tokens (the vectorized decode path), sample_next
          per request with its own generator
      --> RequestState.accept per request --> DecodeTokens to the coordinator; finished requests free their blocks

Decode stops a request by its state's rules: eos, max_new_tokens or the context window; stop strings need text,
so the coordinator checks them and sends `Abort` (as vLLM's front-end process does with its detokenizer).
What it reuses from chapter 06: the `ModelRunner` and the engine's `Request`, fed a `SchedulerOutput` built here.
Not the `Scheduler`: this worker reserves each request's worst case at admission and never preempts, where
chapter 06's scheduler admits optimistically and preempts when blocks run out.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from minillm.core.config import check_instance, check_int, check_int_list
from minillm.core.model import GPT, require_model
from minillm.disagg.kv_transfer import payload_from_bytes, unpack_kv
from minillm.disagg.messages import Abort, DecodeTokens, KVHandoff, StepRecord, TransferRecord, WorkerInit
from minillm.disagg.prefill_worker import start_worker_request
from minillm.engine.model_runner import ModelRunner
from minillm.engine.request import Request, RequestStatus
from minillm.engine.scheduler import ScheduledRequest, SchedulerOutput
from minillm.paged import BlockManager, num_blocks_for


def max_kv_tokens(num_prompt_tokens: int, max_new_tokens: int, context_window: int) -> int:
    """The most KV slots a request ever fills: prompt + max_new_tokens - 1 (the last token is never fed back),
    capped by the context window."""
    for name, value, least in (("num_prompt_tokens", num_prompt_tokens, 1), ("max_new_tokens", max_new_tokens, 0),
                               ("context_window", context_window, 1)):
        if type(value) is not int or value < least:  # one cheap test per argument: every waiting hand-off, every step
            check_int(name, value, least)
    return min(num_prompt_tokens + max_new_tokens - 1, context_window)


def admit_handoffs(
    waiting_kv_tokens: Sequence[int],
    num_free_blocks: int,
    num_reserved_blocks: int,
    num_running: int,
    max_num_seqs: int,
    block_size: int,
) -> int:
    """How many of the waiting hand-offs to admit now, first come first served.

    `waiting_kv_tokens[i]` is the worst-case KV slots of the i-th waiting request (`max_kv_tokens`);
    `num_reserved_blocks` are the free blocks the running requests may still claim as they grow. A request is
    admitted when the batch has room (num_running + admitted < max_num_seqs) and its worst-case blocks fit in the
    free blocks nobody has reserved. Admission stops at the first request that does not fit: FCFS, no
    overtaking, so a long request cannot starve behind a stream of short ones.

    Worked example: bs = 4, 10 free blocks, 3 reserved (7 unreserved), 1 running, max_num_seqs = 4, waiting
    [9, 12, 1]: the first needs ceil(9/4) = 3 <= 7 blocks -> admitted (4 left); the second needs 3 <= 4 ->
    admitted (1 left); the third needs 1 <= 1 and the batch has room (1 + 2 < 4) -> admitted: the answer is 3.
    With max_num_seqs = 3 the batch is full after two (1 + 2 = 3) and the answer is 2.
    """
    check_int_list("waiting_kv_tokens", waiting_kv_tokens)
    for name, value in (("num_free_blocks", num_free_blocks), ("num_reserved_blocks", num_reserved_blocks),
                        ("num_running", num_running), ("max_num_seqs", max_num_seqs), ("block_size", block_size)):
        check_int(name, value, 1 if name in ("max_num_seqs", "block_size") else 0)
    # BEGIN SOLUTION
    available = num_free_blocks - num_reserved_blocks
    admitted = 0
    for tokens in waiting_kv_tokens:
        if num_running + admitted >= max_num_seqs:
            break
        need = num_blocks_for(tokens, block_size)
        if need > available:
            break
        available -= need
        admitted += 1
    return admitted
    # END SOLUTION


class DecodeCore:
    def __init__(self, model: GPT, init: WorkerInit):
        self.context_window = require_model(model, "DecodeCore").block_size
        check_instance("init", init, WorkerInit, "the decode worker's WorkerInit")
        self.model = model
        self.init = init
        self.device = torch.device(init.device)
        self.blocks = BlockManager(init.num_blocks, init.block_size)
        self.runner = ModelRunner(model, init.num_blocks, init.block_size, device=self.device,
                                  kv_dtype=init.kv_dtype)
        self.waiting: deque[tuple[KVHandoff, float]] = deque()  # (hand-off, received perf_counter)
        self.running: dict[str, Request] = {}  # admitted, decoding; its last output token not yet fed
        self.worst_case_blocks: dict[str, int] = {}  # blocks each running request may hold at most (reserved)
        self.aborted: set[str] = set()  # aborted before their hand-off arrived: drop it when it does
        self.transfers: list[TransferRecord] = []  # received since the last DecodeTokens
        self.errors: list[tuple[str, str]] = []  # (request_id, message): failed alone since the last DecodeTokens

    @property
    def cache(self):
        """The KV pool (the model runner's): `k_pools` / `v_pools` per layer, (nb, bs, nh, hs) each."""
        return self.runner.cache

    # ----------------------------------------------------------------------------------------------- messages
    def handle(self, msg: Any) -> None:
        if isinstance(msg, KVHandoff):
            if msg.request_id in self.aborted:
                self.aborted.discard(msg.request_id)
            else:
                self.waiting.append((msg, time.perf_counter()))
        elif isinstance(msg, Abort):
            for rid in msg.request_ids:
                if rid in self.running:
                    self._finish(rid)
                elif any(h.request_id == rid for h, _ in self.waiting):
                    self.waiting = deque((h, t) for h, t in self.waiting if h.request_id != rid)
                else:
                    self.aborted.add(rid)
        else:
            raise TypeError(f"decode worker got an unexpected message {type(msg).__name__}")

    def has_work(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    def _finish(self, rid: str) -> None:
        self.blocks.free(rid)
        del self.running[rid]
        del self.worst_case_blocks[rid]

    # ----------------------------------------------------------------------------------------------- admission
    def _reserved_blocks(self) -> int:
        return sum(w - len(self.blocks.block_table(rid)) for rid, w in self.worst_case_blocks.items())

    def _admit(self) -> None:
        bs = self.init.block_size
        worst = [max_kv_tokens(len(h.prompt_ids), h.params.max_new_tokens, self.context_window) for h, _ in self.waiting]
        n = admit_handoffs(worst, self.blocks.num_free_blocks, self._reserved_blocks(), len(self.running),
                           self.init.max_num_seqs, bs)
        for i in range(n):
            h, received = self.waiting.popleft()
            try:
                self._admit_one(h, received, worst[i])
            except Exception as exc:  # noqa: BLE001 - one bad hand-off fails its request only; the worker goes on
                if h.request_id in self.running:
                    self._finish(h.request_id)
                elif self.blocks.has_seq(h.request_id):
                    self.blocks.free(h.request_id)
                self.errors.append((h.request_id, f"could not admit its hand-off: {type(exc).__name__}: {exc}"))

    def _admit_one(self, h: KVHandoff, received: float, worst_tokens: int) -> None:
        bs = self.init.block_size
        req = start_worker_request(self.model, h.request_id, h.prompt_ids, h.params, self.init.eos_id, self.device)
        if h.generator_state is not None:
            # subtle: continue the SAME random stream the prefill worker drew the first token from, so a
            # seeded request samples exactly the tokens it would have in the colocated engine.
            assert req.generator is not None, "a generator state arrived for an unseeded request"
            req.generator.set_state(torch.frombuffer(bytearray(h.generator_state), dtype=torch.uint8))
        done = req.accept([h.first_token], received)  # the first token, sampled by the prefill worker
        assert not done, "the prefill worker hands off only requests its first token did not finish"
        self.blocks.allocate(h.request_id, h.prompt_ids)
        self.blocks.mark_computed(h.request_id, len(h.prompt_ids))  # their K/V arrive by copy, not compute
        payload = payload_from_bytes(h.header, h.data)  # (L, 2, T, nh, hs)
        unpack_kv(payload, self.cache.k_pools, self.cache.v_pools, self.blocks.block_table(h.request_id))
        req.num_computed_tokens = req.num_block_tokens = req.num_prompt_tokens
        req.status = RequestStatus.RUNNING
        self.running[h.request_id] = req
        self.worst_case_blocks[h.request_id] = num_blocks_for(worst_tokens, bs)
        self.transfers.append(TransferRecord(h.request_id, len(h.data), h.sent_time, received,
                                             time.perf_counter()))

    # ----------------------------------------------------------------------------------------------- decoding
    def step(self) -> list[tuple[str, Any]]:
        self._admit()
        transfers, self.transfers = self.transfers, []
        errors, self.errors = self.errors, []
        if not self.running:  # hand-offs wait for blocks; nothing to decode yet
            if transfers or errors:
                now = time.perf_counter()
                return [("ctrl", DecodeTokens([], StepRecord("decode", "decode", now, now, 0), transfers, errors))]
            return []
        start = time.perf_counter()
        reqs = list(self.running.values())
        sched = SchedulerOutput()
        for req in reqs:
            pairs = self.blocks.append_slot(req.request_id, req.output_token_ids[-1])  # admission reserved it
            assert not pairs, "decode sequences never share blocks"
            req.num_block_tokens += 1
            sched.scheduled.append(ScheduledRequest(req, 1, req.num_computed_tokens))  # feed the last token
        tokens = self.runner.run(sched, self.blocks)  # one forward, one draw per request from its own generator
        now = time.perf_counter()
        items = []
        for req, token in zip(reqs, tokens):
            req.num_computed_tokens += 1
            # eos, max_new_tokens or the context window; a raising stop check fails this request alone
            done = req.state.finished or req.accept([token], now)  # finished already: its sampling failed
            if req.state.error is not None:
                errors.append((req.request_id, req.state.error))
            else:
                items.append((req.request_id, token, done))
            if done:
                self._finish(req.request_id)
        step = StepRecord("decode", "decode", start, now, len(reqs), [req.request_id for req in reqs])
        return [("ctrl", DecodeTokens(items, step, transfers, errors))]

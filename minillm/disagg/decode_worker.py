"""The decode worker's model work: admit handed-off prompts into its own pool, then decode them all, step by step.

Adds the decode half of a disaggregated server: this process never runs a prompt, so every one of its steps is a
batch of one-token decodes and its inter-token latency does not depend on prompt arrivals (DistServe calls what it avoids
"prefill-decoding interference"). What it leaves out: preemption. Admission reserves each request's
worst case (prompt + max_new_tokens - 1 KV slots, capped by the context window) up front, so a running request
never runs out of blocks; the price is a smaller batch than chapter 06's optimistic scheduler would run.

One step (`DecodeCore.step`):

    hand-offs received (FCFS) --admit_handoffs: fits max_num_seqs and the unreserved blocks?-->
      allocate blocks under this pool's block table, unpack_kv the bytes into them, restore the generator
      --> every running request appends its last token's slot (chapter 05's append_slot)
      --> one forward over S new tokens (the vectorized decode path) --> sample_next per request
      --> DecodeTokens to the coordinator; finished requests free their blocks

Decode stops a request on eos, max_new_tokens or the context window; stop strings need text, so the coordinator
checks them and sends `Abort` (as vLLM's front-end process does with its detokenizer).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from minillm.disagg.kv_transfer import payload_from_bytes, unpack_kv
from minillm.disagg.messages import Abort, DecodeTokens, KVHandoff, StepRecord, TransferRecord, WorkerInit
from minillm.core.model import GPT
from minillm.paged import BlockManager, PagedBatch, PagedKVCache, num_blocks_for
from minillm.core.sampling import SamplingParams, sample_next


def max_kv_tokens(num_prompt_tokens: int, max_new_tokens: int, context_window: int) -> int:
    """The most KV slots a request ever fills: prompt + max_new_tokens - 1 (the last token is never fed back),
    capped by the context window."""
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
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
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


@dataclass
class _Running:
    request_id: str
    params: SamplingParams
    generator: torch.Generator | None
    num_prompt_tokens: int
    num_generated: int  # output tokens so far, the first (sampled by the prefill worker) included
    last_token: int  # sampled, not yet fed through the model
    worst_case_blocks: int  # blocks it may hold at most (admission reserved them)


class DecodeCore:
    def __init__(self, model: GPT, init: WorkerInit):
        self.model = model
        self.init = init
        self.device = torch.device(init.device)
        self.dtype = next(model.parameters()).dtype
        self.context_window = model.config.block_size
        self.blocks = BlockManager(init.num_blocks, init.block_size)
        self.cache = PagedKVCache(model.config, init.num_blocks, init.block_size, self.device, self.dtype)
        self.waiting: deque[tuple[KVHandoff, float]] = deque()  # (hand-off, received perf_counter)
        self.running: dict[str, _Running] = {}
        self.aborted: set[str] = set()  # aborted before their hand-off arrived: drop it when it does
        self.transfers: list[TransferRecord] = []  # received since the last DecodeTokens

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

    # ----------------------------------------------------------------------------------------------- admission
    def _reserved_blocks(self) -> int:
        return sum(r.worst_case_blocks - len(self.blocks.block_table(rid)) for rid, r in self.running.items())

    def _admit(self) -> None:
        bs = self.init.block_size
        worst = [max_kv_tokens(len(h.prompt_ids), h.params.max_new_tokens, self.context_window) for h, _ in self.waiting]
        n = admit_handoffs(worst, self.blocks.num_free_blocks, self._reserved_blocks(), len(self.running),
                           self.init.max_num_seqs, bs)
        for i in range(n):
            h, received = self.waiting.popleft()
            self.blocks.allocate(h.request_id, h.prompt_ids)
            self.blocks.mark_computed(h.request_id, len(h.prompt_ids))  # their K/V arrive by copy, not compute
            payload = payload_from_bytes(h.header, h.data)  # (L, 2, T, nh, hs)
            unpack_kv(payload, self.cache.k_pools, self.cache.v_pools, self.blocks.block_table(h.request_id))
            gen = None
            if h.generator_state is not None:
                # subtle: continue the SAME random stream the prefill worker drew the first token from, so a
                # seeded request samples exactly the tokens it would have in the colocated engine.
                gen = torch.Generator(device=self.device)
                gen.set_state(torch.frombuffer(bytearray(h.generator_state), dtype=torch.uint8))
            self.running[h.request_id] = _Running(
                h.request_id, h.params, gen, len(h.prompt_ids), 1, h.first_token, num_blocks_for(worst[i], bs)
            )
            self.transfers.append(TransferRecord(h.request_id, len(h.data), h.sent_time, received,
                                                 time.perf_counter()))

    # ----------------------------------------------------------------------------------------------- decoding
    def _done(self, r: _Running, token: int) -> bool:
        eos = self.init.eos_id
        if eos is not None and token == eos and not r.params.ignore_eos:
            return True
        if r.num_generated >= r.params.max_new_tokens:
            return True
        return r.num_prompt_tokens + r.num_generated > self.context_window  # the next token has no position

    @torch.no_grad()
    def step(self) -> list[tuple[str, Any]]:
        self._admit()
        transfers, self.transfers = self.transfers, []
        if not self.running:  # hand-offs wait for blocks; nothing to decode yet
            if transfers:
                now = time.perf_counter()
                return [("ctrl", DecodeTokens([], StepRecord("decode", "decode", now, now, 0), transfers))]
            return []
        start = time.perf_counter()
        reqs = list(self.running.values())
        entries = []
        for r in reqs:
            pairs = self.blocks.append_slot(r.request_id, r.last_token)  # admission reserved the block it may need
            assert not pairs, "decode sequences never share blocks"
            n = self.blocks.num_tokens(r.request_id)
            entries.append((r.request_id, n - 1, 1))
        pb = PagedBatch.build(self.blocks, entries, self.device)
        self.cache.set_batch(pb)
        idx = torch.tensor([r.last_token for r in reqs], dtype=torch.int64, device=self.device)[None]  # (1, S)
        logits = self.model(idx, pb.positions(), cache=self.cache)[0]  # (1, S, V) -> (S, V)
        items = []
        for i, r in enumerate(reqs):
            token = int(sample_next(logits[i : i + 1], r.params, r.generator)[0])  # one draw per token per request
            r.num_generated += 1
            r.last_token = token
            done = self._done(r, token)
            items.append((r.request_id, token, done))
            if done:
                self._finish(r.request_id)
        step = StepRecord("decode", "decode", start, time.perf_counter(), len(reqs), [r.request_id for r in reqs])
        return [("ctrl", DecodeTokens(items, step, transfers))]

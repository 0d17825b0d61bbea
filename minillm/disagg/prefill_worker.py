"""The prefill worker's model work: run prompts, sample each one's first token, pack its KV, hand it off.

Adds the prefill half of a disaggregated server (DistServe, Zhong et al. OSDI 2024; Splitwise, Patel et al.
ISCA 2024): this process only ever runs prompts, so its steps are long and compute-bound, and no decode step ever
waits behind them. What it leaves out: chunking a prompt longer than the token budget (a prompt always runs in
one step here), prefix caching, and overlapping the KV transfer with the next layer's compute.

One step (`PrefillCore.step`):

    waiting prompts --FCFS, <= max_num_batched_tokens--> allocate blocks in this worker's pool
      --> one ragged forward over all of them (chapter 05's PagedBatch) --> logits at each prompt's last token
      --> sample_next with the request's own generator: the FIRST token is sampled here, as vLLM's
          disaggregated prefill does, so TTFT never includes the transfer
      --> FirstTokens to the coordinator;  KVHandoff (pack_kv bytes + generator state) to the decode worker
      --> free the blocks: the prefill pool only holds prompts while they run
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch

from minillm.disagg.kv_transfer import pack_kv, payload_to_bytes
from minillm.disagg.messages import Abort, FirstTokens, KVHandoff, PrefillRequest, StepRecord, WorkerInit
from minillm.core.model import GPT
from minillm.paged import BlockManager, PagedBatch, PagedKVCache, num_blocks_for
from minillm.core.sampling import make_generator, sample_next


def first_token_finishes(token: int, params, eos_id: int | None, num_prompt_tokens: int, context_window: int) -> bool:
    """Whether the first sampled token already ends the request, so there is nothing to hand off: eos, a budget of
    one token, or a prompt that fills the context window (the token would have no position to be fed at)."""
    if eos_id is not None and token == eos_id and not params.ignore_eos:
        return True
    return params.max_new_tokens <= 1 or num_prompt_tokens + 1 > context_window


class PrefillCore:
    def __init__(self, model: GPT, init: WorkerInit):
        self.model = model
        self.init = init
        self.device = torch.device(init.device)
        self.dtype = next(model.parameters()).dtype
        self.blocks = BlockManager(init.num_blocks, init.block_size)
        self.cache = PagedKVCache(model.config, init.num_blocks, init.block_size, self.device, self.dtype)
        self.waiting: deque[PrefillRequest] = deque()

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

    @torch.no_grad()
    def step(self) -> list[tuple[str, Any]]:
        batch = self._take_batch()
        start = time.perf_counter()
        for r in batch:
            self.blocks.allocate(r.request_id, r.prompt_ids)  # the coordinator sized the pool for any one prompt
        pb = PagedBatch.build(self.blocks, [(r.request_id, 0, len(r.prompt_ids)) for r in batch], self.device)
        self.cache.set_batch(pb)
        idx = torch.tensor([t for r in batch for t in r.prompt_ids], dtype=torch.int64, device=self.device)[None]
        logits = self.model(idx, pb.positions(), cache=self.cache)  # (1, N, V)
        last = torch.cumsum(pb.query_lens, 0) - 1  # (S,): index of each prompt's last token in the flat row
        last_logits = logits[0, last.to(self.device)]  # (S, V)
        items, out = [], []
        for i, r in enumerate(batch):
            gen = make_generator(r.params.seed, self.device)
            token = int(sample_next(last_logits[i : i + 1], r.params, gen)[0])  # exactly one draw, as colocated
            done = first_token_finishes(token, r.params, self.init.eos_id, len(r.prompt_ids),
                                        self.model.config.block_size)
            items.append((r.request_id, token, done))
            if not done:
                table = self.blocks.block_table(r.request_id)
                payload = pack_kv(self.cache.k_pools, self.cache.v_pools, table, len(r.prompt_ids))
                header, data = payload_to_bytes(payload)  # (L, 2, T, nh, hs) -> bytes
                state = bytes(gen.get_state().numpy().tobytes()) if gen is not None else None
                out.append(("peer", KVHandoff(r.request_id, list(r.prompt_ids), token, r.params, state, header, data,
                                              time.perf_counter())))
            self.blocks.free(r.request_id)
        end = time.perf_counter()
        step = StepRecord("prefill", "prefill", start, end, int(idx.shape[1]), [r.request_id for r in batch])
        # The coordinator hears about the first tokens before the decode worker gets the KV: TTFT excludes transfer.
        return [("ctrl", FirstTokens(items, step))] + out

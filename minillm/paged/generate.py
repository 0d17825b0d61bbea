"""Generation on the paged cache: one request, or n parallel samples that share the prompt's blocks.

It adds `PagedGenerator`, a block manager and a paged cache kept across requests (so prefix caching can reuse a
system prompt between them), and `paged_generate`, the one-shot form. The request's lifecycle is the one every
loop shares (`minillm.core.stopping.start_request`, `sample_next`, `RequestState.accept`), so equal logits give
chapter 04's tokens. Seeding of n samples: sample i is a `RequestState.fork` drawing from its own generator seeded
with `params.seed + i`, exactly the generator an independent run with `seed = params.seed + i` would use (sample
0 is the plain seeded run). What it leaves
out: several requests at once and preemption (chapter 06's engine); here the n samples of one prompt are the
only batch, decoded together in one ragged forward per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from minillm.core.config import check_int
from minillm.core.model import GPT, require_model
from minillm.core.sampling import SamplingParams, sample_next
from minillm.core.stopping import RequestState, check_eos_id, check_token_ids, start_request
from minillm.paged.block_manager import BlockManager, num_blocks_for
from minillm.paged.paged_cache import PagedBatch, PagedKVCache


@dataclass
class PagedGeneration:
    """The outcome of one request: every sample's new tokens, plus what paging saved."""

    token_ids: list[list[int]]  # new tokens of each of the n samples
    finish_reasons: list[str]  # "length" | "eos" | "stop", per sample
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens whose K/V came from the prefix cache (prefill skipped)
    peak_blocks: int  # most blocks this request held at once, sharing counted once
    peak_blocks_unshared: int  # the same moment's need if every sample had private copies of its blocks
    num_cow_copies: int  # blocks copied because a sample wrote into a shared block
    block_tables: list[list[int]] = field(default_factory=list)  # each sample's table just before it was freed

    @property
    def blocks_saved(self) -> int:
        return self.peak_blocks_unshared - self.peak_blocks


class PagedGenerator:
    """A model plus a `BlockManager` and `PagedKVCache` that live across `generate` calls.

    `model` is anything with GPT's interface (`require_model`); the pool is allocated in `kv_dtype`, a setting of
    its own, never read off the weights.
    """

    def __init__(
        self,
        model: GPT,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = False,
        use_fast_decode: bool = True,
        kv_dtype: torch.dtype = torch.float32,
    ):
        config = require_model(model, "PagedGenerator")
        for name, flag in (("enable_prefix_caching", enable_prefix_caching), ("use_fast_decode", use_fast_decode)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__} {flag!r}")
        self.model = model
        self.manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.cache = PagedKVCache(config, num_blocks, block_size, device=model.device, dtype=kv_dtype,
                                  use_fast_decode=use_fast_decode)
        self._next_id = 0

    @torch.inference_mode()
    def forward(self, entries: list[tuple[Any, int, int]], token_ids: list[int]) -> torch.Tensor:
        """One ragged forward: entries [(seq_id, start, num_new)], their new tokens flattened -> logits (S, V) of
        each entry's last new token (the one its next token is sampled from)."""
        device = self.model.device
        batch = PagedBatch.build(self.manager, entries, device=device)  # checks the entries
        if len(check_token_ids("token_ids", token_ids, self.model.config.vocab_size)) != batch.num_tokens:
            raise ValueError(f"token_ids must hold the entries' {batch.num_tokens} new tokens, got {len(token_ids)}")
        self.cache.set_batch(batch)
        idx = torch.tensor([token_ids], dtype=torch.long, device=device)  # (1, N)
        ends, offset = [], 0
        for _, _, num_new in entries:
            offset += num_new
            ends.append(offset - 1)  # the row of the entry's last new token
        rows = torch.tensor(ends, dtype=torch.long, device=device)  # (S,)
        # Unchecked path: the prompt was validated by `generate`, positions come from the block manager.
        h = self.model.hidden(idx, batch.positions(), self.cache)  # (1, N, C)
        return self.model.logits(h[0].index_select(0, rows))  # (S, C) -> (S, V)

    def generate(
        self, prompt_ids: Any, params: SamplingParams, tokenizer: Any = None, eos_id: int | None = None
    ) -> PagedGeneration:
        """Generate params.n samples of one prompt; every block is freed again before returning."""
        check_eos_id(eos_id, self.model.config.vocab_size)
        return self._generate(start_request(self.model.config, prompt_ids, params, tokenizer, eos_id,
                                            device=self.model.device))

    def _generate(self, first: RequestState) -> PagedGeneration:
        """`generate` for a request already started (validated, window-capped) on this generator's device."""
        ids, params, bs = first.prompt_ids, first.params, self.manager.block_size
        n = params.n
        seqs = [(self._next_id, i) for i in range(n)]  # seq ids unique across calls
        self._next_id += 1
        states = [first] + [first.fork(params.seed + i if params.seed is not None else None) for i in range(1, n)]
        out = PagedGeneration([s.output_ids for s in states], [""] * n, len(ids), 0, 0, 0, 0, [[] for _ in range(n)])
        if first.finished:  # max_new_tokens == 0: nothing to generate, nothing allocated
            out.finish_reasons = [s.finish_reason for s in states]
            return out
        m = self.manager
        used_before = m.allocator.num_used
        try:
            # Prefill once for all samples: the prompt's blocks are shared by fork, not copied.
            out.num_cached_tokens = m.allocate(seqs[0], ids)
            start = out.num_cached_tokens
            logits = self.forward([(seqs[0], start, len(ids) - start)], ids[start:])  # (1, V)
            m.mark_computed(seqs[0], len(ids))
            for s in seqs[1:]:
                m.fork(seqs[0], s)
            active = list(range(n))
            rows = {i: logits for i in active}  # sample i's next-token logits (1, V)
            while active:
                tokens: dict[int, int] = {}
                for i in list(active):
                    tok = int(sample_next(rows[i], states[i].params, states[i].generator))
                    if states[i].accept([tok]):  # out.token_ids[i] is the state's own list: appended here
                        out.finish_reasons[i] = states[i].finish_reason
                        out.block_tables[i] = m.block_table(seqs[i])
                        m.free(seqs[i])
                        active.remove(i)
                    else:
                        tokens[i] = tok
                if not active:
                    break
                for i in active:
                    pairs = m.append_slot(seqs[i], tokens[i])
                    self.cache.copy_blocks(pairs)
                    out.num_cow_copies += len(pairs)
                held = m.allocator.num_used - used_before
                unshared = sum(num_blocks_for(m.num_tokens(seqs[i]), bs) for i in active)
                out.peak_blocks = max(out.peak_blocks, held)
                out.peak_blocks_unshared = max(out.peak_blocks_unshared, unshared)
                entries = [(seqs[i], m.num_tokens(seqs[i]) - 1, 1) for i in active]
                logits = self.forward(entries, [tokens[i] for i in active])  # (S, V)
                rows = {i: logits[j : j + 1] for j, i in enumerate(active)}
        finally:
            for s in seqs:  # on any error (OutOfBlocks included) the pool is left as it was
                if m.has_seq(s):
                    m.free(s)
        return out


def paged_generate(
    model: GPT,
    prompt_ids: Any,
    params: SamplingParams,
    tokenizer: Any = None,
    eos_id: int | None = None,
    block_size: int = 16,
    num_blocks: int | None = None,
    kv_dtype: torch.dtype = torch.float32,
) -> PagedGeneration:
    """One request on a fresh paged cache (in `kv_dtype`). `num_blocks` defaults to what n private copies could
    ever need."""
    config = require_model(model, "paged_generate")
    # The request is started (and checked) once, here, before its length sizes the pool.
    check_eos_id(eos_id, config.vocab_size)
    block_size = check_int("block_size", block_size, 1)  # before it divides the pool size below
    state = start_request(config, prompt_ids, params, tokenizer, eos_id, device=model.device)
    if num_blocks is None:
        longest = min(len(state.prompt_ids) + state.params.max_new_tokens, config.block_size)
        num_blocks = params.n * num_blocks_for(longest, block_size) + 1
    return PagedGenerator(model, num_blocks, block_size, kv_dtype=kv_dtype)._generate(state)

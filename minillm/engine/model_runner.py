"""The model runner: turn one scheduled step into one forward pass over a ragged batch, and sample.

It adds the tensor side of the engine, kept apart from the scheduler (which only moves requests between queues)
so that chapter 07's prefill-only and decode-only workers can reuse it: `ModelRunner.run(scheduler_output,
block_manager) -> [token or None per scheduled request]`. The scheduled requests' new tokens are flattened into
one row, idx (1, N), with their absolute positions; chapter 05's `PagedKVCache` writes their K/V at their slots and
runs attention per sequence (Orca's selective batching, §3.3: the linear layers see one flat batch of N tokens,
attention never mixes sequences). Only the rows that end a request's known tokens go through the output head, and
each of them is sampled with its own request's generator. What it leaves out: CUDA graphs and torch.compile
(chapter 13), and overlapping the CPU-side batch building with the forward.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from minillm.engine.scheduler import SchedulerOutput
from minillm.core.model import GPT
from minillm.paged import PagedBatch
from minillm.core.sampling import sample_next
from minillm.engine.selective_cache import SelectiveKVCache


@contextmanager
def _only_rows(model: GPT, rows: torch.Tensor):
    """Make the model's output head see only `rows` of the final hidden states: logits (1, len(rows), V).

    Why: a 512-token prompt chunk needs the logits of its last token only; the head (C x V = 256 x 4096 on `base`)
    on all 512 rows would cost about as much as the six transformer blocks. A forward hook on `ln_f` keeps the
    model plain (style: speed-ups from the call site) while `forward` returns just the rows we sample from.
    """

    def hook(module, inputs, output):  # output (1, N, C) -> (1, R, C)
        return output.index_select(1, rows)

    handle = model.transformer.ln_f.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


class ModelRunner:
    """Owns the KV pool (a `PagedKVCache`) and runs the model on what the scheduler picked."""

    def __init__(self, model: GPT, num_blocks: int, block_size: int, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None):
        if not isinstance(model, GPT):
            raise TypeError(f"model must be a minillm GPT, got {type(model).__name__}")
        self.model = model
        self.device = torch.device(device) if device is not None else model.device
        self.dtype = dtype or model.lm_head.weight.dtype
        self.block_size = block_size
        self.cache = SelectiveKVCache(model.config, num_blocks, block_size, device=self.device, dtype=self.dtype)
        self.num_forward_calls = 0

    def prepare(self, out: SchedulerOutput, block_manager) -> tuple[torch.Tensor, torch.Tensor, PagedBatch]:
        """idx (1, N), positions (1, N) and the `PagedBatch` for this step (decodes first, as the scheduler orders)."""
        entries = [(s.request.request_id, s.start, s.num_new_tokens) for s in out.scheduled]
        batch = PagedBatch.build(block_manager, entries, device=self.device)
        flat: list[int] = []
        for s in out.scheduled:
            flat += s.request.all_token_ids[s.start : s.start + s.num_new_tokens]
        idx = torch.tensor([flat], dtype=torch.int64, device=self.device)  # (1, N)
        return idx, batch.positions(), batch

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput, block_manager) -> torch.Tensor:
        """One forward over the scheduled tokens; logits (R, V) of the R requests that sample this step, in order."""
        if out.cow_pairs:
            self.cache.copy_blocks(out.cow_pairs)  # copy-on-write before anything writes the new blocks
        idx, positions, batch = self.prepare(out, block_manager)
        ends, offset = [], 0
        for s in out.scheduled:
            offset += s.num_new_tokens
            if s.samples:
                ends.append(offset - 1)  # the row of the request's last known token
        rows = torch.tensor(ends, dtype=torch.int64, device=self.device)  # (R,)
        self.cache.set_batch(batch)
        self.num_forward_calls += 1
        with _only_rows(self.model, rows):
            logits = self.model(idx, positions=positions, cache=self.cache)  # (1, R, V)
        return logits[0]  # (R, V)

    def sample(self, out: SchedulerOutput, logits: torch.Tensor) -> list[int | None]:
        """One token per sampling request, None for prompt chunks that do not reach the end of their prompt.

        Greedy rows share one argmax (row-wise, so batching cannot change it); every other row is drawn by
        `sample_next` from its own request's generator, exactly one draw per token, as when the request runs alone.
        """
        samplers = [s for s in out.scheduled if s.samples]
        assert logits.shape[0] == len(samplers)
        tokens: list[int | None] = [None] * len(samplers)
        greedy = [i for i, s in enumerate(samplers) if s.request.params.is_greedy]
        if greedy:
            picked = sample_next(logits[greedy], samplers[greedy[0]].request.params)  # (G,)
            for i, t in zip(greedy, picked.tolist()):
                tokens[i] = t
        for i, s in enumerate(samplers):
            if tokens[i] is None:
                req = s.request
                tokens[i] = int(sample_next(logits[i : i + 1], req.params, req.generator))  # (1, V) -> (1,)
        it = iter(tokens)
        return [next(it) if s.samples else None for s in out.scheduled]

    def run(self, out: SchedulerOutput, block_manager) -> list[int | None]:
        """forward + sample: the next token of every scheduled request that reached its end (None otherwise)."""
        if out.is_empty:
            return []
        return self.sample(out, self.forward(out, block_manager))

"""The model runner: the in-process executor (`minillm.engine.executor.Executor`), which carries out one planned
step (`StepInput`) on the device.

It adds the tensor side of the engine, kept apart from the scheduler (which only moves requests between queues
and blocks) and from the planner (`minillm.engine.step.plan`, which turns the scheduler's choice into plain
data): `ModelRunner.execute(step) -> logits (R, V)`. In order: the swap-outs (pool blocks to host memory), the
swap-ins, the copy-on-write pairs, then one forward over the step's N tokens flattened into one row, idx (1, N),
with their absolute positions. The KV cache (chapter 05's paged pool, built by name from
`EngineConfig.attention_backend` in `EngineConfig.kv_dtype`) writes their K/V at their slots and runs attention
per sequence (Orca's selective batching, §3.3: the linear layers see one flat batch of N tokens, attention never
mixes sequences). Only the R rows the step asks for go through the output head (`model.hidden`, then
`model.logits` of those rows; no forward hooks). Sampling is not here (`minillm.engine.sampler`): the executor
needs no `Request`, so a second process holding another copy (or a shard) of the model runs the same `StepInput`.
What it leaves out: CUDA graphs and torch.compile (chapter 13), and overlapping the host-side planning with the
forward.
"""

from __future__ import annotations

import torch

from minillm.core.config import check_device
from minillm.core.model import require_model
from minillm.engine.config import resolve_kv_dtype
from minillm.engine.sampler import Sampler
from minillm.engine.step import StepInput, check_step_input, plan
from minillm.engine.swap import SwapSpace
from minillm.paged import PagedBatch
from minillm.paged.backends import make_attention_backend


class ModelRunner:
    """Owns the KV pool (a cache built by name from `minillm.paged.backends`) and its host swap space, and runs
    the model on a `StepInput`.

    `model` is anything with GPT's interface (`require_model`): a GPT, a quantized copy, a wrapper. The KV dtype is
    a setting of its own (`kv_dtype`, default float32), never read off the weights; the cache converts K/V to the
    query's dtype when it reads them.
    """

    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device | str | None = None,
                 kv_dtype: torch.dtype | str = torch.float32, attention_backend: str = "selective"):
        self.model_config = require_model(model, "ModelRunner")
        self.model = model
        self.device = check_device("device", device) if device is not None else model.device
        self.kv_dtype = resolve_kv_dtype(kv_dtype)
        self.attention_backend = attention_backend
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cache = make_attention_backend(attention_backend, self.model_config, num_blocks, block_size,
                                            device=self.device, dtype=self.kv_dtype)
        self.swap_space = SwapSpace(self.cache)
        self.num_forward_calls = 0

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def move_blocks(self, step: StepInput) -> None:
        """The step's byte moves, in their only safe order: swap-outs, discards, swap-ins, copy-on-write."""
        check_step_input(step)
        for key, table in step.swap_out:  # before anything writes these blocks: they may be reused this step
            self.swap_space.swap_out(key, table)
        for key in step.swap_discard:
            self.swap_space.discard(key)
        for key, table in step.swap_in:
            self.swap_space.swap_in(key, table)
        if step.cow_pairs:
            self.cache.copy_blocks(step.cow_pairs)  # copy-on-write before the forward writes the new blocks

    @torch.inference_mode()
    def execute(self, step: StepInput) -> torch.Tensor | None:
        """Carry out one step: the byte moves, then one forward; logits (R, V) of `step.sample_rows`, in order.

        None when the step has no tokens to run (it only moved bytes). Unchecked path: a locally planned step's
        token ids were validated when their requests were added and its slots come from the block manager, so no
        host sync for range checks (a step received from elsewhere is checked first: `StepInput.check`). Only the
        R sampled rows go through the head: a 512-token prompt chunk needs its last row's logits, and the head
        (C x V) on all rows would cost about as much as the transformer blocks on a small model.
        """
        self.move_blocks(step)  # checks that step is a StepInput first
        if not step.has_forward:
            return None
        idx = self._tensor(step.token_ids).unsqueeze(0)  # (1, N)
        positions = self._tensor(step.positions).unsqueeze(0)  # (1, N)
        self.cache.set_batch(PagedBatch.from_lists(step.slot_mapping, step.block_tables, step.context_lens,
                                                   step.query_lens, self.device))
        self.num_forward_calls += 1
        h = self.model.hidden(idx, positions, self.cache)  # (1, N, C)
        return self.model.logits(h[0].index_select(0, self._tensor(step.sample_rows)))  # (R, C) -> (R, V)

    def close(self) -> None:
        """Nothing to release in process (the `Executor` contract; chapter 14's executor stops its ranks here)."""

    def run(self, out, block_manager, sampler: Sampler | None = None) -> list[int | None]:
        """plan + execute + sample, for loops that own their requests in this process (chapter 07's workers):
        the next token of every scheduled request that reached its end (None otherwise)."""
        if sampler is not None and not callable(getattr(sampler, "sample", None)):
            raise TypeError(f"sampler must be a Sampler or None, got {type(sampler).__name__}")
        logits = self.execute(plan(out, block_manager))
        return [] if logits is None else (sampler or Sampler()).sample(out, logits)

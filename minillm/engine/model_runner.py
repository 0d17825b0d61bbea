"""The model runner: turn one scheduled step into one forward pass over a ragged batch, and sample.

It adds the tensor side of the engine, kept apart from the scheduler (which only moves requests between queues)
so that chapter 07's prefill-only and decode-only workers can reuse it: `ModelRunner.run(scheduler_output,
block_manager) -> [token or None per scheduled request]`. The scheduled requests' new tokens are flattened into
one row, idx (1, N), with their absolute positions; the KV cache (chapter 05's paged pool, built by name from
`EngineConfig.attention_backend` in `EngineConfig.kv_dtype`) writes their K/V at their slots and runs attention per
sequence (Orca's selective batching, §3.3: the linear layers see one flat batch of N tokens, attention never mixes
sequences). Only the rows that end a request's known tokens go through the output head (`model.hidden`, then
`model.logits` of those rows; no forward hooks), and each of them is sampled with its own request's generator.
What it leaves out: CUDA graphs and torch.compile (chapter 13), and overlapping the CPU-side batch building with
the forward.
"""

from __future__ import annotations

import torch

from minillm.core.model import require_model
from minillm.core.sampling import sample_next
from minillm.engine.config import resolve_kv_dtype
from minillm.engine.scheduler import SchedulerOutput
from minillm.engine.selective_cache import SelectiveKVCache  # noqa: F401  (registers "selective", the default)
from minillm.paged import PagedBatch
from minillm.paged.backends import make_attention_backend


def _is_greedy(params) -> bool:
    """params.is_greedy, or False if even that raises: the row is then sampled alone, where its failure is caught."""
    try:
        return bool(params.is_greedy)
    except Exception:  # noqa: BLE001 - the per-row path below fails this request with the same exception
        return False


class ModelRunner:
    """Owns the KV pool (a cache built by name from `minillm.paged.backends`) and runs the model on what the
    scheduler picked.

    `model` is anything with GPT's interface (`require_model`): a GPT, a quantized copy, a wrapper. The KV dtype is
    a setting of its own (`kv_dtype`, default float32), never read off the weights; the cache converts K/V to the
    query's dtype when it reads them.
    """

    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device | str | None = None,
                 kv_dtype: torch.dtype | str = torch.float32, attention_backend: str = "selective"):
        config = require_model(model, "ModelRunner")
        self.model = model
        self.device = torch.device(device) if device is not None else model.device
        self.kv_dtype = resolve_kv_dtype(kv_dtype)
        self.attention_backend = attention_backend
        self.block_size = block_size
        self.cache = make_attention_backend(attention_backend, config, num_blocks, block_size, device=self.device,
                                            dtype=self.kv_dtype)
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
        # Unchecked path: every token id was validated when its request was added, and positions come from the
        # block manager, so no host sync for range checks. Only the R sampled rows go through the head: a 512-token
        # prompt chunk needs its last row's logits, and the head (C x V) on all rows would cost about as much as
        # the transformer blocks on a small model.
        h = self.model.hidden(idx, positions, self.cache)  # (1, N, C)
        return self.model.logits(h[0].index_select(0, rows))  # (R, C) -> (R, V)

    def sample(self, out: SchedulerOutput, logits: torch.Tensor) -> list[int | None]:
        """One token per sampling request, None for prompt chunks that do not reach the end of their prompt.

        Greedy rows share one argmax (row-wise, so batching cannot change it); every other row is drawn by
        `sample_next` from its own request's generator, exactly one draw per token, as when the request runs alone.
        A request whose sampling raises is failed alone (`state.fail`, finish_reason "error", a message naming it)
        and gets None; the caller finishes and frees it (`Scheduler.update`, the workers), the others go on.
        """
        samplers = [s for s in out.scheduled if s.samples]
        assert logits.shape[0] == len(samplers)
        tokens: list[int | None] = [None] * len(samplers)
        greedy = [i for i, s in enumerate(samplers) if _is_greedy(s.request.params)]
        if greedy:
            try:
                picked = sample_next(logits[greedy], samplers[greedy[0]].request.params)  # (G,)
                for i, t in zip(greedy, picked.tolist()):
                    tokens[i] = t
            except Exception:  # noqa: BLE001 - redone row by row below, so the failure lands on its own request
                pass
        for i, s in enumerate(samplers):
            if tokens[i] is None:
                req = s.request
                try:
                    tokens[i] = int(sample_next(logits[i : i + 1], req.params, req.generator))  # (1, V) -> (1,)
                except Exception as exc:  # noqa: BLE001 - one request's failure, whatever it is, is its own
                    req.state.fail(f"request {req.request_id!r} failed in sampling: {type(exc).__name__}: {exc}")
        it = iter(tokens)
        return [next(it) if s.samples else None for s in out.scheduled]

    def run(self, out: SchedulerOutput, block_manager) -> list[int | None]:
        """forward + sample: the next token of every scheduled request that reached its end (None otherwise)."""
        if out.is_empty:
            return []
        return self.sample(out, self.forward(out, block_manager))

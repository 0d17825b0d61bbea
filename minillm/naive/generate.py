"""The naive generation loop: run the whole sequence through the model for every new token, and stream it.

Adds `generate_naive` (the baseline every later chapter must reproduce token for token) and `collect`. The request's
lifecycle (prompt checks, the window cap, the generator, the stop rules) is `minillm.core.stopping`'s
`start_request` / `RequestState`, the one every loop in minillm shares. What it leaves out: any reuse of work
between steps. Step t feeds all prompt_len + t tokens through every layer again, so generating n tokens costs
O(P·n²) linear-layer FLOPs for P parameters; chapter 04's KV cache removes that.

    prompt ids ──► GPT(all T tokens) ──► logits of row T-1 ──► sample_next ──► token ──► yield, accept, repeat
                        ▲                                                                 │
                        └────────────────── T grows by one every step ────────────────────┘
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from minillm.core.model import require_model
from minillm.core.sampling import SamplingParams, sample_next
from minillm.core.stopping import RequestState, check_eos_id, start_request


def generate_naive(
    model: torch.nn.Module,
    prompt_ids: Any,
    params: SamplingParams,
    tokenizer: Any = None,
    eos_id: int | None = None,
    truncate: bool = False,
) -> Iterator[int]:
    """Stream new token ids, recomputing the whole sequence at every step (no cache: the baseline).

    Input is checked now (errors raise here, not at the first `next`). The returned generator yields each token as
    soon as it is sampled and, when exhausted, returns the finish reason ("length", "eos" or "stop") as its
    `StopIteration.value`; `collect` gets both. `eos_id` defaults to the tokenizer's end-of-text token.
    """
    cfg = require_model(model, "generate_naive")
    check_eos_id(eos_id, cfg.vocab_size)
    state = start_request(cfg, prompt_ids, params, tokenizer, eos_id, device=model.device, truncate=truncate)
    return _naive_stream(model, state)


def _naive_stream(model: torch.nn.Module, state: RequestState) -> Iterator[int]:
    if state.finished:  # max_new_tokens == 0
        return state.finish_reason
    device = model.device
    ids = state.prompt_ids
    idx = torch.tensor([ids], dtype=torch.long, device=device)  # (1, T)
    # Positions as views of one arange; the prompt was validated at the entry point, so the loop calls the
    # unchecked hidden + logits (no host sync for range checks) and the head sees only the row it samples from.
    positions = torch.arange(len(ids) + state.params.max_new_tokens, device=device)  # (T_max,)
    with torch.inference_mode():
        while True:
            T = idx.size(1)
            h = model.hidden(idx, positions[None, :T])  # (1, T, C): every position recomputed, only the last used
            token = sample_next(model.logits(h[:, -1]), state.params, state.generator)  # (1, C) -> (1, V) -> (1,)
            token_id = int(token)  # subtle: on CUDA this waits for the GPU, so a timestamp taken now is honest
            yield token_id
            if state.accept([token_id]):
                return state.finish_reason
            idx = torch.cat([idx, token.view(1, 1)], dim=1)  # (1, T) -> (1, T + 1)


def collect(stream: Iterator[int]) -> tuple[list[int], str | None]:
    """Drain a generation stream: (all token ids, the finish reason the generator returned)."""
    ids: list[int] = []
    while True:
        try:
            ids.append(next(stream))
        except StopIteration as stop:
            return ids, stop.value


def generate_naive_ids(
    model: torch.nn.Module,
    prompt_ids: Any,
    params: SamplingParams,
    tokenizer: Any = None,
    eos_id: int | None = None,
    truncate: bool = False,
) -> list[int]:
    """`generate_naive`, collected into a list of the new token ids."""
    return collect(generate_naive(model, prompt_ids, params, tokenizer, eos_id, truncate))[0]

"""The naive generation loop: run the whole sequence through the model for every new token, and stream it.

Adds `generate_naive` (the baseline every later chapter must reproduce token for token), the prompt checks all
generation paths share (`validate_prompt`), and `StopChecker` (max tokens, end-of-text, stop strings). What it
leaves out: any reuse of work between steps. Step t feeds all prompt_len + t tokens through every layer again, so
generating n tokens costs O(P·n²) linear-layer FLOPs for P parameters; chapter 04's KV cache removes that.

    prompt ids ──► GPT(all T tokens) ──► logits[:, -1] ──► sample_next ──► token ──► yield, append, repeat
                        ▲                                                            │
                        └────────────────── T grows by one every step ───────────────┘
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import torch

from minillm.core.sampling import SamplingParams, make_generator, sample_next

FINISH_REASONS = ("length", "eos", "stop")


def _default_eos(tokenizer: Any, eos_id: int | None) -> int | None:
    """The explicit eos_id, else the tokenizer's end-of-text token when it has one, else none."""
    if eos_id is not None:
        if not isinstance(eos_id, int) or isinstance(eos_id, bool):
            raise TypeError(f"eos_id must be an int or None, got {type(eos_id).__name__} {eos_id!r}")
        return eos_id
    return getattr(tokenizer, "eot_token", None) if tokenizer is not None else None


class StopChecker:
    """Decides after each generated token whether generation is over, and why.

    `update(token_id)` returns True when the request must stop: the token is end-of-text (unless
    `params.ignore_eos`), a stop string now appears in the generated text, or `params.max_new_tokens` tokens have
    been produced. `finish_reason` is then "eos", "stop" or "length" (checked in that order, as vLLM does). The token
    that triggered the stop has already been streamed; `output_text()` gives the text with the stop string and
    anything after it cut off, as vLLM returns it.
    """

    def __init__(self, tokenizer: Any, params: SamplingParams, eos_id: int | None = None):
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.stop and tokenizer is None:
            raise ValueError(f"stop strings {params.stop!r} need a tokenizer to decode the generated text")
        self.tokenizer = tokenizer
        self.params = params
        self.eos_id = _default_eos(tokenizer, eos_id)
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self._max_stop = max((len(s) for s in params.stop), default=0)
        self._searched = 0  # characters of decoded text already searched for stop strings
        self._stop_at: int | None = None  # character index where the stop string begins

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """All generated text so far (stop string included)."""
        return self.tokenizer.decode(self.token_ids) if self.tokenizer is not None else ""

    def output_text(self) -> str:
        """The generated text up to (not including) the stop string, if one was hit."""
        text = self.text
        return text if self._stop_at is None else text[: self._stop_at]

    def update(self, token_id: int) -> bool:
        if self.finished:
            raise RuntimeError(f"update() after generation finished ({self.finish_reason})")
        self.token_ids.append(int(token_id))
        if self.eos_id is not None and token_id == self.eos_id and not self.params.ignore_eos:
            self.finish_reason = "eos"
        elif self.params.stop and self._find_stop():
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.params.max_new_tokens:
            self.finish_reason = "length"
        return self.finished

    def _find_stop(self) -> bool:
        text = self.text
        # subtle: only the tail can hold a new match, but a token can end mid-character (shown as U+FFFD until its
        # next bytes arrive), so re-search a few characters before the stop string's length.
        start = max(0, self._searched - self._max_stop - 4)
        hits = [i for i in (text.find(s, start) for s in self.params.stop) if i >= 0]
        self._searched = len(text)
        if hits:
            self._stop_at = min(hits)
            return True
        return False


def validate_prompt(
    prompt_ids: Any, params: SamplingParams, vocab_size: int, block_size: int, truncate: bool = False
) -> tuple[list[int], int]:
    """Check a prompt against the model; return (prompt ids as a list, the number of tokens that can be generated).

    A prompt longer than the context window is a ValueError unless `truncate=True`, which keeps the last tokens,
    as many as leave room for `max_new_tokens` (at least one). Generation is capped where the sequence fills the
    window: the naive loop feeds prompt_len + n - 1 tokens to produce n, so at most block_size - prompt_len + 1 new
    tokens fit (finish_reason "length"), as vLLM caps max_tokens at the model's length.
    """
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() != 1 or prompt_ids.is_floating_point() or prompt_ids.dtype == torch.bool:
            raise TypeError(f"prompt_ids tensor must be 1-D integer, got {prompt_ids.dtype} {tuple(prompt_ids.shape)}")
        prompt_ids = prompt_ids.tolist()
    if not isinstance(prompt_ids, (list, tuple)):
        raise TypeError(f"prompt_ids must be a list of ints, got {type(prompt_ids).__name__}")
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids is empty: generation needs at least one token to condition on")
    for pos, tok in enumerate(prompt_ids):
        if not isinstance(tok, int) or isinstance(tok, bool):
            raise TypeError(f"prompt_ids[{pos}] must be an int token id, got {type(tok).__name__} {tok!r}")
        if not 0 <= tok < vocab_size:
            raise ValueError(f"prompt_ids[{pos}] = {tok} is outside the vocabulary [0, {vocab_size})")
    ids = list(prompt_ids)
    if not isinstance(truncate, bool):
        raise TypeError(f"truncate must be a bool, got {truncate!r}")
    if len(ids) > block_size:
        if not truncate:
            raise ValueError(f"prompt has {len(ids)} tokens, more than the context window block_size={block_size}; "
                             f"pass truncate=True to keep the last tokens")
    if truncate:
        keep = max(1, block_size - max(params.max_new_tokens - 1, 0))
        ids = ids[-keep:]
    return ids, min(params.max_new_tokens, block_size - len(ids) + 1)


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
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"model must be a minillm GPT (an nn.Module with a config), got {type(model).__name__}")
    cfg = model.config
    ids, max_new = validate_prompt(prompt_ids, params, cfg.vocab_size, cfg.block_size, truncate)
    checker = StopChecker(tokenizer, dataclasses.replace(params, max_new_tokens=max_new), eos_id)
    return _naive_stream(model, ids, params, checker)


def _naive_stream(model: torch.nn.Module, ids: list[int], params: SamplingParams, checker: StopChecker):
    if checker.params.max_new_tokens == 0:
        checker.finish_reason = "length"
        return checker.finish_reason
    device = model.device
    generator = make_generator(params.seed, device)
    idx = torch.tensor([ids], dtype=torch.long, device=device)  # (1, T)
    with torch.inference_mode():
        while True:
            logits = model(idx)  # (1, T, V): every position recomputed, though only the last one is used
            token = sample_next(logits[:, -1, :], params, generator)  # (1,)
            token_id = int(token)  # subtle: on CUDA this waits for the GPU, so a timestamp taken now is honest
            yield token_id
            if checker.update(token_id):
                return checker.finish_reason
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

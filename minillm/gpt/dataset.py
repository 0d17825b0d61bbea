"""Training data for the GPT: a corpus encoded to one long tensor of token ids, and random windows drawn from it.

What it adds: `encode_corpus` (text -> int64 ids with the shipped tokenizer, `<|endoftext|>` between files kept
as its special id), `split_tokens` (the train or val split of a corpus, encoded once per process),
`default_eval_tokens` (the validation ids every later chapter evaluates on), and `BatchSampler` (random windows,
drawn from its own seeded `torch.Generator`, so a run and its resume draw the same batches). What it leaves out:
epochs, shuffling without replacement, document boundaries (a window may span two files, as in GPT-2 training).
"""

from __future__ import annotations

import functools
import os

import torch

from minillm.core.config import check_choice, check_tensor_elements, short_repr
from minillm.core.corpus import SEPARATOR, load_corpus
from minillm.core.sampling import check_seed
from minillm.tokenizer import load_tokenizer


def encode_corpus(tokenizer, text: str) -> torch.Tensor:
    """All ids of `text` as a 1-D int64 tensor; the file separator `<|endoftext|>` becomes its special id."""
    if isinstance(tokenizer, (str, bytes)) or not callable(getattr(tokenizer, "encode", None)):
        raise TypeError(f"tokenizer must have an encode(text) method (the shipped tokenizer's), got "
                        f"{type(tokenizer).__name__} {short_repr(tokenizer)}")
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    allowed = {SEPARATOR} if SEPARATOR in getattr(tokenizer, "special_tokens", {}) else set()
    ids = tokenizer.encode(text, allowed_special=allowed) if allowed else tokenizer.encode(text)
    return torch.tensor(ids, dtype=torch.int64)  # (N,)


@functools.lru_cache(maxsize=8)
def _split_tokens_cached(split: str, corpus_path: str | None) -> torch.Tensor:
    corpus = load_corpus(corpus_path)
    text = {"train": corpus.train_text, "val": corpus.val_text}[split]
    return encode_corpus(load_tokenizer(), text)


def split_tokens(split: str = "train", corpus_path: str | os.PathLike | None = None, tokenizer=None) -> torch.Tensor:
    """The ids of a corpus split ("train" or "val"); the shipped tokenizer's are encoded once per process."""
    split = check_choice("split", split, ("train", "val"))
    if tokenizer is not None:
        corpus = load_corpus(corpus_path)
        return encode_corpus(tokenizer, corpus.train_text if split == "train" else corpus.val_text)
    key = None if corpus_path is None else str(os.fspath(corpus_path))
    return _split_tokens_cached(split, key).clone()  # a copy: callers may write into it


def default_eval_tokens(n_tokens: int | None = None, split: str = "val") -> torch.Tensor:
    """The first `n_tokens` ids (None = all) of a default-corpus split, encoded with the shipped tokenizer.

    Every chapter that measures perplexity or needs realistic prompts uses these, so their numbers compare.
    """
    if n_tokens is not None and (not isinstance(n_tokens, int) or isinstance(n_tokens, bool) or n_tokens <= 0):
        raise ValueError(f"n_tokens must be a positive int or None, got {short_repr(n_tokens)}")
    ids = split_tokens(split)
    if n_tokens is not None and n_tokens > ids.numel():
        raise ValueError(f"n_tokens={n_tokens} exceeds the {ids.numel()} tokens of the {split!r} split")
    return ids if n_tokens is None else ids[:n_tokens].clone()


class BatchSampler:
    """Random training windows: x = tokens[i : i+T], y = tokens[i+1 : i+T+1] for B random starts i.

    The starts come from the sampler's own `torch.Generator`, never the global RNG, so model code that draws
    random numbers (dropout) cannot shift the data order, and `state()` / `set_state()` make resume exact.
    """

    def __init__(self, tokens: torch.Tensor, batch_size: int, block_size: int, seed: int = 0):
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.dtype != torch.int64:
            raise TypeError("tokens must be a 1-D int64 tensor")
        for name, value in (("batch_size", batch_size), ("block_size", block_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {short_repr(value)}")
        if tokens.numel() < block_size + 1:
            raise ValueError(f"need at least block_size+1={block_size + 1} tokens, got {tokens.numel()}")
        check_tensor_elements("batch_size x block_size", (batch_size, block_size))  # a batch, before the allocator
        self.tokens = tokens
        self.batch_size = batch_size
        self.block_size = block_size
        self.generator = torch.Generator().manual_seed(check_seed(seed))  # a TypeError naming seed

    def sample(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), both (B, T) int64 on `device`; y is x shifted left by one token."""
        B, T = self.batch_size, self.block_size
        starts = torch.randint(0, self.tokens.numel() - T, (B,), generator=self.generator)  # (B,)
        offsets = torch.arange(T + 1)  # (T+1,)
        windows = self.tokens[starts.unsqueeze(1) + offsets]  # (B, 1) + (T+1,) -> (B, T+1)
        x, y = windows[:, :-1], windows[:, 1:]  # (B, T) each
        return x.to(device), y.to(device)

    def state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)


def fixed_windows(tokens: torch.Tensor, n_windows: int, block_size: int, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """The same (x, y) windows every call: a validation set that does not move between evaluations."""
    sampler = BatchSampler(tokens, n_windows, block_size, seed=seed)
    return sampler.sample()

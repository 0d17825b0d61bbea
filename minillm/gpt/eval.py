"""Perplexity: how surprised a model is by held-out text, exp(mean negative log-likelihood per token).

What it adds: `perplexity(model, tokens)` and `token_nll` (the summed NLL and the count behind it), the one
evaluation every compression chapter (quantization, pruning, distillation) reports. Each target token is scored
exactly once. Without `stride` the text is cut into back-to-back windows of `block_size` tokens, so a token at
the start of a window sees little context; with `stride < block_size` windows overlap and only the last `stride`
positions of each later window are scored, so every token sees at least block_size - stride tokens of context
(the sliding-window evaluation, a little lower and slower). What it leaves out: bits per byte, per-file resets.

    ppl = exp( -(1/N) * sum_t log p(x_t | x_<t) )      N = number of scored tokens = len(tokens) - 1
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from minillm.core.config import short_repr
from minillm.core.model import require_model
from minillm.core.stopping import check_token_ids


def _windows(n_targets: int, block_size: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, score_from, end) per window: inputs tokens[begin:end], targets j in [score_from, end) are scored.

    Target j is token j+1, predicted from inputs up to position j. The windows tile [0, n_targets) exactly once.
    """
    out = []
    end = min(block_size, n_targets)
    out.append((0, 0, end))
    while end < n_targets:
        new_end = min(end + stride, n_targets)
        begin = max(0, new_end - block_size)
        out.append((begin, end, new_end))
        end = new_end
    return out


@torch.no_grad()
def token_nll(model, tokens, block_size: int | None = None, stride: int | None = None,
              batch_size: int = 8) -> tuple[float, int]:
    """(sum of -log p over scored tokens, number of scored tokens); see `perplexity`."""
    require_model(model, "perplexity (model)")
    if isinstance(tokens, list):
        tokens = torch.tensor(tokens, dtype=torch.int64)
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"tokens must be a list of ints or a 1-D tensor, got {type(tokens).__name__}")
    if tokens.dim() != 1 or tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"tokens must be a 1-D integer tensor, got shape {tuple(tokens.shape)} dtype {tokens.dtype}")
    if tokens.numel() < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {tokens.numel()}")
    window = model.config.block_size if block_size is None else block_size
    if type(window) is not int or window <= 0 or window > model.config.block_size:
        raise ValueError(f"block_size must be an int in [1, {model.config.block_size}], got {short_repr(block_size)}")
    stride = window if stride is None else stride
    if type(stride) is not int or not 1 <= stride <= window:
        raise ValueError(f"stride must be an int in [1, block_size={window}], got {short_repr(stride)}")
    if type(batch_size) is not int or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int, got {short_repr(batch_size)}")

    was_training = model.training
    model.eval()
    device = model.device
    tokens = tokens.to(torch.int64)
    windows = _windows(tokens.numel() - 1, window, stride)
    # Batch windows of equal length together (all but the first and last usually are).
    by_len: dict[int, list[tuple[int, int, int]]] = {}
    for w in windows:
        by_len.setdefault(w[2] - w[0], []).append(w)
    total = 0.0
    count = 0
    for length, group in by_len.items():
        for i in range(0, len(group), batch_size):
            chunk = group[i : i + batch_size]
            x = torch.stack([tokens[b:e] for b, _, e in chunk]).to(device)  # (B, T)
            y = torch.stack([tokens[b + 1 : e + 1] for b, _, e in chunk]).to(device)  # (B, T)
            logits = model(x).float()  # (B, T, V); fp32 so bf16 models sum their NLL exactly enough
            nll = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(len(chunk), length)  # (B, T)
            for row, (b, s, e) in enumerate(chunk):
                total += nll[row, s - b :].double().sum().item()  # only the targets not scored before
                count += e - s
    model.train(was_training)
    assert count == tokens.numel() - 1, (count, tokens.numel())
    return total, count


def check_eval_ids(name: str, ids: object, vocab_size: int) -> torch.Tensor:
    """Evaluation ids (a list, a 1-D tensor or array) as a 1-D int64 tensor of at least 2 ids in [0, vocab_size)
    (perplexity scores every token after the first); a TypeError / ValueError naming `name` (a benchmark's `val`)
    otherwise, where perplexity would name its own `tokens`."""
    ids = check_token_ids(name, ids, vocab_size)
    if len(ids) < 2:
        raise ValueError(f"{name} must hold at least 2 token ids (perplexity scores every token after the first), "
                         f"got {len(ids)}")
    return torch.tensor(ids, dtype=torch.long)


def perplexity(model, tokens, block_size: int | None = None, stride: int | None = None, batch_size: int = 8) -> float:
    """exp(mean NLL) of `tokens` (a list of ids or a 1-D tensor) under `model`; every token after the first is scored.

    block_size: window length (default: the model's context); stride: new tokens per window (default: block_size,
    i.e. no overlap); batch_size: windows per forward pass.
    """
    total, count = token_nll(model, tokens, block_size, stride, batch_size)
    return math.exp(total / count)

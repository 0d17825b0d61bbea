"""Greedy agreement, teacher-forced: how often a model's argmax is the next token of a fixed continuation.

Adds `argmax_along(model, prompt, continuation)` (one forward over prompt + continuation: the model's argmax at
each position that predicts a continuation token), and the two measurements chapters 09-11 report with it:
`teacher_forced_agreement(reference, candidate, sequences, prompt_len)`, where two models' argmaxes agree (a
quantized or pruned model against fp32), and `greedy_agreement(model, prompts, continuations)`, how often a model
predicts a given continuation (a distilled draft against its teacher's greedy tokens). Both models read the same
tokens, so one early difference cannot cascade into later ones as it does when each generates its own. What it
leaves out: sampling (speculative sampling's acceptance is `1 - TV`, chapter 08's `draft_agreement`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn


@torch.inference_mode()
def argmax_along(model: nn.Module, prompt: Sequence[int], continuation: Sequence[int]) -> torch.Tensor:
    """(n,) int64 on the CPU: the model's argmax at the n positions predicting `continuation` (n = its length),
    from one forward of prompt + continuation without its last token."""
    if len(prompt) < 1:
        raise ValueError("argmax_along needs a prompt of at least one token: its last token predicts the first one")
    if not continuation:
        return torch.zeros(0, dtype=torch.long)
    ids = torch.tensor([list(prompt) + list(continuation[:-1])], device=model.device)  # (1, P + n - 1)
    return model(ids)[0, len(prompt) - 1:].argmax(-1).cpu()  # (n, V) -> (n,)


def teacher_forced_agreement(reference: nn.Module, candidate: nn.Module, sequences: Sequence[Sequence[int]],
                             prompt_len: int) -> tuple[int, int]:
    """(positions where the two models' argmax agree, positions) over each sequence's continuation part
    (`seq[prompt_len:]`, typically the reference's own greedy output)."""
    agree = total = 0
    for seq in sequences:
        prompt, cont = seq[:prompt_len], seq[prompt_len:]
        a, b = argmax_along(reference, prompt, cont), argmax_along(candidate, prompt, cont)  # (n,) each
        agree += int((a == b).sum())
        total += a.numel()
    return agree, total


def greedy_agreement(model: nn.Module, prompts: Sequence[Sequence[int]],
                     continuations: Sequence[Sequence[int]]) -> float:
    """Fraction of continuation tokens the model predicts as its argmax, given the prompt and the continuation's
    tokens before it (teacher forcing on, say, a teacher's own greedy path)."""
    hits = total = 0
    for prompt, cont in zip(prompts, continuations, strict=True):
        hits += int((argmax_along(model, prompt, cont) == torch.tensor(list(cont), dtype=torch.long)).sum())
        total += len(cont)
    return hits / total

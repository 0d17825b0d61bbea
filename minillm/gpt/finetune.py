"""A short fine-tune of an already-trained model: the few hundred AdamW steps later chapters use to let a changed
model recover (chapter 09's quantization-aware training, chapter 10's recovery after structured pruning).

What it adds: `short_finetune(net, steps, ...)`, which trains `net` in place on random windows of the training split
and returns the loss of every step. The loss is the next-token cross-entropy, or, given a `teacher`, the KL divergence
from the teacher's own predictions on the same windows, KL(p_teacher ‖ p_net): "behave like the model you were", not
"fit the training text better", which a model already trained on that text can only overfit. What it leaves out:
everything the full trainer (`minillm.gpt.train`) has — schedules, checkpoints, resume, evaluation.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.core.config import check_float, check_int, check_tensor_elements
from minillm.core.sampling import check_seed
from minillm.gpt.dataset import BatchSampler, split_tokens


# The most optimizer steps one fine-tune here takes: the chapters' fine-tunes run tens to a few thousand; past this a
# count is a typo (2**40 steps would train until the machine is switched off), not a fine-tune.
MAX_FINETUNE_STEPS = 100_000


def check_steps(steps: object) -> int:
    """A fine-tune's step count as the plain int it holds, in [1, MAX_FINETUNE_STEPS]; a TypeError / ValueError
    naming steps otherwise."""
    steps = check_int("steps", steps)
    if steps > MAX_FINETUNE_STEPS:
        raise ValueError(f"steps must be at most {MAX_FINETUNE_STEPS} optimizer steps, got {steps}")
    return steps


def short_finetune(net: nn.Module, steps: int, batch_size: int = 4, lr: float = 2e-5, seed: int = 0,
                   teacher: nn.Module | None = None, block_size: int | None = None) -> list[float]:
    """Train `net` in place for `steps` AdamW steps (no weight decay, constant lr); returns the loss per step.

    Windows are `batch_size` × `block_size` (default: the model's context) tokens of the training split, drawn from
    a generator seeded with `seed`. `teacher` (frozen, eval mode) switches the loss to KL from its distribution.
    `net` is left in eval mode. At least one step (0 would hand back the model untouched, as if it had been
    fine-tuned), a finite lr > 0, logits of at most MAX_TENSOR_ELEMENTS a step, and a `net` whose vocabulary holds
    every id of the training split; else a ValueError/TypeError naming the argument.
    """
    steps = check_steps(steps)
    batch_size = check_int("batch_size", batch_size)
    seed = check_seed(seed)
    lr = check_float("lr", lr, 0.0, include_minimum=False)  # inf would turn every weight into NaN at the first step
    T = check_int("block_size", block_size) if block_size is not None else net.config.block_size
    # each step's logits are (batch_size, T, V): refused before the sampler or the allocator sees the size
    check_tensor_elements("batch_size x block_size x vocab_size", (batch_size, T, net.config.vocab_size))
    tokens = split_tokens("train")
    top = int(tokens.max())
    if top >= net.config.vocab_size:
        raise ValueError(f"net has vocab_size={net.config.vocab_size}, but the training split holds token ids up to "
                         f"{top}: the fine-tune needs a model of the shipped tokenizer's vocabulary")
    sampler = BatchSampler(tokens, batch_size, T, seed=seed)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    if teacher is not None:
        teacher.eval()
    net.train()
    losses: list[float] = []
    try:
        for step in range(steps):
            x, y = sampler.sample(net.device)  # (B, T) each
            logits = net(x).flatten(0, 1)  # (B*T, V)
            if teacher is not None:
                with torch.no_grad():
                    target = F.log_softmax(teacher(x).flatten(0, 1), dim=-1)  # (B*T, V)
                loss = F.kl_div(F.log_softmax(logits, dim=-1), target, log_target=True, reduction="batchmean")
            else:
                loss = F.cross_entropy(logits, y.flatten())  # (B*T, V) vs (B*T,)
            losses.append(loss.item())
            if not math.isfinite(losses[-1]):  # before the step, which would spread NaN into every weight
                raise ValueError(f"the fine-tune diverged: loss {losses[-1]} at step {step} (lr={lr} is too large "
                                 f"for this model, or its weights were not finite); the weights were updated in "
                                 f"place up to the step before")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    finally:
        net.eval()
    return losses

"""One loader for every benchmark and tour entry: `load_model(name)` -> (model, tokenizer, trained, label).

What it adds: the shipped checkpoint when minillm has its weights; otherwise (not trained yet, or a preset that is
never shipped, such as "tiny") a model of the preset's shape with weights drawn from `seed` and trained=False,
labelled so that every printed row says so. Timings are the same either way, since compute depends only on the
shapes. A shipped checkpoint that is present but broken raises instead of falling back.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from minillm.core.config import GPTConfig
from minillm.core.model import GPT
from minillm.gpt.pretrained import SHIPPED_PRESETS, is_shipped, load_pretrained
from minillm.tokenizer import Tokenizer, load_tokenizer


class LoadedModel(NamedTuple):
    model: GPT  # eval mode, on the requested device
    tokenizer: Tokenizer  # the shipped tokenizer (also for a random-init stand-in, so prompts can be real text)
    trained: bool  # False: seeded random weights of the preset's shape
    label: str  # "base", or "base (random init: checkpoint missing)"


def load_model(name: str = "base", device: str | torch.device = "cpu", seed: int = 0,
               random_init: bool = False) -> LoadedModel:
    """The shipped checkpoint `name` (eval mode), or seeded random weights of preset `name`'s shape, labelled.

    `random_init=True` takes the random weights even when the checkpoint is there (`minillm bench --random-init`).
    """
    if is_shipped(name) and not random_init:
        model, tokenizer = load_pretrained(name, device=device)
        return LoadedModel(model.eval(), tokenizer, True, name)
    torch.manual_seed(seed)
    model = GPT(GPTConfig.from_name(SHIPPED_PRESETS.get(name, name))).to(device).eval()  # "draft-distilled": draft
    why = "asked for" if random_init and is_shipped(name) else "checkpoint missing"
    return LoadedModel(model, load_tokenizer(), False, f"{name} (random init: {why})")

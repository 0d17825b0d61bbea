"""The two checkpoints minillm ships, with the tokenizer they were trained with: `minillm.load("base")`.

What it adds: `load_pretrained(name)` -> (GPT, Tokenizer) for "base" (5.85M parameters, the target model of every
later chapter) and "draft" (0.95M, chapter 08's draft), both trained in this chapter on the default corpus and
stored as safetensors inside the package; and chapter 11's two students of `draft`'s shape, "draft-distilled"
(`draft` trained on with knowledge distillation from `base`, the better draft for chapter 08) and "draft-hardlabel"
(its control: the same steps and batches on the hard labels only), made by `python -m minillm.distill.train`. What
it leaves out: training them (`minillm.gpt.train`, `minillm.distill.train`) and the benchmarks' stand-in for a
checkpoint that is missing (`minillm.bench.models.load_model`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from minillm.core.checkpoint import WEIGHTS_NAME, load_checkpoint
from minillm.core.model import GPT
from minillm.tokenizer import Tokenizer, load_tokenizer

CHECKPOINTS_DIR = Path(__file__).resolve().parent.parent / "assets" / "checkpoints"
SHIPPED = ("base", "draft", "draft-distilled", "draft-hardlabel")
# The GPTConfig preset each shipped checkpoint has the shape of (chapter 11's students are `draft`-shaped).
SHIPPED_PRESETS = {"base": "base", "draft": "draft", "draft-distilled": "draft", "draft-hardlabel": "draft"}


def pretrained_dir(name: str) -> Path:
    """The package directory of shipped checkpoint `name`; an unknown name is a ValueError listing the known ones."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a shipped checkpoint's name (a str), one of {list(SHIPPED)}, got "
                        f"{type(name).__name__}")
    name = str.__str__(name)  # the plain str: a str subclass's == is not consulted
    if name not in SHIPPED:
        raise ValueError(f"unknown shipped checkpoint {name!r}; choose one of {list(SHIPPED)}")
    return CHECKPOINTS_DIR / name


def is_shipped(name: str) -> bool:
    """True when `name` is a shipped checkpoint whose weights are present."""
    return name in SHIPPED and (CHECKPOINTS_DIR / name / WEIGHTS_NAME).is_file()


def load_pretrained(name: str = "base", device: str | torch.device = "cpu",
                    **config_overrides: Any) -> tuple[GPT, Tokenizer]:
    """(GPT in eval mode, Tokenizer): a checkpoint minillm ships ("base", the target of every later chapter, "draft",
    or chapter 11's "draft-distilled" and "draft-hardlabel")."""
    directory = pretrained_dir(name)
    if not (directory / WEIGHTS_NAME).is_file():
        how = ("the `python -m minillm.distill.train` command in chapters/11-distillation.md"
               if SHIPPED_PRESETS[name] != name else
               f"`minillm train --preset {name} --export {directory}` (see chapters/02-gpt.md)")
        raise FileNotFoundError(f"shipped checkpoint {name!r} not found in {str(directory)!r}; train it with {how}")
    model = load_checkpoint(directory, device=device, **config_overrides)
    tokenizer = load_tokenizer()
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"the shipped tokenizer has {tokenizer.vocab_size} tokens but checkpoint {name!r} only "
                         f"{model.config.vocab_size}: they do not belong together")
    return model, tokenizer

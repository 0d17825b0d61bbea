"""minillm: LLM inference optimization, taught by building it.

A from-scratch GPT-2-architecture model, extended chapter by chapter; every technique is checked against its
naive twin and measured against it. Start with `minillm tour`, or read `chapters/` in order; `minillm.chapters`
maps each chapter to its package.

The public surface:

    model, tokenizer = minillm.load("base")      a shipped checkpoint and its tokenizer (chapter 02)
    tokenizer = minillm.load_tokenizer()         the shipped BPE tokenizer (chapter 01)
    minillm.GPT, minillm.GPTConfig               the model (chapter 02), GPT.from_hf for Hugging Face weights
    minillm.SamplingParams                       how to sample and when to stop (chapter 03)
    minillm.LLM, minillm.EngineConfig            the continuous-batching engine (chapter 06)
    minillm.DisaggregatedLLM                     prefill and decode in two processes (chapter 07)

The engine classes are imported on first use, so `import minillm` (and every `import minillm.<chapter>`, which runs
this file first) stays as light as the core.
"""

from __future__ import annotations

import importlib
from typing import Any

from minillm.core.config import GPTConfig
from minillm.core.device import resolve_device
from minillm.core.model import GPT
from minillm.core.sampling import SamplingParams

__version__ = "0.1.0"

__all__ = ["GPT", "GPTConfig", "SamplingParams", "LLM", "EngineConfig", "DisaggregatedLLM", "resolve_device",
           "load_tokenizer", "load", "__version__"]

# name -> module that defines it, imported when first asked for (PEP 562 module __getattr__).
_LAZY = {"LLM": "minillm.engine", "EngineConfig": "minillm.engine", "DisaggregatedLLM": "minillm.disagg"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'minillm' has no attribute {name!r}")


def load_tokenizer():
    """The tokenizer minillm ships (4,096 byte-level BPE tokens trained on the default corpus; chapter 01)."""
    return importlib.import_module("minillm.tokenizer").load_tokenizer()


def load(name: str = "base", device="cpu"):
    """A shipped checkpoint and its tokenizer: `model, tokenizer = minillm.load("base")` (chapter 02)."""
    return importlib.import_module("minillm.gpt.pretrained").load_pretrained(name, device=device)

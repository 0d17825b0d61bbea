"""minillm: LLM inference optimization, taught by building it.

A from-scratch GPT-2-architecture model, extended chapter by chapter; every technique is checked against its
naive twin and measured against it. Start with `minillm tour`, or read `chapters/` in order.
"""

from minillm.core.config import GPTConfig
from minillm.core.device import resolve_device
from minillm.core.model import GPT

__version__ = "0.1.0"

__all__ = ["GPT", "GPTConfig", "resolve_device", "load_tokenizer", "load", "__version__"]


def load_tokenizer():
    """The tokenizer minillm ships (4,096 byte-level BPE tokens trained on the default corpus; chapter 01)."""
    from minillm.tokenizer import load_tokenizer as _load

    return _load()


def load(name: str = "base", device="cpu"):
    """A shipped checkpoint and its tokenizer: `model, tokenizer = minillm.load("base")` (chapter 02)."""
    from minillm.gpt.pretrained import load_pretrained

    return load_pretrained(name, device=device)

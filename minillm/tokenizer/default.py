"""The shipped tokenizer: 4,096 tokens trained on the default corpus, stored in the package, used by every chapter.

What it adds: `build_default_tokenizer` (the exact recipe that produced `minillm/assets/tokenizer.json`) and
`load_tokenizer` (load the shipped file, cached). What it leaves out: retraining at import time; the file is
committed so every machine uses the same ids whatever its Python version (the corpus hash differs across versions,
so retraining on another Python can give a slightly different tokenizer; the file records the hash it came from).

Recipe: incremental trainer, GPT-4 split pattern, vocab_size 4,096 = 256 bytes + 3,839 merges + "<|endoftext|>"
(id 4095), trained on the whole train split of the default corpus (3.8 MB on Python 3.11). Why the GPT-4
pattern: on Python source it keeps newline+indentation runs together ("\\n        ") and lets one punctuation
character join the following word (".append", "_name", "self" after "("), and caps digit runs at 3 -- measured on
the validation split, see `chapters/01-tokenization.md`.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from minillm.core.corpus import load_corpus, take_bytes
from minillm.tokenizer.bpe import Tokenizer
from minillm.tokenizer.train import train_bpe

DEFAULT_TOKENIZER_PATH = Path(__file__).resolve().parent.parent / "assets" / "tokenizer.json"
DEFAULT_VOCAB_SIZE = 4096
DEFAULT_PATTERN = "gpt4"
DEFAULT_TRAIN_BYTES: int | None = None  # None = the whole train split
SPECIAL_TOKENS = ("<|endoftext|>",)


def build_default_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE, corpus_path: str | os.PathLike | None = None,
                            pattern: str = DEFAULT_PATTERN, train_bytes: int | None = DEFAULT_TRAIN_BYTES) -> Tokenizer:
    """Train the shipped tokenizer from scratch (a few seconds on one CPU core for the defaults).

    `train_bytes` caps the training text (a prefix of the train split, None = all of it).
    """
    import hashlib

    corpus = load_corpus(corpus_path)
    text = corpus.train_text if train_bytes is None else take_bytes(corpus.train_text, train_bytes)
    result = train_bpe(text, vocab_size, pattern, SPECIAL_TOKENS)
    name = f"minillm-{vocab_size}" if corpus_path is None else f"minillm-{vocab_size}-custom"
    tok = result.to_tokenizer(name)
    tok.metadata = {
        "trainer": "minillm.tokenizer.train.train_bpe",
        "pattern_name": pattern if pattern in ("gpt2", "gpt4") else "custom",
        "vocab_size": vocab_size,
        "corpus_source": corpus.source,
        "corpus_sha256": corpus.sha256,
        "train_text_bytes": len(text.encode("utf-8")),
        "train_text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "num_chunks": result.num_chunks,
        "num_unique_chunks": result.num_unique_chunks,
    }
    return tok


@functools.lru_cache(maxsize=4)
def _load_cached(path: str) -> Tokenizer:
    return Tokenizer.load(path)


def load_tokenizer(path: str | os.PathLike | None = None) -> Tokenizer:
    """The shipped tokenizer (path=None) or a tokenizer `.json` file. Cached per path: treat it as read-only."""
    return _load_cached(str(DEFAULT_TOKENIZER_PATH if path is None else Path(path).resolve()))

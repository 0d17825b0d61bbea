"""Chapter 01's benchmark: encode throughput on ordinary text and on an adversarial input, fast vs simple encoder.

What it adds: `adversarial_text` (one long run of letters: the split pattern keeps it as a single chunk, so the
per-chunk merge loop sees all of it at once) and `encode_throughput`, which times `Tokenizer.encode_ordinary`
(heap-based `encode_chunk_fast`) on both inputs and checks its ids against the simple `encode_chunk` twin
(`Tokenizer.encode_ordinary_ref`). What it leaves out: the comparison with tiktoken (the tour's encode row).

Why an adversarial input: ordinary text is cut into short chunks (words, numbers, runs of spaces), so any
per-chunk algorithm looks fast. A 16k-letter run is one chunk of 16k bytes: the simple encoder rescans every
pair after every merge, O(n^2), and takes seconds; the heap takes milliseconds. The simple encoder is timed on
a shorter run (`reference_chars`), so the benchmark itself stays quick.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from minillm.core.config import short_repr
from minillm.core.corpus import load_corpus, take_bytes
from minillm.tokenizer.bpe import Tokenizer


def adversarial_text(num_chars: int, unit: str = "the") -> str:
    """`unit` repeated to `num_chars` characters with no space: one pre-token chunk under the GPT-2/4 patterns."""
    if not isinstance(num_chars, int) or isinstance(num_chars, bool) or num_chars <= 0:
        raise ValueError(f"num_chars must be a positive int, got {short_repr(num_chars)}")
    return (unit * (num_chars // len(unit) + 1))[:num_chars]


def _seconds(fn: Callable[[], Any], repeats: int) -> float:
    """Best of `repeats` wall-clock runs (the least disturbed by other processes)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@dataclass
class EncodeThroughput:
    ordinary_MBps: float  # encode_ordinary on ordinary text (the validation split), cold cache
    adversarial_MBps: float  # encode_ordinary on one long run of `adversarial_chars` characters, cold cache
    adversarial_chars: int
    reference_MBps: float  # the simple encoder (encode_ordinary_ref) on a run of `reference_chars` characters
    reference_chars: int
    identical_ids: bool  # fast == simple on the reference run and on the ordinary text

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def encode_throughput(tokenizer: Tokenizer, ordinary_bytes: int = 100_000, adversarial_chars: int = 16_000,
                      reference_chars: int = 2_000, repeats: int = 3) -> EncodeThroughput:
    """Encode MB/s of `tokenizer` on ordinary text and on an adversarial run, and whether its ids equal the twin's.

    Each timed call uses a fresh Tokenizer (same ranks), so the chunk cache starts empty and the merge loop runs.
    """
    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"encode_throughput needs a minillm Tokenizer, got {type(tokenizer).__name__}")
    ranks, pattern = tokenizer.mergeable_ranks, tokenizer.pattern
    fresh = lambda: Tokenizer(ranks, pattern)  # noqa: E731  (no cache carried between timed calls)
    ordinary = take_bytes(load_corpus().val_text, ordinary_bytes)
    adversarial = adversarial_text(adversarial_chars)
    short = adversarial_text(reference_chars)

    def mbps(text: str, seconds: float) -> float:
        return len(text.encode("utf-8")) / 1e6 / max(seconds, 1e-9)

    identical = (fresh().encode_ordinary(short) == tokenizer.encode_ordinary_ref(short)
                 and fresh().encode_ordinary(ordinary) == tokenizer.encode_ordinary_ref(ordinary))
    return EncodeThroughput(
        ordinary_MBps=mbps(ordinary, _seconds(lambda: fresh().encode_ordinary(ordinary), repeats)),
        adversarial_MBps=mbps(adversarial, _seconds(lambda: fresh().encode_ordinary(adversarial), repeats)),
        adversarial_chars=adversarial_chars,
        reference_MBps=mbps(short, _seconds(lambda: tokenizer.encode_ordinary_ref(short), 1)),
        reference_chars=reference_chars,
        identical_ids=identical,
    )

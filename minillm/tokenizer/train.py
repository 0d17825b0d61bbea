"""Training byte-level BPE: the naive recount-everything trainer and the incremental trainer it is checked against.

What it adds: `train_bpe_naive` (after each merge, recount every pair of every chunk occurrence: the loop of
Sennrich et al. 2016, Algorithm 1, without even its word-frequency dictionary) and `train_bpe` (count each
distinct chunk once, weighted by its frequency, as Sennrich et al. 2016, Sec. 3.2, suggest: "The algorithm can thus
be run on the dictionary extracted from a text, with each word being weighted by its frequency"; then after a merge
update only the pair counts of the chunks that contained the merged pair, found through an index pair -> chunks,
with a heap for the most frequent pair). Both return the same merges, tie-break included. What it leaves out: encoding
(`encode.py`, `bpe.py`), and anything beyond a single process (no parallel counting).

The rules both trainers share, so that their results are identical (tested on small inputs):
  * text is first cut at special tokens (they never take part in merges), then split by the pattern;
    pairs never cross a chunk boundary (Radford et al. 2019, Sec. 2.2);
  * ids 0..255 are the single bytes; merge k gets id 256 + k (unless its bytes already exist, see below);
  * a pair's count is the number of adjacent positions holding it, overlaps included ([7, 7, 7] -> 2);
  * the merged pair is the one with the highest count; ties go to the smallest (left id, right id) tuple;
  * subtle: two different pairs can spell the same bytes ("ab"+"c" and "a"+"bc"). A byte string is a token only
    once (tiktoken's rank table maps bytes -> rank), so the second such merge reuses the existing id and adds no
    new token; training continues until the vocabulary has `vocab_size` entries.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Callable

from minillm.tokenizer.basics import get_pair_counts, merge
from minillm.tokenizer.bpe import Tokenizer
from minillm.tokenizer.patterns import compile_pattern, resolve_pattern
from minillm.tokenizer.special import special_split_regex


@dataclass(frozen=True)
class Merge:
    left: int  # id of the left token of the pair
    right: int  # id of the right token
    new_id: int  # id the pair is replaced by (a new token, or an existing one with the same bytes)
    count: int  # how often the pair occurred when it was chosen (weighted by chunk frequency)


@dataclass
class TrainResult:
    vocab: list[bytes]  # token bytes, indexed by id == tiktoken rank
    merges: list[Merge]  # in the order they were learned
    pattern: str  # the split pattern used
    special_tokens: dict[str, int]  # special token text -> id (after all mergeable tokens)
    num_chunks: int = 0  # pre-token chunks in the training text
    num_unique_chunks: int = 0  # distinct chunks (what the incremental trainer works on)
    stats: dict[str, float] = field(default_factory=dict)

    def to_tokenizer(self, name: str = "minillm-bpe") -> Tokenizer:
        ranks = {token: rank for rank, token in enumerate(self.vocab)}
        return Tokenizer(ranks, self.pattern, self.special_tokens, name=name)


def _check_args(text: str, vocab_size: int, special_tokens: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    if not isinstance(text, str):
        raise TypeError(f"training text must be a str, got {type(text).__name__}")
    if isinstance(special_tokens, str) or not all(isinstance(s, str) and s for s in special_tokens):
        raise TypeError(f"special_tokens must be a sequence of non-empty str, got {special_tokens!r}")
    specials = tuple(dict.fromkeys(special_tokens))  # de-duplicated, order kept
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
        raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
    if vocab_size < 256 + len(specials):
        raise ValueError(
            f"vocab_size={vocab_size} is smaller than 256 byte tokens + {len(specials)} special tokens "
            f"= {256 + len(specials)}"
        )
    return specials


def _chunks(text: str, pattern: str, specials: tuple[str, ...]) -> list[str]:
    """All pre-token chunks of `text`, special tokens cut out first."""
    split = compile_pattern(pattern).findall
    if not specials:
        return split(text)
    out: list[str] = []
    for segment in special_split_regex(specials).split(text):
        out.extend(split(segment))
    return out


def _result(vocab, merges, pattern, specials, num_chunks, num_unique) -> TrainResult:
    special_ids = {s: len(vocab) + i for i, s in enumerate(specials)}
    return TrainResult(vocab, merges, pattern, special_ids, num_chunks, num_unique)


def _no_pairs_left(done: int, wanted: int) -> ValueError:
    return ValueError(
        f"the training text is too small for this vocab_size: no pair left to merge after {done} of {wanted} "
        f"merges; use more text or a smaller vocab_size"
    )


def train_bpe_naive(text: str, vocab_size: int, pattern: str = "gpt4",
                    special_tokens: tuple[str, ...] | list[str] = ("<|endoftext|>",)) -> TrainResult:
    """The baseline: after every merge, recount every pair of every chunk. O(merges x text length)."""
    specials = _check_args(text, vocab_size, special_tokens)
    pattern = resolve_pattern(pattern)
    chunk_texts = _chunks(text, pattern, specials)
    chunks = [list(c.encode("utf-8")) for c in chunk_texts]
    vocab = [bytes([i]) for i in range(256)]
    index = {t: i for i, t in enumerate(vocab)}
    merges: list[Merge] = []
    wanted = vocab_size - len(specials) - 256
    while len(vocab) < vocab_size - len(specials):
        counts: dict[tuple[int, int], int] = {}
        for ids in chunks:
            get_pair_counts(ids, counts)
        if not counts:
            raise _no_pairs_left(len(vocab) - 256, wanted)
        pair = min(counts, key=lambda p: (-counts[p], p))  # highest count, then smallest pair
        new_id = _new_token(vocab, index, pair)
        merges.append(Merge(pair[0], pair[1], new_id, counts[pair]))
        chunks = [merge(ids, pair, new_id) for ids in chunks]
    return _result(vocab, merges, pattern, specials, len(chunk_texts), len(set(chunk_texts)))


def _new_token(vocab: list[bytes], index: dict[bytes, int], pair: tuple[int, int]) -> int:
    token = vocab[pair[0]] + vocab[pair[1]]
    existing = index.get(token)
    if existing is not None:  # subtle: same bytes from a different pair; reuse the id (see module docstring)
        return existing
    index[token] = len(vocab)
    vocab.append(token)
    return len(vocab) - 1


def train_bpe(text: str, vocab_size: int, pattern: str = "gpt4",
              special_tokens: tuple[str, ...] | list[str] = ("<|endoftext|>",),
              on_merge: Callable[[Merge, bytes], None] | None = None) -> TrainResult:
    """Incremental BPE training: same merges as `train_bpe_naive`, touching only the chunks a merge changes.

    `on_merge(merge, token_bytes)` is called after each merge (for watching training; None = silent).
    """
    specials = _check_args(text, vocab_size, special_tokens)
    pattern = resolve_pattern(pattern)
    chunk_texts = _chunks(text, pattern, specials)
    freq = Counter(chunk_texts)  # each distinct chunk is processed once, weighted by how often it occurs
    words = [list(c.encode("utf-8")) for c in freq]
    weights = list(freq.values())

    # pair -> weighted count, and pair -> indices of the words that (may) contain it.
    # Invariant: pair_counts holds the exact count of every pair with a positive count; `where[p]` is a superset
    # of the words containing p (entries go stale when a merge removes p from a word and are skipped then).
    pair_counts: dict[tuple[int, int], int] = {}
    where: defaultdict[tuple[int, int], set[int]] = defaultdict(set)
    for wi, (w, f) in enumerate(zip(words, weights)):
        for p in zip(w, w[1:]):
            pair_counts[p] = pair_counts.get(p, 0) + f
            where[p].add(wi)
    # Max-heap by count via negation; ties pop the smallest pair tuple, the naive trainer's tie-break. Entries go
    # stale when a count changes (the new count is pushed again); a popped entry is valid only if it matches.
    heap = [(-c, p) for p, c in pair_counts.items()]
    heapq.heapify(heap)

    vocab = [bytes([i]) for i in range(256)]
    index = {t: i for i, t in enumerate(vocab)}
    merges: list[Merge] = []
    wanted = vocab_size - len(specials) - 256
    while len(vocab) < vocab_size - len(specials):
        while True:
            if not heap:
                raise _no_pairs_left(len(vocab) - 256, wanted)
            neg, pair = heapq.heappop(heap)
            if pair_counts.get(pair) == -neg:
                break
        new_id = _new_token(vocab, index, pair)
        merges.append(Merge(pair[0], pair[1], new_id, -neg))
        delta: defaultdict[tuple[int, int], int] = defaultdict(int)
        for wi in where.pop(pair):
            w = words[wi]
            new_w = merge(w, pair, new_id)
            if len(new_w) == len(w):  # stale index entry: this word no longer holds the pair
                continue
            f = weights[wi]
            # Remove the word's old pairs and add its new ones; pairs away from the merge cancel out in `delta`.
            for p in zip(w, w[1:]):
                delta[p] -= f
            for p in zip(new_w, new_w[1:]):
                delta[p] += f
                if new_id in p:
                    where[p].add(wi)
            words[wi] = new_w
        for p, d in delta.items():
            if d:
                c = pair_counts.get(p, 0) + d
                assert c >= 0, f"negative count for pair {p}"
                if c:
                    pair_counts[p] = c
                    heapq.heappush(heap, (-c, p))
                else:
                    del pair_counts[p]
        if on_merge is not None:
            on_merge(merges[-1], vocab[new_id])
    return _result(vocab, merges, pattern, specials, len(chunk_texts), len(words))

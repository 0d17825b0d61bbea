"""Encoding one pre-token chunk with learned ranks: tiktoken's byte-pair-merge rule.

What it adds: `encode_chunk`, the inner loop of encoding (a chapter-01 exercise). What it leaves out: splitting
text into chunks, special tokens and caching (`bpe.py`).

The rule (the one tiktoken implements, so our ids equal its ids on the same ranks): start from single bytes;
repeatedly find the adjacent pair whose concatenated bytes have the lowest rank in the table, the leftmost one if
several tie, and join it; stop when no adjacent concatenation is in the table. Ranks are the merge order, so
"lowest rank first" replays training's merges in the order they were learned.

subtle: the rule looks up the *bytes* of a pair, not the pair of ids. When two different splits spell the same
bytes ("ab"+"c" and "a"+"bc"), this rule joins either one, where a merges-list encoder would only join the pair
that was learned. tiktoken-compatible ranks files hold no merges list, so bytes are all we can use.

Worked example with ranks {a:0, b:1, c:2, ab:3, bc:4, abc:5}: "abc" -> [a, b, c]; candidate pairs "ab" (3) and
"bc" (4); join "ab" -> [ab, c]; candidate "abc" (5); join -> [abc] -> ids [5].
"""

from __future__ import annotations


def encode_chunk(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    """Token ids of one chunk (a byte string) under `ranks` (bytes -> rank); every single byte must have a rank."""
    # BEGIN SOLUTION
    parts = [piece[i : i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        best_rank, best_i = None, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best_rank is None or rank < best_rank):  # strict <: leftmost wins ties
                best_rank, best_i = rank, i
        if best_rank is None:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return [ranks[p] for p in parts]
    # END SOLUTION

"""Encoding one pre-token chunk with learned ranks: tiktoken's byte-pair-merge rule, simple and fast.

What it adds: `encode_chunk`, the inner loop of encoding (a chapter-01 exercise, and the reference twin), and
`encode_chunk_fast`, the same ids in O(n log n) per chunk instead of O(n^2), which `Tokenizer.encode` uses.
What it leaves out: splitting text into chunks, special tokens and caching (`bpe.py`).

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

import heapq

from minillm.core.config import short_repr


def _check_chunk(piece: object, ranks: object) -> None:
    """A TypeError naming `piece` unless it is bytes (one chunk, UTF-8 encoded), or `ranks` unless it is a dict
    (bytes -> rank). Two isinstance tests: the encoders below run once per chunk of text."""
    if not isinstance(piece, bytes):
        raise TypeError(f"piece must be bytes (a chunk, UTF-8 encoded), got {type(piece).__name__} {short_repr(piece)}")
    if not isinstance(ranks, dict):
        raise TypeError(f"ranks must be a dict of bytes -> rank, got {type(ranks).__name__} {short_repr(ranks)}")
    if not ranks:
        raise ValueError("ranks is empty: every single byte must have a rank")


def encode_chunk(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    """Token ids of one chunk (a byte string) under `ranks` (bytes -> rank); every single byte must have a rank."""
    _check_chunk(piece, ranks)
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


def encode_chunk_fast(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    """`encode_chunk`'s ids in O(n log n) for a chunk of n bytes: a heap of pair ranks over a linked list of parts.

    Why: `encode_chunk` rescans every pair after each merge, so one long chunk (a 16k-letter run with no space,
    which the split pattern keeps whole) costs O(n^2). Here each part is named by the byte offset where it starts
    (a merge keeps the left part's start), `end[s]` is where part s ends, so its right neighbour starts at
    `end[s]` and its left neighbour at `prev[s]`. The heap holds (rank, start, mid, stop) for adjacent pairs; it
    pops the lowest rank, the smallest start on ties -- exactly `encode_chunk`'s "lowest rank, leftmost" rule.

    subtle: entries go stale when a neighbour merges; an entry is live only while the part at `start` still ends
    at `mid` and the part at `mid` still ends at `stop` (parts tile the chunk, so this pins both parts). Stale
    entries are skipped when popped. Each merge pushes at most two new pairs, so the heap sees O(n) entries.
    """
    _check_chunk(piece, ranks)
    n = len(piece)
    if n <= 1:
        return [ranks[piece]] if n else []
    end = list(range(1, n + 1))  # end[s]: where the part starting at s ends (only read for live starts)
    prev = list(range(-1, n - 1))  # prev[s]: start of the part left of s (-1 for the first part)
    heap: list[tuple[int, int, int, int]] = []
    for i in range(n - 1):
        rank = ranks.get(piece[i : i + 2])
        if rank is not None:
            heap.append((rank, i, i + 1, i + 2))
    heapq.heapify(heap)
    while heap:
        _, start, mid, stop = heapq.heappop(heap)
        if end[start] != mid or end[mid] != stop:
            continue  # stale: one of the two parts has merged since this pair was pushed
        end[start] = stop  # join [start, mid) and [mid, stop) into [start, stop); mid is no longer a start
        end[mid] = -1  # subtle: mark mid dead so an old entry (x, mid, ...) can never look live again
        if stop < n:
            prev[stop] = start
            rank = ranks.get(piece[start : end[stop]])
            if rank is not None:
                heapq.heappush(heap, (rank, start, stop, end[stop]))
        left = prev[start]
        if left >= 0:
            rank = ranks.get(piece[left:stop])
            if rank is not None:
                heapq.heappush(heap, (rank, left, start, stop))
    out = []
    s = 0
    while s < n:
        out.append(ranks[piece[s : end[s]]])
        s = end[s]
    return out

"""Chapter 01's probes: pair counts, merges and one chunk's encoding on inputs drawn from the seed."""

from __future__ import annotations

from . import Probe, rng
from minillm.tokenizer import basics, encode


def _ids(r, n: int) -> list[int]:
    """n ids from a small alphabet, with runs (overlapping pairs such as 7 7 7) on purpose."""
    out: list[int] = []
    while len(out) < n:
        out += [r.randrange(5)] * r.choice((1, 1, 2, 3))
    return out[:n]


def pair_counts(seed: int) -> list:
    r = rng(seed)
    outs = []
    for _ in range(6):
        counts = basics.get_pair_counts(_ids(r, r.randrange(0, 30)))
        weighted = basics.get_pair_counts(_ids(r, r.randrange(2, 30)), dict(counts), weight=r.randrange(2, 9))
        outs.append([sorted([*k, v] for k, v in counts.items()), sorted([*k, v] for k, v in weighted.items())])
    return outs


def merges(seed: int) -> list:
    """Overlapping runs first (the left-to-right rule decides them: [7, 7, 7] -> [new, 7]), then random ids with
    runs, half of them merging a pair (a, a)."""
    r = rng(seed)
    cases = [basics.merge([7, 7, 7], (7, 7), 9), basics.merge([1, 1, 1, 1, 1, 2], (1, 1), 9),
             basics.merge([3, 4, 4, 4, 5, 4, 4, 4], (4, 4), 8)]
    for _ in range(12):
        ids = _ids(r, r.randrange(0, 40))
        a = r.randrange(5)
        pair = (a, a) if r.random() < 0.5 else (a, r.randrange(5))
        cases.append(basics.merge(ids, pair, 100 + r.randrange(50)))
    return cases


def _ranks(r) -> dict[bytes, int]:
    """Every single byte, then merged tokens of 2-4 letters of a small alphabet at random ranks."""
    ranks = {bytes([b]): b for b in range(256)}
    letters = b"abcde"
    while len(ranks) < 256 + 40:
        tok = bytes(r.choice(letters) for _ in range(r.randrange(2, 5)))
        ranks.setdefault(tok, 256 + r.randrange(10_000))
    return ranks


def chunks(seed: int) -> list:
    """A chunk whose lowest-ranked pair is not its first (the rank, not the position, picks each merge), then
    random chunks under random ranks."""
    fixed = {**{bytes([b]): b for b in range(256)}, b"bc": 256, b"ab": 257}  # "abc": bc first, so [a, bc]
    r = rng(seed)
    ranks = _ranks(r)
    pieces = [bytes(r.choice(b"abcde") for _ in range(r.randrange(1, 24))) for _ in range(12)]
    return [encode.encode_chunk(b"abc", fixed), *(encode.encode_chunk(p, ranks) for p in pieces)]


PROBES = {
    "get_pair_counts": Probe(pair_counts),
    "merge": Probe(merges),
    "encode_chunk": Probe(chunks),
}

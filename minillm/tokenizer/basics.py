"""The two primitive operations of byte-pair encoding: count adjacent pairs, and replace one pair by a new id.

What it adds: `get_pair_counts` and `merge`, the building blocks of both trainers (Sennrich et al. 2016, Sec. 3.2:
"iteratively count all symbol pairs and replace each occurrence of the most frequent pair ('A', 'B') with a new
symbol 'AB'"). What it leaves out: choosing which pair to merge (`train.py`) and encoding with learned ranks
(`encode.py`). Both functions are chapter-01 exercises.
"""

from __future__ import annotations

from collections.abc import Sequence

from minillm.core.config import check_int, short_repr


def get_pair_counts(ids: Sequence[int], counts: dict[tuple[int, int], int] | None = None, weight: int = 1
                    ) -> dict[tuple[int, int], int]:
    """Count every adjacent pair of `ids`, adding `weight` per occurrence into `counts` (a new dict if None).

    Overlapping pairs all count: [7, 7, 7] holds the pair (7, 7) twice. Worked example:
    get_pair_counts([1, 2, 3, 1, 2]) == {(1, 2): 2, (2, 3): 1, (3, 1): 1}.
    """
    _check_ids(ids)  # type tests only: the trainers call both functions once per chunk per merge
    if counts is not None and not isinstance(counts, dict):
        raise TypeError(f"counts must be a dict of pair counts or None, got {type(counts).__name__}")
    if type(weight) is not int or weight < 1:
        check_int("weight", weight)
    # BEGIN SOLUTION
    if counts is None:
        counts = {}
    for pair in zip(ids, ids[1:]):
        counts[pair] = counts.get(pair, 0) + weight
    return counts
    # END SOLUTION


def merge(ids: Sequence[int], pair: tuple[int, int], new_id: int) -> list[int]:
    """Replace every occurrence of `pair` in `ids` by `new_id`, scanning left to right.

    subtle: occurrences may overlap ([7, 7, 7] with pair (7, 7)); the left-to-right scan takes the leftmost and
    skips past it, giving [new_id, 7]. Both trainers and the tests rely on exactly this rule.
    Worked example: merge([1, 2, 3, 1, 2], (1, 2), 9) == [9, 3, 9].
    """
    _check_ids(ids)
    if not isinstance(pair, tuple) or len(pair) != 2:
        raise TypeError(f"pair must be a tuple of two token ids, got {type(pair).__name__} {short_repr(pair)}")
    if type(new_id) is not int or new_id < 0:
        check_int("new_id", new_id, 0)
    # BEGIN SOLUTION
    a, b = pair
    out: list[int] = []
    i, n = 0, len(ids)
    while i < n:
        if i + 1 < n and ids[i] == a and ids[i + 1] == b:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out
    # END SOLUTION


def _check_ids(ids: object) -> None:
    if not isinstance(ids, (list, tuple)):  # a tensor or a dict would be scanned item by item, wrongly
        raise TypeError(f"ids must be a list of token ids, got {type(ids).__name__}")

"""One same-tokens check for every benchmark: a candidate's token ids against the baseline's, id by id, exactly.

Adds `same_tokens(reference, *candidates)`: the ids (prompt index, request id, ...) whose tokens every candidate
reproduces, the first one that differs, and the `check` text tour rows print ("identical tokens, 16/16 prompts").
Tokens are discrete, so the comparison is exact; floats (logits) are compared elsewhere with a tolerance.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

TokenMap = Mapping[Hashable, Sequence[int]] | Sequence[Sequence[int]]  # id -> tokens, or tokens by position


@dataclass(frozen=True)
class SameTokens:
    equal: int  # reference ids whose tokens every candidate matched
    total: int  # reference ids
    first_mismatch: Hashable | None  # the first reference id (in the reference's order) that differed, or None
    unit: str = "prompts"  # what an id is, for the check text: "prompts", "requests", "rows", "samples"

    @property
    def ok(self) -> bool:
        return self.equal == self.total

    @property
    def check(self) -> str:
        return f"identical tokens, {self.equal}/{self.total} {self.unit}"


def _as_map(tokens: TokenMap) -> Mapping[Hashable, Sequence[int]]:
    return tokens if isinstance(tokens, Mapping) else dict(enumerate(tokens))


def same_tokens(reference: TokenMap, *candidates: TokenMap, unit: str = "prompts") -> SameTokens:
    """Count the reference ids whose tokens equal those of every candidate; an id a candidate lacks (or holds None
    for) is a mismatch, and so is a reference id holding None (the baseline lost that request)."""
    if not candidates:
        raise ValueError("same_tokens needs at least one candidate to compare with the reference")
    ref = _as_map(reference)
    cands = [_as_map(c) for c in candidates]
    equal, first = 0, None
    for key, want in ref.items():
        if want is not None and all(c.get(key) is not None and list(c[key]) == list(want) for c in cands):
            equal += 1
        elif first is None:
            first = key
    return SameTokens(equal, len(ref), first, unit)

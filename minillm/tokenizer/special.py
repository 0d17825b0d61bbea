"""Special tokens: cutting text at them, and tiktoken's allowed_special / disallowed_special rules.

What it adds: the regex that finds special-token text and the check that raises on special-token text that is
not allowed. What it leaves out: the ids themselves (the Tokenizer holds them).

tiktoken's semantics, which `Tokenizer.encode` follows: special tokens are recognised in the input only if they
are in `allowed_special` ("all" = every one). Any text equal to a special token that is in `disallowed_special`
("all" = every special not allowed) raises, because silently encoding "<|endoftext|>" as plain text in user input
is how prompt-injection bugs happen; pass disallowed_special=() to encode such text as ordinary characters.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable
from collections.abc import Set as AbstractSet
from typing import Literal

import regex

from minillm.core.config import short_repr

AllOrSet = Literal["all"] | Collection[str]


@functools.lru_cache(maxsize=64)
def special_split_regex(specials: tuple[str, ...]) -> regex.Pattern:
    """A regex matching any of `specials` (longest first, so a special that prefixes another never wins)."""
    ordered = sorted(specials, key=len, reverse=True)
    return regex.compile("|".join(regex.escape(s) for s in ordered))


def resolve_special_sets(
    specials: Iterable[str], allowed_special: AllOrSet, disallowed_special: AllOrSet
) -> tuple[frozenset[str], frozenset[str]]:
    """Turn tiktoken-style arguments into (allowed, disallowed) sets, validating them."""
    specials = _names("specials", specials)
    if allowed_special == "all":
        allowed = specials
    elif isinstance(allowed_special, str):
        raise ValueError(f"allowed_special must be 'all' or a collection of str, got {allowed_special!r}")
    else:
        allowed = _names("allowed_special", allowed_special)
        unknown = allowed - specials
        if unknown:
            raise ValueError(f"allowed_special names tokens that are not special tokens: {sorted(unknown)!r}")
    if disallowed_special == "all":
        disallowed = specials - allowed
    elif isinstance(disallowed_special, str):
        raise ValueError(f"disallowed_special must be 'all' or a collection of str, got {disallowed_special!r}")
    else:
        disallowed = _names("disallowed_special", disallowed_special)
    return allowed, disallowed


def _names(name: str, values: object) -> frozenset[str]:
    """`values`, a collection of special-token names, as a frozenset; a TypeError naming `name` for anything else
    (a tensor or a dict of numbers would become a set of non-names)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (AbstractSet, list, tuple, dict)) or not all(
            isinstance(s, str) for s in values):
        raise TypeError(f"{name} must be a collection of special-token names (str), got {short_repr(values)}")
    return frozenset(values)


def raise_if_disallowed(text: str, disallowed: frozenset[str]) -> None:
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__} {short_repr(text)}")
    if not isinstance(disallowed, (set, frozenset, list, tuple)) or not all(isinstance(s, str) for s in disallowed):
        raise TypeError(f"disallowed must be a set of special-token names (str), got {short_repr(disallowed)}")
    if not disallowed:
        return
    found = special_split_regex(tuple(sorted(disallowed))).search(text)
    if found:
        raise ValueError(
            f"encountered text corresponding to disallowed special token {found.group()!r} at character "
            f"{found.start()}; pass allowed_special={{{found.group()!r}}} (or 'all') to encode it as a special "
            f"token, or disallowed_special=() to encode it as ordinary text"
        )

"""Pre-tokenization: the regular expressions that cut text into chunks before byte-pair merging.

What it adds: the GPT-2 and GPT-4 (cl100k) split patterns, a compiled-pattern cache and `split_text`.
What it leaves out: merging (see `train.py`, `encode.py`); special tokens are cut out before splitting (`bpe.py`).

BPE never merges across chunk boundaries, so the pattern decides which tokens can exist at all: GPT-2's pattern
keeps a leading space with the word (" the"), splits letters from digits from punctuation, and keeps runs of
whitespace apart from the word that follows (Radford et al. 2019, Sec. 2.2, motivate this: without it BPE wastes
vocabulary on "dog." "dog!" "dog?" variants). The GPT-4 pattern adds what helps code: digit runs capped at 3,
case-insensitive contractions, newlines grouped with the indentation before them, and one punctuation character
allowed in front of a word (".append", "_name").

Both patterns use possessive quantifiers (`++`, `?+`) and Unicode classes (`\\p{L}`, `\\p{N}`), which the stdlib
`re` module lacks (possessives arrived only in 3.11, `\\p{..}` never), so we use the `regex` package, exactly
as tiktoken's own Python reference does. The strings below are byte-for-byte tiktoken's `gpt2` and
`cl100k_base` patterns, which is what makes parity with tiktoken possible.
"""

from __future__ import annotations

import functools

import regex

# tiktoken's "gpt2" pattern. Equivalent to the one in OpenAI's gpt-2 encoder.py ('s|'t|...| ?\p{L}+|...|\s+(?!\S)|\s+);
# the possessive/`\s++$` form only makes it faster.
GPT2_SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""

# tiktoken's "cl100k_base" (GPT-4) pattern.
GPT4_SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|"""
    r"""\s+(?!\S)|\s"""
)

PATTERNS = {"gpt2": GPT2_SPLIT_PATTERN, "gpt4": GPT4_SPLIT_PATTERN}


def resolve_pattern(pattern: str) -> str:
    """Accept a pattern by name ("gpt2", "gpt4") or as a regular expression; check that it compiles."""
    if not isinstance(pattern, str):
        raise TypeError(f"pattern must be a str (a name or a regex), got {type(pattern).__name__}")
    pattern = PATTERNS.get(pattern, pattern)
    if not pattern:
        raise ValueError("pattern must not be empty")
    compile_pattern(pattern)
    return pattern


@functools.lru_cache(maxsize=16)
def compile_pattern(pattern: str) -> regex.Pattern:
    try:
        return regex.compile(pattern)
    except regex.error as e:
        raise ValueError(f"invalid split pattern {pattern!r}: {e}") from e


def split_text(text: str, pattern: str) -> list[str]:
    """Cut `text` into pre-token chunks. Joining the chunks gives back `text` for both shipped patterns."""
    return compile_pattern(pattern).findall(text)

"""The Tokenizer: byte-level BPE encode/decode with special tokens, file formats and tiktoken interop.

What it adds: `Tokenizer` (encode with tiktoken's allowed_special/disallowed_special rules, decode to text or
bytes, save/load in `.tiktoken` and minillm JSON, `from_tiktoken` / `to_tiktoken`, a chunk cache). What it leaves
out: training (`train.py`, whose `train_bpe(...).to_tokenizer()` builds one) and speed beyond what a heap-based
chunk encoder and a per-chunk cache give: encoding stays pure Python, several times slower than tiktoken's Rust core
(the tour measures by how much). `encode_ordinary_ref` is the reference twin: no cache, the simple `encode_chunk`.

Encoding, step by step (identical to tiktoken, which is what the parity tests check):
    text --cut at allowed special tokens--> segments | special ids
    segment --split pattern--> chunks  (e.g. "def foo():" -> "def", " foo", "():")
    chunk --utf-8--> bytes --rank table lookup (whole chunk is a token?)--> [id]
                          \\--otherwise encode_chunk_fast (lowest-rank pair first, via a heap)--> [ids]
Chunk results are cached by chunk text: code and prose repeat a few thousand chunks over and over.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from numbers import Integral
from pathlib import Path
from typing import Any

from minillm.core.config import number_kind, short_repr
from minillm.core.io import atomic_write_bytes, atomic_write_text
from minillm.tokenizer import formats
from minillm.tokenizer.encode import encode_chunk, encode_chunk_fast
from minillm.tokenizer.patterns import compile_pattern, resolve_pattern
from minillm.tokenizer.special import AllOrSet, raise_if_disallowed, resolve_special_sets, special_split_regex

CACHE_LIMIT = 200_000  # chunk-cache entries kept per tokenizer (each a short str -> tuple of ints)
# Special token ids follow the mergeable ranks. tiktoken checks exact density (ids 0..n_vocab-1, no gaps) when it is
# told n_vocab (GPT-2: 50,256 ranks, <|endoftext|> = 50256), and its later encodings leave a few reserved ids
# unused (cl100k_base: ranks 0..100255, specials 100257..100260 and 100276). We allow such gaps up to this many
# unused ids, so a typo like 10**9 cannot silently make a billion-row embedding table.
MAX_UNUSED_SPECIAL_IDS = 1024


class Tokenizer:
    """A byte-level BPE tokenizer defined by a rank table (token bytes -> id), a split pattern and special tokens."""

    def __init__(self, ranks: dict[bytes, int], pattern: str, special_tokens: dict[str, int] | None = None,
                 name: str = "minillm-bpe", metadata: dict[str, Any] | None = None) -> None:
        if not isinstance(ranks, dict):
            raise TypeError(f"ranks must be a dict of bytes -> int, got {type(ranks).__name__}")
        for tok, rank in ranks.items():
            if not isinstance(tok, bytes) or not isinstance(rank, int) or isinstance(rank, bool):
                raise TypeError(f"ranks must map bytes -> int, got {short_repr(tok)}: {short_repr(rank)}")
        missing = [b for b in range(256) if bytes([b]) not in ranks]
        if missing:
            raise ValueError(f"ranks lack {len(missing)} of the 256 single-byte tokens (first: byte {missing[0]}); "
                             f"a byte-level tokenizer needs all of them (truncated or foreign rank file?)")
        if sorted(ranks.values()) != list(range(len(ranks))):
            seen: set[int] = set()
            bad = next((r for r in sorted(ranks.values()) if r in seen or seen.add(r) or r >= len(ranks)), None)
            raise ValueError(f"ranks must be exactly 0..{len(ranks) - 1}, each once; rank {short_repr(bad)} breaks "
                             f"this")
        special_tokens = dict(special_tokens or {})
        for s, i in special_tokens.items():
            if not isinstance(s, str) or not s:
                raise TypeError(f"special token names must be non-empty str, got {s!r}")
            if not isinstance(i, int) or isinstance(i, bool) or i < len(ranks):
                raise ValueError(f"special token {s!r} has id {short_repr(i)}; special ids must be ints >= "
                                 f"{len(ranks)} (after the mergeable ranks)")
        if len(set(special_tokens.values())) != len(special_tokens):
            raise ValueError(f"special token ids must be distinct, got {special_tokens!r}")
        max_id = len(ranks) + len(special_tokens) - 1 + MAX_UNUSED_SPECIAL_IDS
        for s, i in special_tokens.items():
            if i > max_id:
                raise ValueError(
                    f"special token {s!r} has id {i}; special ids must follow the {len(ranks)} mergeable ranks "
                    f"(as in tiktoken: {len(ranks)}, {len(ranks) + 1}, ...), leaving at most "
                    f"{MAX_UNUSED_SPECIAL_IDS} ids unused, so at most {max_id} here")
        self.name = name
        self.pattern = resolve_pattern(pattern)
        self.metadata = dict(metadata or {})
        self._ranks = ranks
        self._special = special_tokens
        self._decoder: dict[int, bytes] = {r: t for t, r in ranks.items()}
        self._decoder.update({i: s.encode("utf-8") for s, i in special_tokens.items()})
        self._split = compile_pattern(self.pattern).findall
        self._cache: dict[str, tuple[int, ...]] = {}

    # ---- properties -------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Largest id + 1 (tiktoken's n_vocab): the embedding table size a model needs."""
        return max(self._decoder) + 1

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._special)

    @property
    def mergeable_ranks(self) -> dict[bytes, int]:
        return dict(self._ranks)

    @property
    def eot_token(self) -> int | None:
        """Id of "<|endoftext|>" if this tokenizer has it."""
        return self._special.get("<|endoftext|>")

    def __repr__(self) -> str:
        return f"Tokenizer(name={self.name!r}, vocab_size={self.vocab_size}, special_tokens={self._special!r})"

    # ---- encoding ---------------------------------------------------------------------------------------
    def encode_ordinary(self, text: str) -> list[int]:
        """Encode `text` with no special-token handling at all (special-token text is ordinary text)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        text = _fix_surrogates(text)
        cache, ranks = self._cache, self._ranks
        out: list[int] = []
        for chunk in self._chunks(text):
            ids = cache.get(chunk)
            if ids is None:
                piece = chunk.encode("utf-8")
                rank = ranks.get(piece)
                # subtle: tiktoken takes a chunk that is itself a token as that token without running the merge
                # loop; the merge loop might not reach it, so we must do the same to match its ids.
                ids = (rank,) if rank is not None else tuple(encode_chunk_fast(piece, ranks))
                if len(cache) < CACHE_LIMIT:
                    cache[chunk] = ids
            out += ids
        return out

    def encode_ordinary_ref(self, text: str) -> list[int]:
        """`encode_ordinary`'s reference twin: no cache, the simple O(n^2)-per-chunk `encode_chunk`. Same ids."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        out: list[int] = []
        for chunk in self._chunks(_fix_surrogates(text)):
            piece = chunk.encode("utf-8")
            rank = self._ranks.get(piece)
            out += [rank] if rank is not None else encode_chunk(piece, self._ranks)
        return out

    def _chunks(self, text: str) -> list[str]:
        """The split pattern's chunks of `text`; text the pattern does not match is a ValueError, never dropped.

        Both shipped patterns end in `\\s` after `\\s+`, `\\p{L}`, `\\p{N}` and "anything else" alternatives, so they
        match every character; a custom pattern may not (e.g. r"\\w+" skips spaces), and a tokenizer that silently
        encodes "ab c" like "abc" is worse than one that refuses. The chunks tile the text iff their lengths sum
        to the text's length, which costs one pass over the chunk list.
        """
        chunks = self._split(text)
        if sum(map(len, chunks)) != len(text):
            pos = 0
            for m in compile_pattern(self.pattern).finditer(text):
                if m.start() != pos:
                    break
                pos = m.end()
            end = next((m.start() for m in compile_pattern(self.pattern).finditer(text, pos)), len(text))
            raise ValueError(f"the split pattern of tokenizer {self.name!r} does not match the text "
                             f"{text[pos:max(end, pos + 1)][:40]!r} at character {pos}; it would be dropped. "
                             f"Use a pattern that matches every character (e.g. 'gpt2' or 'gpt4')")
        return chunks

    def encode(self, text: str, allowed_special: AllOrSet = frozenset(),
               disallowed_special: AllOrSet = "all") -> list[int]:
        """Encode `text`; special-token text raises unless allowed (tiktoken's semantics, see `special.py`)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        allowed, disallowed = resolve_special_sets(self._special, allowed_special, disallowed_special)
        raise_if_disallowed(text, disallowed)
        if not allowed:
            return self.encode_ordinary(text)
        out: list[int] = []
        start = 0
        for m in special_split_regex(tuple(sorted(allowed))).finditer(text):
            out += self.encode_ordinary(text[start : m.start()])
            out.append(self._special[m.group()])
            start = m.end()
        out += self.encode_ordinary(text[start:])
        return out

    def encode_batch(self, texts: Iterable[str], **kwargs: Any) -> list[list[int]]:
        return [self.encode(t, **kwargs) for t in texts]

    # ---- decoding ---------------------------------------------------------------------------------------
    def decode_bytes(self, ids: Sequence[int] | Any) -> bytes:
        """The exact bytes of `ids` (special tokens as their UTF-8 text). Unknown ids raise ValueError."""
        if hasattr(ids, "tolist"):  # a torch tensor or numpy array of ids
            ids = ids.tolist()
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
            raise TypeError(f"ids must be a sequence of ints, got {type(ids).__name__}")
        ids = list(ids)  # subtle: a generator can be read only once, and the error path below reads it again
        dec = self._decoder
        try:
            # subtle: 1.0 and True hash and compare equal to 1, so a dict lookup alone would accept them as ids.
            if all(type(i) is int for i in ids):
                return b"".join([dec[i] for i in ids])
        except KeyError:
            pass
        for pos, i in enumerate(ids):
            if isinstance(i, bool) or not isinstance(i, Integral):  # numpy ints are Integral; floats, numpy bools not
                raise TypeError(f"token id at position {pos} must be an int, got {number_kind(i)}")
            if int(i) not in dec:
                raise ValueError(f"unknown token id {i} at position {pos}: no token has this id "
                                 f"(vocab_size={self.vocab_size})")
        return b"".join([dec[int(i)] for i in ids])

    def decode(self, ids: Sequence[int] | Any, errors: str = "replace") -> str:
        """Text of `ids`; byte sequences that are not valid UTF-8 become U+FFFD (errors="replace")."""
        return self.decode_bytes(ids).decode("utf-8", errors=errors)

    def decode_single_token_bytes(self, token_id: int) -> bytes:
        return self.decode_bytes([token_id])

    def token_bytes(self) -> list[bytes]:
        """Bytes of every id 0..vocab_size-1 (b"" for ids that are no token)."""
        return [self._decoder.get(i, b"") for i in range(self.vocab_size)]

    # ---- files --------------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Save by suffix: `.json` (minillm format, everything) or `.tiktoken` (ranks only). Atomic."""
        path = Path(path)
        if path.suffix == ".json":
            return atomic_write_text(path, formats.dump_json(self._ranks, self.pattern, self._special, self.name,
                                                             self.metadata))
        if path.suffix == ".tiktoken":
            return atomic_write_bytes(path, formats.dump_tiktoken_ranks(self._ranks))
        raise ValueError(f"unknown tokenizer file suffix {path.suffix!r} in {str(path)!r}; use .json or .tiktoken")

    @classmethod
    def load(cls, path: str | os.PathLike, pattern: str | None = None,
             special_tokens: dict[str, int] | None = None) -> Tokenizer:
        """Load a `.json` file (self-describing) or a `.tiktoken` file (needs `pattern` and `special_tokens`)."""
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"tokenizer file not found: {str(path)!r}")
        if path.suffix == ".tiktoken":
            return cls.from_tiktoken(path, pattern=pattern, special_tokens=special_tokens)
        if path.suffix != ".json":
            raise ValueError(f"unknown tokenizer file suffix {path.suffix!r} in {str(path)!r}; use .json or .tiktoken")
        if pattern is not None or special_tokens is not None:
            raise ValueError("a .json tokenizer file records its own pattern and special tokens; do not pass them")
        d = formats.parse_json(path.read_bytes(), source=str(path))
        return cls(d["ranks"], d["pattern"], d["special_tokens"], name=d["name"], metadata=d["metadata"])

    @classmethod
    def from_tiktoken(cls, encoding_or_ranks_file: Any, pattern: str | None = None,
                      special_tokens: dict[str, int] | None = None, name: str | None = None) -> Tokenizer:
        """From a `tiktoken.Encoding` (pattern and specials taken from it unless given) or a `.tiktoken` file."""
        src = encoding_or_ranks_file
        if isinstance(src, (str, os.PathLike)):
            path = Path(src)
            if pattern is None:
                raise ValueError(
                    f"a .tiktoken file holds no split pattern: pass pattern= (e.g. 'gpt2') for {str(path)!r}")
            if not path.is_file():
                raise ValueError(f"tiktoken rank file not found: {str(path)!r}")
            ranks = formats.parse_tiktoken_ranks(path.read_bytes(), source=str(path))
            return cls(ranks, pattern, special_tokens or {}, name=name or path.stem)
        if hasattr(src, "_mergeable_ranks") and hasattr(src, "_pat_str"):  # a tiktoken.Encoding
            return cls(dict(src._mergeable_ranks), pattern or src._pat_str,
                       src._special_tokens if special_tokens is None else special_tokens, name=name or src.name)
        raise TypeError(f"expected a tiktoken.Encoding or a path to a .tiktoken file, got {type(src).__name__}")

    def to_tiktoken(self):  # -> tiktoken.Encoding (imported lazily: tiktoken is only needed for interop)
        """A `tiktoken.Encoding` with the same ranks, pattern and special tokens (ids are identical)."""
        import tiktoken

        return tiktoken.Encoding(self.name, pat_str=self.pattern, mergeable_ranks=dict(self._ranks),
                                 special_tokens=dict(self._special))


def _fix_surrogates(text: str) -> str:
    """Lone surrogates cannot be UTF-8 encoded; replace them by U+FFFD as tiktoken does."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text

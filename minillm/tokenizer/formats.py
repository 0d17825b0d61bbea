"""Tokenizer files: tiktoken's `.tiktoken` rank format, and minillm's own JSON format that also keeps the pattern.

What it adds: writing and strictly parsing both formats, with errors that name the file and the line. What it leaves
out: the Tokenizer itself (`bpe.py` calls these functions).

`.tiktoken` (tiktoken's format, readable by `tiktoken.load.load_tiktoken_bpe`): one line per mergeable token,
`<base64 of the token bytes> <rank>`, sorted by rank. It holds neither the split pattern nor the special tokens,
so loading one needs both passed in. A file cut at a line boundary cannot be told from a smaller vocabulary; a
file cut inside a line, or one with a missing single-byte token, is rejected.

minillm JSON (`.json`), version 1, one object:
    {
      "format": "minillm-bpe",            # always this string
      "version": 1,                        # bumped on incompatible change
      "name": "minillm-stdlib-4k",         # free text
      "pattern": "<regex>",                # the split pattern (the `regex` package's syntax)
      "special_tokens": {"<|endoftext|>": 4095},
      "num_ranks": 4095,                   # len(ranks), a check against truncation
      "ranks": ["AA==", "AQ==", ...],      # base64 token bytes; the list index is the rank (= token id)
      "metadata": {...}                    # free-form provenance (corpus hash, trainer, ...), optional
    }
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from minillm.core.config import check_label, short_repr

FORMAT_NAME = "minillm-bpe"
FORMAT_VERSION = 1


def check_ranks(ranks: Any) -> dict[bytes, int]:
    """`ranks` if it is a dict of bytes -> int (a tokenizer's mergeable ranks); a TypeError naming the first entry
    that is not, before a writer sorts or encodes it."""
    if not isinstance(ranks, dict):
        raise TypeError(f"ranks must be a dict of bytes -> int, got {type(ranks).__name__} {short_repr(ranks)}")
    for tok, rank in ranks.items():
        if not isinstance(tok, bytes) or not isinstance(rank, int) or isinstance(rank, bool):
            raise TypeError(f"ranks must map bytes -> int, got {short_repr(tok)}: {short_repr(rank)}")
    return ranks


def dump_tiktoken_ranks(ranks: dict[bytes, int]) -> bytes:
    check_ranks(ranks)
    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    lines = [base64.b64encode(tok) + b" " + str(rank).encode() for tok, rank in by_rank]
    return b"\n".join(lines) + b"\n"


def parse_tiktoken_ranks(data: bytes, source: str = "<bytes>") -> dict[bytes, int]:
    """Parse `.tiktoken` content strictly: every non-empty line must be `<base64> <int>`."""
    if not isinstance(data, (bytes, bytearray)):
        raise TypeError(f"tiktoken rank data must be bytes, got {type(data).__name__}")
    check_label("source", source)
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(bytes(data).splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split()
        if len(fields) != 2:
            raise ValueError(f"{source}: line {lineno} must be '<base64 token> <rank>', got {line[:60]!r}")
        try:
            token = base64.b64decode(fields[0], validate=True)
            rank = int(fields[1])
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"{source}: line {lineno} is malformed ({e}): {line[:60]!r}") from e
        if token in ranks:
            raise ValueError(f"{source}: line {lineno} repeats token {short_repr(token)}")
        ranks[token] = rank
    if not ranks:
        raise ValueError(f"{source}: no ranks found (empty tiktoken file)")
    return ranks


def dump_json(ranks: dict[bytes, int], pattern: str, special_tokens: dict[str, int], name: str,
              metadata: dict[str, Any] | None = None) -> str:
    check_ranks(ranks)
    for what, value in (("pattern", pattern), ("name", name)):
        if not isinstance(value, str):
            raise TypeError(f"{what} must be a str, got {type(value).__name__} {short_repr(value)}")
    if not isinstance(special_tokens, dict) or not all(isinstance(s, str) and isinstance(i, int)
                                                       for s, i in special_tokens.items()):
        raise TypeError(f"special_tokens must be a dict of str -> int, got {short_repr(special_tokens)}")
    if metadata is not None and not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict or None, got {type(metadata).__name__} {short_repr(metadata)}")
    ordered = [tok for tok, _ in sorted(ranks.items(), key=lambda kv: kv[1])]
    obj = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "name": name,
        "pattern": pattern,
        "special_tokens": dict(special_tokens),
        "num_ranks": len(ordered),
        "ranks": [base64.b64encode(t).decode("ascii") for t in ordered],
        "metadata": dict(metadata or {}),
    }
    # One rank per line keeps the shipped file diff-able and greppable.
    head = json.dumps({k: v for k, v in obj.items() if k != "ranks"}, indent=1, ensure_ascii=False)
    ranks_text = ",\n".join("  " + json.dumps(r) for r in obj["ranks"])
    return head[:-2] + ',\n "ranks": [\n' + ranks_text + "\n ]\n}\n"


def parse_json(text: str | bytes, source: str = "<json>") -> dict[str, Any]:
    """Parse and validate minillm JSON; returns ranks (bytes -> rank), pattern, special_tokens, name, metadata."""
    check_label("source", source)
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{source}: not a valid minillm tokenizer JSON file (truncated or corrupt?): {e}") from e
    if not isinstance(obj, dict) or obj.get("format") != FORMAT_NAME:
        got = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
        raise ValueError(f"{source}: 'format' must be {FORMAT_NAME!r}, got {got!r}")
    if obj.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{source}: unsupported format version {obj.get('version')!r} (this minillm reads {FORMAT_VERSION})")
    for key, typ in (("pattern", str), ("special_tokens", dict), ("ranks", list), ("num_ranks", int)):
        if not isinstance(obj.get(key), typ):
            raise ValueError(f"{source}: field {short_repr(key)} must be a {typ.__name__}, got "
                             f"{type(obj.get(key)).__name__}")
    if len(obj["ranks"]) != obj["num_ranks"]:
        raise ValueError(f"{source}: 'num_ranks' says {obj['num_ranks']} but 'ranks' holds {len(obj['ranks'])} entries")
    ranks: dict[bytes, int] = {}
    for rank, b64 in enumerate(obj["ranks"]):
        try:
            token = base64.b64decode(b64, validate=True)
        except (binascii.Error, TypeError, ValueError) as e:
            raise ValueError(f"{source}: rank {rank} holds invalid base64 {b64!r}") from e
        if token in ranks:
            raise ValueError(f"{source}: rank {rank} repeats the token of rank {ranks[token]}: {short_repr(token)}")
        ranks[token] = rank
    specials = obj["special_tokens"]
    for s, i in specials.items():
        if not isinstance(i, int) or isinstance(i, bool):
            raise ValueError(f"{source}: special token {s!r} has non-integer id {short_repr(i)}")
    metadata = obj.get("metadata", {})
    if not isinstance(metadata, dict):
        raise ValueError(f"{source}: field 'metadata' must be an object, got {type(metadata).__name__}")
    return {"ranks": ranks, "pattern": obj["pattern"], "special_tokens": specials,
            "name": str(obj.get("name", "minillm-bpe")), "metadata": metadata}

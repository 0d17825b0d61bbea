"""Parity with tiktoken: a varied test text, and an id-by-id comparison that reports the first disagreement.

What it adds: `varied_text` (deterministic text mixing the corpus with the cases tokenizers get wrong: unicode,
emoji, whitespace runs, contractions, numbers, code) and `compare_with_tiktoken`. What it leaves out: timing (the
tour does that through `minillm.core.timing`).

Why these cases: the split pattern's alternatives are where implementations drift: contractions ("'s" vs "'S",
only GPT-4's pattern is case-insensitive), runs of spaces before a word (`\\s+(?!\\S)` leaves one space for the
word), "\\r\\n", digits of other scripts (\\p{N} includes "٣" and "½"), letters of all scripts (\\p{L}), and byte
sequences no merge covers (emoji, rare CJK) that fall back to single bytes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from minillm.core.config import check_instance, short_repr
from minillm.core.corpus import load_corpus, take_bytes
from minillm.tokenizer.bpe import Tokenizer

FRAGMENTS = (
    "I'm sure they'll say it's fine, but we've seen what you'd do. DON'T! She'S here; he'LL go. 'tis 'twas '' ' ",
    "Ünïcödé façade naïve café résumé Ærøskøbing straße ß ẞ İstanbul ıi ǅ ǈ ǋ",
    "日本語のテキストと漢字、ひらがな。中文字符测试，標點符號！한국어 문장입니다. ภาษาไทย ไม่มีช่องว่าง",
    "Русский текст и цифры 1234567. Ελληνικά γράμματα αβγ. עברית מימין לשמאל. العربية ١٢٣٤٥ ۱۲۳",
    "emoji 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🇩🇪🇯🇵 🏳️‍🌈 ❤️‍🔥 ✨ 🦀🐍 #️⃣ 1️⃣ ©️ ™",
    "numbers 0 7 42 123 1234 12345 123456789012 3.14159 -2.5e-10 1,000,000 ½ ¾ ² ³ Ⅻ ௰ 0x1F 0b1010 1_000",
    "   leading spaces\t\ttabs\n\n\nnewlines   \r\n\r\nCRLF  \u00a0nbsp\u3000ideographic\u2028line sep \u200bzero width",
    "trailing spaces      \n      \n\t \t \n",
    "def f(x: int) -> list[int]:\n    return [i ** 2 for i in range(x) if i % 3 != 0]  # squares\n",
    "if (a && b || !c) { printf(\"%d\\n\", a->b[i++]); } else { return -1; }\n",
    "<html><body class=\"x\">&amp;&lt;&#x27;</body></html> {\"key\": [1, 2.5, null, true], \"k2\": {}}",
    "combining: e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937 Z\u0351\u0357a\u0364l\u0302g\u0300o\u0301",
    "control \x00\x01\x07\x1b[31mred\x1b[0m \x7f \ufeffBOM \ufffd replacement \U0010fffd private",
    "<|endoftext|> is plain text here, as is <|fim_prefix|> and <|im_start|>",
)

_WORDS = ("the", "of", "and", "tokenizer", "byte", "pair", "encoding", "Zürich", "naïve", "данные", "数据", "λόγος",
          "x", "I", "a", "HTTP", "iPhone", "snake_case", "camelCase", "kebab-case", "C++", "3D", "v2.0")


def _random_piece(rng: random.Random) -> str:
    kind = rng.randrange(7)
    if kind == 0:  # random code points from all planes (no surrogates: they are not text)
        out = []
        for _ in range(rng.randint(1, 12)):
            cp = rng.choice((rng.randrange(0x20, 0x7F), rng.randrange(0xA0, 0x800), rng.randrange(0x800, 0xD800),
                             rng.randrange(0xE000, 0x10000), rng.randrange(0x10000, 0x30000)))
            out.append(chr(cp))
        return "".join(out)
    if kind == 1:  # whitespace runs
        return "".join(rng.choice((" ", "  ", "\t", "\n", "\r\n", "\u00a0", "\u3000", "\v", "\f"))
                       for _ in range(rng.randint(1, 9)))
    if kind == 2:  # numbers
        return rng.choice(("", "-", "+", "$", " ")) + str(rng.randrange(10 ** rng.randint(1, 15)))
    if kind == 3:  # contractions in any case
        word = rng.choice(_WORDS)
        suffix = rng.choice(("s", "t", "re", "ve", "m", "ll", "d"))
        return word + "'" + "".join(c.upper() if rng.random() < 0.5 else c for c in suffix)
    if kind == 4:
        return rng.choice(FRAGMENTS)
    punct = rng.choice(("", ".", ",", "!", "?", "...", ":", ";", "()", "[]"))
    return " " * rng.randint(0, 3) + rng.choice(_WORDS) + punct


def varied_text(num_bytes: int, seed: int = 0, corpus_fraction: float = 0.6) -> str:
    """About `num_bytes` UTF-8 bytes: a slice of the default corpus plus random and hand-picked hard cases."""
    if not isinstance(num_bytes, int) or num_bytes <= 0:
        raise ValueError(f"num_bytes must be a positive int, got {short_repr(num_bytes)}")
    if not 0.0 <= corpus_fraction <= 1.0:
        raise ValueError(f"corpus_fraction must be in [0, 1], got {short_repr(corpus_fraction)}")
    rng = random.Random(seed)
    parts = [take_bytes(load_corpus().text, int(num_bytes * corpus_fraction))]
    parts.extend(FRAGMENTS)
    size = sum(len(p.encode("utf-8")) for p in parts)
    while size < num_bytes:
        piece = _random_piece(rng)
        parts.append(piece)
        size += len(piece.encode("utf-8"))
    return "".join(parts)


@dataclass
class ParityResult:
    identical: bool
    num_bytes: int  # UTF-8 bytes compared
    num_ids: int  # ids produced by ours
    first_mismatch: int | None  # index of the first differing id, None if identical
    context: str  # the text around the first mismatch ("" if identical)

    def summary(self) -> str:
        mb = self.num_bytes / 1e6
        if self.identical:
            return f"identical ids, {mb:.2f} MB, {self.num_ids:,} tokens"
        return f"ids differ at token {self.first_mismatch} ({mb:.2f} MB compared) near {self.context!r}"


def compare_with_tiktoken(ours: Any, reference: Any, text: str, **encode_kwargs: Any) -> ParityResult:
    """Encode `text` with our Tokenizer and with a tiktoken.Encoding; compare the ids one by one."""
    check_instance("ours", ours, Tokenizer, "a minillm Tokenizer")
    if isinstance(reference, (str, bytes)) or not callable(getattr(reference, "encode", None)):
        raise TypeError(f"reference must be a tiktoken.Encoding (with encode(text)), got {type(reference).__name__} "
                        f"{short_repr(reference)}")
    check_instance("text", text, str, "a str")
    a = ours.encode(text, **encode_kwargs)
    b = reference.encode(text, **encode_kwargs)
    if a == b:
        return ParityResult(True, len(text.encode("utf-8")), len(a), None, "")
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    prefix = len(ours.decode_bytes(a[:i]))
    context = text.encode("utf-8")[max(0, prefix - 20) : prefix + 20].decode("utf-8", "replace")
    return ParityResult(False, len(text.encode("utf-8")), len(a), i, context)

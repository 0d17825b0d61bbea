"""Incremental detokenization: the text of a growing list of tokens, at a cost per token that does not grow.

What it adds: `IncrementalText`, which every stop check and every streamed output shares. Decoding the whole
output again after each token (what a plain `tokenizer.decode(ids)` loop does) costs O(n) per token, O(n²) per
request; here each token's bytes go once through Python's incremental UTF-8 decoder
(`codecs.getincrementaldecoder`), which keeps back the bytes of a character that is not complete yet. So a
character split across two tokens (byte-level BPE splits rare characters into their bytes) never reaches the
text half-decoded as U+FFFD; bytes that can never become a character still do, once a later byte proves it.
A tokenizer without per-token bytes (any object with `decode(ids) -> str`) is decoded in a short window instead:
the tokens since the last complete character, emitted once their text no longer ends in U+FFFD.
What it leaves out: tokenizers whose decode of a token depends on its neighbours (SentencePiece's leading spaces):
minillm's BPE and tiktoken map each token to fixed bytes.

    tokens  [..., 0xE2 0x82]  [0xAC, " a"]      (the euro sign's three bytes split over two tokens)
    text    "..."             "...€ a"          nothing is emitted for the first token
"""

from __future__ import annotations

import codecs
from typing import Any

from minillm.core.config import short_repr

# The most tokens the window fallback keeps undecoded while their text ends in U+FFFD. A token may hold the end of
# one character and the start of the next, so a run of split characters can keep the window open for a few tokens;
# past this many, the replacement character is taken as real (the model produced bytes that are no UTF-8).
MAX_PENDING_TOKENS = 16


class IncrementalText:
    """`text` of every token `append`ed so far; `append` returns the characters it added (maybe "")."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._bytes_of = getattr(tokenizer, "decode_single_token_bytes", None)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace") if self._bytes_of else None
        self._pieces: list[str] = []  # the text, in pieces (joined on demand: appends stay O(1))
        self._length = 0
        self._pending: list[int] = []  # window fallback: tokens whose text is not complete yet

    def __len__(self) -> int:
        """Characters of text so far."""
        return self._length

    @property
    def text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def append(self, token_id: int) -> str:
        """Decode one more token; return the new characters (complete ones only)."""
        if self._decoder is not None:
            piece = self._bytes_of(token_id)
            if not isinstance(piece, bytes):
                raise TypeError(f"tokenizer.decode_single_token_bytes must return bytes, got {type(piece).__name__} "
                                f"{short_repr(piece)} (from {type(self.tokenizer).__name__})")
            new = self._decoder.decode(piece)
        else:
            self._pending.append(token_id)
            new = self._decode(self._pending)
            if new.endswith("\ufffd") and len(self._pending) < MAX_PENDING_TOKENS:
                return ""
            self._pending = []
        return self._add(new)

    def flush(self) -> str:
        """The request ended: what is still held back becomes text (a cut-off character as U+FFFD)."""
        if self._decoder is not None:
            return self._add(self._decoder.decode(b"", final=True))
        new = self._decode(self._pending) if self._pending else ""
        self._pending = []
        return self._add(new)

    def _decode(self, ids: list[int]) -> str:
        """The tokenizer's text of ids; a TypeError naming the tokenizer when what comes back is no str (a stop
        string is searched in it, and its length counted)."""
        text = self.tokenizer.decode(ids)
        if not isinstance(text, str):
            raise TypeError(f"tokenizer.decode must return a str, got {type(text).__name__} {short_repr(text)} "
                            f"(from {type(self.tokenizer).__name__})")
        return text

    def _add(self, new: str) -> str:
        if new:
            self._pieces.append(new)
            self._length += len(new)
        return new

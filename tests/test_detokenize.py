"""Incremental detokenization and streamed text: whole characters only, never any part of a stop string, and a
decoding cost per token that does not grow with the output.

The streamed deltas are checked through the engine's own `_output` (what `step()` hands out), on requests whose
tokens are accepted one at a time, so the text of every delta is known in advance.
"""

from __future__ import annotations

import pytest
import torch

from minillm import GPT, GPTConfig, load_tokenizer
from minillm.core.detokenize import MAX_PENDING_TOKENS, IncrementalText
from minillm.core.sampling import SamplingParams
from minillm.core.stopping import StopChecker
from minillm.engine import LLM, EngineConfig

TEXT = "héllo € 中文 🙂 world, and more words after it"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


class WindowOnly:
    """A tokenizer with only `decode(ids) -> str` (no per-token bytes): the window fallback."""

    def __init__(self, tok):
        self.tok = tok
        self.eos_id = getattr(tok, "eos_id", None)

    def decode(self, ids):
        return self.tok.decode(ids)


class Counting:
    """Counts the token ids every decode call is given: the text's decoding work."""

    def __init__(self, tok, per_token: bool = True):
        self.tok = tok
        self.work = 0
        if per_token:
            self.decode_single_token_bytes = self._bytes

    def _bytes(self, token_id):
        self.work += 1
        return self.tok.decode_single_token_bytes(token_id)

    def decode(self, ids):
        self.work += len(ids)
        return self.tok.decode(ids)


def test_the_text_splits_characters_across_tokens(tok):
    """The premise: byte-level BPE gives some characters of TEXT as several tokens, each alone U+FFFD."""
    assert any("\ufffd" in tok.decode([i]) for i in tok.encode(TEXT))


@pytest.mark.parametrize("wrap", [lambda t: t, WindowOnly])
def test_incremental_text_never_emits_half_a_character(tok, wrap):
    text = IncrementalText(wrap(tok))
    pieces = [text.append(i) for i in tok.encode(TEXT)]
    assert "".join(pieces) == text.text == TEXT and len(text) == len(TEXT)
    assert not any("\ufffd" in p for p in pieces)
    assert text.flush() == ""


def test_bytes_that_can_never_be_a_character_become_u_fffd(tok):
    euro = tok.encode("€")  # three byte tokens
    assert len(euro) == 3
    text = IncrementalText(tok)
    got = text.append(euro[0]) + text.append(euro[1])  # a character cut off...
    assert got == ""
    got += text.append(tok.encode("a")[0])  # ...and a byte that proves it will not be completed
    assert got == "\ufffda"
    text = IncrementalText(tok)
    text.append(euro[0])
    assert text.flush() == "\ufffd"  # cut off at the end of the request


def _engine(tok) -> LLM:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=128, n_layer=1, n_head=2, n_embd=16))
    return LLM(model, tok, EngineConfig(num_blocks=16, block_size=16))


def _stream(llm: LLM, text: str, stop: list[str], max_new_tokens: int = 100):
    """Accept `text`'s tokens one by one into a request; every output `_output` would stream."""
    params = SamplingParams.greedy(max_new_tokens, stop=stop, ignore_eos=True)
    req = llm._new_request([1, 2, 3], params, None, None)
    outs = []
    for t in llm.tokenizer.encode(text):
        done = req.accept([t], 0.0)
        outs.append(llm._output(req))
        if done:
            break
    return req, outs


@pytest.mark.parametrize("stop", [["🙂 wor"], ["€ 中"], ["s aft", "more"], ["🙂"]])
def test_a_stop_string_across_tokens_is_never_streamed(tok, stop):
    llm = _engine(tok)
    req, outs = _stream(llm, TEXT, stop)
    want = TEXT[: min(TEXT.find(s) for s in stop)]
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    assert "".join(o.new_text for o in outs) == outs[-1].text == want
    for o in outs:  # no delta holds a piece of a split character, and every total is what was streamed
        assert "\ufffd" not in o.new_text and want.startswith(o.text)


def test_a_tail_that_might_become_a_stop_string_is_held_back_then_released(tok):
    llm = _engine(tok)
    req, outs = _stream(llm, TEXT, ["world!"], max_new_tokens=len(tok.encode(TEXT)))
    streamed = [o.text for o in outs]
    # while " w", " wor", " world" (prefixes of "world!") end the text, they are held back; the "," releases them
    assert not any(s.endswith(("🙂 w", "🙂 wor", "🙂 world")) for s in streamed), streamed
    assert "héllo € 中文 🙂 " in streamed and "héllo € 中文 🙂 world," in streamed
    assert outs[-1].finish_reason == "length" and outs[-1].text == TEXT
    assert "".join(o.new_text for o in outs) == TEXT


@pytest.mark.parametrize("per_token", [True, False])
def test_a_2000_token_output_costs_the_same_per_step(tok, per_token):
    """The stop check and the text decode only the new token (the window fallback: at most a character's worth of
    tokens), whatever the output's length; the old checker decoded the whole output every step."""
    counting = Counting(tok, per_token)
    checker = StopChecker(counting, SamplingParams.greedy(2000, stop=["never appears"], ignore_eos=True))
    ids = (tok.encode(TEXT) * 200)[:2000]
    work = []
    for t in ids:
        before = counting.work
        checker.update(t)
        checker.streamable_length()
        work.append(counting.work - before)
    assert checker.finish_reason == "length" and len(checker.token_ids) == 2000
    assert checker.output_text() == tok.decode(ids)
    if per_token:
        assert work == [1] * 2000  # one token's bytes per step, the 2,000th as the first
    else:
        assert max(work) <= MAX_PENDING_TOKENS and sum(work[-500:]) <= sum(work[:500]) + 50, (max(work), work[-500:])

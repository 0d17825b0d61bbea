"""One request's lifecycle, shared by every generation loop: check the prompt, sample into it, decide when it stops.

Adds the three pieces every loop in minillm used to write for itself: `validate_prompt` (the prompt and its
context window, checked once at a public entry point), `StopChecker` (end-of-text, stop strings, max tokens and
the window, in vLLM's order) and `RequestState`, built by `start_request`: the validated prompt, the capped
`SamplingParams`, the request's own generator and its stop checker. A loop samples with `sample_next(logits,
state.params, state.generator)` and hands the tokens to `state.accept`, which says whether the request is over.
Chapter 03's naive loop, chapter 04's cached loop and static batch, chapter 05's paged generator, chapter 06's
engine and both of chapter 07's workers all do exactly this, so equal logits give equal tokens and equal endings
everywhere. What it leaves out: sampling itself (`minillm.core.sampling`), and anything about KV memory.

    prompt ids ──start_request──▶ RequestState(prompt_ids, params (capped), generator, stop_checker)
    loop:  logits ──sample_next──▶ tokens ──state.accept(tokens)──▶ finished?  (finish_reason, output_text())
           sampling or the stop check raised ──state.fail(message)──▶ finished, finish_reason "error", state.error

A failure is one request's: a batched loop catches it around that request's sampling and `accept`, fails that
request alone (`fail`, with a message naming it) and goes on with the others.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from minillm.core.config import check_has_data, check_int, GPTConfig, plain_int, short_repr
from minillm.core.detokenize import IncrementalText
from minillm.core.sampling import SamplingParams, make_generator

FINISH_REASONS = ("length", "eos", "stop", "error")  # "error": sampling or the stop check raised for this request


def check_tokenizer_arg(tokenizer: Any) -> Any:
    """`tokenizer` if it is None or has a decode(ids) method (what the stop rule calls, once per token); a TypeError
    naming it otherwise, at the call that takes it, not an AttributeError at the first token. A str or bytes is
    refused by name: it would pass a duck test for encode."""
    if tokenizer is not None and (isinstance(tokenizer, (str, bytes)) or not callable(getattr(tokenizer, "decode",
                                                                                               None))):
        raise TypeError(f"tokenizer must be None or have a decode(ids) method (the shipped tokenizer's), got "
                        f"{type(tokenizer).__name__}")
    return tokenizer


def default_eos(tokenizer: Any, eos_id: int | None) -> int | None:
    """The explicit eos_id (a plain int: a numpy int is read as the int it holds), else the tokenizer's end-of-text
    token when it has one, else none."""
    if eos_id is not None:
        plain = plain_int(eos_id)
        if plain is None:
            raise TypeError(f"eos_id must be an int or None, got {type(eos_id).__name__} {short_repr(eos_id)}")
        if plain < 0:  # no token: it would never stop anything (one past the vocabulary is left to check_eos_id)
            raise ValueError(f"eos_id must be a token id >= 0, got {plain}")
        return plain
    return getattr(tokenizer, "eot_token", None) if tokenizer is not None else None


def check_eos_id(eos_id: int | None, vocab_size: int) -> None:
    """An explicit eos_id must be a token the model can produce; checked at the entry points that take one.

    (Not inside `start_request`: an eos taken from a tokenizer may lie outside a small test model's vocabulary,
    and then simply never occurs, which is how minillm has always treated it.)"""
    if type(vocab_size) is not int or vocab_size < 1:
        check_int("vocab_size", vocab_size)
    if eos_id is None:
        return
    eos_id = default_eos(None, eos_id)  # the type check, and the plain int
    if not 0 <= eos_id < vocab_size:  # it could never be sampled, so it would never stop anything
        raise ValueError(f"eos_id={short_repr(eos_id)} is outside the model's vocabulary [0, {vocab_size})")


def check_token_ids(name: str, ids: Any, vocab_size: int) -> list[int]:
    """`ids` (a list or tuple of ints, a 1-D integer tensor or numpy array) as a list of Python ints in
    [0, vocab_size); a TypeError/ValueError naming `name` and the position of a bad one. Shared by prompts here and
    chapter 08's draft tokens. numpy integers count as ints (what a numpy tokenizer pipeline hands over); bools and
    floats do not, even integral ones (a float id is a bug upstream, not a token)."""
    if type(vocab_size) is not int or vocab_size < 1:  # a type test first: chapter 08 checks drafts every round
        check_int("vocab_size", vocab_size)
    if isinstance(ids, torch.Tensor):
        check_has_data(name, ids)  # nested, sparse, quantized, uint64, meta: before the shape is read
        if ids.dim() != 1 or ids.is_floating_point() or ids.dtype == torch.bool:
            raise TypeError(f"{name} tensor must be 1-D integer, got {ids.dtype} {tuple(ids.shape)}")
        ids = ids.tolist()
    elif isinstance(ids, np.ndarray):
        if ids.ndim != 1 or ids.dtype.kind not in "iu":  # signed or unsigned integers only: not bool, float, object
            raise TypeError(f"{name} array must be 1-D integer, got {ids.dtype} {ids.shape}")
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple)):
        raise TypeError(f"{name} must be a list of ints, got {type(ids).__name__} (a 1-D integer tensor or numpy "
                        "array also does)")
    out = []
    for pos, tok in enumerate(ids):
        plain = plain_int(tok)  # an int subclass's own comparisons are never consulted
        if plain is None:
            raise TypeError(f"{name}[{pos}] must be an int token id, got {type(tok).__name__} {short_repr(tok)}")
        if not 0 <= plain < vocab_size:
            raise ValueError(f"{name}[{pos}] = {short_repr(plain)} is outside the vocabulary [0, {vocab_size})")
        out.append(plain)
    return out


def validate_prompt(
    prompt_ids: Any, params: SamplingParams, vocab_size: int, block_size: int, truncate: bool = False
) -> tuple[list[int], int]:
    """Check a prompt against the model; return (prompt ids as a list, the number of tokens that can be generated).

    A prompt longer than the context window is a ValueError unless `truncate=True`, which keeps the last tokens,
    as many as leave room for `max_new_tokens` (at least one). Generation is capped where the sequence fills the
    window: the naive loop feeds prompt_len + n - 1 tokens to produce n, so at most block_size - prompt_len + 1 new
    tokens fit (finish_reason "length"), as vLLM caps max_tokens at the model's length.
    """
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    if type(block_size) is not int or block_size < 1:
        check_int("block_size", block_size)
    ids = check_token_ids("prompt_ids", prompt_ids, vocab_size)
    if len(ids) == 0:
        raise ValueError("prompt_ids is empty: generation needs at least one token to condition on")
    if not isinstance(truncate, bool):
        raise TypeError(f"truncate must be a bool, got {truncate!r}")
    if len(ids) > block_size:
        if not truncate:
            raise ValueError(f"prompt has {len(ids)} tokens, more than the context window block_size={block_size}; "
                             f"pass truncate=True to keep the last tokens")
    if truncate:
        keep = max(1, block_size - max(params.max_new_tokens - 1, 0))
        ids = ids[-keep:]
    return ids, min(params.max_new_tokens, block_size - len(ids) + 1)


class StopChecker:
    """Decides after each generated token whether generation is over, and why.

    `update(token_id)` returns True when the request must stop: the token is end-of-text (unless
    `params.ignore_eos`), a stop string now appears in the generated text, or `params.max_new_tokens` tokens have
    been produced. `finish_reason` is then "eos", "stop" or "length" (checked in that order, as vLLM does). The
    context window is a length limit too: `start_request` folds it into `max_new_tokens` (`validate_prompt`), so
    a request whose next token would have no position finishes with "length". `output_text()` gives the text with
    the stop string and anything after it cut off, as vLLM returns it.

    The text grows one token at a time (`minillm.core.detokenize.IncrementalText`): each step decodes only its new
    token and searches only the new characters (plus the few before them a stop string could start in), so a
    long output costs the same per step as a short one. `streamable_length()` is how much of the text a stream may
    show now: never half a character, and never a tail that could still grow into a stop string.
    """

    def __init__(self, tokenizer: Any, params: SamplingParams, eos_id: int | None = None):
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.stop and tokenizer is None:
            raise ValueError(f"stop strings {params.stop!r} need a tokenizer to decode the generated text")
        self.tokenizer = check_tokenizer_arg(tokenizer)
        self.params = params
        self.eos_id = default_eos(tokenizer, eos_id)
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None  # why the request failed (finish_reason "error"), else None
        self._max_stop = max((len(s) for s in params.stop), default=0)
        self._text = IncrementalText(tokenizer) if tokenizer is not None else None
        self._tail = ""  # the text's last max_stop - 1 characters: where a stop string may have begun
        self._stop_at: int | None = None  # character index where the stop string begins

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """All generated text so far (stop string included; a character still incomplete is not in it yet)."""
        return self._text.text if self._text is not None else ""

    def output_text(self) -> str:
        """The generated text up to (not including) the stop string, if one was hit."""
        text = self.text
        return text if self._stop_at is None else text[: self._stop_at]

    def streamable_length(self) -> int:
        """Characters of `text` a stream may show now. Finished: all of `output_text()`. Running: the text less its
        longest tail that is the start of a stop string (it could still become one, and a client must never see
        any part of a matched stop string)."""
        if self._text is None:
            return 0
        if self._stop_at is not None:
            return self._stop_at
        n = len(self._text)
        if self.finished or not self.params.stop:
            return n
        tail = self._tail
        held = max((k for k in range(1, len(tail) + 1) for s in self.params.stop if tail.endswith(s[:k])), default=0)
        return n - held

    def fail(self, message: str) -> None:
        """End the request with finish_reason "error" (its sampling or stop check raised); keeps the tokens so far."""
        if not isinstance(message, str) or not message:
            raise TypeError(f"fail() needs a non-empty message string, got {message!r}")
        self.finish_reason, self.error = "error", message
        self._flush()

    def update(self, token_id: int) -> bool:
        if self.finished:
            raise RuntimeError(f"update() after generation finished ({self.finish_reason})")
        self.token_ids.append(int(token_id))
        new = self._text.append(int(token_id)) if self._text is not None else ""
        if self.eos_id is not None and token_id == self.eos_id and not self.params.ignore_eos:
            self.finish_reason = "eos"
        elif self.params.stop and self._find_stop(new):
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.params.max_new_tokens:
            self.finish_reason = "length"
        if self.finished:
            self._flush()
        return self.finished

    def _flush(self) -> None:
        """The request ended: bytes still held back (a cut-off character) become text, searched like the rest."""
        if self._text is not None and self._stop_at is None:
            new = self._text.flush()
            if new and self.params.stop:
                self._find_stop(new)

    def _find_stop(self, new: str) -> bool:
        """Search the new characters, and the tail of the old ones a stop string could have started in."""
        if not new:
            return False
        window = self._tail + new
        base = len(self._text) - len(window)  # where the window starts in the text
        hits = [i for i in (window.find(s) for s in self.params.stop) if i >= 0]
        self._tail = window[-(self._max_stop - 1):] if self._max_stop > 1 else ""
        if hits:
            self._stop_at = base + min(hits)
            return True
        return False


@dataclass
class RequestState:
    """One request as every loop sees it: what to condition on, how to sample, and whether it is over.

    Built by `start_request` (never by hand in a loop), so the prompt is validated, `params.max_new_tokens` is
    capped by the context window, and the generator is seeded from `params.seed` on the loop's device. The output
    tokens live in the stop checker (`output_ids`); `accept` is the only way to add them.
    """

    prompt_ids: list[int]  # the validated prompt (the last tokens, if it was truncated)
    params: SamplingParams  # the request's params with max_new_tokens capped by the window
    generator: torch.Generator | None  # the request's own RNG (None = the global one: seed was None)
    stop_checker: StopChecker
    vocab_size: int | None = None  # the model's, set by `start_request`: `accept` refuses ids outside it

    @property
    def output_ids(self) -> list[int]:
        """Every accepted output token, in order (the stop checker's list: do not append to it)."""
        return self.stop_checker.token_ids

    @property
    def num_tokens(self) -> int:
        """Prompt plus accepted output tokens."""
        return len(self.prompt_ids) + len(self.stop_checker.token_ids)

    @property
    def finished(self) -> bool:
        return self.stop_checker.finished

    @property
    def finish_reason(self) -> str | None:
        """"length", "eos", "stop" or "error" once finished, else None."""
        return self.stop_checker.finish_reason

    @property
    def error(self) -> str | None:
        """Why the request failed (finish_reason "error"), else None."""
        return self.stop_checker.error

    def fail(self, message: str) -> None:
        """Finish the request with finish_reason "error" and `message` (which names the request and the cause)."""
        self.stop_checker.fail(message)

    def accept_or_fail(self, tokens: Sequence[int], what: str) -> bool:
        """`accept`, but an exception inside the stop check fails this request (message starts with `what`, which
        names it) instead of propagating to the loop: True when the request is finished, either way."""
        if not isinstance(what, str):  # the failure message's subject: checked before anything can fail
            raise TypeError(f"what must be a str naming the request, got {type(what).__name__}")
        if self.stop_checker.finished:  # a loop bug, not the request's: let it surface
            raise RuntimeError(f"accept() after the request finished ({self.stop_checker.finish_reason})")
        try:
            return self.accept(tokens)
        except Exception as exc:  # noqa: BLE001 - any failure is this request's alone; the message keeps its type
            self.fail(f"{what} failed in its stop check: {type(exc).__name__}: {exc}")
            return True

    def output_text(self) -> str:
        """The generated text, a hit stop string and what follows it cut off ("" without a tokenizer)."""
        return self.stop_checker.output_text()

    def accept(self, tokens: Sequence[int]) -> bool:
        """Append newly sampled tokens in order; True when the request is finished.

        One token per step for every loop up to chapter 07. Chapter 08's speculative decoding accepts several
        tokens at once: they are taken one by one, and at the first that finishes the request (eos, a stop string,
        max tokens, the window) the rest are dropped, exactly as if the tokens had come one step at a time.
        Accepting into a finished request is a RuntimeError (a loop that forgot to stop); a token that is no id
        (a bool, a float, a negative int, one past the vocabulary when it is known) is a ValueError naming it.
        """
        if self.stop_checker.finished:
            raise RuntimeError(f"accept() after the request finished ({self.stop_checker.finish_reason})")
        if not isinstance(tokens, (list, tuple)):
            raise TypeError(f"tokens must be a list of sampled token ids, got {type(tokens).__name__}")
        update, vocab = self.stop_checker.update, self.vocab_size
        for token in tokens:
            plain = plain_int(token)  # an int or a numpy int; never a bool or a float read as one
            if plain is None or plain < 0 or (vocab is not None and plain >= vocab):
                raise ValueError(f"sampled token {short_repr(token)} is no token id: an int (Python or numpy) in the "
                                 f"vocabulary [0, {vocab if vocab is not None else 'V'})")
            if update(plain):
                return True  # subtle: tokens after the finishing one are ignored, never appended
        return False

    def fork(self, seed: int | None, tokenizer: Any = None) -> "RequestState":
        """A fresh sibling for a parallel sample of the same prompt (chapter 05's n > 1): same prompt and params,
        no output yet, its own generator seeded with `seed` and its own stop checker."""
        device = self.generator.device if self.generator is not None else "cpu"
        checker = StopChecker(tokenizer if tokenizer is not None else self.stop_checker.tokenizer, self.params,
                              self.stop_checker.eos_id)
        return RequestState(self.prompt_ids, self.params, make_generator(seed, device), checker, self.vocab_size)


def start_request(
    model_config: GPTConfig,
    prompt_ids: Any,
    params: SamplingParams,
    tokenizer: Any = None,
    eos_id: int | None = None,
    *,
    device: torch.device | str = "cpu",
    truncate: bool = False,
) -> RequestState:
    """Validate one request against the model and build its state: the one way every loop starts a request.

    Raises TypeError/ValueError (with `validate_prompt`'s and `StopChecker`'s messages) for a bad prompt, params,
    eos_id, or stop strings without a tokenizer. `eos_id` defaults to the tokenizer's end-of-text token. A request
    with nothing to generate (max_new_tokens 0) comes back already finished, with finish_reason "length".
    """
    if not isinstance(model_config, GPTConfig):
        raise TypeError(f"model_config must be a GPTConfig, got {type(model_config).__name__}")
    ids, max_new = validate_prompt(prompt_ids, params, model_config.vocab_size, model_config.block_size, truncate)
    params = dataclasses.replace(params, max_new_tokens=max_new)  # the window cap, as vLLM caps max_tokens
    checker = StopChecker(tokenizer, params, eos_id)
    if max_new == 0:
        checker.finish_reason = "length"  # finished on arrival: nothing may be generated
    return RequestState(ids, params, make_generator(params.seed, device), checker, model_config.vocab_size)

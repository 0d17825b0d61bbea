"""Speculative decoding: a cheap proposer drafts γ tokens, the target checks them all in ONE forward.

What it adds over chapter 04's cached loop (one target forward per token): each round a proposer drafts γ tokens;
the target scores the γ+1 positions they open in a single multi-token decode step on its `ContiguousKVCache`;
`minillm.speculative.sampling` keeps a prefix of the drafts plus one token of the target's own, and both caches
roll back (`truncate`) to what was kept. A round costs one target forward (plus γ cheap draft forwards) and emits
1 to γ+1 tokens, always distributed as the target alone would emit them, greedy tokens identical. Two proposers:
a small draft model (`generate_speculative`, Leviathan et al. 2023; Chen et al. 2023) and prompt lookup
(`generate_prompt_lookup`: copy what followed the last n-gram where it occurred before; no second model, Saxena
2023). What it leaves out: batches and the engine (one request at a time, on contiguous caches), a trained draft
(chapter 11 distills one), and tree or adaptive-γ drafting.

Invariant of every round, for the sequence `seq` (prompt + emitted tokens, n = len(seq)):

    target cache: K/V of seq[:n-1]  (the last token is not in yet)      draft cache: K/V of seq[:L], L <= n-1
    draft:   feed seq[L:] then d1..d(γ-1), one forward each  ─▶ d1..dγ with distributions q (γ, V)
    verify:  feed [seq[n-1], d1..dγ] at positions n-1..n-1+γ  ─▶ target logits (γ+1, V), ONE forward
    accept:  k drafts kept + 1 target token ─▶ seq grows by k+1; truncate the target cache to n+k, the draft's
             to min(its length, n+k)   (all γ kept: the draft never saw dγ, it catches up next round)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from minillm.core.config import (GPTConfig, check_device, check_float_tensor, check_has_data, check_int,
                                 check_tensor_elements, is_float_compute, plain_int, short_repr, tensor_kind)
from minillm.core.model import GPT, require_model
from minillm.core.sampling import SamplingParams, probs_from_logits, sample_next
from minillm.core.stopping import RequestState, check_eos_id, check_token_ids, start_request
from minillm.kvcache.cache import ContiguousKVCache
from minillm.speculative.sampling import (accept_greedy, accept_or_resample, check_distributions, check_draft_tokens,
                                         check_generator)


@dataclass
class SpeculativeStats:
    """What one speculative run did; forwards are counted after the prompt's prefill."""

    target_calls: int = 0  # target verify forwards (each scores γ+1 positions, or 1 when nothing was drafted)
    draft_calls: int = 0  # draft-model forwards (0 for prompt lookup)
    proposed: int = 0  # draft tokens proposed in total
    accepted: int = 0  # draft tokens the acceptance rule kept (before the stop check cut the output)
    num_tokens: int = 0  # tokens emitted (the output's length)
    finish_reason: str | None = None  # the request's: "length", "eos" or "stop"

    def __post_init__(self) -> None:
        """Counts are ints >= 0 (accepted at most proposed) and finish_reason a str or None, checked when a record
        is built by hand: the loops count up from the zeros (a TypeError / ValueError naming the field)."""
        for name in ("target_calls", "draft_calls", "proposed", "accepted", "num_tokens"):
            setattr(self, name, check_int(f"SpeculativeStats.{name}", getattr(self, name), 0))
        if self.accepted > self.proposed:
            raise ValueError(f"SpeculativeStats.accepted={self.accepted} is more than proposed={self.proposed}")
        if self.finish_reason is not None and not isinstance(self.finish_reason, str):
            raise TypeError(f"SpeculativeStats.finish_reason must be a str or None, got "
                            f"{type(self.finish_reason).__name__}")

    @property
    def acceptance_rate(self) -> float:
        """α: the fraction of proposed draft tokens kept (0.0 when nothing was proposed)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_target_call(self) -> float:
        """Emitted tokens per target forward: 1.0 is plain decoding, γ+1 the most a round can give."""
        return self.num_tokens / self.target_calls if self.target_calls else 0.0


MAX_GAMMA = 64  # draft tokens per round: far past any useful γ (the expected tokens per round saturate near 1/(1-α))


def check_gamma(gamma: object, name: str = "gamma") -> int:
    """γ, the number of draft tokens per round: an int in [1, MAX_GAMMA], else TypeError/ValueError naming it
    (`name`: the caller's argument)."""
    gamma = check_int(name, gamma, 1)
    if gamma > MAX_GAMMA:  # type: ignore[operator]
        raise ValueError(f"{name} must be at most {MAX_GAMMA} draft tokens per round, got {gamma}")
    return gamma  # type: ignore[return-value]


def _forward(model: GPT, cache: ContiguousKVCache, tokens: list[int], start: int) -> torch.Tensor:
    """Feed `tokens` at positions start.. into `cache` (which must hold exactly `start` slots); logits (T, V)."""
    assert cache.length == start, f"cache holds {cache.length} slots, the tokens start at {start}"
    idx = torch.tensor([tokens], dtype=torch.long, device=model.device)  # (1, T)
    positions = torch.arange(start, start + len(tokens), device=model.device)  # (T,)
    h = model.hidden(idx, positions, cache)  # (1, T, C): unchecked, the request was validated at the entry
    return model.logits(h[0])  # (T, C) -> (T, V)


def check_params(params: object) -> SamplingParams:
    """A copy of `params` with every field re-checked: SamplingParams is a mutable dataclass checked in its
    `__post_init__`, so a field set afterwards (top_k=-3, max_new_tokens='8') would be used as it is; TypeError /
    ValueError naming params or the field otherwise."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__} {short_repr(params)}")
    return dataclasses.replace(params)  # re-runs __post_init__


def sample_draft(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None, step: int
                 ) -> tuple[int, torch.Tensor]:
    """A draft token drawn from the draft model's logits (1, V) with the request's processors (the same as the
    target's p), and the distribution q (V,) it was drawn from; greedy params take the argmax (q one-hot there),
    as the eager proposer does. logits must be a float tensor (1, V) with V >= 1, params a SamplingParams
    (re-checked: `check_params`), generator None or a torch.Generator on the logits' device, step an int >= 0:
    TypeError/ValueError naming them otherwise; a ValueError naming the draft model when q is not finite (its
    logits NaN or inf, or every token masked), before torch.multinomial would fail naming neither."""
    check_float_tensor("logits", logits, ndim=2)
    if logits.size(0) != 1 or logits.size(1) == 0:
        raise ValueError(f"logits must have shape (1, V) with V >= 1, the draft's last position, got "
                         f"{tuple(logits.shape)}")
    params = check_params(params)
    check_generator(generator, logits.device)
    step = check_int("step", step, 0)
    if params.is_greedy:
        tok = int(torch.argmax(logits[0]))  # sample_next's greedy pick (first index on ties)
        q = torch.zeros(logits.size(1), device=logits.device)  # (V,) a point mass: the draft is deterministic
        q[tok] = 1.0
        return tok, q
    q = probs_from_logits(logits, params)  # (1, V)
    if not bool(torch.isfinite(q).all()):
        raise ValueError(f"the draft model's distribution q at draft step {step} holds NaN (its logits are NaN or "
                         "inf, or mask every token): the draft cannot propose")
    return int(torch.multinomial(q, 1, generator=generator)), q[0]


class DraftModelProposer:
    """Drafts γ tokens autoregressively with a small model and its own cache, sampled with the request's params.
    The cache holds `max_len` tokens, at most the draft's context window (block_size)."""

    def __init__(self, draft: GPT, max_len: int):
        cfg = require_model(draft, "DraftModelProposer (draft)")
        max_len = check_int("max_len", max_len, 1)
        if max_len > cfg.block_size:  # the draft sees no position past its window: the cache needs no more slots
            raise ValueError(f"max_len={max_len} is past the draft's context window block_size={cfg.block_size}")
        self.model = draft
        self.cache = ContiguousKVCache(draft.config, 1, max_len, device=draft.device)
        self.calls = 0

    def prefill(self, prompt: list[int]) -> None:
        """Start a request: empty the cache and feed all of the prompt but its last token (at least one token id,
        each in the draft's vocabulary, at most max_len of them)."""
        prompt = check_prompt_ids(prompt, self.model.config.vocab_size, self.cache.max_len, "the draft cache's")
        self.cache.reset()  # a second prefill starts over, as the fused proposer's does
        if len(prompt) > 1:  # the cache holds all but the last token, as the target's does
            _forward(self.model, self.cache, prompt[:-1], 0)

    def propose(self, seq: list[int], gamma: int, state: RequestState) -> tuple[list[int], torch.Tensor | None]:
        """γ draft tokens and the distributions q (γ, V) they were drawn from (None in greedy mode: not needed).
        A TypeError / ValueError naming seq, gamma or state when they are not the sequence so far (past what the
        cache holds, its new ids in the vocabulary), a γ whose drafts fit the cache, and a RequestState."""
        feed, gamma = check_draft_feed(seq, gamma, state, self.cache.length, self.cache.max_len,
                                       self.model.config.vocab_size)
        params, tokens, q_rows = state.params, [], []
        start = self.cache.length  # feed: 1 token, or 2 after a round that kept all γ
        for _ in range(gamma):
            logits = _forward(self.model, self.cache, feed, start)[-1:]  # (1, V): the last fed position only
            self.calls += 1
            if params.is_greedy:
                tok = int(sample_next(logits, params))
            else:
                tok, q = sample_draft(logits, params, state.generator, len(tokens))
                q_rows.append(q)
            tokens.append(tok)
            start, feed = start + len(feed), [tok]
        # subtle: dγ is never fed (nobody needs its logits); the cache stays one token short if all γ are kept.
        return tokens, (torch.stack(q_rows) if q_rows else None)  # (γ, V)

    def rollback(self, length: int) -> None:
        """Forget every cached token past the first `length` (an int >= 0; more than are cached keeps them all)."""
        length = check_int("length", length, 0)
        self.cache.truncate(min(self.cache.length, length))


def _check_propose_args(seq: object, state: object) -> None:
    if not isinstance(seq, list):
        raise TypeError(f"seq must be the sequence so far (a list of token ids), got {type(seq).__name__}")
    if not isinstance(getattr(state, "params", None), SamplingParams):  # duck-typed: the tests pass stand-ins
        raise TypeError(f"state must be the request's RequestState, got {type(state).__name__}")


def check_prompt_ids(prompt: object, vocab_size: int, max_len: int | None = None, whose: str = "the") -> list[int]:
    """A proposer's prefill prompt: at least one token id, each in [0, vocab_size), at most `max_len` of them when
    given (`whose` names the cache in the message); the ids as a list, or a TypeError / ValueError naming prompt."""
    if max_len is not None:
        max_len = check_int("max_len", max_len)
    prompt = check_token_ids("prompt", prompt, check_int("vocab_size", vocab_size))
    if not prompt:
        raise ValueError("prompt must hold at least one token, got []")
    if max_len is not None and len(prompt) > max_len:
        raise ValueError(f"prompt has {len(prompt)} tokens, more than {whose} max_len={max_len}")
    return prompt


def check_draft_feed(seq: object, gamma: object, state: object, cached: int, max_len: int, vocab_size: int
                     ) -> tuple[list[int], int]:
    """A draft model's propose arguments checked before its first forward: (the tokens to feed, γ as a plain int).
    seq must be the sequence so far, a list longer than the `cached` tokens the draft's cache holds (the feed: one
    token, or two after a round that kept all γ) whose new ids are in [0, vocab_size); γ as `check_gamma`, its
    drafts fitting the cache (the feed and γ - 1 drafts are written: the last draft is never fed); state a
    RequestState. A TypeError / ValueError naming seq, gamma or state otherwise, not an IndexError in the embedding
    or "cache full" a forward later. Only the feed's ids are checked: the rest was checked when it was fed."""
    cached, max_len = check_int("cached", cached, 0), check_int("max_len", max_len)
    vocab_size = check_int("vocab_size", vocab_size)
    _check_propose_args(seq, state)
    gamma = check_gamma(gamma)
    seq_len = len(seq)  # type: ignore[arg-type]
    if seq_len <= cached:
        raise ValueError(f"seq has {seq_len} tokens but the draft's cache already holds {cached}: seq must be the "
                         "whole sequence so far, prefilled and longer than what the draft has fed")
    feed = check_token_ids(f"seq[{cached}:]", seq[cached:], vocab_size)  # type: ignore[index]
    needed = cached + len(feed) + gamma - 1
    if needed > max_len:
        raise ValueError(f"gamma={gamma} drafts after {seq_len} tokens need {needed} slots of the draft's cache, "
                         f"more than its max_len={max_len}: a smaller gamma or a longer draft cache")
    return feed, gamma


class PromptLookupProposer:
    """Drafts by copying what followed the most recent earlier occurrence of the last n-gram; no model at all."""

    def __init__(self, ngram: int, vocab_size: int, device: torch.device):
        ngram = check_int("ngram", ngram, 1)
        vocab_size = check_int("vocab_size", vocab_size, 1)
        check_tensor_elements("vocab_size", (vocab_size,))  # a row of the one-hot q of sampling mode
        self.ngram = ngram  # check_int's plain int: `lookup` takes nothing else
        self.vocab_size = vocab_size  # for the one-hot q of sampling mode
        self.device = check_device("device", device, allocates=True)  # its one-hot q is made there
        self.calls = 0  # never a forward

    def prefill(self, prompt: list[int]) -> None:
        """Nothing to feed (no model); the prompt is checked as the draft proposers check theirs."""
        check_prompt_ids(prompt, self.vocab_size)

    def propose(self, seq: list[int], gamma: int, state: RequestState) -> tuple[list[int], torch.Tensor | None]:
        """Up to γ tokens copied from seq (`lookup`), and their one-hot q (γ, V) when sampling. seq (a non-empty
        list), gamma (`check_gamma`) and state are checked; seq's ids only where a draft is copied from."""
        _check_propose_args(seq, state)  # two type tests
        gamma = check_gamma(gamma)
        if not seq:
            raise ValueError("seq must be the sequence so far: at least one token, got []")
        tokens = lookup(seq, gamma, self.ngram)  # subtle: not prompt_lookup_proposals, whose check of every token
        # of seq (hundreds) each round was 5% of a fused round; seq is a copy of the round loop's list
        plain = [plain_int(t) for t in tokens]  # a Python or numpy int as the plain int; None for 2.5, True, None
        for t, p in zip(tokens, plain):  # copied from seq: a bad id there (or no id at all) would come back as a draft
            if p is None:
                raise ValueError(f"seq holds {short_repr(t)} where a token id in [0, {self.vocab_size}) belongs: "
                                 "a draft is copied from it")
            if not 0 <= p < self.vocab_size:
                raise ValueError(f"seq holds token id {short_repr(t)}, outside the vocabulary [0, {self.vocab_size})")
        tokens = plain  # type: ignore[assignment]
        if not tokens or state.params.is_greedy:
            return tokens, None
        # A copied draft is a point mass: q = one-hot, so a token is kept with probability p(x) and a rejection
        # resamples from p without x, which keeps the output distributed as p (the same rule, q deterministic).
        check_tensor_elements("gamma x vocab_size", (len(tokens), self.vocab_size))  # before the allocation
        q = torch.zeros(len(tokens), self.vocab_size, device=self.device)  # (γ, V)
        q[torch.arange(len(tokens), device=self.device), torch.tensor(tokens, device=self.device)] = 1.0
        return tokens, q

    def rollback(self, length: int) -> None:
        """Nothing to cut back (no cache); length is checked as the draft proposers check it."""
        check_int("length", length, 0)


def prompt_lookup_proposals(ids: list[int], gamma: int, ngram: int = 3) -> list[int]:
    """Up to γ tokens that followed the most recent earlier occurrence of the last `ngram` tokens of `ids`.

    Example: ids [1, 2, 3, 9, 1, 2], ngram 2 -> the last bigram (1, 2) occurred at index 0, followed by 3, 9, 1, 2,
    so γ = 3 gives [3, 9, 1]. No earlier occurrence (or ids shorter than ngram + 1): [] (the caller then takes a
    plain one-token step). Saxena 2023, "Prompt Lookup Decoding"; Hugging Face's `prompt_lookup_num_tokens`.
    """
    gamma = check_gamma(gamma)
    ngram = check_int("ngram", ngram, 1)
    if not isinstance(ids, (list, tuple)):
        raise TypeError(f"ids must be a list of ints, got {type(ids).__name__}")
    plain = []  # the plain ints the ids hold: an int subclass's own comparisons are never consulted
    for pos, tok in enumerate(ids):  # what is copied comes back as drafts: only token ids may
        if not isinstance(tok, int) or isinstance(tok, bool):
            raise TypeError(f"ids[{pos}] must be an int token id, got {type(tok).__name__} {short_repr(tok)}")
        plain.append(int.__index__(tok))
        if not 0 <= plain[-1] < 2**63:
            raise ValueError(f"ids[{pos}] = {short_repr(plain[-1])} is not a token id (an int64 >= 0)")
    return lookup(plain, gamma, int.__index__(ngram))


def lookup(ids: list[int], gamma: int, ngram: int) -> list[int]:
    """`prompt_lookup_proposals` without its checks: the search itself, called every round by `PromptLookupProposer`
    on the round loop's own sequence (a checked prompt followed by the target's tokens). Only the argument types are
    checked (two isinstance calls: a TypeError naming ids or ngram rather than Python's own); the values are the
    caller's."""
    if not isinstance(ids, list) or type(ngram) is not int or type(gamma) is not int:
        raise TypeError(f"lookup takes ids as a list of token ids and gamma and ngram as ints, got "
                        f"{type(ids).__name__}, {type(gamma).__name__} and {type(ngram).__name__} "
                        "(prompt_lookup_proposals checks everything)")
    if ngram < 1 or gamma < 0:
        raise ValueError(f"lookup needs ngram >= 1 and gamma >= 0, got ngram={short_repr(ngram)}, "
                         f"gamma={short_repr(gamma)}")
    n = len(ids)
    if n <= ngram:
        return []
    tail = ids[n - ngram:]
    for start in range(n - ngram - 1, -1, -1):  # most recent first; the tail itself (start n - ngram) excluded
        # compare the n-gram's last token first: most starts fail there, without building a slice
        if ids[start + ngram - 1] == tail[-1] and ids[start:start + ngram] == tail:
            return ids[start + ngram:start + ngram + gamma]  # at least one token: start + ngram <= n - 1
    return []


def _start(target: Any, prompt_ids: Any, params: SamplingParams, gamma: int, tokenizer: Any,
           eos_id: int | None) -> tuple[RequestState, int]:
    """The request's state and γ as the plain int it holds (the rounds compare it), every argument checked."""
    cfg = require_model(target, "speculative decoding (target)")
    gamma = check_gamma(gamma)
    check_eos_id(eos_id, cfg.vocab_size)
    params = check_params(params)  # a field mutated after construction reached '<' in start_request
    state = start_request(cfg, prompt_ids, params, tokenizer, eos_id, device=target.device)
    if params.n != 1:
        raise ValueError(f"speculative decoding runs one sequence; n={params.n} parallel samples are not supported")
    return state, gamma


@torch.inference_mode()
def _run(target: GPT, state: RequestState, proposer: Any, gamma: int) -> tuple[list[int], SpeculativeStats]:
    """The round loop on the eager target: its cache prefilled with the prompt but its last token, every verify one
    forward of the target over that cache (`run_rounds`)."""
    if state.finished:  # max_new_tokens == 0
        return run_rounds(state, proposer, gamma, None, None)
    prompt = state.prompt_ids
    max_len = len(prompt) + state.params.max_new_tokens - 1  # slots: everything but the last emitted token
    cache = ContiguousKVCache(target.config, 1, max(max_len, 1), device=target.device)
    if len(prompt) > 1:
        _forward(target, cache, prompt[:-1], 0)
    return run_rounds(state, proposer, gamma, cache, lambda tokens, start: _forward(target, cache, tokens, start))


def check_proposal(drafts: Any, q: Any, vocab_size: int, sampling: bool) -> tuple[list[int], torch.Tensor | None]:
    """A proposer's (drafts, q) as a round uses them: drafts int token ids in [0, vocab_size) (a list or a 1-D
    integer tensor; returned as a list), and when the request samples (`sampling`, a bool) and something was
    drafted, q a float tensor (len(drafts), vocab_size) of the distributions they were drawn from (otherwise q is
    not read and None is returned in its place). TypeError/
    ValueError naming the proposer's drafts or q, or sampling (a custom proposer's bad id was torch's IndexError in
    the embedding; a q of the wrong shape was reported as the target's p)."""
    if not isinstance(sampling, bool):  # 'no' read as True blamed q; None read as False skipped q's check
        raise TypeError(f"sampling must be a bool, got {type(sampling).__name__} {short_repr(sampling)}")
    drafts = check_draft_tokens(drafts, vocab_size, "the proposer's drafts")
    if not sampling or not drafts:
        return drafts, None  # nothing reads q: a greedy round compares argmaxes, and no draft has no distribution
    if not is_float_compute(q):
        raise TypeError(f"the proposer's q must be a float tensor ({len(drafts)}, V={vocab_size}), the distributions "
                        f"its {len(drafts)} drafts were drawn from, got {tensor_kind(q)}")
    check_has_data("the proposer's q", q)  # a sparse or meta q: named before its shape is read
    if tuple(q.shape) != (len(drafts), vocab_size):
        raise ValueError(f"the proposer's q must have shape ({len(drafts)}, V={vocab_size}), one distribution per "
                         f"draft, got {tuple(q.shape)}")
    check_distributions("the proposer's q", q)
    return drafts, q


def run_rounds(state: RequestState, proposer: Any, gamma: int, cache: Any,
               verify: Callable[[list[int], int], torch.Tensor] | None) -> tuple[list[int], SpeculativeStats]:
    """Draft, verify, accept, roll back, until the request finishes; returns (new token ids, stats).

    `cache`, a `ContiguousKVCache` of the target's config, holds its keys and values of every token but the
    sequence's last (its `truncate(n)` keeps the first n); `verify(tokens, start)` scores `tokens` at positions
    start.. in one call of the target, writing their keys and values at those slots, and returns their logits
    (len(tokens), V). Each proposal is checked (`check_proposal`, against the vocabulary of the cache's config)
    before the target sees it. Chapter 13's fused decoders run this same loop with their own verify
    (`minillm.compile.fused_speculative`).

    A proposer has `prefill(prompt)`, `propose(seq, gamma, state)` returning a tuple (drafts, q or None), and
    `rollback(length)` (and `calls`, its forwards, reported as stats.draft_calls: 0 when absent); propose gets a
    copy of the sequence, so changing it cannot corrupt the round. TypeError naming the proposer otherwise."""
    if not isinstance(state, RequestState):
        raise TypeError(f"state must be a RequestState (start_request's), got {type(state).__name__}")
    gamma = check_gamma(gamma)
    name = type(proposer).__name__
    for method in ("prefill", "propose", "rollback"):
        if not callable(getattr(proposer, method, None)):
            raise TypeError(f"the proposer ({name}) must have a {method}() method: a proposer has prefill(prompt), "
                            "propose(seq, gamma, state) and rollback(length)")
    stats = SpeculativeStats()
    if state.finished:  # max_new_tokens == 0
        stats.finish_reason = state.finish_reason
        return [], stats
    if not callable(getattr(cache, "truncate", None)) or not isinstance(getattr(cache, "config", None), GPTConfig):
        raise TypeError(f"cache must be a KV cache of the target's config (a ContiguousKVCache), got "
                        f"{type(cache).__name__}")
    if not callable(verify):
        raise TypeError(f"verify must be a function (tokens, start) -> logits, got {type(verify).__name__}")
    proposer.prefill(state.prompt_ids)
    seq = list(state.prompt_ids)
    while True:
        n = len(seq)
        remaining = state.params.max_new_tokens - len(state.output_ids)
        # Never draft past what may still be emitted: a round emits at most γ+1, and the verify's last position
        # n-1+γ must stay inside the cache and the context window (start_request capped max_new_tokens to it).
        g = min(gamma, remaining - 1)
        proposal = proposer.propose(list(seq), g, state) if g > 0 else ([], None)  # a copy: seq is the round's
        if not isinstance(proposal, tuple) or len(proposal) != 2:
            raise TypeError(f"the proposer's ({name}) propose() must return a pair (drafts, q or None), got "
                            f"{type(proposal).__name__} {short_repr(proposal)}")
        drafts, q = check_proposal(*proposal, cache.config.vocab_size, not state.params.is_greedy)
        if len(drafts) > g:  # as the engine's scheduler does: the first g are verified, the rest never were asked
            # for (the verify's positions, and the cache and window room behind them, were sized for g)
            drafts, q = drafts[:g], None if q is None else q[:g]
        logits = verify([seq[-1], *drafts], n - 1)  # (γ+1, V): ONE target call
        stats.target_calls += 1
        stats.proposed += len(drafts)
        if state.params.is_greedy:
            emitted = accept_greedy(logits, drafts, state.params)
        elif drafts:
            emitted = accept_or_resample(probs_from_logits(logits, state.params), q, drafts, state.generator)
        else:  # nothing drafted: a plain decode step, the same single draw the target alone would make
            emitted = [int(sample_next(logits, state.params, state.generator))]
        if not 1 <= len(emitted) <= len(drafts) + 1 or emitted[:-1] != drafts[:len(emitted) - 1]:
            # A broken acceptance rule (an exercise in progress) would otherwise loop forever or corrupt the cache.
            raise ValueError(f"the acceptance rule emitted {emitted} for drafts {drafts}: a round must emit a kept "
                             f"prefix of the drafts plus exactly one token of the target's")
        stats.accepted += len(emitted) - 1
        cache.truncate(n + len(emitted) - 1)  # keep seq[:n] + the kept drafts; the new last token is not in
        proposer.rollback(n + len(emitted) - 1)
        seq.extend(emitted)
        if state.accept(emitted):
            break
    stats.draft_calls = getattr(proposer, "calls", 0)
    stats.num_tokens = len(state.output_ids)
    stats.finish_reason = state.finish_reason
    return list(state.output_ids), stats


def generate_speculative(target: GPT, draft: GPT, prompt_ids: Any, params: SamplingParams, gamma: int = 4,
                         tokenizer: Any = None, eos_id: int | None = None) -> tuple[list[int], SpeculativeStats]:
    """Generate with a draft model proposing γ tokens per round; returns (new token ids, stats).

    The output is distributed exactly as `minillm.kvcache.generate.generate_ids(target, ...)` (greedy: the same
    tokens), whatever the draft. The draft must share the target's vocabulary and hold the request in its context.
    """
    state, gamma = _start(target, prompt_ids, params, gamma, tokenizer, eos_id)
    dcfg = require_model(draft, "speculative decoding (draft)")
    tcfg = target.config
    if dcfg.vocab_size != tcfg.vocab_size:
        raise ValueError(f"the draft's vocab_size={dcfg.vocab_size} differs from the target's "
                         f"vocab_size={tcfg.vocab_size}: their tokens must mean the same thing")
    max_len = max(len(state.prompt_ids) + state.params.max_new_tokens - 1, 1)
    if dcfg.block_size < min(max_len, tcfg.block_size):
        raise ValueError(f"the draft's block_size={dcfg.block_size} cannot hold this request "
                         f"({len(state.prompt_ids)} prompt + {state.params.max_new_tokens} new tokens)")
    if draft.device != target.device:
        raise ValueError(f"draft and target must be on one device, got {draft.device} and {target.device}")
    return _run(target, state, DraftModelProposer(draft, max_len), gamma)


def generate_prompt_lookup(target: GPT, prompt_ids: Any, params: SamplingParams, gamma: int = 4, ngram: int = 3,
                           tokenizer: Any = None, eos_id: int | None = None) -> tuple[list[int], SpeculativeStats]:
    """Generate with prompt-lookup drafts (`prompt_lookup_proposals`); returns (new token ids, stats).

    Rounds with no earlier match of the last n-gram are plain one-token steps. Output as the target alone gives.
    """
    ngram = check_int("ngram", ngram, 1)
    state, gamma = _start(target, prompt_ids, params, gamma, tokenizer, eos_id)
    return _run(target, state, PromptLookupProposer(ngram, target.config.vocab_size, target.device), gamma)

"""Speculative decoding on chapter 13's fused C++ step: chapter 08's rounds with every forward one C++ call.

What it adds: `generate_speculative_fused(target, draft, ...)`, where both models run as `FusedCPUDecoder`s: each
round the draft proposes γ tokens, one fused step each (`FusedCPUDecoder.verify` of one token, or of two when the
last round kept all γ and the draft catches up), the target scores the γ+1 positions in ONE C++ call
(`FusedDecoder::verify`: each block's products walk the weights once for all γ+1 rows), chapter 08's acceptance rule
keeps a prefix plus one token of the target's, and both caches roll back (`ContiguousKVCache.truncate`) to what was
kept. And `generate_prompt_lookup_fused(target, ...)`: the same rounds with chapter 08's prompt lookup as the
proposer (`PromptLookupProposer`: copy what followed the last n-gram; no draft model). The round loop and its
invariant are chapter 08's own (`minillm.speculative.generate.run_rounds`); only the verify differs. Greedy tokens
equal the target's own greedy output (`FusedCPUDecoder(target).generate_ids`, chapter 04's `generate_ids`); sampled
tokens follow the target's distribution (`accept_or_resample` on softmax probabilities; both tested). The stats are
chapter 08's `SpeculativeStats`.

Why: on the eager path a verify of γ+1 tokens costs about what one step costs (both pay ~150 operator calls), but so
does every draft step, whatever the draft's size: chapter 08 measures c, a draft step over a target step, near 0.3
for a draft with a sixth of the target's weights, which caps the speed-up. The fused step removes that per-call
cost, so a step costs about what streaming its weights costs: the draft's step falls to its share of the bytes,
and the verify of γ+1 rows to about one target step plus the arithmetic of the extra rows.

What it leaves out: batches and the engine (one request at a time, chapter 08's engine does speculation for many),
γ past MAX_GAMMA (15: a verify takes at most MAX_VERIFY = 16 rows), several parallel samples (n > 1), and adaptive γ
or tree drafts. Both decoders must be built beforehand (`FusedCPUDecoder(model)`), with caches long enough for the
request; their models must be in eval mode (a ValueError otherwise: a fused step has no dropout).
"""

from __future__ import annotations

from typing import Any

import torch

from minillm.compile.decode import check_eval_mode
from minillm.compile.fused_step import MAX_VERIFY, FusedCPUDecoder
from minillm.core.config import check_int
from minillm.core.sampling import SamplingParams
from minillm.core.stopping import RequestState, check_eos_id, start_request
from minillm.speculative.generate import (PromptLookupProposer, SpeculativeStats, check_draft_feed, check_prompt_ids,
                                         run_rounds, sample_draft)

MAX_GAMMA = MAX_VERIFY - 1  # drafts per round: the verify scores γ+1 rows in one C++ call of at most MAX_VERIFY


def check_fused_gamma(gamma: object) -> int:
    """γ, draft tokens per round: an int in [1, MAX_GAMMA], else TypeError/ValueError naming it."""
    gamma = check_int("gamma", gamma, 1)
    if gamma > MAX_GAMMA:  # type: ignore[operator]
        raise ValueError(f"gamma must be at most {MAX_GAMMA} draft tokens per round (the fused verify scores "
                         f"gamma + 1 <= {MAX_VERIFY} rows in one call), got {gamma}")
    return gamma  # type: ignore[return-value]


def _check_decoder(name: str, decoder: object) -> FusedCPUDecoder:
    """A FusedCPUDecoder whose model is in eval mode and unchanged since it was built; TypeError/ValueError naming
    `name` otherwise."""
    if not isinstance(decoder, FusedCPUDecoder):
        raise TypeError(f"{name} must be a FusedCPUDecoder (build one with FusedCPUDecoder(model)), got "
                        f"{type(decoder).__name__}")
    check_eval_mode(decoder.model, f"the fused speculative decoder's {name}")
    decoder.check_model_unchanged()  # once per request: the C++ step must still hold the model's tensors
    return decoder


def _prefill(decoder: FusedCPUDecoder, prompt: list[int]) -> None:
    """The decoder's cache reset and filled with the K/V of all but the prompt's last token (the last token is the
    first row of the first verify): up to MAX_VERIFY tokens in one C++ call (`verify`, as `FusedCPUDecoder.prefill`
    does), more by the model itself (PyTorch's GEMM is the right tool for many rows)."""
    decoder.cache.reset()
    body = prompt[:-1]
    if 1 <= len(body) <= MAX_VERIFY:
        decoder.verify(body)  # its logits are not needed: the K/V are
    elif body:
        decoder.model.hidden(torch.tensor([body]), torch.arange(len(body)), decoder.cache)  # (1, T-1): K/V only


class FusedDraftProposer:
    """Chapter 08's `DraftModelProposer` on the draft's fused step: γ tokens, one C++ call each (two tokens in one
    call after a round that kept all γ), sampled with the request's params; greedy takes the argmax. `draft` is
    checked as the speculative decoders check it (`_check_decoder`: a TypeError naming it unless a FusedCPUDecoder)."""

    def __init__(self, draft: FusedCPUDecoder):
        self.decoder = _check_decoder("draft", draft)
        self.calls = 0  # C++ calls of the draft

    def prefill(self, prompt: list[int]) -> None:
        """Reset the draft's cache and feed all of the prompt but its last token (ids in the draft's vocabulary,
        at most the decoder's max_len of them; a TypeError / ValueError naming prompt otherwise)."""
        decoder = self.decoder
        prompt = check_prompt_ids(prompt, decoder.model.config.vocab_size, decoder.max_len, "the draft decoder's")
        _prefill(decoder, prompt)  # all but the last token, as the target's cache

    def propose(self, seq: list[int], gamma: int, state: RequestState) -> tuple[list[int], torch.Tensor | None]:
        """γ draft tokens and the distributions q (γ, V) they were drawn from (None in greedy mode: not needed).
        seq, gamma and state are checked as the eager proposer checks them (`check_draft_feed`), γ also against
        the fused verify's MAX_GAMMA."""
        cache = self.decoder.cache
        feed, gamma = check_draft_feed(seq, check_fused_gamma(gamma), state, cache.length, self.decoder.max_len,
                                       self.decoder.model.config.vocab_size)
        if len(feed) > MAX_VERIFY:
            raise ValueError(f"seq has {len(feed)} tokens past the draft's cache, more than one fused call feeds "
                             f"({MAX_VERIFY}): prefill the draft first")
        params, tokens, q_rows = state.params, [], []
        for _ in range(gamma):
            logits = self.decoder.verify(feed)[-1:]  # (1, V): the last fed position only
            self.calls += 1
            if params.is_greedy:
                tok = int(torch.argmax(logits))  # sample_next's greedy pick, without its checks (a hot loop)
            else:
                tok, q = sample_draft(logits, params, state.generator, len(tokens))  # q (V,): the target's processors
                q_rows.append(q)
            tokens.append(tok)
            feed = [tok]
        # subtle: dγ is never fed (nobody needs its logits); the cache stays one token short if all γ are kept.
        return tokens, (torch.stack(q_rows) if q_rows else None)  # (γ, V)

    def rollback(self, length: int) -> None:
        """Forget every cached token past the first `length` (an int >= 0; more than are cached keeps them all)."""
        length = check_int("length", length, 0)
        cache = self.decoder.cache
        cache.truncate(min(cache.length, length))


def _start(target: FusedCPUDecoder, prompt_ids: Any, params: SamplingParams, gamma: int, tokenizer: Any,
           eos_id: int | None) -> tuple[RequestState, int]:
    """The request's state and γ as the plain int it holds, every argument checked (chapter 08's `_start` for a
    fused target): γ, the params (n = 1), eos_id, and room in the target decoder's cache."""
    gamma = check_fused_gamma(gamma)
    cfg = target.model.config
    check_eos_id(eos_id, cfg.vocab_size)
    state = start_request(cfg, prompt_ids, params, tokenizer, eos_id)
    if state.params.n != 1:
        raise ValueError(f"speculative decoding runs one sequence; params.n={state.params.n} parallel samples are "
                         "not supported")
    needed = max(len(state.prompt_ids) + state.params.max_new_tokens - 1, 1)
    if needed > target.max_len:
        raise ValueError(f"the target decoder's max_len={target.max_len} is too short for this request: it needs "
                         f"{needed} cache slots; build FusedCPUDecoder(target, max_len >= {needed})")
    return state, gamma


@torch.inference_mode()
def _run(target: FusedCPUDecoder, state: RequestState, proposer: Any, gamma: int
         ) -> tuple[list[int], SpeculativeStats]:
    """Chapter 08's round loop (`minillm.speculative.generate.run_rounds`, its invariant in that module's docstring)
    with the target's verify one fused C++ call over the decoder's own cache, which holds the tokens before
    `start` (the verify writes after them)."""
    if not state.finished:  # max_new_tokens == 0: nothing to prefill
        _prefill(target, state.prompt_ids)
    return run_rounds(state, proposer, gamma, target.cache, lambda tokens, start: target.verify(tokens))


def generate_speculative_fused(target: FusedCPUDecoder, draft: FusedCPUDecoder, prompt_ids: Any,
                               params: SamplingParams, gamma: int = 4, tokenizer: Any = None,
                               eos_id: int | None = None) -> tuple[list[int], SpeculativeStats]:
    """Generate with the draft's fused step proposing γ tokens per round and the target's fused verify checking them;
    returns (new token ids, stats). Both are `FusedCPUDecoder`s (two of them: two caches), their models in eval mode
    and sharing one vocabulary, the draft's cache long enough for the request.

    The output is distributed exactly as the target alone gives it (`FusedCPUDecoder(target).generate_ids`, chapter
    04's `generate_ids`); greedy, the same tokens.
    """
    target = _check_decoder("target", target)
    draft = _check_decoder("draft", draft)
    if draft is target:
        raise ValueError("draft and target must be two FusedCPUDecoders (each round rolls back two caches); build "
                         "another FusedCPUDecoder for the draft")
    tv, dv = target.model.config.vocab_size, draft.model.config.vocab_size
    if dv != tv:
        raise ValueError(f"the draft's vocab_size={dv} differs from the target's vocab_size={tv}: their tokens must "
                         "mean the same thing")
    state, gamma = _start(target, prompt_ids, params, gamma, tokenizer, eos_id)
    needed = max(len(state.prompt_ids) + state.params.max_new_tokens - 1, 1)
    if needed > draft.max_len:  # at most the draft's block_size: a draft with a shorter window fails here too
        raise ValueError(f"the draft decoder's max_len={draft.max_len} is too short for this request: it needs "
                         f"{needed} cache slots (a {len(state.prompt_ids)}-token prompt and max_new_tokens="
                         f"{state.params.max_new_tokens})")
    with target.exclusive(), draft.exclusive():  # one request per decoder at a time: each holds one cache
        return _run(target, state, FusedDraftProposer(draft), gamma)


def generate_prompt_lookup_fused(target: FusedCPUDecoder, prompt_ids: Any, params: SamplingParams, gamma: int = 4,
                                 ngram: int = 3, tokenizer: Any = None, eos_id: int | None = None
                                 ) -> tuple[list[int], SpeculativeStats]:
    """Generate with prompt-lookup drafts (chapter 08's `prompt_lookup_proposals`) verified by the target's fused
    step; returns (new token ids, stats). Rounds with no earlier match of the last n-gram are plain one-token
    steps. Output as the target alone gives (greedy: the same tokens)."""
    target = _check_decoder("target", target)
    ngram = check_int("ngram", ngram, 1)
    state, gamma = _start(target, prompt_ids, params, gamma, tokenizer, eos_id)
    with target.exclusive():  # one request at a time: the decoder holds one cache
        return _run(target, state, PromptLookupProposer(ngram, target.model.config.vocab_size, torch.device("cpu")),
                    gamma)

"""Speculative decoding inside chapter 06's continuous-batching engine: per-request drafts, one ragged verify step.

What it adds over `minillm.speculative.generate` (one request, contiguous caches) and chapter 06's `LLM` (one new
token per request per step): `SpeculativeLLM`, the same engine in which every request that samples this step may
append up to γ draft tokens to its entry. Chapter 06's scheduler picks the step as always; the drafts then fill the
token budget it left over, each on a slot of the paged pool (`BlockManager.append_slot`), never preempting anyone.
One ragged forward scores every request's [last token, d1..dk] together with the other requests' prompt chunks;
the acceptance rule (`accept_greedy`, or `accept_or_resample` with the request's own generator) keeps a prefix of
each request's drafts plus one token of the target's; the rejected positions are rolled back in the pool
(`BlockManager.truncate`) and in the request's `num_computed_tokens`; `RequestState.accept(emitted)` takes the
emitted tokens through the stop rules (eos, stop strings, max tokens may cut them). Greedy tokens are those of
`LLM` without speculation and of each request alone, preemption included.

    Scheduler.schedule (chapter 06, unchanged) ─▶ decodes (1 token each) │ prompt chunks │ admissions
    + drafts   each entry that samples: k = min(γ, max_new_tokens left - 1, budget left, free slots)
               drafted by prompt lookup (n-grams of its own tokens) or a draft model (its own contiguous cache)
    forward    ONE ragged step:  req A [a_last d1 d2 d3] │ req B [b_last] │ req C [prompt chunk ...]
               logits of the last 1+k rows of every entry that samples
    accept     A keeps d1 d2, emits d1 d2 t ─▶ A.num_computed = n + 2, block_manager.truncate(A, n + 2)
    rollback   the draft model's cache of A cut to n + 2 as well; A.state.accept([d1, d2, t])

Draft lengths are per request: k is 0 when prompt lookup finds no earlier n-gram, shrinks near max_new_tokens (a
step emits at most k + 1 tokens, and the verify's last position stays inside the window and the request's KV
budget), and shrinks when the step's token budget or the pool's free blocks run short. What it leaves out: drafts
for a batch in one draft-model forward (each request's draft runs at batch 1 on its own cache, so the draft's cost
grows with the number of running requests), tree drafts, and adapting γ to the measured acceptance or the load.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from minillm.core.config import check_choice, check_int, check_tensor_elements, short_repr, tensor_kind
from minillm.core.model import GPT, require_model
from minillm.core.sampling import probs_from_logits
from minillm.engine.config import EngineConfig
from minillm.engine.llm import LLM
from minillm.engine.request import Request
from minillm.engine.sampler import Sampler, check_step_logits
from minillm.engine.scheduler import (ScheduledRequest, Scheduler, SchedulerOutput, check_request_id,
                                      check_sample_entry, check_sampled_token, check_update_args)
from minillm.speculative.generate import MAX_GAMMA, DraftModelProposer, PromptLookupProposer, check_gamma
from minillm.speculative.sampling import accept_greedy, accept_or_resample, check_distributions, check_draft_tokens
from minillm.speculative.verify_cache import VerifyKVCache  # noqa: F401  (registers the "verify" attention backend)

METHODS = ("prompt-lookup", "draft-model")
logger = logging.getLogger("minillm.speculative")


@dataclass
class SpeculativeConfig:
    method: str = "prompt-lookup"  # who drafts: "prompt-lookup" (no second model) or "draft-model" (pass draft=)
    gamma: int = 4  # γ: the most draft tokens one request appends to one step
    ngram: int = 3  # prompt lookup: the length of the suffix searched for earlier in the request's tokens

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ValueError/TypeError naming the field unless every field is valid. Run at construction and again
        where the config is used (`SpeculativeLLM`): a dataclass's fields can be reassigned after __post_init__."""
        self.method = check_choice("SpeculativeConfig.method", self.method, METHODS)
        self.gamma = check_int("SpeculativeConfig.gamma", self.gamma, 1)  # the plain int: its comparisons cannot lie
        if self.gamma > MAX_GAMMA:
            raise ValueError(f"SpeculativeConfig.gamma must be at most {MAX_GAMMA}, got {self.gamma}")
        self.ngram = check_int("SpeculativeConfig.ngram", self.ngram, 1)


# ----------------------------------------------------------------------------------------------- drafters


class Drafter(Protocol):
    """Proposes draft tokens for one engine request and keeps whatever per-request state that needs."""

    num_forwards: int  # draft-model forwards so far (0 for prompt lookup)

    def propose(self, req: Request, k: int) -> tuple[list[int], torch.Tensor | None]:
        """Up to k tokens to follow req.all_token_ids, and (sampling mode) the distributions q (k, V) they came from."""

    def rollback(self, req: Request, num_tokens: int) -> None:
        """Forget any state past the first `num_tokens` tokens of the request (they are not, or no longer, real)."""

    def release(self, request_id: str) -> None:
        """Drop the request's state (it finished, was aborted or preempted)."""


def _check_request(req: object) -> None:
    if not isinstance(req, Request):
        raise TypeError(f"req must be an engine Request, got {type(req).__name__}")


class PromptLookupDrafter:
    """Chapter 08's `PromptLookupProposer` for every request: stateless, so rollback and release do nothing."""

    def __init__(self, ngram: int, vocab_size: int, device: torch.device):
        self.proposer = PromptLookupProposer(ngram, vocab_size, device)
        self.num_forwards = 0

    def propose(self, req: Request, k: int) -> tuple[list[int], torch.Tensor | None]:
        _check_request(req)
        k = check_gamma(k, "k")
        return self.proposer.propose(req.all_token_ids, k, req.state)

    def rollback(self, req: Request, num_tokens: int) -> None:
        """Nothing to cut back (no state); the arguments are checked as the draft model's drafter checks them."""
        _check_request(req)
        check_int("num_tokens", num_tokens, 0)

    def release(self, request_id: str) -> None:
        """Nothing to drop; request_id is checked (a str) as the draft model's drafter checks it."""
        check_request_id(request_id)


class DraftModelDrafter:
    """A draft model for every request, each with its own contiguous cache (chapter 08's `DraftModelProposer`).

    A request's draft cache is made at its first proposal (sized for its whole KV budget), catches up on the
    tokens it has not seen (the prompt, then the emitted tokens) inside `propose`, is cut back after each verify,
    and is dropped when the request leaves the running batch (recomputed, cheaply, if it comes back).
    """

    def __init__(self, draft: GPT):
        require_model(draft, "DraftModelDrafter (draft)")  # here, not at the first proposal
        self.model = draft
        self.states: dict[str, DraftModelProposer] = {}
        self.num_forwards = 0

    def propose(self, req: Request, k: int) -> tuple[list[int], torch.Tensor | None]:
        _check_request(req)
        k = check_gamma(k, "k")  # named as this method calls it, before the proposer names it gamma
        state = self.states.get(req.request_id)
        if state is None:
            state = self.states[req.request_id] = DraftModelProposer(self.model, max(req.max_kv_tokens, 1))
        before = state.calls
        try:
            return state.propose(req.all_token_ids, k, req.state)
        finally:
            self.num_forwards += state.calls - before

    def rollback(self, req: Request, num_tokens: int) -> None:
        """Cut the request's draft cache back to its first `num_tokens` (an int >= 0; TypeError / ValueError naming
        req or num_tokens otherwise); nothing when it has no draft cache."""
        _check_request(req)
        num_tokens = check_int("num_tokens", num_tokens, 0)
        state = self.states.get(req.request_id)
        if state is not None:
            state.rollback(num_tokens)

    def release(self, request_id: str) -> None:
        """Drop the request's draft cache (none kept for an unknown id); request_id must be a str."""
        self.states.pop(check_request_id(request_id), None)


# ----------------------------------------------------------------------------------------------- scheduling


@dataclass
class VerifyEntry(ScheduledRequest):
    """A scheduled request that feeds its last known token(s) and then k draft tokens, and samples all k + 1 rows.

    num_new_tokens counts the drafts too: the entry computes positions start .. start + num_new_tokens - 1, the
    last k of which hold draft_token_ids (slots appended for them in the block manager, not in the request).
    One built by hand is checked as far as the entry can see: ids are ints >= 0, draft_probs one row per draft,
    the known tokens it feeds inside its request. The vocabulary is the scheduler's to know: it checks every id a
    drafter proposes (`check_draft_tokens`), and the sampler refuses a hand-built id or q of another size, failing
    that request alone with a message naming it.
    """

    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None  # (k, V) the draft's q, sampling mode only

    def __post_init__(self) -> None:
        self.check_fields()  # request, num_new_tokens, start
        if not isinstance(self.draft_token_ids, list):
            raise TypeError(f"draft_token_ids must be a list of token ids, got {type(self.draft_token_ids).__name__}")
        for i, t in enumerate(self.draft_token_ids):  # the drafter's ids were checked (check_proposal); by hand, here
            if type(t) is not int or t < 0:
                raise ValueError(f"draft_token_ids[{i}] = {short_repr(t)} is no token id (an int >= 0)")
        k = len(self.draft_token_ids)
        if k >= self.num_new_tokens:  # the last known token scores the first draft: without one nothing verifies
            raise ValueError(f"num_new_tokens={self.num_new_tokens} must count the {k} drafts and at least one known "
                             "token before them")
        if self.draft_probs is not None:
            if not isinstance(self.draft_probs, torch.Tensor) or self.draft_probs.dim() != 2:
                raise TypeError(f"draft_probs must be the draft's q (k, V) or None, got "
                                f"{tensor_kind(self.draft_probs)}")
            if self.draft_probs.shape[0] != k:
                raise ValueError(f"draft_probs must have one row per draft ({k}), got {tuple(self.draft_probs.shape)}")
        self.check_span(self.num_new_tokens - k)  # the drafts are not the request's tokens yet
        self._drafts = tuple(self.draft_token_ids)  # what was checked: the list itself could still change in place
        self._checked = True  # its fields are fixed from here (CheckedFields)

    @property
    def num_drafts(self) -> int:
        return len(self._drafts)

    def drafts(self) -> list[int]:
        """The draft ids as checked; a ValueError when the draft_token_ids list was changed in place since (a
        grown, shrunk or edited list would feed the wrong tokens, or drop a known one)."""
        if tuple(self.draft_token_ids) != self._drafts:
            raise ValueError(f"this VerifyEntry's drafts changed in place since it was checked: it was built with "
                             f"{list(self._drafts)}, it now holds {short_repr(self.draft_token_ids)}")
        return list(self._drafts)

    @property
    def samples(self) -> bool:
        return self.start + self.num_new_tokens - self.num_drafts == self.request.num_tokens

    def fed_tokens(self) -> list[int]:
        """Its slice of the request's known tokens, then its drafts (which the request does not hold yet)."""
        drafts = self.drafts()
        return self.request.token_slice(self.start, self.start + self.num_new_tokens - len(drafts)) + drafts

    def sample_rows(self) -> range:
        """The last known token's row (it scores d1) and every draft's row (each scores the next): 1 + k rows."""
        n = self.num_new_tokens
        return range(n - 1 - self.num_drafts, n) if self.samples else range(0)


class SpeculativeScheduler(Scheduler):
    """Chapter 06's scheduler, then drafts on the entries that sample; after the forward, rollback of the rest.

    Invariants on top of chapter 06's (the tests check them after every step):
      S1. Drafts never preempt and never displace work: they take only the token budget and free blocks left
          after chapter 06's schedule (I4 holds with them: a step's tokens, drafts included, fit the budget).
      S2. A request drafts at most min(γ, max_new_tokens left - 1) tokens, so the verify's last position is
          inside its KV budget (`Request.max_kv_tokens`) and the context window.
      S3. Between steps the block manager holds slots for a request's known tokens at most (its length there ==
          num_block_tokens <= num_tokens): no draft slot outlives its step.

    A drafter that raises, or proposes something that is not k token ids (and, when sampling, their q (k, V)),
    costs only the speed-up: the request takes a plain step, the failure is counted (`num_drafter_failures`, in
    `SpeculativeLLM.stats()`) and the first one is logged (logger "minillm.speculative", with the exception's type
    and message), so speculation that silently stopped paying shows up.
    """

    def __init__(self, config: EngineConfig, block_manager, drafter: Drafter, gamma: int, vocab_size: int):
        super().__init__(config, block_manager)
        if not all(callable(getattr(drafter, name, None)) for name in ("propose", "rollback", "release")):
            raise TypeError(f"drafter must be a Drafter (propose, rollback and release methods), got "
                            f"{type(drafter).__name__}")
        self.drafter = drafter
        self.gamma = check_gamma(gamma)
        vocab_size = check_int("vocab_size", vocab_size)
        check_tensor_elements("vocab_size", (vocab_size,))  # the target's logits rows: one tensor row each
        self.vocab_size = vocab_size  # the target's: every draft token must be one of its ids
        self.num_proposed = 0  # draft tokens scheduled for verification
        self.num_accepted = 0  # of those, kept by the acceptance rule (before a stop rule cut the output)
        self.num_verifies = 0  # entries that verified at least one draft
        self.num_drafter_failures = 0  # proposals that raised or came back malformed (that request drafted nothing)

    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        budget = self.config.max_num_batched_tokens - out.num_batched_tokens
        for i, s in enumerate(out.scheduled):  # decodes first: they get the leftover budget in priority order
            if budget <= 0:
                break
            req = s.request
            k = min(self.gamma, req.params.max_new_tokens - len(req.output_token_ids) - 1, budget)  # S1, S2
            if not s.samples or k <= 0:
                continue
            try:
                drafts, q = self._checked_proposal(req, *self.drafter.propose(req, k))
            except Exception as exc:  # noqa: BLE001 - a failed proposal costs only the speed-up; a broken request
                self._drafter_failed(req, exc)  # fails in its own sampling below, with a message naming it
                continue
            drafts = self._append_draft_slots(req, drafts[:k], out)
            if not drafts:
                continue
            out.scheduled[i] = VerifyEntry(req, s.num_new_tokens + len(drafts), s.start, drafts,
                                           None if q is None else q[: len(drafts)])
            budget -= len(drafts)
            self.num_proposed += len(drafts)
            self.num_verifies += 1
        return out

    def _checked_proposal(self, req: Request, drafts: Any, q: Any) -> tuple[list[int], torch.Tensor | None]:
        """The drafter's (drafts, q), checked: token ids in the vocabulary, and when the request samples, q (k, V)
        of probability distributions. A ValueError/TypeError here is a drafter failure."""
        drafts = check_draft_tokens(drafts, self.vocab_size)
        if req.params.is_greedy or not drafts:
            return drafts, q
        if (not isinstance(q, torch.Tensor) or q.dim() != 2 or q.size(0) < len(drafts)
                or q.size(1) != self.vocab_size):
            raise ValueError(f"a sampling request's {len(drafts)} drafts need their distributions q "
                             f"({len(drafts)}, V={self.vocab_size}), got "
                             f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
        check_distributions("q", q[: len(drafts)])
        return drafts, q

    def _drafter_failed(self, req: Request, exc: Exception) -> None:
        """Count a failed proposal, drop the request's drafter state, and log the first failure of this engine."""
        self.drafter.release(req.request_id)
        self.num_drafter_failures += 1
        if self.num_drafter_failures == 1:
            logger.warning("drafter %s failed for request %r (%s: %s); that request took a plain step. Later "
                           "failures are only counted: stats()['num_drafter_failures']", type(self.drafter).__name__,
                           req.request_id, type(exc).__name__, exc)

    def _append_draft_slots(self, req: Request, drafts: list[int], out: SchedulerOutput) -> list[int]:
        """Slots for as many drafts as free blocks allow (S1); returns the drafts that got one.

        subtle: `append_slot` marks every earlier token computed, so with prefix caching a block full of this
        step's tokens is published before the forward writes it. No request can find it first: admissions were
        decided above, and the forward comes next. A block that a rollback leaves partial is unpublished again by
        `truncate`; a dropped full one keeps K/V that the forward did compute for exactly its tokens.
        """
        got: list[int] = []
        for tok in drafts:
            if not self.block_manager.can_append(req.request_id):
                break
            out.cow_pairs.extend(self.block_manager.append_slot(req.request_id, tok))
            got.append(tok)
        req.num_block_tokens += len(got)
        return got

    def update(self, out: SchedulerOutput, sampled: list[Any], now: float) -> list[Request]:
        """Roll back every verify entry to its kept drafts and accept its emitted tokens; plain entries as before.

        `sampled[i]` is, for a `VerifyEntry`, the list of tokens the acceptance rule emitted (kept drafts + one of
        the target's) or None if its verification failed; for a plain entry, chapter 06's token or None. The
        arguments are checked as chapter 06's (`check_update_args`), each entry's tokens as ids (`_checked_sample`),
        and `out` is claimed as chapter 06's (`claim`: the last schedule()'s output, updated once).
        """
        check_update_args(out, sampled, now)
        sampled = self.claim(out, sampled, self._checked_sample)
        plain_out, plain_sampled, finished = SchedulerOutput(), [], []
        for s, emitted in zip(out.scheduled, sampled):
            if not isinstance(s, VerifyEntry):
                plain_out.scheduled.append(s)
                plain_sampled.append(emitted)
                continue
            req = s.request
            if req.is_finished:  # aborted since the step was scheduled: nothing to advance
                continue
            assert req.num_computed_tokens == s.start
            if emitted is None:  # its verification raised (SpeculativeSampler.sample): it alone ends here
                req.finish()
                self._free_finished(req, finished)
                continue
            kept = len(emitted) - 1
            self.num_accepted += kept
            # K/V are right up to the last kept draft: the request's known tokens + `kept` drafts. The target's own
            # token (emitted[-1]) is not in the pool yet; the next step feeds it, like any decode.
            num_computed = req.num_tokens + kept
            self.block_manager.truncate(req.request_id, num_computed)
            req.num_computed_tokens = req.num_block_tokens = num_computed
            self.drafter.rollback(req, num_computed)
            if req.accept(emitted, now):  # the stop rules may cut `emitted`: eos, a stop string, max tokens
                self._free_finished(req, finished)
        for s in plain_out.scheduled:  # a plain entry that samples: its drafter state ends at its computed tokens
            if s.samples:
                self.drafter.rollback(s.request, s.start + s.num_new_tokens)
        done = self._advance(plain_out, plain_sampled, now)
        for req in done:
            self.drafter.release(req.request_id)
        if finished:
            gone = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in gone]
        return finished + done

    def _checked_sample(self, i: int, entry: ScheduledRequest, emitted: Any) -> Any:
        """sampled[i] as `update` reads it, where chapter 06's update wants it (`check_sample_entry`): a plain
        entry's token id, or a verify entry's non-empty list of emitted token ids (kept drafts + the target's), at
        most its drafts + 1; a TypeError / ValueError naming it."""
        if not isinstance(entry, VerifyEntry):
            return check_sample_entry(i, entry, emitted, lambda t, name: check_sampled_token(name, t, self.vocab_size))

        def emitted_ids(tokens: Any, name: str) -> list[int]:
            if not isinstance(tokens, list) or not 1 <= len(tokens) <= entry.num_drafts + 1:
                raise ValueError(f"{name} must be the list of 1..{entry.num_drafts + 1} tokens the acceptance rule "
                                 f"emitted for its verify entry, got {short_repr(tokens)}")
            return [check_sampled_token(f"{name}[{j}]", t, self.vocab_size) for j, t in enumerate(tokens)]

        return check_sample_entry(i, entry, emitted, emitted_ids)

    def check_invariants(self) -> None:
        """Chapter 06's checks, then S3 for every running request (the tests call it after every step)."""
        super().check_invariants()
        for r in self.running:
            held = self.block_manager.num_tokens(r.request_id)
            assert held == r.num_block_tokens, f"S3: {r.request_id!r} holds {held} slots, {r.num_block_tokens} known"
            assert r.num_block_tokens <= r.num_tokens, (
                f"S3: {r.request_id!r} holds {r.num_block_tokens} slots for its {r.num_tokens} known tokens")

    def _free_finished(self, req: Request, finished: list[Request]) -> None:
        self.block_manager.free(req.request_id)
        req.num_block_tokens = 0
        self.drafter.release(req.request_id)
        finished.append(req)

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        super()._preempt(victim, out)
        self.drafter.release(victim.request_id)

    def abort(self, request_id: str) -> Request | None:
        req = super().abort(request_id)
        self.drafter.release(request_id)
        return req


# ----------------------------------------------------------------------------------------------- sampling


class SpeculativeSampler(Sampler):
    """Chapter 06's sampler for plain entries; the acceptance rule on each verify entry's 1 + k rows.

    The forward needs nothing of its own: a `VerifyEntry` says what it feeds (`fed_tokens`, its drafts included)
    and which rows come back (`sample_rows`), so chapter 06's planner and executor run verify steps unchanged."""

    def sample(self, out: SchedulerOutput, logits: torch.Tensor) -> list[Any]:
        """Per entry: None (a prompt chunk that does not sample), a token (plain entry, chapter 06's sampling), or
        the list a verify entry emits (None if its verification raised: that request alone fails). out must be
        the step's SchedulerOutput and logits (R, V) its sampled rows, 1 + k for a verify entry with k drafts."""
        check_step_logits(out, logits, lambda s: s.num_drafts + 1 if isinstance(s, VerifyEntry) else 1)
        plain = SchedulerOutput()
        plain_rows: list[int] = []
        verify_rows: dict[int, torch.Tensor] = {}  # position in out.scheduled -> (1 + k, V)
        r = 0
        for i, s in enumerate(out.scheduled):
            if not s.samples:
                continue
            k = s.num_drafts if isinstance(s, VerifyEntry) else 0
            if k:
                verify_rows[i] = logits[r : r + k + 1]  # (1 + k, V)
            else:
                plain.scheduled.append(s)
                plain_rows.append(r)
            r += k + 1
        plain_tokens = iter(super().sample(plain, logits[plain_rows]) if plain.scheduled else [])  # (P, V) rows
        result: list[Any] = []
        for i, s in enumerate(out.scheduled):
            if i in verify_rows:
                result.append(self._verify(s, verify_rows[i]))
            else:
                result.append(next(plain_tokens) if s.samples else None)
        return result

    @staticmethod
    def _verify(s: VerifyEntry, logits: torch.Tensor) -> list[int] | None:
        """The acceptance rule on one entry's rows: the emitted tokens (kept drafts + one target token)."""
        req = s.request
        try:
            drafts = s.drafts()
            if req.params.is_greedy:
                emitted = accept_greedy(logits, drafts, req.params)
            else:  # the request's own generator: a seeded request repeats, batched or alone
                p = probs_from_logits(logits, req.params)  # (1 + k, V)
                emitted = accept_or_resample(p, s.draft_probs, drafts, req.generator)
            if not 1 <= len(emitted) <= len(drafts) + 1 or emitted[:-1] != drafts[: len(emitted) - 1]:
                raise ValueError(f"the acceptance rule emitted {emitted} for drafts {drafts}: a step must emit a "
                                 f"kept prefix of the drafts plus exactly one token of the target's")
            return emitted
        except Exception as exc:  # noqa: BLE001 - one request's failure, whatever it is, is its own
            req.state.fail(f"request {req.request_id!r} failed in verification: {type(exc).__name__}: {exc}")
            return None


# ----------------------------------------------------------------------------------------------- the engine


class SpeculativeLLM(LLM):
    """`LLM` with speculative decoding: same surface (`generate`, `add_request`, `step`, `abort`), fewer steps.

    `speculative` picks the drafter (prompt lookup by default); `draft` is the draft model for
    method="draft-model": it must share the target's vocabulary and device and hold each request in its window.
    Without a `config`, the engine's defaults with the "verify" attention backend (`minillm.speculative.
    verify_cache`), which batches the multi-token queries of verify steps; any backend gives the same tokens.
    """

    scheduler_cls = SpeculativeScheduler
    sampler_cls = SpeculativeSampler
    # n > 1 is refused (a ValueError naming n): LLM forks the samples from sample 0's one first-token row, but
    # here the step that ends a prompt may verify drafts too, and a fork would need its own drafts and rows.
    supports_parallel_sampling = False

    def __init__(self, model: GPT, tokenizer: Any = None, config: EngineConfig | None = None,
                 eos_id: int | None = None, speculative: SpeculativeConfig | None = None, draft: GPT | None = None):
        speculative = speculative if speculative is not None else SpeculativeConfig()
        if not isinstance(speculative, SpeculativeConfig):
            raise TypeError(f"speculative must be a SpeculativeConfig, got {type(speculative).__name__}")
        speculative.check()  # subtle: a field set after construction (c.method = "medusa") was never checked
        if (draft is None) != (speculative.method != "draft-model"):
            raise ValueError(f"method={speculative.method!r} with draft={'a model' if draft is not None else None}: "
                             "pass a draft model exactly when SpeculativeConfig.method is 'draft-model'")
        config = config if config is not None else EngineConfig(attention_backend="verify")
        # The drafter is built first, so that LLM.__init__ builds the speculative scheduler around it (the
        # `scheduler_cls` hook): the engine runs on the model's device (LLM.__init__ refuses any other).
        vocab_size = require_model(model, "SpeculativeLLM").vocab_size
        if draft is not None:
            dcfg = require_model(draft, "SpeculativeLLM (draft)")
            if dcfg.vocab_size != vocab_size:
                raise ValueError(f"the draft's vocab_size={dcfg.vocab_size} differs from the target's "
                                 f"vocab_size={vocab_size}: their tokens must mean the same thing")
            if draft.device != model.device:
                raise ValueError(f"the draft is on {draft.device} but the engine runs on {model.device}")
            self.drafter: Drafter = DraftModelDrafter(draft.eval())
        else:
            self.drafter = PromptLookupDrafter(speculative.ngram, vocab_size, model.device)
        self.speculative = speculative
        self.draft = draft
        super().__init__(model, tokenizer, config, eos_id)

    def _scheduler_kwargs(self) -> dict[str, Any]:
        return {"drafter": self.drafter, "gamma": self.speculative.gamma, "vocab_size": self.model.config.vocab_size}

    def max_request_tokens(self) -> int:
        limit = super().max_request_tokens()
        return limit if self.draft is None else min(limit, self.draft.config.block_size)

    def _check_fits(self, req: Request) -> None:
        super()._check_fits(req)
        if self.draft is not None and req.max_kv_tokens > self.draft.config.block_size:
            raise ValueError(f"request {req.request_id!r} may reach {req.max_kv_tokens} tokens, more than the "
                             f"draft's context window block_size={self.draft.config.block_size}")

    def stats(self) -> dict[str, Any]:
        """Chapter 06's counters plus the speculation's: drafts proposed and kept, verify entries, draft forwards,
        and proposals that failed (the drafter raised or returned something malformed: no drafts that step)."""
        s = self.scheduler
        assert isinstance(s, SpeculativeScheduler)
        return {**super().stats(), "num_proposed": s.num_proposed, "num_accepted": s.num_accepted,
                "num_verifies": s.num_verifies, "num_draft_forwards": s.drafter.num_forwards,
                "num_drafter_failures": s.num_drafter_failures,
                "acceptance_rate": s.num_accepted / s.num_proposed if s.num_proposed else 0.0}

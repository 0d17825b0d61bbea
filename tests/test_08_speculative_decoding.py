"""Chapter 08: speculative decoding emits what the target alone emits, greedy tokens exactly and sampled tokens in
distribution, whatever the draft; the acceptance rule on hand-computed examples; bad input. No test measures time.

The distribution test is a chi-square goodness-of-fit of many draws of `accept_or_resample` against the target's p,
run on the real rule and on planted wrong rules, so the test is shown able to fail.

Inside chapter 06's engine (the second half of this file): `SpeculativeLLM` against `LLM` without speculation and
each request alone. Exact token equality for greedy requests over many prompts and γ, with pools small enough to
force preemption (by recomputation and by swapping), with and without chunked prefill and prefix caching, mixed
max_tokens, eos and stop strings; seeded sampled requests repeating (and equal to the batch-1 loops when nothing
cuts their drafts); after every step the scheduler's and block manager's invariants plus the speculative ones (S1-S3
of `SpeculativeScheduler`). Also: the "verify" attention backend against the reference loop, bad configuration
values, a failing request among healthy ones, abort, and the engine's `runner_cls` hook.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minillm.speculative.sampling as spec_sampling
from helpers import EngineDriver, PoisonedParams, context_model, noisy_copy, random_prompts
from minillm import GPT, GPTConfig, load_tokenizer
from minillm.core.sampling import SamplingParams, probs_from_logits
from minillm.engine import LLM, EngineConfig, ModelRunner, Sampler, Scheduler
from minillm.kvcache.generate import generate, generate_ids
from minillm.naive.generate import collect
from minillm.paged import BlockManager, PagedBatch, PagedKVCache
from minillm.speculative import bench as spec_bench
from minillm.speculative import engine as spec_engine
from minillm.speculative import engine_bench
from minillm.speculative.engine import (
    DraftModelDrafter,
    SpeculativeConfig,
    SpeculativeLLM,
    SpeculativeScheduler,
    VerifyEntry,
)
from minillm.speculative.generate import (
    SpeculativeStats,
    generate_prompt_lookup,
    generate_speculative,
    prompt_lookup_proposals,
)
from minillm.speculative.sampling import (
    accept_greedy,
    accept_or_resample,
    acceptance_probability,
    residual_distribution,
    sample_from_target,
)
from minillm.speculative.verify_cache import VerifyKVCache

SMALL = dict(vocab_size=128, block_size=64, n_layer=2, n_head=2, n_embd=32)
GAMMAS = (1, 2, 4, 7)


@pytest.fixture(scope="module")
def models() -> dict[str, GPT]:
    target = context_model(GPTConfig(**SMALL), seed=0)
    return {
        "target": target,
        "stranger": context_model(GPTConfig(**SMALL), seed=1),  # a differently seeded model: almost never agrees
        "noisy": noisy_copy(target, 0.1, seed=5),  # agrees sometimes: partial acceptance, rollbacks of both caches
        "self": target,  # the target as its own draft: always agrees, every round keeps all γ plus the bonus
    }


PROMPTS = random_prompts(6, SMALL["vocab_size"], [1, 2, 5, 17], seed=3)


# ----- greedy: identical tokens ---------------------------------------------------------------------------------


@pytest.mark.graded(points=3, exercise="accept_greedy")
@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("which", ["stranger", "noisy", "self"])
def test_greedy_speculative_gives_the_target_alone_tokens(models, which, gamma):
    target, draft = models["target"], models[which]
    totals = SpeculativeStats()
    for prompt in PROMPTS:
        params = SamplingParams.greedy(24)
        want = generate_ids(target, prompt, params)  # chapter 04's cached loop on the target alone
        got, stats = generate_speculative(target, draft, prompt, params, gamma=gamma)
        assert got == want, f"prompt {prompt}, gamma {gamma}, draft {which}"
        assert stats.num_tokens == len(got) == 24 and stats.finish_reason == "length"
        assert stats.draft_calls <= stats.proposed + stats.target_calls and stats.accepted <= stats.proposed
        assert stats.num_tokens == stats.accepted + stats.target_calls  # each round: kept drafts + one target token
        for f in ("target_calls", "draft_calls", "proposed", "accepted"):
            setattr(totals, f, getattr(totals, f) + getattr(stats, f))
    if which == "self":
        assert totals.accepted == totals.proposed > 0  # never a rejection
    elif which == "noisy" and gamma > 1:
        assert 0 < totals.accepted < totals.proposed  # both paths ran: kept drafts and rejections with rollback
    if which == "stranger" and gamma == 4:
        assert totals.accepted < totals.proposed / 4


def test_speculative_on_each_device_gives_the_target_alone_tokens(models, device):
    """Greedy draft-model and prompt-lookup speculation on CUDA too (when there is one), against chapter 04's loop
    on the same device; seeded sampling repeats there."""
    target, draft = (copy.deepcopy(models[k]).to(device) for k in ("target", "noisy"))
    for prompt in PROMPTS:
        want = generate_ids(target, prompt, SamplingParams.greedy(20))
        assert generate_speculative(target, draft, prompt, SamplingParams.greedy(20), gamma=3)[0] == want, device
        assert generate_prompt_lookup(target, prompt, SamplingParams.greedy(20), gamma=3)[0] == want, device
    sp = SamplingParams(max_new_tokens=16, temperature=0.9, seed=7)
    first = generate_speculative(target, draft, PROMPTS[2], sp, gamma=3)[0]
    assert first == generate_speculative(target, draft, PROMPTS[2], sp, gamma=3)[0]


@pytest.mark.graded(points=1, exercise="accept_greedy")
@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("ngram", [1, 2, 3])
def test_greedy_prompt_lookup_gives_the_target_alone_tokens(models, gamma, ngram):
    target = models["target"]
    proposed = 0
    prompts = [p * 3 for p in PROMPTS[1:4]] + [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9]]  # repetitive, and one token
    for prompt in prompts:
        params = SamplingParams.greedy(20)
        want = generate_ids(target, prompt, params)
        got, stats = generate_prompt_lookup(target, prompt, params, gamma=gamma, ngram=ngram)
        assert got == want, f"prompt {prompt}, gamma {gamma}, ngram {ngram}"
        assert stats.draft_calls == 0 and stats.num_tokens == stats.accepted + stats.target_calls
        proposed += stats.proposed
    assert proposed > 0  # the repetitive prompts did draft


@pytest.mark.graded(points=1, exercise="accept_greedy")
def test_stops_eos_max_tokens_and_the_window(models):
    target = models["target"]
    prompt = PROMPTS[2]
    ref = generate_ids(target, prompt, SamplingParams.greedy(24))
    eos = ref[5]  # a token the target emits; the output must end at its first occurrence
    want, reason = collect(generate(target, prompt, SamplingParams.greedy(24), eos_id=eos))
    assert reason == "eos" and want[-1] == eos and len(want) <= 6
    for gamma in (2, 7):
        for run in (lambda p: generate_speculative(target, models["noisy"], prompt, p, gamma=gamma, eos_id=eos),
                    lambda p: generate_speculative(target, target, prompt, p, gamma=gamma, eos_id=eos),
                    lambda p: generate_prompt_lookup(target, prompt, p, gamma=gamma, ngram=1, eos_id=eos)):
            got, stats = run(SamplingParams.greedy(24))
            assert got == want and stats.finish_reason == "eos"
        # ignore_eos runs on to max tokens
        got, stats = generate_speculative(target, target, prompt, SamplingParams.greedy(24, ignore_eos=True),
                                          gamma, eos_id=eos)
        assert got == ref and stats.finish_reason == "length"
    for max_new in (0, 1, 2, 3, 9):
        params = SamplingParams.greedy(max_new)
        want = generate_ids(target, prompt, params)
        for gamma in (1, 4, 7):
            got, stats = generate_speculative(target, models["noisy"], prompt, params, gamma=gamma)
            assert got == want and len(got) == max_new, (max_new, gamma)
    # The context window caps generation as for the target alone (block_size 64: a 60-token prompt gets 5 tokens).
    long_prompt = random_prompts(1, SMALL["vocab_size"], [60], seed=9)[0]
    want = generate_ids(target, long_prompt, SamplingParams.greedy(50))
    for gamma in (1, 4, 7):
        got, stats = generate_speculative(target, models["self"], long_prompt, SamplingParams.greedy(50), gamma)
        assert got == want and len(got) == 5 and stats.finish_reason == "length"
        got, _ = generate_prompt_lookup(target, long_prompt, SamplingParams.greedy(50), gamma, ngram=1)
        assert got == want


@pytest.mark.graded(points=1, exercise=("accept_or_resample", "acceptance_probability", "residual_distribution"))
def test_seeded_sampling_repeats_and_stays_in_the_vocabulary(models):
    target, draft = models["target"], models["noisy"]
    params = SamplingParams(max_new_tokens=20, temperature=0.8, top_k=40, seed=7)
    a, sa = generate_speculative(target, draft, PROMPTS[3], params, gamma=3)
    b, sb = generate_speculative(target, draft, PROMPTS[3], params, gamma=3)
    assert a == b and sa == sb and len(a) == 20 and 0 < sa.accepted < sa.proposed
    c, _ = generate_prompt_lookup(target, PROMPTS[3] * 2, params, gamma=3, ngram=2)
    assert len(c) == 20 and all(0 <= t < SMALL["vocab_size"] for t in a + c)


# ----- the rule on hand-computed examples -----------------------------------------------------------------------


@pytest.mark.graded(points=2, exercise="residual_distribution")
def test_residual_distribution_by_hand():
    """p = [0.6, 0.3, 0.1], q = [0.2, 0.2, 0.6]: max(0, p - q) = [0.4, 0.1, 0.0], mass 0.5 -> [0.8, 0.2, 0.0].
    Where p == q the residual is all zero and rejection impossible; p itself comes back, never NaN."""
    p = torch.tensor([[0.6, 0.3, 0.1], [0.5, 0.25, 0.25]])
    q = torch.tensor([[0.2, 0.2, 0.6], [0.5, 0.25, 0.25]])
    got = residual_distribution(p, q)
    torch.testing.assert_close(got, torch.tensor([[0.8, 0.2, 0.0], [0.5, 0.25, 0.25]]), atol=1e-6, rtol=0)


@pytest.mark.graded(points=1, exercise="acceptance_probability")
def test_acceptance_probability_by_hand():
    """min(1, p/q): a draft token the target likes at least as much is always kept; one it likes half as much, half
    the time; one it never emits, never. Elementwise over any shape."""
    p_x = torch.tensor([0.5, 0.2, 0.1, 0.0, 0.3])
    q_x = torch.tensor([0.25, 0.2, 0.2, 0.4, 0.9])
    torch.testing.assert_close(acceptance_probability(p_x, q_x), torch.tensor([1.0, 1.0, 0.5, 0.0, 1 / 3]),
                               atol=1e-6, rtol=0)
    assert acceptance_probability(p_x.view(5, 1), q_x.view(5, 1)).shape == (5, 1)


@pytest.mark.graded(points=2, exercise="accept_greedy")
def test_accept_greedy_by_hand():
    logits = torch.tensor([[0.0, 1.0, 3.0], [2.0, 0.0, 1.0], [0.0, 5.0, 1.0]])  # argmax per row: 2, 0, 1
    assert accept_greedy(logits, [2, 0]) == [2, 0, 1]  # both kept, then the bonus
    assert accept_greedy(logits, [2, 1]) == [2, 0]  # second rejected: the target's own token instead
    assert accept_greedy(logits, [0, 0]) == [2]  # first rejected
    assert accept_greedy(logits[:1], []) == [2]  # nothing drafted: a plain greedy step


@pytest.mark.graded(points=2, exercise=("accept_or_resample", "acceptance_probability", "residual_distribution"))
def test_accept_or_resample_certain_cases():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    # q below p on the drafted tokens: p/q >= 1, always kept, then the bonus from p[2] (token 0 for sure)
    q = torch.tensor([[0.25, 0.25, 0.5], [0.0, 0.5, 0.5]])
    for _ in range(50):
        assert accept_or_resample(p, q, [0, 2], g) == [0, 2, 0]
    # p(x) = 0: always rejected; the residual of row 0 is norm(max(0, p - q)) = [0.5, 0.5, 0] -> token 0 or 1
    seen = {tuple(accept_or_resample(p, q, [2, 2], g)) for _ in range(100)}
    assert seen == {(0,), (1,)}


# ----- exactness of sampling: chi-square against the target's p -------------------------------------------------

# Upper 0.1% points of the chi-square distribution (dof 1..15), from standard tables (e.g. NIST/SEMATECH e-Handbook
# 1.3.6.7.4). The statistic exceeds them with probability 0.001 when the draws do follow p.
CHI2_999 = [10.828, 13.816, 16.266, 18.467, 20.515, 22.458, 24.322, 26.124, 27.877, 29.588, 31.264, 32.909, 34.528,
            36.123, 37.697]
# Draws per distribution test. The power is measured: at 5,000 draws the wrong rules planted below (and a bonus
# token drawn from the last draft row) score chi-square 220 to 11,000 (q/p) at the position they distort, against a
# critical value of about 37, while the right rule scores 11-25; 6,000 keeps that margin at a third of the time.
NUM_DRAWS = 6_000
V_SMALL = 16


def chi_square(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, float]:
    """(statistic, critical value at 0.1%) of observed counts against p; bins expecting < 5 draws are merged."""
    n = float(counts.sum())
    expected = p.double() * n
    small = expected < 5
    obs = torch.cat([counts.double()[~small], counts.double()[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    if exp[-1] < 5:  # merged bin still too small: fold it into the largest bin
        obs, exp = obs[:-1].clone(), exp[:-1].clone()
        obs[exp.argmax()] += counts.double()[small].sum()
        exp[exp.argmax()] += expected[small].sum()
    stat = float(((obs - exp) ** 2 / exp).sum())
    return stat, CHI2_999[len(exp) - 2]


@pytest.fixture(scope="module")
def p_and_q() -> tuple[torch.Tensor, torch.Tensor]:
    """p (3, V) and q (2, V) of two tiny models with a 16-token vocabulary at fixed prefixes (temperature 1.5, so
    many tokens have mass and p and q differ a lot: a wrong rule cannot hide)."""
    cfg = GPTConfig(**{**SMALL, "vocab_size": V_SMALL})
    target, draft = context_model(cfg, seed=0), context_model(cfg, seed=3)
    params = SamplingParams(temperature=1.5)
    prefix = torch.tensor([[3, 1, 4, 1, 5, 9, 2]])  # (1, 7)
    with torch.no_grad():
        p = probs_from_logits(target(prefix)[0, -3:], params)  # (3, V)
        q = probs_from_logits(draft(prefix)[0, -2:], params)  # (2, V)
    assert 0.2 < 0.5 * float((p[:2] - q).abs().sum(dim=-1).min()) < 0.9  # total variation: far apart, overlapping
    return p, q


def draw_emitted(p: torch.Tensor, q: torch.Tensor, seed: int, rule=accept_or_resample) -> list[list[int]]:
    """NUM_DRAWS runs of the rule, each with drafts drawn from q (as the draft would draw them)."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.stack([torch.multinomial(q[i], NUM_DRAWS, replacement=True, generator=g)
                          for i in range(q.size(0))], dim=1).tolist()  # (N, γ)
    return [rule(p, q, d, g) for d in drafts]


def position_counts(runs: list[list[int]], position: int, V: int) -> torch.Tensor:
    """Counts of the token emitted at `position`, over the runs that got that far."""
    toks = [r[position] for r in runs if len(r) > position]
    return torch.bincount(torch.tensor(toks, dtype=torch.long), minlength=V)


@pytest.mark.graded(points=4, exercise=("accept_or_resample", "acceptance_probability", "residual_distribution"))
def test_speculative_sampling_follows_the_target_distribution(p_and_q):
    """Every emitted position follows its p row: the first token (kept draft or residual), the second (among runs
    that kept the first, which do not depend on it here since p's rows are fixed), and the bonus token."""
    p, q = p_and_q
    runs = draw_emitted(p, q, seed=11)
    lengths = torch.bincount(torch.tensor([len(r) for r in runs]), minlength=4)
    assert lengths[1:].min() > 1000  # all three outcomes (reject first, reject second, bonus) are well sampled
    for pos in range(3):
        stat, critical = chi_square(position_counts(runs, pos, V_SMALL), p[pos])
        assert stat < critical, f"position {pos}: chi-square {stat:.1f} >= {critical}"
    # The naive twin passes the same test, as it must.
    g = torch.Generator().manual_seed(12)
    naive = torch.bincount(torch.tensor([sample_from_target(p, g) for _ in range(NUM_DRAWS)]), minlength=V_SMALL)
    stat, critical = chi_square(naive, p[0])
    assert stat < critical


@pytest.mark.parametrize("plant", ["q_over_p", "resample_from_p", "resample_from_q", "p_off_by_one"])
def test_the_distribution_test_rejects_planted_wrong_rules(p_and_q, monkeypatch, plant):
    """The same check on a wrong rule fails: accepting with q/p instead of p/q; resampling after a rejection from
    p (or q) instead of the residual norm(max(0, p - q)); or the off-by-one of reading the target's row i+1 for draft
    token i (the logits *after* the token instead of those that predicted it, the classic misaligned verify).
    (Leaving the residual unnormalized is not a bug here: torch.multinomial normalizes its weights.)"""
    p, q = p_and_q
    rule = spec_sampling.accept_or_resample
    if plant == "q_over_p":
        monkeypatch.setattr(spec_sampling, "acceptance_probability", lambda p_x, q_x: (q_x / p_x).clamp(max=1.0))
    elif plant == "resample_from_p":
        monkeypatch.setattr(spec_sampling, "residual_distribution", lambda p_i, q_i: p_i)
    elif plant == "resample_from_q":
        monkeypatch.setattr(spec_sampling, "residual_distribution", lambda p_i, q_i: q_i)
    else:  # every draft position i judged (and the bonus drawn) with the row one further on
        def misaligned(p_, q_, drafts, g):
            return spec_sampling.accept_or_resample(torch.cat([p_[1:], p_[-1:]]), q_, drafts, g)
        rule = misaligned
    runs = draw_emitted(p, q, seed=11, rule=rule)
    stat, critical = chi_square(position_counts(runs, 0, V_SMALL), p[0])
    assert stat > critical, f"planted {plant} was not rejected: chi-square {stat:.1f} < {critical}"


# ----- prompt lookup ----------------------------------------------------------------------------------------------


def test_prompt_lookup_proposals_by_hand():
    ids = [1, 2, 3, 9, 1, 2]
    assert prompt_lookup_proposals(ids, 3, ngram=2) == [3, 9, 1]  # (1, 2) at index 0, then 3, 9, 1
    assert prompt_lookup_proposals(ids, 9, ngram=2) == [3, 9, 1, 2]  # as many as follow
    assert prompt_lookup_proposals([7, 1, 2, 8, 1, 2, 5, 1, 2], 2, ngram=2) == [5, 1]  # the most recent occurrence
    assert prompt_lookup_proposals([4, 4, 4], 3, ngram=1) == [4]  # overlapping with the tail itself
    assert prompt_lookup_proposals([1, 2, 3], 4, ngram=3) == []  # the tail alone: nothing earlier
    assert prompt_lookup_proposals([1, 2, 3, 4], 4, ngram=2) == []  # no earlier match


# ----- bad input --------------------------------------------------------------------------------------------------


def test_bad_input_names_the_value(models):
    target, draft = models["target"], models["noisy"]
    params = SamplingParams.greedy(4)
    with pytest.raises(ValueError, match="gamma"):
        generate_speculative(target, draft, [1, 2], params, gamma=0)
    with pytest.raises(TypeError, match="gamma"):
        generate_speculative(target, draft, [1, 2], params, gamma=2.0)
    with pytest.raises(ValueError, match="gamma"):
        generate_prompt_lookup(target, [1, 2], params, gamma=-1)
    with pytest.raises(ValueError, match="ngram"):
        generate_prompt_lookup(target, [1, 2], params, gamma=2, ngram=0)
    other = context_model(GPTConfig(**{**SMALL, "vocab_size": 100}), seed=0)
    with pytest.raises(ValueError, match="vocab_size=100"):
        generate_speculative(target, other, [1, 2], params)
    short = context_model(GPTConfig(**{**SMALL, "block_size": 8}), seed=0)
    with pytest.raises(ValueError, match="block_size=8"):
        generate_speculative(target, short, [1, 2, 3, 4, 5, 6], params)
    with pytest.raises(TypeError, match="draft"):
        generate_speculative(target, "not a model", [1, 2], params)
    with pytest.raises(TypeError, match="SamplingParams"):
        generate_speculative(target, draft, [1, 2], {"temperature": 0})
    with pytest.raises(ValueError, match="n=2"):
        generate_speculative(target, draft, [1, 2], SamplingParams.greedy(4, n=2))
    with pytest.raises(ValueError, match="vocabulary"):
        generate_speculative(target, draft, [1, 999], params)
    p, q = torch.full((3, 4), 0.25), torch.full((2, 4), 0.25)
    with pytest.raises(ValueError, match=r"\(3, V\)"):
        accept_or_resample(p[:2], q, [0, 1])
    with pytest.raises(ValueError, match="draft_tokens has 1"):
        accept_or_resample(p, q, [0])
    with pytest.raises(ValueError, match="draft_tokens\\[1\\] = 4"):
        accept_or_resample(p, q, [0, 4])
    with pytest.raises(TypeError, match="draft_tokens\\[0\\]"):
        accept_or_resample(p, q, ["a", 1])
    with pytest.raises(TypeError, match="q must be a float tensor"):
        accept_or_resample(p, [[0.5, 0.5]], [0])
    with pytest.raises(ValueError, match="probability 0"):
        accept_or_resample(p, torch.tensor([[1.0, 0, 0, 0], [1.0, 0, 0, 0]]), [0, 1])
    with pytest.raises(ValueError, match="gamma"):
        prompt_lookup_proposals([1, 2, 3], 0)


# ===== inside the engine: SpeculativeLLM against LLM and each request alone =====================================

VOCAB = 512


@pytest.fixture(scope="module")
def model() -> GPT:
    # vocab 512, window 64, 2 layers; context-sensitive (tests/helpers.py), so a wrong cache changes the tokens
    return context_model("tiny", seed=1234)


@pytest.fixture(scope="module")
def draft(model) -> GPT:
    """A draft that agrees with the target often, not always: the target with noise on every weight."""
    d = copy.deepcopy(model)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3 * p.std())
    return d.eval()


def prompts_with_repeats(n: int, seed: int = 0, vocab: int = VOCAB) -> list[list[int]]:
    """Prompts of 1-30 tokens, most a short unit repeated (prompt lookup finds n-grams), every fourth random."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(1, 31, (1,), generator=g))
        if i % 4 == 3:
            out.append(torch.randint(0, vocab, (length,), generator=g).tolist())
            continue
        unit = torch.randint(0, vocab, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
        out.append((unit * 31)[:length])
    return out


def mixed_params(n: int, seed: int = 0) -> list[SamplingParams]:
    g = torch.Generator().manual_seed(seed + 100)
    return [SamplingParams.greedy(int(torch.randint(1, 33, (1,), generator=g))) for _ in range(n)]


class Driver(EngineDriver):
    """`EngineDriver` with the speculative invariants S1 and S2 checked on every step that ran."""

    def __init__(self, llm: LLM):
        super().__init__(llm)
        self.num_verifies = 0

    def after_step(self, sched) -> None:  # chapter 06's I1-I3, I9 and, for SpeculativeLLM, S3 ran in step()
        llm = self.llm
        if sched is not None and not sched.is_empty:
            assert sched.num_batched_tokens <= llm.config.max_num_batched_tokens  # S1: drafts fit the budget
            for s in sched.scheduled:
                if isinstance(s, VerifyEntry):  # S2: at most γ drafts, and never past what may still be emitted
                    self.num_verifies += 1
                    known_outputs = s.start + s.num_new_tokens - s.num_drafts - s.request.num_prompt_tokens
                    assert 1 <= s.num_drafts <= llm.speculative.gamma
                    assert s.num_drafts <= s.request.params.max_new_tokens - known_outputs - 1


def run_checked(llm: LLM, prompts, params) -> list[list[int]]:
    d = Driver(llm)
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    d.run()
    assert set(d.final) == set(ids), "a request was lost"
    return [d.final[rid] for rid in ids]


CONFIGS = {
    "roomy": EngineConfig(num_blocks=160, block_size=4, max_num_seqs=8, max_num_batched_tokens=64),
    "tiny-pool-recompute": EngineConfig(num_blocks=16, block_size=4, max_num_seqs=8, max_num_batched_tokens=16,
                                        attention_backend="verify"),
    "tiny-pool-swap": EngineConfig(num_blocks=16, block_size=4, max_num_seqs=8, max_num_batched_tokens=16,
                                   preemption_mode="swap", num_swap_blocks=8, attention_backend="verify"),
    "no-chunking": EngineConfig(num_blocks=20, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                                enable_chunked_prefill=False, attention_backend="verify"),
    "prefix-caching": EngineConfig(num_blocks=24, block_size=4, max_num_seqs=8, max_num_batched_tokens=12,
                                   enable_prefix_caching=True, attention_backend="verify"),
    "tight-budget": EngineConfig(num_blocks=64, block_size=8, max_num_seqs=6, max_num_batched_tokens=8,
                                 attention_backend="verify"),
}


@pytest.mark.parametrize("gamma", [1, 3, 6])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_prompt_lookup_greedy_equals_plain_engine_and_alone(model, name, gamma):
    prompts, params = prompts_with_repeats(16, seed=gamma), mixed_params(16, seed=gamma)
    if name == "prefix-caching":  # shared prefixes, so the cache actually hits
        prompts = [prompts[0][:9] + p for p in prompts]
    spec = SpeculativeLLM(model, None, CONFIGS[name], speculative=SpeculativeConfig(gamma=gamma, ngram=2))
    got = run_checked(spec, prompts, params)
    plain = LLM(model, None, CONFIGS[name]).generate(prompts, params)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        assert got[i] == plain[i].output_token_ids == generate_ids(model, p, sp), i
    stats = spec.stats()
    assert 0 < stats["num_accepted"] < stats["num_proposed"]  # drafts were kept and drafts were rolled back
    if name.startswith("tiny-pool"):
        assert stats["num_preemptions"] > 0  # the pool really was too small for everyone at once


@pytest.mark.parametrize("which", ["noisy-draft", "draft-is-target"])
@pytest.mark.parametrize("name", ["roomy", "tiny-pool-recompute", "tiny-pool-swap", "prefix-caching"])
def test_draft_model_greedy_equals_alone(model, draft, name, which):
    d = draft if which == "noisy-draft" else model
    prompts, params = prompts_with_repeats(12, seed=7), mixed_params(12, seed=7)
    spec = SpeculativeLLM(model, None, CONFIGS[name], speculative=SpeculativeConfig("draft-model", gamma=3), draft=d)
    got = run_checked(spec, prompts, params)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        assert got[i] == generate_ids(model, p, sp), i
    stats = spec.stats()
    assert stats["num_draft_forwards"] > 0
    if which == "draft-is-target":
        assert stats["num_accepted"] == stats["num_proposed"] > 0  # the target agrees with itself: all kept
    else:
        assert 0 < stats["num_accepted"] < stats["num_proposed"]
    drafter = spec.scheduler.drafter
    assert isinstance(drafter, DraftModelDrafter) and drafter.states == {}  # every request's draft cache dropped


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), n=st.integers(1, 12), block_size=st.sampled_from([2, 4, 8]),
       num_blocks=st.integers(12, 48), budget=st.integers(8, 40), gamma=st.integers(1, 7), ngram=st.integers(1, 3),
       mode=st.sampled_from(["recompute", "swap", "prefix"]), backend=st.sampled_from(["verify", "selective"]))
def test_random_workloads_equal_alone(model, seed, n, block_size, num_blocks, budget, gamma, ngram, mode, backend):
    prompts, params = prompts_with_repeats(n, seed=seed), mixed_params(n, seed=seed)
    need = max(-(-(len(p) + sp.max_new_tokens - 1) // block_size) for p, sp in zip(prompts, params))
    cfg = EngineConfig(num_blocks=max(num_blocks // block_size * 2, need), block_size=block_size, max_num_seqs=6,
                       max_num_batched_tokens=budget, preemption_mode="swap" if mode == "swap" else "recompute",
                       num_swap_blocks=8, enable_prefix_caching=mode == "prefix", attention_backend=backend)
    spec = SpeculativeLLM(model, None, cfg, speculative=SpeculativeConfig(gamma=gamma, ngram=ngram))
    got = run_checked(spec, prompts, params)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        assert got[i] == generate_ids(model, p, sp), i


@pytest.mark.parametrize("method", ["prompt-lookup", "draft-model"])
def test_eos_and_stop_strings_cut_the_emitted_tokens(method):
    """A stop string or eos that falls inside a step's kept drafts ends the request there, as in the plain engine.
    With the target as its own draft every draft is kept, so the stops land inside multi-token steps."""
    tok = load_tokenizer()
    m = context_model("tiny", seed=3, vocab_size=4096)
    prompts = [(u * 20)[:24] for u in ([101, 202, 303], [7, 8, 9, 10], [55, 66], [400, 401, 402, 403, 404])]
    roomy = EngineConfig(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    base = LLM(m, tok, roomy).generate(prompts, SamplingParams.greedy(30, ignore_eos=True))
    # a stop string from the middle of each request's own text, and an eos id from the middle of one output
    stops = [tok.decode(o.output_token_ids[12:14]) for o in base]
    eos = base[1].output_token_ids[10]
    params = [SamplingParams.greedy(30, stop=(s,)) if s.strip() else SamplingParams.greedy(30) for s in stops]
    plain = LLM(m, tok, roomy, eos_id=eos).generate(prompts, params)
    spec = SpeculativeLLM(m, tok, roomy, eos_id=eos, speculative=SpeculativeConfig(method, gamma=5, ngram=1),
                          draft=m if method == "draft-model" else None)
    d = Driver(spec)
    ids = [spec.add_request(p, sp) for p, sp in zip(prompts, params)]
    d.run()
    for rid, want in zip(ids, plain):
        got = d.outputs[rid]
        assert (got.output_token_ids, got.finish_reason, got.text) == (want.output_token_ids, want.finish_reason,
                                                                       want.text)
    assert {o.finish_reason for o in plain} == {"stop", "eos"}
    if method == "draft-model":
        assert spec.stats()["num_accepted"] > 0 and spec.num_steps < 30


def test_seeded_sampling_repeats_and_equals_the_batch_one_loops(model, draft):
    """Each request draws from its own generator: with room for every draft, the engine's tokens are chapter 08's
    batch-1 loops' tokens; through preemption (other draft lengths, other draws) a seeded run still repeats."""
    prompts = prompts_with_repeats(8, seed=11)
    params = [SamplingParams(max_new_tokens=6 + 3 * i, temperature=0.9, top_k=50, seed=40 + i) for i in range(8)]
    roomy = EngineConfig(num_blocks=160, block_size=4, max_num_seqs=8, max_num_batched_tokens=256)
    pl = SpeculativeLLM(model, None, roomy, speculative=SpeculativeConfig(gamma=3, ngram=1))
    dm = SpeculativeLLM(model, None, roomy, speculative=SpeculativeConfig("draft-model", gamma=3), draft=draft)
    got_pl, got_dm = run_checked(pl, prompts, params), run_checked(dm, prompts, params)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        assert got_pl[i] == generate_prompt_lookup(model, p, sp, gamma=3, ngram=1)[0], i
        assert got_dm[i] == generate_speculative(model, draft, p, sp, gamma=3)[0], i
    assert pl.stats()["num_proposed"] > 0 and dm.stats()["num_accepted"] > 0
    tiny = CONFIGS["tiny-pool-recompute"]
    runs = [run_checked(SpeculativeLLM(model, None, tiny, speculative=SpeculativeConfig(gamma=3, ngram=1)), prompts,
                        params) for _ in range(2)]
    assert runs[0] == runs[1]


def test_draft_lengths_near_max_tokens_and_without_matches(model):
    """k = min(γ, tokens still allowed - 1): no drafts for the last token, none when no n-gram occurred before."""
    cfg = EngineConfig(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    spec = SpeculativeLLM(model, None, cfg, speculative=SpeculativeConfig(gamma=6, ngram=1))
    d = Driver(spec)
    spec.add_request([5, 6] * 8, SamplingParams.greedy(3))  # at most 2 drafts, then 1, then none
    spec.add_request([9, 8, 7], SamplingParams.greedy(1))  # one token: never a draft
    spec.add_request(list(range(20, 40)), SamplingParams.greedy(1))  # no repeated token in the prompt
    first = True
    while spec.has_unfinished():
        d.step()
        drafts = {s.request.request_id: s.num_drafts for s in spec.last_schedule.scheduled
                  if isinstance(s, VerifyEntry)}
        assert set(drafts) <= {"req-0"}
        if first:
            assert drafts == {"req-0": 2}  # 3 tokens allowed: the last prompt token 6 and 2 drafts ("5 6")
            first = False
    assert d.num_verifies >= 1


def test_verify_cache_equals_reference_loop():
    """The "verify" backend (short queries padded and batched) computes what chapter 05's reference loop does."""
    torch.manual_seed(0)
    from minillm.core.config import GPTConfig

    cfg = GPTConfig.from_name("tiny")
    bm = BlockManager(32, 4)
    lens = {"a": (9, 3), "b": (5, 1), "c": (30, 20), "d": (7, 7), "e": (13, 5)}  # id -> (context, new tokens)
    for sid, (ctx, _) in lens.items():
        bm.allocate(sid, list(range(ctx)))
    batch = PagedBatch.build(bm, [(sid, ctx - ql, ql) for sid, (ctx, ql) in lens.items()])
    N = batch.num_tokens
    q, k, v = (torch.randn(1, cfg.n_head, N, cfg.head_size) for _ in range(3))  # (1, nh, N, hs)
    ref, fast = PagedKVCache(cfg, 32, 4, use_fast_decode=False), VerifyKVCache(cfg, 32, 4)
    for cache in (ref, fast):
        for pool in cache.k_pools + cache.v_pools:  # the same earlier context in both
            pool.copy_(torch.randn(pool.shape, generator=torch.Generator().manual_seed(1)))
    outs = []
    for cache in (ref, fast):
        cache.set_batch(batch)
        outs.append(cache.attend(0, q, k, v))
    assert fast._verify and fast._long == [2]  # "c" (20 new tokens) is the one prompt chunk looped
    torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=1e-5)


def test_bad_configuration_values_are_named(model, draft):
    for kwargs, err, word in [({"gamma": 0}, ValueError, "gamma"), ({"gamma": 2.0}, TypeError, "gamma"),
                              ({"gamma": True}, TypeError, "gamma"), ({"method": "medusa"}, ValueError, "medusa"),
                              ({"ngram": 0}, ValueError, "ngram")]:
        with pytest.raises(err, match=word):
            SpeculativeConfig(**kwargs)
    with pytest.raises(TypeError, match="SpeculativeConfig"):
        SpeculativeLLM(model, speculative={"gamma": 4})
    with pytest.raises(ValueError, match="draft-model"):
        SpeculativeLLM(model, speculative=SpeculativeConfig("draft-model"))  # no draft given
    with pytest.raises(ValueError, match="draft-model"):
        SpeculativeLLM(model, draft=draft)  # a draft, but prompt lookup asked for
    other_vocab = context_model("tiny", seed=1, vocab_size=256)
    with pytest.raises(ValueError, match="vocab_size=256"):
        SpeculativeLLM(model, speculative=SpeculativeConfig("draft-model"), draft=other_vocab)
    short = context_model("tiny", seed=1, block_size=16)
    llm = SpeculativeLLM(model, speculative=SpeculativeConfig("draft-model"), draft=short)
    with pytest.raises(ValueError, match="draft's context window block_size=16"):
        llm.add_request(list(range(10)), SamplingParams.greedy(10))  # 19 tokens > the draft's 16
    llm.add_request(list(range(10)), SamplingParams.greedy(7))  # 16 tokens: fits
    assert [len(o.output_token_ids) for o in llm.generate([[1, 2, 1, 2]], SamplingParams.greedy(4))] == [4]


@dataclasses.dataclass
class FailsInVerification(SamplingParams):
    """Greedy params that the patched acceptance rule below refuses: a stand-in for a failure in verification."""

    fail_in_verification: bool = True


def test_failing_request_does_not_take_others_down(model, monkeypatch):
    """One request fails in sampling (PoisonedParams), one in its verification; the others finish as if alone."""
    real = spec_engine.accept_greedy

    def accept_greedy(logits, drafts, params=None):
        if getattr(params, "fail_in_verification", False):
            raise RuntimeError("verification blew up")
        return real(logits, drafts, params)

    monkeypatch.setattr(spec_engine, "accept_greedy", accept_greedy)
    prompts, params = prompts_with_repeats(6, seed=21), mixed_params(6, seed=21)
    params[2] = FailsInVerification(max_new_tokens=20, temperature=0.0)
    params[4] = PoisonedParams(max_new_tokens=8, temperature=0.0)
    # the target drafting for itself: every request that samples verifies drafts, so request 2 surely does
    spec = SpeculativeLLM(model, None, CONFIGS["tiny-pool-recompute"],
                          speculative=SpeculativeConfig("draft-model", gamma=3), draft=model)
    d = Driver(spec)
    ids = [spec.add_request(p, sp) for p, sp in zip(prompts, params)]
    d.run()
    for i, rid in enumerate(ids):
        out = d.outputs[rid]
        if i in (2, 4):
            assert out.finish_reason == "error" and rid in out.error
        else:
            assert out.output_token_ids == generate_ids(model, prompts[i], params[i]) and out.finish_reason == "length"
    assert "verification blew up" in d.outputs[ids[2]].error and "sampling" in d.outputs[ids[4]].error


def test_abort_frees_everything(model, draft):
    cfg = EngineConfig(num_blocks=20, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                       preemption_mode="swap", num_swap_blocks=12)
    spec = SpeculativeLLM(model, None, cfg, speculative=SpeculativeConfig("draft-model", gamma=3), draft=draft)
    prompts = prompts_with_repeats(4, seed=3)
    params = [SamplingParams.greedy(24)] * 4
    ids = [spec.add_request(p, sp) for p, sp in zip(prompts, params)]
    d = Driver(spec)
    for _ in range(6):
        d.step()
    victim = spec.scheduler.running[0].request_id
    assert victim in spec.scheduler.drafter.states  # it has drafted
    assert spec.abort(victim) and victim not in spec.scheduler.drafter.states
    d.run()
    assert d.final[victim] == d.streamed[victim] and len(d.final[victim]) < 24
    assert spec.swap_space.num_used == 0 and spec.scheduler.drafter.states == {}
    for p, sp, rid in zip(prompts, params, ids):
        if rid != victim:
            assert d.final[rid] == generate_ids(model, p, sp)


def test_scheduler_checks_that_no_draft_outlives_its_step(model):
    """S3 is checked, not assumed: a draft slot left in the block manager is caught by check_invariants."""
    spec = SpeculativeLLM(model, None, CONFIGS["roomy"], speculative=SpeculativeConfig(gamma=2, ngram=1))
    spec.add_request([3, 4] * 5, SamplingParams.greedy(10))
    spec.step()
    spec.step()
    req = spec.scheduler.running[0]
    for tok in (req.all_token_ids[-1], 3):  # the last token's slot (next step's), then a draft nobody rolled back
        spec.block_manager.append_slot(req.request_id, tok)
        req.num_block_tokens += 1
    assert isinstance(spec.scheduler, SpeculativeScheduler)
    with pytest.raises(AssertionError, match="S3"):
        spec.scheduler.check_invariants()


def test_engine_hooks_build_the_subclasses(model):
    """Chapter 06's hooks for chapter 08: `LLM.runner_cls`, `scheduler_cls` and `sampler_cls` pick the classes
    `__init__` builds; the pool is built once, by the runner, and the speculative engine keeps chapter 06's runner
    (its verify entries say what they feed and sample, so the executor needs no subclass)."""

    class CountingRunner(ModelRunner):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.num_executes = 0

        def execute(self, step):
            self.num_executes += 1
            return super().execute(step)

    class CountingSampler(Sampler):
        num_samples = 0

        def sample(self, out, logits):
            self.num_samples += 1
            return super().sample(out, logits)

    class CountingLLM(LLM):
        runner_cls = CountingRunner
        sampler_cls = CountingSampler

    llm = CountingLLM(model, None, CONFIGS["roomy"])
    assert isinstance(llm.runner, CountingRunner) and llm.swap_space.cache is llm.runner.cache
    assert isinstance(llm.sampler, CountingSampler) and type(llm.scheduler) is Scheduler
    prompts, params = prompts_with_repeats(4, seed=1), mixed_params(4, seed=1)
    outs = llm.generate(prompts, params)
    assert [o.output_token_ids for o in outs] == [generate_ids(model, p, sp) for p, sp in zip(prompts, params)]
    assert llm.runner.num_executes == llm.sampler.num_samples == llm.num_steps > 0
    assert (LLM.runner_cls, LLM.scheduler_cls, LLM.sampler_cls) == (ModelRunner, Scheduler, Sampler)
    spec = SpeculativeLLM(model)
    assert type(spec.runner) is ModelRunner and isinstance(spec.sampler, spec_engine.SpeculativeSampler)
    assert isinstance(spec.scheduler, SpeculativeScheduler) and spec.scheduler.drafter is spec.drafter


@pytest.mark.slow
@pytest.mark.parametrize("method", ["prompt-lookup", "draft-model"])
def test_shipped_models_equal_the_plain_engine(method):
    """`base` on code prompts from the validation split (and `draft` drafting): the engine's tokens, faster or not."""
    from minillm.bench.models import load_model
    from minillm.speculative.engine_bench import code_prompts

    tgt = load_model("base")
    dft = load_model("draft").model if method == "draft-model" else None
    prompts = code_prompts(tgt.tokenizer, 4, prompt_len=96)
    params = SamplingParams.greedy(24, ignore_eos=True)
    cfg = EngineConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=128,
                       attention_backend="verify")
    spec = SpeculativeLLM(tgt.model, None, cfg, speculative=SpeculativeConfig(method, gamma=4), draft=dft)
    plain = LLM(tgt.model, None, cfg).generate(prompts, params)
    got = run_checked(spec, prompts, [params] * 4)
    assert got == [o.output_token_ids for o in plain]
    assert spec.stats()["num_accepted"] > 0 and spec.num_steps < 4 * 24


def test_benchmark_sweep_rows_on_small_models():
    """The chapter benchmark's γ sweep (what the tour reports) on small models: identical tokens at every γ,
    α from γ = 1, the cost model beside each row, and the best γ among the rows. No timing is asserted."""
    from minillm.speculative.bench import greedy_sweep

    target = context_model(GPTConfig(**{**SMALL, "block_size": 128}), seed=0)  # room for the cost model's context
    report = greedy_sweep(target, noisy_copy(target, 0.1, seed=5), PROMPTS[:2], 8, [1, 2], repeats=1)
    assert report["identical"] and [r["gamma"] for r in report["rows"]] == [1, 2]
    assert 0 <= report["alpha"] <= 1 and report["best_gamma"] in (1, 2)
    for r in report["rows"]:
        assert r["identical"] and r["tokens_per_target_call"] >= 1 and r["speedup"] > 0
        assert r["predicted_speedup"] > 0 and r["model_tokens_per_call"] >= 1


BYTES = SimpleNamespace(encode=lambda text: [b % SMALL["vocab_size"] for b in text.encode("utf-8")])
CHAPTER_TEXT = Path(__file__).resolve().parent.parent / "chapters" / "08-speculative-decoding.md"


def _quoted_names(results_file: str) -> set[str]:
    """The names the chapter text quotes from one results file (its include blocks and inline values)."""
    text = CHAPTER_TEXT.read_text(encoding="utf-8")
    return set(re.findall(rf"<!-- (?:include|value): {re.escape(results_file)}::([^>\n]+?) -->", text))


def test_bench_quotes_hold_every_name_the_text_quotes():
    """Both benchmarks' `quotes` on small reports read back from JSON (string keys, as the texts read them): every
    table and value the chapter text names, Markdown tables ending in a newline, and the console reports still
    print. No timing is asserted."""
    target = context_model(GPTConfig(**{**SMALL, "block_size": 128}), seed=0)
    draft = noisy_copy(target, 0.1, seed=5)
    prompt = PROMPTS[1]
    sweep = spec_bench.greedy_sweep(target, draft, PROMPTS[:2], 8, [1, 2, 4, 6], repeats=1)  # the text's γ
    report = {"target": "t", "draft": "d", "device": "cpu", "threads": 1, "greedy": sweep,
              "distilled_draft": "d2", "distilled": sweep,
              "prompt_lookup": spec_bench.prompt_lookup(target, prompt * 4, 8, repeats=1),
              "sampling": spec_bench.sampling_exactness(target, draft, prompt, draws=200),
              "hf_assisted": spec_bench.hf_assisted(target, draft, prompt, 8, gamma=2, repeats=1)}
    print(spec_bench.format_report(report))
    small = engine_bench.load_sweep(context_model(GPTConfig(**SMALL), seed=0), BYTES, loads=(1, 2), new_tokens=8,
                                    prompt_len=16, requests_per_slot=1, repeats=1)
    engine = {"target": "t", "draft": None, "device": "cpu", "threads": 1, **small}
    print(engine_bench.format_report(engine))
    for module, rep, stem in ((spec_bench, report, "08-speculative"), (engine_bench, engine, "08-engine-lookup"),
                              (engine_bench, engine, "08-engine-draft")):
        back = json.loads(json.dumps({**rep, "cpu": "test cpu"}, default=str))
        pieces = module.quotes(back)
        assert _quoted_names(f"chapters/results/{stem}.json") <= set(pieces)
        for name, piece in pieces.items():
            assert piece.endswith("\n") if piece.startswith("|") else "\n" not in piece, name
    assert spec_bench.chi_square_quantile(10, 0.001) == pytest.approx(29.588, abs=1e-3)

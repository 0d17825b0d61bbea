"""Chapter 08: speculative decoding emits what the target alone emits, greedy tokens exactly and sampled tokens in
distribution, whatever the draft; the acceptance rule on hand-computed examples; bad input. No test measures time.

The distribution test is a chi-square goodness-of-fit of many draws of `accept_or_resample` against the target's p,
run on the real rule and on planted wrong rules, so the test is shown able to fail.
"""

from __future__ import annotations

import copy

import pytest
import torch

import minillm.speculative.sampling as spec_sampling
from helpers import context_model, random_prompts
from minillm import GPT, GPTConfig
from minillm.core.sampling import SamplingParams, probs_from_logits
from minillm.kvcache.generate import generate, generate_ids
from minillm.naive.generate import collect
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

SMALL = dict(vocab_size=128, block_size=64, n_layer=2, n_head=2, n_embd=32)
GAMMAS = (1, 2, 4, 7)


def noisy_copy(model: GPT, noise: float, seed: int) -> GPT:
    """The target with every weight perturbed by `noise` times its own std: a draft that agrees part of the time
    (greedy acceptance about 0.3 at noise 0.1 on these models)."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    return draft


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
NUM_DRAWS = 20_000
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
        def rule(p_, q_, drafts, g):
            return spec_sampling.accept_or_resample(torch.cat([p_[1:], p_[-1:]]), q_, drafts, g)
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

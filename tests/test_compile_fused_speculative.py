"""Chapter 13's fused C++ step under chapter 08's speculative decoding (`minillm.compile.fused_speculative`).

`FusedDecoder::verify` against n single steps (logits and the cache's K/V, float32, int8 and int4, and after a
roll-back); greedy tokens identical to the target's own (the fused step alone and chapter 04's eager generator) for a
draft model and for prompt lookup, on a tiny model and on the shipped `base` + `draft`, at several γ; sampled first
tokens following the target's distribution (chapter 08's chi-square test, shown able to fail on a planted wrong
rule); bad arguments as TypeError/ValueError naming them. No test measures time.
"""

from __future__ import annotations


import pytest
import torch

from helpers import context_model, noisy_copy
from minillm import GPT, GPTConfig
from minillm.bench.models import load_model
from minillm.compile.cpu_gemv import build_problem
from minillm.compile.fused_speculative import (MAX_GAMMA, generate_prompt_lookup_fused, generate_speculative_fused)
from minillm.speculative import generate as speculative_generate
from minillm.compile.fused_step import MAX_VERIFY, FusedCPUDecoder
from minillm.core.sampling import SamplingParams, probs_from_logits
from minillm.kvcache.generate import generate_ids
from minillm.prune.structured import shrink_mlp
from minillm.quant.linear import QuantConfig, quantize_model
from minillm.speculative.bench import chi_square_test, code_prompt

pytestmark = pytest.mark.skipif(build_problem() is not None, reason=f"cannot build the C++ step: {build_problem()}")

SMALL = GPTConfig(vocab_size=4096, block_size=64, n_layer=2, n_head=4, n_embd=64)
PROMPTS = [[5, 17, 99, 3], [200, 1, 1, 42, 7, 9, 11, 300, 12], [64], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]]
GAMMAS = (1, 2, 4, 7, MAX_GAMMA)


@pytest.fixture(scope="module")
def tiny() -> tuple[GPT, GPT]:
    target = context_model(SMALL, seed=0)
    return target, noisy_copy(target, 0.1, seed=3).eval()


def prefilled(model: GPT, ids: list[int]) -> FusedCPUDecoder:
    """A decoder of `model` whose cache holds `ids`, prefilled by the model as the generators do."""
    dec = FusedCPUDecoder(model)
    with torch.inference_mode():
        model.hidden(torch.tensor([ids]), torch.arange(len(ids)), dec.cache)
    return dec


@pytest.mark.parametrize("kind", ["float32", "int8", "int4", "pruned"])
def test_verify_equals_n_single_steps(tiny, kind):
    """One verify of n rows against n one-token steps on a second decoder: the logits (n, V) and the K/V written
    to slots start..start+n-1 agree to float rounding, for n from 1 to MAX_VERIFY, the last verify filling the
    cache up to the window's end; the int8 and int4 linears take the M-row int8 and int4 loops; a pruned model
    (chapter 10: an MLP 86 wide, neither a multiple of 8 nor of 4) takes the tails of the two-row loop."""
    model = tiny[0]
    if kind in ("int8", "int4"):
        model = quantize_model(model, QuantConfig(kind, group_size=32))
    elif kind == "pruned":
        model = shrink_mlp(model, [torch.arange(0, 4 * SMALL.n_embd, 3) for _ in range(SMALL.n_layer)])
    ids = torch.randint(0, SMALL.vocab_size, (SMALL.block_size,), generator=torch.Generator().manual_seed(1)).tolist()
    rows, steps = prefilled(model, ids[:3]), prefilled(model, ids[:3])
    at = 3
    for n in (2, 5, MAX_VERIFY, MAX_VERIFY, 7, 3, 1, SMALL.block_size - 3 - 50):  # the last: the 11 slots left
        got = rows.verify(ids[at:at + n])  # (n, V)
        want = torch.cat([steps.verify([t]) for t in ids[at:at + n]])  # n calls of the one-token step
        assert got.shape == (n, SMALL.vocab_size)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        at += n
    assert rows.cache.length == steps.cache.length == SMALL.block_size
    for layer in range(SMALL.n_layer):
        # the verify's products sum in another order than one step's (16 lanes with AVX-512, not 8): float rounding
        torch.testing.assert_close(rows.cache.k[layer], steps.cache.k[layer], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rows.cache.v[layer], steps.cache.v[layer], rtol=1e-5, atol=1e-5)
    with torch.inference_mode():  # and the model's own forward over the whole sequence
        full = model.logits(model.hidden(torch.tensor([ids]), torch.arange(len(ids)))[0])  # (T, V)
    torch.testing.assert_close(got, full[-n:], rtol=1e-4, atol=1e-4)


def test_verify_after_a_rollback_overwrites_the_rejected_rows(tiny):
    """Speculative decoding's roll-back is the cache's `truncate`: rows verified and then dropped leave nothing
    behind; the next verify from the kept length gives the logits of a decoder that never saw them."""
    model = tiny[0]
    a, b = prefilled(model, PROMPTS[1]), prefilled(model, PROMPTS[1])
    a.verify([7, 8, 9, 10, 11])
    a.cache.truncate(len(PROMPTS[1]) + 2)  # keep 7, 8; reject 9, 10, 11
    b.verify([7, 8])
    torch.testing.assert_close(a.verify([40, 41, 42]), b.verify([40, 41, 42]), rtol=1e-6, atol=1e-6)
    assert a.cache.length == b.cache.length == len(PROMPTS[1]) + 5


def test_greedy_tokens_are_the_targets_own(tiny):
    """Greedy output of the fused speculative loop (a draft model, and prompt lookup) equals the fused target alone
    and chapter 04's eager generator, at every γ up to MAX_GAMMA, on prompts of four lengths through the same two
    decoders (their caches reset by each request), and with an eos stop."""
    target, draft = tiny
    tdec, ddec = FusedCPUDecoder(target), FusedCPUDecoder(draft)
    params = SamplingParams.greedy(30, ignore_eos=True)
    for prompt in PROMPTS:
        want = generate_ids(target, prompt, params)
        assert tdec.generate_ids(prompt, params) == want
        for gamma in GAMMAS:
            out, stats = generate_speculative_fused(tdec, ddec, prompt, params, gamma=gamma)
            assert out == want, (prompt, gamma)
            assert stats.num_tokens == 30 and stats.proposed >= stats.accepted
            assert stats.draft_calls >= stats.proposed  # one C++ call per proposed token
            assert stats.tokens_per_target_call == 30 / stats.target_calls
            out, stats = generate_prompt_lookup_fused(tdec, prompt, params, gamma=gamma)
            assert out == want, (prompt, gamma, "lookup")
            assert stats.draft_calls == 0
    # the repeating prompt gives prompt lookup something to copy, and the draft agrees part of the time
    assert generate_prompt_lookup_fused(tdec, PROMPTS[3], params)[1].accepted > 0
    assert generate_speculative_fused(tdec, ddec, PROMPTS[0], params)[1].accepted > 0
    want = generate_ids(target, PROMPTS[1], params)
    out, stats = generate_speculative_fused(tdec, ddec, PROMPTS[1], SamplingParams.greedy(30), gamma=4,
                                            eos_id=want[6])
    assert out == want[:want.index(want[6]) + 1] and stats.finish_reason == "eos"
    assert generate_speculative_fused(tdec, ddec, PROMPTS[0], SamplingParams.greedy(0))[0] == []


def test_greedy_tokens_on_the_shipped_base_and_draft():
    """The shipped `base` and `draft` (seeded random weights of their shapes where a checkpoint is missing): greedy
    tokens of the fused speculative loop at γ 1, 3 and 7 and of prompt lookup on code equal the fused target alone
    and chapter 04's generator."""
    base, draft = load_model("base"), load_model("draft")
    tdec, ddec = FusedCPUDecoder(base.model), FusedCPUDecoder(draft.model)
    params = SamplingParams.greedy(40, ignore_eos=True)
    prompts = [base.tokenizer.encode(t) for t in ("def fibonacci(n):\n    ", "import numpy as np\n",
                                                   "class Tokenizer:\n    def __init__(self")]
    for prompt in prompts:
        want = generate_ids(base.model, prompt, params)
        assert tdec.generate_ids(prompt, params) == want
        for gamma in (1, 3, 7):
            assert generate_speculative_fused(tdec, ddec, prompt, params, gamma=gamma)[0] == want, gamma
    code = code_prompt(base.tokenizer)
    want = generate_ids(base.model, code, params)
    for gamma in (1, 4, 8):
        assert generate_prompt_lookup_fused(tdec, code, params, gamma=gamma)[0] == want, gamma


V_SMALL = 16
DRAWS = 4000


@pytest.fixture(scope="module")
def sampling_pair() -> tuple[FusedCPUDecoder, FusedCPUDecoder, list[int], torch.Tensor, torch.Tensor]:
    """Two tiny models with a 16-token vocabulary, their decoders, a prefix, and p, q (V,) of the next token at
    temperature 1.5 (many tokens have mass and p and q differ a lot: a wrong rule cannot hide)."""
    cfg = GPTConfig(vocab_size=V_SMALL, block_size=32, n_layer=2, n_head=2, n_embd=32)
    target, draft = context_model(cfg, seed=0), context_model(cfg, seed=3)
    prefix = [3, 1, 4, 1, 5, 9, 2]
    params = SamplingParams(temperature=1.5)
    with torch.no_grad():
        p = probs_from_logits(target(torch.tensor([prefix]))[0, -1:], params)[0]  # (V,)
        q = probs_from_logits(draft(torch.tensor([prefix]))[0, -1:], params)[0]  # (V,)
    assert 0.2 < 0.5 * float((p - q).abs().sum()) < 0.9  # total variation: far apart, overlapping
    return FusedCPUDecoder(target), FusedCPUDecoder(draft), prefix, p, q


def first_tokens(tdec: FusedCPUDecoder, ddec: FusedCPUDecoder, prefix: list[int], gamma: int) -> torch.Tensor:
    """Counts (V,) of the first token emitted by DRAWS seeded sampled runs (two new tokens each, so the first round
    drafts min(γ, 1) token and the acceptance rule decides it)."""
    counts = torch.zeros(V_SMALL, dtype=torch.int64)
    for seed in range(DRAWS):
        params = SamplingParams(max_new_tokens=2, temperature=1.5, seed=seed, ignore_eos=True)
        out, _ = generate_speculative_fused(tdec, ddec, prefix, params, gamma=gamma)
        counts[out[0]] += 1
    return counts


def test_sampled_first_tokens_follow_the_targets_distribution(sampling_pair, monkeypatch):
    """Chapter 08's chi-square test (`chi_square_test`, its 10 likeliest tokens + the rest) of the first token of
    DRAWS seeded runs against the target's p: not rejected at 0.1% for the real rule; rejected for a planted rule
    that keeps every draft (whose first tokens follow the draft's q), so the test can fail. Seeded runs repeat."""
    tdec, ddec, prefix, p, q = sampling_pair
    test = chi_square_test(first_tokens(tdec, ddec, prefix, gamma=2), p)
    assert test.p_value > 1e-3, f"chi-square {test.chi2:.1f} (dof {test.dof}), p-value {test.p_value:.2g}"
    params = SamplingParams(max_new_tokens=12, temperature=1.5, seed=7, ignore_eos=True)
    assert (generate_speculative_fused(tdec, ddec, prefix, params, gamma=3)
            == generate_speculative_fused(tdec, ddec, prefix, params, gamma=3))
    out, _ = generate_prompt_lookup_fused(tdec, prefix * 2, params, gamma=3)
    assert len(out) == 12 and all(0 <= t < V_SMALL for t in out)

    def keep_every_draft(p_rows, q_rows, drafts, generator):
        return [*drafts, int(torch.multinomial(p_rows[-1], 1, generator=generator))]

    monkeypatch.setattr(speculative_generate, "accept_or_resample", keep_every_draft)  # the shared round loop's
    planted = chi_square_test(first_tokens(tdec, ddec, prefix, gamma=1), p)
    assert planted.p_value < 1e-3, f"the planted rule passed: chi-square {planted.chi2:.1f}"


def test_bad_arguments_are_named(tiny):
    target, draft = tiny
    tdec, ddec = FusedCPUDecoder(target), FusedCPUDecoder(draft)
    params = SamplingParams.greedy(8, ignore_eos=True)
    prompt = PROMPTS[0]
    for gamma, err in ((0, ValueError), (MAX_GAMMA + 1, ValueError), (2.0, TypeError), (True, TypeError)):
        with pytest.raises(err, match="gamma"):
            generate_speculative_fused(tdec, ddec, prompt, params, gamma=gamma)
        with pytest.raises(err, match="gamma"):
            generate_prompt_lookup_fused(tdec, prompt, params, gamma=gamma)
    with pytest.raises(ValueError, match="ngram"):
        generate_prompt_lookup_fused(tdec, prompt, params, ngram=0)
    with pytest.raises(TypeError, match="target must be a FusedCPUDecoder"):
        generate_speculative_fused(target, ddec, prompt, params)
    with pytest.raises(TypeError, match="draft must be a FusedCPUDecoder"):
        generate_speculative_fused(tdec, draft, prompt, params)
    with pytest.raises(ValueError, match="two FusedCPUDecoders"):
        generate_speculative_fused(tdec, tdec, prompt, params)
    other = FusedCPUDecoder(context_model(SMALL, seed=1, vocab_size=512))
    with pytest.raises(ValueError, match="vocab_size=512"):
        generate_speculative_fused(tdec, other, prompt, params)
    with pytest.raises(ValueError, match="params.n=2"):
        generate_speculative_fused(tdec, ddec, prompt, SamplingParams(max_new_tokens=4, temperature=1.0, n=2))
    with pytest.raises(ValueError, match="max_len=8"):
        generate_speculative_fused(FusedCPUDecoder(target, max_len=8), ddec, prompt, params)
    with pytest.raises(ValueError, match="draft decoder's max_len=8"):
        generate_speculative_fused(tdec, FusedCPUDecoder(draft, max_len=8), prompt, params)
    with pytest.raises(ValueError, match=r"prompt_ids\[1\] = 4096 is outside the vocabulary"):
        generate_speculative_fused(tdec, ddec, [1, SMALL.vocab_size], params)
    for model, who in ((target, "target"), (draft, "draft")):
        model.train()
        try:
            with pytest.raises(ValueError, match=f"{who} .*training mode"):
                generate_speculative_fused(tdec, ddec, prompt, params)
        finally:
            model.eval()
    assert generate_speculative_fused(tdec, ddec, prompt, params)[0] == generate_ids(target, prompt, params)


def test_verify_rejects_bad_tokens_and_a_full_cache(tiny):
    """FusedCPUDecoder.verify and the C++ verify behind it: a clear TypeError/ValueError, never a crash, and a
    refused call leaves the cache as it was."""
    dec = prefilled(tiny[0], PROMPTS[0])
    with pytest.raises(TypeError, match="^tokens must be a list of ints, got str"):
        dec.verify("12")
    with pytest.raises(TypeError, match=r"tokens\[1\]"):
        dec.verify([1, 2.0])
    with pytest.raises(ValueError, match=f"1 to {MAX_VERIFY}"):
        dec.verify([])
    with pytest.raises(ValueError, match=f"1 to {MAX_VERIFY}"):
        dec.verify([1] * (MAX_VERIFY + 1))
    with pytest.raises(ValueError, match=r"^tokens\[2\] = 4096 is outside the vocabulary \[0, 4096\)"):
        dec.verify([1, 2, SMALL.vocab_size])
    with pytest.raises(ValueError, match=r"^tokens\[1\] = -1 is outside the vocabulary"):
        dec.verify([1, -1])
    with pytest.raises(ValueError, match=r"^tokens\[0\] = 9223372036854775808 is outside the vocabulary"):
        dec.verify([2 ** 63])  # before: pybind's "incompatible function arguments"
    dec.cache.mark_written(SMALL.block_size - 4 - 2)  # two slots left
    with pytest.raises(ValueError, match="outside the context window"):
        dec.verify([1, 2, 3])
    assert dec.cache.length == SMALL.block_size - 2
    assert dec.verify([1, 2]).shape == (2, SMALL.vocab_size)
    cpp = dec._cpp  # the C++ side's own checks, past the Python wrapper
    with pytest.raises(RuntimeError, match="is not the cache length"):
        cpp.verify([1, 2], 3, 4)
    with pytest.raises(RuntimeError, match="outside the context window"):
        cpp.verify([1, 2], SMALL.block_size - 1, SMALL.block_size - 1)
    with pytest.raises(RuntimeError, match=r"slots 7..8 are outside the cache \[0, 8\)"):
        FusedCPUDecoder(tiny[0], max_len=8)._cpp.verify([1, 2], 7, 7)
    with pytest.raises(RuntimeError, match="takes 1 to 16 tokens"):
        cpp.verify([], 0, 0)
    tiny[0].train()
    try:
        with pytest.raises(ValueError, match="training mode"):
            dec.verify([1])
    finally:
        tiny[0].eval()


def test_a_nan_draft_is_refused_by_name_when_sampling(tiny):
    """A draft whose logits are NaN: greedy, its argmax is still verified (the target's own tokens come out); sampled,
    its q is refused naming the draft model, before torch.multinomial would fail naming neither."""
    target, draft = tiny
    broken = noisy_copy(draft, 0.0, seed=0).eval()
    with torch.no_grad():
        broken.transformer.ln_f.weight.fill_(float("nan"))
    tdec, ddec = FusedCPUDecoder(target), FusedCPUDecoder(broken)
    params = SamplingParams.greedy(12, ignore_eos=True)
    assert generate_speculative_fused(tdec, ddec, PROMPTS[0], params, gamma=3)[0] == generate_ids(target, PROMPTS[0],
                                                                                                   params)
    with pytest.raises(ValueError, match="the draft model's distribution q at draft step 0 holds NaN"):
        generate_speculative_fused(tdec, ddec, PROMPTS[0], SamplingParams(temperature=1.0, max_new_tokens=8, seed=1),
                                   gamma=3)

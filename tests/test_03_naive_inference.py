"""Chapter 03: sampling, the naive generate loop, the metrics, the roofline model and the bench harness.

The naive loop is the baseline of every later chapter, so it is checked against an outside oracle: Hugging Face
`generate(use_cache=False, do_sample=False)` on the same weights, token for token.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from minillm import GPT, GPTConfig
from minillm.naive.bench import BenchCase, GENERATORS, register_generator, run_bench, plot_bench
from minillm.core.stopping import StopChecker, validate_prompt
from minillm.naive.generate import collect, generate_naive, generate_naive_ids
from minillm.core.metrics import PeakMemory, RequestTimes, summarize, throughput
from minillm.naive.roofline import (Machine, decode_bound, decode_cost, decode_weights, measure_bandwidth,
                                    measure_weight_streaming, naive_step_flops, param_count)
from minillm.core.sampling import (SamplingParams, Temperature, TopK, TopP, apply_processors, make_generator,
                              probs_from_logits, sample_next, top_k_filter, top_p_filter)

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SMALL = dict(vocab_size=97, block_size=32, n_layer=2, n_head=2, n_embd=16)


def small_model(seed: int = 0, **overrides) -> GPT:
    """A random model whose weights are large enough that its greedy output is not one repeated token."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**SMALL, **overrides})).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0)
    return model


class CharTokenizer:
    """Each id decodes to one letter: enough to test stop strings without the real tokenizer."""

    eot_token = None

    def decode(self, ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)


# --------------------------------------------------------------------------------------------------------------
# Sampling: hand-computed distributions


WORKED = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]]))  # (1, 4): probabilities that are exact in binary


@pytest.mark.graded(points=2, exercise="top_k_filter")
def test_top_k_worked_example():
    """Probabilities p = [1/2, 1/4, 1/8, 1/8].

    k=1 keeps only the argmax: [1, 0, 0, 0]. k=2 keeps 1/2 and 1/4, renormalised by 3/4: [2/3, 1/3, 0, 0].
    k=3: the 3rd largest value is 1/8, and the 4th token ties with it, so all four stay: p unchanged.
    """
    for k, expected in [(1, [1, 0, 0, 0]), (2, [2 / 3, 1 / 3, 0, 0]), (3, [0.5, 0.25, 0.125, 0.125]),
                        (4, [0.5, 0.25, 0.125, 0.125])]:
        probs = torch.softmax(top_k_filter(WORKED, k), dim=-1)
        torch.testing.assert_close(probs, torch.tensor([expected], dtype=torch.float32), atol=1e-6, rtol=0)


@pytest.mark.graded(points=2, exercise="top_p_filter")
def test_top_p_worked_example():
    """Probabilities p = [1/2, 1/4, 1/8, 1/8]; the mass strictly before each token is [0, 1/2, 3/4, 7/8].

    A token is dropped when the mass before it already reaches top_p:
    top_p=0.5  -> keeps token 0 only (1/2 >= 0.5 drops token 1):     [1, 0, 0, 0]
    top_p=0.7  -> keeps tokens 0, 1 (3/4 >= 0.7 drops token 2):      [2/3, 1/3, 0, 0]
    top_p=0.8  -> keeps tokens 0, 1, 2 (7/8 >= 0.8 drops token 3):   [4/7, 2/7, 1/7, 0]
    top_p=1.0  -> keeps all.
    """
    for p, expected in [(0.5, [1, 0, 0, 0]), (0.7, [2 / 3, 1 / 3, 0, 0]), (0.8, [4 / 7, 2 / 7, 1 / 7, 0]),
                        (1.0, [0.5, 0.25, 0.125, 0.125])]:
        probs = torch.softmax(top_p_filter(WORKED, p), dim=-1)
        torch.testing.assert_close(probs, torch.tensor([expected], dtype=torch.float32), atol=1e-6, rtol=0)


def test_temperature_then_top_p_worked_example():
    """Temperature 2 turns p into p^(1/2) renormalised: sqrt([1/2, 1/4, 1/8, 1/8]) / s with s = sum of those.

    That flattens the distribution: the masses before each token become [0, .369, .630, .815], so top_p=0.7 now
    keeps three tokens where at temperature 1 it kept two. The processors compose left to right.
    """
    root = torch.tensor([0.5, 0.25, 0.125, 0.125]).sqrt()
    flat = root / root.sum()
    got = probs_from_logits(WORKED, SamplingParams(temperature=2.0))
    torch.testing.assert_close(got, flat.unsqueeze(0), atol=1e-6, rtol=0)
    kept = flat[:3] / flat[:3].sum()
    got = probs_from_logits(WORKED, SamplingParams(temperature=2.0, top_p=0.7))
    torch.testing.assert_close(got, torch.cat([kept, torch.zeros(1)]).unsqueeze(0), atol=1e-6, rtol=0)
    # order matters: top-p at temperature 1 first, then temperature, keeps only two tokens
    other = torch.softmax(apply_processors(WORKED, [TopP(0.7), Temperature(2.0)]), dim=-1)
    assert int((other > 0).sum()) == 2
    nested = Temperature(2.0)(TopK(3)(WORKED))
    torch.testing.assert_close(apply_processors(WORKED, [TopK(3), Temperature(2.0)]), nested)


def _distinct_logits(min_size=2, max_size=40):
    return st.lists(st.floats(-20, 20, allow_nan=False, width=32), min_size=min_size, max_size=max_size,
                    unique=True)


@pytest.mark.graded(points=3, exercise="top_k_filter")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=_distinct_logits(), data=st.data())
def test_top_k_keeps_the_k_largest(values, data):
    k = data.draw(st.integers(0, len(values) + 2))
    logits = torch.tensor([values])
    kept = set(torch.nonzero(torch.isfinite(top_k_filter(logits, k))[0]).flatten().tolist())
    order = sorted(range(len(values)), key=lambda i: -values[i])
    expected = set(order if k == 0 or k >= len(values) else order[:k])
    assert kept == expected


@pytest.mark.graded(points=3, exercise="top_p_filter")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=_distinct_logits(), p=st.floats(0.01, 1.0))
def test_top_p_keeps_the_smallest_set_reaching_p(values, p):
    logits = torch.tensor([values])
    probs = torch.softmax(logits, dim=-1)[0].tolist()
    # Rank by logit, not by probability: two distinct float32 logits (0.0 and 1e-9) can round to the same
    # probability, and the most likely token is the one with the larger logit.
    order = sorted(range(len(values)), key=lambda i: -values[i])
    before = 0.0
    expected = set()
    for i in order:
        assume(abs(before - p) > 1e-4)  # float32 and float64 sums may disagree right at the boundary
        if before >= p and p < 1.0:
            break
        expected.add(i)
        before += probs[i]
    kept = set(torch.nonzero(torch.isfinite(top_p_filter(logits, p))[0]).flatten().tolist())
    assert kept == expected
    assert sum(probs[i] for i in kept) >= p - 1e-4  # the kept set reaches p ...
    smallest = max(kept, key=lambda i: -probs[i]) if len(kept) > 1 else None
    if smallest is not None:  # ... and is the smallest such set: without its least likely member it falls short
        assert sum(probs[i] for i in kept) - min(probs[i] for i in kept) < p + 1e-4


def test_greedy_is_argmax_and_top_k_1_agrees():
    logits = torch.randn(5, 50)
    greedy = sample_next(logits, SamplingParams.greedy())
    assert torch.equal(greedy, logits.argmax(-1))
    g = make_generator(0, "cpu")
    assert torch.equal(sample_next(logits, SamplingParams(top_k=1), g), greedy)


def test_seeded_sampling_repeats_and_matches_the_distribution():
    """20,000 seeded draws of the worked example after top-p 0.8: same draws twice, frequencies near [4/7, 2/7, 1/7, 0]."""
    logits = WORKED.expand(20_000, 4)
    params = SamplingParams(top_p=0.8, seed=123)
    a = sample_next(logits, params, make_generator(params.seed, "cpu"))
    b = sample_next(logits, params, make_generator(params.seed, "cpu"))
    assert torch.equal(a, b)
    freq = torch.bincount(a, minlength=4).double() / a.numel()
    assert freq[3] == 0
    torch.testing.assert_close(freq, torch.tensor([4 / 7, 2 / 7, 1 / 7, 0], dtype=torch.float64), atol=0.015, rtol=0)


def test_make_generator():
    assert make_generator(None, "cpu") is None
    g1, g2 = make_generator(7, "cpu"), make_generator(7, "cpu")
    assert torch.equal(torch.rand(3, generator=g1), torch.rand(3, generator=g2))
    with pytest.raises(TypeError, match="1.5"):
        make_generator(1.5, "cpu")


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(temperature=-0.5), ValueError, "-0.5"),
    (dict(temperature=float("nan")), ValueError, "nan"),
    (dict(top_p=0.0), ValueError, "0.0"),
    (dict(top_p=1.5), ValueError, "1.5"),
    (dict(top_k=-1), ValueError, "-1"),
    (dict(max_new_tokens=-3), ValueError, "-3"),
    (dict(max_new_tokens=2.0), TypeError, "2.0"),
    (dict(top_k=2.5), TypeError, "2.5"),
    (dict(temperature="hot"), TypeError, "hot"),
    (dict(seed="x"), TypeError, "'x'"),
    (dict(stop=("ok", 3)), TypeError, "3"),
    (dict(stop=("",)), ValueError, "''"),
    (dict(n=0), ValueError, "0"),
    (dict(ignore_eos=1), TypeError, "1"),
])
def test_sampling_params_reject_bad_values(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_normalise():
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams.greedy(5).is_greedy and SamplingParams.greedy(5).max_new_tokens == 5
    assert isinstance(SamplingParams(temperature=1).temperature, float)


def test_sample_next_rejects_bad_logits():
    with pytest.raises(ValueError, match=r"\(4,\)"):
        sample_next(torch.randn(4), SamplingParams.greedy())
    with pytest.raises(TypeError, match="int64"):
        sample_next(torch.ones(1, 4, dtype=torch.long), SamplingParams.greedy())


# --------------------------------------------------------------------------------------------------------------
# The naive loop against Hugging Face


def to_hf(model: GPT):
    """Chapter 02's exporter: a transformers GPT2LMHeadModel with exactly these weights."""
    pytest.importorskip("transformers")
    from minillm.core.hf import to_hf_model

    return to_hf_model(model)


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])  # (1, T)
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                      do_sample=False, use_cache=False, pad_token_id=0, eos_token_id=None)  # (1, T + n)
    return out[0, len(prompt):].tolist()


def test_greedy_matches_hf_generate_without_cache():
    model = small_model()
    hf = to_hf(model)
    prompts = [[1], [5, 9, 2, 77], list(range(10, 30))]
    for prompt in prompts:
        n = model.config.block_size - len(prompt) + 1  # up to the full window
        ours = generate_naive_ids(model, prompt, SamplingParams.greedy(n))
        assert len(set(ours)) > 3, "the test model must not be degenerate"
        assert ours == hf_greedy(hf, prompt, n)


def test_greedy_matches_hf_on_base():
    from minillm.gpt.pretrained import load_pretrained

    try:
        model, tokenizer = load_pretrained("base")
    except FileNotFoundError:
        pytest.skip("the base checkpoint is not present")
    hf = to_hf(model)
    for text in ("def main():\n    ", "import os\n", "The"):
        prompt = tokenizer.encode(text)
        ours = generate_naive_ids(model, prompt, SamplingParams.greedy(16, ignore_eos=True))
        assert ours == hf_greedy(hf, prompt, 16)


def test_streaming_yields_the_collected_tokens_one_at_a_time():
    model = small_model()
    params = SamplingParams(max_new_tokens=10, temperature=0.9, top_k=20, seed=3)
    stream = generate_naive(model, [1, 2, 3], params)
    first = next(stream)  # available before the rest is computed
    rest, reason = collect(stream)
    assert [first] + rest == generate_naive_ids(model, [1, 2, 3], params)
    assert reason == "length" and len(rest) == 9


def test_seeded_generation_repeats_exactly_and_seeds_matter():
    model = small_model()
    runs = [generate_naive_ids(model, [4, 5], SamplingParams(max_new_tokens=20, temperature=1.5, seed=s))
            for s in (11, 11, 12)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_eos_stops_and_is_emitted_unless_ignored():
    model = small_model()
    free = generate_naive_ids(model, [3, 1], SamplingParams.greedy(15))
    eos = free[4]
    first = free.index(eos)
    ids, reason = collect(generate_naive(model, [3, 1], SamplingParams.greedy(15), eos_id=eos))
    assert (ids, reason) == (free[: first + 1], "eos")
    ids, reason = collect(generate_naive(model, [3, 1], SamplingParams.greedy(15, ignore_eos=True), eos_id=eos))
    assert (ids, reason) == (free, "length")


def test_stop_strings_across_tokens():
    model = small_model()
    tok = CharTokenizer()
    free = generate_naive_ids(model, [7], SamplingParams.greedy(12))
    text = tok.decode(free)
    stop = text[5:8]  # spans three tokens
    cut = text.index(stop)
    params = SamplingParams.greedy(12, stop=(stop, "never-there"))
    stream = generate_naive(model, [7], params, tokenizer=tok)
    ids, reason = collect(stream)
    assert reason == "stop"
    assert ids == free[: cut + len(stop)]
    checker = StopChecker(tok, params)
    for t in ids:
        checker.update(t)
    assert checker.finish_reason == "stop" and checker.output_text() == text[:cut]


def test_stop_checker_order_and_misuse():
    tok = CharTokenizer()
    c = StopChecker(tok, SamplingParams.greedy(2, stop=("b",)), eos_id=1)
    assert c.update(1) and c.finish_reason == "eos"  # id 1 decodes to "b" too: eos wins, as in vLLM
    with pytest.raises(RuntimeError, match="eos"):
        c.update(0)
    c = StopChecker(None, SamplingParams.greedy(2))
    assert not c.update(5) and c.update(6) and c.finish_reason == "length"
    with pytest.raises(ValueError, match="tokenizer"):
        StopChecker(None, SamplingParams.greedy(2, stop=("x",)))


def test_zero_new_tokens_and_the_context_window():
    model = small_model()
    assert collect(generate_naive(model, [1, 2], SamplingParams.greedy(0))) == ([], "length")
    block = model.config.block_size
    prompt = list(range(block - 2))
    ids, reason = collect(generate_naive(model, prompt, SamplingParams.greedy(10)))
    assert len(ids) == 3 and reason == "length"  # block - 2 + 3 - 1 = block tokens fed at the last step
    ids, _ = collect(generate_naive(model, list(range(block)), SamplingParams.greedy(10)))
    assert len(ids) == 1


def test_truncate_keeps_the_last_tokens():
    model = small_model()
    block = model.config.block_size
    long_prompt = [i % 90 for i in range(block + 9)]
    params = SamplingParams.greedy(5)
    with pytest.raises(ValueError, match=f"{block + 9} tokens"):
        generate_naive(model, long_prompt, params)
    kept, max_new = validate_prompt(long_prompt, params, 97, block, truncate=True)
    assert kept == long_prompt[-(block - 4):] and max_new == 5
    assert generate_naive_ids(model, long_prompt, params, truncate=True) == generate_naive_ids(model, kept, params)


@pytest.mark.parametrize("prompt, exc, match", [
    ([], ValueError, "empty"),
    ([1, 97], ValueError, "97"),
    ([1, -2], ValueError, "-2"),
    ([1, 2.0], TypeError, "2.0"),
    ([True], TypeError, "True"),
    ("hello", TypeError, "str"),
    (torch.tensor([[1, 2]]), TypeError, r"\(1, 2\)"),
    (torch.tensor([1.0]), TypeError, "float32"),
])
def test_generate_rejects_bad_prompts(prompt, exc, match):
    with pytest.raises(exc, match=match):
        generate_naive(small_model(), prompt, SamplingParams.greedy(3))


def test_generate_rejects_bad_arguments():
    model = small_model()
    with pytest.raises(TypeError, match="dict"):
        generate_naive(model, [1], {"max_new_tokens": 3})
    with pytest.raises(TypeError, match="str"):
        generate_naive("gpt2", [1], SamplingParams.greedy(3))
    with pytest.raises(TypeError, match="'7'"):
        generate_naive(model, [1], SamplingParams.greedy(3), eos_id="7")
    with pytest.raises(TypeError, match="truncate"):
        generate_naive(model, [1], SamplingParams.greedy(3), truncate="yes")
    assert generate_naive_ids(model, torch.tensor([1, 2]), SamplingParams.greedy(2)) == \
        generate_naive_ids(model, [1, 2], SamplingParams.greedy(2))


@CUDA
def test_cuda_greedy_matches_cpu_and_seeded_sampling_repeats():
    model = small_model()
    cpu = generate_naive_ids(model, [1, 2, 3], SamplingParams.greedy(12))
    cuda_model = model.to("cuda")
    assert generate_naive_ids(cuda_model, [1, 2, 3], SamplingParams.greedy(12)) == cpu
    params = SamplingParams(max_new_tokens=12, top_p=0.9, seed=5)
    assert generate_naive_ids(cuda_model, [1], params) == generate_naive_ids(cuda_model, [1], params)


# --------------------------------------------------------------------------------------------------------------
# Metrics


@pytest.mark.graded(points=2, exercise=("itl", "tpot"))
def test_itl_and_tpot_worked_example():
    """Arrival 0 s; tokens at 0.5, 0.75, 1.0, 2.0 s. TTFT = 0.5, ITL = [0.25, 0.25, 1.0], E2E = 2.0,
    TPOT = (2.0 - 0.5) / 3 = 0.5 (the mean of the ITL gaps, which the 1 s stall dominates)."""
    r = RequestTimes(arrival=0.0, token_times=[0.5, 0.75, 1.0, 2.0])
    assert r.ttft == 0.5 and r.e2e == 2.0
    assert r.itl == [0.25, 0.25, 1.0]
    assert r.tpot == 0.5
    assert RequestTimes(1.0, [1.5]).tpot == 0 and RequestTimes(1.0, [1.5]).itl == []


@pytest.mark.graded(points=2, exercise=("itl", "tpot"))
@settings(max_examples=50, deadline=None)
@given(arrival=st.fractions(0, 100), gaps=st.lists(st.fractions(0, 10), min_size=2, max_size=30))
def test_e2e_equals_ttft_plus_n_minus_1_tpot_exactly(arrival, gaps):
    """With exact rational timestamps the identity holds with ==, and TPOT is the mean ITL (n >= 2; n = 1 has
    TPOT 0 by definition, checked in the worked example)."""
    times, t = [], arrival
    for g in gaps:
        t += g
        times.append(t)
    r = RequestTimes(arrival=arrival, token_times=times)
    n = r.num_output_tokens
    assert r.e2e == r.ttft + (n - 1) * r.tpot
    assert len(r.itl) == n - 1
    assert r.tpot == sum(r.itl, Fraction(0)) / (n - 1)


@pytest.mark.graded(points=1, exercise=("itl", "tpot"))
def test_e2e_identity_with_float_timestamps():
    """Timestamps on a 1/1024 s grid with n - 1 a power of two: every float operation is exact, so == holds."""
    for n in (2, 3, 5, 9, 17, 65):
        times = [1.0 + (i * 37 % 11 + 3 * i) / 1024 for i in range(n)]
        times.sort()
        r = RequestTimes(arrival=0.5, token_times=times)
        assert r.e2e == r.ttft + (n - 1) * r.tpot
        assert math.isclose(r.tpot, sum(r.itl) / (n - 1), rel_tol=0, abs_tol=1e-15)


def test_summarize_matches_vllm_definitions():
    reqs = [
        RequestTimes(0.0, [0.5, 0.75, 1.0, 2.0], prompt_len=4),  # TTFT .5, TPOT .5, ITL .25 .25 1
        RequestTimes(1.0, [1.25, 1.5], prompt_len=6),  # TTFT .25, TPOT .25, ITL .25
        RequestTimes(2.0, [3.0], prompt_len=2),  # one token: no TPOT sample, no ITL
    ]
    s = summarize(reqs, duration_s=4.0)
    assert (s["completed"], s["total_input"], s["total_output"]) == (3, 12, 7)
    assert s["request_throughput"] == 0.75 and s["output_throughput"] == 7 / 4 and s["total_token_throughput"] == 19 / 4
    assert s["mean_ttft_ms"] == pytest.approx(1000 * (0.5 + 0.25 + 1.0) / 3)
    assert s["median_ttft_ms"] == pytest.approx(500)
    assert s["mean_tpot_ms"] == pytest.approx(375)  # (500 + 250) / 2: the one-token request is left out
    assert s["median_itl_ms"] == pytest.approx(250) and s["mean_itl_ms"] == pytest.approx(1750 / 4)
    assert s["p99_itl_ms"] == pytest.approx(250 + 0.99 * 3 * 750 - 2 * 750)  # numpy's linear interpolation
    assert s["p50_e2el_ms"] == pytest.approx(1000) and s["p90_e2el_ms"] == pytest.approx(1800)
    assert summarize(reqs)["duration_s"] == 3.0  # default: first arrival to last token
    with pytest.raises(ValueError, match="at least one"):
        summarize([])
    with pytest.raises(ValueError, match="no tokens"):
        RequestTimes(0.0).ttft
    with pytest.raises(ValueError, match="-1"):
        throughput(reqs, -1)


def test_peak_memory_sees_a_large_allocation():
    with PeakMemory("cpu") as pm:
        x = torch.ones(16 * 2**20)  # 64 MiB, written so the pages are resident
        del x
    assert pm.bytes >= 64 * 2**20 and "RSS" in pm.source


@CUDA
def test_peak_memory_cuda():
    with PeakMemory("cuda") as pm:
        x = torch.ones(2**20, device="cuda")
        del x
    assert pm.bytes >= 4 * 2**20 and "cuda" in pm.source


# --------------------------------------------------------------------------------------------------------------
# Roofline


@pytest.mark.parametrize("name", ["tiny", "draft", "base"])
def test_param_count_matches_the_model(name):
    cfg = GPTConfig.from_name(name)
    assert param_count(cfg) == GPT(cfg).num_params()


def test_decode_cost_by_hand():
    """tiny: C=32, L=2, V=512, block 64. Matmul weights 2·12·32² + 512·32 = 40,960, so 81,920 FLOPs, plus
    attention 2·4·32·t. Weights read: 43,904 params − 63 unused wpe rows · 32 = 41,888 floats = 167,552 bytes.
    KV: 2·2·32·t floats read plus 2·2·32 written."""
    cfg = GPTConfig.from_name("tiny")
    c = decode_cost(cfg, 10)
    assert c.flops == 81_920 + 2 * 4 * 32 * 10
    assert c.weight_bytes == 167_552
    assert c.kv_bytes == 4 * (2 * 2 * 32 * 10 + 2 * 2 * 32)
    half = decode_cost(cfg, 10, torch.bfloat16)
    assert 2 * half.bytes == c.bytes and half.flops == c.flops
    assert naive_step_flops(cfg, 11) == 11 * 81_920 + 2 * 4 * 32 * 11 * 11
    with pytest.raises(ValueError, match="-1"):
        decode_cost(cfg, -1)
    with pytest.raises(TypeError, match="str"):
        decode_cost("tiny", 1)


def test_decode_bound_is_the_slower_roof():
    cfg = GPTConfig.from_name("base")
    slow_memory = Machine("cpu", "float32", bandwidth_gbs=1.0, matmul_gflops=1000.0)
    r = decode_bound(cfg, slow_memory, 16, 8)
    assert r.limited_by == "bandwidth"
    assert r.tokens_per_s == pytest.approx(r.bandwidth_bound_tps) and r.tokens_per_s < r.compute_bound_tps
    assert r.bandwidth_bound_tps == pytest.approx(1e9 / r.bytes_per_token)
    slow_math = Machine("cpu", "float32", bandwidth_gbs=1000.0, matmul_gflops=0.001)
    r = decode_bound(cfg, slow_math, 16, 8)
    assert r.limited_by == "compute" and r.tokens_per_s == pytest.approx(r.compute_bound_tps)
    with pytest.raises(ValueError, match="0"):
        decode_bound(cfg, slow_math, 16, 0)


def test_measure_bandwidth_runs():
    assert measure_bandwidth("cpu", nbytes=4 * 2**20, repeats=2) > 0


def test_weight_streaming_reads_every_matrix_of_a_step_once():
    model = small_model()
    cfg = model.config
    mats = decode_weights(model)
    assert len(mats) == 4 * cfg.n_layer + 1 and mats[-1][0] is model.lm_head.weight
    ws = measure_weight_streaming(model, repeats=1, steps=2)
    C, V = cfg.n_embd, cfg.vocab_size
    per_block = (3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C) + (4 * C * C + C)  # qkv, proj, fc, proj
    assert ws.bytes_per_step == 4 * (cfg.n_layer * per_block + V * C)
    assert ws.tokens_per_s == pytest.approx(1 / ws.seconds_per_step) and ws.gbps > 0
    with pytest.raises(ValueError, match="steps"):
        measure_weight_streaming(model, steps=0)


# --------------------------------------------------------------------------------------------------------------
# The bench harness


def test_run_bench_interleaves_a_registered_candidate(tmp_path):
    def naive_again(model, prompt_ids, params, tokenizer=None, eos_id=None):
        return generate_naive(model, prompt_ids, params, tokenizer, eos_id)

    register_generator("naive-again-test", naive_again, overwrite=True)
    with pytest.raises(ValueError, match="already registered"):
        register_generator("naive-again-test", lambda *a: iter(()))
    model = small_model()
    report = run_bench(model, [1, 2, 3], BenchCase(prompt_len=3, new_tokens=6, repeats=2, warmup=0),
                       ["naive", "naive-again-test"])
    assert report["comparisons"][0]["identical_tokens"]
    res = report["results"]["naive"]
    assert len(res["tokens"]) == 6 and len(res["per_token_latency_s"]) == 6
    assert res["summary"]["completed"] == 2
    json.dumps(report)  # JSON-ready
    assert plot_bench(report, tmp_path / "bench.png").stat().st_size > 1000
    del GENERATORS["naive-again-test"]
    with pytest.raises(ValueError, match="nope"):
        run_bench(model, [1], BenchCase(), ["nope"])
    with pytest.raises(ValueError, match="-2"):
        BenchCase(new_tokens=-2)


def test_bench_command(tmp_path, capsys):
    from minillm.course.cli import main

    out = tmp_path / "bench.json"
    rc = main(["bench", "--model", "tiny", "--random-init", "--prompt-len", "4", "--new-tokens", "3",
               "--repeats", "1", "--warmup", "0", "--device", "cpu", "--json", str(out), "--roofline",
               "--quick-roofline"])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["results"]["naive"]["summary"]["total_output"] == 3
    rf = report["roofline"]  # both bounds, and the baseline's fraction of each
    assert rf["fraction_of_weight_streaming"] == pytest.approx(
        report["results"]["naive"]["decode_tokens_per_s"] / rf["weight_streaming"]["tokens_per_s"])
    printed = capsys.readouterr().out
    assert "TTFT" in printed and "weight-streaming bound" in printed
    assert main(["bench", "--model", "tiny", "--random-init", "--prompt-len", "60", "--new-tokens", "10"]) == 2


# ----- exact boundaries (the property test above assume()s them away) -------------------------------------------


@pytest.mark.parametrize("p, kept", [(0.25, [0]), (0.5, [0, 1]), (0.75, [0, 1, 2]), (0.5 + 1e-6, [0, 1, 2]),
                                     (0.5 - 1e-6, [0, 1]), (1.0, [0, 1, 2, 3])])
def test_top_p_exact_boundaries(p, kept):
    """Four equal logits: probabilities exactly 0.25 each, prefix masses exactly 0, 0.25, 0.5, 0.75 (ties are
    ordered by index, the sort being stable). A token is dropped once the mass strictly before it reaches p, so
    p = 0.5 keeps two tokens, not three."""
    logits = torch.zeros(1, 4)
    got = torch.nonzero(torch.isfinite(top_p_filter(logits, p))[0]).flatten().tolist()
    assert got == kept


def test_stop_string_at_the_very_start_of_the_output():
    """A stop string at index 0 of the generated text stops at once with empty text (the token is streamed)."""
    tok = CharTokenizer()
    params = SamplingParams.greedy(10, stop=("c",))
    checker = StopChecker(tok, params)
    assert checker.update(2)  # decodes to "c": index 0
    assert checker.finish_reason == "stop" and checker.output_text() == ""
    checker = StopChecker(tok, SamplingParams.greedy(10, stop=("ab",)))
    assert not checker.update(0) and checker.update(1)  # "ab" spans two tokens and starts at index 0
    assert checker.output_text() == ""

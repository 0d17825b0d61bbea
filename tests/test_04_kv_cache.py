"""Chapter 04: the KV cache agrees with the naive loop (tokens exactly, logits to 1e-5), static batching gives each
prompt what it gets alone, and the cache's bytes equal the formula. No test here measures time."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import context_model
from minillm import GPT, GPTConfig
from minillm.kvcache.generate import (
    decode_step,
    generate,
    generate_ids,
    generate_static_batch,
    left_pad,
    prefill,
    static_positions,
)
from minillm.naive.generate import collect, generate_naive, generate_naive_ids
from minillm.kvcache.cache import ContiguousKVCache, kv_cache_bytes
from minillm.core.sampling import SamplingParams

# Logits of the cached path against a full forward: the same math summed in a different order (one query row
# against T keys instead of the last row of a T x T product), so they agree to float32 rounding, not bit for bit.
ATOL, RTOL = 1e-5, 1e-5

SMALL = dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64)


def make_model(seed: int = 0, device="cpu", **overrides) -> GPT:
    # The shared context-sensitive test model (tests/helpers.py): the old one here (GPT-2 init, embeddings x20)
    # repeated the last prompt token forever, so a wrong position or a corrupted cache left its tokens unchanged.
    return context_model(GPTConfig(**{**SMALL, **overrides}), seed=seed, device=device)


def random_prompts(n: int, vocab: int, lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def model() -> GPT:
    return make_model()


# ----- the cache against a full forward -------------------------------------------------------------------------


@pytest.mark.graded(points=3, exercise="attend")
@pytest.mark.parametrize("split", [1, 7, 20])
def test_prefill_then_decode_logits_match_full_forward(model, split):
    ids = torch.randint(0, SMALL["vocab_size"], (2, 30))
    with torch.inference_mode():
        full = model(ids)  # (2, 30, V): the naive computation of every position
        cache = ContiguousKVCache(model.config, 2, 30)
        parts = [model(ids[:, :split], cache=cache)]
        for t in range(split, 30):
            parts.append(model(ids[:, t:t + 1], positions=torch.tensor([t]), cache=cache))
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=ATOL, rtol=RTOL)
    assert cache.length == 30


@pytest.mark.graded(points=3, exercise="attend")
def test_chunked_prefill_logits_match_full_forward(model):
    """A chunk of several tokens after earlier ones needs the offset causal mask (query t sits at slot start+t)."""
    ids = torch.randint(0, SMALL["vocab_size"], (1, 24))
    with torch.inference_mode():
        full = model(ids)
        cache = ContiguousKVCache(model.config, 1, 24)
        out = [model(ids[:, a:b], positions=torch.arange(a, b), cache=cache) for a, b in ((0, 5), (5, 13), (13, 24))]
    torch.testing.assert_close(torch.cat(out, dim=1), full, atol=ATOL, rtol=RTOL)


def test_truncate_rewinds_the_cache(model):
    ids = torch.randint(0, SMALL["vocab_size"], (1, 12))
    with torch.inference_mode():
        cache = ContiguousKVCache(model.config, 1, 12)
        first = model(ids, cache=cache)[:, -1]
        cache.truncate(11)
        again = model(ids[:, -1:], positions=torch.tensor([11]), cache=cache)[:, -1]
    torch.testing.assert_close(again, first, atol=ATOL, rtol=RTOL)
    with pytest.raises(ValueError, match="13"):
        cache.truncate(13)


# ----- generation: identical to the naive loop ------------------------------------------------------------------


@pytest.mark.graded(points=2, exercise="attend")
def test_greedy_tokens_identical_to_naive_many_prompts(model):
    prompts = random_prompts(12, SMALL["vocab_size"], lengths=[1, 2, 5, 9, 16, 33])
    for prompt, n in zip(prompts, [1, 2, 8, 20, 31, 12, 5, 27, 16, 3, 30, 9]):
        params = SamplingParams.greedy(n, ignore_eos=True)
        assert generate_ids(model, prompt, params) == generate_naive_ids(model, prompt, params), (len(prompt), n)


@pytest.mark.graded(points=2, exercise="attend")
def test_step_logits_within_tolerance_of_naive(model):
    """Every step's logits, cached vs recomputed from scratch, for one prompt: atol = rtol = 1e-5."""
    prompt = random_prompts(1, SMALL["vocab_size"], [10])[0]
    tokens = generate_naive_ids(model, prompt, SamplingParams.greedy(25, ignore_eos=True))
    seq = torch.tensor([prompt + tokens])  # (1, 35)
    cache = ContiguousKVCache(model.config, 1, seq.size(1))
    cached = [prefill(model, cache, seq[:, :10])]
    for t in range(10, seq.size(1) - 1):
        cached.append(decode_step(model, cache, seq[:, t], torch.tensor([t])))
    with torch.inference_mode():
        naive = [model(seq[:, : t + 1])[:, -1] for t in range(9, seq.size(1) - 1)]
    torch.testing.assert_close(torch.stack(cached), torch.stack(naive), atol=ATOL, rtol=RTOL)


@pytest.mark.graded(points=1, exercise="attend")
@pytest.mark.parametrize("knobs", [dict(temperature=1.0), dict(temperature=0.7, top_k=20), dict(top_p=0.9)])
def test_seeded_sampling_gives_the_naive_tokens(model, knobs):
    prompt = random_prompts(1, SMALL["vocab_size"], [6], seed=4)[0]
    params = SamplingParams(max_new_tokens=24, seed=123, ignore_eos=True, **knobs)
    assert generate_ids(model, prompt, params) == generate_naive_ids(model, prompt, params)


def test_finish_reasons_and_window_cap_match_naive(model):
    """Stopping (eos, length) and the context-window cap behave exactly as in chapter 03."""
    bs = model.config.block_size
    prompt = random_prompts(1, SMALL["vocab_size"], [bs - 3])[0]
    params = SamplingParams.greedy(10, ignore_eos=True)  # only 4 tokens fit: prompt_len + n - 1 <= block_size
    cached, naive = collect(generate(model, prompt, params)), collect(generate_naive(model, prompt, params))
    assert cached == naive and len(cached[0]) == 4 and cached[1] == "length"
    # eos: pick the 3rd greedy token as the end-of-text id, both must stop right after it
    short = random_prompts(1, SMALL["vocab_size"], [5])[0]
    ref = generate_naive_ids(model, short, SamplingParams.greedy(10, ignore_eos=True))
    eos = ref[2]
    cached = collect(generate(model, short, SamplingParams.greedy(10), eos_id=eos))
    assert cached == collect(generate_naive(model, short, SamplingParams.greedy(10), eos_id=eos))
    assert cached[1] == "eos" and cached[0][-1] == eos


def test_truncate_and_full_window_prompt(model):
    bs = model.config.block_size
    long_prompt = random_prompts(1, SMALL["vocab_size"], [bs + 9])[0]
    params = SamplingParams.greedy(5, ignore_eos=True)
    with pytest.raises(ValueError, match="block_size"):
        generate(model, long_prompt, params)
    assert generate_ids(model, long_prompt, params, truncate=True) == generate_naive_ids(
        model, long_prompt, params, truncate=True)
    full = long_prompt[:bs]  # a prompt that fills the window still yields one token
    assert generate_ids(model, full, params) == generate_naive_ids(model, full, params) and len(
        generate_ids(model, full, params)) == 1


def test_stop_strings_with_a_tokenizer(model):
    from minillm.tokenizer import Tokenizer

    tok = Tokenizer({bytes([b]): b for b in range(256)}, "gpt4")  # bytes only: ids fit the small model
    prompt = [104, 105]
    ref = generate_naive_ids(model, prompt, SamplingParams.greedy(12, ignore_eos=True), tokenizer=tok)
    stop = tok.decode(ref[3:5])
    params = SamplingParams.greedy(12, stop=(stop,), ignore_eos=True)
    cached = collect(generate(model, prompt, params, tokenizer=tok))
    assert cached == collect(generate_naive(model, prompt, params, tokenizer=tok))
    assert cached[1] == "stop" and len(cached[0]) <= 5


def test_edge_cases(model):
    assert generate_ids(model, [3], SamplingParams.greedy(0)) == []
    assert generate_ids(model, [3], SamplingParams.greedy(1)) == generate_naive_ids(model, [3], SamplingParams.greedy(1))
    # kv_cache=False is the naive loop itself
    p = SamplingParams.greedy(6, ignore_eos=True)
    assert generate_ids(model, [1, 2, 3], p, kv_cache=False) == generate_naive_ids(model, [1, 2, 3], p)
    # a caller-owned cache is reused (reset between calls) and never reallocated
    cache = ContiguousKVCache(model.config, 1, 40)
    ptrs = [t.data_ptr() for t in cache.k + cache.v]
    a = generate_ids(model, [5, 6, 7], SamplingParams.greedy(20, ignore_eos=True), kv_cache=cache)
    b = generate_ids(model, [5, 6, 7], SamplingParams.greedy(20, ignore_eos=True), kv_cache=cache)
    assert a == b == generate_naive_ids(model, [5, 6, 7], SamplingParams.greedy(20, ignore_eos=True))
    assert [t.data_ptr() for t in cache.k + cache.v] == ptrs
    assert cache.length == 3 + 20 - 1  # the last sampled token is never fed back


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(0, SMALL["vocab_size"] - 1), min_size=1, max_size=40),
       n=st.integers(1, 30))
def test_property_greedy_equals_naive(model, prompt, n):
    params = SamplingParams.greedy(n, ignore_eos=True)
    assert generate_ids(model, prompt, params) == generate_naive_ids(model, prompt, params)


# ----- static batching --------------------------------------------------------------------------------------------


@pytest.mark.graded(points=1, exercise="left_pad")
def test_left_pad_worked_example():
    idx, pads = left_pad([[5, 6, 7], [9], [1, 2]])
    assert idx.tolist() == [[5, 6, 7], [0, 0, 9], [0, 1, 2]]
    assert pads.tolist() == [0, 2, 1]


@pytest.mark.graded(points=1, exercise="static_positions")
def test_static_positions_worked_example():
    pads = torch.tensor([0, 2])
    assert static_positions(pads, 0, 3).tolist() == [[0, 1, 2], [0, 0, 0]]
    assert static_positions(pads, 3, 1).tolist() == [[3], [1]]


@pytest.mark.graded(points=3, exercise="attention_mask")
def test_padding_mask():
    """Row 1 has two padding slots: its real queries never see them; padding queries see only themselves."""
    cache = ContiguousKVCache(GPTConfig(**SMALL), 2, 8).reset([0, 2])
    mask = cache.attention_mask(0, 4)  # (B, 1, T, 4)
    assert mask.shape == (2, 1, 4, 4)
    assert mask[0, 0].tolist() == torch.ones(4, 4, dtype=torch.bool).tril().tolist()
    assert mask[1, 0].tolist() == [
        [True, False, False, False],   # padding slot 0 sees itself only (keeps it finite)
        [False, True, False, False],   # padding slot 1 likewise
        [False, False, True, False],   # first real token: position 0
        [False, False, True, True],
    ]
    assert cache.attention_mask(4, 1)[1, 0].tolist() == [[False, False, True, True, True]]


@pytest.mark.graded(points=2, exercise=("left_pad", "static_positions", "attention_mask", "attend"))
def test_static_batch_greedy_equals_each_prompt_alone(model):
    prompts = random_prompts(6, SMALL["vocab_size"], lengths=[1, 4, 11, 17, 25, 40], seed=7)
    params = SamplingParams.greedy(18, ignore_eos=True)
    batched = generate_static_batch(model, prompts, params)
    assert batched == [generate_ids(model, p, params) for p in prompts]
    assert batched == [generate_naive_ids(model, p, params) for p in prompts]


@pytest.mark.graded(points=2, exercise=("left_pad", "static_positions", "attention_mask", "attend"))
def test_static_batch_logits_close_to_alone(model):
    """Padding and a bigger matmul change float rounding slightly, never more than atol = rtol = 1e-5."""
    prompts = random_prompts(3, SMALL["vocab_size"], lengths=[3, 14, 9], seed=8)
    idx, pads = left_pad(prompts)
    cache = ContiguousKVCache(model.config, 3, idx.size(1)).reset(pads)
    batched = prefill(model, cache, idx, static_positions(pads, 0, idx.size(1)))  # (3, V)
    for row, p in enumerate(prompts):
        alone = prefill(model, ContiguousKVCache(model.config, 1, len(p)), torch.tensor([p]))
        torch.testing.assert_close(batched[row:row + 1], alone, atol=ATOL, rtol=RTOL)


def test_static_batch_mixed_params_and_lengths(model):
    prompts = random_prompts(4, SMALL["vocab_size"], lengths=[2, 30, 8, 15], seed=9)
    params = [
        SamplingParams(max_new_tokens=12, temperature=0.9, seed=1, ignore_eos=True),
        SamplingParams.greedy(3, ignore_eos=True),
        SamplingParams(max_new_tokens=20, top_k=10, seed=2, ignore_eos=True),
        SamplingParams.greedy(0),
    ]
    seen: list[tuple[int, int]] = []
    out = generate_static_batch(model, prompts, params, on_token=lambda r, t: seen.append((r, t)))
    assert out == [generate_ids(model, p, sp) for p, sp in zip(prompts, params)]
    assert [len(o) for o in out] == [12, 3, 20, 0]
    assert sorted(seen) == sorted((r, t) for r, o in enumerate(out) for t in o)


def test_static_batch_short_row_near_the_window(model):
    """A finished row must not push positions past block_size while a longer request keeps going."""
    bs = model.config.block_size
    prompts = random_prompts(2, SMALL["vocab_size"], lengths=[bs - 2, 3], seed=10)
    params = [SamplingParams.greedy(3, ignore_eos=True), SamplingParams.greedy(bs - 5, ignore_eos=True)]
    out = generate_static_batch(model, prompts, params)
    assert out == [generate_naive_ids(model, p, sp) for p, sp in zip(prompts, params)]


# ----- memory -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,nbytes", [(torch.float32, 4), (torch.float16, 2), (torch.bfloat16, 2)])
@pytest.mark.parametrize("batch,max_len", [(1, 1), (3, 50), (8, 256)])
def test_cache_bytes_equal_the_formula(dtype, nbytes, batch, max_len):
    cfg = GPTConfig.from_name("base")
    cache = ContiguousKVCache(cfg, batch, max_len, dtype=dtype)
    expected = 2 * cfg.n_layer * cfg.n_head * cfg.head_size * max_len * batch * nbytes
    assert cache.nbytes == expected
    assert cache.nbytes == kv_cache_bytes(cfg.n_layer, cfg.n_head, cfg.head_size, max_len, batch, nbytes)


def test_formula_reproduces_the_published_examples():
    # vLLM §3: OPT-13B, fp16, 40 layers, hidden 5120 (40 heads x 128): "800 KB" per token, "1.6 GB" at 2048.
    per_token = kv_cache_bytes(40, 40, 128, 1, 1, 2)
    assert per_token == 819_200 == 800 * 1024
    assert kv_cache_bytes(40, 40, 128, 2048, 1, 2) == 2048 * per_token  # 1.68e9 B = 1.56 GiB
    # GQA: Llama-3.1-8B, 32 layers, 8 kv heads x 128, bf16: 128 KiB per token.
    assert kv_cache_bytes(32, 8, 128, 1, 1, 2) == 128 * 1024


# ----- bad input -------------------------------------------------------------------------------------------------


def test_bad_input(model):
    cfg = model.config
    with pytest.raises(TypeError, match="GPTConfig"):
        ContiguousKVCache("base", 1, 8)
    with pytest.raises(ValueError, match="max_len must be positive, got 0"):
        ContiguousKVCache(cfg, 1, 0)
    with pytest.raises(TypeError, match="batch_size must be an int"):
        ContiguousKVCache(cfg, 1.5, 8)
    with pytest.raises(TypeError, match="dtype"):
        ContiguousKVCache(cfg, 1, 8, dtype=torch.int8)
    cache = ContiguousKVCache(cfg, 2, 8)
    with pytest.raises(ValueError, match=r"pad_lens must be in \[0, max_len=8\), got \[0, 9\]"):
        cache.reset([0, 9])
    with pytest.raises(ValueError, match="one per row"):
        cache.reset([0, 1, 2])
    with pytest.raises(ValueError, match=r"batch_size=2, T\), got \(1, 2\)"):
        prefill(model, cache, torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="cache full: 0 slots used \\+ 9 new > max_len=8"):
        prefill(model, cache, torch.ones(2, 9, dtype=torch.long))
    with pytest.raises(TypeError, match="kv_cache must be True, False or a ContiguousKVCache"):
        generate(model, [1], SamplingParams.greedy(2), kv_cache="yes")
    with pytest.raises(ValueError, match="max_len >= 12"):
        generate(model, [1, 2, 3], SamplingParams.greedy(10), kv_cache=ContiguousKVCache(cfg, 1, 5))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(model, [1, 99999], SamplingParams.greedy(2))
    with pytest.raises(ValueError, match="empty"):
        generate(model, [], SamplingParams.greedy(2))
    with pytest.raises(ValueError, match="n=2"):
        generate(model, [1], dataclasses.replace(SamplingParams.greedy(2), n=2))
    with pytest.raises(ValueError, match="non-empty list"):
        generate_static_batch(model, [], SamplingParams.greedy(2))
    with pytest.raises(ValueError, match="list of 2"):
        generate_static_batch(model, [[1], [2], [3]], [SamplingParams.greedy(2)] * 2)
    with pytest.raises(ValueError, match=r"prompts\[1\]: .*outside the vocabulary"):
        generate_static_batch(model, [[1], [2, -4]], SamplingParams.greedy(2))


# ----- devices ----------------------------------------------------------------------------------------------------


def test_on_device(device):
    m = make_model(device=device)
    prompts = random_prompts(3, SMALL["vocab_size"], lengths=[2, 9, 5], seed=11)
    params = SamplingParams.greedy(10, ignore_eos=True)
    alone = [generate_ids(m, p, params) for p in prompts]
    assert alone == [generate_naive_ids(m, p, params) for p in prompts]
    assert generate_static_batch(m, prompts, params) == alone


def test_benchmark_helpers_report_consistent_checks(model):
    """The chapter's benchmark module on a small model: its checks pass and its report has every figure (no timing
    is asserted; only that the measured quantities exist and the equivalences hold)."""
    from minillm.kvcache.bench import check_equivalence, memory_check, static_batch_speedup, step_latency_by_position

    prompts = random_prompts(3, SMALL["vocab_size"], lengths=[2, 7, 12], seed=12)
    eq = check_equivalence(model, prompts, 6)
    assert eq["identical"] == 3 and eq["max_abs_logit_diff"] <= ATOL + RTOL * eq["max_abs_logit"]
    sb = static_batch_speedup(model, prompts, 6)
    assert (sb["identical_rows"], sb["rows"]) == (3, 3) and sb["speedup"] > 0
    mem = memory_check(model, batch_size=2, max_len=10)
    assert mem["equal"] and mem["measured_bytes"] == 2 * 2 * 4 * 16 * 10 * 2 * 4
    lat = step_latency_by_position(model, [1, 5, 9], repeats=1)
    assert lat["positions"] == [1, 5, 9] and len(lat["cached_s"]) == len(lat["naive_s"]) == 3
    with pytest.raises(ValueError, match="positions must lie in"):
        step_latency_by_position(model, [0, 64], repeats=1)


def test_projection_times_compare_the_same_projections():
    pytest.importorskip("transformers")
    from minillm.kvcache.bench import projection_times

    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny")).eval()
    res = projection_times(model, repeats=1, passes=2)
    assert set(res) == {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"}
    for r in res.values():
        assert min(r["ours_hot"], r["hf_hot"], r["ours_streamed"], r["hf_streamed"]) > 0
        assert r["max_abs_diff"] < 1e-5  # HF's Conv1D carries our Linear weights, transposed, exactly


def test_generate_takes_a_prefill_and_a_decode_function(model):
    """`prefill_fn` and `decode_fn` replace `prefill` and `decode_step` (chapter 13 plugs its fast paths in here):
    each is called with the model, the cache and the prompt (1, T) or the token (1,), at positions 0..T-1 or the next
    one; the tokens are theirs. A value that is not callable is a TypeError naming it."""
    m = model
    seen: list[tuple[str, int, list[int]]] = []

    def my_prefill(model_, cache, ids, positions):
        seen.append(("prefill", ids.shape[1], positions.tolist()))
        return prefill(model_, cache, ids, positions)

    def my_decode(model_, cache, token, positions):
        seen.append(("decode", token.numel(), positions.tolist()))
        return decode_step(model_, cache, token, positions)

    params = SamplingParams.greedy(4, ignore_eos=True)
    assert generate_ids(m, [5, 6, 7], params, prefill_fn=my_prefill, decode_fn=my_decode) == generate_ids(
        m, [5, 6, 7], params)
    assert seen == [("prefill", 3, [0, 1, 2]), ("decode", 1, [3]), ("decode", 1, [4]), ("decode", 1, [5])]
    for name in ("prefill_fn", "decode_fn"):
        with pytest.raises(TypeError, match=f"{name} must be callable"):
            generate_ids(m, [5], params, **{name: "prefill"})

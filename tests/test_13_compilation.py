"""Chapter 13 (under construction): the static-shape decode step, eager, compiled and captured, gives chapter 04's
greedy tokens, and compiles one graph for a whole generation. No test here measures time.

torch.compile runs with the `aot_eager` backend here (dynamo's full-graph capture and AOT functionalization, without
inductor's C++ build, which takes tens of seconds on a small CPU): a graph break, a guard on per-step Python state or
a wrong graph shows up either way. The CUDA-graph test runs where a GPU is.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_every_generator_agrees, context_model, noisy_copy
from minillm import GPTConfig
from minillm.bench.models import load_model
from minillm.compile.bench import FUSED, quotes as bench_quotes, run_all, weight_streaming_bound
from minillm.compile.cpu_gemv import (build_problem, fast_cpu_model, gemv, has_avx2, int4_gemv, int8_gemv,
                                      load_cpu_ext)
from minillm.compile.cpu_paged import NAME, VERIFY_NAME, paged_decode_attention, paged_verify_attention
from minillm.compile.decode import StaticDecoder, compile_problem
from minillm.compile import aot, fused_step, llamacpp, mirror
from minillm.compile.fused_step import FusedCPUDecoder
from minillm.compile.sweep import Case, profile_decode, quotes as sweep_quotes, run_sweep
from minillm.core.sampling import SamplingParams
from minillm.course.results import find_values
from minillm.kvcache.cache import ContiguousKVCache
from minillm.kvcache.generate import decode_step, generate_ids, prefill
from minillm.naive.roofline import decode_weight_bytes
from minillm.quant.linear import QuantConfig, QuantLinear, quantize_model
from minillm.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer

SMALL = GPTConfig(vocab_size=4096, block_size=64, n_layer=2, n_head=4, n_embd=64)
PROMPTS = [[5, 17, 99, 3], [200, 1, 1, 42, 7, 9, 11, 300, 12], [64]]
DYNAMO = hasattr(torch, "compile") and torch._dynamo.is_dynamo_supported()


def model(device: str = "cpu"):
    return context_model(SMALL, seed=0, device=device)


@pytest.mark.parametrize("mode", ["eager", pytest.param("compile", marks=pytest.mark.skipif(
    not DYNAMO, reason="torch.compile (dynamo) is not supported on this Python/PyTorch"))])
def test_static_decoder_gives_the_generators_tokens_and_compiles_once(mode):
    m = model()
    dec = StaticDecoder(m, mode, backend="aot_eager")
    params = SamplingParams.greedy(20, ignore_eos=True)
    for prompt in PROMPTS:  # prompts of three lengths through one decoder: one graph for all of them
        assert dec.generate_ids(prompt, params) == generate_ids(m, prompt, params)
    assert dec.compiles == (1 if mode == "compile" else 0)
    assert dec.calls == 3 * 19 and dec.first_call_seconds is not None


@pytest.mark.parametrize("mode", [
    "eager",
    pytest.param("compile", marks=pytest.mark.skipif(not DYNAMO, reason="torch.compile (dynamo) is not supported")),
    pytest.param("cuda-graph", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])
def test_batched_static_decoder_equals_the_dynamic_cache_step(mode):
    """A static batch of 3 rows through the static-shape step (eager, compiled or a captured CUDA graph) gives the
    logits of chapter 04's `decode_step` over a growing cache, step after step; one graph for every step."""
    device = "cuda" if mode == "cuda-graph" else "cpu"
    m = model(device)
    B, T = 3, 5
    idx = torch.randint(0, SMALL.vocab_size, (B, T), generator=torch.Generator().manual_seed(1)).to(device)
    dec = StaticDecoder(m, mode, backend="aot_eager", max_len=T + 6, batch_size=B)
    ref = ContiguousKVCache(SMALL, B, T + 6, device=device)
    positions = torch.arange(T, device=device).expand(B, T)
    torch.testing.assert_close(prefill(m, dec.cache, idx, positions), prefill(m, ref, idx, positions))
    tokens = idx[:, -1]
    for step in range(6):
        pos = torch.full((B,), T + step, device=device)
        got, want = dec(m, dec.cache, tokens, pos), decode_step(m, ref, tokens, pos.view(B, 1))  # (B, V) each
        torch.testing.assert_close(got, want, atol=1e-4 if device == "cuda" else 1e-5, rtol=1e-5)
        tokens = want.argmax(-1)
    assert dec.compiles == (0 if mode == "eager" else 1)
    with pytest.raises(ValueError, match="batch_size 3 takes 3"):
        dec(m, dec.cache, tokens[:2], pos[:2])
    with pytest.raises(ValueError, match="batch_size 3"):
        dec.generate_ids(PROMPTS[0], SamplingParams.greedy(2))


@pytest.mark.skipif(not DYNAMO, reason="torch.compile (dynamo) is not supported on this Python/PyTorch")
def test_compile_sweep_checks_every_case_against_eager():
    """The sweep's rows on a small model (aot_eager): every case's compiled outputs against eager's, one graph each,
    at each thread count; the thread setting comes back. Timings are reported, never asserted."""
    m = model()
    before = torch.get_num_threads()
    cases = (Case("decode", 1, 6), Case("decode", 3, 6), Case("prefill", 1, 12))
    report = run_sweep(m, threads=(1, 2), cases=cases, steps=3, repeats=1, backend="aot_eager")
    assert torch.get_num_threads() == before
    rows = report["rows"]
    assert [(r["threads"], r["case"]) for r in rows] == [(n, c.name) for n in (1, 2) for c in cases]
    for r in rows:
        assert r["ok"] and r["same_argmax"] and r["max_abs_diff"] <= 1e-3, r
        assert r["compiles"] == 1 and r["eager_s"] > 0 and r["compiled_s"] > 0
    assert rows[0]["steps"] == 3 and rows[2]["steps"] == 1
    with pytest.raises(ValueError, match=r"threads\[0\] must be positive, got 0"):
        run_sweep(m, threads=(0,))
    with pytest.raises(ValueError, match="kind"):
        Case("generate", 1, 4)
    with pytest.raises(ValueError, match="batch"):
        Case("decode", 0, 4)
    prof = profile_decode(m, Case("decode", 1, 6), steps=2, backend="aot_eager", top=5)
    for mode in ("eager", "compile"):
        assert 1 <= len(prof[mode]) <= 5 and all(0 <= op["share"] <= 1 for op in prof[mode])
    assert any("mm" in op["name"] for op in prof["eager"])  # the products are the eager step's biggest calls


@pytest.mark.skipif(not DYNAMO or not torch.cuda.is_available(), reason="needs torch.compile and CUDA")
def test_compile_sweep_on_cuda_checks_the_captured_graph_too():
    m = model("cuda")
    report = run_sweep(m, threads=(1,), cases=(Case("decode", 1, 6), Case("decode", 3, 6)), steps=3, repeats=1,
                       backend="aot_eager")
    for r in report["rows"]:
        assert r["ok"] and r["graph_same_argmax"] and r["graph_max_abs_diff"] <= 1e-3 and r["graph_s"] > 0, r


def test_static_decoder_honours_the_request_lifecycle():
    """Stops (eos, max_new_tokens) and the window cap come from chapter 04's generate, unchanged."""
    m = model()
    dec = StaticDecoder(m, "eager")
    want = generate_ids(m, PROMPTS[1], SamplingParams.greedy(12, ignore_eos=True))
    eos = want[5]
    got = dec.generate_ids(PROMPTS[1], SamplingParams.greedy(12), eos_id=eos)
    assert got == want[: want.index(eos) + 1]
    seeded = SamplingParams(max_new_tokens=10, temperature=0.8, top_k=50, seed=3)
    assert dec.generate_ids(PROMPTS[0], seeded) == generate_ids(m, PROMPTS[0], seeded)


def test_static_decoder_rejects_bad_arguments():
    m = model()
    with pytest.raises(ValueError, match="mode"):
        StaticDecoder(m, "jit")
    with pytest.raises(TypeError, match="GPT"):
        StaticDecoder(torch.nn.Linear(2, 2))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            StaticDecoder(m, "cuda-graph")
    dec = StaticDecoder(m, "eager")
    other = ContiguousKVCache(SMALL, 1, 64, use_static_shapes=True)
    with pytest.raises(ValueError, match="its own cache"):
        generate_ids(m, PROMPTS[0], SamplingParams.greedy(3, ignore_eos=True), kv_cache=other, decode_fn=dec)
    with pytest.raises(TypeError, match="decode_fn"):
        generate_ids(m, PROMPTS[0], SamplingParams.greedy(3), decode_fn="fast")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_decoder_gives_the_generators_tokens():
    m = model("cuda")
    dec = StaticDecoder(m, "cuda-graph")
    params = SamplingParams.greedy(20, ignore_eos=True)
    for prompt in PROMPTS:
        assert dec.generate_ids(prompt, params) == generate_ids(m, prompt, params)
    assert dec.compiles == 1  # captured once, replayed for every token of every prompt


def test_weight_streaming_bound_counts_every_matrix_once():
    m = model()
    b = weight_streaming_bound(m, repeats=1, calls=2)
    C, V, L = SMALL.n_embd, SMALL.vocab_size, SMALL.n_layer
    per_block = (3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C) + (4 * C * C + C)
    assert b["bytes"] == 4 * (L * per_block + V * C) and b["tok_s_bound"] > 0
    assert b["step_seconds"] == min(b["seconds"].values()) and b["by"] in b["seconds"]
    assert set(b["seconds"]) == ({"F.linear"} if build_problem() else {"F.linear", "C++ GEMV"})


@pytest.mark.skipif(not DYNAMO, reason="torch.compile (dynamo) is not supported on this Python/PyTorch")
def test_benchmark_rows_on_a_small_model():
    draft = context_model(GPTConfig(**{**SMALL.to_dict(), "n_layer": 1}), seed=1)  # smaller, the same vocabulary
    report = run_all(model(), real_text=True, quick=True, backend="aot_eager", with_hf=False, draft=draft)
    modes = [r["mode"] for r in report["rows"]]
    assert modes[-2:] == ["eager", "compile"] and modes[:-2] in ([], ["C++ GEMV (fast_cpu_model)", FUSED])
    assert all(r["identical"] for r in report["rows"]) and report["rows"][-1]["compiles"] == 1
    for r in report["rows"]:  # both fractions of the bound, each from its own timing (values are not asserted)
        assert r["fraction_of_bound"] > 0 and r["bound_tok_s"] > 0
        assert r["fraction_of_fastest_bound"] == pytest.approx(r["tok_s"] / report["bound"]["tok_s_bound"])
    if modes[:-2]:  # the C++ step builds here: chapter 10's MLP-pruned model on it, the pruned model's own tokens
        p = report["pruned_fused"]
        hidden = 4 * SMALL.n_embd  # a quarter of each block's neurons gone: c_fc and c_proj lose a quarter
        removed = SMALL.n_layer * (hidden // 4) * (2 * SMALL.n_embd + 1) * 4
        total = decode_weight_bytes(model())
        assert p["identical"] and p["weight_ratio"] == pytest.approx(total / (total - removed))
        q = report["quantized_fused"]  # chapter 09's int8 model on it: the int8 model's own tokens, a byte per weight
        linears = total - 4 * SMALL.vocab_size * SMALL.n_embd  # the block linears' float32 bytes (the head stays)
        assert q["identical"] and q["int8_path"] in ("AVX-512", "AVX2 + FMA", "scalar")
        assert q["int8_MB"] * 1e6 < total - linears + linears / 2 and q["weight_ratio"] > 1
        q4 = q["int4"]  # and its int4 model: half a byte per weight, fewer bytes than int8's
        assert q4["identical"] and q4["path"] in ("AVX-512", "AVX2 + FMA", "scalar")
        assert q4["MB"] < q["int8_MB"] and q4["weight_ratio"] > q["weight_ratio"] and q4["vs_int8"] > 0
        s = report["fused_speculation"]  # speculation on it: the target's own tokens, however often the draft is right
        assert s["identical"] and s["lookup"]["identical"] and 0 <= s["alpha"] <= 1 and s["tokens_per_call"] >= 1
        assert s["verify_cost"][0] == 1 and len(s["verify_cost"]) == max(s["gamma"], s["lookup"]["gamma"]) + 1
        assert s["draft_cost"] > 0


@pytest.mark.skipif(not DYNAMO or shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor's CPU backend needs torch.compile and a C++ compiler")
def test_inductor_compiled_decoder_gives_the_generators_tokens():
    """The real backend once (a C++ build of the generated kernels, ~10-25 s cold, cached after): same greedy
    tokens as eager chapter 04, one graph."""
    m = model()
    dec = StaticDecoder(m, "compile", backend="inductor")
    params = SamplingParams.greedy(12, ignore_eos=True)
    for prompt in PROMPTS[:2]:
        assert dec.generate_ids(prompt, params) == generate_ids(m, prompt, params)
    assert dec.compiles == 1


def test_compile_problem_says_what_is_missing(monkeypatch):
    """The notebook's guard before `torch.compile`: None where inductor can build, else the missing piece by name."""
    if DYNAMO:
        monkeypatch.setattr(shutil, "which", lambda name: None)
        assert compile_problem() == "inductor's CPU backend needs a C++ compiler (c++ or g++) on the PATH"
    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: False)
    assert compile_problem() == "torch.compile (dynamo) is not supported on this Python/PyTorch"


needs_cpp = pytest.mark.skipif(build_problem() is not None, reason=f"cannot build the C++ GEMV: {build_problem()}")


@needs_cpp
@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (1, 7, 9), (3, 33, 130), (4, 768, 256), (2, 5, 8)])
@pytest.mark.parametrize("bias", [True, False])
def test_cpp_gemv_equals_f_linear(M, N, K, bias):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    torch.testing.assert_close(gemv(x, w, b), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5 * K ** 0.5)


@needs_cpp
def test_cpp_gemv_rejects_bad_arguments():
    w = torch.randn(4, 8)
    with pytest.raises(TypeError, match="float32"):
        gemv(torch.randn(1, 8, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="same K"):
        gemv(torch.randn(1, 7), w)
    with pytest.raises(ValueError, match=r"b must have shape \(4,\)"):
        gemv(torch.randn(1, 8), w, torch.randn(3))
    xt = torch.randn(8, 2).t()  # (2, 8), not contiguous: copied, not refused
    torch.testing.assert_close(gemv(xt, w), torch.nn.functional.linear(xt, w), rtol=1e-5, atol=1e-5)


@needs_cpp
def test_fast_cpu_model_gives_the_generators_tokens_everywhere():
    """Every few-row product through C++ (decode), prefill through F.linear, training untouched: the same greedy
    tokens from chapter 04's generator, static batching and the engine."""
    m = model()
    fast = fast_cpu_model(m)
    assert fast.lm_head.weight is fast.transformer.wte.weight and type(fast.lm_head).__name__ == "FastLinear"
    params = SamplingParams.greedy(20, ignore_eos=True)
    for prompt in PROMPTS:
        assert generate_ids(fast, prompt, params) == generate_ids(m, prompt, params)
    assert_every_generator_agrees(fast, vocab_size=SMALL.vocab_size)
    x = torch.randn(2, 3, SMALL.n_embd, requires_grad=True)  # with grad: F.linear, so backward works
    fast.transformer.h[0].mlp.c_fc(x).sum().backward()
    assert x.grad is not None


@needs_cpp
def test_fused_cpu_step_equals_the_models_logits_step_by_step():
    """One C++ call per token against GPT.hidden + logits over a ContiguousKVCache: logits to float rounding at every
    position (the cache filling up to the window's end), and the same keys and values stored in the cache."""
    m = model()
    assert_steps_equal_the_model(m, FusedCPUDecoder(m), seed=1)


def assert_in_place_changes_are_seen(q, dec: FusedCPUDecoder, flip) -> torch.nn.Module:
    """Block 1's mlp.c_fc scales tripled and `flip` applied to its first 5 code rows, in place (the step holds that
    storage): the fused step's greedy tokens still equal the eager quantized model's. Returns the changed layer."""
    fc = q.transformer.h[1].mlp.c_fc
    with torch.no_grad():
        fc.scale.mul_(3.0)
        flip(fc.qweight[:5])
    params = SamplingParams.greedy(16, ignore_eos=True)
    for prompt in PROMPTS:
        assert dec.generate_ids(prompt, params) == generate_ids(q, prompt, params)
    return fc


def assert_steps_equal_the_model(m, dec: FusedCPUDecoder, seed: int) -> None:
    """The decoder's C++ step, one call per token, against `m`'s own GPT.hidden + logits over a ContiguousKVCache:
    after a 3-token prefill through the model (as generate does for a long prompt), logits within 1e-4 at every
    position up to the window's end, and the same keys and values stored in the cache."""
    ref = ContiguousKVCache(SMALL, 1, SMALL.block_size)
    ids = torch.randint(0, SMALL.vocab_size, (1, SMALL.block_size), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        m.hidden(ids[:, :3], torch.arange(3), dec.cache)
        m.hidden(ids[:, :3], torch.arange(3), ref)
        for pos in range(3, SMALL.block_size):
            want = m.logits(m.hidden(ids[:, pos:pos + 1], torch.tensor([pos]), ref)[:, -1])  # (1, V)
            got = dec(m, dec.cache, ids[0, pos:pos + 1], torch.tensor([pos]))
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert dec.cache.length == ref.length == SMALL.block_size
    for layer in range(SMALL.n_layer):
        torch.testing.assert_close(dec.cache.k[layer], ref.k[layer], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dec.cache.v[layer], ref.v[layer], rtol=1e-5, atol=1e-5)


@needs_cpp
def test_fused_cpu_step_gelu_holds_at_large_activations():
    """The vectorized GELU (tanh through an 8-wide exp) where tanh saturates: c_fc scaled so its outputs reach
    hundreds, logits still equal the model's (whose F.gelu uses the same tanh form)."""
    m = model()
    with torch.no_grad():
        for block in m.transformer.h:
            block.mlp.c_fc.weight.mul_(60.0)
    dec = FusedCPUDecoder(m)
    ref = ContiguousKVCache(SMALL, 1, SMALL.block_size)
    ids = torch.tensor([[5, 17, 99, 3, 200, 1]])
    with torch.inference_mode():
        x = m.transformer.h[0].ln_2(m.transformer.wte(ids) + m.transformer.wpe(torch.arange(6)))
        assert m.transformer.h[0].mlp.c_fc(x).abs().max() > 100
        m.hidden(ids[:, :1], torch.arange(1), dec.cache)
        m.hidden(ids[:, :1], torch.arange(1), ref)
        for pos in range(1, 6):
            want = m.logits(m.hidden(ids[:, pos:pos + 1], torch.tensor([pos]), ref)[:, -1])
            got = dec(m, dec.cache, ids[0, pos:pos + 1], torch.tensor([pos]))
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


@needs_cpp
def test_fused_cpu_step_gives_the_generators_tokens():
    """Greedy tokens as chapter 04's eager generator, on prompts of three lengths through one decoder (its cache
    reset by each request), with the lifecycle's stops, seeded sampling, and a model whose heads and MLP were
    pruned (chapter 10: nh * hs != C and an MLP narrower than 4C)."""
    m = model()
    dec = FusedCPUDecoder(m)
    params = SamplingParams.greedy(20, ignore_eos=True)
    for prompt in PROMPTS:
        assert dec.generate_ids(prompt, params) == generate_ids(m, prompt, params)
    want = generate_ids(m, PROMPTS[1], SamplingParams.greedy(12, ignore_eos=True))
    got = dec.generate_ids(PROMPTS[1], SamplingParams.greedy(12), eos_id=want[5])
    assert got == want[: want.index(want[5]) + 1]
    seeded = SamplingParams(max_new_tokens=10, temperature=0.8, top_k=50, seed=3)
    assert dec.generate_ids(PROMPTS[0], seeded) == generate_ids(m, PROMPTS[0], seeded)
    dec._cpp.products(3)  # the benchmark's bound runs the step's products on the scratch: no state survives it
    assert dec.generate_ids(PROMPTS[2], params) == generate_ids(m, PROMPTS[2], params)
    from minillm.prune.structured import prune_heads, shrink_mlp

    keep = [torch.arange(0, 4 * SMALL.n_embd, 3) for _ in range(SMALL.n_layer)]  # a third of each MLP's neurons
    pruned = shrink_mlp(prune_heads(m, {i: [1] for i in range(SMALL.n_layer)}), keep)
    assert pruned.config.attn_dim == 3 * SMALL.head_size
    pdec = FusedCPUDecoder(pruned)
    for prompt in PROMPTS:
        assert pdec.generate_ids(prompt, params) == generate_ids(pruned, prompt, params)


@needs_cpp
def test_fused_cpu_step_rejects_what_it_cannot_run():
    m = model()
    with pytest.raises(TypeError, match="GPT"):
        FusedCPUDecoder(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="float32"):
        FusedCPUDecoder(model().double())
    dec = FusedCPUDecoder(m)
    with pytest.raises(ValueError, match="its own cache"):
        generate_ids(m, PROMPTS[0], SamplingParams.greedy(3, ignore_eos=True), decode_fn=dec)
    with pytest.raises(ValueError, match="token id 4096 is outside the vocabulary"):
        dec(m, dec.cache, torch.tensor([SMALL.vocab_size]), torch.tensor([0]))
    with pytest.raises(ValueError, match="position 64 is outside the context window"):
        dec(m, dec.cache, torch.tensor([1]), torch.tensor([SMALL.block_size]))
    dec.cache.reset().truncate(0)
    dec.cache.mark_written(SMALL.block_size)
    with pytest.raises(ValueError, match="slot 64 is outside the cache"):
        dec(m, dec.cache, torch.tensor([1]), torch.tensor([3]))
    assert dec.cache.length == SMALL.block_size  # a refused step leaves the cache as it was
    full = ContiguousKVCache(SMALL, 1, 4)
    full.mark_written(4)
    with pytest.raises(ValueError, match="cache full"):
        full.mark_written(1)
    with pytest.raises(ValueError, match="static-shape"):
        ContiguousKVCache(SMALL, 1, 4, use_static_shapes=True).mark_written(1)


def shuffled_pool(lens: list[int], nh: int, hs: int, bs: int, g: torch.Generator
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K and V pools (nb, bs, nh, hs) of random values and block tables (S, max_nb) giving sequence s the blocks for
    lens[s] tokens, drawn from a shuffled pool (-1 past each sequence's blocks, one spare column and two spare
    blocks)."""
    S = len(lens)
    max_nb = max(-(-n // bs) for n in lens) + 1
    nb = S * max_nb + 2
    k_pool, v_pool = torch.randn(nb, bs, nh, hs, generator=g), torch.randn(nb, bs, nh, hs, generator=g)
    tables = torch.full((S, max_nb), -1, dtype=torch.int64)
    ids = torch.randperm(nb, generator=g)
    for s, n in enumerate(lens):
        tables[s, : -(-n // bs)] = ids[s * max_nb : s * max_nb - (-n // bs)]
    return k_pool, v_pool, tables


@needs_cpp
@pytest.mark.parametrize("S,nh,hs,bs", [(1, 1, 1, 1), (3, 4, 16, 4), (5, 2, 7, 3), (8, 8, 32, 16)])
def test_cpp_paged_decode_attention_equals_the_gathered_reference(S, nh, hs, bs):
    """Every sequence's query against its own blocks, in a shuffled pool, lengths from 1 to several blocks (one ends
    exactly on a block boundary): equal to SDPA over the K/V gathered through the block table."""
    g = torch.Generator().manual_seed(S * 100 + nh * 10 + hs)
    lens = [1 + (7 * s + 3) % (3 * bs) for s in range(S)]
    lens[-1] = 2 * bs
    k_pool, v_pool, tables = shuffled_pool(lens, nh, hs, bs, g)
    for scale in (1.0, 300.0):  # ordinary scores, then scores hundreds apart (the softmax's exp at its extremes)
        q = torch.randn(S, nh, hs, generator=g) * scale
        got = paged_decode_attention(q, k_pool, v_pool, tables, torch.tensor(lens))
        for s, n in enumerate(lens):
            blocks = tables[s, : -(-n // bs)]
            k = k_pool[blocks].flatten(0, 1)[:n].transpose(0, 1)  # (nh, n, hs)
            v = v_pool[blocks].flatten(0, 1)[:n].transpose(0, 1)
            want = torch.nn.functional.scaled_dot_product_attention(q[s].unsqueeze(1), k, v).squeeze(1)  # (nh, hs)
            torch.testing.assert_close(got[s], want, rtol=1e-5, atol=1e-5)


@needs_cpp
@pytest.mark.parametrize("S,nh,hs,bs", [(1, 1, 1, 1), (3, 4, 16, 4), (5, 2, 7, 3)])
def test_cpp_paged_verify_attention_equals_the_causal_reference(S, nh, hs, bs):
    """Several queries per sequence (a verify step: 1 to 6 new tokens, the last ones of each context), in a shuffled
    pool: query j of a sequence equals SDPA over its gathered K/V with the causal mask of its new tokens; with one
    query per sequence it is paged_decode_attention's result."""
    g = torch.Generator().manual_seed(S * 100 + nh * 10 + hs)
    lens = [6 + (7 * s + 3) % (3 * bs) for s in range(S)]
    qls = [1 + (5 * s) % 6 for s in range(S)]
    k_pool, v_pool, tables = shuffled_pool(lens, nh, hs, bs, g)
    q = torch.randn(sum(qls), nh, hs, generator=g)
    got = paged_verify_attention(q, k_pool, v_pool, tables, torch.tensor(lens), torch.tensor(qls))
    row = 0
    for s, (n, ql) in enumerate(zip(lens, qls)):
        blocks = tables[s, : -(-n // bs)]
        k = k_pool[blocks].flatten(0, 1)[:n].transpose(0, 1)  # (nh, n, hs)
        v = v_pool[blocks].flatten(0, 1)[:n].transpose(0, 1)
        mask = torch.arange(n)[None, :] <= torch.arange(n - ql, n)[:, None]  # (ql, n): the new ones causal
        want = torch.nn.functional.scaled_dot_product_attention(q[row:row + ql].transpose(0, 1), k, v, mask)
        torch.testing.assert_close(got[row:row + ql], want.transpose(0, 1), rtol=1e-5, atol=1e-5)  # (ql, nh, hs)
        row += ql
    ones = torch.ones(S, dtype=torch.int64)
    last = torch.tensor(lens)
    torch.testing.assert_close(paged_verify_attention(q[:S], k_pool, v_pool, tables, last, ones),
                               paged_decode_attention(q[:S], k_pool, v_pool, tables, last), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"query_lens: query length 9 of sequence 0 is outside \[1, 6\]"):
        paged_verify_attention(q[:9], k_pool, v_pool, tables[:1], torch.tensor([6]), torch.tensor([9]))
    with pytest.raises(ValueError, match=r"q must hold sum\(query_lens\)"):
        paged_verify_attention(q, k_pool, v_pool, tables, last, 2 * ones)  # 2S rows, q has more or fewer
    with pytest.raises(ValueError, match=r"context_lens \(S,\) and query_lens \(S,\) must agree on S"):
        paged_verify_attention(q, k_pool, v_pool, tables, last, torch.tensor(qls[:-1] or [1, 1]))
    with pytest.raises(TypeError, match="query_lens must be an int64"):
        paged_verify_attention(q, k_pool, v_pool, tables, last, torch.tensor(qls, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="query lengths add up to"):  # the C++ entry point's own check
        load_cpu_ext().paged_verify_attention(q[:-1].contiguous(), k_pool, v_pool, tables, last, torch.tensor(qls))


@needs_cpp
def test_cpp_paged_decode_attention_rejects_bad_arguments():
    q, pool = torch.randn(2, 2, 4), torch.randn(6, 4, 2, 4)
    tables, lens = torch.tensor([[0, 1], [2, -1]]), torch.tensor([5, 3])
    with pytest.raises(TypeError, match="q must be a float32"):
        paged_decode_attention(q.double(), pool, pool, tables, lens)
    with pytest.raises(TypeError, match="block_tables must be an int64"):
        paged_decode_attention(q, pool, pool, tables.int(), lens)
    with pytest.raises(ValueError, match=r"context length 9 of sequence 1 is outside \[1, 8\]"):
        paged_decode_attention(q, pool, pool, tables, torch.tensor([5, 9]))
    with pytest.raises(ValueError, match="block id -1 of sequence 1"):
        paged_decode_attention(q, pool, pool, tables, torch.tensor([5, 6]))
    with pytest.raises(ValueError, match="block id 7 of sequence 0"):
        paged_decode_attention(q, pool, pool, torch.tensor([[0, 7], [2, -1]]), lens)
    with pytest.raises(ValueError, match="q must be"):
        paged_decode_attention(torch.randn(2, 3, 4), pool, pool, tables, lens)


@needs_cpp
def test_engine_with_the_cpp_attention_backend_gives_the_same_outputs():
    """Chapter 06's engine with attention_backend="selective-cpp" (decodes in C++, prompt chunks in PyTorch, mixed
    steps, preemption under a small pool): outputs identical to the default backend's, and to each request alone."""
    from minillm.engine import LLM, EngineConfig

    m = model()
    prompts = [[(7 * i + j) % SMALL.vocab_size for j in range(3 + 5 * i)] for i in range(6)]
    params = [SamplingParams.greedy(8 + 3 * i, ignore_eos=True) for i in range(6)]
    outs = {}
    for backend in ("selective", NAME):
        cfg = EngineConfig(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=24,
                           attention_backend=backend)
        llm = LLM(fast_cpu_model(m), None, cfg)
        outs[backend] = [o.output_token_ids for o in llm.generate(prompts, params)]
        assert llm.stats()["num_preemptions"] > 0 and llm.stats()["num_free_blocks"] == 16
    assert outs[NAME] == outs["selective"]
    assert outs[NAME] == [generate_ids(m, p, sp) for p, sp in zip(prompts, params)]


@needs_cpp
def test_speculative_engine_with_the_cpp_verify_backend_gives_the_same_outputs():
    """Chapter 08's speculative engine (prompt lookup and a draft model) with attention_backend="verify-cpp" (decode
    and verify steps in C++, prompt chunks in PyTorch, preemption under a small pool): outputs identical to the
    "verify" backend's and to each request alone."""
    from minillm.engine import EngineConfig
    from minillm.speculative.engine import SpeculativeConfig, SpeculativeLLM

    m = model()
    prompts = [[(7 * i + j) % 50 for j in range(3 + 5 * i)] * 2 for i in range(6)]  # repeats: lookup finds drafts
    params = [SamplingParams.greedy(8 + 3 * i, ignore_eos=True) for i in range(6)]
    want = [generate_ids(m, p, sp) for p, sp in zip(prompts, params)]
    draft = noisy_copy(m, 0.1, seed=3).eval()
    for spec, drafter in ((SpeculativeConfig(method="prompt-lookup", gamma=3), None),
                          (SpeculativeConfig(method="draft-model", gamma=2), draft)):
        outs = {}
        for backend in ("verify", VERIFY_NAME):
            cfg = EngineConfig(num_blocks=24, block_size=4, max_num_seqs=4, max_num_batched_tokens=48,
                               attention_backend=backend)
            llm = SpeculativeLLM(fast_cpu_model(m), None, cfg, speculative=spec, draft=drafter)
            outs[backend] = [o.output_token_ids for o in llm.generate(prompts, params)]
            assert llm.stats()["num_free_blocks"] == 24
        assert outs[VERIFY_NAME] == outs["verify"] == want, spec.method


@needs_cpp
def test_engine_bench_runs_both_engines_on_the_cpp_attention():
    """Chapter 08's engine benchmark with attention_backend="verify-cpp": both engines on the C++ attention, their
    outputs identical, the backend recorded; an unknown backend is a ValueError naming it before any engine runs."""
    from minillm.speculative import engine_bench

    tok = Tokenizer.load(DEFAULT_TOKENIZER_PATH)
    small = engine_bench.load_sweep(context_model(SMALL, seed=0), tok, loads=(1, 2), new_tokens=8, prompt_len=16,
                                    requests_per_slot=1, repeats=1, attention_backend=VERIFY_NAME)
    assert small["identical"] and small["attention_backend"] == VERIFY_NAME
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        engine_bench.load_point(model(), [[1, 2, 3]], 1, 4, engine_bench.SpeculativeConfig(), attention_backend="cpp")


def test_llamacpp_export_recovers_our_tokenizer_for_hugging_face(tmp_path):
    """The side-by-side script's converter input: vocab.json + merges.txt recovered from our tokenizer's ranks load
    in Hugging Face's GPT-2 tokenizer and encode plain text to our ids (an outside check of `recover_merges` and of
    the byte alphabet, which must equal GPT-2's own); config.json carries the n_ctx the converter reads."""
    transformers = pytest.importorskip("transformers")
    from transformers.convert_slow_tokenizer import bytes_to_unicode as hf_bytes_to_unicode

    from minillm.compile.llamacpp_build import bytes_to_unicode, export_hf_dir, recover_merges
    from minillm.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer

    assert bytes_to_unicode() == hf_bytes_to_unicode()
    tok = Tokenizer.load(DEFAULT_TOKENIZER_PATH)
    merges = recover_merges(tok.mergeable_ranks)
    assert len(merges) == len(tok.mergeable_ranks) - 256
    with pytest.raises(ValueError, match="not one merge"):
        recover_merges({b"a": 0, b"b": 1, b"abc": 2})
    out = export_hf_dir(context_model("tiny", vocab_size=tok.vocab_size), tok, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["n_ctx"] == GPTConfig.from_name("tiny").block_size
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)  # what llama.cpp's converter loads
    text = "the cat sat on the mat and then the model said hello to everyone in the room"
    assert hf_tok.encode(text) == tok.encode_ordinary(text)


def test_llamacpp_quotes_every_figure_the_texts_name():
    """`quotes` of a small report of the side by side gives the medians' table and every value chapters 09 and 13
    quote from its results file, computed from the rounds: llama.cpp's q8_0 over its f32, ours as a fraction of it."""
    samples = {"llama.cpp f32": [700.0, 600.0, 800.0], "llama.cpp f16": [1400.0, 1300.0, 1500.0],
               "llama.cpp q8_0": [1750.0, 1500.0, 1800.0], "llama.cpp q4_0": [2000.0, 1900.0, 2100.0],
               llamacpp.EAGER: [250.0, 240.0, 260.0], llamacpp.FUSED: [630.0, 420.0, 640.0],
               llamacpp.FUSED_INT8: [1200.0, 800.0, 1210.0], llamacpp.FUSED_INT4: [1300.0, 1290.0, 900.0],
               llamacpp.FUSED_SPEC: [1000.0, 1100.0, 1050.0]}
    report = {"model": "base", "threads": 1, "tokens": 128, "rounds": 3, "llama_cpp": "llama-cpp-python==0.3.36",
              "cpu": "a CPU", "samples": samples, "median_tok_s": {k: sorted(v)[1] for k, v in samples.items()}}
    q = llamacpp.quotes(report)
    assert q["table"].splitlines()[:3] == ["| path | tok/s | of llama.cpp f32 |", "|---|---:|---:|",
                                           "| llama.cpp f32 | 700 | 100% |"]
    assert q["table"].endswith("| minillm fused C++ step | 630 | 90% |\n"
                               "| minillm fused C++ step, int8 weights | 1,200 | 171% |\n"
                               "| minillm fused C++ step, int4 weights | 1,290 | 184% |\n"
                               "| minillm fused C++ step, speculative | 1,050 | 150% |\n")
    assert (q["fused_spec_vs_fused"], q["fused_spec_tok_s"]) == ("1.67x", "1,050")
    assert (q["fused_int8_vs_q8_0"], q["fused_int8_vs_fused"], q["fused_int8_tok_s"]) == ("0.69x", "1.90x", "1,200")
    assert (q["fused_int4_vs_q4_0"], q["fused_int4_vs_int8"], q["q4_0_vs_f32"]) == ("0.65x", "1.07x", "2.86x")
    assert len(q["per_round"].splitlines()) == 2 + 3
    assert (q["q8_0_vs_f32"], q["f16_vs_f32"], q["q8_0_tok_s"], q["f16_tok_s"]) == ("2.50x", "2.00x", "1,750", "1,400")
    assert (q["fused_of_f32_min"], q["fused_of_f32_max"], q["f32_min"], q["f32_max"]) == ("70%", "90%", "600", "800")
    root = Path(__file__).resolve().parent.parent
    named = {name for text in ("09-quantization.md", "13-compilation.md")
             for _, source, name, _ in find_values((root / "chapters" / text).read_text(), text)
             if source == "chapters/results/13-llamacpp.json"}
    assert named <= set(q), sorted(named - set(q))


def names_the_text_quotes(results_file: str) -> set[str]:
    """Every name chapter 13's text takes from `results_file`: its included tables and its inline values."""
    text = (Path(__file__).resolve().parent.parent / "chapters" / "13-compilation.md").read_text()
    tables = set(re.findall(rf"<!-- include: {re.escape(results_file)}::(\w+) -->", text))
    return tables | {name for _, source, name, _ in find_values(text, "13-compilation.md") if source == results_file}


def test_bench_quotes_every_figure_the_text_names():
    """`quotes` of a small report of `python -m minillm.compile.bench`: the paths' table and every value the text
    names, computed from the rows (fractions of the bound, speed-ups over the eager generator run beside each)."""
    def row(mode, static, tok_s, eager_tok_s, of_bound, first_call=0.0):
        return {"mode": mode, "static": static, "backend": "inductor" if mode == "compile" else None,
                "tok_s": tok_s, "eager_tok_s": eager_tok_s, "speedup": tok_s / eager_tok_s, "identical": True,
                "fraction_of_bound": of_bound, "fraction_of_fastest_bound": tok_s / 1000.0, "compiles": 0,
                "first_call_seconds": first_call}
    rows = [row("C++ GEMV (fast_cpu_model)", False, 400.0, 300.0, 0.4), row(FUSED, False, 900.0, 300.0, 0.75),
            row("eager", True, 270.0, 310.0, 0.25), {**row("compile", True, 280.0, 290.0, 0.3, 2.94), "compiles": 1}]
    hf = {name: {"ratio": ratio} for name, ratio in (("eager", 1.2), ("fast", 1.7), ("fused", 2.7))}
    report = {"device": "cpu", "threads": 1, "new_tokens": 64, "prompt_len": 16, "rows": rows, "hf": hf,
              "bound": {"step_seconds": 1e-3, "by": "C++ GEMV", "seconds": {"F.linear": 1.5e-3, "C++ GEMV": 1e-3},
                        "bytes": 23.1e6, "GBps": 23.1, "tok_s_bound": 1000.0},
              "pruned_fused": {"fraction": 0.25, "identical": True, "dense_tok_s": 950.0, "pruned_tok_s": 1085.0,
                               "speedup": 1.142, "weight_ratio": 1.16},
              "quantized_fused": {"identical": True, "f32_tok_s": 1050.0, "int8_tok_s": 1942.5, "speedup": 1.85,
                                  "eager_f32_tok_s": 581.0, "eager_int8_tok_s": 433.0, "eager_speedup": 0.745,
                                  "int8_path": "AVX-512", "f32_MB": 23.12, "int8_MB": 9.02, "weight_ratio": 2.563,
                                  "int4": {"identical": True, "tok_s": 2100.0, "speedup": 2.0, "eager_tok_s": 300.0,
                                           "eager_speedup": 0.516, "MB": 6.6, "weight_ratio": 3.5, "group_size": 128,
                                           "vs_int8": 1.081, "path": "AVX-512"}},
              "fused_speculation": {"gamma": 2, "prompts": 4, "new_tokens": 128, "identical": True,
                                    "alone_tok_s": 1030.0, "speculative_tok_s": 1402.0, "speedup": 1.361,
                                    "alpha": 0.842, "tokens_per_call": 2.49, "draft_cost": 0.181,
                                    "verify_cost": [1.0, 1.05, 1.16, 1.38, 1.55],
                                    "lookup": {"gamma": 4, "prompt_len": 200, "identical": True, "alone_tok_s": 743.0,
                                               "lookup_tok_s": 855.0, "speedup": 1.151, "kept": 97, "proposed": 160,
                                               "tokens_per_call": 1.74}},
              "model": "base", "cpu": "a CPU", "command": "python -m minillm.compile.bench"}
    q = bench_quotes(report)
    assert q["paths"].splitlines()[2] == "| C++ GEMV (fast_cpu_model), growing cache | 400 | 1.33x (300) | 40% | 40% " \
                                         "| True | 0 | 0.00 s |"
    assert len(q["paths"].splitlines()) == 2 + 4 and q["paths"].endswith("| 1 | 2.94 s |\n")
    assert (q["fused_speedup"], q["fused_of_bound"], q["fused_of_fastest_bound"]) == ("3.00x", "75%", "90%")
    assert (q["bound_ms"], q["linear_ms"], q["bound_tok_s"], q["compile_first_call"]) == ("1.000", "1.500", "1,000",
                                                                                          "2.9 s")
    assert (q["eager_tok_s_min"], q["eager_tok_s_max"], q["hf_fused"], q["pruned_speedup"]) == ("290", "310",
                                                                                                "2.70x", "1.14x")
    assert (q["int8_tok_s"], q["int8_speedup"], q["int8_weight_ratio"], q["int8_eager_speedup"]) == (
        "1,942", "1.85x", "2.56x", "0.74x")
    assert (q["int4_tok_s"], q["int4_speedup"], q["int4_vs_int8"], q["int4_MB"], q["int4_eager_speedup"]) == (
        "2,100", "2.00x", "1.08x", "6.6 MB", "0.52x")
    assert (q["spec_draft_cost"], q["spec_verify_cost"], q["spec_verify_row_cost"], q["lookup_verify_cost"]) == (
        "0.18", "1.16", "0.08", "1.55")
    assert q["spec_predicted"] == f"{2.49 / (2 * 0.181 + 1.16):.2f}x"
    assert (q["spec_speedup"], q["spec_alpha"], q["lookup_speedup"], q["lookup_kept"]) == ("1.36x", "0.84", "1.15x",
                                                                                            "97/160")
    named = names_the_text_quotes("chapters/results/13-compile.json")
    assert named <= set(q), sorted(named - set(q))


def test_sweep_quotes_every_figure_the_text_names():
    """`quotes` of a small report of `python -m minillm.compile.sweep --profile`: the cases' table, the two
    profiles (the first operators and one row for the rest), and every value the text names."""
    rows = [{"case": Case(kind, batch, tokens).name, "kind": kind, "batch": batch, "tokens": tokens,
             "steps": 16 if kind == "decode" else 1, "threads": n, "max_abs_diff": 2e-6 * n, "same_argmax": True,
             "ok": True, "compiles": 1, "first_call_seconds": 0.5 * n, "eager_s": 0.016 * n, "compiled_s": 0.016,
             "speedup": float(n)} for n in (1, 2) for kind, batch, tokens in (("decode", 1, 64), ("decode", 8, 64),
                                                                             ("prefill", 1, 128))]
    names = ["aten::addmm", "aten::mm", "TorchDynamo Cache Lookup", "aten::view", "aten::copy_", "aten::add",
             "aten::select", "aten::t"]
    ops = [{"name": name, "calls_per_step": 2.0, "self_us_per_step": 100.0 / (i + 1), "share": 0.4 / (i + 1)}
           for i, name in enumerate(names)]
    report = {"device": "cpu", "backend": "inductor", "rows": rows, "profile_case": rows[0]["case"],
              "profile": {"eager": ops, "compile": ops}, "model": "base", "cpu": "a CPU",
              "command": "python -m minillm.compile.sweep --profile"}
    q = sweep_quotes(report)
    assert len(q["cases"].splitlines()) == 2 + 6
    assert q["cases"].splitlines()[2] == ("| decode, batch 1, context 64 | 1 | 1.00 ms/step | 1.00 ms/step | 1.00x | "
                                          "1 | 0.5 s | 2.0e-06 | True |")
    eager, compiled = q["profile_eager"].splitlines(), q["profile_compile"].splitlines()
    assert len(eager) == 2 + 4 + 1 and len(compiled) == 2 + 6 + 1
    assert eager[2] == "| `aten::addmm` | 2 | 100 µs | 40% |" and eager[-1].startswith("| the other 4 operators | 8 |")
    assert (q["decode8_t2_speedup"], q["prefill1_t2_eager_ms"], q["speedup_max"], q["first_call_max"]) == (
        "2.00x", "32.00", "2.00x", "1.0 s")
    assert (q["eager_products_share"], q["compile_guard_share"], q["eager_calls"]) == ("60%", "13%", "16")
    named = names_the_text_quotes("chapters/results/13-sweep.json")
    assert named <= set(q), sorted(named - set(q))


def test_aot_quotes_every_figure_the_text_names():
    """`quotes` of a small report of `python -m minillm.compile.aot`: the cold-start table and every value the text
    names, computed from the medians (the compile is torch.compile's second token minus its first)."""
    def path_row(name, ready, second, total):
        run = {"imports": 0.9, "ready": ready, "first_token": ready + 0.01, "second_token": second,
               "all_tokens": total, "tokens": [1, 2]}
        return {"path": name, "identical": True, "runs": [run, {**run, "all_tokens": total + 1.0}], **run}
    rows = [path_row(aot.PATHS[0], 1.0, 1.02, 1.1), path_row(aot.PATHS[1], 2.0, 25.0, 25.1),
            path_row(aot.PATHS[2], 2.0, 5.0, 5.1), path_row(aot.PATHS[3], 10.0, 10.02, 10.04),
            path_row(aot.PATHS[4], 3.0, 3.02, 3.4)]
    report = {"model": "base", "threads": 1, "repeats": 3, "new_tokens": 32, "prompt_len": 16, "build_seconds": 12.46,
              "package_mb": 28.6, "rows": rows, "cpu": "a CPU", "command": "python -m minillm.compile.aot --threads 1"}
    q = aot.quotes(report)
    assert q["cold_start"].splitlines()[2] == "| eager | 0.90 s | 1.00 s | 1.01 s | 1.02 s | 1.10 s | True |"
    assert (q["compile_cold_compile"], q["aot_vs_compile_cold"], q["aot_vs_compile_warm"]) == ("23.0 s", "2.5x",
                                                                                                "1.5x")
    assert (q["aot_cold_load"], q["aot_warm_all_max"], q["build_seconds"], q["identical"]) == ("9.10 s", "4.40 s",
                                                                                               "12.5 s", "True")
    named = names_the_text_quotes("chapters/results/13-aot.json")
    assert named <= set(q), sorted(named - set(q))


# ----- the graded mirrors: the C++ loops in PyTorch (minillm assignment 13) ----------------------------------------


@pytest.mark.graded(points=2, exercise="gemv_blocked")
@pytest.mark.parametrize("M,N,K", [(1, 8, 16), (3, 12, 64), (16, 4, 8)])
@pytest.mark.parametrize("bias", [True, False])
def test_gemv_blocked_equals_f_linear(M, N, K, bias):
    """Whole blocks of 4 weight rows and whole registers of 8 columns."""
    g = torch.Generator().manual_seed(M * 100 + N + K)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    torch.testing.assert_close(mirror.gemv_blocked(x, w, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


@pytest.mark.graded(points=2, exercise="gemv_blocked")
@pytest.mark.parametrize("M,N,K", [(1, 7, 9), (2, 5, 3), (4, 1, 1), (3, 33, 130), (1, 6, 7)])
def test_gemv_blocked_handles_the_tails(M, N, K):
    """N % 4 last rows (a shorter last block) and K % 8 last columns (the scalar tail), with a bias."""
    g = torch.Generator().manual_seed(M * 100 + N + K)
    x, w, b = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    torch.testing.assert_close(mirror.gemv_blocked(x, w, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


@pytest.mark.graded(points=1, exercise="gemv_blocked")
def test_gemv_blocked_worked_example():
    """x = [1, 2, ..., 9], w = one row of ones and one row [0, ..., 0, 1]: sums 45 and 9, plus the bias."""
    x = torch.arange(1.0, 10.0).view(1, 9)
    w = torch.stack([torch.ones(9), torch.zeros(9)])
    w[1, 8] = 1.0  # only the tail column
    got = mirror.gemv_blocked(x, w, torch.tensor([0.5, -1.0]))
    assert got.tolist() == [[45.5, 8.0]]


def _by_hand_run(m, ids: list[int]) -> tuple[list[torch.Tensor], ContiguousKVCache]:
    """Every token of `ids` through decode_step_by_hand from an empty cache: (logits per token (V,), the cache)."""
    cache = ContiguousKVCache(m.config, 1, len(ids) + 2)
    logits = [mirror.decode_step_by_hand(m, cache.k, cache.v, t, i, i) for i, t in enumerate(ids)]
    return logits, cache


@pytest.mark.graded(points=3, exercise="decode_step_by_hand")
def test_decode_step_by_hand_gives_the_models_logits_at_every_position():
    m = model()
    ids = PROMPTS[1]
    logits, _ = _by_hand_run(m, ids)
    with torch.inference_mode():
        want = m(torch.tensor([ids]))[0]  # (T, V): the whole prompt in one forward
    for t, got in enumerate(logits):
        torch.testing.assert_close(got, want[t], atol=1e-4, rtol=1e-4)


@pytest.mark.graded(points=2, exercise="decode_step_by_hand")
def test_decode_step_by_hand_writes_the_keys_and_values_the_model_writes():
    m = model()
    ids = PROMPTS[0]
    _, cache = _by_hand_run(m, ids)
    ref = ContiguousKVCache(m.config, 1, len(ids) + 2)
    prefill(m, ref, torch.tensor([ids]), torch.arange(len(ids)).view(1, -1))
    T = len(ids)
    for layer in range(m.config.n_layer):
        torch.testing.assert_close(cache.k[layer][:, :, :T], ref.k[layer][:, :, :T], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cache.v[layer][:, :, :T], ref.v[layer][:, :, :T], atol=1e-5, rtol=1e-5)


@pytest.mark.graded(points=2, exercise="decode_step_by_hand")
def test_decode_step_by_hand_keeps_slot_and_position_apart():
    """A token at position 5 stored in slot 0 of a fresh cache attends to itself alone: the model's logits for a
    one-token sequence at position 5. And a greedy continuation by hand is the generator's."""
    m = model()
    cache = ContiguousKVCache(m.config, 1, 4)
    got = mirror.decode_step_by_hand(m, cache.k, cache.v, 17, 5, 0)
    with torch.inference_mode():
        want = m.logits(m.hidden(torch.tensor([[17]]), torch.tensor([[5]])))[0, -1]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    prompt, n = PROMPTS[2], 6
    cache = ContiguousKVCache(m.config, 1, len(prompt) + n)
    for i, t in enumerate(prompt):
        logits = mirror.decode_step_by_hand(m, cache.k, cache.v, t, i, i)
    out = []
    for i in range(len(prompt), len(prompt) + n):
        out.append(int(logits.argmax()))
        logits = mirror.decode_step_by_hand(m, cache.k, cache.v, out[-1], i, i)
    assert out == generate_ids(m, prompt, SamplingParams.greedy(n, ignore_eos=True))


# ----- chapter 09's int8 weight-only models on the fused C++ step ----------------------------------------------------


def int8_layer(N: int, K: int, bias: bool = True, seed: int = 0) -> QuantLinear:
    """Chapter 09's weight-only int8 layer (symmetric, one scale per output row) of a random nn.Linear(K, N)."""
    torch.manual_seed(seed)
    return QuantLinear.from_linear(torch.nn.Linear(K, N, bias=bias), QuantConfig("int8"))


@needs_cpp
@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (1, 3, 9), (1, 7, 17), (3, 33, 130), (1, 768, 256), (2, 256, 1024)])
@pytest.mark.parametrize("bias", [True, False])
def test_cpp_int8_gemv_equals_the_quantized_layer(M, N, K, bias):
    """The C++ int8 GEMV against QuantLinear's own forward (F.linear on the codes, times the scales, plus the bias).
    The shapes run every loop of this build: rows in blocks of 4 through the vector loop (AVX-512 or AVX2), its K tail
    (K not a multiple of 16 or 8), and the scalar loop, which takes the N % 4 last rows (every row where N < 4: the
    whole product on the portable path, as on a machine without AVX2)."""
    layer = int8_layer(N, K, bias, seed=M * 1000 + N + K)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(K))
    with torch.no_grad():
        want = layer(x)
    torch.testing.assert_close(int8_gemv(x, layer.qweight, layer.scale, layer.bias), want, rtol=1e-5,
                               atol=1e-5 * K ** 0.5)
    torch.testing.assert_close(int8_gemv(x, layer.qweight, layer.scale.view(-1), layer.bias), want, rtol=1e-5,
                               atol=1e-5 * K ** 0.5)  # the scales as (N,) too


@needs_cpp
def test_cpp_int8_gemv_rejects_bad_arguments():
    layer = int8_layer(4, 8)
    q, s, x = layer.qweight, layer.scale, torch.randn(1, 8)
    with pytest.raises(TypeError, match="q must be an int8 CPU tensor"):
        int8_gemv(x, q.float(), s)
    with pytest.raises(TypeError, match="x must be a float32"):
        int8_gemv(x.double(), q, s)
    with pytest.raises(TypeError, match="scale must be a float32"):
        int8_gemv(x, q, s.double())
    with pytest.raises(ValueError, match="same K"):
        int8_gemv(torch.randn(1, 7), q, s)
    with pytest.raises(ValueError, match=r"scale must have shape \(4,\) or \(4, 1\)"):
        int8_gemv(x, q, s[:3])
    with pytest.raises(ValueError, match=r"b must have shape \(4,\)"):
        int8_gemv(x, q, s, torch.randn(3))
    ext = load_cpu_ext()  # the C++ entry point's own checks: an error, never a crash
    with pytest.raises(TypeError, match="q int8"):
        ext.int8_gemv(x, q.float(), s.view(-1), torch.empty(0))
    with pytest.raises(ValueError, match="scale must be"):
        ext.int8_gemv(x, q, s, torch.empty(0))  # (N, 1) reaches C++ only through the wrapper, which flattens it
    with pytest.raises(ValueError, match="contiguous"):
        ext.int8_gemv(x, torch.zeros(8, 4, dtype=torch.int8).t(), s.view(-1), torch.empty(0))
    assert ext.int8_path() in ("AVX-512", "AVX2 + FMA", "scalar")


@needs_cpp
def test_fused_cpu_step_runs_an_int8_model_like_the_eager_quantized_model():
    """Chapter 09's int8 model (every block linear a weight-only int8 QuantLinear, the tied head float32) through the
    C++ step: logits within 1e-4 of the eager quantized model's at every position up to the window's end (the
    measured gap is ~1e-6: float rounding, the sums run in another order), the same keys and values in the cache.
    The step reads the model's own codes and scales: an in-place change is seen; a replaced buffer is a ValueError."""
    q = quantize_model(model(), QuantConfig("int8"))
    dec = FusedCPUDecoder(q)
    assert dec.int8_linears == 4 * SMALL.n_layer
    assert_steps_equal_the_model(q, dec, seed=1)
    params = SamplingParams.greedy(16, ignore_eos=True)
    fc = assert_in_place_changes_are_seen(q, dec, lambda codes: codes.neg_())
    fc.qweight = fc.qweight.clone()  # a new buffer: the step's snapshot is stale
    with pytest.raises(ValueError, match="build a new FusedCPUDecoder"):
        dec.generate_ids(PROMPTS[0], params)


@needs_cpp
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_fused_cpu_step_gives_the_eager_quantized_tokens_on_base(mode):
    """The shipped `base` (seeded random weights of its shape where the checkpoint is missing) quantized to int8 or
    int4 (group size 128, chapter 09's default): greedy tokens of the fused step equal chapter 04's eager generator
    on the quantized model, on several prompts through one decoder."""
    loaded = load_model("base")
    q = quantize_model(loaded.model, QuantConfig(mode))
    dec = FusedCPUDecoder(q)
    params = SamplingParams.greedy(32, ignore_eos=True)
    for text in ("def main(", "import numpy as np\n", "class Tokenizer:\n    def __init__(self", "for i in range("):
        prompt = loaded.tokenizer.encode(text)
        assert dec.generate_ids(prompt, params) == generate_ids(q, prompt, params), text


@needs_cpp
def test_fused_cpu_step_runs_a_mix_of_float_and_int8_linears():
    """Each block linear runs the GEMV of its own kind: a model whose linears are part int8, part float32 (here one
    layer put back to float) gives the eager model's tokens."""
    m = model()
    q = quantize_model(m, QuantConfig("int8"))
    q.transformer.h[0].attn.c_proj = m.transformer.h[0].attn.c_proj
    dec = FusedCPUDecoder(q)
    assert dec.int8_linears == 4 * SMALL.n_layer - 1
    params = SamplingParams.greedy(16, ignore_eos=True)
    for prompt in PROMPTS:
        assert dec.generate_ids(prompt, params) == generate_ids(q, prompt, params)


# ----- chapter 09's int4 group-wise models on the fused C++ step ------------------------------------------------------


def int4_layer(N: int, K: int, group_size: int, bias: bool = True, seed: int = 0) -> QuantLinear:
    """Chapter 09's weight-only int4 layer (symmetric, group-wise, two codes per byte) of a random nn.Linear(K, N)."""
    torch.manual_seed(seed)
    return QuantLinear.from_linear(torch.nn.Linear(K, N, bias=bias), QuantConfig("int4", group_size=group_size))


@needs_cpp
@pytest.mark.parametrize("M,N,K,G", [(1, 1, 2, 2), (1, 3, 64, 32), (1, 7, 96, 32), (3, 33, 128, 64), (1, 768, 256, 128),
                                     (2, 256, 1024, 128), (16, 9, 128, 128), (4, 6, 48, 16), (1, 5, 36, 6)])
@pytest.mark.parametrize("bias", [True, False])
def test_cpp_int4_gemv_equals_the_quantized_layer(M, N, K, G, bias):
    """The C++ int4 GEMV against QuantLinear's own forward (F.linear on the de-quantized weight, plus the bias). The
    shapes run every loop of this build: rows in blocks of 4 through the vector loop (AVX-512: groups of 32 columns
    and more; AVX2: of 16), the scalar loop for the N % 4 last rows, for every row where N < 4, and for group sizes
    the vector loops do not take (16 and 6 here with AVX-512: the whole product on the portable path)."""
    layer = int4_layer(N, K, G, bias, seed=M * 1000 + N + K)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(K))
    with torch.no_grad():
        want = layer(x)
    torch.testing.assert_close(int4_gemv(x, layer.qweight, layer.scale, layer.bias), want, rtol=1e-5,
                               atol=1e-5 * K ** 0.5)
    assert load_cpu_ext().int4_path(G) in ("AVX-512", "AVX2 + FMA", "scalar")


@needs_cpp
def test_cpp_int4_gemv_unpacks_a_worked_example():
    """By hand: one row of 4 codes [3, -2, -8, 7] packed as bytes 0xE3 (low nibble 3, high 14 = -2) and 0x78 (low 8 =
    -8, high 7), one group with scale 0.5, x = [1, 2, 3, 4], bias 1: 0.5 (3 - 4 - 24 + 28) + 1 = 2.5."""
    packed = torch.tensor([[0xE3, 0x78]], dtype=torch.uint8)
    got = int4_gemv(torch.tensor([[1.0, 2.0, 3.0, 4.0]]), packed, torch.tensor([[0.5]]), torch.tensor([1.0]))
    assert got.tolist() == [[2.5]]


@needs_cpp
def test_cpp_int4_gemv_rejects_bad_arguments():
    layer = int4_layer(4, 64, 32)
    p, s, x = layer.qweight, layer.scale, torch.randn(1, 64)
    with pytest.raises(TypeError, match="packed must be a uint8 CPU tensor"):
        int4_gemv(x, p.to(torch.int8), s)
    with pytest.raises(TypeError, match="x must be a float32"):
        int4_gemv(x.double(), p, s)
    with pytest.raises(TypeError, match="scale must be a float32"):
        int4_gemv(x, p, s.double())
    with pytest.raises(ValueError, match=r"packed \(N, K/2\)"):
        int4_gemv(torch.randn(1, 63), p, s)
    for bad in (s[:3], s.view(-1), torch.ones(4, 3), torch.ones(4, 64 // 2 + 1), torch.ones(4, 64)):  # 64: groups of 1
        with pytest.raises(ValueError, match=r"scale must be \(N, groups\)"):
            int4_gemv(x, p, bad)
    with pytest.raises(ValueError, match=r"b must have shape \(4,\)"):
        int4_gemv(x, p, s, torch.randn(3))
    ext = load_cpu_ext()  # the C++ entry point's own checks: an error, never a crash
    with pytest.raises(TypeError, match="p uint8"):
        ext.int4_gemv(x, p.to(torch.int8), s, torch.empty(0))
    with pytest.raises(ValueError, match="scale must be"):
        ext.int4_gemv(x, p, torch.ones(4, 3), torch.empty(0))
    with pytest.raises(ValueError, match="scale must be"):
        ext.int4_gemv(x, p, torch.ones(4, 0), torch.empty(0))
    with pytest.raises(ValueError, match="contiguous"):
        ext.int4_gemv(x, torch.zeros(32, 4, dtype=torch.uint8).t(), s, torch.empty(0))
    with pytest.raises(ValueError, match="bias must be"):
        ext.int4_gemv(x, p, s, torch.ones(5))


@needs_cpp
def test_fused_cpu_step_runs_an_int4_model_like_the_eager_quantized_model():
    """Chapter 09's int4 model (every block linear a symmetric group-wise int4 QuantLinear, the tied head float32)
    through the C++ step: logits within 1e-4 of the eager quantized model's at every position up to the window's end,
    the same keys and values in the cache; the step reads the model's own packed codes and scales (an in-place
    change is seen); greedy tokens equal the eager model's, also for a model mixing float32, int8 and int4 linears
    and for a group size the vector loops do not take (16: the scalar loop)."""
    q = quantize_model(model(), QuantConfig("int4", group_size=32))
    dec = FusedCPUDecoder(q)
    assert (dec.int4_linears, dec.int8_linears) == (4 * SMALL.n_layer, 0)
    assert_steps_equal_the_model(q, dec, seed=2)
    params = SamplingParams.greedy(16, ignore_eos=True)
    assert_in_place_changes_are_seen(q, dec, lambda codes: codes.bitwise_not_())  # packed: flip both nibbles
    m = model()
    mixed = quantize_model(m, QuantConfig("int8"))
    mixed.transformer.h[0].attn.c_proj = m.transformer.h[0].attn.c_proj
    mixed.transformer.h[1].mlp.c_proj = QuantLinear.from_linear(m.transformer.h[1].mlp.c_proj,
                                                                QuantConfig("int4", group_size=64))
    scalar = quantize_model(m, QuantConfig("int4", group_size=16))
    for qmodel, counts in ((mixed, (4 * SMALL.n_layer - 2, 1)), (scalar, (0, 4 * SMALL.n_layer))):
        dec = FusedCPUDecoder(qmodel)
        assert (dec.int8_linears, dec.int4_linears) == counts
        for prompt in PROMPTS:
            assert dec.generate_ids(prompt, params) == generate_ids(qmodel, prompt, params)


@needs_cpp
@pytest.mark.parametrize("mode", ["float32", "int4"])
def test_fused_cpu_step_prefills_a_short_prompt_in_one_cpp_call(monkeypatch, mode):
    """A prompt of up to MAX_VERIFY tokens is prefilled by the C++ step itself (one verify call, never the model's
    forward, which for a quantized model de-quantizes every matrix), a longer one by the model: the last token's
    logits and the cache's keys and values are the model's own prefill's to float rounding either way. A prefill into
    a cache that is not empty, or of another model, is a ValueError."""
    m = model() if mode == "float32" else quantize_model(model(), QuantConfig("int4", group_size=32))
    dec = FusedCPUDecoder(m)
    ids = torch.randint(0, SMALL.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    calls = []
    monkeypatch.setattr(fused_step, "prefill", lambda *a: calls.append(a[2].shape[1]) or prefill(*a))
    for T in (1, 7, fused_step.MAX_VERIFY, fused_step.MAX_VERIFY + 1, 40):
        ref = ContiguousKVCache(SMALL, 1, SMALL.block_size)
        want = prefill(m, ref, ids[:, :T], torch.arange(T))
        dec.cache.reset()
        got = dec.prefill(m, dec.cache, ids[:, :T], torch.arange(T))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert dec.cache.length == T
        for layer in range(SMALL.n_layer):
            torch.testing.assert_close(dec.cache.k[layer][:, :, :T], ref.k[layer][:, :, :T], rtol=1e-5, atol=1e-5)
    assert calls == [fused_step.MAX_VERIFY + 1, 40]  # only the long prompts went through the model's forward
    with pytest.raises(ValueError, match="into an empty cache"):
        dec.prefill(m, dec.cache, ids[:, :3], torch.arange(3))  # the cache still holds the 40 tokens
    with pytest.raises(ValueError, match="its own model over its own cache"):
        dec.prefill(model(), dec.cache, ids[:, :3], torch.arange(3))


def cpp_constructor_args(monkeypatch, q) -> list:
    """The arguments FusedCPUDecoder(q) hands the C++ FusedDecoder constructor, captured by a stand-in extension."""
    captured: dict[str, list] = {}
    monkeypatch.setattr(fused_step, "load_cpu_ext", lambda: type("Ext", (), {
        "FusedDecoder": staticmethod(lambda *args: captured.setdefault("args", list(args))),
        "TensorWatch": staticmethod(lambda watched, reads: None),
        "ObjectWatch": staticmethod(lambda *watched: None)}))
    FusedCPUDecoder(q)
    monkeypatch.undo()
    return captured["args"]


def replaced(tensors: list, i: int, t: torch.Tensor) -> list:
    """`tensors` with entry i replaced by t."""
    return [t if j == i else x for j, x in enumerate(tensors)]


@needs_cpp
def test_fused_cpu_step_cpp_checks_every_int4_argument(monkeypatch):
    """The C++ constructor's own checks on an int4 linear's arguments: packed codes of the wrong shape or not
    contiguous, a scale that is 1-D, of the wrong dtype, or whose groups do not split the width into even groups.
    Each is an error naming the block and the linear, never a crash."""
    q = quantize_model(model(), QuantConfig("int4", group_size=32))
    glob, layers, k, v, nh, hs, eps, scales = cpp_constructor_args(monkeypatch, q)
    build = load_cpu_ext().FusedDecoder
    assert layers[2].dtype == torch.uint8 and scales[0].shape == (3 * SMALL.n_embd, 2)

    def with_layer(i: int, t: torch.Tensor) -> list[torch.Tensor]:
        return replaced(layers, i, t)

    def with_scale(i: int, t: torch.Tensor) -> list[torch.Tensor]:
        return replaced(scales, i, t)

    codes = "block 0's attn.c_attn int4 codes must be a contiguous uint8 CPU tensor of shape \\(192, 32\\)"
    scale = "block 0's attn.c_attn int4 scale must be a contiguous float32 CPU tensor of shape \\(192, groups\\)"
    bad = [
        (with_layer(2, layers[2][:, :16].contiguous()), scales, codes),
        (with_layer(2, layers[2].t().contiguous().t()), scales, codes),
        (layers, with_scale(0, scales[0].reshape(-1)), scale),
        (layers, with_scale(0, scales[0].double()), scale),
        (layers, with_scale(0, torch.ones(192, 3)), scale),  # 64 columns do not split into 3 groups
        (layers, with_scale(0, torch.ones(192, 64)), scale),  # groups of one column: not two codes per byte
    ]
    for lay, sc, message in bad:
        with pytest.raises(RuntimeError, match=message):
            build(glob, lay, k, v, nh, hs, eps, sc)
    step = build(glob, layers, k, v, nh, hs, eps, scales)
    assert step.step(5, 0, 0).shape == (1, SMALL.vocab_size)


@needs_cpp
def test_the_build_takes_the_loops_of_the_cpus_capability():
    """The extension is built for what PyTorch reports this CPU can do (`ATEN_CPU_CAPABILITY` lowers it): AVX-512
    widens the int8 and int4 loops, AVX2 + FMA runs every vector loop at 8 lanes, and without either every product is
    the portable scalar loop."""
    ext = load_cpu_ext()
    want = {"AVX512": ("AVX-512", True), "AVX2": ("AVX2 + FMA", True)}.get(torch.backends.cpu.get_cpu_capability(),
                                                                         ("scalar", False))
    assert (ext.int8_path(), ext.uses_avx2()) == want
    assert ext.int4_path(128) == want[0] and ext.int4_path(6) == "scalar"


FALLBACK_TESTS = ("test_the_build_takes_the_loops_of_the_cpus_capability or test_cpp_gemv_equals_f_linear or "
                  "test_cpp_int8_gemv_equals or test_cpp_int4_gemv_equals or test_cpp_int4_gemv_unpacks or "
                  "test_fused_cpu_step_equals_the_models_logits or test_fused_cpu_step_runs_an_int8_model or "
                  "test_fused_cpu_step_runs_an_int4_model or test_fused_cpu_step_gives_the_generators_tokens or "
                  "test_cpp_paged_decode_attention_equals")


@needs_cpp
@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_the_cpu_feature_fallbacks_pass_the_same_tests(capability):
    """The loops a machine without AVX-512 (`avx2`) or without AVX2 (`default`: the portable scalar loops) would
    build, each built here (PyTorch's ATEN_CPU_CAPABILITY lowers what this CPU reports, and the build follows it) and
    run through the same tests in a fresh process: the float32, int8 and int4 GEMVs against F.linear and
    QuantLinear, the fused step's logits and greedy tokens (float32, int8, int4), the paged attention."""
    if capability == "avx2" and not has_avx2():
        pytest.skip("this CPU has no AVX2: its build is the portable one, tested by the other tests")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          FALLBACK_TESTS], env={**os.environ, "ATEN_CPU_CAPABILITY": capability},
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], run.stdout[-2000:]


@needs_cpp
def test_fused_cpu_step_refuses_other_quantized_models():
    """Only the symmetric weight-only forms run (int8 per channel, int4 group-wise): asymmetric int8 or int4, W8A8, a
    quantized head, a model mixing int8 with one W8A8 layer, and an int8 or int4 layer whose buffers were cast or
    dropped are each a TypeError naming the layer."""
    m = model()
    cases = [
        (quantize_model(m, QuantConfig("int4", group_size=32, symmetric=False)), r"transformer.h.0.attn.c_attn = "
         r"QuantLinear with mode='int4', symmetric=False"),
        (quantize_model(m, QuantConfig("int8", symmetric=False)), r"transformer.h.0.attn.c_attn = QuantLinear with "
         r"mode='int8', symmetric=False"),
        (quantize_model(m, QuantConfig("w8a8")), r"transformer.h.0.attn.c_attn = QuantLinear with mode='w8a8'"),
        (quantize_model(m, QuantConfig("int8", quantize_head=True)), r"has lm_head = TiedQuantHead"),
        (quantize_model(m, QuantConfig("int4", group_size=32, quantize_head=True)), r"has lm_head = TiedQuantHead"),
    ]
    mixed = quantize_model(m, QuantConfig("int8"))
    mixed.transformer.h[1].mlp.c_proj = QuantLinear.from_linear(m.transformer.h[1].mlp.c_proj,
                                                                QuantConfig("w8a8"))
    cases.append((mixed, r"transformer.h.1.mlp.c_proj = QuantLinear with mode='w8a8'"))
    for mode, change, message in [
            ("int8", lambda lin: setattr(lin, "scale", lin.scale.double()), r"scale torch.float64"),
            ("int8", lambda lin: setattr(lin, "qweight", lin.qweight.to(torch.int16)), "codes torch.int16"),
            ("int8", lambda lin: setattr(lin, "bias", None), "no bias"),
            ("int4", lambda lin: setattr(lin, "scale", lin.scale.double()), r"scale torch.float64"),
            ("int4", lambda lin: setattr(lin, "qweight", lin.qweight.to(torch.int8)), r"codes torch.int8 \(64, 32\), "
             r"want torch.uint8 \(64, 32\)"),
            ("int4", lambda lin: setattr(lin, "bias", None), "no bias")]:
        bad = quantize_model(m, QuantConfig(mode, group_size=32))
        change(bad.transformer.h[1].attn.c_proj)
        cases.append((bad, rf"transformer.h.1.attn.c_proj = QuantLinear with {message}"))
    for qmodel, message in cases:
        with pytest.raises(TypeError, match=r"the fused C\+\+ step .*" + message):
            FusedCPUDecoder(qmodel)


@needs_cpp
def test_fused_cpu_step_cpp_checks_every_int8_argument(monkeypatch):
    """The C++ constructor's own checks on the int8 arguments (what a caller past FusedCPUDecoder's checks meets): a
    scales list of the wrong length, a scale of the wrong shape or dtype, float weights given a scale, int8 codes
    given none, codes of the wrong shape. Each is an error naming the tensor, never a crash; the arguments that
    FusedCPUDecoder passes build a working step."""
    q = quantize_model(model(), QuantConfig("int8"))
    glob, layers, k, v, nh, hs, eps, scales = cpp_constructor_args(monkeypatch, q)
    build = load_cpu_ext().FusedDecoder

    def with_layer(i: int, t: torch.Tensor) -> list[torch.Tensor]:
        return replaced(layers, i, t)

    def with_scale(i: int, t: torch.Tensor) -> list[torch.Tensor]:
        return replaced(scales, i, t)

    bad = [
        ((glob, layers, k, v, nh, hs, eps, scales[:3]), "scales must be empty or hold 4 tensors per block"),
        ((glob, layers, k, v, nh, hs, eps, with_scale(0, scales[0][:5])), r"block 0's attn.c_attn scale must be a "
         r"contiguous float32 CPU tensor of shape \(192,\)"),
        ((glob, layers, k, v, nh, hs, eps, with_scale(1, scales[1].double())), "block 0's attn.c_proj scale must be"),
        ((glob, with_layer(2, layers[2].float()), k, v, nh, hs, eps, scales),
         "block 0's attn.c_attn.weight has a scale, so it must hold int8 codes"),
        ((glob, with_layer(2, layers[2][:, :32].contiguous()), k, v, nh, hs, eps, scales),
         r"block 0's attn.c_attn codes must have shape \[192, 64\]"),
        ((glob, layers, k, v, nh, hs, eps, with_scale(4, torch.empty(0))),
         "attn.c_attn.weight must be a contiguous float32 CPU tensor"),  # block 1's codes with no scale
        ((glob, layers, k, v, nh, hs, eps, []), "attn.c_attn.weight must be a contiguous float32 CPU tensor"),
    ]
    for args, message in bad:
        with pytest.raises(RuntimeError, match=message):
            build(*args)
    step = build(glob, layers, k, v, nh, hs, eps, scales)
    assert step.step(5, 0, 0).shape == (1, SMALL.vocab_size)


@pytest.mark.skipif(not DYNAMO, reason="torch.compile (dynamo) is not supported on this Python/PyTorch")
def test_more_than_eight_compiled_decoders_in_one_process():
    """dynamo keeps graphs, and a limit of 8 recompilations, per code object: when every decoder compiled the class's
    one `_step`, the 9th compiled decoder of a process failed ("FailOnRecompileLimitHit", fullgraph=True) on valid
    input. Each decoder now compiles its own copy (`own_code`); twelve in a row each build one graph and give the
    model's greedy tokens."""
    model = context_model(GPTConfig(vocab_size=32, block_size=32, n_layer=1, n_head=2, n_embd=16), seed=0)
    params = SamplingParams.greedy(4, ignore_eos=True)
    want = generate_ids(model, [1, 2, 3], params)
    decoders = [StaticDecoder(model, mode="compile", backend="eager") for _ in range(12)]  # all alive at once
    for d in decoders:
        assert d.generate_ids([1, 2, 3], params) == want and d.compiles == 1

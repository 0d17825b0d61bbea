"""Chapter 13 (under construction): the static-shape decode step, eager, compiled and captured, gives chapter 04's
greedy tokens, and compiles one graph for a whole generation. No test here measures time.

torch.compile runs with the `aot_eager` backend here (dynamo's full-graph capture and AOT functionalization, without
inductor's C++ build, which takes tens of seconds on a small CPU): a graph break, a guard on per-step Python state or
a wrong graph shows up either way. The CUDA-graph test runs where a GPU is.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from helpers import assert_every_generator_agrees, context_model
from minillm import GPTConfig
from minillm.compile.bench import run_all, weight_streaming_bound
from minillm.compile.cpu_gemv import build_problem, fast_cpu_model, gemv
from minillm.compile.decode import StaticDecoder
from minillm.core.sampling import SamplingParams
from minillm.kvcache.cache import ContiguousKVCache
from minillm.kvcache.generate import generate_ids

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


@pytest.mark.skipif(not DYNAMO, reason="torch.compile (dynamo) is not supported on this Python/PyTorch")
def test_benchmark_rows_on_a_small_model():
    report = run_all(model(), real_text=True, quick=True, backend="aot_eager", with_hf=False)
    modes = [r["mode"] for r in report["rows"]]
    assert modes[-2:] == ["eager", "compile"] and modes[:-2] in ([], ["C++ GEMV (fast_cpu_model)"])
    assert all(r["identical"] for r in report["rows"]) and report["rows"][-1]["compiles"] == 1


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

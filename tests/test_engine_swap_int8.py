"""Preemption by swapping moves whole blocks, whatever a KV cache keeps per block.

The bug these tests pin down: the swap space copied `k_pools` / `v_pools` by name, so the int8 cache's per-token
scale pools stayed behind; a swapped-in request read its codes with whatever scales the blocks' next owner had
written, and greedy tokens changed with no error. Now every cache lists its block tensors (`block_tensors()`) and
the swap space copies that list. For every attention backend the engine knows, swapping must give the tokens that
recomputation gives and that an unpreempted run gives; so must the speculative engine with int8 KV. Chapter 07's
hand-off, which carries float K/V only, refuses int8 pools instead of guessing their scales.
"""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from helpers import context_model

from minillm.core.config import GPTConfig
from minillm.core.sampling import SamplingParams
from minillm.disagg.kv_transfer import pack_kv
from minillm.engine import LLM, EngineConfig
from minillm.engine.swap import SwappedKV, SwapSpace
from minillm.paged.backends import SHIPPED_BACKENDS, attention_backends, make_attention_backend
from minillm.quant.kv_cache import Int8PagedKVCache
from minillm.speculative.engine import SpeculativeConfig, SpeculativeLLM

CFG = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=32)
ENGINE = dict(block_size=2, max_num_seqs=4, max_num_batched_tokens=64)
SMALL_POOL = 24  # blocks: 8 requests growing to 32 tokens cannot all fit, so requests are preempted
BIG_POOL = 400  # every request fits: no preemption, the reference
# chapter 13's backends build a C++ extension; without a compiler they cannot run here
HAS_COMPILER = shutil.which("c++") is not None or shutil.which("g++") is not None
NEEDS_COMPILER = {name for name, module in SHIPPED_BACKENDS.items() if module.startswith("minillm.compile")}


@pytest.fixture(scope="module")
def model():
    return context_model(CFG, seed=1)  # argmax depends strongly on the context: a stale scale shows in the tokens


def _prompts() -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(CFG.vocab_size) for _ in range(rng.randint(1, 8))] for _ in range(8)]
    return prompts, [SamplingParams(max_new_tokens=CFG.block_size - len(p), temperature=0.0) for p in prompts]


def _run(llm: LLM) -> tuple[list[list[int]], int]:
    prompts, params = _prompts()
    tokens = [o.output_token_ids for o in llm.generate(prompts, params)]
    assert llm.swap_space.num_used == 0 and llm.block_manager.num_free_blocks == llm.config.num_blocks
    return tokens, llm.stats()["num_preemptions"]


def _backend_param(name: str):
    marks = [pytest.mark.skipif(not HAS_COMPILER, reason=f"{name} needs a C++ compiler")] \
        if name in NEEDS_COMPILER else []
    return pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("backend", [_backend_param(n) for n in attention_backends()])
def test_swap_gives_the_tokens_of_recompute_and_of_no_preemption(model, backend):
    ref, n_ref = _run(LLM(model, None, EngineConfig(attention_backend=backend, num_blocks=BIG_POOL, **ENGINE)))
    assert n_ref == 0
    outs = {}
    for mode in ("recompute", "swap"):
        llm = LLM(model, None, EngineConfig(attention_backend=backend, num_blocks=SMALL_POOL, preemption_mode=mode,
                                            **ENGINE))
        outs[mode], n_pre = _run(llm)
        assert n_pre > 0, f"{backend}/{mode}: nothing was preempted, the test proves nothing"
        if mode == "swap":
            assert llm.swap_space.num_swap_outs == llm.swap_space.num_swap_ins > 0
    assert outs["swap"] == outs["recompute"] == ref


def test_bfloat16_kv_swap_gives_the_tokens_of_recompute(model):
    outs = {}
    for mode in ("recompute", "swap"):
        llm = LLM(model, None, EngineConfig(kv_dtype="bfloat16", num_blocks=SMALL_POOL, preemption_mode=mode,
                                            **ENGINE))
        outs[mode], n_pre = _run(llm)
        assert n_pre > 0 and llm.runner.cache.k_pools[0].dtype == torch.bfloat16
    assert llm.swap_space.num_swap_ins > 0
    assert outs["swap"] == outs["recompute"]


@pytest.mark.parametrize("method", ["prompt-lookup", "draft-model"])
def test_speculative_engine_int8_swap(model, method):
    draft = context_model(CFG, seed=2) if method == "draft-model" else None
    spec = SpeculativeConfig(method=method, gamma=3, ngram=1)

    def run(num_blocks: int, mode: str) -> tuple[list[list[int]], int]:
        return _run(SpeculativeLLM(model, None, EngineConfig(attention_backend="paged-int8", num_blocks=num_blocks,
                                                             preemption_mode=mode, **ENGINE),
                                   speculative=spec, draft=draft))

    ref, n_ref = run(BIG_POOL, "recompute")
    plain, _ = _run(LLM(model, None, EngineConfig(attention_backend="paged-int8", num_blocks=BIG_POOL, **ENGINE)))
    swap, n_swap = run(SMALL_POOL, "swap")
    recompute, n_rec = run(SMALL_POOL, "recompute")
    assert n_ref == 0 and n_swap > 0 and n_rec > 0
    assert swap == recompute == ref == plain


def test_swap_space_carries_every_block_tensor_of_the_int8_cache():
    cache = Int8PagedKVCache(CFG, num_blocks=6, block_size=2)
    tensors = cache.block_tensors()
    assert len(tensors) == 4 * CFG.n_layer  # codes and scales, K and V, per layer
    g = torch.Generator().manual_seed(0)
    for t in tensors:
        t.copy_(torch.randint(-127, 128, t.shape, generator=g) if t.dtype == torch.int8 else
                torch.rand(t.shape, generator=g) + 0.5)
    before = [t[[1, 4]].clone() for t in tensors]  # (2, ...) the two blocks swapped out
    space = SwapSpace(cache)
    space.swap_out("r", [1, 4])
    for t in tensors:
        t.zero_()  # the blocks' next owner overwrites everything, scales included
    space.swap_in("r", [5, 0])
    for t, b in zip(tensors, before):
        assert torch.equal(t[[5, 0]], b)
    assert space.num_used == 0


def test_copy_on_write_carries_the_scales():
    cache = Int8PagedKVCache(CFG, num_blocks=4, block_size=2)
    every = cache.k_pools + cache.v_pools + cache.k_scales + cache.v_scales  # named, not block_tensors(): the check
    for i, t in enumerate(every):
        t[1] = i + 2
    cache.copy_blocks([(1, 3)])
    assert all(torch.equal(t[3], t[1]) for t in every)


def test_swap_space_put_refuses_a_layout_the_cache_does_not_have():
    cache = Int8PagedKVCache(CFG, num_blocks=4, block_size=2)
    kv = torch.zeros(1, 2, CFG.n_head, CFG.head_size)  # (n_blocks, bs, nh, hs) float: no scales
    with pytest.raises(ValueError, match="block_tensors"):
        SwapSpace(cache).put("r", SwappedKV([kv] * (2 * CFG.n_layer), 1))
    paged = make_attention_backend("paged", CFG, 4, 2)
    with pytest.raises(ValueError, match=r"tensors\[0\]"):
        SwapSpace(paged).put("r", SwappedKV([kv.double()] * (2 * CFG.n_layer), 1))


def test_prefilled_arrival_and_kv_transfer_refuse_int8_kv(model):
    llm = LLM(model, None, EngineConfig(attention_backend="paged-int8", num_blocks=8, **ENGINE))
    kv = torch.zeros(CFG.n_layer, 2, 3, CFG.n_head, CFG.head_size)  # (L, 2, T, nh, hs)
    with pytest.raises(ValueError, match="attention_backend='paged-int8'"):
        llm.add_prefilled_request([1, 2, 3], SamplingParams(max_new_tokens=4), 5, kv)
    assert not llm.has_unfinished() and llm.swap_space.num_used == 0
    cache = llm.runner.cache
    with pytest.raises(ValueError, match="paged-int8"):
        pack_kv(cache.k_pools, cache.v_pools, [0, 1], 3)

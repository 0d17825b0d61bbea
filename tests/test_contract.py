"""The cache/engine contract that chapters 08-15 plug into, one section per point, each point proven here.

1. roll back and several tokens per step (08 speculative): `ContiguousKVCache.truncate`, `BlockManager.truncate`;
2. the KV dtype is a setting (09 quantization): caches take `dtype`, `EngineConfig.kv_dtype`;
3. no host sync, static shapes in decode (13 compilation): `ContiguousKVCache(use_static_shapes=True)`;
4. attention backends by name (12 kernels): `register_attention_backend`, `EngineConfig.attention_backend`;
5. no forward hooks (11 distillation, 09): the model runner calls `model.hidden` + `model.logits`.

Every reference is computed inside the test that uses it: a fresh prefill of exactly the tokens a rolled-back
cache should hold, one-by-one decoding for a multi-token step, the float32 cache for another KV dtype.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from minillm.core.config import GPTConfig
from minillm.core.model import GPT
from minillm.core.sampling import SamplingParams
from minillm.engine import LLM, EngineConfig, ModelRunner
from minillm.engine.config import resolve_kv_dtype
from minillm.engine.selective_cache import SelectiveKVCache
import minillm.kvcache.cache as cache_mod
from minillm.kvcache.cache import ContiguousKVCache
from minillm.kvcache.generate import generate_ids
from minillm.paged import BlockManager, PagedBatch, PagedKVCache, hash_block, ROOT_HASH
from minillm.paged.backends import (
    attention_backends,
    make_attention_backend,
    register_attention_backend,
    unregister_attention_backend,
)

ATOL, RTOL = 1e-5, 1e-5  # fp32: the same terms summed in another order
CFG = GPTConfig(vocab_size=96, block_size=64, n_layer=2, n_head=2, n_embd=32)


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    m = GPT(CFG).eval()
    with torch.no_grad():
        m.transformer.wte.weight.mul_(20.0)  # confident argmaxes, so equal greedy tokens test something
    return m


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist()


def _step(model, cache, tokens: list[int], start: int) -> torch.Tensor:
    """Logits (T, V) of `tokens` fed at positions start.. to a batch-1 cache, on the unchecked path."""
    idx = torch.tensor([tokens])  # (1, T)
    pos = torch.arange(start, start + len(tokens)).unsqueeze(0)  # (1, T)
    return model.logits(model.hidden(idx, pos, cache))[0]  # (T, V)


def _fresh(model, tokens: list[int]) -> torch.Tensor:
    """The reference: a full forward of exactly these tokens, no cache. (T, V)"""
    with torch.inference_mode():
        return model(torch.tensor([tokens]))[0]


def _paged_step(model, cache, manager, entries, tokens) -> torch.Tensor:
    """One paged forward over `entries` [(seq, start, n)] with their new `tokens` flattened: logits (N, V)."""
    batch = PagedBatch.build(manager, entries)
    cache.set_batch(batch)
    h = model.hidden(torch.tensor([tokens]), batch.positions(), cache)  # (1, N, C)
    return model.logits(h)[0]  # (N, V)


# ================================================================================ 1. roll back, several tokens


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static-shapes"])
def test_contiguous_truncate_then_new_tokens_equals_fresh_prefill(model, static):
    """Prefill 10, verify 4 draft tokens in one step, keep 1 of them, then 3 other tokens: as if never drafted."""
    prompt, draft, other = _ids(10, 1), _ids(4, 2), _ids(3, 3)
    cache = ContiguousKVCache(CFG, 1, 32, use_static_shapes=static)
    with torch.inference_mode():
        _step(model, cache, prompt, 0)
        _step(model, cache, draft, 10)
        assert cache.length == 14
        cache.truncate(11)  # 3 draft tokens rejected
        got = _step(model, cache, other, 11)
    kept = prompt + draft[:1] + other
    torch.testing.assert_close(got, _fresh(model, kept)[11:], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static-shapes"])
def test_contiguous_truncate_to_zero_and_bad_lengths(model, static):
    cache = ContiguousKVCache(CFG, 1, 16, use_static_shapes=static)
    with torch.inference_mode():
        _step(model, cache, _ids(5, 1), 0)
        cache.truncate(0)
        got = _step(model, cache, _ids(4, 2), 0)
    torch.testing.assert_close(got, _fresh(model, _ids(4, 2)), atol=ATOL, rtol=RTOL)
    for bad in (-1, 5):
        with pytest.raises(ValueError, match=str(bad)):
            cache.truncate(bad)
    with pytest.raises(TypeError, match="2.0"):
        cache.truncate(2.0)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static-shapes"])
@pytest.mark.parametrize("pads", [[0, 0], [0, 3]], ids=["no-padding", "left-padding"])
def test_contiguous_multi_token_step_equals_one_by_one(model, static, pads):
    """A step of T=4 new tokens per row after a cached prompt gives the logits of four single-token steps."""
    B, P = 2, 9
    prompts = torch.tensor([_ids(P, 1), _ids(P, 2)])  # (B, P): padding slots hold junk tokens, masked anyway
    new = torch.tensor([_ids(4, 3), _ids(4, 4)])  # (B, 4)
    outs = []
    for chunked in (True, False):
        cache = ContiguousKVCache(CFG, B, 16, use_static_shapes=static).reset(pads)
        with torch.inference_mode():
            model.hidden(prompts, cache.positions(P), cache)
            if chunked:
                outs.append(model.logits(model.hidden(new, cache.positions(4), cache)))  # (B, 4, V)
            else:
                outs.append(torch.cat([model.logits(model.hidden(new[:, t : t + 1], cache.positions(1), cache))
                                       for t in range(4)], dim=1))  # (B, 4, V)
    torch.testing.assert_close(outs[0], outs[1], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("backend", ["selective", "paged", "paged-reference"])
def test_paged_multi_token_step_equals_one_by_one(model, backend):
    """Sequence 0 adds 3 tokens in one step while sequence 1 decodes one: the logits of one-by-one decoding."""
    p0, p1, new0, new1 = _ids(9, 1), _ids(6, 2), _ids(3, 3), _ids(1, 4)
    got = {}
    for chunked in (True, False):
        m = BlockManager(16, 4)
        cache = make_attention_backend(backend, CFG, 16, 4)
        m.allocate(0, p0)
        m.allocate(1, p1)
        with torch.inference_mode():
            _paged_step(model, cache, m, [(0, 0, 9), (1, 0, 6)], p0 + p1)
            for t in new0:
                m.append_slot(0, t)
            m.append_slot(1, new1[0])
            if chunked:
                out = _paged_step(model, cache, m, [(0, 9, 3), (1, 6, 1)], new0 + new1)
                got[chunked] = out[:3]
            else:
                got[chunked] = torch.cat([_paged_step(model, cache, m, [(0, 9 + t, 1)], [new0[t]]) for t in range(3)])
        m.free(0)
        m.free(1)
    torch.testing.assert_close(got[True], got[False], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got[True], _fresh(model, p0 + new0)[9:], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["plain", "prefix-caching"])
def test_block_manager_truncate_then_reappend_equals_fresh_prefill(model, prefix_caching):
    """Paged speculative step: 10 prompt tokens, 5 drafts verified at once, 2 kept, 3 others: a fresh prefill's logits."""
    bs = 4
    prompt, draft, other = _ids(10, 1), _ids(5, 2), _ids(3, 3)
    m = BlockManager(16, bs, enable_prefix_caching=prefix_caching)
    cache = PagedKVCache(CFG, 16, bs)
    m.allocate("s", prompt)
    with torch.inference_mode():
        _paged_step(model, cache, m, [("s", 0, 10)], prompt)
        for t in draft:
            assert m.append_slot("s", t) == []
        _paged_step(model, cache, m, [("s", 10, 5)], draft)
        m.mark_computed("s", 15)
        m.truncate("s", 12)
        m.check_invariants()
        assert m.num_tokens("s") == 12 and len(m.block_table("s")) == 3 and m.num_free_blocks == 13
        for t in other:
            assert m.append_slot("s", t) == []  # sole holder: written in place
        got = _paged_step(model, cache, m, [("s", 12, 3)], other)
    torch.testing.assert_close(got, _fresh(model, prompt + draft[:2] + other)[12:], atol=ATOL, rtol=RTOL)
    m.free("s")


def test_truncate_block_counts_and_free_list_exact():
    m = BlockManager(8, 4)
    m.allocate("a", list(range(10)))  # 3 blocks: 0, 1, 2
    assert m.block_table("a") == [0, 1, 2]
    m.truncate("a", 8)  # block 2 empty -> freed
    assert m.block_table("a") == [0, 1] and m.num_free_blocks == 6
    assert list(m.allocator._free) == [3, 4, 5, 6, 7, 2]  # released to the tail: FIFO reuse
    m.truncate("a", 5)  # block 1 keeps token 4
    assert m.block_table("a") == [0, 1] and m.token_ids("a") == [0, 1, 2, 3, 4]
    m.truncate("a", 5)  # to its own length: nothing changes
    assert m.block_table("a") == [0, 1] and m.num_free_blocks == 6
    m.truncate("a", 0)
    assert m.block_table("a") == [] and m.token_ids("a") == [] and m.num_free_blocks == 8
    m.check_invariants()
    assert m.append_slot("a", 7) == [] and m.num_tokens("a") == 1 and len(m.block_table("a")) == 1
    m.check_invariants()
    m.free("a")
    assert m.num_free_blocks == 8


def test_fork_then_truncate_one_child_leaves_the_other_intact(model):
    """Two children share a 10-token prefix; child b rolls back into the shared block 1 and writes new tokens.
    Block 1 is copied first (copy-on-write), so child a's next logits still equal a fresh prefill of its tokens."""
    bs = 4
    prompt = _ids(10, 1)
    m = BlockManager(16, bs)
    cache = PagedKVCache(CFG, 16, bs)
    m.allocate("a", prompt)
    with torch.inference_mode():
        _paged_step(model, cache, m, [("a", 0, 10)], prompt)
        m.mark_computed("a", 10)
        m.fork("a", "b")
        table = m.block_table("a")
        m.truncate("b", 6)  # b drops block 2 (a still holds it) and keeps block 1 partly
        assert m.block_table("b") == table[:2] and m.block_table("a") == table and m.token_ids("a") == prompt
        assert [m.allocator.ref_count(b) for b in table] == [2, 2, 1]
        m.check_invariants()
        other = _ids(3, 2)
        pairs = m.append_slot("b", other[0])
        assert pairs and pairs[0][0] == table[1]  # the shared partial block is copied, not written in place
        cache.copy_blocks(pairs)
        for t in other[1:]:
            assert m.append_slot("b", t) == []
        got_b = _paged_step(model, cache, m, [("b", 6, 3)], other)
        nxt = _ids(1, 3)
        m.append_slot("a", nxt[0])
        got_a = _paged_step(model, cache, m, [("a", 10, 1)], nxt)
    torch.testing.assert_close(got_b, _fresh(model, prompt[:6] + other)[6:], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got_a, _fresh(model, prompt + nxt)[10:], atol=ATOL, rtol=RTOL)
    m.check_invariants()
    m.free("a")
    m.free("b")
    assert m.num_free_blocks == 16


def test_truncate_unpublishes_a_full_block_that_becomes_partial():
    bs = 4
    toks = list(range(20, 33))  # 13 tokens: blocks 0..2 full, block 3 partial
    m = BlockManager(16, bs, enable_prefix_caching=True)
    m.allocate("a", toks)
    m.mark_computed("a", 13)
    h0 = hash_block(ROOT_HASH, toks[:4])
    h1 = hash_block(h0, toks[4:8])
    h2 = hash_block(h1, toks[8:12])
    block1 = m.block_table("a")[1]
    assert m.allocator.find(h1, h0, toks[4:8]) == block1
    m.truncate("a", 6)  # block 1 becomes partial (it will be overwritten); block 2 is dropped, content intact
    assert m.allocator.find(h1, h0, toks[4:8]) is None
    assert m.allocator.find(h2, h1, toks[8:12]) is not None  # a dropped full block stays cached, as after free
    m.check_invariants()
    assert m.allocate("b", toks) == 4  # only block 0 is still found for the same prompt
    m.free("b")
    m.free("a")
    m.check_invariants()


def test_truncate_unpublishes_a_shared_block_before_its_sole_holder_writes_it():
    """subtle: the block is shared when truncated, its other holder leaves, then the truncated one writes in place."""
    bs = 4
    toks = list(range(40, 49))  # 9 tokens
    m = BlockManager(16, bs, enable_prefix_caching=True)
    m.allocate("a", toks)
    m.mark_computed("a", 9)
    m.fork("a", "b")
    m.truncate("b", 6)
    m.free("a")
    assert m.append_slot("b", 1) == []  # b holds block 1 alone now: written in place
    m.check_invariants()
    assert m.allocate("c", toks) == 4  # block 1's old content is not found any more
    for s in ("b", "c"):
        m.free(s)


def test_block_manager_truncate_bad_arguments_name_the_value():
    m = BlockManager(8, 4)
    m.allocate("a", [1, 2, 3, 4, 5])
    for bad in (-1, 6):
        with pytest.raises(ValueError, match=f"num_tokens={bad}"):
            m.truncate("a", bad)
    with pytest.raises(ValueError, match="'nope'"):
        m.truncate("nope", 0)
    with pytest.raises(TypeError, match="2.5"):
        m.truncate("a", 2.5)
    assert m.token_ids("a") == [1, 2, 3, 4, 5] and m.num_free_blocks == 6  # nothing changed
    m.free("a")


# ================================================================================ 2. the KV dtype is a setting


@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-5), (torch.bfloat16, 0.15)])
def test_caches_store_their_own_dtype_and_convert_on_read(model, dtype, atol):
    """float64 storage of float32 K/V is exact; bfloat16 keeps ~3 digits, so logits move by a few hundredths."""
    tokens = _ids(12, 1)
    ref = _fresh(model, tokens)
    c = ContiguousKVCache(CFG, 1, 16, dtype=dtype)
    m = BlockManager(8, 4)
    p = PagedKVCache(CFG, 8, 4, dtype=dtype)
    m.allocate(0, tokens[:8])
    with torch.inference_mode():
        got_c = torch.cat([_step(model, c, tokens[:8], 0)] + [_step(model, c, [t], 8 + i)
                                                              for i, t in enumerate(tokens[8:])])
        got_p = [_paged_step(model, p, m, [(0, 0, 8)], tokens[:8])]
        for i, t in enumerate(tokens[8:]):
            m.append_slot(0, t)
            got_p.append(_paged_step(model, p, m, [(0, 8 + i, 1)], [t]))
    m.free(0)
    assert c.k[0].dtype == dtype and p.k_pools[0].dtype == dtype
    assert got_c.dtype == torch.float32  # attention runs in the query's dtype
    torch.testing.assert_close(got_c, ref, atol=atol, rtol=0)
    torch.testing.assert_close(torch.cat(got_p), ref, atol=atol, rtol=0)


def test_engine_kv_dtype_setting(model):
    prompts = [_ids(7, 1), _ids(12, 2)]
    params = SamplingParams(max_new_tokens=6, temperature=0.0)

    def run(**kw):
        llm = LLM(model, None, EngineConfig(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                                            **kw))
        return llm, [o.output_token_ids for o in llm.generate(prompts, params)]

    _, ref = run()
    llm64, got64 = run(kv_dtype="float64")
    assert llm64.runner.cache.k_pools[0].dtype == torch.float64 and llm64.config.kv_dtype == torch.float64
    assert got64 == ref  # float32 -> float64 -> float32 is exact
    llm16, got16 = run(kv_dtype=torch.bfloat16)
    assert llm16.runner.cache.k_pools[0].dtype == torch.bfloat16 and [len(g) for g in got16] == [6, 6]


def test_kv_dtype_does_not_follow_the_weights(model):
    """A float64 model with the default KV dtype: the pool stays float32 and reads are converted to float64."""
    m64 = GPT(CFG).eval()
    m64.load_state_dict(model.state_dict())
    m64 = m64.double()
    runner = ModelRunner(m64, 8, 4)
    assert runner.cache.k_pools[0].dtype == torch.float32 and runner.kv_dtype == torch.float32
    cache = ContiguousKVCache(CFG, 1, 8)
    with torch.inference_mode():
        got = _step(m64, cache, _ids(6, 1), 0)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got.float(), _fresh(model, _ids(6, 1)), atol=1e-4, rtol=0)


@pytest.mark.parametrize("bad", ["int8", "float", torch.int8, 3, None])
def test_bad_kv_dtype_names_the_value(bad):
    with pytest.raises(ValueError, match=repr(bad).replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(kv_dtype=bad)
    assert resolve_kv_dtype("bfloat16") is torch.bfloat16 and resolve_kv_dtype("torch.float16") is torch.float16


# ================================================================================ 3. no host sync, static shapes


class _CountSyncs(TorchDispatchMode):
    """Counts ops that copy a tensor's value to the host: .item(), int(t), bool(t), .tolist() all end in
    aten._local_scalar_dense (tolist on a CPU tensor reads memory directly, so it is counted by the patch below)."""

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static-shapes"])
def test_contiguous_decode_step_makes_no_host_sync(model, static, monkeypatch):
    cache = ContiguousKVCache(CFG, 2, 16, use_static_shapes=static).reset([0, 2])
    with torch.inference_mode():
        model.hidden(torch.tensor([_ids(5, 1), _ids(5, 2)]), cache.positions(5), cache)
        positions = cache.positions(1)
        idx = torch.tensor([[3], [4]])
        tolist_calls = []
        original = torch.Tensor.tolist
        monkeypatch.setattr(torch.Tensor, "tolist", lambda t: tolist_calls.append(t.shape) or original(t))
        with _CountSyncs() as mode:
            model.logits(model.hidden(idx, positions, cache))
    assert mode.syncs == [] and tolist_calls == []


def test_static_shape_decode_equals_dynamic_and_keeps_its_shapes(model, monkeypatch):
    """Left-padded batch: prefill, 5 decode steps, a 3-token step, a rollback, 2 more steps; same logits either way,
    and every attention call of the static path sees keys of the same shape."""
    shapes: list[tuple[int, ...]] = []
    original = cache_mod.attention
    monkeypatch.setattr(cache_mod, "attention", lambda q, k, v, **kw: shapes.append(tuple(k.shape)) or
                        original(q, k, v, **kw))
    outs = {}
    for static in (False, True):
        shapes.clear()
        cache = ContiguousKVCache(CFG, 2, 24, use_static_shapes=static).reset([3, 0])
        got = []
        with torch.inference_mode():
            got.append(model.logits(model.hidden(torch.tensor([_ids(6, 1), _ids(6, 2)]), cache.positions(6), cache)))
            for t in range(5):
                got.append(model.logits(model.hidden(torch.tensor([[t], [t + 1]]), cache.positions(1), cache)))
            got.append(model.logits(model.hidden(torch.tensor([_ids(3, 3), _ids(3, 4)]), cache.positions(3), cache)))
            cache.truncate(cache.length - 2)
            for t in range(2):
                got.append(model.logits(model.hidden(torch.tensor([[t], [t + 2]]), cache.positions(1), cache)))
        outs[static] = torch.cat(got, dim=1)
        if static:
            assert set(shapes) == {(2, CFG.n_head, 24, CFG.head_size)}
        else:
            assert len(set(shapes)) > 1  # the dynamic path's keys grow with the length
    torch.testing.assert_close(outs[True], outs[False], atol=ATOL, rtol=RTOL)


def test_decode_step_compiles_fullgraph_and_matches_eager(model):
    """torch.compile(fullgraph=True) of hidden + logits over the static-shape cache: no graph break (a host sync
    or data-dependent Python would be one) and the compiled decode matches eager for three steps."""
    if not hasattr(torch, "compile") or not torch._dynamo.is_dynamo_supported():
        pytest.skip("torch.compile (dynamo) is not supported on this Python/PyTorch")
    from torch._dynamo.backends.debugging import aot_eager
    caches = [ContiguousKVCache(CFG, 1, 16, use_static_shapes=True) for _ in range(2)]

    def step(idx, positions, cache):
        return model.logits(model.hidden(idx, positions, cache))

    compile_count = [0]

    def counting_backend(gm, example_inputs):
        compile_count[0] += 1
        return aot_eager(gm, example_inputs)

    # aot_eager: dynamo's full-graph capture and AOT functionalization, without inductor's C++ build (which
    # takes ~25 s on a small CPU); a graph break or a guard on per-step Python state shows up either way.
    compiled = torch.compile(step, fullgraph=True, dynamic=False, backend=counting_backend)
    with torch.no_grad():
        for c in caches:
            model.hidden(torch.tensor([_ids(6, 1)]), c.positions(6), c)
        outs = []
        for t in range(3):
            idx = torch.tensor([[t + 5]])
            e = step(idx, caches[0].positions(1), caches[0])
            g = compiled(idx, caches[1].positions(1), caches[1])
            outs.append((e, g))
    for e, g in outs:
        torch.testing.assert_close(g, e, atol=ATOL, rtol=RTOL)
    assert caches[1].length == caches[0].length == 9
    assert compile_count[0] == 1, "the compiled decode step recompiled: it depends on per-step Python state"


# ================================================================================ 4. attention backends by name


class CountingKVCache(SelectiveKVCache):
    """A toy backend: the engine's default cache, counting its attention calls."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_attend_calls = 0

    def attend(self, layer_idx, q, k, v):
        self.num_attend_calls += 1
        return super().attend(layer_idx, q, k, v)


@pytest.fixture
def counting_backend():
    register_attention_backend("counting", CountingKVCache)
    yield "counting"
    unregister_attention_backend("counting")


def _greedy(model, **cfg_kw):
    llm = LLM(model, None, EngineConfig(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=8,
                                        **cfg_kw))
    prompts = [_ids(9, 1), _ids(3, 2), _ids(14, 3)]
    out = llm.generate(prompts, SamplingParams(max_new_tokens=5, temperature=0.0))
    return llm, [o.output_token_ids for o in out]


def test_built_in_backends_are_registered_and_agree(model):
    assert {"selective", "paged", "paged-reference"} <= set(attention_backends())
    llm, ref = _greedy(model)
    assert type(llm.runner.cache) is SelectiveKVCache  # the default is today's behaviour
    for name in ("paged", "paged-reference"):
        llm, got = _greedy(model, attention_backend=name)
        assert type(llm.runner.cache) is PagedKVCache and got == ref
    assert not llm.runner.cache.use_fast_decode


def test_a_registered_toy_backend_is_used_by_name(model, counting_backend):
    _, ref = _greedy(model)
    llm, got = _greedy(model, attention_backend=counting_backend)
    assert isinstance(llm.runner.cache, CountingKVCache)
    assert llm.runner.cache.num_attend_calls == CFG.n_layer * llm.runner.num_forward_calls > 0
    assert got == ref


def test_unknown_backend_lists_the_known_names():
    with pytest.raises(ValueError, match=r"'nope'.*'paged'.*'selective'"):
        EngineConfig(attention_backend="nope")
    with pytest.raises(TypeError, match="12"):
        EngineConfig(attention_backend=12)
    with pytest.raises(ValueError, match="'selective' is already registered"):
        register_attention_backend("selective", PagedKVCache)


# ================================================================================ 5. no forward hooks


def test_model_runner_uses_hidden_and_logits_not_forward_or_hooks(model, monkeypatch):
    """The engine never calls the checked forward (its host sync) nor registers a hook: same tokens as the reference
    computed by chapter 04's loop."""
    params = SamplingParams(max_new_tokens=5, temperature=0.0)
    prompts = [_ids(9, 1), _ids(3, 2), _ids(14, 3)]
    ref = [generate_ids(model, p, params) for p in prompts]

    def refuse(*a, **k):
        raise AssertionError("the engine must not call this")

    monkeypatch.setattr(GPT, "forward", refuse)
    monkeypatch.setattr(nn.Module, "register_forward_hook", refuse)
    _, got = _greedy(model)
    assert got == ref


def test_model_runner_accepts_any_module_with_the_models_interface(model):
    class Wrapped(nn.Module):  # e.g. chapter 09's quantized copy: not a GPT, same interface
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        device = property(lambda self: self.inner.device)

        def hidden(self, idx, positions, cache=None):
            return self.inner.hidden(idx, positions, cache)

        def logits(self, h):
            return self.inner.logits(h)

    runner = ModelRunner(Wrapped(model), 8, 4, attention_backend="paged")
    assert isinstance(runner.cache, PagedKVCache)
    with pytest.raises(TypeError, match="ModelRunner.*Linear"):
        ModelRunner(nn.Linear(2, 2), 8, 4)

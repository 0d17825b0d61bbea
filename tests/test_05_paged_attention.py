"""Chapter 05: block allocator, block tables, paged attention, prefix sharing (copy-on-write), prefix caching.

Every test leaves every pool it made with all blocks free: the autouse fixture below records each allocator
created during the test and checks it at teardown, so a leak anywhere (a test, or the library) fails loudly.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import context_model
from minillm import GPT, GPTConfig
from minillm.kvcache.generate import generate_ids
from minillm.naive.generate import generate_naive_ids
from minillm.kvcache.cache import ContiguousKVCache
from minillm.paged import (
    ROOT_HASH,
    BlockAllocator,
    BlockManager,
    BlockStateError,
    OutOfBlocks,
    PagedBatch,
    PagedKVCache,
    PrefixCachingAllocator,
    compute_slot_mapping,
    hash_block,
    write_kv,
)
from minillm.paged.generate import PagedGenerator, paged_generate
from minillm.paged.bench import contiguous_memory_use, make_length_workload, paged_memory_use
from minillm.core.sampling import SamplingParams

ATOL, RTOL = 1e-5, 1e-5  # fp32 logits: paged and contiguous sum the same terms in a different order


@pytest.fixture(autouse=True)
def _every_pool_returns_to_free(monkeypatch):
    """Track every BlockAllocator built during the test; at teardown all its blocks must be free again."""
    created: list[BlockAllocator] = []
    original = BlockAllocator.__init__

    def tracking_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        created.append(self)

    monkeypatch.setattr(BlockAllocator, "__init__", tracking_init)
    yield
    for alloc in created:
        alloc.check_invariants()
        assert alloc.num_free == alloc.num_blocks, f"{alloc!r} leaked {alloc.num_used} blocks"


@pytest.fixture(scope="module")
def model() -> GPT:
    # context-sensitive (tests/helpers.py): a default-init model's tokens barely depend on the K/V read back
    return context_model(GPTConfig(vocab_size=96, block_size=64, n_layer=2, n_head=2, n_embd=32), seed=0)


def _prompt(n: int, seed: int = 0, vocab: int = 96) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


# ------------------------------------------------------------------------------------------- allocator


@pytest.mark.graded(points=2, exercise="allocate")
def test_allocator_hands_out_every_block_once_then_raises_out_of_blocks():
    alloc = BlockAllocator(4)
    blocks = [alloc.allocate() for _ in range(4)]
    assert sorted(blocks) == [0, 1, 2, 3]
    assert alloc.num_free == 0 and all(alloc.ref_count(b) == 1 for b in blocks)
    with pytest.raises(OutOfBlocks):
        alloc.allocate()
    alloc.check_invariants()  # the failed allocate changed nothing
    assert alloc.fork(blocks[0]) == 2
    assert alloc.free(blocks[0]) is False  # one holder left
    for b in blocks:
        assert alloc.free(b) is True
    assert alloc.num_free == 4


@pytest.mark.graded(points=2, exercise="allocate")
def test_allocate_calls_the_on_take_hook_so_prefix_caching_evicts():
    """`allocate` hands out blocks through the `_on_take` hook (its docstring says so). Prefix caching overrides
    the hook to forget a cached free block's content when it is reused; an allocate that skips the hook passes every
    plain-allocator test yet leaves a block findable by the hash of content about to be overwritten."""
    alloc = PrefixCachingAllocator(2)
    cached = alloc.allocate()
    assert alloc.publish(cached, 123, ROOT_HASH, (1, 2))
    alloc.free(cached)  # free, content still findable
    assert alloc.find(123, ROOT_HASH, (1, 2)) == cached
    plain = alloc.allocate()  # uncached free blocks are reused first
    assert plain != cached and alloc.num_evictions == 0
    again = alloc.allocate()  # now the cached block itself: its content must be evicted
    assert again == cached and alloc.num_evictions == 1
    assert alloc.find(123, ROOT_HASH, (1, 2)) is None and alloc.num_cached_blocks == 0
    alloc.check_invariants()
    alloc.free(plain)
    alloc.free(again)


@pytest.mark.graded(points=1, exercise="allocate")
def test_double_free_and_use_after_free_are_errors():
    alloc = BlockAllocator(2)
    b = alloc.allocate()
    alloc.free(b)
    with pytest.raises(BlockStateError, match=f"block {b}"):
        alloc.free(b)
    with pytest.raises(BlockStateError, match="free"):
        alloc.fork(b)
    with pytest.raises(BlockStateError, match="outside the pool"):
        alloc.free(7)
    alloc.check_invariants()


def test_allocator_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks must be positive, got 0"):
        BlockAllocator(0)
    with pytest.raises(TypeError, match="num_blocks must be an int"):
        BlockAllocator(2.5)
    with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
        BlockManager(4, 0)


# ------------------------------------------------------------------------------------------- block tables


@pytest.mark.graded(points=2, exercise="compute_slot_mapping")
def test_slot_mapping_worked_example():
    # bs = 4, table [7, 2]: positions 3, 4, 5 -> block 7 offset 3, block 2 offsets 0, 1.
    assert compute_slot_mapping([7, 2], 4, 3, 6) == [31, 8, 9]
    assert compute_slot_mapping([5], 4, 0, 4) == [20, 21, 22, 23]
    assert compute_slot_mapping([5, 1, 3], 2, 0, 6) == [10, 11, 2, 3, 6, 7]
    with pytest.raises(ValueError, match="past the 2 blocks"):
        compute_slot_mapping([7, 2], 4, 0, 9)


@pytest.mark.graded(points=2, exercise=("compute_slot_mapping", "allocate"))
def test_block_tables_grow_one_block_at_a_time():
    m = BlockManager(8, 4)
    assert m.allocate("a", [1, 2, 3, 4, 5]) == 0
    assert m.block_table("a") == [0, 1]
    assert m.slot_mapping("a", 0, 5) == [0, 1, 2, 3, 4]
    for t in (6, 7, 8):  # fills block 1
        assert m.append_slot("a", t) == []
    assert m.block_table("a") == [0, 1]
    m.append_slot("a", 9)  # position 8 starts a third block
    assert m.block_table("a") == [0, 1, 2] and m.slot_mapping("a", 8, 9) == [8]
    m.check_invariants()
    m.free("a")


@pytest.mark.graded(points=3, exercise="_copy_on_write")
def test_fork_shares_blocks_and_copy_on_write_copies_the_shared_last_block():
    m = BlockManager(8, 4)
    m.allocate("p", list(range(6)))  # blocks [0, 1]; block 1 holds 2 of 4 tokens
    m.fork("p", "c")
    assert m.block_table("c") == m.block_table("p") == [0, 1]
    assert m.allocator.ref_count(0) == 2 and m.allocator.ref_count(1) == 2
    pairs = m.append_slot("c", 99)  # the child writes into the shared block 1: copied first
    assert pairs == [(1, 2)]
    assert m.block_table("c") == [0, 2] and m.block_table("p") == [0, 1]
    assert m.allocator.ref_count(1) == 1 and m.allocator.ref_count(0) == 2
    assert m.append_slot("p", 42) == []  # the parent is now the only holder of block 1: no copy
    m.check_invariants()
    m.free("p")
    m.free("c")


def test_out_of_blocks_in_manager_changes_nothing():
    m = BlockManager(3, 4)
    m.allocate("a", list(range(8)))  # 2 blocks
    with pytest.raises(OutOfBlocks):
        m.allocate("b", list(range(9)))  # needs 3, 1 free
    assert not m.has_seq("b") and m.num_free_blocks == 1
    m.allocate("b", [1])
    assert not m.can_append("a")
    with pytest.raises(OutOfBlocks):
        m.append_slot("a", 5)  # a new block is needed, none free
    assert m.num_tokens("a") == 8 and m.block_table("a") == [0, 1]
    m.fork("b", "b2")
    with pytest.raises(OutOfBlocks):
        m.append_slot("b2", 5)  # copy-on-write needs a block, none free
    assert m.block_table("b2") == m.block_table("b")
    m.check_invariants()
    for s in ("a", "b", "b2"):
        m.free(s)


def test_manager_bad_input_names_the_value():
    m = BlockManager(4, 4)
    with pytest.raises(ValueError, match="at least one prompt token"):
        m.allocate("x", [])
    with pytest.raises(ValueError, match="unknown sequence 'nope'"):
        m.free("nope")
    m.allocate("x", [1])
    with pytest.raises(ValueError, match="'x' already has blocks"):
        m.allocate("x", [1])
    with pytest.raises(ValueError, match="num_tokens=5"):
        m.mark_computed("x", 5)
    m.free("x")


# ------------------------------------------------------------------------------------------- property test

_ops = st.lists(
    st.tuples(st.sampled_from(["allocate", "append", "fork", "free"]), st.integers(0, 5), st.integers(1, 11)),
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_ops, prefix=st.booleans())
def test_random_operations_keep_the_invariants(ops, prefix):
    """Reference counts equal the number of tables holding a block; free + used = total; no duplicates."""
    m = BlockManager(12, 3, enable_prefix_caching=prefix)
    live: list[int] = []
    next_id = 0
    for op, pick, n in ops:
        try:
            if op == "allocate":
                m.allocate(next_id, [(next_id + i) % 3 for i in range(n)])  # few distinct tokens: cache hits
                live.append(next_id)
                next_id += 1
            elif live and op == "append":
                m.append_slot(live[pick % len(live)], n)
            elif live and op == "fork":
                m.fork(live[pick % len(live)], next_id)
                live.append(next_id)
                next_id += 1
            elif live and op == "free":
                m.free(live.pop(pick % len(live)))
        except OutOfBlocks:
            pass  # a full pool is a normal outcome; the invariants must still hold
        m.check_invariants()
    for s in live:
        m.free(s)
    m.check_invariants()
    assert m.num_free_blocks == m.num_blocks


# ------------------------------------------------------------------------------------------- the cache


@pytest.mark.graded(points=2, exercise="write_kv")
def test_write_kv_stores_each_token_at_its_slot():
    pool = torch.zeros(3, 4, 2, 5)  # (nb, bs, nh, hs)
    x = torch.arange(3 * 2 * 5, dtype=torch.float32).view(3, 2, 5)  # (N, nh, hs)
    write_kv(pool, torch.tensor([9, 0, 6]), x)
    torch.testing.assert_close(pool[2, 1], x[0], atol=0, rtol=0)  # slot 9 = block 2, offset 1
    torch.testing.assert_close(pool[0, 0], x[1], atol=0, rtol=0)
    torch.testing.assert_close(pool[1, 2], x[2], atol=0, rtol=0)
    assert int((pool != 0).sum()) == int((x != 0).sum())  # nothing else written


def _contiguous_logits(model, tokens, prompt_len, device):
    """Logits of the prompt (prefill) and of every later token (one decode step each), on chapter 04's cache."""
    cache = ContiguousKVCache(model.config, 1, len(tokens), device=device)
    with torch.inference_mode():
        out = [model(torch.tensor([tokens[:prompt_len]], device=device), cache=cache)[0]]
        for p in range(prompt_len, len(tokens)):
            out.append(model(torch.tensor([[tokens[p]]], device=device), positions=torch.tensor([[p]], device=device),
                             cache=cache)[0])
    return torch.cat(out)  # (len(tokens), V)


@pytest.mark.parametrize("fast", [True, False], ids=["fast-decode", "reference-loop"])
def test_ragged_batch_matches_contiguous_cache_logits(model, device, fast):
    """Three sequences, mixed prefill/decode steps in one ragged forward, against chapter 04 one at a time."""
    if device.type != "cpu":  # the module's model stays on the CPU for the other tests
        model = copy.deepcopy(model).to(device)
    seqs = [_prompt(13, 1) + _prompt(6, 2), _prompt(5, 3) + _prompt(6, 4), _prompt(20, 5) + _prompt(6, 6)]
    plens = [13, 5, 20]
    m = BlockManager(32, 4)
    cache = PagedKVCache(model.config, 32, 4, device=device, use_fast_decode=fast)
    got = [[] for _ in seqs]
    for i, (s, p) in enumerate(zip(seqs, plens)):
        m.allocate(i, s[:p])
    with torch.inference_mode():
        # step 0: prefill of all three at once; step 1..6: one token each (decode)
        entries = [(i, 0, p) for i, p in enumerate(plens)]
        toks = [t for s, p in zip(seqs, plens) for t in s[:p]]
        for step in range(7):
            batch = PagedBatch.build(m, entries, device=device)
            cache.set_batch(batch)
            logits = model(torch.tensor([toks], device=device), batch.positions(), cache=cache)[0]
            off = 0
            for i, (_, _, n) in enumerate(entries):
                got[i].append(logits[off : off + n])
                off += n
            if step == 6:
                break
            for i, s in enumerate(seqs):
                m.append_slot(i, s[plens[i] + step])
            entries = [(i, plens[i] + step, 1) for i in range(3)]
            toks = [s[plens[i] + step] for i, s in enumerate(seqs)]
    for i, (s, p) in enumerate(zip(seqs, plens)):
        ref = _contiguous_logits(model, s, p, device)
        torch.testing.assert_close(torch.cat(got[i])[: len(s)], ref, atol=ATOL, rtol=RTOL)
        m.free(i)


def test_fast_decode_equals_reference_loop_with_ragged_lengths(model):
    m = BlockManager(16, 4)
    caches = [PagedKVCache(model.config, 16, 4, use_fast_decode=f) for f in (True, False)]
    lens = [3, 9, 4]
    for i, n in enumerate(lens):
        m.allocate(i, _prompt(n, i))
    prefill = PagedBatch.build(m, [(i, 0, n) for i, n in enumerate(lens)])
    decode = [(i, n - 1, 1) for i, n in enumerate(lens)]
    outs = []
    with torch.inference_mode():
        for c in caches:
            c.set_batch(prefill)
            toks = [t for i, n in enumerate(lens) for t in _prompt(n, i)]
            model(torch.tensor([toks]), prefill.positions(), cache=c)
            # re-run the last token of each as a decode step (rewrites the same slots)
            b = PagedBatch.build(m, decode)
            c.set_batch(b)
            outs.append(model(torch.tensor([[_prompt(n, i)[-1] for i, n in enumerate(lens)]]), b.positions(), cache=c))
    assert prefill.is_decode is False and b.is_decode is True
    torch.testing.assert_close(outs[0], outs[1], atol=ATOL, rtol=RTOL)
    for i in range(3):
        m.free(i)


def test_cache_bad_input(model):
    cache = PagedKVCache(model.config, 4, 4)
    q = torch.zeros(1, 2, 1, 16)
    with pytest.raises(ValueError, match="before set_batch"):
        cache.attend(0, q, q, q)
    with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
        PagedKVCache(model.config, 4, 0)
    with pytest.raises(TypeError, match="GPTConfig"):
        PagedKVCache("base", 4, 4)
    one = torch.tensor([1])
    with pytest.raises(ValueError, match="query_lens sum to 2 but slot_mapping has 1"):
        PagedBatch(one, torch.tensor([[0]]), one, torch.tensor([2]))
    with pytest.raises(TypeError, match="slot_mapping must be an int64 tensor"):
        PagedBatch(one.float(), torch.tensor([[0]]), one, one)
    cache.set_batch(PagedBatch(torch.tensor([0]), torch.tensor([[0]]), one, one))
    with pytest.raises(ValueError, match="expects q of shape"):
        cache.attend(0, torch.zeros(2, 2, 1, 16), q, q)


def test_nbytes_match_the_kv_formula(model):
    cfg = model.config
    per_token = 2 * cfg.n_layer * cfg.n_head * cfg.head_size * 4  # fp32
    assert PagedKVCache(cfg, 10, 16).nbytes == 10 * 16 * per_token
    assert ContiguousKVCache(cfg, 1, 64).nbytes == 64 * per_token


# ------------------------------------------------------------------------------------------- generation


@pytest.mark.graded(points=2, exercise=("allocate", "compute_slot_mapping", "write_kv"))
def test_paged_greedy_tokens_equal_contiguous_and_naive(model):
    prompt = _prompt(11, 7)
    params = SamplingParams.greedy(30)
    paged = paged_generate(model, prompt, params, block_size=4).token_ids[0]
    assert paged == generate_ids(model, prompt, params) == generate_naive_ids(model, prompt, params)


@pytest.mark.graded(points=3, exercise=("_copy_on_write", "allocate", "compute_slot_mapping", "write_kv"))
def test_n_samples_share_the_prompt_and_equal_independent_seeded_runs(model):
    """Sample i is seeded with seed + i, exactly as an independent run with that seed."""
    prompt = _prompt(18, 8)  # 4 full blocks of 4 + 2 tokens in a shared partial block
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=20, seed=11, n=3, ignore_eos=True)
    out = paged_generate(model, prompt, params, block_size=4)
    for i in range(3):
        alone = generate_ids(model, prompt, dataclasses.replace(params, n=1, seed=11 + i))
        assert out.token_ids[i] == alone
    assert len({tuple(t) for t in out.token_ids}) == 3  # different seeds, different samples
    assert out.num_cow_copies == 2  # two of three samples copy the shared partial block; the last writes in place
    # the 4 full prompt blocks are held once instead of three times
    assert out.peak_blocks_unshared - out.peak_blocks == 2 * 4
    assert [t[:4] for t in out.block_tables] == [out.block_tables[0][:4]] * 3


def test_prefix_caching_skips_the_shared_prefix_with_identical_outputs(model):
    system = _prompt(21, 9)  # 5 full blocks of 4 + 1 token
    params = SamplingParams.greedy(8)
    gen = PagedGenerator(model, 40, 4, enable_prefix_caching=True)
    first = gen.generate(system + [5, 6, 7], params)
    second = gen.generate(system + [8, 9], params)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 20  # the 5 full blocks of the system prompt were reused
    assert second.token_ids[0] == generate_ids(model, system + [8, 9], params)
    assert first.token_ids[0] == generate_ids(model, system + [5, 6, 7], params)
    gen.manager.check_invariants()


def test_a_fully_cached_prompt_still_computes_its_last_token():
    m = BlockManager(8, 4, enable_prefix_caching=True)
    m.allocate("a", list(range(8)))
    assert m.allocate("early", list(range(8))) == 0  # nothing is published before its K/V is computed
    m.mark_computed("a", 8)
    assert m.allocate("b", list(range(8))) == 4  # block 1 holds the last token: recomputed, not shared
    assert m.block_table("b")[0] == m.block_table("a")[0] and m.block_table("b")[1] != m.block_table("a")[1]
    for s in ("a", "early", "b"):
        m.free(s)


def test_hash_chain_and_lru_eviction():
    assert hash_block(ROOT_HASH, (1, 2)) == hash((ROOT_HASH, (1, 2)))
    assert hash_block(hash_block(ROOT_HASH, [1, 2]), [3, 4]) != hash_block(hash_block(ROOT_HASH, [9, 9]), [3, 4])
    m = BlockManager(4, 2, enable_prefix_caching=True)
    for name, toks in (("a", [1, 2, 3]), ("b", [4, 5, 6])):  # one full block each gets cached
        m.allocate(name, toks)
        m.mark_computed(name, 3)
    m.free("a")  # a's full block is released first: least recently used
    m.free("b")
    alloc = m.allocator
    assert isinstance(alloc, PrefixCachingAllocator) and alloc.num_cached_blocks == 2 and m.num_free_blocks == 4
    m.allocate("c", [7] * 7)  # needs all 4 blocks: evicts both cached blocks, a's first
    assert alloc.num_evictions == 2
    m.free("c")
    m.allocate("d", [1, 2, 3])
    assert m.num_computed_tokens("d") == 0  # a's block is gone
    m.mark_computed("d", 3)
    m.free("d")
    m.allocate("e", [8] * 5)  # 3 blocks: takes the 3 uncached free blocks, keeps d's cached one
    assert alloc.num_evictions == 2
    m.free("e")
    assert m.allocate("f", [1, 2, 9]) == 2  # d's block (the same content as a's) is still there
    m.free("f")


def test_out_of_blocks_during_generation_leaves_the_pool_free(model):
    gen = PagedGenerator(model, 3, 4)
    with pytest.raises(OutOfBlocks):
        gen.generate(_prompt(10, 1), SamplingParams.greedy(20))
    assert gen.manager.num_free_blocks == 3 and gen.manager.seq_ids == []


# ------------------------------------------------------------------------------------------- memory study


def test_memory_study_paged_waste_under_5_percent_at_block_size_16():
    work = make_length_workload(num_requests=80, seed=0)
    paged = paged_memory_use(work, 16)
    contiguous = contiguous_memory_use(work, "max_len")
    assert paged.waste < 0.05 and paged.max_waste_per_seq <= 15
    assert contiguous.utilisation < paged.utilisation
    assert paged_memory_use(work, 1).waste == 0.0
    assert paged.used_slots == contiguous.used_slots  # same tokens, different reservations


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_paged_greedy_equals_contiguous(model):
    cuda_model = GPT(model.config).eval()
    cuda_model.load_state_dict(model.state_dict())
    cuda_model = cuda_model.cuda()
    prompt, params = _prompt(9, 3), SamplingParams.greedy(16)
    assert paged_generate(cuda_model, prompt, params, block_size=8).token_ids[0] == generate_ids(
        cuda_model, prompt, params)


# ----- the K/V themselves after copy-on-write (token equality alone once missed a copy that did not copy) ---------


def _random_pools(cache: PagedKVCache, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for pool in cache.k_pools + cache.v_pools:
        pool.copy_(torch.randn(pool.shape, generator=g))


def test_copy_on_write_copies_the_kv_of_the_shared_block(model):
    """fork + append into the shared partial block: the child's new block holds exactly the parent's K/V for the
    tokens written so far, in every layer, and the parent's block is untouched."""
    m, cache = BlockManager(8, 4), PagedKVCache(model.config, 8, 4)
    _random_pools(cache)
    m.allocate("a", [1, 2, 3, 4, 5, 6])  # blocks [b0, b1]; b1 holds 2 tokens
    m.fork("a", "b")
    parent_before = [pool.clone() for pool in cache.k_pools + cache.v_pools]
    pairs = m.append_slot("b", 7)  # b writes position 6, inside the shared b1: copy first
    assert len(pairs) == 1
    cache.copy_blocks(pairs)
    a1, b1 = m.block_table("a")[1], m.block_table("b")[1]
    assert a1 != b1 and pairs[0] == (a1, b1)
    for pool, before in zip(cache.k_pools + cache.v_pools, parent_before):
        assert torch.equal(pool[b1][:2], pool[a1][:2])  # (2, nh, hs): the copied tokens
        assert torch.equal(pool[a1], before[a1])  # the parent's block is unchanged
    m.free("a")
    m.free("b")


def test_n_samples_read_their_own_kv_after_copy_on_write(model):
    """Two seeded samples of one prompt through the paged generator equal two independent runs: each reads the
    shared prompt blocks and its own copied block (a copy without K/V would change the context-sensitive model's
    tokens)."""
    prompt = _prompt(10, seed=3)
    params = SamplingParams(max_new_tokens=8, seed=21, n=2)
    out = PagedGenerator(model, 16, 4).generate(prompt, params)
    assert out.num_cow_copies > 0
    for i in range(2):
        single = dataclasses.replace(params, n=1, seed=21 + i)
        assert out.token_ids[i] == generate_ids(model, prompt, single), i


def test_prefix_cache_never_reuses_a_block_computed_after_another_prefix(model):
    """Block [1, 2, 3, 4] cached as the SECOND block of one prompt must not serve as the FIRST block of another:
    its K/V were computed at other positions after other tokens. The chained hash (parent included) keeps them
    apart; a hash without the parent hands the wrong K/V over and changes the tokens."""
    gen = PagedGenerator(model, 32, 4, enable_prefix_caching=True)
    gen.generate([5, 6, 7, 8, 1, 2, 3, 4, 9], SamplingParams.greedy(4))
    prompt = [1, 2, 3, 4, 9, 10]
    out = gen.generate(prompt, SamplingParams.greedy(8))
    assert out.num_cached_tokens == 0
    assert out.token_ids[0] == generate_ids(model, prompt, SamplingParams.greedy(8))


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-4, ValueError), (2.5, TypeError), (True, TypeError)])
def test_paged_generate_names_a_bad_block_size(model, bad, error):
    # block_size sizes the default pool by division: a 0 used to raise ZeroDivisionError from deep inside
    with pytest.raises(error, match="block_size"):
        paged_generate(model, [1, 2, 3], SamplingParams.greedy(4), block_size=bad)

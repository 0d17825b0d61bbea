"""Chapter 06: parallel sampling (`SamplingParams.n > 1`) in the continuous-batching engine.

Sample i of a request seeded s draws from a generator seeded s + i, so its tokens must be exactly chapter 05's
`paged_generate` sample i, and exactly an independent n = 1 request seeded s + i, whatever the engine does around
it: a shared prompt (fork + copy-on-write), preemption by recomputation or swapping, prefix caching, a full batch.
Every test checks the scheduler's and block manager's invariants after every step and ends with the pool free.
"""

from __future__ import annotations

import dataclasses

import pytest

from helpers import EngineDriver, PoisonedParams, context_model
from minillm.core.model import GPT
from minillm.core.sampling import SamplingParams
from minillm.engine import LLM, EngineConfig, RequestStatus
from minillm.kvcache.generate import generate_ids
from minillm.paged.generate import paged_generate

VOCAB = 512
PROMPT = [5, 17, 99, 3, 8, 1, 2, 40, 41, 77]  # 10 tokens: two full blocks of 4 and a partial one (2 tokens)


@pytest.fixture(scope="module")
def model() -> GPT:
    # vocab 512, window 64, 2 layers; context-sensitive (tests/helpers.py), so a wrong shared block changes tokens
    return context_model("tiny", seed=1234)


def _sampled(max_new_tokens: int = 12, seed: int | None = 11, n: int = 3, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, top_k=20, seed=seed, n=n,
                          ignore_eos=True, **kw)


def _sample_alone(model, prompt, params: SamplingParams, index: int) -> list[int]:
    """Sample `index` of an n > 1 request, run as an independent n = 1 request seeded params.seed + index."""
    return generate_ids(model, prompt, dataclasses.replace(params, n=1, seed=params.seed + index))


class SampleDriver(EngineDriver):
    """`EngineDriver` keyed by (request_id, index): every sample's deltas, final ids and final output."""

    def step(self) -> None:
        for out in self.llm.step():
            key = (out.request_id, out.index)
            got = self.streamed.setdefault(key, [])
            got += out.new_token_ids
            assert out.output_token_ids == got  # the deltas add up to the sample's cumulative output
            if out.finished:
                assert key not in self.final, f"{key} finished twice"
                self.final[key] = out.output_token_ids
                self.outputs[key] = out
        self.llm.scheduler.check_invariants()
        self.llm.block_manager.check_invariants()
        self.after_step(self.llm.last_schedule)


def _run(llm: LLM, prompts, params) -> dict[tuple[str, int], list[int]]:
    d = SampleDriver(llm)
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    d.run()
    want = {(rid, i) for rid, sp in zip(ids, params) for i in range(sp.n)}
    assert set(d.final) == want, "a sample was lost or invented"
    return d.final


CONFIGS = {
    "roomy": EngineConfig(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=16),
    "prefix-caching": EngineConfig(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=8,
                                   enable_prefix_caching=True),
    "no-chunking": EngineConfig(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                                enable_chunked_prefill=False),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_seeded_samples_equal_chapter_05_and_separate_requests(model, name):
    params = _sampled()
    reference = paged_generate(model, PROMPT, params, block_size=4).token_ids  # chapter 05: prefill once, fork
    assert len({tuple(t) for t in reference}) == 3  # three different samples, or the test proves little
    llm = LLM(model, None, CONFIGS[name])
    got = _run(llm, [PROMPT], [params])
    assert [got[("req-0", i)] for i in range(3)] == reference
    separate = _run(llm, [PROMPT] * 3, [dataclasses.replace(params, n=1, seed=params.seed + i) for i in range(3)])
    assert [separate[(f"req-{1 + i}", 0)] for i in range(3)] == reference
    assert reference == [_sample_alone(model, PROMPT, params, i) for i in range(3)]


def test_greedy_samples_are_identical_to_one_greedy_request(model):
    llm = LLM(model, None, CONFIGS["roomy"])
    params = SamplingParams.greedy(10, ignore_eos=True, n=3)
    outs = llm.generate([PROMPT], params)
    one = llm.generate([PROMPT], dataclasses.replace(params, n=1))[0]
    assert [(o.request_id, o.index) for o in outs] == [(outs[0].request_id, i) for i in range(3)]
    assert [o.output_token_ids for o in outs] == [one.output_token_ids] * 3
    assert one.output_token_ids == generate_ids(model, PROMPT, dataclasses.replace(params, n=1))
    assert llm.block_manager.num_free_blocks == llm.config.num_blocks


def test_samples_share_the_prompt_blocks_then_copy_on_write(model):
    """The step that samples the first token forks: all three tables are sample 0's (ref count 3 each, nothing
    allocated); the next decode writes into the shared partial block, so two samples copy it (the last writer
    holds it alone and writes in place) while the two full blocks stay shared."""
    cfg = EngineConfig(num_blocks=32, block_size=4, max_num_seqs=8, max_num_batched_tokens=16)
    llm = LLM(model, None, cfg)
    bm = llm.block_manager
    assert llm.add_request(PROMPT, _sampled(8), request_id="r") == "r"
    assert llm.num_unfinished == 3 and llm.stats()["held"] == 2 and llm.has_unfinished()
    d = SampleDriver(llm)
    d.step()  # the whole prompt (10 <= budget 16): sample 0's first token, and the fork
    assert llm.num_held == 0 and [r.request_id for r in llm.scheduler.running] == ["r", "r#1", "r#2"]
    tables = [bm.block_table(rid) for rid in ("r", "r#1", "r#2")]
    assert tables[0] == tables[1] == tables[2] and len(tables[0]) == 3
    assert all(bm.allocator.ref_count(b) == 3 for b in tables[0])
    assert bm.num_free_blocks == cfg.num_blocks - 3  # shared, not copied
    assert sorted(d.streamed) == [("r", 0), ("r", 1), ("r", 2)] and all(len(v) == 1 for v in d.streamed.values())
    for r in llm.scheduler.running:
        assert r.num_computed_tokens == r.num_block_tokens == len(PROMPT) and len(r.output_token_ids) == 1
    d.step()  # first decode of each sample: copy-on-write of the partial third block
    assert len(llm.last_schedule.cow_pairs) == 2
    tables = [bm.block_table(rid) for rid in ("r", "r#1", "r#2")]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]  # the full prompt blocks stay shared
    assert len({t[2] for t in tables}) == 3  # the partial one is private now
    assert all(bm.allocator.ref_count(b) == 3 for b in tables[0][:2])
    d.run()
    params = _sampled(8)
    assert [d.final[("r", i)] for i in range(3)] == [_sample_alone(model, PROMPT, params, i) for i in range(3)]
    assert bm.num_free_blocks == cfg.num_blocks


PREEMPTING = {
    # 2 requests x 3 samples, each up to 10 + 19 = 29 tokens (8 blocks): a pool of 14 blocks must preempt
    "recompute": EngineConfig(num_blocks=14, block_size=4, max_num_seqs=8, max_num_batched_tokens=16),
    "swap": EngineConfig(num_blocks=14, block_size=4, max_num_seqs=8, max_num_batched_tokens=16,
                         preemption_mode="swap", num_swap_blocks=16),
    "prefix-caching": EngineConfig(num_blocks=14, block_size=4, max_num_seqs=8, max_num_batched_tokens=8,
                                   enable_prefix_caching=True),
    # a batch limit below the samples: forks that do not fit wait at the head of `waiting` and recompute
    "batch-limit-2": EngineConfig(num_blocks=32, block_size=4, max_num_seqs=2, max_num_batched_tokens=16),
    "batch-limit-1": EngineConfig(num_blocks=32, block_size=4, max_num_seqs=1, max_num_batched_tokens=16),
}


@pytest.mark.parametrize("name", list(PREEMPTING))
def test_preemption_and_a_full_batch_keep_every_sample_exact(model, name):
    cfg = PREEMPTING[name]
    prompts = [PROMPT, [7, 7, 3, 200, 11, 9]]
    params = [_sampled(20, seed=3), SamplingParams.greedy(20, ignore_eos=True, n=3)]
    llm = LLM(model, None, cfg)
    got = _run(llm, prompts, params)
    if not name.startswith("batch-limit"):
        assert llm.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    if name == "swap":
        assert llm.scheduler.num_swap_outs > 0
    for i in range(3):
        assert got[("req-0", i)] == _sample_alone(model, prompts[0], params[0], i), i
        assert got[("req-1", i)] == generate_ids(model, prompts[1], dataclasses.replace(params[1], n=1)), i
    assert llm.block_manager.num_free_blocks == cfg.num_blocks


def test_forks_beyond_the_batch_limit_wait_at_the_head_of_waiting(model):
    cfg = EngineConfig(num_blocks=32, block_size=4, max_num_seqs=2, max_num_batched_tokens=16)
    llm = LLM(model, None, cfg)
    llm.add_request(PROMPT, _sampled(6), request_id="r")
    llm.add_request([9, 9, 9], SamplingParams.greedy(6, ignore_eos=True), request_id="later")
    d = SampleDriver(llm)
    d.step()  # both prompts run (10 + 3 tokens <= 16); r forks, but the batch of 2 is full
    assert [r.request_id for r in llm.scheduler.running] == ["r", "later"]
    waiting = list(llm.scheduler.waiting)
    assert [r.request_id for r in waiting] == ["r#1", "r#2"]
    for r in waiting:  # as if preempted by recomputation at birth: no blocks, nothing computed, first token kept
        assert r.status is RequestStatus.WAITING and r.num_computed_tokens == r.num_block_tokens == 0
        assert len(r.output_token_ids) == 1 and not llm.block_manager.has_seq(r.request_id)
    d.run()
    params = _sampled(6)
    assert [d.final[("r", i)] for i in range(3)] == [_sample_alone(model, PROMPT, params, i) for i in range(3)]


@pytest.mark.parametrize("when", ["held", "running"])
def test_abort_the_user_id_aborts_every_sample_once(model, when):
    # budget 4: the 10-token prompt takes three steps, so the samples stay held for two
    cfg = EngineConfig(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=4)
    llm = LLM(model, None, cfg)
    llm.add_request(PROMPT, _sampled(20), request_id="r")
    other = llm.add_request([3, 4, 5], SamplingParams.greedy(6, ignore_eos=True))
    d = SampleDriver(llm)
    d.step()
    if when == "running":
        for _ in range(5):
            d.step()
        assert llm.num_held == 0 and {r.request_id for r in llm.scheduler.running} >= {"r", "r#1", "r#2"}
    else:
        assert llm.num_held == 2
    assert not llm.abort("r#1")  # an internal id is not the user's to abort
    assert llm.abort("r")
    assert not llm.abort("r")
    assert llm.num_held == 0
    d.run()
    params = _sampled(20)
    for i in range(3):
        out = d.outputs[("r", i)]
        assert out.finished and out.finish_reason == "abort" and out.index == i
        got = out.output_token_ids
        assert (got == []) if when == "held" else (0 < len(got) < 20)
        assert got == _sample_alone(model, PROMPT, params, i)[: len(got)]
    assert d.final[(other, 0)] == generate_ids(model, [3, 4, 5], SamplingParams.greedy(6, ignore_eos=True))
    assert llm.block_manager.num_free_blocks == cfg.num_blocks
    assert llm.add_request(PROMPT, _sampled(2), request_id="r") == "r"  # every sample done: the id is free again


def test_one_token_each_finishes_every_sample_at_the_fork(model):
    llm = LLM(model, None, CONFIGS["roomy"])
    params = _sampled(1)
    d = SampleDriver(llm)
    llm.add_request(PROMPT, params, request_id="r")
    d.step()
    assert not llm.has_unfinished() and len(d.final) == 3
    assert llm.block_manager.num_free_blocks == llm.config.num_blocks
    for i in range(3):
        assert d.outputs[("r", i)].finish_reason == "length"
        assert d.final[("r", i)] == _sample_alone(model, PROMPT, params, i)
    outs = llm.generate([PROMPT], dataclasses.replace(params, max_new_tokens=0))  # finished on arrival, each
    assert [(o.index, o.output_token_ids, o.finish_reason) for o in outs] == [(i, [], "length") for i in range(3)]


@pytest.mark.parametrize("which", [0, 1])
def test_eos_on_the_first_token_finishes_that_sample_only(model, which):
    """Sample `which` draws eos at the fork (eos_id is chosen as its first token); the others go on. With
    which = 0, sample 0 frees its blocks in that very step, and the others still hold the prompt's."""
    params = dataclasses.replace(_sampled(10), ignore_eos=False)
    firsts = [_sample_alone(model, PROMPT, params, i)[0] for i in range(3)]
    eos = firsts[which]
    assume_distinct = [f for i, f in enumerate(firsts) if i != which]
    assert eos not in assume_distinct, "pick another seed: two samples start with the same token"
    llm = LLM(model, None, CONFIGS["roomy"], eos_id=eos)
    d = SampleDriver(llm)
    llm.add_request(PROMPT, params, request_id="r")
    d.step()
    assert d.outputs[("r", which)].finish_reason == "eos" and d.final[("r", which)] == [eos]
    with pytest.raises(ValueError, match="already in use"):  # another sample still runs under "r"
        llm.add_request([1, 2], SamplingParams.greedy(2), request_id="r")
    d.run()
    for i in range(3):
        want = generate_ids(model, PROMPT, dataclasses.replace(params, n=1, seed=params.seed + i), eos_id=eos)
        assert d.final[("r", i)] == want, i


def test_sample_0_failing_before_the_fork_fails_every_held_sample(model):
    cfg = EngineConfig(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=4)
    llm = LLM(model, None, cfg)
    good = SamplingParams.greedy(5, ignore_eos=True)
    llm.add_request(PROMPT, PoisonedParams(max_new_tokens=8, temperature=0.0, n=3), request_id="bad")
    llm.add_request([1, 2, 3], good, request_id="good")
    d = SampleDriver(llm)
    d.run()
    for i in range(3):
        out = d.outputs[("bad", i)]
        assert out.finish_reason == "error" and out.output_token_ids == [] and "bad" in out.error
    assert d.final[("good", 0)] == generate_ids(model, [1, 2, 3], good)
    assert llm.block_manager.num_free_blocks == cfg.num_blocks


def test_streaming_outputs_carry_the_index_and_add_up(model):
    cfg = EngineConfig(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=4)
    llm = LLM(model, None, cfg)
    params = _sampled(7)
    llm.add_request(PROMPT, params, request_id="r")
    llm.add_request([4, 4], SamplingParams.greedy(5, ignore_eos=True), request_id="s")
    streamed: dict[tuple[str, int], list[int]] = {}
    finals: dict[tuple[str, int], list[int]] = {}
    while llm.has_unfinished():
        outs = llm.step()
        keys = [(o.request_id, o.index) for o in outs]
        assert len(keys) == len(set(keys)), "one output per sample and step"
        for o in outs:
            streamed.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
            if o.finished:
                finals[(o.request_id, o.index)] = o.output_token_ids
        llm.scheduler.check_invariants()
    assert sorted(finals) == [("r", 0), ("r", 1), ("r", 2), ("s", 0)]
    assert all(streamed[k] == finals[k] for k in finals)
    assert [finals[("r", i)] for i in range(3)] == [_sample_alone(model, PROMPT, params, i) for i in range(3)]


def test_generate_mixes_n_in_prompt_then_index_order(model):
    llm = LLM(model, None, CONFIGS["roomy"])
    prompts = [[3, 1, 4], PROMPT, [2, 7, 1, 8], [6, 6]]
    params = [SamplingParams.greedy(5, ignore_eos=True), _sampled(6, seed=5),
              _sampled(4, seed=9, n=2), _sampled(3, seed=1, n=1)]
    outs = llm.generate(prompts, params)
    order = [(o.request_id, o.index) for o in outs]
    assert order == [("req-0", 0), ("req-1", 0), ("req-1", 1), ("req-1", 2), ("req-2", 0), ("req-2", 1),
                     ("req-3", 0)]
    i = 0
    for p, sp in zip(prompts, params):
        for k in range(sp.n):
            want = generate_ids(model, p, dataclasses.replace(sp, n=1, seed=None if sp.seed is None else sp.seed + k))
            assert outs[i].output_token_ids == want and outs[i].prompt_token_ids == p, (i, k)
            i += 1
    assert not llm.has_unfinished() and llm.block_manager.num_free_blocks == llm.config.num_blocks


def test_sample_ids_cannot_collide(model):
    llm = LLM(model, None, CONFIGS["roomy"])
    llm.add_request(PROMPT, _sampled(4), request_id="r")
    with pytest.raises(ValueError, match="'r#1' is already in use"):
        llm.add_request([1], SamplingParams.greedy(2), request_id="r#1")
    llm.add_request([1], SamplingParams.greedy(2), request_id="x#2")
    with pytest.raises(ValueError, match="'x#2' is already in use"):  # x's third sample would be x#2
        llm.add_request([1], _sampled(2), request_id="x")
    llm.add_request([1], _sampled(2, n=2), request_id="x")  # x#1 is free
    auto = llm.add_request([1], SamplingParams.greedy(2, n=2))
    assert auto not in ("r", "x") and llm.num_unfinished == 3 + 1 + 2 + 2
    d = SampleDriver(llm)
    d.run()
    assert len(d.final) == 8


def test_engines_without_parallel_sampling_refuse_n(model):
    from minillm.speculative.engine import SpeculativeLLM

    spec = SpeculativeLLM(model, None, EngineConfig(num_blocks=32, block_size=4, attention_backend="verify"))
    with pytest.raises(ValueError, match="n=2"):
        spec.add_request([1, 2], SamplingParams.greedy(4, n=2))
    assert LLM.supports_parallel_sampling and not SpeculativeLLM.supports_parallel_sampling
    llm = LLM(model, None, CONFIGS["roomy"])
    with pytest.raises(ValueError, match="n=3"):  # its samples would need the prompt's logits
        llm.add_prefilled_request([1, 2], SamplingParams.greedy(4, n=3), 5, None)
    assert not llm.has_unfinished()

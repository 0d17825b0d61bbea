"""Chapter 14: parallelism. Every form proven equal to one process; collectives counted against the formula.

Ranks are real processes (gloo on loopback, spawned by `run_ranks` on chapter 06's process layer) with one torch
thread each; world size 4 oversubscribes this machine's two cores, which only costs time. No test here times anything.
"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import context_model

from minillm.core.formats import model_to_bytes
from minillm.core.sampling import SamplingParams
from minillm.engine import LLM, EngineConfig
from minillm.engine.process import WorkerDiedError
from minillm.parallel import Comm, collectives_per_forward, run_ranks, shard_model
from minillm.parallel.executor import TensorParallelExecutor
from minillm.parallel.tensor import all_reduce_bytes, ring_traffic_per_rank

VOCAB = 512


@pytest.fixture(scope="module")
def model():
    return context_model("tiny", seed=14, n_head=4)  # vocab 512, window 64, 2 layers, 4 heads: context-sensitive


def _idx(T: int = 12, B: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(3))


QKV = tuple(torch.randn(2, 3, 16, 8, generator=torch.Generator().manual_seed(4 + i)) for i in range(3))  # (B,nh,T,hs)
BUBBLE_M = 4  # micro-batches of the bubble experiment


@pytest.fixture(scope="module")
def ranks(model):
    """ranks(t): every rank's results of `process_roles.parallel_suite` for a group of t, run once per module (each
    spawn of t ranks costs seconds), then read by the tests below."""
    from process_roles import parallel_suite

    cache: dict[int, list[dict]] = {}

    def get(world_size: int) -> list[dict]:
        if world_size not in cache:
            cache[world_size] = run_ranks(parallel_suite, world_size, model_to_bytes(model), _idx(), _idx(T=9, B=4),
                                          QKV, BUBBLE_M)
        return cache[world_size]

    return get


def test_one_rank_shard_is_the_model_and_counts_the_formula(model):
    shard = shard_model(model, 0, 1)
    idx = _idx()
    with torch.no_grad():
        torch.testing.assert_close(shard(idx), model(idx), rtol=0, atol=0)
    L, C = model.config.n_layer, model.config.n_embd
    assert shard.comm.calls == collectives_per_forward(L)
    assert shard.comm.bytes["all_reduce"] == all_reduce_bytes(idx.numel(), C, L)
    assert shard.comm.bytes["all_gather"] == idx.numel() * VOCAB * 4  # the head's (B, T, V/t) message, t = 1


@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_logits_equal_one_process(model, ranks, world_size):
    idx = _idx()
    with torch.no_grad():
        want = model(idx)
    results = [r["tp"] for r in ranks(world_size)]
    L, C, nh = model.config.n_layer, model.config.n_embd, model.config.n_head
    for r, got in enumerate(results):
        torch.testing.assert_close(got["logits"], want, rtol=1e-5, atol=1e-5)  # fp32: only the sums' order differs
        assert got["calls"] == collectives_per_forward(L)
        assert got["bytes"]["all_reduce"] == all_reduce_bytes(idx.numel(), C, L)  # the message: T x C per call
        assert got["bytes"]["all_gather"] == idx.numel() * VOCAB // world_size * 4  # each rank's V/t logits
        assert got["n_head"] == nh // world_size  # its KV cache holds nh/t heads
    # Per-rank weights: the replicated parts (LayerNorms, wpe, the row-parallel biases) plus 1/t of the rest.
    total = sum(p.numel() for p in model.parameters())
    replicated = sum(p.numel() for n, p in model.named_parameters()
                     if "ln_" in n or "wpe" in n or n.endswith("c_proj.bias"))
    assert all(r["params"] == replicated + (total - replicated) // world_size for r in results)


def test_ring_all_reduce_traffic_formula():
    assert ring_traffic_per_rank(1000, 1) == 0
    assert ring_traffic_per_rank(1000, 2) == 1000
    assert ring_traffic_per_rank(1000, 4) == 1500


def test_sharding_refuses_what_does_not_divide(model):
    with pytest.raises(ValueError, match="does not divide n_head=4"):
        shard_model(model, 0, 3)
    with pytest.raises(ValueError, match="rank must be in"):
        shard_model(model, 2, 2)
    with pytest.raises(ValueError, match="positive int"):
        shard_model(model, 0, 0)
    with pytest.raises(TypeError, match="plain minillm GPT"):
        from minillm.quant.linear import QuantConfig, quantize_model
        shard_model(quantize_model(model, QuantConfig("int8")), 0, 2)
    assert isinstance(Comm().calls, dict)


def test_a_rank_that_raises_fails_the_run_naming_it():
    from process_roles import fails_on_rank_one

    with pytest.raises(WorkerDiedError, match="rank1 worker raised(.|\n)*rank one refuses"):
        run_ranks(fails_on_rank_one, 2, timeout_s=120)


# ----- tensor parallelism inside chapter 06's engine --------------------------------------------------------------


class TP2LLM(LLM):
    runner_cls = functools.partial(TensorParallelExecutor, tensor_parallel_size=2)


def test_the_engine_on_two_ranks_gives_the_one_process_tokens(model):
    cfg = EngineConfig(num_blocks=14, block_size=4, max_num_seqs=6, max_num_batched_tokens=32,
                       preemption_mode="swap", num_swap_blocks=32)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(1, VOCAB, (int(n),), generator=g).tolist() for n in torch.randint(3, 20, (6,))]
    params = [SamplingParams.greedy(12, ignore_eos=True) if i % 2 else
              SamplingParams(max_new_tokens=12, temperature=0.8, seed=i, ignore_eos=True) for i in range(6)]
    here = LLM(model, None, cfg)
    want = [o.output_token_ids for o in here.generate(prompts, params)]
    tp = TP2LLM(model, None, cfg)
    try:
        assert [o.output_token_ids for o in tp.generate(prompts, params)] == want
        assert tp.stats()["num_preemptions"] == here.stats()["num_preemptions"] > 0
        calls = tp.runner.comm.calls
        assert calls["all_gather"] == tp.runner.num_forward_calls  # one head all-gather per forward
        assert calls["all_reduce"] == (1 + 2 * model.config.n_layer) * tp.runner.num_forward_calls
        assert tp.runner.runner.cache.k_pools[0].shape[2] == model.config.n_head // 2  # nh/t heads per rank
        c = model.config  # the pool per rank: 2 (K, V) x L x nb x bs x nh/t x hs x 4 bytes
        cache = tp.runner.runner.cache
        pool = sum(t.numel() * t.element_size() for t in cache.k_pools + cache.v_pools)
        assert pool == 2 * c.n_layer * cfg.num_blocks * cfg.block_size * (c.n_head // 2) * c.head_size * 4
    finally:
        tp.runner.close()
    assert tp.runner.closed and not any(h.process.is_alive() for h in tp.runner._handles)


@pytest.mark.parametrize("world_size", [2, 4])
def test_pytorch_parallelize_module_plan_equals_the_hand_written_shards(model, ranks, world_size):
    idx = _idx()
    with torch.no_grad():
        want = model(idx)
    for r in (r["library"] for r in ranks(world_size)):
        torch.testing.assert_close(r["library"], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["library"], r["hand"], rtol=1e-5, atol=1e-5)
        # CommDebugMode counts the library's collectives: the same as the hand-written shards' (its all-gather
        # is called all_gather_into_tensor)
        assert r["counts"] == {"all_reduce": r["hand_calls"]["all_reduce"], "all_gather_into_tensor": 1}
        assert r["hand_calls"] == collectives_per_forward(model.config.n_layer)


# ----- pipeline parallelism -----------------------------------------------------------------------------------------


def test_stage_layers_split_evenly():
    from minillm.parallel.pipeline import stage_layers

    assert stage_layers(12, 4) == [range(0, 3), range(3, 6), range(6, 9), range(9, 12)]
    assert stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    with pytest.raises(ValueError, match="n_layer=2"):
        stage_layers(2, 3)


def test_pipeline_logits_equal_one_process(model, ranks):
    idx = _idx(T=9, B=4)
    with torch.no_grad():
        want = model(idx)
    results = [r["pp"] for r in ranks(2)]  # two stages of one block each, two micro-batches of two sequences
    torch.testing.assert_close(results[-1]["logits"], want, rtol=1e-5, atol=1e-5)
    assert [r["layers"] for r in results] == [[0], [1]]
    # PyTorch's ScheduleGPipe over the same stages gives the same logits
    torch.testing.assert_close(ranks(2)[-1]["pp_library"], want, rtol=1e-5, atol=1e-5)
    # the schedule: stage 1 starts micro-batch 0 only after stage 0 finished it
    e0, e1 = results[0]["events"], results[1]["events"]
    assert e1[0].start >= e0[0].end


@pytest.mark.parametrize("p", [2, 4])
def test_the_measured_bubble_follows_the_formula(ranks, p):
    """Each step a fixed 50 ms sleep (known work; sleeping ranks need no core): the idle share is (p-1)/(m+p-1)."""
    from minillm.parallel.pipeline import bubble_fraction, measured_bubble

    m = BUBBLE_M
    events = [e for r in ranks(p) for e in r["bubble"]]
    assert len(events) == p * m
    assert abs(measured_bubble(events, p) - bubble_fraction(p, m)) < 0.08  # sends and wake-ups add a little


# ----- sequence and context parallelism ---------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 4])
def test_sequence_parallel_equals_one_process_and_moves_the_all_reduce_bytes(model, ranks, world_size):
    from minillm.parallel.tensor import ring_traffic_per_rank

    idx = _idx()
    with torch.no_grad():
        want = model(idx)
    L = model.config.n_layer
    message = idx.numel() * model.config.n_embd * 4  # one all-reduce's (B, T, C) fp32 message
    for r in (r["sp"] for r in ranks(world_size)):
        torch.testing.assert_close(r["logits"], want, rtol=1e-5, atol=1e-5)
        # every all-reduce became a reduce-scatter (the embedding, 2 per layer), plus an all-gather after each of
        # the 2 L LayerNorms and ln_f
        assert r["calls"] == {"reduce_scatter_seq": 1 + 2 * L, "all_gather_seq": 2 * L + 1, "all_gather": 1}
        # ring traffic per rank: a reduce-scatter sends (t-1)/t of its input, an all-gather (t-1) times its input;
        # the pair per layer moves what the all-reduce moved: 2 (t-1)/t of the message
        t = world_size
        rs = r["bytes"]["reduce_scatter_seq"] * (t - 1) / t
        ag = r["bytes"]["all_gather_seq"] * (t - 1)
        assert rs + ag == pytest.approx(ring_traffic_per_rank(message, t) * (2 * L + 1))


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_attention_equals_full_causal_attention(ranks, world_size):
    from minillm.core.attention import attention

    want = attention(*QKV, is_causal=True)
    got = torch.cat([r["ring"] for r in ranks(world_size)], dim=2)  # each rank's chunk of the sequence
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_merge_of_partial_attentions_is_exact_and_handles_an_empty_part():
    from minillm.parallel.context import block_attention, merge_attention

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    whole, lse = block_attention(q, k, v, causal=False)
    a, la = block_attention(q, k[:, :, :1], v[:, :, :1], causal=False)
    b, lb = block_attention(q, k[:, :, 1:], v[:, :, 1:], causal=False)
    o, l2 = merge_attention(a, la, b, lb)
    torch.testing.assert_close(o, whole)
    torch.testing.assert_close(l2, lse)
    empty = torch.full_like(la, float("-inf"))
    o, _ = merge_attention(torch.zeros_like(a), empty, a, la)  # nothing seen yet, then a block
    torch.testing.assert_close(o, a)


def test_a_rank_killed_mid_run_is_an_error_naming_it_not_a_hang(model):
    import os
    import signal
    import time

    cfg = EngineConfig(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
    tp = TP2LLM(model, None, cfg)
    try:
        assert tp.generate([[1, 2, 3]], SamplingParams.greedy(3))[0].finish_reason == "length"
        os.kill(tp.runner._handles[0].process.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="rank1 worker .* killed by signal 9"):
            tp.generate([[4, 5, 6]], SamplingParams.greedy(3))
        assert time.monotonic() - start < 60
        assert tp.runner.closed
    finally:
        tp.runner.close()
    assert not any(h.process.is_alive() for h in tp.runner._handles)


def test_engine_config_tensor_parallel_size_runs_the_engine_on_ranks(model):
    """The user's way: EngineConfig(tensor_parallel_size=2), nothing else changes; `with` stops the ranks."""
    params = SamplingParams.greedy(8, ignore_eos=True)
    cfg = dict(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, enable_prefix_caching=True)
    want = LLM(model, None, EngineConfig(**cfg)).generate([[1, 2, 3, 4, 5], [1, 2, 3, 4, 9]], params)
    with LLM(model, None, EngineConfig(**cfg, tensor_parallel_size=2)) as tp:
        assert isinstance(tp.runner, TensorParallelExecutor)
        got = tp.generate([[1, 2, 3, 4, 5], [1, 2, 3, 4, 9]], params)
        assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
        with pytest.raises(ValueError, match="does not take prefilled requests"):
            tp.add_prefilled_request([1, 2, 3], params, 7, torch.zeros(2, 2, 3, 4, 8))
    assert tp.runner.closed
    with pytest.raises(ValueError, match="does not divide n_head=4"):
        LLM(model, None, EngineConfig(tensor_parallel_size=3))
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)


def test_pipelined_decode_of_sequences_in_flight_gives_each_its_own_greedy_tokens(model, ranks):
    from minillm.kvcache.generate import generate_ids

    prompts = _idx(T=9, B=4).tolist()
    results = ranks(2)
    want = [generate_ids(model, p, SamplingParams.greedy(6, ignore_eos=True)) for p in prompts]
    assert results[0]["pp_decode"]["tokens"] == want
    # in flight: stage 1 works on a sequence while stage 0 already runs the next one
    e0, e1 = results[0]["pp_decode"]["events"], results[1]["pp_decode"]["events"]
    assert len(e0) == len(e1) == 4 * 6


def test_the_trained_base_on_two_ranks_gives_hugging_face_s_greedy_tokens():
    """The shipped `base` model (8 heads, vocabulary 4096) through the tensor-parallel engine on 2 ranks, against
    Hugging Face's generate on the same weights and against the engine in one process."""
    pytest.importorskip("transformers")
    from minillm.bench.models import load_model
    from minillm.core.hf import to_hf_model

    loaded = load_model("base")
    if not loaded.trained:
        pytest.skip("the shipped base checkpoint is missing")
    model, tok = loaded.model, loaded.tokenizer
    prompts = [tok.encode(t) for t in ("def main(", "The quick brown", "import os\nimport sys\n")]
    params = SamplingParams.greedy(12, ignore_eos=True)
    hf = to_hf_model(model)
    want = []
    for p in prompts:
        ids = torch.tensor([p])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                          do_sample=False, pad_token_id=0, eos_token_id=None)
        want.append(out[0, len(p):].tolist())
    here = [o.output_token_ids for o in LLM(model, tok, EngineConfig(num_blocks=64)).generate(prompts, params)]
    with LLM(model, tok, EngineConfig(num_blocks=64, tensor_parallel_size=2)) as tp:
        got = [o.output_token_ids for o in tp.generate(prompts, params)]
    assert got == here == want


class ShortTimeoutTP2LLM(LLM):
    runner_cls = functools.partial(TensorParallelExecutor, tensor_parallel_size=2, timeout_s=3.0)


def test_an_idle_tensor_parallel_engine_outlives_the_group_timeout(model):
    """Steps reach the ranks on the process layer's pipes, so a rank waiting for its next step is in no collective:
    an engine idle for longer than the group's timeout (a server between requests) still works."""
    import time

    params = SamplingParams.greedy(4, ignore_eos=True)
    with ShortTimeoutTP2LLM(model, None, EngineConfig(num_blocks=32, block_size=4)) as tp:
        first = tp.generate([[1, 2, 3]], params)[0].output_token_ids
        time.sleep(5.0)  # longer than the group's 3 s timeout
        assert tp.generate([[1, 2, 3]], params)[0].output_token_ids == first

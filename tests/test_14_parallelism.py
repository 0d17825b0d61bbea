"""Chapter 14: parallelism. Every form proven equal to one process; collectives counted against the formula.

Ranks are real processes (gloo on loopback, spawned by `run_ranks` on chapter 06's process layer) with one torch
thread each; world size 4 oversubscribes this machine's two cores, which only costs time. No test here times anything.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import context_model

from minillm.core.formats import model_to_bytes
from minillm.core.sampling import SamplingParams
from minillm.engine import LLM, EngineConfig
from minillm.engine.process import WorkerDiedError
from minillm.parallel import Comm, collectives_per_forward, run_ranks, shard_model
from minillm.parallel.bench import quotes
from minillm.parallel.checks import parallel_suite
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
# Each stage step of it sleeps this long: 100 ms, so the handoffs (a send, a wake-up on a loaded machine: 0.086 over
# the formula once in CI at 50 ms) stay a small share of the makespan.
BUBBLE_WORK_S = 0.1


@pytest.fixture(scope="module")
def ranks(model):
    """ranks(t): every rank's results of `parallel_suite` for a group of t, run once per module (each spawn of t
    ranks costs seconds), then read by the tests below."""
    cache: dict[int, list[dict]] = {}

    def get(world_size: int) -> list[dict]:
        if world_size not in cache:
            cache[world_size] = run_ranks(parallel_suite, world_size, model_to_bytes(model), _idx(), _idx(T=9, B=4),
                                          QKV, BUBBLE_M, BUBBLE_WORK_S)
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


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")
def test_ranks_listen_on_loopback_only():
    """The store (rank 0) and gloo's connections (every rank) accept connections from this machine only."""
    from process_roles import listening_addresses

    loopback = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1 as /proc/net/tcp writes them
    found = run_ranks(listening_addresses, 2, timeout_s=120)
    assert found[0], "rank 0 hosts the store: it must listen somewhere"
    for rank, addresses in enumerate(found):
        assert set(addresses) <= loopback, (rank, addresses)


def test_the_torchrun_entry_point_gives_the_one_process_tokens():
    """What `torchrun -m minillm.parallel.generate` runs on each rank, here on ranks of run_ranks; without
    torchrun's environment the command says how to launch it."""
    from minillm.parallel.generate import generate_on_rank, main

    out = run_ranks(generate_on_rank, 2, "base", "def main(", 6, "cpu", True, timeout_s=120)
    assert out[0]["tokens"] == out[1]["tokens"] == out[0]["one_process"]
    assert out[0]["heads_per_rank"] == 4  # base: 8 heads, 4 on each rank
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        assert key not in os.environ
    with pytest.raises(SystemExit, match="launch with torchrun"):
        main(["--max-new-tokens", "2"])
    with pytest.raises(SystemExit, match="max-new-tokens must be >= 1"):
        main(["--max-new-tokens", "0"])


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
    """Each step a fixed 100 ms sleep (known work; sleeping ranks need no core): the idle share is (p-1)/(m+p-1)."""
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


def test_the_committed_results_give_every_number_chapter_14_quotes():
    """Each table and value the chapter text takes from chapters/results/14-parallel.json is one of `quotes`, and
    the command that wrote it is the one the text shows."""
    root = Path(__file__).resolve().parent.parent
    results = "chapters/results/14-parallel.json"
    text = (root / "chapters/14-parallelism.md").read_text(encoding="utf-8")
    names = set(re.findall(re.escape(results) + r"::([\w.]+) -->", text))
    assert {"decode", "pipeline", "links", "bubble_p2", "bubble_p4"} <= names
    report = json.loads((root / results).read_text(encoding="utf-8"))
    assert report["bench"] == "minillm.parallel.bench" and report["command"] in text
    pieces = quotes(report)
    assert names <= set(pieces)
    assert pieces["decode"].count("\n") == 2 + len(report["rows"]) and pieces["links"].count("\n") == 6


# ----- graded exercises: single-process, so `minillm grade 14` needs no ranks ------------------------------------


class ThreadRanks:
    """t ranks as t threads of this process, for the exercises: `all_reduce(rank, y)` returns the sum of every
    rank's y. `in_place=True` also writes it into y, as torch.distributed's all_reduce does; False returns a new
    tensor and leaves NaN in y, as a reduce that is not in place (the sequence-parallel reduce-scatter) leaves y
    useless: code that ignores what reduce returns fails then. A rank that never calls it makes the others fail
    after 10 s (a broken barrier), never hang."""

    def __init__(self, t: int, in_place: bool = True):
        self.t, self.parts, self.in_place = t, [None] * t, in_place
        self.barrier = threading.Barrier(t, timeout=10)

    def all_reduce(self, rank: int, y: torch.Tensor) -> torch.Tensor:
        self.parts[rank] = y.clone()
        self.barrier.wait()
        total = torch.stack(self.parts).sum(0)
        self.barrier.wait()  # everyone has read every part before the next call overwrites one
        if self.in_place:
            return y.copy_(total)
        y.fill_(float("nan"))
        return total

    def run(self, fn):
        """fn(rank) on every rank at once; the results in rank order."""
        with ThreadPoolExecutor(self.t) as pool:
            return list(pool.map(fn, range(self.t)))


SPLITS = [(8, 6, 1), (8, 6, 2), (12, 8, 4), (6, 10, 2), (4, 4, 4)]  # (out_features, in_features, t)


@pytest.mark.graded(points=3, exercise=("column_split", "row_split"))
@pytest.mark.parametrize("out_features,in_features,t", SPLITS)
@pytest.mark.parametrize("bias", [True, False])
def test_column_and_row_shards_rebuild_the_linear(out_features, in_features, t, bias):
    from minillm.parallel.tensor import column_split, row_split

    g = torch.Generator().manual_seed(out_features * 10 + t)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    x = torch.randn(3, 5, in_features, generator=g)
    want = torch.nn.functional.linear(x, w, b)
    # column parallel: each rank computes its slice of the output features; side by side in rank order they are y
    cols = [column_split(w, b, r, t) for r in range(t)]
    for w_r, b_r in cols:
        assert w_r.shape == (out_features // t, in_features)
        assert (b_r is None) == (b is None) and (b_r is None or b_r.shape == (out_features // t,))
    torch.testing.assert_close(torch.cat([torch.nn.functional.linear(x, w_r, b_r) for w_r, b_r in cols], -1), want)
    # row parallel: rank r multiplies its slice of the input features; the partial sums add up to y (bias once)
    k = in_features // t
    rows = [row_split(w, r, t) for r in range(t)]
    assert all(w_r.shape == (out_features, k) for w_r in rows)
    partial = sum(torch.nn.functional.linear(x[..., r * k:(r + 1) * k], w_r) for r, w_r in enumerate(rows))
    torch.testing.assert_close(partial if b is None else partial + b, want)
    assert w.shape == (out_features, in_features)  # the full weight is left as it was


@pytest.mark.graded(points=2, exercise="row_parallel_forward")
@pytest.mark.parametrize("t", [1, 2, 4])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("in_place", [True, False])
def test_row_parallel_forward_sums_over_the_ranks_then_adds_the_bias_once(t, bias, in_place):
    from minillm.parallel.tensor import row_parallel_forward

    g = torch.Generator().manual_seed(t)
    w = torch.randn(6, 8, generator=g)
    b = torch.randn(6, generator=g) + 3.0 if bias else None  # a large bias: counted t times, it shows
    x = torch.randn(2, 3, 8, generator=g)
    k = 8 // t
    group = ThreadRanks(t, in_place)

    def rank_fn(r):
        return row_parallel_forward(x[..., r * k:(r + 1) * k], w[:, r * k:(r + 1) * k].clone(), b,
                                    lambda y: group.all_reduce(r, y))

    for y in group.run(rank_fn):  # every rank holds the whole output
        torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b))


@pytest.mark.graded(points=1, exercise="row_parallel_forward")
def test_a_two_layer_mlp_needs_one_all_reduce_at_the_end():
    """Megatron's MLP: column-parallel c_fc, GELU on each rank's own neurons, row-parallel c_proj, one sum."""
    from minillm.parallel.tensor import row_parallel_forward

    g = torch.Generator().manual_seed(7)
    C, t = 8, 2
    fc_w, fc_b, proj_w, proj_b = (torch.randn(4 * C, C, generator=g), torch.randn(4 * C, generator=g),
                                  torch.randn(C, 4 * C, generator=g), torch.randn(C, generator=g))
    x = torch.randn(3, C, generator=g)
    F = torch.nn.functional
    want = F.linear(F.gelu(F.linear(x, fc_w, fc_b)), proj_w, proj_b)
    group, n = ThreadRanks(t), 4 * C // t
    calls = [0] * t

    def rank_fn(r):
        def reduce(y):
            calls[r] += 1
            return group.all_reduce(r, y)
        h = F.gelu(F.linear(x, fc_w[r * n:(r + 1) * n], fc_b[r * n:(r + 1) * n]))  # (3, 4C/t): no communication
        return row_parallel_forward(h, proj_w[:, r * n:(r + 1) * n], proj_b, reduce)

    for y in group.run(rank_fn):
        torch.testing.assert_close(y, want)
    assert calls == [1] * t


def _attend(q, k, v):
    """Reference attention without a mask: (output, lse)."""
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


@pytest.mark.graded(points=3, exercise="merge_attention")
@pytest.mark.parametrize("cuts", [(1,), (3,), (1, 2), (2, 5, 6)])
@pytest.mark.parametrize("scale", [1.0, 40.0])  # 40: scores in the thousands, exp of them overflows
def test_merging_partial_attentions_gives_attention_over_all_keys(cuts, scale):
    from minillm.parallel.context import merge_attention

    g = torch.Generator().manual_seed(len(cuts))
    q = scale * torch.randn(2, 3, 4, 8, generator=g)
    k, v = torch.randn(2, 3, 7, 8, generator=g), torch.randn(2, 3, 7, 8, generator=g)
    want, want_lse = _attend(q, k, v)
    bounds = (0, *cuts, 7)
    o, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"))  # nothing seen yet: an empty part
    for lo, hi in zip(bounds, bounds[1:]):  # the blocks in order, as a rank meets them around the ring
        o, lse = merge_attention(o, lse, *_attend(q, k[:, :, lo:hi], v[:, :, lo:hi]))
    assert torch.isfinite(o).all()
    torch.testing.assert_close(o, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-4, atol=1e-4)


@pytest.mark.graded(points=1, exercise="merge_attention")
def test_merging_parts_empty_for_some_queries_only():
    """Causal blocks leave some queries with no key in a part (lse -inf on those rows only): each row on its own."""
    from minillm.parallel.context import merge_attention

    g = torch.Generator().manual_seed(9)
    o_a, o_b = torch.randn(1, 2, 4, 8, generator=g), torch.randn(1, 2, 4, 8, generator=g)
    lse_a, lse_b = torch.randn(1, 2, 4, generator=g), torch.randn(1, 2, 4, generator=g)
    lse_a[..., 0] = float("-inf")  # row 0: only b saw keys
    lse_b[..., 1] = float("-inf")  # row 1: only a did
    lse_a[..., 3] = lse_b[..., 3] = float("-inf")  # row 3: neither
    o, lse = merge_attention(o_a, lse_a, o_b, lse_b)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(o[..., 0, :], o_b[..., 0, :])
    torch.testing.assert_close(o[..., 1, :], o_a[..., 1, :])
    torch.testing.assert_close(lse[..., :2], torch.stack([lse_b[..., 0], lse_a[..., 1]], -1))
    w = torch.softmax(torch.stack([lse_a[..., 2], lse_b[..., 2]]), 0)  # row 2: both, by their denominators
    torch.testing.assert_close(o[..., 2, :], w[0, ..., None] * o_a[..., 2, :] + w[1, ..., None] * o_b[..., 2, :])
    assert torch.isneginf(lse[..., 3]).all() and torch.equal(o[..., 3, :], torch.zeros_like(o[..., 3, :]))


@pytest.mark.graded(points=1, exercise="merge_attention")
def test_merging_is_symmetric_and_an_empty_part_changes_nothing():
    from minillm.parallel.context import block_attention, merge_attention

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    a, la = block_attention(q, k[:, :, :1], v[:, :, :1], causal=False)
    b, lb = block_attention(q, k[:, :, 1:], v[:, :, 1:], causal=False)
    ab, l_ab = merge_attention(a, la, b, lb)
    ba, l_ba = merge_attention(b, lb, a, la)
    torch.testing.assert_close(ab, ba)
    torch.testing.assert_close(l_ab, l_ba)
    empty = torch.full_like(la, float("-inf"))
    for o, lse in (merge_attention(torch.zeros_like(a), empty, a, la), merge_attention(a, la, torch.zeros_like(a),
                                                                                      empty)):
        torch.testing.assert_close(o, a)
        torch.testing.assert_close(lse, la)
    both, l_both = merge_attention(torch.zeros_like(a), empty, torch.zeros_like(a), empty)
    assert torch.equal(both, torch.zeros_like(a)) and torch.isneginf(l_both).all()  # nothing seen: no NaN


def test_splits_refuse_what_does_not_divide():
    from minillm.parallel.tensor import column_split, row_split

    w = torch.zeros(6, 4)
    with pytest.raises(ValueError, match="out_features=6"):
        column_split(w, None, 0, 4)
    with pytest.raises(ValueError, match="in_features=4"):
        row_split(w, 0, 3)
    with pytest.raises(ValueError, match="rank must be in"):
        row_split(w, 2, 2)
    with pytest.raises(ValueError, match="positive int"):
        column_split(w, None, 0, 0)

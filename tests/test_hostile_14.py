"""Chapter 14 (parallelism) against a hostile user: every public entry point that runs in one process fed wrong
types, bool for int, NaN/inf, empty tensors, out-of-range numbers and mismatched shapes. Each must raise ValueError
or TypeError from minillm's own code, its message naming the argument, or give the right answer (checked here
against one process). Entry points that start ranks are checked before any rank starts, so no case spawns one.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_refused_by_minillm

from minillm import GPT, GPTConfig
from minillm.engine import EngineConfig
from minillm.parallel.bench import link_estimate
from minillm.parallel.bench import main as bench_main
from minillm.parallel.checks import ring_forward
from minillm.parallel.context import block_attention, merge_attention, ring_attention
from minillm.parallel.group import init_rank, run_ranks
from minillm.parallel.pipeline import (PipelineStage, StageEvent, bubble_fraction, measured_bubble, pipelined_decode,
                                      run_gpipe, stage_layers)
from minillm.parallel.plots import plot_timeline
from minillm.parallel.tensor import (Comm, all_reduce_bytes, collectives_per_forward, column_split, ring_traffic_per_rank,
                                    row_parallel_forward, row_split, sequence_parallel_logits, shard_model)

TINY = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)).eval()
W = torch.randn(6, 4)
Q = torch.randn(1, 2, 3, 8)
O, LSE = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3)
NAN = float("nan")


def _events(p: int = 2) -> list[StageEvent]:
    return [StageEvent(s, j, s + j, s + j + 1.0) for s in range(p) for j in range(2)]


def _nested():
    def inner(rank, world_size):
        return rank
    return inner


def _module_level(rank, world_size):  # a valid rank function, never reached: every case fails before a spawn
    return rank


BAD = [
    # the splits
    ("column_split-int-weight", lambda: column_split(torch.ones(4, 4, dtype=torch.int64), None, 0, 2), TypeError,
     "weight"),
    ("column_split-1d-weight", lambda: column_split(torch.ones(4), None, 0, 2), ValueError, "weight"),
    ("column_split-list-weight", lambda: column_split([[1.0, 2.0]], None, 0, 1), TypeError, "weight"),
    ("column_split-bias-shape", lambda: column_split(W, torch.ones(5), 0, 2), ValueError, "bias"),
    ("column_split-bool-t", lambda: column_split(W, None, 0, True), ValueError, r"\bt\b"),
    ("column_split-float-rank", lambda: column_split(W, None, 0.0, 2), ValueError, "rank"),
    ("column_split-negative-rank", lambda: column_split(W, None, -1, 2), ValueError, "rank"),
    ("column_split-indivisible", lambda: column_split(W, None, 0, 4), ValueError, "out_features=6"),
    ("row_split-1d-weight", lambda: row_split(torch.ones(4), 0, 2), ValueError, "weight"),
    ("row_split-indivisible", lambda: row_split(W, 0, 3), ValueError, "in_features=4"),
    ("row_split-rank-too-big", lambda: row_split(W, 2, 2), ValueError, "rank"),
    ("row_split-str-t", lambda: row_split(W, 0, "2"), ValueError, r"\bt\b"),
    ("row_parallel_forward-not-callable", lambda: row_parallel_forward(torch.ones(2, 2), W[:, :2], None, 3), TypeError,
     "reduce"),
    ("row_parallel_forward-shape", lambda: row_parallel_forward(torch.ones(2, 3), W[:, :2], None, lambda y: y),
     ValueError, r"\bx\b"),
    ("row_parallel_forward-bias-shape", lambda: row_parallel_forward(torch.ones(2, 2), W[:, :2], torch.ones(4),
                                                                     lambda y: y), ValueError, "bias"),
    # shard_model
    ("shard_model-not-a-model", lambda: shard_model("base", 0, 2), TypeError, "model"),
    ("shard_model-bool-t", lambda: shard_model(TINY, 0, True), ValueError, "positive int"),
    ("shard_model-t-too-big", lambda: shard_model(TINY, 0, 4), ValueError, "n_head=2"),
    ("shard_model-float-rank", lambda: shard_model(TINY, 0.5, 2), ValueError, "rank"),
    # attention pieces
    ("block_attention-3d-q", lambda: block_attention(torch.ones(2, 3, 8), torch.ones(2, 3, 8), torch.ones(2, 3, 8),
                                                     False), ValueError, r"\bq\b"),
    ("block_attention-head-size", lambda: block_attention(Q, torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4), False),
     ValueError, r"\bk\b"),
    ("block_attention-causal-not-square", lambda: block_attention(Q, torch.ones(1, 2, 5, 8), torch.ones(1, 2, 5, 8),
                                                                  True), ValueError, "causal"),
    ("block_attention-kv-length", lambda: block_attention(Q, torch.ones(1, 2, 3, 8), torch.ones(1, 2, 4, 8), False),
     ValueError, r"\bv\b"),
    ("block_attention-int", lambda: block_attention(Q.long(), Q.long(), Q.long(), False), TypeError, r"\bq\b"),
    ("block_attention-causal-int", lambda: block_attention(Q, Q, Q, 1), TypeError, "causal"),
    ("merge_attention-lse-shape", lambda: merge_attention(O, LSE, O, torch.randn(1, 2, 4)), ValueError, "lse_b"),
    ("merge_attention-o-shape", lambda: merge_attention(O, LSE, torch.randn(1, 2, 3, 4), LSE), ValueError, "o_b"),
    ("merge_attention-nan-lse", lambda: merge_attention(O, LSE, O, torch.full_like(LSE, NAN)), ValueError, "lse_b"),
    ("merge_attention-plus-inf-lse", lambda: merge_attention(O, LSE, O, torch.full_like(LSE, math.inf)), ValueError,
     "lse_b"),
    ("ring_attention-shape", lambda: ring_attention(Q, torch.ones(1, 2, 4, 8), torch.ones(1, 2, 4, 8)), ValueError,
     r"\bk\b"),
    ("sequence_parallel_logits-plain-shard", lambda: sequence_parallel_logits(shard_model(TINY, 0, 1),
                                                                              torch.zeros(1, 4, dtype=torch.long)),
     ValueError, "sequence_parallel=True"),
    ("sequence_parallel_logits-id-out-of-range", lambda: sequence_parallel_logits(
        shard_model(TINY, 0, 1, sequence_parallel=True), torch.full((1, 4), 64)), ValueError, "vocab"),
    ("ring_forward-uneven", lambda: ring_forward(1, 2, Q, Q, Q), ValueError, "T=3"),
    ("run_gpipe-uneven-micro-batch", lambda: run_gpipe(PipelineStage(TINY, 0, 1), [torch.zeros(2, 4, dtype=torch.long),
                                                                                   torch.zeros(1, 4, dtype=torch.long)],
                                                       (2, 4, 16)), ValueError, r"micro_batches\[1\]"),
    ("run_gpipe-empty", lambda: run_gpipe(PipelineStage(TINY, 0, 1), [], (2, 4, 16)), ValueError, "micro_batches"),
    # the pipeline
    ("stage_layers-bool-p", lambda: stage_layers(4, True), ValueError, "stages"),
    ("stage_layers-zero-p", lambda: stage_layers(4, 0), ValueError, "stages"),
    ("stage_layers-too-many", lambda: stage_layers(2, 3), ValueError, "n_layer=2"),
    ("stage_layers-bad-n_layer", lambda: stage_layers(0, 1), ValueError, "n_layer"),
    ("PipelineStage-not-a-model", lambda: PipelineStage("base", 0, 2), TypeError, "minillm GPT"),
    ("PipelineStage-stage-out-of-range", lambda: PipelineStage(TINY, 2, 2), ValueError, "stage"),
    ("PipelineStage-negative-stage", lambda: PipelineStage(TINY, -1, 2), ValueError, "stage"),
    ("PipelineStage-too-many-stages", lambda: PipelineStage(TINY, 0, 3), ValueError, "stages"),
    ("bubble_fraction-zero-m", lambda: bubble_fraction(2, 0), ValueError, r"\bm\b"),
    ("bubble_fraction-bool-p", lambda: bubble_fraction(True, 4), ValueError, r"\bp\b"),
    ("bubble_fraction-float-m", lambda: bubble_fraction(2, 2.5), ValueError, r"\bm\b"),
    ("measured_bubble-empty", lambda: measured_bubble([], 2), ValueError, "events"),
    ("measured_bubble-p-too-small", lambda: measured_bubble(_events(3), 2), ValueError, r"\bp\b"),
    ("measured_bubble-zero-span", lambda: measured_bubble([StageEvent(0, 0, 1.0, 1.0)], 1), ValueError, "events"),
    ("measured_bubble-not-events", lambda: measured_bubble([(0, 0, 1.0, 2.0)], 1), TypeError, "events"),
    # groups and ranks: refused before anything starts
    ("init_rank-str-rank", lambda: init_rank("0", 2, 29500), TypeError, "rank"),
    ("init_rank-rank-out-of-range", lambda: init_rank(2, 2, 29500), ValueError, "rank"),
    ("init_rank-bad-backend", lambda: init_rank(0, 1, 29500, backend="mpi"), ValueError, "backend"),
    ("init_rank-no-env", lambda: init_rank(), ValueError, "torchrun"),
    ("init_rank-bad-timeout", lambda: init_rank(0, 1, 29500, timeout_s=0), ValueError, "timeout_s"),
    ("init_rank-bad-port", lambda: init_rank(0, 1, 70000), ValueError, "port"),
    ("run_ranks-lambda", lambda: run_ranks(lambda r, w: r, 2), TypeError, "module-level"),
    ("run_ranks-not-callable", lambda: run_ranks(3, 2), TypeError, "fn"),
    ("run_ranks-zero", lambda: run_ranks(_module_level, 0), ValueError, "world_size"),
    ("run_ranks-bool", lambda: run_ranks(_module_level, True), ValueError, "world_size"),
    ("run_ranks-bad-backend", lambda: run_ranks(_module_level, 1, backend="tcp"), ValueError, "backend"),
    ("run_ranks-bad-timeout", lambda: run_ranks(_module_level, 1, timeout_s=-1), ValueError, "timeout_s"),
    ("run_ranks-bad-threads", lambda: run_ranks(_module_level, 1, num_threads=0), ValueError, "num_threads"),
    ("run_ranks-nested", lambda: run_ranks(_nested(), 1), TypeError, "module-level"),
    # found by an independent hostile run
    ("shard_model-comm-str", lambda: shard_model(TINY, 0, 2, comm="gloo"), TypeError, "comm"),
    ("shard_model-sp-str", lambda: shard_model(TINY, 0, 2, sequence_parallel="yes"), TypeError, "sequence_parallel"),
    ("shard_model-comm-disagrees", lambda: shard_model(TINY, 0, 2, comm=Comm(sequence_parallel=True)), ValueError,
     "sequence_parallel"),
    ("shard_model-twice", lambda: shard_model(shard_model(TINY, 0, 1), 0, 1), ValueError, "shard already"),
    ("shard-without-its-group", lambda: shard_model(TINY, 0, 2)(torch.tensor([[1, 2, 3]])), ValueError, "t=2"),
    ("Comm-group-str", lambda: Comm(group="world"), TypeError, "group"),
    ("Comm-sp-int", lambda: Comm(sequence_parallel=1), TypeError, "sequence_parallel"),
    ("Comm-all_reduce-str", lambda: Comm().all_reduce("x"), TypeError, "torch.Tensor"),
    ("Comm-all_gather_seq-1d", lambda: Comm().all_gather_seq(torch.ones(0)), ValueError, "all_gather_seq"),
    ("collectives_per_forward-zero", lambda: collectives_per_forward(0), ValueError, "n_layer"),
    ("collectives_per_forward-bool", lambda: collectives_per_forward(True), TypeError, "n_layer"),
    ("all_reduce_bytes-negative", lambda: all_reduce_bytes(-1, 16, 2), ValueError, "tokens"),
    ("all_reduce_bytes-element-size", lambda: all_reduce_bytes(1, 16, 2, element_size=3), ValueError, "element_size"),
    ("ring_traffic_per_rank-zero-t", lambda: ring_traffic_per_rank(100, 0), ValueError, r"\bt\b"),
    ("ring_traffic_per_rank-negative", lambda: ring_traffic_per_rank(-5, 2), ValueError, "message_bytes"),
    ("link_estimate-zero-t", lambda: link_estimate(TINY.config, 0), ValueError, r"\bt\b"),
    ("link_estimate-str", lambda: link_estimate("cfg", 2), TypeError, "config"),
    ("PipelineStage-forward-bad-id", lambda: PipelineStage(TINY, 0, 1)(torch.tensor([[1, 2, 99]])), ValueError,
     "token ids"),
    ("PipelineStage-forward-float-ids", lambda: PipelineStage(TINY, 0, 1)(torch.tensor([[1.0, 2.0]])), TypeError,
     "token ids"),
    ("PipelineStage-forward-negative-start", lambda: PipelineStage(TINY, 0, 1)(torch.tensor([[1, 2]]), start=-1),
     ValueError, "start"),
    ("PipelineStage-forward-past-window", lambda: PipelineStage(TINY, 0, 1)(torch.tensor([[1, 2]]), start=15),
     ValueError, "block_size"),
    ("PipelineStage-forward-hidden-shape", lambda: PipelineStage(TINY, 1, 2)(torch.randn(1, 3, 7)), ValueError,
     "hidden states"),
    ("run_gpipe-not-a-stage", lambda: run_gpipe("stage", 2, (1, 3, 16)), TypeError, "stage"),
    ("run_gpipe-negative-work", lambda: run_gpipe(PipelineStage(TINY, 0, 1), [torch.zeros(1, 3, dtype=torch.long)],
                                                  (1, 3, 16), stage_work_s=-1), ValueError, "stage_work_s"),
    ("pipelined_decode-no-prompts", lambda: pipelined_decode(PipelineStage(TINY, 0, 1), [], 2), ValueError,
     "prompts"),
    ("pipelined_decode-bad-id", lambda: pipelined_decode(PipelineStage(TINY, 0, 1), [[1, 99]], 2), ValueError,
     r"prompts\[0\]"),
    ("measured_bubble-nan-time", lambda: measured_bubble([StageEvent(0, 0, NAN, 1.0)], 1), ValueError, "events"),
    ("plot_timeline-str", lambda: plot_timeline("x"), ValueError, "events"),
    ("plot_timeline-title-int", lambda: plot_timeline(_events(), title=5), TypeError, "title"),
    ("plot_timeline-ax-str", lambda: plot_timeline(_events(), ax="axes"), TypeError, r"\bax\b"),
    ("block_attention-dtype-mismatch", lambda: block_attention(Q, Q.double(), Q, False), ValueError, r"\bk\b"),
    ("block_attention-nan", lambda: block_attention(Q, torch.full_like(Q, NAN), Q, False), ValueError, r"\bk\b"),
    ("ring_attention-group-str", lambda: ring_attention(Q, Q, Q, group="world"), TypeError, "group"),
    ("init_rank-nccl-without-gpu", lambda: init_rank(0, 1, 29500, backend="nccl"), ValueError, "nccl"),
    ("run_ranks-nccl-without-gpu", lambda: run_ranks(_module_level, 2, backend="nccl"), ValueError, "nccl"),
    ("bench-unknown-model", lambda: bench_main(["--model", "nonexistent_zz"]), SystemExit, "nonexistent_zz"),
    ("bench-indivisible-world", lambda: bench_main(["--world-sizes", "3"]), SystemExit, "n_head=8"),
    ("EngineConfig-tp-bool", lambda: EngineConfig(tensor_parallel_size=True), TypeError, "tensor_parallel_size"),
    ("EngineConfig-tp-float", lambda: EngineConfig(tensor_parallel_size=2.0), TypeError, "tensor_parallel_size"),
    ("EngineConfig-tp-zero", lambda: EngineConfig(tensor_parallel_size=0), ValueError, "tensor_parallel_size"),
]


@pytest.mark.parametrize("call, err, match", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_input_is_refused_by_minillm_naming_the_argument(call, err, match):
    assert_refused_by_minillm(call, err, match)


def test_case_ids_are_distinct():
    ids = [case[0] for case in BAD]
    assert len(ids) == len(set(ids))


def test_edge_inputs_that_are_valid_give_the_right_answer():
    """One rank, empty parts, one key: the answers one process gives."""
    w, b = torch.randn(4, 6), torch.randn(4)
    cw, cb = column_split(w, b, 0, 1)
    assert torch.equal(cw, w) and torch.equal(cb, b)
    assert torch.equal(row_split(w, 0, 1), w)
    x = torch.randn(3, 6)
    torch.testing.assert_close(row_parallel_forward(x, w, b, lambda y: y), torch.nn.functional.linear(x, w, b))
    o, lse = block_attention(Q, Q[:, :, :1], Q[:, :, :1], causal=False)  # one key: its value, weight 1
    torch.testing.assert_close(o, Q[:, :, :1].expand_as(Q))
    torch.testing.assert_close(ring_attention(Q, Q, Q), block_attention(Q, Q, Q, causal=True)[0])  # no group: 1 rank
    assert stage_layers(3, 3) == [range(0, 1), range(1, 2), range(2, 3)]
    assert bubble_fraction(1, 1) == 0.0


def test_r22_run_ranks_bounds_each_ranks_thread_count():
    """A rank sets torch's thread count first: 100000 crashed torch's pool inside the rank. Refused before any
    rank starts, as every thread count is (check_threads: at most 4 per core)."""
    from minillm.parallel.group import run_ranks

    with pytest.raises(ValueError, match=r"^num_threads must be at most"):
        run_ranks(print, 1, num_threads=100000)

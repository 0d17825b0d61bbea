"""Chapters 14 (parallelism) and 15 (serving) against a hostile user, past what tests/test_hostile_14.py covers.

Every public entry point is fed wrong types, bool for int, NaN/inf, empty values, out-of-range numbers, world sizes
that do not divide the model, malformed request bodies and bad flags. Each must raise ValueError/TypeError (or, for
an unreachable server, RuntimeError) from minillm's own code, its message naming the argument; an HTTP request must
get its status with an OpenAI error body naming the field (`param`); a command must exit 2 with one line naming its
flag; or the call returns the right answer, checked against a reference computed here (one process, numpy, the
model itself, the same request without the hostile part).

Nothing here starts a rank or an engine process: every case that could is refused before it would. The HTTP cases
go through the FastAPI app in this process (Starlette's TestClient) over a one-layer model; one test sends raw bytes
to a real server on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import io
import math

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fastapi.testclient import TestClient
from helpers import assert_refused_by_minillm

from minillm import GPT, GPTConfig
from minillm.course.cli import main as minillm_main
from minillm.core.sampling import SamplingParams
from minillm.engine import LLM, EngineConfig
from minillm.engine.core import EngineCore
from minillm.kvcache.generate import generate_ids
from minillm.parallel.bench import link_estimate
from minillm.parallel.context import block_attention, merge_attention, ring_attention
from minillm.parallel.executor import TensorParallelExecutor
from minillm.parallel.generate import generate_on_rank
from minillm.parallel.group import backend_for, init_rank, run_ranks
from minillm.parallel.library import regroup_qkv_rows
from minillm.parallel.pipeline import (PipelineStage, StageEvent, bubble_fraction, measured_bubble, pipelined_decode,
                                      run_gpipe, stage_layers)
from minillm.parallel.plots import plot_timeline
from minillm.parallel.tensor import (Comm, all_reduce_bytes, column_split, ring_traffic_per_rank, row_parallel_forward,
                                    shard_model)
from minillm.serve import cli as serve_cli
from minillm.serve import loadgen as L
from minillm.serve import plots as SP
from minillm.serve import protocol as P
from minillm.serve.app import Server, ServerThread, ServeOptions, loopback_socket
from minillm.serve.async_engine import AsyncEngine, wait_until
from minillm.serve.cli import ServerProcess
from minillm.serve.engine_process import EngineProcess, build_engine
from minillm.serve.metrics import parse_metrics
from minillm.tokenizer import load_tokenizer

NAN, INF = float("nan"), float("inf")
TINY = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)).eval()
ODD_VOCAB = GPT(GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=16)).eval()
W = torch.randn(6, 4)
Q = torch.randn(1, 2, 3, 8)
TOK = load_tokenizer()
SERVED = GPT(GPTConfig(vocab_size=TOK.vocab_size, block_size=64, n_layer=1, n_head=2, n_embd=16)).eval()
MODEL_NAME = "m"
URL = "http://127.0.0.1:9"  # nothing listens there: a call that gets this far fails at once


def _llm() -> LLM:
    return LLM(SERVED, TOK, EngineConfig(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64))


def _fn(rank, world_size):  # a valid rank function, never reached: every case fails before a spawn
    return rank


def _rec(**fields) -> L.RequestRecord:
    """A successful record sent at t = 1 s, its three text chunks 0.1 s apart."""
    base = dict(index=0, prompt_len=10, max_tokens=3, scheduled_s=1.0, send_s=1.0, chunk_s=[1.1, 1.2, 1.3],
                done_s=1.3, text="abc", output_tokens=3, success=True)
    return L.RequestRecord(**{**base, **fields})


WORKLOAD = L.Workload("default", ["def main(", "import os"], [3, 3], [4, 4], 0)
SAMPLES = {key: [] for key, *_ in SP.LATENCIES}


def _completion(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": "def main(", "max_tokens": 3, "temperature": 0, **fields}


def _chat(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
            **fields}


# ======================================================================================================= refused calls

BAD_14 = [
    # torchrun's environment, read by init_rank(): checked before torch reads it with a bare int() or waits
    ("init_rank-env-rank-not-int", lambda env: init_rank(**env(RANK="abc")), ValueError, "RANK"),
    ("init_rank-env-rank-past-world", lambda env: init_rank(**env(RANK="3", WORLD_SIZE="2")), ValueError,
     r"RANK must be in \[0, WORLD_SIZE=2\)"),
    ("init_rank-env-world-zero", lambda env: init_rank(**env(WORLD_SIZE="0")), ValueError, "WORLD_SIZE"),
    ("init_rank-env-port-not-int", lambda env: init_rank(**env(MASTER_PORT="http")), ValueError, "MASTER_PORT"),
    ("init_rank-env-port-too-big", lambda env: init_rank(**env(MASTER_PORT="70000")), ValueError, "MASTER_PORT"),
    ("init_rank-world-none", lambda env: init_rank(0, None, 29500), TypeError, "world_size"),
    ("init_rank-timeout-nan", lambda env: init_rank(0, 1, 29500, timeout_s=NAN), ValueError, "timeout_s"),
    ("init_rank-timeout-str", lambda env: init_rank(0, 1, 29500, timeout_s="5"), TypeError, "timeout_s"),
    ("run_ranks-threads-bool", lambda env: run_ranks(_fn, 1, num_threads=True), TypeError, "num_threads"),
    ("run_ranks-timeout-inf", lambda env: run_ranks(_fn, 1, timeout_s=INF), ValueError, "timeout_s"),
    ("backend_for-unknown-device", lambda env: backend_for("tpu"), ValueError, "device"),
    ("backend_for-int", lambda env: backend_for(0), TypeError, "device"),
    # sharding and its pieces
    ("shard_model-vocab-indivisible", lambda env: shard_model(ODD_VOCAB, 0, 2), ValueError, "vocab_size=65"),
    ("row_parallel_forward-reduce-returns-none", lambda env: row_parallel_forward(
        torch.ones(2, 2), W[:, :2], None, lambda y: None), TypeError, "reduce must return"),
    ("row_parallel_forward-weight-dtype", lambda env: row_parallel_forward(
        torch.ones(2, 2), W[:, :2].double(), None, lambda y: y), ValueError, "weight"),
    ("row_parallel_forward-bias-dtype", lambda env: row_parallel_forward(
        torch.ones(2, 2), W[:, :2], torch.ones(6, dtype=torch.float64), lambda y: y), ValueError, "bias"),
    ("column_split-bias-int", lambda env: column_split(W, torch.ones(6, dtype=torch.long), 0, 2), TypeError, "bias"),
    ("Comm-ranks-str", lambda env: Comm(ranks="2"), TypeError, "ranks"),
    ("Comm-ranks-zero", lambda env: Comm(ranks=0), ValueError, "ranks"),
    ("Comm-all_gather_last-0d", lambda env: Comm().all_gather_last(torch.tensor(1.0)), ValueError, "0-d"),
    ("link_estimate-element-zero", lambda env: link_estimate(TINY.config, 2, element_bytes=0), ValueError,
     "element_bytes"),
    ("link_estimate-element-three", lambda env: link_estimate(TINY.config, 2, element_bytes=3), ValueError,
     "element_bytes"),
    ("link_estimate-element-str", lambda env: link_estimate(TINY.config, 2, element_bytes="2"), TypeError,
     "element_bytes"),
    ("regroup_qkv_rows-indivisible", lambda env: regroup_qkv_rows(torch.ones(48, 16), 2, 8, 3), ValueError,
     "n_head=2"),
    ("regroup_qkv_rows-rows", lambda env: regroup_qkv_rows(torch.ones(10, 16), 2, 8, 2), ValueError,
     "weight_or_bias"),
    ("regroup_qkv_rows-bool-t", lambda env: regroup_qkv_rows(torch.ones(48, 16), 2, 8, True), TypeError, r"\bt\b"),
    # attention
    ("merge_attention-dtype-mix", lambda env: merge_attention(
        torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3), torch.randn(1, 2, 3, 8).double(),
        torch.randn(1, 2, 3).double()), ValueError, "o_b"),
    ("block_attention-inf", lambda env: block_attention(Q, torch.full_like(Q, INF), Q, False), ValueError, r"\bk\b"),
    ("ring_attention-nan-v", lambda env: ring_attention(Q, Q, torch.full_like(Q, NAN)), ValueError, r"\bv\b"),
    # the pipeline
    ("PipelineStage-hidden-int", lambda env: PipelineStage(TINY, 1, 2)(torch.ones(1, 3, 16, dtype=torch.long)),
     TypeError, "hidden states"),
    ("measured_bubble-negative-stage", lambda env: measured_bubble([StageEvent(-1, 0, 0.0, 1.0)], 1), ValueError,
     r"events\[0\]"),
    ("measured_bubble-str-time", lambda env: measured_bubble([StageEvent(0, 0, "0", 1.0)], 1), TypeError,
     r"events\[0\]"),
    ("plot_timeline-bool-micro-batch", lambda env: plot_timeline([StageEvent(0, True, 0.0, 1.0)]), ValueError,
     r"events\[0\]"),
    ("pipelined_decode-bool-tokens", lambda env: pipelined_decode(PipelineStage(TINY, 0, 1), [[1, 2]], True),
     ValueError, "new_tokens"),
    ("stage_layers-float-p", lambda env: stage_layers(4, 2.0), ValueError, "stages"),
    # the tensor-parallel engine: refused before a rank is spawned
    ("TPExecutor-timeout-nan", lambda env: TensorParallelExecutor(TINY, 8, 4, timeout_s=NAN), ValueError,
     "timeout_s"),
    ("TPExecutor-startup-negative", lambda env: TensorParallelExecutor(TINY, 8, 4, startup_timeout_s=-1),
     ValueError, "startup_timeout_s"),
    ("TPExecutor-cuda", lambda env: TensorParallelExecutor(TINY, 8, 4, device="cuda"), ValueError, "device"),
    ("LLM-tp-vocab-indivisible", lambda env: LLM(ODD_VOCAB, None, EngineConfig(num_blocks=8, block_size=4,
                                                                               tensor_parallel_size=2)),
     ValueError, "vocab_size=65"),
    ("EngineConfig-tp-str", lambda env: EngineConfig(tensor_parallel_size="2"), TypeError, "tensor_parallel_size"),
    # the torchrun entry point's rank function
    ("generate_on_rank-prompt-int", lambda env: generate_on_rank(0, 1, "base", 5, 4), TypeError, "prompt"),
    ("generate_on_rank-empty-prompt", lambda env: generate_on_rank(0, 1, "base", "", 4), ValueError, "prompt"),
    ("generate_on_rank-unknown-model", lambda env: generate_on_rank(0, 1, "nonexistent_zz", "x", 4), ValueError,
     "nonexistent_zz"),
]

BAD_15 = [
    # the protocol, called directly
    ("parse_completion-body-none", lambda: P.parse_completion(None, MODEL_NAME, 4096), P.RequestError,
     "JSON object"),
    ("parse_completion-prompt-bool-ids", lambda: P.parse_completion(_completion(prompt=[True, 1]), MODEL_NAME, 4096),
     P.RequestError, "prompt"),
    ("parse_completion-prompt-nested-empty", lambda: P.parse_completion(_completion(prompt=[[1], []]), MODEL_NAME,
                                                                        4096), P.RequestError, "prompt"),
    ("parse_completion-temperature-nan", lambda: P.parse_completion(_completion(temperature=NAN), MODEL_NAME, 4096),
     P.RequestError, "temperature"),
    ("parse_completion-seed-float", lambda: P.parse_completion(_completion(seed=1.0), MODEL_NAME, 4096),
     P.RequestError, "seed"),
    ("parse_completion-include_usage-str", lambda: P.parse_completion(
        _completion(stream=True, stream_options={"include_usage": "y"}), MODEL_NAME, 4096), P.RequestError,
     "include_usage"),
    ("parse_completion-model_name-int", lambda: P.parse_completion(_completion(), 5, 4096), TypeError, "model_name"),
    ("parse_completion-vocab-zero", lambda: P.parse_completion(_completion(), MODEL_NAME, 0), ValueError,
     "vocab_size"),
    ("parse_completion-vocab-float", lambda: P.parse_completion(_completion(), MODEL_NAME, 4096.0), TypeError,
     "vocab_size"),
    ("parse_chat-model_name-empty", lambda: P.parse_chat(_chat(), ""), TypeError, "model_name"),
    ("parse_chat-role-missing", lambda: P.parse_chat(_chat(messages=[{"content": "x"}]), MODEL_NAME), P.RequestError,
     r"messages\[0\]\.role"),
    ("parse_chat-part-text-int", lambda: P.parse_chat(
        _chat(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]), MODEL_NAME), P.RequestError,
     r"messages\[0\]\.content"),
    ("parse_stop-tuple", lambda: P.parse_stop(("a",)), P.RequestError, "stop"),
    ("sse_event-int", lambda: P.sse_event(5), TypeError, "data"),
    ("sse_event-none", lambda: P.sse_event(None), TypeError, "data"),
    ("sse_event-bytes", lambda: P.sse_event(b"[DONE]"), TypeError, "data"),
    ("sse_event-nan", lambda: P.sse_event({"x": [1.0, NAN]}), ValueError, "data"),
    ("sse_event-set", lambda: P.sse_event({"x": {1}}), TypeError, "data"),
    ("sse_event-int-key", lambda: P.sse_event({1: "x"}), TypeError, "data"),
    ("sse_event-two-lines", lambda: P.sse_event("a\nb"), ValueError, "data"),
    ("check_context-negative-prompt", lambda: P.check_context(-1, 5, 64, True), ValueError, "num_prompt_tokens"),
    ("check_context-given-int", lambda: P.check_context(1, 5, 64, 1), TypeError, "given"),
    ("check_context-chat-names-messages", lambda: P.check_context(70, 5, 64, True, "messages"), P.RequestError,
     "maximum context length"),
    # the server and its options: refused before anything starts
    ("ServeOptions-timeout-str", lambda: ServeOptions(request_timeout="5"), TypeError, "request_timeout"),
    ("ServeOptions-timeout-bool", lambda: ServeOptions(request_timeout=True), TypeError, "request_timeout"),
    ("ServeOptions-shutdown-inf", lambda: ServeOptions(shutdown_timeout=INF), ValueError, "shutdown_timeout"),
    ("ServeOptions-model-int", lambda: ServeOptions(model_name=5), TypeError, "model_name"),
    ("ServeOptions-model-empty", lambda: ServeOptions(model_name=""), ValueError, "model_name"),
    ("ServeOptions-tokens-zero", lambda: ServeOptions(max_queued_tokens=0), ValueError, "max_queued_tokens"),
    ("ServeOptions-bytes-float", lambda: ServeOptions(max_request_bytes=1e6), TypeError, "max_request_bytes"),
    ("Server-options-dict", lambda: Server(_llm(), TOK, {"model_name": "x"}), TypeError, "options"),
    ("Server-engine-str", lambda: Server("engine", TOK), TypeError, "engine"),
    ("Server-tokenizer-none", lambda: Server(_llm(), None), TypeError, "tokenizer"),
    ("AsyncEngine-bare-model", lambda: AsyncEngine(SERVED), TypeError, "engine"),
    ("ServerThread-server-str", lambda: ServerThread("server"), TypeError, "server"),
    ("ServerThread-timeout-nan", lambda: ServerThread(Server(_llm(), TOK), timeout=NAN), ValueError, "timeout"),
    ("loopback_socket-port-negative", lambda: loopback_socket("127.0.0.1", -1), ValueError, "port"),
    ("loopback_socket-port-too-big", lambda: loopback_socket("127.0.0.1", 70000), ValueError, "port"),
    ("loopback_socket-port-str", lambda: loopback_socket("127.0.0.1", "80"), TypeError, "port"),
    ("loopback_socket-host-unresolved", lambda: loopback_socket("no such host.invalid", 0), ValueError, "host"),
    ("ServerProcess-threads-zero", lambda: ServerProcess([], threads=0), ValueError, "threads"),
    ("ServerProcess-timeout-negative", lambda: ServerProcess([], timeout=-1), ValueError, "timeout"),
    ("wait_until-timeout-nan", lambda: wait_until(lambda: False, NAN), ValueError, "timeout"),
    ("wait_until-not-callable", lambda: wait_until(True, 1.0), TypeError, "predicate"),
    ("wait_until-interval-negative", lambda: wait_until(lambda: False, 0.01, -1), ValueError, "interval"),
    # the engine core behind the server
    ("EngineCore-idle-nan", lambda: EngineCore(_llm(), idle_wait_s=NAN), ValueError, "idle_wait_s"),
    ("EngineCore-idle-zero", lambda: EngineCore(_llm(), idle_wait_s=0), ValueError, "idle_wait_s"),
    ("EngineCore-on_output-str", lambda: EngineCore(_llm(), on_output="queue"), TypeError, "on_output"),
    ("EngineCore-on_step-int", lambda: EngineCore(_llm(), on_step=5), TypeError, "on_step"),
    ("EngineCore-check-str", lambda: EngineCore(_llm(), check_invariants="yes"), TypeError, "check_invariants"),
    ("EngineCore-stop-timeout-nan", lambda: EngineCore(_llm()).stop(NAN), ValueError, "timeout"),
    ("EngineCore-arrival-nan", lambda: EngineCore(_llm()).add_request("x", None, arrival_time=NAN), TypeError,
     "arrival_time"),
    # building the engine: before any weights load or any process starts
    ("build_engine-unknown-argument", lambda: build_engine(num_blokcs=8), TypeError, "num_blokcs"),
    ("build_engine-num_blocks-zero", lambda: build_engine(num_blocks=0), ValueError, "num_blocks"),
    ("build_engine-gamma-zero", lambda: build_engine(speculative="prompt-lookup", gamma=0), ValueError, "gamma"),
    ("EngineProcess-build-str", lambda: EngineProcess("base"), TypeError, "build"),
    ("EngineProcess-unknown-argument", lambda: EngineProcess({"num_blokcs": 8}), TypeError, "num_blokcs"),
    ("EngineProcess-timeout-nan", lambda: EngineProcess({}, timeout=NAN), ValueError, "timeout"),
    ("EngineProcess-liveness-zero", lambda: EngineProcess({}, liveness_timeout_s=0), ValueError,
     "liveness_timeout_s"),
    # the load generator
    ("percentile-empty-array", lambda: L.percentile(np.array([]), 50), ValueError, "values"),
    ("percentile-bools", lambda: L.percentile([True, False], 50), TypeError, "values"),
    ("latency_stats-str", lambda: L.latency_stats("abc"), TypeError, "values"),
    ("latency_stats-scale-nan", lambda: L.latency_stats([1.0], scale=NAN), ValueError, "scale"),
    ("latency_stats-scale-str", lambda: L.latency_stats([1.0], scale="ms"), TypeError, "scale"),
    ("interarrival-rate-zero", lambda: L.interarrival_gaps(3, 0), ValueError, "rate"),
    ("interarrival-rate-negative", lambda: L.interarrival_gaps(3, -2.0), ValueError, "rate"),
    ("interarrival-seed-negative", lambda: L.interarrival_gaps(3, 1.0, seed=-1), ValueError, "seed"),
    ("interarrival-seed-float", lambda: L.interarrival_gaps(3, 1.0, seed=1.5), TypeError, "seed"),
    ("arrival_times-seed-str", lambda: L.arrival_times(2, 1.0, seed="x"), TypeError, "seed"),
    ("goodput-duration-inf", lambda: L.goodput([_rec()], L.SLO(), INF), ValueError, "duration"),
    ("run_duration-str", lambda: L.run_duration("abc"), TypeError, "records"),
    ("run_duration-none-record", lambda: L.run_duration([None]), TypeError, r"records\[0\]"),
    ("request_ttft-dict", lambda: L.request_ttft({"send_s": 1.0}), TypeError, "rec"),
    ("request_itls-str", lambda: L.request_itls("abc"), TypeError, "rec"),
    ("RequestRecord-chunks-out-of-order", lambda: _rec(chunk_s=[1.3, 1.2]), ValueError, "chunk_s"),
    ("RequestRecord-chunk-before-send", lambda: _rec(chunk_s=[0.5]), ValueError, "chunk_s"),
    ("RequestRecord-chunk-nan", lambda: _rec(chunk_s=[NAN]), ValueError, r"chunk_s\[0\]"),
    ("RequestRecord-tokens-negative", lambda: _rec(output_tokens=-1), ValueError, "output_tokens"),
    ("RequestRecord-success-str", lambda: _rec(success="yes"), TypeError, "success"),
    ("RequestRecord-send-str", lambda: _rec(send_s="1"), TypeError, "send_s"),
    ("records_from_report-empty", lambda: L.records_from_report({}), ValueError, "records"),
    ("records_from_report-unknown-field", lambda: L.records_from_report({"records": [{"bogus": 1}]}), ValueError,
     r"records\[0\]"),
    ("common_prefix_len-empty", lambda: L.common_prefix_len([]), ValueError, "token_lists"),
    ("common_prefix_len-int", lambda: L.common_prefix_len(5), TypeError, "token_lists"),
    ("Workload-output-zero", lambda: L.Workload("default", ["a"], [1], [0], 0), ValueError, "output_lens"),
    ("Workload-prompt-int", lambda: L.Workload("default", [5], [1], [1], 0), TypeError, "prompts"),
    ("Workload-prompts-str", lambda: L.Workload("default", "ab", [1, 1], [1, 1], 0), TypeError, "prompts"),
    ("Workload-seed-negative", lambda: L.Workload("default", ["a"], [1], [1], -1), ValueError, "seed"),
    ("make_workload-context-str", lambda: L.make_workload("default", 2, 8, 4, context_length="64"), TypeError,
     "context_length"),
    ("make_workload-context-one", lambda: L.make_workload("default", 2, 8, 4, context_length=1), ValueError,
     "context_length"),
    ("make_workload-tokenizer-str", lambda: L.make_workload("default", 2, 8, 4, tokenizer="gpt2"), TypeError,
     "tokenizer"),
    ("goodput_search-target-nan", lambda: L.goodput_search(lambda r: [_rec()], L.SLO(ttft_s=1.0), rates=[1.0],
                                                           target=NAN), ValueError, "target"),
    ("goodput_search-run-returns-none", lambda: L.goodput_search(lambda r: None, L.SLO(ttft_s=1.0), rates=[1.0]),
     TypeError, "records"),
    ("run_benchmark-rate-zero", lambda: L.run_benchmark(URL, WORKLOAD, model=MODEL_NAME, rate=0), ValueError,
     "rate"),
    ("run_benchmark-max_duration-nan", lambda: L.run_benchmark(URL, WORKLOAD, model=MODEL_NAME, max_duration=NAN),
     ValueError, "max_duration"),
    ("run_benchmark-warmup-str", lambda: L.run_benchmark(URL, WORKLOAD, model=MODEL_NAME, warmup="no"), TypeError,
     "warmup"),
    ("run_benchmark-model-int", lambda: L.run_benchmark(URL, WORKLOAD, model=5), TypeError, "model"),
    ("run_benchmark-unreachable", lambda: L.run_benchmark(URL, WORKLOAD, model=MODEL_NAME, timeout=5), RuntimeError,
     "did not answer a test request"),
    ("server_info-timeout-negative", lambda: L.server_info(URL, -1), ValueError, "timeout"),
    ("server_info-url-int", lambda: L.server_info(8000), ValueError, "base_url"),
    ("offline_throughput-llm-str", lambda: L.offline_throughput("llm", WORKLOAD), TypeError, "llm"),
    ("format_result-empty", lambda: L.format_result({}), ValueError, "report"),
    ("error_type-str", lambda: L.error_type("boom"), TypeError, "exc"),
    ("parse_len_range-int", lambda: L.parse_len_range(5, "--input-len"), TypeError, "--input-len"),
    ("parse_rates-inf", lambda: L.parse_rates("1,inf"), ValueError, "--goodput-search"),
    ("parse_metrics-bytes", lambda: parse_metrics(b"x 1"), TypeError, "text"),
    ("parse_metrics-garbage", lambda: parse_metrics("# HELP x\ngarbage\n"), ValueError, "text line 2"),
    # the plots
    ("plot_latency_cdfs-no-samples", lambda: SP.plot_latency_cdfs({"samples": {}}), ValueError, "samples"),
    ("plot_latency_cdfs-slo-int", lambda: SP.plot_latency_cdfs({"samples": SAMPLES}, slo=5), TypeError, "slo"),
    ("plot_latency_cdfs-slo-nan", lambda: SP.plot_latency_cdfs({"samples": SAMPLES}, slo={"ttft_s": NAN}),
     ValueError, "ttft_s"),
    ("plot_latency_cdfs-path-txt", lambda: SP.plot_latency_cdfs({"samples": SAMPLES}, path="latency.txt"),
     ValueError, "path"),
    ("plot_frontier-no-metrics", lambda: SP.plot_frontier([{}]), ValueError, r"reports\[0\]"),
    ("ecdf-nan", lambda: SP.ecdf([1.0, NAN]), ValueError, "values"),
    ("ecdf-str", lambda: SP.ecdf("abc"), TypeError, "values"),
]


@pytest.fixture
def torchrun_env(monkeypatch):
    """`env(**overrides)` sets a valid one-rank torchrun environment with the overrides; returns init_rank's kwargs
    (none: init_rank() reads the environment)."""
    def env(**overrides):
        for name, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                            **overrides}.items():
            monkeypatch.setenv(name, value)
        return {}
    return env


@pytest.mark.parametrize("call, err, match", [case[1:] for case in BAD_14], ids=[case[0] for case in BAD_14])
def test_chapter_14_bad_input_is_refused_naming_the_argument(torchrun_env, call, err, match):
    assert_refused_by_minillm(lambda: call(torchrun_env), err, match)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("call, err, match", [case[1:] for case in BAD_15], ids=[case[0] for case in BAD_15])
def test_chapter_15_bad_input_is_refused_naming_the_argument(call, err, match):
    assert_refused_by_minillm(call, err, match)


def test_case_ids_are_distinct():
    ids = [case[0] for case in BAD_14 + BAD_15 + GOOD + HTTP_BAD + CLI]
    assert len(ids) == len(set(ids))


# ========================================================================================== valid edges: right answers


def _two_halves_merge() -> bool:
    """Attention of 3 queries over 6 keys, computed as two parts of 3 keys merged, equals the attention over all 6."""
    k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    o_a, lse_a = block_attention(Q, k[:, :, :3], v[:, :, :3], False)
    o_b, lse_b = block_attention(Q, k[:, :, 3:], v[:, :, 3:], False)
    o, _ = merge_attention(o_a, lse_a, o_b, lse_b)
    reference = torch.softmax(Q @ k.transpose(-2, -1) / math.sqrt(8), dim=-1) @ v  # (1, 2, 3, 8)
    return torch.allclose(o, reference, atol=1e-5)


def _reference_bubble() -> bool:
    """Two stages, two micro-batches of 1 s each, stage 1 a step behind: busy 4 of 2 x 3 stage-seconds."""
    events = [StageEvent(0, 0, 0.0, 1.0), StageEvent(0, 1, 1.0, 2.0), StageEvent(1, 0, 1.0, 2.0),
              StageEvent(1, 1, 2.0, 3.0)]
    return measured_bubble(events, 2) == pytest.approx(1 / 3) == bubble_fraction(2, 2)


def _top_k_past_vocab_is_no_top_k(client) -> bool:
    """top_k at or past the vocabulary keeps every token: the same samples as top_k off, for the same seed."""
    texts = [client.post("/v1/completions", json=_completion(top_k=k, temperature=1.0, seed=5, max_tokens=6)
                         ).json()["choices"][0]["text"] for k in (0, 4096, 100_000)]
    return texts[0] == texts[1] == texts[2]


GOOD = [
    # chapter 14: one rank, or the formula, is the reference
    ("shard_model-one-rank-is-the-model", lambda c: torch.allclose(
        shard_model(TINY, 0, 1)(torch.tensor([[1, 2, 3]]))[0], TINY(torch.tensor([[1, 2, 3]]))[0], atol=1e-5)),
    ("shard_model-meta-shapes", lambda c: (lambda w: w.device.type == "meta" and tuple(w.shape) == (32, 16))(
        shard_model(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)).to("meta"), 1, 2)
        .transformer.h[0].mlp.c_fc.weight)),
    ("row_parallel_forward-one-rank-is-linear", lambda c: (lambda x, w, b: torch.allclose(
        row_parallel_forward(x, w, b, lambda y: y), F.linear(x, w, b)))(torch.randn(3, 6), torch.randn(4, 6),
                                                                        torch.randn(4))),
    ("merge_attention-two-halves-are-the-whole", lambda c: _two_halves_merge()),
    ("merge_attention-both-empty-is-zero", lambda c: merge_attention(
        torch.zeros(1, 2, 3, 8), torch.full((1, 2, 3), -INF), torch.zeros(1, 2, 3, 8), torch.full((1, 2, 3), -INF)
    )[0].abs().sum().item() == 0.0),
    ("ring_attention-one-rank-fp16", lambda c: torch.allclose(
        ring_attention(Q.half(), Q.half(), Q.half()).float(), block_attention(Q, Q, Q, True)[0], atol=1e-2)),
    ("ring_attention-empty-sequence", lambda c: tuple(ring_attention(*(torch.randn(1, 2, 0, 8),) * 3).shape)
     == (1, 2, 0, 8)),
    ("measured_bubble-equals-the-formula", lambda c: _reference_bubble()),
    ("all_reduce_bytes-formula", lambda c: all_reduce_bytes(3, 16, 2, 2) == (1 + 2 * 2) * 3 * 16 * 2),
    ("ring_traffic_per_rank-formula", lambda c: ring_traffic_per_rank(100, 4) == 2 * 3 / 4 * 100),
    ("link_estimate-one-rank-is-free", lambda c: set(link_estimate(TINY.config, 1).values()) == {0.0}),
    ("regroup_qkv_rows-one-rank-keeps-order", lambda c: torch.equal(
        regroup_qkv_rows(torch.arange(48.0).reshape(48, 1), 2, 8, 1), torch.arange(48.0).reshape(48, 1))),
    ("run_gpipe-one-stage-is-the-model", lambda c: torch.allclose(
        run_gpipe(PipelineStage(TINY, 0, 1), [torch.tensor([[1, 2, 3]])], (1, 3, 16))[0][0],
        TINY(torch.tensor([[1, 2, 3]])), atol=1e-5)),
    ("pipelined_decode-one-stage-is-greedy", lambda c: pipelined_decode(PipelineStage(TINY, 0, 1), [[1, 2]], 4)[0][0]
     == generate_ids(TINY, [1, 2], SamplingParams.greedy(4, ignore_eos=True))),
    ("backend_for-devices", lambda c: (backend_for("cpu"), backend_for("cuda:1")) == ("gloo", "nccl")),
    ("generate_on_rank-zero-tokens", lambda c: generate_on_rank(0, 1, "base", "def", 0)["tokens"] == []),
    # chapter 15: the protocol and the load generator's arithmetic
    ("parse_completion-mixed-batch", lambda c: P.parse_completion(_completion(prompt=["a", [1, 2]]), MODEL_NAME,
                                                                  4096).prompts == ["a", [1, 2]]),
    ("parse_completion-max_tokens-zero", lambda c: P.parse_completion(_completion(max_tokens=0), MODEL_NAME,
                                                                      4096).params.max_new_tokens == 0),
    ("parse_completion-best_of-equals-n", lambda c: P.parse_completion(
        _completion(best_of=2, n=2, temperature=1), MODEL_NAME, 4096).params.n == 2),
    ("parse_completion-tiny-temperature-is-greedy", lambda c: P.parse_completion(
        _completion(temperature=1e-3), MODEL_NAME, 4096).params.temperature == 0.0),
    ("parse_chat-stop-gets-the-turn-marker", lambda c: P.parse_chat(_chat(stop="x"), MODEL_NAME).params.stop
     == ("x", P.CHAT_STOP)),
    ("render_chat-template", lambda c: P.render_chat(
        [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                           {"type": "text", "text": "b"}]}])
     == "### System:\ns\n\n### User:\nab\n\n### Assistant:\n"),
    ("sse_event-nested-unicode", lambda c: P.sse_event({"a": ["é", {"b": None, "c": True, "d": 1.5}]})
     == 'data: {"a":["é",{"b":null,"c":true,"d":1.5}]}\n\n'.encode()),
    ("check_context-caps-a-default", lambda c: P.check_context(10, 100, 64, False) == 54),
    ("percentile-equals-numpy", lambda c: all(L.percentile([4, 1, 3, 2, 9.5], q) == pytest.approx(
        np.percentile([4, 1, 3, 2, 9.5], q), rel=1e-12) for q in (0, 12.5, 50, 90, 99, 100))),
    ("percentile-one-value", lambda c: L.percentile([7.0], 99) == 7.0),
    ("latency_stats-equals-numpy", lambda c: (lambda s: s["mean"] == pytest.approx(2500.0)
                                              and s["std"] == pytest.approx(np.std([1, 2, 3, 4]) * 1e3)
                                              and s["p90"] == pytest.approx(np.percentile([1, 2, 3, 4], 90) * 1e3))(
        L.latency_stats([1.0, 2.0, 3.0, 4.0], 1e3))),
    ("latency_stats-empty-is-none", lambda c: L.latency_stats([]) is None),
    ("interarrival-inf-is-all-at-once", lambda c: L.interarrival_gaps(3, INF).tolist() == [0.0, 0.0, 0.0]),
    ("arrival_times-none", lambda c: L.arrival_times(0, 1.0) == []),
    ("goodput-by-hand", lambda c: L.goodput([_rec(), _rec(success=False)], L.SLO(ttft_s=0.5), 2.0) == 0.5),
    ("goodput-no-records", lambda c: L.goodput([], L.SLO(), 1.0) == 0.0),
    ("compute_metrics-no-records", lambda c: L.compute_metrics([], 1.0)["completed"] == 0),
    ("request_itls-by-hand", lambda c: np.allclose(L.request_itls(_rec()), [0.1, 0.1])),
    ("records_from_report-round-trip", lambda c: L.records_from_report({"records": [vars(_rec())]}) == [_rec()]),
    ("common_prefix_len-by-hand", lambda c: L.common_prefix_len([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2),
    ("goodput_search-bisection", lambda c: L.goodput_search(
        lambda r: [_rec(chunk_s=[1.0 + r / 10])], L.SLO(ttft_s=0.5), bracket=(1.0, 8.0), steps=3).rate == 4.5),
    ("parse_len_range-pair", lambda c: L.parse_len_range("3:9", "--input-len") == (3, 9)),
    ("parse_metrics-one-sample", lambda c: parse_metrics('# HELP x\nminillm_a{b="c d"} 2.0\n')
     == {'minillm_a{b="c d"}': 2.0}),
    ("ecdf-by-hand", lambda c: [a.tolist() for a in SP.ecdf([3.0, 1.0])] == [[1.0, 3.0], [0.5, 1.0]]),
    ("error_type-stream", lambda c: L.error_type(L.StreamError("engine_error", "x")) == "stream:engine_error"),
    ("wait_until-true-at-once", lambda c: wait_until(lambda: True, 0.0) is True),
    ("EngineCore-serves-a-request", lambda c: (lambda core: (
        core.add_request([1, 2, 3], SamplingParams.greedy(2, ignore_eos=True), request_id="r"),
        [core.step() for _ in range(4)], core.outputs.qsize() > 0)[-1])(EngineCore(_llm()))),
    # chapter 15 through HTTP: the same request without the hostile part is the reference
    ("http-top_k-past-vocab-is-no-top-k", _top_k_past_vocab_is_no_top_k),
    ("http-max_tokens-zero-generates-nothing", lambda c: (lambda r: r.status_code == 200 and r.json()["choices"][0][
        "text"] == "" and r.json()["usage"]["completion_tokens"] == 0)(
        c.post("/v1/completions", json=_completion(max_tokens=0)))),
    ("http-chat-max_tokens-zero", lambda c: c.post("/v1/chat/completions", json=_chat(max_tokens=0)).json()[
        "usage"]["completion_tokens"] == 0),
    ("http-stream-max_tokens-zero-ends", lambda c: c.post("/v1/completions", json=_completion(max_tokens=0, stream=True)
                                                          ).text.endswith("data: [DONE]\n\n")),
    ("http-n-3-three-choices", lambda c: len(c.post("/v1/completions", json=_completion(n=3, temperature=1, seed=3)
                                                   ).json()["choices"]) == 3),
    ("http-duplicate-key-last-wins", lambda c: c.post(
        "/v1/completions", content=b'{"model": "x", "model": "m", "prompt": "a", "max_tokens": 1}').status_code == 200),
    ("http-models", lambda c: c.get("/v1/models").json()["data"][0] | {"created": 0} == {
        "id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "minillm", "max_model_len": 64}),
    ("http-put-is-405", lambda c: c.put("/v1/completions", json=_completion()).status_code == 405),
    ("http-content-length-lie-is-413", lambda c: c.post(
        "/v1/completions", content=b'{"a": 1}', headers={"content-length": "99999999999"}).status_code == 413),
]


@pytest.fixture(scope="module")
def client():
    """The FastAPI app of a server over a one-layer model, its engine on a thread of this process."""
    server = Server(_llm(), TOK, ServeOptions(model_name=MODEL_NAME, max_queued_requests=64))
    with TestClient(server.app) as c:
        yield c


@pytest.mark.timeout(60)
@pytest.mark.parametrize("check", [case[1] for case in GOOD], ids=[case[0] for case in GOOD])
def test_valid_edge_inputs_give_the_reference_answer(client, check):
    assert check(client)


# ========================================================================================== HTTP: 400 naming the field

HTTP_BAD = [
    # (id, path, JSON body or raw bytes, status, the `param` the error names)
    ("http-nan-temperature", "/v1/completions", b'{"model": "m", "prompt": "x", "temperature": NaN}', 400,
     "temperature"),
    ("http-infinity-max_tokens", "/v1/completions", b'{"model": "m", "prompt": "x", "max_tokens": Infinity}', 400,
     "max_tokens"),
    ("http-null-body", "/v1/completions", b"null", 400, None),
    ("http-empty-body", "/v1/completions", b"", 400, None),
    ("http-not-utf8", "/v1/completions", b'{"model": "\xff"}', 400, None),
    ("http-batch-with-empty-prompt", "/v1/completions", _completion(prompt=["a", ""]), 400, "prompt"),
    ("http-ids-past-the-window", "/v1/completions", _completion(prompt=[1] * 70), 400, "prompt"),
    ("http-max_tokens-past-the-window", "/v1/completions", _completion(max_tokens=100), 400, "max_tokens"),
    ("http-n-17", "/v1/completions", _completion(n=17), 400, "n"),
    ("http-top_k-negative", "/v1/completions", _completion(top_k=-1), 400, "top_k"),
    ("http-stop-list-of-lists", "/v1/completions", _completion(stop=[["a"]]), 400, "stop"),
    ("http-logit_bias", "/v1/completions", _completion(logit_bias={"1": 5}), 400, "logit_bias"),
    ("http-user-int", "/v1/completions", _completion(user=5), 400, "user"),
    ("http-wrong-model", "/v1/completions", _completion(model="gpt-4"), 404, "model"),
    ("http-chat-role-tool", "/v1/chat/completions", _chat(messages=[{"role": "tool", "content": "x"}]), 400,
     "messages[0].role"),
    ("http-chat-content-null", "/v1/chat/completions", _chat(messages=[{"role": "user", "content": None}]), 400,
     "messages[0].content"),
    ("http-chat-past-the-window", "/v1/chat/completions", _chat(messages=[{"role": "user", "content": "word " * 400}]),
     400, "messages"),
    ("http-chat-special-token-text", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": "<|endoftext|>"}]), 400, "messages"),
    ("http-chat-both-max-tokens", "/v1/chat/completions", _chat(max_completion_tokens=3), 400,
     "max_completion_tokens"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path, body, status, param", [case[1:] for case in HTTP_BAD],
                         ids=[case[0] for case in HTTP_BAD])
def test_bad_requests_get_an_openai_error_naming_the_field(client, path, body, status, param):
    r = client.post(path, content=body) if isinstance(body, bytes) else client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    assert error["message"]


@pytest.mark.timeout(120)
def test_a_real_loopback_server_answers_malformed_bytes_with_400s():
    """The same framing through uvicorn and a socket: malformed JSON, a JSON list, a body that is not UTF-8."""
    server = Server(_llm(), TOK, ServeOptions(model_name=MODEL_NAME))
    with ServerThread(server, timeout=60) as thread:
        url = thread.url + "/v1/completions"
        for raw, why in ((b'{"model": "m", "prompt": ', "not valid JSON"), (b"[1, 2]", "JSON object"),
                         (b'{"model": "\xff\xfe"}', "not valid JSON")):
            r = httpx.post(url, content=raw, timeout=30)
            assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
        r = httpx.post(url, json=_completion(max_tokens=2), timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2


# ==================================================================================== commands: exit 2 naming the flag

CLI = [
    ("serve-port-negative", ["serve", "--port", "-1"], "--port"),
    ("serve-port-too-big", ["serve", "--port", "70000"], "--port"),
    ("serve-threads-zero", ["serve", "--threads", "0"], "--threads"),
    ("serve-shutdown-nan", ["serve", "--shutdown-timeout", "nan"], "--shutdown-timeout"),
    ("serve-queue-zero", ["serve", "--max-queued-requests", "0"], "--max-queued-requests"),
    ("serve-queued-tokens-zero", ["serve", "--max-queued-tokens", "0"], "--max-queued-tokens"),
    ("serve-request-bytes-zero", ["serve", "--max-request-bytes", "0"], "--max-request-bytes"),
    ("serve-request-timeout-zero", ["serve", "--request-timeout", "0"], "--request-timeout"),
    ("serve-empty-model-name", ["serve", "--served-model-name", ""], "--served-model-name"),
    ("serve-unknown-model", ["serve", "--model", "bogus"], "--model"),
    ("bench-serve-threads-zero", ["bench-serve", "--threads", "0"], "--threads"),
    ("bench-serve-seed-negative", ["bench-serve", "--seed", "-1", "--base-url", URL], "--seed"),
    ("bench-serve-timeout-inf", ["bench-serve", "--timeout", "inf"], "--timeout"),
    ("bench-serve-rate-nan", ["bench-serve", "--request-rate", "nan"], "--request-rate"),
    ("bench-serve-output-past-context", ["bench-serve", "--output-len", "300", "--context-length", "256", "--model",
                                         "m", "--base-url", URL], "output_len"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv, flag", [case[1:] for case in CLI], ids=[case[0] for case in CLI])
def test_bad_flags_exit_2_naming_the_flag(monkeypatch, argv, flag):
    """Checked before any model is loaded, any server started or any request sent (the stubs fail the test if one
    were)."""
    def reached(*args, **kwargs):
        raise AssertionError("a bad flag got as far as building the engine")

    monkeypatch.setattr(serve_cli, "build_engine", reached)
    monkeypatch.setattr(serve_cli, "EngineProcess", reached)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = minillm_main(argv)
        except SystemExit as exc:  # argparse's own refusals (a choice, a type)
            code = exc.code
    assert code == 2, err.getvalue()
    assert flag in err.getvalue().strip().splitlines()[-1], err.getvalue()

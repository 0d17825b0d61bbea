"""The executor interface (`minillm.engine.executor.Executor`) and the process layer (`minillm.engine.process`).

An executor that shares nothing with the engine but each step's pickled bytes (its own model copy, rebuilt from
model bytes as a second rank would, its own KV pool) plugs into `LLM` and `SpeculativeLLM` as `runner_cls` and gives
exactly the in-process tokens, through preemption by swap and by recompute, prefix caching and speculation: the
scheduler, planner and sampler never needed to know where the step ran. The process layer runs roles it knows
nothing about (a toy role here, N of them at once), reports a dead worker by name, and stops them all for sure.
"""

from __future__ import annotations

import multiprocessing
import pickle
import time

import pytest
import torch
from helpers import context_model

from minillm.core.formats import model_from_bytes, model_to_bytes
from minillm.core.model import require_model
from minillm.core.sampling import SamplingParams
from minillm.engine import LLM, EngineConfig, Executor, ModelRunner
from minillm.engine.process import CRASH_EXIT_CODE, CrashAfter, WorkerDiedError, WorkerHandle, receive, stop_all, \
    wait_ready
from minillm.speculative.engine import SpeculativeLLM

VOCAB = 512


@pytest.fixture(scope="module")
def model():
    return context_model("tiny", seed=99)  # vocab 512, window 64, 2 layers, context-sensitive


class FarExecutor:
    """Runs every step from its pickled bytes on a model copy of its own: what a rank of chapter 14 receives."""

    def __init__(self, model, num_blocks, block_size, device=None, kv_dtype=torch.float32,
                 attention_backend="selective"):
        self.config = require_model(model, "FarExecutor")
        copy = model_from_bytes(model_to_bytes(model))  # nothing shared with the engine's model object
        self.runner = ModelRunner(copy, num_blocks, block_size, device=device, kv_dtype=kv_dtype,
                                  attention_backend=attention_backend)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.bytes_received = 0
        self.closed = False

    @property
    def kv_dtype(self):
        return self.runner.kv_dtype

    @property
    def num_forward_calls(self):
        return self.runner.num_forward_calls

    @property
    def swap_space(self):
        return self.runner.swap_space

    def execute(self, step):
        data = pickle.dumps(step)
        self.bytes_received += len(data)
        received = pickle.loads(data)
        received.check(self.config, self.num_blocks, self.block_size)  # as a rank checks what it is sent
        return self.runner.execute(received)

    def close(self):
        self.closed = True


class FarLLM(LLM):
    runner_cls = FarExecutor


class FarSpeculativeLLM(SpeculativeLLM):
    runner_cls = FarExecutor


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, VOCAB, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_both_executors_meet_the_interface(model):
    cfg = EngineConfig(num_blocks=16, block_size=4)
    assert isinstance(LLM(model, None, cfg).runner, Executor)
    assert isinstance(FarLLM(model, None, cfg).runner, Executor)


@pytest.mark.parametrize("settings", [
    dict(preemption_mode="swap", num_swap_blocks=32),
    dict(preemption_mode="recompute"),
    dict(enable_prefix_caching=True),
], ids=["swap", "recompute", "prefix-caching"])
def test_an_executor_elsewhere_gives_the_in_process_tokens(model, settings):
    """A pool small enough that requests are preempted; seeded sampling too, so every draw must line up."""
    cfg = EngineConfig(num_blocks=14, block_size=4, max_num_seqs=6, max_num_batched_tokens=32, **settings)
    prompts = _prompts(8)
    if settings.get("enable_prefix_caching"):
        prompts = [prompts[0][:12] + p for p in prompts]  # a shared prefix to hit
    params = [SamplingParams.greedy(14, ignore_eos=True) if i % 2 else
              SamplingParams(max_new_tokens=14, temperature=0.9, seed=i, ignore_eos=True) for i in range(8)]
    here = LLM(model, None, cfg)
    far = FarLLM(model, None, cfg)
    want = [o.output_token_ids for o in here.generate(prompts, params)]
    assert [o.output_token_ids for o in far.generate(prompts, params)] == want
    assert far.stats()["num_preemptions"] == here.stats()["num_preemptions"]
    if "preemption_mode" in settings:
        assert here.stats()["num_preemptions"] > 0  # the pool really was too small
    assert far.runner.bytes_received > 0 and far.block_manager.num_free_blocks == cfg.num_blocks


def test_speculation_runs_unchanged_on_an_executor_elsewhere(model):
    cfg = EngineConfig(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                       attention_backend="verify")
    prompts = [p * 3 for p in _prompts(4)]  # repeats: prompt lookup finds drafts
    params = SamplingParams.greedy(16, ignore_eos=True)
    want = [o.output_token_ids for o in SpeculativeLLM(model, None, cfg).generate(prompts, params)]
    assert [o.output_token_ids for o in FarSpeculativeLLM(model, None, cfg).generate(prompts, params)] == want


# ----- the process layer, with a role it knows nothing about ----------------------------------------------------


def test_n_workers_of_a_toy_role_start_answer_and_stop():
    from process_roles import ToyInit, setup_doubler

    ctx = multiprocessing.get_context("spawn")
    handles = [WorkerHandle(ctx, ToyInit(f"rank{i}", heartbeat_s=0.2, num_threads=1), setup_doubler)
               for i in range(3)]
    try:
        wait_ready(handles, timeout=300)
        for i, h in enumerate(handles):
            h.send(10 * i + 1)
        answers: dict[str, list] = {}
        deadline = time.monotonic() + 60
        while len(answers) < 3 and time.monotonic() < deadline:
            got, failure = receive(handles, timeout=0.5, liveness_timeout_s=30)
            assert failure is None, failure
            for h, msg in got:
                answers.setdefault(h.role, []).append(msg)
        assert answers == {"rank0": [2], "rank1": [22], "rank2": [42]}

        handles[1].send(CrashAfter(0))  # rank1 dies at its next loop turn
        handles[1].send(5)
        deadline, failure = time.monotonic() + 60, None
        while failure is None and time.monotonic() < deadline:
            _, failure = receive(handles, timeout=0.5, liveness_timeout_s=30)
        assert failure is not None and "rank1 worker" in failure and f"code {CRASH_EXIT_CODE}" in failure
        with pytest.raises(WorkerDiedError, match="cannot reach the rank1 worker"):
            for _ in range(50):  # the pipe may take a moment to report the dead reader
                handles[1].send(1)
                time.sleep(0.05)
    finally:
        stop_all(handles)
    assert not any(h.process.is_alive() for h in handles)


def test_a_role_whose_setup_raises_fails_the_start_with_its_traceback():
    from process_roles import ToyInit, setup_broken

    ctx = multiprocessing.get_context("spawn")
    handles = [WorkerHandle(ctx, ToyInit("broken", heartbeat_s=0.2, num_threads=1), setup_broken)]
    try:
        with pytest.raises(WorkerDiedError, match="broken worker failed to start:(.|\n)*no model for this role"):
            wait_ready(handles, timeout=300)
    finally:
        stop_all(handles)

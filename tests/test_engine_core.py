"""The engine core: a step as plain data (`StepInput`, `plan`, `ModelRunner.execute`) and `EngineCore`, the engine
behind a thread-safe inbox and an outbox.

The step tests run each planned `StepInput` a second time, pickled, on another copy of the model in another
process, and compare the logits bit for bit. The core tests drive it from several threads at once; every request
must get exactly one final output and the pool must end with every block free.
"""

from __future__ import annotations

import pickle
import random
import subprocess
import sys
import threading
import time

import pytest
import torch
from helpers import context_model
from safetensors.torch import load_file

from minillm.core.checkpoint import save_checkpoint
from minillm.core.sampling import SamplingParams
from minillm.engine import LLM, EngineConfig, ModelRunner, StepInput, plan
from minillm.engine.core import EngineCore
from minillm.kvcache.generate import generate_ids
from minillm.speculative.engine import SpeculativeLLM

VOCAB = 512
SMALL = EngineConfig(num_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                     preemption_mode="swap", num_swap_blocks=24)  # small: requests swap


@pytest.fixture(scope="module")
def model():
    return context_model("tiny", seed=1234)  # vocab 512, window 64, 2 layers, context-sensitive


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 14))] for _ in range(n)]


class RecordingRunner(ModelRunner):
    """Keeps every StepInput it executed and the logits it returned."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps: list[tuple[StepInput, torch.Tensor | None]] = []

    def execute(self, step):
        logits = super().execute(step)
        self.steps.append((pickle.loads(pickle.dumps(step)), None if logits is None else logits.clone()))
        return logits


class RecordingLLM(LLM):
    runner_cls = RecordingRunner


# ----- the step as data --------------------------------------------------------------------------------------------


def test_plan_holds_only_plain_data_and_pickles_small(model):
    llm = RecordingLLM(model, None, SMALL)
    llm.generate(_prompts(6, 0), SamplingParams.greedy(16, ignore_eos=True))
    assert llm.runner.steps
    kinds = {"swap_out": 0, "swap_in": 0, "prefill": 0, "decode": 0}
    for step, _ in llm.runner.steps:
        step.check(model.config, SMALL.num_blocks, SMALL.block_size)
        for value in vars(step).values():  # lists of ints, of (str, [int]) pairs, of (int, int) pairs
            assert isinstance(value, list)
            for item in value:
                assert isinstance(item, (int, str, tuple, list)) and not isinstance(item, bool), item
        assert len(pickle.dumps(step)) < 4096, len(pickle.dumps(step))
        kinds["swap_out"] += len(step.swap_out)
        kinds["swap_in"] += len(step.swap_in)
        kinds["prefill"] += sum(q > 1 for q in step.query_lens)
        kinds["decode"] += sum(q == 1 for q in step.query_lens)
    assert all(kinds.values()), f"the workload should reach every kind of step data: {kinds}"


def test_step_input_check_names_what_does_not_fit(model):
    ok = StepInput(token_ids=[5, 6], positions=[0, 1], slot_mapping=[0, 1], block_tables=[[0]], context_lens=[2],
                   query_lens=[2], sample_rows=[1])
    ok.check(model.config, 4, 4)
    bad = {
        "slot_mapping": dict(slot_mapping=[0, 99]),
        "token_ids": dict(token_ids=[5, VOCAB]),
        "blocks": dict(block_tables=[[7]]),
        "must all agree": dict(positions=[0]),
        "sample_rows": dict(sample_rows=[2]),
        "do not fit": dict(context_lens=[9]),
    }
    for match, change in bad.items():
        step = pickle.loads(pickle.dumps(ok))
        for k, v in change.items():
            setattr(step, k, v)
        with pytest.raises(ValueError, match=match):
            step.check(model.config, 4, 4)


CHILD = r"""
import pickle, sys
import torch
from safetensors.torch import load_file, save_file
from minillm.core.checkpoint import load_checkpoint
from minillm.engine import ModelRunner

torch.set_num_threads(1)
folder = sys.argv[1]
with open(f"{folder}/steps.pkl", "rb") as f:
    num_blocks, block_size, steps = pickle.load(f)
model = load_checkpoint(f"{folder}/model").eval()  # safetensors, checked on load
runner = ModelRunner(model, num_blocks, block_size)  # a fresh pool: the steps rebuild its contents in order
out = {}
for i, step in enumerate(steps):
    step.check(model.config, num_blocks, block_size)
    logits = runner.execute(step)
    if logits is not None:
        out[f"step{i}"] = logits.contiguous()
save_file(out, f"{folder}/logits.safetensors")
"""


def test_a_pickled_step_runs_on_another_model_copy_in_another_process(model, tmp_path):
    """Rank 0 plans and executes; a second process with its own copy of the weights and its own empty pool executes
    the same pickled StepInputs in order (swaps and copy-on-write included) and returns the same logits, bit for
    bit: the step needs no Request, no scheduler and no block manager."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same kernels and reduction order as the child's
    try:
        llm = RecordingLLM(model, None, SMALL)
        llm.generate(_prompts(6, 1), [SamplingParams(temperature=0.8, seed=i, max_new_tokens=16, ignore_eos=True)
                                      for i in range(6)])
    finally:
        torch.set_num_threads(threads)
    steps = [s for s, _ in llm.runner.steps]
    assert any(s.swap_out for s in steps) and any(s.swap_in for s in steps)
    save_checkpoint(model, tmp_path / "model")
    with open(tmp_path / "steps.pkl", "wb") as f:
        pickle.dump((SMALL.num_blocks, SMALL.block_size, steps), f)
    subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], check=True, timeout=300)
    got = load_file(str(tmp_path / "logits.safetensors"))
    want = {f"step{i}": lg for i, (_, lg) in enumerate(llm.runner.steps) if lg is not None}
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


# ----- outputs that wait -------------------------------------------------------------------------------------------


def test_has_unfinished_counts_outputs_still_to_deliver(model):
    """An aborted request's final output, and one finished on arrival, come out of a loop gated on has_unfinished."""
    llm = LLM(model, None, SMALL)
    a = llm.add_request([1, 2, 3], SamplingParams.greedy(5))
    llm.step()
    llm.abort(a)
    b = llm.add_request([4, 5], SamplingParams.greedy(0))  # nothing to generate: finished on arrival
    assert llm.has_unfinished()
    seen = []
    while llm.has_unfinished():
        seen += llm.step()
    assert {(o.request_id, o.finish_reason) for o in seen} == {(a, "abort"), (b, "length")}


# ----- EngineCore ---------------------------------------------------------------------------------------------------


def _finals(core: EngineCore) -> dict[str, list]:
    got: dict[str, list] = {}
    while not core.outputs.empty():
        o = core.outputs.get_nowait()
        if o.finished:
            got.setdefault(o.request_id, []).append(o)
    return got


def test_core_on_its_own_thread_gives_the_tokens_of_each_request_alone(model):
    prompts = _prompts(5, 2)
    params = SamplingParams.greedy(8, ignore_eos=True)
    with EngineCore(LLM(model, None, SMALL), check_invariants=True) as core:
        ids = [core.add_request(p, params) for p in prompts]
        deadline = time.monotonic() + 120
        while core.num_live and time.monotonic() < deadline:
            time.sleep(0.01)
    finals = _finals(core)
    assert core.error is None and set(finals) == set(ids)
    for rid, p in zip(ids, prompts):
        assert len(finals[rid]) == 1
        assert finals[rid][0].output_token_ids == generate_ids(model, p, params)


def test_core_checks_a_request_in_the_caller_s_thread(model):
    core = EngineCore(LLM(model, None, SMALL))
    with pytest.raises(ValueError, match="vocab"):
        core.add_request([VOCAB + 3], SamplingParams.greedy(2))
    with pytest.raises(TypeError, match="SamplingParams"):
        core.add_request([1, 2], "greedy")
    rid = core.add_request([1, 2], SamplingParams.greedy(2), request_id="mine")
    with pytest.raises(ValueError, match="already in use"):
        core.add_request([1, 2], SamplingParams.greedy(2), request_id="mine")
    with pytest.raises(TypeError, match="request_id"):
        core.abort(3)
    assert not core.abort("nobody")
    core.stop()  # never started: stop ends the live request here, with its final output
    finals = _finals(core)
    assert [o.finish_reason for o in finals[rid]] == ["abort"]
    with pytest.raises(RuntimeError, match="stopped"):
        core.add_request([1, 2], SamplingParams.greedy(2))
    with pytest.raises(TypeError, match="front end"):
        EngineCore(object())


def test_stop_ends_every_live_request_with_one_final_output(model):
    core = EngineCore(LLM(model, None, SMALL), check_invariants=True).start()
    ids = [core.add_request(p, SamplingParams.greedy(30, ignore_eos=True)) for p in _prompts(6, 3)]
    time.sleep(0.05)
    core.stop()
    finals = _finals(core)
    assert set(finals) == set(ids) and all(len(v) == 1 for v in finals.values())
    assert {v[0].finish_reason for v in finals.values()} <= {"abort", "length"}
    assert core.engine.block_manager.num_free_blocks == SMALL.num_blocks and not core.engine.has_unfinished()


def test_a_failed_admission_ends_that_request_alone(model, monkeypatch):
    llm = LLM(model, None, SMALL)
    core = EngineCore(llm)
    good = core.add_request([1, 2, 3], SamplingParams.greedy(3, ignore_eos=True))
    bad = core.add_request([4, 5, 6], SamplingParams.greedy(3, ignore_eos=True))
    real = llm._enqueue

    def enqueue(req):
        if req.request_id == bad:
            raise RuntimeError("planted")
        real(req)

    monkeypatch.setattr(llm, "_enqueue", enqueue)
    while core.has_work():
        core.step()
    finals = _finals(core)
    assert finals[bad][0].finish_reason == "error" and "planted" in finals[bad][0].error
    assert finals[good][0].output_token_ids == generate_ids(model, [1, 2, 3], SamplingParams.greedy(3, ignore_eos=True))
    assert core.num_live == 0


def test_a_broken_loop_fails_every_live_request_and_says_why(model, monkeypatch):
    llm = LLM(model, None, SMALL)
    core = EngineCore(llm)
    ids = [core.add_request(p, SamplingParams.greedy(5)) for p in _prompts(3, 4)]

    def broken():
        raise RuntimeError("planted engine bug")

    monkeypatch.setattr(llm, "step", broken)
    core.start()
    core._thread.join(30)
    assert isinstance(core.error, RuntimeError)
    finals = _finals(core)
    assert set(finals) == set(ids)
    assert all(v[0].finish_reason == "error" and "planted engine bug" in v[0].error for v in finals.values())
    with pytest.raises(RuntimeError, match="stopped"):
        core.add_request([1], SamplingParams.greedy(1))


@pytest.mark.parametrize("engine", ["llm", "speculative"])
def test_threads_adding_and_aborting_at_random(model, engine):
    """Four threads add and abort requests at random while the core's thread runs the loop (invariants checked
    after every step): every request gets exactly one final output, the ones that were not aborted have the
    tokens of their run alone, and the pool ends with every block free."""
    make = LLM if engine == "llm" else SpeculativeLLM
    config = SMALL if engine == "llm" else EngineConfig(num_blocks=24, block_size=4, max_num_seqs=4,
                                                         max_num_batched_tokens=16, attention_backend="verify")
    core = EngineCore(make(model, None, config), check_invariants=True).start()
    added: dict[str, tuple[list[int], SamplingParams]] = {}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def client(seed: int) -> None:
        rng = random.Random(seed)
        mine: list[str] = []
        try:
            for prompt in _prompts(8, 100 + seed):
                params = SamplingParams.greedy(rng.randint(1, 12), ignore_eos=True)
                rid = core.add_request(prompt, params)
                with lock:
                    added[rid] = (prompt, params)
                mine.append(rid)
                if rng.random() < 0.4:
                    time.sleep(rng.random() * 0.02)
                    core.abort(rng.choice(mine))
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors.append(exc)

    clients = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in clients:
        t.start()
    for t in clients:
        t.join(120)
    deadline = time.monotonic() + 180
    while core.num_live and time.monotonic() < deadline:
        time.sleep(0.01)
    core.stop()
    assert not errors and core.error is None
    finals = _finals(core)
    assert set(finals) == set(added) and len(added) == 32
    assert all(len(v) == 1 for v in finals.values()), "a request got two final outputs"
    reasons = {rid: v[0].finish_reason for rid, v in finals.items()}
    assert set(reasons.values()) <= {"length", "abort"}
    for rid, (prompt, params) in added.items():
        if reasons[rid] == "length":
            assert finals[rid][0].output_token_ids == generate_ids(model, prompt, params), rid
    assert core.engine.block_manager.num_free_blocks == config.num_blocks


def test_parallel_samples_through_the_core_each_get_one_final_output(model):
    """n = 3 through the core: three final outputs (index 0, 1, 2); an abort after one finished still ends the rest."""
    core = EngineCore(LLM(model, None, EngineConfig(num_blocks=64, block_size=4, max_num_seqs=8,
                                                    max_num_batched_tokens=32)))
    rid = core.add_request([5, 6, 7], SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, n=3))
    finals = {}
    while core.has_work():
        for out in core.step():
            if out.finished:
                finals[(out.request_id, out.index)] = out
    assert sorted(finals) == [(rid, 0), (rid, 1), (rid, 2)] and core.num_live == 0
    alone = [generate_ids(model, [5, 6, 7], SamplingParams(max_new_tokens=6, temperature=1.0, seed=3 + i))
             for i in range(3)]
    assert [finals[(rid, i)].output_token_ids for i in range(3)] == alone
    # stop() with a sample still running: every index that had no final output gets one
    rid = core.add_request([5, 6, 7], SamplingParams(max_new_tokens=40, temperature=1.0, seed=3, n=2))
    core.step()
    core.stop()
    got = []
    while not core.outputs.empty():
        out = core.outputs.get()
        if out.finished and out.request_id == rid:
            got.append(out.index)
    assert sorted(got) == [0, 1]


def test_sample_ids_cannot_collide_through_the_core_and_a_refused_admission_ends_every_sample(model, monkeypatch):
    core = EngineCore(LLM(model, None, EngineConfig(num_blocks=64, block_size=4)))
    core.add_request([5, 6, 7], SamplingParams.greedy(3, n=2), request_id="x")
    with pytest.raises(ValueError, match="already in use"):
        core.add_request([5, 6, 7], SamplingParams.greedy(3), request_id="x#1")  # x's second sample
    core.add_request([5, 6, 7], SamplingParams.greedy(3), request_id="y#1")
    with pytest.raises(ValueError, match="would name its samples"):
        core.add_request([5, 6, 7], SamplingParams.greedy(3, n=2), request_id="y")
    # an admission that fails when its turn comes ends sample 0 and the held sample alike
    monkeypatch.setattr(core.engine, "_enqueue", lambda req: (_ for _ in ()).throw(RuntimeError("no room")))
    core.add_request([1, 2], SamplingParams.greedy(3, n=3), request_id="z")
    finals = [(o.request_id, o.index) for o in core.step() if o.finished]
    assert sorted(f for f in finals if f[0] == "z") == [("z", 0), ("z", 1), ("z", 2)]
    assert "z" not in core.live

"""The measurement kit (`minillm.bench`): loader, workload presets, the over-time driver, the same-tokens check.

No timing is asserted here: only that the kit's numbers are the ones it claims (lengths, orders, counts).
"""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest
import torch

from minillm.bench.check import SameTokens, same_tokens
from minillm.bench.driver import drive
from minillm.bench.models import load_model
from minillm.bench.workload import PRESETS, LengthDist, eval_prompts, make_workload, workload
from minillm.core.config import GPTConfig
from minillm.core.model import GPT
from minillm.engine import LLM, EngineConfig
from minillm.kvcache.generate import generate_ids


# ------------------------------------------------------------------------------------------------- load_model


def test_load_model_random_init_is_seeded_and_labelled():
    a, b = load_model("tiny", seed=3), load_model("tiny", seed=3)
    assert not a.trained and "random init" in a.label and not a.model.training
    assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()))
    c = load_model("tiny", seed=4)
    assert not torch.equal(a.model.lm_head.weight, c.model.lm_head.weight)
    assert a.tokenizer is not None  # the shipped tokenizer, so prompts can be real text


def test_load_model_random_init_on_request_even_for_a_shipped_name():
    loaded = load_model("base", random_init=True)
    assert not loaded.trained and loaded.label.startswith("base (random init")


# ---------------------------------------------------------------------------------------------------- workload


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_deterministic_per_seed_and_in_range(name):
    a = workload(name, 12, seed=5, rate=4.0, vocab_size=300)
    b = workload(name, 12, seed=5, rate=4.0, vocab_size=300)
    c = workload(name, 12, seed=6, rate=4.0, vocab_size=300)
    key = lambda wl: [(w.arrival_time, w.prompt_token_ids, w.output_len) for w in wl]  # noqa: E731
    assert key(a) == key(b) and key(a) != key(c)
    p, o = LengthDist.parse(PRESETS[name].prompt_len), LengthDist.parse(PRESETS[name].output_len)
    for w in a:
        assert min(p.args[:2]) <= len(w.prompt_token_ids) <= p.max
        assert o.args[-2 if o.kind == "lognormal" else 0] <= w.output_len <= o.max
        assert w.params.ignore_eos and w.params.max_new_tokens == w.output_len
    arrivals = [w.arrival_time for w in a]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals)
    if not PRESETS[name].real_text:
        assert all(0 <= t < 300 for w in a for t in w.prompt_token_ids)


def test_preset_lengths_can_be_overridden_and_offline_is_all_at_zero():
    wl = workload("prefill-heavy", 4, seed=0, prompt_len="uniform:10:12", output_len=3)
    assert all(10 <= len(w.prompt_token_ids) <= 12 and w.output_len == 3 for w in wl)
    assert all(w.arrival_time == 0 for w in wl)  # rate = inf by default


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(ValueError, match="mixed") as err:
        workload("bursty", 3)
    assert "prefill-heavy" in str(err.value)


def test_eval_prompts_are_consecutive_text_or_seeded_ids():
    text = eval_prompts([3, 5], vocab_size=100, real_text=True)
    assert [len(p) for p in text] == [3, 5]
    assert text[0] + text[1] == eval_prompts([8], vocab_size=100, real_text=True)[0]
    rnd = eval_prompts([4, 2], vocab_size=50, real_text=False, seed=1)
    assert rnd == eval_prompts([4, 2], vocab_size=50, real_text=False, seed=1)
    assert all(0 <= t < 50 for p in rnd for t in p)


# ------------------------------------------------------------------------------------------------------ driver


class FakeEngine:
    """One token per step for every request, in the order added: enough to watch the driver's bookkeeping."""

    def __init__(self):
        self.added: list[tuple[str, float]] = []  # (request id, arrival time) in the order the driver added them
        self.live: dict[str, SimpleNamespace] = {}

    def add_request(self, prompt, params, request_id=None, arrival_time=None):
        self.added.append((request_id, arrival_time))
        self.live[request_id] = SimpleNamespace(request_id=request_id, prompt_token_ids=list(prompt), finished=False,
                                                output_token_ids=[], token_times=[], arrival_time=arrival_time,
                                                want=params.max_new_tokens)
        return request_id

    def has_unfinished(self):
        return bool(self.live)

    def step(self):
        outs = []
        for rid, r in list(self.live.items()):
            r.output_token_ids.append(len(r.output_token_ids))
            r.token_times.append(time.perf_counter())
            r.finished = len(r.output_token_ids) == r.want
            if r.finished:
                del self.live[rid]
            outs.append(r)
        return outs


def test_driver_respects_arrival_order_and_collects_every_request():
    wl = make_workload(6, rate=200.0, prompt_len_dist="uniform:2:5", output_len_dist="uniform:1:4", seed=2)
    engine = FakeEngine()
    run = drive(engine, wl, realtime=True)
    assert [rid for rid, _ in engine.added] == [w.request_id for w in sorted(wl, key=lambda w: w.arrival_time)]
    added_at = [t for _, t in engine.added]
    assert added_at == sorted(added_at)
    assert [t - run.start for t in added_at] == pytest.approx(sorted(w.arrival_time for w in wl))
    assert list(run.outputs) == [w.request_id for w in wl]  # workload order
    assert run.output_token_ids == [list(range(w.output_len)) for w in wl]
    for times in run.times:
        assert times.token_times == sorted(times.token_times) and times.token_times[0] >= times.arrival
    assert run.output_tokens == sum(w.output_len for w in wl) and run.duration_s > 0 and run.cpu_s >= 0


def test_driver_feeds_a_tiny_engine_offline_and_online():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny")).eval()
    wl = make_workload(5, rate=100.0, prompt_len_dist="uniform:2:9", output_len_dist="uniform:1:6",
                       vocab_size=model.config.vocab_size, seed=4)
    for realtime in (False, True):
        llm = LLM(model, None, EngineConfig(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32))
        run = drive(llm, wl, realtime=realtime)
        assert not llm.has_unfinished()
        assert run.output_token_ids == [generate_ids(model, w.prompt_token_ids, w.params) for w in wl]
        for w, times in zip(wl, run.times):
            assert len(times.token_times) == w.output_len and times.token_times == sorted(times.token_times)
            assert times.prompt_len == len(w.prompt_token_ids)
        summary = run.summary()
        assert summary["completed"] == 5 and summary["total_output"] == sum(w.output_len for w in wl)


# ------------------------------------------------------------------------------------------------- same_tokens


def test_same_tokens_equal_mismatch_and_missing():
    ref = {"a": [1, 2], "b": [3], "c": [4, 5]}
    assert same_tokens(ref, dict(ref)) == SameTokens(3, 3, None)
    got = same_tokens(ref, {"a": [1, 2], "b": [9], "c": [4, 5]}, unit="requests")
    assert (got.equal, got.total, got.first_mismatch, got.ok) == (2, 3, "b", False)
    assert got.check == "identical tokens, 2/3 requests"
    missing = same_tokens(ref, {"a": [1, 2], "b": [3]})
    assert (missing.equal, missing.first_mismatch) == (2, "c")


def test_same_tokens_on_lists_and_several_candidates():
    ref = [[1], [2, 3], [4]]
    assert same_tokens(ref, [[1], [2, 3], [4]]).check == "identical tokens, 3/3 prompts"
    assert same_tokens(ref, [[1], [2, 3]]).first_mismatch == 2  # a shorter candidate misses the last prompt
    three = same_tokens(ref, [[1], [2, 3], [4]], [[1], [2, 4], [4]])
    assert (three.equal, three.first_mismatch) == (2, 1)  # equal only where every candidate agrees
    assert same_tokens([], []).ok and same_tokens([], []).total == 0
    with pytest.raises(ValueError, match="candidate"):
        same_tokens(ref)
    assert math.isclose(same_tokens(ref, ref).equal / 3, 1.0)

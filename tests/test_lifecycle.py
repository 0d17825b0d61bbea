"""One request lifecycle for every loop: `start_request` builds a `RequestState`, `accept` decides when it is over.

The state is tested by hand (one token, several tokens at once as chapter 08's speculative decoding will hand it,
stop strings across tokens, the context window); then every loop is shown to start its requests through the one
function, and chapter 06's `LLM` and chapter 07's `DisaggregatedLLM` to share one front end.
"""

from __future__ import annotations

import pytest
import torch

import minillm.core.stopping as stopping
import minillm.disagg.prefill_worker as prefill_worker
import minillm.engine.frontend as frontend
import minillm.kvcache.generate as kvcache_generate
import minillm.naive.generate as naive_generate
import minillm.paged.generate as paged_generate
from minillm.core.config import GPTConfig
from minillm.core.model import GPT
from minillm.core.sampling import SamplingParams
from minillm.core.stopping import RequestState, StopChecker, start_request
from minillm.disagg.decode_worker import DecodeCore
from minillm.disagg.llm import DisaggregatedLLM
from minillm.disagg.messages import FirstTokens, PrefillRequest, WorkerInit
from minillm.disagg.prefill_worker import PrefillCore
from minillm.engine import LLM, EngineConfig
from minillm.engine.frontend import FrontEnd

CFG = GPTConfig.from_name("tiny", vocab_size=64)  # block_size 64


class CharTokenizer:
    """Each id decodes to one letter: enough to test stop strings without the real tokenizer."""

    eot_token = None

    def decode(self, ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def tiny_model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG).eval()


# ------------------------------------------------------------------------------------------ the state by hand


def test_accept_one_token_at_a_time():
    state = start_request(CFG, [1, 2, 3], SamplingParams.greedy(3), eos_id=9)
    assert state.prompt_ids == [1, 2, 3] and state.params.max_new_tokens == 3 and state.generator is None
    assert not state.accept([5]) and not state.accept([6])
    assert state.accept([7]) and state.finish_reason == "length"
    assert state.output_ids == [5, 6, 7] and state.num_tokens == 6
    with pytest.raises(RuntimeError, match="after the request finished"):
        state.accept([8])


def test_accept_several_tokens_stops_at_the_first_that_finishes():
    """Speculative decoding hands k accepted tokens at once: [4, 9, 5] with eos 9 keeps 4 and 9, drops 5."""
    state = start_request(CFG, [1], SamplingParams.greedy(10), eos_id=9)
    assert not state.accept([2, 3])
    assert state.accept([4, 9, 5]) and state.finish_reason == "eos"
    assert state.output_ids == [2, 3, 4, 9]
    capped = start_request(CFG, [1], SamplingParams.greedy(3, ignore_eos=True), eos_id=9)
    assert capped.accept([9, 9, 9, 9, 9]) and capped.finish_reason == "length" and capped.output_ids == [9, 9, 9]


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_accept_in_chunks_equals_one_at_a_time(chunk):
    tok = CharTokenizer()
    tokens = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    params = SamplingParams.greedy(10, stop=("efg",))
    one = start_request(CFG, [1], params, tok)
    for t in tokens:
        if one.accept([t]):
            break
    many = start_request(CFG, [1], params, tok)
    for i in range(0, len(tokens), chunk):
        if many.accept(tokens[i:i + chunk]):
            break
    assert many.output_ids == one.output_ids == [0, 1, 2, 3, 4, 5, 6]
    assert many.finish_reason == one.finish_reason == "stop"


def test_stop_string_spanning_tokens_is_cut_from_the_text():
    tok = CharTokenizer()
    state = start_request(CFG, [1], SamplingParams.greedy(20, stop=("cde", "zz")), tok)
    assert not state.accept([0, 1, 2, 3])  # "abcd": "cde" not complete yet
    assert state.accept([4, 5]) and state.finish_reason == "stop"  # "e" completes it; 5 is dropped
    assert state.output_ids == [0, 1, 2, 3, 4] and state.output_text() == "ab"


def test_the_context_window_caps_generation():
    """prompt_len + n - 1 tokens are fed to produce n, so block_size - prompt_len + 1 new tokens fit."""
    block = CFG.block_size
    state = start_request(CFG, list(range(block - 2)), SamplingParams.greedy(50))
    assert state.params.max_new_tokens == 3
    assert not state.accept([1, 1]) and state.accept([1]) and state.finish_reason == "length"
    full = start_request(CFG, [1] * block, SamplingParams.greedy(50))
    assert full.accept([1]) and full.output_ids == [1]
    with pytest.raises(ValueError, match=f"{block + 1} tokens, more than the context window"):
        start_request(CFG, [1] * (block + 1), SamplingParams.greedy(1))
    long_prompt = [i % 50 for i in range(block + 5)]
    kept = start_request(CFG, long_prompt, SamplingParams.greedy(4), truncate=True)
    assert kept.prompt_ids == long_prompt[-(block - 3):] and kept.params.max_new_tokens == 4


def test_nothing_to_generate_is_finished_on_arrival():
    state = start_request(CFG, [1, 2], SamplingParams.greedy(0))
    assert state.finished and state.finish_reason == "length" and state.output_ids == []


def test_start_request_checks_and_seeds():
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        start_request(CFG, [], SamplingParams.greedy(2))
    with pytest.raises(ValueError, match=r"prompt_ids\[1\] = 64 is outside"):
        start_request(CFG, [1, 64], SamplingParams.greedy(2))
    with pytest.raises(ValueError, match="need a tokenizer"):
        start_request(CFG, [1], SamplingParams.greedy(2, stop=("x",)))
    with pytest.raises(TypeError, match="GPTConfig"):
        start_request("tiny", [1], SamplingParams.greedy(2))
    a = start_request(CFG, [1], SamplingParams(max_new_tokens=2, seed=5))
    b = start_request(CFG, [1], SamplingParams(max_new_tokens=2, seed=5))
    assert torch.equal(torch.rand(3, generator=a.generator), torch.rand(3, generator=b.generator))
    sibling = a.fork(6)  # chapter 05's sample i of n: same prompt and params, its own seed, no output
    assert sibling.prompt_ids == a.prompt_ids and sibling.params is a.params and sibling.output_ids == []
    assert torch.equal(torch.rand(3, generator=sibling.generator),
                       torch.rand(3, generator=torch.Generator().manual_seed(6)))


def test_the_state_keeps_stop_checker_semantics():
    """RequestState.accept([t]) and StopChecker.update(t) agree token for token (eos wins over a stop string)."""
    tok = CharTokenizer()
    params = SamplingParams.greedy(5, stop=("b",))
    state = start_request(CFG, [1], params, tok, eos_id=1)
    checker = StopChecker(tok, state.params, eos_id=1)
    assert state.accept([1]) == checker.update(1) is True
    assert state.finish_reason == checker.finish_reason == "eos"


# ------------------------------------------------------------------------------------------ every loop uses it


@pytest.fixture
def spy(monkeypatch):
    """Replace start_request in every module that starts requests; record who called it."""
    calls: list[str] = []
    real = stopping.start_request

    def make(name):
        def spying(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        return spying

    for module in (naive_generate, kvcache_generate, paged_generate, frontend, prefill_worker):
        assert module.start_request is real  # imported from the one place, not redefined
        monkeypatch.setattr(module, "start_request", make(module.__name__))
    return calls


def test_every_loop_starts_its_requests_with_start_request(spy):
    model = tiny_model()
    params = SamplingParams.greedy(4, ignore_eos=True)
    prompt = [1, 2, 3, 4, 5]
    expected = naive_generate.generate_naive_ids(model, prompt, params)
    assert spy == ["minillm.naive.generate"]

    spy.clear()
    assert kvcache_generate.generate_ids(model, prompt, params) == expected
    assert kvcache_generate.generate_static_batch(model, [prompt, [7, 8]], params)[0] == expected
    assert spy == ["minillm.kvcache.generate"] * 3

    spy.clear()
    assert paged_generate.paged_generate(model, prompt, params, block_size=4).token_ids == [expected]
    assert spy == ["minillm.paged.generate"]

    spy.clear()
    llm = LLM(model, None, EngineConfig(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=64))
    assert llm.generate([prompt], params)[0].output_token_ids == expected
    assert spy == ["minillm.engine.frontend"]

    spy.clear()
    init = dict(model=b"", model_sha256="", device="cpu", num_blocks=32, block_size=4, max_num_seqs=4,
                max_num_batched_tokens=64, eos_id=None, heartbeat_s=0.5, num_threads=0)
    prefill = PrefillCore(model, WorkerInit(role="prefill", **init))
    decode = DecodeCore(model, WorkerInit(role="decode", **init))
    prefill.handle(PrefillRequest("r", prompt, params))
    got = []
    for dest, msg in prefill.step():
        if isinstance(msg, FirstTokens):
            got += [t for _, t, _ in msg.items]
        else:
            decode.handle(msg)
    while decode.has_work():
        for _, msg in decode.step():
            got += [t for _, t, _ in msg.items]
    assert got == expected
    assert spy == ["minillm.disagg.prefill_worker"] * 2  # both workers, through start_worker_request


def test_llm_and_disaggregated_llm_share_one_front_end():
    for cls in (LLM, DisaggregatedLLM):
        assert issubclass(cls, FrontEnd)
        for name in ("add_request", "generate", "_new_request", "_admit", "_output", "_encode"):
            assert getattr(cls, name) is getattr(FrontEnd, name), (cls.__name__, name)


def test_the_engine_request_holds_its_state():
    model = tiny_model()
    llm = LLM(model, CharTokenizer(), EngineConfig(num_blocks=32, block_size=4, max_num_seqs=4,
                                                   max_num_batched_tokens=64))
    rid = llm.add_request([1, 2, 3], SamplingParams(max_new_tokens=3, seed=1))
    req = llm._requests[rid]
    assert isinstance(req.state, RequestState) and req.output_token_ids is req.state.output_ids
    assert req.generator is req.state.generator is not None
    while llm.has_unfinished():
        llm.step()
    assert req.is_finished and req.finish_reason == req.state.finish_reason == "length"
    assert len(req.token_times) == len(req.output_token_ids) == 3

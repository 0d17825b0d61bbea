"""Chapter 15: the engine core in a process of its own (`--engine-core process`, what `minillm serve` runs).

The same checks as on a thread, through the pipe: the official client gets the offline engine's text, streams end
and give their blocks back, aborts, stops and drains reach the other process, and a dead engine process ends every
request with an error instead of hanging them, and turns `/health` to 503. Servers listen on 127.0.0.1 only; every
engine process is stopped by its test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import httpx
import openai
import pytest
from helpers import long_stream_in_background

from minillm.bench.models import load_model
from minillm.core.sampling import SamplingParams
from minillm.engine import LLM, EngineConfig
from minillm.engine.process import WorkerDiedError
from minillm.serve.app import Server, ServerThread, ServeOptions
from minillm.serve.async_engine import wait_until
from minillm.serve.engine_process import AddRequest, EngineProcess, EngineWorker, StepOutputs
from minillm.serve.metrics import parse_metrics
from minillm.serve.protocol import render_chat
from minillm.serve.tour import CASES, client_texts  # the tour's client-equals-offline requests
from minillm.tokenizer import load_tokenizer

MODEL = "base"
NUM_BLOCKS = 128
BUILD = dict(model=MODEL, num_blocks=NUM_BLOCKS, max_num_seqs=32)


@pytest.fixture(scope="module")
def loaded():
    return load_model(MODEL)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _offline_outputs(loaded, prompt, params: SamplingParams) -> list:
    engine = LLM(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=NUM_BLOCKS))
    return sorted(engine.generate([prompt], params), key=lambda o: o.index)


def _offline(loaded, prompt, params: SamplingParams) -> list[str]:
    return [o.text for o in _offline_outputs(loaded, prompt, params)]


def _idle(srv: Server, url: str, timeout: float = 30.0) -> None:
    """Nothing in flight, and the engine process's last snapshot (sent when it went idle) shows the pool full."""
    assert wait_until(lambda: srv.engine.num_in_flight == 0 and srv.engine.queued_requests == 0, timeout)
    assert wait_until(lambda: srv.engine.snapshot.num_free_blocks == NUM_BLOCKS
                      and srv.engine.snapshot.running + srv.engine.snapshot.waiting == 0, timeout)
    values = parse_metrics(httpx.get(url + "/metrics", timeout=30).text)
    assert values["minillm_kv_blocks_used"] == 0 and values["minillm_queued_tokens"] == 0


@pytest.fixture(scope="module")
def served():
    """One server whose engine runs in a child process; tests that share it leave it idle."""
    srv = Server(EngineProcess(BUILD, threads=1), load_tokenizer(), ServeOptions(model_name=MODEL))
    with ServerThread(srv) as thread:
        yield srv, thread.url
    assert not srv.engine.process.handle.process.is_alive()  # leaving the server stopped its engine process




@pytest.mark.parametrize("case", CASES, ids=["greedy", "stop", "seeded-n2", "chat"])
def test_streamed_and_whole_equal_the_offline_engine(served, loaded, case):
    srv, url = served
    body, params, chat = case
    whole, got, streamed = client_texts(_client(url), body, chat)
    prompt = render_chat(body["messages"]) if chat else body["prompt"]
    want = _offline_outputs(loaded, prompt, params)
    assert got == streamed == [o.text for o in want]
    assert whole.usage.completion_tokens == sum(len(o.output_token_ids) for o in want)
    _idle(srv, url)


def test_fifty_concurrent_streams_complete_and_the_pool_is_full_again(served, loaded):
    srv, url = served
    results: dict[int, str] = {}

    def one(i: int) -> None:
        chunks = _client(url).completions.create(model=MODEL, prompt=f"def f{i}(", max_tokens=8, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        results[i] = "".join(c.choices[0].text for c in chunks)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results) == list(range(50))
    assert results[7] == _offline(loaded, "def f7(", SamplingParams.greedy(8, ignore_eos=True))[0]
    _idle(srv, url)
    values = parse_metrics(httpx.get(url + "/metrics", timeout=30).text)
    assert values["minillm_engine_steps_total"] > 0 and values["minillm_num_requests_running"] == 0


def test_a_disconnect_aborts_in_the_engine_process(served):
    srv, url = served
    body = {"model": MODEL, "prompt": "def main(", "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    before = parse_metrics(httpx.get(url + "/metrics", timeout=30).text)["minillm_generation_tokens_total"]
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert srv.engine.num_in_flight == 1
    _idle(srv, url)  # aborted long before its 200 tokens: every block back in the other process's pool
    after = parse_metrics(httpx.get(url + "/metrics", timeout=30).text)
    assert after['minillm_requests_total{outcome="disconnected"}'] >= 1
    assert after["minillm_generation_tokens_total"] - before < 200


def test_stopping_the_server_aborts_what_runs_and_ends_the_engine_process():
    srv = Server(EngineProcess(BUILD, threads=1), load_tokenizer(),
                 ServeOptions(model_name=MODEL, shutdown_timeout=0.2))
    with ServerThread(srv) as thread:
        t, result = long_stream_in_background(thread.url, 250)
        assert wait_until(lambda: srv.engine.num_in_flight == 1, 30)
    t.join(60)
    events = [e[6:] for e in result["r"].text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "server_shutdown"
    assert srv.engine.num_in_flight == 0 and srv.engine.queued_requests == 0
    assert not srv.engine.process.handle.process.is_alive()


def test_a_dead_engine_process_ends_every_request_and_the_server_says_so():
    """SIGKILL the engine process mid-stream: the stream ends with an error event (no hang), /health is 503
    naming the failure, and new requests get 503 at once."""
    srv = Server(EngineProcess(BUILD, threads=1, liveness_timeout_s=30), load_tokenizer(),
                 ServeOptions(model_name=MODEL))
    with ServerThread(srv) as thread:
        body = {"model": MODEL, "prompt": "def main(", "max_tokens": 250, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", thread.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(srv.engine.process.handle.process.pid, signal.SIGKILL)
            rest = [x for x in lines if x.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][6:])["error"]
        assert "engine process" in error["message"] and "killed by signal 9" in error["message"]
        health = httpx.get(thread.url + "/health", timeout=30)
        assert health.status_code == 503 and health.json()["status"] == "failed"
        r = httpx.post(thread.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=30)
        assert r.status_code == 503 and "engine process" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "engine_failed" and r.json()["error"]["param"] is None
        assert srv.engine.num_in_flight == 0 and srv.engine.queued_requests == 0
        # the gauges no longer show the dead engine's last requests and blocks; the dashboard says it failed
        values = parse_metrics(httpx.get(thread.url + "/metrics", timeout=30).text)
        assert values["minillm_num_requests_running"] == 0 and values["minillm_kv_blocks_used"] == 0
        assert httpx.get(thread.url + "/dashboard/state", timeout=30).json()["status"] == "failed"


def test_an_engine_that_cannot_be_built_fails_at_start_naming_why():
    with pytest.raises(WorkerDiedError, match="quantize must be one of"):
        EngineProcess(dict(BUILD, quantize="int3"), threads=1)
    with pytest.raises(TypeError, match="plain data"):
        EngineProcess(dict(BUILD, model=object()))
    with pytest.raises(ValueError, match="threads"):
        EngineProcess(BUILD, threads=0)


def test_the_worker_refuses_a_bad_request_with_one_error_per_sample(loaded):
    """In-process: the engine process's core turns a request its engine refuses into a final error output per
    sample, so the server's stream ends instead of waiting for outputs that never come."""
    worker = EngineWorker(LLM(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=NUM_BLOCKS)))
    assert worker.has_work()
    info = worker.step()[0][1]
    assert (info.context_length, info.vocab_size) == (loaded.model.config.block_size,
                                                      loaded.model.config.vocab_size)
    worker.handle(AddRequest("bad", [loaded.model.config.vocab_size + 5], SamplingParams(n=2, seed=1), 0.0))
    worker.handle(AddRequest("good", loaded.tokenizer.encode("def main("), SamplingParams.greedy(4), 0.0))
    outputs: list = []
    while worker.has_work():
        for dest, msg in worker.step():
            assert dest == "ctrl" and isinstance(msg, StepOutputs)
            outputs += msg.outputs
    bad = [o for o in outputs if o.request_id == "bad"]
    assert sorted(o.index for o in bad) == [0, 1]
    assert all(o.finished and o.finish_reason == "error" and "'bad'" in o.error for o in bad)
    good = [o for o in outputs if o.request_id == "good" and o.finished]
    assert len(good) == 1 and good[0].text == _offline(loaded, "def main(", SamplingParams.greedy(4))[0]
    assert msg.snapshot is not None and msg.snapshot.num_free_blocks == NUM_BLOCKS  # idle: its state is sent


def test_what_the_engine_would_refuse_is_a_400_before_the_response_starts():
    """Speculative decoding runs one sample per request: n=2 reached the engine process, which refused it after
    the response had started (a 500, or an error event in a 200 stream), where the thread placement said 400.
    The server now knows the engine's limits from the engine process's first message and answers 400 first."""
    srv = Server(EngineProcess(dict(BUILD, speculative="prompt-lookup"), threads=1), load_tokenizer(),
                 ServeOptions(model_name=MODEL))
    with ServerThread(srv) as thread:
        for stream in (False, True):
            r = httpx.post(thread.url + "/v1/completions", timeout=30, json={"model": MODEL, "prompt": "x", "n": 2,
                                                                            "max_tokens": 4, "stream": stream})
            assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        r = httpx.post(thread.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4},
                       timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")
        _idle(srv, thread.url)


def test_an_engine_that_cannot_start_is_one_line_from_the_command():
    proc = subprocess.run([sys.executable, "-m", "minillm", "serve", "--port", "0", "--threads", "1",
                           "--no-chunked-prefill", "--max-num-batched-tokens", "64"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("minillm serve: the engine could not start:") and "max_num_batched_tokens" in proc.stderr


@pytest.mark.slow
def test_a_tensor_parallel_engine_runs_in_the_engine_process(loaded):
    """The engine process starts rank processes of its own (chapter 14): it is not daemonic, and still stopped."""
    srv = Server(EngineProcess(dict(BUILD, tensor_parallel_size=2), threads=1), load_tokenizer(),
                 ServeOptions(model_name=MODEL))
    with ServerThread(srv) as thread:
        chunks = _client(thread.url).completions.create(model=MODEL, prompt="def main(", max_tokens=16,
                                                        temperature=0, stream=True, extra_body={"ignore_eos": True})
        text = "".join(c.choices[0].text for c in chunks)
        _idle(srv, thread.url)
    assert text == _offline(loaded, "def main(", SamplingParams.greedy(16, ignore_eos=True))[0]
    assert not srv.engine.process.handle.process.is_alive()

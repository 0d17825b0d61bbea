"""Tour entry for chapter 15: the engine behind the OpenAI API, with the official `openai` client as the user.

Checks: every request the official client sends (completions and chat, streamed and not, greedy, with stop
strings, seeded sampling with n = 2) gets the offline engine's text for the same request, bad requests get a 400
naming the field, and the pool is full again afterwards. Measured, with the server in a child process (its own
interpreter, as deployed) and the load generator in this one: the output throughput of 32 concurrent streams
against the offline engine on the same prompts (the served text equal to the offline text), with the engine core in
a process of its own and, beside it, on the server's thread; and goodput at an SLO pair under Poisson arrivals,
with the report's metrics recomputed from its recorded chunk timestamps.
"""

from __future__ import annotations

import statistics
from typing import Any

import httpx
import openai

from minillm.bench.models import load_model
from minillm.core.config import check_instance
from minillm.core.rows import Row, TourContext
from minillm.core.sampling import SamplingParams
from minillm.engine import LLM, EngineConfig
from minillm.serve.app import Server, ServerThread, ServeOptions
from minillm.serve.cli import ServerProcess
from minillm.serve.bench import throughput
from minillm.serve.loadgen import SLO, compute_metrics, make_workload, records_from_report, run_benchmark
from minillm.serve.metrics import parse_metrics
from minillm.serve.protocol import CHAT_STOP, render_chat

TITLE = "serving behind the OpenAI API"
MODEL = "base"
CONCURRENCY = 32  # concurrent streams of the throughput row
SLO_PAIR = SLO(ttft_s=0.5, tpot_s=0.05)  # the goodput row's objectives (see the chapter for how they were chosen)
NUM_BLOCKS = 512

# (request body without model, the matching SamplingParams, chat?) for the client-equals-offline check
CASES = [
    (dict(prompt="def main(", max_tokens=24, temperature=0), SamplingParams.greedy(24), False),
    (dict(prompt="import os\nimport sys\n", max_tokens=40, temperature=0, stop=["\n\n"]),
     SamplingParams.greedy(40, stop=("\n\n",)), False),
    (dict(prompt="class Model:", max_tokens=16, temperature=0.9, top_p=0.95, seed=7, n=2),
     SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=7, n=2), False),
    (dict(messages=[{"role": "user", "content": "Write a loop."}], max_tokens=20, temperature=0),
     SamplingParams.greedy(20, stop=(CHAT_STOP,)), True),
]


def client_texts(client: openai.OpenAI, body: dict, chat: bool) -> tuple[Any, list[str], list[str]]:
    """Send `body` (without model) through the official client, whole and streamed: (the whole response, its
    choices' texts by index, the streamed texts by index)."""
    check_instance("client", client, openai.OpenAI, "an openai.OpenAI client")
    check_instance("body", body, dict, "a request body (a dict)")
    check_instance("chat", chat, bool, "a bool")
    create = client.chat.completions.create if chat else client.completions.create
    whole = create(model=MODEL, **body)
    got = [(c.message.content if chat else c.text) for c in sorted(whole.choices, key=lambda c: c.index)]
    streamed = [""] * body.get("n", 1)
    for chunk in create(model=MODEL, stream=True, **body):
        for c in chunk.choices:
            streamed[c.index] += (c.delta.content or "") if chat else c.text
    return whole, got, streamed


def _client_equals_offline(ctx: TourContext, loaded) -> Row:
    model, tok = loaded.model, loaded.tokenizer
    srv = Server(LLM(model, tok, EngineConfig(num_blocks=256)), tok, ServeOptions(model_name=MODEL))
    offline = LLM(model, tok, EngineConfig(num_blocks=256))
    same, compared = True, 0
    with ServerThread(srv) as thread:
        client = openai.OpenAI(base_url=thread.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for body, params, chat in CASES:
            n = body.get("n", 1)
            prompt = render_chat(body["messages"]) if chat else body["prompt"]
            want = [o.text for o in sorted(offline.generate([prompt], params), key=lambda o: o.index)]
            whole, got, streamed = client_texts(client, body, chat)
            same &= got == streamed == want
            compared += 2 * n
        bad = httpx.post(thread.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "temperature": 7},
                         timeout=30)
        too_long = httpx.post(thread.url + "/v1/completions", timeout=30,
                              json={"model": MODEL, "prompt": "x", "max_tokens": 10_000})
        named = bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
        context = too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
        values = parse_metrics(httpx.get(thread.url + "/metrics", timeout=30).text)
        ttft = values["minillm_time_to_first_token_seconds_sum"] / values["minillm_time_to_first_token_seconds_count"]
    engine = srv.engine.engine
    free = engine.block_manager.num_free_blocks == engine.config.num_blocks
    return Row("15", "OpenAI client, streamed = offline", "the offline engine (LLM.generate)",
               "minillm serve (FastAPI + uvicorn, engine core on its own thread)",
               f"{compared} completions (greedy, stop, seeded n=2, chat; streamed and not) == offline: {same}; "
               f"bad temperature -> 400 naming it: {named}; too long -> context_length_exceeded: {context}; "
               f"pool full after: {free}", same and named and context and free, "server TTFT (mean)", 1e3 * ttft,
               "ms", ctx.device.type, {"compared": compared})


def _throughput(ctx: TourContext, loaded, urls: dict[str, str], rounds: int) -> Row:
    """Output throughput of 32 streams against the offline engine, for each engine core placement in `urls`
    ("process" is the row's value; "thread" is shown beside it), interleaved round by round (the benchmark's
    `throughput`)."""
    n = 32 if ctx.quick else 64
    t = throughput(loaded, urls, n, CONCURRENCY, rounds, ctx.seed)
    served = {core: statistics.median(tput) for core, tput in t["served_tok_s"].items()}
    same = all(k == n for k in t["same_texts"].values())
    errors = sum(t["errors"].values())
    used = sum(t["kv_blocks_used"].values())
    ok = same and errors == 0 and not used
    beside = "".join(f"; engine core on the server's thread instead: {served[core]:.0f} tok/s, "
                     f"{t['ratios'][core]:.2f}x" for core in urls if core != "process")
    return Row("15", f"serving throughput, {CONCURRENCY} concurrent streams", "offline engine, same prompts",
               "minillm serve, engine core in its own process, the official openai client",
               f"{n} requests x {t['output_len']} tokens, {rounds} interleaved rounds: offline "
               f"{statistics.median(t['offline_tok_s']):.0f} tok/s, served {served['process']:.0f} tok/s{beside}; "
               f"served text == offline: {same}; errors: {errors}; KV blocks in use after: {used:.0f}", ok,
               "throughput vs offline", t["ratios"]["process"], "x", ctx.device.type,
               {"offline_tok_s": t["offline_tok_s"], "served_tok_s": t["served_tok_s"], "ratios": t["ratios"],
                "metrics": t["metrics"]["process"]})


def _goodput(ctx: TourContext, loaded, url: str) -> Row:
    n = 24 if ctx.quick else 48
    rate = 8.0
    workload = make_workload("default", num_prompts=n, output_len=32, seed=ctx.seed + 1, tokenizer=loaded.tokenizer)
    report = run_benchmark(url, workload, model=MODEL, rate=rate, slo=SLO_PAIR, timeout=120)
    m = report["metrics"]
    again = compute_metrics(records_from_report(report), m["duration_s"], SLO_PAIR)
    consistent = again == m
    ok = consistent and m["failed"] == 0
    return Row("15", f"goodput at SLO (Poisson, {rate:g} req/s)", "request throughput",
               f"TTFT <= {SLO_PAIR.ttft_s * 1e3:.0f} ms and TPOT <= {SLO_PAIR.tpot_s * 1e3:.0f} ms",
               f"{n} requests: {m['request_throughput']:.2f} req/s served, SLO attainment "
               f"{100 * m['slo_attainment']:.0f}%, TTFT p90 {m['ttft_ms']['p90']:.0f} ms, TPOT p90 "
               f"{m['tpot_ms']['p90']:.1f} ms; metrics recomputed from the chunk timestamps == report: {consistent}; "
               f"errors: {m['failed']}", ok, "goodput", m["goodput"], "req/s", ctx.device.type,
               {"metrics": m, "slo": vars(SLO_PAIR)})


def run(ctx: TourContext) -> list[Row]:
    loaded = load_model(MODEL, ctx.device, ctx.seed)
    rows = [_client_equals_offline(ctx, loaded)]
    args = ["--num-blocks", str(NUM_BLOCKS), "--max-num-seqs", str(CONCURRENCY), "--device", ctx.device.type]
    with ServerProcess(args, threads=ctx.threads) as url:
        with ServerProcess(args + ["--engine-core", "thread"], threads=ctx.threads) as thread_url:
            rows.append(_throughput(ctx, loaded, {"process": url, "thread": thread_url},
                                    rounds=2 if ctx.quick else 3))
        rows.append(_goodput(ctx, loaded, url))
    return rows

"""Chapter 15: the serving benchmark (`minillm bench-serve`). Metrics recomputed by hand from a real run's chunk
timestamps, arrivals, concurrency, 429s, goodput search, plots and the command line (the graded tests of its two
exercises, `percentile` and `goodput`, are in the chapter's test file, tests/test_15_serving.py).

The real runs are short (a few requests of a few tokens) against in-process servers on loopback. No test asserts a
speed: only what was recorded and what follows from it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math

import httpx
import numpy as np
import pytest
from helpers import hand_record
from matplotlib.figure import Figure

from minillm.bench.models import load_model
from minillm.core.corpus import SEPARATOR
from minillm.engine import LLM, EngineConfig
from minillm.serve import loadgen as L
from minillm.serve.app import Server, ServeOptions, ServerThread
from minillm.serve.loadgen import SLO, RequestRecord, goodput, percentile
from minillm.serve.plots import plot_frontier, plot_latency_cdfs

OUTPUT_LEN = 8  # tokens per request in the real runs


class AdmissionProbe:
    """Counts what reaches the server's admission (every HTTP completion request that was parsed, admitted or
    refused) and the peak of requests the engine holds right after each admission.

    The engine's count drops when a request's last output is produced, before the client reads [DONE], so it
    never exceeds what the client has in flight: a peak above C would prove the client overran its limit."""

    def __init__(self, server: Server):
        self.engine = server.engine
        self.original = server.engine.submit
        self.attempts = 0
        self.peak = 0
        server.engine.submit = self.submit

    def submit(self, *args, **kwargs):
        self.attempts += 1
        stream = self.original(*args, **kwargs)  # raises RequestError 429 when full (then nothing was admitted)
        self.peak = max(self.peak, self.engine.queued_requests)
        return stream

    def reset(self) -> None:
        self.attempts = self.peak = 0


def _server(max_queued_requests: int = 256) -> tuple[Server, AdmissionProbe]:
    m = load_model("base")
    server = Server(LLM(m.model, m.tokenizer, EngineConfig(num_blocks=256)), m.tokenizer,
                    ServeOptions(model_name="base", max_queued_requests=max_queued_requests))
    return server, AdmissionProbe(server)


@pytest.fixture(scope="module")
def served():
    server, probe = _server()
    with ServerThread(server) as thread:
        yield thread.url, probe


@pytest.fixture(scope="module")
def workload():
    return L.make_workload("default", 6, (16, 48), OUTPUT_LEN, seed=3)


@pytest.fixture(scope="module")
def report(served, workload):
    url, _ = served
    return L.run_benchmark(url, workload, concurrency=3, backend="openai", slo=SLO(ttft_s=5.0, tpot_s=1.0))


# ----- a real run: every metric recomputed by hand from the recorded chunk times -----------------------------------


def test_metrics_recomputed_by_hand_from_chunk_timestamps(report, workload):
    records = report["records"]
    assert len(records) == len(workload) and all(r["success"] for r in records)
    assert all(r["output_tokens"] == OUTPUT_LEN for r in records)  # ignore_eos: fixed lengths, counted by usage
    assert all(r["prompt_len"] == n for r, n in zip(records, workload.prompt_lens))  # the server counted the same
    ttft, tpot, itl, e2e = [], [], [], []
    for r in records:
        chunks = r["chunk_s"]
        assert chunks == sorted(chunks) and r["text"] and chunks[0] >= r["send_s"] >= r["scheduled_s"]
        ttft.append(chunks[0] - r["send_s"])
        e2e.append(chunks[-1] - r["send_s"])
        tpot.append((e2e[-1] - ttft[-1]) / (r["output_tokens"] - 1))
        itl.extend(b - a for a, b in zip(chunks, chunks[1:]))
    m = report["metrics"]
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        ms = np.asarray(values) * 1e3
        stats = m[f"{name}_ms"]
        assert stats["mean"] == pytest.approx(ms.mean(), rel=1e-9)
        assert stats["std"] == pytest.approx(ms.std(), rel=1e-9, abs=1e-9)
        for q in (50, 90, 99):
            assert stats[f"p{q}"] == pytest.approx(np.percentile(ms, q), rel=1e-9)
    duration = max(r["done_s"] for r in records)
    assert m["duration_s"] == pytest.approx(duration)
    assert m["completed"] == len(records) and m["failed"] == 0 and m["errors"] == {}
    assert m["request_throughput"] == pytest.approx(len(records) / duration)
    assert m["output_throughput"] == pytest.approx(OUTPUT_LEN * len(records) / duration)
    assert m["total_token_throughput"] == pytest.approx((sum(workload.prompt_lens) + OUTPUT_LEN * len(records))
                                                        / duration)
    meets = sum(a <= 5.0 and b <= 1.0 for a, b in zip(ttft, tpot))
    assert m["goodput"] == pytest.approx(meets / duration)
    assert m["slo_attainment"] == pytest.approx(meets / len(records))


def test_report_is_json_and_its_metrics_can_be_recomputed(report):
    back = json.loads(json.dumps(report, allow_nan=False))
    assert back["config"]["request_rate"] == "inf" and back["config"]["max_concurrency"] == 3
    again = L.compute_metrics(L.records_from_report(back), back["metrics"]["duration_s"], SLO(ttft_s=5.0, tpot_s=1.0))
    assert again == back["metrics"]
    assert report["peak_in_flight"] <= 3


def test_both_backends_stream_the_same_text(served, workload):
    url, _ = served
    one = L.Workload("default", workload.prompts[:2], workload.prompt_lens[:2], [OUTPUT_LEN] * 2, 0)
    texts = {}
    for backend in L.BACKENDS:  # one at a time (C = 1): the same steps, so greedy gives the same tokens
        rep = L.run_benchmark(url, one, concurrency=1, backend=backend)
        assert rep["metrics"]["completed"] == 2
        texts[backend] = [r["text"] for r in rep["records"]]
        assert all(len(r["chunk_s"]) >= 1 for r in rep["records"])
    assert texts["openai"] == texts["http"]


def test_run_benchmark_works_inside_a_running_event_loop(served, workload):
    url, _ = served
    one = L.Workload("default", workload.prompts[:1], workload.prompt_lens[:1], [2], 0)

    async def notebook_cell():  # Jupyter runs cells inside its own event loop, where asyncio.run refuses
        return L.run_benchmark(url, one, warmup=False)

    assert asyncio.run(notebook_cell())["metrics"]["completed"] == 1


def test_fixed_concurrency_never_exceeds_c(served):
    url, probe = served
    wl = L.make_workload("default", 10, (16, 32), 6, seed=5)
    probe.reset()
    rep = L.run_benchmark(url, wl, concurrency=2, warmup=False)
    assert rep["metrics"]["completed"] == 10
    assert probe.attempts == 10 and probe.peak == 2  # the server never held more than C (and did reach C)
    assert rep["peak_in_flight"] == 2
    # from the records: at any send, at most C requests (this one included) have been sent and not yet ended
    for r in rep["records"]:
        overlapping = [o for o in rep["records"] if o["send_s"] <= r["send_s"] < o["done_s"]]
        assert len(overlapping) <= 2


def test_429s_are_counted_by_type_and_never_retried():
    server, probe = _server(max_queued_requests=2)
    wl = L.make_workload("default", 8, (16, 32), OUTPUT_LEN, seed=1)
    with ServerThread(server) as thread:
        for backend in L.BACKENDS:
            probe.reset()
            rep = L.run_benchmark(thread.url, wl, backend=backend, warmup=False)  # rate inf: a burst of 8
            m = rep["metrics"]
            refused = m["errors"].get("429", 0)
            assert refused >= 1 and set(m["errors"]) == {"429"}
            assert m["completed"] + refused == 8 and m["failed"] == refused
            assert probe.attempts == 8  # every request reached the server exactly once: no retry
            for r in rep["records"]:
                assert r["success"] or (r["error"] == "429" and r["chunk_s"] == [] and r["output_tokens"] == 0)
            assert m["total_output_tokens"] == OUTPUT_LEN * m["completed"]


def test_every_request_and_the_run_are_bounded_in_time(served):
    url, _ = served
    wl = L.make_workload("default", 2, (16, 32), 120, seed=2)
    rep = L.run_benchmark(url, wl, timeout=0.05, warmup=False)  # 120 tokens take far longer than 50 ms
    assert rep["metrics"]["errors"] == {"timeout": 2} and rep["metrics"]["ttft_ms"] is None
    wl3 = L.make_workload("default", 3, (16, 32), 120, seed=2)
    rep = L.run_benchmark(url, wl3, rate=0.1, warmup=False, max_duration=0.3)  # gaps of ~10 s: one sent
    errors = [r["error"] for r in rep["records"]]
    assert errors[0] == "cancelled" and errors[1:] == ["not_sent", "not_sent"]
    # the next arrival is seconds away (gaps average 10 s): ending well before it proves the run stopped at
    # max_duration; the margin is wide because a loaded 2-core machine has taken over a second to tear the run down
    assert rep["metrics"]["duration_s"] < 5.0


# ----- arrivals ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_gaps_have_mean_one_over_rate_and_cv_one_over_sqrt_burstiness(burstiness):
    gaps = L.interarrival_gaps(40_000, rate=5.0, burstiness=burstiness, seed=7)
    assert gaps.shape == (40_000,) and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.2, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)
    assert np.array_equal(gaps, L.interarrival_gaps(40_000, 5.0, burstiness, seed=7))  # seeded
    assert not np.array_equal(gaps, L.interarrival_gaps(40_000, 5.0, burstiness, seed=8))


def test_arrival_times_start_at_zero_and_add_the_gaps():
    times = L.arrival_times(5, 2.0, 1.0, seed=3)
    gaps = L.interarrival_gaps(5, 2.0, 1.0, seed=3)
    assert times[0] == 0.0 and np.allclose(np.diff(times), gaps[:-1])
    assert L.arrival_times(4, math.inf) == [0.0] * 4


# ----- goodput search -------------------------------------------------------------------------------------------


def _synthetic_run(rate: float) -> list[RequestRecord]:
    """100 requests whose TTFT grows with the rate: the i-th has 0.001 * rate * (i + 1) s, so a 1 s TTFT bound is
    met by min(100, floor(1000 / rate)) of them: attainment >= 90% exactly up to rate 1000 / 90 = 11.11 req/s."""
    return [hand_record(0.001 * rate * (i + 1), [0.01]) for i in range(100)]


def test_goodput_search_over_a_list_of_rates():
    slo = SLO(ttft_s=1.0)
    found = L.goodput_search(_synthetic_run, slo, rates=[16, 2, 8, 4])
    assert found.rate == 8 and [r for r, _ in found.tried] == [2, 4, 8, 16]
    assert dict(found.tried)[16] == pytest.approx(0.62)
    assert L.goodput_search(_synthetic_run, slo, rates=[20, 40]).rate is None


def test_goodput_search_by_bisection():
    calls = []

    def run(rate):
        calls.append(rate)
        return _synthetic_run(rate)

    found = L.goodput_search(run, SLO(ttft_s=1.0), bracket=(1.0, 65.0), steps=8)
    assert len(calls) == 2 + 8 and not found.capped
    assert 100 / 9 - 64 / 2**8 <= found.rate <= 100 / 9
    assert L.goodput_search(_synthetic_run, SLO(ttft_s=1.0), bracket=(1.0, 5.0)).capped
    assert L.goodput_search(_synthetic_run, SLO(ttft_s=1.0), bracket=(50.0, 60.0)).rate is None


# ----- workloads --------------------------------------------------------------------------------------------------


def test_default_prompts_are_seeded_corpus_text_that_fits_the_context(workload):
    m = load_model("base")
    again = L.make_workload("default", 6, (16, 48), OUTPUT_LEN, seed=3, tokenizer=m.tokenizer)
    assert again.prompts == workload.prompts
    assert L.make_workload("default", 6, (16, 48), OUTPUT_LEN, seed=4).prompts != workload.prompts
    for text, n in zip(workload.prompts, workload.prompt_lens):
        assert SEPARATOR not in text and "\ufffd" not in text and text.strip()
        assert len(m.tokenizer.encode(text)) == n and n + OUTPUT_LEN <= m.model.config.block_size
    wide = L.make_workload("default", 20, (150, 192), 64, seed=0)  # at the edge: 192 + 64 = 256
    assert max(wide.prompt_lens) + 64 <= 256 and min(wide.prompt_lens) >= 140


def test_shared_prefix_prompts_share_their_first_tokens():
    m = load_model("base")
    wl = L.make_workload("shared-prefix", 5, (80, 120), 16, seed=2, prefix_len=64)
    assert wl.dataset == "shared-prefix" and wl.shared_prefix_len >= 63
    ids = [m.tokenizer.encode(p) for p in wl.prompts]
    assert L.common_prefix_len(ids) == wl.shared_prefix_len
    assert len({tuple(t[wl.shared_prefix_len:]) for t in ids}) == 5  # the suffixes differ
    assert all(n + 16 <= 256 for n in wl.prompt_lens)


# ----- plots ------------------------------------------------------------------------------------------------------


def test_plots_draw_the_cdfs_and_the_frontier(report, tmp_path):
    fig = plot_latency_cdfs(report, path=tmp_path / "cdf.png")
    assert isinstance(fig, Figure) and len(fig.axes) == 4 and (tmp_path / "cdf.png").stat().st_size > 0
    slo_lines = [line for line in fig.axes[0].lines if line.get_linestyle() == "--"]
    assert len(slo_lines) == 1 and slo_lines[0].get_xdata()[0] == pytest.approx(5000.0)  # the TTFT bound, ms
    fig = plot_frontier([report, report], SLO(e2e_s=2.0), stat="mean", path=tmp_path / "frontier.png")
    assert isinstance(fig, Figure) and len(fig.axes) == 3 and (tmp_path / "frontier.png").is_file()
    with pytest.raises(ValueError, match="stat"):
        plot_frontier([report], stat="p42")


# ----- bad arguments ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("values,q,match", [([], 50, "empty"), ([1.0, math.nan], 50, "finite"),
                                            ([1.0, math.inf], 50, "finite"), ([1.0], 101, "q"),
                                            ([1.0], -1, "q"), ([1.0], math.nan, "q")])
def test_percentile_refuses_bad_input(values, q, match):
    with pytest.raises(ValueError, match=match):
        percentile(values, q)


def test_bad_arguments_name_the_value(workload):
    rec = hand_record(0.1, [0.1])
    with pytest.raises(ValueError, match="SLO.ttft_s"):
        SLO(ttft_s=-1.0)
    with pytest.raises(TypeError, match="SLO.e2e_s"):
        SLO(e2e_s="1s")
    with pytest.raises(ValueError, match="duration"):
        goodput([rec], SLO(), 0.0)
    with pytest.raises(TypeError, match=r"records\[1\]"):
        goodput([rec, {"ttft": 1}], SLO(), 1.0)
    with pytest.raises(TypeError, match="slo"):
        goodput([rec], {"ttft_s": 1.0}, 1.0)
    with pytest.raises(ValueError, match="burstiness"):
        L.interarrival_gaps(3, 1.0, burstiness=math.nan)
    with pytest.raises(ValueError, match="rate"):
        L.interarrival_gaps(3, 0.0)
    url = "http://127.0.0.1:9"  # never contacted: every check comes first
    for kwargs, err, match in [({"backend": "grpc"}, ValueError, "backend"), ({"rate": -1.0}, ValueError, "rate"),
                               ({"concurrency": 0}, ValueError, "concurrency"),
                               ({"concurrency": 2.5}, TypeError, "concurrency"),
                               ({"timeout": math.inf}, ValueError, "timeout"),
                               ({"slo": {"ttft_s": 1}}, TypeError, "slo")]:
        with pytest.raises(err, match=match):
            L.run_benchmark(url, workload, model="base", **kwargs)
    with pytest.raises(ValueError, match="base_url"):
        L.run_benchmark("127.0.0.1:8000", workload)
    with pytest.raises(TypeError, match="workload"):
        L.run_benchmark(url, ["a prompt"])
    with pytest.raises(ValueError, match="dataset"):
        L.make_workload("sharegpt", 2)
    with pytest.raises(ValueError, match="input_len"):
        L.make_workload("default", 2, (100, 220), 64)  # 220 + 64 > 256
    with pytest.raises(ValueError, match="input_len"):
        L.make_workload("default", 2, (50, 40), 8)
    with pytest.raises(ValueError, match="prefix_len"):
        L.make_workload("shared-prefix", 2, (32, 64), 8, prefix_len=40)
    with pytest.raises(ValueError, match="exactly one"):
        L.goodput_search(_synthetic_run, SLO(ttft_s=1.0), rates=[1.0], bracket=(1.0, 2.0))
    with pytest.raises(ValueError, match="no bound"):
        L.goodput_search(_synthetic_run, SLO(), rates=[1.0])
    with pytest.raises(ValueError, match="lo < hi"):
        L.goodput_search(_synthetic_run, SLO(ttft_s=1.0), bracket=(4.0, 2.0))
    with pytest.raises(ValueError, match=r"rates\[1\]"):
        L.goodput_search(_synthetic_run, SLO(ttft_s=1.0), rates=[1.0, -2.0])


def test_error_types():
    assert L.error_type(TimeoutError()) == "timeout"
    assert L.error_type(httpx.ReadTimeout("slow")) == "timeout"
    assert L.error_type(L.StreamError("engine_error", "boom")) == "stream:engine_error"
    assert L.error_type(httpx.ConnectError("refused")) == "ConnectError"
    request = httpx.Request("POST", "http://x/v1/completions")
    assert L.error_type(httpx.HTTPStatusError("full", request=request,
                                              response=httpx.Response(429, request=request))) == "429"


# ----- the command --------------------------------------------------------------------------------------------------


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="minillm")
    L.add_commands(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench-serve", *argv])


@pytest.mark.parametrize("argv,flag", [
    (["--input-len", "50:40"], "--input-len"), (["--input-len", "ab"], "--input-len"),
    (["--json", "out.txt"], "--json"), (["--plot", "out.json"], "--plot"),
    (["--max-concurrency", "0"], "--max-concurrency"), (["--request-rate", "0"], "--request-rate"),
    (["--burstiness", "nan"], "--burstiness"), (["--num-prompts", "0"], "--num-prompts"),
    (["--slo-ttft-ms", "-5", "--serve"], "--slo-ttft-ms"), (["--goodput-search", "1,x", "--slo-e2e-ms", "9"],
                                                            "--goodput-search"),
    (["--goodput-search", "1,2"], "--goodput-search"), (["--compare-offline"], "--compare-offline"),
    (["--base-url", "localhost:8000"], "--base-url"),
])
def test_bad_flags_are_errors_naming_the_flag(argv, flag):
    args = _parse(argv)
    with pytest.raises(ValueError, match=flag):
        args.handler(args)


def test_an_unreachable_server_is_one_line_and_exit_code_1(capsys):
    args = _parse(["--base-url", "http://127.0.0.1:9", "--num-prompts", "2", "--timeout", "5"])
    assert args.handler(args) == 1
    assert "could not list the models at http://127.0.0.1:9" in capsys.readouterr().err
    args = _parse(["--base-url", "http://127.0.0.1:9", "--model", "base", "--context-length", "256", "--num-prompts",
                   "2", "--timeout", "5"])
    assert args.handler(args) == 1
    assert "did not answer a test request" in capsys.readouterr().err


def test_the_command_serves_benches_compares_and_writes(tmp_path, capsys):
    out, png = tmp_path / "run.json", tmp_path / "cdf.png"
    args = _parse(["--serve", "--num-prompts", "4", "--input-len", "16:32", "--output-len", "4", "--max-concurrency",
                   "2", "--slo-ttft-ms", "5000", "--compare-offline", "--json", str(out), "--plot", str(png)])
    assert args.handler(args) == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "offline engine on the same prompts" in printed
    report = json.loads(out.read_text())
    assert report["metrics"]["completed"] == 4 and report["metrics"]["total_output_tokens"] == 16
    assert report["offline"]["output_tokens"] == 16 and report["serving_over_offline"] > 0
    assert png.stat().st_size > 0

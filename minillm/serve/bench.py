"""Chapter 15's benchmark: the server measured from outside, against the offline engine and under load.

Two parts, one command, `minillm serve` in child processes (each its own interpreter, as deployed) and the load
generator in this one (`minillm.serve.loadgen`):

  1. throughput: `rounds` interleaved rounds, each timing the offline engine (`LLM.generate` on every prompt at
     once, in this process), then a server with its engine core in a process of its own, then a second server with
     the core on the server's thread, each sent the same prompts by `concurrency` streams of the official `openai`
     client (greedy, ignore_eos, 32 output tokens each). Reported per placement: the median output tokens/s, the
     median over the rounds of its ratio to the offline engine of the same round, how many served texts equal the
     offline engine's, the failed requests, and the KV blocks the server still holds afterwards (its /metrics);
  2. load: the first server sent `load_prompts` requests at each Poisson rate of `rates` and then by a closed loop
     of `concurrency` streams; per load, the served request rate, output tokens/s, TTFT / TPOT / ITL percentiles,
     the share of requests meeting the SLO (TTFT <= 500 ms and TPOT <= 50 ms) and vLLM's goodput, and over the
     rates DistServe's goodput (the highest rate with >= 90% meeting it, `goodput_search`).

The report keeps every run's metrics and configuration, not its per-request records (`minillm bench-serve --json`
writes those). `quotes(report)` turns a saved report into the tables and numbers chapter 15's text shows
(`minillm.course.results`).

    python -m minillm.serve.bench [--quick] [--threads 1] [--seed 0] [--json FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict
from typing import Any

import httpx

from minillm.bench.cli import bench_parser, pick_size, start, write_report
from minillm.bench.tables import markdown_table
from minillm.bench.models import LoadedModel, load_model
from minillm.core.config import check_instance, check_int, reads_report, short_repr
from minillm.core.sampling import SamplingParams
from minillm.engine import LLM, EngineConfig
from minillm.serve.cli import ServerProcess
from minillm.serve.loadgen import (SLO, goodput_search, make_workload, offline_throughput, records_from_report,
                                   run_benchmark)
from minillm.serve.metrics import parse_metrics

MODEL = "base"
NUM_BLOCKS = 512  # KV blocks of 16 tokens in every engine, served or offline
OUTPUT_LEN = 32  # tokens generated per request
SLO_PAIR = SLO(ttft_s=0.5, tpot_s=0.05)  # the load part's objectives
PLACEMENTS = {"process": "engine core in its own process", "thread": "engine core on the server's thread"}
SIZES = {
    "quick": dict(num_prompts=16, rounds=1, concurrency=8, load_prompts=16, rates=(4, 16)),  # the tests: seconds
    "tour": dict(num_prompts=32, rounds=2, concurrency=32, load_prompts=24, rates=(8,)),  # the tour's --quick
    "full": dict(num_prompts=64, rounds=3, concurrency=32, load_prompts=48, rates=(2, 4, 8, 16, 32)),
}


def throughput(loaded: Any, urls: dict[str, str], num_prompts: int, concurrency: int, rounds: int,
               seed: int = 0) -> dict[str, Any]:
    """Output tokens/s of `concurrency` streams against the offline engine on the same prompts, for each engine core
    placement in `urls` (name -> server URL), interleaved round by round: per round the offline engine, then each
    server. Keys: offline_tok_s (per round), served_tok_s and ratios (per placement: per round, and the median of
    the per-round ratios), same_texts (served texts of the last round equal to the offline engine's), errors
    (failed requests over every round), kv_blocks_used (after the runs), metrics (the last round's)."""
    check_instance("loaded", loaded, LoadedModel, "a LoadedModel (minillm.bench.models.load_model)")
    if not isinstance(urls, dict) or not all(isinstance(k, str) and isinstance(u, str) for k, u in urls.items()):
        raise TypeError(f"urls must be a dict of placement name -> server URL (str), got {short_repr(urls)}")
    num_prompts, concurrency = check_int("num_prompts", num_prompts), check_int("concurrency", concurrency)
    rounds = check_int("rounds", rounds)
    tok = loaded.tokenizer
    workload = make_workload("default", num_prompts=num_prompts, output_len=OUTPUT_LEN, seed=seed, tokenizer=tok)
    offline: list[float] = []
    reports: dict[str, list[dict[str, Any]]] = {core: [] for core in urls}
    for _ in range(rounds):  # interleaved: the offline engine, then each server, on the same prompts
        llm = LLM(loaded.model, tok, EngineConfig(num_blocks=NUM_BLOCKS, max_num_seqs=concurrency))
        offline.append(offline_throughput(llm, workload)["output_throughput"])
        for core, url in urls.items():
            reports[core].append(run_benchmark(url, workload, model=MODEL, concurrency=concurrency, timeout=120))
    want = [o.text for o in LLM(loaded.model, tok, EngineConfig(num_blocks=NUM_BLOCKS)).generate(
        workload.prompts, [SamplingParams.greedy(k, ignore_eos=True) for k in workload.output_lens])]
    served = {core: [r["metrics"]["output_throughput"] for r in reps] for core, reps in reports.items()}
    texts = {core: {r["index"]: r["text"] for r in reps[-1]["records"]} for core, reps in reports.items()}
    return {"num_prompts": num_prompts, "output_len": OUTPUT_LEN, "concurrency": concurrency, "rounds": rounds,
            "offline_tok_s": offline, "served_tok_s": served,
            "ratios": {core: statistics.median(s / o for s, o in zip(tput, offline)) for core, tput in served.items()},
            "same_texts": {core: sum(got.get(i) == w for i, w in enumerate(want)) for core, got in texts.items()},
            "errors": {core: sum(r["metrics"]["failed"] for r in reps) for core, reps in reports.items()},
            "kv_blocks_used": {core: parse_metrics(httpx.get(url + "/metrics", timeout=30).text)[
                "minillm_kv_blocks_used"] for core, url in urls.items()},
            "metrics": {core: reps[-1]["metrics"] for core, reps in reports.items()}}


def load_sweep(url: str, tokenizer: Any, num_prompts: int, rates: tuple[float, ...], concurrency: int,
               slo: SLO = SLO_PAIR, seed: int = 0) -> dict[str, Any]:
    """The server at `url` under Poisson arrivals at each of `rates`, then a closed loop of `concurrency` streams,
    `num_prompts` requests each time; every run's config and metrics (at `slo`), and DistServe's goodput over the
    rates. Keys: slo, runs (each {"load", "rate" or "concurrency", "config", "metrics"}), goodput_search."""
    workload = make_workload("default", num_prompts=num_prompts, output_len=OUTPUT_LEN, seed=seed,
                             tokenizer=tokenizer)
    runs, records = [], {}
    for rate in rates:
        report = run_benchmark(url, workload, model=MODEL, rate=rate, slo=slo, timeout=120)
        records[rate] = records_from_report(report)
        runs.append({"load": f"{rate:g} req/s", "rate": rate, "config": report["config"],
                     "metrics": report["metrics"]})
    closed = run_benchmark(url, workload, model=MODEL, concurrency=concurrency, slo=slo, timeout=120)
    runs.append({"load": f"{concurrency} streams (closed loop)", "concurrency": concurrency,
                 "config": closed["config"], "metrics": closed["metrics"]})
    found = goodput_search(lambda rate: records[rate], slo, rates=list(rates))
    return {"slo": asdict(slo), "runs": runs, "goodput_search": asdict(found)}


def run_all(size: str = "full", seed: int = 0, threads: int = 1) -> dict[str, Any]:
    """Both parts at a size of `SIZES`: the servers started here (loopback, `threads` torch threads each) and
    stopped before returning."""
    sizes = pick_size(SIZES, size)
    loaded = load_model(MODEL, "cpu", seed)
    args = ["--num-blocks", str(NUM_BLOCKS), "--max-num-seqs", str(sizes["concurrency"])]
    with ServerProcess(args, threads=threads) as url:
        with ServerProcess(args + ["--engine-core", "thread"], threads=threads) as thread_url:
            part1 = throughput(loaded, {"process": url, "thread": thread_url}, sizes["num_prompts"],
                               sizes["concurrency"], sizes["rounds"], seed)
        part2 = load_sweep(url, loaded.tokenizer, sizes["load_prompts"], tuple(sizes["rates"]),
                           sizes["concurrency"], seed=seed)
    return {"model": loaded.label, "size": size, "sizes": sizes, "threads": threads, "num_blocks": NUM_BLOCKS,
            "throughput": part1, "load": part2}


# ============================================================================================ the tables


def _times(x: float) -> str:
    return f"{x:.2f}x"


@reads_report
def throughput_table(report: dict[str, Any]) -> str:
    """The throughput part as a Markdown table: the offline engine, then each engine core placement."""
    t = report["throughput"]
    rows = [["offline engine (`LLM.generate`)", f"{statistics.median(t['offline_tok_s']):.0f}", "1", "—", "—", "—"]]
    for core, tput in t["served_tok_s"].items():
        same = t["same_texts"][core]
        rows.append([f"served, {PLACEMENTS[core]}", f"{statistics.median(tput):.0f}", _times(t["ratios"][core]),
                     f"{'yes' if same == t['num_prompts'] else 'NO'}, {same} of {t['num_prompts']}",
                     str(t["errors"][core]), f"{t['kv_blocks_used'][core]:.0f}"])
    return markdown_table(["engine", "output tok/s (median)", "against offline", "served text equal to offline", "errors",
                           "KV blocks in use after"], rows, "l" * 6)


@reads_report
def load_table(report: dict[str, Any]) -> str:
    """The load part as a Markdown table: one row per load level, latencies in ms."""
    rows = []
    for run in report["load"]["runs"]:
        m = run["metrics"]
        rows.append([str(run["load"]), f"{m['request_throughput']:.2f}", f"{m['output_throughput']:.0f}",
                     f"{m['ttft_ms']['p50']:.0f} ms", f"{m['ttft_ms']['p90']:.0f} ms", f"{m['tpot_ms']['p90']:.1f} ms",
                     f"{m['itl_ms']['p99']:.0f} ms", f"{100 * m['slo_attainment']:.0f}%", f"{m['goodput']:.2f}"])
    return markdown_table(["load", "served req/s", "output tok/s", "TTFT p50", "TTFT p90", "TPOT p90", "ITL p99",
                           "SLO met", "goodput (req/s)"], rows, "l" * 9)


def _load_key(run: dict[str, Any]) -> str:
    """"r8" for 8 req/s, "c32" for the closed loop of 32 streams: the names `quotes` gives a load's values."""
    return f"r{run['rate']:g}" if "rate" in run else f"c{run['concurrency']}"


@reads_report
def quotes(report: dict[str, Any]) -> dict[str, str]:
    """What chapter 15's text quotes from a full run's report (`minillm.course.results`): the tables "throughput" and
    "load", and single values: the machine ("cpu", "date", "wall": the command's seconds); the offline engine's and
    each placement's median tok/s ("offline_tok_s", "process_tok_s", "thread_tok_s"), the offline engine's slowest
    and fastest round ("offline_tok_s_min", "..._max"), each placement's median ratio ("process_ratio",
    "thread_ratio") and its lowest and highest round ("process_ratio_min", "..._max"); per load level (`_load_key`:
    "r8", "c32") its "..._req_s", "..._tok_s", "..._ttft_p50", "..._ttft_p90", "..._tpot_p90", "..._itl_p99",
    "..._slo" and "..._goodput"; DistServe's goodput ("distserve_goodput", "none of the rates" when no rate reached
    90%) and the SLO ("slo_ttft_ms", "slo_tpot_ms")."""
    t, load = report["throughput"], report["load"]
    out = {"throughput": throughput_table(report), "load": load_table(report), "cpu": report["cpu"],
           "date": report["date"], "wall": f"{report['wall_s']:.0f} s",
           "offline_tok_s": f"{statistics.median(t['offline_tok_s']):.0f}",
           "offline_tok_s_min": f"{min(t['offline_tok_s']):.0f}", "offline_tok_s_max": f"{max(t['offline_tok_s']):.0f}"}
    for core, tput in t["served_tok_s"].items():
        out[f"{core}_tok_s"] = f"{statistics.median(tput):.0f}"
        out[f"{core}_ratio"] = _times(t["ratios"][core])
        per_round = [s / o for s, o in zip(tput, t["offline_tok_s"])]
        out[f"{core}_ratio_min"], out[f"{core}_ratio_max"] = _times(min(per_round)), _times(max(per_round))
    for run in load["runs"]:
        m, key = run["metrics"], _load_key(run)
        out |= {f"{key}_req_s": f"{m['request_throughput']:.2f}", f"{key}_tok_s": f"{m['output_throughput']:.0f}",
                f"{key}_ttft_p50": f"{m['ttft_ms']['p50']:.0f} ms", f"{key}_ttft_p90": f"{m['ttft_ms']['p90']:.0f} ms",
                f"{key}_tpot_p90": f"{m['tpot_ms']['p90']:.1f} ms", f"{key}_itl_p99": f"{m['itl_ms']['p99']:.0f} ms",
                f"{key}_slo": f"{100 * m['slo_attainment']:.0f}%", f"{key}_goodput": f"{m['goodput']:.2f}"}
    rate = load["goodput_search"]["rate"]
    out["distserve_goodput"] = "none of the rates" if rate is None else f"{rate:g} req/s"
    out["slo_ttft_ms"] = f"{load['slo']['ttft_s'] * 1e3:g} ms"
    out["slo_tpot_ms"] = f"{load['slo']['tpot_s'] * 1e3:g} ms"
    return out


@reads_report
def format_report(report: dict[str, Any]) -> str:
    """Both tables, as the command prints them."""
    t = report["throughput"]
    rate = report["load"]["goodput_search"]["rate"]
    return (f"throughput: {t['num_prompts']} requests x {t['output_len']} tokens, {t['concurrency']} concurrent "
            f"streams, {t['rounds']} interleaved rounds\n{throughput_table(report)}\n"
            f"under load: {report['sizes']['load_prompts']} requests per load level\n{load_table(report)}\n"
            f"DistServe goodput (the highest rate with >= 90% of requests meeting the SLO): "
            f"{'none of the rates' if rate is None else f'{rate:g} req/s'}")


# ============================================================================================ the command


def build_parser() -> argparse.ArgumentParser:
    """The kit's shared options (`minillm.bench.cli`; the servers run on the CPU here)."""
    return bench_parser("python -m minillm.serve.bench", __doc__.splitlines()[0],
                        "16 requests, one round, rates 4 and 16", sizes=SIZES, devices=("cpu",))


def main(argv: list[str] | None = None) -> int:
    args = start(build_parser(), argv)
    start_s = time.perf_counter()
    report = run_all(args.size, args.seed, args.threads)
    report["wall_s"] = time.perf_counter() - start_s
    print(f"model {report['model']}; {args.threads} torch thread(s) per engine; {NUM_BLOCKS} KV blocks")
    print(format_report(report))
    write_report(args.json, report)
    t = report["throughput"]
    ok = all(n == t["num_prompts"] for n in t["same_texts"].values()) and not any(t["errors"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Tour entry for chapter 03: the naive loop against Hugging Face, its baseline figures, and the roofline bound
(with the weight-streaming bound measured on the model beside it)."""

from __future__ import annotations

import math

import torch

from minillm.bench.models import load_model
from minillm.core.rows import Row, TourContext
from minillm.naive.bench import run_all

TITLE = "naive inference"


def run(ctx: TourContext) -> list[Row]:
    # Threads come from the tour (`--threads`, default 1); the roofline rates are measured under the same setting,
    # so the fraction the naive loop reaches is fair.
    loaded = load_model("base", ctx.device, ctx.seed)
    label, dev = loaded.label, str(ctx.device)
    report = run_all(loaded.model, loaded.trained, ctx.quick, ctx.seed)
    parity, parity_tokens = report["parity"]["result"], report["parity"]["new_tokens"]
    rows = [Row("03", "naive generate loop (greedy)", "HF generate(use_cache=False)", "generate_naive",
                f"identical tokens {parity.equal}/{parity.total} prompts ({parity.total * parity_tokens} tokens), "
                f"{label}", parity.ok, "prompts identical", 100.0 * parity.equal / parity.total, "%", dev)]

    res = report["results"]["naive"]
    s, n = res["summary"], report["case"]["new_tokens"]
    ttft, tpot, e2e = s["median_ttft_ms"], s["median_tpot_ms"], s["median_e2el_ms"]
    got = len(res["tokens"])
    # E2E = TTFT + (n-1)·TPOT holds per request; the medians of the three need not satisfy it, so show the sum.
    check = f"{got}/{n} tokens, TTFT + {n - 1}·TPOT = {ttft + (n - 1) * tpot:.0f} ms vs median E2E {e2e:.0f} ms"
    details = {"model": label, "threads": torch.get_num_threads(), "summary": s,
               "peak_memory_bytes": res["peak_memory_bytes"], "peak_memory_source": res["peak_memory_source"]}
    common = dict(baseline="-", optimized="generate_naive", check=check, check_passed=got == n, device=dev,
                  details=details)
    rows.append(Row("03", f"naive loop TTFT, prompt {report['case']['prompt_len']}", metric="TTFT", value=ttft,
                    unit="ms", **common))
    rows.append(Row("03", f"naive loop TPOT, {n} new tokens", metric="TPOT", value=tpot, unit="ms", **common))
    rows.append(Row("03", f"naive loop throughput, {n} new tokens", metric="output tok/s", value=res["tokens_per_s"],
                    unit="tok/s", **common))

    rf = report["roofline"]
    m, b, frac, ws = rf["machine"], rf["bound"], rf["fraction_of_bound"], rf["weight_streaming"]
    rows.append(Row(
        "03", "roofline bound on decode tokens/s",
        f"{m['bandwidth_gbs']:.1f} GB/s, {m['matmul_gflops']:.1f} GFLOP/s", "generate_naive (1/TPOT)",
        f"bound {b['tokens_per_s']:,.0f} tok/s ({b['limited_by']}-bound), 0 < fraction <= 1; weight-streaming bound "
        f"{ws['tokens_per_s']:,.0f} tok/s (the step's weights through F.linear alone, {ws['gbps']:.1f} GB/s: "
        f"{100 * rf['fraction_of_weight_streaming']:.1f}% reached)",
        bool(0 < frac <= 1 and math.isfinite(frac)), "fraction of bound", 100.0 * frac, "%", dev,
        details={"model": label, **rf},
    ))
    return rows

"""Tour entry for chapter 03: the naive loop against Hugging Face, its baseline figures, and the roofline bound."""

from __future__ import annotations

import math

import torch

from minillm.core.rows import Row, TourContext
from minillm.bench.models import load_model

TITLE = "naive inference"


def _load_base(device: torch.device):
    """The shipped base checkpoint; random weights of its shape (said so in every row) if it is not there."""
    loaded = load_model("base", device)
    return loaded.model, loaded.label


def _hf_parity(model, prompts: list[list[int]], new_tokens: int) -> tuple[int, int]:
    """(prompts whose greedy tokens equal HF generate(use_cache=False, do_sample=False), tokens compared)."""
    from minillm.naive.generate import generate_naive_ids
    from minillm.core.hf import to_hf_model
    from minillm.core.sampling import SamplingParams

    hf = to_hf_model(model).to(model.device).eval()
    same = 0
    for prompt in prompts:
        ids = torch.tensor([prompt], device=model.device)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, use_cache=False, pad_token_id=0,
                          eos_token_id=None)
        ours = generate_naive_ids(model, prompt, SamplingParams.greedy(new_tokens, ignore_eos=True))
        same += ours == out[0, len(prompt):].tolist()
    return same, len(prompts) * new_tokens


def run(ctx: TourContext) -> list[Row]:
    # Threads come from the tour (`--threads`, default 1); the roofline rates are measured under the same setting,
    # so the fraction the naive loop reaches is fair.
    from minillm.naive.bench import BenchCase, add_roofline, bench_prompt, run_bench

    model, label = _load_base(ctx.device)
    real = label == "base"
    dev = str(ctx.device)
    n_prompts, parity_tokens = (1, 8) if ctx.quick else (3, 24)
    lengths = [16, 40, 5][:n_prompts]
    prompts = [bench_prompt(sum(lengths[: i + 1]), model.config.vocab_size, real, ctx.seed)[-n:]
               for i, n in enumerate(lengths)]  # consecutive stretches of the validation text
    same, compared = _hf_parity(model, prompts, parity_tokens)
    rows = [Row("03", "naive generate loop (greedy)", "HF generate(use_cache=False)", "generate_naive",
                f"identical tokens {same}/{n_prompts} prompts ({compared} tokens), {label}", same == n_prompts,
                "prompts identical", 100.0 * same / n_prompts, "%", dev)]

    case = BenchCase(prompt_len=16, new_tokens=16 if ctx.quick else 64, repeats=2 if ctx.quick else 3, warmup=0)
    report = run_bench(model, bench_prompt(case.prompt_len, model.config.vocab_size, real, ctx.seed), case)
    add_roofline(report, model, quick=ctx.quick)
    res = report["results"]["naive"]
    s = res["summary"]
    n = case.new_tokens
    ttft, tpot, e2e = s["median_ttft_ms"], s["median_tpot_ms"], s["median_e2el_ms"]
    got = len(res["tokens"])
    # E2E = TTFT + (n-1)·TPOT holds per request; the medians of the three need not satisfy it, so show the sum.
    check = f"{got}/{n} tokens, TTFT + {n - 1}·TPOT = {ttft + (n - 1) * tpot:.0f} ms vs median E2E {e2e:.0f} ms"
    details = {"model": label, "threads": torch.get_num_threads(), "summary": s, "peak_memory_bytes": res["peak_memory_bytes"],
               "peak_memory_source": res["peak_memory_source"]}
    common = dict(baseline="-", optimized="generate_naive", check=check, check_passed=got == n, device=dev,
                  details=details)
    rows.append(Row("03", f"naive loop TTFT, prompt {case.prompt_len}", metric="TTFT", value=ttft, unit="ms",
                    **common))
    rows.append(Row("03", f"naive loop TPOT, {n} new tokens", metric="TPOT", value=tpot, unit="ms", **common))
    rows.append(Row("03", f"naive loop throughput, {n} new tokens", metric="output tok/s", value=res["tokens_per_s"],
                    unit="tok/s", **common))

    rf = report["roofline"]
    m, b = rf["machine"], rf["bound"]
    frac = rf["fraction_of_bound"]
    rows.append(Row(
        "03", "roofline bound on decode tokens/s",
        f"{m['bandwidth_gbs']:.1f} GB/s, {m['matmul_gflops']:.1f} GFLOP/s", "generate_naive (1/TPOT)",
        f"bound {b['tokens_per_s']:,.0f} tok/s ({b['limited_by']}-bound), 0 < fraction <= 1",
        bool(0 < frac <= 1 and math.isfinite(frac)), "fraction of bound", 100.0 * frac, "%", dev,
        details={"model": label, **rf},
    ))
    return rows

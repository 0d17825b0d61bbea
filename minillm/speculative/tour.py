"""Tour entry for chapter 08: speculative decoding against `base` alone, checked exact, and against Hugging Face.

`base` is the target and `draft` the draft model (same tokenizer), greedy at batch 1 on chapter 04's KV cache,
then the same with chapter 11's distilled draft (`draft-distilled`) when it is shipped.
Checks: greedy speculative and prompt-lookup decoding give the target's own tokens for every γ; the sampled first
token follows the target's distribution by a chi-square test; HF assisted generation gives the same tokens too.
Measured: the speed-up at the best γ (and the cost model's prediction), prompt lookup's speed-up on code, the
test's p-value, and tokens/s against HF's assisted generation (`minillm.speculative.bench`).
"""

from __future__ import annotations

from minillm.core.rows import Row, TourContext
from minillm.speculative.bench import run_all
from minillm.speculative.engine_bench import run as run_engine

TITLE = "speculative decoding"


def _sweep_row(name: str, r: dict, g: dict, draft: str, dev: str) -> Row:
    best = next(row for row in g["rows"] if row["gamma"] == g["best_gamma"])
    gammas = ", ".join(str(row["gamma"]) for row in g["rows"])
    predicted = best.get("predicted_speedup_measured_verify")
    alpha = f"alpha {g['alpha']:.2f}, " if g["alpha"] is not None else ""
    return Row("08", name, f"{r['target']} alone (ch04 KV cache)",
               f"{r['target']} + {draft}, best gamma {g['best_gamma']}",
               f"identical tokens for gamma {gammas}: {g['identical']}; {g['prompts']} prompts x {g['new_tokens']} "
               f"tokens; {alpha}{best['tokens_per_target_call']:.2f} tokens/target call"
               + (f"; cost model {predicted:.2f}x (c = {g['costs']['c']:.2f})" if predicted is not None else ""),
               g["identical"], "speed-up", g["best_speedup"], "x", dev, g)


def run(ctx: TourContext) -> list[Row]:
    # The sweeps over 4 prompts, not the benchmark's 6 (the Fibonacci prompt and three held-out code excerpts): they
    # are most of this chapter's tour time; `python -m minillm.speculative.bench` runs all six.
    r = run_all(ctx.device, quick=ctx.quick, seed=ctx.seed, prompts=None if ctx.quick else 4)
    pl, s, h = r["prompt_lookup"], r["sampling"], r["hf_assisted"]
    dev = str(ctx.device)
    rows = [_sweep_row("speculative decoding, draft model, greedy", r, r["greedy"], r["draft"], dev)]
    if "distilled" in r:
        rows.append(_sweep_row("speculative decoding, distilled draft, greedy", r, r["distilled"],
                               r["distilled_draft"], dev))
    return rows + [
        Row("08", "prompt lookup decoding", f"{r['target']} alone (ch04 KV cache)",
            f"{pl['ngram']}-gram drafts from the sequence, gamma {pl['gamma']}",
            f"identical tokens: {pl['identical']}; {pl['accepted']}/{pl['proposed']} drafts kept on code, "
            f"{pl['tokens_per_target_call']:.2f} tokens/target call", pl["identical"], "speed-up", pl["speedup"],
            "x", dev, pl),
        Row("08", "speculative sampling distribution", "the target's own p", "accept_or_resample, gamma 1",
            f"chi-square {s['chi2']:.1f} on {s['dof']} dof over {s['draws']:,} draws, p-value > 0.001; "
            f"TV {s['tv']:.3f} (the draft's q: {s['tv_draft']:.3f})", s["p_value"] > 0.001, "p-value",
            s["p_value"], "", dev, s),
        Row("08", "vs HF assisted generation", "transformers generate(assistant_model=)",
            f"generate_speculative, gamma {h['gamma']}",
            f"identical tokens (ours = HF default = HF constant gamma = target alone): {h['identical']}; HF best "
            f"{max(h['hf_default_tok_s'], h['hf_constant_tok_s']):.0f} tok/s", h["identical"], "tok/s ratio",
            h["ratio"], "x", dev, h),
        # The engine at 1, 4 and 16 concurrent requests with the engine benchmark's quick sizes (about 20 s); its full
        # sweep (`python -m minillm.speculative.engine_bench`, loads up to 64) takes minutes.
        _engine_row(run_engine(ctx.device, quick=True, loads=(1, 8) if ctx.quick else (1, 4, 16), seed=ctx.seed),
                    dev),
    ]


def _engine_row(e: dict, dev: str) -> Row:
    cross = (f"slower from {e['crossover']} concurrent requests" if e["crossover"] is not None
             else f"no crossover up to {e['points'][-1]['concurrency']} concurrent requests")
    ratios = ", ".join(f"{p['concurrency']}: {p['ratio']:.2f}x" for p in e["points"])
    return Row("08", "speculative decoding in the engine", "chapter 06 engine (LLM), same config",
               f"SpeculativeLLM, prompt lookup, gamma {e['gamma']}",
               f"identical tokens at every load: {e['identical']}; throughput ratio by concurrency {ratios}; {cross}",
               e["identical"], "throughput ratio", e["low_load_ratio"], "x", dev, e)

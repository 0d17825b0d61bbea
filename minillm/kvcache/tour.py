"""Tour entry for chapter 04: KV cache vs the naive loop (identical tokens, speed-up by length), vs Hugging Face
generate(use_cache=True), static batching vs each prompt alone, and the cache's bytes vs the formula."""

from __future__ import annotations

import torch

from minillm.core.rows import Row, TourContext

TITLE = "KV cache"


def _static_batch_speedup(model, prompts: list[list[int]], new_tokens: int) -> dict:
    """One static batch vs the same prompts one at a time (both cached), interleaved; rows compared exactly."""
    from minillm.kvcache.generate import generate_ids, generate_static_batch
    from minillm.core.sampling import SamplingParams
    from minillm.core.timing import compare

    params = SamplingParams.greedy(new_tokens, ignore_eos=True)
    out: dict[str, list] = {}
    cmp = compare(lambda: out.__setitem__("alone", [generate_ids(model, p, params) for p in prompts]),
                  lambda: out.__setitem__("batch", generate_static_batch(model, prompts, params)),
                  warmup=0, repeats=1, device=model.device)
    same = sum(a == b for a, b in zip(out["alone"], out["batch"]))
    return {"identical_rows": same, "rows": len(prompts), "speedup": cmp.speedup}


def run(ctx: TourContext) -> list[Row]:
    from minillm.gpt.dataset import eval_prompts
    from minillm.kvcache.bench import load_base, run_all

    model, _, label = load_base(ctx.device, seed=ctx.seed)
    real = label == "base"
    dev = str(ctx.device)
    report = run_all(model, real_text=real, quick=ctx.quick, seed=ctx.seed)
    rows: list[Row] = []
    eq = report["equivalence"]
    for i, r in enumerate(report["speedup"]):
        check = f"identical tokens ({r['generated']}), {label}"
        if i == 0:
            check = (f"identical greedy tokens {eq['identical']}/{eq['prompts']} prompts + this run; max |dlogit| "
                     f"{eq['max_abs_logit_diff']:.1e} on |logits| <= {eq['max_abs_logit']:.0f}, {label}")
        passed = r["identical"] and (i > 0 or eq["identical"] == eq["prompts"])
        rows.append(Row("04", f"KV cache, {r['new_tokens']} new tokens (prompt {r['prompt_len']})",
                        "naive generate (recompute all)", "generate (prefill + decode)", check, passed,
                        "speed-up", r["speedup"], "x", dev, details={"model": label, **r}))
    h = report["hf"]
    rows.append(Row("04", f"KV cache vs HF, batch 1, {h['new_tokens']} new tokens",
                    "HF generate(use_cache=True)", "generate (prefill + decode)",
                    f"identical tokens: {h['identical']}, same weights", h["identical"], "tok/s ratio", h["ratio"], "x",
                    dev, details={"model": label, **h}))
    lat = report["latency"]
    p_last = lat["positions"][-1]
    rows.append(Row("04", f"decode step at position {p_last}", "naive step (forward of all tokens)",
                    "decode_step (1 token, cached K/V)",
                    f"cached {lat['cached_s'][0] * 1e3:.2f} -> {lat['cached_s'][-1] * 1e3:.2f} ms from position "
                    f"{lat['positions'][0]} to {p_last}", True, "per-step speed-up",
                    lat["naive_s"][-1] / lat["cached_s"][-1], "x", dev, details={"model": label, **lat}))
    sb_prompts = eval_prompts(model, [5, 12, 20, 33] if ctx.quick else [5, 9, 12, 20, 27, 33, 41, 60], real, ctx.seed)
    sb = _static_batch_speedup(model, sb_prompts, 8 if ctx.quick else 32)
    rows.append(Row("04", f"static batching, {sb['rows']} prompts of different lengths", "each prompt alone (cached)",
                    "generate_static_batch (left padding)", f"identical rows {sb['identical_rows']}/{sb['rows']}",
                    sb["identical_rows"] == sb["rows"], "speed-up", sb["speedup"], "x", dev,
                    details={"model": label, **sb}))
    m = report["memory"]
    rows.append(Row("04", f"KV cache memory, batch {m['batch_size']} x {m['max_len']} slots",
                    "formula 2*L*nh*hs*T*B*bytes", "ContiguousKVCache.nbytes",
                    f"measured {m['measured_bytes']:,} B == formula {m['formula_bytes']:,} B", m["equal"],
                    "KV bytes/token", m["bytes_per_token"], "B", dev, details=m))
    return rows


if __name__ == "__main__":  # python -m minillm.kvcache.tour
    from minillm.core.rows import format_table

    print(format_table(run(TourContext(device=torch.device("cpu"), quick=True))))

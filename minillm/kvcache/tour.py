"""Tour entry for chapter 04: KV cache vs the naive loop (identical tokens, speed-up by length), vs Hugging Face
generate(use_cache=True), static batching vs each prompt alone, and the cache's bytes vs the formula."""

from __future__ import annotations

from minillm.bench.models import load_model
from minillm.core.rows import Row, TourContext
from minillm.kvcache.bench import run_all

TITLE = "KV cache"


def run(ctx: TourContext) -> list[Row]:
    loaded = load_model("base", ctx.device, ctx.seed)
    label, dev = loaded.label, str(ctx.device)
    report = run_all(loaded.model, real_text=loaded.trained, quick=ctx.quick, seed=ctx.seed)
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
    sb = report["static_batch"]
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

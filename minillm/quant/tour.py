"""Tour entry for chapter 09: each quantization method on `base` against fp32 (weight bytes, perplexity delta,
greedy agreement, KL from fp32 and identical continuations, decode tok/s), and the engine running a quantized model
token for token like `generate_ids`. KL and the continuations are reported, never pass criteria."""

from __future__ import annotations

from minillm.bench.models import load_model
from minillm.core.rows import Row, TourContext
from minillm.quant.bench import run_all

TITLE = "quantization"

# The chapter's targets (benchmarks, never timed tests): int8 weight-only within 0.5% perplexity and >= 98% greedy
# agreement; int4 group-wise GPTQ within 5% and better than round-to-nearest.
INT8_MAX_DELTA_PCT, INT8_MIN_AGREEMENT, INT4_MAX_DELTA_PCT = 0.5, 0.98, 5.0


def run(ctx: TourContext) -> list[Row]:
    loaded = load_model("base", "cpu", ctx.seed)  # the quantized paths are CPU code (chapter 12 brings kernels)
    # The benchmark's "tour" sizes (4,096 validation tokens, 6 prompts, 3 timed runs; about a minute on one CPU
    # thread), its "quick" ones with --quick (4 prompts, one timed run): the full sizes take 3-9 minutes, more than
    # the tour's share of its budget. The chapter's table is the full benchmark's.
    report = run_all(loaded.model, real_text=loaded.trained, size="quick" if ctx.quick else "tour", seed=ctx.seed)
    label = loaded.label
    cases = {r["case"]: r for r in report["cases"]}
    rtn_ppl = cases["int4 group-wise RTN"]["perplexity"]
    rows: list[Row] = []
    for r in report["cases"]:
        if r["mode"] == "fp32":
            continue
        check = (f"ppl {r['perplexity']:.2f} ({r['ppl_delta_pct']:+.2f}%), argmax agreement "
                 f"{100 * r['agreement']:.1f}%, KL from fp32 {r['kl_mean']:.3g} nats/token (p99 {r['kl_p99']:.3g}), "
                 f"identical continuations {r['identical_prompts']}/{report['prompts']} (mean common prefix "
                 f"{r['mean_common_prefix']:.1f}/{report['new_tokens']}), {r['bytes_ratio']:.2f}x fewer bytes "
                 f"({r['linear_ratio']:.2f}x on the block linears), {label}")
        if r["mode"] in ("int8", "w8a8"):
            passed = r["ppl_delta_pct"] < INT8_MAX_DELTA_PCT and r["agreement"] >= INT8_MIN_AGREEMENT
        elif r["method"] == "gptq":
            passed = r["ppl_delta_pct"] < INT4_MAX_DELTA_PCT and r["perplexity"] < rtn_ppl
            check += f"; GPTQ {'<' if passed else '>='} RTN ppl {rtn_ppl:.2f}"
        else:
            passed = r["ppl_delta_pct"] < INT4_MAX_DELTA_PCT
            if r["method"] == "qat":
                check += f"; RTN ppl {rtn_ppl:.2f}, fine-tune {r['quantize_s']:.0f} s"
        if "engine" in r:
            e = r["engine"]
            check += f"; engine = generate_ids {e['same_as_generate']}/{e['prompts']}"
            passed = passed and e["same_as_generate"] == e["prompts"]
        rows.append(Row("09", r["case"], "fp32 model", f"quantized {r['mode']} ({r['method']})", check, passed,
                        "decode tok/s vs fp32 (batch 1)", r["speedup"], "x", "cpu", details={"model": label, **r}))
    kv = report["kv_int8"]
    kv_ok = kv["engine_same_as_generate"] == kv["prompts"] and kv["ppl_delta_pct"] < INT8_MAX_DELTA_PCT
    rows.append(Row("09", "KV cache int8", "fp32 KV cache", "Int8ContiguousKVCache / paged-int8",
                    f"{kv['kv_ratio']:.2f}x fewer KV bytes, ppl through the cache {kv['ppl_delta_pct']:+.2f}%, "
                    f"identical greedy prompts {kv['identical_prompts']}/{kv['prompts']}, engine = generate_ids "
                    f"{kv['engine_same_as_generate']}/{kv['prompts']}, {label}", kv_ok,
                    "decode tok/s vs fp32 cache (batch 1)", kv["speedup"], "x", "cpu", details={"model": label, **kv}))
    planted = report["outliers"]["rows"][-1]["ppl_delta_pct"]
    cured = min(planted["W8A8 + LLM.int8 (6.0)"], planted["SmoothQuant + W8A8"])
    rows.append(Row("09", "W8A8 with planted outlier features", "plain W8A8", "LLM.int8 decomposition / SmoothQuant",
                    f"ppl delta: W8A8 {planted['W8A8']:+.2f}%, LLM.int8 {planted['W8A8 + LLM.int8 (6.0)']:+.2f}%, "
                    f"SmoothQuant {planted['SmoothQuant + W8A8']:+.2f}%, {label}",
                    cured < planted["W8A8"], "ppl delta of plain W8A8", planted["W8A8"], "%", "cpu",
                    details={"model": label, **report["outliers"]}))
    return rows

"""Tour entry for chapter 10: magnitude, Wanda and 2:4 pruning at 50% and structured MLP pruning on `base`, each
against the dense model (perplexity delta, bytes, decode tok/s), and each pruned model run by the chapter 06 engine
token for token like `generate_ids` of the same model.

Checks (what must hold, whatever the numbers): every mask removes exactly what it says (50% of each matrix for
magnitude, of each row for Wanda, 2 of every 4 for 2:4; the structured model's MLPs physically 3C wide), the engine
gives `generate_ids`' tokens on the pruned model, and the magnitude masks equal `torch.nn.utils.prune`'s. The
chapter's targets are reported beside them: Wanda below magnitude at 50%, structured 25% faster than 1.1x. So are
KL from the dense model (nats per token, teacher-forced) and the free-running continuations identical to dense's:
reported, never pass criteria.
"""

from __future__ import annotations

from minillm.bench.models import load_model
from minillm.core.rows import Row, TourContext
from minillm.prune.bench import run_all

TITLE = "pruning"
STRUCTURED_TARGET = 1.1  # decode speed-up of structured MLP 25% (a benchmark target, never a test)


def run(ctx: TourContext) -> list[Row]:
    loaded = load_model("base", ctx.device, ctx.seed)
    draft = load_model("draft", ctx.device, ctx.seed)
    # The benchmark's "tour" sizes (4,096 validation tokens, 6 prompts, 50% only, 10 recovery steps, 3 timed runs;
    # under a minute on one thread), its "quick" ones with --quick (4 prompts, one timed run): the sparsity sweep of
    # the chapter's figure is the full benchmark's.
    report = run_all(loaded.model, real_text=loaded.trained, size="quick" if ctx.quick else "tour", seed=ctx.seed,
                     draft=draft.model if draft.trained else None)
    label, dev, n = loaded.label, str(ctx.device), report["prompts"]
    fifty = {r["method"]: r for r in report["unstructured"] if r["sparsity"] == 0.5}
    mag, wanda = fifty["magnitude"], fifty["wanda"]
    tp = report["torch_prune"]
    mag_exact = mag["block_sparsity"] == 0.5 and tp["same"] == tp["layers"]
    rows = []
    for name, r, extra, exact in (
            ("magnitude 50%", mag, f"masks = torch.nn.utils.prune {tp['same']}/{tp['layers']} layers", mag_exact),
            ("Wanda 50%", wanda, _wanda_vs_magnitude(report, mag, wanda), wanda["block_sparsity"] == 0.5)):
        engine_ok = r["engine_same_as_generate"] == n
        rows.append(Row("10", name, "dense model", f"{r['method']} pruning, unstructured",
                        f"{100 * r['block_sparsity']:.1f}% zeros in the block linears; ppl {r['perplexity']:.2f} "
                        f"({r['ppl_delta_pct']:+.2f}%), argmax agreement {100 * r['agreement']:.1f}%, KL from dense "
                        f"{r['kl_mean']:.3g} nats/token (p99 {r['kl_p99']:.3g}), identical continuations "
                        f"{r['identical_prompts']}/{n} (mean common prefix {r['mean_common_prefix']:.1f}/"
                        f"{report['new_tokens']}), engine = "
                        f"generate_ids {r['engine_same_as_generate']}/{n}; {extra}; bitmask storage "
                        f"{r['dense_bytes'] / r['bitmask_bytes']:.2f}x fewer bytes; decode "
                        f"{r['speedup']:.2f}x dense (dense kernels), {label}", exact and engine_ok,
                        "perplexity delta %", r["ppl_delta_pct"], "%", dev, details={"model": label, **r}))
    tf = {r["method"]: r for r in report["two_four"]}
    best = min(tf.values(), key=lambda r: r["perplexity"])
    gpu = report["semi_structured_gpu"]
    if "rows" in gpu:
        speed = "GPU 2:4 kernel " + ", ".join(f"M={g['tokens']} {g['speedup']:.2f}x" for g in gpu["rows"])
    else:
        speed = "no 2:4 kernel here (CUDA sm80+ only)"
    rows.append(Row("10", "2:4 semi-structured", "dense model", f"2:4 pruning by {best['method']}",
                    f"2 of every 4 kept, verified: {all(r['pattern_ok'] for r in tf.values())}; ppl magnitude "
                    f"{tf['magnitude']['perplexity']:.2f}, Wanda {tf['wanda']['perplexity']:.2f}; KL from dense "
                    f"magnitude {tf['magnitude']['kl_mean']:.3g}, Wanda {tf['wanda']['kl_mean']:.3g} nats/token; "
                    f"identical continuations {tf['magnitude']['identical_prompts']}/{n} and "
                    f"{tf['wanda']['identical_prompts']}/{n}; engine = "
                    f"generate_ids {best['engine_same_as_generate']}/{n}; 2:4 format {best['fp16_ratio']:.2f}x "
                    f"fewer bytes in fp16; {speed}, {label}",
                    all(r["pattern_ok"] and r["engine_same_as_generate"] == n for r in tf.values()),
                    "perplexity delta %", best["ppl_delta_pct"], "%", dev, details={"model": label, **tf, "gpu": gpu}))
    s = report["structured"][0]
    shrunk = all(w == round(0.75 * 4 * loaded.model.config.n_embd) for w in s["mlp_hidden"])
    rows.append(Row("10", "structured MLP 25%", "dense model (decode, batch 1)", "MLP neurons removed + recovery",
                    f"MLPs {s['mlp_hidden'][0]} wide (was {4 * loaded.model.config.n_embd}), "
                    f"{100 * (1 - s['params'] / s['dense_params']):.1f}% of parameters gone; ppl "
                    f"{s['before_recovery']['ppl_delta_pct']:+.2f}% before and {s['ppl_delta_pct']:+.2f}% after "
                    f"{s['recovery_steps']} recovery steps; KL from dense {s['kl_mean']:.3g} nats/token (p99 "
                    f"{s['kl_p99']:.3g}), identical continuations {s['identical_prompts']}/{n} (mean common prefix "
                    f"{s['mean_common_prefix']:.1f}/{report['new_tokens']}); engine = generate_ids "
                    f"{s['engine_same_as_generate']}/{n}; "
                    f"prefill {s['prefill_speedup']:.2f}x; target > {STRUCTURED_TARGET}x "
                    f"{'met' if s['speedup'] > STRUCTURED_TARGET else 'missed'}, {label}",
                    shrunk and s["engine_same_as_generate"] == n, "speed-up", s["speedup"], "x", dev,
                    details={"model": label, **s}))
    return rows


def _wanda_vs_magnitude(report: dict, mag: dict, wanda: dict) -> str:
    text = (f"target Wanda < magnitude {'met' if wanda['perplexity'] < mag['perplexity'] else 'missed'} "
            f"({wanda['perplexity']:.2f} vs {mag['perplexity']:.2f})")
    if "draft" in report:
        d = report["draft"]
        text += f"; on draft {d['wanda']:.2f} vs {d['magnitude']:.2f}"
    return text

"""Tour entry for chapter 13: the decode step compiled, captured and rewritten, against eager PyTorch.

Checks: every path gives the eager generator's greedy tokens (and the engine's outputs equal static batching's and
Hugging Face's). Measured: `torch.compile decode, batch 1` (speed-up over eager, whatever it is),
`fastest decode, batch 1` (the fastest path's tok/s as a fraction of the weight-streaming bound's, the two timed
in turn in one run), `fastest decode vs HF, batch 1` (tok/s ratio to `generate(use_cache=True)`),
`fastest continuous vs static` and `fastest continuous vs HF` (tok/CPU-s ratios of chapter 06's engine on the
fastest path: its short steps one C++ call each, `FusedEngineModel`, on chapter 06's workload; static batching on
`fast_cpu_model`),
`structured MLP 25% on the fused step` (speed-up of chapter 10's MLP-pruned model over the dense one, both on
`FusedCPUDecoder`), and on CUDA
`CUDA graph decode, batch 1` (speed-up).
"""

from __future__ import annotations

from minillm.bench.models import load_model
from minillm.bench.workload import workload
from minillm.compile.bench import run_all
from minillm.compile.cpu_gemv import build_problem, fast_cpu_model
from minillm.compile.cpu_paged import NAME as CPP_BACKEND
from minillm.compile.fused_engine import FusedEngineModel
from minillm.core.rows import Row, TourContext
from minillm.engine.throughput import offline_throughput
from minillm.engine.tour import throughput_rows

TITLE = "compilation and graphs"


def run(ctx: TourContext) -> list[Row]:
    loaded = load_model("base", ctx.device, ctx.seed)
    model, label, dev = loaded.model, loaded.label, str(ctx.device)
    draft = load_model("draft-distilled", ctx.device, ctx.seed).model
    r = run_all(model, loaded.trained, quick=True, seed=ctx.seed, draft=draft)
    by_mode = {row["mode"]: row for row in r["rows"]}
    rows = []
    c = by_mode["compile"]
    rows.append(Row("13", "torch.compile decode, batch 1", "eager generate_ids (ch04)",
                    f"static-shape step, torch.compile ({c['backend']})",
                    f"identical greedy tokens: {c['identical']}; {c['compiles']} graph(s) for the whole generation; "
                    f"first call {c['first_call_seconds']:.1f} s (compile, or the cache); {c['tok_s']:.0f} vs "
                    f"{c['eager_tok_s']:.0f} tok/s, {label}", c["identical"] and c["compiles"] == 1, "speed-up",
                    c["speedup"], "x", dev, details={"model": label, **c}))
    if "cuda-graph" in by_mode:
        g = by_mode["cuda-graph"]
        rows.append(Row("13", "CUDA graph decode, batch 1", "eager generate_ids (ch04)", "captured static step",
                        f"identical greedy tokens: {g['identical']}; captured {g['compiles']} time(s); "
                        f"{g['tok_s']:.0f} vs {g['eager_tok_s']:.0f} tok/s, {label}",
                        g["identical"] and g["compiles"] == 1, "speed-up", g["speedup"], "x", dev,
                        details={"model": label, **g}))
    fastest = max(r["rows"], key=lambda row: row["tok_s"])
    b = r["bound"]
    bound = (f"weight-streaming bound ({b['bytes'] / 1e6:.1f} MB through {b['by']}: {fastest['bound_tok_s']:.0f} "
             f"tok/s in the same interleaved run, fastest ever {b['tok_s_bound']:.0f})")
    rows.append(Row("13", "fastest decode, batch 1", bound, fastest["mode"],
                    f"identical greedy tokens: {fastest['identical']}; {fastest['tok_s']:.0f} tok/s, "
                    f"{fastest['speedup']:.2f}x eager; {100 * fastest['fraction_of_fastest_bound']:.0f}% of the "
                    f"fastest-ever bound; target 60%, {label}", fastest["identical"],
                    "fraction of weight-streaming bound", 100 * fastest["fraction_of_bound"], "%", dev,
                    details={"model": label, "bound": b, **fastest}))
    hf = r.get("hf", {})
    if "fused" in hf:
        h, e = hf["fused"], hf["eager"]
        rows.append(Row("13", "fastest decode vs HF, batch 1", "HF generate(use_cache=True, sdpa), same weights",
                        "ch04 generate with FusedCPUDecoder (the step in one C++ call)",
                        f"identical tokens: {h['identical']}; {h['ours_tok_s']:.0f} vs {h['hf_tok_s']:.0f} tok/s "
                        f"(eager ours in the same run: {e['ratio']:.2f}x HF); target 1.5x, {label}", h["identical"],
                        "tok/s ratio", h["ratio"], "x", dev, details={"model": label, **hf}))
    if "pruned_fused" in r:
        p = r["pruned_fused"]
        rows.append(Row("13", "structured MLP 25% on the fused step", "dense base on FusedCPUDecoder",
                        f"MLP-pruned base ({100 * p['fraction']:.0f}% of neurons, ch10) on FusedCPUDecoder",
                        f"identical to the pruned model's eager tokens: {p['identical']}; {p['pruned_tok_s']:.0f} vs "
                        f"{p['dense_tok_s']:.0f} tok/s; weights read {p['weight_ratio']:.2f}x fewer, {label}",
                        p["identical"], "speed-up", p["speedup"], "x", dev, details={"model": label, **p}))
    if "quantized_fused" in r:
        q = r["quantized_fused"]
        q4 = q["int4"]
        rows.append(Row("13", "int8 fused step", "float32 base on FusedCPUDecoder",
                        f"int8 weight-only base (ch09, per-channel) on FusedCPUDecoder (C++ int8 GEMV, "
                        f"{q['int8_path']})",
                        f"identical to the int8 model's eager tokens: {q['identical']}; {q['int8_tok_s']:.0f} vs "
                        f"{q['f32_tok_s']:.0f} tok/s; weights read {q['weight_ratio']:.2f}x fewer; eager int8 "
                        f"{q['eager_speedup']:.2f}x eager f32, {label}",
                        q["identical"], "speed-up", q["speedup"], "x", dev,
                        details={"model": label, **{k: v for k, v in q.items() if k != "int4"}}))
        rows.append(Row("13", "int4 fused step", "float32 base on FusedCPUDecoder",
                        f"int4 weight-only base (ch09, groups of {q4['group_size']}) on FusedCPUDecoder (C++ int4 "
                        f"GEMV, {q4['path']})",
                        f"identical to the int4 model's eager tokens: {q4['identical']}; {q4['tok_s']:.0f} vs "
                        f"{q['f32_tok_s']:.0f} tok/s, {q4['vs_int8']:.2f}x the int8 step; weights read "
                        f"{q4['weight_ratio']:.2f}x fewer; eager int4 {q4['eager_speedup']:.2f}x eager f32, {label}",
                        q4["identical"], "speed-up", q4["speedup"], "x", dev, details={"model": label, **q4}))
    if "fused_speculation" in r:
        s, lk = r["fused_speculation"], r["fused_speculation"]["lookup"]
        rows.append(Row("13", "speculative on the fused step, distilled draft", "base alone on FusedCPUDecoder",
                        f"draft-distilled proposes {s['gamma']} on its fused step, base verifies {s['gamma'] + 1} in "
                        "one C++ call",
                        f"identical tokens: {s['identical']}; {s['speculative_tok_s']:.0f} vs {s['alone_tok_s']:.0f} "
                        f"tok/s; alpha {s['alpha']:.2f}, {s['tokens_per_call']:.2f} tokens per target call; "
                        f"{s['prompts']} prompts, {label}",
                        s["identical"], "speed-up", s["speedup"], "x", dev, details={"model": label, **s}))
        rows.append(Row("13", "prompt lookup on the fused step", "base alone on FusedCPUDecoder",
                        f"{lk['gamma']} tokens copied from the context, verified in one C++ call",
                        f"identical tokens: {lk['identical']}; {lk['lookup_tok_s']:.0f} vs {lk['alone_tok_s']:.0f} "
                        f"tok/s; {lk['kept']}/{lk['proposed']} drafts kept on a {lk['prompt_len']}-token prompt, "
                        f"{label}",
                        lk["identical"], "speed-up", lk["speedup"], "x", dev, details={"model": label, **lk}))
    if ctx.device.type == "cpu" and build_problem() is None:
        # Chapter 06's throughput comparison (same workload and batch) with every decode-sized product in C++
        # for both engines, and the engine's decode attention read through the block tables in C++.
        # The engine's short steps (decodes, short prompt chunks) run as one C++ call each (`FusedEngineModel`).
        fast = fast_cpu_model(model)
        n, batch = (8, 4) if ctx.quick else (48, 8)
        off = offline_throughput(fast, workload("mixed", n, seed=ctx.seed, vocab_size=model.config.vocab_size),
                                 batch=batch, with_hf=True, attention_backend=CPP_BACKEND,
                                 repeats=1 if ctx.quick else 3, engine_model=FusedEngineModel(fast))
        rows += throughput_rows("13", off, label, dev,
                                ("fastest continuous vs static", "static batching (ch04) on fast_cpu_model"),
                                "fastest continuous vs HF", "LLM on the fused C++ step (FusedEngineModel), attention "
                                f"{CPP_BACKEND!r} for long prompt chunks",
                                note=f"; {n} mixed requests, batch {batch}; target 2x vs static, 1.5x vs HF")
    return rows

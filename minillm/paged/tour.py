"""Tour entry for chapter 05: paged KV cache vs the contiguous cache (identical tokens), KV memory utilisation,
the decode-time cost of reading through block tables, parallel samples sharing blocks, and prefix caching."""

from __future__ import annotations

from minillm.bench.models import load_model
from minillm.core.rows import Row, TourContext
from minillm.paged.bench import run_all

TITLE = "paged attention"


def run(ctx: TourContext) -> list[Row]:
    loaded = load_model("base", ctx.device, ctx.seed)
    label, dev = loaded.label, str(ctx.device)
    r = run_all(loaded.model, real_text=loaded.trained, quick=ctx.quick, seed=ctx.seed)  # the tour's --threads
    rows: list[Row] = []
    eq = r["equivalence"]
    rows.append(Row("05", f"paged KV cache, bs={eq['block_size']}", "contiguous cache (ch04) and naive loop (ch03)",
                    "PagedKVCache via block tables",
                    f"identical greedy tokens {eq['identical']}/{eq['prompts']} prompts ({eq['tokens']} tokens), "
                    f"paged == contiguous == naive; {label}", eq["identical"] == eq["prompts"],
                    "max |dlogit| vs contiguous", eq["max_abs_logit_diff"], "", dev, details={"model": label, **eq}))
    mem = {m["scheme"]: m for m in r["memory"]}
    contiguous, paged = mem["contiguous (max length)"], mem["paged bs=16"]
    rows.append(Row("05", "KV memory utilisation, mixed-length workload", "contiguous max-length reservation",
                    "paged bs=16",
                    f"contiguous {contiguous['utilisation']:.1%} vs paged {paged['utilisation']:.1%}; "
                    f"paged waste {paged['waste']:.2%} < 5%, <= {paged['max_waste_per_seq']} slots/seq",
                    paged["waste"] < 0.05 and paged["max_waste_per_seq"] <= 15,
                    "utilisation paged/contiguous", paged["utilisation"] / contiguous["utilisation"], "x", dev,
                    details={"memory": r["memory"]}))
    d = r["decode"]
    rows.append(Row("05", f"batched decode, {d['num_seqs']} seqs x {d['steps']} steps, bs={d['block_size']}",
                    "ContiguousKVCache decode", "PagedKVCache decode (gather via block tables)",
                    f"identical greedy tokens every step: {d['identical_tokens']}; target <= 1.3x",
                    bool(d["identical_tokens"]), "paged/contiguous time", d["ratio"], "x", dev,
                    details={"model": label, **d, "attention_by_block_size": r.get("attention_by_block_size")}))
    s = r["samples"]
    rows.append(Row("05", f"{s['n']} parallel samples, shared prompt blocks", "independent runs seeded seed+i",
                    "fork + copy-on-write",
                    f"identical samples {s['identical']}/{s['n']}; peak blocks {s['peak_blocks']} vs "
                    f"{s['peak_blocks_unshared']} unshared, {s['cow_copies']} copies",
                    s["identical"] == s["n"], "blocks saved", s["blocks_saved"], "blocks", dev, details=s))
    p = r["prefix"]
    rows.append(Row("05", f"prefix caching, {p['requests']} requests sharing a {p['system_len']}-token prompt",
                    "paged, no prefix caching", "hash-chained block reuse",
                    f"identical outputs {p['identical']}/{p['requests']}; {p['prefill_tokens_skipped']} of "
                    f"{p['prompt_tokens']} prefill tokens skipped", p["identical"] == p["requests"],
                    "prefill tokens skipped", 100 * p["skipped_fraction"], "%", dev, details=p))
    return rows

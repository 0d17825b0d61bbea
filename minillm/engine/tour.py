"""Tour entry for chapter 06: the continuous-batching engine against each request alone (identical outputs, with
preemption and chunked prefill), its throughput against static batching and Hugging Face's two batched paths, and
the inter-token-latency spike of a long prompt with chunked prefill."""

from __future__ import annotations

from minillm.bench.models import load_model
from minillm.bench.workload import workload
from minillm.core.config import check_report, short_repr
from minillm.core.rows import Row, TourContext
from minillm.engine.bench import agreement, chunked_prefill_itl, offline_throughput

TITLE = "Continuous batching"


def throughput_rows(chapter: str, off: dict, label: str, dev: str, static: tuple[str, str], hf_technique: str,
                    optimized: str, note: str = "") -> list[Row]:
    """The engine against static batching and against the best of HF's batched paths, from `offline_throughput`:
    tok/CPU-s ratios (wall clock on a shared machine measures the neighbours' load as much as the code; the engine
    and static batching at their median of alternating runs, HF from one run), checked by identical outputs.
    `static` is (technique, baseline) of the first row; `note` ends each check (a target)."""
    check_report("off", off, ("n", "runs", "hf_note"))
    for name, run in check_report("off['runs']", off["runs"], ("continuous", "static")).items():
        check_report(f"off['runs'][{name!r}]", run, ("tokens_per_s", "tokens_per_cpu_s", "agree_with_engine")
                     + (("repeats", "repeats_identical") if name in ("continuous", "static") else ()))
    for name, value in (("chapter", chapter), ("dev", dev), ("hf_technique", hf_technique), ("optimized", optimized),
                        ("note", note)):
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a str, got {type(value).__name__} {short_repr(value)}")
    if not isinstance(static, tuple) or len(static) != 2 or not all(isinstance(s, str) for s in static):
        raise TypeError(f"static must be a (technique, baseline) pair of str, got {short_repr(static)}")
    n, runs = off["n"], off["runs"]
    eng, st = runs["continuous"], runs["static"]
    steady = eng["repeats_identical"] and st["repeats_identical"]
    rows = [Row(chapter, static[0], static[1], optimized,
                f"identical outputs {st['agree_with_engine']}/{n}"
                + ("" if steady else ", but a repeat changed its outputs")
                + f"; {eng['tokens_per_cpu_s']:.0f} vs {st['tokens_per_cpu_s']:.0f} tok/CPU-s, median of "
                f"{eng['repeats']} alternating runs (wall {eng['tokens_per_s']:.0f} vs {st['tokens_per_s']:.0f})"
                + note, st["agree_with_engine"] == n and steady, "tok/CPU-s ratio",
                eng["tokens_per_cpu_s"] / st["tokens_per_cpu_s"], "x", dev, details={"model": label, **off})]
    hf_names = [k for k in ("hf-generate", "hf-generate_batch") if k in runs]
    if hf_names:
        best = max(hf_names, key=lambda k: runs[k]["tokens_per_cpu_s"])
        agree = " ".join(f"{k} {runs[k]['agree_with_engine']}/{n}" for k in hf_names)
        hf_note = f"; {off['hf_note']}" if off["hf_note"] else ""
        rows.append(Row(chapter, hf_technique, f"best of HF {' / '.join(hf_names)} ({best})", optimized,
                        f"identical outputs {agree}{hf_note}{note}",
                        all(runs[k]["agree_with_engine"] == n for k in hf_names), "tok/CPU-s ratio",
                        eng["tokens_per_cpu_s"] / runs[best]["tokens_per_cpu_s"], "x", dev,
                        details={"model": label, **{k: runs[k] for k in hf_names}}))
    return rows


def run(ctx: TourContext) -> list[Row]:
    loaded = load_model("base", ctx.device, ctx.seed)
    model, label, dev = loaded.model, loaded.label, str(ctx.device)
    rows: list[Row] = []

    a = agreement(model, 4 if ctx.quick else 16, ctx.seed)
    rows.append(Row("06", "continuous batching (preemption, chunked prefill)", "each request alone (ch04 generate)",
                    "LLM.generate", f"identical greedy outputs {a['identical']}/{a['n']}, {a['preemptions']} "
                    f"preemptions, pool free after: {a['all_free']}, {label}",
                    a["identical"] == a["n"] and a["all_free"], "identical", 100.0 * a["identical"] / a["n"], "%",
                    dev, details=a))

    n, batch = (8, 4) if ctx.quick else (48, 8)
    off = offline_throughput(model, workload("mixed", n, seed=ctx.seed, vocab_size=model.config.vocab_size),
                             batch=batch, with_hf=True, repeats=1 if ctx.quick else 3)
    rows += throughput_rows("06", off, label, dev,
                            (f"continuous vs static batching, {n} mixed-length requests, batch {batch}",
                             "static batching (ch04 generate_static_batch)"),
                            f"continuous batching vs Hugging Face, same weights, batch {batch}",
                            "LLM (iteration-level scheduling)")
    c = chunked_prefill_itl(model, num_decodes=4 if ctx.quick else 16, chunk=16, repeats=1 if ctx.quick else 2,
                            long_len=64 if ctx.quick else None)
    rows.append(Row("06", f"chunked prefill, {c['long_len']}-token prompt among {c['num_decodes']} decodes",
                    f"one-step prefill (ITL spike {c['unchunked']['itl_ratio']:.1f}x steady)",
                    f"chunked prefill (budget {c['chunked']['budget']} tokens)",
                    f"identical outputs: {c['identical']}; long prompt TTFT {c['unchunked']['long_ttft_ms']:.0f} -> "
                    f"{c['chunked']['long_ttft_ms']:.0f} ms", bool(c["identical"]), "p99 ITL / steady ITL",
                    c["chunked"]["itl_ratio"], "x", dev, details={"model": label, **c}))
    return rows

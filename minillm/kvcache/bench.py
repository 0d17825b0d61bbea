"""Chapter 04's measurements: cached vs naive per-step latency, end-to-end speed-up, Hugging Face ratio, memory.

One source for the tour entry, the notebook and the chapter table: every timing goes through `minillm.core.timing`
(warm-up, median of repeats, baseline and candidate interleaved), every speed-up is checked for identical tokens
in the same run. What it leaves out: batch sizes above one for the speed figures (static batching is checked for
correctness here; chapter 06 measures batching) and any GPU-specific tuning.

`python -m minillm.kvcache.bench [--quick] [--threads N] [--device D] [--json FILE]` prints the chapter's table.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile

from minillm.bench.check import same_tokens
from minillm.bench.tables import markdown_table
from minillm.bench.cli import bench_parser, start, write_report
from minillm.bench.hf_compare import hf_comparison as kit_hf_comparison
from minillm.bench.models import load_model
from minillm.bench.workload import eval_prompts
from minillm.core.config import check_int_list, reads_report
from minillm.core.device import resolve_device
from minillm.core.hf import to_hf_model
from minillm.core.model import GPT, require_model
from minillm.core.sampling import SamplingParams, check_seed
from minillm.core.timing import check_repeats, compare
from minillm.kvcache.cache import ContiguousKVCache, kv_cache_bytes
from minillm.kvcache.generate import decode_step, generate_ids, generate_static_batch, prefill
from minillm.naive.generate import generate_naive_ids


def check_equivalence(model: GPT, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Greedy tokens, cached vs naive, per prompt (exact); and every step's logits, cached vs a full forward.

    The logit reference for step t is row t of one forward over the finished sequence (the naive loop's math).
    Reports the largest absolute difference and the largest |logit| it sits on (the float32 scale).
    """
    params = SamplingParams.greedy(new_tokens, ignore_eos=True)
    cached_all = [generate_ids(model, p, params) for p in prompts]
    same = same_tokens([generate_naive_ids(model, p, params) for p in prompts], cached_all)
    max_diff, max_logit = 0.0, 0.0
    for p, cached in zip(prompts, cached_all):
        seq = torch.tensor([p + cached], device=model.device)  # (1, T)
        cache = ContiguousKVCache(model.config, 1, seq.size(1), device=model.device)
        steps = [prefill(model, cache, seq[:, :len(p)])]
        for t in range(len(p), seq.size(1) - 1):
            steps.append(decode_step(model, cache, seq[:, t], torch.tensor([t], device=model.device)))
        with torch.inference_mode():
            ref = model(seq)[0, len(p) - 1:-1]  # (n, V)
        max_diff = max(max_diff, (torch.cat(steps) - ref).abs().max().item())
        max_logit = max(max_logit, ref.abs().max().item())
    return {"identical": same.equal, "prompts": same.total, "new_tokens": new_tokens, "max_abs_logit_diff": max_diff,
            "max_abs_logit": max_logit}


def static_batch_speedup(model: GPT, prompts: list[list[int]], new_tokens: int, repeats: int = 1) -> dict[str, Any]:
    """One left-padded static batch vs the same prompts one at a time (both cached), interleaved; rows exact."""
    params = SamplingParams.greedy(new_tokens, ignore_eos=True)
    out: dict[str, list] = {}
    cmp = compare(lambda: out.__setitem__("alone", [generate_ids(model, p, params) for p in prompts]),
                  lambda: out.__setitem__("batch", generate_static_batch(model, prompts, params)),
                  warmup=0, repeats=repeats, device=model.device)
    same = same_tokens(out["alone"], out["batch"], unit="rows")
    return {"identical_rows": same.equal, "rows": same.total, "speedup": cmp.speedup}


def step_latency_by_position(model: GPT, positions: list[int], repeats: int = 5, seed: int = 0) -> dict[str, Any]:
    """Median seconds of one generation step at each position t (t tokens already there, one new).

    Cached: one decode step of one token over t cached slots (the cache is rewound to t before every repeat).
    Naive: what the naive loop does at that step, a forward over all t+1 tokens.
    """
    require_model(model, "step_latency_by_position (model)")
    check_int_list("positions", positions), check_repeats("repeats", repeats), check_seed(seed)
    device = model.device
    bs = model.config.block_size
    if not positions or min(positions) < 1 or max(positions) >= bs:
        raise ValueError(f"positions must lie in [1, block_size-1={bs - 1}], got {positions}")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, max(positions) + 1), generator=g).to(device)
    cache = ContiguousKVCache(model.config, 1, max(positions) + 1, device=device)
    prefill(model, cache, ids[:, :max(positions)])
    cached: dict[int, float] = {}
    naive: dict[int, float] = {}
    # subtle: longest first, so rewinding (truncate) always goes back; re-decoding slot t rewrites the same K/V.
    for t in sorted(set(positions), reverse=True):
        token, pos = ids[:, t], torch.tensor([t], device=device)

        def one_cached(t=t, token=token, pos=pos) -> None:
            cache.truncate(t)
            decode_step(model, cache, token, pos)

        def one_naive(t=t) -> None:
            with torch.inference_mode():
                model(ids[:, : t + 1])[:, -1]

        cmp = compare(one_naive, one_cached, warmup=1, repeats=repeats, device=device)
        naive[t], cached[t] = cmp.baseline.median, cmp.candidate.median
    return {"positions": list(positions), "cached_s": [cached[t] for t in positions],
            "naive_s": [naive[t] for t in positions]}


def speedup_vs_naive(model: GPT, prompt: list[int], new_tokens: int, warmup: int = 1, repeats: int = 3
                     ) -> dict[str, Any]:
    """End-to-end time of `new_tokens` greedy tokens, naive loop vs KV cache, interleaved; tokens compared."""
    params = SamplingParams.greedy(new_tokens, ignore_eos=True)
    out: dict[str, list[int]] = {}
    cmp = compare(lambda: out.__setitem__("naive", generate_naive_ids(model, prompt, params)),
                  lambda: out.__setitem__("cached", generate_ids(model, prompt, params)),
                  warmup=warmup, repeats=repeats, device=model.device)
    return {"new_tokens": new_tokens, "prompt_len": len(prompt), "naive_s": cmp.baseline.median,
            "cached_s": cmp.candidate.median, "speedup": cmp.speedup,
            "identical": same_tokens([out["naive"]], [out["cached"]]).ok,
            "generated": len(out["cached"])}


def hf_comparison(model: GPT, prompt: list[int], new_tokens: int, warmup: int = 1, repeats: int = 3,
                  attn_implementation: str = "sdpa",
                  generate_fn: Callable[[list[int], SamplingParams], list[int]] | None = None) -> dict[str, Any]:
    """Tokens/s at batch 1: ours (`generate`, KV cache) vs Hugging Face `generate(use_cache=True)`, same weights.

    The measurement kit's `minillm.bench.hf_compare.hf_comparison` with chapter 04's `generate_ids(model, ...)` as
    ours unless `generate_fn(prompt, params) -> ids` names another batch-1 path over the same model."""
    ours = generate_fn or (lambda prompt, params: generate_ids(model, prompt, params))
    return kit_hf_comparison(model, prompt, new_tokens, ours, warmup=warmup, repeats=repeats,
                             attn_implementation=attn_implementation)


def profile_ops(model: GPT, prompt: list[int], new_tokens: int = 128) -> dict[str, dict[str, float]]:
    """Where a request's time goes, ours vs HF generate(use_cache=True): operator self-CPU ms from torch.profiler.

    Groups: weight matmuls (addmm/mm), attention (SDPA kernels), `aten::cat` (HF's growing cache), and the rest.
    """
    hf = to_hf_model(model, attn_implementation="sdpa")
    idx = torch.tensor([prompt], device=model.device)
    params = SamplingParams.greedy(new_tokens, ignore_eos=True)

    def run_hf() -> None:
        with torch.inference_mode():
            hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=new_tokens,
                        min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None)

    def run_ours() -> None:
        generate_ids(model, prompt, params)

    out = {}
    for name, fn in (("hf", run_hf), ("ours", run_ours)):
        fn()  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        ev = prof.key_averages()
        ms = lambda pred: sum(e.self_cpu_time_total for e in ev if pred(e.key)) / 1e3  # noqa: E731
        calls = cProfile.Profile()
        calls.runcall(fn)
        out[name] = {"total_ms": ms(lambda k: True), "matmul_ms": ms(lambda k: k in ("aten::addmm", "aten::mm")),
                     "attention_ms": ms(lambda k: "scaled_dot" in k or "flash" in k),
                     "cat_ms": ms(lambda k: k == "aten::cat"),
                     "python_calls_per_token": pstats.Stats(calls).total_calls / new_tokens}
    return out


def projection_times(model: GPT, repeats: int = 7, passes: int = 20) -> dict[str, dict[str, float]]:
    """One token through each block projection, ours (`nn.Linear`, weight (out, in)) vs HF (`Conv1D`, (in, out)).

    Same weights, same input, in two regimes, median of `repeats`, µs per projection:
    - "hot": the same projection of every layer over and over, so its weights stay in the CPU's caches
      (ours and HF's interleaved by `compare`);
    - "streamed": all projections in the order one decode step runs them (layer by layer), so each weight has
      been pushed out of the caches by the rest of the model when it comes round again, as in a real decode loop.
    Also the largest output difference between the two (the same math on the same weights: float rounding only).
    """
    hf = to_hf_model(model, attn_implementation="sdpa")
    C = model.config.n_embd
    names = (("attn.c_attn", C), ("attn.c_proj", C), ("mlp.c_fc", C), ("mlp.c_proj", 4 * C))
    xs = {name: torch.randn(1, 1, width, device=model.device) for name, width in names}
    mods = {key: {name: [block.get_submodule(name) for block in net.transformer.h] for name, _ in names}
            for key, net in (("ours", model), ("hf", hf))}
    n_layer = len(model.transformer.h)
    calls = passes * n_layer

    def hot(key: str, name: str):
        return lambda: [m(xs[name]) for _ in range(passes) for m in mods[key][name]]

    streamed: dict[tuple[str, str], list[float]] = {(k, n): [] for k in mods for n, _ in names}
    out: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for name, _ in names:
            cmp = compare(hot("hf", name), hot("ours", name), warmup=1, repeats=repeats, device=model.device)
            out[name] = {"ours_hot": cmp.candidate.median / calls * 1e6, "hf_hot": cmp.baseline.median / calls * 1e6}
        # subtle: the streamed regime times each projection call on its own inside one decode-order pass (the
        # point is what runs between two calls of the same projection), so it cannot be two callables for
        # `compare`; ours and HF's still alternate, repeat by repeat.
        for _ in range(repeats):
            for key in mods:
                spent = {name: 0.0 for name, _ in names}
                for _ in range(passes):
                    for layer in range(n_layer):
                        for name, _ in names:
                            t0 = time.perf_counter()
                            mods[key][name][layer](xs[name])
                            spent[name] += time.perf_counter() - t0
                for name, _ in names:
                    streamed[key, name].append(spent[name] / calls * 1e6)
        for name, _ in names:
            diff = max(float((a(xs[name]) - b(xs[name])).abs().max())
                       for a, b in zip(mods["ours"][name], mods["hf"][name]))
            out[name].update({"ours_streamed": statistics.median(streamed["ours", name]),
                              "hf_streamed": statistics.median(streamed["hf", name]), "max_abs_diff": diff})
    return out


def memory_check(model: GPT, batch_size: int = 1, max_len: int | None = None) -> dict[str, Any]:
    """The cache's measured bytes (tensor nbytes) against 2·layers·heads·head_dim·tokens·batch·bytes."""
    require_model(model, "memory_check (model)")  # batch_size and max_len: the cache checks them
    cfg = model.config
    max_len = max_len or cfg.block_size
    dtype = torch.float32  # the cache's dtype is the caller's choice (chapter 09 varies it), not read off the model
    cache = ContiguousKVCache(cfg, batch_size, max_len, device=model.device, dtype=dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    formula = kv_cache_bytes(cfg.n_layer, cfg.n_head, cfg.head_size, max_len, batch_size, elem)
    return {"measured_bytes": cache.nbytes, "formula_bytes": formula, "equal": cache.nbytes == formula,
            "bytes_per_token": kv_cache_bytes(cfg.n_layer, cfg.n_head, cfg.head_size, 1, 1, elem),
            "batch_size": batch_size, "max_len": max_len}


def run_all(model: GPT, real_text: bool, quick: bool = False, seed: int = 0, full: bool = False) -> dict[str, Any]:
    """Everything the tour and the chapter table report.

    Sizes: `quick` ~10 s on a 2-core CPU; the default (the tour's) ~45-60 s, dominated by the naive loop's
    256-token run; `full` (the chapter table, `python -m minillm.kvcache.bench`) more prompts, repeats and positions.
    """
    bs = model.config.block_size
    if quick:
        eq_lengths, eq_new, lengths, hf_new, hf_rep = [3, 8, 16, 31], 8, [64], 32, 3
        positions, lat_rep = [1, bs // 2, bs - 1], 3
    elif full:
        eq_lengths, eq_new, lengths, hf_new, hf_rep = [3, 8, 16, 31, 47, 64, 90, 120], 24, [64, 128, bs], 128, 5
        positions, lat_rep = [1, 32, 64, 96, 128, 160, 192, 224, bs - 1], 5
    else:
        eq_lengths, eq_new, lengths, hf_new, hf_rep = [3, 8, 16, 31, 64, 120], 16, [64, 128, bs], 64, 3
        positions, lat_rep = [1, 64, 128, 192, bs - 1], 3
    V = model.config.vocab_size
    eq_prompts = eval_prompts(eq_lengths, V, real_text, seed)
    report: dict[str, Any] = {"threads": torch.get_num_threads(), "device": str(model.device)}
    report["equivalence"] = check_equivalence(model, eq_prompts, eq_new)
    sb_lengths = [5, 12, 20, 33] if quick else [5, 9, 12, 20, 27, 33, 41, 60]
    report["static_batch"] = static_batch_speedup(model, eval_prompts(sb_lengths, V, real_text, seed),
                                                  8 if quick else 32, repeats=3 if full else 1)
    # One-token prompt: the most new tokens the window allows is block_size (prompt_len + n - 1 <= block_size).
    prompt = eval_prompts([1], V, real_text, seed)[0]
    # The chapter table takes the median of 3 interleaved runs at every length; the tour keeps the long naive runs
    # to one each (a 256-token naive run alone is ~10 s), so its 128- and 256-token rows are single samples.
    report["speedup"] = [
        speedup_vs_naive(model, prompt, n, warmup=1 if n <= 64 else 0, repeats=3 if full else (2 if n <= 64 else 1))
        for n in lengths
    ]
    report["hf"] = hf_comparison(model, eval_prompts([16], V, real_text, seed)[0], hf_new, warmup=1,
                                 repeats=hf_rep)
    report["latency"] = step_latency_by_position(model, positions, repeats=lat_rep, seed=seed)
    report["memory"] = memory_check(model)
    return report


@reads_report
def format_table(report: dict[str, Any]) -> str:
    table = markdown_table(["new tokens", "naive s", "KV cache s", "speed-up", "identical tokens"],
                           [[str(r["new_tokens"]), f"{r['naive_s']:.3f}", f"{r['cached_s']:.3f}", f"{r['speedup']:.1f}x",
                             "yes" if r["identical"] else "NO"] for r in report["speedup"]], "rrrrc")
    lines = [table.rstrip("\n")]
    h = report["hf"]
    lines.append("")
    lines.append(f"HF generate(use_cache=True, {h['attn_implementation']}) {h['hf_tok_s']:.0f} tok/s vs ours "
                 f"{h['ours_tok_s']:.0f} tok/s at batch 1, {h['new_tokens']} new tokens: {h['ratio']:.2f}x "
                 f"(tokens {'identical' if h['identical'] else 'DIFFERENT'})")
    lat = report["latency"]
    lines.append("per-step ms by position (cached / naive): " + ", ".join(
        f"{p}: {c * 1e3:.2f}/{n * 1e3:.1f}" for p, c, n in zip(lat["positions"], lat["cached_s"], lat["naive_s"])))
    e, s, m = report["equivalence"], report["static_batch"], report["memory"]
    lines.append(f"greedy tokens identical to naive: {e['identical']}/{e['prompts']} prompts; max |logit diff| "
                 f"{e['max_abs_logit_diff']:.2e} (logits up to {e['max_abs_logit']:.1f}); static batch rows identical to alone: {s['identical_rows']}/"
                 f"{s['rows']} ({s['speedup']:.1f}x faster than alone)")
    lines.append(f"cache bytes {m['measured_bytes']:,} == formula {m['formula_bytes']:,}: {m['equal']} "
                 f"({m['bytes_per_token']:,} B/token)")
    lines.append(f"(torch threads: {report['threads']}, device {report['device']}, median per-step ratio "
                 f"{statistics.median(n / c for c, n in zip(lat['cached_s'], lat['naive_s'])):.1f}x)")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = bench_parser("python -m minillm.kvcache.bench", __doc__.splitlines()[0], "smaller workload (~10 s)")
    ap.add_argument("--profile", action="store_true", help="only profile ours vs HF generate (op time by group)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = start(build_parser(), argv)
    loaded = load_model("base", resolve_device(args.device), args.seed)
    model, label = loaded.model, loaded.label
    if args.profile:
        prof = profile_ops(model, eval_prompts([16], model.config.vocab_size, real_text=loaded.trained,
                                               seed=args.seed)[0])
        for name, r in prof.items():
            print(f"{name:5s} " + "  ".join(f"{k} {v:.0f}" for k, v in r.items()))
        print("one-token projection, us, ours nn.Linear (out, in) / HF Conv1D (in, out), same weights:")
        for name, r in projection_times(model).items():
            print(f"  {name:12s} hot {r['ours_hot']:6.1f} / {r['hf_hot']:6.1f}   streamed (decode order) "
                  f"{r['ours_streamed']:6.1f} / {r['hf_streamed']:6.1f}   max |diff| {r['max_abs_diff']:.1e}")
        return 0
    report = run_all(model, real_text=loaded.trained, quick=args.quick, seed=args.seed, full=not args.quick)
    report["model"] = label
    print(f"model: {label}")
    print(format_table(report))
    write_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

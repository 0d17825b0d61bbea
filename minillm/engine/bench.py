"""Chapter 06's measurements: offline throughput (continuous vs static vs Hugging Face), online latency against
request rate, the efficient frontier, and the inter-token-latency spike of a long prompt with and without chunks.

Everything runs on one model in one process, side by side, and each number is a ratio or a percentile of that run
(curriculum: measured, never asserted in a test). `python -m minillm.engine.bench` prints the chapter's tables
and writes the frontier plot; the tour (`minillm/engine/tour.py`) calls the same functions on smaller workloads.
What it leaves out: multi-GPU and real traces.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from minillm.bench.check import same_tokens
from minillm.bench.cli import bench_parser, start, write_report
from minillm.bench.models import load_model
from minillm.bench.workload import WorkloadRequest, workload
from minillm.core.config import check_choice, check_int, check_sequence, short_repr
from minillm.core.io import atomic_save_figure, check_output_file, check_path
from minillm.core.model import GPT, require_model
from minillm.core.timing import compare
from minillm.engine.config import EngineConfig
from minillm.engine.llm import LLM
from minillm.kvcache.generate import generate_ids

# The runners and the offline comparison live in `minillm.engine.throughput` (chapter 13's tour uses them too);
# imported here so this module's callers (the notebook, the tour) find them where they always were.
from minillm.engine.throughput import (
    RunResult,
    hf_generate_batch_available,
    offline_throughput,
    run_engine,
    run_hf_continuous,
    run_hf_generate,
    run_static_batches,
)

__all__ = ["RunResult", "hf_generate_batch_available", "offline_throughput", "run_engine", "run_hf_continuous",
           "run_hf_generate", "run_static_batches"]


# ----------------------------------------------------------------------------------------------- experiments


def agreement(model: GPT, n: int, seed: int = 0) -> dict[str, Any]:
    """n requests through a deliberately small pool (forces preemption) with chunked prefill, vs each alone."""
    require_model(model, "agreement")
    wl = workload("small-pool", n, seed=seed, vocab_size=model.config.vocab_size)
    need = max(len(w.prompt_token_ids) + w.output_len for w in wl)
    cfg = EngineConfig(num_blocks=max(-(-need // 8) + 1, n), block_size=8, max_num_seqs=8,
                       max_num_batched_tokens=32)
    llm = LLM(model, None, cfg)
    outs = llm.generate([w.prompt_token_ids for w in wl], [w.params for w in wl])
    same = same_tokens([generate_ids(model, w.prompt_token_ids, w.params) for w in wl],
                       [o.output_token_ids for o in outs], unit="requests")
    return {"identical": same.equal, "n": same.total, "preemptions": llm.scheduler.num_preemptions,
            "all_free": llm.block_manager.num_free_blocks == cfg.num_blocks}


def frontier(model: GPT, workload: Sequence[WorkloadRequest], batch_limits: Sequence[int], num_blocks: int = 512
             ) -> list[dict[str, Any]]:
    """Throughput against mean TPOT as the batch limit varies, for the engine and for static batching."""
    points = []
    for b in batch_limits:
        cfg = EngineConfig(num_blocks=num_blocks, block_size=16, max_num_seqs=b, max_num_batched_tokens=max(512, b))
        for run in (run_engine(model, workload, cfg), run_static_batches(model, workload, b)):
            s = run.summary()
            points.append({"engine": run.name, "batch": b, "tokens_per_s": run.tokens_per_s,
                           "tokens_per_cpu_s": run.tokens_per_cpu_s,
                           "mean_tpot_ms": s["mean_tpot_ms"], "p99_tpot_ms": s["p99_tpot_ms"]})
    return points


def plot_frontier(points: list[dict[str, Any]], path: str, title: str = "", y: str = "tokens_per_s") -> None:
    """Throughput (`y`: "tokens_per_s" wall clock, or "tokens_per_cpu_s") against mean TPOT, batch limits marked."""
    y = check_choice("y", y, ("tokens_per_s", "tokens_per_cpu_s"))
    _check_points(points, y)
    check_path(path, "path")
    if not isinstance(title, str):
        raise TypeError(f"title must be a str, got {type(title).__name__} {short_repr(title)}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, style in (("static", "o--"), ("continuous", "s-")):
        pts = sorted((p for p in points if p["engine"] == name), key=lambda p: p["batch"])
        ax.plot([p["mean_tpot_ms"] for p in pts], [p[y] for p in pts], style, label=name)
        for p in pts:
            ax.annotate(str(p["batch"]), (p["mean_tpot_ms"], p[y]), textcoords="offset points",
                        xytext=(4, 4), fontsize=8)
    ax.set_xlabel("mean time per output token, TPOT (ms)  — lower is better")
    ax.set_ylabel(("output tokens / CPU-second" if y == "tokens_per_cpu_s" else "output tokens / s")
                  + "  — higher is better")
    ax.set_title(title or "The efficient frontier: batch limit annotated")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_save_figure(fig, path, dpi=120)
    plt.close(fig)


def _check_points(points: Any, y: str) -> None:
    """`frontier`'s points: a list of dicts, each with the keys the plot reads (a TypeError / ValueError naming the
    first one that is not)."""
    if not isinstance(points, list):
        raise TypeError(f"points must be a list of frontier points (dicts), got {type(points).__name__} "
                        f"{short_repr(points)}")
    keys = ("engine", "batch", "mean_tpot_ms", y)
    for i, p in enumerate(points):
        if not isinstance(p, dict) or not all(k in p for k in keys):
            raise ValueError(f"points[{i}] must be a frontier point, a dict with {list(keys)}, got {short_repr(p)}")


def online_latency(model: GPT, rates: Sequence[float], n: int = 32, seed: int = 0, batch: int = 32,
                   num_blocks: int = 512) -> list[dict[str, Any]]:
    """TTFT and TPOT p50/p99 of the engine against request rate (Poisson arrivals, real time)."""
    require_model(model, "online_latency")
    check_sequence("rates", rates)  # each rate is checked by the workload it makes
    batch, num_blocks = check_int("batch", batch), check_int("num_blocks", num_blocks)
    cfg = EngineConfig(num_blocks=num_blocks, block_size=16, max_num_seqs=batch, max_num_batched_tokens=512)
    rows = []
    for rate in rates:
        wl = workload("mixed", n, seed=seed, rate=rate, vocab_size=model.config.vocab_size)
        s = run_engine(model, wl, cfg, realtime=True).summary()
        rows.append({"rate": rate, **{k: s[k] for k in ("output_throughput", "median_ttft_ms", "p99_ttft_ms",
                                                         "median_tpot_ms", "p99_tpot_ms")}})
    return rows


def chunked_prefill_itl(model: GPT, num_decodes: int = 16, long_len: int | None = None, chunk: int = 16,
                        seed: int = 0, repeats: int = 3) -> dict[str, Any]:
    """A long prompt arriving among `num_decodes` running decodes: the decodes' inter-token latency.

    Steady state: median ITL of the steps before the arrival. Spike: p99 of the decodes' ITL between the arrival
    and the long prompt's first token. Without chunking the whole prompt shares one step with the decodes; with
    chunking (token budget = decodes + `chunk`) it is spread over several. Outputs must be identical.
    """
    require_model(model, "chunked_prefill_itl")
    num_decodes, chunk = check_int("num_decodes", num_decodes), check_int("chunk", chunk)
    repeats = check_int("repeats", repeats)
    if long_len is not None:
        check_int("long_len", long_len)
    window = model.config.block_size
    long_len = long_len or window - 16
    V = model.config.vocab_size
    dec = workload("decodes", num_decodes, seed=seed, vocab_size=V)
    long_req = workload("decodes", 1, seed=seed + 1, vocab_size=V, prompt_len=long_len, output_len=8)[0]
    results: dict[str, Any] = {}
    for chunked in (False, True):
        ratios, spikes, steadies, ttfts = [], [], [], []
        outputs = None
        for _ in range(repeats):
            budget = num_decodes + chunk if chunked else max(512, window)
            cfg = EngineConfig(num_blocks=512, block_size=16, max_num_seqs=num_decodes + 1,
                               max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
            llm = LLM(model, None, cfg)
            ids = [llm.add_request(w.prompt_token_ids, w.params) for w in dec]
            finals: dict[str, Any] = {}
            for _ in range(14):  # prefill everyone, then settle into decoding
                for o in llm.step():
                    finals[o.request_id] = o
            t_arrive = time.perf_counter()
            lid = llm.add_request(long_req.prompt_token_ids, long_req.params, arrival_time=t_arrive)
            while llm.has_unfinished():
                for o in llm.step():
                    finals[o.request_id] = o
            t_first = finals[lid].token_times[0]
            before, during = [], []
            for rid in ids:
                tt = finals[rid].token_times
                for a, b in zip(tt, tt[1:]):
                    if b < t_arrive and a > tt[2]:
                        before.append(b - a)
                    elif t_arrive <= b <= t_first + 1e-9:
                        during.append(b - a)
            steady = statistics.median(before)
            spike = float(torch.tensor(during).quantile(0.99)) if during else steady
            ratios.append(spike / steady)
            spikes.append(spike)
            steadies.append(steady)
            ttfts.append(t_first - t_arrive)
            outs = [finals[r].output_token_ids for r in ids + [lid]]
            assert outputs is None or outs == outputs
            outputs = outs
        key = "chunked" if chunked else "unchunked"
        results[key] = {"itl_ratio": statistics.median(ratios), "p99_itl_ms": 1e3 * statistics.median(spikes),
                        "steady_itl_ms": 1e3 * statistics.median(steadies),
                        "long_ttft_ms": 1e3 * statistics.median(ttfts), "outputs": outputs,
                        "budget": num_decodes + chunk if chunked else max(512, window)}
    results["identical"] = same_tokens(results["unchunked"].pop("outputs"), results["chunked"].pop("outputs")).ok
    results["long_len"], results["num_decodes"] = long_len, num_decodes
    return results


def decode_attention_forms(num_seqs: int = 8, n_head: int = 8, head_size: int = 32, block_size: int = 16,
                           num_blocks: int = 512, calls: int = 50, repeats: int = 5, seed: int = 0
                           ) -> dict[str, Any]:
    """One layer's decode attention (one query per sequence) in four forms, timed in one run; µs per call.

    - `paged_padded` (our engine, chapter 05's fast path): gather every sequence's blocks, padded to the longest,
      then one SDPA over (S, nh, L, hs) keys read as a strided view of the pool's (S, L, nh, hs) layout;
    - `paged_padded_sdpa_only`: the SDPA call of the above alone, on already gathered keys;
    - `contiguous`: the same SDPA on keys already in (S, nh, L, hs) order (a contiguous cache, chapter 04's
      static batching): what the gather and the strided layout cost;
    - `flattened_block_diagonal` (Hugging Face's continuous batching): gather only real blocks, then one SDPA of
      all S queries over all gathered keys with a block-diagonal mask.
    Context lengths are drawn uniformly from [16, 250] (one sequence at 250). All four outputs must agree.
    """
    g = torch.Generator().manual_seed(seed)
    S, nh, hs, bs = num_seqs, n_head, head_size, block_size
    k_pool = torch.randn(num_blocks, bs, nh, hs, generator=g)  # (nb, bs, nh, hs)
    v_pool = torch.randn(num_blocks, bs, nh, hs, generator=g)
    lens = torch.randint(16, 251, (S,), generator=g)
    lens[0] = 250
    nblk = [-(-int(n) // bs) for n in lens]
    perm = torch.randperm(num_blocks, generator=g)
    offsets = [0] + list(torch.tensor(nblk).cumsum(0).tolist())
    tables = [perm[offsets[i]:offsets[i + 1]] for i in range(S)]  # each sequence's blocks, scattered in the pool
    width = max(nblk)
    L = width * bs
    padded_ids = torch.cat([torch.cat([t, t[:1].repeat(width - len(t))]) for t in tables])  # (S*width,)
    pad_mask = torch.zeros(S, 1, 1, L).masked_fill(~(torch.arange(L) < lens[:, None])[:, None, None, :], float("-inf"))
    real_ids = torch.cat(tables)  # (sum nblk,)
    tot = len(real_ids) * bs
    owner = torch.repeat_interleave(torch.arange(S), torch.tensor(nblk) * bs)  # (tot,) which sequence a slot holds
    offset_in_seq = torch.cat([torch.arange(n * bs) for n in nblk])  # (tot,)
    visible = (owner[None, :] == torch.arange(S)[:, None]) & (offset_in_seq[None, :] < lens[:, None])  # (S, tot)
    flat_mask = torch.zeros(1, 1, S, tot).masked_fill(~visible[None, None], float("-inf"))
    q = torch.randn(S, nh, 1, hs, generator=g)  # (S, nh, 1, hs)
    q_flat = q[:, :, 0].transpose(0, 1).unsqueeze(0)  # (1, nh, S, hs)
    row = bs * nh * hs
    scratch = torch.empty(2, S * width, row)
    scratch_flat = torch.empty(2, len(real_ids), row)

    def gather_padded():
        k = torch.index_select(k_pool.view(num_blocks, row), 0, padded_ids, out=scratch[0])
        v = torch.index_select(v_pool.view(num_blocks, row), 0, padded_ids, out=scratch[1])
        return k.view(S, L, nh, hs).transpose(1, 2), v.view(S, L, nh, hs).transpose(1, 2)  # (S, nh, L, hs) views

    k_g, v_g = gather_padded()
    k_c, v_c = k_g.contiguous(), v_g.contiguous()

    def paged_padded():
        k, v = gather_padded()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=pad_mask)  # (S, nh, 1, hs)

    def flattened():
        k = torch.index_select(k_pool.view(num_blocks, row), 0, real_ids, out=scratch_flat[0])
        v = torch.index_select(v_pool.view(num_blocks, row), 0, real_ids, out=scratch_flat[1])
        k, v = (x.view(1, tot, nh, hs).transpose(1, 2) for x in (k, v))  # (1, nh, tot, hs)
        return F.scaled_dot_product_attention(q_flat, k, v, attn_mask=flat_mask)  # (1, nh, S, hs)

    forms = {
        "paged_padded": paged_padded,
        "paged_padded_sdpa_only": lambda: F.scaled_dot_product_attention(q, k_g, v_g, attn_mask=pad_mask),
        "contiguous": lambda: F.scaled_dot_product_attention(q, k_c, v_c, attn_mask=pad_mask),
        "flattened_block_diagonal": flattened,
    }
    def as_rows(name: str, y: torch.Tensor) -> torch.Tensor:  # every form's output as (S, nh, hs)
        return y[0].transpose(0, 1) if name == "flattened_block_diagonal" else y[:, :, 0]

    def many(fn):
        return lambda: [fn() for _ in range(calls)]

    with torch.inference_mode():
        ref = as_rows("paged_padded", paged_padded())
        diffs = {name: float((as_rows(name, fn()) - ref).abs().max()) for name, fn in forms.items()}
        us, base_times = {}, []
        for name, fn in forms.items():  # each form interleaved with our engine's (the first), median of repeats
            if name != "paged_padded":
                cmp = compare(many(paged_padded), many(fn), warmup=1, repeats=repeats)
                us[name] = cmp.candidate.median / calls * 1e6
                base_times += cmp.baseline.times
        us["paged_padded"] = statistics.median(base_times) / calls * 1e6
    return {"num_seqs": S, "context_lens": lens.tolist(), "padded_len": L, "flattened_len": tot,
            "us_per_call": {name: us[name] for name in forms}, "max_abs_diff": diffs}


def build_parser() -> argparse.ArgumentParser:
    """The kit's shared options (`minillm.bench.cli`; the engine runs on the CPU here) and this benchmark's own."""
    ap = bench_parser("python -m minillm.engine.bench", __doc__.splitlines()[0], devices=("cpu",))
    ap.add_argument("--model", default="base", help="shipped checkpoint (default base)")
    ap.add_argument("--n", type=int, default=64, help="requests in the offline workload (default 64)")
    ap.add_argument("--batch", type=int, default=32, help="batch limit of the engine and static batching")
    ap.add_argument("--frontier", default="1,2,4,8,16,32,64", help="batch limits of the frontier")
    ap.add_argument("--rates", default="2,4,8,16", help="request rates of the online latency sweep")
    ap.add_argument("--plot", default="chapters/figures/06-frontier.png", help="where the frontier figure goes")
    ap.add_argument("--skip", default="", help="comma list of: offline,frontier,online,chunked,attention")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = start(ap, argv)  # --threads checked and set, the --json path checked
    check_output_file(args.plot, "--plot", (".png",))
    loaded = load_model(args.model, seed=args.seed)
    model = loaded.model
    skip = set(filter(None, args.skip.split(",")))
    report: dict[str, Any] = {"model": loaded.label, "trained": loaded.trained, "threads": torch.get_num_threads()}
    wl = workload("mixed", args.n, seed=args.seed, vocab_size=model.config.vocab_size)
    if "offline" not in skip:
        report["offline"] = offline_throughput(model, wl, batch=args.batch)
        print(json.dumps(report["offline"], indent=1))
    if "attention" not in skip:
        report["attention"] = decode_attention_forms(n_head=model.config.n_head, head_size=model.config.head_size)
        print(json.dumps(report["attention"], indent=1))
    if "chunked" not in skip:
        report["chunked"] = chunked_prefill_itl(model)
        print(json.dumps(report["chunked"], indent=1))
    if "frontier" not in skip:
        pts = frontier(model, wl, [int(b) for b in args.frontier.split(",")])
        report["frontier"] = pts
        print(json.dumps(pts, indent=1))
        plot_frontier(pts, args.plot, f"minillm {args.model}: {args.n} mixed-length requests, CPU", y="tokens_per_cpu_s")
    if "online" not in skip:
        report["online"] = online_latency(model, [float(r) for r in args.rates.split(",")])
        print(json.dumps(report["online"], indent=1))
    write_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Chapter 05's checks and measurements, shared by the tour entry, the notebook and the chapter text.

It adds nothing to the cache itself: it runs the paged path beside chapter 04's contiguous cache and chapter 03's
naive loop (identical tokens, parallel samples, prefix caching), replays a seeded workload of mixed prompt and
output lengths through the real `BlockManager` to count reserved against used KV slots (the vLLM paper's Figure 2
on our workload), and times paged against contiguous decode and paged attention against block size.
What it leaves out: many requests at once and the throughput a scheduler wins from the freed memory (chapter 06),
and external fragmentation across a real schedule (all reservations are per request here).

`python -m minillm.paged.bench [--quick] [--json PATH]` prints the chapter's tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
from dataclasses import dataclass
from typing import Any

import torch

from minillm.bench.check import same_tokens
from minillm.bench.cli import bench_parser, start, write_report
from minillm.bench.models import load_model
from minillm.bench.workload import eval_prompts
from minillm.core.config import check_choice, check_instance, check_int, check_sequence, reads_report
from minillm.core.device import resolve_device
from minillm.core.model import GPT, require_model
from minillm.core.sampling import SamplingParams, check_seed
from minillm.core.stopping import check_token_ids
from minillm.core.timing import check_calls, check_repeats, compare
from minillm.kvcache.cache import ContiguousKVCache
from minillm.kvcache.generate import generate_ids
from minillm.naive.generate import generate_naive_ids
from minillm.paged.block_manager import BlockManager, num_blocks_for
from minillm.paged.generate import PagedGenerator, paged_generate
from minillm.paged.paged_cache import PagedBatch, PagedKVCache

BLOCK_SIZES = (1, 4, 8, 16, 32, 64)


# ------------------------------------------------------------------------------------------------ correctness


@torch.inference_mode()
def prefill_logit_diff(model: GPT, prompt: list[int], block_size: int = 16) -> float:
    """Largest |logit| difference over every prompt position, paged prefill vs chapter 04's contiguous prefill."""
    cfg = require_model(model, "prefill_logit_diff (model)")
    prompt, block_size = check_token_ids("prompt", prompt, cfg.vocab_size), check_int("block_size", block_size)
    if not 1 <= len(prompt) <= cfg.block_size:
        raise ValueError(f"prompt must hold 1 to block_size={cfg.block_size} tokens, got {len(prompt)}")
    dev = model.device
    cache = ContiguousKVCache(model.config, 1, len(prompt), device=dev, dtype=torch.float32)
    ref = model(torch.tensor([prompt], device=dev), cache=cache)[0]  # (T, V)
    nblocks = -(-len(prompt) // block_size)
    manager = BlockManager(nblocks, block_size)
    pcache = PagedKVCache(model.config, nblocks, block_size, device=dev, dtype=torch.float32)
    manager.allocate(0, prompt)
    try:
        batch = PagedBatch.build(manager, [(0, 0, len(prompt))], device=dev)
        pcache.set_batch(batch)
        got = model(torch.tensor([prompt], device=dev), batch.positions(), cache=pcache)[0]  # (T, V)
    finally:
        manager.free(0)
    return (got - ref).abs().max().item()


def check_equivalence(model: GPT, prompts: list[list[int]], new_tokens: int, block_size: int = 16) -> dict[str, Any]:
    """Greedy tokens: paged == contiguous == naive, per prompt (exact); and the largest prefill logit difference."""
    params = SamplingParams.greedy(new_tokens, ignore_eos=True)
    paged = [paged_generate(model, p, params, block_size=block_size).token_ids[0] for p in prompts]
    same = same_tokens([generate_naive_ids(model, p, params) for p in prompts],
                       [generate_ids(model, p, params) for p in prompts], paged)
    max_diff = max(prefill_logit_diff(model, p, block_size) for p in prompts)
    return {"identical": same.equal, "prompts": same.total, "tokens": sum(map(len, paged)),
            "max_abs_logit_diff": max_diff, "block_size": block_size}


def check_parallel_samples(model: GPT, prompt: list[int], n: int, new_tokens: int, seed: int,
                           block_size: int = 16) -> dict[str, Any]:
    """n seeded samples sharing the prompt's blocks vs n independent contiguous runs seeded seed + i."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, top_k=50, seed=seed, n=n, ignore_eos=True)
    out = paged_generate(model, prompt, params, block_size=block_size)
    alone = [generate_ids(model, prompt, dataclasses.replace(params, n=1, seed=seed + i)) for i in range(n)]
    same = same_tokens(alone, out.token_ids[:n], unit="samples")
    return {"identical": same.equal, "n": n, "peak_blocks": out.peak_blocks,
            "peak_blocks_unshared": out.peak_blocks_unshared, "blocks_saved": out.blocks_saved,
            "cow_copies": out.num_cow_copies, "block_size": block_size}


def check_prefix_caching(model: GPT, system: list[int], users: list[list[int]], new_tokens: int,
                         block_size: int = 16) -> dict[str, Any]:
    """Requests sharing a system prompt, one after another: with prefix caching vs without (tokens exact)."""
    params = SamplingParams.greedy(new_tokens, ignore_eos=True)
    nblocks = 4 * (-(-(len(system) + max(map(len, users)) + new_tokens) // block_size)) + 1
    cached = PagedGenerator(model, nblocks, block_size, enable_prefix_caching=True)
    plain = PagedGenerator(model, nblocks, block_size)
    with_cache, without = [], []
    for u in users:  # subtle: one after another, so each request can reuse the blocks the previous ones cached
        with_cache.append(cached.generate(system + u, params))
        without.append(plain.generate(system + u, params))
    same = same_tokens([b.token_ids for b in without], [a.token_ids for a in with_cache], unit="requests")
    skipped = sum(a.num_cached_tokens for a in with_cache)
    prompt_tokens = sum(a.num_prompt_tokens for a in with_cache)
    return {"identical": same.equal, "requests": same.total, "prefill_tokens_skipped": skipped,
            "prompt_tokens": prompt_tokens, "skipped_fraction": skipped / prompt_tokens,
            "system_len": len(system), "block_size": block_size}


# -------------------------------------------------------------------------------------------- memory and time


@dataclass(frozen=True)
class LengthRequest:
    prompt_len: int  # tokens in the prompt (a system prompt plus the user's message)
    output_len: int  # tokens actually generated before end-of-text
    max_new_tokens: int  # the cap the request asked for (what a contiguous cache reserves for it)


def make_length_workload(
    num_requests: int = 200,
    seed: int = 0,
    prompt_range: tuple[int, int] = (96, 224),
    mean_output: float = 48.0,
    max_new_tokens: int = 128,
    context: int = 256,
) -> list[LengthRequest]:
    """Requests with prompts uniform in prompt_range and outputs exponential around mean_output (at least 4),
    all fitting the context window. A chat-like shape: a long shared system prompt, shorter answers."""
    if num_requests <= 0:
        raise ValueError(f"num_requests must be positive, got {num_requests}")
    lo, hi = prompt_range
    if not 1 <= lo <= hi < context:
        raise ValueError(f"prompt_range must satisfy 1 <= lo <= hi < context={context}, got {prompt_range}")
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        p = rng.randint(lo, hi)
        cap = min(max_new_tokens, context - p)
        o = max(4, min(cap, round(rng.expovariate(1.0 / mean_output))))
        out.append(LengthRequest(p, min(o, cap), cap))
    return out


@dataclass
class MemoryUse:
    scheme: str  # "contiguous (max length)", "contiguous (prompt + max_new)", "paged bs=16"
    used_slots: int  # sum over requests and steps of tokens held in the cache
    reserved_slots: int  # sum over requests and steps of slots set aside for them
    max_waste_per_seq: int  # the largest reserved - used seen for one request at one step

    @property
    def utilisation(self) -> float:
        return self.used_slots / self.reserved_slots

    @property
    def waste(self) -> float:
        return 1.0 - self.utilisation


def _lifetime_lengths(r: LengthRequest):
    # The cache holds prompt + t tokens while the (t+1)-th new token is computed; the last one is never fed back.
    return range(r.prompt_len, r.prompt_len + r.output_len)


def _check_workload(workload: Any) -> tuple[LengthRequest, ...]:
    """`workload` as a tuple if it is a non-empty list of `LengthRequest`s (what `make_length_workload` returns); a
    TypeError / ValueError naming the first entry that is not one."""
    workload = check_sequence("workload", workload)
    for i, r in enumerate(workload):
        check_instance(f"workload[{i}]", r, LengthRequest, "a LengthRequest")
    return workload


def contiguous_memory_use(workload: list[LengthRequest], reserve: str = "max_len", context: int = 256) -> MemoryUse:
    """Each request reserves `context` slots ("max_len"), or prompt + max_new_tokens ("max_new"), up front."""
    workload, context = _check_workload(workload), check_int("context", context)
    reserve = check_choice("reserve", reserve, ("max_len", "max_new"))
    used = reserved = worst = 0
    for r in workload:
        slots = context if reserve == "max_len" else r.prompt_len + r.max_new_tokens
        for L in _lifetime_lengths(r):
            used += L
            reserved += slots
            worst = max(worst, slots - L)
    name = "contiguous (max length)" if reserve == "max_len" else "contiguous (prompt + max_new)"
    return MemoryUse(name, used, reserved, worst)


def paged_memory_use(workload: list[LengthRequest], block_size: int) -> MemoryUse:
    """Replay every request through a real `BlockManager`: allocate the prompt, append one token per step."""
    workload, block_size = _check_workload(workload), check_int("block_size", block_size)
    longest = max(r.prompt_len + r.output_len for r in workload)
    manager = BlockManager(num_blocks_for(longest, block_size), block_size)
    used = reserved = worst = 0
    for r in workload:
        manager.allocate("r", [0] * r.prompt_len)
        for L in _lifetime_lengths(r):
            if L > r.prompt_len:
                manager.append_slot("r", 0)
            held = len(manager.block_table("r")) * block_size
            used += L
            reserved += held
            worst = max(worst, held - L)
        manager.free("r")
    assert manager.num_free_blocks == manager.num_blocks
    return MemoryUse(f"paged bs={block_size}", used, reserved, worst)


# ----------------------------------------------------------------------------------------------------- timing


def _decoder_pair(model: GPT, num_seqs: int, prompt_len: int, block_size: int, seed: int = 0):
    """Two stateful closures, each decoding one step for `num_seqs` sequences of the same prompt length:
    one on a ContiguousKVCache, one on a PagedKVCache. Both prefill first (untimed), both feed greedy tokens."""
    cfg, dev = model.config, model.device
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, cfg.vocab_size, (num_seqs, prompt_len), generator=g).to(dev)  # (S, P)
    dtype = torch.float32  # the cache's dtype is the caller's choice (chapter 09 varies it), not read off the model
    # contiguous
    ccache = ContiguousKVCache(cfg, num_seqs, cfg.block_size, device=dev, dtype=dtype)
    with torch.inference_mode():
        c_tok = model(prompts, cache=ccache)[:, -1].argmax(-1)  # (S,)
    c_state = {"tok": c_tok, "history": [c_tok.tolist()]}

    def contiguous_step():
        with torch.inference_mode():
            logits = model(c_state["tok"].view(-1, 1), positions=ccache.positions(1), cache=ccache)  # (S, 1, V)
            c_state["tok"] = logits[:, -1].argmax(-1)
        c_state["history"].append(c_state["tok"].tolist())  # subtle: one host sync per step, on both sides

    # paged
    nblocks = num_seqs * num_blocks_for(cfg.block_size, block_size) + 1
    manager = BlockManager(nblocks, block_size)
    pcache = PagedKVCache(cfg, nblocks, block_size, device=dev, dtype=dtype)
    for i in range(num_seqs):
        manager.allocate(i, prompts[i].tolist())
    batch = PagedBatch.build(manager, [(i, 0, prompt_len) for i in range(num_seqs)], device=dev)
    pcache.set_batch(batch)
    with torch.inference_mode():
        logits = model(prompts.view(1, -1), positions=batch.positions(), cache=pcache)[0]  # (S*P, V)
    first = logits.view(num_seqs, prompt_len, -1)[:, -1].argmax(-1).tolist()  # (S*P, V) -> (S, P, V) -> (S,)
    p_state = {"tok": first, "history": [first]}

    def paged_step():
        toks = p_state["tok"]
        for i, t in enumerate(toks):
            manager.append_slot(i, t)
        b = PagedBatch.build(manager, [(i, manager.num_tokens(i) - 1, 1) for i in range(num_seqs)], device=dev)
        pcache.set_batch(b)
        with torch.inference_mode():
            out = model(torch.tensor([toks], device=dev), positions=b.positions(), cache=pcache)[0]  # (S, V)
        p_state["tok"] = out.argmax(-1).tolist()
        p_state["history"].append(p_state["tok"])

    def release():
        for i in range(num_seqs):
            manager.free(i)

    def same_tokens() -> bool:
        return c_state["history"] == p_state["history"]

    return contiguous_step, paged_step, release, same_tokens


@dataclass
class DecodeTiming:
    contiguous_s: float  # median seconds for `steps` decode steps on the contiguous cache
    paged_s: float  # the same on the paged cache
    block_size: int
    num_seqs: int
    prompt_len: int
    steps: int
    identical_tokens: bool  # both caches produced the same greedy tokens at every timed step

    @property
    def ratio(self) -> float:
        """paged time / contiguous time: 1.0 = as fast, above 1 = slower."""
        return self.paged_s / self.contiguous_s


def decode_time_ratio(
    model: GPT, num_seqs: int = 8, prompt_len: int = 96, steps: int = 16, block_size: int = 16,
    repeats: int = 5, seed: int = 0,
) -> DecodeTiming:
    """Median time of `steps` batched decode steps, paged vs contiguous, interleaved (`minillm.core.timing.compare`).

    Each timed call continues decoding where the last stopped, on both sides alike, so all repeats together
    cover contexts prompt_len .. prompt_len + (repeats + 1) * steps; that must fit the context window.
    """
    require_model(model, "decode_time_ratio (model)")
    for name, value in (("num_seqs", num_seqs), ("prompt_len", prompt_len), ("steps", steps),
                        ("block_size", block_size)):
        check_int(name, value)
    check_repeats("repeats", repeats), check_seed(seed)
    if prompt_len + (repeats + 1) * steps > model.config.block_size:
        raise ValueError(f"prompt_len={prompt_len} + (repeats+1)*steps={(repeats + 1) * steps} exceeds the "
                         f"context window {model.config.block_size}")
    c_step, p_step, release, same_tokens = _decoder_pair(model, num_seqs, prompt_len, block_size, seed)
    try:
        def run(step):
            return lambda: [step() for _ in range(steps)]

        cmp = compare(run(c_step), run(p_step), warmup=1, repeats=repeats, device=model.device)
    finally:
        release()
    return DecodeTiming(cmp.baseline.median, cmp.candidate.median, block_size, num_seqs, prompt_len, steps,
                        same_tokens())


def attention_time_by_block_size(
    model: GPT, block_sizes: tuple[int, ...] = BLOCK_SIZES, num_seqs: int = 8, context: int = 160,
    repeats: int = 7, calls: int = 10, reference: int = 16,
) -> dict[int, float]:
    """Median seconds of one layer's paged decode attention (`PagedKVCache.attend`) per block size.

    The same step is replayed (it writes the same K/V into the same slots), so only the attention is timed. Each
    block size is timed by `compare`, interleaved with the `reference` block size, so a burst of load on a shared
    machine hits both alike; the reference's own figure is the median over all its runs.
    """
    require_model(model, "attention_time_by_block_size (model)")
    for i, bs in enumerate(check_sequence("block_sizes", block_sizes)):
        check_int(f"block_sizes[{i}]", bs)
    for name, value in (("num_seqs", num_seqs), ("context", context), ("reference", reference)):
        check_int(name, value)
    check_repeats("repeats", repeats), check_calls("calls", calls)
    cfg, dev = model.config, model.device
    nh, hs = cfg.n_head, cfg.head_size
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, nh, num_seqs, hs, generator=g).to(dev)  # (1, nh, S, hs)
    k = torch.randn(1, nh, num_seqs, hs, generator=g).to(dev)
    v = torch.randn(1, nh, num_seqs, hs, generator=g).to(dev)
    managers, fns = [], {}
    try:
        for bs in dict.fromkeys((reference, *block_sizes)):
            nblocks = num_seqs * num_blocks_for(context, bs)
            manager = BlockManager(nblocks, bs)
            managers.append(manager)
            cache = PagedKVCache(cfg, nblocks, bs, device=dev, dtype=torch.float32)
            for i in range(num_seqs):
                manager.allocate(i, [0] * context)
            cache.set_batch(PagedBatch.build(manager, [(i, context - 1, 1) for i in range(num_seqs)], device=dev))
            fns[bs] = lambda cache=cache: [cache.attend(0, q, k, v) for _ in range(calls)]
        out, ref_times = {}, []
        for bs in block_sizes:
            if bs == reference:
                continue
            cmp = compare(fns[reference], fns[bs], warmup=1, repeats=repeats, device=dev)
            out[bs] = cmp.candidate.median / calls
            ref_times += cmp.baseline.times
    finally:
        for manager in managers:
            for i in range(num_seqs):
                if manager.has_seq(i):
                    manager.free(i)
    if reference in block_sizes:
        out[reference] = statistics.median(ref_times) / calls
    return {bs: out[bs] for bs in block_sizes}


def memory_table(num_requests: int = 200, seed: int = 0, block_sizes: tuple[int, ...] = BLOCK_SIZES,
                 context: int = 256) -> list[dict[str, Any]]:
    """Utilisation of reserved KV slots on the seeded workload, contiguous reservations vs paged block sizes."""
    work = make_length_workload(num_requests, seed, context=context)
    uses = [contiguous_memory_use(work, "max_len", context), contiguous_memory_use(work, "max_new", context)]
    uses += [paged_memory_use(work, bs) for bs in block_sizes]
    return [{"scheme": u.scheme, "utilisation": u.utilisation, "waste": u.waste,
             "max_waste_per_seq": u.max_waste_per_seq, "used_slots": u.used_slots,
             "reserved_slots": u.reserved_slots} for u in uses]


def run_all(model: GPT, real_text: bool, quick: bool = False, seed: int = 0) -> dict[str, Any]:
    """Everything the tour prints, in one dict."""
    lens = [24, 61] if quick else [24, 61, 97]
    V = model.config.vocab_size
    prompts = eval_prompts(lens, V, real_text, seed)
    report: dict[str, Any] = {}
    report["equivalence"] = check_equivalence(model, prompts, 8 if quick else 24)
    report["samples"] = check_parallel_samples(model, prompts[-1], 3 if quick else 4, 8 if quick else 16, seed)
    text = eval_prompts([80, 12, 9, 15, 11, 14], V, real_text, seed + 1)
    users = text[1:3] if quick else text[1:]
    report["prefix"] = check_prefix_caching(model, text[0], users, 4 if quick else 8)
    report["memory"] = memory_table(80 if quick else 200, seed)
    if quick:
        report["decode"] = dataclasses.asdict(decode_time_ratio(model, num_seqs=4, prompt_len=64, steps=4, repeats=3))
    else:
        report["decode"] = dataclasses.asdict(decode_time_ratio(model, num_seqs=8, prompt_len=64, steps=16,
                                                                repeats=5))
    report["decode"]["ratio"] = report["decode"]["paged_s"] / report["decode"]["contiguous_s"]
    if not quick:
        report["attention_by_block_size"] = attention_time_by_block_size(model)
    return report


@reads_report
def format_markdown(report: dict[str, Any], label: str) -> str:
    """The report as the Markdown tables the chapter text pastes."""
    out = [f"Model: {label}.", "", "| scheme | KV slots holding a token | waste | max waste per sequence (slots) |",
           "|---|---|---|---|"]
    for m in report["memory"]:
        out.append(f"| {m['scheme']} | {m['utilisation']:.1%} | {m['waste']:.2%} | {m['max_waste_per_seq']} |")
    d = report["decode"]
    out += ["", "| decode, batch of sequences | contiguous | paged | paged / contiguous | identical tokens |",
            "|---|---|---|---|---|",
            f"| {d['num_seqs']} seqs, prompt {d['prompt_len']}, {d['steps']} steps, bs={d['block_size']} | "
            f"{1e3 * d['contiguous_s'] / d['steps']:.2f} ms/step | {1e3 * d['paged_s'] / d['steps']:.2f} ms/step | "
            f"{d['ratio']:.2f}x | {d['identical_tokens']} |"]
    att = report.get("attention_by_block_size")
    if att:
        out += ["", "| block size | " + " | ".join(str(b) for b in att) + " |",
                "|---|" + "---|" * len(att),
                "| paged decode attention, µs per layer (8 seqs x 160 tokens) | "
                + " | ".join(f"{1e6 * t:.0f}" for t in att.values()) + " |"]
    eq, s, p = report["equivalence"], report["samples"], report["prefix"]
    out += ["", f"- Greedy tokens paged == contiguous == naive: {eq['identical']}/{eq['prompts']} prompts "
                f"({eq['tokens']} tokens); largest prefill logit difference {eq['max_abs_logit_diff']:.1e}.",
            f"- {s['n']} parallel samples: {s['identical']}/{s['n']} equal independent runs seeded seed+i; peak "
            f"{s['peak_blocks']} blocks instead of {s['peak_blocks_unshared']} ({s['blocks_saved']} saved), "
            f"{s['cow_copies']} copy-on-write copies.",
            f"- Prefix caching: {p['identical']}/{p['requests']} requests identical to no caching; "
            f"{p['prefill_tokens_skipped']} of {p['prompt_tokens']} prompt tokens skipped "
            f"({p['skipped_fraction']:.1%})."]
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    return bench_parser("python -m minillm.paged.bench", main.__doc__, "smaller workloads")


def main(argv: list[str] | None = None) -> int:
    """`python -m minillm.paged.bench [--quick] [--json PATH]`: every chapter 05 measurement, as Markdown."""
    args = start(build_parser(), argv)
    loaded = load_model("base", resolve_device(args.device), args.seed)
    report = run_all(loaded.model, real_text=loaded.trained, quick=args.quick, seed=args.seed)
    print(format_markdown(report, loaded.label))
    write_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The chapter's checks and measurements in one place, shared by the tour entry, the notebook and the chapter text.

It adds nothing to the cache itself: it runs the paged path beside chapter 04's contiguous cache and chapter 03's
naive loop on the `base` checkpoint (random weights of its shape when the checkpoint is missing, labelled so),
and returns plain dicts. What it leaves out: many requests at once (chapter 06).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from minillm.kvcache.generate import generate_ids
from minillm.gpt.dataset import eval_prompts as make_prompts  # re-exported: the chapter 05 notebook calls it
from minillm.naive.generate import generate_naive_ids
from minillm.kvcache.cache import ContiguousKVCache
from minillm.core.model import GPT
from minillm.paged.block_manager import BlockManager
from minillm.paged.generate import PagedGenerator, paged_generate
from minillm.paged.paged_cache import PagedBatch, PagedKVCache
from minillm.paged.study import (
    attention_time_by_block_size,
    contiguous_memory_use,
    decode_time_ratio,
    make_length_workload,
    paged_memory_use,
)
from minillm.core.sampling import SamplingParams
from minillm.bench import models as bench_models

BLOCK_SIZES = (1, 4, 8, 16, 32, 64)


def load_model(device: torch.device | str = "cpu", seed: int = 0) -> tuple[GPT, str]:
    """(model, label): the shipped `base` checkpoint, or seeded random weights of its shape, labelled as such."""
    loaded = bench_models.load_model("base", device, seed)
    return loaded.model, loaded.label


@torch.inference_mode()
def prefill_logit_diff(model: GPT, prompt: list[int], block_size: int = 16) -> float:
    """Largest |logit| difference over every prompt position, paged prefill vs chapter 04's contiguous prefill."""
    dev = model.device
    cache = ContiguousKVCache(model.config, 1, len(prompt), device=dev, dtype=model.lm_head.weight.dtype)
    ref = model(torch.tensor([prompt], device=dev), cache=cache)[0]  # (T, V)
    nblocks = -(-len(prompt) // block_size)
    manager = BlockManager(nblocks, block_size)
    pcache = PagedKVCache(model.config, nblocks, block_size, device=dev, dtype=model.lm_head.weight.dtype)
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
    same, total, max_diff = 0, 0, 0.0
    for p in prompts:
        paged = paged_generate(model, p, params, block_size=block_size).token_ids[0]
        contiguous = generate_ids(model, p, params)
        naive = generate_naive_ids(model, p, params)
        same += paged == contiguous == naive
        total += len(paged)
        max_diff = max(max_diff, prefill_logit_diff(model, p, block_size))
    return {"identical": same, "prompts": len(prompts), "tokens": total, "max_abs_logit_diff": max_diff,
            "block_size": block_size}


def check_parallel_samples(model: GPT, prompt: list[int], n: int, new_tokens: int, seed: int,
                           block_size: int = 16) -> dict[str, Any]:
    """n seeded samples sharing the prompt's blocks vs n independent contiguous runs seeded seed + i."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, top_k=50, seed=seed, n=n, ignore_eos=True)
    out = paged_generate(model, prompt, params, block_size=block_size)
    same = sum(out.token_ids[i] == generate_ids(model, prompt, dataclasses.replace(params, n=1, seed=seed + i))
               for i in range(n))
    return {"identical": same, "n": n, "peak_blocks": out.peak_blocks,
            "peak_blocks_unshared": out.peak_blocks_unshared, "blocks_saved": out.blocks_saved,
            "cow_copies": out.num_cow_copies, "block_size": block_size}


def check_prefix_caching(model: GPT, system: list[int], users: list[list[int]], new_tokens: int,
                         block_size: int = 16) -> dict[str, Any]:
    """Requests sharing a system prompt, one after another: with prefix caching vs without (tokens exact)."""
    params = SamplingParams.greedy(new_tokens, ignore_eos=True)
    nblocks = 4 * (-(-(len(system) + max(map(len, users)) + new_tokens) // block_size)) + 1
    cached = PagedGenerator(model, nblocks, block_size, enable_prefix_caching=True)
    plain = PagedGenerator(model, nblocks, block_size)
    same = skipped = prompt_tokens = 0
    for u in users:
        a = cached.generate(system + u, params)
        b = plain.generate(system + u, params)
        same += a.token_ids == b.token_ids
        skipped += a.num_cached_tokens
        prompt_tokens += a.num_prompt_tokens
    return {"identical": same, "requests": len(users), "prefill_tokens_skipped": skipped,
            "prompt_tokens": prompt_tokens, "skipped_fraction": skipped / prompt_tokens,
            "system_len": len(system), "block_size": block_size}


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
    prompts = make_prompts(model, lens, real_text, seed)
    report: dict[str, Any] = {}
    report["equivalence"] = check_equivalence(model, prompts, 8 if quick else 24)
    report["samples"] = check_parallel_samples(model, prompts[-1], 3 if quick else 4, 8 if quick else 16, seed)
    text = make_prompts(model, [80, 12, 9, 15, 11, 14], real_text, seed + 1)
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


def main(argv: list[str] | None = None) -> int:
    """`python -m minillm.paged.bench [--quick] [--json PATH]`: every chapter 05 measurement, as Markdown."""
    import argparse
    import json

    from minillm.core.io import atomic_write_text

    parser = argparse.ArgumentParser(prog="python -m minillm.paged.bench", description=main.__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller workloads")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--json", metavar="PATH", help="also write the raw report as JSON")
    args = parser.parse_args(argv)
    from minillm.core.device import resolve_device

    torch.set_num_threads(args.threads)
    model, label = load_model(resolve_device(args.device))
    report = run_all(model, real_text=label == "base", quick=args.quick)
    print(format_markdown(report, label))
    if args.json:
        atomic_write_text(args.json, json.dumps(report, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Speculative decoding in the engine against the same engine without it, from low load to high: where it stops paying.

At low load a decode step is cheap beside its fixed costs (one forward reads every weight for a handful of tokens),
so verifying k drafts in the same forward is nearly free and every kept draft is a step saved. As the batch grows
each step already feeds many tokens; k drafts per request multiply the step's tokens, the step's cost grows with
them, and rejected drafts are paid for and thrown away. Past some load the speculative engine is slower: vLLM
reports the same for its engine (speculative decoding "can be slower at high load"). This benchmark looks for that
crossover on our models. Where a step's cost is mostly per sequence rather than per token (reading each sequence's
K/V from the pool, as in a memory-bound decode), verify tokens stay cheap and the crossover moves to higher load;
a drafter whose own cost grows with the batch (the draft model, one forward per request per draft token here)
brings it down.

For each load c (requests running at once: `max_num_seqs = c`, with 3c requests queued so the batch stays full as
requests finish), `LLM` and `SpeculativeLLM` (same `EngineConfig`, same prompts, greedy, end-of-text ignored) run
alternately in one process (`minillm.core.timing.compare`, warm-up, median of repeats); both engines' outputs must
be identical. Both use the "verify" attention backend (`minillm.speculative.verify_cache`), which batches the
verify steps' short queries and runs the plain engine's steps exactly as chapter 06's default backend does; with
`--attention-backend verify-cpp`, both use chapter 13's C++ attention instead (decode and verify steps read the paged
pool in place), picked by name.
Reported per load: output tokens per second and per CPU-second for each, their ratios (speculative / plain: above 1
speculation wins), drafts kept / proposed, and engine steps. Prompts are code from the corpus' validation split,
where prompt lookup finds what to copy; the draft-model method (`--method draft-model`, `draft` drafting for
`base`) is the other proposer. The command:
`python -m minillm.speculative.engine_bench [--quick] [--method prompt-lookup|draft-model] [--loads 1,2,4]
[--attention-backend verify|verify-cpp] [--fused-step] [--json FILE]`; `--fused-step` runs both engines' target on
chapter 13's fused C++ step (`minillm.compile.fused_engine`). What it leaves out: arrival over time (chapter 06's online benchmark), and sampling (greedy only,
so outputs can be compared token for token). The chapter text quotes one run per method,
`chapters/results/08-engine-lookup.json` and `08-engine-draft.json`, through `quotes(report)`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import torch

from minillm.bench.check import same_tokens
from minillm.bench.cli import bench_parser, start, write_report
from minillm.bench.models import load_model
from minillm.bench.workload import check_load_list
from minillm.bench.tables import markdown_table
from minillm.core.config import check_choice, check_fits_window, check_float, check_int, reads_report, short_repr
from minillm.core.corpus import corpus_sample
from minillm.core.device import resolve_device
from minillm.core.model import GPT, require_model
from minillm.core.sampling import SamplingParams, check_seed
from minillm.core.timing import check_repeats, compare
from minillm.engine.config import EngineConfig
from minillm.engine.llm import LLM
from minillm.engine.step_models import step_model
from minillm.speculative.bench import check_tokenizer, encode
from minillm.speculative.engine import SpeculativeConfig, SpeculativeLLM

EOT = "<|endoftext|>"
DEFAULT_LOADS = (1, 2, 4, 8, 16, 32, 64)  # `load_sweep`'s and the command's loads (concurrent requests)
REQUESTS_PER_SLOT = 3  # requests queued per batch slot, so the batch stays full as requests finish
FUSED_STEP = "fused-cpp"  # `--fused-step`: the step model both engines' target runs on (minillm.engine.step_models)
BACKENDS = ("verify", "verify-cpp")  # the engines' attention: PyTorch's, or chapter 13's C++ (by name: no import)
QUICK = dict(loads=(1, 8), new_tokens=32, requests_per_slot=2, repeats=1)  # run(quick=True): seconds on a CPU


def code_pieces(window: int = 1500) -> list[str]:
    """The validation split's Python files (split at end-of-text) cut into `window`-character pieces, in order."""
    window = check_int("window", window)
    docs = corpus_sample(10**9, split="val").split(EOT)
    return [d[o : o + window] for d in docs for o in range(0, len(d) - window + 1, window)]


def check_loads(loads: object, requests_per_slot: int = REQUESTS_PER_SLOT) -> list[int]:
    """`loads` as a list if it is a non-empty list of positive ints (`check_load_list`) whose highest load's
    prompts (`requests_per_slot` per batch slot, one `code_pieces` piece each) the validation split holds; a
    TypeError/ValueError naming loads otherwise, checked before any model loads (`run`, the command line)."""
    loads = check_load_list(loads)
    requests_per_slot = check_int("requests_per_slot", requests_per_slot)
    need, have = requests_per_slot * max(loads), len(code_pieces())
    if need > have:
        raise ValueError(f"loads: the highest load {max(loads)} needs {need} prompts (requests_per_slot="
                         f"{requests_per_slot} per batch slot), the validation split has {have}; lower the loads or "
                         "requests_per_slot")
    return loads


def code_prompts(tokenizer: Any, n: int, prompt_len: int = 128, window: int = 1500) -> list[list[int]]:
    """n code-completion prompts: the last `prompt_len` tokens of `window`-character pieces of the validation split's
    Python files (split at end-of-text), spread evenly over it, so no two prompts share text. A piece holding fewer
    than `prompt_len` tokens is a ValueError naming prompt_len (and window), not a shorter prompt."""
    n = check_int("n", n)
    prompt_len = check_int("prompt_len", prompt_len)
    window = check_int("window", window)
    check_tokenizer(tokenizer)
    pieces = code_pieces(window)
    if n > len(pieces):
        raise ValueError(f"asked for n={n} prompts, the validation split has {len(pieces)} pieces of window={window} "
                         "chars; lower n (or window)")
    step = len(pieces) // n
    prompts = [encode(tokenizer, pieces[i * step]) for i in range(n)]
    shortest = min(len(p) for p in prompts)
    if prompt_len > shortest:
        raise ValueError(f"prompt_len={prompt_len} is more than the {shortest} tokens of the shortest "
                         f"{window}-char piece; lower prompt_len (or raise window)")
    return [p[-prompt_len:] for p in prompts]


def _timed(llm: LLM, prompts: list[list[int]], params: SamplingParams, cpu: list[float],
           outs: list[list[list[int]]]) -> Callable[[], None]:
    """A zero-argument run of `llm.generate` that appends its process CPU seconds and outputs to the lists."""

    def run() -> None:
        c0 = time.process_time()
        res = llm.generate(prompts, params)
        cpu.append(time.process_time() - c0)
        outs.append([o.output_token_ids for o in res])
    return run


def load_point(target: GPT, prompts: list[list[int]], concurrency: int, new_tokens: int,
               speculative: SpeculativeConfig, draft: GPT | None = None, repeats: int = 3,
               attention_backend: str = "verify", fused_step: bool = False) -> dict[str, Any]:
    """One load: `concurrency` requests at a time over `prompts`, the plain engine against the speculative one, both
    with `attention_backend` (BACKENDS). `fused_step`: both run the target on chapter 13's fused C++ step (the step
    model "fused-cpp", picked by name: decode and verify steps in one C++ call each); the draft stays eager."""
    attention_backend = check_choice("attention_backend", attention_backend, BACKENDS)
    if not isinstance(fused_step, bool):
        raise TypeError(f"fused_step must be a bool, got {fused_step!r}")
    if fused_step:  # chapter 13's C++ step, by name (as the C++ attention is): its module loads on first use
        target = step_model(FUSED_STEP, target)
    concurrency = check_int("concurrency", concurrency)
    new_tokens = check_int("new_tokens", new_tokens)
    repeats = check_repeats("repeats", repeats)
    if not isinstance(prompts, (list, tuple)) or not prompts or not all(isinstance(p, (list, tuple)) and p
                                                                        for p in prompts):
        raise ValueError(f"prompts must be a non-empty list of non-empty prompts, got {prompts!r}")
    params = SamplingParams.greedy(new_tokens, ignore_eos=True)
    bs = 16
    per_request = -(-(max(len(p) for p in prompts) + new_tokens) // bs)
    config = EngineConfig(num_blocks=per_request * concurrency + 8, block_size=bs, max_num_seqs=concurrency,
                          max_num_batched_tokens=max(512, concurrency), attention_backend=attention_backend)
    plain = LLM(target, None, config)
    spec = SpeculativeLLM(target, None, config, speculative=speculative, draft=draft)
    cpu_p: list[float] = []
    cpu_s: list[float] = []
    outs_p: list[list[list[int]]] = []
    outs_s: list[list[list[int]]] = []
    cmp = compare(_timed(plain, prompts, params, cpu_p, outs_p), _timed(spec, prompts, params, cpu_s, outs_s),
                  warmup=1, repeats=repeats, device=target.device)
    same = same_tokens(outs_p[0], *outs_p[1:], *outs_s, unit="requests")
    tokens = sum(len(o) for o in outs_p[0])
    stats = spec.stats()
    runs = repeats + 1  # the warm-up run counts in the engines' step counters too
    cpu_plain, cpu_spec = statistics.median(cpu_p[1:]), statistics.median(cpu_s[1:])
    return {
        "concurrency": concurrency, "requests": len(prompts), "output_tokens": tokens,
        "identical": same.ok, "check": same.check,
        "plain_tok_s": tokens / cmp.baseline.median, "spec_tok_s": tokens / cmp.candidate.median,
        "ratio": cmp.speedup,
        "plain_tok_cpu_s": tokens / cpu_plain, "spec_tok_cpu_s": tokens / cpu_spec, "ratio_cpu": cpu_plain / cpu_spec,
        "acceptance_rate": stats["acceptance_rate"],
        "plain_steps": plain.num_steps / runs, "spec_steps": spec.num_steps / runs,
        "draft_forwards": stats["num_draft_forwards"] / runs,
        "timing": cmp.to_dict(),
    }


def crossover(points: Sequence[dict[str, Any]], key: str = "ratio") -> int | None:
    """The lowest load from which speculation stays slower (ratio < 1 there and at every higher load); None if the
    last load measured still gains (or no load was measured).

    points: records of `load_point` (any dicts holding "concurrency", a positive int, and `key`, a real number); a
    record without them is a TypeError/ValueError naming it, not a KeyError from the middle of the sort."""
    if not isinstance(key, str):
        raise TypeError(f"key must be a str naming the ratio field, got {type(key).__name__} {short_repr(key)}")
    if not isinstance(points, (list, tuple)):
        raise TypeError(f"points must be a list of load_point records (dicts), got {type(points).__name__}")
    for i, p in enumerate(points):
        if not isinstance(p, dict):
            raise TypeError(f"points[{i}] must be a dict (a load_point record), got {type(p).__name__}")
        missing = [k for k in ("concurrency", key) if k not in p]
        if missing:
            raise ValueError(f"points[{i}] has no {missing[0]!r} field (it holds {list(p)}); crossover needs "
                             f"'concurrency' and {short_repr(key)} in every record")
    # the plain numbers: (concurrency, value) per record
    plain = [(check_int(f"points[{i}]['concurrency']", p["concurrency"]),
              check_float(f"points[{i}][{short_repr(key)}]", p[key])) for i, p in enumerate(points)]
    found = None
    for concurrency, value in sorted(plain):
        if value < 1.0:
            found = concurrency if found is None else found
        else:
            found = None
    return found


def load_sweep(target: GPT, tokenizer: Any, loads: Sequence[int] = DEFAULT_LOADS, new_tokens: int = 64,
               prompt_len: int = 128, requests_per_slot: int = REQUESTS_PER_SLOT,
               speculative: SpeculativeConfig | None = None,
               draft: GPT | None = None, repeats: int = 3, attention_backend: str = "verify",
               fused_step: bool = False) -> dict[str, Any]:
    """Every load of `loads`: ratios of tokens/s (wall and CPU), identical outputs, and the crossover load."""
    speculative = speculative if speculative is not None else SpeculativeConfig()
    if not isinstance(speculative, SpeculativeConfig):
        raise TypeError(f"speculative must be a SpeculativeConfig, got {type(speculative).__name__}")
    new_tokens = check_int("new_tokens", new_tokens)
    prompt_len = check_int("prompt_len", prompt_len)
    requests_per_slot = check_int("requests_per_slot", requests_per_slot)
    repeats = check_repeats("repeats", repeats)
    loads = check_loads(loads, requests_per_slot)
    window = require_model(target, "load_sweep (target)").block_size
    check_fits_window(f"each {prompt_len}-token prompt", prompt_len, new_tokens, window, "the target")
    pool = code_prompts(tokenizer, requests_per_slot * max(loads), prompt_len)
    points = [load_point(target, pool[: requests_per_slot * c], c, new_tokens, speculative, draft, repeats,
                         attention_backend, fused_step) for c in loads]
    return {"method": speculative.method, "attention_backend": attention_backend, "fused_step": fused_step,
            "gamma": speculative.gamma, "ngram": speculative.ngram,
            "new_tokens": new_tokens, "prompt_len": prompt_len, "requests_per_slot": requests_per_slot,
            "points": points, "identical": all(p["identical"] for p in points),
            "crossover": crossover(points), "crossover_cpu": crossover(points, "ratio_cpu"),
            "low_load_ratio": points[0]["ratio"], "low_load_ratio_cpu": points[0]["ratio_cpu"],
            "low_load": points[0]["concurrency"]}


def sweep_sizes(quick: bool, loads: Sequence[int] | None) -> dict[str, Any]:
    """`load_sweep`'s size arguments for `run`: QUICK's (or load_sweep's defaults), `loads` in place of their loads,
    the loads checked (`check_loads`); a TypeError unless quick is a bool."""
    if not isinstance(quick, bool):
        raise TypeError(f"quick must be a bool, got {type(quick).__name__} {short_repr(quick)}")
    size: dict[str, Any] = dict(QUICK) if quick else {}
    size["loads"] = check_loads(loads if loads is not None else size.get("loads", DEFAULT_LOADS),
                                size.get("requests_per_slot", REQUESTS_PER_SLOT))
    return size


def run(device: torch.device | str = "cpu", quick: bool = False, method: str = "prompt-lookup", gamma: int = 4,
        loads: Sequence[int] | None = None, seed: int = 0, attention_backend: str = "verify",
        fused_step: bool = False) -> dict[str, Any]:
    """The benchmark on `base` (and `draft` for method="draft-model"), by default at loads 1 to 64; quick: loads 1
    and 8, 32 new tokens, one repeat (a few seconds on a CPU), for the chapter's tour. `attention_backend`: "verify"
    (PyTorch) or "verify-cpp" (chapter 13's C++ decode and verify attention, read through the block tables);
    `fused_step`: the target on chapter 13's fused C++ step in both engines (`load_point`)."""
    attention_backend = check_choice("attention_backend", attention_backend, BACKENDS)
    spec = SpeculativeConfig(method=method, gamma=gamma)  # checks method and gamma before the models load
    size = sweep_sizes(quick, loads)  # and the loads, and the seed
    seed = check_seed(seed)
    device = resolve_device(device) if isinstance(device, str) else device
    tgt = load_model("base", device, seed)
    draft = load_model("draft", device, seed) if method == "draft-model" else None
    sweep = load_sweep(tgt.model, tgt.tokenizer, speculative=spec, draft=draft.model if draft else None,
                       attention_backend=attention_backend, fused_step=fused_step, **size)
    return {"target": tgt.label, "draft": draft.label if draft else None, "device": str(device),
            "threads": torch.get_num_threads(), **sweep}


LOAD_HEADER = ["concurrent requests", "requests", "plain tok/s", "speculative tok/s", "ratio", "plain tok/cpu-s",
               "speculative tok/cpu-s", "ratio (cpu)", "drafts kept", "engine steps plain → speculative", "identical"]


def _point_cells(p: dict[str, Any]) -> list[str]:
    """One load of `load_sweep`, cell by cell under LOAD_HEADER: the console report and the chapter's table."""
    return [str(p["concurrency"]), str(p["requests"]), f"{p['plain_tok_s']:.0f}", f"{p['spec_tok_s']:.0f}",
            f"{p['ratio']:.2f}x", f"{p['plain_tok_cpu_s']:.0f}", f"{p['spec_tok_cpu_s']:.0f}", f"{p['ratio_cpu']:.2f}x",
            f"{p['acceptance_rate']:.2f}", f"{p['plain_steps']:.0f} → {p['spec_steps']:.0f}", str(p["identical"])]


def _crossover_text(cross: int | None) -> str:
    return f"{cross} concurrent requests" if cross is not None else "none up to the highest load measured"


@reads_report
def format_report(r: dict[str, Any]) -> str:
    who = f"{r['target']} + {r['draft']}" if r["draft"] else f"{r['target']}, prompt lookup ({r['ngram']}-grams)"
    who += ", on the fused C++ step" if r.get("fused_step") else ""
    lines = [f"{who}, gamma {r['gamma']}, {r['device']}, {r['threads']} thread(s); {r['prompt_len']}-token code "
             f"prompts, {r['new_tokens']} new tokens, {r['requests_per_slot']} requests per batch slot, greedy",
             " | ".join(LOAD_HEADER)]
    lines += [" | ".join(c.rjust(len(h)) for c, h in zip(_point_cells(p), LOAD_HEADER)) for p in r["points"]]
    lines.append(f"crossover (speculation slower from this load on): {_crossover_text(r['crossover'])}; by CPU time: "
                 f"{_crossover_text(r['crossover_cpu'])}")
    return "\n".join(lines)


@reads_report
def quotes(report: dict[str, Any]) -> dict[str, str]:
    """The table and numbers chapter 08's text quotes from a report of `run` (`minillm.course.results`).

    Table "loads": every load, plain against speculative. Values: the crossover (by wall and by CPU time), the
    ratios, drafts kept and engine steps at the lowest and highest load, the range of drafts kept, the largest gap
    between the wall-time and CPU-time ratios, the smallest share of wall time the process spent on a CPU (tok/s
    over tok/cpu-s, either engine: well below 100% when other work shared the machine), per load c the ratio and
    both engines' tok/s (`ratio_c4`, `plain_tok_s_c4`, `spec_tok_s_c4`), the attention backend, the run's sizes and
    the machine ("cpu").
    """
    points = report["points"]
    low, high = points[0], points[-1]
    kept = [p["acceptance_rate"] for p in points]
    share = min(p[f"{e}_tok_s"] / p[f"{e}_tok_cpu_s"] for p in points for e in ("plain", "spec"))
    per_load = {f"{k}_c{p['concurrency']}": v for p in points
                for k, v in (("ratio", f"{p['ratio']:.2f}x"), ("plain_tok_s", f"{p['plain_tok_s']:,.0f}"),
                             ("spec_tok_s", f"{p['spec_tok_s']:,.0f}"))}
    return {**per_load, "attention_backend": str(report.get("attention_backend", "verify")),
        "loads": markdown_table(LOAD_HEADER, [_point_cells(p) for p in points], "rrrrrrrrrrc"),
        "crossover": _crossover_text(report["crossover"]), "crossover_cpu": _crossover_text(report["crossover_cpu"]),
        "low_ratio": f"{low['ratio']:.2f}x", "high_ratio": f"{high['ratio']:.2f}x",
        "high_change": f"{100 * abs(high['ratio'] - 1):.0f}%", "high_load": str(high["concurrency"]),
        "low_ratio_cpu": f"{low['ratio_cpu']:.2f}x", "high_ratio_cpu": f"{high['ratio_cpu']:.2f}x",
        "high_change_cpu": f"{100 * abs(high['ratio_cpu'] - 1):.0f}%", "cpu_share_min": f"{100 * share:.0f}%",
        "low_plain_tok_s": f"{low['plain_tok_s']:.0f}", "low_plain_steps": f"{low['plain_steps']:.0f}",
        "low_spec_steps": f"{low['spec_steps']:.0f}", "low_requests": str(low["requests"]),
        "kept_range": f"{min(kept):.2f}–{max(kept):.2f}",
        "ratio_range": f"{min(p['ratio'] for p in points):.2f}x–{max(p['ratio'] for p in points):.2f}x",
        "cpu_gap": f"{max(abs(p['ratio'] - p['ratio_cpu']) for p in points):.2f}",
        "gamma": str(report["gamma"]), "new_tokens": str(report["new_tokens"]), "prompt_len": str(report["prompt_len"]),
        "requests_per_slot": str(report["requests_per_slot"]), "identical": str(report["identical"]),
        "cpu": str(report["cpu"]), "threads": str(report["threads"]),
    }


def _usage_check(ap: argparse.ArgumentParser, flag: str, check: Callable[[], object]) -> None:
    """Run `check()`; a ValueError/TypeError it raises becomes a usage error (exit 2) naming `flag`."""
    try:
        check()
    except (ValueError, TypeError) as e:
        ap.error(f"{flag}: {e}")


def build_parser() -> argparse.ArgumentParser:
    ap = bench_parser("python -m minillm.speculative.engine_bench", __doc__.split("\n")[0],
                      "two loads, short outputs, one repeat")
    ap.add_argument("--method", default="prompt-lookup", choices=("prompt-lookup", "draft-model"))
    ap.add_argument("--gamma", type=int, default=4, help="draft tokens per request per step (default 4)")
    ap.add_argument("--loads", help="comma-separated concurrency levels (default 1,2,4,8,16,32,64; quick 1,8)")
    ap.add_argument("--attention-backend", default="verify", choices=BACKENDS,
                    help="both engines' attention: verify (PyTorch, default) or verify-cpp (chapter 13's C++)")
    ap.add_argument("--fused-step", action="store_true",
                    help="both engines run the target on chapter 13's fused C++ step (FusedEngineModel)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = start(ap, argv)
    try:
        # subtle: `if args.loads` would read --loads '' as "not given" and run the default loads
        loads = [int(c) for c in args.loads.split(",")] if args.loads is not None else None
    except ValueError:
        ap.error(f"--loads must be comma-separated ints, got {args.loads!r}")
    # What run() refuses is a usage error naming the flag, before any model loads (not a traceback after).
    _usage_check(ap, "--gamma", lambda: SpeculativeConfig(method=args.method, gamma=args.gamma))
    _usage_check(ap, "--loads", lambda: sweep_sizes(args.quick, loads))
    report = run(resolve_device(args.device), quick=args.quick, method=args.method, gamma=args.gamma, loads=loads,
                 seed=args.seed, attention_backend=args.attention_backend, fused_step=args.fused_step)
    print(format_report(report))
    write_report(args.json, report)
    return 0 if report["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())

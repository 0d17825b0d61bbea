"""The benchmark harness every chapter uses: generators timed side by side, per-token metrics, JSON and a figure.

Adds a registry of generation paths (`register_generator`; chapter 03 registers "naive", and the `minillm`
command registers each later chapter's generator, e.g. chapter 04's "kv-cache"), `BenchCase` (what to run), `run_request` (one request's token timestamps), `run_bench` (warm-up,
repeats, baseline and each candidate interleaved by `minillm.core.timing.compare`, vLLM-style summaries, tokens equal
or not, peak memory) and the `minillm bench` command. What it leaves out: concurrent requests and arrival processes
(`minillm.bench.driver` does that for chapters 06 and 07).

A generator is any `fn(model, prompt_ids, params, tokenizer=None, eos_id=None) -> Iterator[int]` that streams the
new token ids; `generate_naive` is the reference signature.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from minillm.bench.check import same_tokens
from minillm.bench.cli import add_bench_options, apply_bench_options, count_argument, write_report
from minillm.bench.models import load_model
from minillm.bench.workload import eval_prompts
from minillm.core.config import check_bool, check_instance, check_int, check_report, reads_report
from minillm.core.device import resolve_device
from minillm.core.hf import to_hf_model
from minillm.core.io import atomic_save_figure, check_output_file, check_path
from minillm.core.metrics import PeakMemory, RequestTimes, summarize, timed_stream
from minillm.core.model import require_model
from minillm.core.sampling import SamplingParams
from minillm.core.stopping import check_token_ids
from minillm.core.timing import compare, measure
from minillm.naive.generate import generate_naive, generate_naive_ids
from minillm.naive.roofline import decode_bound, measure_machine, measure_weight_streaming

GeneratorFn = Callable[..., Iterator[int]]
GENERATORS: dict[str, GeneratorFn] = {}


def register_generator(name: str, fn: GeneratorFn, overwrite: bool = False) -> None:
    """Make `fn` benchmarkable as `name` (`minillm bench --generators naive,NAME`)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"generator name must be a non-empty string, got {name!r}")
    if not callable(fn):
        raise TypeError(f"generator {name!r} must be callable, got {type(fn).__name__}")
    if name in GENERATORS and GENERATORS[name] is not fn and not overwrite:
        raise ValueError(f"a generator named {name!r} is already registered")
    GENERATORS[name] = fn


register_generator("naive", generate_naive)


def get_generator(name: str) -> GeneratorFn:
    if name not in GENERATORS:
        raise ValueError(f"unknown generator {name!r}; registered: {sorted(GENERATORS)}")
    return GENERATORS[name]


@dataclass
class BenchCase:
    prompt_len: int = 16  # prompt tokens
    new_tokens: int = 64  # tokens generated per request (greedy, end-of-text ignored, so every run is this long)
    repeats: int = 3  # timed requests per generator; medians over these
    warmup: int = 1  # untimed requests per generator first

    def __post_init__(self) -> None:
        for name, low in (("prompt_len", 1), ("new_tokens", 1), ("repeats", 1), ("warmup", 0)):
            setattr(self, name, check_int(f"BenchCase.{name}", getattr(self, name), low))

    @property
    def params(self) -> SamplingParams:
        return SamplingParams.greedy(self.new_tokens, ignore_eos=True)


def run_request(fn: GeneratorFn, model: torch.nn.Module, prompt_ids: list[int], params: SamplingParams,
                tokenizer: Any = None) -> tuple[list[int], RequestTimes]:
    """One request through `fn`: its tokens and their arrival times (clock starts just before the call)."""
    times = RequestTimes(arrival=time.perf_counter(), prompt_len=len(prompt_ids))
    ids = list(timed_stream(fn(model, prompt_ids, params, tokenizer), times))
    return ids, times


def _runner(fn: GeneratorFn, model, prompt_ids, params, tokenizer, log: list) -> Callable[[], None]:
    def run() -> None:
        log.append(run_request(fn, model, prompt_ids, params, tokenizer))
    return run


def _median_curve(requests: list[RequestTimes]) -> list[float]:
    """Per-token latency by position (TTFT, then each ITL), median over repeats: the curve the figure plots."""
    curves = [[r.ttft] + r.itl for r in requests]
    return [statistics.median(step) for step in zip(*curves)]


def _result(name: str, log: list, repeats: int, memory: PeakMemory) -> dict[str, Any]:
    timed = log[-repeats:]  # subtle: the log also holds the warm-up requests, which come first
    requests = [t for _, t in timed]
    e2e = statistics.median(r.e2e for r in requests)
    summary = summarize(requests, duration_s=sum(r.e2e for r in requests))  # requests ran one after another
    return {
        "generator": name,
        "tokens": timed[-1][0],
        "summary": summary,
        "median_e2e_s": e2e,
        "tokens_per_s": requests[0].num_output_tokens / e2e,
        "decode_tokens_per_s": 1000.0 / summary["median_tpot_ms"] if summary["median_tpot_ms"] > 0 else float("nan"),
        "per_token_latency_s": _median_curve(requests),
        "peak_memory_bytes": memory.bytes,
        "peak_memory_source": memory.source,
    }


def run_bench(model: torch.nn.Module, prompt_ids: list[int], case: BenchCase, generators: list[str] | None = None,
              tokenizer: Any = None) -> dict[str, Any]:
    """Benchmark `generators` (the first is the baseline) on one prompt; each candidate interleaved with it.

    Returns a JSON-ready dict: the case, one result per generator (vLLM-style summary, tokens/s, per-token latency
    curve, peak memory), and per candidate the E2E speed-up over the baseline and whether the tokens were equal.
    """
    check_token_ids("prompt_ids", prompt_ids, require_model(model, "run_bench (model)").vocab_size)
    check_instance("case", case, BenchCase, "a BenchCase")
    if generators is not None and (not isinstance(generators, list) or not all(isinstance(g, str) for g in generators)):
        raise TypeError(f"generators must be a list of registered generator names or None, got {generators!r:.80}")
    names = generators or ["naive"]
    fns = {n: get_generator(n) for n in names}
    device = model.device
    params = case.params
    logs: dict[str, list] = {n: [] for n in names}
    memory: dict[str, PeakMemory] = {}
    for n in names:  # one untimed request each under the memory probe, so peaks are per generator
        with PeakMemory(device) as memory[n]:
            run_request(fns[n], model, prompt_ids, params, tokenizer)
    base = names[0]
    run_base = _runner(fns[base], model, prompt_ids, params, tokenizer, logs[base])
    comparisons = []
    if len(names) == 1:
        measure(run_base, warmup=case.warmup, repeats=case.repeats, device=device)
    for cand in names[1:]:
        logs[base].clear()
        run_cand = _runner(fns[cand], model, prompt_ids, params, tokenizer, logs[cand])
        cmp = compare(run_base, run_cand, warmup=case.warmup, repeats=case.repeats, device=device)
        comparisons.append({"baseline": base, "candidate": cand, "speedup_e2e": cmp.speedup,
                            "identical_tokens": same_tokens([logs[base][-1][0]], [logs[cand][-1][0]]).ok,
                            "timing": cmp.to_dict()})
    return {
        "case": asdict(case),
        "device": str(device),
        "model_params": sum(p.numel() for p in model.parameters()),
        "results": {n: _result(n, logs[n], case.repeats, memory[n]) for n in names},
        "comparisons": comparisons,
    }


@reads_report
def plot_bench(report: dict[str, Any], path: str | Path) -> Path:
    """Per-token latency against position for each generator, and output tokens/s as bars; PNG, written atomically."""
    check_output_file(check_path(path, "path"), "path")  # before anything is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, res in results.items():
        curve = [s * 1000 for s in res["per_token_latency_s"]]
        ax1.plot(range(1, len(curve) + 1), curve, marker=".", label=name)
    ax1.set_xlabel("output token index (1 = first token, its latency is TTFT)")
    ax1.set_ylabel("latency of this token (ms)")
    ax1.set_title(f"per-token latency, prompt {report['case']['prompt_len']} tokens")
    ax1.legend()
    ax2.bar(list(results), [r["tokens_per_s"] for r in results.values()], color="tab:blue")
    ax2.set_ylabel("output tokens/s (median request)")
    ax2.set_title(f"throughput on {report['device']}")
    fig.tight_layout()
    out = atomic_save_figure(fig, path, dpi=110)
    plt.close(fig)
    return out


@reads_report
def format_report(report: dict[str, Any]) -> str:
    lines = [f"{'generator':<12} {'TTFT ms':>9} {'TPOT ms':>9} {'p99 ITL ms':>11} {'E2E ms':>9} {'tok/s':>8} "
             f"{'peak MB':>8}"]
    for name, r in report["results"].items():
        s = r["summary"]
        mem = f"{r['peak_memory_bytes'] / 1e6:8.1f}" if r["peak_memory_bytes"] is not None else f"{'n/a':>8}"
        lines.append(f"{name:<12} {s['median_ttft_ms']:9.2f} {s['median_tpot_ms']:9.2f} {s['p99_itl_ms']:11.2f} "
                     f"{s['median_e2el_ms']:9.1f} {r['tokens_per_s']:8.1f} {mem}")
    for c in report["comparisons"]:
        lines.append(f"{c['candidate']} vs {c['baseline']}: {c['speedup_e2e']:.2f}x E2E, "
                     f"tokens {'identical' if c['identical_tokens'] else 'DIFFERENT'}")
    if "roofline" in report:
        rf = report["roofline"]
        ws = rf["weight_streaming"]
        lines.append(f"roofline bound {rf['bound']['tokens_per_s']:.0f} tok/s ({rf['bound']['limited_by']}-bound); "
                     f"baseline decode reaches {rf['fraction_of_bound']:.1%}")
        lines.append(f"weight-streaming bound {ws['tokens_per_s']:.0f} tok/s (the step's weights through F.linear "
                     f"alone at {ws['gbps']:.1f} GB/s); baseline decode reaches "
                     f"{rf['fraction_of_weight_streaming']:.1%}")
    return "\n".join(lines)


def add_roofline(report: dict[str, Any], model: torch.nn.Module, quick: bool = False) -> dict[str, Any]:
    """Attach the machine's rates, the decode bound for this case, the weight-streaming bound measured on the model,
    and the baseline's fraction of each."""
    check_report("report", report, ("case", "results"))  # what run_bench returned: checked before any measuring
    check_report("report['case']", report["case"], ("prompt_len", "new_tokens"))
    if not isinstance(report["results"], dict) or not report["results"]:
        raise ValueError(f"report['results'] must hold run_bench's results, got {report['results']!r:.80}")
    check_report("report['results'] (its first)", next(iter(report["results"].values())), ("decode_tokens_per_s",))
    require_model(model, "add_roofline (model)")
    check_bool("quick", quick)
    dtype = next(model.parameters()).dtype
    machine = measure_machine(model.device, dtype, quick=quick)
    case = report["case"]
    bound = decode_bound(model.config, machine, case["prompt_len"], case["new_tokens"], dtype)
    streaming = measure_weight_streaming(model, repeats=5 if quick else 9)
    decode_tps = next(iter(report["results"].values()))["decode_tokens_per_s"]
    report["roofline"] = {"machine": machine.to_dict(), "bound": bound.to_dict(),
                          "fraction_of_bound": decode_tps / bound.tokens_per_s,
                          "weight_streaming": streaming.to_dict(),
                          "fraction_of_weight_streaming": decode_tps / streaming.tokens_per_s}
    return report


def hf_parity(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int):
    """Greedy tokens of `generate_naive` against HF generate(use_cache=False, do_sample=False), prompt by prompt."""
    hf = to_hf_model(model).to(model.device).eval()
    params = SamplingParams.greedy(new_tokens, ignore_eos=True)
    theirs, ours = [], []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=model.device)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, use_cache=False, pad_token_id=0,
                          eos_token_id=None)
        theirs.append(out[0, len(prompt):].tolist())
        ours.append(generate_naive_ids(model, prompt, params))
    return same_tokens(theirs, ours)


def run_all(model: torch.nn.Module, real_text: bool, quick: bool = False, seed: int = 0) -> dict[str, Any]:
    """The chapter's tour figures: HF parity on consecutive stretches of the validation text, one `run_bench` of
    the naive loop (TTFT, TPOT, tokens/s, memory) and the roofline bound, measured under the same threads."""
    lengths = [16] if quick else [16, 40, 5]
    new_tokens = 8 if quick else 24
    parity = hf_parity(model, eval_prompts(lengths, model.config.vocab_size, real_text, seed), new_tokens)
    case = BenchCase(prompt_len=16, new_tokens=16 if quick else 64, repeats=2 if quick else 3, warmup=0)
    prompt = eval_prompts([case.prompt_len], model.config.vocab_size, real_text, seed)[0]
    report = add_roofline(run_bench(model, prompt, case), model, quick=quick)
    report["parity"] = {"result": parity, "new_tokens": new_tokens}
    return report


def _cmd_bench(args: argparse.Namespace) -> int:
    apply_bench_options(args)  # --threads (checked, then set) and the --json path, before any work
    check_output_file(args.plot, "--plot", (".png",))
    device = resolve_device(args.device)
    loaded = load_model(args.model, device, seed=args.seed, random_init=args.random_init)
    model, tokenizer = loaded.model, loaded.tokenizer
    case = BenchCase(prompt_len=args.prompt_len, new_tokens=args.new_tokens, repeats=args.repeats, warmup=args.warmup)
    if args.prompt_len + args.new_tokens - 1 > model.config.block_size:
        raise ValueError(f"--prompt-len {args.prompt_len} + --new-tokens {args.new_tokens} - 1 exceeds the context "
                         f"window block_size={model.config.block_size}")
    prompt = eval_prompts([args.prompt_len], model.config.vocab_size, real_text=loaded.trained, seed=args.seed)[0]
    report = run_bench(model, prompt, case, args.generators.split(","), tokenizer)
    report["model"] = loaded.label
    report["threads"] = torch.get_num_threads()
    if args.roofline:
        add_roofline(report, model, quick=args.quick_roofline)
    print(format_report(report))
    if args.json:
        write_report(args.json, report)
        print(f"results written to {args.json}")
    if args.plot:
        print(f"figure written to {plot_bench(report, args.plot)}")
    return 0


BENCH_HELP = "benchmark generation paths on a model: TTFT, TPOT, ITL, tokens/s, memory"


def add_options(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of `minillm bench`: the shared ones (`minillm.bench.cli`) and this harness's own."""
    check_instance("p", p, argparse.ArgumentParser, "an argparse.ArgumentParser")
    add_bench_options(p)
    p.add_argument("--model", default="base", help="shipped checkpoint (base, draft) or, with --random-init, "
                   "any GPTConfig preset (default: base)")
    p.add_argument("--random-init", action="store_true", help="random weights of the preset's shape, no checkpoint")
    p.add_argument("--generators", default="naive", help="comma-separated registered generators, the first is the "
                   "baseline (default: naive; chapter 04 adds kv-cache)")
    p.add_argument("--prompt-len", type=count_argument(1), default=16, help="prompt tokens (default 16)")
    p.add_argument("--new-tokens", type=count_argument(1), default=64, help="tokens to generate (default 64)")
    p.add_argument("--repeats", type=count_argument(1), default=3, help="timed requests per generator (default 3)")
    p.add_argument("--warmup", type=count_argument(0), default=1,
                   help="untimed requests per generator first (default 1)")
    p.add_argument("--roofline", action="store_true", help="also measure the machine and report the decode bound")
    p.add_argument("--quick-roofline", action="store_true", help="smaller roofline micro-benchmarks")
    p.add_argument("--plot", metavar="PATH", help="write a PNG figure (per-token latency, tokens/s)")
    return p


def build_parser() -> argparse.ArgumentParser:
    """`minillm bench` as a parser of its own (what `add_commands` adds to the `minillm` command)."""
    return add_options(argparse.ArgumentParser(prog="minillm bench", description=BENCH_HELP))


def add_commands(sub: argparse._SubParsersAction) -> None:
    check_instance("sub", sub, argparse._SubParsersAction, "an ArgumentParser's add_subparsers()")
    p = add_options(sub.add_parser("bench", help=BENCH_HELP))
    p.set_defaults(handler=_cmd_bench)

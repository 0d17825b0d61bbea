"""Chapter 13's benchmark: batch-1 decode of `base` by each mode of `StaticDecoder` against
chapter 04's eager generator, beside the weight-streaming bound measured in the same run.

What it reports:
  - the weight-streaming bound: every weight matrix a decode step multiplies (the 24 block linears and the tied
    head) pushed through `F.linear` and through the C++ GEMV (driven from C++) at batch 1 alone, back to back, the
    fastest of repeats; the faster way is the bound (their bytes / that time is the bandwidth reached);
  - decode tok/s at batch 1: chapter 04's `generate_ids` (dynamic cache, eager) against the static-shape step
    eager, compiled by `torch.compile` (inductor by default), and on CUDA captured as a CUDA graph; each row's
    greedy tokens against the eager generator's (they must be identical), its compile count after the run (1 is
    one graph for every token) and its first call's time (the compile);
  - on the CPU, chapter 04's generator on `fast_cpu_model(model)` (every batch-1 matrix-vector product through the
    C++ GEMV of `cpu_gemv`) and with `FusedCPUDecoder` (the whole step one C++ call); same greedy tokens, checked;
  - each mode's tok/s as a fraction of the bound two ways: against the bound's products for as many tokens, timed
    in turn with the path in one interleaved run (median against median: the ratio every other figure here is),
    and against the fastest-ever bound above (a best case a shared machine only moves away from);
  - Hugging Face `generate(use_cache=True)` on the same weights against the eager generator and the fast path;
  - on the CPU, chapter 10's structured MLP pruning on the fused step (`pruned_fused`): a quarter of every block's
    MLP neurons removed, decoded by `FusedCPUDecoder`, against the dense model's fused step;
  - on the CPU, chapter 09's int8 and int4 weight-only models on the fused step (`quantized_fused`): the C++ int8
    and int4 GEMVs against the float32 fused step, beside the eager quantized models against the eager float32 one;
  - on the CPU, chapter 08's speculative decoding on the fused step (`fused_speculation`): the shipped
    `draft-distilled` proposing on its fused step, `base` verifying gamma+1 tokens in one C++ call, and prompt
    lookup on it, each against the fused step alone.
Timings interleave the eager generator, each path and the bound's products (`minillm.core.timing.interleave`),
medians of repeats.
The command: `python -m minillm.compile.bench [--device cuda] [--threads N] [--quick] [--json FILE]`; `quotes(report)`
gives the table and the figures chapter 13's text includes from the saved report.
"""

from __future__ import annotations

import argparse
import importlib.util
from functools import partial
from typing import Any, Callable

import torch
import torch.nn as nn

from minillm.bench.check import same_tokens
from minillm.bench.cli import bench_parser, cli_type, start, write_report
from minillm.bench.hf_compare import hf_comparison
from minillm.bench.models import load_model
from minillm.bench.tables import markdown_table
from minillm.bench.workload import eval_prompts
from minillm.compile.cpu_gemv import build_problem, fast_cpu_model, load_cpu_ext
from minillm.compile.decode import StaticDecoder, check_backend, check_eval_mode
from minillm.compile.fused_speculative import generate_prompt_lookup_fused, generate_speculative_fused
from minillm.compile.fused_step import MAX_VERIFY, FusedCPUDecoder
from minillm.compile.mirror import check_plain_model
from minillm.core.config import check_fit_windows, check_int, reads_report, short_repr
from minillm.core.model import GPT, require_model
from minillm.core.sampling import SamplingParams, check_seed
from minillm.core.stopping import check_token_ids
from minillm.core.timing import check_calls, check_repeats, interleave, measure, Timing
from minillm.gpt.dataset import split_tokens
from minillm.kvcache.generate import generate_ids
from minillm.naive.roofline import decode_weight_bytes, stream_weights
from minillm.prune.masks import check_sparsity
from minillm.prune.structured import mlp_neuron_scores, prune_mlp
from minillm.quant.gptq import calibration_windows
from minillm.quant.linear import QuantConfig, QuantLinear, quantize_model
from minillm.speculative.generate import check_gamma


FUSED = "fused C++ step (FusedCPUDecoder)"


def hf_available() -> bool:
    """Whether Hugging Face transformers (a dev extra) is installed, for the comparison with its generate."""
    return importlib.util.find_spec("transformers") is not None


def streaming_ways(model: GPT) -> tuple[dict[str, Callable[[int], None]], int]:
    """Every weight matrix of a decode step (the 24 block linears and the tied head) at batch 1, `steps` times over,
    with nothing else in the loop: {way: run(steps)} and the matrices' bytes. The ways: through `F.linear` (25
    PyTorch calls per step, chapter 03's `stream_weights`), and on the CPU through the C++ GEMV driven from C++
    (`FusedDecoder.products`: the fused step's own products, no per-call cost from Python). The model must be a
    plain float GPT (`check_plain_model`): a quantized model's codes are no nn.Linear weights `F.linear` could stream
    nor bytes the bound counts (a TypeError naming the layer)."""
    require_model(model, "streaming_ways (model)")
    check_plain_model(model, "streaming_ways")
    ways: dict[str, Callable[[int], None]] = {"F.linear": stream_weights(model)}
    if model.device.type == "cpu" and build_problem() is None:
        ways["C++ GEMV"] = FusedCPUDecoder(model, max_len=1)._cpp.products
    return ways, decode_weight_bytes(model)


def weight_streaming_bound(model: GPT, repeats: int = 9, calls: int = 50,
                           ways: tuple[dict[str, Callable[[int], None]], int] | None = None) -> dict[str, Any]:
    """The fastest this machine streams every weight matrix of a decode step at batch 1 (`streaming_ways`, or the
    `ways` a caller already built), each way the fastest of `repeats` runs of `calls` steps. The bound is the faster
    way; its tok/s is what a step made of those products alone could reach. `repeats` and `calls` are positive
    ints (the time is divided by calls); `ways` is None or what `streaming_ways` returns, at least one way and a
    positive int of bytes."""
    require_model(model, "weight_streaming_bound (model)")
    repeats = check_repeats("repeats", repeats)
    calls = check_calls("calls", calls)
    if ways is not None and not (isinstance(ways, tuple) and len(ways) == 2 and isinstance(ways[0], dict)
                                 and ways[0] and all(callable(run) for run in ways[0].values())):
        raise TypeError(f"ways must be None or ({{way: run(steps)}}, bytes) with at least one way, as "
                        f"streaming_ways returns, got {type(ways).__name__} {short_repr(ways)}")
    ways, nbytes = ways if ways is not None else streaming_ways(model)
    nbytes = check_int("ways[1] (the matrices' bytes)", nbytes)  # the bound's GB/s divides by it

    def seconds(run: Callable[[int], None]) -> float:
        t = measure(lambda: run(calls), warmup=1, repeats=repeats, device=model.device)
        return t.min / calls  # a bound: the fastest it ever went (a shared machine only slows it)

    per_way = {name: seconds(run) for name, run in ways.items()}
    best = min(per_way, key=per_way.get)
    return {"step_seconds": per_way[best], "by": best, "seconds": per_way, "bytes": nbytes,
            "GBps": nbytes / per_way[best] / 1e9, "tok_s_bound": 1 / per_way[best]}


def _check_fused_comparison(model: GPT, params: SamplingParams, repeats: int, who: str) -> None:
    """The arguments of a fused-step comparison (`pruned_fused`, `quantized_fused`): a GPT in eval mode, greedy params
    (the tokens are compared, and two samplers draw differently), a positive repeat count; a TypeError / ValueError
    naming `who` and the argument otherwise."""
    require_model(model, f"{who} (model)")
    check_eval_mode(model, who)
    check_repeats("repeats", repeats)
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be greedy SamplingParams, got {type(params).__name__} {short_repr(params)}")
    if not params.is_greedy:
        raise ValueError(f"params must be greedy (temperature 0): {who} compares greedy tokens, got "
                         f"temperature={params.temperature}")


def _check_training_vocabulary(model: GPT, who: str) -> None:
    """A ValueError naming `who` unless the model's vocabulary holds every id of the training text, which
    `pruned_fused` scores its neurons on (the shipped tokenizer's ids)."""
    top = int(split_tokens("train").max())
    if top >= model.config.vocab_size:
        raise ValueError(f"{who} scores the MLP neurons of pruned_fused on training text, whose token ids reach "
                         f"{top}: the model's vocab_size={model.config.vocab_size} does not hold them; it needs a "
                         "model of the shipped tokenizer's vocabulary")


def pruned_fused(model: GPT, prompt: list[int], params: SamplingParams, fraction: float = 0.25, repeats: int = 5,
                 seed: int = 0) -> dict[str, Any]:
    """Chapter 10's structured MLP pruning on the fastest path: `fraction` of every block's MLP neurons removed
    (scored on 8 windows of training text; no recovery, which changes the weights but not the shapes, so not the
    speed), its greedy tokens from `FusedCPUDecoder` against chapter 04's generator on the same pruned model, and
    its tok/s against the dense model's fused step (interleaved, medians). `weight_ratio`: the bytes a dense step
    reads over the pruned step's, the speed-up a step that only streams weights would reach. `params` must be
    greedy (a ValueError naming it otherwise): the tokens are compared, and two samplers draw differently."""
    _check_fused_comparison(model, params, repeats, "pruned_fused")
    fraction = check_sparsity(fraction, "fraction")  # before the calibration text: a NaN never reaches the scores
    _check_training_vocabulary(model, "pruned_fused")
    calibration = calibration_windows(8, model.config.block_size, seed)
    pruned = prune_mlp(model, fraction, mlp_neuron_scores(model, calibration))
    dense_step, pruned_step = FusedCPUDecoder(model), FusedCPUDecoder(pruned)
    got = pruned_step.generate_ids(prompt, params)
    dense, sparse = interleave([lambda: dense_step.generate_ids(prompt, params),
                                lambda: pruned_step.generate_ids(prompt, params)], warmup=1, repeats=repeats,
                               device=model.device)
    new = params.max_new_tokens
    return {"fraction": fraction, "identical": same_tokens([generate_ids(pruned, prompt, params)], [got]).equal == 1,
            "dense_tok_s": new / dense.median, "pruned_tok_s": new / sparse.median,
            "speedup": dense.median / sparse.median,
            "weight_ratio": decode_weight_bytes(model) / decode_weight_bytes(pruned)}


def step_bytes(model: nn.Module) -> int:
    """Bytes one fused decode step reads for its products: each block linear's weight (or, for chapter 09's int8
    QuantLinear, its codes and scales) and bias, and the tied head. `decode_weight_bytes` for a model whose linears
    may be quantized."""
    require_model(model, "step_bytes (model)")
    total = model.lm_head.weight.nbytes
    for m in model.transformer.h.modules():
        if isinstance(m, QuantLinear):
            total += m.qweight.nbytes + m.scale.nbytes + (m.bias.nbytes if m.bias is not None else 0)
        elif isinstance(m, nn.Linear):
            total += m.weight.nbytes + (m.bias.nbytes if m.bias is not None else 0)
    return total


def quantized_fused(model: GPT, prompt: list[int], params: SamplingParams, repeats: int = 5) -> dict[str, Any]:
    """Chapter 09's weight-only models on the fastest path: int8 (per-channel symmetric block linears) and int4
    (group-wise, 128 columns per scale, or the largest power of two below that divides every block linear's width;
    codes two per byte), each quantized by `quantize_model`. Per mode, its greedy
    tokens from `FusedCPUDecoder` (the C++ int8 or int4 GEMV) against chapter 04's generator on the same quantized
    model, and its tok/s against the float32 model's fused step, beside the eager quantized model against the eager
    float32 one (where de-quantizing every call costs more than the bytes it saves); all six paths interleaved,
    medians. Top level: the float32 figures and the int8 ones (`int8_tok_s`, `speedup`, `weight_ratio`: the bytes a
    float32 step reads over the int8 step's, ...); `int4`: the same for int4, with `vs_int8`. `params` must be greedy
    (ValueError)."""
    _check_fused_comparison(model, params, repeats, "quantized_fused")
    widths = {m.in_features for m in model.transformer.h.modules() if isinstance(m, nn.Linear)}
    group = next((g for g in (128, 64, 32, 16, 8, 4, 2) if all(w % g == 0 for w in widths)), None)  # 128 on `base`
    if group is None:
        raise ValueError(f"quantized_fused's int4 needs an even group size dividing every block linear's width, but "
                         f"model has widths {sorted(widths)}: no power of two from 2 to 128 divides them all")
    models = {"int8": quantize_model(model, QuantConfig("int8")).eval(),
              "int4": quantize_model(model, QuantConfig("int4", group_size=group)).eval()}
    steps = {"f32": FusedCPUDecoder(model), **{mode: FusedCPUDecoder(m) for mode, m in models.items()}}
    got = {mode: steps[mode].generate_ids(prompt, params) for mode in models}
    runs = [lambda s=s: s.generate_ids(prompt, params) for s in steps.values()]
    runs += [lambda m=m: generate_ids(m, prompt, params) for m in (model, *models.values())]
    fused_f32, fused_q8, fused_q4, eager_f32, eager_q8, eager_q4 = interleave(runs, warmup=1, repeats=repeats,
                                                                              device=model.device)
    f32_bytes = step_bytes(model)
    new = params.max_new_tokens
    ext = load_cpu_ext()

    def mode_figures(mode: str, fused: Timing, eager: Timing) -> dict[str, Any]:
        return {"identical": same_tokens([generate_ids(models[mode], prompt, params)], [got[mode]]).equal == 1,
                "tok_s": new / fused.median, "speedup": fused_f32.median / fused.median,
                "eager_tok_s": new / eager.median, "eager_speedup": eager_f32.median / eager.median,
                "MB": step_bytes(models[mode]) / 1e6, "weight_ratio": f32_bytes / step_bytes(models[mode])}

    q8, q4 = mode_figures("int8", fused_q8, eager_q8), mode_figures("int4", fused_q4, eager_q4)
    return {"identical": q8["identical"], "f32_tok_s": new / fused_f32.median, "int8_tok_s": q8["tok_s"],
            "speedup": q8["speedup"], "eager_f32_tok_s": new / eager_f32.median, "eager_int8_tok_s": q8["eager_tok_s"],
            "eager_speedup": q8["eager_speedup"], "int8_path": ext.int8_path(), "f32_MB": f32_bytes / 1e6,
            "int8_MB": q8["MB"], "weight_ratio": q8["weight_ratio"],
            "int4": {**q4, "group_size": group, "vs_int8": fused_q8.median / fused_q4.median,
                     "path": ext.int4_path(group)}}


def round_costs(target: FusedCPUDecoder, draft: FusedCPUDecoder, rows: int, context: int, repeats: int = 5,
                calls: int = 50) -> dict[str, Any]:
    """What a speculative round's calls cost on the fused step, in target steps: `verify_cost[n - 1]`, a verify of n
    rows (1..`rows`) over `context` cached tokens, and `draft_cost`, c, one step of the draft (chapter 08's cost
    model). Each timed `calls` times from the same cache length, interleaved, medians of `repeats`. Every argument is
    checked first: rows in [1, MAX_VERIFY], context >= 0 with room for the rows in both caches."""
    for name, dec in (("target", target), ("draft", draft)):
        if not isinstance(dec, FusedCPUDecoder):
            raise TypeError(f"{name} must be a FusedCPUDecoder, got {type(dec).__name__}")
        dec.check_model_unchanged()  # verify does not: timing a snapshot the model no longer holds says nothing
    rows = check_int("rows", rows)
    if rows > MAX_VERIFY:
        raise ValueError(f"rows must be in [1, MAX_VERIFY={MAX_VERIFY}] (the most one verify call takes), got {rows}")
    context = check_int("context", context, 0)
    room = min(target.max_len - rows, draft.max_len - 1)
    if context > room:
        raise ValueError(f"context must leave room for {rows} rows in the target's cache (max_len {target.max_len}) "
                         f"and 1 in the draft's (max_len {draft.max_len}): at most {room}, got {context}")
    repeats = check_repeats("repeats", repeats)
    calls = check_calls("calls", calls)
    for dec in (target, draft):
        dec.cache.reset()
        for at in range(0, context, MAX_VERIFY):  # any ids: the timings only need the cache's length
            dec.verify([1] * min(MAX_VERIFY, context - at))

    def timed(dec: FusedCPUDecoder, n: int) -> Callable[[], None]:
        def run() -> None:
            for _ in range(calls):
                dec.verify([1] * n)
                dec.cache.truncate(context)
        return run

    runs = [timed(target, n) for n in range(1, rows + 1)] + [timed(draft, 1)]
    times = [t.median for t in interleave(runs, warmup=1, repeats=repeats)]
    return {"verify_cost": [t / times[0] for t in times[:-1]], "draft_cost": times[-1] / times[0]}


def fused_speculation(model: GPT, draft: GPT, prompts: list[list[int]], lookup_prompt: list[int], new_tokens: int,
                      gamma: int = 4, lookup_gamma: int = 5, repeats: int = 5) -> dict[str, Any]:
    """Chapter 08's speculative decoding on the fastest path (`fused_speculative`): `draft`'s fused step proposes
    `gamma` tokens, `model`'s fused verify checks gamma+1 in one C++ call, greedy, over `prompts`; and prompt lookup
    (`lookup_gamma` tokens copied from the context) on `lookup_prompt`, text that repeats itself. Each against the
    target's fused step alone on the same prompts (interleaved, medians), tokens checked identical; with the
    acceptance rate α and tokens per target call of each. Every prompt must leave room for new_tokens in both
    models' windows (else the runs stop early and the rates count tokens never generated): a ValueError naming it."""
    for name, m in (("model", model), ("draft", draft)):
        require_model(m, f"fused_speculation ({name})")
        check_eval_mode(m, f"fused_speculation ({name})")
    new_tokens = check_int("new_tokens", new_tokens)
    gamma, lookup_gamma = check_gamma(gamma), check_gamma(lookup_gamma, "lookup_gamma")
    repeats = check_repeats("repeats", repeats)
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise TypeError(f"prompts must be a non-empty list of prompts (lists of token ids), got "
                        f"{type(prompts).__name__} {short_repr(prompts)}")
    named = [(f"prompts[{i}]", p) for i, p in enumerate(prompts)] + [("lookup_prompt", lookup_prompt)]
    for what, p in named:
        if not check_token_ids(what, p, min(model.config.vocab_size, draft.config.vocab_size)):
            raise ValueError(f"{what} is empty: generation needs at least one token to condition on")
    check_fit_windows([(what, len(p)) for what, p in named], new_tokens,
                      [("the model", model.config.block_size), ("the draft", draft.config.block_size)])
    rows = max(gamma, lookup_gamma) + 1  # `round_costs` times a verify this wide after prompts[0]: checked now
    if rows > MAX_VERIFY:
        raise ValueError(f"gamma and lookup_gamma must be below MAX_VERIFY={MAX_VERIFY} (a verify of gamma + 1 rows), "
                         f"got {gamma} and {lookup_gamma}")
    if len(prompts[0]) + rows > model.config.block_size or len(prompts[0]) + 1 > draft.config.block_size:
        raise ValueError(f"prompts[0] ({len(prompts[0])} tokens) leaves no room for the cost model's verify of {rows} "
                         f"rows in the model's context window block_size={model.config.block_size}: shorten it")
    params = SamplingParams.greedy(new_tokens, ignore_eos=True)
    target_step, draft_step = FusedCPUDecoder(model), FusedCPUDecoder(draft)

    def alone(ps: list[list[int]]) -> list[list[int]]:
        return [target_step.generate_ids(p, params) for p in ps]

    def speculative() -> list[tuple[list[int], Any]]:
        return [generate_speculative_fused(target_step, draft_step, p, params, gamma) for p in prompts]

    def lookup() -> tuple[list[int], Any]:
        return generate_prompt_lookup_fused(target_step, lookup_prompt, params, lookup_gamma)

    want, spec, looked = alone(prompts), speculative(), lookup()
    base, fast = interleave([lambda: alone(prompts), speculative], warmup=1, repeats=repeats, device=model.device)
    base_l, fast_l = interleave([lambda: alone([lookup_prompt]), lookup], warmup=1, repeats=repeats,
                                device=model.device)
    accepted, proposed = sum(s.accepted for _, s in spec), sum(s.proposed for _, s in spec)
    calls = sum(s.target_calls for _, s in spec)
    tokens = len(prompts) * new_tokens
    costs = round_costs(target_step, draft_step, max(gamma, lookup_gamma) + 1, len(prompts[0]), repeats)
    return {"gamma": gamma, "prompts": len(prompts), "new_tokens": new_tokens, **costs,
            "identical": [ids for ids, _ in spec] == want, "alone_tok_s": tokens / base.median,
            "speculative_tok_s": tokens / fast.median, "speedup": base.median / fast.median,
            "alpha": accepted / max(proposed, 1), "tokens_per_call": sum(len(ids) for ids, _ in spec) / max(calls, 1),
            "lookup": {"gamma": lookup_gamma, "prompt_len": len(lookup_prompt),
                       "identical": looked[0] == alone([lookup_prompt])[0],
                       "alone_tok_s": new_tokens / base_l.median, "lookup_tok_s": new_tokens / fast_l.median,
                       "speedup": base_l.median / fast_l.median,
                       "kept": looked[1].accepted, "proposed": looked[1].proposed,
                       "tokens_per_call": looked[1].tokens_per_target_call}}


def run_all(model: GPT, real_text: bool, quick: bool = False, seed: int = 0, backend: str = "inductor",
            with_hf: bool = True, draft: GPT | None = None) -> dict[str, Any]:
    """Every measurement of the module docstring on `model` (the shipped `base`, or any GPT): `real_text` picks
    validation text over random ids for the prompt; `draft` (the shipped `draft-distilled`, or any GPT of the
    model's vocabulary) adds speculative decoding on the fused step. Every argument is checked before the first
    measurement."""
    require_model(model, "run_all (model)")
    if draft is not None:
        require_model(draft, "run_all (draft)")
        check_eval_mode(draft, "run_all (draft)")
        if draft.config.vocab_size != model.config.vocab_size:
            raise ValueError(f"draft's vocab_size={draft.config.vocab_size} differs from the model's "
                             f"{model.config.vocab_size}")
    check_eval_mode(model, "run_all")  # every path's tokens are compared with the eager generator's
    for name, flag in (("real_text", real_text), ("quick", quick), ("with_hf", with_hf)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__} {flag!r}")
    seed = check_seed(check_int("seed", seed, 0))  # [0, 2**64): torch's generator's range
    backend = check_backend(backend)
    device = model.device
    if device.type == "cpu" and build_problem() is None:  # pruned_fused runs last: refused now, not after minutes
        _check_training_vocabulary(model, "run_all")
    new = 32 if quick else 64
    repeats = 3 if quick else 5
    prompt = eval_prompts([16], model.config.vocab_size, real_text, seed)[0]
    params = SamplingParams.greedy(new, ignore_eos=True)
    want = generate_ids(model, prompt, params)
    ways = streaming_ways(model)
    bound = weight_streaming_bound(model, ways=ways)
    stream = ways[0][bound["by"]]
    rows = []

    def row(mode: str, run: Callable[[], list[int]], **info: Any) -> dict[str, Any]:
        """One path: its tokens against the eager generator's, then the eager generator, the path and the bound's
        products for as many tokens, timed in turn (medians of repeats in one interleaved run)."""
        got = run()  # for a compiled or captured step, this first run builds it
        eager, path, streamed = interleave([lambda: generate_ids(model, prompt, params), run,
                                            lambda: stream(new)], warmup=1, repeats=repeats, device=device)
        rows.append({"mode": mode, "identical": same_tokens([want], [got]).equal == 1, "tok_s": new / path.median,
                     "eager_tok_s": new / eager.median, "speedup": eager.median / path.median,
                     "fraction_of_bound": streamed.median / path.median, "bound_tok_s": new / streamed.median,
                     **info})
        return rows[-1]

    cpp = device.type == "cpu" and build_problem() is None
    if cpp:
        fast = fast_cpu_model(model)
        fused = FusedCPUDecoder(model)
        for mode, run in (("C++ GEMV (fast_cpu_model)", lambda: generate_ids(fast, prompt, params)),
                          (FUSED, lambda: fused.generate_ids(prompt, params))):
            row(mode, run, backend=None, static=False, compiles=0, first_call_seconds=0.0)
    for mode in ["eager", "compile"] + (["cuda-graph"] if device.type == "cuda" else []):
        dec = StaticDecoder(model, mode, backend=backend)
        r = row(mode, lambda: dec.generate_ids(prompt, params), backend=backend if mode == "compile" else None,
                static=True)
        r.update(compiles=dec.compiles, first_call_seconds=dec.first_call_seconds)
    # subtle: the fastest-ever bound is a best case, and a neighbour's load during its few seconds would make every
    # path look closer to it (or past it); measured again after the paths, the faster of the two is kept.
    again = weight_streaming_bound(model, ways=ways)
    if again["step_seconds"] < bound["step_seconds"]:
        bound = again
    for r in rows:
        r["fraction_of_fastest_bound"] = r["tok_s"] / bound["tok_s_bound"]
    report = {"device": str(device), "threads": torch.get_num_threads(), "new_tokens": new,
              "prompt_len": len(prompt), "bound": bound, "rows": rows}
    if with_hf and hf_available():
        # Hugging Face generate(use_cache=True) on the same weights, against the eager generator and against the fast
        # path, each interleaved with HF in its own comparison (the measurement kit's `hf_comparison`, as chapter 04).
        report["hf"] = {"eager": hf_comparison(model, prompt, new, partial(generate_ids, model), repeats=repeats)}
        if cpp:
            report["hf"]["fast"] = hf_comparison(fast, prompt, new, partial(generate_ids, fast), repeats=repeats)
            report["hf"]["fused"] = hf_comparison(model, prompt, new, fused.generate_ids, repeats=repeats)
    if cpp:
        report["pruned_fused"] = pruned_fused(model, prompt, params, repeats=repeats, seed=seed)
        report["quantized_fused"] = quantized_fused(model, prompt, params, repeats=repeats)
        window = min(model.config.block_size, draft.config.block_size) if draft is not None else 0
        if draft is not None and window >= 16 + new + 8:
            # prompts from the validation text; the lookup prompt a longer stretch (up to 200 tokens) that repeats
            spec_prompts = eval_prompts([16] * (2 if quick else 4), model.config.vocab_size, real_text, seed + 1)
            lookup_prompt = eval_prompts([min(200, window - new)], model.config.vocab_size, real_text, seed + 2)[0]
            report["fused_speculation"] = fused_speculation(model, draft, spec_prompts, lookup_prompt, new,
                                                            repeats=repeats)
    return report


@reads_report
def paths_table(report: dict[str, Any]) -> str:
    """The rows of a report as a Markdown table: each path's tok/s, against the eager generator timed in turn with
    it (the generator's own tok/s in brackets), its two fractions of the bound, its checks."""
    rows = []
    for r in report["rows"]:
        name = f"{r['mode']} ({r['backend']})" if r["backend"] else r["mode"]
        name = f"static-shape, {name}" if r["static"] else f"{name}, growing cache"
        rows.append([name, f"{r['tok_s']:.0f}", f"{r['speedup']:.2f}x ({r['eager_tok_s']:.0f})",
                     f"{100 * r['fraction_of_bound']:.0f}%", f"{100 * r['fraction_of_fastest_bound']:.0f}%",
                     str(r["identical"]), str(r["compiles"]), f"{r['first_call_seconds']:.2f} s"])
    return markdown_table(["decode step", "tok/s", "vs eager generate_ids", "of the bound, same run",
                           "of the fastest bound", "identical tokens", "graphs built", "first call (compile)"], rows)


@reads_report
def format_table(report: dict[str, Any]) -> str:
    b = report["bound"]
    ways = ", ".join(f"{k} {1e3 * v:.3f} ms" for k, v in b["seconds"].items())
    lines = [f"weight-streaming bound: {b['bytes'] / 1e6:.1f} MB of weights per step ({ways}); the faster, {b['by']}, "
             f"is {b['GBps']:.1f} GB/s = {b['tok_s_bound']:.0f} tok/s; {report['device']}, {report['threads']} "
             f"thread(s), {report['new_tokens']} greedy tokens after a {report['prompt_len']}-token prompt", "",
             paths_table(report).rstrip("\n")]
    for name, h in report.get("hf", {}).items():
        lines.append(f"HF generate(use_cache=True, {h['attn_implementation']}) {h['hf_tok_s']:.0f} tok/s vs ours "
                     f"({name}) {h['ours_tok_s']:.0f}: {h['ratio']:.2f}x, identical tokens {h['identical']}")
    if "pruned_fused" in report:
        p = report["pruned_fused"]
        lines.append(f"structured MLP {100 * p['fraction']:.0f}% on the fused step: {p['pruned_tok_s']:.0f} vs "
                     f"{p['dense_tok_s']:.0f} tok/s dense, {p['speedup']:.2f}x (weights read {p['weight_ratio']:.2f}x "
                     f"fewer), identical to the pruned model's eager tokens {p['identical']}")
    if "quantized_fused" in report:
        q = report["quantized_fused"]
        q4 = q["int4"]
        lines.append(f"int8 weights on the fused step ({q['int8_path']}): {q['int8_tok_s']:.0f} vs "
                     f"{q['f32_tok_s']:.0f} tok/s float32, {q['speedup']:.2f}x (weights read "
                     f"{q['weight_ratio']:.2f}x fewer; eager int8 "
                     f"{q['eager_speedup']:.2f}x eager float32), identical to the int8 model's eager tokens "
                     f"{q['identical']}")
        lines.append(f"int4 weights on the fused step ({q4['path']}, groups of {q4['group_size']}): "
                     f"{q4['tok_s']:.0f} tok/s, {q4['speedup']:.2f}x float32, {q4['vs_int8']:.2f}x int8 (weights "
                     f"read {q4['weight_ratio']:.2f}x fewer than float32; eager int4 {q4['eager_speedup']:.2f}x eager "
                     f"float32), identical to the int4 model's eager tokens {q4['identical']}")
    if "fused_speculation" in report:
        s, lk = report["fused_speculation"], report["fused_speculation"]["lookup"]
        lines.append(f"speculative on the fused step (distilled draft, gamma {s['gamma']}, {s['prompts']} prompts): "
                     f"{s['speculative_tok_s']:.0f} vs {s['alone_tok_s']:.0f} tok/s alone, {s['speedup']:.2f}x, "
                     f"alpha {s['alpha']:.2f}, {s['tokens_per_call']:.2f} tokens per target call, identical "
                     f"{s['identical']}")
        lines.append("  a round's calls in target steps: verify of " + ", ".join(
            f"{n + 1} rows {c:.2f}" for n, c in enumerate(s["verify_cost"])) + f"; a draft step {s['draft_cost']:.2f}")
        lines.append(f"prompt lookup on the fused step (gamma {lk['gamma']}, a {lk['prompt_len']}-token prompt): "
                     f"{lk['lookup_tok_s']:.0f} vs {lk['alone_tok_s']:.0f} tok/s alone, {lk['speedup']:.2f}x, "
                     f"{lk['kept']}/{lk['proposed']} drafts kept, identical {lk['identical']}")
    return "\n".join(lines)


# The rows the chapter text names in its quotes, by the report's mode and whether the step is static-shape.
QUOTED_ROWS = {"gemv": ("C++ GEMV (fast_cpu_model)", False), "fused": (FUSED, False), "static_eager": ("eager", True),
               "compile": ("compile", True)}


@reads_report
def quotes(report: dict[str, Any]) -> dict[str, str]:
    """What the chapter text quotes from a report of `main --json` (a CPU run, where the C++ paths build):
    the table of paths ("paths"); the bound (`bound_ms`, the faster way's ms per step, `linear_ms` and `cpp_ms`
    for the two ways, `bound_GBps`, `bound_tok_s`, `weights_MB`); per quoted row (`gemv`, `fused`,
    `static_eager`, `compile`) its `_tok_s`, `_speedup` over the eager generator ("2.80x"), `_of_bound` and
    `_of_fastest_bound` ("74%"); the eager generator's tok/s over the rows' runs (`eager_tok_s_min`, `_max`);
    the compiled step's first call (`compile_first_call`, "2.9 s"); Hugging Face against each of ours
    (`hf_eager`, `hf_fast`, `hf_fused`, "1.22x"); the pruned fused step (`pruned_tok_s`, `pruned_dense_tok_s`,
    `pruned_speedup`, `pruned_weight_ratio`); the int8 fused step (`int8_tok_s`, `int8_f32_tok_s`, `int8_speedup`,
    `int8_weight_ratio`, `int8_MB`, `int8_f32_MB`, `int8_eager_speedup`, `int8_path`) and the int4 one (`int4_tok_s`,
    `int4_speedup`, `int4_vs_int8`, `int4_MB`, `int4_weight_ratio`, `int4_eager_speedup`, `int4_path`,
    `int4_group_size`); speculation on the fused
    step (`spec_tok_s`, `spec_alone_tok_s`, `spec_speedup`, `spec_alpha`, `spec_gamma`, `spec_tokens_per_call`,
    `spec_prompts`) and prompt lookup on it (`lookup_speedup`, `lookup_gamma`, `lookup_kept`,
    `lookup_tokens_per_call`, `lookup_prompt_len`) with what a round's calls cost in target steps (`spec_draft_cost`,
    `spec_verify_cost` and `lookup_verify_cost` for their γ+1 rows, `spec_verify_row_cost` per extra row) and the
    speed-up those costs predict from the tokens per target call (`spec_predicted`: tokens / (γ c + verify)); the
    run's settings
    (`new_tokens`, `prompt_len`, `threads`, `model`,
    `cpu`, `command`)."""
    b = report["bound"]
    out = {"paths": paths_table(report), "bound_ms": f"{1e3 * b['step_seconds']:.3f}",
           "linear_ms": f"{1e3 * b['seconds']['F.linear']:.3f}", "cpp_ms": f"{1e3 * b['seconds']['C++ GEMV']:.3f}",
           "bound_GBps": f"{b['GBps']:.1f}", "bound_tok_s": f"{b['tok_s_bound']:,.0f}",
           "weights_MB": f"{b['bytes'] / 1e6:.1f}"}
    for key, (mode, static) in QUOTED_ROWS.items():
        r = next(r for r in report["rows"] if r["mode"] == mode and r["static"] == static)
        out[f"{key}_tok_s"] = f"{r['tok_s']:,.0f}"
        out[f"{key}_speedup"] = f"{r['speedup']:.2f}x"
        out[f"{key}_of_bound"] = f"{100 * r['fraction_of_bound']:.0f}%"
        out[f"{key}_of_fastest_bound"] = f"{100 * r['fraction_of_fastest_bound']:.0f}%"
        if key == "compile":
            out["compile_first_call"] = f"{r['first_call_seconds']:.1f} s"
    eager = [r["eager_tok_s"] for r in report["rows"]]
    out["eager_tok_s_min"], out["eager_tok_s_max"] = f"{min(eager):,.0f}", f"{max(eager):,.0f}"
    for name, h in report.get("hf", {}).items():
        out[f"hf_{name}"] = f"{h['ratio']:.2f}x"
    if "pruned_fused" in report:
        p = report["pruned_fused"]
        out.update(pruned_tok_s=f"{p['pruned_tok_s']:,.0f}", pruned_dense_tok_s=f"{p['dense_tok_s']:,.0f}",
                   pruned_speedup=f"{p['speedup']:.2f}x", pruned_weight_ratio=f"{p['weight_ratio']:.2f}x",
                   pruned_fraction=f"{100 * p['fraction']:.0f}%")
    if "quantized_fused" in report:
        q = report["quantized_fused"]
        q4 = q["int4"]
        out.update(int8_tok_s=f"{q['int8_tok_s']:,.0f}", int8_f32_tok_s=f"{q['f32_tok_s']:,.0f}",
                   int8_speedup=f"{q['speedup']:.2f}x", int8_weight_ratio=f"{q['weight_ratio']:.2f}x",
                   int8_MB=f"{q['int8_MB']:.1f} MB", int8_f32_MB=f"{q['f32_MB']:.1f} MB",
                   int8_eager_speedup=f"{q['eager_speedup']:.2f}x", int8_path=str(q["int8_path"]),
                   int4_tok_s=f"{q4['tok_s']:,.0f}", int4_speedup=f"{q4['speedup']:.2f}x",
                   int4_vs_int8=f"{q4['vs_int8']:.2f}x", int4_MB=f"{q4['MB']:.1f} MB",
                   int4_weight_ratio=f"{q4['weight_ratio']:.2f}x", int4_eager_speedup=f"{q4['eager_speedup']:.2f}x",
                   int4_path=str(q4["path"]), int4_group_size=str(q4["group_size"]))
    if "fused_speculation" in report:
        s, lk = report["fused_speculation"], report["fused_speculation"]["lookup"]
        predicted_round = s["gamma"] * s["draft_cost"] + s["verify_cost"][s["gamma"]]  # in target steps
        out.update(spec_tok_s=f"{s['speculative_tok_s']:,.0f}", spec_alone_tok_s=f"{s['alone_tok_s']:,.0f}",
                   spec_speedup=f"{s['speedup']:.2f}x", spec_alpha=f"{s['alpha']:.2f}", spec_gamma=str(s["gamma"]),
                   spec_tokens_per_call=f"{s['tokens_per_call']:.2f}", spec_prompts=str(s["prompts"]),
                   lookup_speedup=f"{lk['speedup']:.2f}x", lookup_gamma=str(lk["gamma"]),
                   lookup_kept=f"{lk['kept']}/{lk['proposed']}",
                   lookup_tokens_per_call=f"{lk['tokens_per_call']:.2f}",
                   lookup_prompt_len=str(lk["prompt_len"]), spec_draft_cost=f"{s['draft_cost']:.2f}",
                   spec_verify_cost=f"{s['verify_cost'][s['gamma']]:.2f}",
                   spec_verify_row_cost=f"{(s['verify_cost'][s['gamma']] - 1) / s['gamma']:.2f}",
                   lookup_verify_cost=f"{s['verify_cost'][lk['gamma']]:.2f}",
                   spec_predicted=f"{s['tokens_per_call'] / predicted_round:.2f}x")
    for key in ("new_tokens", "prompt_len", "threads", "model", "cpu", "command"):
        if key in report:
            out[key] = str(report[key])
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = bench_parser("python -m minillm.compile.bench", __doc__.splitlines()[0], "32 tokens, fewer repeats")
    ap.add_argument("--backend", default="inductor", type=cli_type(check_backend),
                    help="torch.compile backend (default inductor)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = start(build_parser(), argv)
    loaded = load_model("base", args.device, args.seed)
    draft = load_model("draft-distilled", args.device, args.seed).model
    report = run_all(loaded.model, loaded.trained, quick=args.quick, seed=args.seed, backend=args.backend,
                     draft=draft)
    report["model"] = loaded.label
    print(f"model: {loaded.label}")
    print(format_table(report))
    write_report(args.json, report)
    spec = report.get("fused_speculation", {})
    ok = all(r["identical"] for r in report["rows"]) and all(report.get(k, {}).get("identical", True)
                                                              for k in ("pruned_fused", "quantized_fused")) \
        and report.get("quantized_fused", {}).get("int4", {}).get("identical", True) \
        and spec.get("identical", True) and spec.get("lookup", {}).get("identical", True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

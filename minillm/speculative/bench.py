"""Chapter 08's benchmark: speculative decoding against the target alone, the cost model, and Hugging Face.

What it measures, greedy at batch 1 unless said otherwise, each speed-up the ratio of medians of alternating runs in
one process (`minillm.core.timing.compare`):
  - `forward_costs`: a target forward of T new tokens on a cache (what a verify of γ = T-1 drafts costs) and a
    draft forward of one token, interleaved so a slow minute hits all of them alike; c = draft / target(1).
  - `matmul_costs`: the same T rows through the target's weight matrices alone, the arithmetic part of a verify.
  - `greedy_sweep`: every γ's `generate_speculative` (base + draft) against chapter 04's `generate_ids`, all timed
    in one interleaved run (`minillm.core.timing.interleave`: alone, γ1, γ2, ... once per repeat): identical
    tokens, accepted / proposed, tokens per target call, tok/s, speed-up, and the cost model's two predictions
    (a verify costing one step, as Leviathan et al. assume, and the measured verify cost).
  - `prompt_lookup`: n-gram drafting on code from the corpus' validation split, same checks.
  - `sampling_exactness`: N draws of `accept_or_resample` at one prefix, binned on the target's likeliest tokens,
    against the target's own p by a chi-square test (its p-value from the regularized incomplete gamma function).
  - `hf_assisted`: `transformers` assisted generation (`generate(assistant_model=...)`) on the same two models'
    weights, with its default schedule and with a constant γ like ours; identical tokens and the tok/s ratio.
The command: `python -m minillm.speculative.bench [--quick] [--device cpu] [--json FILE]`. The chapter text's tables
and numbers come from the committed report of one full run, `chapters/results/08-speculative.json`, through
`quotes(report)` (`minillm.course.results`).
Speculation inside chapter 06's engine has its own benchmark, `minillm.speculative.engine_bench`.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import torch

from minillm.bench.check import same_tokens
from minillm.bench.cli import bench_parser, start, write_report
from minillm.bench.models import load_model
from minillm.bench.tables import markdown_table
from minillm.core.config import check_fit_windows, check_float, check_has_data, check_int, reads_report
from minillm.core.corpus import corpus_sample
from minillm.core.device import resolve_device
from minillm.core.hf import to_hf_model
from minillm.core.model import GPT, require_model
from minillm.core.sampling import SamplingParams, check_seed, probs_from_logits
from minillm.core.stopping import check_token_ids
from minillm.core.timing import check_calls, check_repeats, compare, interleave, measure
from minillm.gpt.pretrained import is_shipped
from minillm.kvcache.cache import ContiguousKVCache
from minillm.kvcache.generate import generate_ids
from minillm.speculative.generate import _forward, generate_prompt_lookup, generate_speculative
from minillm.speculative.generate import check_gamma
from minillm.speculative.sampling import accept_or_resample, check_distributions

FIB_PROMPT = "def fibonacci(n):\n    "


def _check_ints(name: str, values: object, minimum: int = 1) -> list[int]:
    """A non-empty list of ints >= minimum (bool excluded), else TypeError/ValueError naming `name`."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)):
        raise TypeError(f"{name} must be a list of ints, got {type(values).__name__} {values!r}")
    if not values:
        raise ValueError(f"{name} must not be empty")
    return [check_int(f"{name}[{i}]", v, minimum) for i, v in enumerate(values)]  # the plain ints


def _check_prompt(name: str, prompt: object, vocab_size: int) -> list[int]:
    """A non-empty list of token ids in [0, vocab_size), else TypeError/ValueError naming `name` (the model's own
    message would name no argument, an embedding's IndexError not even the id)."""
    _check_ints(name, prompt, 0)
    return check_token_ids(name, prompt, vocab_size)


def _check_prompts(name: str, prompts: object, vocab_size: int) -> list[list[int]]:
    """A non-empty list of non-empty prompts (lists of token ids in [0, vocab_size))."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"{name} must be a non-empty list of prompts (lists of token ids), got {prompts!r}")
    return [_check_prompt(f"{name}[{i}]", p, vocab_size) for i, p in enumerate(prompts)]


def _check_pair(target: GPT, draft: GPT, who: str) -> None:
    """target and draft: minillm GPTs on one device sharing one vocabulary (their distributions are compared token
    by token); TypeError/ValueError naming `who` and both values otherwise, before any forward."""
    t, d = require_model(target, f"{who} (target)"), require_model(draft, f"{who} (draft)")
    if t.vocab_size != d.vocab_size:
        raise ValueError(f"{who}: the draft's vocab_size={d.vocab_size} differs from the target's "
                         f"vocab_size={t.vocab_size}: their tokens must mean the same thing")
    if target.device != draft.device:
        raise ValueError(f"{who}: draft and target must be on one device, got {draft.device} and {target.device}")


def expected_tokens_per_call(alpha: float, gamma: int) -> float:
    """(1 - α^(γ+1)) / (1 - α): tokens one target forward yields when each draft is kept with probability α."""
    alpha = check_float("alpha", alpha, 0.0, 1.0)
    gamma = check_int("gamma", gamma, 0)
    return (1 - alpha ** (gamma + 1)) / (1 - alpha) if alpha < 1 else gamma + 1.0


def predicted_speedup(alpha: float, gamma: int, c: float, verify_cost: float = 1.0) -> float:
    """The cost model: tokens per round over the round's cost in target steps (γ drafts at c, one verify)."""
    gamma = check_int("gamma", gamma, 0)
    c = check_float("c", c, 0.0)
    verify_cost = check_float("verify_cost", verify_cost, 0.0, include_minimum=False)
    return expected_tokens_per_call(alpha, gamma) / (gamma * c + verify_cost)


COST_CONTEXT = 64  # cached tokens the timed forwards of `forward_costs` (and so `greedy_sweep`) run on


def forward_costs(target: GPT, draft: GPT, prompt: list[int], ts: list[int], context: int = COST_CONTEXT,
                  repeats: int = 40) -> dict[str, Any]:
    """Seconds for a target forward of T new tokens on a `context`-token cache, and a draft forward of one token.

    Both go through the very call the speculative loop makes (`generate._forward`: the model's hidden states and
    logits of every fed position), the draft's followed by its argmax as in a greedy proposal, so c is what a
    draft step costs the loop and not a lighter stand-in.
    """
    ts = _check_ints("ts", ts)
    context = check_int("context", context)
    repeats = check_repeats("repeats", repeats)  # each one a Python loop of forwards: bounded
    for who, model, T in (("target", target, max(ts)), ("draft", draft, 1)):
        cfg = require_model(model, f"forward_costs ({who})")
        _check_prompt("prompt", prompt, cfg.vocab_size)
        window = cfg.block_size
        if context + T > window:  # the timed forward writes positions context .. context + T - 1
            raise ValueError(f"context={context} plus {T} new token(s) is past the {who}'s context window "
                             f"block_size={window}: lower context (or ts)")

    def one_forward(model: GPT, T: int, pick: bool):
        cache = ContiguousKVCache(model.config, 1, context + T, device=model.device)
        ctx_ids = (prompt * (context // max(len(prompt), 1) + 1))[:context]
        with torch.inference_mode():
            _forward(model, cache, ctx_ids, 0)
        new = [0] * T

        def step() -> None:
            with torch.inference_mode():
                logits = _forward(model, cache, new, context)  # (T, V)
                if pick:
                    int(logits[-1].argmax())
            cache.truncate(context)
        return step

    steps = {("target", T): one_forward(target, T, False) for T in ts} | {("draft", 1): one_forward(draft, 1, True)}
    times: dict[tuple[str, int], list[float]] = {k: [] for k in steps}
    for f in steps.values():
        measure(f, warmup=5, repeats=1, device=target.device)
    for _ in range(repeats):  # interleaved: every configuration once per repeat
        for k, f in steps.items():
            times[k].append(measure(f, warmup=0, repeats=1, device=target.device).median)
    target_s = {T: statistics.median(times[("target", T)]) for T in ts}
    draft_s = statistics.median(times[("draft", 1)])
    return {"target_s": target_s, "draft_s": draft_s, "c": draft_s / target_s[ts[0]],
            "verify_cost": {T: target_s[T] / target_s[ts[0]] for T in ts}}


def matmul_costs(model: GPT, ts: list[int], repeats: int = 40) -> dict[str, Any]:
    """Seconds to push T rows through every weight matrix of `model` alone (`F.linear`, the lm_head included):
    the part of a forward of T new tokens that is matrix products, without attention, norms or Python around them.

    If a one-token step were bound by reading the weights, T rows would cost about what one row costs; on a model
    whose weights sit in the CPU's caches the products are bound by arithmetic and grow with T instead. Each T in
    `ts` is at most the model's block_size, the most rows one forward feeds.
    """
    window = require_model(model, "matmul_costs: model").block_size
    ts = _check_ints("ts", ts)
    repeats = check_calls("repeats", repeats)  # at most MAX_REPEATS, as measure allows
    if max(ts) > window:  # a forward never feeds more rows than the window; far past it, the allocator fails
        raise ValueError(f"ts holds T={max(ts)}, more rows than the model's context window block_size={window}")
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]  # (out, in) weights, lm_head tied
    inputs = {T: [torch.randn(T, m.in_features, device=model.device) for m in layers] for T in ts}

    def run(T: int) -> None:
        with torch.inference_mode():
            for m, x in zip(layers, inputs[T]):
                torch.nn.functional.linear(x, m.weight, m.bias)

    times: dict[int, list[float]] = {T: [] for T in ts}
    for T in ts:
        measure(lambda: run(T), warmup=3, repeats=1, device=model.device)
    for _ in range(repeats):
        for T in ts:
            times[T].append(measure(lambda: run(T), warmup=0, repeats=1, device=model.device).median)
    seconds = {T: statistics.median(v) for T, v in times.items()}
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    flops = 2 * sum(m.weight.numel() for m in layers)  # per row
    return {"seconds": seconds, "relative": {T: seconds[T] / seconds[ts[0]] for T in ts},
            "weight_bytes": weight_bytes, "gb_per_s_one_row": weight_bytes / seconds[ts[0]] / 1e9,
            "gflop_per_s": {T: flops * T / seconds[T] / 1e9 for T in ts}}


def draft_agreement(target: GPT, draft: GPT, prompts: list[list[int]], outputs: list[list[int]]) -> dict[str, float]:
    """How well the draft predicts the target along the target's own greedy continuations, from one forward each.

    argmax agreement: the fraction of continuation positions where the draft's argmax is the target's (what greedy
    speculation keeps, α at γ = 1 up to the draft's cache). 1 − TV: Σ_x min(p(x), q(x)) at temperature 1, averaged
    over the same positions: the acceptance probability of speculative *sampling* (Leviathan et al. §3.1).
    """
    _check_pair(target, draft, "draft_agreement")
    prompts = _check_prompts("prompts", prompts, target.config.vocab_size)
    if not isinstance(outputs, (list, tuple)) or len(outputs) != len(prompts):
        raise ValueError(f"outputs must hold one continuation per prompt ({len(prompts)}), got {outputs!r}")
    outputs = [check_token_ids(f"outputs[{i}]", o, target.config.vocab_size) for i, o in enumerate(outputs)]
    if not any(len(o) for o in outputs):
        raise ValueError("outputs are all empty: no position to compare the draft with the target on")
    window = min(target.config.block_size, draft.config.block_size)
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        if len(prompt) + len(out) - 1 > window:  # the last token predicts nothing compared here: it is not fed
            raise ValueError(f"prompts[{i}] ({len(prompt)} tokens) and outputs[{i}] ({len(out)} tokens) need "
                             f"{len(prompt) + len(out) - 1} positions, past the smaller context window of target and "
                             f"draft, block_size={window}")
    agree, overlap, n = 0, 0.0, 0
    for prompt, out in zip(prompts, outputs):
        ids = torch.tensor([prompt + out[:-1]], device=target.device)  # (1, P + N - 1): every predicting position
        rows = slice(len(prompt) - 1, len(prompt) + len(out) - 1)  # the positions that predicted the continuation
        with torch.inference_mode():
            p = torch.softmax(target(ids)[0, rows].float(), dim=-1)  # (N, V)
            q = torch.softmax(draft(ids)[0, rows].float(), dim=-1)  # (N, V)
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        overlap += float(torch.minimum(p, q).sum())
        n += len(out)
    return {"argmax_agreement": agree / n, "one_minus_tv": overlap / n, "positions": n}


def greedy_sweep(target: GPT, draft: GPT, prompts: list[list[int]], new_tokens: int, gammas: list[int],
                 repeats: int = 3) -> dict[str, Any]:
    """Each γ against the target alone over a set of prompts: identical tokens, acceptance, tokens per call,
    speed-up (all prompts' tokens over all prompts' time), and the cost model beside it."""
    _check_pair(target, draft, "greedy_sweep")
    prompts = _check_prompts("prompts", prompts, target.config.vocab_size)
    gammas = [check_gamma(g) for g in _check_ints("gammas", gammas)]
    new_tokens = check_int("new_tokens", new_tokens)
    repeats = check_repeats("repeats", repeats)
    check_fit_windows([(f"prompts[{i}]", len(p)) for i, p in enumerate(prompts)], new_tokens,
                      [("the target", target.config.block_size), ("the draft", draft.config.block_size)])
    fits = target.config.block_size - COST_CONTEXT - 1  # forward_costs times γ+1 tokens after COST_CONTEXT cached
    if max(gammas) > fits:
        raise ValueError(f"gammas holds gamma={max(gammas)}: forward_costs times its verify of {max(gammas) + 1} "
                         f"tokens after a {COST_CONTEXT}-token context, past the target's context window block_size="
                         f"{target.config.block_size}; " + (f"use gammas <= {fits}" if fits >= 1 else
                                                            f"greedy_sweep needs block_size > {COST_CONTEXT + 1}"))
    params = SamplingParams.greedy(new_tokens, ignore_eos=True)

    def alone_all() -> list[list[int]]:  # the target alone on every prompt
        return [generate_ids(target, p, params) for p in prompts]

    def speculative_all(gamma: int) -> list:  # every prompt at this γ: [(tokens, stats), ...]
        return [generate_speculative(target, draft, p, params, gamma=gamma) for p in prompts]

    alone = alone_all()
    costs = forward_costs(target, draft, prompts[0], [1] + [g + 1 for g in gammas], context=COST_CONTEXT)
    costs["matmuls"] = matmul_costs(target, [1] + [g + 1 for g in gammas])
    total = sum(len(o) for o in alone)
    rows = []
    for gamma in gammas:
        runs = speculative_all(gamma)
        outs, stats = [r[0] for r in runs], [r[1] for r in runs]
        proposed, accepted = sum(s.proposed for s in stats), sum(s.accepted for s in stats)
        calls = sum(s.target_calls for s in stats)
        rows.append({"gamma": gamma, "identical": same_tokens(alone, outs).ok,
                     "accepted_per_proposed": accepted / proposed if proposed else 0.0,
                     "tokens_per_target_call": sum(len(o) for o in outs) / calls, "target_calls": calls})
    # One interleaved run: the target alone, then every γ, once per repeat, so each speed-up is a ratio of medians
    # taken on the same machine minutes and the baseline is timed once per repeat, not once per γ.
    # warmup=0: the untimed runs above (and `alone` before the loop) already warmed every path.
    base, *spec = interleave([alone_all, *(lambda g=g: speculative_all(g) for g in gammas)],
                             warmup=0, repeats=repeats, device=target.device)
    for r, t in zip(rows, spec):
        r.update(alone_tok_s=total / base.median, spec_tok_s=total / t.median, speedup=base.median / t.median)
    # subtle: accepted / proposed equals the per-draft acceptance α only at γ = 1 (after a round's first rejection
    # the later drafts count as proposed without a chance), so the smallest γ measured estimates α for all of them.
    alpha = rows[0]["accepted_per_proposed"] if gammas[0] == 1 else None
    for r in rows:
        if alpha is not None:
            g = r["gamma"]
            r["model_tokens_per_call"] = expected_tokens_per_call(alpha, g)
            r["predicted_speedup"] = predicted_speedup(alpha, g, costs["c"])
            r["predicted_speedup_measured_verify"] = predicted_speedup(alpha, g, costs["c"],
                                                                       costs["verify_cost"][g + 1])
    best = max(rows, key=lambda r: r["speedup"])
    return {"new_tokens": new_tokens, "prompts": len(prompts), "prompt_lens": [len(p) for p in prompts],
            "alpha": alpha, "agreement": draft_agreement(target, draft, prompts, alone), "costs": costs,
            "rows": rows, "best_gamma": best["gamma"], "best_speedup": best["speedup"],
            "identical": all(r["identical"] for r in rows)}


def prompt_lookup(target: GPT, prompt: list[int], new_tokens: int, gamma: int = 4, ngram: int = 3,
                  repeats: int = 3) -> dict[str, Any]:
    """n-gram drafting from the sequence itself against the target alone: identical tokens and the speed-up."""
    _check_prompt("prompt", prompt, require_model(target, "prompt_lookup").vocab_size)
    new_tokens = check_int("new_tokens", new_tokens)  # 0 would time two loops that generate nothing
    gamma = check_gamma(gamma)
    ngram = check_int("ngram", ngram)
    repeats = check_repeats("repeats", repeats)
    params = SamplingParams.greedy(new_tokens, ignore_eos=True)
    alone = generate_ids(target, prompt, params)
    out, stats = generate_prompt_lookup(target, prompt, params, gamma=gamma, ngram=ngram)
    cmp = compare(lambda: generate_ids(target, prompt, params),
                  lambda: generate_prompt_lookup(target, prompt, params, gamma=gamma, ngram=ngram),
                  warmup=1, repeats=repeats, device=target.device)
    return {"identical": out == alone, "gamma": gamma, "ngram": ngram, "proposed": stats.proposed,
            "accepted": stats.accepted, "target_calls": stats.target_calls,
            "tokens_per_target_call": stats.tokens_per_target_call, "speedup": cmp.speedup,
            "alone_tok_s": len(alone) / cmp.baseline.median, "prompt_len": len(prompt), "new_tokens": new_tokens,
            "produced": len(alone)}  # fewer than new_tokens where the context window ends first


def chi_square_p_value(chi2: float, dof: int) -> float:
    """P(X >= chi2) for X ~ chi-square(dof): the upper regularized incomplete gamma function Q(dof/2, chi2/2)."""
    chi2 = check_float("chi2", chi2, 0.0)
    dof = check_int("dof", dof)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(chi2 / 2, dtype=torch.float64)))


@dataclass
class ChiSquare:
    n: float  # draws: counts.sum(), a float (whole for counts of draws; expected counts need not be)
    chi2: float
    dof: int
    p_value: float
    tv: float  # total variation between the binned empirical and expected distributions

    def __post_init__(self) -> None:
        """The test's numbers in their ranges (n, chi2 >= 0, dof >= 0, p-value and TV in [0, 1]; chi2 may be inf,
        for a draw p forbids; dof 0 for a single bin): a record built by hand is checked (a TypeError / ValueError
        naming the field)."""
        self.n = check_float("ChiSquare.n", self.n, 0.0)
        inf = isinstance(self.chi2, float) and float.__float__(self.chi2) == float("inf")  # a tensor's == is no bool
        self.chi2 = float("inf") if inf else check_float("ChiSquare.chi2", self.chi2, 0.0)
        self.dof = check_int("ChiSquare.dof", self.dof, 0)
        self.p_value = check_float("ChiSquare.p_value", self.p_value, 0.0, 1.0)
        self.tv = check_float("ChiSquare.tv", self.tv, 0.0, 1.0)


def chi_square_test(counts: torch.Tensor, p: torch.Tensor, bins: int = 10) -> ChiSquare:
    """Counts (V,) of drawn tokens against the distribution p (V,), binned on p's `bins` likeliest tokens + the rest.

    counts may be integer or float; they are summed in float64 (float16 counts past 65504 would sum to inf), and
    need not be whole: expected counts (q * draws) are tested exactly as they are. Any draw of a token p gives
    probability 0 is impossible under p: chi2 is then infinite and the p-value 0."""
    for name, t in (("counts", counts), ("p", p)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1:
            raise TypeError(f"{name} must be a 1-D tensor (V,), got {getattr(t, 'shape', type(t).__name__)}")
        check_has_data(name, t)  # every check below reads values
    if counts.dtype == torch.bool or counts.is_complex():
        raise TypeError(f"counts must be an integer or float tensor of draws per token, got {counts.dtype}")
    counts = counts.double()
    if counts.shape != p.shape:
        raise ValueError(f"counts {tuple(counts.shape)} and p {tuple(p.shape)} must both be (V,)")
    bins = check_int("bins", bins)
    if bins >= p.numel():
        raise ValueError(f"bins={bins} must be below V={p.numel()} (the last bin holds the rest)")
    check_distributions("p", p)
    if not bool(torch.isfinite(counts).all()) or bool((counts < 0).any()) or float(counts.sum()) <= 0:
        raise ValueError("counts must be finite, >= 0 and not all zero")
    top = torch.topk(p, bins).indices
    # subtle: int(counts.sum()) truncated non-whole counts (2.4 -> 2): the rest bin came out wrong, and a sum below 1
    # gave n = 0 and a dof error
    n = float(counts.sum())
    rest = torch.ones_like(p, dtype=torch.bool)
    rest[top] = False
    p64 = p.double() / p.double().sum()  # the rest bin's mass summed, not 1 - top (which rounds to 0 or below)
    observed = torch.cat([counts[top], counts[rest].sum().reshape(1)])  # (bins+1,)
    expected = torch.cat([p64[top], p64[rest].sum().reshape(1)]) * n  # (bins+1,)
    keep = expected > 0
    dof = int(keep.sum()) - 1
    tv = 0.5 * float((observed / n - expected / n).abs().sum())
    # subtle: a bin p gives probability 0 adds nothing to chi2 and no degree of freedom, but a draw in it is
    # impossible under p, not a term to drop: chi2 is infinite and the p-value 0
    if bool((observed[~keep] > 0).any()):
        return ChiSquare(n, math.inf, dof, 0.0, tv)
    chi2 = float(((observed - expected)[keep] ** 2 / expected[keep]).sum())
    return ChiSquare(n, chi2, dof, chi_square_p_value(chi2, dof) if dof else 1.0, tv)  # dof 0: p is one token


def sampling_exactness(target: GPT, draft: GPT, prompt: list[int], draws: int = 20_000, seed: int = 0
                       ) -> dict[str, Any]:
    """At one prefix: draw x ~ q, run the acceptance rule (γ = 1) `draws` times (at most MAX_REPEATS); the first
    emitted token against p."""
    _check_pair(target, draft, "sampling_exactness")
    _check_prompt("prompt", prompt, target.config.vocab_size)
    draws = check_repeats("draws", draws)  # a Python loop of draws (~0.3 ms each on the tiny model): bounded
    seed = check_seed(seed)
    sp = SamplingParams(temperature=1.0)
    with torch.inference_mode():
        ids = torch.tensor([prompt], device=target.device)
        p = probs_from_logits(target(ids)[0, -1:], sp)[0].cpu()  # (V,)
        q = probs_from_logits(draft(ids)[0, -1:], sp)[0].cpu()  # (V,)
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.shape, dtype=torch.int64)  # (V,) exact at any number of draws
    P, Q = torch.stack([p, p]), q[None]  # (γ+1, V), (γ, V) with γ = 1
    accepted = 0
    for _ in range(draws):
        x = int(torch.multinomial(q, 1, generator=gen))
        out = accept_or_resample(P, Q, [x], generator=gen)
        counts[out[0]] += 1
        accepted += len(out) == 2
    test = chi_square_test(counts, p)
    draft_test = chi_square_test(q * draws, p)  # the draft's own q, as if sampled perfectly: far from p
    return {"draws": draws, "chi2": test.chi2, "dof": test.dof, "p_value": test.p_value, "tv": test.tv,
            "tv_draft": draft_test.tv, "acceptance": accepted / draws,
            "expected_acceptance": float(torch.minimum(p, q).sum()), "tv_p_q": 0.5 * float((p - q).abs().sum())}


def hf_assisted(target: GPT, draft: GPT, prompt: list[int], new_tokens: int, gamma: int = 4,
                repeats: int = 3) -> dict[str, Any]:
    """Ours (`generate_speculative`, γ) against `transformers` assisted generation on the same weights, greedy.

    HF runs twice: with its default assistant settings (a schedule that adapts the draft length, and a confidence
    threshold that stops drafting early) and with a constant γ like ours. The ratio is against the faster of them.
    """
    _check_pair(target, draft, "hf_assisted")
    _check_prompt("prompt", prompt, target.config.vocab_size)
    new_tokens = check_int("new_tokens", new_tokens)
    check_fit_windows([("prompt", len(prompt))], new_tokens,  # HF's generate would fail past the window
                      [("the target", target.config.block_size), ("the draft", draft.config.block_size)])
    gamma = check_gamma(gamma)
    repeats = check_repeats("repeats", repeats)
    hf_t = to_hf_model(target, attn_implementation="sdpa")
    hf_d = to_hf_model(draft, attn_implementation="sdpa")
    params = SamplingParams.greedy(new_tokens, ignore_eos=True)
    idx = torch.tensor([prompt], device=target.device)
    mask = torch.ones_like(idx)
    out: dict[str, list[int]] = {}

    def run_hf(key: str, **assistant: Any) -> None:
        for k, v in assistant.items():
            setattr(hf_d.generation_config, k, v)
        with torch.inference_mode():
            seq = hf_t.generate(idx, attention_mask=mask, assistant_model=hf_d, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
        out[key] = seq[0, len(prompt):].tolist()

    default = {k: getattr(hf_d.generation_config, k, None)
               for k in ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")}
    constant = dict(num_assistant_tokens=gamma, num_assistant_tokens_schedule="constant",
                    assistant_confidence_threshold=0.0)

    def ours() -> None:
        out["ours"] = generate_speculative(target, draft, prompt, params, gamma=gamma)[0]

    cmp_default = compare(lambda: run_hf("hf_default", **default), ours, warmup=1, repeats=repeats,
                          device=target.device)
    cmp_constant = compare(lambda: run_hf("hf_constant", **constant), ours, warmup=1, repeats=repeats,
                           device=target.device)
    alone = generate_ids(target, prompt, params)
    hf_best_s = min(cmp_default.baseline.median, cmp_constant.baseline.median)
    ours_s = statistics.median(cmp_default.candidate.times + cmp_constant.candidate.times)
    return {"gamma": gamma, "new_tokens": new_tokens, "transformers": metadata.version("transformers"),
            "hf_default_settings": default,
            "hf_default_tok_s": new_tokens / cmp_default.baseline.median,
            "hf_constant_tok_s": new_tokens / cmp_constant.baseline.median, "ours_tok_s": new_tokens / ours_s,
            "ratio": hf_best_s / ours_s,
            "identical": same_tokens([alone], [out["ours"]], [out["hf_default"]], [out["hf_constant"]]).ok}


def check_tokenizer(tokenizer: Any) -> None:
    """A TypeError naming `tokenizer` unless it has an encode(text) method (the shipped tokenizer's), before any text
    of the corpus is read."""
    # a str passes the duck test (str.encode) and would then be asked for the codec named by the corpus text
    if isinstance(tokenizer, (str, bytes)) or not callable(getattr(tokenizer, "encode", None)):
        raise TypeError(f"tokenizer must have an encode(text) method (the shipped tokenizer's), got "
                        f"{type(tokenizer).__name__}")


def encode(tokenizer: Any, text: str) -> list[int]:
    """`tokenizer.encode(text)` as a list of ints; a TypeError naming `tokenizer` when it hands back anything else
    (a str, say), which would otherwise be cut into prompts of characters; one naming `text` unless it is a str."""
    check_tokenizer(tokenizer)
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    ids = tokenizer.encode(text)
    if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise TypeError(f"tokenizer.encode must return a list of int token ids, got {type(ids).__name__} "
                        f"{ids!r:.60}")
    return list(ids)


def code_prompt(tokenizer: Any, tokens: int = 200) -> list[int]:
    """The last `tokens` tokens of some validation-split Python source (1500 bytes of it): in-domain text that
    repeats itself. More tokens than those bytes hold is a ValueError naming `tokens`, not a shorter prompt."""
    tokens = check_int("tokens", tokens)
    check_tokenizer(tokenizer)
    ids = encode(tokenizer, corpus_sample(1500, split="val"))
    if tokens > len(ids):
        raise ValueError(f"tokens={tokens} is more than the {len(ids)} tokens of the 1500-byte sample")
    return ids[-tokens:]


def code_prompts(tokenizer: Any, count: int, tokens: int = 48) -> list[list[int]]:
    """`count` prompts of `tokens` tokens cut at evenly spaced places of the validation split: held-out Python
    source, the kind of text both models were trained on, with none of it seen in training. More tokens than the
    sample holds is a ValueError naming `tokens`, not shorter prompts."""
    count = check_int("count", count)
    tokens = check_int("tokens", tokens)
    check_tokenizer(tokenizer)
    ids = encode(tokenizer, corpus_sample(4000 * count, split="val"))
    if tokens + count - 1 > len(ids):  # else the last prompts would come back shorter than `tokens`
        raise ValueError(f"tokens={tokens} is too long: count={count} prompts of it need {tokens + count - 1} "
                         f"tokens, the {4000 * count}-byte sample holds {len(ids)}")
    step = max((len(ids) - tokens) // max(count, 1), 1)
    return [ids[i * step:i * step + tokens] for i in range(count)]


def run_all(device: torch.device, quick: bool = False, seed: int = 0, prompts: int | None = None) -> dict[str, Any]:
    """Every measurement above on `base` (target) and `draft`, one thread per the chapter's convention; the greedy
    sweep again with `draft-distilled` (chapter 11) when that checkpoint is shipped. `prompts` overrides how many
    prompts the sweeps run over (default 6, quick 3; the tour takes 4 to stay inside its time budget)."""
    if not isinstance(quick, bool):  # 'zzz' is truthy: the quick sizes would be picked without a word
        raise TypeError(f"quick must be a bool, got {type(quick).__name__}")
    if prompts is not None:
        prompts = check_int("prompts", prompts, 2)  # before the models load: the fib prompt and at least one more
        if prompts > 64:  # each sweep runs every prompt at every γ: past this a count is a typo
            raise ValueError(f"prompts must be at most 64, got {prompts}")
    seed = check_seed(seed)  # likewise: sampling_exactness, after the greedy sweeps, would refuse it
    tgt, dft = load_model("base", device, seed), load_model("draft", device, seed)
    tok = tgt.tokenizer
    prompt = tok.encode(FIB_PROMPT)
    new, gammas, reps, count = (32, [1, 4], 1, 3) if quick else (64, [1, 2, 4, 6], 3, 6)
    if prompts is not None:
        count = prompts
    prompts = [prompt, *code_prompts(tok, count - 1)]
    report: dict[str, Any] = {"target": tgt.label, "draft": dft.label, "device": str(device),
                              "threads": torch.get_num_threads()}
    report["greedy"] = greedy_sweep(tgt.model, dft.model, prompts, new, gammas, repeats=reps)
    if is_shipped("draft-distilled"):
        distilled = load_model("draft-distilled", device, seed)
        report["distilled_draft"] = distilled.label
        report["distilled"] = greedy_sweep(tgt.model, distilled.model, prompts, new, gammas, repeats=reps)
    report["prompt_lookup"] = prompt_lookup(tgt.model, code_prompt(tok), 48 if quick else 64, repeats=reps)
    report["sampling"] = sampling_exactness(tgt.model, dft.model, prompt, draws=5_000 if quick else 20_000,
                                            seed=seed)
    report["hf_assisted"] = hf_assisted(tgt.model, dft.model, prompt, 48 if quick else 128,
                                        gamma=report["greedy"]["best_gamma"], repeats=reps)
    return report


SWEEP_HEADER = ["γ", "identical", "accepted / proposed", "tokens per target call", "model E", "target alone tok/s",
                "speculative tok/s", "speed-up", "cost model, verify = 1 step", "cost model, measured verify"]


def _num(x: float | None, spec: str, suffix: str = "") -> str:
    """x formatted by `spec`, or "-" where the report has no value (the cost model needs γ = 1 among the rows)."""
    return "-" if x is None or x != x else f"{x:{spec}}{suffix}"


def _sweep_cells(row: dict[str, Any]) -> list[str]:
    """One γ of `greedy_sweep`, cell by cell under SWEEP_HEADER: the console report and the chapter's table."""
    return [str(row["gamma"]), str(row["identical"]), f"{row['accepted_per_proposed']:.3f}",
            f"{row['tokens_per_target_call']:.2f}", _num(row.get("model_tokens_per_call"), ".2f"),
            f"{row['alone_tok_s']:.0f}", f"{row['spec_tok_s']:.0f}", f"{row['speedup']:.2f}x",
            _num(row.get("predicted_speedup"), ".2f", "x"),
            _num(row.get("predicted_speedup_measured_verify"), ".2f", "x")]


def _by_t(d: dict[Any, float]) -> dict[int, float]:
    """A per-T dict of the report with int keys (a report read back from JSON has them as strings)."""
    return {int(t): v for t, v in d.items()}


def _format_sweep(name: str, g: dict[str, Any]) -> list[str]:
    a = g["agreement"]
    lines = [f"{name}: {g['prompts']} prompts x {g['new_tokens']} tokens; c = {g['costs']['c']:.3f}"
             + (f", alpha (gamma 1) = {g['alpha']:.3f}" if g["alpha"] is not None else "")
             + f"; argmax agreement {a['argmax_agreement']:.3f}, mean 1 - TV {a['one_minus_tv']:.3f}",
             " | ".join(SWEEP_HEADER)]
    lines += [" | ".join(c.rjust(len(h)) for c, h in zip(_sweep_cells(row), SWEEP_HEADER)) for row in g["rows"]]
    vc = ", ".join(f"T={t}: {v:.2f}x" for t, v in _by_t(g["costs"]["verify_cost"]).items())
    lines.append(f"target forward cost by new tokens (relative to one): {vc}")
    mm = g["costs"]["matmuls"]
    gflops = _by_t(mm["gflop_per_s"])
    rel = ", ".join(f"T={t}: {v:.2f}x ({gflops[t]:.0f} GFLOP/s)" for t, v in _by_t(mm["relative"]).items())
    lines.append(f"its weight matrices alone ({mm['weight_bytes'] / 1e6:.1f} MB, one row "
                 f"{_by_t(mm['seconds'])[1] * 1e3:.2f} ms = {mm['gb_per_s_one_row']:.1f} GB/s): {rel}")
    return lines


def _prompt_lookup_line(pl: dict[str, Any]) -> str:
    return (f"identical tokens: {pl['identical']}; {pl['accepted']} of {pl['proposed']} drafts kept over "
            f"{pl['target_calls']} target calls, {pl['tokens_per_target_call']:.2f} tokens per call; "
            f"speed-up {pl['speedup']:.2f}x")


def _sampling_line(s: dict[str, Any]) -> str:
    return (f"chi-square {s['chi2']:.1f} on {s['dof']} degrees of freedom, p = {s['p_value']:.3f}; TV "
            f"{s['tv']:.4f} from p, against {s['tv_draft']:.3f} for the draft's q; acceptance {s['acceptance']:.3f} "
            f"against Σ min(p, q) = {s['expected_acceptance']:.3f}")


def _hf_line(h: dict[str, Any]) -> str:
    return (f"identical tokens (ours = HF default = HF constant γ = target alone): {h['identical']}; HF with its "
            f"default settings {h['hf_default_tok_s']:.0f} tok/s, HF with a constant γ = {h['gamma']} "
            f"{h['hf_constant_tok_s']:.0f} tok/s, ours {h['ours_tok_s']:.0f} tok/s: {h['ratio']:.2f}x HF's best")


@reads_report
def format_report(r: dict[str, Any]) -> str:
    lines = [f"target {r['target']}, {r['device']}, {r['threads']} thread(s)",
             *_format_sweep(f"draft {r['draft']}", r["greedy"])]
    if "distilled" in r:
        lines += _format_sweep(f"draft {r['distilled_draft']}", r["distilled"])
    pl, s, h = r["prompt_lookup"], r["sampling"], r["hf_assisted"]
    lines.append(f"prompt lookup (gamma {pl['gamma']}, {pl['ngram']}-grams, {pl['produced']} tokens): "
                 + _prompt_lookup_line(pl))
    lines.append(f"sampling exactness ({s['draws']} draws): " + _sampling_line(s))
    lines.append(f"HF assisted generation (gamma {h['gamma']}, transformers {h.get('transformers', '?')}): "
                 + _hf_line(h))
    return "\n".join(lines)


def chi_square_quantile(dof: int, tail: float) -> float:
    """The x with P(X >= x) = tail for X ~ chi-square(dof), by bisection on `chi_square_p_value`."""
    dof = check_int("dof", dof)
    tail = check_float("tail", tail, 0.0, 1.0, include_minimum=False)
    lo, hi = 0.0, 1.0
    while chi_square_p_value(hi, dof) > tail:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi_square_p_value(mid, dof) > tail else (lo, mid)
    return (lo + hi) / 2


def _sweep_quotes(key: str, g: dict[str, Any]) -> dict[str, str]:
    """The values of one draft's sweep the chapter quotes, each name prefixed with `key` ("draft", "distilled")."""
    rows = g["rows"]
    by_gamma = {r["gamma"]: r for r in rows}
    speedups = [r["speedup"] for r in rows]
    costs = g["costs"]
    target_ms = _by_t(costs["target_s"])
    verify = _by_t(costs["verify_cost"])
    a = g["agreement"]
    q = {f"{key}_c": f"{costs['c']:.3f}", f"{key}_draft_ms": f"{costs['draft_s'] * 1e3:.2f}",
         f"{key}_target_ms": ", ".join(f"{s * 1e3:.2f}" for s in target_ms.values()),
         f"{key}_speedups": f"{min(speedups):.2f}x–{max(speedups):.2f}x",
         f"{key}_best_gamma": str(g["best_gamma"]), f"{key}_best_speedup": f"{g['best_speedup']:.2f}x",
         f"{key}_alone_tok_s": f"{rows[0]['alone_tok_s']:.0f}",
         f"{key}_agreement": f"{100 * a['argmax_agreement']:.1f}%", f"{key}_one_minus_tv": f"{a['one_minus_tv']:.3f}",
         f"{key}_prompts": str(g["prompts"]), f"{key}_new_tokens": str(g["new_tokens"])}
    for t, v in verify.items():
        q[f"{key}_verify_{t}"] = f"{v:.2f}"
        q[f"{key}_target_ms_{t}"] = f"{target_ms[t] * 1e3:.2f}"
    if g["alpha"] is not None:
        predicted = [r["predicted_speedup"] for r in rows]
        measured_verify = [r["predicted_speedup_measured_verify"] for r in rows]
        q |= {f"{key}_alpha": f"{g['alpha']:.3f}",
              f"{key}_predicted": f"{min(predicted):.2f}x–{max(predicted):.2f}x",
              f"{key}_predicted_verify": f"{min(measured_verify):.2f}x–{max(measured_verify):.2f}x"}
        for r in rows:  # the model's E against the measured tokens per call, and its prediction against the speed-up
            gm = r["gamma"]
            q[f"{key}_e_error_{gm}"] = f"{100 * abs(r['model_tokens_per_call'] / r['tokens_per_target_call'] - 1):.0f}%"
            q[f"{key}_model_gap_{gm}"] = f"{100 * (r['predicted_speedup_measured_verify'] / r['speedup'] - 1):+.0f}%"
            q[f"{key}_E_{gm}"] = f"{r['model_tokens_per_call']:.2f}"
            q[f"{key}_predicted_verify_{gm}"] = f"{r['predicted_speedup_measured_verify']:.2f}x"
    for gm, r in by_gamma.items():
        q[f"{key}_tokens_per_call_{gm}"] = f"{r['tokens_per_target_call']:.2f}"
        q[f"{key}_speedup_{gm}"] = f"{r['speedup']:.2f}x"
    return q


@reads_report
def quotes(report: dict[str, Any]) -> dict[str, str]:
    """The tables and numbers chapter 08's text quotes from a report of `run_all` (`minillm.course.results`).

    Tables: "sweep" (every γ of each draft), "checks" (prompt lookup, the chi-square test, Hugging Face). Values:
    per draft ("draft_...", and "distilled_..." when the distilled draft ran) c, the forward times, the verify
    costs, α, speed-up ranges and the cost model's; the weight-matrix profile ("matmul_..."); the machine ("cpu").
    """
    sweeps = [("draft", report["draft"], report["greedy"])]
    if "distilled" in report:
        sweeps.append(("distilled", report["distilled_draft"], report["distilled"]))
    rows = [[f"`{label}`", *_sweep_cells(r)] for _, label, g in sweeps for r in g["rows"]]
    q = {"sweep": markdown_table(["draft", *SWEEP_HEADER], rows, "lrcrrrrrrrr")}
    for key, _, g in sweeps:
        q |= _sweep_quotes(key, g)
    modelled = [r for _, _, g in sweeps for r in g["rows"] if "predicted_speedup_measured_verify" in r]
    if modelled:  # how far the model is off: its E up to γ = 4, its speed-up (measured verify cost) at every γ
        e_off = [abs(r["model_tokens_per_call"] / r["tokens_per_target_call"] - 1) for r in modelled if r["gamma"] <= 4]
        s_off = [abs(r["predicted_speedup_measured_verify"] / r["speedup"] - 1) for r in modelled]
        q |= {"e_error_max_gamma_4": f"{100 * max(e_off, default=0.0):.0f}%",
              "model_gap_max": f"{100 * max(s_off):.0f}%"}
    if "distilled" in report:
        q["alpha_gain"] = f"{100 * (report['distilled']['alpha'] - report['greedy']['alpha']):.1f}"
    mm = report["greedy"]["costs"]["matmuls"]
    rel = _by_t(mm["relative"])
    q |= {"matmul_mb": f"{mm['weight_bytes'] / 1e6:.1f}", "matmul_one_row_ms": f"{_by_t(mm['seconds'])[1] * 1e3:.2f}",
          "matmul_gb_s": f"{mm['gb_per_s_one_row']:.1f}",
          "matmul_relative": ", ".join(f"{v:.2f}x" for t, v in rel.items() if t != 1),
          "matmul_gflop_s": ", ".join(f"{v:.0f}" for v in _by_t(mm["gflop_per_s"]).values())}
    q |= {f"matmul_rel_{t}": f"{v:.2f}x" for t, v in rel.items()}
    pl, s, h = report["prompt_lookup"], report["sampling"], report["hf_assisted"]
    cut = f": {pl['produced']} produced, where the context window ends" if pl["produced"] < pl["new_tokens"] else ""
    checks = [
        [f"prompt lookup on code (the last {pl['prompt_len']} tokens of a validation file, γ = {pl['gamma']}, "
         f"{pl['ngram']}-grams, {pl['new_tokens']} new tokens asked for{cut})", _prompt_lookup_line(pl)],
        [f"speculative sampling, {s['draws']:,} draws of `accept_or_resample` at one prompt (temperature 1; the "
         f"0.1% tail of chi-square on {s['dof']} degrees of freedom is {chi_square_quantile(s['dof'], 0.001):.1f})",
         _sampling_line(s)],
        [f"ours against Hugging Face assisted generation (`generate(assistant_model=)`, transformers "
         f"{h['transformers']}, same two models, γ = {h['gamma']}, the plain draft's best, {h['new_tokens']} tokens "
         f"of the Fibonacci prompt)", _hf_line(h)],
    ]
    q["checks"] = markdown_table(["what", "result"], checks, "ll")
    q |= {"prompt_lookup_speedup": f"{pl['speedup']:.2f}x", "prompt_lookup_produced": str(pl["produced"]),
          "sampling_p": f"{s['p_value']:.3f}", "hf_ratio": f"{h['ratio']:.2f}x", "hf_gamma": str(h["gamma"]),
          "transformers": str(h["transformers"]),
          "cpu": str(report["cpu"]), "threads": str(report["threads"])}
    return q


def build_parser() -> argparse.ArgumentParser:
    return bench_parser("python -m minillm.speculative.bench", __doc__.split("\n")[0],
                        "shorter generations, fewer γ and repeats")


def main(argv: list[str] | None = None) -> int:
    args = start(build_parser(), argv)
    report = run_all(resolve_device(args.device), quick=args.quick, seed=args.seed)
    print(format_report(report))
    write_report(args.json, report)
    ok = all(report[k]["identical"] for k in ("greedy", "distilled", "prompt_lookup", "hf_assisted") if k in report)
    return 0 if ok and report["sampling"]["p_value"] > 0.001 else 1


if __name__ == "__main__":
    sys.exit(main())

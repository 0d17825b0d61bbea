"""Chapter 11's benchmark: what distillation buys a draft, in quality and in chapter 08's speculative decoding.

What it measures, on the shipped models (`base` the teacher and target; `draft` the plain draft; `draft-hardlabel`
and `draft-distilled` the two students of `python -m minillm.distill.train`, same start, steps and batches):
  - `val_perplexity`: exp(mean NLL) on the default corpus' validation split (`minillm.gpt.eval.perplexity`);
  - `greedy_agreement` (the measurement kit's, `minillm.bench.agreement`): along the teacher's own greedy
    continuations of validation prompts, how often the student's argmax equals the teacher's next token (what a
    greedy verify step checks, at every position);
  - `teacher_forced_kl` (the kit's): along the same continuations, KL(p_base || p_student) per position, in nats
    (mean, 99th percentile, max): the forward KL the distilled student was trained to lower, measured on held-out
    text; and `output_consistency`: each student's own free-running greedy continuations of the same prompts against
    `base`'s (identical ones, mean common prefix);
  - `acceptance`: α = accepted / proposed of `generate_speculative` (greedy) with each draft over the same
    prompts, for a few γ (only at γ = 1 is accepted / proposed the per-token α of the cost model);
  - `speedups`: the end-to-end speed-up of speculative decoding with each draft against the target alone
    (`minillm.core.timing.compare`, alternating, median of repeats, one torch thread), identical tokens checked;
  - `step_cost`: c of chapter 08's cost model, the draft's time per greedy token over the target's, each decoding
    alone, timed side by side; with α at γ = 1 it gives the speed-up that cost model predicts.
The command: `python -m minillm.distill.bench [--quick | --size S] [--device D] [--json FILE]`; `quotes(report)`
turns a report into the tables and numbers the chapter text includes (`minillm.course.results`).
What it leaves out: sampling at temperature > 0 (α then depends on the whole distributions, not the argmax), and
other prompts than validation text.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch

from minillm.bench.agreement import greedy_agreement, output_consistency, teacher_forced_kl
from minillm.bench.cli import bench_parser, check_sizes, pick_size, start, write_report
from minillm.bench.models import load_model
from minillm.bench.tables import markdown_table
from minillm.core.config import check_fits_window, check_float, check_int, check_label, reads_report, short_repr
from minillm.core.device import resolve_device
from minillm.core.model import GPT, require_model
from minillm.core.sampling import SamplingParams
from minillm.core.stopping import check_token_ids
from minillm.core.timing import check_repeats, compare
from minillm.gpt.dataset import default_eval_tokens
from minillm.gpt.eval import perplexity
from minillm.kvcache.generate import generate_ids
from minillm.speculative.generate import MAX_GAMMA, generate_speculative

DRAFTS = ("draft", "draft-hardlabel", "draft-distilled")
TARGET = "base"


def val_prompts(num_prompts: int, prompt_len: int) -> list[list[int]]:
    """`num_prompts` stretches of `prompt_len` validation ids, spread evenly over the split (different files)."""
    num_prompts = check_int("num_prompts", num_prompts)
    prompt_len = check_int("prompt_len", prompt_len)
    ids = default_eval_tokens(split="val")
    if num_prompts * prompt_len > ids.numel():
        raise ValueError(f"num_prompts={num_prompts} x prompt_len={prompt_len} is more than the validation split's "
                         f"{ids.numel()} tokens")
    step = (ids.numel() - prompt_len) // num_prompts
    return [ids[i * step:i * step + prompt_len].tolist() for i in range(num_prompts)]


def check_prompts(model: GPT, prompts: object, who: str, new_tokens: int | None = None, role: str = "the model"
                  ) -> None:
    """`prompts` a non-empty list (or tuple) of prompts, each a non-empty list of token ids in `model`'s vocabulary
    and, with `new_tokens`, short enough that new_tokens greedy tokens follow it inside `model`'s window (`role`,
    e.g. "the target"; generation would stop early, and the counts and timings below count new_tokens a prompt); a
    TypeError / ValueError naming `prompts` or `prompts[i]` (a str would otherwise be read one character a prompt,
    and a bad prompt be named `prompt_ids` by the generator below). `who` names the function for a bad model."""
    who, role = check_label("who", who), check_label("role", role)
    config = require_model(model, who)
    vocab = config.vocab_size
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of prompts (lists of token ids), got {type(prompts).__name__} "
                        f"{short_repr(prompts)}")
    if not prompts:
        raise ValueError(f"prompts must be a non-empty list of prompts, got {prompts!r}")
    if new_tokens is not None:
        new_tokens = check_int("new_tokens", new_tokens)
    for i, p in enumerate(prompts):
        if not check_token_ids(f"prompts[{i}]", p, vocab):
            raise ValueError(f"prompts[{i}] is empty: generation needs at least one token to condition on")
        if new_tokens is not None:
            check_fits_window(f"prompts[{i}]", len(p), new_tokens, config.block_size, role)


def teacher_continuations(teacher: GPT, prompts: Sequence[list[int]], new_tokens: int) -> list[list[int]]:
    """The teacher's greedy continuation of each prompt (chapter 04's cached loop, end-of-text ignored)."""
    new_tokens = check_int("new_tokens", new_tokens)
    check_prompts(teacher, prompts, "teacher_continuations (teacher)", new_tokens, "the teacher")
    params = SamplingParams.greedy(new_tokens, ignore_eos=True)
    return [generate_ids(teacher, p, params) for p in prompts]


def acceptance(target: GPT, draft: GPT, prompts: Sequence[list[int]], new_tokens: int, gamma: int,
               reference: Sequence[list[int]] | None = None) -> dict[str, Any]:
    """accepted / proposed of greedy speculative decoding summed over the prompts; tokens checked identical to
    `reference` (the target's own greedy outputs, `teacher_continuations`; computed here when not given).
    new_tokens >= 1 and gamma >= 1: with no token generated there is no α (and no target call) to divide by."""
    new_tokens = check_int("new_tokens", new_tokens)
    gamma = check_int("gamma", gamma)
    params = SamplingParams.greedy(new_tokens, ignore_eos=True)
    check_prompts(target, prompts, "acceptance (target)", new_tokens, "the target")
    require_model(draft, "acceptance (draft)")
    if reference is None:
        reference = teacher_continuations(target, prompts, new_tokens)
    if not isinstance(reference, (list, tuple)) or len(reference) != len(prompts):
        raise ValueError(f"reference must hold one continuation per prompt ({len(prompts)}), got "
                         f"{len(reference) if isinstance(reference, (list, tuple)) else type(reference).__name__}")
    # as lists: a tuple of ids never equals the list a generator returns (identical would be False for equal tokens)
    vocab = target.config.vocab_size
    reference = [check_token_ids(f"reference[{i}]", r, vocab) for i, r in enumerate(reference)]
    accepted = proposed = calls = emitted = 0
    identical = True
    for p, want in zip(prompts, reference, strict=True):
        out, stats = generate_speculative(target, draft, p, params, gamma=gamma)
        identical &= out == want
        accepted, proposed = accepted + stats.accepted, proposed + stats.proposed
        calls, emitted = calls + stats.target_calls, emitted + stats.num_tokens
    return {"gamma": gamma, "alpha": accepted / proposed if proposed else 0.0, "accepted": accepted,
            "proposed": proposed, "tokens_per_target_call": emitted / calls, "identical": identical}


def speedups(target: GPT, drafts: dict[str, GPT], prompts: Sequence[list[int]], new_tokens: int,
             gammas: Sequence[int], repeats: int = 3) -> dict[str, list[dict[str, float]]]:
    """For each draft and γ: speculative decoding of every prompt against the target alone, timed side by side.
    `drafts` maps a name to a draft model ({"draft": model}); every argument is checked before the first timing,
    what `generate_speculative` would refuse halfway through the sweep included: a γ past MAX_GAMMA, a draft of
    another vocabulary, on another device or with too short a window for the prompts."""
    new_tokens = check_int("new_tokens", new_tokens)
    check_prompts(target, prompts, "speedups (target)", new_tokens, "the target")
    if not isinstance(drafts, dict):
        raise TypeError(f"drafts must be a dict of name -> draft model ({{'draft': model}}), got "
                        f"{type(drafts).__name__}")
    for name, draft in drafts.items():
        dcfg = require_model(draft, f"speedups (drafts[{name!r}])")
        if dcfg.vocab_size != target.config.vocab_size or draft.device != target.device:
            raise ValueError(f"drafts[{name!r}] must share the target's vocabulary and device, got vocab_size="
                             f"{dcfg.vocab_size} on {draft.device} (the target: vocab_size="
                             f"{target.config.vocab_size} on {target.device})")
        check_prompts(draft, prompts, f"speedups (drafts[{name!r}])", new_tokens, f"drafts[{name!r}]")  # its window
    if isinstance(gammas, (str, bytes)) or not isinstance(gammas, (list, tuple)) or not gammas:
        raise ValueError(f"gammas must be a non-empty list of ints >= 1, got {gammas!r}")
    gammas = [check_int(f"gammas[{i}]", g) for i, g in enumerate(gammas)]  # the plain ints
    for i, g in enumerate(gammas):
        if g > MAX_GAMMA:  # generate_speculative's limit, met otherwise after the smaller γ's timings
            raise ValueError(f"gammas[{i}] must be at most MAX_GAMMA={MAX_GAMMA} draft tokens per round, got {g}")
    repeats = check_repeats("repeats", repeats)
    params = SamplingParams.greedy(new_tokens, ignore_eos=True)

    def alone() -> None:
        for p in prompts:
            generate_ids(target, p, params)

    out: dict[str, list[dict[str, float]]] = {}
    for name, draft in drafts.items():
        out[name] = []
        for gamma in gammas:
            def speculative() -> None:
                for p in prompts:
                    generate_speculative(target, draft, p, params, gamma=gamma)

            cmp = compare(alone, speculative, warmup=1, repeats=repeats, device=target.device)
            n = new_tokens * len(prompts)
            out[name].append({"gamma": gamma, "speedup": cmp.speedup, "alone_tok_s": n / cmp.baseline.median,
                              "spec_tok_s": n / cmp.candidate.median})
    return out


def step_cost(target: GPT, draft: GPT, prompts: Sequence[list[int]], new_tokens: int, repeats: int = 3
              ) -> dict[str, float]:
    """c of chapter 08's cost model, measured end to end: the draft's seconds per greedy token over the target's,
    each decoding every prompt alone with chapter 04's cached loop (`generate_ids`, the prompt's prefill included),
    timed side by side (`compare`). The drafts share one shape, so one draft stands for all three."""
    new_tokens = check_int("new_tokens", new_tokens)
    check_prompts(target, prompts, "step_cost (target)", new_tokens, "the target")
    check_prompts(draft, prompts, "step_cost (draft)", new_tokens, "the draft")
    repeats = check_repeats("repeats", repeats)
    params = SamplingParams.greedy(new_tokens, ignore_eos=True)

    def decode(model: GPT):
        def run() -> None:
            for p in prompts:
                generate_ids(model, p, params)
        return run

    cmp = compare(decode(target), decode(draft), warmup=1, repeats=repeats, device=target.device)
    n = new_tokens * len(prompts)
    return {"c": cmp.candidate.median / cmp.baseline.median, "target_tok_s": n / cmp.baseline.median,
            "draft_tok_s": n / cmp.candidate.median}


def cost_model_speedup(alpha: float, gamma: int, c: float) -> float:
    """Chapter 08's cost model with a verify costing one target step: S = (1 − α^(γ+1)) / ((1 − α)(γc + 1)),
    tokens per round over the round's cost in target steps (α the per-token acceptance rate, c a draft step's cost).
    Every argument is checked as chapter 08's `predicted_speedup` checks it (a TypeError / ValueError naming it)."""
    alpha = check_float("alpha", alpha, 0.0, 1.0)
    gamma = check_int("gamma", gamma, 0)
    c = check_float("c", c, 0.0)
    tokens = (1 - alpha ** (gamma + 1)) / (1 - alpha) if alpha < 1 else gamma + 1.0
    return tokens / (gamma * c + 1)


@dataclass(frozen=True)
class Sizes:
    ppl_tokens: int | None  # validation tokens for perplexity (None: the whole split)
    num_prompts: int  # validation prompts for agreement and α
    prompt_len: int
    new_tokens: int  # greedy tokens generated per prompt
    gammas: tuple[int, ...]
    timed_prompts: int  # of those prompts, how many the speed-up times
    repeats: int  # timing repeats (median)

    def __post_init__(self) -> None:
        check_sizes(self)  # every field by its type, named: a bad size fails here, not minutes into a run
        if self.timed_prompts > self.num_prompts:  # "of those prompts": the report would state a count it never ran
            raise ValueError(f"Sizes.timed_prompts={self.timed_prompts} must be at most Sizes.num_prompts="
                             f"{self.num_prompts}: the timed prompts are some of the validation prompts")


SIZES = {
    "quick": Sizes(8192, 4, 32, 32, (1, 4), 1, 1),  # the tour's --quick
    "tour": Sizes(16384, 8, 32, 32, (1, 4), 1, 3),  # the tour: well under a minute
    "full": Sizes(None, 16, 32, 64, (1, 2, 4, 6), 4, 3),  # python -m minillm.distill.bench
}


def run_all(device: torch.device, size: str = "full", seed: int = 0) -> dict[str, Any]:
    """Every measurement above on the shipped models, at one of the `SIZES`."""
    sz = pick_size(SIZES, size)
    began = time.perf_counter()
    names = (TARGET, *DRAFTS)
    loaded = {n: load_model(n, device, seed) for n in names}
    models = {n: m.model for n, m in loaded.items()}
    val = default_eval_tokens(sz.ppl_tokens)
    report: dict[str, Any] = {"labels": {n: m.label for n, m in loaded.items()},
                              "trained": {n: m.trained for n, m in loaded.items()}, "device": str(device),
                              "threads": torch.get_num_threads(), "size": size, "sizes": asdict(sz),
                              "ppl_tokens": val.numel()}
    report["perplexity"] = {n: perplexity(m, val) for n, m in models.items()}
    prompts = val_prompts(sz.num_prompts, sz.prompt_len)
    conts = teacher_continuations(models[TARGET], prompts, sz.new_tokens)
    report["agreement"] = {n: greedy_agreement(models[n], prompts, conts) for n in DRAFTS}
    sequences = [p + c for p, c in zip(prompts, conts)]
    report["kl"] = {n: teacher_forced_kl(models[TARGET], models[n], sequences, sz.prompt_len) for n in DRAFTS}
    report["consistency"] = {n: output_consistency(conts, teacher_continuations(models[n], prompts, sz.new_tokens))
                             for n in DRAFTS}
    report["acceptance"] = {n: [acceptance(models[TARGET], models[n], prompts, sz.new_tokens, g, reference=conts)
                                for g in sz.gammas] for n in DRAFTS}
    report["speedup"] = speedups(models[TARGET], {n: models[n] for n in DRAFTS}, prompts[:sz.timed_prompts],
                                 sz.new_tokens, sz.gammas, sz.repeats)
    report["step_cost"] = step_cost(models[TARGET], models["draft"], prompts[:sz.timed_prompts], sz.new_tokens,
                                    sz.repeats)
    report["identical"] = all(r["identical"] for rows in report["acceptance"].values() for r in rows)
    report["wall_seconds"] = time.perf_counter() - began
    return report


def report_section(report: object, key: str) -> Any:
    """`report[key]` of a `run_all` report, a dict (per draft); a TypeError / ValueError naming `report` when it is
    no dict, lacks the section or the section is no dict (not a KeyError from the middle of a computation)."""
    if not isinstance(report, dict):
        raise TypeError(f"report must be a run_all report (a dict), got {type(report).__name__} {short_repr(report)}")
    if not isinstance(key, str):
        raise TypeError(f"key must be a section's name (a str), got {type(key).__name__}")
    if key not in report:
        raise ValueError(f"report has no {short_repr(key)} section (not a run_all report?); its keys are "
                         f"{short_repr(list(report))}")
    if not isinstance(report[key], dict):
        raise TypeError(f"report[{short_repr(key)}] must be a dict (per draft), got {type(report[key]).__name__} "
                        f"{short_repr(report[key])}")
    return report[key]


@reads_report
def alpha_at(report: dict[str, Any], name: str, gamma: int) -> float:
    """accepted / proposed of draft `name` at γ in a `run_all` report: a number in [0, 1], else a TypeError /
    ValueError naming the report's row."""
    gamma = check_int("gamma", gamma)  # subtle: True == 1, so a bool would find the γ = 1 row
    name = check_label("name", name)  # a draft's name: a list here is no key of the report
    acceptance = report_section(report, "acceptance")
    if name not in acceptance:
        raise ValueError(f"no draft {name!r} in the report; it has {sorted(acceptance)}")
    rows, where = acceptance[name], f"report['acceptance'][{name!r}]"
    if not isinstance(rows, list):
        raise TypeError(f"{where} must be a list of rows {{'gamma', 'alpha'}}, got {type(rows).__name__} "
                        f"{short_repr(rows)}")
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or "gamma" not in r or "alpha" not in r:
            raise ValueError(f"{where}[{i}] must be a row with 'gamma' and 'alpha', got {short_repr(r)}")
    # each row's gamma as the plain int it holds: an object whose == always says True would match any γ
    found = [(i, r["alpha"]) for i, r in enumerate(rows) if check_int(f"{where}[{i}]['gamma']", r["gamma"]) == gamma]
    if not found:
        raise ValueError(f"gamma={short_repr(gamma)} was not measured; the report has gamma "
                         f"{[r['gamma'] for r in rows]}")
    return check_float(f"{where}[{found[0][0]}]['alpha']", found[0][1], 0.0, 1.0)  # a fraction: a str '0.5' is no alpha


@reads_report
def alpha_gain(report: dict[str, Any], gamma: int) -> float:
    """α of draft-distilled minus α of the plain draft at the same γ, in points (percentage points)."""
    return 100 * (alpha_at(report, "draft-distilled", gamma) - alpha_at(report, "draft", gamma))


@reads_report
def perplexity_ratio(report: dict[str, Any]) -> float:
    """Validation perplexity of draft-distilled over its hard-label control's (below 1: distillation helped)."""
    ppl = report_section(report, "perplexity")
    for name in ("draft-distilled", "draft-hardlabel"):
        if name not in ppl:
            raise ValueError(f"report['perplexity'] has no {name!r}; it has {sorted(ppl)}")
    distilled, hardlabel = (check_float(f"report['perplexity'][{name!r}]", ppl[name], 0.0, include_minimum=False)
                            for name in ("draft-distilled", "draft-hardlabel"))  # the plain numbers, divided below
    return distilled / hardlabel


SHORT = {"draft": "draft", "draft-hardlabel": "hardlabel", "draft-distilled": "distilled"}  # in `quotes`' names
ROLE = {TARGET: "teacher, target", "draft-hardlabel": "hard labels", "draft-distilled": "KD from `base`"}
# The better end of each column of `model_cells`, for the bold mark in `quotes`' tables (the drafts only).
BETTER = {"ppl": min, "agreement": max, "kl_mean": min, "kl_p99": min, "prefix": max, "alpha": max, "calls": max,
          "speedup": max}


@reads_report
def model_cells(r: dict[str, Any], name: str) -> dict[str, str]:
    """Model `name`'s numbers in a `run_all` report, formatted, by column ("ppl", "agreement", "kl_mean", "kl_p99",
    "identical", "prefix", and "alpha_g{γ}", "calls_g{γ}" (tokens per target call), "speedup_g{γ}" for each γ): the
    one formatting behind `format_report`'s rows and `quotes`' tables. The target's row is the target against itself
    (agreement 1, KL 0, every continuation identical, one token per call), with no α or speed-up."""
    sz = r["sizes"]
    cells = {"ppl": f"{r['perplexity'][name]:.2f}"}
    if name == TARGET:
        n = sz["num_prompts"]
        cells.update(agreement="1", kl_mean="0", kl_p99="0", identical=f"{n}/{n}", prefix=str(sz["new_tokens"]))
        for g in sz["gammas"]:
            cells.update({f"alpha_g{g}": "-", f"calls_g{g}": "1", f"speedup_g{g}": "-"})
        return cells
    kl, same = r["kl"][name], r["consistency"][name]
    cells.update(agreement=f"{r['agreement'][name]:.3f}", kl_mean=f"{kl['kl_mean']:.3f}", kl_p99=f"{kl['kl_p99']:.2f}",
                 identical=f"{same['identical']}/{same['prompts']}", prefix=f"{same['mean_common_prefix']:.1f}")
    for row in r["acceptance"][name]:
        cells[f"alpha_g{row['gamma']}"] = f"{row['alpha']:.3f}"
        cells[f"calls_g{row['gamma']}"] = f"{row['tokens_per_target_call']:.2f}"
    for row in r["speedup"][name]:
        cells[f"speedup_g{row['gamma']}"] = f"{row['speedup']:.2f}x"
    return cells


@reads_report
def format_report(r: dict[str, Any]) -> str:
    sz = r["sizes"]
    gammas = list(sz["gammas"])
    lines = [f"target/teacher {r['labels'][TARGET]}, {r['device']}, {r['threads']} thread(s); perplexity on "
             f"{r['ppl_tokens']:,} validation tokens; {sz['num_prompts']} validation prompts of {sz['prompt_len']} "
             f"tokens, {sz['new_tokens']} greedy tokens each; speed-ups timed on {sz['timed_prompts']} of them, "
             f"median of {sz['repeats']}",
             "model | val perplexity | agreement with base's greedy token | KL from base, mean / p99 (nats) | "
             "identical continuations (mean common prefix) | "
             + " | ".join(f"alpha g={g}" for g in gammas) + " | "
             + " | ".join(f"tokens/call g={g}" for g in gammas) + " | "
             + " | ".join(f"speed-up g={g}" for g in gammas)]
    for n in (TARGET, *DRAFTS):
        c = model_cells(r, n)
        lines.append(" | ".join([r["labels"][n], c["ppl"], c["agreement"], f"{c['kl_mean']} / {c['kl_p99']}",
                                 f"{c['identical']} ({c['prefix']})", *(c[f"alpha_g{g}"] for g in gammas),
                                 *(c[f"calls_g{g}"] for g in gammas), *(c[f"speedup_g{g}"] for g in gammas)]))
    alone = [row["alone_tok_s"] for rows in r["speedup"].values() for row in rows]
    lines.append(f"base alone: {min(alone):.0f}-{max(alone):.0f} tok/s over the timed runs")
    cost = r["step_cost"]
    lines.append(f"decoding alone: base {cost['target_tok_s']:.0f} tok/s, draft {cost['draft_tok_s']:.0f} tok/s: "
                 f"c = {cost['c']:.3f} (the cost model's draft step over a target step)")
    lines.append("alpha gain of draft-distilled over draft, points: "
                 + ", ".join(f"gamma={g}: {alpha_gain(r, g):+.1f}" for g in gammas))
    lines.append(f"perplexity ratio draft-distilled / draft-hardlabel: {perplexity_ratio(r):.3f}; "
                 f"identical tokens with every draft: {r['identical']}; {r['wall_seconds']:.0f} s in all")
    return "\n".join(lines)


@reads_report
def models_table(r: dict[str, Any], names: Sequence[str], header: Sequence[str], columns: Sequence[str]) -> str:
    """A Markdown table of `model_cells` columns, one row per model in `names` (named with its role), numbers
    right-aligned, the best draft of each column in bold (`BETTER`; not when only one draft is shown)."""
    cells = {n: model_cells(r, n) for n in names}
    drafts = [n for n in names if n != TARGET]
    for col in columns:
        better = BETTER.get(col.split("_g")[0])
        if better is None or len(drafts) < 2:
            continue
        values = {n: float(cells[n][col].rstrip("x")) for n in drafts}  # as shown: a tie in print is a tie
        if len(set(values.values())) > 1:
            best = better(values.values())
            for n in drafts:
                if values[n] == best:
                    cells[n][col] = f"**{cells[n][col]}**"
    labels = {n: f"`{r['labels'][n]}`" + (f" ({ROLE[n]})" if n in ROLE else "") for n in names}
    return markdown_table(header, [[labels[n], *(cells[n][col] for col in columns)] for n in names])


@reads_report
def quotes(report: dict[str, Any]) -> dict[str, str]:
    """The tables and numbers chapter 11's text quotes from a `run_all` report (`--json`), by name:

    tables "quality" (perplexity, agreement, KL, output consistency), "acceptance" (α and tokens per target call per
    γ), "speedup", and "console" (`format_report`'s printout, as a code block); per draft (`SHORT` names it: draft,
    hardlabel, distilled) "ppl_{s}", "agreement_{s}", "kl_{s}", "kl_p99_{s}", "identical_{s}", "prefix_{s}",
    "alpha_{s}_g{γ}", "calls_{s}_g{γ}", "speedup_{s}_g{γ}", "speedup_range_{s}"; the differences in points of α
    ("alpha_gain_g{γ}": distilled − draft, "hardlabel_gain_g{γ}": hard-label − draft, "teacher_share_g{γ}":
    distilled − hard-label) and of agreement; ratios in percent; the cost model's c and what it predicts from α at
    γ = 1 ("model_best_{s}" at γ "model_gamma_{s}", and "model_point_{s}", what one more point of α adds to it);
    the sizes and the machine."""
    r = report
    sz = r["sizes"]
    gammas = list(sz["gammas"])
    ppl, agree, kl = report_section(r, "perplexity"), report_section(r, "agreement"), report_section(r, "kl")
    gap = ppl["draft-hardlabel"] - ppl[TARGET]
    q: dict[str, str] = {
        "quality": models_table(r, (TARGET, *DRAFTS), [
            "model", "val perplexity", "agreement with `base`'s greedy token", "KL from `base`, mean (nats/token)",
            "KL, 99th percentile", f"identical {sz['new_tokens']}-token continuations", "mean common prefix"],
            ["ppl", "agreement", "kl_mean", "kl_p99", "identical", "prefix"]),
        "acceptance": models_table(r, DRAFTS, [
            "draft", *(f"{'α, ' if i == 0 else ''}γ = {g}" for i, g in enumerate(gammas)),
            *(f"{'tokens / target call, ' if i == 0 else ''}γ = {g}" for i, g in enumerate(gammas))],
            [*(f"alpha_g{g}" for g in gammas), *(f"calls_g{g}" for g in gammas)]),
        "speedup": models_table(r, DRAFTS, [
            "draft", *(f"{'speed-up vs `base`, ' if i == 0 else ''}γ = {g}" for i, g in enumerate(gammas))],
            [f"speedup_g{g}" for g in gammas]),
        "console": "```\n" + format_report(r) + "\n```\n",  # what the command printed
        "cpu": r["cpu"], "threads": str(r["threads"]), "wall_seconds": f"{r['wall_seconds']:.0f}",
        "ppl_tokens": f"{r['ppl_tokens']:,}", "num_prompts": str(sz["num_prompts"]),
        "prompt_len": str(sz["prompt_len"]), "new_tokens": str(sz["new_tokens"]),
        "scored_tokens": f"{sz['num_prompts'] * sz['new_tokens']:,}", "timed_prompts": str(sz["timed_prompts"]),
        "repeats": str(sz["repeats"]), "identical": "yes" if r["identical"] else "no",
        "ppl_base": f"{ppl[TARGET]:.2f}", "ppl_ratio": f"{perplexity_ratio(r):.3f}",
        "ppl_drop_pct": f"{100 * (1 - perplexity_ratio(r)):.1f}%",
        # the share of the hard-label student's perplexity gap to the teacher that distillation closed
        "gap_closed_pct": f"{100 * (ppl['draft-hardlabel'] - ppl['draft-distilled']) / gap:.0f}%",
        "kl_drop_pct": f"{100 * (1 - kl['draft-distilled']['kl_mean'] / kl['draft-hardlabel']['kl_mean']):.0f}%",
        "agreement_gain_hardlabel": f"{100 * (agree['draft-hardlabel'] - agree['draft']):+.1f}",
        "agreement_share": f"{100 * (agree['draft-distilled'] - agree['draft-hardlabel']):+.1f}",
    }
    for n in DRAFTS:
        s, cells = SHORT[n], model_cells(r, n)
        q.update({f"{k}_{s}": cells[col] for k, col in (("ppl", "ppl"), ("agreement", "agreement"),
                                                           ("kl", "kl_mean"), ("kl_p99", "kl_p99"),
                                                           ("identical", "identical"), ("prefix", "prefix"))})
        for g in gammas:
            q.update({f"{k}_{s}_g{g}": cells[f"{k}_g{g}"] for k in ("alpha", "calls", "speedup")})
        ups = [row["speedup"] for row in r["speedup"][n]]
        q[f"speedup_range_{s}"] = f"{min(ups):.2f}x–{max(ups):.2f}x"
    for g in gammas:
        q[f"alpha_gain_g{g}"] = f"{alpha_gain(r, g):+.1f}"
        hard, dist, plain = (alpha_at(r, n, g) for n in ("draft-hardlabel", "draft-distilled", "draft"))
        q[f"hardlabel_gain_g{g}"] = f"{100 * (hard - plain):+.1f}"
        q[f"teacher_share_g{g}"] = f"{100 * (dist - hard):+.1f}"
    # one standard error of an α cell, were its proposals independent (they are not quite: a round stops at its
    # first rejection), in points: the largest over the drafts and γ
    rows = [row for rows in r["acceptance"].values() for row in rows]
    q["alpha_se"] = f"{max(100 * math.sqrt(x['alpha'] * (1 - x['alpha']) / x['proposed']) for x in rows):.1f}"
    best = max(((row["speedup"], n, row["gamma"]) for n in DRAFTS for row in r["speedup"][n]))
    q.update(best_speedup=f"{best[0]:.2f}x", best_speedup_draft=best[1], best_speedup_gamma=str(best[2]))
    alone = [row["alone_tok_s"] for rows in r["speedup"].values() for row in rows]
    q["base_tok_s"] = f"{min(alone):.0f}–{max(alone):.0f}"
    # chapter 08's cost model with the measured c, a verify costing one step, and α at γ = 1 (the per-token rate)
    c = r["step_cost"]["c"]
    q["c"] = f"{c:.2f}"
    if 1 in gammas:
        for n in DRAFTS:
            a = alpha_at(r, n, 1)
            model = {g: cost_model_speedup(a, g, c) for g in gammas}
            g_best = max(model, key=model.get)
            q[f"model_best_{SHORT[n]}"] = f"{model[g_best]:.2f}x"
            q[f"model_gamma_{SHORT[n]}"] = str(g_best)
            # what one more point of α would add to the best predicted speed-up, in percent
            more = cost_model_speedup(min(a + 0.01, 1.0), g_best, c)
            q[f"model_point_{SHORT[n]}"] = f"{100 * (more / model[g_best] - 1):.1f}%"
    return q


def build_parser() -> argparse.ArgumentParser:
    return bench_parser("python -m minillm.distill.bench", __doc__.split("\n")[0],
                        "fewer tokens, prompts, γ and repeats", sizes=SIZES)


def main(argv: list[str] | None = None) -> int:
    args = start(build_parser(), argv)
    report = run_all(resolve_device(args.device), size=args.size, seed=args.seed)
    print(format_report(report))
    write_report(args.json, report)
    return 0 if report["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())

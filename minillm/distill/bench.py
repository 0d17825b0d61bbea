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
    (`minillm.core.timing.compare`, alternating, median of repeats, one torch thread), identical tokens checked.
The command: `python -m minillm.distill.bench [--quick | --size S] [--device D] [--json FILE]`.
What it leaves out: sampling at temperature > 0 (α then depends on the whole distributions, not the argmax), and
other prompts than validation text.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch

from minillm.bench.agreement import greedy_agreement, output_consistency, teacher_forced_kl
from minillm.bench.cli import bench_parser, pick_size, start, write_report
from minillm.bench.models import load_model
from minillm.core.config import check_fits_window, check_float, check_int
from minillm.core.device import resolve_device
from minillm.core.model import GPT, require_model
from minillm.core.sampling import SamplingParams
from minillm.core.stopping import check_token_ids
from minillm.core.timing import compare
from minillm.gpt.dataset import default_eval_tokens
from minillm.gpt.eval import perplexity
from minillm.kvcache.generate import generate_ids
from minillm.speculative.generate import generate_speculative

DRAFTS = ("draft", "draft-hardlabel", "draft-distilled")
TARGET = "base"


def val_prompts(num_prompts: int, prompt_len: int) -> list[list[int]]:
    """`num_prompts` stretches of `prompt_len` validation ids, spread evenly over the split (different files)."""
    check_int("num_prompts", num_prompts)
    check_int("prompt_len", prompt_len)
    ids = default_eval_tokens(split="val")
    if num_prompts * prompt_len > ids.numel():
        raise ValueError(f"num_prompts={num_prompts} x prompt_len={prompt_len} is more than the validation split's "
                         f"{ids.numel()} tokens")
    step = (ids.numel() - prompt_len) // num_prompts
    return [ids[i * step:i * step + prompt_len].tolist() for i in range(num_prompts)]


def check_prompts(model: GPT, prompts: object, who: str, new_tokens: int | None = None, role: str = "the model"
                  ) -> None:
    """`prompts` a non-empty list (or tuple) of prompts, each a list of token ids in `model`'s vocabulary and, with
    `new_tokens`, short enough that new_tokens greedy tokens follow it inside `model`'s window (`role`, e.g. "the
    target"; generation would stop early, and the counts and timings below count new_tokens a prompt); a TypeError /
    ValueError naming `prompts` or `prompts[i]` (a str would otherwise be read one character a prompt, and a bad
    prompt be named `prompt_ids` by the generator below). `who` names the function for a bad model."""
    config = require_model(model, who)
    vocab = config.vocab_size
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of prompts (lists of token ids), got {type(prompts).__name__} "
                        f"{prompts!r:.80}")
    if not prompts:
        raise ValueError(f"prompts must be a non-empty list of prompts, got {prompts!r}")
    for i, p in enumerate(prompts):
        check_token_ids(f"prompts[{i}]", p, vocab)
        if new_tokens is not None:
            check_fits_window(f"prompts[{i}]", len(p), new_tokens, config.block_size, role)


def teacher_continuations(teacher: GPT, prompts: Sequence[list[int]], new_tokens: int) -> list[list[int]]:
    """The teacher's greedy continuation of each prompt (chapter 04's cached loop, end-of-text ignored)."""
    check_int("new_tokens", new_tokens)
    check_prompts(teacher, prompts, "teacher_continuations (teacher)", new_tokens, "the teacher")
    params = SamplingParams.greedy(new_tokens, ignore_eos=True)
    return [generate_ids(teacher, p, params) for p in prompts]


def acceptance(target: GPT, draft: GPT, prompts: Sequence[list[int]], new_tokens: int, gamma: int,
               reference: Sequence[list[int]] | None = None) -> dict[str, Any]:
    """accepted / proposed of greedy speculative decoding summed over the prompts; tokens checked identical to
    `reference` (the target's own greedy outputs, `teacher_continuations`; computed here when not given).
    new_tokens >= 1 and gamma >= 1: with no token generated there is no α (and no target call) to divide by."""
    check_int("new_tokens", new_tokens)
    check_int("gamma", gamma)
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
    `drafts` maps a name to a draft model ({"draft": model}); every argument is checked before the first timing."""
    check_int("new_tokens", new_tokens)
    check_prompts(target, prompts, "speedups (target)", new_tokens, "the target")
    if not isinstance(drafts, dict):
        raise TypeError(f"drafts must be a dict of name -> draft model ({{'draft': model}}), got "
                        f"{type(drafts).__name__}")
    for name, draft in drafts.items():
        require_model(draft, f"speedups (drafts[{name!r}])")
    if isinstance(gammas, (str, bytes)) or not isinstance(gammas, (list, tuple)) or not gammas:
        raise ValueError(f"gammas must be a non-empty list of ints >= 1, got {gammas!r}")
    for i, g in enumerate(gammas):
        check_int(f"gammas[{i}]", g)
    check_int("repeats", repeats)
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


@dataclass(frozen=True)
class Sizes:
    ppl_tokens: int | None  # validation tokens for perplexity (None: the whole split)
    num_prompts: int  # validation prompts for agreement and α
    prompt_len: int
    new_tokens: int  # greedy tokens generated per prompt
    gammas: tuple[int, ...]
    timed_prompts: int  # of those prompts, how many the speed-up times
    repeats: int  # timing repeats (median)


SIZES = {
    "quick": Sizes(8192, 4, 32, 32, (1, 4), 1, 1),  # the tour's --quick
    "tour": Sizes(16384, 8, 32, 32, (1, 4), 1, 3),  # the tour: well under a minute
    "full": Sizes(None, 16, 32, 64, (1, 2, 4, 6), 4, 3),  # python -m minillm.distill.bench
}


def run_all(device: torch.device, size: str = "full", seed: int = 0) -> dict[str, Any]:
    """Every measurement above on the shipped models, at one of the `SIZES`."""
    sz = pick_size(SIZES, size)
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
    report["identical"] = all(r["identical"] for rows in report["acceptance"].values() for r in rows)
    return report


def report_section(report: object, key: str) -> Any:
    """`report[key]` of a `run_all` report, a dict (per draft); a TypeError / ValueError naming `report` when it is
    no dict, lacks the section or the section is no dict (not a KeyError from the middle of a computation)."""
    if not isinstance(report, dict):
        raise TypeError(f"report must be a run_all report (a dict), got {type(report).__name__} {report!r:.80}")
    if key not in report:
        raise ValueError(f"report has no {key!r} section (not a run_all report?); its keys are {sorted(report)}")
    if not isinstance(report[key], dict):
        raise TypeError(f"report[{key!r}] must be a dict (per draft), got {type(report[key]).__name__} "
                        f"{report[key]!r:.80}")
    return report[key]


def alpha_at(report: dict[str, Any], name: str, gamma: int) -> float:
    """accepted / proposed of draft `name` at γ in a `run_all` report."""
    check_int("gamma", gamma)  # subtle: True == 1, so a bool would find the γ = 1 row
    acceptance = report_section(report, "acceptance")
    if name not in acceptance:
        raise ValueError(f"no draft {name!r} in the report; it has {sorted(acceptance)}")
    rows, where = acceptance[name], f"report['acceptance'][{name!r}]"
    if not isinstance(rows, list):
        raise TypeError(f"{where} must be a list of rows {{'gamma', 'alpha'}}, got {type(rows).__name__} {rows!r:.80}")
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or "gamma" not in r or "alpha" not in r:
            raise ValueError(f"{where}[{i}] must be a row with 'gamma' and 'alpha', got {r!r:.80}")
    found = [r["alpha"] for r in rows if r["gamma"] == gamma]
    if not found:
        raise ValueError(f"gamma={gamma!r} was not measured; the report has gamma {[r['gamma'] for r in rows]}")
    return found[0]


def alpha_gain(report: dict[str, Any], gamma: int) -> float:
    """α of draft-distilled minus α of the plain draft at the same γ, in points (percentage points)."""
    return 100 * (alpha_at(report, "draft-distilled", gamma) - alpha_at(report, "draft", gamma))


def perplexity_ratio(report: dict[str, Any]) -> float:
    """Validation perplexity of draft-distilled over its hard-label control's (below 1: distillation helped)."""
    ppl = report_section(report, "perplexity")
    for name in ("draft-distilled", "draft-hardlabel"):
        if name not in ppl:
            raise ValueError(f"report['perplexity'] has no {name!r}; it has {sorted(ppl)}")
        check_float(f"report['perplexity'][{name!r}]", ppl[name], 0.0, include_minimum=False)  # divided by below
    return ppl["draft-distilled"] / ppl["draft-hardlabel"]


def format_report(r: dict[str, Any]) -> str:
    sz = r["sizes"]
    gammas = list(sz["gammas"])
    lines = [f"target/teacher {r['labels'][TARGET]}, {r['device']}, {r['threads']} thread(s); perplexity on "
             f"{r['ppl_tokens']:,} validation tokens; {sz['num_prompts']} validation prompts of {sz['prompt_len']} "
             f"tokens, {sz['new_tokens']} greedy tokens each; speed-ups timed on {sz['timed_prompts']} of them, "
             f"median of {sz['repeats']}",
             "model | val perplexity | agreement with base's greedy token | KL from base, mean / p99 (nats) | "
             "identical continuations (mean common prefix) | "
             + " | ".join(f"alpha g={g}" for g in gammas) + " | " + " | ".join(f"speed-up g={g}" for g in gammas)]
    lines.append(f"{r['labels'][TARGET]} | {r['perplexity'][TARGET]:.2f} | 1 | 0 | {sz['num_prompts']}/"
                 f"{sz['num_prompts']} ({sz['new_tokens']}) | " + " | ".join("-" for _ in gammas * 2))
    for n in DRAFTS:
        kl, same = r["kl"][n], r["consistency"][n]
        lines.append(f"{r['labels'][n]} | {r['perplexity'][n]:.2f} | {r['agreement'][n]:.3f} | "
                     f"{kl['kl_mean']:.3f} / {kl['kl_p99']:.2f} | {same['identical']}/{same['prompts']} "
                     f"({same['mean_common_prefix']:.1f}) | "
                     + " | ".join(f"{row['alpha']:.3f}" for row in r["acceptance"][n]) + " | "
                     + " | ".join(f"{row['speedup']:.2f}x" for row in r["speedup"][n]))
    alone = [row["alone_tok_s"] for rows in r["speedup"].values() for row in rows]
    lines.append(f"base alone: {min(alone):.0f}-{max(alone):.0f} tok/s over the timed runs")
    lines.append("alpha gain of draft-distilled over draft, points: "
                 + ", ".join(f"gamma={g}: {alpha_gain(r, g):+.1f}" for g in gammas))
    lines.append(f"perplexity ratio draft-distilled / draft-hardlabel: {perplexity_ratio(r):.3f}; "
                 f"identical tokens with every draft: {r['identical']}")
    return "\n".join(lines)


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

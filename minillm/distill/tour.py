"""Tour entry for chapter 11: the distilled draft against the plain draft, and against its hard-label control.

`base` is the teacher and the target; `draft-distilled` and `draft-hardlabel` continued the shipped `draft` for the
same steps on the same batches, with and without the teacher's distributions. Checks: greedy speculative decoding
with every draft gives `base`'s own tokens, and the two students were trained the same way (same start, steps,
seed and batch size, read from their training logs; only the loss differs). Measured
(`minillm.distill.bench`): the gain in α of the distilled draft over the plain one at the same γ, in points, and the
validation perplexity of the distilled student over the hard-label student's. Reported beside it, never a pass
criterion: each student's KL from `base` (nats per token, teacher-forced on `base`'s greedy continuations) and how
many of its own greedy continuations are `base`'s.
"""

from __future__ import annotations

import json

from minillm.core.rows import Row, TourContext
from minillm.distill.bench import DRAFTS, alpha_at, alpha_gain, perplexity_ratio, run_all
from minillm.gpt.pretrained import is_shipped, pretrained_dir

TITLE = "distillation"
GAMMA = 4  # the γ the acceptance row compares at (chapter 08's usual best); every γ measured is in the details
SAME_RECIPE = ("init_from", "steps", "batch_size", "seed", "lr", "warmup_steps", "min_lr_ratio", "grad_accum")


def same_recipe() -> tuple[bool, str]:
    """Were the two students trained alike (all but the loss)? Read from their training logs."""
    names = ("draft-distilled", "draft-hardlabel")
    if not all(is_shipped(n) for n in names):
        return False, "a student checkpoint is missing"
    logs = {n: json.loads((pretrained_dir(n) / "training_log.json").read_text(encoding="utf-8")) for n in names}
    cfgs = {n: logs[n]["train_config"] for n in names}
    differ = [k for k in SAME_RECIPE if cfgs[names[0]].get(k) != cfgs[names[1]].get(k)]
    kd = {n: logs[n].get("distillation", {}).get("kd_weight") for n in names}
    if differ:
        return False, f"the students' training differs in {differ}"
    if not (kd["draft-hardlabel"] == 0 and (kd["draft-distilled"] or 0) > 0):
        return False, f"unexpected kd_weight {kd}"
    return True, f"same start, {logs[names[0]]['steps']} steps and batches; kd_weight {kd['draft-distilled']} vs 0"


def run(ctx: TourContext) -> list[Row]:
    r = run_all(ctx.device, size="quick" if ctx.quick else "tour", seed=ctx.seed)
    dev = str(ctx.device)
    gammas = list(r["sizes"]["gammas"])
    gamma = GAMMA if GAMMA in gammas else gammas[-1]
    alphas = {n: alpha_at(r, n, gamma) for n in DRAFTS}
    speed = {n: next(s for s in r["speedup"][n] if s["gamma"] == gamma)["speedup"] for n in DRAFTS}
    trained = all(r["trained"].values())
    fair, why = same_recipe()
    details = {k: r[k] for k in ("perplexity", "agreement", "kl", "consistency", "acceptance", "speedup", "sizes",
                                 "labels")}
    ppl, kl, same = r["perplexity"], r["kl"], r["consistency"]
    return [
        Row("11", "distilled draft acceptance", f"{r['labels']['draft']} as the draft",
            f"{r['labels']['draft-distilled']} as the draft, gamma {gamma}",
            f"identical greedy tokens with every draft: {r['identical']}; alpha {alphas['draft']:.3f} -> "
            f"{alphas['draft-distilled']:.3f} (hard-label control {alphas['draft-hardlabel']:.3f}); speed-up vs "
            f"base {speed['draft']:.2f}x -> {speed['draft-distilled']:.2f}x", r["identical"] and trained,
            "acceptance gain",
            alpha_gain(r, gamma), "pts", dev, details),
        Row("11", "distilled student perplexity", f"{r['labels']['draft-hardlabel']} (hard labels)",
            f"{r['labels']['draft-distilled']} (KD from base)",
            f"{why}; val ppl {ppl['draft-hardlabel']:.2f} -> {ppl['draft-distilled']:.2f} (base "
            f"{ppl['base']:.2f}); KL from base {kl['draft-hardlabel']['kl_mean']:.3f} -> "
            f"{kl['draft-distilled']['kl_mean']:.3f} nats/token (p99 {kl['draft-hardlabel']['kl_p99']:.2f} -> "
            f"{kl['draft-distilled']['kl_p99']:.2f}); identical {r['sizes']['new_tokens']}-token continuations "
            f"{same['draft-hardlabel']['identical']} -> {same['draft-distilled']['identical']}/"
            f"{same['draft-distilled']['prompts']} (mean common prefix "
            f"{same['draft-hardlabel']['mean_common_prefix']:.1f} -> "
            f"{same['draft-distilled']['mean_common_prefix']:.1f})", fair and trained, "perplexity ratio",
            perplexity_ratio(r), "x", dev, details),
    ]

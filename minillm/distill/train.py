"""Distilling a student with chapter 02's trainer: the objective, and the command that made the distilled drafts.

What it adds: `DistillObjective`, the trainer's `loss_fn` (a frozen teacher's logits, and optionally its hidden
states, against the student's: `minillm.distill.losses`), `distill` (one run of `minillm.gpt.train.train` with it),
and `python -m minillm.distill.train`, which reproduces the two shipped students:

    draft-hardlabel   `draft` trained on for S more steps on the hard labels only            (--kd-weight 0)
    draft-distilled   `draft` trained on for the same S steps, same batches, with KD from `base`

Both start from the shipped `draft` weights and see exactly the same batches (one seed, one data sampler), the same
optimizer, learning-rate schedule, clipping and steps; only the loss differs. So any difference between them is
the teacher's doing, not more data or more compute for one of them.

What it leaves out: caching the teacher's logits (the teacher runs on every batch: V = 4096 floats per position
would not fit on disk for long), on-policy distillation on the student's own samples (MiniLLM's full method), and
resuming a distillation run that trains a feature projection (the trainer's checkpoints hold the model only).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn as nn

from minillm.core.checkpoint import load_checkpoint
from minillm.core.config import check_float
from minillm.core.device import DEVICE_CHOICES, resolve_device
from minillm.core.io import atomic_write_text
from minillm.core.model import GPT, require_model
from minillm.distill.losses import KINDS, FeatureProjection, check_temperature, default_layer_pairs, distillation_loss
from minillm.gpt.pretrained import SHIPPED, pretrained_dir
from minillm.gpt.train import LOG_NAME, TrainConfig, TrainResult, train


class DistillObjective(nn.Module):
    """loss_fn(student, x, y) for `train`: (1 − w)·CE + w·T²·KL against a frozen teacher, + β·feature loss.

    The teacher is registered (it moves with `.to()`) but frozen: `requires_grad_(False)` on all its parameters, so
    the trainer, which trains the objective's parameters that require grad, trains only the feature projection.
    Every call appends its terms to `records` (the KD loss curves of the chapter's notebook).
    """

    def __init__(self, teacher: GPT, temperature: float = 1.0, kd_weight: float = 0.5, kind: str = "forward",
                 feature_weight: float = 0.0, student_config=None,
                 layer_pairs: Sequence[tuple[int, int]] | None = None):
        super().__init__()
        tcfg = require_model(teacher, "DistillObjective (teacher)")
        self.temperature = check_temperature(temperature)
        check_float("kd_weight", kd_weight, 0.0, 1.0)
        check_float("feature_weight", feature_weight, 0.0)
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self.kd_weight, self.kind, self.feature_weight = float(kd_weight), kind, float(feature_weight)
        self.teacher = teacher.eval().requires_grad_(False)
        self.features: FeatureProjection | None = None
        if feature_weight > 0:
            if student_config is None:
                raise ValueError("feature_weight > 0 needs student_config (the student's width and depth)")
            pairs = layer_pairs or default_layer_pairs(student_config.n_layer, tcfg.n_layer)
            self.features = FeatureProjection(student_config.n_embd, tcfg.n_embd, pairs)
        self.records: list[dict[str, float]] = []  # one per call: total, hard, soft, feature

    def forward(self, student: GPT, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x, y (B, T) from the trainer's batch sampler -> the scalar loss to minimise."""
        scfg = require_model(student, "DistillObjective (student)")
        if scfg.vocab_size != self.teacher.config.vocab_size:
            raise ValueError(f"student vocab_size={scfg.vocab_size} differs from the teacher's "
                             f"{self.teacher.config.vocab_size}: KD compares distributions over the same tokens")
        positions = student.check_inputs(x)  # (1, T)
        s_states: list[torch.Tensor] | None = [] if self.features is not None else None
        s_logits = student.logits(student.hidden(x, positions, collect=s_states))  # (B, T, V)
        t_states: list[torch.Tensor] | None = [] if self.features is not None else None
        self.teacher.eval()  # whatever mode someone left it in: the teacher's targets never carry dropout
        # subtle: no_grad, not inference_mode: the teacher's probabilities are saved for the student's backward,
        # and autograd refuses to save inference tensors.
        with torch.no_grad():
            t_logits = self.teacher.logits(self.teacher.hidden(x, positions, collect=t_states))  # (B, T, V)
        parts = distillation_loss(s_logits, t_logits, y, self.temperature, self.kd_weight, self.kind)
        total = parts.total
        record = {"hard": parts.hard.item(), "soft": parts.soft.item()}
        if self.features is not None:
            feat = self.features(s_states, t_states)
            total = total + self.feature_weight * feat
            record["feature"] = feat.item()
        record["total"] = total.item()
        self.records.append(record)
        return total


def student_dir(name: str) -> Path:
    """A shipped checkpoint's directory ("draft"), or any checkpoint directory given as a path."""
    if name in SHIPPED:
        return pretrained_dir(name)
    path = Path(name)
    if not path.is_dir():
        raise ValueError(f"student {name!r} is neither a shipped checkpoint {list(SHIPPED)} nor a directory")
    return path


def distill(cfg: TrainConfig, teacher: GPT | None, temperature: float = 1.0, kd_weight: float = 0.5,
            kind: str = "forward", feature_weight: float = 0.0, progress: bool = True
            ) -> tuple[TrainResult, DistillObjective | None]:
    """One training run of the student `cfg.init_from` with the distillation objective (None: kd_weight = 0).

    kd_weight = 0 and feature_weight = 0 is the hard-label control: the trainer's own cross-entropy, no teacher. The
    exported training_log.json (if `cfg.export_dir`) gains a "distillation" section: the settings and, per logged
    step, the mean hard, soft and feature terms.
    """
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"distill needs a TrainConfig, got {type(cfg).__name__}")
    if cfg.init_from is None:
        raise ValueError("distill continues a student: set TrainConfig.init_from to its checkpoint directory")
    objective = None
    if kd_weight > 0 or feature_weight > 0:
        if teacher is None:
            raise ValueError(f"kd_weight={kd_weight} / feature_weight={feature_weight} need a teacher")
        student_config = load_checkpoint(cfg.init_from).config if feature_weight > 0 else None
        objective = DistillObjective(teacher, temperature, kd_weight, kind, feature_weight, student_config)
        objective.to(resolve_device(cfg.device))
    result = train(cfg, progress=progress, loss_fn=objective)
    section: dict[str, Any] = {"teacher": None if objective is None else teacher_label(teacher),
                               "temperature": temperature, "kd_weight": kd_weight, "kind": kind,
                               "feature_weight": feature_weight, "student_init": cfg.init_from,
                               "history": kd_history(objective, cfg.log_interval)}
    result.log["distillation"] = section
    if cfg.export_dir is not None:
        atomic_write_text(Path(cfg.export_dir) / LOG_NAME, json.dumps(result.log, indent=1) + "\n")
    return result, objective


def teacher_label(teacher: GPT) -> str:
    c = teacher.config
    return f"{c.n_layer} layers x {c.n_embd} ({teacher.num_params():,} parameters)"


def kd_history(objective: DistillObjective | None, every: int) -> list[dict[str, float]]:
    """The objective's per-step terms averaged over blocks of `every` steps: [{"step", "hard", "soft", ...}]."""
    if objective is None or not objective.records:
        return []
    out = []
    recs = objective.records
    for end in range(every, len(recs) + every, every):
        block = recs[end - every:end]
        if not block:
            break
        out.append({"step": min(end, len(recs)),
                    **{k: round(sum(r[k] for r in block) / len(block), 5) for k in block[0]}})
    return out


# ---- CLI ----------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m minillm.distill.train", description=__doc__.split("\n")[0])
    ap.add_argument("--student", default="draft", help="shipped checkpoint or directory to start from (default draft)")
    ap.add_argument("--teacher", default="base", help="shipped checkpoint or directory of the teacher (default base)")
    ap.add_argument("--kd-weight", type=float, default=1.0,
                    help="w in (1-w)*CE + w*T^2*KL (default 1: the teacher only); 0 = hard labels only")
    ap.add_argument("--temperature", type=float, default=1.0, help="T of the soft term (default 1)")
    ap.add_argument("--kind", default="forward", choices=KINDS, help="KL direction (default forward)")
    ap.add_argument("--feature-weight", type=float, default=0.0, help="weight of hidden-state matching (default 0)")
    ap.add_argument("--steps", type=int, default=360)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-4, help="peak learning rate (default 5e-4)")
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=20)
    ap.add_argument("--eval-interval", type=int, default=100)
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--final-eval-tokens", type=int, default=None, help="val tokens for the final perplexity")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--device", default="cpu", choices=DEVICE_CHOICES)
    ap.add_argument("--export", metavar="DIR", help="write the student + training_log.json here")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def _relative(path: Path) -> Path:
    """`path` relative to the working directory when it lies inside it (the log then names no machine's paths)."""
    try:
        return path.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return path


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    init = _relative(student_dir(args.student))
    cfg = TrainConfig(
        preset="draft", init_from=str(init), steps=args.steps, batch_size=args.batch_size, lr=args.lr,
        min_lr_ratio=args.min_lr_ratio, warmup_steps=args.warmup_steps, eval_interval=args.eval_interval,
        eval_windows=args.eval_windows, final_eval_tokens=args.final_eval_tokens, seed=args.seed,
        device=args.device, num_threads=args.threads, export_dir=args.export,
        command="python -m minillm.distill.train " + " ".join(shlex.quote(a) for a in argv))
    teacher = None
    if args.kd_weight > 0 or args.feature_weight > 0:
        teacher = load_checkpoint(student_dir(args.teacher), device=resolve_device(args.device))
    result, _ = distill(cfg, teacher, args.temperature, args.kd_weight, args.kind, args.feature_weight,
                        progress=not args.no_progress)
    log = result.log
    print(f"{result.step} steps ({result.tokens_seen:,} tokens) in {result.wall_seconds / 60:.1f} min; "
          f"val loss {log.get('final_val_loss')}, val perplexity {log.get('val_perplexity')}")
    if args.export:
        print(f"written to {args.export}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

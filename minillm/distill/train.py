"""Distilling a student with chapter 02's trainer: the objective, and the command that made the distilled drafts.

What it adds: `DistillObjective`, the trainer's `loss_fn` (a frozen teacher's logits, and optionally its hidden
states, against the student's: `minillm.distill.losses`), `distill` (one run of `minillm.gpt.train.train` with it),
and `python -m minillm.distill.train`, which reproduces the two shipped students:

    draft-hardlabel   `draft` trained on for S more steps on the hard labels only            (--kd-weight 0)
    draft-distilled   `draft` trained on for the same S steps, same batches, with KD from `base`

Both start from the shipped `draft` weights and see exactly the same batches (one seed, one data sampler), the same
optimizer, learning-rate schedule, clipping and steps; only the loss differs. So any difference between them is
the teacher's doing, not more data or more compute for one of them.

An interrupted run resumes exactly: `TrainConfig(resume=out_dir)` (or `--resume DIR`) continues from the newest
checkpoint with chapter 02's machinery (weights, AdamW, RNGs, atomically), and `minillm.distill.run_state` keeps
what only distillation has (its settings and the per-step loss terms), so N steps straight and k + resume + N − k
give identical weights and log (tested). Every argument is checked before any work: a NaN weight or a zero
temperature is a ValueError naming it, never a run that quietly trains on hard labels.

What it leaves out: caching the teacher's logits (the teacher runs on every batch: V = 4096 floats per position
would not fit on disk for long), on-policy distillation on the student's own samples (MiniLLM's full method), and
resuming a distillation run that trains a feature projection (the trainer's checkpoints hold the model only; such a
resume is refused up front).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn, Sequence

import torch
import torch.nn as nn

from minillm.bench.cli import CheckedParser
from minillm.core.checkpoint import CONFIG_NAME, load_checkpoint, read_config
from minillm.core.config import (check_bool, check_float, check_int, check_label, check_module_has_data, GPTConfig,
                                 short_repr)
from minillm.core.device import DEVICE_CHOICES, resolve_device
from minillm.core.sampling import seed_argument
from minillm.core.io import atomic_write_text, check_output_dir, check_path
from minillm.core.model import GPT, require_model
from minillm.distill.losses import (
    KINDS,
    FeatureProjection,
    check_kind,
    check_layer_pairs,
    check_targets,
    check_temperature,
    default_layer_pairs,
    distillation_loss,
)
from minillm.distill.run_state import (RECORD_KEYS, TRAINER_FIELDS, check_record, resume_run, start_run,
                                      teacher_digest)
from minillm.gpt.pretrained import SHIPPED, pretrained_dir
from minillm.gpt.train import LOG_NAME, TrainConfig, TrainResult, check_batch_fits, train
from minillm.gpt.train_state import find_checkpoint


def check_student(student: GPTConfig, teacher: GPTConfig, name: str, window: bool = False) -> None:
    """A ValueError naming `name` (the student as the caller knows it), the field and both values unless the
    student can learn from the teacher: the same vocab_size (KD compares distributions over the same tokens) and,
    with `window`, a block_size no longer than the teacher's (the teacher scores the student's training windows).
    A student or teacher that is no GPTConfig (a preset's name, a model) is a TypeError naming it."""
    name, window = check_label("name", name), check_bool("window", window)
    for who, config in ((name, student), ("teacher", teacher)):
        if not isinstance(config, GPTConfig):
            raise TypeError(f"{who} must be a GPTConfig, got {type(config).__name__} {short_repr(config)}")
    if student.vocab_size != teacher.vocab_size:
        raise ValueError(f"{name} has vocab_size={student.vocab_size}, the teacher vocab_size={teacher.vocab_size}: "
                         "KD compares distributions over the same tokens")
    if window and student.block_size > teacher.block_size:
        raise ValueError(f"{name} has block_size={student.block_size} (its training windows), longer than the "
                         f"teacher's context window block_size={teacher.block_size}")


class DistillObjective(nn.Module):
    """loss_fn(student, x, y) for `train`: (1 − w)·CE + w·T²·KL against a frozen teacher, + β·feature loss.

    The teacher is registered (it moves with `.to()`) but frozen: `requires_grad_(False)` on all its parameters, so
    the trainer, which trains the objective's parameters that require grad, trains only the feature projection.
    Every call appends its terms to `records` (the KD loss curves of the chapter's notebook) and hands them to
    `on_record`, if set (`distill` appends them to the run directory, so that a resumed run has them all).
    """

    def __init__(self, teacher: GPT, temperature: float = 1.0, kd_weight: float = 0.5, kind: str = "forward",
                 feature_weight: float = 0.0, student_config: GPTConfig | None = None,
                 layer_pairs: Sequence[tuple[int, int]] | None = None):
        super().__init__()
        tcfg = require_model(teacher, "DistillObjective (teacher)")
        check_module_has_data("teacher", teacher)  # a meta teacher would fail at the first step, inside torch
        self.temperature = check_temperature(temperature)
        kd_weight = check_float("kd_weight", kd_weight, 0.0, 1.0)
        feature_weight = check_float("feature_weight", feature_weight, 0.0)
        self.kd_weight, self.kind, self.feature_weight = float(kd_weight), check_kind(kind), float(feature_weight)
        if student_config is not None and not isinstance(student_config, GPTConfig):
            raise TypeError(f"student_config must be a GPTConfig or None, got {type(student_config).__name__}")
        if student_config is not None:
            check_student(student_config, tcfg, "student_config")
        self.student_config = student_config
        # subtle: layer_pairs is checked whether or not features are on: pairs outside both models, given with
        # feature_weight = 0, would otherwise be ignored without a word.
        student_layers = None if student_config is None else student_config.n_layer
        pairs = None if layer_pairs is None else check_layer_pairs(layer_pairs, student_layers, tcfg.n_layer)
        self.teacher = teacher.eval().requires_grad_(False)
        self.features: FeatureProjection | None = None
        if feature_weight > 0:
            if student_config is None:
                raise ValueError("feature_weight > 0 needs student_config (the student's width and depth)")
            if pairs is None:
                pairs = default_layer_pairs(student_config.n_layer, tcfg.n_layer)
            self.features = FeatureProjection(student_config.n_embd, tcfg.n_embd, pairs)
        self.records: list[dict[str, float]] = []  # one per call: total, hard, soft, feature
        self.on_record: Callable[[dict[str, float]], None] | None = None

    def forward(self, student: GPT, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x, y (B, T) from the trainer's batch sampler -> the scalar loss to minimise."""
        scfg = require_model(student, "DistillObjective (student)")
        # attributes a caller can replace after construction, re-checked here as the constructor checked them
        tcfg = require_model(self.teacher, "DistillObjective.teacher")
        if not isinstance(self.records, list):
            raise TypeError(f"DistillObjective.records must be a list (each call appends its terms), got "
                            f"{type(self.records).__name__}")
        if self.on_record is not None and not callable(self.on_record):
            raise TypeError(f"DistillObjective.on_record must be None or a callable taking a record, got "
                            f"{type(self.on_record).__name__}")
        if self.features is not None and not isinstance(self.student_config, GPTConfig):
            raise TypeError(f"DistillObjective.student_config must be the GPTConfig its feature projection was built "
                            f"for, got {type(self.student_config).__name__}")
        check_student(scfg, tcfg, "the student")
        # an attribute: it can be set after construction
        self.feature_weight = check_float("feature_weight", self.feature_weight, 0.0)
        if self.feature_weight > 0 and self.features is None:
            raise ValueError(f"feature_weight={self.feature_weight} but this objective has no feature projection: it "
                             "was built with feature_weight=0 (construct it with feature_weight > 0 and "
                             "student_config)")
        if self.features is not None:  # the projection and the layer pairs were built for student_config's shape
            for field in ("n_layer", "n_embd"):
                if getattr(scfg, field) != getattr(self.student_config, field):
                    raise ValueError(f"the student has {field}={getattr(scfg, field)} but student_config "
                                     f"{field}={getattr(self.student_config, field)}, the shape the feature "
                                     "projection was built for")
        positions = student.check_inputs(x)  # (1, T)
        check_targets("y", y, tuple(x.shape), scfg.vocab_size, x.device)  # named here as y, the trainer's targets
        if x.size(1) > tcfg.block_size:
            raise ValueError(f"sequence length {x.size(1)} exceeds the teacher's context window "
                             f"block_size={tcfg.block_size}")
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
        if self.on_record is not None:
            self.on_record(record)
        return total


def checkpoint_dir(name: str | os.PathLike, role: str) -> Path:
    """A shipped checkpoint's directory ("draft"), or any checkpoint directory given as a path; `role` is what the
    caller resolves it as ("student", "--teacher"), and every error names it, so a missing teacher is never
    reported as a missing student."""
    role = check_label("role", role)
    if not isinstance(name, (str, os.PathLike)):
        raise TypeError(f"{role} must be a shipped checkpoint name or a directory, got {type(name).__name__}")
    if name in SHIPPED:
        return pretrained_dir(name)  # type: ignore[arg-type]
    if not os.fspath(name):  # subtle: Path("") is Path("."), the working directory: a directory, but not a choice
        raise ValueError(f"{role} must name a shipped checkpoint {list(SHIPPED)} or a directory, got an empty string")
    path = Path(name)
    if not path.is_dir():
        raise ValueError(f"{role} {os.fspath(name)!r} is neither a shipped checkpoint {list(SHIPPED)} nor a "
                         "directory")
    if not (path / CONFIG_NAME).is_file():  # Path("") is Path("."): the working directory, seldom a checkpoint
        raise ValueError(f"{role} {os.fspath(name)!r} is a directory but no checkpoint (it has no {CONFIG_NAME})")
    return path


def student_dir(name: str | os.PathLike) -> Path:
    """The student's checkpoint directory: `checkpoint_dir(name, "student")`."""
    return checkpoint_dir(name, "student")


def distill(cfg: TrainConfig, teacher: GPT | None, temperature: float = 1.0, kd_weight: float = 0.5,
            kind: str = "forward", feature_weight: float = 0.0, progress: bool = True
            ) -> tuple[TrainResult, DistillObjective | None]:
    """One training run of the student `cfg.init_from` with the distillation objective (None: kd_weight = 0).

    kd_weight = 0 and feature_weight = 0 is the hard-label control: the trainer's own cross-entropy, no teacher. The
    exported training_log.json (if `cfg.export_dir`) gains a "distillation" section: the settings and, per logged
    step, the mean hard, soft and feature terms. Every argument is checked first, whether or not the run uses it:
    temperature in [MIN_TEMPERATURE, MAX_TEMPERATURE] = [1e-2, 1e4], kd_weight in [0, 1], feature_weight >= 0 (all
    finite), kind "forward" or "reverse", and `cfg` again (a field set after construction, steps = 0 or lr = NaN, is
    refused as TrainConfig refuses it; a batch_size whose logits would not fit one tensor, `check_batch_fits`).
    `prepare_distill` does all of that and `run_distill` trains: `distill` is
    the two. The teacher runs frozen, in eval mode, on cfg.device (it is moved there, as `.to()` moves a module),
    and is handed back in the modes it came in: every module's training mode and every parameter's requires_grad
    restored (`kept_modes`), whether the run finished or raised. (The returned objective holds that same teacher,
    no longer frozen: for its records, not to train with again; `distill` builds a new one each run.)

    Resume: with `cfg.out_dir` the run keeps its state beside the trainer's checkpoints (`run_state`); a run
    stopped there (`stop_after`, or killed) continues with `cfg.resume = out_dir` and `init_from = None`, the same
    teacher and settings (a difference is a ValueError naming it), and ends with the weights and log the run would
    have had uninterrupted. A run that trains a feature projection cannot resume (its weights are not saved).
    """
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be a bool, got {type(progress).__name__} {progress!r}")
    with kept_modes(teacher):  # DistillObjective freezes the teacher for the run; the caller gets it back as it was
        return run_distill(prepare_distill(cfg, teacher, temperature, kd_weight, kind, feature_weight), progress)


@contextmanager
def kept_modes(model: nn.Module | None) -> Iterator[None]:
    """Run the body, then give every module of `model` back its training mode and every parameter its
    requires_grad, as they were on entry (None, or anything that is no module: nothing to keep). The body may switch
    them freely (`DistillObjective` puts the teacher in eval mode and freezes it); the caller's model comes back in
    the mode it came in, as chapter 13's `eval_mode` hands back a decoder's model."""
    if not isinstance(model, nn.Module):
        yield
        return
    modes = [(m, m.training) for m in model.modules()]
    grads = [(p, p.requires_grad) for p in model.parameters()]
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training
        for p, requires_grad in grads:
            p.requires_grad_(requires_grad)


@dataclass
class PreparedDistill:
    """A checked distillation run, ready to train: the config (re-checked), the objective (None: hard labels only)
    and the "distillation" section of the log, less its history."""
    cfg: TrainConfig
    objective: DistillObjective | None
    section: dict[str, Any]


def prepare_distill(cfg: TrainConfig, teacher: GPT | None, temperature: float = 1.0, kd_weight: float = 0.5,
                    kind: str = "forward", feature_weight: float = 0.0) -> PreparedDistill:
    """Every check of `distill`, then the run state in out_dir (`start_run`, or `resume_run` after its checks of the
    interrupted run); no training step, so a refused argument never costs a run. The CLI reports what this refuses
    as usage errors."""
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"distill needs a TrainConfig, got {type(cfg).__name__}")
    cfg = replace(cfg)  # re-runs __post_init__: a field set to nonsense after construction is refused here
    temperature = check_temperature(temperature)
    kd_weight = check_float("kd_weight", kd_weight, 0.0, 1.0)
    feature_weight = check_float("feature_weight", feature_weight, 0.0)
    kind = check_kind(kind)
    if teacher is not None:
        require_model(teacher, "distill (teacher)")
    uses_teacher = kd_weight > 0 or feature_weight > 0
    if uses_teacher and teacher is None:
        raise ValueError(f"kd_weight={kd_weight} / feature_weight={feature_weight} need a teacher")
    if cfg.init_from is None and cfg.resume is None:
        raise ValueError("distill continues a student: set TrainConfig.init_from to its checkpoint directory (or "
                         "TrainConfig.resume to the out_dir of an interrupted distillation)")
    if cfg.resume is not None and feature_weight > 0:
        raise ValueError(f"feature_weight={feature_weight} with resume={cfg.resume!r}: a run that trains a feature "
                         "projection cannot resume (the checkpoints hold the student's weights, not the projection's)")
    student_dir_ = cfg.init_from if cfg.resume is None else find_checkpoint(cfg.resume).path
    student_config, _ = read_config(student_dir_)  # the student's shape, from config.json alone
    check_batch_fits(cfg, student_config)  # batch_size set huge after construction: named, not met by the allocator
    if uses_teacher:
        check_student(student_config, teacher.config, f"the student {str(student_dir_)!r}",  # type: ignore[union-attr]
                      window=True)
    objective = None
    if uses_teacher:
        objective = DistillObjective(teacher, temperature, kd_weight, kind, feature_weight,  # type: ignore[arg-type]
                                     student_config if feature_weight > 0 else None)
        objective.to(resolve_device(cfg.device))
    student_init = cfg.init_from
    record_log = None
    if cfg.resume is not None or cfg.out_dir is not None:
        settings = {"temperature": temperature, "kd_weight": float(kd_weight), "kind": kind,
                    "feature_weight": float(feature_weight), "grad_accum": cfg.grad_accum,
                    "teacher_sha256": teacher_digest(teacher) if uses_teacher else None,
                    "trainer": {name: getattr(cfg, name) for name in TRAINER_FIELDS}}
        if cfg.resume is not None:
            records, student_init, record_log = resume_run(cfg.resume, cfg.out_dir, settings,
                                                           needs_records=objective is not None)
            if objective is not None:
                objective.records = records
        else:
            record_log = start_run(cfg.out_dir, settings, cfg.init_from)  # type: ignore[arg-type]
    if objective is not None:
        objective.on_record = record_log
    section: dict[str, Any] = {"teacher": None if objective is None else _teacher_label(teacher),  # type: ignore
                               "temperature": temperature, "kd_weight": kd_weight, "kind": kind,
                               "feature_weight": feature_weight, "student_init": student_init}
    return PreparedDistill(cfg, objective, section)


def run_distill(prepared: PreparedDistill, progress: bool = True) -> tuple[TrainResult, DistillObjective | None]:
    """Train what `prepare_distill` checked; the log gains its "distillation" section (written to `out_dir` and
    `export_dir` when the run finished)."""
    if not isinstance(prepared, PreparedDistill):
        raise TypeError(f"prepared must come from prepare_distill, got {type(prepared).__name__}")
    cfg, objective = prepared.cfg, prepared.objective
    result = train(cfg, progress=progress, loss_fn=objective)
    result.log["distillation"] = {**prepared.section,
                                  "history": kd_history(objective, cfg.log_interval, cfg.grad_accum)}
    if "final_val_loss" in result.log:  # the trainer finished (not stopped by stop_after) and wrote its logs
        for where in (cfg.out_dir, cfg.export_dir):
            if where is not None:
                atomic_write_text(Path(where) / LOG_NAME, json.dumps(result.log, indent=1) + "\n")
    return result, objective


def _teacher_label(teacher: GPT) -> str:
    c = teacher.config
    return f"{c.n_layer} layers x {c.n_embd} ({teacher.num_params():,} parameters)"


def kd_history(objective: DistillObjective | None, every: int, grad_accum: int = 1) -> list[dict[str, float]]:
    """The objective's terms averaged over blocks of `every` optimizer steps, each step's `grad_accum` calls
    (micro-batches) together: [{"step", "hard", "soft", ...}], "step" the block's last step (the last block may be
    shorter). Records that are no whole number of steps (3 calls at grad_accum=2: a step cut short, or the wrong
    grad_accum) are a ValueError naming both: a step count from them would be wrong."""
    if objective is not None and not isinstance(objective, DistillObjective):
        raise TypeError(f"objective must be a DistillObjective or None, got {type(objective).__name__} {objective!r}")
    every = check_int("every", every)
    grad_accum = check_int("grad_accum", grad_accum)
    if objective is None or not objective.records:
        return []
    recs, per_block = objective.records, every * grad_accum
    if not isinstance(recs, list):
        raise TypeError(f"objective.records must be a list of records, got {type(recs).__name__}")
    keys = tuple(recs[0]) if isinstance(recs[0], dict) else RECORD_KEYS  # a first record that is no dict: refused
    for i, r in enumerate(recs):  # every record has the first one's fields, each a number: all are averaged below
        check_record(r, keys, f"objective.records[{i}]")
    if len(recs) % grad_accum:
        raise ValueError(f"objective.records holds {len(recs)} records, not a whole number of steps of "
                         f"grad_accum={grad_accum} calls each")
    out = []
    for start in range(0, len(recs), per_block):
        block = recs[start:start + per_block]
        out.append({"step": (start + len(block)) // grad_accum,
                    **{k: round(sum(r[k] for r in block) / len(block), 5) for k in block[0]}})
    return out


# ---- CLI ----------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    ap = CheckedParser(prog="python -m minillm.distill.train", description=__doc__.split("\n")[0])
    ap.add_argument("--student", default="draft",
                    help="shipped checkpoint or directory to start from (default draft; unused with --resume: the "
                         "run's checkpoint decides, so the same command line can resume)")
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
    ap.add_argument("--seed", type=seed_argument, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--device", default="cpu", choices=DEVICE_CHOICES)
    ap.add_argument("--export", metavar="DIR", help="write the student + training_log.json here")
    ap.add_argument("--out", metavar="DIR", help="run directory: checkpoints and the distillation's state, to resume")
    ap.add_argument("--save-interval", type=int, default=0, help="checkpoint every N steps into --out (0: at the end)")
    ap.add_argument("--stop-after", type=int, help="stop (with a checkpoint in --out) after this step")
    ap.add_argument("--resume", metavar="DIR", help="continue the interrupted run in DIR (its --out); same settings")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def _relative(path: Path) -> Path:
    """`path` relative to the working directory when it lies inside it (the log then names no machine's paths)."""
    try:
        return path.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return path


# The names the library gives the flags' values (TrainConfig's fields, distill's arguments), each with its flag: a
# refused value is reported as a usage error naming the flags of the names its message holds (`usage_error`).
FLAG_OF = {name: "--" + name.replace("_", "-") for name in (
    "steps", "batch_size", "lr", "min_lr_ratio", "warmup_steps", "eval_interval", "eval_windows", "final_eval_tokens",
    "seed", "save_interval", "stop_after", "resume", "student", "teacher", "temperature", "kd_weight", "kind",
    "feature_weight")} | {"init_from": "--student", "num_threads": "--threads", "export_dir": "--export",
                          "out_dir": "--out"}


def usage_error(ap: argparse.ArgumentParser, error: Exception) -> NoReturn:
    """`ap.error(...)` (exit 2, a usage line, no traceback) for a value TrainConfig or `prepare_distill` refused:
    "argument --warmup-steps/--steps: warmup_steps=20 must be smaller than steps=1". The flags are those of the
    names in the message's first clause (up to its first ": "; what follows explains, and "the student's weights"
    there is no --student), in its order, outside quoted paths (a folder named 'steps' names no flag)."""
    if not isinstance(ap, argparse.ArgumentParser):
        raise TypeError(f"ap must be the command's argparse.ArgumentParser, got {type(ap).__name__}")
    text = re.sub(r"'[^']*'", "''", str(error)).split(": ")[0]
    names = re.findall(r"(?<![\w-])(" + "|".join(FLAG_OF) + r")(?!\w)", text)
    flags = list(dict.fromkeys(FLAG_OF[n] for n in names))
    ap.error(f"argument {'/'.join(flags)}: {error}" if flags else str(error))


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    # Everything below up to the training is a check or a load: a refused value is a usage error naming its flag.
    try:
        for flag, value in (("--export", args.export), ("--out", args.out)):  # named as flags, before TrainConfig
            check_output_dir(value, flag)
        if args.resume is not None:
            check_path(args.resume, "--resume")
        # The teacher is checked whatever the weights: a wrong path is a mistake even in a run that would not load it.
        teacher_dir = checkpoint_dir(args.teacher, "--teacher")
        init = None if args.resume else str(_relative(checkpoint_dir(args.student, "--student")))  # resumed: it has one
        cfg = TrainConfig(
            preset="draft", init_from=init, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
            min_lr_ratio=args.min_lr_ratio, warmup_steps=args.warmup_steps, eval_interval=args.eval_interval,
            eval_windows=args.eval_windows, final_eval_tokens=args.final_eval_tokens, seed=args.seed,
            device=args.device, num_threads=args.threads, export_dir=args.export, out_dir=args.out,
            save_interval=args.save_interval, stop_after=args.stop_after, resume=args.resume,
            command="python -m minillm.distill.train " + " ".join(shlex.quote(a) for a in argv))
        teacher = None
        if args.kd_weight > 0 or args.feature_weight > 0:
            teacher = load_checkpoint(teacher_dir, device=resolve_device(args.device))
        prepared = prepare_distill(cfg, teacher, args.temperature, args.kd_weight, args.kind, args.feature_weight)
    except (ValueError, TypeError) as e:
        usage_error(ap, e)
    result, _ = run_distill(prepared, progress=not args.no_progress)
    log = result.log
    print(f"{result.step} steps ({result.tokens_seen:,} tokens) in {result.wall_seconds / 60:.1f} min; "
          f"val loss {log.get('final_val_loss')}, val perplexity {log.get('val_perplexity')}")
    if args.export:
        print(f"written to {args.export}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

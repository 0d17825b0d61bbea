"""Training the GPT: AdamW, warm-up + cosine, clipping, accumulation, validation, and checkpoints that resume exactly.

What it adds: `TrainConfig` (validated), `train(config) -> TrainResult`, and the `minillm train` command that
produced the two shipped checkpoints. The loop is the standard GPT-2-style recipe (as in nanoGPT): AdamW with
weight decay on matrices only, a linear warm-up then a cosine decay to `min_lr_ratio * lr`, global-norm gradient
clipping, gradient accumulation over micro-batches, bf16 autocast on CUDA (fp32 on the CPU). Two openings for
later chapters: `init_from` starts from a checkpoint's weights with a fresh optimizer, and `train(loss_fn=...)`
swaps the training objective (chapter 11 continues `draft` with a distillation loss through both).

Resume is bit-for-bit on the CPU: a checkpoint holds the weights, the AdamW moments, the step, the torch RNG
state and the data sampler's generator state (safetensors + JSON, no pickle), and the learning rate is a pure
function of the step. So N steps straight and N/2 + resume + N/2 give `torch.equal` weights (tested). Each
checkpoint is saved as one atomic unit (`train_state.py`), so an interrupt during a save resumes from the previous
one, still exactly (tested by killing a save at every stage).

Training refuses to go on with NaN: every float setting must be finite (checked in `TrainConfig`), and a
non-finite loss or parameter stops the run with `NonFiniteTrainingError` naming the step, before anything is
saved or exported.

What it leaves out: data parallelism, mixed precision on the CPU, a learning-rate finder. A run limited by
`max_minutes` fits its cosine to the clock (progress = max(step/steps, elapsed/budget)), so it always ends
with a fully decayed learning rate but is not bit-reproducible: the clock decides how many steps it takes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.core.checkpoint import load_checkpoint, save_checkpoint
from minillm.core.config import (check_device, check_fits_float, check_float, check_instance, check_int,
                                 check_tensor_elements, check_threads, GPTConfig, plain_number, PRESETS, short_repr,
                                 tensor_kind)
from minillm.core.device import DEVICE_CHOICES, resolve_device
from minillm.core.sampling import check_seed, seed_argument
from minillm.core.io import atomic_write_text, check_output_dir, check_path
from minillm.core.model import GPT, require_model
from minillm.gpt.dataset import BatchSampler, fixed_windows, split_tokens
from minillm.gpt.eval import token_nll
from minillm.gpt.train_state import find_checkpoint, load_train_state, save_train_state
from minillm.tokenizer import load_tokenizer

LOG_NAME = "training_log.json"
PATH_FIELDS = ("corpus", "tokenizer", "out_dir", "export_dir", "resume", "init_from")  # TrainConfig's paths


class NonFiniteTrainingError(ValueError):
    """The loss or a parameter became NaN or infinite; the message names the step. Nothing was saved after it."""


@dataclass
class TrainConfig:
    preset: str = "base"  # GPTConfig preset of the model to train (ignored on resume: the checkpoint decides)
    model_overrides: dict[str, Any] = field(default_factory=dict)  # GPTConfig fields to change, e.g. vocab_size
    corpus: str | None = None  # UTF-8 text file; None = the default stdlib corpus (its train/val split)
    tokenizer: str | None = None  # tokenizer .json; None = the shipped tokenizer
    steps: int = 2000  # optimizer steps (the cosine spans these); with max_minutes, an upper bound
    max_minutes: float | None = None  # wall-clock budget; the schedule is fitted to whichever ends first
    batch_size: int = 16  # sequences per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step (effective batch = batch_size * grad_accum)
    lr: float = 1e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # the cosine ends at min_lr_ratio * lr
    warmup_steps: int = 100  # linear warm-up from lr/warmup_steps to lr
    weight_decay: float = 0.1  # AdamW decoupled weight decay, applied to tensors with dim >= 2 only
    beta1: float = 0.9
    beta2: float = 0.95  # GPT-3/nanoGPT's value: steadier than 0.999 for small batches
    grad_clip: float = 1.0  # clip the global gradient norm to this (0 = off)
    dropout: float = 0.0
    eval_interval: int = 200  # validation loss every this many steps (0 = only at the end)
    eval_windows: int = 64  # fixed validation windows for the periodic loss
    final_eval_tokens: int | None = None  # val tokens for the final perplexity (None = whole split, 0 = skip)
    save_interval: int = 0  # checkpoint every this many steps (0 = only at the end); needs out_dir
    stop_after: int | None = None  # stop after this step, as if interrupted (the schedule still spans `steps`)
    out_dir: str | None = None  # training checkpoint (weights + optimizer + state) for --resume
    export_dir: str | None = None  # the final model only: weights, config.json, training_log.json
    resume: str | None = None  # a previous out_dir to continue from
    init_from: str | None = None  # a checkpoint directory to start from instead of random weights (fresh optimizer)
    seed: int = 0
    device: str = "auto"
    amp: bool = True  # bf16 autocast when on CUDA; never on the CPU
    num_threads: int | None = None  # torch.set_num_threads, None = leave as is
    log_interval: int = 10  # history entry every this many steps
    command: str | None = None  # the command line that started the run, for the log

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {sorted(PRESETS)}")
        if not isinstance(self.model_overrides, dict):
            raise TypeError(f"model_overrides must be a dict, got {type(self.model_overrides).__name__}")
        # A path is a str or an os.PathLike, kept as a str: the training log that holds them is JSON, written after
        # the whole run (a pathlib.Path there was a TypeError from json.dumps once every step had run).
        for name in PATH_FIELDS:
            value = getattr(self, name)
            if value is not None:
                check_path(value, f"TrainConfig.{name}")
                setattr(self, name, os.fsdecode(os.fspath(value)))
        if self.command is not None and not isinstance(self.command, str):  # in the log too
            raise TypeError(f"TrainConfig.command must be a str or None, got {type(self.command).__name__}")
        for name in ("out_dir", "export_dir"):  # written at the end: a bad folder must not cost the whole run
            check_output_dir(getattr(self, name), f"TrainConfig.{name}")
        # The plain ints the count fields hold (an int subclass's own comparisons are not consulted), each within
        # the float range (str() of a 5001-digit int fails, and the schedule divides by steps).
        for name in ("steps", "batch_size", "grad_accum", "eval_windows", "log_interval", "warmup_steps",
                     "eval_interval", "save_interval", "seed", "stop_after", "final_eval_tokens", "num_threads"):
            setattr(self, name, plain_number(getattr(self, name)))
            check_fits_float(f"TrainConfig.{name}", getattr(self, name))
        for name in ("steps", "batch_size", "grad_accum", "eval_windows", "log_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"TrainConfig.{name} must be a positive int, got {short_repr(value)}")
        for name in ("warmup_steps", "eval_interval", "save_interval", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"TrainConfig.{name} must be a non-negative int, got {short_repr(value)}")
        self.seed = check_seed(self.seed)  # torch's generator's range: 2**64 would fail inside manual_seed
        if self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be smaller than steps={self.steps}")
        # Every float must be finite: NaN passes any `x < 0` test, and one NaN setting makes every weight NaN.
        self.lr = check_float("TrainConfig.lr", self.lr, 0.0, include_minimum=False)
        self.min_lr_ratio = check_float("TrainConfig.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        self.weight_decay = check_float("TrainConfig.weight_decay", self.weight_decay, 0.0)
        self.beta1 = check_float("TrainConfig.beta1", self.beta1, 0.0, 1.0, include_maximum=False)
        self.beta2 = check_float("TrainConfig.beta2", self.beta2, 0.0, 1.0, include_maximum=False)
        self.grad_clip = check_float("TrainConfig.grad_clip", self.grad_clip, 0.0)  # 0 = off
        self.dropout = check_float("TrainConfig.dropout", self.dropout, 0.0, 1.0, include_maximum=False)
        if self.max_minutes is not None:
            self.max_minutes = check_float("TrainConfig.max_minutes", self.max_minutes, 0.0, include_minimum=False)
        if self.stop_after is not None and not (isinstance(self.stop_after, int) and 0 < self.stop_after <= self.steps):
            raise ValueError(f"stop_after must be an int in [1, steps={self.steps}], got {short_repr(self.stop_after)}")
        if self.final_eval_tokens is not None and (not isinstance(self.final_eval_tokens, int) or self.final_eval_tokens < 0):
            raise ValueError(f"final_eval_tokens must be a non-negative int or None, got "
                             f"{short_repr(self.final_eval_tokens)}")
        if self.device not in DEVICE_CHOICES and not str(self.device).startswith("cuda"):
            raise ValueError(f"unknown device {self.device!r}; choose one of {DEVICE_CHOICES}")
        if self.num_threads is not None and (not isinstance(self.num_threads, int) or self.num_threads <= 0):
            raise ValueError(f"num_threads must be a positive int or None, got {short_repr(self.num_threads)}")
        if self.num_threads is not None:  # 4 per core at most: torch's pool of 100000 threads is a MemoryError
            check_threads("num_threads", self.num_threads)
        if (self.save_interval or self.stop_after) and self.out_dir is None:
            raise ValueError("save_interval and stop_after need out_dir (where the checkpoint goes)")
        if self.init_from is not None and self.resume is not None:
            raise ValueError(f"init_from={self.init_from!r} and resume={self.resume!r} both choose the starting "
                             "weights; a resumed run continues from its checkpoint, so give one of them")


def check_batch_fits(cfg: TrainConfig, model_config: GPTConfig) -> None:
    """A ValueError naming TrainConfig.batch_size (or eval_windows) when one micro-batch's logits (batch_size,
    block_size, vocab_size), or the validation windows (eval_windows, block_size), of a model of `model_config`
    would pass MAX_TENSOR_ELEMENTS: refused before any batch is allocated, not in the allocator at the first step."""
    check_instance("cfg", cfg, TrainConfig, "a TrainConfig")
    check_instance("model_config", model_config, GPTConfig, "a GPTConfig")
    check_tensor_elements("TrainConfig.batch_size x the model's block_size x vocab_size (one micro-batch's logits)",
                          (cfg.batch_size, model_config.block_size, model_config.vocab_size))
    check_tensor_elements("TrainConfig.eval_windows x the model's block_size", (cfg.eval_windows,
                                                                                 model_config.block_size))


def lr_at(cfg: TrainConfig, step: int, progress: float, warmup_end_progress: float) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warm-up, then cosine from lr to min_lr_ratio*lr.

    `progress` in [0, 1] is how far the run is (step/(steps-1), or the clock's share of max_minutes if larger);
    the cosine runs over the progress left after warm-up, so it reaches its floor exactly at the end.
    """
    check_instance("cfg", cfg, TrainConfig, "a TrainConfig")
    check_int("step", step, 0)
    for name, value in (("progress", progress), ("warmup_end_progress", warmup_end_progress)):
        check_float(name, value, 0.0, 1.0)  # shares of the run: -1 or 2 would bend the cosine silently
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1e-12, 1.0 - warmup_end_progress)
    t = min(1.0, max(0.0, (progress - warmup_end_progress) / span))
    min_lr = cfg.lr * cfg.min_lr_ratio
    return min_lr + 0.5 * (cfg.lr - min_lr) * (1.0 + math.cos(math.pi * t))


def make_optimizer(model: GPT, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with two groups: matrices (embeddings included) decay, vectors (biases, LayerNorm gains) do not.

    Decaying a LayerNorm gain or a bias pulls it to 0, which only hurts; the matrices are where the capacity
    (and the over-fitting) is. named_parameters() lists the tied head once (as transformer.wte.weight).
    """
    check_instance("model", model, nn.Module, "a torch module (the GPT to train)")
    check_instance("cfg", cfg, TrainConfig, "a TrainConfig")
    check_device("device", device)
    decay = [p for _, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for _, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # subtle: foreach=False fixes the update kernel, so a resumed run and a straight run take the same code path.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), foreach=False)


@dataclass
class TrainResult:
    model: GPT
    step: int  # optimizer steps done in total
    tokens_seen: int
    wall_seconds: float  # this run's wall time (all runs together if resumed: see log["wall_seconds_total"])
    history: list[dict[str, Any]]
    log: dict[str, Any]  # what training_log.json holds


# ---- the loop ---------------------------------------------------------------------------------------------

@torch.no_grad()
def estimate_loss(model: GPT, x: torch.Tensor, y: torch.Tensor, batch_size: int, autocast) -> float:
    """Mean cross-entropy over fixed windows x, y (N, T)."""
    require_model(model, "estimate_loss (model)")
    for name, t in (("x", x), ("y", y)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.is_floating_point():
            raise TypeError(f"{name} must be an (N, T) tensor of token ids, got {tensor_kind(t)}")
    if x.shape != y.shape or not x.numel():
        raise ValueError(f"x and y must be windows of one non-empty shape (N, T), got {tuple(x.shape)} and "
                         f"{tuple(y.shape)}")
    check_int("batch_size", batch_size)
    if not callable(autocast):
        raise TypeError(f"autocast must be callable (a context-manager factory), got {type(autocast).__name__}")
    was_training = model.training
    model.eval()
    total, n = 0.0, 0
    for i in range(0, x.size(0), batch_size):
        xb, yb = x[i : i + batch_size].to(model.device), y[i : i + batch_size].to(model.device)
        with autocast():
            logits = model(xb)  # (b, T, V)
        total += F.cross_entropy(logits.float().flatten(0, 1), yb.flatten(), reduction="sum").item()
        n += yb.numel()
    model.train(was_training)
    return total / n


def _load_data(cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    tokenizer = None
    if cfg.tokenizer is not None:
        tokenizer = load_tokenizer(cfg.tokenizer)
    return split_tokens("train", cfg.corpus, tokenizer), split_tokens("val", cfg.corpus, tokenizer)


def train(cfg: TrainConfig, train_tokens: torch.Tensor | None = None, val_tokens: torch.Tensor | None = None,
          progress: bool = True, loss_fn: Callable[[GPT, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
          ) -> TrainResult:
    """Train a GPT as `cfg` says; tokens default to the corpus encoded with the (shipped) tokenizer.

    `loss_fn(model, x, y) -> scalar` replaces the hard-label cross-entropy of the training batches (chapter 11
    distils with it; validation stays cross-entropy). If it is an `nn.Module`, its parameters that require grad (a
    learned feature projection) are trained with the model's, in an AdamW group of their own, clipped with them.
    """
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"train needs a TrainConfig, got {type(cfg).__name__}")
    cfg = dataclasses.replace(cfg)  # re-runs __post_init__: a field set to nonsense after construction is refused here
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(model, x, y), got {type(loss_fn).__name__}")
    extra_params = ([p for p in loss_fn.parameters() if p.requires_grad] if isinstance(loss_fn, nn.Module)
                    else [])
    if extra_params and cfg.resume is not None:
        raise ValueError("resuming a run whose loss_fn has parameters of its own is not supported: the checkpoint "
                         "holds the model's weights only")
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    device = resolve_device(cfg.device)
    if train_tokens is None or val_tokens is None:
        train_tokens, val_tokens = _load_data(cfg)

    torch.manual_seed(cfg.seed)
    resume_point = None
    if cfg.resume is not None:
        resume_point = find_checkpoint(cfg.resume)  # the newest complete checkpoint; ValueError if none
        model = load_checkpoint(resume_point.path, device=device)
    elif cfg.init_from is not None:
        model = load_checkpoint(cfg.init_from, device=device, dropout=cfg.dropout)
    else:
        model = GPT(GPTConfig.from_name(cfg.preset, dropout=cfg.dropout, **cfg.model_overrides)).to(device)
    mcfg = model.config
    check_batch_fits(cfg, mcfg)
    top = int(max(train_tokens.max(), val_tokens.max()))
    if top >= mcfg.vocab_size:
        raise ValueError(f"token id {top} does not fit the model's vocab_size={mcfg.vocab_size}")
    model.train()
    opt = make_optimizer(model, cfg, device)
    if extra_params:
        opt.add_param_group({"params": extra_params, "weight_decay": 0.0})
    trainable = [*model.parameters(), *extra_params]
    sampler = BatchSampler(train_tokens, cfg.batch_size, mcfg.block_size, seed=cfg.seed)
    val_x, val_y = fixed_windows(val_tokens, cfg.eval_windows, mcfg.block_size, seed=cfg.seed + 1)
    use_amp = cfg.amp and device.type == "cuda"
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if use_amp else contextlib.nullcontext

    state: dict[str, Any] = {"step": 0, "tokens_seen": 0, "elapsed_s": 0.0, "warmup_end_progress": None,
                             "history": [], "evals": []}
    if resume_point is not None:
        state = load_train_state(resume_point.path, model, opt, sampler)
        if progress:
            print(resume_point.describe(), file=sys.stderr)
    out_dir = Path(cfg.out_dir) if cfg.out_dir else None
    budget_s = cfg.max_minutes * 60.0 if cfg.max_minutes else None
    tokens_per_step = cfg.batch_size * cfg.grad_accum * mcfg.block_size
    step = state["step"]

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=None if budget_s else cfg.steps, initial=step, unit="step", desc=f"train {cfg.preset}",
                   dynamic_ncols=True)
    t_start = time.perf_counter()
    elapsed_before = state["elapsed_s"]
    last_t, last_step = t_start, step
    # the last 50 losses, for the final train loss: kept in the checkpoint, so a resumed run reports what an
    # uninterrupted one would
    recent: list[float] = list(state.get("recent_losses", []))
    while True:
        elapsed = elapsed_before + time.perf_counter() - t_start
        if step >= cfg.steps or (budget_s is not None and elapsed >= budget_s):
            break
        # Step-based progress reaches 1 at the last step (steps-1), so that step runs at exactly min_lr.
        progress_frac = min(1.0, step / max(1, cfg.steps - 1))
        if budget_s is not None:
            progress_frac = max(progress_frac, min(1.0, elapsed / budget_s))
        if step == cfg.warmup_steps and state["warmup_end_progress"] is None:
            state["warmup_end_progress"] = progress_frac
        lr = lr_at(cfg, step, progress_frac, state["warmup_end_progress"] or 0.0)
        for group in opt.param_groups:
            group["lr"] = lr
        loss_sum = 0.0
        for _ in range(cfg.grad_accum):
            x, y = sampler.sample(device)  # (B, T) each
            with autocast():
                if loss_fn is None:
                    logits = model(x)  # (B, T, V)
                    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                else:
                    loss = loss_fn(model, x, y)
            (loss / cfg.grad_accum).backward()  # gradients of the mean over all micro-batches
            loss_sum += loss.item()
        if cfg.grad_clip > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable, cfg.grad_clip))
        else:
            grad_norm = float("nan")
        if not math.isfinite(loss_sum):
            raise NonFiniteTrainingError(
                f"training stopped at step {step + 1}: the loss is {loss_sum / cfg.grad_accum} (lr={lr:.3g}); "
                "nothing was saved or exported after the last checkpoint")
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        # One reduction per tensor, one host sync for all of them.
        if not bool(torch.stack([torch.isfinite(p).all() for p in model.parameters()]).all()):
            bad = next(n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all()))
            raise NonFiniteTrainingError(
                f"training stopped at step {step}: parameter {bad!r} became non-finite (loss "
                f"{loss_sum / cfg.grad_accum:.4g}, lr={lr:.3g}, weight_decay={cfg.weight_decay}); "
                "nothing was saved or exported after the last checkpoint")
        state["tokens_seen"] += tokens_per_step
        train_loss = loss_sum / cfg.grad_accum
        recent = (recent + [train_loss])[-50:]
        state["recent_losses"] = recent

        if step % cfg.log_interval == 0 or step == cfg.steps:
            now = time.perf_counter()
            tps = (step - last_step) * tokens_per_step / max(1e-9, now - last_t)
            last_t, last_step = now, step
            state["history"].append({"step": step, "loss": round(train_loss, 5), "lr": lr, "grad_norm": grad_norm,
                                     "tokens_per_s": round(tps, 1),
                                     "elapsed_s": round(elapsed_before + now - t_start, 2)})
            if bar is not None:
                bar.set_postfix(loss=f"{train_loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:,.0f}")
        if cfg.eval_interval and step % cfg.eval_interval == 0:
            val_loss = estimate_loss(model, val_x, val_y, cfg.batch_size, autocast)
            state["evals"].append({"step": step, "val_loss": round(val_loss, 5), "train_loss": round(train_loss, 5),
                                   "elapsed_s": round(elapsed_before + time.perf_counter() - t_start, 2)})
            if bar is not None:
                bar.write(f"step {step}: train loss {train_loss:.4f}, val loss {val_loss:.4f}")
        if bar is not None:
            bar.update(1)
        state["step"] = step
        interrupted = cfg.stop_after is not None and step >= cfg.stop_after
        if out_dir is not None and (interrupted or (cfg.save_interval and step % cfg.save_interval == 0)):
            state["elapsed_s"] = elapsed_before + time.perf_counter() - t_start
            save_train_state(out_dir, model, opt, sampler, state)
        if interrupted:
            break
    if bar is not None:
        bar.close()
    wall = time.perf_counter() - t_start
    state["elapsed_s"] = elapsed_before + wall
    finished = not (cfg.stop_after is not None and step >= cfg.stop_after and step < cfg.steps)

    log: dict[str, Any] = {
        "command": cfg.command,
        "preset": cfg.preset,
        "model_config": mcfg.to_dict(),
        "num_params": model.num_params(),
        "steps": step,
        "tokens_seen": state["tokens_seen"],
        "tokens_per_step": tokens_per_step,
        "wall_seconds": round(wall, 1),
        "wall_seconds_total": round(state["elapsed_s"], 1),
        "final_train_loss": round(sum(recent) / len(recent), 5) if recent else None,
        "train_config": dataclasses.asdict(cfg),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
                    "device": str(device), "threads": torch.get_num_threads()},
        "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "history": state["history"],
        "evals": state["evals"],
        "resumed_from": None if resume_point is None else {"path": str(resume_point.path), "step": resume_point.step,
                                                           "skipped": resume_point.skipped},
    }
    if finished:
        log["final_val_loss"] = round(estimate_loss(model, val_x, val_y, cfg.batch_size, autocast), 5)
        if cfg.final_eval_tokens != 0:
            ids = val_tokens if cfg.final_eval_tokens is None else val_tokens[: cfg.final_eval_tokens]
            total, count = token_nll(model, ids)
            log["val_perplexity"] = round(math.exp(total / count), 4)
            log["val_perplexity_tokens"] = count + 1
        if out_dir is not None and not (cfg.save_interval and step % cfg.save_interval == 0):
            save_train_state(out_dir, model, opt, sampler, state)
        if out_dir is not None:
            atomic_write_text(out_dir / LOG_NAME, json.dumps(log, indent=1) + "\n")
        if cfg.export_dir is not None:
            summary = {k: log.get(k) for k in ("steps", "tokens_seen", "final_train_loss", "final_val_loss",
                                               "val_perplexity", "wall_seconds_total")}
            # The shipped config is for inference: dropout off (the weights do not depend on it).
            save_checkpoint(model, cfg.export_dir, extra_metadata={"trained_with": cfg.command, **summary},
                            config=dataclasses.replace(mcfg, dropout=0.0))
            atomic_write_text(Path(cfg.export_dir) / LOG_NAME, json.dumps(log, indent=1) + "\n")
    model.eval()
    return TrainResult(model, step, state["tokens_seen"], wall, state["history"], log)


# ---- CLI ----------------------------------------------------------------------------------------------------

def _cmd_train(args: argparse.Namespace) -> int:
    cfg = TrainConfig(
        preset=args.preset, corpus=args.corpus, tokenizer=args.tokenizer, steps=args.steps,
        max_minutes=args.max_minutes, batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr,
        min_lr_ratio=args.min_lr_ratio, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
        grad_clip=args.grad_clip, dropout=args.dropout, eval_interval=args.eval_interval,
        eval_windows=args.eval_windows, save_interval=args.save_interval, stop_after=args.stop_after,
        out_dir=args.out, export_dir=args.export, resume=args.resume, init_from=args.init_from, seed=args.seed,
        device=args.device,
        amp=not args.no_amp, num_threads=args.threads, final_eval_tokens=args.final_eval_tokens,
        command="minillm " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
    )
    result = train(cfg, progress=not args.no_progress)
    log = result.log
    if log["resumed_from"] is not None:
        print(f"resumed from {log['resumed_from']['path']} (step {log['resumed_from']['step']})")
    print(f"trained {log['num_params']:,} parameters for {result.step} steps ({result.tokens_seen:,} tokens) "
          f"in {result.wall_seconds / 60:.1f} min; final train loss {log['final_train_loss']}, "
          f"val loss {log.get('final_val_loss')}, val perplexity {log.get('val_perplexity')}")
    for where in (args.out, args.export):
        if where:
            print(f"written to {where}")
    return 0


def add_commands(subparsers) -> None:
    check_instance("subparsers", subparsers, argparse._SubParsersAction, "an ArgumentParser's add_subparsers()")
    p = subparsers.add_parser("train", help="train a GPT on a corpus (chapter 02)")
    d = TrainConfig()
    p.add_argument("--preset", default=d.preset, choices=sorted(PRESETS), help="model shape (default: base)")
    p.add_argument("--corpus", metavar="PATH", help="UTF-8 text file (default: the stdlib corpus)")
    p.add_argument("--tokenizer", metavar="PATH", help="tokenizer .json (default: the shipped tokenizer)")
    p.add_argument("--steps", type=int, default=d.steps, help=f"optimizer steps (default {d.steps})")
    p.add_argument("--max-minutes", type=float, help="wall-clock budget; the cosine is fitted to it")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--grad-accum", type=int, default=d.grad_accum, help="micro-batches per step")
    p.add_argument("--lr", type=float, default=d.lr, help=f"peak learning rate (default {d.lr})")
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip)
    p.add_argument("--dropout", type=float, default=d.dropout)
    p.add_argument("--eval-interval", type=int, default=d.eval_interval)
    p.add_argument("--eval-windows", type=int, default=d.eval_windows)
    p.add_argument("--final-eval-tokens", type=int, default=None, help="val tokens for the final perplexity")
    p.add_argument("--save-interval", type=int, default=d.save_interval)
    p.add_argument("--stop-after", type=int, help="stop (with a checkpoint) after this step; resume later")
    p.add_argument("--out", metavar="DIR", help="training checkpoint directory (weights + optimizer + state)")
    p.add_argument("--export", metavar="DIR", help="write the final model + training_log.json here")
    p.add_argument("--resume", metavar="DIR", help="continue a run from its --out directory")
    p.add_argument("--init-from", metavar="DIR", help="start from this checkpoint's weights (fresh optimizer)")
    p.add_argument("--seed", type=seed_argument, default=d.seed)
    p.add_argument("--device", default=d.device, choices=DEVICE_CHOICES)
    p.add_argument("--no-amp", action="store_true", help="no bf16 autocast on CUDA")
    p.add_argument("--threads", type=int, help="torch.set_num_threads")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(handler=_cmd_train)

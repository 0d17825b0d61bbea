"""A training run's checkpoints: weights, AdamW state, RNG states and progress, saved as one atomic unit.

What it adds: `save_train_state` / `find_checkpoint` / `load_train_state`, used by `minillm.gpt.train` so that
`minillm train --resume` is exact. What it leaves out: sharded or distributed optimizers, keeping a history of
checkpoints (only the newest complete one is kept).

Layout of a run directory (`--out`): one subdirectory per checkpoint, the newest complete one wins.

    ckpt-000003-step-0000021/      serial 3 (one more than any checkpoint before it), taken after step 21
        model.safetensors, config.json   the weights (`minillm.core.checkpoint`), config.json's metadata has the step
        optimizer.safetensors            AdamW's tensors as "state.<index>.<name>", torch/sampler/CUDA RNG states
        train_state.json                 step, tokens seen, elapsed time, history, AdamW's param-group settings
        manifest.json                    written last: the step and every file above with its size and sha256
    training_log.json                    the finished run's log

Why one unit: the four files belong to one step. Written one by one into the run directory, an interrupt between
two of them leaves weights of step 21 beside an optimizer and RNG of step 14 (resume then diverges silently), or a
half set that can never be resumed. So a save writes everything into a hidden temporary directory
(`.tmp-ckpt-...`), fsyncs it, writes the manifest last, and only then renames the directory into place (one atomic
`os.rename`); after that it deletes the older checkpoints and any temporary directory a killed save left behind.
An interrupt at any point leaves the previous checkpoint untouched, and resume takes the newest directory whose
manifest checks out (by serial, not by step: a fresh run into an old directory must not resume the old run).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from minillm.core.checkpoint import CONFIG_NAME, WEIGHTS_NAME, read_config, save_checkpoint
from minillm.core.config import check_instance, check_int
from minillm.core.io import (atomic_save_safetensors, atomic_write_text, check_output_dir, check_path, fsync_dir,
                             read_json_file, read_safetensors_file)
from minillm.core.model import GPT, require_model
from minillm.gpt.dataset import BatchSampler

OPTIMIZER_NAME = "optimizer.safetensors"
STATE_NAME = "train_state.json"
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "minillm-train-checkpoint"
CHECKPOINT_FILES = (WEIGHTS_NAME, CONFIG_NAME, OPTIMIZER_NAME, STATE_NAME)
_CKPT_DIR = re.compile(r"^ckpt-(\d+)-step-(\d+)$")
_TMP_PREFIX = ".tmp-ckpt-"


@dataclass
class ResumePoint:
    """Which checkpoint a resume uses, and why the newer ones (if any) were passed over."""

    path: Path  # the checkpoint directory
    step: int  # optimizer steps done when it was saved
    serial: int  # its save number within the run directory (0: an old single-directory checkpoint)
    skipped: list[str] = field(default_factory=list)  # "<dir>: <reason>" for newer, incomplete or damaged ones

    def describe(self) -> str:
        note = f" (skipped {len(self.skipped)} newer incomplete: {'; '.join(self.skipped)})" if self.skipped else ""
        return f"resuming from {str(self.path)!r} at step {self.step}{note}"


def _check_parts(model: object, opt: object, sampler: object) -> None:
    """A TypeError naming `model`, `opt` or `sampler` when it is not what a checkpoint saves or restores: a GPT, a
    torch optimizer, a `BatchSampler`; before any file is read or written."""
    require_model(model, "train state (model)")
    check_instance("opt", opt, torch.optim.Optimizer, "a torch optimizer (AdamW)")
    check_instance("sampler", sampler, BatchSampler, "a BatchSampler")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _checkpoint_dirs(run_dir: Path) -> list[tuple[int, int, Path]]:
    """(serial, step, path) of every finished checkpoint directory name in run_dir, newest serial first."""
    found = []
    if run_dir.is_dir():
        for p in run_dir.iterdir():
            m = _CKPT_DIR.match(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), int(m.group(2)), p))
    return sorted(found, reverse=True)


def save_train_state(out_dir: Path, model: GPT, opt: torch.optim.Optimizer, sampler: BatchSampler, state: dict,
                     on_write: Callable[[str], None] | None = None) -> Path:
    """Save one checkpoint of the run into `out_dir` atomically (see the module docstring). Returns its directory.

    `on_write(stage)`, if given, is called after each stage lands ("started", "model", "optimizer", "train_state",
    "manifest", "renamed", "cleaned"): the tests kill a child process there to prove that any interrupt is safe.
    """
    out_dir = check_output_dir(check_path(out_dir, "out_dir"), "out_dir")  # a file there: a ValueError naming it
    _check_parts(model, opt, sampler)
    if not isinstance(state, dict) or "step" not in state:
        raise TypeError(f"state must be the run's progress dict, holding 'step', got {type(state).__name__}")
    check_int("state['step']", state["step"], 0)
    if on_write is not None and not callable(on_write):
        raise TypeError(f"on_write must be callable(stage) or None, got {type(on_write).__name__}")
    out_dir.mkdir(parents=True, exist_ok=True)
    hook = on_write or (lambda stage: None)
    step = int(state["step"])
    serial = max((s for s, _, _ in _checkpoint_dirs(out_dir)), default=0) + 1
    name = f"ckpt-{serial:06d}-step-{step:07d}"
    tmp = out_dir / f"{_TMP_PREFIX}{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    hook("started")

    save_checkpoint(model, tmp, extra_metadata={"step": step})
    hook("model")
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for idx, st in sd["state"].items():
        for key, value in st.items():
            tensors[f"state.{idx}.{key}"] = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    tensors["rng.torch"] = torch.get_rng_state()
    tensors["rng.sampler"] = sampler.state()
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    atomic_save_safetensors(tensors, tmp / OPTIMIZER_NAME, metadata={"step": str(step)})
    hook("optimizer")
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    atomic_write_text(tmp / STATE_NAME, json.dumps({**state, "param_groups": groups}, indent=1) + "\n")
    hook("train_state")
    manifest = {"format": MANIFEST_FORMAT, "step": step, "serial": serial,
                "files": {f: {"bytes": (tmp / f).stat().st_size, "sha256": _sha256(tmp / f)} for f in CHECKPOINT_FILES}}
    atomic_write_text(tmp / MANIFEST_NAME, json.dumps(manifest, indent=1) + "\n")
    hook("manifest")

    fsync_dir(tmp)
    os.rename(tmp, out_dir / name)  # the commit point: before it the new checkpoint does not exist, after it it does
    fsync_dir(out_dir)
    hook("renamed")
    for p in out_dir.iterdir():  # only now is it safe to drop the previous checkpoint and leftovers of killed saves
        if p.name != name and p.is_dir() and (_CKPT_DIR.match(p.name) or p.name.startswith(_TMP_PREFIX)):
            shutil.rmtree(p, ignore_errors=True)
    hook("cleaned")
    return out_dir / name


def verify_checkpoint(path: Path) -> int:
    """The step of a complete checkpoint directory; ValueError naming what is missing or damaged otherwise."""
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        raise ValueError(f"no {MANIFEST_NAME} (the save did not finish)")
    manifest = read_json_file(manifest_path, what="checkpoint manifest")
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{str(manifest_path)!r} is not a {MANIFEST_FORMAT!r} manifest")
    for name, want in manifest["files"].items():
        f = path / name
        if not f.is_file():
            raise ValueError(f"{name} is missing")
        if f.stat().st_size != want["bytes"] or _sha256(f) != want["sha256"]:
            raise ValueError(f"{name} does not match its sha256 in {MANIFEST_NAME} (damaged after saving?)")
    return int(manifest["step"])


def find_checkpoint(run_dir: str | os.PathLike) -> ResumePoint:
    """The newest complete checkpoint in a run directory (`--out` of an earlier run); ValueError if there is none.

    A run directory written by an older minillm (the four files directly in it, no manifest) is accepted as it is,
    with the old check that the three steps it records agree.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"resume directory not found: {str(run_dir)!r}")
    skipped = []
    for serial, _, path in _checkpoint_dirs(run_dir):
        try:
            step = verify_checkpoint(path)
        except ValueError as e:
            skipped.append(f"{path.name}: {e}")
            continue
        return ResumePoint(path, step, serial, skipped)
    if (run_dir / STATE_NAME).is_file():  # the single-directory layout of older versions
        state = read_json_file(run_dir / STATE_NAME, what="training state")
        return ResumePoint(run_dir, int(state["step"]), 0, skipped)
    detail = f": {'; '.join(skipped)}" if skipped else ""
    raise ValueError(f"no complete training checkpoint in {str(run_dir)!r} to resume from{detail}")


def load_train_state(ckpt_dir: Path, model: GPT, opt: torch.optim.Optimizer, sampler: BatchSampler) -> dict:
    """Restore AdamW, the RNGs and the sampler from a checkpoint directory (`find_checkpoint(...).path`).

    The model's weights are loaded by the caller (`load_checkpoint(ckpt_dir)`); returns the progress dict.
    """
    from safetensors import safe_open

    ckpt_dir = check_path(ckpt_dir, "ckpt_dir")
    if not ckpt_dir.is_dir():
        error = ValueError if ckpt_dir.exists() else FileNotFoundError
        raise error(f"ckpt_dir {str(ckpt_dir)!r} is no checkpoint folder (give find_checkpoint(...).path)")
    _check_parts(model, opt, sampler)
    state = read_json_file(ckpt_dir / STATE_NAME, what="training state")
    if not isinstance(state, dict) or not {"step", "param_groups"} <= state.keys():
        raise ValueError(f"{str(ckpt_dir / STATE_NAME)!r} lacks the 'step' and 'param_groups' a training state holds")
    _, meta = read_config(ckpt_dir)
    tensors = read_safetensors_file(ckpt_dir / OPTIMIZER_NAME)
    with safe_open(str(ckpt_dir / OPTIMIZER_NAME), "pt") as f:
        opt_step = int((f.metadata() or {}).get("step", -1))
    if meta.get("step") != state["step"] or opt_step != state["step"]:  # only possible in the old layout
        raise ValueError(f"checkpoint in {str(ckpt_dir)!r} is torn: weights at step {meta.get('step')}, optimizer "
                         f"at {opt_step}, train_state at {state['step']}")
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("state."):
            _, idx, name = key.split(".", 2)
            per_param.setdefault(int(idx), {})[name] = value
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in state.pop("param_groups")]
    opt.load_state_dict({"state": per_param, "param_groups": groups})
    torch.set_rng_state(tensors["rng.torch"])
    sampler.set_state(tensors["rng.sampler"])
    if torch.cuda.is_available():
        cuda_states = [tensors[k] for k in sorted(tensors) if k.startswith("rng.cuda.")]
        if cuda_states:
            torch.cuda.set_rng_state_all(cuda_states)
    return state

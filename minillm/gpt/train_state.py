"""A training run's checkpoint: weights, AdamW state, RNG states and progress, so `minillm train --resume` is exact.

What it adds: `save_train_state` / `load_train_state`, used by `minillm.gpt.train`. Files in the run directory:
model.safetensors + config.json (`minillm.core.checkpoint`), optimizer.safetensors (AdamW's per-parameter tensors as
"state.<index>.<name>", the torch RNG state, the data sampler's generator state, CUDA RNG states) and
train_state.json (step, tokens seen, elapsed time, history, AdamW's param-group hyperparameters). No pickle.
What it leaves out: several checkpoints per run (each save replaces the last), sharded or distributed optimizers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from minillm.core.checkpoint import read_config, save_checkpoint
from minillm.core.io import atomic_save_safetensors, atomic_write_text
from minillm.core.model import GPT
from minillm.gpt.dataset import BatchSampler

OPTIMIZER_NAME = "optimizer.safetensors"
STATE_NAME = "train_state.json"


def save_train_state(out_dir: Path, model: GPT, opt: torch.optim.Optimizer, sampler: BatchSampler, state: dict) -> None:
    save_checkpoint(model, out_dir, extra_metadata={"step": state["step"]})
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for idx, st in sd["state"].items():
        for name, value in st.items():
            tensors[f"state.{idx}.{name}"] = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    tensors["rng.torch"] = torch.get_rng_state()
    tensors["rng.sampler"] = sampler.state()
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    atomic_save_safetensors(tensors, out_dir / OPTIMIZER_NAME, metadata={"step": str(state["step"])})
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    # Written last: a crash before this line leaves the previous train_state.json, whose step no longer matches
    # the newer weights, and resume refuses the mismatch instead of mixing two steps.
    atomic_write_text(out_dir / STATE_NAME, json.dumps({**state, "param_groups": groups}, indent=1) + "\n")


def load_train_state(out_dir: Path, model: GPT, opt: torch.optim.Optimizer, sampler: BatchSampler) -> dict:
    from safetensors import safe_open
    from safetensors.torch import load_file

    state = json.loads((out_dir / STATE_NAME).read_text(encoding="utf-8"))
    _, meta = read_config(out_dir)
    with safe_open(str(out_dir / OPTIMIZER_NAME), "pt") as f:
        opt_step = int((f.metadata() or {}).get("step", -1))
    if meta.get("step") != state["step"] or opt_step != state["step"]:
        raise ValueError(f"checkpoint in {str(out_dir)!r} is torn: weights at step {meta.get('step')}, optimizer at "
                         f"{opt_step}, train_state at {state['step']}")
    tensors = load_file(str(out_dir / OPTIMIZER_NAME))
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

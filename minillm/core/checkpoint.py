"""Checkpoints on disk: a model's weights as safetensors plus its `GPTConfig` as JSON, saved atomically, loaded strictly.

What it adds: `save_checkpoint` / `load_checkpoint` for one model directory, loaded strictly by
`minillm.core.weights`, . The two checkpoints minillm ships are loaded, with their
tokenizer, by `minillm.gpt.pretrained`. What it leaves out: optimizer state and training progress (`minillm.gpt.train`
keeps those beside the model while training) and the Hugging Face layout (`minillm.core.hf`).

Layout of a checkpoint directory:

    model.safetensors   every parameter of GPT.state_dict(), the tied lm_head.weight stored once (as wte)
    config.json         {"format": "minillm-gpt", "config": GPTConfig.to_dict(), "metadata": {...}}

safetensors holds raw tensors and a JSON header, so loading a checkpoint runs no code (unlike pickle).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from minillm.core.config import GPTConfig
from minillm.core.device import resolve_device
from minillm.core.io import atomic_save_safetensors, atomic_write_text, read_json_file, read_safetensors_file
from minillm.core.model import GPT
from minillm.core.weights import load_state_dict_strict, model_tensors

FORMAT = "minillm-gpt"
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


def save_checkpoint(model: GPT, path_dir: str | os.PathLike, extra_metadata: dict[str, Any] | None = None,
                    config: GPTConfig | None = None) -> Path:
    """Write `model.safetensors` and `config.json` into path_dir (each file atomically). Returns the directory.

    `config` replaces `model.config` in config.json (same shapes required), e.g. to ship a model trained with
    dropout as a dropout-free inference config.
    """
    if not isinstance(model, GPT):
        raise TypeError(f"save_checkpoint needs a minillm GPT, got {type(model).__name__}")
    if extra_metadata is not None and not isinstance(extra_metadata, dict):
        raise TypeError(f"extra_metadata must be a dict or None, got {type(extra_metadata).__name__}")
    tensors = model_tensors(model)  # an untied head is refused here, before anything is written
    config = model.config if config is None else config
    shape_fields = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "head_size")
    if any(getattr(config, f) != getattr(model.config, f) for f in shape_fields):
        raise ValueError(f"config {config} does not describe the model's shapes {model.config}")
    out = Path(path_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_save_safetensors(tensors, out / WEIGHTS_NAME, metadata={"format": FORMAT})
    doc = {"format": FORMAT, "config": config.to_dict(), "metadata": extra_metadata or {}}
    atomic_write_text(out / CONFIG_NAME, json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return out


def read_config(path_dir: str | os.PathLike) -> tuple[GPTConfig, dict[str, Any]]:
    """(GPTConfig, metadata) from a checkpoint directory's config.json."""
    path = Path(path_dir) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no {CONFIG_NAME} in checkpoint directory {str(Path(path_dir))!r}")
    doc = read_json_file(path, what="checkpoint config")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        hint = " (a Hugging Face directory? use GPT.from_hf)" if isinstance(doc, dict) and "n_embd" in doc else ""
        raise ValueError(f"{str(path)!r} is not a minillm checkpoint config (format != {FORMAT!r}){hint}")
    if not isinstance(doc.get("config"), dict) or not isinstance(doc.get("metadata", {}), dict):
        raise ValueError(f"{str(path)!r}: 'config' and 'metadata' must be JSON objects")
    try:
        config = GPTConfig.from_dict(doc["config"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{str(path)!r} holds an invalid model config: {e}") from e
    return config, dict(doc.get("metadata", {}))


def load_checkpoint(path_dir: str | os.PathLike, device: str | torch.device = "cpu", **config_overrides: Any) -> GPT:
    """A GPT rebuilt from a checkpoint directory, in eval mode. `config_overrides` may set e.g. attn_impl."""
    directory = Path(path_dir)
    config, _ = read_config(directory)
    if config_overrides:
        config = GPTConfig.from_dict({**config.to_dict(), **config_overrides})
    weights = directory / WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"no {WEIGHTS_NAME} in checkpoint directory {str(directory)!r}")
    model = GPT(config)
    load_state_dict_strict(model, read_safetensors_file(weights), source=f"checkpoint {str(weights)!r}")
    return model.to(resolve_device(device)).eval()

"""Checkpoints on disk: a model's weights as safetensors plus its `GPTConfig` as JSON, saved atomically, loaded strictly.

What it adds: `save_checkpoint` / `load_checkpoint` for one model directory, loaded strictly by
`minillm.core.weights`, . The two checkpoints minillm ships are loaded, with their
tokenizer, by `minillm.gpt.pretrained`. What it leaves out: optimizer state and training progress (`minillm.gpt.train`
keeps those beside the model while training) and the Hugging Face layout (`minillm.core.hf`).

Layout of a checkpoint directory:

    model.safetensors   every parameter of GPT.state_dict(), the tied lm_head.weight stored once (as wte)
    config.json         {"format": "minillm-gpt", "config": GPTConfig.to_dict(), "metadata": {...},
                         "sha256": `checkpoint_sha256` of the tensors and the "config" object}

safetensors holds raw tensors and a JSON header, so loading a checkpoint runs no code (unlike pickle). The sha256 is
checked on load (`minillm.core.io.check_sha256`, as the quantized and pruned files check theirs), so a byte changed
in a weight after saving, or a config edited by hand (n_head 8 -> 4 keeps every shape), is a ValueError naming the
checkpoint, not a model that runs with it. It is checked last, after the strict load has named any missing, extra or
misshaped tensor. A config.json written before digests were recorded has no "sha256": it still loads, unverified.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from minillm.core.config import GPTConfig, check_instance
from minillm.core.device import resolve_device
from minillm.core.io import (SHA256_FIELD, atomic_save_safetensors, atomic_write_text, check_sha256, read_json_file,
                             read_safetensors_file, with_sha256)
from minillm.core.model import GPT
from minillm.core.weights import load_state_dict_strict, model_tensors

FORMAT = "minillm-gpt"
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


def _digest_fields(config_doc: object) -> dict[str, str]:
    """What the digest covers beside the tensors: the format and the "config" object as config.json stores it."""
    return {"format": FORMAT, "config": json.dumps(config_doc, sort_keys=True)}


def checkpoint_sha256(tensors: dict[str, torch.Tensor], config_doc: dict[str, Any]) -> str:
    """The "sha256" of config.json: `minillm.core.io.content_sha256` of the tensors model.safetensors holds and of
    the "config" object (`GPTConfig.to_dict()`, as stored). The "metadata" object (training notes) is left out."""
    return with_sha256(_digest_fields(config_doc), tensors)[SHA256_FIELD]


def save_checkpoint(model: GPT, path_dir: str | os.PathLike, extra_metadata: dict[str, Any] | None = None,
                    config: GPTConfig | None = None) -> Path:
    """Write `model.safetensors` and `config.json` into path_dir (each file atomically). Returns the directory.

    config.json records the sha256 of the tensors and the config (`checkpoint_sha256`); `load_checkpoint` checks it.

    `config` replaces `model.config` in config.json (same shapes required), e.g. to ship a model trained with
    dropout as a dropout-free inference config.
    """
    if not isinstance(model, GPT):
        raise TypeError(f"save_checkpoint needs a minillm GPT, got {type(model).__name__}")
    if extra_metadata is not None and not isinstance(extra_metadata, dict):
        raise TypeError(f"extra_metadata must be a dict or None, got {type(extra_metadata).__name__}")
    tensors = model_tensors(model)  # an untied head is refused here, before anything is written
    config = model.config if config is None else check_instance("config", config, GPTConfig, "a GPTConfig or None")
    shape_fields = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "head_size")
    if any(getattr(config, f) != getattr(model.config, f) for f in shape_fields):
        raise ValueError(f"config {config} does not describe the model's shapes {model.config}")
    out = Path(path_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_save_safetensors(tensors, out / WEIGHTS_NAME, metadata={"format": FORMAT})
    doc = {"format": FORMAT, "config": config.to_dict(), "metadata": extra_metadata or {},
           SHA256_FIELD: checkpoint_sha256(tensors, config.to_dict())}
    atomic_write_text(out / CONFIG_NAME, json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return out


def read_config(path_dir: str | os.PathLike) -> tuple[GPTConfig, dict[str, Any]]:
    """(GPTConfig, metadata) from a checkpoint directory's config.json."""
    config, metadata, _ = _read_config(path_dir)
    return config, metadata


def _read_config(path_dir: str | os.PathLike) -> tuple[GPTConfig, dict[str, Any], dict[str, Any]]:
    """`read_config`'s pair and config.json's whole document (for its "config" object and "sha256")."""
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
    return config, dict(doc.get("metadata", {})), doc


def load_checkpoint(path_dir: str | os.PathLike, device: str | torch.device = "cpu", **config_overrides: Any) -> GPT:
    """A GPT rebuilt from a checkpoint directory, in eval mode. `config_overrides` may set e.g. attn_impl.

    The tensors and the stored config must match config.json's sha256 when it records one (a ValueError naming the
    checkpoint otherwise); the overrides apply after that check."""
    directory = Path(path_dir)
    config, _, doc = _read_config(directory)
    if config_overrides:
        config = GPTConfig.from_dict({**config.to_dict(), **config_overrides})
    weights = directory / WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"no {WEIGHTS_NAME} in checkpoint directory {str(directory)!r}")
    model = GPT(config)
    tensors = read_safetensors_file(weights)
    load_state_dict_strict(model, tensors, source=f"checkpoint {str(weights)!r}")
    # last: whatever the strict load could not see (a changed value, an edited config of the same shapes)
    recorded = {SHA256_FIELD: doc[SHA256_FIELD]} if SHA256_FIELD in doc else {}  # none: written before digests
    check_sha256({**_digest_fields(doc["config"]), **recorded}, tensors,
                 f"checkpoint {str(weights)!r} (with the sha256 in its {CONFIG_NAME})")
    return model.to(resolve_device(device)).eval()

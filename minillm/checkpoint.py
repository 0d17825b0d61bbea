"""Checkpoints on disk: a model's weights as safetensors plus its `GPTConfig` as JSON, saved atomically, loaded strictly.

What it adds: `save_checkpoint` / `load_checkpoint` for one model directory, `load_state_dict_strict` (every
tensor must be there, with the right shape, and nothing else), and `load_pretrained("base" | "draft")`, the
two checkpoints minillm ships. What it leaves out: optimizer state and training progress (`minillm.train`
keeps those beside the model while training) and the Hugging Face layout (`minillm.hf`).

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

from minillm.config import GPTConfig
from minillm.io import atomic_save_safetensors, atomic_write_text
from minillm.model import GPT

FORMAT = "minillm-gpt"
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
CHECKPOINTS_DIR = Path(__file__).resolve().parent / "assets" / "checkpoints"
SHIPPED = ("base", "draft")
# subtle: the head shares its matrix with the token embedding (weight tying). safetensors refuses two names for
# one storage, and storing it twice would waste 4 MB, so the head is dropped on save and re-tied by GPT().
TIED_KEYS = ("lm_head.weight",)


def model_tensors(model: GPT) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint stores: the state dict minus the tied head."""
    return {k: v for k, v in model.state_dict().items() if k not in TIED_KEYS}


def _shape(t: torch.Tensor | None) -> str:
    return "none" if t is None else str(tuple(t.shape))


def load_state_dict_strict(model: GPT, tensors: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
    """Copy `tensors` into `model`; any missing, unexpected or mis-shaped tensor is a ValueError naming it.

    The message names the key and both shapes (the model's and the file's), e.g.
    "checkpoint tensor 'transformer.h.0.attn.c_attn.weight' has shape (96, 32) but the model expects (96, 64)".
    Tensors are cast to the model's dtype; the tied head may be present or absent.
    """
    expected = model_tensors(model)
    for key in sorted(expected):
        if key not in tensors:
            raise ValueError(
                f"{source} is missing tensor {key!r}: the model expects shape {_shape(expected[key])}, "
                f"the {source} has none"
            )
    for key in sorted(tensors):
        if key in TIED_KEYS:
            continue
        if key not in expected:
            raise ValueError(
                f"{source} has unexpected tensor {key!r} with shape {_shape(tensors[key])}; "
                f"the model has no such tensor (expected shape: none)"
            )
    for key in sorted(expected):
        if tuple(tensors[key].shape) != tuple(expected[key].shape):
            raise ValueError(
                f"{source} tensor {key!r} has shape {_shape(tensors[key])} "
                f"but the model expects {_shape(expected[key])}"
            )
    for key in TIED_KEYS:
        if key in tensors:
            wte = tensors["transformer.wte.weight"]
            if tuple(tensors[key].shape) != tuple(wte.shape):
                raise ValueError(f"{source} tensor {key!r} has shape {_shape(tensors[key])} but the model "
                                 f"expects {_shape(wte)} (tied to transformer.wte.weight)")
            if not torch.equal(tensors[key], wte):
                raise ValueError(f"{source} tensor {key!r} differs from transformer.wte.weight; minillm's GPT ties "
                                 "the output head to the token embedding and cannot load an untied head")
    with torch.no_grad():
        for key, param in expected.items():
            param.copy_(tensors[key].to(dtype=param.dtype, device=param.device))


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
    out = Path(path_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_save_safetensors(model_tensors(model), out / WEIGHTS_NAME, metadata={"format": FORMAT})
    config = model.config if config is None else config
    shape_fields = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")
    if any(getattr(config, f) != getattr(model.config, f) for f in shape_fields):
        raise ValueError(f"config {config} does not describe the model's shapes {model.config}")
    doc = {"format": FORMAT, "config": config.to_dict(), "metadata": extra_metadata or {}}
    atomic_write_text(out / CONFIG_NAME, json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return out


def read_config(path_dir: str | os.PathLike) -> tuple[GPTConfig, dict[str, Any]]:
    """(GPTConfig, metadata) from a checkpoint directory's config.json."""
    path = Path(path_dir) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no {CONFIG_NAME} in checkpoint directory {str(Path(path_dir))!r}")
    doc = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        hint = " (a Hugging Face directory? use minillm.hf.load_hf)" if isinstance(doc, dict) and "n_embd" in doc else ""
        raise ValueError(f"{str(path)!r} is not a minillm checkpoint config (format != {FORMAT!r}){hint}")
    return GPTConfig.from_dict(doc["config"]), dict(doc.get("metadata", {}))


def load_checkpoint(path_dir: str | os.PathLike, device: str | torch.device = "cpu", **config_overrides: Any) -> GPT:
    """A GPT rebuilt from a checkpoint directory, in eval mode. `config_overrides` may set e.g. attn_impl."""
    from safetensors.torch import load_file

    from minillm.device import resolve_device

    directory = Path(path_dir)
    config, _ = read_config(directory)
    if config_overrides:
        config = GPTConfig.from_dict({**config.to_dict(), **config_overrides})
    weights = directory / WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"no {WEIGHTS_NAME} in checkpoint directory {str(directory)!r}")
    model = GPT(config)
    load_state_dict_strict(model, load_file(str(weights)), source=f"checkpoint {str(weights)!r}")
    return model.to(resolve_device(device)).eval()


def pretrained_dir(name: str) -> Path:
    if name not in SHIPPED:
        raise ValueError(f"unknown shipped checkpoint {name!r}; choose one of {list(SHIPPED)}")
    return CHECKPOINTS_DIR / name


def load_pretrained(name: str = "base", device: str | torch.device = "cpu", **config_overrides: Any):
    """(GPT, Tokenizer): a checkpoint minillm ships ("base", the target of every later chapter, or "draft")."""
    from minillm.tokenizer import load_tokenizer

    directory = pretrained_dir(name)
    if not (directory / WEIGHTS_NAME).is_file():
        raise FileNotFoundError(
            f"shipped checkpoint {name!r} not found in {str(directory)!r}; train it with "
            f"`minillm train --preset {name} --export {directory}` (see chapters/02-gpt.md)"
        )
    model = load_checkpoint(directory, device=device, **config_overrides)
    tokenizer = load_tokenizer()
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"the shipped tokenizer has {tokenizer.vocab_size} tokens but checkpoint {name!r} only "
                         f"{model.config.vocab_size}: they do not belong together")
    return model, tokenizer


def load_pretrained_or_random(name: str = "base", device: str | torch.device = "cpu", seed: int = 0):
    """For benchmarks and the tour: (model in eval mode, tokenizer or None, trained).

    The shipped checkpoint `name` and its tokenizer when minillm has its weights; otherwise (not trained yet, or
    a preset that is never shipped, such as "tiny") a model of the preset's shape with weights drawn from `seed`,
    no tokenizer, and trained=False, so callers can say so in what they print. Timings are the same either way.
    A shipped checkpoint that is present but broken still raises.
    """
    if name in SHIPPED and (pretrained_dir(name) / WEIGHTS_NAME).is_file():
        model, tokenizer = load_pretrained(name, device=device)
        return model.eval(), tokenizer, True
    torch.manual_seed(seed)
    return GPT(GPTConfig.from_name(name)).to(device).eval(), None, False

"""Quantized checkpoints: one safetensors file holding integer codes, scales and zero points, with the mode in
the file's own metadata.

What it adds: `save_quantized(model, path)` and `load_quantized(path)`. The header of the file says what the
tensors mean; nothing is ever guessed from a file name or from dtypes:

    metadata  {"format": "minillm-quant", "format_version": "1",
               "quant_config": QuantConfig as JSON, "gpt_config": GPTConfig as JSON, "method": "rtn" | "gptq" | ...}
    tensors   transformer.h.0.attn.c_attn.qweight  int8 (3C, C) | uint8 (3C, C/2) packed int4
              transformer.h.0.attn.c_attn.scale    fp32 (3C, groups)
              transformer.h.0.attn.c_attn.zero     uint8 (3C, groups), asymmetric modes only
              ... and the fp32 rest (LayerNorms, biases, position embedding, the token embedding unless quantized)

Loading builds the model the metadata describes and refuses a file whose metadata is missing, unreadable, or
disagrees with its tensors (a missing, extra, mis-shaped or mis-typed tensor), naming what is wrong. Writes are
atomic (`minillm.core.io`): a crash leaves the old file or the new one, never half of one. What it leaves out:
the tokenizer (the shipped one belongs to `base`) and sharded files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from minillm.core.config import GPTConfig
from minillm.core.device import resolve_device
from minillm.core.io import atomic_save_safetensors, read_format_metadata, read_safetensors_file
from minillm.core.formats import ModelFormat, gpt_config_from, gpt_config_json, register_model_format
from minillm.core.model import GPT
from minillm.core.weights import load_state_dict_strict, model_tensors
from minillm.quant.linear import QuantConfig, QuantizedGPT, quantize_model

FORMAT = "minillm-quant"
FORMAT_VERSION = "1"
_HINT = ("an fp32 checkpoint loads with minillm.core.checkpoint.load_checkpoint, and a quantized one never loads "
         "without its mode")


def _metadata(model: QuantizedGPT) -> dict[str, str]:
    """The header fields that say what the tensors mean (everything but the method, which only people read)."""
    return {"format_version": FORMAT_VERSION, "quant_config": json.dumps(model.quant_config.to_dict(), sort_keys=True),
            "gpt_config": gpt_config_json(model.config)}


def save_quantized(model: QuantizedGPT, path: str | os.PathLike, method: str = "rtn") -> Path:
    """Write `model` (from `quantize_model` or GPTQ) to the safetensors file `path`, atomically. Returns the path.

    `method` records how the codes were chosen ("rtn", "gptq", ...); it is informative, the loader does not need it.
    """
    if not isinstance(model, QuantizedGPT):
        raise TypeError(f"save_quantized needs a quantized model (see quantize_model), got {type(model).__name__}")
    if not isinstance(method, str) or not method:
        raise TypeError(f"method must be a non-empty str, got {method!r}")
    metadata = {"format": FORMAT, **_metadata(model), "method": method}
    return atomic_save_safetensors(model_tensors(model), path, metadata=metadata)


def _parse(meta: dict[str, str], where: str) -> tuple[GPTConfig, QuantConfig]:
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{where} has format_version {meta.get('format_version')!r}; this code reads "
                         f"{FORMAT_VERSION!r}")
    try:
        qconfig = QuantConfig.from_dict(json.loads(meta["quant_config"]))
    except KeyError as e:
        raise ValueError(f"{where}: metadata field {e.args[0]!r} is missing") from e
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: invalid quantization metadata: {e}") from e
    return gpt_config_from(meta, where), qconfig


def read_metadata(path: str | os.PathLike) -> tuple[GPTConfig, QuantConfig, dict[str, str]]:
    """(GPTConfig, QuantConfig, raw metadata) from a quantized file's header; ValueError naming what is wrong."""
    meta = read_format_metadata(path, FORMAT, FORMAT_VERSION, _HINT)
    config, qconfig = _parse(meta, repr(str(path)))
    return config, qconfig, dict(meta)


def _build(meta: dict[str, str], tensors: dict[str, torch.Tensor], where: str) -> QuantizedGPT:
    """The quantized model the metadata describes, every tensor checked against the mode and loaded strictly."""
    config, qconfig = _parse(meta, where)
    # The skeleton: a GPT of the stored shape, quantized in the stored mode, so every buffer has the shape and dtype
    # that mode implies; its random weights are all overwritten below.
    model = quantize_model(GPT(config), qconfig)
    expected = model_tensors(model)
    where += f" (mode {qconfig.mode}" + (f", group_size {qconfig.group_size})" if qconfig.mode == "int4" else ")")
    for key, want in sorted(expected.items()):
        got = tensors.get(key)
        if got is not None and (got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape)):
            raise ValueError(f"{where}: tensor {key!r} is {got.dtype} {tuple(got.shape)} but the metadata's mode "
                             f"implies {want.dtype} {tuple(want.shape)}; the file and its metadata disagree")
    load_state_dict_strict(model, tensors, source=where)  # missing or extra tensors, named
    return model


def load_quantized(path: str | os.PathLike, device: str | torch.device = "cpu") -> QuantizedGPT:
    """The quantized model stored in `path` (eval mode), built from the mode in its metadata."""
    meta = read_format_metadata(path, FORMAT, FORMAT_VERSION, _HINT)  # the header first: another format is named
    model = _build(meta, read_safetensors_file(path), f"quantized checkpoint {str(Path(path))!r}")
    return model.to(resolve_device(device)).eval()


# A QuantizedGPT crosses process boundaries (chapter 07's workers) as the bytes of its file (`minillm.core.formats`).
register_model_format(ModelFormat(FORMAT, lambda m: isinstance(m, QuantizedGPT), _metadata, _build))


def describe(path: str | os.PathLike) -> dict[str, Any]:
    """The metadata of a quantized file as a dict (mode, group size, method, model shape), without loading it."""
    config, qconfig, meta = read_metadata(path)
    return {"quant_config": qconfig.to_dict(), "gpt_config": config.to_dict(), "method": meta.get("method")}

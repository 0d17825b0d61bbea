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
from minillm.core.model import GPT
from minillm.core.weights import load_state_dict_strict, model_tensors
from minillm.quant.linear import QuantConfig, QuantizedGPT, quantize_model

FORMAT = "minillm-quant"
FORMAT_VERSION = "1"


def save_quantized(model: QuantizedGPT, path: str | os.PathLike, method: str = "rtn") -> Path:
    """Write `model` (from `quantize_model` or GPTQ) to the safetensors file `path`, atomically. Returns the path.

    `method` records how the codes were chosen ("rtn", "gptq", ...); it is informative, the loader does not need it.
    """
    if not isinstance(model, QuantizedGPT):
        raise TypeError(f"save_quantized needs a quantized model (see quantize_model), got {type(model).__name__}")
    if not isinstance(method, str) or not method:
        raise TypeError(f"method must be a non-empty str, got {method!r}")
    metadata = {"format": FORMAT, "format_version": FORMAT_VERSION,
                "quant_config": json.dumps(model.quant_config.to_dict(), sort_keys=True),
                "gpt_config": json.dumps(model.config.to_dict(), sort_keys=True), "method": method}
    return atomic_save_safetensors(model_tensors(model), path, metadata=metadata)


def read_metadata(path: str | os.PathLike) -> tuple[GPTConfig, QuantConfig, dict[str, str]]:
    """(GPTConfig, QuantConfig, raw metadata) from a quantized file's header; ValueError naming what is wrong."""
    meta = read_format_metadata(path, FORMAT, FORMAT_VERSION,
                                "an fp32 checkpoint loads with minillm.core.checkpoint.load_checkpoint, and a "
                                "quantized one never loads without its mode")
    try:
        qconfig = QuantConfig.from_dict(json.loads(meta["quant_config"]))
        config = GPTConfig.from_dict(json.loads(meta["gpt_config"]))
    except KeyError as e:
        raise ValueError(f"{str(path)!r}: metadata field {e.args[0]!r} is missing") from e
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise ValueError(f"{str(path)!r}: invalid quantization metadata: {e}") from e
    return config, qconfig, dict(meta)


def load_quantized(path: str | os.PathLike, device: str | torch.device = "cpu") -> QuantizedGPT:
    """The quantized model stored in `path` (eval mode), built from the mode in its metadata."""
    config, qconfig, _ = read_metadata(path)
    tensors = read_safetensors_file(path)
    # The skeleton: a GPT of the stored shape, quantized in the stored mode, so every buffer has the shape and dtype
    # that mode implies; its random weights are all overwritten below.
    model = quantize_model(GPT(config), qconfig)
    expected = model_tensors(model)
    where = f"quantized checkpoint {str(Path(path))!r} (mode {qconfig.mode}"
    where += f", group_size {qconfig.group_size})" if qconfig.mode == "int4" else ")"
    for key, want in sorted(expected.items()):
        got = tensors.get(key)
        if got is not None and (got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape)):
            raise ValueError(f"{where}: tensor {key!r} is {got.dtype} {tuple(got.shape)} but the metadata's mode "
                             f"implies {want.dtype} {tuple(want.shape)}; the file and its metadata disagree")
    load_state_dict_strict(model, tensors, source=where)  # missing or extra tensors, named
    return model.to(resolve_device(device)).eval()


def describe(path: str | os.PathLike) -> dict[str, Any]:
    """The metadata of a quantized file as a dict (mode, group size, method, model shape), without loading it."""
    config, qconfig, meta = read_metadata(path)
    return {"quant_config": qconfig.to_dict(), "gpt_config": config.to_dict(), "method": meta.get("method")}

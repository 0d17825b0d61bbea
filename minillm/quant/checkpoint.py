"""Quantized checkpoints: one safetensors file holding integer codes, scales and zero points, with the mode in
the file's own metadata.

What it adds: `save_quantized(model, path)` and `load_quantized(path)`. The header of the file says what the
tensors mean; nothing is ever guessed from a file name or from dtypes:

    metadata  {"format": "minillm-quant", "format_version": "1",
               "quant_config": QuantConfig as JSON, "gpt_config": GPTConfig as JSON, "method": "rtn" | "gptq" | ...,
               "sha256": digest of every other field and every tensor (`minillm.core.io.content_sha256`)}
    tensors   transformer.h.0.attn.c_attn.qweight  int8 (3C, C) | uint8 (3C, C/2) packed int4
              transformer.h.0.attn.c_attn.scale    fp32 (3C, groups)
              transformer.h.0.attn.c_attn.zero     uint8 (3C, groups), asymmetric modes only
              ... and the fp32 rest (LayerNorms, biases, position embedding, the token embedding unless quantized)
              no head: it is the token embedding's matrix (a model with an untied head is refused on save)

Loading builds the model the metadata describes and refuses (ValueError naming the file and the field or tensor):
metadata that is missing or unreadable; a config the tensors contradict (n_layer, n_head x head size against
c_attn's rows, ...); a missing, extra, mis-shaped or mis-typed tensor (fp16 where the mode implies fp32 is not
upcast); a non-finite float, a scale <= 0, a zero point off the grid (> 2^bits - 1); and, last, content that
does not match the recorded sha256 (a flipped byte, an edited header). The specific checks run first so the
message names what is wrong; the digest catches what they cannot see (n_head=4 for a model of 2 heads of twice
the width has the same shapes). A file written before digests were recorded has no "sha256" field: it still
loads, with every other check. The digest finds damage, not forgery: whoever edits a file can recompute it.

Writes are atomic (`minillm.core.io`): a crash leaves the old file or the new one, never half of one; a path that
is a directory, or lies under a file, is a ValueError naming it. What it leaves out: the tokenizer (the shipped
one belongs to `base`), sharded files, and checking the codes themselves (every int8/uint8 code is a valid
integer; a symmetric -128 is off the restricted grid but still de-quantizes).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from minillm.core.config import GPTConfig, short_repr
from minillm.core.device import resolve_device
from minillm.core.formats import (ModelFormat, check_gpt_config, check_stored_tensors, gpt_config_from,
                                  gpt_config_json, register_model_format)
from minillm.core.io import (atomic_save_safetensors, check_output_file, check_sha256, read_format_metadata,
                             read_safetensors_file, with_sha256)
from minillm.core.model import GPT
from minillm.core.weights import load_state_dict_strict, model_tensors, untied_head
from minillm.quant.linear import QuantConfig, QuantizedGPT, QuantLinear, quantize_model
from minillm.quant.quantize import qrange

FORMAT = "minillm-quant"
FORMAT_VERSION = "1"
_HINT = ("an fp32 checkpoint loads with minillm.core.checkpoint.load_checkpoint, and a quantized one never loads "
         "without its mode")


def _fields(model: QuantizedGPT) -> dict[str, str]:
    """The header fields that say what the tensors mean (everything but the method, which only people read)."""
    return {"format_version": FORMAT_VERSION, "quant_config": json.dumps(model.quant_config.to_dict(), sort_keys=True),
            "gpt_config": gpt_config_json(model.config)}


def _metadata(model: QuantizedGPT) -> dict[str, str]:
    """The fields plus their digest, for the bytes a worker receives (`minillm.core.formats`), checked by `_build`."""
    _check_tied(model, "model_to_bytes (model)")
    return with_sha256({"format": FORMAT, **_fields(model)}, model_tensors(model))


def save_quantized(model: QuantizedGPT, path: str | os.PathLike, method: str = "rtn") -> Path:
    """Write `model` (from `quantize_model` or GPTQ) to the safetensors file `path`, atomically. Returns the path.

    `method` records how the codes were chosen ("rtn", "gptq", ...); it is informative, the loader does not need it.
    The metadata records a sha256 of every field and tensor, checked on load. A `path` that is a directory, ends in
    a separator ('dir/') or whose parent is a file, is a ValueError naming it; so is what loading would refuse (a
    `quant_config` the layers were not built with, a tensor not fp32 or not finite, a scale <= 0, a zero point off
    the grid, a buffer of another dtype or shape than the mode implies: the loader's own checks run on the tensors
    first), naming it, before anything is written; and what the file cannot hold: an untied head (its own
    `lm_head.weight`: the file stores the head tied to the token embedding) or a LayerNorm eps other than the
    config's (`check_layernorm_eps`).
    """
    if not isinstance(model, QuantizedGPT):
        raise TypeError(f"save_quantized needs a quantized model (see quantize_model), got {type(model).__name__}")
    if not isinstance(method, str) or not method:
        raise TypeError(f"method must be a non-empty str, got {method!r}")
    if not _full_width(model):
        raise TypeError("save_quantized stores quantized models of full MLP width; this one was MLP-pruned before it "
                        "was quantized, and no file format holds both (save the pruned model, quantize on load)")
    out = check_output_file(path, "save_quantized: path")
    if out is None:
        raise ValueError(f"save_quantized: path must name a file, got {path!r}")
    _check_modes(model, "save_quantized (model)")
    _check_tied(model, "save_quantized (model)")
    tensors = model_tensors(model)
    _check_saveable(model, tensors, "save_quantized (model)")
    metadata = with_sha256({"format": FORMAT, **_fields(model), "method": method}, tensors)
    # What load_quantized would do with these exact tensors and fields, before anything is written: a buffer
    # replaced after quantization (float codes, another shape) would otherwise be saved, then refused on load.
    try:
        _build(metadata, tensors, "save_quantized (model)")
    except ValueError as e:
        raise ValueError(f"save_quantized: the file would not load back, so nothing was written: {e}") from e
    return atomic_save_safetensors(tensors, out, metadata=metadata)


def _parse(meta: dict[str, str], where: str) -> tuple[GPTConfig, QuantConfig]:
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{where} has format_version {meta.get('format_version')!r}; this code reads "
                         f"{FORMAT_VERSION!r}")
    try:
        qconfig = QuantConfig.from_dict(json.loads(meta["quant_config"]))
    except KeyError as e:
        raise ValueError(f"{where}: metadata field {e.args[0]!r} is missing") from e
    except (json.JSONDecodeError, TypeError, ValueError, RecursionError) as e:  # RecursionError: JSON nested deep
        raise ValueError(f"{where}: invalid quantization metadata: {type(e).__name__}: {str(e)[:100]}") from e
    return gpt_config_from(meta, where), qconfig


def read_metadata(path: str | os.PathLike) -> tuple[GPTConfig, QuantConfig, dict[str, str]]:
    """(GPTConfig, QuantConfig, raw metadata) from a quantized file's header; ValueError naming what is wrong."""
    meta = read_format_metadata(path, FORMAT, FORMAT_VERSION, _HINT)
    config, qconfig = _parse(meta, repr(str(path)))
    return config, qconfig, dict(meta)


def _check_grid(model: QuantizedGPT, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Every QuantLinear's stored scales > 0 and zero points on the grid [0, 2^bits - 1]; ValueError naming the tensor.

    subtle: a scale of 0 de-quantizes every code to 0 and a negative one flips the weight's sign; neither raises
    anywhere later. A uint8 zero point always fits int8's grid, but int4's stops at 15. NaN scales were refused
    already (`check_stored_tensors`: every float is finite).
    """
    _, zmax = qrange(model.quant_config.bits, symmetric=False)
    for name, module in model.named_modules():
        if not isinstance(module, QuantLinear):
            continue
        scale = tensors.get(f"{name}.scale")
        if scale is not None and scale.numel() and not bool((scale > 0).all()):
            n = int((scale <= 0).sum())
            raise ValueError(f"{where}: tensor {name + '.scale'!r} holds {n} scale{'s' * (n != 1)} <= 0 (smallest "
                             f"{scale.min().item():g}); a scale must be > 0")
        zero = tensors.get(f"{name}.zero")
        if zero is not None and zero.numel() and int(zero.max()) > zmax:
            raise ValueError(f"{where}: tensor {name + '.zero'!r} holds zero point {int(zero.max())}, off the "
                             f"{model.quant_config.bits}-bit grid [0, {zmax}]")


def _check_modes(model: QuantizedGPT, where: str) -> None:
    """Every QuantLinear built with `model.quant_config`, the config the file records; ValueError naming it otherwise.

    subtle: `quant_config` is a plain attribute; reassigned (int4 over int8 layers), the file would record a mode
    its own tensors contradict, and loading it would be refused."""
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear) and module.config != model.quant_config:
            raise ValueError(f"{where}: model.quant_config {model.quant_config!r} is not the config its layer {name!r} "
                             f"was built with, {module.config!r}; the file would record a mode its tensors "
                             "contradict")


def _check_tied(model: QuantizedGPT, where: str) -> None:
    """A ValueError naming lm_head when it has a weight of its own: the file stores the head once, as the token
    embedding (`minillm.core.weights.TIED_KEYS`), and loading would tie it back, a model with other logits."""
    if untied_head(model):
        raise ValueError(f"{where}: model.lm_head has a weight of its own (other values than transformer.wte's); "
                         "the format stores the head tied to the token embedding, and the loaded model would give "
                         "other logits")


def _check_saveable(model: QuantizedGPT, tensors: dict[str, torch.Tensor], where: str) -> None:
    """What loading refuses, refused before a file is written (ValueError naming the tensor): a float tensor that is
    not fp32 (e.g. after `model.half()`), a non-finite value, a scale <= 0, a zero point off the grid."""
    for key, t in sorted(tensors.items()):
        if t.is_floating_point() and t.dtype != torch.float32:
            raise ValueError(f"{where}: tensor {short_repr(key)} is {t.dtype}; the format stores fp32 and loading "
                             f"would refuse it (cast the model back with .float())")
    check_stored_tensors({}, tensors, where)  # every float finite
    _check_grid(model, tensors, where)


def _build(meta: dict[str, str], tensors: dict[str, torch.Tensor], where: str) -> QuantizedGPT:
    """The quantized model the metadata describes, every tensor checked against the mode and loaded strictly.

    The checks, in order (the first that fails is a ValueError naming `where` and what): the metadata parses; the
    GPTConfig fits the tensors' shapes; every tensor has the dtype and shape the mode implies, and every float is
    finite; scales > 0 and zero points on the grid; no tensor missing or extra; the recorded sha256, when there is
    one (a file from before digests has none). The same checks run for a file and for bytes sent to a worker.
    """
    config, qconfig = _parse(meta, where)
    check_gpt_config(config, tensors, where)  # before the skeleton: names the field, bounds the allocation
    # The skeleton: a GPT of the stored shape, quantized in the stored mode, so every buffer has the shape and dtype
    # that mode implies; its random weights are all overwritten below.
    try:  # a config the tensors' shapes cannot take (int4's group size past a re-signed file's width)
        model = quantize_model(GPT(config), qconfig)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: its quant_config {qconfig} does not fit its model: {e}") from e
    where += f" (mode {qconfig.mode}" + (f", group_size {qconfig.group_size})" if qconfig.mode == "int4" else ")")
    check_stored_tensors(model_tensors(model), tensors, where, implied_by="the metadata's mode")
    _check_grid(model, tensors, where)
    load_state_dict_strict(model, tensors, source=where)  # missing or extra tensors, named
    check_sha256(meta, tensors, where)  # last: whatever the checks above could not see
    return model


def load_quantized(path: str | os.PathLike, device: str | torch.device = "cpu") -> QuantizedGPT:
    """The quantized model stored in `path` (eval mode), built from the mode in its metadata."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike naming a file, got {type(path).__name__}")
    where = resolve_device(device)  # a bad device is named before the file is read
    meta = read_format_metadata(path, FORMAT, FORMAT_VERSION, _HINT)  # the header first: another format is named
    model = _build(meta, read_safetensors_file(path), f"quantized checkpoint {str(Path(path))!r}")
    return model.to(where).eval()


# A QuantizedGPT crosses process boundaries (chapter 07's workers) as the bytes of its file (`minillm.core.formats`).
def _full_width(model: QuantizedGPT) -> bool:
    """Every MLP at 4C: the file rebuilds `quantize_model(GPT(config))`, which has no narrowed MLPs."""
    return all(b.mlp.c_fc.out_features == 4 * model.config.n_embd for b in model.transformer.h)


register_model_format(ModelFormat(FORMAT, lambda m: isinstance(m, QuantizedGPT) and _full_width(m), _metadata,
                                  _build))


def describe(path: str | os.PathLike) -> dict[str, Any]:
    """The metadata of a quantized file as a dict (mode, group size, method, model shape), verified first by the
    checks `load_quantized` runs (its tensors read, the sha256 compared): an edited field (method 'rtn' changed to
    'gptq') is the loader's ValueError naming the file, never reported as if it were true."""
    config, qconfig, meta = read_metadata(path)
    _build(meta, read_safetensors_file(path), f"quantized checkpoint {str(Path(path))!r}")  # what load_quantized checks
    return {"quant_config": qconfig.to_dict(), "gpt_config": config.to_dict(), "method": meta.get("method")}

"""Pruned checkpoints: one safetensors file, the model's shape after pruning and how it was pruned in its metadata.

What it adds: `save_pruned(model, path, method)` and `load_pruned(path)`. A structurally pruned model has MLPs
narrower than 4C (a different width per block, in general), so its shape is no longer its GPTConfig alone:

    metadata  {"format": "minillm-pruned", "format_version": "1", "gpt_config": GPTConfig as JSON (head_dim set
               when heads were removed), "mlp_hidden": [768, 768, ...] (each block's MLP width),
               "method": "wanda 50%" | "2:4 magnitude" | ..., "pattern": "dense" | "unstructured" | "2:4",
               "block_sparsity": "0.5000" (share of zeros in the block linears, as saved),
               "sha256": digest of every other field and every tensor (`minillm.core.io.content_sha256`)}
    tensors   the GPT's state dict (the tied head once), all fp32, c_fc (k, C) and c_proj (C, k) at each block's
              width k

Loading builds a GPT of the stored config, narrows each MLP to its stored width and refuses (ValueError naming the
file and the field or tensor): metadata that is missing or unreadable; a config or mlp_hidden the tensors'
shapes contradict (n_head x head size against c_attn's rows, each width against its c_fc); a missing, extra,
mis-shaped or non-fp32 tensor (fp16 is not upcast); a non-finite value; zeros that break what the metadata says
(the 2:4 pattern exactly, the block sparsity to the stored four decimals); and, last, content that does not
match the recorded sha256 (a flipped byte in a weight or a LayerNorm, an edited header). The specific checks run
first so the message names what is wrong; the digest catches what they cannot see. A file written before digests
were recorded has no "sha256" field: it still loads, with every other check. The digest finds damage, not
forgery: whoever edits a file can recompute it.

Writes are atomic (`minillm.core.io`); a path that is a directory, or lies under a file, is a ValueError naming
it. Unstructured zeros are stored as dense zeros: the file saves no bytes (see `semi_structured.stored_bytes` for
what a sparse format would), it keeps the model loadable everywhere.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from minillm.core.config import GPTConfig, check_choice, short_repr
from minillm.core.device import resolve_device
from minillm.core.formats import (ModelFormat, check_gpt_config, check_stored_tensors, gpt_config_from,
                                  gpt_config_json, register_model_format)
from minillm.core.io import (atomic_save_safetensors, check_output_file, check_sha256, read_format_metadata,
                             read_safetensors_file, with_sha256)
from minillm.core.model import GPT
from minillm.core.weights import load_state_dict_strict, model_tensors
from minillm.prune.masks import is_nm_sparse
from minillm.prune.structured import mlp_widths, shrink_mlp
from minillm.prune.unstructured import block_weights, check_prunable, weight_sparsity

FORMAT = "minillm-pruned"
FORMAT_VERSION = "1"
PATTERNS = ("dense", "unstructured", "2:4")
_HINT = "a dense checkpoint loads with minillm.core.checkpoint.load_checkpoint"


def _is_2_4(weight: torch.Tensor) -> bool:
    """Whether a block linear's weight (out, in) is 2:4 sparse; a width that is no multiple of 4 (an MLP shrunk to
    an odd width) has no 2:4 layout at all, so it is not."""
    return weight.shape[1] % 4 == 0 and is_nm_sparse(weight, 2, 4)


def _pattern_of(model: GPT) -> str:
    """The strongest pattern the block linears' zeros satisfy: "2:4", else "unstructured" with zeros, else "dense"."""
    weights = block_weights(model)
    if all(_is_2_4(w) for w in weights):
        return "2:4"
    return "unstructured" if weight_sparsity(model)["blocks"] > 0 else "dense"


def _fields(model: GPT, pattern: str | None = None) -> dict[str, str]:
    """The header fields that say the model's shape and what its zeros promise (checked again on load)."""
    return {"format_version": FORMAT_VERSION, "gpt_config": gpt_config_json(model.config),
            "mlp_hidden": json.dumps(mlp_widths(model)), "pattern": pattern or _pattern_of(model),
            "block_sparsity": f"{weight_sparsity(model)['blocks']:.4f}"}


def _metadata(model: GPT, pattern: str | None = None) -> dict[str, str]:
    """The fields plus their digest, for the bytes a worker receives (`minillm.core.formats`), checked by `_build`."""
    return with_sha256({"format": FORMAT, **_fields(model, pattern)}, model_tensors(model))


def save_pruned(model: GPT, path: str | os.PathLike, method: str, pattern: str = "unstructured") -> Path:
    """Write a pruned `model` to the safetensors file `path`, atomically; returns the path.

    `method` says how it was pruned (free text, kept for people); `pattern` is checked now and on load: "2:4"
    needs every block linear 2:4 sparse, "dense" means no zeros were imposed (structured pruning alone: a block
    sparsity of 0.0000). The metadata records a sha256 of every field and tensor, checked on load. A `path` that is
    a directory (or ends in a slash), or whose parent is a file, is a ValueError naming it; so is a tensor loading would refuse (not
    fp32, e.g. after `model.half()`, not finite, missing or of another shape: the loader's own checks run on the
    tensors first) or a LayerNorm eps other than the config's, naming it, before anything is written. A model whose
    block linears are not plain nn.Linear (quantized, or prepared for QAT) is a TypeError naming the layer: the
    file would load back as a plain GPT.
    """
    check_prunable(model, "save_pruned")  # a quantized or QAT model would load back as a plain GPT
    if not isinstance(method, str) or not method:
        raise TypeError(f"method must be a non-empty str, got {method!r}")
    pattern = check_choice("pattern", pattern, PATTERNS)
    if pattern == "2:4" and not all(_is_2_4(w) for w in block_weights(model)):
        raise ValueError("pattern '2:4' but some block linear has more than 2 nonzeros in a group of 4")
    sparsity = weight_sparsity(model)["blocks"]
    if pattern == "dense" and f"{sparsity:.4f}" != "0.0000":
        raise ValueError(f"pattern 'dense' but the block linears hold {sparsity:.4f} zeros; save zeros that pruning "
                         "imposed as pattern 'unstructured' (or '2:4')")
    out = check_output_file(path, "save_pruned: path")
    if out is None:
        raise ValueError(f"save_pruned: path must name a file, got {path!r}")
    tensors = model_tensors(model)
    for key, t in sorted(tensors.items()):
        if t.dtype != torch.float32:
            raise ValueError(f"save_pruned: tensor {short_repr(key)} is {t.dtype}; the format stores fp32 and "
                             f"loading would refuse it (cast the model back with .float())")
    check_stored_tensors({}, tensors, "save_pruned (model)")  # every value finite, as loading checks
    metadata = with_sha256({"format": FORMAT, **_fields(model, pattern), "method": method}, tensors)
    # What load_pruned would do with these exact tensors and fields, before anything is written: a layer the file
    # cannot rebuild (a c_fc without bias, wider than 4C, a c_proj that does not match it) would otherwise be saved,
    # then refused on load.
    try:
        _build(metadata, tensors, "save_pruned (model)")
    except ValueError as e:
        raise ValueError(f"save_pruned: the file would not load back, so nothing was written: {e}") from e
    return atomic_save_safetensors(tensors, out, metadata=metadata)


def _parse(meta: dict[str, str], where: str) -> tuple[GPTConfig, list[int]]:
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{where} has format_version {meta.get('format_version')!r}; this code reads "
                         f"{FORMAT_VERSION!r}")
    config = gpt_config_from(meta, where)
    missing = [f for f in ("mlp_hidden", "block_sparsity", "pattern") if f not in meta]
    if missing:
        raise ValueError(f"{where}: metadata field {missing[0]!r} is missing")
    pattern = meta["pattern"]
    try:
        widths = json.loads(meta["mlp_hidden"])
    except (ValueError, RecursionError) as e:  # json's errors, an int past Python's digit limit, nesting too deep
        raise ValueError(f"{where}: metadata field mlp_hidden {short_repr(meta['mlp_hidden'])} is not a JSON list: "
                         f"{type(e).__name__}") from e
    try:
        sparsity = float(meta["block_sparsity"])
    except ValueError as e:
        raise ValueError(f"{where}: metadata field block_sparsity {meta['block_sparsity']!r} is not a number") from e
    if not isinstance(widths, list) or len(widths) != config.n_layer or \
            not all(type(w) is int and 0 < w <= 4 * config.n_embd for w in widths):  # JSON true is a bool, no width
        raise ValueError(f"{where}: mlp_hidden must list {config.n_layer} widths in [1, {4 * config.n_embd}], "
                         f"got {meta['mlp_hidden']!r}")
    if pattern not in PATTERNS:
        raise ValueError(f"{where}: metadata field pattern {pattern!r} is not one of {PATTERNS}")
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"{where}: metadata field block_sparsity {meta['block_sparsity']!r} is not in [0, 1)")
    return config, widths


def read_metadata(path: str | os.PathLike) -> tuple[GPTConfig, list[int], dict[str, str]]:
    """(GPTConfig, MLP widths, raw metadata) from a pruned file's header; ValueError naming what is wrong."""
    meta = read_format_metadata(path, FORMAT, FORMAT_VERSION, _HINT)
    config, widths = _parse(meta, repr(str(path)))
    return config, widths, dict(meta)


def _check_widths(widths: list[int], tensors: dict[str, torch.Tensor], where: str) -> None:
    """Each block's stored c_fc (k, C) against its width in mlp_hidden; ValueError naming the field and the tensor."""
    for i, width in enumerate(widths):
        t = tensors.get(f"transformer.h.{i}.mlp.c_fc.weight")
        if t is not None and t.dim() >= 1 and t.shape[0] != width:
            raise ValueError(f"{where}: metadata field mlp_hidden[{i}] = {width} but tensor "
                             f"'transformer.h.{i}.mlp.c_fc.weight' has shape {tuple(t.shape)} ({t.shape[0]} hidden "
                             "units); the metadata and the tensors disagree")


def _build(meta: dict[str, str], tensors: dict[str, torch.Tensor], where: str) -> GPT:
    """The pruned model the metadata describes: MLPs at their widths, tensors loaded strictly, zeros checked.

    The checks, in order (the first that fails is a ValueError naming `where` and what): the metadata parses; the
    GPTConfig and mlp_hidden fit the tensors' shapes; every tensor is fp32 of the skeleton's shape, and finite; no
    tensor missing or extra; the zeros keep the pattern and block sparsity the metadata says; the recorded sha256,
    when there is one (a file from before digests has none). The same checks run for a file and for bytes sent to
    a worker.
    """
    config, widths = _parse(meta, where)
    check_gpt_config(config, tensors, where)  # before the skeleton: names the field, bounds the allocation
    _check_widths(widths, tensors, where)
    skeleton = GPT(config)  # random weights, all overwritten below
    model = shrink_mlp(skeleton, [torch.arange(w) for w in widths])
    check_stored_tensors(model_tensors(model), tensors, where, implied_by="the metadata (gpt_config, mlp_hidden)")
    load_state_dict_strict(model, tensors, source=where)
    if meta["pattern"] == "2:4" and not all(_is_2_4(w) for w in block_weights(model)):
        raise ValueError(f"{where}: metadata says 2:4 but the weights break the pattern")
    got = weight_sparsity(model)["blocks"]
    if f"{got:.4f}" != meta["block_sparsity"]:
        raise ValueError(f"{where}: metadata says block sparsity {meta['block_sparsity']} (field block_sparsity) but "
                         f"the weights hold {got:.4f}")
    if meta["pattern"] == "dense" and f"{got:.4f}" != "0.0000":
        raise ValueError(f"{where}: metadata field pattern says 'dense' but the block linears hold {got:.4f} zeros")
    check_sha256(meta, tensors, where)  # last: whatever the checks above could not see
    return model


def load_pruned(path: str | os.PathLike, device: str | torch.device = "cpu") -> GPT:
    """The pruned model stored in `path` (eval mode), its MLPs at their stored widths, its zeros checked."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike naming a file, got {type(path).__name__}")
    meta = read_format_metadata(path, FORMAT, FORMAT_VERSION, _HINT)  # the header first: another format is named
    model = _build(meta, read_safetensors_file(path), f"pruned checkpoint {str(Path(path))!r}")
    return model.to(resolve_device(device)).eval()


def _is_mlp_pruned(model: object) -> bool:
    """A plain GPT class whose MLPs are narrower than 4C somewhere (chapter 10's structured pruning)."""
    return type(model) is GPT and any(w != 4 * model.config.n_embd for w in mlp_widths(model))


# A GPT with narrowed MLPs crosses process boundaries (chapter 07's workers) as the bytes of its file
# (`minillm.core.formats`); a GPT of full width, zeros or not, is the plain "minillm-gpt" format.
register_model_format(ModelFormat(FORMAT, _is_mlp_pruned, _metadata, _build))


def describe(path: str | os.PathLike) -> dict[str, Any]:
    """The metadata of a pruned file as a dict, verified first by the checks `load_pruned` runs (its tensors read,
    the zeros counted, the sha256 compared): an edited field (block sparsity 0.9000 on a half-zero model) is the
    loader's ValueError naming the file, never reported as if it were true.

    A file without the "method" field (the loader never needs it, so such a file still loads) has nothing to
    describe it by: a ValueError naming the file and the field."""
    config, widths, meta = read_metadata(path)
    if "method" not in meta:
        raise ValueError(f"{str(path)!r}: metadata field 'method' is missing, so the file does not say how it was "
                         "pruned (load_pruned still loads it)")
    _build(meta, read_safetensors_file(path), f"pruned checkpoint {str(Path(path))!r}")  # what load_pruned checks
    return {"gpt_config": config.to_dict(), "mlp_hidden": widths, "method": meta["method"],
            "pattern": meta["pattern"], "block_sparsity": float(meta["block_sparsity"])}

"""Model formats by name: how any minillm model becomes safetensors bytes and comes back, whatever its modules.

What it adds: `model_to_bytes(model) -> bytes` and `model_from_bytes(data, device) -> model`, for a model that must
cross a process boundary (chapter 07's prefill and decode workers, chapter 14's ranks). A quantized model
(chapter 09: int8/int4 codes, scales, zero points) or a structurally pruned one (chapter 10: narrower MLPs) is
not a `GPT(config)` with other numbers in it: its modules have other shapes and other buffers, so rebuilding
`GPT(config)` on the other side and loading the weights would fail, or worse. The bytes are the ones its
checkpoint file would hold: safetensors tensors plus a header whose metadata says `format`, and the format
(a name in this table) says how to build the skeleton the tensors load into, strictly.

    model ──claims?──▶ ModelFormat "minillm-quant" ──metadata + tensors──▶ safetensors bytes ──▶ (pipe) ──▶
        bytes ──header "format"──▶ ModelFormat.build(metadata, tensors) ──▶ the same model, checked

Shipped formats (`SHIPPED_FORMATS`: name -> the module that registers it, imported on first use, as the
attention backends of `minillm.paged.backends` are):

    minillm-gpt     a plain GPT, head-pruned ones included (the config says n_head and head_dim)
    minillm-quant   chapter 09's QuantizedGPT (the header holds its QuantConfig)
    minillm-pruned  chapter 10's GPT with narrowed MLPs (the header holds each block's width)

Loading runs no code (safetensors, never pickle), checks a SHA-256 of the bytes when the sender gives one, and
refuses a header or tensors that disagree with the format (ValueError naming what). The quantized and pruned
formats check more, in their `build`, so a file and the bytes of a worker get the same checks: the config against
the tensors' shapes (`check_gpt_config`), every tensor's dtype and finiteness (`check_stored_tensors`), and the
content digest their metadata records (`minillm.core.io.check_sha256`). What it leaves out: a model
that combines two formats (a quantized *and* MLP-pruned model has no format: `model_to_bytes` says so), and
sharding a model across the bytes of several ranks (chapter 14 ships the whole model and shards on arrival).
"""

from __future__ import annotations

import hashlib
import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
import torch
import torch.nn as nn

from minillm.core.config import check_instance, check_label, check_tensor_dict, GPTConfig, short_repr
from minillm.core.device import resolve_device
from minillm.core.model import GPT
from minillm.core.weights import load_state_dict_strict, model_tensors


@dataclass(frozen=True)
class ModelFormat:
    """One way a model is written as tensors + string metadata, and read back.

    `claims(model)`: is this model this format's kind? (the shipped formats' claims never overlap)
    `metadata(model)`: the header fields besides "format" (strings), everything `build` needs besides the tensors
    `build(metadata, tensors, where)`: the model, with every tensor loaded strictly; ValueError naming `where`
    """

    name: str
    claims: Callable[[nn.Module], bool]
    metadata: Callable[[nn.Module], dict[str, str]]
    build: Callable[[dict[str, str], dict[str, torch.Tensor], str], nn.Module]


SHIPPED_FORMATS: dict[str, str] = {
    "minillm-gpt": "minillm.core.formats",  # this module, below
    "minillm-quant": "minillm.quant.checkpoint",  # chapter 09
    "minillm-pruned": "minillm.prune.checkpoint",  # chapter 10
}

_FORMATS: dict[str, ModelFormat] = {}


def register_model_format(fmt: ModelFormat, replace: bool = False) -> None:
    """Make `fmt` known by its name; a taken name is a ValueError unless `replace=True`."""
    if not isinstance(fmt, ModelFormat):
        raise TypeError(f"register_model_format needs a ModelFormat, got {type(fmt).__name__}")
    if fmt.name in _FORMATS and not replace and _FORMATS[fmt.name] is not fmt:
        raise ValueError(f"model format {fmt.name!r} is already registered; pass replace=True to override it")
    _FORMATS[fmt.name] = fmt


def _import_shipped() -> None:
    for module in SHIPPED_FORMATS.values():
        importlib.import_module(module)


def model_formats() -> tuple[str, ...]:
    """Every known format name (the shipped ones, imported now, and any registered)."""
    _import_shipped()
    return tuple(sorted(_FORMATS))


def format_of(model: nn.Module) -> ModelFormat:
    """The one format that claims `model`; a TypeError naming the model's type and the known formats otherwise."""
    _import_shipped()
    found = [f for f in _FORMATS.values() if f.claims(model)]
    if len(found) != 1:
        what = "no model format claims" if not found else f"formats {[f.name for f in found]} all claim"
        raise TypeError(f"{what} a {type(model).__name__}; known formats: {sorted(_FORMATS)} (a model must be "
                        "one of them to cross a process boundary)")
    return found[0]


def model_to_bytes(model: nn.Module) -> bytes:
    """The model as safetensors bytes: its tensors (on the CPU) and a header naming its format."""
    from safetensors.torch import save

    fmt = format_of(model)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model_tensors(model).items()}
    half = sorted({str(v.dtype) for v in tensors.values() if v.is_floating_point() and v.dtype != torch.float32})
    if half:
        raise TypeError(f"model_to_bytes sends fp32 models (every format rebuilds fp32 skeletons); this one holds "
                        f"{half} tensors: send model.float() and convert on arrival")
    return save(tensors, metadata={**fmt.metadata(model), "format": fmt.name})


def sha256(data: bytes) -> str:
    """The hex digest a sender ships beside the bytes, so the receiver can tell a torn transfer from a model."""
    return hashlib.sha256(data).hexdigest()


def read_header_metadata(data: bytes, where: str = "model bytes") -> dict[str, str]:
    """The string metadata of safetensors bytes (the header alone), or ValueError naming `where`.

    Layout: 8 bytes little-endian header length, then that many bytes of JSON; "__metadata__" holds the strings."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"{where} must be bytes, got {type(data).__name__}")
    n = int.from_bytes(bytes(data[:8]), "little") if len(data) >= 8 else -1
    if n < 0 or 8 + n > len(data):
        raise ValueError(f"{where}: {len(data)} bytes cannot hold a safetensors header (truncated?)")
    try:
        header = json.loads(bytes(data[8 : 8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: the safetensors header is not valid JSON (truncated or corrupt?): {e}") from e
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        raise ValueError(f"{where}: the safetensors header has no metadata, so no format says what it holds")
    return meta


def model_from_bytes(data: bytes, device: str | torch.device = "cpu", expected_sha256: str | None = None
                     ) -> nn.Module:
    """The model `model_to_bytes` wrote, built by its format, on `device`, in eval mode.

    A digest that does not match, a header without a known format, or tensors the format refuses are ValueErrors
    naming what is wrong."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    if expected_sha256 is not None and sha256(data) != expected_sha256:
        raise ValueError(f"model bytes: SHA-256 {sha256(data)[:16]}... does not match the sender's "
                         f"{expected_sha256[:16]}... ({len(data)} bytes arrived): the transfer is torn")
    meta = read_header_metadata(data)
    name = meta.get("format")
    _import_shipped()
    if not isinstance(name, str) or name not in _FORMATS:
        raise ValueError(f"model bytes declare format {name!r}; known formats: {sorted(_FORMATS)}")
    try:
        tensors = load(bytes(data))
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise ValueError(f"model bytes ({name}) are not valid safetensors (truncated or corrupt?): {e}") from e
    model = _FORMATS[name].build(meta, tensors, f"model bytes ({name})")
    return model.to(resolve_device(device)).eval()


# ------------------------------------------------------------------------- checks a format's build can share


def _shape_of(tensors: dict[str, torch.Tensor], *keys: str) -> tuple[str, tuple[int, ...]] | None:
    """(key, shape) of the first of `keys` present in `tensors`, or None (a missing tensor is named by the strict
    load later, with the shape the model expects)."""
    for key in keys:
        if key in tensors:
            return key, tuple(tensors[key].shape)
    return None


def check_gpt_config(config: GPTConfig, tensors: dict[str, torch.Tensor], where: str) -> None:
    """The stored GPTConfig against the tensors' shapes, before a skeleton is built from it; ValueError naming the
    config field and the tensor.

    The skeleton's strict load finds most lies too, but names only a tensor; this names the field, and refuses a
    config far bigger than the file (n_layer, vocab_size, block_size) before allocating its skeleton. It checks:
    the blocks stored (0..n_layer-1), wpe (block_size, C), the token embedding's (V, C) rows (a quantized one is
    `wte.table.qweight`), and each c_attn's 3 * n_head * head_size rows, the heads' width being n_embd / n_head or,
    for a head-pruned model, the config's explicit head_dim. subtle: n_head alone can lie without changing a shape
    (2 heads of 16 or 4 of 8 are both 32 columns); only a recorded digest (`minillm.core.io.check_sha256`) finds that.
    """
    check_instance("config", config, GPTConfig, "a GPTConfig")
    check_tensor_dict("tensors", tensors)
    blocks = sorted({int(k.split(".")[2]) for k in tensors if k.startswith("transformer.h.") and
                     k.split(".")[2].isdigit()})
    if blocks and blocks != list(range(config.n_layer)):
        raise ValueError(f"{where}: gpt_config n_layer={config.n_layer} but the tensors hold blocks "
                         f"{blocks[0]}..{blocks[-1]} ({len(blocks)} blocks); the metadata and the tensors disagree")
    C = config.n_embd
    found = _shape_of(tensors, "transformer.wpe.weight")
    if found is not None and found[1] != (config.block_size, C):
        raise ValueError(f"{where}: gpt_config block_size={config.block_size}, n_embd={C} imply "
                         f"{(config.block_size, C)} but tensor {found[0]!r} has shape {found[1]}")
    found = _shape_of(tensors, "transformer.wte.weight", "transformer.wte.table.qweight")
    if found is not None and found[1][0] != config.vocab_size:
        raise ValueError(f"{where}: gpt_config vocab_size={config.vocab_size} but tensor {found[0]!r} has shape "
                         f"{found[1]}")
    hs = "head_dim" if config.head_dim is not None else "head_size n_embd/n_head"
    for i in range(config.n_layer):
        found = _shape_of(tensors, f"transformer.h.{i}.attn.c_attn.weight", f"transformer.h.{i}.attn.c_attn.qweight")
        if found is not None and found[1][0] != 3 * config.attn_dim:
            raise ValueError(f"{where}: gpt_config n_head={config.n_head} x {hs}={config.head_size} gives q, k, v "
                             f"of {config.attn_dim} rows each, but tensor {found[0]!r} has shape {found[1]} "
                             f"({found[1][0]} rows = 3 x {found[1][0] / 3:g}); the metadata and the tensors disagree")


def check_stored_tensors(expected: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], where: str,
                         implied_by: str = "the metadata") -> None:
    """Every stored tensor the skeleton has (`expected`, its `model_tensors`) has exactly its dtype and shape, and
    every floating-point tensor is finite; ValueError naming `where` and the tensor.

    subtle: `load_state_dict_strict` casts to the model's dtype, so without this an fp16 file where the format
    says fp32 (or int8 codes where it says uint8) would load silently, converted. Missing and extra tensors are
    left to the strict load, which names them with the shape the model expects.
    """
    check_tensor_dict("expected", expected)
    check_tensor_dict("tensors", tensors)
    for key, want in sorted(expected.items()):
        got = tensors.get(key)
        if got is not None and (got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape)):
            raise ValueError(f"{where}: tensor {short_repr(key)} is {got.dtype} {tuple(got.shape)} but {implied_by} "
                             f"implies {want.dtype} {tuple(want.shape)}; the file and its metadata disagree")
    for key, t in sorted(tensors.items()):
        if t.is_floating_point():
            bad = ~torch.isfinite(t)
            if bad.any():
                n = int(bad.sum())
                raise ValueError(f"{where}: tensor {short_repr(key)} holds {n} non-finite value{'s' * (n != 1)} "
                                 f"(first: {t[bad][0].item()}); a stored model must be finite")


# ------------------------------------------------------------------------------------------------- minillm-gpt


def gpt_config_from(meta: dict[str, str], where: str) -> GPTConfig:
    """The GPTConfig stored as JSON in the header field "gpt_config"; ValueError naming `where` otherwise."""
    check_instance("meta", meta, dict, "a dict of header metadata")
    where = check_label("where", where)
    try:
        return GPTConfig.from_dict(json.loads(meta["gpt_config"]))
    except KeyError:
        raise ValueError(f"{where}: metadata field 'gpt_config' is missing") from None
    except (TypeError, ValueError, RecursionError) as e:  # ValueError: json's, and an int past Python's digit limit
        raise ValueError(f"{where}: invalid gpt_config metadata: {type(e).__name__}: {str(e)[:120]}") from e


def gpt_config_json(config: GPTConfig) -> str:
    return json.dumps(check_instance("config", config, GPTConfig, "a GPTConfig").to_dict(), sort_keys=True)


def _is_plain_gpt(model: nn.Module) -> bool:
    """A GPT whose tensors have exactly the shapes GPT(its config) has (no narrowed MLP, no extra buffer)."""
    if type(model) is not GPT:
        return False
    with torch.device("meta"):
        skeleton = GPT(model.config)  # shapes only: no memory, no random init worth the name
    want = {k: tuple(v.shape) for k, v in model_tensors(skeleton).items()}
    return want == {k: tuple(v.shape) for k, v in model_tensors(model).items()}


def _build_gpt(meta: dict[str, str], tensors: dict[str, torch.Tensor], where: str) -> GPT:
    model = GPT(gpt_config_from(meta, where))
    check_stored_tensors(model_tensors(model), tensors, where)  # fp32 everywhere, finite
    load_state_dict_strict(model, tensors, source=where)
    return model


register_model_format(ModelFormat("minillm-gpt", _is_plain_gpt, lambda m: {"gpt_config": gpt_config_json(m.config)},
                                  _build_gpt))


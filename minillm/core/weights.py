"""Strict weight loading, shared by our checkpoints (`core.checkpoint`) and Hugging Face's (`core.hf`).

What it adds: `load_state_dict_strict`, which copies a dict of tensors into a model only if every tensor is there,
with the right shape, and nothing else is, naming the first key that is not; and `model_tensors`, the tensors a
checkpoint stores. It works on any module with GPT's parameter names and imports no model class, so both
checkpoint formats and `GPT.from_hf` can use it without importing each other.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from minillm.core.config import check_instance, check_label, check_tensor_dict, short_repr

# subtle: the head shares its matrix with the token embedding (weight tying). safetensors refuses two names for
# one storage, and storing it twice would waste 4 MB, so the head is dropped on save and re-tied by GPT().
TIED_KEYS = ("lm_head.weight",)


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint stores: the state dict minus the tied head. A model whose head was untied (given a
    weight of its own) is a ValueError naming model.lm_head: every format here would drop that weight on save, and
    the model would come back with the embedding as its head."""
    check_instance("model", model, nn.Module, "a torch module (a minillm GPT)")
    if hasattr(model, "lm_head") and hasattr(model, "transformer") and untied_head(model):
        raise ValueError("model.lm_head has a weight of its own, not the token embedding transformer.wte.weight: "
                         "this format stores the tied pair once, so the head would be lost on save; tie it again "
                         "(model.lm_head.weight = model.transformer.wte.weight) or keep the model in memory")
    check_layernorm_eps(model)
    return {k: v for k, v in model.state_dict().items() if k not in TIED_KEYS}


def check_layernorm_eps(model: nn.Module) -> None:
    """A ValueError naming the LayerNorm whose eps differs from the model's `config.layer_norm_epsilon`: every
    format rebuilds its LayerNorms from the config, so a value set on the layer after construction would be lost on
    save (the loaded model gives other logits: 0.05 to 0.4 apart at eps 0.1 on `ln_1` or `ln_f`). Models without a
    GPTConfig (nothing rebuilds them from one) pass."""
    eps = getattr(getattr(model, "config", None), "layer_norm_epsilon", None)
    if eps is None:
        return
    for name, module in model.named_modules():
        if isinstance(module, nn.LayerNorm) and module.eps != eps:
            raise ValueError(f"model's {name}.eps is {short_repr(module.eps)} but its config.layer_norm_epsilon is "
                             f"{short_repr(eps)}: every format rebuilds LayerNorms from the config, so this eps "
                             "would be lost on save; set config.layer_norm_epsilon (one value for every LayerNorm) or "
                             "keep the model in memory")


def _shape(t: torch.Tensor | None) -> str:
    return "none" if t is None else str(tuple(t.shape))


def load_state_dict_strict(model: nn.Module, tensors: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
    """Copy `tensors` into `model`; any missing, unexpected or mis-shaped tensor is a ValueError naming it.

    The message names the key and both shapes (the model's and the file's), e.g.
    "checkpoint tensor 'transformer.h.0.attn.c_attn.weight' has shape (96, 32) but the model expects (96, 64)".
    Tensors are cast to the model's dtype; the tied head may be present or absent.
    """
    expected = model_tensors(model)  # checks model
    check_tensor_dict("tensors", tensors)
    source = check_label("source", source)
    for key in sorted(expected):
        if key not in tensors:
            raise ValueError(
                f"{source} is missing tensor {short_repr(key)}: the model expects shape {_shape(expected[key])}, "
                f"the {source} has none"
            )
    for key in sorted(tensors):
        if key in TIED_KEYS:
            continue
        if key not in expected:
            raise ValueError(
                f"{source} has unexpected tensor {short_repr(key)} with shape {_shape(tensors[key])}; "
                f"the model has no such tensor (expected shape: none)"
            )
    for key in sorted(expected):
        if tuple(tensors[key].shape) != tuple(expected[key].shape):
            raise ValueError(
                f"{source} tensor {short_repr(key)} has shape {_shape(tensors[key])} "
                f"but the model expects {_shape(expected[key])}"
            )
    for key in TIED_KEYS:
        if key in tensors:
            wte = tensors["transformer.wte.weight"]
            if tuple(tensors[key].shape) != tuple(wte.shape):
                raise ValueError(f"{source} tensor {short_repr(key)} has shape {_shape(tensors[key])} but the model "
                                 f"expects {_shape(wte)} (tied to transformer.wte.weight)")
            if not torch.equal(tensors[key], wte):
                raise ValueError(f"{source} tensor {short_repr(key)} differs from transformer.wte.weight; minillm's "
                                 f"GPT ties the output head to the token embedding and cannot load an untied head")
    with torch.no_grad():
        for key, param in expected.items():
            param.copy_(tensors[key].to(dtype=param.dtype, device=param.device))




def untied_head(model: nn.Module) -> bool:
    """Whether `model.lm_head` has a weight of its own: another tensor than the token embedding's, with other
    values. GPT ties the two, and every format here stores the pair once, as transformer.wte.weight (`TIED_KEYS`):
    such a head would be dropped on save, or replaced by the embedding on export, without a word. A head with no
    `weight` (a quantized tied head) is tied; a head with one beside an embedding without (a quantized one) is not."""
    check_instance("model", model, nn.Module, "a torch module (a minillm GPT)")
    if not isinstance(getattr(model, "lm_head", None), nn.Module) or not isinstance(
            getattr(getattr(model, "transformer", None), "wte", None), nn.Module):
        raise TypeError(f"model must be a GPT-like module with lm_head and transformer.wte, got {type(model).__name__}")
    head = getattr(model.lm_head, "weight", None)
    wte = getattr(model.transformer.wte, "weight", None)
    if head is None or head is wte:
        return False
    return wte is None or not (head.shape == wte.shape and head.dtype == wte.dtype and head.device == wte.device
                               and torch.equal(head, wte))

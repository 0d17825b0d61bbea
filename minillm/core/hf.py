"""Hugging Face GPT-2 interop: load `GPT2LMHeadModel` weights into minillm's GPT, and export ours back.

What it adds: `read_hf(source)` (which `GPT.from_hf` loads) for a `transformers.GPT2LMHeadModel` (or `GPT2Model`), its state dict, or a local
checkpoint directory in Hugging Face layout (config.json + model.safetensors); `hf_config_to_gpt` (with a clear
error for every GPT-2 variant our model does not implement); `to_hf_state_dict` and `to_hf_model`, so later
chapters can run Hugging Face's `generate` on minillm's own weights. What it leaves out: downloads from the Hub
(give it a directory), pickle `.bin` files (safetensors only: loading them runs no code), sharded checkpoints.

The only real difference between the two layouts: Hugging Face's GPT-2 uses `Conv1D`, which stores a linear
map's weight as (in, out) and computes x @ W + b, where `nn.Linear` stores (out, in) and computes x @ W.T + b. So
the four projection matrices per block (c_attn, attn.c_proj, c_fc, mlp.c_proj) are transposed; every other
tensor copies as is. `transformers` is imported only when a model object is built or given.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from minillm.core.config import check_instance, check_int, check_tensor_dict, GPTConfig, short_repr
from minillm.core.io import read_json_file, read_safetensors_file
from minillm.core.weights import untied_head

# Conv1D weights, stored (in, out) by Hugging Face: transposed on the way in and out.
_CONV1D = re.compile(r"^transformer\.h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")
# Non-persistent causal-mask buffers that older transformers versions kept in the state dict: not weights.
_BUFFERS = re.compile(r"^transformer\.h\.\d+\.attn\.(bias|masked_bias)$")
_SUPPORTED_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # both are the tanh approximation of GELU


def hf_config_to_gpt(hf_config: Any, **overrides: Any) -> GPTConfig:
    """A GPTConfig from a `transformers.GPT2Config` or its dict (config.json); unsupported variants raise ValueError."""
    if not isinstance(hf_config, dict) and not callable(getattr(hf_config, "to_dict", None)):
        raise TypeError(f"hf_config must be a transformers GPT2Config or its dict (config.json), got "
                        f"{type(hf_config).__name__} {short_repr(hf_config)}")
    cfg = check_instance("hf_config.to_dict()", hf_config if isinstance(hf_config, dict) else hf_config.to_dict(),
                         dict, "a dict")
    model_type = cfg.get("model_type", "gpt2")
    if model_type != "gpt2":
        raise ValueError(f"only GPT-2 checkpoints are supported, got model_type={model_type!r}")
    act = cfg.get("activation_function", "gelu_new")
    if act not in _SUPPORTED_ACTIVATIONS:
        raise ValueError(f"unsupported activation_function={act!r}: minillm's MLP uses tanh-GELU ('gelu_new')")
    n_embd = cfg.get("n_embd", 768)
    if cfg.get("n_inner") not in (None, 4 * n_embd):
        raise ValueError(f"unsupported n_inner={cfg['n_inner']}: minillm's MLP is 4*n_embd={4 * n_embd} wide")
    checks = {
        "scale_attn_weights": True,  # attention scores divided by sqrt(hs)
        "scale_attn_by_inverse_layer_idx": False,  # an extra 1/(layer+1) factor on scores
        "reorder_and_upcast_attn": False,  # a different fp16 order of operations
        "add_cross_attention": False,  # encoder-decoder cross-attention layers
        "tie_word_embeddings": True,  # lm_head shares wte's matrix
    }
    for key, want in checks.items():
        if key in cfg and bool(cfg[key]) != want:
            raise ValueError(f"unsupported GPT-2 setting {key}={cfg[key]!r}: minillm implements only {key}={want}")
    fields = dict(
        vocab_size=cfg.get("vocab_size", 50257),
        block_size=cfg.get("n_positions", cfg.get("n_ctx", 1024)),
        n_layer=cfg.get("n_layer", 12),
        n_head=cfg.get("n_head", 12),
        n_embd=n_embd,
        layer_norm_epsilon=float(cfg.get("layer_norm_epsilon", 1e-5)),
    )
    return GPTConfig(**{**fields, **overrides})


def _normalize_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Prefix bare `GPT2Model` keys ("h.0.ln_1.weight") with "transformer."; drop the mask buffers."""
    out = {}
    for key, value in check_tensor_dict("state", state).items():
        full = key if key.startswith(("transformer.", "lm_head.")) else f"transformer.{key}"
        if _BUFFERS.match(full):
            continue
        out[full] = value
    return out


def hf_state_dict_to_minillm(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face GPT-2 tensors -> minillm tensors (same names, Conv1D weights transposed)."""
    return {k: (v.t().contiguous() if _CONV1D.match(k) else v) for k, v in _normalize_keys(state).items()}


def infer_config(state: dict[str, torch.Tensor], n_head: int | None, **overrides: Any) -> GPTConfig:
    """Shapes say everything but the head count: a state dict alone needs `n_head`."""
    state = _normalize_keys(state)
    if n_head is None:
        raise ValueError("a bare state dict does not record n_head; pass GPT.from_hf(state_dict, n_head=...)")
    n_head = check_int("n_head", n_head)
    try:
        vocab_size, n_embd = state["transformer.wte.weight"].shape
        block_size = state["transformer.wpe.weight"].shape[0]
    except KeyError as e:
        raise ValueError(f"not a GPT-2 state dict: missing tensor {e.args[0]!r}") from None
    layers = {int(m.group(1)) for k in state if (m := re.match(r"^transformer\.h\.(\d+)\.", k))}
    return GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=max(layers) + 1 if layers else 0,
                     n_head=n_head, n_embd=n_embd, **overrides)


def _read_dir(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"no config.json in Hugging Face checkpoint directory {str(path)!r}")
    weights = path / "model.safetensors"
    if not weights.is_file():
        found = sorted(p.name for p in path.iterdir())
        raise FileNotFoundError(f"no model.safetensors in {str(path)!r} (found {found}); only unsharded safetensors "
                                "checkpoints are supported (save with save_pretrained(..., safe_serialization=True))")
    hf_cfg = read_json_file(cfg_path, what="Hugging Face config")
    if not isinstance(hf_cfg, dict):
        raise ValueError(f"Hugging Face config {str(cfg_path)!r} must hold a JSON object, got {type(hf_cfg).__name__}")
    return hf_cfg, read_safetensors_file(weights)


def read_hf(source: Any, n_head: int | None = None, **config_overrides: Any) -> tuple[GPTConfig, dict[str, torch.Tensor], str]:
    """(GPTConfig, minillm-layout fp32 tensors, a label naming the source) from a Hugging Face GPT-2.

    source: a `GPT2LMHeadModel` / `GPT2Model`, a state dict of one (then pass `n_head`), or a directory holding
    config.json + model.safetensors. `config_overrides` set GPTConfig fields such as attn_impl. `GPT.from_hf`
    builds the model from this and loads the tensors strictly.
    """
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_dir():
            raise ValueError(f"Hugging Face checkpoint directory not found: {str(path)!r}")
        hf_cfg, state = _read_dir(path)
        config = hf_config_to_gpt(hf_cfg, **config_overrides)
        label = f"Hugging Face checkpoint {str(path)!r}"
    elif isinstance(source, dict):
        state = source
        config = infer_config(state, n_head, **config_overrides)
        label = "Hugging Face state dict"
    elif isinstance(source, torch.nn.Module) and hasattr(source, "config"):
        state = source.state_dict()
        config = hf_config_to_gpt(source.config, **config_overrides)
        label = f"{type(source).__name__}"
    else:
        raise TypeError(f"GPT.from_hf takes a GPT2LMHeadModel, its state dict or a directory, got "
                        f"{type(source).__name__}")
    tensors = {k: v.detach().to(torch.float32) for k, v in hf_state_dict_to_minillm(state).items()}
    return config, tensors, label


def to_hf_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """minillm tensors -> Hugging Face GPT-2 tensors (Conv1D weights transposed; the head included, tied or not)."""
    out = {}
    for key, value in check_instance("model", model, torch.nn.Module, "a minillm GPT").state_dict().items():
        value = value.detach()
        out[key] = value.t().contiguous() if _CONV1D.match(key) else value.clone()
    return out


def to_hf_config(config: GPTConfig, **hf_kwargs: Any):
    """The `transformers.GPT2Config` of the same shape, dropout off (inference); `hf_kwargs` override fields."""
    check_instance("config", config, GPTConfig, "a GPTConfig")
    from transformers import GPT2Config

    if config.attn_dim != config.n_embd:
        raise ValueError(f"GPT-2 has n_embd / n_head wide heads; this config's {config.n_head} heads of "
                         f"{config.head_size} (head_dim, after head pruning) have no Hugging Face GPT-2 equivalent")
    fields = dict(vocab_size=config.vocab_size, n_positions=config.block_size, n_embd=config.n_embd,
                  n_layer=config.n_layer, n_head=config.n_head, layer_norm_epsilon=config.layer_norm_epsilon,
                  activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                  bos_token_id=None, eos_token_id=None, tie_word_embeddings=True)
    return GPT2Config(**{**fields, **hf_kwargs})


def to_hf_model(model: torch.nn.Module, attn_implementation: str = "eager", **hf_kwargs: Any):
    """A `transformers.GPT2LMHeadModel` (eval mode, on the model's device) carrying `model`'s weights exactly.

    Used to run Hugging Face's own loops (`generate`) on minillm's checkpoints. `hf_kwargs` go to GPT2Config,
    e.g. eos_token_id=tokenizer.eot_token. "eager" attention is the plain softmax path, closest to `attention_ref`.
    A model whose lm_head has a weight of its own (untied, `minillm.core.weights.untied_head`) gets an untied
    Hugging Face head (tie_word_embeddings=False) holding that weight; a tie_word_embeddings in `hf_kwargs` that
    contradicts the model is a ValueError naming it.
    """
    from transformers import GPT2LMHeadModel

    if not isinstance(getattr(model, "config", None), GPTConfig):
        raise TypeError(f"to_hf_model needs a minillm GPT (a module with a GPTConfig), got {type(model).__name__}")
    untied = untied_head(model)
    if "tie_word_embeddings" in hf_kwargs and bool(hf_kwargs["tie_word_embeddings"]) == untied:
        raise ValueError(f"tie_word_embeddings={hf_kwargs['tie_word_embeddings']!r}, but the model's lm_head is "
                         f"{'untied (a weight of its own)' if untied else 'tied to transformer.wte'}")
    hf_config = to_hf_config(model.config, **{"tie_word_embeddings": not untied, **hf_kwargs})
    hf_config._attn_implementation = attn_implementation
    hf = GPT2LMHeadModel(hf_config)
    state = to_hf_state_dict(model)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if not _BUFFERS.match(k) and (untied or k != "lm_head.weight")]
    if missing or unexpected:  # an internal invariant: the two layouts are the same by construction
        raise AssertionError(f"layout mismatch exporting to Hugging Face: missing {missing}, unexpected {unexpected}")
    if not untied:
        hf.tie_weights()
    return hf.to(model.device).eval()

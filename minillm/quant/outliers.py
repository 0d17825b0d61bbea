"""Activation outliers: measuring them, planting them, and two cures (LLM.int8's decomposition, SmoothQuant).

Large LLMs grow a few hidden features whose magnitude is 20-100x the others' (Dettmers et al. 2022 see them in every
layer from ~6.7B parameters on). One per-token int8 scale must then cover the outlier, and every other feature of
that token is rounded to a handful of codes: W8A8 collapses while weight-only int8 does not care. What it adds:

  - `input_absmax(model, tokens)`: per block linear, the largest |x| of each input feature on some tokens, and
    `outlier_report` (how many features reach the threshold, the ratio of the largest to the median feature);
  - `inject_outliers(model, channels, factor)`: a copy of the model computing the same function whose LayerNorm
    outputs carry outlier features: ln.weight and ln.bias times `factor` on `channels`, the next linear's input
    columns divided by it. `base` is far too small to have outliers of its own; this shows what large models look like;
  - the cure inside the matmul: `QuantConfig("w8a8", outlier_threshold=6.0)` (`minillm.quant.linear.llm_int8_linear`);
  - the cure before it, SmoothQuant (Xiao et al. 2023, eq. 4): per input channel j, s_j = max|X_j|^α / max|W_j|^(1-α),
    X' = X / s and W' = W * s (diag(s) moves difficulty from activations to weights), the 1/s folded into what
    produces X, so the smoothed fp32 model computes the same function: `smooth_model`.

SmoothQuant here smooths the inputs of c_attn and c_fc (folded into ln_1 and ln_2) and of attn.c_proj (folded into
the value rows of c_attn: attention is linear in V). What it leaves out: mlp.c_proj, whose input comes through GELU
(nothing linear to fold 1/s into), and searching α per layer.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from minillm.core.config import check_float, check_has_data, plain_number, short_repr, tensor_kind
from minillm.core.model import GPT
from minillm.quant.gptq import check_calibration
from minillm.quant.linear import check_fp32_model


@torch.no_grad()
def input_absmax(model: nn.Module, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """{block linear name ("0.attn.c_attn"): (in,) max |x| of each input feature} over token windows (N, T).

    Measured in eval mode (dropout would inflate max |x|); the caller's model is handed back in the mode it came in."""
    if not isinstance(model, GPT):
        raise TypeError(f"input_absmax needs a minillm GPT, got {type(model).__name__}")
    tokens = check_calibration(model, tokens, "input_absmax (tokens)")
    stats: dict[str, torch.Tensor] = {}

    def record(name: str):
        def hook(_module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            a = inputs[0].reshape(-1, inputs[0].shape[-1]).abs().amax(dim=0)  # (in,)
            stats[name] = a if name not in stats else torch.maximum(stats[name], a)
        return hook

    handles = [m.register_forward_pre_hook(record(name)) for name, m in model.transformer.h.named_modules()
               if isinstance(m, nn.Linear) or hasattr(m, "qweight")]
    was_training = model.training
    try:
        model.eval()(tokens)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return stats


def outlier_report(absmax: dict[str, torch.Tensor], threshold: float = 6.0) -> list[dict[str, float | int | str]]:
    """One row per layer: features with max |x| >= threshold, the largest max |x|, and largest / median."""
    threshold = check_float("threshold", threshold, 0.0, include_minimum=False)
    if not isinstance(absmax, dict) or not absmax:
        raise ValueError(f"absmax must be a non-empty dict {{layer: (in,) tensor}} from input_absmax, got "
                         f"{short_repr(absmax)}")
    for name, a in absmax.items():
        if (not isinstance(a, torch.Tensor) or check_has_data(f"absmax[{name!r}]", a).dim() != 1 or a.numel() == 0
                or not a.is_floating_point()):
            raise ValueError(f"absmax[{name!r}] must be a non-empty 1-D float tensor, got "
                             f"{tuple(getattr(a, 'shape', ()))}")
        if not bool(torch.isfinite(a).all()) or bool((a < 0).any()):  # NaN >= threshold is False: counted as 0
            raise ValueError(f"absmax[{name!r}] holds negative, NaN or inf values: it must be max |x| of finite "
                             "activations")
    return [{"layer": name, "outlier_features": int((a >= threshold).sum()), "max_abs": float(a.max()),
             "max_over_median": float(a.max() / a.median().clamp(min=1e-12))} for name, a in absmax.items()]


# inject_outliers' factor lies in [1 / MAX_OUTLIER_FACTOR, MAX_OUTLIER_FACTOR]: real outliers are 20-100x (Dettmers
# et al. 2022); far past that, fp32 weights times f overflow to inf (1e39) or divided by f sink into subnormals, and
# the copy no longer computes the model's function.
MAX_OUTLIER_FACTOR = 1e4


@torch.no_grad()
def inject_outliers(model: GPT, channels: list[int], factor: float = 20.0) -> GPT:
    """A copy of `model` with the same outputs whose ln_1 and ln_2 outputs are `factor` times larger on `channels`.

    ln(x)_j = g_j * x̂_j + b_j feeds c(ln(x)) = W ln(x) + c_b. Multiplying g_j and b_j by f and dividing column j of
    W by f leaves W ln(x) unchanged (up to float rounding) while feature j of the activation grows f-fold.
    factor must lie in [1 / MAX_OUTLIER_FACTOR, MAX_OUTLIER_FACTOR] (ValueError naming it otherwise).
    """
    check_fp32_model(model, "inject_outliers")
    C = model.config.n_embd
    # the plain ints: an int subclass's own comparisons are not consulted (999 would reach torch's indexing)
    if not isinstance(channels, (list, tuple)) or not channels:
        raise ValueError(f"channels must be a non-empty list of feature indices in [0, {C}), got "
                         f"{short_repr(channels)}")
    channels = [plain_number(c) for c in channels]
    for i, c in enumerate(channels):
        if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < C:
            raise ValueError(f"channels must be a non-empty list of feature indices in [0, {C}), got channels[{i}] = "
                             f"{short_repr(c)}")
    factor = check_float("factor", factor, 1 / MAX_OUTLIER_FACTOR, MAX_OUTLIER_FACTOR)
    out = copy.deepcopy(model)
    idx = torch.tensor(channels, device=model.device)
    for block in out.transformer.h:
        for ln, linear in ((block.ln_1, block.attn.c_attn), (block.ln_2, block.mlp.c_fc)):
            ln.weight[idx] *= factor
            ln.bias[idx] *= factor
            linear.weight[:, idx] /= factor
    return out


def smoothing_scales(act_absmax: torch.Tensor, weight: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """s (in,) = max|X_j|^α / max_i |W_ij|^(1-α) (Xiao et al. 2023, eq. 4), for a weight (out, in).

    α = 0.5 splits the range evenly between activations and weights: after smoothing, max|X'_j| = max|W'_j|.
    Features that never fire (max|X_j| = 0) get s = 1.
    """
    alpha = check_float("alpha", alpha, 0.0, 1.0)
    if not isinstance(weight, torch.Tensor) or not check_has_data("weight", weight).is_floating_point() \
            or weight.dim() != 2:
        raise TypeError(f"weight must be a 2-D float tensor (out, in), got {tensor_kind(weight)}")
    if not isinstance(act_absmax, torch.Tensor) or tuple(check_has_data("act_absmax", act_absmax).shape) != \
            (weight.shape[1],) \
            or not act_absmax.is_floating_point():
        raise ValueError(f"act_absmax must be a float tensor ({weight.shape[1]},), one max |x| per input feature, got "
                         f"{tuple(getattr(act_absmax, 'shape', ()))}")
    check_has_data("weight", weight)  # a meta tensor has no values: `.item()` or a device error from torch
    check_has_data("act_absmax", act_absmax)
    if not bool(torch.isfinite(act_absmax).all()) or bool((act_absmax < 0).any()):
        raise ValueError("act_absmax holds negative, NaN or inf values: it must be max |x| of finite activations")
    w_max = weight.detach().abs().amax(dim=0).clamp(min=1e-8)  # (in,)
    s = act_absmax.clamp(min=1e-8).pow(alpha) / w_max.pow(1.0 - alpha)  # (in,)
    return torch.where(act_absmax > 0, s, torch.ones_like(s))


@torch.no_grad()
def smooth_model(model: GPT, calibration: torch.Tensor, alpha: float = 0.5) -> GPT:
    """A copy of `model` computing the same function with smoothed activations (SmoothQuant), ready for W8A8.

    Per block: c_attn's input is divided by s1 (folded into ln_1), c_fc's by s2 (into ln_2), attn.c_proj's by s3
    (into the value rows of c_attn), each weight's input columns multiplied by the same s. Scales come from the
    activations of `calibration` (N, T) in the *original* model, block by block.
    """
    check_fp32_model(model, "smooth_model")
    alpha = check_float("alpha", alpha, 0.0, 1.0)
    # checked here, under this function's own argument name (input_absmax would name its `tokens`)
    calibration = check_calibration(model, calibration, "smooth_model (calibration)")
    absmax = input_absmax(model, calibration)
    out = copy.deepcopy(model)
    A = model.config.attn_dim  # the heads' width: n_embd, less after chapter 10's head pruning
    for b, block in enumerate(out.transformer.h):
        attn, mlp = block.attn, block.mlp
        pairs = ((block.ln_1, attn.c_attn, f"{b}.attn.c_attn"), (block.ln_2, mlp.c_fc, f"{b}.mlp.c_fc"))
        for ln, linear, name in pairs:
            s = smoothing_scales(absmax[name], linear.weight, alpha)  # (C,)
            ln.weight /= s
            ln.bias /= s
            linear.weight *= s  # (out, C) * (C,): column j times s_j
        # attn.c_proj reads the attention output, a convex combination of value vectors: scaling value feature j
        # (row 2A + j of c_attn, and its bias) by 1/s_j scales output feature j by 1/s_j.
        s = smoothing_scales(absmax[f"{b}.attn.c_proj"], attn.c_proj.weight, alpha)  # (A,)
        attn.c_attn.weight[2 * A:] /= s.unsqueeze(1)  # (A, C) rows of the value projection
        attn.c_attn.bias[2 * A:] /= s
        attn.c_proj.weight *= s
    return out

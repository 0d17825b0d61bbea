"""GPTQ (Frantar et al. 2023): round one weight column at a time, and push each rounding error onto the columns
not rounded yet, so the layer's *output* on real inputs moves as little as possible.

What it adds over round-to-nearest (RTN): RTN minimises each weight's own error |w - ŵ|; what matters is the layer's
output error on the activations it sees, for one row w of W (all rows are independent and share H):

    E(ŵ) = ‖X w - X ŵ‖² / N = (w - ŵ)ᵀ H (w - ŵ),   H = Xᵀ X / N (in, in), from calibration inputs X (N, in)

GPTQ quantizes the columns left to right. When column i is fixed to its grid point, the columns F = i+1.. still
free are moved to the least-squares optimum given everything fixed so far (Optimal Brain Surgeon; Frantar et al.
eq. 2-3):

    δ_F = -(w_i - ŵ_i) / [H_F⁻¹]_ii · [H_F⁻¹]_{F,i}          H_F⁻¹: the inverse Hessian of the columns i.. still free

Removing column i from H_F⁻¹ is one step of Gaussian elimination, so all the rows [H_F⁻¹]_{i, i:} / sqrt([H_F⁻¹]_ii)
needed along the way are the rows of one upper Cholesky factor U of H⁻¹ (H⁻¹ = Uᵀ U; Frantar et al. §3 "Cholesky
reformulation"): the update is W[:, i+1:] -= (w_i - ŵ_i) / U_ii · U_{i, i+1:}. The grid (scale and zero point of a
group) is chosen from the already-updated weights when the loop enters the group; GPTQ changes the rounding, not
the grid. `gptq_reference` computes the same thing by solving the least-squares problem from scratch at every step.

What it leaves out: the lazy batched updates and act-order (columns by decreasing H_ii) of the paper, both speed or
accuracy refinements of the same update; quantizing layers inside a block one after another (here a block's four
layers see the inputs of the already-quantized earlier blocks, as in the paper's default).
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from minillm.core.config import (check_float, check_has_data, check_int, check_label, check_module_has_data,
                                 plain_number, short_repr, tensor_kind)
from minillm.core.model import GPT, require_model
from minillm.core.sampling import check_seed
from minillm.gpt.dataset import split_tokens
from minillm.quant.linear import QuantConfig, QuantizedGPT, check_fp32_model, quantize_model
from minillm.quant.quantize import (
    QuantizedTensor,
    asymmetric_params,
    check_finite,
    dequantize,
    dequantize_asymmetric,
    dequantize_symmetric,
    qrange,
    quantize,
    quantize_asymmetric,
    quantize_symmetric,
    symmetric_params,
)


def _check_layer(W: torch.Tensor, H: torch.Tensor, group_size: int | None, bits: object, symmetric: object,
                 damp: object) -> int:
    """Check one layer's arguments (TypeError/ValueError naming the first bad one); the group size to use (None:
    one group per row, W's width). W's type and shape are checked first: every later check reads its shape."""
    if not isinstance(W, torch.Tensor) or not W.is_floating_point():
        raise TypeError(f"W must be a 2-D float tensor (out, in), got {tensor_kind(W)}")
    if check_has_data("W", W).dim() != 2:  # nested, sparse, float8, meta: before anything reads the shape
        raise ValueError(f"W must be a 2-D float tensor (out, in), got shape {tuple(W.shape)}")
    group_size = W.shape[1] if group_size is None else group_size
    if W.numel() == 0:
        raise ValueError(f"W is empty (shape {tuple(W.shape)})")
    if not isinstance(H, torch.Tensor) or not H.is_floating_point():
        raise TypeError(f"H must be a float tensor, got {tensor_kind(H)}")
    if tuple(check_has_data("H", H).shape) != (W.shape[1], W.shape[1]):
        raise ValueError(f"H must be ({W.shape[1]}, {W.shape[1]}) for W of shape {tuple(W.shape)}, got "
                         f"{tuple(H.shape)}")
    group_size = plain_number(group_size)  # an int subclass's own comparisons and % are not consulted
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0 or W.shape[1] % group_size:
        raise ValueError(f"group_size must be a positive int dividing in={W.shape[1]}, got {short_repr(group_size)}")
    qrange(bits, symmetric)  # type: ignore[arg-type]  # ValueError/TypeError naming bits or symmetric
    damp = check_float("damp", damp, 0.0)
    check_finite("W", W.detach())
    _check_hessian(H)
    if not bool(H.detach().any()):
        raise ValueError("H is all zero (calibration inputs that are all zero): every rounding moves the layer's "
                         "output by the same 0, so GPTQ has nothing to choose by; calibrate on real inputs, or "
                         "round to nearest with quantize")
    return group_size


def _check_hessian(H: torch.Tensor) -> None:
    """H (in, in) finite and symmetric, as XᵀX / N is (to float rounding: max(1e-4, 16 ulps) of max|H|); a
    ValueError naming H otherwise. GPTQ's update reads only H's upper Cholesky factor, so an asymmetric H would be
    quietly treated as another matrix. One host sync."""
    H = check_finite("H", H.detach())
    tol = max(1e-4, 16 * torch.finfo(H.dtype).eps) * float(H.abs().max())
    gap = float((H - H.T).abs().max())
    if gap > tol:
        raise ValueError(f"H must be symmetric (a Hessian XᵀX / N of the layer's inputs), but |H - Hᵀ| reaches "
                         f"{gap:g} (max |H| = {float(H.abs().max()):g})")


def _cholesky(H: torch.Tensor, damp: float, name: str) -> torch.Tensor:
    """torch.linalg.cholesky(H), its LinAlgError turned into a ValueError naming the layer and the damping."""
    try:
        return torch.linalg.cholesky(H)
    except torch.linalg.LinAlgError as e:
        raise ValueError(f"GPTQ on {name}: the damped Hessian H + damp * mean(diag H) * I (damp={damp}) is not "
                         "positive definite (calibration inputs too few or too correlated, or H is not XᵀX); "
                         "raise damp (e.g. 0.1) or give more calibration windows") from e


def _grid(w: torch.Tensor, bits: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scale, zero) per row of w (out, g) by min/max, shaped (out, 1); zero is None when symmetric."""
    if symmetric:
        return symmetric_params(w, bits, dim=1), None
    return asymmetric_params(w, bits, dim=1)


def _round(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, de-quantized values) of w on the given grid: the plain round-to-nearest of one column."""
    if zero is None:  # the grid comes from `_grid`: no value check (a host sync per column)
        q = quantize_symmetric(w, scale, bits, check_values=False)
        return q, dequantize_symmetric(q, scale, check_values=False)
    q = quantize_asymmetric(w, scale, zero, bits, check_values=False)
    return q, dequantize_asymmetric(q, scale, zero, check_values=False)


def damped(H: torch.Tensor, damp: float) -> torch.Tensor:
    """H + damp * mean(diag H) * I, in float64, with inputs that never fire (H_ii = 0) given H_ii = 1.

    The damping keeps the Cholesky factorisation stable when calibration data leave H (nearly) singular; a dead
    input's column has no effect on the output, so any grid point is optimal for it. H must be finite and symmetric
    (a ValueError naming H otherwise: NaN would pass into every later step).
    """
    damp = check_float("damp", damp, 0.0)
    if not isinstance(H, torch.Tensor) or check_has_data("H", H).dim() != 2 or H.shape[0] != H.shape[1]:
        raise ValueError(f"H must be a square matrix (in, in), got {tuple(getattr(H, 'shape', ()))}")
    if not H.is_floating_point():
        raise TypeError(f"H must be a float tensor, got {H.dtype}")
    _check_hessian(H)
    H = H.detach().to(torch.float64).clone()
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    H += damp * torch.diagonal(H).mean() * torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    return H


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, bits: int = 4, symmetric: bool = True,
                  group_size: int | None = None, damp: float = 0.01, name: str = "W") -> QuantizedTensor:
    """GPTQ codes for a weight W (out, in) given the Hessian H (in, in) of its inputs; scales per group of columns.

    group_size None = one group per row (per-channel). Returns a QuantizedTensor (group-wise layout), so its
    `dequantize` is the layer's new weight Ŵ. `damp` (finite, >= 0) is the share of mean(diag H) added to the
    diagonal; a damped H that is still not positive definite is a ValueError naming `name` (the layer) and damp.
    """
    name = check_label("name", name)  # the layer's name in messages
    group_size = _check_layer(W, H, group_size, bits, symmetric, damp)
    out, n = W.shape
    H = damped(H, damp)  # (n, n)
    W = W.detach().to(torch.float64).clone()  # (out, n): updated in place as errors are pushed right
    # U: upper Cholesky factor of H^-1 (H^-1 = U^T U). Row i holds [H_F^-1]_{i, i:} / sqrt([H_F^-1]_ii) for the
    # columns F = i.. still free at step i, which is all the OBS update needs.
    L = _cholesky(H, damp, name)  # H = L L^T
    U = _cholesky(torch.cholesky_inverse(L), damp, name).T  # (n, n): upper, from the lower factor of H^-1
    codes = torch.empty(out, n, dtype=torch.int8 if symmetric else torch.uint8, device=W.device)
    groups = n // group_size
    scales = torch.empty(out, groups, dtype=torch.float64, device=W.device)
    zeros = None if symmetric else torch.empty(out, groups, dtype=torch.uint8, device=W.device)
    # BEGIN SOLUTION
    for i in range(n):
        g = i // group_size
        if i % group_size == 0:  # entering a group: its grid from the weights as they are now (already updated)
            scale, zero = _grid(W[:, i:i + group_size], bits, symmetric)  # (out, 1) each
            scales[:, g] = scale[:, 0]
            if zeros is not None:
                zeros[:, g] = zero[:, 0]
        q, w_hat = _round(W[:, i:i + 1], scale, zero, bits)  # (out, 1) codes and grid values
        codes[:, i] = q[:, 0]
        err = (W[:, i] - w_hat[:, 0]) / U[i, i]  # (out,)
        W[:, i + 1:] -= err.unsqueeze(1) * U[i, i + 1:].unsqueeze(0)  # (out, 1) * (1, n-i-1): OBS update
    # END SOLUTION
    return QuantizedTensor(codes, scales.float(), zeros, bits, (out, n))


def gptq_reference(W: torch.Tensor, H: torch.Tensor, bits: int = 4, symmetric: bool = True,
                   group_size: int | None = None, damp: float = 0.01, name: str = "W") -> QuantizedTensor:
    """The naive twin: after fixing columns S = 0..i, set the free columns F to argmin (w - ŵ)ᵀ H (w - ŵ) by solving
    the least-squares normal equations from scratch: ŵ_F = w_F + (w_S - ŵ_S) H_SF H_FF⁻¹. O(n⁴); for tests.

    Derivation: with e = w - ŵ and e_S fixed, the gradient in e_F of e_S H_SS e_Sᵀ + 2 e_S H_SF e_Fᵀ + e_F H_FF e_Fᵀ
    is 2 (e_S H_SF + e_F H_FF) = 0, so e_F = -e_S H_SF H_FF⁻¹.
    """
    name = check_label("name", name)  # the layer's name in messages
    group_size = _check_layer(W, H, group_size, bits, symmetric, damp)
    out, n = W.shape
    H = damped(H, damp)
    _cholesky(H, damp, name)  # the same refusal as gptq_quantize when H is not positive definite
    W0 = W.detach().to(torch.float64)
    cur = W0.clone()  # (out, n): the fixed columns hold grid values, the free ones their current optimum
    codes = torch.empty(out, n, dtype=torch.int8 if symmetric else torch.uint8)
    groups = n // group_size
    scales = torch.empty(out, groups, dtype=torch.float64)
    zeros = None if symmetric else torch.empty(out, groups, dtype=torch.uint8)
    for i in range(n):
        g = i // group_size
        if i % group_size == 0:
            scale, zero = _grid(cur[:, i:i + group_size], bits, symmetric)
            scales[:, g] = scale[:, 0]
            if zeros is not None:
                zeros[:, g] = zero[:, 0]
        q, w_hat = _round(cur[:, i:i + 1], scale, zero, bits)
        codes[:, i] = q[:, 0]
        cur[:, i] = w_hat[:, 0]
        S, F = slice(0, i + 1), slice(i + 1, n)
        if i + 1 < n:
            e_S = W0[:, S] - cur[:, S]  # (out, |S|)
            cur[:, F] = W0[:, F] + torch.linalg.solve(H[F, F], (e_S @ H[S, F]).T).T  # H symmetric
    return QuantizedTensor(codes, scales.float(), zeros, bits, (out, n))


def output_error(W: torch.Tensor, W_hat: torch.Tensor, X: torch.Tensor) -> float:
    """‖X Wᵀ - X Ŵᵀ‖_F: how far a layer's outputs on inputs X (N, in) move when W (out, in) becomes Ŵ."""
    for name, t in (("W", W), ("W_hat", W_hat), ("X", X)):
        if not isinstance(t, torch.Tensor) or not check_has_data(name, t).is_floating_point() or t.dim() != 2:
            raise TypeError(f"{name} must be a 2-D float tensor, got {tensor_kind(t)} "
                            f"{tuple(getattr(t, 'shape', ()))}")
    if W_hat.shape != W.shape or X.shape[1] != W.shape[1]:
        raise ValueError(f"W {tuple(W.shape)}, W_hat {tuple(W_hat.shape)} and X {tuple(X.shape)} do not fit: W_hat "
                         "must be shaped like W, X (N, in)")
    for name, t in (("W", W), ("W_hat", W_hat), ("X", X)):
        check_has_data(name, t)
        if t.device != W.device:
            raise ValueError(f"{name} must be on W's device {W.device}, got {t.device}")
    if X.shape[0] == 0:  # the norm over no outputs is 0.0, which would read as "no error at all"
        raise ValueError(f"X holds no inputs (shape {tuple(X.shape)}): there are no outputs to compare; give N >= 1 "
                         "rows")
    return float(torch.linalg.matrix_norm(X.double() @ (W.double() - W_hat.double()).T))


# ----- a whole model -------------------------------------------------------------------------------------------


def calibration_windows(num_windows: int = 32, length: int = 256, seed: int = 0) -> torch.Tensor:
    """(num_windows, length) token ids: windows of the *training* split at seeded random starts (never validation
    text, which measures the result). At most as many tokens in all as the split holds (num_windows x length): more
    would only repeat its text; a ValueError naming num_windows otherwise, before anything is allocated."""
    num_windows = check_int("num_windows", num_windows)
    length = check_int("length", length)
    seed = check_seed(check_int("seed", seed, 0))  # [0, 2**64): torch's generator's range
    tokens = split_tokens("train")
    if length >= tokens.numel():
        raise ValueError(f"length={length} leaves no room in the {tokens.numel()} training tokens")
    if num_windows * length > tokens.numel():
        raise ValueError(f"num_windows={num_windows} windows of length={length} ask for {num_windows * length} tokens, "
                         f"more than the {tokens.numel()} of the training split; lower num_windows")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, tokens.numel() - length, (num_windows,), generator=g)
    return torch.stack([tokens[s:s + length] for s in starts.tolist()])  # (num_windows, length)


def check_calibration(model: GPT, calibration: object, who: str = "calibration") -> torch.Tensor:
    """Calibration ids (N, T) on the model's device, or a TypeError/ValueError naming what is wrong: an int64
    tensor, N >= 1 windows of 1 <= T <= block_size tokens, every id inside the vocabulary (one host sync).

    Chapter 10's pruning checks its calibration with this same function (`minillm.prune.unstructured`)."""
    who = check_label("who", who)  # the caller's name, in every message below
    require_model(model, f"{who}: model")  # a name ('base') where the model goes: TypeError, not AttributeError
    name = who if "calibration" in who else f"{who} calibration"
    if (not isinstance(calibration, torch.Tensor) or check_has_data(name, calibration).dim() != 2  # its ids are read
            or calibration.dtype != torch.int64):
        raise TypeError(f"{who} needs calibration token ids: an int64 tensor shaped (N, T), got "
                        f"{tensor_kind(calibration)} {tuple(getattr(calibration, 'shape', ()))}")
    if calibration.numel() == 0:
        raise ValueError(f"{who}: the calibration ids are empty (shape {tuple(calibration.shape)}); give at least "
                         "one window of at least one token")
    if calibration.size(1) > model.config.block_size:
        raise ValueError(f"calibration windows of {calibration.size(1)} tokens exceed the model's block_size "
                         f"{model.config.block_size}")
    lo, hi = (int(v) for v in torch.aminmax(calibration))
    if lo < 0 or hi >= model.config.vocab_size:
        raise ValueError(f"{who}: calibration token id {lo if lo < 0 else hi} is outside the vocabulary "
                         f"[0, {model.config.vocab_size})")
    return calibration.to(model.device)


@torch.no_grad()
def gptq_quantize_model(model: GPT, config: QuantConfig, calibration: torch.Tensor, damp: float = 0.01
                        ) -> QuantizedGPT:
    """A QuantizedGPT whose block layers got their codes from GPTQ on `calibration` ids (N, T).

    Block by block: the calibration activations enter block b from blocks 0..b-1 already quantized (so later layers
    correct for earlier layers' errors too), each of block b's linears gets H = Xᵀ X / N from its own inputs, then
    block b's output with its new weights feeds block b+1. Weight-only modes only (int8 or int4).
    """
    if not isinstance(config, QuantConfig):
        raise TypeError(f"config must be a QuantConfig, got {type(config).__name__}")
    check_fp32_model(model, "gptq_quantize_model", config)
    if config.mode == "w8a8":
        raise ValueError(f"GPTQ chooses weight codes for the weight-only modes int8/int4, got {config!r}")
    damp = check_float("damp", damp, 0.0)
    idx = check_calibration(model, calibration, "GPTQ")
    work = copy.deepcopy(model).eval()  # fp32, its weights replaced by the de-quantized GPTQ ones as we go
    positions = torch.arange(idx.size(1), device=idx.device)
    x = work.transformer.wte(idx) + work.transformer.wpe(positions)  # (N, T, C)
    weights: dict[str, QuantizedTensor] = {}
    group = config.quantize_group_size
    for b, block in enumerate(work.transformer.h):
        linears = [(name, m) for name, m in block.named_modules() if isinstance(m, nn.Linear)]
        hessians = {name: torch.zeros(m.in_features, m.in_features, dtype=torch.float64, device=idx.device)
                    for name, m in linears}
        counts = {name: 0 for name, _ in linears}

        def collect(name: str):
            def hook(_module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
                a = inputs[0].reshape(-1, inputs[0].shape[-1]).double()  # (tokens, in)
                hessians[name] += a.T @ a
                counts[name] += a.shape[0]
            return hook

        handles = [m.register_forward_pre_hook(collect(name)) for name, m in linears]
        try:
            block(x)
        finally:
            for h in handles:
                h.remove()
        for name, m in linears:
            qt = gptq_quantize(m.weight, hessians[name] / counts[name], config.bits, config.symmetric, group, damp,
                               name=f"layer {b}.{name}")
            weights[f"{b}.{name}"] = qt
            m.weight.copy_(dequantize(qt))
        x = block(x)  # (N, T, C): the input of the next block, through this block's quantized weights
    return quantize_model(model, config, weights)


def rtn_and_gptq_errors(layer: nn.Linear, X: torch.Tensor, bits: int = 4, symmetric: bool = True,
                        group_size: int | None = None) -> dict[str, float]:
    """Output error ‖XWᵀ - XŴᵀ‖ of round-to-nearest and of GPTQ on one layer with inputs X (N, in)."""
    if not isinstance(layer, nn.Linear):
        raise TypeError(f"layer must be an nn.Linear, got {type(layer).__name__}")
    check_module_has_data("layer", layer)  # else `quantize` refuses the meta weight under its own name, x
    if not isinstance(X, torch.Tensor) or not X.is_floating_point() or X.dim() != 2 or X.shape[0] == 0 \
            or X.shape[1] != layer.in_features:
        raise ValueError(f"X must be a non-empty float tensor (N, {layer.in_features}), got "
                         f"{tensor_kind(X)} {tuple(getattr(X, 'shape', ()))}")
    check_has_data("X", X)
    if not bool(torch.isfinite(X).all()):  # else met as a NaN Hessian, H, which the caller never passed
        raise ValueError("X holds inf or NaN values: the layer's outputs and the Hessian built from X would be NaN")
    W = layer.weight.detach()
    H = X.double().T @ X.double() / X.shape[0]
    if not bool(torch.isfinite(H).all()):  # finite X, but XᵀX past float64's range
        raise ValueError(f"X's values are too large (max |x| = {X.abs().max().item():.3g}): XᵀX / N, the Hessian "
                         "GPTQ builds from X, overflows float64")
    rtn = dequantize(quantize(W.float(), bits, symmetric, "channel" if group_size is None else "group", group_size))
    gptq = dequantize(gptq_quantize(W, H, bits, symmetric, group_size))
    return {"rtn": output_error(W, rtn, X), "gptq": output_error(W, gptq, X)}

"""W8A8: int8 weights times int8 activations, accumulated in int32, and LLM.int8's outlier decomposition.

What it adds: `quantize_activations` (dynamic per-token absmax: one scale per row of x, computed at every forward, no
calibration), `int8_matmul` (torch._int_mm where it runs, else its exact float64 twin `int8_matmul_ref`),
`w8a8_linear` and its float twin `w8a8_reference`, and `llm_int8_linear` (Dettmers et al. 2022) with its twin.

    y = (sx sw^T) ⊙ (xq @ Wq^T) + b      xq = round(x / sx), sx = max|x_row| / 127;  Wq, sw per output channel

Both scales factor out of the sum over the input dimension, which is why they can be applied after the integer
matmul. The functions take a layer's buffers (or a layer with `qweight`, `scale`, `bias`, `config` and
`dequantized_weight()`, i.e. a `minillm.quant.linear.QuantLinear`). What it leaves out: static (calibrated)
activation scales, per-channel activation scales (SmoothQuant moves them into the weights instead, see
`minillm.quant.outliers`), and an int8 matmul kernel of its own: `torch._int_mm` is PyTorch's (oneDNN's GEMM on a
CPU where PyTorch has it, else a plain loop), and its CPU speed depends on the machine, from far slower than fp32
BLAS to faster: bench.py measures it and names the CPU.

NaN and inf activations: the per-step path (`w8a8_linear`, `llm_int8_linear`) never reads a value on the host (that
would be a sync per layer per decode step); a token holding NaN or inf gets a NaN/inf activation scale instead
(`symmetric_params`), so its output row is NaN, visibly wrong as the fp32 model's would be, never masked to a
plausible number. The functions a user calls to look at one tensor (`quantize_activations`, the float twins
`w8a8_reference`, `llm_int8_reference`) refuse it with a ValueError naming `x`. A NaN weight is refused when the layer
is built (`QuantLinear.from_linear`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from minillm.core.config import (check_device, check_float, check_float_tensor, check_linear_input, check_strided,
                                 tensor_kind)
from minillm.quant.quantize import check_finite, quantize_symmetric, symmetric_params


# The longest int8 dot product whose int32 sum cannot overflow: 131071. Each product is at most (-128)^2 = 2^14, and
# int32 holds up to 2^31 - 1, so K <= (2^31 - 1) // 2^14. subtle: K = 2^17 fits everything but all -128 codes, whose
# sum is exactly 2^31 and wraps to -2^31 (`quantize` never emits -128, but a caller's codes may).
MAX_INT8_K = (2**31 - 1) // 2**14


def _check_int8_operands(a: object, b: object) -> None:
    for name, t in (("a", a), ("b", b)):
        # check_strided first: a sparse operand is torch's "unsupported memory format option Contiguous", a nested
        # one has no shape to print
        if not isinstance(t, torch.Tensor) or check_strided(name, t).dtype != torch.int8 or t.dim() != 2:
            raise TypeError(f"{name} must be a 2-D int8 tensor, got {tensor_kind(t)} "
                            f"{tuple(getattr(t, 'shape', ()))}")
    if a.shape[1] != b.shape[0]:  # type: ignore[union-attr]
        raise ValueError(f"a {tuple(a.shape)} @ b {tuple(b.shape)}: "  # type: ignore[union-attr]
                         "the inner dimensions differ")
    if a.device != b.device or a.device.type == "meta":  # type: ignore[union-attr]
        # subtle: a meta operand has no values; mixed with a CPU one, the product came back as uninitialised memory
        raise ValueError(f"a and b must be on one real device, got {a.device} and {b.device}")  # type: ignore
    if a.shape[1] > MAX_INT8_K:  # type: ignore[union-attr]
        # subtle: each output sums K products of at most 128 * 128 = 2^14 in int32; from K = 2^17 on it can wrap around
        raise ValueError(f"a @ b sums K = {a.shape[1]} int8 products, more than {MAX_INT8_K}: the int32 result "
                         "could overflow; split K and add the parts")


LAYER_FIELDS = ("in_features", "qweight", "scale", "bias", "config", "dequantized_weight")


def _check_layer(layer: object) -> None:
    """A TypeError naming `layer` unless it has what the functions below read (a W8A8 `QuantLinear`'s fields) and
    its config's mode is "w8a8": an int4 or int8 weight-only layer has the same fields, and its codes are no int8
    operand (int4 codes are packed two per byte; asymmetric ones are uint8 with a zero point)."""
    missing = [name for name in LAYER_FIELDS if not hasattr(layer, name)]
    if missing:
        raise TypeError(f"layer must be a W8A8 QuantLinear (with {', '.join(LAYER_FIELDS)}), got "
                        f"{type(layer).__name__}, which has no {missing[0]!r}")
    mode = getattr(layer.config, "mode", None)  # type: ignore[attr-defined]
    if mode != "w8a8":
        raise TypeError(f"layer must be a W8A8 QuantLinear, got a {type(layer).__name__} of mode {mode!r}")


def _check_threshold(threshold: object) -> float:
    threshold = check_float("threshold", threshold, 0.0, include_minimum=False)
    return float(threshold)  # type: ignore[arg-type]


@functools.lru_cache(maxsize=None)
def int_mm_available(device_type: str) -> bool:
    """Whether torch._int_mm runs on this device type (probed once with a small product); a device type torch
    cannot read ('gpu0') is a ValueError naming device_type, not a quiet False."""
    check_device("device_type", device_type)
    if not hasattr(torch, "_int_mm"):
        return False
    try:
        a = torch.ones(32, 32, dtype=torch.int8, device=device_type)
        return bool((torch._int_mm(a, a) == 32).all())
    except (RuntimeError, NotImplementedError):
        return False


def int8_matmul_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (M, K) int8 @ b (K, N) int8 -> (M, N) int32, exactly, in float64 (any device, any shape).

    Exact because every partial sum is an integer of magnitude <= K * 127 * 127, far below 2^53.
    """
    _check_int8_operands(a, b)
    return (a.to(torch.float64) @ b.to(torch.float64)).to(torch.int32)


def int8_matmul(a: torch.Tensor, b: torch.Tensor, use_int_mm: bool = True) -> torch.Tensor:
    """a (M, K) int8 @ b (K, N) int8 -> (M, N) int32 with torch._int_mm where it runs, else `int8_matmul_ref`.

    subtle: `torch._int_mm` is a private op; CUDA needs M > 16 and K, N multiples of 8, so a batch-1 decode step
    falls back there. On the CPU it accepts any shape, but (PyTorch 2.x) it is a plain loop, slower than fp32 BLAS:
    the bench prints the numbers. Both paths give the same integers.
    """
    _check_int8_operands(a, b)
    if not isinstance(use_int_mm, bool):
        raise TypeError(f"use_int_mm must be a bool, got {use_int_mm!r}")
    M, K = a.shape
    N = b.shape[1]
    dev = a.device.type
    if use_int_mm and int_mm_available(dev) and (dev == "cpu" or (M > 16 and K % 8 == 0 and N % 8 == 0)):
        return torch._int_mm(_dense(a), _dense(b))
    return int8_matmul_ref(a, b)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """t itself when row- or column-major (a weight's `.t()` is not copied), else a row-major copy.

    subtle: torch._int_mm reads other layouts wrong: an expanded (stride-0) operand, e.g. `w[:1].expand(8, K)`, or
    overlapping strides give garbage read past the tensor's storage, without an error."""
    return t if t.is_contiguous() or t.t().is_contiguous() else t.contiguous()


def _quantize_rows(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-step map, unchecked: a row holding NaN/inf gets a NaN/inf scale (its output row becomes NaN)."""
    scale = symmetric_params(x2, 8, dim=1)  # (M, 1)
    return quantize_symmetric(x2, scale, 8, check_values=False), scale


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token int8: x (M, K) -> (codes (M, K) int8, scales (M, 1)), one absmax scale per row.

    Refuses NaN/inf (ValueError naming x); the forward path uses the unchecked twin, which propagates NaN instead.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {tensor_kind(x)}")
    if check_strided("x", x).dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"x must have shape (M, K) with K > 0, got {tuple(x.shape)}")
    check_finite("x", x)
    return _quantize_rows(x)


def w8a8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                use_int_mm: bool = True) -> torch.Tensor:
    """y = (sx sw^T) ⊙ (xq @ Wq^T) + b: x (..., K) float, qweight (N, K) int8, scale (N, 1) -> (..., N).

    The activation scale is per token and computed now (dynamic), so no calibration is needed; the weight's is per
    output channel. Both factor out of the sum over K, which is why they can be applied after the integer matmul.
    A token holding NaN/inf comes out NaN (module docstring); an integer x is a TypeError naming its dtype.
    """
    if not isinstance(qweight, torch.Tensor) or qweight.dtype != torch.int8 or qweight.dim() != 2:
        raise TypeError(f"qweight must be a 2-D int8 tensor (N, K), got {tensor_kind(qweight)}")
    check_strided("qweight", qweight)
    check_float_tensor("scale", scale)  # an int64 scale would multiply in as whole numbers
    if tuple(scale.shape) != (qweight.shape[0], 1):
        raise ValueError(f"scale must have shape ({qweight.shape[0]}, 1), got {tuple(getattr(scale, 'shape', ()))}")
    if bias is not None:
        # subtle: a (1,) bias would broadcast over all N outputs without a word; torch names neither argument
        check_float_tensor("bias", bias)
        if tuple(bias.shape) != (qweight.shape[0],):
            raise ValueError(f"bias must have shape ({qweight.shape[0]},), one per output, got {tuple(bias.shape)}")
    check_linear_input(x, qweight.shape[1])
    for name, t in (("qweight", qweight), ("scale", scale), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).float()  # (M, K), M = all tokens
    xq, sx = _quantize_rows(x2)  # (M, K) int8, (M, 1)
    acc = int8_matmul(xq, qweight.t(), use_int_mm)  # (M, K) @ (K, N) -> (M, N) int32
    y = acc.float() * sx * scale.t()  # (M, N) * (M, 1) * (1, N)
    if bias is not None:
        y = y + bias
    return y.to(x.dtype).reshape(*shape[:-1], qweight.shape[0])  # (..., N); N spelled out: x may hold no tokens


def w8a8_reference(x: torch.Tensor, layer: Any) -> torch.Tensor:
    """The float twin of W8A8: de-quantize both operands, then an fp32 `F.linear`, returned in x's dtype (as
    `w8a8_linear`). Refuses NaN/inf in x."""
    _check_layer(layer)
    check_linear_input(x, layer.in_features)
    x2 = x.reshape(-1, x.shape[-1]).float()  # (M, K)
    xq, sx = quantize_activations(x2)
    y = F.linear(xq.float() * sx, layer.dequantized_weight(), layer.bias)  # (M, N)
    return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])  # x's dtype, as w8a8_linear returns


def outlier_columns(x2: torch.Tensor, threshold: float) -> torch.Tensor:
    """(K,) bool: the input features where some token of x2 (M, K) reaches |x| >= threshold."""
    check_float_tensor("x2", x2, ndim=2)
    threshold = _check_threshold(threshold)
    return (x2.abs() >= threshold).any(dim=0)


def llm_int8_linear(x: torch.Tensor, layer: Any, threshold: float) -> torch.Tensor:
    """LLM.int8's mixed-precision decomposition (Dettmers et al. 2022, §3.2, eq. 8): the few input features with an
    outlier go through an fp32 matmul, everything else through W8A8, and the two partial sums are added.

        y = x_out @ deq(W)[:, out]^T  +  (sx sw^T) ⊙ (q(x_reg) @ Wq^T)     out: outlier features, reg: the rest

    The outliers are left out of the per-token activation scale, so they no longer flatten every other feature of
    their token to a few codes. The fp32 part multiplies the de-quantized weight columns (no fp32 copy is stored).
    """
    threshold = _check_threshold(threshold)
    _check_layer(layer)
    check_linear_input(x, layer.in_features)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).float()  # (M, K)
    cols = outlier_columns(x2, threshold)  # (K,)
    regular = x2.masked_fill(cols, 0.0)  # (M, K): outlier features zeroed, so they add nothing to the int8 sum
    y = w8a8_linear(regular, layer.qweight, layer.scale, layer.bias, layer.config.use_int_mm)  # (M, N)
    idx = cols.nonzero().squeeze(1)  # (k,) the outlier features: a host sync, and a shape that depends on data
    if idx.numel():
        w_out = layer.qweight.index_select(1, idx).float() * layer.scale  # (N, k): de-quantized weight columns
        y = y + x2.index_select(1, idx) @ w_out.t()  # (M, k) @ (k, N)
    return y.to(x.dtype).reshape(*shape[:-1], y.shape[-1])  # N spelled out: -1 is ambiguous when M = 0


def llm_int8_reference(x: torch.Tensor, layer: Any, threshold: float) -> torch.Tensor:
    """The float twin of `llm_int8_linear`: de-quantize everything, one fp32 `F.linear` per part, returned in x's
    dtype (as `llm_int8_linear`). Refuses NaN/inf."""
    threshold = _check_threshold(threshold)
    _check_layer(layer)
    check_linear_input(x, layer.in_features)
    check_finite("x", x)
    x2 = x.reshape(-1, x.shape[-1]).float()  # (M, K)
    cols = outlier_columns(x2, threshold)
    w = layer.dequantized_weight()  # (N, K)
    y = w8a8_reference(x2.masked_fill(cols, 0.0), layer) + F.linear(x2 * cols, w)  # (M, N)
    return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])

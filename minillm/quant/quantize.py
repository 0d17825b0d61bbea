"""Quantization as pure functions: float tensor -> small integers + scales (+ zero points), and back.

What it adds: the two affine maps every later piece of chapter 09 is built from, at three granularities, for int8
and int4, and the packing of two int4 values into one byte:

    symmetric (absmax):     s = max|x| / qmax              q = clamp(round(x / s), -qmax, qmax)    x̂ = s * q
    asymmetric (zero point): s = (max - min) / (2^b - 1)    z = round(-min / s)
                             q = clamp(round(x / s) + z, 0, 2^b - 1)                            x̂ = s * (q - z)

with qmax = 2^(b-1) - 1 (127 for int8, 7 for int4: the restricted range, so +x and -x round to +q and -q). The range
an asymmetric grid covers always contains 0 (min <= 0 <= max), so 0.0 is represented exactly. For every value
inside the range the round trip errs by at most half a step: |x - x̂| <= s / 2 (rounding to the nearest grid
point; the clamp only removes the half-step overshoot of a rounded zero point).

Granularity is how many values share one scale. A tensor is seen as rows (its first dimension; one row for
per-tensor) cut into groups of consecutive values along the rest:

    per-tensor   scale (1, 1)                 one scale for everything
    per-channel  scale (rows, 1)              one per output channel of a weight, or per token of an activation
    group-wise   scale (rows, cols // g)      one per g consecutive input columns of each row (g = 32, 64, 128)

so a `QuantizedTensor` never needs to say which it is: its scale's shape does. What it leaves out: the modules
that use these (`minillm.quant.linear`), choosing the grid better than min/max (GPTQ in `minillm.quant.gptq`
keeps the grid and changes the rounding), fp8 and other float formats, and stochastic rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minillm.core.config import (check_bool, check_choice, check_float_tensor, check_has_data, check_strided,
                                 number_kind, plain_number, short_repr, tensor_kind)

BITS = (4, 8)
GRANULARITIES = ("tensor", "channel", "group")


def _check_bits(bits: object) -> int:
    if not isinstance(bits, int):  # 8.0 would pass `in BITS`; bool is an int, refused below as a value
        raise TypeError(f"bits must be an int, one of {BITS}, got {number_kind(bits)}")
    # the plain int: an int subclass whose == always says True would pass `in BITS`
    if isinstance(bits, bool) or int.__index__(bits) not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {short_repr(bits)}")
    return int.__index__(bits)


def _check_float(name: str, x: object) -> torch.Tensor:
    return check_float_tensor(name, x)  # float16/bfloat16/float32/float64, holding values


def _check_bool(name: str, value: object) -> bool:
    return check_bool(name, value)  # a numpy bool too


def _check_codes(name: str, q: object) -> torch.Tensor:
    if not isinstance(q, torch.Tensor) or q.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"{name} must be an int8 or uint8 tensor of codes, got {tensor_kind(q)}")
    return check_has_data(name, q)


def _check_dim(x: torch.Tensor, dim: object) -> tuple[int, ...]:
    """The dimensions `dim` names (None = all), each in range and named once; TypeError/ValueError naming dim."""
    if dim is None:
        return tuple(range(x.dim()))
    dims = (dim,) if isinstance(dim, int) else dim
    if (not isinstance(dims, (tuple, list)) or not dims
            or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims)):
        raise TypeError(f"dim must be an int, a non-empty tuple of ints or None, got {short_repr(dim)}")
    dims = tuple(int.__index__(d) for d in dims)  # the plain ints: an int subclass's comparisons are not consulted
    n = max(x.dim(), 1)  # torch lets a 0-d tensor be reduced along dim 0 or -1
    if not all(-n <= d < n for d in dims):
        raise ValueError(f"dim={short_repr(dims[0] if len(dims) == 1 else dims)} is out of range for x with {x.dim()} "
                         "dimensions")
    if len({d % n for d in dims}) != len(dims):
        raise ValueError(f"dim={short_repr(dims)} names the same dimension twice")
    return tuple(d % n for d in dims)


def _check_reducible(x: object, dim: int | tuple[int, ...] | None) -> tuple[int, ...] | None:
    """x a float tensor with something to take a min/max over along `dim` (None = all of it); returns the
    dimensions as plain non-negative ints (`_check_dim`), or None for all of x."""
    x = _check_float("x", x)
    dims = _check_dim(x, dim)
    if x.numel() == 0 and (dim is None or any(x.shape[d] == 0 for d in dims)):
        raise ValueError(f"x of shape {tuple(x.shape)} is empty along dim={short_repr(dim)}: there is no range to "
                         f"choose a scale from")
    return None if dim is None else dims


def _check_broadcasts(name: str, t: torch.Tensor, x_name: str, x: torch.Tensor) -> None:
    """`t` broadcasts against `x` without changing x's shape; ValueError naming `name` otherwise (host-only)."""
    check_strided(name, t)  # a nested tensor has no shape to read: "NestedTensorImpl doesn't support sizes"
    try:
        fits = torch.broadcast_shapes(t.shape, x.shape) == x.shape
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"{name} of shape {tuple(t.shape)} does not broadcast against {x_name} of shape "
                         f"{tuple(x.shape)}")


def check_scale_positive(scale: torch.Tensor) -> None:
    """No scale <= 0 (a zero scale divides by zero, a negative one flips every sign); NaN passes (see
    `symmetric_params`). One host sync. A TypeError naming scale unless it is a floating-point tensor."""
    check_float_tensor("scale", scale, values=False)  # the meta case gets its own message below
    if scale.device.type == "meta":
        raise ValueError(f"scale is a meta tensor (shape {tuple(scale.shape)}): it has no values to check; pass "
                         "check_values=False to map meta tensors")
    if bool((scale <= 0).any()):
        raise ValueError(f"scale must be > 0, got {int((scale <= 0).sum())} scale(s) <= 0 (smallest "
                         f"{scale.min().item():g})")


def _check_zero(zero: object, x: torch.Tensor, bits: int, check_values: bool) -> torch.Tensor:
    """Zero points: an integer or float tensor (not bool, not complex) broadcasting against x and, when
    `check_values`, whole numbers on the asymmetric grid [0, 2^b - 1] (one host sync); TypeError/ValueError naming
    zero."""
    if not isinstance(zero, torch.Tensor):
        raise TypeError(f"zero must be a tensor of zero points, got {type(zero).__name__}")
    if zero.dtype == torch.bool or zero.is_complex():  # bool passed as 0/1 codes; complex failed in torch's `<`
        raise TypeError(f"zero must be an integer or float tensor of zero points, got {zero.dtype}")
    check_strided("zero", zero)  # a sparse zero point: torch's "Could not run 'aten::lt.Scalar' ... SparseCPU"
    _check_broadcasts("zero", zero, "x", x)
    lo, hi = qrange(bits, symmetric=False)
    if check_values and zero.device.type == "meta":
        raise ValueError(f"zero is a meta tensor (shape {tuple(zero.shape)}): it has no values to check; pass "
                         "check_values=False to map meta tensors")
    if check_values:
        off = (zero < lo) | (zero > hi)
        if zero.is_floating_point():
            off |= zero != torch.round(zero)  # NaN too: it is not equal to itself
        if bool(off.any()):
            raise ValueError(f"zero must hold whole numbers in [{lo}, {hi}] ({bits}-bit asymmetric codes), got "
                             f"{zero[off].reshape(-1)[0].item()!r}")
    return zero


def _widen(*ts: torch.Tensor) -> list[torch.Tensor]:
    """The tensors in the dtype torch computes them in together (`x / scale`'s), fp32 at least.

    subtle: x / s rounded to bf16 (8 significant bits) is off by up to a whole code near 127 (round(x / s) must be
    exact: |x - x̂| <= s / 2); in fp32 the quotient of two bf16 or fp16 values rounds to the same integer as the
    exact one."""
    together = torch.result_type(*ts) if len(ts) == 2 else ts[0].dtype
    dtype = torch.promote_types(together, torch.float32)
    return [t.to(dtype) for t in ts]


def tensor_state(*tensors: torch.Tensor | None) -> tuple:
    """Each tensor's identity and version counter (None stays None), read on the host for free: replacing a tensor,
    or writing into it in place (`mul_`, `fill_`, `copy_`, `load_state_dict`), changes it, so a value check need
    only run again when this does. Writes that bump no counter are not seen: through `.data`, or into an inference
    tensor (made under `torch.inference_mode`). A TypeError naming the position of anything else."""
    for i, t in enumerate(tensors):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"tensor_state takes tensors (or None), got {tensor_kind(t)} at position {i}")
    return tuple(None if t is None else (id(t), -1 if t.is_inference() else t._version) for t in tensors)


def check_finite(name: str, x: torch.Tensor) -> torch.Tensor:
    """x unchanged, or a ValueError naming it when it holds NaN or inf (one host sync: not for a per-step path), or
    when it is a meta tensor (a shape without values: nothing to check or to quantize); a TypeError naming it when
    it is not a tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {tensor_kind(x)}")
    check_has_data(name, x)
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} holds inf or NaN values, which have no integer code")
    return x


def qrange(bits: int, symmetric: bool) -> tuple[int, int]:
    """The integers a code may take: symmetric (-qmax, qmax) with qmax = 2^(b-1) - 1, asymmetric (0, 2^b - 1).

    int8: (-127, 127) or (0, 255); int4: (-7, 7) or (0, 15).
    """
    bits = _check_bits(bits)
    _check_bool("symmetric", symmetric)
    return (-(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1) if symmetric else (0, 2**bits - 1)


def storage_dtype(symmetric: bool) -> torch.dtype:
    """int8 for signed codes, uint8 for unsigned ones (int4 codes too, one per byte, until `pack_int4`)."""
    _check_bool("symmetric", symmetric)
    return torch.int8 if symmetric else torch.uint8


# ----- the two maps, given their parameters --------------------------------------------------------------------


def quantize_symmetric(x: torch.Tensor, scale: torch.Tensor, bits: int, *,
                       check_values: bool = True) -> torch.Tensor:
    """q = clamp(round(x / scale), -qmax, qmax) as int8; `scale` broadcasts against x and must be > 0.

    Worked example (int8, scale = 0.5 / 127): x = [0.5, -0.25, 0.001] -> x / s = [127, -63.5, 0.254]
    -> q = [127, -64, 0] (torch.round rounds halves to even: -63.5 -> -64).

    subtle: NaN has no integer code (cast to int8 it becomes some number); this map does not look at x (a check
    would cost a host sync on every decode step). Scales from `symmetric_params` carry the NaN instead, so
    de-quantizing gives NaN back. `quantize` refuses non-finite input outright. A scale <= 0 is refused (one host
    sync); `check_values=False` skips that read, for per-step callers whose scales come from `symmetric_params`.
    """
    _check_float("x", x)
    _check_float("scale", scale)
    _check_broadcasts("scale", scale, "x", x)
    _check_bool("check_values", check_values)
    if check_values:
        check_scale_positive(scale)
    lo, hi = qrange(bits, symmetric=True)
    x, scale = _widen(x, scale)  # x / s in fp32 at least (bf16 would round it by up to a code)
    # BEGIN SOLUTION
    return torch.clamp(torch.round(x / scale), lo, hi).to(torch.int8)
    # END SOLUTION


def dequantize_symmetric(q: torch.Tensor, scale: torch.Tensor, *, check_values: bool = True) -> torch.Tensor:
    """x̂ = scale * q, in the scale's float dtype. A scale <= 0 is refused (one host sync), as `quantize_symmetric`
    refuses it; `check_values=False` skips that read, for per-step callers whose scales were checked already."""
    _check_codes("q", q)
    _check_float("scale", scale)
    _check_broadcasts("scale", scale, "q", q)
    _check_bool("check_values", check_values)
    if check_values:
        check_scale_positive(scale)
    # BEGIN SOLUTION
    return q.to(scale.dtype) * scale
    # END SOLUTION


def quantize_asymmetric(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, *,
                        check_values: bool = True) -> torch.Tensor:
    """q = clamp(round(x / scale) + zero, 0, 2^b - 1) as uint8; `scale` and `zero` broadcast against x.

    Worked example (int4, x in [-1, 2]): s = 3 / 15 = 0.2, z = round(1 / 0.2) = 5; x = [-1, 0, 2]
    -> x / s + z = [0, 5, 15] -> q = [0, 5, 15], and 0.0 comes back exactly as 0.2 * (5 - 5).
    A scale <= 0, or a zero point that is not a whole number in [0, 2^b - 1], is refused (one host sync);
    `check_values=False` skips that read, for callers whose parameters come from `asymmetric_params`.
    """
    _check_float("x", x)
    _check_float("scale", scale)
    _check_broadcasts("scale", scale, "x", x)
    _check_bool("check_values", check_values)
    _check_zero(zero, x, bits, check_values)
    if check_values:
        check_scale_positive(scale)
    lo, hi = qrange(bits, symmetric=False)
    x, scale = _widen(x, scale)  # x / s in fp32 at least (bf16 would round it by up to a code)
    # BEGIN SOLUTION
    return torch.clamp(torch.round(x / scale) + zero.to(x.dtype), lo, hi).to(torch.uint8)
    # END SOLUTION


def dequantize_asymmetric(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, *,
                          check_values: bool = True) -> torch.Tensor:
    """x̂ = scale * (q - zero), in the scale's float dtype. A scale <= 0, or a zero point that is not a whole number
    in [0, 255] (the widest grid, 8 bits), is refused (one host sync), as `quantize_asymmetric` refuses it;
    `check_values=False` skips that read, for per-step callers whose parameters were checked already."""
    _check_codes("q", q)
    _check_float("scale", scale)
    _check_broadcasts("scale", scale, "q", q)
    if not isinstance(zero, torch.Tensor):
        raise TypeError(f"zero must be a tensor of zero points, got {type(zero).__name__}")
    _check_broadcasts("zero", zero, "q", q)
    _check_bool("check_values", check_values)
    _check_zero(zero, q, 8, check_values)
    if check_values:
        check_scale_positive(scale)
    # BEGIN SOLUTION
    return (q.to(scale.dtype) - zero.to(scale.dtype)) * scale
    # END SOLUTION


# ----- choosing the parameters (min/max calibration) -----------------------------------------------------------


def symmetric_params(x: torch.Tensor, bits: int, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """scale = max|x| / qmax over `dim` (kept, so it broadcasts; None = all of x). An all-zero slice gets scale 1.

    subtle: a zero scale would turn 0 / 0 into NaN; any positive scale codes an all-zero slice exactly as 0.
    subtle: a slice holding NaN (or inf) gets a NaN (inf) scale, so its de-quantized values are NaN, visibly wrong,
    never a plausible 0: `absmax > 0` is False for NaN, which is why the test is `absmax == 0` (no host sync).
    """
    dim = _check_reducible(x, dim)  # the plain dims
    _, qmax = qrange(bits, symmetric=True)
    absmax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    # subtle: a subnormal max|x| (1e-44) over qmax underflows to a zero scale; the smallest normal float codes it
    # as 0, within half a step. clamp keeps NaN and inf as they are.
    scale = (absmax / qmax).clamp(min=torch.finfo(absmax.dtype).tiny) if absmax.is_floating_point() else absmax / qmax
    return torch.where(absmax == 0, torch.ones_like(scale), scale)


def asymmetric_params(x: torch.Tensor, bits: int, dim: int | tuple[int, ...] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) from the min and max over `dim`, the range widened to contain 0; zero is uint8 in [0, 2^b - 1].

    NaN or inf in x is a ValueError naming x (one host sync): unlike `symmetric_params`, whose NaN scale carries
    the NaN through, the zero point round(-min / scale) would be NaN cast to uint8, a plausible code.
    """
    dim = _check_reducible(x, dim)  # the plain dims
    check_finite("x", x)
    _, qmax = qrange(bits, symmetric=False)
    if dim is None:
        lo, hi = x.amin(), x.amax()
    else:
        lo, hi = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)  # 0 must lie on the grid
    span = hi - lo
    # subtle: max - min overflows to inf (fp32: -3e38 and 3e38) though both ends are finite; max/qmax - min/qmax
    # does not, and is used only there, so every other scale stays span / qmax bit for bit.
    step = torch.where(torch.isinf(span), hi / qmax - lo / qmax, span / qmax)
    step = step.clamp(min=torch.finfo(step.dtype).tiny)  # a subnormal range: no zero scale (see symmetric_params)
    scale = torch.where(span == 0, torch.ones_like(span), step)
    zero = torch.clamp(torch.round(-lo / scale), 0, qmax).to(torch.uint8)
    return scale, zero


# ----- whole tensors at a granularity --------------------------------------------------------------------------


@dataclass
class QuantizedTensor:
    """Integer codes with their scales; dequantize(qt) gives back a float tensor of `shape`.

    q: the codes, shape `shape`, int8 (symmetric) or uint8 (asymmetric), one code per element (int4 too: packing
    is a storage decision, see `pack_int4`). scale: float (rows, groups), zero: uint8 (rows, groups) or None for
    symmetric. The value at row r, group j, element k is scale[r, j] * (q - zero[r, j]).

    Building one checks shapes and dtypes, then the values in one host sync: codes that fit `bits` ([-8, 7] or
    [0, 15] for 4 bits), scales finite and > 0, zero points in [0, 2^b - 1]. `from_checked` skips the values, for
    a layer's own buffers rebuilt on every forward. The fields may be changed afterwards: `dequantize` checks the
    shapes and dtypes again on every call (host-only), and the values again, once, when a field was replaced, a
    tensor written in place or `bits` changed since they were last checked (`tensor_state`: no host sync
    otherwise). So `qt.bits = 4` over 8-bit codes is a ValueError naming q and bits, not codes read modulo 16.
    """

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    bits: int
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        self._check_layout()
        self._check_values()
        self._checked = self._state()

    def _state(self) -> tuple:
        """What the value check saw: the tensors (`tensor_state`) and bits."""
        return (*tensor_state(self.q, self.scale, self.zero), self.bits)

    def _recheck(self) -> None:
        """Shapes and dtypes again (host-only), and the values again (one host sync) only if something changed since
        they were last checked; no value is read inside a compiled graph (no host sync may run there)."""
        self._check_layout()
        if torch.compiler.is_compiling() or getattr(self, "_checked", None) == self._state():
            return
        self._check_values()
        self._checked = self._state()

    @classmethod
    def from_checked(cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int,
                     shape: tuple[int, ...]) -> "QuantizedTensor":
        """The same, its shapes and dtypes checked but no value read (no host sync, no pass over the codes): for
        codes and scales checked when they were stored, e.g. a QuantLinear's buffers on each forward."""
        qt = object.__new__(cls)
        qt.q, qt.scale, qt.zero, qt.bits, qt.shape = q, scale, zero, bits, shape
        qt._check_layout()
        if not torch.compiler.is_compiling():
            qt._checked = qt._state()  # taken as checked: later changes to it are still seen
        return qt

    def _check_layout(self) -> None:
        # Shapes and dtypes only (no values read: no host sync).
        _check_codes("q", self.q)
        if not isinstance(self.scale, torch.Tensor) or not self.scale.is_floating_point() or self.scale.dim() != 2:
            raise TypeError(f"scale must be a 2-D float tensor (rows, groups), got "
                            f"{tensor_kind(self.scale)} {tuple(getattr(self.scale, 'shape', ()))}")
        if self.zero is not None and (not isinstance(self.zero, torch.Tensor) or self.zero.dtype != torch.uint8
                                      or self.zero.shape != self.scale.shape):
            raise TypeError(f"zero must be None or a uint8 tensor shaped like scale {tuple(self.scale.shape)}, got "
                            f"{tensor_kind(self.zero)}")
        if (self.zero is None) != (self.q.dtype == torch.int8):
            # subtle: int8 codes given a zero point (a field replaced after construction) would de-quantize as
            # asymmetric, every code shifted by it: a plausible tensor of wrong values
            raise TypeError(f"zero must be None for int8 (symmetric) codes and a uint8 tensor for uint8 (asymmetric) "
                            f"ones, got q {self.q.dtype} with zero "
                            f"{'None' if self.zero is None else tensor_kind(self.zero)}")
        self.bits = _check_bits(self.bits)
        # subtle: (4, 16.0) == (4, 16) in Python, and reshape then refuses the float naming nothing: plain ints only
        if not isinstance(self.shape, tuple) or any(type(d) is not int for d in self.shape) \
                or tuple(self.q.shape) != self.shape:
            raise ValueError(f"shape must be the codes' shape {tuple(self.q.shape)} as a tuple, got "
                             f"{short_repr(self.shape)}")
        rows, groups = self.scale.shape
        code_rows = self.q.shape[0] if self.q.dim() else 1
        if (rows, groups) != (1, 1) and rows != code_rows:
            # subtle: only the count was checked before; 3 scale rows for 4 code rows de-quantized groups that
            # straddle two rows of q, a plausible tensor of wrong values
            raise ValueError(f"scale has {rows} rows for q's {code_rows}: it must be (1, 1) (one scale for the "
                             f"tensor) or have one row per row of q, got scale shape {tuple(self.scale.shape)}")
        if rows * groups == 0 or self.q.numel() % (rows * groups):
            raise ValueError(f"{rows} x {groups} scales cannot share {self.q.numel()} codes evenly")
        for name, t in (("scale", self.scale), ("zero", self.zero)):
            if t is not None and t.device != self.q.device:
                raise ValueError(f"{name} must be on the codes' device {self.q.device}, got {t.device}")

    def _check_values(self) -> None:
        # One host sync. Symmetric codes may take the full 4-bit range [-8, 7] (a -8 de-quantizes fine; the
        # restricted grid [-7, 7] is what `quantize` chooses, not what storage can hold).
        lo, hi = (-(2 ** (self.bits - 1)), 2 ** (self.bits - 1) - 1) if self.zero is None else (0, 2**self.bits - 1)
        if self.q.device.type == "meta":
            return  # no values to read
        checks = [((self.q < lo) | (self.q > hi)).any(), ~(torch.isfinite(self.scale) & (self.scale > 0)).all()]
        if self.zero is not None:
            checks.append((self.zero > hi).any())
        bad_q, bad_scale, *bad_zero = torch.stack(checks).tolist()
        if bad_q:
            raise ValueError(f"q holds codes outside [{lo}, {hi}], which bits={self.bits} "
                             f"{'symmetric' if self.zero is None else 'asymmetric'} codes cannot take")
        if bad_scale:
            raise ValueError("scale must hold finite values > 0 (a zero or NaN scale loses the weights, a negative "
                             "one flips their signs)")
        if any(bad_zero):
            raise ValueError(f"zero holds zero points above {hi}, off the {self.bits}-bit grid [0, {hi}]")

    @property
    def symmetric(self) -> bool:
        return self.zero is None

    @property
    def group_size(self) -> int:
        """Values per scale along a row: numel for per-tensor, the row length for per-channel."""
        rows, groups = self.scale.shape
        return self.q.numel() // (rows * groups)


def _grouped_view(x: torch.Tensor, granularity: str, group_size: int | None) -> torch.Tensor:
    """x viewed as (rows, groups, group_size): the values that share one scale lie along the last dimension."""
    granularity = check_choice("granularity", granularity, GRANULARITIES)
    if x.dim() == 0:
        raise ValueError("x is a 0-d tensor: quantize needs at least one dimension (x.reshape(1) for a scalar)")
    if granularity != "group" and group_size is not None:  # else it would be ignored: one scale per row or tensor
        raise ValueError(f"group_size={short_repr(group_size)} applies to granularity='group' only, got granularity="
                         f"{granularity!r}; leave group_size None")
    if granularity == "tensor":
        return x.reshape(1, 1, -1)  # (1, 1, numel)
    rows = x.shape[0]
    cols = x[0].numel() if rows else 0
    if granularity == "channel":
        return x.reshape(rows, 1, cols)  # (rows, 1, cols)
    group_size = plain_number(group_size)  # an int subclass's own comparisons are not consulted
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group-wise quantization needs a positive int group_size, got {short_repr(group_size)}")
    if cols % group_size:
        raise ValueError(f"group_size={short_repr(group_size)} does not divide the row length {cols} of a tensor "
                         f"shaped {tuple(x.shape)}")
    return x.reshape(rows, cols // group_size, group_size)  # (rows, groups, g)


def quantize(x: torch.Tensor, bits: int = 8, symmetric: bool = True, granularity: str = "channel",
             group_size: int | None = None) -> QuantizedTensor:
    """Quantize x with min/max parameters at a granularity ("tensor", "channel" = per row, "group" of group_size).

    A weight (out, in) per channel gets one scale per output row; group-wise, one per `group_size` input columns of
    each row. For activations (..., C) per token, pass x.reshape(-1, C) with granularity="channel". A bf16 or fp16
    x is quantized in fp32 (its scales are fp32, and so is `dequantize`'s result): in bf16, x / s itself rounds by
    up to a code.
    """
    _check_float("x", x)
    bits = _check_bits(bits)
    _check_bool("symmetric", symmetric)
    if x.numel() == 0:
        raise ValueError(f"cannot quantize an empty tensor x of shape {tuple(x.shape)}")
    check_finite("x", x)
    (x,) = _widen(x)  # bf16/fp16 in fp32: scales and codes as the exact x / s gives them (`_widen`)
    g = _grouped_view(x, granularity, group_size)  # (rows, groups, gs)
    if symmetric:
        scale = symmetric_params(g, bits, dim=2)  # (rows, groups, 1)
        q, zero = quantize_symmetric(g, scale, bits), None
    else:
        scale, zero = asymmetric_params(g, bits, dim=2)  # (rows, groups, 1) each
        q = quantize_asymmetric(g, scale, zero, bits)
        zero = zero.squeeze(2)  # (rows, groups)
    return QuantizedTensor(q.reshape(x.shape), scale.squeeze(2), zero, bits, tuple(x.shape))


def dequantize(qt: QuantizedTensor) -> torch.Tensor:
    """The float tensor `qt` stands for: scale * (q - zero) group by group, shaped like the original.

    The shapes and dtypes are checked again (no value read): a field replaced after construction (`qt.scale = ...`)
    is a TypeError/ValueError naming it, not a reshape error or a tensor of the wrong shape. The values are read
    again (one host sync) only when a field changed since they were last checked (see `QuantizedTensor`)."""
    if not isinstance(qt, QuantizedTensor):
        raise TypeError(f"qt must be a QuantizedTensor (from quantize), got {type(qt).__name__}")
    qt._recheck()
    rows, groups = qt.scale.shape
    q = qt.q.reshape(rows, groups, -1)  # (rows, groups, gs)
    scale = qt.scale.unsqueeze(2)  # (rows, groups, 1)
    # No value read (a layer's forward comes here every step): QuantizedTensor checked its values when built.
    if qt.zero is None:
        x = dequantize_symmetric(q, scale, check_values=False)
    else:
        x = dequantize_asymmetric(q, scale, qt.zero.unsqueeze(2), check_values=False)
    return x.reshape(qt.shape)


# ----- int4 storage: two codes per byte ------------------------------------------------------------------------


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack int4 codes two per byte along the last dimension: (..., 2n) -> (..., n) uint8.

    Element 2i goes to the low nibble of byte i, element 2i+1 to the high nibble. Signed codes (int8 tensor,
    values -8..7) are stored as their 4-bit two's complement (-1 -> 0b1111), unsigned ones (uint8, 0..15) as they
    are. Worked example: [3, -2] -> low 0b0011, high 0b1110 -> byte 0b1110_0011 = 227.
    """
    if not isinstance(q, torch.Tensor) or q.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"pack_int4 needs q, an int8 or uint8 tensor of codes, got {tensor_kind(q)}")
    check_has_data("q", q)  # its codes' range is read below
    if q.dim() == 0 or q.shape[-1] % 2:
        raise ValueError(f"pack_int4 needs q with an even last dimension, got shape {tuple(q.shape)}")
    lo, hi = (-8, 7) if q.dtype == torch.int8 else (0, 15)
    if q.numel() and (int(q.min()) < lo or int(q.max()) > hi):
        raise ValueError(f"q holds {q.dtype} codes in [{int(q.min())}, {int(q.max())}]: they must lie in [{lo}, {hi}] "
                         "to fit 4 bits")
    # BEGIN SOLUTION
    nibbles = q.to(torch.int16) & 0xF  # (..., 2n): two's complement for negatives, in 0..15
    low, high = nibbles[..., 0::2], nibbles[..., 1::2]  # (..., n) each
    return (low | (high << 4)).to(torch.uint8)  # (..., n)
    # END SOLUTION


def unpack_int4(packed: torch.Tensor, signed: bool) -> torch.Tensor:
    """Undo `pack_int4`: (..., n) uint8 -> (..., 2n), int8 in -8..7 when `signed`, else uint8 in 0..15."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise TypeError(f"unpack_int4 needs packed, a uint8 tensor, got {tensor_kind(packed)}")
    check_strided("packed", packed)
    _check_bool("signed", signed)
    if packed.dim() == 0:
        raise ValueError("unpack_int4 needs packed with at least one dimension, got a 0-d tensor")
    # BEGIN SOLUTION
    p = packed.to(torch.int16)
    low, high = p & 0xF, p >> 4  # (..., n) each, 0..15
    nibbles = torch.stack((low, high), dim=-1).flatten(-2)  # (..., n, 2) -> (..., 2n): low nibble first
    if signed:
        return ((nibbles ^ 8) - 8).to(torch.int8)  # sign-extend 4 bits: 0..7 stay, 8..15 -> -8..-1
    return nibbles.to(torch.uint8)
    # END SOLUTION

"""Quantized layers swapped in for `nn.Linear`: weight-only int8/int4 de-quantized on the fly, and W8A8.

What it adds: `QuantConfig` (the mode, explicit), `QuantLinear` (integer weights + scales as buffers; its forward
is `F.linear` with the de-quantized weight, or for W8A8 an int8 x int8 -> int32 matmul with a per-token activation
scale computed at run time, see `minillm.quant.w8a8`), the tied embedding/head pair (`QuantEmbedding`,
`TiedQuantHead`), and `quantize_model(model, config)`, which returns a quantized copy of a GPT (a `QuantizedGPT`);
the original is left untouched.

    weight-only   y = x @ deq(Wq)^T + b                    the matmul is fp32; only memory shrinks
    W8A8          y = (sx * sw^T) ⊙ (xq @ Wq^T) + b       xq = round(x / sx), sx = max|x_row| / 127 per token;
                                                           the matmul runs on int8 codes, accumulated in int32

The output head is tied to the token embedding (one V x C matrix, 18% of `base`'s weights). With
`quantize_head=False` (the default) both stay fp32. With True the matrix is quantized once, per row: a row is
an output channel of the head and a token's vector for the embedding, so one scale per row serves both; the
embedding looks up and de-quantizes the rows it needs, the head multiplies by all of them.

What it leaves out: fused de-quantization kernels (chapter 12 writes an int8 GEMV), so on the CPU the weight-only
forward *adds* a conversion pass over the weight to every matmul (bench.py measures what that costs, and what the
4x smaller weights win back at decode); smoothing activation outliers (`minillm.quant.outliers`), and choosing the
rounding better than nearest (`minillm.quant.gptq`).
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.core.config import (check_bool, check_choice, check_float, check_has_data, check_int, check_label,
                                 check_module_has_data, check_strided, check_tensor_elements, short_repr, tensor_kind)
from minillm.core.model import GPT, require_model
from minillm.core.weights import untied_head
from minillm.quant.quantize import QuantizedTensor, dequantize, pack_int4, quantize, tensor_state, unpack_int4
from minillm.quant.w8a8 import llm_int8_linear, w8a8_linear

MODES = ("int8", "int4", "w8a8")


@dataclass(frozen=True)
class QuantConfig:
    """How to quantize a model's linear layers. Presets: int8 per channel, int4 group-wise, W8A8."""

    mode: str  # "int8": weight-only, per output channel; "int4": weight-only, group-wise; "w8a8": int8 weights
    #            per channel and int8 activations per token (dynamic: scales computed at every forward)
    group_size: int = 128  # int4 only: input columns per scale (32, 64, 128 ...); must divide every layer's width
    symmetric: bool = True  # weights: absmax (no zero point) or min/max with a zero point; W8A8 needs symmetric
    quantize_head: bool = False  # also quantize the tied embedding / output head matrix (per row)
    use_int_mm: bool = True  # W8A8: torch._int_mm where it runs; False (or unsupported) -> the exact float64 twin
    outlier_threshold: float | None = None  # W8A8 only: input features with any |x| >= this run in fp32 (LLM.int8's
    #                                         mixed-precision decomposition; Dettmers et al. 2022 use 6.0); None = off

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", check_choice("mode", self.mode, MODES))  # frozen: the plain str
        object.__setattr__(self, "group_size", check_int("group_size", self.group_size))  # frozen: the plain int
        for name in ("symmetric", "quantize_head", "use_int_mm"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.outlier_threshold is not None:
            object.__setattr__(self, "outlier_threshold", check_float("outlier_threshold", self.outlier_threshold,
                                                                      0.0, include_minimum=False))
            if self.mode != "w8a8":
                raise ValueError(f"outlier_threshold decomposes activations: it needs mode='w8a8', got {self.mode!r}")
        if self.mode == "w8a8" and not self.symmetric:
            raise ValueError("w8a8 keeps both operands symmetric (a zero point would add correction terms to the "
                             "integer matmul); use symmetric=True")

    @property
    def bits(self) -> int:
        return 4 if self.mode == "int4" else 8

    @property
    def granularity(self) -> str:
        return "group" if self.mode == "int4" else "channel"

    @property
    def quantize_group_size(self) -> int | None:
        """group_size as `quantize` takes it beside `granularity`: the int4 group, None for the per-channel modes
        (whose `group_size` field is unused; `quantize` refuses a group size it would ignore)."""
        return self.group_size if self.granularity == "group" else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "QuantConfig":
        if not isinstance(d, dict):
            raise TypeError(f"a QuantConfig is built from a dict, got {type(d).__name__}")
        unknown = set(d) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise ValueError(f"unknown QuantConfig fields {sorted(unknown)}")
        return cls(**d)


# ----- the modules ---------------------------------------------------------------------------------------------


def _check_buffer(name: str, t: object, shape: tuple[int, ...], dtype: torch.dtype | None) -> None:
    """A QuantLinear buffer: a tensor of `shape` and `dtype` (None: any float dtype), else a TypeError/ValueError
    naming it (host-only)."""
    if not isinstance(t, torch.Tensor) or (not t.is_floating_point() if dtype is None else t.dtype != dtype):
        raise TypeError(f"{name} must be a {dtype or 'float'} tensor of shape {shape} for this layer, got "
                        f"{tensor_kind(t)}: was it replaced after the layer was built?")
    if tuple(check_strided(name, t).shape) != shape:
        raise ValueError(f"{name} must have shape {shape} for this layer, got {tuple(t.shape)}: was it replaced after "
                         "the layer was built?")


class QuantLinear(nn.Module):
    """A linear layer holding integer weights: `qweight` (out, in) int8/uint8, or (out, in/2) packed int4 codes,
    `scale` (out, groups) fp32, `zero` (out, groups) uint8 when asymmetric, `bias` (out,) fp32 or None.

    Build one with `from_linear`; `forward` equals `F.linear(x, self.dequantized_weight(), self.bias)` (weight-only;
    symmetric int8 scales the output instead of the weight, equal to float rounding) or
    `minillm.quant.w8a8.w8a8_reference` (W8A8). The buffers are all that is saved: no fp32 copy of the weight is kept.

    x must have the layer's compute dtype, its scales' (fp32 unless the layer was cast): any other float dtype is a
    TypeError naming x, in every mode. Cast x, or the layer, first.

    What is checked when (the buffers are plain attributes: they can be replaced or written after construction):
    every forward (and `quantized_weight`, and the quantized embedding's lookup) runs `check_config` and
    `check_buffers` on the host, about a microsecond together. Unless a buffer was replaced or written in place
    since the last check (their identities and version counters: `tensor_state`) that is all; after such a change,
    `check_values` runs once: shapes, dtypes and devices (`l.qweight = l.qweight[:4]`, a bias of another length:
    an error naming it), then the values in one host sync (scales finite and > 0: `l.scale.mul_(-1)` is refused;
    zero points on the grid; bias finite). `from_linear` runs it at build time, so an unchanged layer's forward
    reads no value. Not seen: writes through `.data` or into inference tensors (they bump no counter); inside a
    compiled graph or a CUDA-graph capture only the shapes are checked, the values by the next eager call.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, config: QuantConfig):
        super().__init__()
        in_features = check_int("in_features", in_features)
        out_features = check_int("out_features", out_features)
        bias = check_bool("bias", bias)  # a tensor here would be "ambiguous" inside torch; a str would mean True
        check_tensor_elements("out_features x in_features", (out_features, in_features))  # before the buffers
        if not isinstance(config, QuantConfig):
            raise TypeError(f"config must be a QuantConfig, got {type(config).__name__}")
        group = config.group_size if config.mode == "int4" else in_features
        if in_features % group:
            raise ValueError(f"group_size={group} does not divide in_features={in_features}")
        if config.mode == "int4" and in_features % 2:
            raise ValueError(f"int4 packs two codes per byte: in_features={in_features} must be even")
        self.in_features, self.out_features, self.config = in_features, out_features, config
        # what `check_config` compares: the config's grid and the sizes the buffers are shaped by
        self._built_for = (config.mode, config.symmetric, config.group_size, in_features, out_features)
        groups = in_features // group
        code_dtype = torch.int8 if config.symmetric else torch.uint8
        width = in_features // 2 if config.mode == "int4" else in_features
        self.register_buffer("qweight", torch.zeros(out_features, width, dtype=torch.uint8 if config.mode == "int4"
                                                    else code_dtype))
        self.register_buffer("scale", torch.ones(out_features, groups))
        self.register_buffer("zero", None if config.symmetric else torch.zeros(out_features, groups, dtype=torch.uint8))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)
        self._checked: tuple | None = None  # `tensor_state` of the buffers when their values were last checked

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: QuantConfig, qt: QuantizedTensor | None = None, *,
                    name: str = "qt") -> "QuantLinear":
        """Quantize `linear`'s weight with min/max round-to-nearest, or take the codes `qt` (e.g. from GPTQ); `name`
        is what an error about qt calls it (`quantize_model` passes "weights['0.attn.c_attn']")."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear needs an nn.Linear, got {type(linear).__name__}")
        name = check_label("name", name)  # the subject of qt's errors
        if not isinstance(config, QuantConfig):
            raise TypeError(f"config must be a QuantConfig, got {type(config).__name__}")
        for what, t in (("weight", linear.weight), ("bias", linear.bias)):
            if t is None:
                continue
            check_has_data(f"linear.{what}", t)  # a layer built on the meta device has no values to quantize
            if not bool(torch.isfinite(t.detach()).all()):  # one host sync per layer, at build time
                raise ValueError(f"linear.{what} holds NaN or inf values: a quantized layer would hide them")
        if qt is not None and not isinstance(qt, QuantizedTensor):
            raise TypeError(f"{name} must be a QuantizedTensor or None, got {type(qt).__name__}")
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, config)
        with torch.no_grad():
            w = linear.weight.detach().float()  # (out, in)
            if qt is None:
                qt = quantize(w, config.bits, config.symmetric, config.granularity, config.quantize_group_size)
            module.load_quantized(qt, name=name)
            if linear.bias is not None:
                module.bias.copy_(linear.bias.detach().float())
        module = module.to(linear.weight.device)
        module.check_values()  # one host sync at build time, so the first forward reads nothing
        return module

    def load_quantized(self, qt: QuantizedTensor, *, name: str = "qt") -> None:
        """Store copies of the codes + scales, checking they fit this layer's mode (bits, symmetry, shapes) and hold
        values (not meta tensors); the errors call qt `name`."""
        if not isinstance(qt, QuantizedTensor):
            raise TypeError(f"{name} must be a QuantizedTensor, got {type(qt).__name__}")
        want_groups = self.scale.shape[1]
        if qt.bits != self.config.bits or qt.symmetric != self.config.symmetric:
            raise ValueError(f"{name} holds {qt.bits}-bit {'symmetric' if qt.symmetric else 'asymmetric'} codes; the "
                             f"layer wants {self.config.bits}-bit "
                             f"{'symmetric' if self.config.symmetric else 'asymmetric'}")
        if qt.shape != (self.out_features, self.in_features) or tuple(qt.scale.shape) != (self.out_features,
                                                                                          want_groups):
            raise ValueError(f"{name} holds codes of shape {qt.shape} with scales {tuple(qt.scale.shape)}, which do "
                             f"not fit a layer ({self.out_features}, {self.in_features}) with {want_groups} groups "
                             "per row")
        qt._recheck()  # its fields may have been replaced, or its tensors written, since it was built
        for field, t in (("q", qt.q), ("scale", qt.scale)):
            check_has_data(f"{name}.{field}", t)  # a meta tensor has no codes to copy
        q = pack_int4(qt.q) if self.config.mode == "int4" else qt.q  # (out, in/2) or (out, in)
        # copies: the layer must not change when the caller later writes into qt's tensors
        self.qweight = q.to(self.qweight.device, copy=True)
        self.scale = qt.scale.to(self.scale.device, torch.float32, copy=True)
        if qt.zero is not None:
            self.zero = qt.zero.to(self.scale.device, copy=True)

    def check_config(self) -> QuantConfig:
        """`self.config` if the buffers are what it implies (shapes and dtypes: no value read), else a TypeError/
        ValueError naming config. subtle: `config` is a plain attribute; replaced after the layer was built (int4
        over int8 codes), it sent the codes down another mode's path, to fail in unpack_int4 naming `packed`. So are
        `in_features` and `out_features`: changed after the layer was built, a ValueError naming them (the buffers
        are shaped by the sizes it was built with; x of the new width reached torch's matmul error)."""
        c = self.config
        if not isinstance(c, QuantConfig):
            raise TypeError(f"config must be a QuantConfig, got {type(c).__name__}")
        if (c.mode, c.symmetric, c.group_size, self.in_features, self.out_features) == self._built_for:
            return c  # the common case, in well under a microsecond (this runs on every forward)
        if (self.in_features, self.out_features) != self._built_for[3:]:
            raise ValueError(f"in_features={short_repr(self.in_features)}, "
                             f"out_features={short_repr(self.out_features)} were "
                             f"changed after the layer was built as ({self._built_for[3]}, {self._built_for[4]}); its "
                             "buffers are "
                             "shaped by those sizes: build a new layer with QuantLinear.from_linear")
        int4, n, g = c.mode == "int4", self.in_features, c.group_size
        groups = n // g if isinstance(g, int) and g > 0 and n % g == 0 else -1
        want = ((self.out_features, n // 2 if int4 else n), torch.uint8 if int4 or not c.symmetric else torch.int8,
                groups if int4 else 1, not c.symmetric)
        got = (tuple(self.qweight.shape), self.qweight.dtype, self.scale.shape[-1], self.zero is not None)
        if got != want:
            raise ValueError(f"config {short_repr(c)} does not fit the layer's buffers (qweight {self.qweight.dtype} "
                             f"{got[0]}, {got[2]} scale(s) per row, zero points: {got[3]}): the layer was built "
                             "with another config; build a new layer with QuantLinear.from_linear")
        return c

    def _state(self) -> tuple:
        """`tensor_state` of the four buffers (read from `_buffers`: a module's attribute lookup costs more; a bias
        assigned as an nn.Parameter moves to `_parameters`)."""
        b = self._buffers
        bias = b["bias"] if "bias" in b else self._parameters.get("bias")
        return tensor_state(b.get("qweight"), b.get("scale"), b.get("zero"), bias)

    def check_buffers(self) -> None:
        """Nothing to do, in about a microsecond, when no buffer was replaced or written in place since they were
        last checked (`tensor_state`: identities and version counters, on the host); otherwise `check_values`,
        shapes and values, except inside a compiled graph or a CUDA-graph capture, where no host sync may run: there
        the shapes alone are checked (when traced), the values by the first eager call after it."""
        compiling = torch.compiler.is_compiling()
        if not compiling and self._checked == self._state():
            return
        self._check_layout()
        if compiling or (self.scale.is_cuda and torch.cuda.is_current_stream_capturing()):
            return  # no host sync here: the values are read by the first eager call after it
        self.check_values()

    def _check_layout(self) -> None:
        """The buffers as the config implies them, on the host: qweight (out, in) int8 / uint8 or (out, in/2) uint8
        for int4, scale (out, groups) float, zero (out, groups) uint8 or None, bias (out,) of the scale's dtype or
        None, all on one device; a TypeError/ValueError naming the buffer otherwise (a buffer replaced after
        construction reached torch's broadcasting error)."""
        c, out, n = self.config, self.out_features, self.in_features
        int4 = c.mode == "int4"
        scale, zero = self.scale, self.zero
        _check_buffer("qweight", self.qweight, (out, n // 2 if int4 else n),
                      torch.uint8 if int4 or not c.symmetric else torch.int8)
        _check_buffer("scale", scale, (out, n // c.group_size if int4 else 1), None)
        if (zero is None) != c.symmetric:
            raise TypeError(f"zero must be None for symmetric codes and a uint8 tensor for asymmetric ones; this layer "
                            f"is {'' if c.symmetric else 'a'}symmetric and zero is {tensor_kind(zero)}")
        if zero is not None:
            _check_buffer("zero", zero, tuple(scale.shape), torch.uint8)
        if self.bias is not None:
            _check_buffer("bias", self.bias, (out,), scale.dtype)
        for name, t in (("qweight", self.qweight), ("zero", zero), ("bias", self.bias)):
            if t is not None and t.device != scale.device:
                raise ValueError(f"{name} is on {t.device}, the layer's scale on {scale.device}: move the layer")

    def check_values(self) -> None:
        """The buffers' shapes, dtypes and devices (`_check_layout`), then their values in one host sync: every scale
        finite and > 0 (a negative one flips the output's signs, NaN makes it NaN), zero points on the grid
        [0, 2^bits - 1], the bias finite; a TypeError/ValueError naming the buffer otherwise. The codes need no
        value check: every int8 and every packed byte is a code. Records the buffers' `tensor_state`, so forward
        checks them again only after the next change."""
        self._check_layout()
        scale, zero, bias = self.scale, self.zero, self.bias
        if scale.device.type != "meta":  # a meta layer has shapes only
            no = scale.new_zeros((), dtype=torch.bool)
            bad_scale, bad_zero, bad_bias = torch.stack([
                ~(torch.isfinite(scale) & (scale > 0)).all(),
                no if zero is None else (zero > 2 ** self.config.bits - 1).any(),
                no if bias is None else ~torch.isfinite(bias).all()]).tolist()
            if bad_scale:
                raise ValueError("scale must hold finite values > 0 (a negative scale flips the output's signs, a NaN "
                                 "one makes it NaN): was it written after the layer was built?")
            if bad_zero:
                raise ValueError(f"zero holds zero points above {2 ** self.config.bits - 1}, off the "
                                 f"{self.config.bits}-bit grid: was it written after the layer was built?")
            if bad_bias:
                raise ValueError("bias holds NaN or inf values: was it written after the layer was built?")
        self._checked = self._state()

    def quantized_weight(self) -> QuantizedTensor:
        """The layer's codes and scales as a QuantizedTensor (int4 codes unpacked)."""
        self.check_config()
        self.check_buffers()
        q = unpack_int4(self.qweight, signed=self.config.symmetric) if self.config.mode == "int4" else self.qweight
        # Checked when stored, and after any change (`check_buffers`): no value is read again here.
        return QuantizedTensor.from_checked(q, self.scale, self.zero, self.config.bits,
                                            (self.out_features, self.in_features))

    def dequantized_weight(self) -> torch.Tensor:
        """(out, in) fp32: what the layer multiplies by. Rebuilt on every call: the price of weight-only storage."""
        return dequantize(self.quantized_weight())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # subtle: an integer x would run (int codes times int x) and drop everything but the bias; dtype and shape
        # are checked on the host for free. NaN in x is not looked for (a sync per step): it comes out NaN.
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"QuantLinear needs a floating-point input x, got {tensor_kind(x)}")
        check_strided("x", x)  # nested, sparse, MKL-DNN, float8: before anything reads the shape
        self.check_config()  # host-only: a config replaced since the layer was built is named here
        self.check_buffers()  # host-only, and the values once after a buffer was replaced or written
        if x.device != self.scale.device:  # a meta x, or one on another device than the layer's codes
            raise ValueError(f"x is on {x.device}, the layer on {self.scale.device}: move one of them")
        if x.dtype != self.scale.dtype:  # the modes would disagree: fp32 out, x's dtype out, or torch's error
            raise TypeError(f"x must be {self.scale.dtype}, the dtype QuantLinear computes in, got {x.dtype}; cast x "
                            "(or the layer) first")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"x must have shape (..., {self.in_features}), got {tuple(x.shape)}")
        if self.config.mode == "w8a8":
            if self.config.outlier_threshold is not None:
                return llm_int8_linear(x, self, self.config.outlier_threshold)
            return w8a8_linear(x, self.qweight, self.scale, self.bias, self.config.use_int_mm)
        if self.config.mode == "int8" and self.zero is None:
            # One scale per output row factors out of the sum: x @ (s ⊙ q)^T = (x @ q^T) ⊙ s^T. Scaling the (..., out)
            # result instead of the (out, in) weight saves a pass over the weight (in times fewer multiplies).
            y = F.linear(x, self.qweight.to(x.dtype)) * self.scale.t().to(x.dtype)  # (..., out) * (1, out)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.dequantized_weight().to(x.dtype), self.bias)  # (..., out)

    def extra_repr(self) -> str:
        c = self.config
        group = f", group_size={c.group_size}" if c.mode == "int4" else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"mode={c.mode}{group}, symmetric={c.symmetric}")


class QuantEmbedding(nn.Module):
    """The token embedding from a per-row quantized (V, C) matrix: look up the rows' codes, de-quantize only those.

    idx (...) int64/int32 ids in [0, V) -> (..., C). An id outside the vocabulary is a ValueError naming it, as
    `nn.Embedding` refuses one (IndexError): the row lookup here is plain indexing, which would read id -1 as the
    last row and return a plausible vector. That check reads the ids (one host sync per call, skipped only while a
    CUDA graph is being captured, where a sync is not allowed and the capturing loop validated its ids already).
    """

    def __init__(self, head: QuantLinear):
        super().__init__()
        if not isinstance(head, QuantLinear):  # else the first forward fails reading its buffers, naming nothing
            raise TypeError(f"head must be the quantized head's QuantLinear (V, C), got {type(head).__name__}")
        self.table = head  # owns the buffers: qweight (V, C or C/2), scale (V, groups), zero

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"idx must be an int64 tensor of token ids, got {tensor_kind(idx)}")
        check_strided("idx", idx)
        t = self.table
        t.check_config()
        t.check_buffers()
        rows = idx.reshape(-1)  # (N,) token ids
        if rows.numel() == 0:  # no ids (an empty batch, as nn.Embedding allows): a QuantizedTensor needs a row
            return t.scale.new_zeros(*idx.shape, t.in_features)  # (..., C)
        capturing = rows.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing:
            check_has_data("idx", rows)
            lo, hi = torch.stack(torch.aminmax(rows)).tolist()  # one host sync for both ends
            if lo < 0 or hi >= t.out_features:
                raise ValueError(f"idx holds token id {lo if lo < 0 else hi}, outside the vocabulary "
                                 f"[0, {t.out_features})")
        q = t.qweight[rows]  # (N, C) or (N, C/2) packed
        if t.config.mode == "int4":
            q = unpack_int4(q, signed=t.config.symmetric)  # (N, C)
        zero = None if t.zero is None else t.zero[rows]
        x = dequantize(QuantizedTensor.from_checked(q, t.scale[rows], zero, t.config.bits,
                                                    (rows.numel(), t.in_features)))
        return x.reshape(*idx.shape, t.in_features)  # (..., C)


class TiedQuantHead(nn.Module):
    """The output head that shares the embedding's quantized matrix: logits = h @ deq(W)^T.

    subtle: the matrix is reached through the embedding, not registered here too. Two modules registering the same
    buffer would each get their own copy on `.to(device)` (buffers are replaced, not updated in place), silently
    untying them, and the state dict would hold the matrix twice.
    """

    def __init__(self, embedding: QuantEmbedding):
        super().__init__()
        if not isinstance(embedding, QuantEmbedding):
            raise TypeError(f"embedding must be the QuantEmbedding this head shares, got {type(embedding).__name__}")
        self._embedding = (embedding,)  # a tuple: not a submodule, so not a second owner

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self._embedding[0].table(h)  # (..., C) -> (..., V)


# ----- the swap ------------------------------------------------------------------------------------------------


class QuantizedGPT(GPT):
    """A GPT whose layers `quantize_model` swapped for quantized ones; `quant_config` says how.

    It adds no computation: the blocks, `hidden`, `logits` and `forward` are GPT's, running whatever modules now sit
    in them. It only answers `device` from a tensor every mode keeps in fp32 (the position embedding), since a
    quantized embedding has no fp32 `weight`.
    """

    quant_config: QuantConfig

    @property
    def device(self) -> torch.device:
        return self.transformer.wpe.weight.device


def check_fp32_model(model: object, who: str, config: QuantConfig | None = None) -> GPT:
    """`model` if it is a dense minillm GPT (not a QuantizedGPT) whose parameters are all fp32, what every quantizer
    here starts from; a TypeError naming `who` otherwise (a bf16 model was accepted, then failed inside a QuantLinear,
    whose scales are fp32, naming its x). With `config`: a model prepared for QAT (`minillm.quant.qat.prepare_qat`,
    its layers carrying a `qat_config`) must have trained on that grid, else a ValueError: rounding its latent
    weights onto another stores weights it never trained with (`convert_qat` stores the grid it trained on)."""
    if isinstance(model, QuantizedGPT) or not isinstance(model, GPT):
        raise TypeError(f"{who} needs an fp32 minillm GPT, got {type(model).__name__}")
    if config is not None and not isinstance(config, QuantConfig):
        raise TypeError(f"config must be a QuantConfig or None, got {type(config).__name__} {short_repr(config)}")
    other = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
    if other:
        raise TypeError(f"{who} needs an fp32 minillm GPT, got one with {', '.join(other)} parameters; cast it with "
                        "model.float() first")
    trained = {m.qat_config for m in model.transformer.h.modules() if hasattr(m, "qat_config")}
    if config is not None and trained and trained != {config}:
        raise ValueError(f"{who}: the model was prepared for QAT on {', '.join(map(repr, trained))}, not on config "
                         f"{config!r}: its latent weights never trained on that grid; convert it with convert_qat")
    return model


def block_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(name, module) of every nn.Linear inside the transformer blocks, in forward order; a TypeError for a model
    without GPT's interface."""
    require_model(model, "block_linears")
    return [(name, m) for name, m in model.transformer.h.named_modules() if isinstance(m, nn.Linear)]


def quantize_model(model: GPT, config: QuantConfig,
                   weights: dict[str, QuantizedTensor] | None = None) -> QuantizedGPT:
    """A copy of the GPT `model` with every block's `nn.Linear` replaced by a `QuantLinear` (and, with
    `config.quantize_head`, the tied embedding/head by `QuantEmbedding` + `TiedQuantHead`).

    With quantize_head, a model whose lm_head has a weight of its own (untied) is a ValueError naming lm_head.
    `weights` maps a layer's name inside `model.transformer.h` ("0.attn.c_attn") to codes chosen elsewhere (GPTQ);
    layers not named there are rounded to nearest. The copy keeps GPT's interface (`hidden`, `logits`, `forward`),
    so every generator, the engine and the perplexity code run it unchanged; `quant_config` records the mode.
    """
    if isinstance(model, QuantizedGPT):
        raise ValueError(f"the model is already quantized ({model.quant_config.mode}); quantize the fp32 model")
    if not isinstance(model, GPT):
        raise TypeError(f"quantize_model needs a minillm GPT, got {type(model).__name__}")
    if not isinstance(config, QuantConfig):
        raise TypeError(f"config must be a QuantConfig, got {type(config).__name__}")
    check_fp32_model(model, "quantize_model", config)
    if config.quantize_head and untied_head(model):
        raise ValueError("quantize_head=True quantizes the tied embedding/head matrix once, but model.lm_head has a "
                         "weight of its own (other values than transformer.wte's): the head would be replaced by "
                         "the embedding; use quantize_head=False (the head stays fp32)")
    if weights is not None and not isinstance(weights, dict):
        raise TypeError(f"weights must be a dict of layer name -> QuantizedTensor or None, got "
                        f"{type(weights).__name__}")
    weights = dict(weights or {})
    linears = dict(block_linears(model))
    unknown = set(weights) - set(linears)
    if unknown:
        raise ValueError(f"weights name layers that are not in the blocks: {sorted(unknown)}")
    for name, qt in weights.items():
        if not isinstance(qt, QuantizedTensor):
            raise TypeError(f"weights[{name!r}] must be a QuantizedTensor, got {type(qt).__name__}")
    check_module_has_data("model", model)  # a model on the meta device has no weights to round
    # A NaN or inf weight is refused here, naming the layer, before it is rounded to a plausible code.
    named = [(f"transformer.h.{name}", linear.weight) for name, linear in linears.items()]
    if config.quantize_head:
        named.append(("transformer.wte", model.transformer.wte.weight))
    for name, weight in named:
        if not bool(torch.isfinite(weight.detach()).all()):
            raise ValueError(f"layer {name} of the model holds NaN or inf weights; quantizing would hide them")
    qmodel = copy.deepcopy(model).eval()
    # The copy becomes the subclass (it adds no state, only `device` and `quant_config`), so nothing is rebuilt.
    qmodel.__class__ = QuantizedGPT
    for name, linear in block_linears(qmodel):
        parent_name, _, attr = name.rpartition(".")
        setattr(qmodel.transformer.h.get_submodule(parent_name), attr,
                QuantLinear.from_linear(linear, config, weights.get(name), name=f"weights[{name!r}]"))
    if config.quantize_head:
        wte = qmodel.transformer.wte
        table = QuantLinear.from_linear(_as_linear(wte.weight), config)  # (V, C): one scale per row (or group)
        embedding = QuantEmbedding(table)
        qmodel.transformer.wte = embedding
        qmodel.lm_head = TiedQuantHead(embedding)
    qmodel.quant_config = config
    return qmodel


def _as_linear(weight: torch.Tensor) -> nn.Linear:
    """An nn.Linear (no bias) wrapping a (out, in) weight, without copying it."""
    V, C = weight.shape
    lin = nn.Linear(C, V, bias=False, device="meta")
    lin.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return lin


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer the model holds, each tensor counted once (the tied head is one)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    # subtle: the tied head is found by data_ptr(), which is 0 for every meta tensor: a meta model would count once
    check_module_has_data("weight_bytes: model", model)
    seen: dict[int, int] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        seen[t.data_ptr()] = t.nbytes
    return sum(seen.values())

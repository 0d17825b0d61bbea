"""Chapter 09's probes: the two affine maps and their inverses, int4 packing, GPTQ's codes and the STE's gradient."""

from __future__ import annotations


import torch

from minillm.quant import gptq, qat
from minillm.quant import quantize as quant
from minillm.quant.linear import QuantConfig
from . import Probe, generator, rng, substituted


# ----- the maps -----------------------------------------------------------------------------------------------


def _x_and_scale(g: torch.Generator, shape: tuple[int, ...], scale_shape: tuple[int, ...], qmax: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x of `shape` and positive scales of `scale_shape` at about max|x| / qmax, some smaller (clamped codes)."""
    x = torch.randn(*shape, generator=g) * torch.rand(*scale_shape, generator=g).add(0.2)
    scale = x.abs().amax(dim=tuple(d for d, n in enumerate(scale_shape) if n == 1), keepdim=True) / qmax
    return x, scale * (torch.rand(*scale_shape, generator=g) * 0.6 + 0.6)


def _halves(g: torch.Generator, n: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x = k / 8 with scale 1/4: x / s lands on whole numbers and halves exactly (halves round to even), and past
    ±qmax (clamped)."""
    k = torch.randint(-2 * qmax - 6, 2 * qmax + 7, (n,), generator=g)  # x / s = k / 2 in [-qmax - 3, qmax + 3]
    k[:6] = torch.tensor([1, -1, 3, -3, 5, -5])  # ±0.5, ±1.5, ±2.5 steps
    return k.float() / 8, torch.tensor(0.25)


def quantize_sym(seed: int) -> list:
    """int8 and int4 codes of random x per tensor, per row (4, 1) and per group (4, 2, 1), scales a little small so
    some codes clamp; then exact halves of a step (round half to even) and values beyond the range."""
    g = generator(seed)
    outs = []
    for bits, qmax in ((8, 127), (4, 7)):
        for shape, scale_shape in (((4, 8), (1, 1)), ((4, 8), (4, 1)), ((4, 2, 4), (4, 2, 1))):
            outs.append(quant.quantize_symmetric(*_x_and_scale(g, shape, scale_shape, qmax), bits))
        outs.append(quant.quantize_symmetric(*_halves(g, 30, qmax), bits))
    return outs


def dequantize_sym(seed: int) -> list:
    """Random int8 codes (the whole int8 and int4 ranges) times float32 scales per tensor, per row and per group,
    and float64 scales (the result comes back in the scale's dtype)."""
    g = generator(seed)
    outs = []
    for lo, hi in ((-127, 127), (-8, 7)):
        q = torch.randint(lo, hi + 1, (4, 2, 4), generator=g, dtype=torch.int8)
        for scale_shape in ((1, 1, 1), (4, 1, 1), (4, 2, 1)):
            outs.append(quant.dequantize_symmetric(q, torch.rand(*scale_shape, generator=g) + 0.01))
        outs.append(quant.dequantize_symmetric(q, torch.rand(4, 1, 1, generator=g, dtype=torch.float64) + 0.01))
    return outs


def _zero(g: torch.Generator, shape: tuple[int, ...], hi: int) -> torch.Tensor:
    return torch.randint(0, hi + 1, shape, generator=g, dtype=torch.uint8)


def quantize_asym(seed: int) -> list:
    """uint8 codes of random x (8 and 4 bits) with random zero points per tensor, per row and per group, scales a
    little small so codes clamp at both ends; then exact halves of a step with even zero points (round half to
    even, where rounding before or after adding z agrees)."""
    g = generator(seed)
    outs = []
    for bits, hi in ((8, 255), (4, 15)):
        for shape, scale_shape in (((4, 8), (1, 1)), ((4, 8), (4, 1)), ((4, 2, 4), (4, 2, 1))):
            x, scale = _x_and_scale(g, shape, scale_shape, hi // 2)
            outs.append(quant.quantize_asymmetric(x, scale, _zero(g, scale_shape, hi), bits))
        x, scale = _halves(g, 30, hi // 2)
        zero = torch.tensor((hi + 1) // 2 - 2 * int(torch.randint(0, 3, (), generator=g)), dtype=torch.uint8)
        outs.append(quant.quantize_asymmetric(x, scale, zero, bits))
    return outs


def dequantize_asym(seed: int) -> list:
    """Random uint8 codes (8- and 4-bit ranges) and zero points per tensor, per row and per group, float32 scales,
    and float64 scales (the result comes back in the scale's dtype)."""
    g = generator(seed)
    outs = []
    for hi in (255, 15):
        q = torch.randint(0, hi + 1, (4, 2, 4), generator=g, dtype=torch.uint8)
        for scale_shape in ((1, 1, 1), (4, 1, 1), (4, 2, 1)):
            scale = torch.rand(*scale_shape, generator=g) + 0.01
            outs.append(quant.dequantize_asymmetric(q, scale, _zero(g, scale_shape, hi)))
        scale = torch.rand(4, 1, 1, generator=g, dtype=torch.float64) + 0.01
        outs.append(quant.dequantize_asymmetric(q, scale, _zero(g, (4, 1, 1), hi)))
    return outs


# ----- int4 packing -------------------------------------------------------------------------------------------


def pack(seed: int) -> list:
    """Signed codes -8..7 (int8) and unsigned 0..15 (uint8) of shapes (6,), (3, 8) and (2, 3, 4), the extremes and -1
    (0b1111) planted, so that the low/high nibble order and two's complement both show."""
    g = generator(seed)
    outs = []
    for dtype, lo, hi in ((torch.int8, -8, 7), (torch.uint8, 0, 15)):
        for shape in ((6,), (3, 8), (2, 3, 4)):
            q = torch.randint(lo, hi + 1, shape, generator=g, dtype=dtype)
            q.view(-1)[:4] = torch.tensor([lo, hi, hi if lo else 1, -1 if lo else 14], dtype=dtype)
            outs.append(quant.pack_int4(q))
    return outs


def unpack(seed: int) -> list:
    """Random bytes (every value 0..255 likely; 0x0F, 0xF0, 0x80, 0xFF planted) of shapes (5,), (3, 4) and (2, 2, 3)
    and a sliced (non-contiguous) view, unpacked signed and unsigned."""
    g = generator(seed)
    outs = []
    for shape in ((5,), (3, 4), (2, 2, 3)):
        packed = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        packed.view(-1)[:4] = torch.tensor([0x0F, 0xF0, 0x80, 0xFF], dtype=torch.uint8)
        outs.append([quant.unpack_int4(packed, signed=True), quant.unpack_int4(packed, signed=False)])
    packed = torch.randint(0, 256, (4, 6), generator=g, dtype=torch.uint8)[1:3, 2:5]
    outs.append([quant.unpack_int4(packed, signed=True), quant.unpack_int4(packed, signed=False)])
    return outs


# ----- GPTQ and QAT: run on the maps' reference rules ---------------------------------------------------------
# gptq_quantize rounds each column with the four maps, and fake_quantize rounds through quantize/dequantize; both
# run here on the maps' reference rules (the formulas of minillm.quant.quantize's module docstring), so that a
# mistake in a map shows in the map's own probe only.


def _q_sym(x, scale, bits, *, check_values=True):
    qmax = 2 ** (bits - 1) - 1
    return torch.clamp(torch.round(x / scale), -qmax, qmax).to(torch.int8)


def _dq_sym(q, scale, *, check_values=True):
    return q.to(scale.dtype) * scale


def _q_asym(x, scale, zero, bits, *, check_values=True):
    return torch.clamp(torch.round(x / scale) + zero.to(x.dtype), 0, 2**bits - 1).to(torch.uint8)


def _dq_asym(q, scale, zero, *, check_values=True):
    return (q.to(scale.dtype) - zero.to(scale.dtype)) * scale


def _maps_substituted(module):
    """`module`'s four map functions replaced by the reference rules while the block runs."""
    return substituted(module, quantize_symmetric=_q_sym, dequantize_symmetric=_dq_sym,
                       quantize_asymmetric=_q_asym, dequantize_asymmetric=_dq_asym)


def gptq_codes(seed: int) -> list:
    """W (5, 12) with columns of different sizes and H = XᵀX / N of correlated inputs X (40, 12): int4 and int8,
    symmetric and asymmetric, per channel and in groups of 4 or 6, damp 0, 0.01 and 0.1, and one input that never
    fires (H_ii = 0). Codes, scales and zero points."""
    g, r = generator(seed), rng(seed)
    outs = []
    with _maps_substituted(gptq):
        for bits, symmetric, group_size, damp in ((4, True, None, 0.01), (4, True, 4, 0.0), (4, False, 6, 0.01),
                                                   (8, False, None, 0.1), (4, False, 4, 0.01), (4, True, 6, 0.01)):
            W = torch.randn(5, 12, generator=g) * (torch.rand(12, generator=g) * 2 + 0.2)
            mix = torch.randn(12, 12, generator=g, dtype=torch.float64) * 0.5 + torch.eye(12, dtype=torch.float64)
            X = torch.randn(40, 12, generator=g, dtype=torch.float64) @ mix  # (40, 12) correlated features
            if damp > 0 and r.random() < 0.5:
                X[:, r.randrange(12)] = 0.0  # a dead input
            qt = gptq.gptq_quantize(W, X.T @ X / X.shape[0], bits, symmetric, group_size, damp)
            outs.append({"q": qt.q, "scale": qt.scale, "zero": qt.zero})
    return outs


def fake_quant(seed: int) -> list:
    """w (6, 16) with one all-zero row, on the int8 per-channel and int4 group-wise grids, symmetric and asymmetric:
    the forward value and the gradient of sum(out * upstream) for a random upstream (the STE passes it through)."""
    g = generator(seed)
    outs = []
    with _maps_substituted(quant):
        for config in (QuantConfig("int8"), QuantConfig("int4", group_size=8),
                       QuantConfig("int8", symmetric=False), QuantConfig("int4", group_size=4, symmetric=False)):
            w = torch.randn(6, 16, generator=g)
            w[2] = 0.0
            w.requires_grad_(True)
            out = qat.fake_quantize(w, config)
            upstream = torch.randn(6, 16, generator=g)
            (out * upstream).sum().backward()
            outs.append({"value": out.detach(), "grad": w.grad})
    return outs


PROBES = {
    "quantize_symmetric": Probe(quantize_sym),
    "dequantize_symmetric": Probe(dequantize_sym, rtol=1e-6, atol=1e-7),
    "quantize_asymmetric": Probe(quantize_asym),
    "dequantize_asymmetric": Probe(dequantize_asym, rtol=1e-6, atol=1e-7),
    "pack_int4": Probe(pack),
    "unpack_int4": Probe(unpack),
    "gptq_quantize": Probe(gptq_codes, rtol=1e-5, atol=1e-7),
    "fake_quantize": Probe(fake_quant, rtol=1e-5, atol=1e-6),
}

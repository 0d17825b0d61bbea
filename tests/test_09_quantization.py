"""Chapter 09: quantize/dequantize round trips (hand-computed, bounded, exact on the grid), int4 packing, quantized
linears equal to `F.linear` with the de-quantized weight, W8A8 equal to its float twin, GPTQ against round-to-nearest
and a brute-force least-squares solution, and quantized checkpoints. No test here measures time."""

from __future__ import annotations

import copy
import itertools
import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from helpers import assert_every_generator_agrees, context_model
from minillm import GPT, GPTConfig
from minillm.bench.agreement import teacher_forced_agreement
from minillm.core.checkpoint import save_checkpoint
from minillm.core.sampling import SamplingParams
from minillm.engine.config import EngineConfig
from minillm.engine.llm import LLM
from minillm.gpt.eval import perplexity
from minillm.kvcache.cache import ContiguousKVCache
from minillm.kvcache.generate import generate_ids
from minillm.quant.bench import CASES, kv_perplexity, linear_bytes, quotes, run_all
from minillm.quant.checkpoint import describe, load_quantized, save_quantized
from minillm.quant.gptq import gptq_quantize, gptq_quantize_model, gptq_reference, rtn_and_gptq_errors
from minillm.quant.kv_cache import (
    FakeQuantContiguousKVCache,
    Int8ContiguousKVCache,
    Int8PagedKVCache,
    dequantize_kv,
    quantize_kv,
)
from minillm.quant.linear import QuantConfig, QuantizedGPT, QuantLinear, quantize_model, weight_bytes
from minillm.quant.outliers import (
    inject_outliers,
    input_absmax,
    outlier_report,
    smooth_model,
    smoothing_scales,
)
from minillm.quant.qat import FakeQuantLinear, convert_qat, fake_quantize, finetune_qat, prepare_qat
from minillm.quant.quantize import (
    asymmetric_params,
    dequantize,
    dequantize_asymmetric,
    dequantize_symmetric,
    pack_int4,
    qrange,
    quantize,
    quantize_asymmetric,
    quantize_symmetric,
    symmetric_params,
    unpack_int4,
)
from minillm.quant.w8a8 import int8_matmul, int8_matmul_ref, llm_int8_linear, llm_int8_reference, w8a8_reference

SMALL = dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64)

# Float slack on the half-step error bound: x / s and s * q each round once in float32 (relative 2^-24 each).
REL = 1e-5
# The exercises of the two maps, graded together where a test runs both.
MAPS = ("quantize_symmetric", "dequantize_symmetric", "quantize_asymmetric", "dequantize_asymmetric")


def small_model(seed: int = 0):
    return context_model(GPTConfig(**SMALL), seed=seed)


# ----- the pure functions: worked examples ----------------------------------------------------------------------


@pytest.mark.graded(points=2, exercise=("quantize_symmetric", "dequantize_symmetric"))
def test_symmetric_int8_worked_example():
    """The docstring's example plus one: s = 0.5 / 127; x / s = [127, -63.5, 0.254, 101.6] -> [127, -64, 0, 102]
    (to nearest, halves to even: truncation would give -63 and 101, flooring 101)."""
    x = torch.tensor([0.5, -0.25, 0.001, 0.4])
    s = symmetric_params(x, 8)
    assert s.item() == pytest.approx(0.5 / 127)
    q = quantize_symmetric(x, s, 8)
    assert q.dtype == torch.int8 and q.tolist() == [127, -64, 0, 102]
    torch.testing.assert_close(dequantize_symmetric(q, s), torch.tensor([127.0, -64, 0, 102]) * (0.5 / 127))


@pytest.mark.graded(points=2, exercise=("quantize_asymmetric", "dequantize_asymmetric"))
def test_asymmetric_int4_worked_example():
    """x in [-1, 2], 4 bits: s = 3 / 15 = 0.2, z = round(1 / 0.2) = 5; [-1, 0, 2, 0.31] -> [0, 5, 15, 7]."""
    x = torch.tensor([-1.0, 0.0, 2.0, 0.31])
    s, z = asymmetric_params(x, 4)
    assert s.item() == pytest.approx(0.2) and z.item() == 5 and z.dtype == torch.uint8
    q = quantize_asymmetric(x, s, z, 4)
    assert q.dtype == torch.uint8 and q.tolist() == [0, 5, 15, 7]  # 0.31 / 0.2 = 1.55 -> 2, + 5
    torch.testing.assert_close(dequantize_asymmetric(q, s, z), torch.tensor([-1.0, 0.0, 2.0, 0.4]))


def test_ranges_and_clamping():
    assert qrange(8, True) == (-127, 127) and qrange(8, False) == (0, 255)
    assert qrange(4, True) == (-7, 7) and qrange(4, False) == (0, 15)
    s = torch.tensor(0.1)
    assert quantize_symmetric(torch.tensor([5.0, -5.0]), s, 4).tolist() == [7, -7]  # beyond the range: clamped
    assert quantize_asymmetric(torch.tensor([5.0, -5.0]), s, torch.tensor(3), 4).tolist() == [15, 0]


def test_all_zero_slices_get_a_usable_scale():
    x = torch.zeros(3, 8)
    for symmetric in (True, False):
        qt = quantize(x, 8, symmetric, "channel")
        assert torch.isfinite(qt.scale).all() and (qt.scale > 0).all()
        assert torch.equal(dequantize(qt), x)


@pytest.mark.graded(points=2, exercise=MAPS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_values_on_the_grid_come_back_exactly(bits, symmetric):
    """x = s * (q - z) for integer codes q in range: quantize gives q back and dequantize gives x back, bit for bit."""
    lo, hi = qrange(bits, symmetric)
    s = torch.tensor(0.125)  # a power of two: s * integer is exact in float32
    z = torch.tensor(0 if symmetric else (hi + 1) // 3, dtype=torch.uint8)
    codes = torch.arange(lo, hi + 1)
    x = s * (codes - (0 if symmetric else z.long())).float()
    if symmetric:
        q = quantize_symmetric(x, s, bits)
        back = dequantize_symmetric(q, s)
    else:
        q = quantize_asymmetric(x, s, z, bits)
        back = dequantize_asymmetric(q, s, z)
    assert torch.equal(q.long(), codes) and torch.equal(back, x)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("granularity,group_size,scale_shape", [("tensor", None, (1, 1)), ("channel", None, (6, 1)),
                                                                ("group", 32, (6, 4)), ("group", 64, (6, 2)),
                                                                ("group", 128, (6, 1))])
def test_granularities_shapes_and_error_bound(bits, symmetric, granularity, group_size, scale_shape):
    x = torch.randn(6, 128) * torch.logspace(-2, 1, 6).unsqueeze(1)  # rows of very different magnitudes
    qt = quantize(x, bits, symmetric, granularity, group_size)
    assert qt.q.shape == x.shape and tuple(qt.scale.shape) == scale_shape
    assert qt.q.dtype == (torch.int8 if symmetric else torch.uint8)
    assert (qt.zero is None) == symmetric
    lo, hi = qrange(bits, symmetric)
    assert int(qt.q.min()) >= lo and int(qt.q.max()) <= hi
    err = (dequantize(qt) - x).abs().reshape(scale_shape[0], scale_shape[1], -1)  # (rows, groups, gs)
    bound = qt.scale.unsqueeze(2) / 2 * (1 + REL) + 1e-12
    assert (err <= bound).all()
    assert qt.group_size == {"tensor": 6 * 128, "channel": 128, "group": group_size}[granularity]


def test_finer_granularity_means_smaller_error():
    """Rows of different magnitudes: one scale for all wastes the small rows' range; per group wastes least."""
    x = torch.randn(16, 256) * torch.logspace(-2, 0, 16).unsqueeze(1)
    errs = [(dequantize(quantize(x, 4, True, g, 32 if g == "group" else None)) - x).pow(2).mean().item()
            for g in ("tensor", "channel", "group")]
    assert errs[0] > errs[1] > errs[2]


@pytest.mark.graded(points=2, exercise=MAPS)
@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 5), groups=st.integers(1, 4), group_size=st.sampled_from([1, 2, 8, 32]),
       bits=st.sampled_from([4, 8]), symmetric=st.booleans(), log_mag=st.floats(-6, 6),
       seed=st.integers(0, 2**31 - 1))
def test_round_trip_error_is_at_most_half_a_step(rows, groups, group_size, bits, symmetric, log_mag, seed):
    """|x - deq(q(x))| <= scale / 2 for every element, at every granularity, magnitude and shape."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, groups * group_size, generator=g) * 10.0**log_mag
    if seed % 3 == 0:
        x = x.abs()  # all positive: the asymmetric range is widened to include 0
    for granularity in ("tensor", "channel", "group"):
        qt = quantize(x, bits, symmetric, granularity, group_size if granularity == "group" else None)
        r, n = qt.scale.shape
        err = (dequantize(qt) - x).abs().reshape(r, n, -1)
        assert (err <= qt.scale.unsqueeze(2) / 2 * (1 + REL)).all(), granularity


@settings(max_examples=40, deadline=None)
@given(data=st.data(), bits=st.sampled_from([4, 8]), symmetric=st.booleans())
def test_quantize_of_dequantize_is_the_identity_on_codes(data, bits, symmetric):
    """Any codes and a positive scale: q(deq(q)) == q (the grid points are fixed points of the round trip)."""
    lo, hi = qrange(bits, symmetric)
    codes = torch.tensor(data.draw(st.lists(st.integers(lo, hi), min_size=1, max_size=40)))
    s = torch.tensor(data.draw(st.floats(1e-4, 1e3)))
    if symmetric:
        q = codes.to(torch.int8)
        assert torch.equal(quantize_symmetric(dequantize_symmetric(q, s), s, bits), q)
    else:
        q, z = codes.to(torch.uint8), torch.tensor(data.draw(st.integers(lo, hi)), dtype=torch.uint8)
        assert torch.equal(quantize_asymmetric(dequantize_asymmetric(q, s, z), s, z, bits), q)


def test_zero_is_exact_for_asymmetric_grids():
    x = torch.tensor([[0.3, 0.0, 1.7, 0.9]])  # all >= 0: the range is widened down to 0
    qt = quantize(x, 4, False, "channel")
    assert dequantize(qt)[0, 1].item() == 0.0


@pytest.mark.parametrize("bad,err,match", [
    (dict(bits=3), ValueError, "bits"), (dict(bits=True), ValueError, "bits"),
    (dict(granularity="row"), ValueError, "granularity"),
    (dict(granularity="group", group_size=48), ValueError, "does not divide"),
    (dict(granularity="group", group_size=0), ValueError, "group_size"),
    (dict(granularity="group", group_size=None), ValueError, "group_size"),
    (dict(symmetric=1), TypeError, "symmetric"),
])
def test_quantize_rejects_bad_arguments(bad, err, match):
    with pytest.raises(err, match=match):
        quantize(torch.randn(4, 64), **{"bits": 8, **bad})


def test_quantize_rejects_bad_tensors():
    with pytest.raises(TypeError, match="floating-point"):
        quantize(torch.ones(4, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="floating-point"):
        quantize([1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="empty"):
        quantize(torch.zeros(0, 4))
    with pytest.raises(TypeError, match="QuantizedTensor"):
        dequantize(torch.ones(2))  # type: ignore[arg-type]


# ----- int4 packing -----------------------------------------------------------------------------------------------


@pytest.mark.graded(points=2, exercise=("pack_int4", "unpack_int4"))
def test_pack_int4_worked_example():
    """[3, -2]: low nibble 0b0011, high nibble 0b1110 (two's complement of -2) -> 0b1110_0011 = 227."""
    packed = pack_int4(torch.tensor([3, -2], dtype=torch.int8))
    assert packed.dtype == torch.uint8 and packed.tolist() == [227]
    assert pack_int4(torch.tensor([15, 1, 0, 9], dtype=torch.uint8)).tolist() == [0x1F, 0x90]


@pytest.mark.graded(points=3, exercise=("pack_int4", "unpack_int4"))
@pytest.mark.parametrize("signed", [True, False])
def test_pack_unpack_is_exact_for_all_256_nibble_pairs(signed):
    values = range(-8, 8) if signed else range(16)
    pairs = torch.tensor(list(itertools.product(values, values)), dtype=torch.int8 if signed else torch.uint8)
    packed = pack_int4(pairs)  # (256, 2) -> (256, 1)
    assert packed.shape == (256, 1)
    assert sorted(packed.flatten().tolist()) == list(range(256))  # every byte used exactly once: nothing collides
    back = unpack_int4(packed, signed=signed)
    assert back.dtype == pairs.dtype and torch.equal(back, pairs)


@pytest.mark.graded(points=1, exercise=("pack_int4", "unpack_int4"))
def test_pack_unpack_keeps_leading_dimensions():
    q = torch.randint(-8, 8, (3, 5, 10), dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.shape == (3, 5, 5)
    assert torch.equal(unpack_int4(packed, signed=True), q)
    assert torch.equal(unpack_int4(packed[1:2, 2:4], signed=True), q[1:2, 2:4])  # rows unpack independently


def test_pack_int4_rejects_bad_input():
    with pytest.raises(ValueError, match="even"):
        pack_int4(torch.zeros(3, 5, dtype=torch.int8))
    with pytest.raises(ValueError, match="fit 4 bits"):
        pack_int4(torch.tensor([8, 0], dtype=torch.int8))
    with pytest.raises(ValueError, match="fit 4 bits"):
        pack_int4(torch.tensor([16, 0], dtype=torch.uint8))
    with pytest.raises(TypeError, match="int8 or uint8"):
        pack_int4(torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="uint8"):
        unpack_int4(torch.tensor([1, 2], dtype=torch.int8), signed=True)
    with pytest.raises(TypeError, match="signed"):
        unpack_int4(torch.tensor([1, 2], dtype=torch.uint8), signed=1)  # type: ignore[arg-type]


# ----- quantized linear layers ------------------------------------------------------------------------------------

# A QuantLinear computes F.linear with the weight it de-quantizes (symmetric int8: the unscaled codes, then the
# output scaled per row, the same products summed in another order); the reference builds the weight with the pure
# functions and calls F.linear itself, so they agree to float32 rounding of sums of ~128 terms of size ~1.
LIN_ATOL, LIN_RTOL = 1e-5, 1e-5


@pytest.mark.parametrize("config", [QuantConfig("int8"), QuantConfig("int8", symmetric=False),
                                    QuantConfig("int4", group_size=32), QuantConfig("int4", group_size=64,
                                                                                    symmetric=False)],
                         ids=lambda c: f"{c.mode}-{'sym' if c.symmetric else 'asym'}")
@pytest.mark.parametrize("bias", [True, False])
def test_weight_only_linear_equals_f_linear_with_the_dequantized_weight(config, bias):
    lin = nn.Linear(128, 48, bias=bias)
    ql = QuantLinear.from_linear(lin, config)
    expected_w = dequantize(quantize(lin.weight.detach(), config.bits, config.symmetric, config.granularity,
                                     config.quantize_group_size))
    x = torch.randn(2, 5, 128)
    with torch.no_grad():
        torch.testing.assert_close(ql(x), F.linear(x, expected_w, lin.bias), atol=LIN_ATOL, rtol=LIN_RTOL)
        # and close to the fp32 layer, within the weight error: |Δy| <= sum_k |x_k| * max step / 2
        step = ql.scale.max().item()
        assert (ql(x) - lin(x)).abs().max().item() <= x.abs().sum(-1).max().item() * step / 2
    bytes_per_weight = ql.qweight.element_size() * ql.qweight.numel() / lin.weight.numel()
    assert bytes_per_weight == (0.5 if config.mode == "int4" else 1.0)


def test_int4_codes_are_stored_packed_and_unpack_to_the_same_codes():
    lin = nn.Linear(64, 8)
    config = QuantConfig("int4", group_size=32)
    ql = QuantLinear.from_linear(lin, config)
    qt = quantize(lin.weight.detach(), 4, True, "group", 32)
    assert ql.qweight.shape == (8, 32) and ql.qweight.dtype == torch.uint8
    assert torch.equal(ql.quantized_weight().q, qt.q)


@pytest.mark.parametrize("shape", [(1, 64), (3, 64), (17, 64), (2, 33, 64)])
def test_w8a8_equals_its_float_twin(shape):
    """The integer matmul accumulates exactly in int32; the float twin de-quantizes both operands first."""
    lin = nn.Linear(64, 40)
    ql = QuantLinear.from_linear(lin, QuantConfig("w8a8"))
    x = torch.randn(*shape)
    with torch.no_grad():
        y = ql(x)
        assert y.shape == (*shape[:-1], 40)
        torch.testing.assert_close(y, w8a8_reference(x, ql), atol=1e-5, rtol=1e-5)
        # both quantizations together stay near the fp32 layer (a loose sanity bound, not the definition)
        assert (y - lin(x)).abs().max().item() < 0.05 * lin(x).abs().max().item()


@pytest.mark.parametrize("use_int_mm", [True, False])
def test_int8_matmul_is_exact(use_int_mm):
    a = torch.randint(-127, 128, (5, 300), dtype=torch.int8)
    b = torch.randint(-127, 128, (300, 7), dtype=torch.int8)
    exact = a.long() @ b.long()
    out = int8_matmul(a, b, use_int_mm)
    assert out.dtype == torch.int32 and torch.equal(out.long(), exact)
    assert torch.equal(int8_matmul_ref(a, b).long(), exact)


def test_w8a8_scales_are_per_token():
    """A token 1000x larger than the others does not flatten their codes: each row has its own activation scale."""
    lin = nn.Linear(32, 16)
    ql = QuantLinear.from_linear(lin, QuantConfig("w8a8"))
    x = torch.randn(2, 32)
    x[1] *= 1000.0
    with torch.no_grad():
        torch.testing.assert_close(ql(x)[:1], ql(x[:1]), atol=1e-6, rtol=1e-6)


def test_quant_config_validation():
    with pytest.raises(ValueError, match="mode"):
        QuantConfig("int2")
    with pytest.raises(ValueError, match="symmetric"):
        QuantConfig("w8a8", symmetric=False)
    with pytest.raises(ValueError, match="group_size"):
        QuantConfig("int4", group_size=0)
    with pytest.raises(TypeError, match="quantize_head"):
        QuantConfig("int8", quantize_head="yes")  # type: ignore[arg-type]
    assert QuantConfig.from_dict(QuantConfig("int4", 64).to_dict()) == QuantConfig("int4", 64)
    with pytest.raises(ValueError, match="unknown"):
        QuantConfig.from_dict({"mode": "int8", "bits": 8})


def test_quant_linear_rejects_groups_that_do_not_divide():
    with pytest.raises(ValueError, match="does not divide"):
        QuantLinear.from_linear(nn.Linear(96, 8), QuantConfig("int4", group_size=64))


# ----- the swapped model ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [QuantConfig("int8"), QuantConfig("int4", group_size=32),
                                    QuantConfig("w8a8"), QuantConfig("int8", quantize_head=True),
                                    QuantConfig("int4", group_size=32, symmetric=False, quantize_head=True)],
                         ids=lambda c: f"{c.mode}{'-head' if c.quantize_head else ''}")
def test_quantize_model_swaps_every_block_linear_and_leaves_the_original(config):
    model = small_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    qmodel = quantize_model(model, config)
    assert isinstance(qmodel, QuantizedGPT) and qmodel.quant_config == config
    assert not any(isinstance(m, nn.Linear) for m in qmodel.transformer.h.modules())
    assert sum(isinstance(m, QuantLinear) for m in qmodel.modules()) == 4 * SMALL["n_layer"] + config.quantize_head
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the fp32 model is untouched
    assert type(model).__name__ == "GPT" and not hasattr(model, "quant_config")
    ids = torch.randint(0, SMALL["vocab_size"], (2, 12))
    with torch.no_grad():
        ref, out = model(ids), qmodel(ids)
    assert out.shape == ref.shape and torch.isfinite(out).all()
    if config.mode != "w8a8":  # (W8A8 also rounds activations; its layers are checked against their twin above)
        # Weight-only: the fp32 model with every swapped weight replaced by its de-quantized twin, to fp32 rounding.
        with torch.no_grad():
            torch.testing.assert_close(out, _dequantized_twin(model, qmodel)(ids), atol=1e-5, rtol=1e-5)
    assert weight_bytes(qmodel) < weight_bytes(model)


def _dequantized_twin(model, qmodel):
    """The fp32 GPT with each quantized layer's de-quantized weight copied in (the naive twin of weight-only)."""
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for name, m in qmodel.transformer.h.named_modules():
            if isinstance(m, QuantLinear):
                twin.transformer.h.get_submodule(name).weight.copy_(m.dequantized_weight())
        if qmodel.quant_config.quantize_head:
            twin.transformer.wte.weight.copy_(qmodel.transformer.wte.table.dequantized_weight())
    return twin


def test_quantized_model_bytes():
    """int8 codes are 1/4 of fp32 per weight; what is left is the scales (one fp32 per row) and the fp32 rest."""
    model = small_model()
    q8 = quantize_model(model, QuantConfig("int8", quantize_head=True))
    C, L, V = SMALL["n_embd"], SMALL["n_layer"], SMALL["vocab_size"]
    linear_w = L * (C * 3 * C + C * C + C * 4 * C + 4 * C * C)
    rows = L * (3 * C + C + 4 * C + C) + V  # one scale per output row (and per embedding row)
    rest = weight_bytes(model) - 4 * (linear_w + V * C)  # biases, LayerNorms, position embedding: fp32 in both
    assert weight_bytes(q8) == linear_w + V * C + 4 * rows + rest


def test_quantize_model_rejects_bad_input():
    model = small_model()
    with pytest.raises(TypeError, match="QuantConfig"):
        quantize_model(model, "int8")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="GPT"):
        quantize_model(nn.Linear(2, 2), QuantConfig("int8"))  # type: ignore[arg-type]
    q = quantize_model(model, QuantConfig("int8"))
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(q, QuantConfig("int4"))
    with pytest.raises(ValueError, match="not in the blocks"):
        quantize_model(model, QuantConfig("int8"), weights={"9.mlp.c_fc": None})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="does not divide"):
        quantize_model(model, QuantConfig("int4", group_size=128))


# ----- GPTQ -------------------------------------------------------------------------------------------------------


def correlated_inputs(n: int, width: int, seed: int) -> torch.Tensor:
    """(n, width) inputs with correlated features and a few large ones, as a layer's activations have."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, width, generator=g) @ torch.randn(width, width, generator=g) / width**0.5
    X[:, :2] *= 8.0  # two outlier features
    return X


def hessian(X: torch.Tensor) -> torch.Tensor:
    return X.double().T @ X.double() / X.shape[0]


@pytest.mark.graded(points=3, exercise="gptq_quantize")
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [None, 8])
@pytest.mark.parametrize("damp", [0.0, 0.01])
def test_gptq_equals_least_squares_from_scratch_at_every_step(symmetric, group_size, damp):
    """The Cholesky-row updates give exactly the codes of re-solving the least-squares problem after every column."""
    torch.manual_seed(1)
    W = torch.randn(12, 24)
    H = hessian(correlated_inputs(200, 24, seed=2))
    fast = gptq_quantize(W, H, 4, symmetric, group_size, damp)
    slow = gptq_reference(W, H, 4, symmetric, group_size, damp)
    assert torch.equal(fast.q, slow.q)
    torch.testing.assert_close(fast.scale, slow.scale, atol=1e-6, rtol=1e-6)
    assert (fast.zero is None and slow.zero is None) or torch.equal(fast.zero, slow.zero)


@pytest.mark.graded(points=3, exercise="gptq_quantize")
def test_gptq_against_lstsq_on_the_inputs():
    """Brute force on a 3-input layer, no damping: after columns 0..i are fixed on the grid, the free columns must
    be the least-squares best replacement, v = argmin_v ‖X w - X[:, :i+1] ŵ[:i+1] - X[:, i+1:] v‖ (torch.linalg.lstsq
    on X itself, no Hessian, no Cholesky), and column i+1 is then v's first entry rounded to nearest on the grid.

    Per-channel symmetric int4: each row's grid is fixed from the original weights before the loop; column 2 is the
    largest, so columns 0 and 1 round somewhere inside the grid and their errors matter.
    """
    g = torch.Generator().manual_seed(3)
    X = torch.randn(100, 3, generator=g) @ torch.tensor([[1.0, 0.9, 0.5], [0.0, 0.4, 0.3], [0.0, 0.0, 0.8]])
    W = torch.randn(40, 3, generator=g) * torch.tensor([1.0, 1.0, 3.0])
    qt = gptq_quantize(W, hessian(X), bits=4, symmetric=True, group_size=None, damp=0.0)
    X64, W64 = X.double(), W.double()
    s = symmetric_params(W64, 4, dim=1)  # (40, 1)
    torch.testing.assert_close(qt.scale.double(), s)
    codes, cur = [], W64.clone()  # cur: fixed columns hold grid values, free columns their least-squares optimum
    for i in range(3):
        q = quantize_symmetric(cur[:, i:i + 1], s, 4)  # (40, 1)
        codes.append(q)
        cur[:, i:i + 1] = s * q.double()
        if i < 2:
            target = X64 @ W64.T - X64[:, :i + 1] @ cur[:, :i + 1].T  # (100, 40): what the free columns must explain
            cur[:, i + 1:] = torch.linalg.lstsq(X64[:, i + 1:], target).solution.T  # (40, 2 - i)
    expected = torch.cat(codes, dim=1)
    assert torch.equal(qt.q, expected)
    rtn = quantize_symmetric(W64, s, 4)
    assert (rtn != expected).sum() >= 5  # the compensation really changed codes: the check is not vacuous


@pytest.mark.graded(points=1, exercise=("gptq_quantize", *MAPS))  # both grids' quality rests on the maps
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("symmetric,group_size", [(True, None), (True, 16), (False, 16)])
def test_gptq_output_error_is_below_round_to_nearest(seed, symmetric, group_size):
    X = correlated_inputs(256, 64, seed)
    layer = nn.Linear(64, 32)
    errs = rtn_and_gptq_errors(layer, X, 4, symmetric, group_size)
    assert errs["gptq"] <= errs["rtn"]


def test_gptq_model_calibrates_each_layer_on_its_own_inputs():
    """Block 0's c_attn sees ln_1 of the embeddings: its codes are GPTQ on exactly that Hessian."""
    model = small_model()
    config = QuantConfig("int4", group_size=32)
    calib = torch.randint(0, SMALL["vocab_size"], (4, 16))
    qmodel = gptq_quantize_model(model, config, calib)
    assert isinstance(qmodel, QuantizedGPT) and qmodel.quant_config == config
    with torch.no_grad():
        x = model.transformer.wte(calib) + model.transformer.wpe(torch.arange(16))
        X = model.transformer.h[0].ln_1(x).reshape(-1, SMALL["n_embd"])  # (64, C)
    expected = gptq_quantize(model.transformer.h[0].attn.c_attn.weight, hessian(X), 4, True, 32)
    assert torch.equal(qmodel.transformer.h[0].attn.c_attn.quantized_weight().q, expected.q)
    rtn = quantize_model(model, config)
    assert not torch.equal(rtn.transformer.h[1].mlp.c_fc.qweight, qmodel.transformer.h[1].mlp.c_fc.qweight)


def test_gptq_rejects_bad_input():
    W, H = torch.randn(4, 8), torch.eye(8)
    with pytest.raises(ValueError, match="H must be"):
        gptq_quantize(W, torch.eye(6))
    with pytest.raises(ValueError, match="group_size"):
        gptq_quantize(W, H, group_size=3)
    with pytest.raises(TypeError, match="2-D float"):
        gptq_quantize(W.long(), H)
    model = small_model()
    with pytest.raises(ValueError, match="weight-only"):
        gptq_quantize_model(model, QuantConfig("w8a8"), torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="calibration"):
        gptq_quantize_model(model, QuantConfig("int8"), torch.zeros(4))


def test_gptq_handles_an_input_that_never_fires():
    """A dead input (H_ii = 0, e.g. a feature that is always 0 on the calibration set) must not break Cholesky."""
    X = correlated_inputs(64, 16, seed=0)
    X[:, 5] = 0.0
    qt = gptq_quantize(torch.randn(4, 16), hessian(X), 4, True, None, damp=0.0)
    assert torch.isfinite(dequantize(qt)).all()


# ----- checkpoints ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [QuantConfig("int8"), QuantConfig("int4", group_size=32, symmetric=False),
                                    QuantConfig("w8a8", quantize_head=True, outlier_threshold=6.0),
                                    QuantConfig("int4", group_size=16, quantize_head=True)],
                         ids=lambda c: f"{c.mode}{'-head' if c.quantize_head else ''}")
def test_quantized_checkpoint_round_trip(tmp_path, config):
    qmodel = quantize_model(small_model(), config)
    path = save_quantized(qmodel, tmp_path / "q.safetensors", method="rtn")
    assert [p.name for p in tmp_path.iterdir()] == ["q.safetensors"]  # the atomic write left no temp file
    loaded = load_quantized(path)
    assert isinstance(loaded, QuantizedGPT) and loaded.quant_config == config and loaded.config == qmodel.config
    before, after = qmodel.state_dict(), loaded.state_dict()
    assert before.keys() == after.keys()
    assert all(before[k].dtype == after[k].dtype and torch.equal(before[k], after[k]) for k in before)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 10))
    with torch.no_grad():
        assert torch.equal(qmodel(ids), loaded(ids))
    assert describe(path)["quant_config"]["mode"] == config.mode and describe(path)["method"] == "rtn"
    assert path.stat().st_size < 4 * sum(p.numel() for p in small_model().parameters())  # smaller than fp32


def _rewrite(src, dst, metadata=None, drop=(), change=None):
    """Copy a quantized file with other metadata, tensors dropped, or one tensor changed."""
    with safe_open(str(src), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys() if k not in drop}
    if change:
        tensors.update(change)
    save_file(tensors, str(dst), metadata=meta if metadata is None else metadata)
    return dst


def test_loading_refuses_missing_or_inconsistent_metadata(tmp_path):
    qmodel = quantize_model(small_model(), QuantConfig("int4", group_size=32))
    good = save_quantized(qmodel, tmp_path / "good.safetensors")
    with safe_open(str(good), framework="pt") as f:
        meta = dict(f.metadata())
    with pytest.raises(ValueError, match="no minillm-quant metadata"):
        load_quantized(_rewrite(good, tmp_path / "none.safetensors", metadata={}))
    with pytest.raises(ValueError, match="'quant_config' is missing"):
        load_quantized(_rewrite(good, tmp_path / "m.safetensors", metadata={k: v for k, v in meta.items()
                                                                             if k != "quant_config"}))
    as_int8 = {**meta, "quant_config": json.dumps(QuantConfig("int8").to_dict())}
    with pytest.raises(ValueError, match="disagree"):
        load_quantized(_rewrite(good, tmp_path / "int8.safetensors", metadata=as_int8))
    as_asym = {**meta, "quant_config": json.dumps(QuantConfig("int4", group_size=32, symmetric=False).to_dict())}
    with pytest.raises(ValueError, match="missing tensor"):  # an asymmetric mode needs zero points
        load_quantized(_rewrite(good, tmp_path / "asym.safetensors", metadata=as_asym))
    as_g16 = {**meta, "quant_config": json.dumps(QuantConfig("int4", group_size=16).to_dict())}
    with pytest.raises(ValueError, match="scale"):  # the group size decides the scales' shape
        load_quantized(_rewrite(good, tmp_path / "g16.safetensors", metadata=as_g16))
    with pytest.raises(ValueError, match="invalid quantization metadata"):
        load_quantized(_rewrite(good, tmp_path / "bad.safetensors", metadata={**meta, "quant_config": "{oops"}))
    with pytest.raises(ValueError, match="mode"):
        load_quantized(_rewrite(good, tmp_path / "mode.safetensors",
                                metadata={**meta, "quant_config": json.dumps({"mode": "int3"})}))
    key = "transformer.h.0.mlp.c_fc.qweight"
    with pytest.raises(ValueError, match="missing tensor"):
        load_quantized(_rewrite(good, tmp_path / "drop.safetensors", drop=(key,)))
    with pytest.raises(ValueError, match="disagree"):
        load_quantized(_rewrite(good, tmp_path / "dtype.safetensors",
                                change={key: qmodel.state_dict()[key].to(torch.int8)}))


def test_loading_refuses_an_fp32_checkpoint_and_a_torn_file(tmp_path):
    directory = save_checkpoint(small_model(), tmp_path / "fp32")
    with pytest.raises(ValueError, match="no minillm-quant metadata"):
        load_quantized(directory / "model.safetensors")
    good = save_quantized(quantize_model(small_model(), QuantConfig("int8")), tmp_path / "q.safetensors")
    torn = tmp_path / "torn.safetensors"
    torn.write_bytes(good.read_bytes()[:100])
    with pytest.raises(ValueError, match="torn.safetensors"):
        load_quantized(torn)
    with pytest.raises(FileNotFoundError):
        load_quantized(tmp_path / "nothing.safetensors")
    with pytest.raises(TypeError, match="quantized model"):
        save_quantized(small_model(), tmp_path / "x.safetensors")  # type: ignore[arg-type]


# ----- a quantized model runs everywhere a GPT runs -------------------------------------------------------------


@pytest.mark.parametrize("config", [QuantConfig("int8", quantize_head=True), QuantConfig("int4", group_size=32),
                                    QuantConfig("w8a8")], ids=lambda c: c.mode)
def test_quantized_model_gives_the_same_tokens_in_every_generator_and_the_engine(config):
    """The generators and the engine take any module with GPT's interface: a quantized model gives the naive loop's
    greedy tokens through the KV cache, static batching, the paged cache and chapter 06's engine (its own tokens,
    not fp32's: those are compared by the benchmark)."""
    assert_every_generator_agrees(quantize_model(small_model(), config))


@pytest.mark.parametrize("config", [QuantConfig("int8"), QuantConfig("int4", group_size=32)], ids=lambda c: c.mode)
def test_a_quantized_model_runs_disaggregated_with_its_own_tokens(config):
    """Chapter 07's workers receive the model as bytes and rebuild it by its format: a QuantizedGPT arrives as a
    QuantizedGPT (codes, scales, zero points), so prefill and decode in two processes give the colocated tokens."""
    assert_every_generator_agrees(quantize_model(small_model(), config), disaggregated=True)


def test_bench_helpers_on_a_small_model():
    model = small_model()
    q = quantize_model(model, QuantConfig("int8"))
    seqs = [[1, 2, 3, 4, 5, 6], [9, 8, 7, 6, 5, 4]]
    assert teacher_forced_agreement(model, model, seqs, prompt_len=2) == (8, 8)
    agree, total = teacher_forced_agreement(model, q, seqs, prompt_len=2)
    assert total == 8 and 0 <= agree <= 8
    C, L = SMALL["n_embd"], SMALL["n_layer"]
    fp32_linears = 4 * L * (C * 3 * C + 3 * C + C * C + C + C * 4 * C + 4 * C + 4 * C * C + C)
    assert linear_bytes(model) == fp32_linears
    # int8 per channel: 1 byte per weight, and a 4-byte scale and a 4-byte bias per output row (9C rows per block)
    assert linear_bytes(q) == L * (12 * C * C + 9 * C * (4 + 4))


def test_the_benchmark_on_a_small_model_at_its_quick_sizes():
    """Every case, the int8 KV cache and the outlier study come back; the engine gives each quantized model's own
    greedy tokens (the contract); the sizes are checked before any work. Width 128: int4's groups of 128."""
    model = context_model(GPTConfig(vocab_size=4096, block_size=32, n_layer=2, n_head=2, n_embd=128), seed=0)
    with pytest.raises(ValueError, match="size must be one of"):
        run_all(model, real_text=True, size="tiny")
    report = run_all(model, real_text=True, size="quick")
    assert report["size"] == "quick" and report["prompts"] == 4 and report["val_tokens"] == 4096
    assert [r["case"] for r in report["cases"]] == [c.name for c in CASES]
    for r in report["cases"]:
        assert 0 <= r["agreement"] <= 1 and r["speedup"] > 0 and r["bytes_ratio"] >= 1
        assert 0 <= r["kl_mean"] <= r["kl_max"] and r["kl_p99"] <= r["kl_max"]
        assert 0 <= r["mean_common_prefix"] <= report["new_tokens"]
        if "engine" in r:
            assert r["engine"]["same_as_generate"] == report["prompts"]
    fp32 = report["cases"][0]  # fp32 against itself: no divergence, every continuation identical
    assert fp32["kl_max"] == 0 and fp32["agreement"] == 1 and fp32["identical_prompts"] == report["prompts"]
    assert report["kv_int8"]["engine_same_as_generate"] == report["prompts"]
    assert len(report["outliers"]["rows"]) == 2 and report["layer_costs"]
    pieces = quotes({**report, "wall_s": 60.0})  # the command line adds the run's wall time
    assert pieces["methods"].count("\n") == 2 + len(CASES) and pieces["divergence"].count("\n") == 2 + len(CASES)
    assert pieces["outliers"].count("\n") == 4 and pieces["minutes"] == "1"
    assert pieces["gptq_delta"] == f"{report['cases'][4]['ppl_delta_pct']:+.2f}%"


def test_the_committed_results_give_every_number_chapter_09_quotes():
    """Each table and value the chapter text takes from chapters/results/09-quantization.json is one of `quotes`."""
    root = Path(__file__).resolve().parent.parent
    results = "chapters/results/09-quantization.json"
    names = set(re.findall(re.escape(results) + r"::([\w.]+) -->", (root / "chapters/09-quantization.md").read_text()))
    assert {"methods", "divergence", "outliers", "layer_costs"} <= names
    report = json.loads((root / results).read_text())
    assert report["bench"] == "minillm.quant.bench" and report["size"] == "full"
    assert names <= set(quotes(report))


# ----- KV-cache int8 ----------------------------------------------------------------------------------------------


def test_quantize_kv_is_per_token_and_head():
    x = torch.randn(2, 4, 5, 16)  # (B, nh, T, hs)
    x[0, 1, 2] *= 100.0  # one large (token, head) vector does not change any other vector's codes
    codes, scale = quantize_kv(x)
    assert codes.dtype == torch.int8 and scale.shape == (2, 4, 5, 1)
    torch.testing.assert_close(scale, x.abs().amax(-1, keepdim=True) / 127)
    assert ((dequantize_kv(codes, scale) - x).abs() <= scale / 2 * (1 + REL)).all()


@pytest.mark.parametrize("split", [1, 9])
def test_int8_contiguous_cache_equals_its_fake_quant_twin(split):
    """Stored as int8 codes or as fp32 values already rounded to the same grid: the same logits."""
    model = small_model()
    ids = torch.randint(0, SMALL["vocab_size"], (2, 24))
    outs, caches = [], []
    with torch.no_grad():
        full = model(ids)
        for cls in (Int8ContiguousKVCache, FakeQuantContiguousKVCache):
            cache = cls(model.config, 2, 24)
            parts = [model(ids[:, :split], cache=cache)]
            parts += [model(ids[:, t:t + 1], positions=torch.tensor([t]), cache=cache) for t in range(split, 24)]
            outs.append(torch.cat(parts, dim=1))
            caches.append(cache)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(outs[0], full, atol=1e-3)  # the rounding is real: it moves the logits...
    assert (outs[0] - full).abs().max() < 0.1 * full.abs().max()  # ...a little
    int8, fp32 = caches
    assert int8.k[0].dtype == torch.int8 and int8.length == fp32.length == 24
    C = SMALL["n_embd"]
    assert int8.nbytes == fp32.nbytes // 4 + 2 * SMALL["n_layer"] * 2 * SMALL["n_head"] * 24 * 4
    assert C // SMALL["n_head"] == 16  # (hs = 16 here: codes 16 B + one 4 B scale per token and head)


def test_int8_caches_give_the_same_tokens_in_generate_static_batch_and_the_engine():
    model = small_model()
    prompts = [[5, 17, 99, 3], [200, 1, 1, 42, 7, 9, 11], [64]]
    params = SamplingParams.greedy(10, ignore_eos=True)
    contiguous = [generate_ids(model, p, params, kv_cache=Int8ContiguousKVCache(model.config, 1, 32))
                  for p in prompts]
    twin = [generate_ids(model, p, params, kv_cache=FakeQuantContiguousKVCache(model.config, 1, 32))
            for p in prompts]
    assert contiguous == twin
    llm = LLM(model, None, EngineConfig(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                                        attention_backend="paged-int8"))
    assert isinstance(llm.runner.cache, Int8PagedKVCache)
    assert [o.output_token_ids for o in llm.generate(prompts, params)] == contiguous


def test_int8_paged_cache_copies_scales_with_blocks():
    cache = Int8PagedKVCache(GPTConfig(**SMALL), num_blocks=4, block_size=2)
    cache.k_pools[0][1] = 7
    cache.k_scales[0][1] = 0.5
    cache.copy_blocks([(1, 3)])
    assert torch.equal(cache.k_pools[0][3], cache.k_pools[0][1])
    assert torch.equal(cache.k_scales[0][3], cache.k_scales[0][1])
    assert cache.k_pools[0].dtype == torch.int8


def test_kv_perplexity_with_a_plain_cache_is_the_usual_perplexity():
    model = small_model()
    tokens = torch.randint(0, SMALL["vocab_size"], (2 * SMALL["block_size"] + 1,))  # two whole windows
    plain = kv_perplexity(model, tokens, lambda B, T: ContiguousKVCache(model.config, B, T))
    assert plain == pytest.approx(perplexity(model, tokens), rel=1e-5)
    int8 = kv_perplexity(model, tokens, lambda B, T: Int8ContiguousKVCache(model.config, B, T))
    assert int8 != plain and int8 == pytest.approx(plain, rel=0.05)


# ----- outliers: LLM.int8 decomposition and SmoothQuant -----------------------------------------------------------


def test_injected_outliers_keep_the_function_and_grow_the_features():
    model = small_model()
    ids = torch.randint(0, SMALL["vocab_size"], (2, 16))
    spiky = inject_outliers(model, [3, 40], factor=50.0)
    with torch.no_grad():
        torch.testing.assert_close(spiky(ids), model(ids), atol=1e-4, rtol=1e-4)
    before, after = input_absmax(model, ids), input_absmax(spiky, ids)
    ratio = after["0.attn.c_attn"] / before["0.attn.c_attn"]
    torch.testing.assert_close(ratio[[3, 40]], torch.tensor([50.0, 50.0]), atol=1e-3, rtol=1e-3)
    assert torch.allclose(ratio[[0, 1, 2]], torch.ones(3))
    rows = outlier_report(after, threshold=6.0)
    assert rows[0]["layer"] == "0.attn.c_attn" and rows[0]["outlier_features"] >= 1
    with pytest.raises(ValueError, match="channels"):
        inject_outliers(model, [SMALL["n_embd"]])


def _outlier_layer(seed: int = 0) -> tuple[nn.Linear, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(64, 32)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(32, 64, generator=g) / 8)
        lin.bias.copy_(torch.randn(32, generator=g) / 8)
    x = torch.randn(6, 64, generator=g)
    x[:, 5] *= 60.0  # one outlier feature, in every token
    return lin, x


def test_llm_int8_equals_its_float_twin_and_its_limits():
    lin, x = _outlier_layer()
    ql = QuantLinear.from_linear(lin, QuantConfig("w8a8", outlier_threshold=6.0))
    with torch.no_grad():
        torch.testing.assert_close(ql(x), llm_int8_reference(x, ql, 6.0), atol=1e-5, rtol=1e-5)
        # no feature reaches the threshold: plain W8A8
        torch.testing.assert_close(llm_int8_linear(x, ql, 1e9), w8a8_reference(x, ql), atol=1e-5, rtol=1e-5)
        # every feature does: all fp32, with the de-quantized weight
        torch.testing.assert_close(llm_int8_linear(x, ql, 1e-9), F.linear(x, ql.dequantized_weight(), lin.bias),
                                   atol=1e-5, rtol=1e-5)


def test_decomposition_and_smoothing_shrink_the_w8a8_error_of_an_outlier_layer():
    lin, x = _outlier_layer()
    with torch.no_grad():
        exact = lin(x)
        plain = QuantLinear.from_linear(lin, QuantConfig("w8a8"))(x)
        mixed = QuantLinear.from_linear(lin, QuantConfig("w8a8", outlier_threshold=6.0))(x)
        s = smoothing_scales(x.abs().amax(0), lin.weight, alpha=0.5)
        smoothed = nn.Linear(64, 32)
        smoothed.weight.copy_(lin.weight * s)
        smoothed.bias.copy_(lin.bias)
        smooth = QuantLinear.from_linear(smoothed, QuantConfig("w8a8"))(x / s)
    err = {name: (y - exact).abs().max().item() for name, y in (("plain", plain), ("mixed", mixed), ("smooth", smooth))}
    assert err["mixed"] < err["plain"] / 3 and err["smooth"] < err["plain"] / 3, err


def test_smoothing_scales_balance_the_ranges():
    """alpha = 0.5: after X / s and W * s, each input channel's activation range equals its weight range."""
    lin, x = _outlier_layer()
    s = smoothing_scales(x.abs().amax(0), lin.weight, alpha=0.5)
    torch.testing.assert_close((x / s).abs().amax(0), (lin.weight * s).abs().amax(0), atol=1e-5, rtol=1e-5)
    assert torch.equal(smoothing_scales(torch.zeros(64), lin.weight), torch.ones(64))  # dead features: s = 1
    with pytest.raises(ValueError, match="alpha"):
        smoothing_scales(x.abs().amax(0), lin.weight, alpha=1.5)


def test_smooth_model_keeps_the_function_and_helps_w8a8_on_outliers():
    model = inject_outliers(small_model(), [3, 40], factor=50.0)
    calib = torch.randint(0, SMALL["vocab_size"], (4, 32))
    smooth = smooth_model(model, calib)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 32))
    with torch.no_grad():
        ref = model(ids)
        torch.testing.assert_close(smooth(ids), ref, atol=1e-4, rtol=1e-4)
        plain = (quantize_model(model, QuantConfig("w8a8"))(ids) - ref).abs().mean().item()
        smoothed = (quantize_model(smooth, QuantConfig("w8a8"))(ids) - ref).abs().mean().item()
    assert smoothed < plain / 2, (smoothed, plain)


def test_outlier_threshold_needs_w8a8():
    with pytest.raises(ValueError, match="w8a8"):
        QuantConfig("int8", outlier_threshold=6.0)
    with pytest.raises(ValueError, match="outlier_threshold"):
        QuantConfig("w8a8", outlier_threshold=0.0)


# ----- QAT --------------------------------------------------------------------------------------------------------


@pytest.mark.graded(points=2, exercise="fake_quantize")
def test_fake_quantize_rounds_forward_and_passes_gradients_straight_through():
    config = QuantConfig("int4", group_size=16)
    w = torch.randn(8, 32, requires_grad=True)
    out = fake_quantize(w, config)
    assert torch.equal(out.detach(), dequantize(quantize(w.detach(), 4, True, "group", 16)))
    upstream = torch.randn(8, 32)
    (out * upstream).sum().backward()
    assert torch.equal(w.grad, upstream)  # d(round)/dw is 0 almost everywhere; the STE uses 1 instead


def test_fake_quant_linear_matches_the_quantized_layer_and_converts_exactly():
    model = small_model()
    config = QuantConfig("int4", group_size=32)
    qat = prepare_qat(model, config)
    assert sum(isinstance(m, FakeQuantLinear) for m in qat.modules()) == 4 * SMALL["n_layer"]
    assert not any(isinstance(m, FakeQuantLinear) for m in model.modules())  # the original is untouched
    ids = torch.randint(0, SMALL["vocab_size"], (2, 12))
    with torch.no_grad():
        fq = qat(ids)
        torch.testing.assert_close(convert_qat(qat, config)(ids), fq, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(quantize_model(model, config)(ids), fq, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="QAT"):
        prepare_qat(model, QuantConfig("w8a8"))


@pytest.mark.parametrize("distill", [False, True])
def test_finetune_qat_trains_the_weights_under_rounding(distill):
    cfg = GPTConfig(vocab_size=4096, block_size=16, n_layer=1, n_head=2, n_embd=32)  # the shipped tokenizer's ids
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    config = QuantConfig("int8")
    net, losses = finetune_qat(model, config, steps=3, batch_size=2, lr=1e-3, distill=distill)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert isinstance(net.transformer.h[0].mlp.c_fc, FakeQuantLinear) and not net.training
    assert not torch.equal(net.transformer.h[0].mlp.c_fc.weight, model.transformer.h[0].mlp.c_fc.weight)
    if distill:  # KL from the fp32 model: small (only the rounding differs at the start), never negative
        assert 0 <= losses[0] < 0.1

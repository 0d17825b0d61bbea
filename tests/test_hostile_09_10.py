"""Chapters 09 (quantization) and 10 (pruning) against a hostile user: every public entry point fed wrong types,
bool for int, NaN/inf, empty tensors, out-of-range numbers and wrong shapes/dtypes. Each must raise ValueError or
TypeError from minillm's own code, its message naming the argument, or give the right answer (checked against a
reference computed in the same test). Plus the regressions found: a QAT model converted to a different grid than it
trained with, GPTQ on a Hessian that is not positive definite, NaN masked to 0 by W8A8 and the int8 KV cache, an
integer input to an int8 layer returning only the bias, 99.9% pruning emptying rows, and pruning a quantized model.
"""

from __future__ import annotations

import copy
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from helpers import LyingInt, assert_refused_by_minillm, special_files
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils.prune as torch_prune
from safetensors import safe_open
from safetensors.torch import save_file

from minillm import GPT, GPTConfig
from minillm.prune.checkpoint import describe as describe_pruned
from minillm.prune.checkpoint import load_pruned, save_pruned
from minillm.prune.masks import (
    is_nm_sparse,
    lowest_k_mask,
    magnitude_mask,
    nm_mask,
    num_pruned,
    per_row_mask,
    sparsity_of,
    wanda_score,
)
from minillm.prune.semi_structured import SemiStructuredLinear, layer_speed, semi_structured_support, stored_bytes
from minillm.prune.structured import (
    head_scores,
    lowest_heads,
    mask_heads,
    mlp_neuron_scores,
    prune_heads,
    prune_mlp,
    recover,
    shrink_mlp,
)
from minillm.prune.unstructured import (
    block_inputs,
    block_weights,
    input_norms,
    layer_mask,
    prune_model,
    weight_sparsity,
)
from minillm.quant.gptq import (
    calibration_windows,
    check_calibration,
    damped,
    gptq_quantize,
    gptq_quantize_model,
    gptq_reference,
    output_error,
    rtn_and_gptq_errors,
)
from minillm.core.formats import model_to_bytes
from minillm.core.sampling import SamplingParams
from minillm.kvcache.cache import ContiguousKVCache
from minillm.kvcache.generate import generate_ids
from minillm.prune import bench as pbench
from minillm.quant import bench as qbench
from minillm.quant.checkpoint import describe as describe_quantized
from minillm.quant.checkpoint import load_quantized, save_quantized
from minillm.quant.kv_cache import Int8ContiguousKVCache, Int8PagedKVCache, dequantize_kv, quantize_kv
from minillm.quant.linear import QuantConfig, QuantEmbedding, QuantLinear, quantize_model, weight_bytes
from minillm.quant.outliers import (
    MAX_OUTLIER_FACTOR,
    inject_outliers,
    input_absmax,
    outlier_report,
    smooth_model,
    smoothing_scales,
)
from minillm.quant.qat import convert_qat, fake_quantize, finetune_qat, prepare_qat
from minillm.quant.quantize import (
    QuantizedTensor,
    asymmetric_params,
    dequantize,
    dequantize_asymmetric,
    dequantize_symmetric,
    pack_int4,
    qrange,
    quantize,
    quantize_asymmetric,
    quantize_symmetric,
    storage_dtype,
    symmetric_params,
    unpack_int4,
)
from minillm.quant.w8a8 import (
    MAX_INT8_K,
    int8_matmul,
    int8_matmul_ref,
    llm_int8_linear,
    llm_int8_reference,
    int_mm_available,
    outlier_columns,
    quantize_activations,
    w8a8_linear,
    w8a8_reference,
)

CFG = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=32)
NAN, INF = float("nan"), float("inf")


def tiny(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG).eval()


MODEL = tiny()
QMODEL = quantize_model(MODEL, QuantConfig("int8"))
CALIB = torch.randint(0, CFG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))


# A prune.bench Harness (it measures on real validation text: a 4096-token vocabulary), the smallest sizes.
HARNESS_SIZES = pbench.Sizes(256, 2, 4, 4, 1, 2, (0.5,), 128, (0.25,), 1, False, 1, 1)
_HARNESS: list = []


def harness() -> "pbench.Harness":
    if not _HARNESS:
        torch.manual_seed(0)
        dense = GPT(GPTConfig(vocab_size=4096, block_size=64, n_layer=2, n_head=2, n_embd=32)).eval()
        _HARNESS.append(pbench.Harness(dense, False, HARNESS_SIZES, 0))
    return _HARNESS[0]


def nan_model() -> GPT:
    m = tiny()
    with torch.no_grad():
        m.transformer.h[1].mlp.c_fc.weight[3, 5] = NAN
    return m


def linear(in_features: int = 32, out_features: int = 8, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features)


def qlinear(mode: str = "int8", **kw) -> QuantLinear:
    return QuantLinear.from_linear(linear(), QuantConfig(mode, **kw))


def with_nan(shape: tuple[int, ...], value: float = NAN) -> torch.Tensor:
    x = torch.randn(shape)
    x.view(-1)[1] = value
    return x


W = torch.randn(8, 32)
H = torch.eye(32)
Q8 = torch.zeros(2, 4, dtype=torch.int8)
QT8 = quantize(W)  # int8 codes up to ±127, one scale per row
U4 = torch.zeros(2, 4, dtype=torch.uint8)

# (id, call, exception, regex the message must match: the argument's name, or the dtype for a dtype error)
BAD = [
    # ----- quantize.py
    ("int8_matmul-meta-operand", lambda: int8_matmul(torch.ones(2, 3, dtype=torch.int8),
                                                     torch.ones(3, 2, dtype=torch.int8, device="meta")), ValueError,
     "one real device"),
    ("w8a8_linear-meta-weight", lambda: w8a8_linear(torch.ones(2, 3), torch.ones(2, 3, dtype=torch.int8, device="meta"),
                                                    torch.ones(2, 1), None), ValueError, "qweight"),
    ("quantize-int-x", lambda: quantize(torch.ones(4, 4, dtype=torch.int64)), TypeError, r"\bx\b"),
    ("quantize-bool-bits", lambda: quantize(W, bits=True), ValueError, "bits"),
    ("quantize-int-symmetric", lambda: quantize(W, symmetric=1), TypeError, "symmetric"),
    ("quantize-nan", lambda: quantize(with_nan((4, 4))), ValueError, r"\bx\b"),
    ("quantize-inf", lambda: quantize(with_nan((4, 4), -INF)), ValueError, r"\bx\b"),
    ("quantize-empty", lambda: quantize(torch.zeros(0, 4)), ValueError, r"\bx\b"),
    ("quantize-group-bool", lambda: quantize(W, granularity="group", group_size=True), ValueError, "group_size"),
    # before: group_size ignored (one scale per row came back); a meta x reached Tensor.item()
    ("quantize-channel-with-group_size", lambda: quantize(W, granularity="channel", group_size=4), ValueError,
     "group_size=4 applies to granularity='group' only"),
    ("quantize-tensor-with-group_size", lambda: quantize(W, granularity="tensor", group_size=8), ValueError,
     "group_size"),
    ("quantize-meta", lambda: quantize(torch.empty(2, 4, device="meta")), ValueError, r"\bx\b is a meta tensor"),
    ("quantize_symmetric-meta-scale", lambda: quantize_symmetric(torch.ones(2, 4),
                                                                 torch.ones(2, 1, device="meta"), 8), ValueError,
     "scale is a meta tensor"),
    ("quantize_asymmetric-meta", lambda: quantize_asymmetric(torch.ones(2, 4), torch.ones(2, 1),
                                                             torch.ones(2, 1, device="meta"), 8),
     ValueError, "zero is a meta tensor"),
    ("qrange-int-symmetric", lambda: qrange(8, 1), TypeError, "symmetric"),
    ("qrange-bool-bits", lambda: qrange(True, True), ValueError, "bits"),
    ("storage_dtype-str", lambda: storage_dtype("yes"), TypeError, "symmetric"),
    ("symmetric_params-empty", lambda: symmetric_params(torch.zeros(0), 8), ValueError, r"\bx\b"),
    ("symmetric_params-int", lambda: symmetric_params(torch.ones(3, dtype=torch.int32), 8), TypeError, r"\bx\b"),
    ("asymmetric_params-empty", lambda: asymmetric_params(torch.zeros(3, 0), 8, dim=1), ValueError, r"\bx\b"),
    ("quantize_symmetric-int-scale", lambda: quantize_symmetric(W, torch.ones(1, dtype=torch.int64), 8), TypeError,
     "scale"),
    ("dequantize_symmetric-float-q", lambda: dequantize_symmetric(W, torch.ones(1)), TypeError, r"\bq\b"),
    ("dequantize_symmetric-int-scale", lambda: dequantize_symmetric(Q8, torch.ones(1, dtype=torch.int32)), TypeError,
     "scale"),
    ("dequantize_asymmetric-int-zero", lambda: dequantize_asymmetric(Q8.to(torch.uint8), torch.ones(1), 3), TypeError,
     "zero"),
    ("QuantizedTensor-float-q", lambda: QuantizedTensor(W, torch.ones(8, 1), None, 8, (8, 32)), TypeError, r"\bq\b"),
    ("QuantizedTensor-shape", lambda: QuantizedTensor(Q8, torch.ones(2, 1), None, 8, (4, 2)), ValueError, "shape"),
    ("QuantizedTensor-bool-bits", lambda: QuantizedTensor(Q8, torch.ones(2, 1), None, True, (2, 4)), ValueError,
     "bits"),
    ("QuantizedTensor-zero", lambda: QuantizedTensor(Q8, torch.ones(2, 1), torch.zeros(2, 2), 8, (2, 4)), TypeError,
     "zero"),
    ("QuantizedTensor-int8-codes-as-int4", lambda: QuantizedTensor(QT8.q, QT8.scale, None, 4, QT8.shape), ValueError,
     r"\bq\b"),
    ("QuantizedTensor-negative-scale", lambda: QuantizedTensor(QT8.q, -QT8.scale, None, 8, QT8.shape), ValueError,
     "scale"),
    ("QuantizedTensor-zero-scale", lambda: QuantizedTensor(QT8.q, 0 * QT8.scale, None, 8, QT8.shape), ValueError,
     "scale"),
    ("QuantizedTensor-nan-scale", lambda: QuantizedTensor(QT8.q, NAN * QT8.scale, None, 8, QT8.shape), ValueError,
     "scale"),
    ("QuantizedTensor-zero-off-int4-grid", lambda: QuantizedTensor(U4, torch.ones(2, 1), torch.full((2, 1), 16,
                                                                                                    dtype=torch.uint8),
                                                                   4, (2, 4)), ValueError, "zero"),
    ("asymmetric_params-nan", lambda: asymmetric_params(torch.tensor([[NAN, 1.0]]), 8, dim=1), ValueError, r"\bx\b"),
    ("asymmetric_params-inf", lambda: asymmetric_params(torch.tensor([[-INF, 1.0]]), 8), ValueError, r"\bx\b"),
    ("symmetric_params-dim-range", lambda: symmetric_params(W, 8, dim=5), ValueError, r"\bdim\b"),
    ("symmetric_params-dim-bool", lambda: symmetric_params(W, 8, dim=True), TypeError, r"\bdim\b"),
    ("asymmetric_params-dim-twice", lambda: asymmetric_params(W, 8, dim=(1, 1)), ValueError, r"\bdim\b"),
    ("asymmetric_params-dim-twice-negative", lambda: asymmetric_params(W, 8, dim=(1, -1)), ValueError, r"\bdim\b"),
    ("quantize_symmetric-scale-shape", lambda: quantize_symmetric(torch.ones(4, 8), torch.ones(3, 1), 8), ValueError,
     "scale"),
    ("quantize_symmetric-scale-widens-x", lambda: quantize_symmetric(torch.ones(4), torch.ones(4, 1), 8), ValueError,
     "scale"),
    ("quantize_symmetric-negative-scale", lambda: quantize_symmetric(W, -torch.ones(8, 1), 8), ValueError, "scale"),
    ("quantize_symmetric-zero-scale", lambda: quantize_symmetric(W, torch.zeros(8, 1), 8), ValueError, "scale"),
    ("quantize_asymmetric-zero-off-grid", lambda: quantize_asymmetric(W, torch.ones(8, 1), torch.full((8, 1), 16), 4),
     ValueError, "zero"),
    ("quantize_asymmetric-zero-fraction", lambda: quantize_asymmetric(W, torch.ones(8, 1), torch.full((8, 1), 2.5), 8),
     ValueError, "zero"),
    ("quantize_asymmetric-int-zero", lambda: quantize_asymmetric(W, torch.ones(8, 1), 3, 8), TypeError, "zero"),
    ("quantize_asymmetric-negative-scale", lambda: quantize_asymmetric(W, -torch.ones(8, 1), torch.zeros(8, 1), 8),
     ValueError, "scale"),
    ("dequantize_symmetric-scale-shape", lambda: dequantize_symmetric(Q8, torch.ones(3, 1)), ValueError, "scale"),
    ("dequantize_asymmetric-zero-shape", lambda: dequantize_asymmetric(torch.zeros(4, 2, dtype=torch.uint8),
                                                                       torch.ones(4, 1), torch.zeros(3, 1)),
     ValueError, "zero"),
    ("dequantize_asymmetric-scale-shape", lambda: dequantize_asymmetric(U4, torch.ones(3, 1), torch.zeros(2, 1)),
     ValueError, "scale"),
    ("dequantize-not-qt", lambda: dequantize(W), TypeError, "QuantizedTensor"),
    ("pack_int4-float", lambda: pack_int4(W), TypeError, r"\bq\b"),
    ("pack_int4-odd", lambda: pack_int4(torch.zeros(2, 3, dtype=torch.int8)), ValueError, r"\bq\b"),
    ("unpack_int4-0d", lambda: unpack_int4(torch.tensor(3, dtype=torch.uint8), True), ValueError, "packed"),
    ("unpack_int4-int-signed", lambda: unpack_int4(torch.zeros(2, dtype=torch.uint8), 1), TypeError, "signed"),
    # ----- linear.py
    ("QuantConfig-bool-group", lambda: QuantConfig("int4", group_size=True), TypeError, "group_size"),
    ("QuantConfig-mode", lambda: QuantConfig("int3"), ValueError, "mode"),
    ("QuantConfig-nan-threshold", lambda: QuantConfig("w8a8", outlier_threshold=NAN), ValueError,
     "outlier_threshold"),
    ("from_linear-nan-weight", lambda: QuantLinear.from_linear(_nan_linear(), QuantConfig("int8")), ValueError,
     "weight"),
    ("from_linear-config-str", lambda: QuantLinear.from_linear(linear(), "int8"), TypeError, "config"),
    ("from_linear-qt-str", lambda: QuantLinear.from_linear(linear(), QuantConfig("int8"), "codes"), TypeError, "qt"),
    ("int8-forward-int-x", lambda: qlinear("int8")(torch.ones(2, 32, dtype=torch.int64)), TypeError, "int64"),
    ("int4-forward-int-x", lambda: qlinear("int4", group_size=16)(torch.ones(2, 32, dtype=torch.int32)), TypeError,
     "int32"),
    ("w8a8-forward-int-x", lambda: qlinear("w8a8")(torch.ones(2, 32, dtype=torch.int8)), TypeError, "int8"),
    ("int8-forward-shape", lambda: qlinear("int8")(torch.ones(2, 31)), ValueError, r"\bx\b"),
    ("int8-forward-fp16-x", lambda: qlinear("int8")(torch.ones(2, 32, dtype=torch.float16)), TypeError, r"\bx\b"),
    ("int8-asym-forward-bf16-x", lambda: qlinear("int8", symmetric=False)(torch.ones(2, 32, dtype=torch.bfloat16)),
     TypeError, r"\bx\b"),
    ("int4-forward-fp64-x", lambda: qlinear("int4", group_size=16)(torch.ones(2, 32, dtype=torch.float64)), TypeError,
     r"\bx\b"),
    ("w8a8-forward-fp16-x", lambda: qlinear("w8a8")(torch.ones(2, 32, dtype=torch.float16)), TypeError, r"\bx\b"),
    ("weight_bytes-str", lambda: weight_bytes("model"), TypeError, "model"),
    ("load_quantized-none", lambda: load_quantized(None), TypeError, "path"),
    ("load_quantized-bytes", lambda: load_quantized(b"m.safetensors"), TypeError, "path"),
    ("load_quantized-str", lambda: qlinear("int8").load_quantized("codes"), TypeError, "qt"),
    ("quantize_model-nan", lambda: quantize_model(nan_model(), QuantConfig("int8")), ValueError, "1.mlp.c_fc"),
    ("quantize_model-weights-list", lambda: quantize_model(MODEL, QuantConfig("int8"), [1]), TypeError, "weights"),
    ("quantize_model-weights-value", lambda: quantize_model(MODEL, QuantConfig("int8"), {"0.attn.c_attn": 3}),
     TypeError, "weights"),
    ("quantize_model-quantized", lambda: quantize_model(QMODEL, QuantConfig("int8")), ValueError, "quantized"),
    # ----- w8a8.py
    ("quantize_activations-nan", lambda: quantize_activations(with_nan((3, 8))), ValueError, r"\bx\b"),
    ("quantize_activations-inf", lambda: quantize_activations(with_nan((3, 8), INF)), ValueError, r"\bx\b"),
    ("quantize_activations-int", lambda: quantize_activations(torch.ones(3, 8, dtype=torch.int64)), TypeError,
     r"\bx\b"),
    ("quantize_activations-1d", lambda: quantize_activations(torch.ones(8)), ValueError, r"\bx\b"),
    ("int8_matmul-float", lambda: int8_matmul(W, Q8), TypeError, r"\ba\b"),
    ("int8_matmul-shapes", lambda: int8_matmul(Q8, Q8), ValueError, r"\ba\b.*\bb\b"),
    ("int8_matmul-bool-flag", lambda: int8_matmul(Q8, Q8.t(), use_int_mm=1), TypeError, "use_int_mm"),
    ("int8_matmul_ref-float", lambda: int8_matmul_ref(Q8, W), TypeError, r"\bb\b"),
    ("w8a8_linear-int-x", lambda: w8a8_linear(torch.ones(2, 32, dtype=torch.int64), qlinear("w8a8").qweight,
                                              qlinear("w8a8").scale, None), TypeError, "int64"),
    ("w8a8_linear-float-qweight", lambda: w8a8_linear(torch.ones(2, 32), W, torch.ones(8, 1), None), TypeError,
     "qweight"),
    ("w8a8_linear-scale-shape", lambda: w8a8_linear(torch.ones(2, 32), qlinear("w8a8").qweight, torch.ones(8), None),
     ValueError, "scale"),
    ("w8a8_reference-nan", lambda: w8a8_reference(with_nan((2, 32)), qlinear("w8a8")), ValueError, r"\bx\b"),
    ("llm_int8-negative-threshold", lambda: llm_int8_linear(torch.ones(2, 32), qlinear("w8a8"), -1.0), ValueError,
     "threshold"),
    ("llm_int8-bool-threshold", lambda: llm_int8_linear(torch.ones(2, 32), qlinear("w8a8"), True), TypeError,
     "threshold"),
    ("llm_int8_reference-nan", lambda: llm_int8_reference(with_nan((2, 32)), qlinear("w8a8"), 6.0), ValueError,
     r"\bx\b"),
    ("outlier_columns-str-threshold", lambda: outlier_columns(torch.ones(4, 8), "6"), TypeError, "threshold"),
    ("outlier_columns-1d", lambda: outlier_columns(torch.ones(4), 1.0), ValueError, r"\bx2\b"),
    # ----- kv_cache.py
    ("quantize_kv-nan", lambda: quantize_kv(with_nan((1, 2, 3, 16))), ValueError, r"\bx\b"),
    ("quantize_kv-inf", lambda: quantize_kv(with_nan((1, 2, 3, 16), INF)), ValueError, r"\bx\b"),
    ("quantize_kv-int", lambda: quantize_kv(torch.ones(2, 16, dtype=torch.int64)), TypeError, r"\bx\b"),
    ("quantize_kv-empty-hs", lambda: quantize_kv(torch.ones(2, 0)), ValueError, r"\bx\b"),
    ("dequantize_kv-float-codes", lambda: dequantize_kv(W, torch.ones(8, 1)), TypeError, "codes"),
    ("dequantize_kv-scale-shape", lambda: dequantize_kv(Q8, torch.ones(2, 4)), ValueError, "scale"),
    ("dequantize_kv-int-dtype", lambda: dequantize_kv(Q8, torch.ones(2, 1), torch.int32), TypeError, "dtype"),
    # before: a negative scale de-quantized every vector with its signs flipped
    ("dequantize_kv-negative-scale", lambda: dequantize_kv(*(lambda q, s: (q, -s))(*quantize_kv(torch.randn(2, 3, 4)))),
     ValueError, "scale must be > 0"),
    ("dequantize_kv-zero-scale", lambda: dequantize_kv(Q8, torch.zeros(2, 1)), ValueError, "scale must be > 0"),
    ("dequantize_kv-check-values-int", lambda: dequantize_kv(Q8, torch.ones(2, 1), check_values=1), TypeError,
     "check_values"),
    # ----- gptq.py
    ("gptq-nan-W", lambda: gptq_quantize(with_nan((8, 32)), H), ValueError, r"\bW\b"),
    ("gptq-inf-H", lambda: gptq_quantize(W, with_nan((32, 32), INF)), ValueError, r"\bH\b"),
    ("gptq-int-H", lambda: gptq_quantize(W, torch.eye(32, dtype=torch.int64)), TypeError, r"\bH\b"),
    ("gptq-H-shape", lambda: gptq_quantize(W, torch.eye(8)), ValueError, r"\bH\b"),
    ("gptq-negative-damp", lambda: gptq_quantize(W, H, damp=-0.1), ValueError, "damp"),
    ("gptq-nan-damp", lambda: gptq_quantize(W, H, damp=NAN), ValueError, "damp"),
    ("gptq-inf-damp", lambda: gptq_quantize(W, H, damp=INF), ValueError, "damp"),
    ("gptq-bool-damp", lambda: gptq_quantize(W, H, damp=True), TypeError, "damp"),
    ("gptq-str-damp", lambda: gptq_quantize(W, H, damp="0.1"), TypeError, "damp"),
    ("gptq-bits", lambda: gptq_quantize(W, H, bits=3), ValueError, "bits"),
    ("gptq-str-symmetric", lambda: gptq_quantize(W, H, symmetric="yes"), TypeError, "symmetric"),
    ("gptq-empty-W", lambda: gptq_quantize(torch.zeros(0, 32), H), ValueError, r"\bW\b"),
    ("gptq_reference-negative-damp", lambda: gptq_reference(W, H, damp=-1.0), ValueError, "damp"),
    ("damped-inf", lambda: damped(H, INF), ValueError, "damp"),
    ("damped-H-shape", lambda: damped(torch.ones(3, 4), 0.01), ValueError, r"\bH\b"),
    # before: an asymmetric H was read through its upper Cholesky factor, an all-zero H gave RTN's codes as if
    # GPTQ had chosen them, damped passed NaN on, output_error over no inputs said 0.0
    ("gptq-H-asymmetric", lambda: gptq_quantize(W, H + torch.triu(torch.ones(32, 32), 1)), ValueError,
     "H must be symmetric"),
    ("gptq_reference-H-asymmetric", lambda: gptq_reference(W, H + torch.triu(torch.ones(32, 32), 1)), ValueError,
     "H must be symmetric"),
    ("gptq-H-zero", lambda: gptq_quantize(W, torch.zeros(32, 32), damp=0.1), ValueError, "H is all zero"),
    ("damped-nan-H", lambda: damped(torch.eye(16) * NAN, 0.01), ValueError, r"\bH\b holds inf or NaN"),
    ("damped-asymmetric-H", lambda: damped(torch.triu(torch.ones(4, 4)), 0.01), ValueError, "H must be symmetric"),
    ("damped-int-H", lambda: damped(torch.eye(4, dtype=torch.int64), 0.01), TypeError, r"\bH\b"),
    ("output_error-empty-X", lambda: output_error(W, W, torch.empty(0, 32)), ValueError, r"\bX\b holds no inputs"),
    ("gptq_model-empty-calib", lambda: gptq_quantize_model(MODEL, QuantConfig("int8"), torch.zeros(0, 8,
                                                                                                  dtype=torch.int64)),
     ValueError, "calibration"),
    ("gptq_model-empty-T", lambda: gptq_quantize_model(MODEL, QuantConfig("int8"), torch.zeros(2, 0,
                                                                                              dtype=torch.int64)),
     ValueError, "calibration"),
    ("gptq_model-long-calib", lambda: gptq_quantize_model(MODEL, QuantConfig("int8"), torch.zeros(1, 33,
                                                                                                 dtype=torch.int64)),
     ValueError, "calibration"),
    ("gptq_model-id-range", lambda: gptq_quantize_model(MODEL, QuantConfig("int8"), CALIB + CFG.vocab_size),
     ValueError, "calibration"),
    ("gptq_model-negative-id", lambda: gptq_quantize_model(MODEL, QuantConfig("int8"), CALIB - 200), ValueError,
     "calibration"),
    ("gptq_model-float-calib", lambda: gptq_quantize_model(MODEL, QuantConfig("int8"), CALIB.float()), TypeError,
     "calibration"),
    ("gptq_model-damp", lambda: gptq_quantize_model(MODEL, QuantConfig("int8"), CALIB, damp=-1.0), ValueError,
     "damp"),
    ("gptq_model-config-str", lambda: gptq_quantize_model(MODEL, "int4", CALIB), TypeError, "config"),
    ("gptq_model-quantized", lambda: gptq_quantize_model(QMODEL, QuantConfig("int8"), CALIB), TypeError,
     "QuantizedGPT"),
    ("gptq_model-nan-weight", lambda: gptq_quantize_model(nan_model(), QuantConfig("int8"), CALIB), ValueError,
     r"\bW\b"),
    ("calibration_windows-bool", lambda: calibration_windows(num_windows=True), TypeError, "num_windows"),
    ("calibration_windows-zero", lambda: calibration_windows(length=0), ValueError, "length"),
    ("output_error-shape", lambda: output_error(W, W[:4], torch.ones(3, 32)), ValueError, "W_hat"),
    ("output_error-int-X", lambda: output_error(W, W, torch.ones(3, 32, dtype=torch.int64)), TypeError, r"\bX\b"),
    ("rtn_and_gptq-X-shape", lambda: rtn_and_gptq_errors(linear(), torch.ones(4, 31)), ValueError, r"\bX\b"),
    ("rtn_and_gptq-layer", lambda: rtn_and_gptq_errors(W, torch.ones(4, 32)), TypeError, "layer"),
    # ----- qat.py
    ("convert_qat-plain-model", lambda: convert_qat(MODEL, QuantConfig("int8")), TypeError, "prepare_qat"),
    ("convert_qat-other-grid", lambda: convert_qat(prepare_qat(MODEL, QuantConfig("int4", group_size=16)),
                                                   QuantConfig("int4", group_size=32)), ValueError, "config"),
    ("convert_qat-quantized", lambda: convert_qat(QMODEL), TypeError, "QuantizedGPT"),
    ("prepare_qat-group", lambda: prepare_qat(MODEL, QuantConfig("int4", group_size=48)), ValueError, "group_size"),
    ("prepare_qat-nan", lambda: prepare_qat(nan_model(), QuantConfig("int8")), ValueError, "1.mlp.c_fc"),
    ("prepare_qat-twice", lambda: prepare_qat(prepare_qat(MODEL, QuantConfig("int8")), QuantConfig("int8")),
     ValueError, "prepared"),
    ("fake_quantize-nan", lambda: fake_quantize(with_nan((8, 32)), QuantConfig("int8")), ValueError, r"\bw\b"),
    ("fake_quantize-config-str", lambda: fake_quantize(W, "int8"), TypeError, "config"),
    ("finetune_qat-int-flag", lambda: finetune_qat(MODEL, QuantConfig("int8"), fake_quant=1), TypeError,
     "fake_quant"),
    # before: 0 steps handed back the model untouched with an empty loss list, as if it had been fine-tuned; a model
    # smaller than the tokenizer's vocabulary failed in the forward with "token id 4050 is outside the vocabulary"
    ("finetune_qat-zero-steps", lambda: finetune_qat(MODEL, QuantConfig("int8"), steps=0), ValueError,
     "steps must be positive"),
    ("finetune_qat-inf-lr", lambda: finetune_qat(MODEL, QuantConfig("int8"), lr=INF), ValueError, r"\blr\b"),
    ("finetune_qat-zero-batch", lambda: finetune_qat(MODEL, QuantConfig("int8"), steps=1, batch_size=0), ValueError,
     "batch_size"),
    ("finetune_qat-small-vocab", lambda: finetune_qat(MODEL, QuantConfig("int8"), steps=1), ValueError,
     "vocab_size=128"),
    # ----- outliers.py
    ("inject_outliers-bool-channel", lambda: inject_outliers(MODEL, [True]), ValueError, "channels"),
    ("inject_outliers-inf-factor", lambda: inject_outliers(MODEL, [0], factor=INF), ValueError, "factor"),
    ("inject_outliers-nan-factor", lambda: inject_outliers(MODEL, [0], factor=NAN), ValueError, "factor"),
    ("inject_outliers-str-factor", lambda: inject_outliers(MODEL, [0], factor="20"), TypeError, "factor"),
    ("inject_outliers-quantized", lambda: inject_outliers(QMODEL, [0]), TypeError, "QuantizedGPT"),
    ("smoothing_scales-bool-alpha", lambda: smoothing_scales(torch.ones(32), W, alpha=True), TypeError, "alpha"),
    ("smoothing_scales-nan-alpha", lambda: smoothing_scales(torch.ones(32), W, alpha=NAN), ValueError, "alpha"),
    ("smoothing_scales-nan", lambda: smoothing_scales(with_nan((32,)).abs(), W), ValueError, "act_absmax"),
    ("smoothing_scales-shape", lambda: smoothing_scales(torch.ones(31), W), ValueError, "act_absmax"),
    ("smooth_model-alpha", lambda: smooth_model(MODEL, CALIB, alpha=2.0), ValueError, "alpha"),
    ("smooth_model-empty", lambda: smooth_model(MODEL, torch.zeros(0, 4, dtype=torch.int64)), ValueError, "empty"),
    ("smooth_model-quantized", lambda: smooth_model(QMODEL, CALIB), TypeError, "QuantizedGPT"),
    ("input_absmax-empty", lambda: input_absmax(MODEL, torch.zeros(0, 4, dtype=torch.int64)), ValueError, "tokens"),
    ("input_absmax-not-model", lambda: input_absmax(W, CALIB), TypeError, "Tensor"),
    ("outlier_report-empty", lambda: outlier_report({}), ValueError, "absmax"),
    ("outlier_report-nan-threshold", lambda: outlier_report({"a": torch.ones(3)}, NAN), ValueError, "threshold"),
    # ----- masks.py
    ("magnitude-int-weight", lambda: magnitude_mask(torch.ones(4, 4, dtype=torch.int64), 0.5), TypeError, "weight"),
    ("magnitude-nan-weight", lambda: magnitude_mask(with_nan((4, 4)), 0.5), ValueError, "weight"),
    ("magnitude-1d", lambda: magnitude_mask(torch.ones(4), 0.5), ValueError, "weight"),
    ("magnitude-bool-sparsity", lambda: magnitude_mask(W, True), ValueError, "sparsity"),
    ("magnitude-sparsity-1", lambda: magnitude_mask(W, 1.0), ValueError, "sparsity"),
    ("magnitude-sparsity-nan", lambda: magnitude_mask(W, NAN), ValueError, "sparsity"),
    ("wanda-int-norm", lambda: wanda_score(W, torch.ones(32, dtype=torch.int64)), TypeError, "input_norm"),
    ("wanda-norm-shape", lambda: wanda_score(W, torch.ones(8)), ValueError, "input_norm"),
    ("wanda-nan-norm", lambda: wanda_score(W, with_nan((32,)).abs()), ValueError, "input_norm"),
    ("per_row-nan", lambda: per_row_mask(with_nan((4, 4)), 0.5), ValueError, "scores"),
    ("nm-bool-n", lambda: nm_mask(W, n=True), TypeError, r"^n must be an int, got bool True"),
    ("nm-m-zero", lambda: nm_mask(W, 2, 0), ValueError, r"^m must be positive, got 0"),
    ("is_nm_sparse-m-zero", lambda: is_nm_sparse(W, 2, 0), ValueError, r"^m must be positive, got 0"),
    ("is_nm_sparse-bool-n", lambda: is_nm_sparse(W, True, 4), TypeError, r"^n must be an int, got bool True"),
    # before: False, as if the row held too many nonzeros, for a width no group of 4 tiles
    ("is_nm_sparse-width-not-multiple", lambda: is_nm_sparse(torch.randn(4, 6)), ValueError,
     "weight has 6 columns, not a multiple of 4"),
    ("lowest_k-too-many", lambda: lowest_k_mask(torch.ones(2, 4), 5), ValueError, r"\bk\b"),
    ("lowest_k-negative", lambda: lowest_k_mask(torch.ones(2, 4), -1), ValueError, r"\bk\b"),
    ("lowest_k-bool", lambda: lowest_k_mask(torch.ones(2, 4), True), ValueError, r"\bk\b"),
    ("lowest_k-int-scores", lambda: lowest_k_mask(torch.ones(2, 4, dtype=torch.int64), 1), TypeError, "scores"),
    ("lowest_k-nan-scores", lambda: lowest_k_mask(with_nan((2, 4)), 1), ValueError, "scores"),
    ("num_pruned-bool", lambda: num_pruned(True, 0.5), TypeError, r"\bn\b"),
    ("sparsity_of-empty", lambda: sparsity_of(torch.zeros(0)), ValueError, "weight"),
    ("sparsity_of-list", lambda: sparsity_of([0.0, 1.0]), TypeError, "weight"),
    # ----- unstructured.py
    ("prune_model-quantized", lambda: prune_model(QMODEL, "magnitude"), TypeError, "QuantizedGPT"),
    ("prune_model-wanda-quantized", lambda: prune_model(QMODEL, "wanda", 0.5, CALIB), TypeError, "QuantizedGPT"),
    ("prune_model-wanda-empty", lambda: prune_model(MODEL, "wanda", 0.5, torch.zeros(0, 8, dtype=torch.int64)),
     ValueError, "calibration"),
    ("prune_model-wanda-empty-T", lambda: prune_model(MODEL, "wanda", 0.5, torch.zeros(3, 0, dtype=torch.int64)),
     ValueError, "calibration"),
    ("prune_model-wanda-id-range", lambda: prune_model(MODEL, "wanda", 0.5, CALIB + 1000), ValueError,
     "calibration"),
    ("prune_model-wanda-none", lambda: prune_model(MODEL, "wanda", 0.5, None), TypeError, "calibration"),
    ("prune_model-bool-sparsity", lambda: prune_model(MODEL, "magnitude", True), ValueError, "sparsity"),
    ("prune_model-method", lambda: prune_model(MODEL, "random"), ValueError, "method"),
    ("prune_model-not-model", lambda: prune_model(W, "magnitude"), TypeError, "Tensor"),
    ("weight_sparsity-quantized", lambda: weight_sparsity(QMODEL), TypeError, "QuantizedGPT"),
    ("layer_mask-method", lambda: layer_mask(W, "wand", 0.5, "unstructured", None), ValueError, "method"),
    ("layer_mask-pattern", lambda: layer_mask(W, "magnitude", 0.5, "1:4", None), ValueError, "pattern"),
    ("layer_mask-no-norm", lambda: layer_mask(W, "wanda", 0.5, "unstructured", None), ValueError, "norm"),
    ("input_norms-int-x", lambda: input_norms(MODEL.transformer.h[0], torch.ones(1, 2, 32, dtype=torch.int64)),
     ValueError, r"\bx\b"),
    ("input_norms-empty", lambda: input_norms(MODEL.transformer.h[0], torch.ones(0, 2, 32)), ValueError, r"\bx\b"),
    ("input_norms-width", lambda: input_norms(MODEL.transformer.h[0], torch.ones(1, 4, 16)), ValueError, r"\bx\b"),
    ("load_pruned-none", lambda: load_pruned(None), TypeError, "path"),
    # ----- structured.py
    ("mlp_scores-quantized", lambda: mlp_neuron_scores(QMODEL, CALIB), TypeError, "QuantizedGPT"),
    ("mlp_scores-empty", lambda: mlp_neuron_scores(MODEL, torch.zeros(0, 8, dtype=torch.int64)), ValueError,
     "calibration"),
    ("head_scores-empty", lambda: head_scores(MODEL, torch.zeros(2, 0, dtype=torch.int64)), ValueError,
     "calibration"),
    ("head_scores-quantized", lambda: head_scores(QMODEL, CALIB), TypeError, "QuantizedGPT"),
    ("prune_mlp-quantized", lambda: prune_mlp(QMODEL, 0.5, [torch.ones(128)] * 2), TypeError, "QuantizedGPT"),
    ("prune_mlp-scores-ints", lambda: prune_mlp(MODEL, 0.5, [1, 2]), ValueError, "scores"),
    ("prune_mlp-scores-nan", lambda: prune_mlp(MODEL, 0.5, [with_nan((128,))] * 2), ValueError, "scores"),
    ("prune_mlp-bool-fraction", lambda: prune_mlp(MODEL, True, [torch.ones(128)] * 2), ValueError, "fraction"),
    ("shrink_mlp-quantized", lambda: shrink_mlp(QMODEL, [torch.arange(4)] * 2), TypeError, "QuantizedGPT"),
    ("mask_heads-list", lambda: mask_heads(MODEL, [0]), TypeError, "heads"),
    ("mask_heads-bool-block", lambda: mask_heads(MODEL, {True: [0]}), ValueError, "block"),
    ("mask_heads-bool-head", lambda: mask_heads(MODEL, {0: [True]}), ValueError, "head"),
    ("mask_heads-int-heads", lambda: mask_heads(MODEL, {0: 1}), TypeError, r"heads\[0\]"),
    ("mask_heads-quantized", lambda: mask_heads(QMODEL, {0: [0]}), TypeError, "QuantizedGPT"),
    ("lowest_heads-too-many", lambda: lowest_heads(torch.ones(2, 2), 3), ValueError, "per_block"),
    ("lowest_heads-bool", lambda: lowest_heads(torch.ones(2, 2), True), ValueError, "per_block"),
    ("lowest_heads-1d", lambda: lowest_heads(torch.ones(2), 1), TypeError, "scores"),
    ("prune_heads-bool-blocks", lambda: prune_heads(MODEL, {False: [0], True: [0]}), ValueError, "block"),
    ("prune_heads-quantized", lambda: prune_heads(QMODEL, {0: [0], 1: [0]}), TypeError, "QuantizedGPT"),
    ("recover-teacher", lambda: recover(MODEL, "teacher", 1), TypeError, "teacher|str"),
    ("recover-zero-steps", lambda: recover(MODEL, MODEL, 0), ValueError, "steps must be positive"),
    ("recover-inf-lr", lambda: recover(MODEL, MODEL, 1, lr=INF), ValueError, r"\blr\b"),
    ("recover-bool-steps", lambda: recover(MODEL, MODEL, True), TypeError, "steps"),
    ("recover-small-vocab", lambda: recover(MODEL, MODEL, 1), ValueError, "vocab_size=128"),
    # ----- semi_structured.py
    ("support-unknown-device", lambda: semi_structured_support("tpu"), ValueError, "device='tpu'"),
    ("support-bool-device", lambda: semi_structured_support(True), TypeError, "device"),
    ("support-negative-index", lambda: semi_structured_support(-1), ValueError, "device must be non-negative"),
    ("stored_bytes-list", lambda: stored_bytes([1.0], "dense"), TypeError, "weight"),
    ("stored_bytes-bool-bytes", lambda: stored_bytes(W, "dense", element_bytes=True), TypeError, "element_bytes"),
    ("stored_bytes-zero-bytes", lambda: stored_bytes(W, "csr", element_bytes=0), ValueError, "element_bytes"),
    ("SemiStructuredLinear-str", lambda: SemiStructuredLinear("linear"), TypeError, "nn.Linear"),
    ("layer_speed-bool", lambda: layer_speed(in_features=True), TypeError, "in_features"),
    ("layer_speed-not-4", lambda: layer_speed(in_features=6), ValueError, "in_features"),
    ("layer_speed-dtype", lambda: layer_speed(dtype=torch.float32), TypeError, "dtype"),
    # ----- the third hostile run: meta tensors (a shape without values) reached Tensor.item() inside torch
    ("pack_int4-meta", lambda: pack_int4(torch.zeros(2, 4, dtype=torch.int8, device="meta")), ValueError,
     r"\bq is a meta tensor"),
    ("quantize_model-meta-model", lambda: quantize_model(tiny().to("meta"), QuantConfig("int8")), ValueError,
     "model tensor 'transformer.wte.weight' is a meta tensor"),
    ("from_linear-meta-linear", lambda: QuantLinear.from_linear(nn.Linear(32, 8, device="meta"), QuantConfig("int8")),
     ValueError, r"linear\.weight is a meta tensor"),
    ("gptq_model-meta-calib", lambda: gptq_quantize_model(MODEL, QuantConfig("int8"), CALIB.to("meta")), ValueError,
     "GPTQ calibration is a meta tensor"),
    ("qembed-meta-idx", lambda: quantize_model(MODEL, QuantConfig("int8", quantize_head=True)).transformer.wte(
        torch.tensor([1], device="meta")), ValueError, "idx is a meta tensor"),
    ("magnitude-meta-weight", lambda: magnitude_mask(W.to("meta"), 0.5), ValueError, "weight is a meta tensor"),
    ("wanda-meta-norm", lambda: wanda_score(W, torch.ones(32, device="meta")), ValueError,
     "input_norm is a meta tensor"),
    ("sparsity_of-meta", lambda: sparsity_of(torch.zeros(3, device="meta")), ValueError, "weight is a meta tensor"),
    ("lowest_k-meta-scores", lambda: lowest_k_mask(torch.ones(2, 4, device="meta"), 1), ValueError,
     "scores is a meta tensor"),
    ("prune_model-meta-model", lambda: prune_model(tiny().to("meta"), "magnitude", 0.5), ValueError,
     "prune_model: model tensor .* is a meta tensor"),
    ("prune_model-wanda-meta-calib", lambda: prune_model(MODEL, "wanda", 0.5, CALIB.to("meta")), ValueError,
     "Wanda calibration is a meta tensor"),
    ("input_norms-meta-x", lambda: input_norms(MODEL.transformer.h[0], torch.ones(1, 2, 32, device="meta")),
     ValueError, r"\bx is a meta tensor"),
    ("prune_mlp-meta-scores", lambda: prune_mlp(MODEL, 0.25, [torch.ones(128, device="meta")] * 2), ValueError,
     r"scores\[0\] is a meta tensor"),
    ("shrink_mlp-meta-keep", lambda: shrink_mlp(MODEL, [torch.arange(4, device="meta")] * 2), ValueError,
     r"keep\[0\] is a meta tensor"),
    ("lowest_heads-meta", lambda: lowest_heads(torch.ones(2, 2, device="meta"), 1), ValueError,
     "scores is a meta tensor"),
    ("mlp_scores-meta-model", lambda: mlp_neuron_scores(tiny().to("meta"), CALIB), ValueError,
     "mlp_neuron_scores: model tensor .* is a meta tensor"),
    # the quantized embedding called directly (the unchecked path a loop takes): before, id -1 read the last row
    ("qembed-negative-id", lambda: quantize_model(MODEL, QuantConfig("int8", quantize_head=True)).transformer.wte(
        torch.tensor([-1])), ValueError, r"idx holds token id -1, outside the vocabulary \[0, 128\)"),
    ("qembed-int4-negative-id", lambda: quantize_model(MODEL, QuantConfig("int4", group_size=16, quantize_head=True))
     .transformer.wte(torch.tensor([[3, -2]])), ValueError, "idx holds token id -2"),
    ("qembed-id-past-vocab", lambda: quantize_model(MODEL, QuantConfig("int8", quantize_head=True)).transformer.wte(
        torch.tensor([0, 128])), ValueError, "idx holds token id 128"),
    # a path that is no path: before, pathlib's "expected str, bytes or os.PathLike object, not int"
    ("save_quantized-int-path", lambda: save_quantized(QMODEL, 123), TypeError, r"save_quantized: path .*int 123"),
    ("save_pruned-int-path", lambda: save_pruned(MODEL, 123, "m"), TypeError, r"save_pruned: path .*int 123"),
    ("describe_quantized-int-path", lambda: describe_quantized(123), TypeError, r"\bpath .*int 123"),
    ("describe_pruned-bytes-path", lambda: describe_pruned(b"m.safetensors"), TypeError, r"\bpath .*bytes"),
    # before: IndexError from W.shape[1], read before W was checked
    ("gptq-W-1d", lambda: gptq_quantize(torch.randn(32), H), ValueError, r"\bW must be a 2-D .*shape \(32,\)"),
    ("gptq_reference-W-1d", lambda: gptq_reference(torch.randn(32), H), ValueError, r"\bW .*shape \(32,\)"),
    # before: "got float32", a numpy array named by its own dtype as if it were a float32 tensor
    ("quantize-numpy-x", lambda: quantize(np.ones((4, 4), dtype=np.float32)), TypeError,
     r"\bx must be a floating-point tensor, got numpy\.ndarray"),
    ("magnitude-numpy-weight", lambda: magnitude_mask(np.ones((4, 4), dtype=np.float32), 0.5), TypeError,
     "weight must be a floating-point tensor, got numpy.ndarray"),
    ("int8-forward-numpy-x", lambda: qlinear("int8")(np.ones((2, 32), dtype=np.float32)), TypeError, "numpy.ndarray"),
    ("gptq-numpy-W", lambda: gptq_quantize(np.ones((8, 32), dtype=np.float32), H), TypeError,
     r"\bW .*numpy\.ndarray"),
    ("quantize_activations-numpy", lambda: quantize_activations(np.ones((3, 8), dtype=np.float32)), TypeError,
     "numpy.ndarray"),
    # before: blamed "input_absmax (tokens)", an argument smooth_model does not have
    ("smooth_model-float-calib", lambda: smooth_model(MODEL, CALIB.float()), TypeError,
     r"smooth_model \(calibration\)"),
    ("smooth_model-calib-range", lambda: smooth_model(MODEL, CALIB + 1000), ValueError,
     r"smooth_model \(calibration\)"),
    # before: a sparsity given with pattern="2:4" was ignored (0.9 gave 50%) and never type-checked ('abc')
    ("prune_model-24-sparsity-09", lambda: prune_model(MODEL, "magnitude", 0.9, pattern="2:4"), ValueError,
     "sparsity=0.9 cannot apply to pattern='2:4'"),
    ("prune_model-24-sparsity-str", lambda: prune_model(MODEL, "magnitude", "abc", pattern="2:4"), ValueError,
     r"sparsity must be a fraction in \[0, 1\), got 'abc'"),
    # before: magnitude pruning dropped any calibration unread, junk included
    ("prune_model-magnitude-calib-junk", lambda: prune_model(MODEL, "magnitude", 0.5, calibration="junk"), TypeError,
     "prune_model needs calibration"),
    ("prune_model-magnitude-calib-range", lambda: prune_model(MODEL, "magnitude", 0.5, CALIB + 1000), ValueError,
     "calibration token id"),
    # before: the teacher's forward failed on the student's ids ("token id 4050 is outside the vocabulary [0, 256)")
    ("recover-teacher-vocab", lambda: recover(MODEL, GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=2,
                                                                   n_head=2, n_embd=32)), 1), ValueError,
     "teacher has vocab_size=256 but pruned has vocab_size=128"),
    ("recover-teacher-window", lambda: recover(MODEL, GPT(GPTConfig(vocab_size=128, block_size=16, n_layer=2,
                                                                    n_head=2, n_embd=32)), 1), ValueError,
     "teacher has block_size=16, shorter than pruned's block_size=32"),
    # ----- the third hostile run, 09: before, each returned a result or failed inside torch/Python
    # before: 3 scale rows for 4 code rows de-quantized groups straddling two rows of q
    ("QuantizedTensor-scale-rows-straddle", lambda: QuantizedTensor(torch.arange(24, dtype=torch.int8).view(4, 6),
                                                                    torch.ones(3, 1), None, 8, (4, 6)), ValueError,
     r"scale has 3 rows for q's 4"),
    ("QuantizedTensor-scale-rows-groups", lambda: QuantizedTensor(torch.zeros(4, 6, dtype=torch.int8), torch.ones(2, 3),
                                                                  None, 8, (4, 6)), ValueError,
     r"scale has 2 rows for q's 4.*\(2, 3\)"),
    # before: 16384 bytes, one meta tensor counted (data_ptr() is 0 for all of them)
    ("weight_bytes-meta-model", lambda: weight_bytes(tiny().to("meta")), ValueError,
     "weight_bytes: model tensor 'transformer.wte.weight' is a meta tensor"),
    # before: K = 2**17 was allowed and all -128 codes summed to -2**31
    ("int8_matmul-K-2-17", lambda: int8_matmul(torch.full((1, 2**17), -128, dtype=torch.int8),
                                               torch.full((2**17, 1), -128, dtype=torch.int8)), ValueError,
     "K = 131072 int8 products, more than 131071"),
    ("int8_matmul_ref-K-2-17", lambda: int8_matmul_ref(torch.ones(1, 2**17, dtype=torch.int8),
                                                       torch.ones(2**17, 1, dtype=torch.int8)), ValueError, "overflow"),
    # before: a (1,) bias was broadcast over all 8 outputs; a (9,) bias was torch's broadcast error
    ("w8a8_linear-bias-length-1", lambda: w8a8_linear(torch.ones(2, 32), qlinear("w8a8").qweight,
                                                      qlinear("w8a8").scale, torch.ones(1)), ValueError,
     r"bias must have shape \(8,\), one per output, got \(1,\)"),
    ("w8a8_linear-bias-too-long", lambda: w8a8_linear(torch.ones(2, 32), qlinear("w8a8").qweight,
                                                      qlinear("w8a8").scale, torch.zeros(9)), ValueError,
     r"bias must have shape \(8,\).*\(9,\)"),
    ("w8a8_linear-bias-int", lambda: w8a8_linear(torch.ones(2, 32), qlinear("w8a8").qweight, qlinear("w8a8").scale,
                                                 torch.zeros(8, dtype=torch.int64)), TypeError, "bias"),
    # before: AttributeError on layer.in_features
    ("w8a8_reference-layer-none", lambda: w8a8_reference(torch.ones(2, 32), None), TypeError,
     "layer must be a W8A8 QuantLinear .* got NoneType"),
    ("llm_int8-layer-object", lambda: llm_int8_linear(torch.ones(2, 32), object(), 6.0), TypeError,
     "layer must be a W8A8 QuantLinear .* got object"),
    ("llm_int8_reference-layer-linear", lambda: llm_int8_reference(torch.ones(2, 32), linear(), 6.0), TypeError,
     "layer must be a W8A8 QuantLinear .* got Linear, which has no 'qweight'"),
    # before: torch's shape error inside attend, for the int8 cache and chapter 04's alike
    ("generate_ids-int8-cache-of-head-pruned-config", lambda: generate_ids(
        MODEL, [3, 1, 4, 1, 5], SamplingParams.greedy(6),
        kv_cache=Int8ContiguousKVCache(prune_heads(MODEL, {0: [1], 1: [0]}).config, 1, 16)), ValueError,
     r"kv_cache was built for n_layer, n_head, head_size = \(2, 1, 16\), but the model has \(2, 2, 16\)"),
    ("generate_ids-cache-of-other-depth", lambda: generate_ids(
        MODEL, [3, 1, 4], SamplingParams.greedy(2),
        kv_cache=ContiguousKVCache(GPTConfig(vocab_size=128, block_size=32, n_layer=3, n_head=2, n_embd=32), 1, 8)),
     ValueError, r"kv_cache was built for .* \(3, 2, 16\)"),
    # before: named x, `quantize`'s own argument
    ("rtn_and_gptq-meta-layer", lambda: rtn_and_gptq_errors(nn.Linear(32, 8, device="meta"), torch.ones(4, 32)),
     ValueError, "layer tensor 'weight' is a meta tensor"),
    # before: the fp32 control (fake_quant=False) trained with config='junk'
    ("finetune_qat-fp32-control-config-str", lambda: finetune_qat(MODEL, "junk", steps=1, batch_size=1,
                                                                  fake_quant=False), TypeError,
     "config must be a QuantConfig, got str"),
    # before: any method but 'gptq'/'qat' measured RTN under its label
    ("qbench-Case-method-typo", lambda: qbench.Case("x", QuantConfig("int8"), "gptx"), ValueError,
     r"Case\.method must be one of .* got 'gptx'"),
    ("qbench-Case-rtn-without-config", lambda: qbench.Case("x", None), ValueError, "config is None exactly for"),
    ("qbench-build-not-a-case", lambda: qbench.build(MODEL, ("x", QuantConfig("int8"), "rtn"), CALIB), TypeError,
     "case must be a quant.bench Case"),
    # before: 'int' object is not iterable, ZeroDivisionError, range()'s message, torch's IndexError
    ("qbench-layer_costs-tokens-int", lambda: qbench.layer_costs(128, 16, tokens=5, repeats=1, calls=1), TypeError,
     "tokens must be a tuple of token counts, got int 5"),
    ("qbench-layer_costs-calls-zero", lambda: qbench.layer_costs(128, 16, tokens=(1,), repeats=1, calls=0),
     ValueError, "calls must be positive, got 0"),
    ("qbench-kv_perplexity-one-token", lambda: qbench.kv_perplexity(MODEL, torch.tensor([5]), lambda B, T:
                                                                    ContiguousKVCache(CFG, B, T)), ValueError,
     "tokens must hold at least 2 ids"),
    ("qbench-kv_perplexity-batch-zero", lambda: qbench.kv_perplexity(MODEL, torch.arange(40), lambda B, T:
                                                                     ContiguousKVCache(CFG, B, T), batch_size=0),
     ValueError, "batch_size must be positive, got 0"),
    ("qbench-kv_perplexity-id-past-vocab", lambda: qbench.kv_perplexity(MODEL, torch.arange(100, 140), lambda B, T:
                                                                        ContiguousKVCache(CFG, B, T)), ValueError,
     r"tokens holds token id 139, outside the vocabulary \[0, 128\)"),
    # ----- the fourth hostile run, 09
    # before: a field replaced after construction reached reshape (torch's error) or gave a tensor of another shape
    ("q09-dequantize-q-replaced-float", lambda: dequantize(mutated_qt(q=QT8.q.float())), TypeError,
     "^q must be an int8 or uint8 tensor of codes, got torch.float32"),
    ("q09-dequantize-scale-replaced-int", lambda: dequantize(mutated_qt(scale=torch.ones(8, 1, dtype=torch.long))),
     TypeError, "^scale must be a 2-D float tensor"),
    ("q09-dequantize-scale-replaced-rows", lambda: dequantize(mutated_qt(scale=torch.ones(3, 1))), ValueError,
     "^scale has 3 rows for q's 8"),
    ("q09-dequantize-shape-replaced", lambda: dequantize(mutated_qt(shape=(4, 64))), ValueError,
     r"^shape must be the codes' shape \(8, 32\)"),
    ("q09-load_quantized-q-replaced-float", lambda: QuantLinear(32, 8, True, QuantConfig("int8")).load_quantized(
        mutated_qt(q=QT8.q.float())), TypeError, "^q must be an int8 or uint8"),
    # before: the latent weights of a QAT model rounded, silently, onto a grid they never trained on
    ("q09-quantize_model-qat-other-grid", lambda: quantize_model(prepare_qat(MODEL, QuantConfig("int4", group_size=16)),
                                                                 QuantConfig("int8")), ValueError,
     r"^quantize_model: the model was prepared for QAT on QuantConfig\(mode='int4'.*convert_qat"),
    ("q09-gptq_model-qat-other-grid", lambda: gptq_quantize_model(prepare_qat(MODEL, QuantConfig("int8")),
                                                                  QuantConfig("int4", group_size=16), CALIB),
     ValueError, "^gptq_quantize_model: the model was prepared for QAT"),
    # before: accepted, then "x must be torch.float32" from inside a QuantLinear
    ("q09-quantize_model-bf16", lambda: quantize_model(tiny().to(torch.bfloat16), QuantConfig("int8")), TypeError,
     "^quantize_model needs an fp32 minillm GPT, got one with torch.bfloat16 parameters"),
    ("q09-gptq_model-bf16", lambda: gptq_quantize_model(tiny().to(torch.bfloat16), QuantConfig("int8"), CALIB),
     TypeError, "^gptq_quantize_model needs an fp32 minillm GPT, got one with torch.bfloat16"),
    ("q09-prepare_qat-bf16", lambda: prepare_qat(tiny().to(torch.bfloat16), QuantConfig("int8")), TypeError,
     "^prepare_qat needs an fp32 minillm GPT, got one with torch.bfloat16"),
    ("q09-convert_qat-cast-to-fp16", lambda: convert_qat(prepare_qat(MODEL, QuantConfig("int8")).half()), TypeError,
     "^convert_qat needs an fp32 minillm GPT, got one with torch.float16"),
    ("q09-smooth_model-bf16", lambda: smooth_model(tiny().to(torch.bfloat16), CALIB), TypeError,
     "^smooth_model needs an fp32 minillm GPT"),
    ("q09-finetune_qat-prepared-model", lambda: finetune_qat(prepare_qat(MODEL, QuantConfig("int8")),
                                                             QuantConfig("int8"), steps=1, batch_size=1), ValueError,
     "the model is already prepared for QAT"),
    # before: OSError "File name too long" / "embedded null byte" from inside tempfile and pathlib
    ("q09-save_quantized-path-too-long", lambda: save_quantized(QMODEL, "/tmp/" + "a" * 5000 + ".safetensors"),
     ValueError, "^save_quantized: path is 5017 characters long, past the 4096"),
    ("q09-save_quantized-name-too-long", lambda: save_quantized(QMODEL, "x" * 300 + ".safetensors"), ValueError,
     "^save_quantized: path holds a name of 312 bytes, past the 255"),
    ("q09-save_quantized-path-nul", lambda: save_quantized(QMODEL, "/tmp/a\0b.safetensors"), ValueError,
     "^save_quantized: path holds a NUL character"),
    # before: torch's "Invalid device string", or a quiet False
    ("q09-int8-cache-device-junk", lambda: Int8ContiguousKVCache(CFG, 1, 8, device="gpu0"), ValueError,
     "^device must be a device like .*'gpu0'"),
    ("q09-int8-paged-cache-device-junk", lambda: Int8PagedKVCache(CFG, 4, 4, device="gpu0"), ValueError,
     "^device must be a device like .*'gpu0'"),
    ("q09-int_mm_available-junk", lambda: int_mm_available("gpu0"), ValueError, "^device_type must be a device"),
    ("q09-load_quantized-device-junk", lambda: load_quantized("missing.safetensors", device="gpu0"), ValueError,
     "unknown device 'gpu0'"),
    # ----- the fifth hostile run, 09
    # before: 8.0 accepted as 8
    ("q09r5-quantize-bits-float", lambda: quantize(W, bits=8.0), TypeError,
     r"^bits must be an int, one of \(4, 8\), got float 8.0"),
    ("q09r5-QuantizedTensor-bits-float", lambda: QuantizedTensor(Q8, torch.ones(2, 1), None, 8.0, (2, 4)), TypeError,
     "^bits must be an int"),
    # before: silently wrong values: zero points off every grid, a negative scale flipping signs
    ("q09r5-dequantize_asymmetric-zero-300", lambda: dequantize_asymmetric(U4, torch.ones(2, 1),
                                                                           torch.full((2, 1), 300)), ValueError,
     r"^zero must hold whole numbers in \[0, 255\]"),
    ("q09r5-dequantize_asymmetric-zero-negative", lambda: dequantize_asymmetric(
        U4, torch.ones(2, 1), torch.full((2, 1), -3, dtype=torch.int8)), ValueError, r"^zero must hold whole numbers"),
    ("q09r5-dequantize_asymmetric-zero-fraction", lambda: dequantize_asymmetric(U4, torch.ones(2, 1),
                                                                                torch.full((2, 1), 2.5)),
     ValueError, r"^zero must hold whole numbers"),
    ("q09r5-dequantize_asymmetric-scale-zero", lambda: dequantize_asymmetric(U4, torch.zeros(2, 1), torch.zeros(2, 1)),
     ValueError, "^scale must be > 0"),
    ("q09r5-dequantize_symmetric-scale-negative", lambda: dequantize_symmetric(Q8, -torch.ones(2, 1)), ValueError,
     "^scale must be > 0"),
    # before: int8 codes with a zero point set afterwards de-quantized as asymmetric, every code shifted by it
    ("q09r5-dequantize-zero-on-int8-codes", lambda: dequantize(mutated_qt(zero=torch.full((8, 1), 5,
                                                                                          dtype=torch.uint8))),
     TypeError, r"^zero must be None for int8 \(symmetric\) codes .* got q torch.int8 with zero torch.uint8"),
    # before: an int64 scale multiplied in; an int4 / asymmetric layer's codes used as int8 operands, or "qweight"
    ("q09r5-w8a8_linear-scale-int", lambda: w8a8_linear(torch.ones(2, 32), qlinear("w8a8").qweight,
                                                        torch.ones(8, 1, dtype=torch.long), None), TypeError,
     "^scale must be a floating-point tensor, got torch.int64"),
    ("q09r5-w8a8_reference-int4-layer", lambda: w8a8_reference(torch.ones(2, 32), qlinear("int4", group_size=16)),
     TypeError, "^layer must be a W8A8 QuantLinear, got a QuantLinear of mode 'int4'"),
    ("q09r5-llm_int8-int4-layer", lambda: llm_int8_linear(torch.ones(2, 32), qlinear("int4", group_size=16), 6.0),
     TypeError, "^layer must be a W8A8 QuantLinear, got a QuantLinear of mode 'int4'"),
    ("q09r5-llm_int8-asymmetric-int8-layer", lambda: llm_int8_linear(torch.ones(2, 32),
                                                                     qlinear("int8", symmetric=False), 6.0), TypeError,
     "^layer must be a W8A8 QuantLinear, got a QuantLinear of mode 'int8'"),
    # before: accepted, refused only inside attend
    ("q09r5-int8-paged-cache-dtype-int", lambda: Int8PagedKVCache(CFG, 4, 4, dtype=torch.int8), TypeError,
     "^dtype must be a floating-point torch.dtype"),
    # before: NaN logits (ln weights x 1e39 = inf), where the docstring promises the same outputs
    ("q09r5-inject_outliers-factor-huge", lambda: inject_outliers(MODEL, [1, 5], 1e39), ValueError,
     r"^factor must be in \[0.0001, 10000.0\], got 1e\+39"),
    ("q09r5-inject_outliers-factor-tiny", lambda: inject_outliers(MODEL, [1, 5], 1e-39), ValueError,
     r"^factor must be in \[0.0001, 10000.0\]"),
    # before: a NaN max|x| counted as 0 outlier features
    ("q09r5-outlier_report-nan", lambda: outlier_report({"l": torch.tensor([1.0, NAN])}), ValueError,
     r"^absmax\['l'\] holds negative, NaN or inf values"),
    ("q09r5-outlier_report-meta", lambda: outlier_report({"l": torch.ones(2, device="meta")}), ValueError,
     r"^absmax\['l'\] is a meta tensor"),
    # before: a None cache measured perplexity without any cache; the cache's own "batch_size" message
    ("q09r5-kv_perplexity-make-cache-none", lambda: qbench.kv_perplexity(MODEL, torch.arange(40) % 128,
                                                                         lambda B, T: None), TypeError,
     r"^make_cache\(\d+, \d+\) must return a KV cache .* got NoneType"),
    ("q09r5-kv_perplexity-cache-too-small", lambda: qbench.kv_perplexity(MODEL, torch.arange(100) % 128, lambda B, T:
                                                                         ContiguousKVCache(CFG, 1, T), batch_size=4),
     ValueError, r"^make_cache\(3, 32\) returned a cache of batch_size=1, max_len=32"),
    # before: messages about "codes" naming no argument and no layer; torch's NotImplementedError on meta codes
    ("q09r5-quantize_model-weights-shape", lambda: quantize_model(MODEL, QuantConfig("int8"),
                                                                  {"0.attn.c_attn": quantize(torch.randn(8, 32))}),
     ValueError, r"^weights\['0.attn.c_attn'\] holds codes of shape \(8, 32\)"),
    ("q09r5-quantize_model-weights-bits", lambda: quantize_model(MODEL, QuantConfig("int8"), {"0.attn.c_attn": quantize(
        MODEL.transformer.h[0].attn.c_attn.weight.detach(), 4, True, "channel")}), ValueError,
     r"^weights\['0.attn.c_attn'\] holds 4-bit symmetric codes; the layer wants 8-bit symmetric"),
    ("q09r5-load_quantized-per-tensor", lambda: qlinear("int8").load_quantized(
        quantize(linear().weight.detach(), 8, True, "tensor")), ValueError,
     r"^qt holds codes of shape \(8, 32\) with scales \(1, 1\)"),
    ("q09r5-load_quantized-meta", lambda: qlinear("int8").load_quantized(QuantizedTensor(
        torch.zeros(8, 32, dtype=torch.int8, device="meta"), torch.ones(8, 1, device="meta"), None, 8, (8, 32))),
     ValueError, r"^q is a meta tensor"),  # refused as QuantizedTensor is built
    ("q09r5-output_error-meta-W_hat", lambda: output_error(W, W.to("meta"), torch.randn(5, 32)), ValueError,
     "^W_hat is a meta tensor"),
    # before: AttributeError on a model given by name
    ("q09r5-check_calibration-model-str", lambda: check_calibration("base", CALIB), TypeError,
     r"^calibration: model needs a minillm GPT .* got str"),
    ("q09r5-linear_bytes-none", lambda: qbench.linear_bytes(None), TypeError,
     r"^linear_bytes: model needs a minillm GPT .* got NoneType"),
    # before: the allocator's RuntimeError, naming no argument (bounds: MAX_TENSOR_ELEMENTS, the training split)
    ("q09r5-calibration_windows-huge", lambda: calibration_windows(10**10, 4), ValueError,
     r"^num_windows=10000000000 windows of length=4 ask for 40000000000 tokens, more than the \d+ of the training"),
    ("q09r5-int8-cache-huge", lambda: Int8ContiguousKVCache(CFG, 10**6, 10**6), ValueError,
     r"^batch_size x max_len ask for a tensor of shape \(1000000, 2, 1000000, 16\)"),
    ("q09r5-int8-paged-cache-huge", lambda: Int8PagedKVCache(CFG, 10**6, 10**6), ValueError,
     r"^num_blocks x block_size ask for a tensor of shape \(1000000, 2, 1000000, 16\)"),
    ("q09r5-quant-linear-huge", lambda: QuantLinear(10**6, 10**6, True, QuantConfig("int8")), ValueError,
     r"^out_features x in_features ask for a tensor of shape \(1000000, 1000000\)"),
    # ----- the sixth hostile run, 09
    # before: an untied head was replaced by the tied embedding (quantize_head), or dropped from the file and
    # loaded back as the embedding (save_quantized, model_to_bytes): other logits, without a word
    ("q09r6-quantize_model-untied-head", lambda: quantize_model(untied(), QuantConfig("int8", quantize_head=True)),
     ValueError, r"^quantize_head=True .* model.lm_head has a weight of its own"),
    ("q09r6-save_quantized-untied-head", lambda: save_quantized(quantize_model(untied(), QuantConfig("int8")),
                                                                "q09r6_never.safetensors"), ValueError,
     r"^save_quantized \(model\): model.lm_head has a weight of its own"),
    ("q09r6-model_to_bytes-untied-head", lambda: model_to_bytes(quantize_model(untied(), QuantConfig("int8"))),
     ValueError, r"model.lm_head has a weight of its own"),
    # before: the missing folder was made, then os.replace onto '..' raised OSError EBUSY naming no argument
    ("q09r6-save_quantized-dotdot", lambda: save_quantized(QMODEL, "q09r6_never_dir/.."), ValueError,
     r"^save_quantized: path must name a file, got 'q09r6_never_dir/\.\.'"),
    # before: unpack_int4's message naming `packed`
    ("q09r6-quant-linear-config-replaced", lambda: replaced_config(qlinear("int8"), QuantConfig("int4", group_size=16)),
     ValueError, r"^config QuantConfig\(mode='int4'.* does not fit the layer's buffers \(qweight torch.int8 \(8, 32\)"),
    ("q09r6-quant-linear-config-mutated", lambda: replaced_config(qlinear("int8"), None), ValueError,
     r"^config QuantConfig\(mode='int4', group_size=128.* does not fit the layer's buffers"),
    ("q09r6-quant-embedding-config-replaced", lambda: replaced_config(
        quantize_model(MODEL, QuantConfig("int8", quantize_head=True)).transformer.wte.table,
        QuantConfig("int4", group_size=16), via_embedding=True), ValueError,
     r"^config QuantConfig\(mode='int4'.* does not fit the layer's buffers"),
    # before: AttributeError; 'no' (truthy) read the validation text; the workload's 'Overflow when unpacking'
    ("q09r6-run_all-model-str", lambda: qbench.run_all("base", False, "quick"), TypeError,
     r"^run_all: model needs an fp32 minillm GPT, got str"),
    ("q09r6-run_all-real-text-str", lambda: qbench.run_all(MODEL, "no", "quick"), TypeError,
     r"^real_text must be a bool .* got str 'no'"),
    ("q09r6-run_all-seed-huge", lambda: qbench.run_all(MODEL, False, "quick", 2**64), ValueError,
     r"^seed must be a 64-bit integer"),
    # ----- the third hostile run, 10
    # before: 2:4 ignored the sparsity (0.9 gave 50%) and never checked it ('lots')
    ("layer_mask-24-sparsity-09", lambda: layer_mask(W, "magnitude", 0.9, "2:4", None), ValueError,
     "sparsity=0.9 cannot apply to pattern='2:4'"),
    ("layer_mask-24-sparsity-str", lambda: layer_mask(W, "magnitude", "lots", "2:4", None), ValueError,
     r"sparsity must be a fraction in \[0, 1\), got 'lots'"),
    # before: torch's "mixed dtype", NotImplementedError (ModuleList has no forward), GPT's message naming idx
    ("input_norms-float64-x", lambda: input_norms(MODEL.transformer.h[0], torch.randn(1, 4, 32, dtype=torch.float64)),
     TypeError, "x must have the block's dtype torch.float32, got torch.float64"),
    ("input_norms-modulelist", lambda: input_norms(MODEL.transformer.h, torch.randn(1, 4, 32)), TypeError,
     "block must be one module .* got ModuleList"),
    ("input_norms-whole-gpt", lambda: input_norms(MODEL, torch.randn(1, 4, 32)), TypeError,
     "block must be one module .* got GPT"),
    # before: torch's IndexError at the first next()
    ("block_inputs-id-past-vocab", lambda: block_inputs(MODEL, torch.tensor([[500]])), ValueError,
     r"block_inputs: calibration token id 500 is outside the vocabulary \[0, 128\)"),
    ("stored_bytes-meta-weight", lambda: stored_bytes(torch.zeros(4, 8, device="meta"), "csr"), ValueError,
     "weight is a meta tensor"),
    # before: torch.nn.utils.prune's "amount=1.5 should either be..."; a quantized model's block bytes came back 0
    ("pbench-torch_prune_agreement-sparsity", lambda: pbench.torch_prune_agreement(MODEL, 1.5), ValueError,
     r"sparsity must be a fraction in \[0, 1\), got 1\.5"),
    ("pbench-block_bytes-quantized", lambda: pbench.block_bytes(QMODEL, "csr"), TypeError,
     r"block_bytes needs a dense \(float\) minillm GPT, got a QuantizedGPT"),
    # ----- the fourth hostile run, 10
    # before: [] for a quantized model; a QAT model saved, and loaded back as a plain GPT
    ("block_weights4-quantized", lambda: block_weights(QMODEL), TypeError,
     r"block_weights needs a dense \(float\) minillm GPT, got a QuantizedGPT"),
    ("save_pruned4-qat", lambda: save_pruned(prepare_qat(MODEL, QuantConfig("int8")), "never.safetensors", "m"),
     TypeError, r"save_pruned needs block linears as plain nn.Linear; block 0 holds "
                r"\['attn.c_attn \(FakeQuantLinear\)"),
    ("prune_model4-qat", lambda: prune_model(prepare_qat(MODEL, QuantConfig("int8")), "magnitude"), TypeError,
     "FakeQuantLinear"),
    # before: ZeroDivisionError (calls=0), bool and 0 tokens accepted, a str read one character a sparsity
    ("pbench4-layer_costs-calls-zero", lambda: pbench.layer_costs(calls=0), ValueError,
     "calls must be positive, got 0"),
    ("pbench4-layer_costs-calls-bool", lambda: pbench.layer_costs(calls=True), TypeError,
     "calls must be an int, got bool"),
    ("pbench4-layer_costs-repeats-negative", lambda: pbench.layer_costs(repeats=-1), ValueError,
     "repeats must be positive, got -1"),
    ("pbench4-layer_costs-repeats-float", lambda: pbench.layer_costs(repeats=1.5), TypeError,
     "repeats must be an int, got float 1.5"),
    ("pbench4-layer_costs-tokens-zero", lambda: pbench.layer_costs(tokens=(0,)), ValueError,
     r"tokens\[0\] must be positive, got 0"),
    ("pbench4-layer_costs-sparsities-str", lambda: pbench.layer_costs(sparsities="0.5"), TypeError,
     "sparsities must be a list or tuple, got str '0.5'"),
    ("pbench4-layer_costs-sparsity-item", lambda: pbench.layer_costs(sparsities=(0.5, 1.0)), ValueError,
     r"sparsities\[1\] must be a fraction in \[0, 1\), got 1.0"),
    ("pbench4-unstructured_rows-str", lambda: pbench.unstructured_rows(harness(), CALIB, "0.5"), TypeError,
     "sparsities must be a list or tuple, got str"),
    ("pbench4-structured_rows-str", lambda: pbench.structured_rows(harness(), CALIB, "0.5", 1), TypeError,
     "fractions must be a list or tuple, got str"),
    # before: lowest_heads' "per_block must be an int in [0, 2]"
    ("pbench4-head_rows-two-heads", lambda: pbench.head_rows(harness(), CALIB, 1), ValueError,
     "head_rows masks up to 4 heads per block: the model needs at least 4 heads per block, it has n_head=2"),
    # before: teacher_forced_kl's "candidate", AttributeError 'str' object has no attribute 'config'
    ("pbench4-agreement-str", lambda: harness().agreement("pruned"), TypeError,
     r"Harness.agreement \(pruned\) needs a minillm GPT"),
    ("pbench4-quality-str", lambda: harness().quality("pruned"), TypeError, r"Harness.quality \(pruned\) needs"),
    ("pbench4-agreement-vocab", lambda: harness().agreement(MODEL), ValueError,
     "Harness.agreement: pruned has vocab_size=128, the dense model vocab_size=4096"),
    ("pbench4-speed-window", lambda: harness().speed(GPT(GPTConfig(vocab_size=4096, block_size=16, n_layer=1,
                                                                    n_head=2, n_embd=32))), ValueError,
     "Harness.speed: pruned has block_size=16, the dense model block_size=64"),
    ("pbench4-harness-window", lambda: pbench.Harness(GPT(GPTConfig(vocab_size=4096, block_size=16, n_layer=1,
                                                                    n_head=2, n_embd=32)), False, HARNESS_SIZES, 0),
     ValueError, "Harness: each prompt has 32 tokens: .* more than the dense model's context window block_size=16"),
    # ----- the fifth hostile run, 10
    # before: 'no' is truthy, so the real validation text was used; AttributeErrors from the middle of a sweep
    ("p10r5-harness-real-text-str", lambda: pbench.Harness(MODEL, "no", HARNESS_SIZES, 0), TypeError,
     "real_text must be a bool, got str 'no'"),
    ("p10r5-harness-real-text-int", lambda: pbench.Harness(MODEL, 1, HARNESS_SIZES, 0), TypeError,
     "real_text must be a bool, got int 1"),
    ("p10r5-unstructured-rows-h-none", lambda: pbench.unstructured_rows(None, CALIB, (0.5,)), TypeError,
     "unstructured_rows: h must be a prune.bench Harness, got NoneType None"),
    ("p10r5-two-four-rows-h-model", lambda: pbench.two_four_rows(MODEL, CALIB), TypeError,
     "two_four_rows: h must be a prune.bench Harness, got GPT"),
    ("p10r5-structured-rows-h-str", lambda: pbench.structured_rows("h", CALIB, (0.25,), 1), TypeError,
     "structured_rows: h must be a prune.bench Harness, got str 'h'"),
    ("p10r5-head-rows-h-none", lambda: pbench.head_rows(None, CALIB, 1), TypeError,
     "head_rows: h must be a prune.bench Harness"),
    ("p10r5-fifty-percent-model-str", lambda: pbench.fifty_percent("base", torch.arange(10), CALIB), TypeError,
     "fifty_percent: model needs a minillm GPT, got str"),
    # before: 'dir/' (Path drops the slash) wrote a file named 'dir'
    ("p10r5-save-pruned-trailing-slash", lambda: save_pruned(MODEL, "p10r5_never_dir/", "m"), ValueError,
     "save_pruned: path must name a file, got 'p10r5_never_dir/'"),
    # ----- the sixth hostile run, 10
    # before: the missing folder was made, then os.replace onto '..' failed with EBUSY, naming no argument
    ("p10r6-save-pruned-dotdot", lambda: save_pruned(MODEL, "p10r6_never_dir/..", "m"), ValueError,
     r"save_pruned: path must name a file, got 'p10r6_never_dir/\.\.'"),
    # before: short_finetune's message named its own `net`; the seed overflowed in the sampler
    ("p10r6-recover-vocab-names-pruned", lambda: recover(prune_mlp(MODEL, 0.5, mlp_neuron_scores(MODEL, CALIB)),
                                                         MODEL, 1, batch_size=1), ValueError,
     "^pruned has vocab_size=128, but the training split holds token ids up to 4095"),
    ("p10r6-recover-seed-huge", lambda: recover(MODEL, MODEL, 1, seed=2 ** 70), ValueError,
     r"^seed must be a 64-bit integer in \[-2\*\*63, 2\*\*64\)"),
    ("p10r6-recover-lr-bool-before-vocab", lambda: recover(MODEL, MODEL, 1, lr=True), TypeError,
     "^lr must be a number, got bool"),
    # before: deepcopy's "Only Tensors created explicitly by the user" from torch
    ("p10r6-prune-model-torch-pruned-layer", lambda: prune_model(_torch_pruned(), "magnitude", 0.5), TypeError,
     "prune_model needs each block linear's weight as a Parameter; block 0's mlp.c_fc weight is re-parametrised"),
    # before: run_all read `draft` after the unstructured, 2:4 and outlier sweeps; the first forward named `idx`
    ("p10r6-run-all-draft-str", lambda: pbench.run_all(harness().model, False, "quick", draft="draft"), TypeError,
     "run_all: draft needs a minillm GPT, got str"),
    ("p10r6-run-all-draft-vocab", lambda: pbench.run_all(harness().model, False, "quick", draft=MODEL), ValueError,
     "run_all: draft has vocab_size=128, block_size=32; .*vocab_size=4096 and block_size >= 64"),
    ("p10r6-run-all-seed-huge", lambda: pbench.run_all(harness().model, False, "quick", seed=2 ** 64), ValueError,
     r"^seed must be a 64-bit integer"),
    ("p10r6-harness-model-vocab", lambda: pbench.Harness(GPT(GPTConfig(vocab_size=128, block_size=64, n_layer=1,
                                                                       n_head=2, n_embd=32)), False, HARNESS_SIZES, 0),
     ValueError,
     "Harness: model has vocab_size=128, but the validation text holds token ids up to 40"),
    ("p10r6-layer-costs-seed-huge", lambda: pbench.layer_costs(seed=2 ** 64), ValueError,
     r"^seed must be a 64-bit integer"),
    # ----- the seventh hostile run, 09: a QuantLinear or QuantizedTensor changed after construction
    # before: a negated scale negated every output, a NaN one made it NaN, without a word
    ("q09r7-qlin-scale-negated", lambda: mutated_layer(lambda l: l.scale.mul_(-1)), ValueError,
     r"^scale must hold finite values > 0 \(a negative scale flips"),
    ("q09r7-qlin-scale-nan", lambda: mutated_layer(lambda l: l.scale.fill_(NAN)), ValueError,
     "^scale must hold finite values > 0"),
    ("q09r7-qlin-int4-scale-negated", lambda: mutated_layer(lambda l: l.scale.mul_(-1), "int4", group_size=16),
     ValueError, "^scale must hold finite values > 0"),
    ("q09r7-qlin-zero-off-grid", lambda: mutated_layer(lambda l: l.zero.fill_(200), "int4", group_size=16,
                                                       symmetric=False), ValueError,
     r"^zero holds zero points above 15, off the 4-bit grid"),
    ("q09r7-qlin-bias-nan", lambda: mutated_layer(lambda l: l.bias.fill_(NAN)), ValueError,
     "^bias holds NaN or inf values"),
    ("q09r7-qlin-state-dict-negative-scale", lambda: mutated_state_dict(qlinear(), scale=-qlinear().scale)(
        torch.randn(5, 32)), ValueError, "^scale must hold finite values > 0"),
    ("q09r7-qlin-quantized-weight-scale-negated", lambda: (lambda l: (l.scale.mul_(-1), l.quantized_weight()))(
        qlinear("int4", group_size=16)), ValueError, "^scale must hold finite values > 0"),
    ("q09r7-embedding-scale-negated", lambda: mutated_layer(lambda l: l.scale.mul_(-1), embedding=True),
     ValueError, "^scale must hold finite values > 0"),
    # before: torch's broadcasting RuntimeError, naming no buffer
    ("q09r7-qlin-qweight-shape", lambda: mutated_layer(lambda l: setattr(l, "qweight", l.qweight[:4])), ValueError,
     r"^qweight must have shape \(8, 32\) for this layer, got \(4, 32\)"),
    ("q09r7-qlin-qweight-dtype", lambda: mutated_layer(lambda l: setattr(l, "qweight", l.qweight.float())),
     TypeError, r"^qweight must be a torch.int8 tensor of shape \(8, 32\) for this layer, got torch.float32"),
    ("q09r7-qlin-bias-shape", lambda: mutated_layer(lambda l: setattr(l, "bias", nn.Parameter(torch.zeros(3)))),
     ValueError, r"^bias must have shape \(8,\) for this layer, got \(3,\)"),
    ("q09r7-qlin-bias-dtype", lambda: mutated_layer(lambda l: setattr(l, "bias", l.bias.double())), TypeError,
     "^bias must be a torch.float32 tensor"),
    ("q09r7-qlin-scale-shape", lambda: mutated_layer(lambda l: setattr(l, "scale", l.scale[:, :0])), ValueError,
     r"^scale must have shape \(8, 1\) for this layer, got \(8, 0\)"),
    ("q09r7-qlin-zero-dropped", lambda: mutated_layer(lambda l: setattr(l, "zero", None), symmetric=False),
     TypeError, "^zero must be None for symmetric codes and a uint8 tensor for asymmetric ones"),
    # before: qt.bits = 4 over 8-bit codes (up to 127) de-quantized without a word
    ("q09r7-dequantize-bits-changed", lambda: dequantize(mutated_qt(bits=4)), ValueError,
     r"^q holds codes outside \[-8, 7\], which bits=4 symmetric codes cannot take"),
    ("q09r7-dequantize-scale-negated", lambda: dequantize((lambda qt: (qt.scale.mul_(-1), qt)[1])(mutated_qt())),
     ValueError, "^scale must hold finite values > 0"),
    ("q09r7-load-quantized-scale-negated", lambda: qlinear().load_quantized(
        (lambda qt: (qt.scale.mul_(-1), qt)[1])(mutated_qt())), ValueError, "^scale must hold finite values > 0"),
    ("q09r7-dequantize-not-qt", lambda: dequantize(W), TypeError, "^qt must be a QuantizedTensor .*got Tensor"),
    ("q09r7-quantize-0d", lambda: quantize(torch.tensor(1.0)), ValueError,
     "^x is a 0-d tensor: quantize needs at least one dimension"),
    # ----- the seventh hostile run, 10: mask_heads' messages named no argument
    ("p10r7-mask-heads-block-oob", lambda: mask_heads(MODEL, {5: [1]}), ValueError,
     r"^heads has a key 5: a block index must be an int in \[0, 2\)"),
    ("p10r7-mask-heads-head-negative", lambda: mask_heads(MODEL, {0: [-1]}), ValueError,
     r"^heads\[0\] holds -1: a head index must be an int in \[0, 2\)"),
    ("p10r7-prune-heads-head-oob", lambda: prune_heads(MODEL, {0: [5], 1: [0]}), ValueError,
     r"^heads\[0\] holds 5: a head index"),
    ("p10r7-mask-heads-np-float", lambda: mask_heads(MODEL, {0: [np.float64(1.0)]}), ValueError,
     r"^heads\[0\] holds np.float64\(1.0\): a head index must be an int"),
    # ----- the eighth hostile run, 09: messages naming the argument, zero points of no number dtype
    # before: "x is a 0-d tensor" (quantize's own name); "torch.int8 codes must lie in ..." naming no argument
    ("q09r8-fake-quantize-0d", lambda: fake_quantize(torch.tensor(1.0), QuantConfig("int8")), ValueError,
     r"^w must be a weight matrix \(out, in\), got shape \(\)"),
    ("q09r8-qat-codes-1d", lambda: fake_quantize(torch.randn(32), QuantConfig("int8")), ValueError,
     r"^w must be a weight matrix \(out, in\), got shape \(32,\)"),
    ("q09r8-pack-int4-int8-8", lambda: pack_int4(torch.tensor([[8, 0]], dtype=torch.int8)), ValueError,
     r"^q holds torch.int8 codes in \[0, 8\]: they must lie in \[-8, 7\]"),
    ("q09r8-pack-int4-uint8-16", lambda: pack_int4(torch.tensor([[16, 0]], dtype=torch.uint8)), ValueError,
     r"^q holds torch.uint8 codes in \[0, 16\]: they must lie in \[0, 15\]"),
    # before: a bool zero point was taken as 0/1 codes (silently); a complex one was torch's "lt_cpu" error
    ("q09r8-quantize-asym-zero-bool", lambda: quantize_asymmetric(W, *_asym_bool_zero(), 8), TypeError,
     "^zero must be an integer or float tensor of zero points, got torch.bool"),
    ("q09r8-quantize-asym-zero-complex", lambda: quantize_asymmetric(
        W, asymmetric_params(W, 8, 1)[0], asymmetric_params(W, 8, 1)[1].to(torch.complex64), 8), TypeError,
     "^zero must be an integer or float tensor of zero points, got torch.complex64"),
    ("q09r8-dequantize-asym-zero-bool", lambda: dequantize_asymmetric(
        torch.zeros(8, 32, dtype=torch.uint8), *_asym_bool_zero()), TypeError,
     "^zero must be an integer or float tensor of zero points, got torch.bool"),
    ("q09r8-dequantize-asym-zero-bool-unchecked", lambda: dequantize_asymmetric(
        torch.zeros(8, 32, dtype=torch.uint8), *_asym_bool_zero(), check_values=False), TypeError,
     "^zero must be an integer or float tensor"),
    ("q09r8-dequantize-asym-zero-complex", lambda: dequantize_asymmetric(
        torch.zeros(8, 32, dtype=torch.uint8), torch.ones(8, 1), torch.zeros(8, 1, dtype=torch.complex64)),
     TypeError, "^zero must be an integer or float tensor of zero points, got torch.complex64"),
    # before: Tensor.item() on a meta tensor; "Tensor on device meta is not on the expected device cpu!"
    ("q09r8-smoothing-scales-act-meta", lambda: smoothing_scales(torch.rand(32, device="meta"), W), ValueError,
     "^act_absmax is a meta tensor"),
    ("q09r8-smoothing-scales-weight-meta", lambda: smoothing_scales(torch.rand(32), W.to("meta")), ValueError,
     "^weight is a meta tensor"),
    # before: torch's "mat1 and mat2 shapes cannot be multiplied (5x16 and 32x8)"
    ("q09r8-qlin-in-features-changed", lambda: (lambda l: (setattr(l, "in_features", 16), l(torch.randn(5, 16))))(
        qlinear()), ValueError, r"^in_features=16, out_features=8 were changed after the layer was built as \(32, 8\)"),
    ("q09r8-qlin-out-features-changed", lambda: mutated_layer(lambda l: setattr(l, "out_features", 4)), ValueError,
     r"^in_features=32, out_features=4 were changed after the layer was built"),
    # before: sparse (COO) operands reached torch ("Could not run 'aten::lt.Scalar' ... SparseCPU", "unsupported
    # memory format option Contiguous"), or were named `q` by the function called inside
    ("q09r8-quantize-asym-zero-sparse", lambda: quantize_asymmetric(
        W, asymmetric_params(W, 8, 1)[0], asymmetric_params(W, 8, 1)[1].to_sparse(), 8), TypeError,
     "^zero must be a strided"),
    ("q09r8-unpack-int4-sparse", lambda: unpack_int4(torch.zeros(2, 4, dtype=torch.uint8).to_sparse(), True),
     TypeError, "^packed must be a strided"),
    ("q09r8-dequantize-kv-codes-sparse", lambda: dequantize_kv(torch.zeros(2, 4, dtype=torch.int8).to_sparse(),
                                                               torch.ones(2, 1)), TypeError, "^codes must be a strided"),
    ("q09r8-dequantize-kv-scale-sparse", lambda: dequantize_kv(torch.zeros(2, 4, dtype=torch.int8),
                                                               torch.ones(2, 1).to_sparse()), TypeError,
     "^scale must be a strided"),
    ("q09r8-int8-matmul-a-sparse", lambda: int8_matmul(Q8.to_sparse(), Q8.t()), TypeError, "^a must be a strided"),
    ("q09r8-w8a8-linear-x-sparse", lambda: w8a8_linear(torch.randn(5, 32).to_sparse(), *_w8a8_parts()), TypeError,
     "^x must be a strided"),
    ("q09r8-w8a8-linear-qweight-sparse", lambda: w8a8_linear(
        torch.randn(5, 32), _w8a8_parts()[0].to_sparse(), *_w8a8_parts()[1:]), TypeError, "^qweight must be a strided"),
    ("q09r8-llm-int8-x-sparse", lambda: llm_int8_linear(torch.randn(5, 32).to_sparse(), qlinear("w8a8"), 6.0),
     TypeError, "^x must be a strided"),
    # ninth hostile run: a nested tensor reports layout strided and has no shape to read, a qint8 one is strided too,
    # uint64 and float8 promote with nothing; `check_strided` refuses all four before anything reads the shape
    ("q09r9-gptq-W-nested", lambda: gptq_quantize(_nested(W), H, 4), TypeError, "^W must be a dense tensor"),
    ("q09r9-gptq-H-nested", lambda: gptq_quantize(W, _nested(H), 4), TypeError, "^H must be a dense tensor"),
    ("q09r9-gptq-W-float8", lambda: gptq_quantize(W.to(torch.float8_e4m3fn), H, 4), TypeError,
     "^W has dtype torch.float8_e4m3fn"),
    ("q09r9-damped-H-nested", lambda: damped(_nested(H), 0.01), TypeError, "^H must be a dense tensor"),
    ("q09r9-output-error-X-nested", lambda: output_error(W, W * 0.9, _nested(torch.randn(4, 32))), TypeError,
     "^X must be a dense tensor"),
    ("q09r9-smoothing-scales-act-absmax-nested", lambda: smoothing_scales(_nested(torch.rand(32)), W), TypeError,
     "^act_absmax must be a dense tensor"),
    ("q09r9-outlier-report-absmax-nested", lambda: outlier_report({"h.0": _nested(torch.rand(2, 32))}, 6.0),
     TypeError, "^absmax\\['h.0'\\] must be a dense tensor"),
    ("q09r9-quantize-kv-x-nested", lambda: quantize_kv(_nested(torch.randn(2, 8))), TypeError,
     "^x must be a dense tensor"),
    ("q09r9-dequantize-asymmetric-zero-nested", lambda: dequantize_asymmetric(
        Q8, torch.ones(2, 1), _nested(torch.zeros(2, 1))), TypeError, "^zero must be a dense tensor"),
    ("q09r9-dequantize-asymmetric-zero-uint64", lambda: dequantize_asymmetric(
        Q8, torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.uint64)), TypeError, "^zero has dtype torch.uint64"),
    ("q09r9-quantize-asymmetric-zero-qint8", lambda: quantize_asymmetric(
        W, torch.ones(8, 1), torch.quantize_per_tensor(torch.zeros(8, 1), 1.0, 0, torch.qint8), 8), TypeError,
     "^zero must be an ordinary \\(not quantized\\) tensor"),
    ("q09r9-int8-matmul-a-nested", lambda: int8_matmul(_nested(Q8), Q8.t()), TypeError, "^a must be a dense tensor"),
    ("q09r9-quantize-activations-x-nested", lambda: quantize_activations(_nested(torch.randn(2, 8))), TypeError,
     "^x must be a dense tensor"),
    ("q09r9-quant-linear-x-nested", lambda: qlinear()(_nested(torch.randn(2, 32))), TypeError,
     "^x must be a dense tensor"),
    ("q09r9-quant-linear-int4-x-nested", lambda: qlinear("int4", group_size=16)(_nested(torch.randn(2, 32))),
     TypeError, "^x must be a dense tensor"),
    ("q09r9-quant-linear-x-mkldnn", lambda: qlinear()(torch.randn(2, 32).to_mkldnn()), TypeError,
     "^x must be a strided"),
    ("q09r9-check-calibration-nested", lambda: check_calibration(MODEL, _nested(CALIB)), TypeError,
     "^calibration must be a dense tensor"),
    ("p10r9-head-scores-calibration-nested", lambda: head_scores(MODEL, _nested(CALIB)), TypeError,
     "calibration must be a dense tensor"),
    ("p10r9-wanda-input-norm-nested", lambda: wanda_score(W, _nested(torch.rand(32))), TypeError,
     "^input_norm must be a dense tensor"),
    ("p10r9-wanda-weight-float8", lambda: wanda_score(W.to(torch.float8_e4m3fn), torch.rand(32)), TypeError,
     "^weight has dtype torch.float8_e4m3fn"),
    ("p10r9-stored-bytes-weight-nested", lambda: stored_bytes(_nested(W), "csr"), TypeError,
     "^weight must be a dense tensor"),
    ("p10r9-lowest-heads-scores-nested", lambda: lowest_heads(_nested(torch.rand(2, 2)), 1), TypeError,
     "^scores must be a dense tensor"),
    ("p10r9-prune-mlp-scores-nested", lambda: prune_mlp(MODEL, 0.5, [_nested(torch.rand(128))] * 2), TypeError,
     r"^scores\[0\] must be a dense tensor"),
    ("p10r9-input-norms-x-nested", lambda: input_norms(MODEL.transformer.h[0], _nested(torch.randn(2, 4, 32))),
     TypeError, "^x must be a dense tensor"),
]


def _nested(t: torch.Tensor) -> torch.Tensor:
    """t as the one component of a nested tensor: layout torch.strided, but no shape torch can read."""
    return torch.nested.nested_tensor([t])


def _w8a8_parts() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qweight, scale, bias) of a W8A8 layer of linear() (8 outputs, 32 inputs)."""
    layer = qlinear("w8a8")
    return layer.qweight, layer.scale, layer.bias


def _asym_bool_zero() -> tuple[torch.Tensor, torch.Tensor]:
    """W's per-row asymmetric scale, and its zero points as a bool tensor."""
    scale, zero = asymmetric_params(W, 8, 1)
    return scale, zero.bool()


def _nan_linear() -> nn.Linear:
    lin = linear()
    with torch.no_grad():
        lin.weight[0, 0] = NAN
    return lin


@pytest.mark.parametrize("call, err, match", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_input_is_refused_by_minillm_naming_the_argument(call, err, match):
    assert_refused_by_minillm(call, err, match)


def test_case_ids_are_distinct():
    ids = [case[0] for case in BAD]
    assert len(ids) == len(set(ids))


def _torch_pruned() -> GPT:
    """MODEL's copy with block 0's c_fc pruned by torch.nn.utils.prune (weight = weight_orig * weight_mask)."""
    m = tiny()
    torch_prune.l1_unstructured(m.transformer.h[0].mlp.c_fc, "weight", 0.3)
    return m


def test_p10r6_run_all_checks_draft_before_any_measurement(monkeypatch):
    # before: draft='draft' was read after the unstructured, 2:4 and outlier sweeps (minutes of work lost)
    dense = harness().model

    def measured(*args, **kwargs):
        raise AssertionError("the measurements started")
    monkeypatch.setattr(pbench, "Harness", measured)
    with pytest.raises(TypeError, match="run_all: draft needs a minillm GPT, got str"):
        pbench.run_all(dense, False, "quick", draft="draft")


def test_p10r6_describe_and_load_refuse_a_bool_width(tmp_path):
    # before: describe returned mlp_hidden [True, 128] (JSON true passed as an int)
    good = save_pruned(MODEL, tmp_path / "good.safetensors", "none", pattern="dense")
    with safe_open(str(good), framework="pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(tmp_path / "bad.safetensors"), metadata={**meta, "mlp_hidden": "[true, 128]"})
    for read in (describe_pruned, load_pruned):
        with pytest.raises(ValueError, match=r"mlp_hidden must list 2 widths in \[1, 128\], got '\[true, 128\]'"):
            read(tmp_path / "bad.safetensors")


def test_p10r6_prune_bench_help_prints(capsys):
    # before: argparse %-formatted the --quick help's "50%": TypeError '%o format' instead of the help
    with pytest.raises(SystemExit) as info:
        pbench.main(["--help"])
    assert info.value.code == 0 and "--quick" in capsys.readouterr().out


# ----- NaN: refused where it is cheap, propagated (never masked to 0) on the per-step paths ----------------------


def test_nan_scale_propagates_instead_of_masking_to_zero():
    x = torch.tensor([[1.0, NAN, 2.0], [1.0, -2.0, 0.5], [INF, 1.0, 0.0]])
    s = symmetric_params(x, 8, dim=1)
    assert not math.isfinite(float(s[0])) and not math.isfinite(float(s[2])) and math.isfinite(float(s[1]))
    # asymmetric: the zero point round(-min / scale) would be NaN cast to uint8, a plausible code; refused instead
    with pytest.raises(ValueError, match=r"\bx\b"):
        asymmetric_params(x, 8, dim=1)
    back = dequantize_symmetric(quantize_symmetric(x, s, 8), s)
    assert back[0].isnan().all() and not back[2].isfinite().any()  # visibly wrong, not a plausible 0
    clean = x[1:2]
    torch.testing.assert_close(back[1:2], dequantize_symmetric(quantize_symmetric(clean, symmetric_params(
        clean, 8, dim=1), 8), symmetric_params(clean, 8, dim=1)))


@pytest.mark.parametrize("use_int_mm", [True, False])
@pytest.mark.parametrize("threshold", [None, 6.0])
def test_w8a8_forward_propagates_a_nan_token_and_leaves_the_others_exact(use_int_mm, threshold):
    layer = qlinear("w8a8", use_int_mm=use_int_mm, outlier_threshold=threshold)
    torch.manual_seed(3)
    x = torch.randn(2, 3, 32)
    want = layer(x)
    x_bad = x.clone()
    x_bad[1, 2, 7] = NAN
    got = layer(x_bad)
    assert got[1, 2].isnan().all()  # the fp32 layer would give NaN there too
    keep = torch.ones(2, 3, dtype=torch.bool)
    keep[1, 2] = False
    torch.testing.assert_close(got[keep], want[keep], atol=0, rtol=0)
    ref = w8a8_reference(x, layer) if threshold is None else llm_int8_reference(x, layer, threshold)
    torch.testing.assert_close(want, ref, atol=1e-5, rtol=1e-5)


def test_int8_kv_cache_propagates_nan_keys_as_the_fp32_cache_does():
    hs = CFG.head_size
    torch.manual_seed(0)
    q, k, v = torch.randn(2, CFG.n_head, 3, hs), torch.randn(2, CFG.n_head, 3, hs), torch.randn(2, CFG.n_head, 3, hs)
    k[1, 0, 0, 0] = NAN
    out = Int8ContiguousKVCache(CFG, batch_size=2, max_len=8).attend(0, q, k, v)
    ref = ContiguousKVCache(CFG, batch_size=2, max_len=8).attend(0, q, k, v)
    assert torch.equal(out.isnan(), ref.isnan())  # before: the NaN key was stored as codes 0, every output finite
    assert out[1, 0, 1:].isnan().all()  # queries 1 and 2 of head 0 attend over the NaN key at position 0
    assert out[0].isfinite().all()
    # the key's stored scale is NaN, so what is read back is NaN, not a plausible 0
    cache = Int8ContiguousKVCache(CFG, batch_size=2, max_len=8)
    cache.attend(0, q, k, v)
    assert cache.k_scale[0][1, 0, 0].isnan().all() and cache.k_scale[0][0].isfinite().all()


def test_integer_input_to_int8_layer_no_longer_returns_the_bias():
    layer = qlinear("int8")
    x = torch.randint(-3, 4, (2, 32))
    with pytest.raises(TypeError, match="int64"):
        layer(x)
    torch.testing.assert_close(layer(x.float()), F.linear(x.float(), layer.dequantized_weight(), layer.bias),
                               atol=1e-5, rtol=1e-5)


def test_asymmetric_range_wider_than_the_largest_float_does_not_overflow():
    # before: max - min = 6e38 overflowed float32 to inf, and every value came back NaN
    x = torch.tensor([[-3e38, 3e38, 1e37, 0.0]])
    qt = quantize(x, symmetric=False)
    back = dequantize(qt)
    assert back.isfinite().all() and qt.scale.isfinite().all()
    assert ((back - x).abs() <= qt.scale / 2 * (1 + 1e-5)).all()
    small = torch.randn(4, 16)  # a range that does not overflow keeps span / qmax bit for bit
    torch.testing.assert_close(asymmetric_params(small, 8, dim=1)[0],
                               (small.amax(1, keepdim=True).clamp(min=0) - small.amin(1, keepdim=True).clamp(max=0))
                               / 255, atol=0, rtol=0)


def test_quantized_tensor_accepts_every_storable_code():
    # the checks refuse what cannot be stored, not what `quantize` would not choose: -8 is a 4-bit code
    q = torch.tensor([[-8, 7, 0, -7]], dtype=torch.int8)
    qt = QuantizedTensor(q, torch.ones(1, 1), None, 4, (1, 4))
    assert dequantize(qt).tolist() == [[-8.0, 7.0, 0.0, -7.0]]
    u = torch.tensor([[0, 15]], dtype=torch.uint8)
    assert dequantize(QuantizedTensor(u, torch.ones(1, 1), torch.full((1, 1), 15, dtype=torch.uint8), 4,
                                      (1, 2))).tolist() == [[-15.0, 0.0]]


@pytest.mark.parametrize("mode, kw", [("int8", {}), ("int8", {"symmetric": False}), ("int4", {"group_size": 16}),
                                      ("w8a8", {})])
def test_quant_linear_modes_agree_on_the_input_dtype(mode, kw):
    # before: int4 (and asymmetric int8) raised torch's dtype error on fp16/bf16/fp64 x, symmetric int8 returned fp32
    # and w8a8 x's dtype. Now: x must have the layer's compute dtype in every mode, and a cast layer takes its dtype.
    layer = qlinear(mode, **kw)
    x = torch.randn(2, 3, 32)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        with pytest.raises(TypeError, match=rf"\bx\b.*{dtype}"):
            layer(x.to(dtype))
    assert layer(x).dtype == torch.float32
    wide = qlinear(mode, **kw).double()
    torch.testing.assert_close(wide(x.double()), layer(x).double(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("shape", [(0, 32), (2, 0, 32)])
@pytest.mark.parametrize("use_int_mm", [True, False])
@pytest.mark.parametrize("outliers", [None, 6.0], ids=["w8a8", "llm-int8"])
def test_w8a8_layer_on_no_tokens_returns_an_empty_output_like_nn_linear(shape, use_int_mm, outliers):
    # before: torch's "cannot reshape tensor of 0 elements" from the final reshape
    x = torch.randn(shape)
    extra = {} if outliers is None else {"outlier_threshold": outliers}
    out = qlinear("w8a8", use_int_mm=use_int_mm, **extra)(x)
    assert out.shape == linear()(x).shape == (*shape[:-1], 8)


def test_save_quantized_refuses_what_load_quantized_refuses(tmp_path):
    # before: a negative scale (or an fp16 model) saved fine and only the load refused it
    negative = quantize_model(MODEL, QuantConfig("int8"))
    with torch.no_grad():
        negative.transformer.h[0].attn.c_attn.scale[3, 0] = -0.5
    with pytest.raises(ValueError, match=r"'transformer\.h\.0\.attn\.c_attn\.scale'.*<= 0"):
        save_quantized(negative, tmp_path / "neg.safetensors")
    with pytest.raises(ValueError, match=r"'transformer\.h\.0\.attn\.c_attn\.bias' is torch\.float16"):
        save_quantized(quantize_model(MODEL, QuantConfig("int8")).half(), tmp_path / "half.safetensors")
    nan_bias = quantize_model(MODEL, QuantConfig("int4", group_size=16, symmetric=False))
    with torch.no_grad():
        nan_bias.transformer.h[1].mlp.c_fc.bias[0] = NAN
    with pytest.raises(ValueError, match=r"'transformer\.h\.1\.mlp\.c_fc\.bias'.*non-finite"):
        save_quantized(nan_bias, tmp_path / "nan.safetensors")
    assert list(tmp_path.iterdir()) == []  # nothing written
    good = save_quantized(QMODEL, tmp_path / "good.safetensors")
    assert torch.equal(load_quantized(good)(CALIB), QMODEL(CALIB))


def test_save_pruned_refuses_what_load_pruned_refuses(tmp_path):
    # before: an fp16 model, a NaN LayerNorm weight and 50% zeros called "dense" all saved; the loads refused them
    with pytest.raises(ValueError, match=r"'transformer\.h\.0\.attn\.c_attn\.bias' is torch\.float16"):
        save_pruned(tiny().half(), tmp_path / "half.safetensors", "m")
    nan = tiny()
    with torch.no_grad():
        nan.transformer.ln_f.weight[0] = NAN
    with pytest.raises(ValueError, match=r"'transformer\.ln_f\.weight'.*non-finite"):
        save_pruned(nan, tmp_path / "nan.safetensors", "m")
    sparse = prune_model(MODEL, "magnitude", 0.5, pattern="2:4")
    with pytest.raises(ValueError, match=r"pattern 'dense'.*0\.5000"):
        save_pruned(sparse, tmp_path / "dense.safetensors", "m", pattern="dense")
    assert list(tmp_path.iterdir()) == []
    assert load_pruned(save_pruned(MODEL, tmp_path / "dense.safetensors", "none", pattern="dense")) is not None


@pytest.mark.parametrize("field, value, match", [
    ("pattern", "dense", r"metadata field pattern says 'dense'.*0\.5000"),  # before: accepted
    ("pattern", "1:4", "metadata field pattern"),
    ("block_sparsity", "half", "metadata field block_sparsity 'half'"),  # before: float()'s message alone
    ("block_sparsity", "nan", "metadata field block_sparsity"),
    ("mlp_hidden", "[64,", r"metadata field mlp_hidden '\[64,'"),  # before: the JSON error alone
])
def test_load_pruned_names_the_bad_metadata_field(tmp_path, field, value, match):
    good = save_pruned(prune_model(MODEL, "magnitude", 0.5, pattern="2:4"), tmp_path / "good.safetensors", "2:4")
    with safe_open(str(good), framework="pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta[field] = value
    save_file(tensors, str(tmp_path / "bad.safetensors"), metadata=meta)
    with pytest.raises(ValueError, match=match):
        load_pruned(tmp_path / "bad.safetensors")


# ----- the fourth hostile run, 09: the right answers ---------------------------------------------------------------


def mutated_qt(**fields) -> QuantizedTensor:
    """A valid QuantizedTensor (QT8's codes and scales, copied) with `fields` replaced after construction."""
    qt = QuantizedTensor(QT8.q.clone(), QT8.scale.clone(), None, 8, QT8.shape)
    for name, value in fields.items():
        setattr(qt, name, value)
    return qt


def test_q09r5_input_absmax_measures_a_training_model_in_eval_mode_and_hands_it_back_training():
    # before: dropout (p=0.5) ran during the measurement and inflated max |x| 2.2-fold
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**CFG.to_dict(), "dropout": 0.5})).train()
    stats = input_absmax(model, CALIB)
    assert model.training
    with torch.no_grad():  # block 0's c_attn reads ln_1 of the embeddings: its max |x| per feature, by hand
        x = model.transformer.wte(CALIB) + model.transformer.wpe(torch.arange(CALIB.shape[1]))
        want = model.transformer.h[0].ln_1(x).abs().amax(dim=(0, 1))
    torch.testing.assert_close(stats["0.attn.c_attn"], want)


def test_q09r5_save_quantized_refuses_a_reassigned_config_and_a_folder_path(tmp_path):
    q = quantize_model(MODEL, QuantConfig("int8"))
    q.quant_config = QuantConfig("int4", group_size=16)  # before: int4 metadata written over int8 tensors
    with pytest.raises(ValueError, match=r"^save_quantized \(model\): model.quant_config QuantConfig\(mode='int4'"):
        save_quantized(q, tmp_path / "c.safetensors")
    with pytest.raises(ValueError, match="^save_quantized: path must name a file, got '.*newdir/'"):
        save_quantized(QMODEL, str(tmp_path / "newdir") + "/")  # before: a file named newdir was written
    assert list(tmp_path.iterdir()) == []


def test_q09r5_inject_outliers_at_either_end_of_its_factor_range_keeps_the_function():
    with torch.no_grad():
        want = MODEL(CALIB)
        for factor in (MAX_OUTLIER_FACTOR, 1 / MAX_OUTLIER_FACTOR):
            torch.testing.assert_close(inject_outliers(MODEL, [1, 5], factor)(CALIB), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode, kw", [("int8", {}), ("int4", {"group_size": 16}), ("int8", {"symmetric": False})])
def test_q09_a_quant_linear_keeps_its_own_copy_of_the_codes(mode, kw):
    # before: load_quantized stored the caller's tensors; writing into them later changed the layer
    config = QuantConfig(mode, **kw)
    lin = linear()
    qt = quantize(lin.weight.detach(), config.bits, config.symmetric, config.granularity, config.quantize_group_size)
    for layer in (QuantLinear.from_linear(lin, config, qt), QuantLinear(32, 8, True, config)):
        layer.load_quantized(qt)
        before = {k: v.clone() for k, v in layer.state_dict().items()}
        want = dequantize(qt).clone()
        qt.q.zero_()
        qt.scale.mul_(3)
        if qt.zero is not None:
            qt.zero.fill_(7)
        assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())
        torch.testing.assert_close(layer.dequantized_weight(), want, atol=0, rtol=0)
        qt = quantize(lin.weight.detach(), config.bits, config.symmetric, config.granularity,
                      config.quantize_group_size)


def test_q09_quantize_model_of_a_qat_model_on_its_own_grid_is_convert_qat():
    # the refusal above is for another grid; on the grid it trained with, RTN of the latent weights is what the
    # training forward rounded to, so it equals convert_qat (the reference)
    config = QuantConfig("int4", group_size=16)
    qat = prepare_qat(MODEL, config)
    with torch.no_grad():
        for p in qat.transformer.h.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ids = torch.randint(0, CFG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(quantize_model(qat, config)(ids), convert_qat(qat)(ids), atol=0, rtol=0)


def test_q09_smooth_model_of_a_head_pruned_model_computes_the_same_function():
    # before: a shape error inside the value-row fold (it assumed n_head * head_size = n_embd)
    wide = GPT(GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=32))
    pruned = prune_heads(wide.eval(), {0: [1, 2], 1: [0, 3]})
    assert pruned.config.attn_dim == 16 < pruned.config.n_embd
    smoothed = smooth_model(pruned, CALIB, alpha=0.5)
    ids = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(smoothed(ids), pruned(ids), atol=1e-5, rtol=1e-5)
        v = smoothed.transformer.h[0].attn.c_attn.weight[32:]  # the value rows, rescaled
        assert not torch.equal(v, pruned.transformer.h[0].attn.c_attn.weight[32:])


# ----- QAT: converted on the grid it trained with ------------------------------------------------------------------


@pytest.mark.parametrize("config", [QuantConfig("int8"), QuantConfig("int4", group_size=16),
                                    QuantConfig("int4", group_size=32, symmetric=False)])
def test_convert_qat_stores_exactly_the_fake_quantized_weights(config):
    qat = prepare_qat(MODEL, config)
    with torch.no_grad():  # stand in for training: move every weight, so no grid is left from the original
        for p in qat.transformer.h.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ids = torch.randint(0, CFG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fake = qat(ids)
        for converted in (convert_qat(qat), convert_qat(qat, config)):
            torch.testing.assert_close(converted(ids), fake, atol=1e-5, rtol=1e-5)
    other = QuantConfig("int4", group_size=32) if config.mode == "int8" else QuantConfig("int8")
    with pytest.raises(ValueError, match="grid"):
        convert_qat(qat, other)  # before: silently converted to `other`'s grid, logits off by ~2e-2


# ----- GPTQ: a Hessian that is not positive definite ---------------------------------------------------------------


def test_gptq_non_positive_definite_hessian_is_a_valueerror_naming_damp():
    torch.manual_seed(0)
    W = torch.randn(4, 8)
    v = torch.randn(8, 1)
    rank_one = v @ v.T  # PSD, singular: one calibration token
    for fn in (gptq_quantize, gptq_reference):
        with pytest.raises(ValueError, match=r"layer 0\.mlp\.c_fc.*damp=0\.0.*raise damp"):
            fn(W, rank_one, 4, True, None, 0.0, name="layer 0.mlp.c_fc")
        with pytest.raises(ValueError, match="not positive definite"):
            fn(W, -torch.eye(8), damp=0.01)  # negative definite: no damping share of mean(diag) can fix it
    # the damping the message suggests works, and both twins agree
    a = gptq_quantize(W, rank_one, damp=0.1)
    b = gptq_reference(W, rank_one, damp=0.1)
    torch.testing.assert_close(dequantize(a), dequantize(b), atol=1e-5, rtol=1e-5)


def test_gptq_model_on_one_token_without_damping_names_the_layer():
    one_token = torch.zeros(1, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"layer 0\.attn\.c_attn.*raise damp"):
        gptq_quantize_model(MODEL, QuantConfig("int8"), one_token, damp=0.0)


# ----- pruning near 100%: no layer or row pruned to nothing ------------------------------------------------------


def test_masks_near_100_percent_follow_torch_prune_and_count_exactly():
    # The pure masks keep torch.nn.utils.prune's count (graded against it): round(s · n) may be all n.
    torch.manual_seed(0)
    w = torch.randn(8, 32)
    assert int(magnitude_mask(w, 0.99).sum()) == round(256 - 0.99 * 256)  # 253 of 256 removed
    assert num_pruned(32, 0.999) == 32 and num_pruned(32, 0.5) == 16 and num_pruned(0, 0.5) == 0


@pytest.mark.parametrize("method, refused, allowed", [("magnitude", 0.9999, 0.999), ("wanda", 0.99, 0.98)])
def test_prune_model_refuses_a_sparsity_that_empties_a_layer_or_row(method, refused, allowed):
    # before: 99.9% (of a row for Wanda) returned layers whose rows were all zero, silently
    with pytest.raises(ValueError, match=rf"sparsity={refused} would remove all .* 0\.attn\.c_attn"):
        prune_model(MODEL, method, refused, CALIB)
    pruned = prune_model(MODEL, method, allowed, CALIB)
    for block in pruned.transformer.h:
        for lin in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj):
            nonzero = lin.weight != 0
            if method == "magnitude":
                assert int(nonzero.sum()) == lin.weight.numel() - round(allowed * lin.weight.numel()) >= 1
            else:
                assert bool(nonzero.any(1).all())  # Wanda: every output row keeps a weight
    assert pruned(CALIB).isfinite().all()


def test_prune_mlp_refuses_emptying_and_keeps_the_best_neuron_at_the_limit():
    scores = mlp_neuron_scores(MODEL, CALIB)
    with pytest.raises(ValueError, match=r"fraction=0\.999 would remove all 128"):
        prune_mlp(MODEL, 0.999, scores)
    pruned = prune_mlp(MODEL, 0.99, scores)  # round(0.99 · 128) = 127: one neuron left per block
    assert [b.mlp.c_fc.out_features for b in pruned.transformer.h] == [1, 1]
    best = [int(s.argmax()) for s in scores]
    for block, src, j in zip(pruned.transformer.h, MODEL.transformer.h, best):
        torch.testing.assert_close(block.mlp.c_fc.weight[0], src.mlp.c_fc.weight[j])


def test_wanda_on_empty_calibration_is_refused_not_a_silent_nan():
    with pytest.raises(ValueError, match="empty"):
        prune_model(MODEL, "wanda", 0.5, CALIB[:0])


def test_good_inputs_still_give_the_reference_answers():
    # bool-free ints, finite floats: the checks add no change of result
    x = torch.randn(4, 32)
    torch.testing.assert_close(dequantize(quantize(x)), x, atol=float(x.abs().max()) / 127, rtol=0)
    torch.testing.assert_close(int8_matmul(Q8, Q8.t()), int8_matmul_ref(Q8, Q8.t()))
    assert is_nm_sparse(W * nm_mask(W.abs()), 2, 4)
    assert sparsity_of(torch.tensor([0.0, 1.0])) == 0.5
    assert stored_bytes(W, "dense", element_bytes=2) == W.numel() * 2
    assert lowest_heads(torch.tensor([[1.0, 0.5], [0.1, 2.0]]), 1) == {0: [1], 1: [0]}
    masked = mask_heads(MODEL, {1: [0]})
    assert masked.transformer.h[1].attn.c_proj.weight[:, :CFG.head_size].eq(0).all()
    assert weight_sparsity(MODEL)["blocks"] == 0.0


@pytest.mark.parametrize("symmetric", [True, False])
def test_subnormal_values_quantize_to_zero_instead_of_a_zero_scale(symmetric):
    # before the overflow fix: a max|x| of 1e-44 over qmax underflowed to a zero scale, refused as "scale <= 0"
    x = torch.tensor([[1e-44, -1e-44, 0.0, 1e-45]])
    qt = quantize(x, symmetric=symmetric)
    assert bool((qt.scale > 0).all()) and torch.equal(dequantize(qt), torch.zeros_like(x))


def test_what_the_second_hostile_run_left_in_09_10_is_refused_by_name():
    # before: an int32 sum that wrapped around past K = 2**17 (-2001207296 for 2293760000), a Wanda row pruned to
    # nothing, a head masked twice
    from minillm.prune.masks import per_row_mask
    from minillm.prune.structured import mask_heads
    from minillm.quant.w8a8 import int8_matmul
    with pytest.raises(ValueError, match="overflow"):
        int8_matmul(torch.full((1, 140_000), -128, dtype=torch.int8), torch.full((140_000, 1), -128, dtype=torch.int8))
    with pytest.raises(ValueError, match="sparsity"):
        per_row_mask(torch.randn(8, 16), 0.99)
    with pytest.raises(ValueError, match="twice"):
        mask_heads(MODEL, {0: [1, 1]})


@pytest.mark.parametrize("mode, groups", [("int8", 1), ("w8a8", 1), ("int4", 32 // 16)])
def test_a_config_whose_group_size_is_unused_still_quantizes_per_channel(mode, groups):
    # quantize now refuses a group_size it would ignore; QuantConfig hands it one only for the group-wise mode, so
    # an int8 config carrying group_size=16 (a field only int4 reads) keeps quantizing one scale per row
    config = QuantConfig(mode, group_size=16)
    assert config.quantize_group_size == (16 if mode == "int4" else None)
    lin = linear()
    layer = QuantLinear.from_linear(lin, config)
    assert tuple(layer.scale.shape) == (8, groups)
    want = quantize(lin.weight.detach(), config.bits, True, config.granularity, config.quantize_group_size)
    torch.testing.assert_close(layer.scale, want.scale)


def test_a_pruned_model_of_odd_mlp_width_still_saves_and_loads(tmp_path):
    # is_nm_sparse now refuses widths no group of 4 tiles; the checkpoint's pattern check asks first, so an MLP shrunk
    # to 3 neurons (c_proj 3 columns wide) is "dense", not an error
    model = shrink_mlp(MODEL, [torch.arange(3), torch.arange(5)])
    path = save_pruned(model, tmp_path / "odd.safetensors", "structured", pattern="dense")
    loaded = load_pruned(path)
    assert [b.mlp.c_proj.in_features for b in loaded.transformer.h] == [3, 5]
    idx = CALIB[:1]
    torch.testing.assert_close(loaded(idx), model(idx))


def test_quantized_and_qat_models_are_refused_by_block_weights_and_save_pruned(tmp_path):
    # before: block_weights(quantized) was [] (0 bytes, an empty 2:4 check passing), and a QAT model saved and loaded
    # back as a plain GPT without its rounding
    assert [tuple(w.shape) for w in block_weights(MODEL)] == [(96, 32), (32, 32), (128, 32), (32, 128)] * 2
    assert block_weights(MODEL)[0] is MODEL.transformer.h[0].attn.c_attn.weight  # the tensors themselves
    qat = prepare_qat(MODEL, QuantConfig("int8"))
    for call in (lambda: block_weights(QMODEL), lambda: save_pruned(qat, tmp_path / "qat.safetensors", "m"),
                 lambda: save_pruned(QMODEL, tmp_path / "q.safetensors", "m")):
        with pytest.raises(TypeError, match="block_weights|save_pruned"):
            call()
    assert list(tmp_path.iterdir()) == []


def test_layer_costs_takes_only_whole_positive_counts_and_measures_each_case():
    # before: calls=True and tokens=(0,) ran and reported numbers; calls=0 divided by zero after timing
    for bad in (dict(calls=True), dict(tokens=(0,)), dict(calls=0), dict(sparsities=["0.5"])):
        with pytest.raises((TypeError, ValueError)):
            pbench.layer_costs(**bad)
    rows = pbench.layer_costs(sparsities=[0.5], tokens=[1, 3], repeats=1, calls=1)
    assert [(r["sparsity"], r["tokens"]) for r in rows] == [(0.5, 1), (0.5, 3)]
    assert all(r["dense_us"] > 0 and r["csr_us"] > 0 for r in rows)


def test_masking_every_head_of_a_block_is_the_ablation_it_asks_for():
    # kept by design (a hostile run flagged it): masking all of block 0's heads is "block 0 without attention", its
    # attention output c_proj's bias alone (test_10 checks that by hand); prune_heads, which must keep a head for the
    # caches, refuses the same removal
    masked = mask_heads(MODEL, {0: [0, 1]})
    assert masked.transformer.h[0].attn.c_proj.weight.eq(0).all()
    assert torch.equal(masked.transformer.h[1].attn.c_proj.weight, MODEL.transformer.h[1].attn.c_proj.weight)
    with pytest.raises(ValueError, match="keep at least one"):
        prune_heads(MODEL, {0: [0, 1], 1: [0, 1]})


# ----- the third hostile run: what is still accepted gives the reference answer ----------------------------------


@pytest.mark.parametrize("config", [QuantConfig("int8", quantize_head=True),
                                   QuantConfig("int4", group_size=16, symmetric=False, quantize_head=True)])
def test_quantized_embedding_of_valid_ids_is_the_dequantized_rows(config):
    # the id check refuses only ids outside [0, V): the first and last rows are looked up as the table holds them
    wte = quantize_model(MODEL, config).transformer.wte
    ids = torch.tensor([[0, 5], [CFG.vocab_size - 1, 0]])
    want = wte.table.dequantized_weight()[ids]  # (2, 2, C): the reference, by indexing the whole table
    torch.testing.assert_close(wte(ids), want, atol=0, rtol=0)
    assert wte(ids[:0]).shape == (0, 2, CFG.n_embd)  # no ids: nothing to check, an empty lookup


def test_prune_model_two_four_takes_its_own_sparsity_and_magnitude_checks_but_ignores_calibration():
    # 2:4 is sparsity 0.5 by construction: passing 0.5 is the default; a valid calibration changes nothing for
    # magnitude pruning, which reads only |W|
    default = prune_model(MODEL, "magnitude", pattern="2:4")
    explicit = prune_model(MODEL, "magnitude", 0.5, CALIB, pattern="2:4")
    for a, b in zip(default.parameters(), explicit.parameters()):
        assert torch.equal(a, b)
    plain, calibrated = prune_model(MODEL, "magnitude", 0.3), prune_model(MODEL, "magnitude", 0.3, CALIB)
    for a, b in zip(plain.parameters(), calibrated.parameters()):
        assert torch.equal(a, b)
    w = MODEL.transformer.h[0].mlp.c_fc.weight.detach()
    torch.testing.assert_close(plain.transformer.h[0].mlp.c_fc.weight, w * magnitude_mask(w, 0.3), atol=0, rtol=0)


def test_describe_of_a_pruned_file_without_its_method_names_the_field(tmp_path):
    # before: KeyError 'method'. The loader never needs the field, so the same file (its digest dropped too, as an
    # edit would) still loads, to the saved model's outputs
    pruned = prune_mlp(MODEL, 0.25, mlp_neuron_scores(MODEL, CALIB))
    good = save_pruned(pruned, tmp_path / "good.safetensors", "mlp 25%", pattern="dense")
    assert describe_pruned(good)["method"] == "mlp 25%"
    with safe_open(str(good), framework="pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    del meta["method"], meta["sha256"]
    save_file(tensors, str(tmp_path / "bad.safetensors"), metadata=meta)
    with pytest.raises(ValueError, match=r"bad\.safetensors.*metadata field 'method' is missing"):
        describe_pruned(tmp_path / "bad.safetensors")
    torch.testing.assert_close(load_pruned(tmp_path / "bad.safetensors")(CALIB), pruned(CALIB), atol=0, rtol=0)


# ----- the third hostile run: what the new checks still accept gives the reference answer -------------------------


@pytest.mark.parametrize("mm", [int8_matmul, int8_matmul_ref])
def test_int8_matmul_at_the_largest_allowed_k_is_exact_with_all_minus_128(mm):
    # (-128)^2 = 2^14 per product: K = 131071 sums to 2^31 - 2^14, the largest that fits int32; K = 2^17 would sum to
    # exactly 2^31 and wrap to -2^31, so it is refused (the BAD rows above)
    a = torch.full((1, MAX_INT8_K), -128, dtype=torch.int8)
    assert MAX_INT8_K * 128 * 128 <= 2**31 - 1 < (MAX_INT8_K + 1) * 128 * 128
    assert int(mm(a, a.t().contiguous())) == MAX_INT8_K * 128 * 128  # the reference: Python's exact integers


def test_quantized_tensor_keeps_the_per_tensor_and_per_row_layouts():
    q = torch.arange(-12, 12, dtype=torch.int8).view(4, 6)
    one = QuantizedTensor(q, torch.full((1, 1), 0.5), None, 8, (4, 6))  # one scale for the whole tensor
    torch.testing.assert_close(dequantize(one), q.float() * 0.5, atol=0, rtol=0)
    s = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0], [0.5, 0.25, 2.0]])
    groups = QuantizedTensor(q, s, None, 8, (4, 6))  # one row of scales per row of q, groups of 2 columns
    torch.testing.assert_close(dequantize(groups), q.float() * s.repeat_interleave(2, dim=1), atol=0, rtol=0)


def test_w8a8_linear_with_a_bias_of_one_per_output_adds_it():
    layer = qlinear("w8a8")
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(4))
    bias = torch.arange(8, dtype=torch.float32)
    no_bias = w8a8_linear(x, layer.qweight, layer.scale, None)
    torch.testing.assert_close(w8a8_linear(x, layer.qweight, layer.scale, bias), no_bias + bias, atol=1e-6, rtol=0)
    assert weight_bytes(layer) == sum(t.nbytes for t in layer.buffers())  # a real module is still counted


@pytest.mark.parametrize("cache_cls", [ContiguousKVCache, Int8ContiguousKVCache])
def test_a_cache_built_from_the_models_own_config_still_generates(cache_cls):
    # the config check compares shapes only: a head-pruned model with a cache from its own config runs, and the
    # plain cache gives the tokens of the cache generate_ids allocates itself
    pruned = prune_heads(MODEL, {0: [1], 1: [0]})
    params = SamplingParams.greedy(6)
    got = generate_ids(pruned, [3, 1, 4, 1, 5], params, kv_cache=cache_cls(pruned.config, 1, 16))
    assert len(got) == 6
    if cache_cls is ContiguousKVCache:
        assert got == generate_ids(pruned, [3, 1, 4, 1, 5], params)


@pytest.mark.parametrize("score", [mlp_neuron_scores, head_scores])
def test_scoring_hands_the_callers_model_back_in_its_own_mode(score):
    # before: the caller's training model came back in eval mode (dropout silently off for the rest of its training)
    model = tiny().train()
    got = score(model, CALIB)
    assert model.training and all(m.training for m in model.modules())
    want = score(tiny().eval(), CALIB)  # the reference: the same weights scored in eval mode
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    evaluated = tiny().eval()
    score(evaluated, CALIB)
    assert not evaluated.training


def test_layer_mask_two_four_at_its_sparsity_is_the_nm_mask_and_dense_bytes_need_no_values():
    torch.manual_seed(0)
    w = torch.randn(8, 32)
    assert torch.equal(layer_mask(w, "magnitude", 0.5, "2:4", None), nm_mask(w.abs(), 2, 4))
    assert stored_bytes(torch.zeros(4, 8, device="meta"), "dense") == 4 * 8 * 4  # the shape is all "dense" reads
    first = next(block_inputs(MODEL, CALIB))[1]  # (N, T, C): the embeddings entering block 0, computed here by hand
    torch.testing.assert_close(first, MODEL.transformer.wte(CALIB) + MODEL.transformer.wpe(torch.arange(8)))


def test_p10r5_recover_hands_the_teacher_back_in_its_own_mode_and_runs_it_without_dropout():
    # before: a teacher in train mode came back in eval mode (recover's docstring: it is only run, never changed)
    def gpt(seed: int, dropout: float) -> GPT:
        torch.manual_seed(seed)
        return GPT(GPTConfig(vocab_size=4096, block_size=16, n_layer=1, n_head=2, n_embd=16, dropout=dropout))

    pruned = gpt(0, 0.0).eval()
    training = gpt(1, 0.5).train()
    _, got = recover(pruned, training, 2, batch_size=1)
    assert training.training and all(m.training for m in training.modules())
    evaluating = gpt(1, 0.5).eval()
    _, want = recover(pruned, evaluating, 2, batch_size=1)  # the reference: the same teacher, given in eval mode
    assert not any(m.training for m in evaluating.modules())
    assert got == want  # the teacher's dropout (p = 0.5) was off during recovery in both runs


# ----- the sixth hostile run, 09


def untied(seed: int = 0) -> GPT:
    """tiny(seed) with an output head of its own (other values than the token embedding's)."""
    model = tiny(seed)
    model.lm_head.weight = nn.Parameter(torch.randn(CFG.vocab_size, CFG.n_embd,
                                                    generator=torch.Generator().manual_seed(seed)) * 0.5)
    return model


def replaced_config(layer: QuantLinear, config: QuantConfig | None, via_embedding: bool = False) -> torch.Tensor:
    """Run `layer` with its config replaced by `config` (None: its own config's mode set to int4 in place)."""
    if config is None:
        object.__setattr__(layer.config, "mode", "int4")
    else:
        layer.config = config
    if via_embedding:
        return QuantEmbedding(layer)(torch.tensor([1, 2]))
    return layer(torch.randn(5, 32))


def test_q09r6_an_untied_head_stays_untied_without_quantize_head_and_a_tied_copy_quantizes():
    # the untied head is kept fp32 (quantize_head=False): the model's logits to int8 rounding
    model = untied()
    tok = torch.randint(0, CFG.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        err = (quantize_model(model, QuantConfig("int8"))(tok) - model(tok)).abs().max().item()
    assert err < 0.1
    # a head untied with the embedding's values (minillm.parallel's copies) is the tied pair: quantized once
    same = tiny(0)
    same.lm_head.weight = nn.Parameter(same.transformer.wte.weight.detach().clone())
    q = quantize_model(same, QuantConfig("int8", quantize_head=True))
    with torch.no_grad():
        assert torch.equal(q(tok), quantize_model(tiny(0), QuantConfig("int8", quantize_head=True))(tok))


def test_q09r6_save_quantized_to_a_dotdot_path_makes_no_folder(tmp_path):
    with pytest.raises(ValueError, match="path must name a file"):
        save_quantized(QMODEL, tmp_path / "fresh" / "..")
    assert not (tmp_path / "fresh").exists()


@pytest.mark.parametrize("symmetric, granularity, group", [(True, "channel", None), (False, "channel", None),
                                                            (True, "group", 8), (False, "tensor", None)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_q09r6_quantize_of_a_half_precision_tensor_rounds_x_over_s_exactly(symmetric, granularity, group, dtype):
    # before: x / s rounded in bf16 (8 significant bits): 27 of 256 codes off by one, error up to 0.81 step
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(3)).to(dtype)
    qt = quantize(x, 8, symmetric, granularity, group)
    rows, groups = qt.scale.shape
    s = qt.scale.double().unsqueeze(2)  # (rows, groups, 1)
    xg = x.double().reshape(rows, groups, -1)
    zero = 0 if qt.zero is None else qt.zero.double().unsqueeze(2)
    lo, hi = qrange(8, symmetric)
    want = torch.clamp(torch.round(xg / s) + zero, lo, hi)  # exact: float64 holds every bf16 / fp32 quotient
    assert torch.equal(qt.q.double().reshape(rows, groups, -1), want)
    assert ((dequantize(qt).double().reshape(rows, groups, -1) - xg).abs() <= s / 2 * (1 + 1e-6)).all()
    # the maps given parameters compute in fp32 at least, too
    sx = symmetric_params(x, 8, dim=1)
    assert torch.equal(quantize_symmetric(x, sx, 8).double(),
                       torch.clamp(torch.round(x.double() / sx.double()), -127, 127))


@pytest.mark.parametrize("expanded", ["a", "b", "a-cols", "overlap"])
@pytest.mark.parametrize("use_int_mm", [True, False])
def test_q09r6_int8_matmul_of_strided_operands_is_the_exact_product(expanded, use_int_mm):
    # before: torch._int_mm read an expanded (stride-0) or overlapping operand past its storage: garbage
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (4, 3), dtype=torch.int8, generator=g)
    b = torch.randint(-127, 128, (3, 5), dtype=torch.int8, generator=g)
    if expanded == "a":
        a = a[:1].expand(4, 3)
    elif expanded == "b":
        b = b[:1].expand(3, 5)
    elif expanded == "a-cols":
        a = a[:, :1].expand(4, 3)
    else:
        a = torch.randint(-127, 128, (40,), dtype=torch.int8, generator=g).as_strided((4, 3), (1, 1))
    assert torch.equal(int8_matmul(a, b, use_int_mm), (a.long() @ b.long()).int())


def test_q09r6_w8a8_linear_with_an_expanded_qweight_is_the_contiguous_ones_output():
    layer = qlinear("w8a8")
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(4))
    qw = layer.qweight[:1].expand(8, 32)
    assert torch.equal(w8a8_linear(x, qw, layer.scale, None), w8a8_linear(x, qw.contiguous(), layer.scale, None))


def test_q09r6_the_w8a8_float_twins_return_xs_dtype_as_the_integer_paths_do():
    # before: w8a8_reference and llm_int8_reference returned fp32 for a bf16 x (their twins return bf16)
    layer = qlinear("w8a8")
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(4)).bfloat16()
    assert w8a8_reference(x, layer).dtype == w8a8_linear(x, layer.qweight, layer.scale, layer.bias).dtype == x.dtype
    assert llm_int8_reference(x, layer, 2.0).dtype == llm_int8_linear(x, layer, 2.0).dtype == x.dtype
    assert w8a8_reference(torch.randn(0, 32), layer).shape == (0, 8)  # no tokens: -1 was ambiguous


# ----- the seventh hostile run, 09 and 10: the right answers -------------------------------------------------------


def mutated_layer(change, mode: str = "int8", embedding: bool = False, **kw) -> torch.Tensor:
    """qlinear(mode) changed after construction by `change(layer)` (in place, or replacing a buffer), then run."""
    layer = qlinear(mode, **kw)
    with torch.no_grad():
        change(layer)
    if embedding:
        return QuantEmbedding(layer)(torch.tensor([1, 2]))
    return layer(torch.randn(5, 32))


def mutated_state_dict(layer: QuantLinear, **tensors) -> QuantLinear:
    """`layer` after load_state_dict of its own state with `tensors` replaced (a copy in place: same buffers)."""
    layer.load_state_dict({**layer.state_dict(), **tensors})
    return layer


@pytest.mark.parametrize("mode, kw", [("int8", {}), ("int8", {"symmetric": False}), ("int4", {"group_size": 16}),
                                      ("w8a8", {"use_int_mm": False})])
def test_q09r7_an_unchanged_quant_linear_reads_no_value_at_forward(monkeypatch, mode, kw):
    """The values are checked when the layer is built; its forward then checks shapes and dtypes on the host only
    (no host sync per step), until a buffer is replaced or written: then once."""
    layer = qlinear(mode, **kw)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    want = layer(x)
    calls = []
    real = QuantLinear.check_values
    monkeypatch.setattr(QuantLinear, "check_values", lambda self: (calls.append(1), real(self))[1])
    for _ in range(3):
        assert torch.equal(layer(x), want)
    assert calls == []
    with torch.no_grad():
        layer.scale.mul_(2.0)  # a valid change: checked once, then used
    for _ in range(3):
        assert torch.allclose(layer(x) - (0 if layer.bias is None else layer.bias),
                              2 * (want - (0 if layer.bias is None else layer.bias)), rtol=1e-5, atol=1e-5)
    assert calls == [1]


def test_q09r7_a_quant_linear_cast_copied_or_reloaded_still_runs():
    """Buffers replaced or rewritten with valid values of the right layout (a cast, a deep copy, a state dict) are
    checked once and run."""
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    layer = qlinear("int8")
    want = layer(x)
    assert torch.allclose(qlinear("int8").half()(x.half()).float(), want, rtol=1e-2, atol=1e-2)
    assert torch.equal(copy.deepcopy(layer)(x), want)
    assert torch.equal(mutated_state_dict(qlinear("int8"), scale=layer.scale.clone())(x), want)


def test_p10r7_mask_heads_takes_numpy_ints_as_ints():
    # before: np.int64 keys and heads were refused ("block index must be an int ..., got np.int64(0)")
    a, b = mask_heads(MODEL, {np.int64(0): [np.int64(1)]}), mask_heads(MODEL, {0: [1]})
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    p, q = prune_heads(MODEL, {np.int64(0): [np.int32(1)], 1: [np.int64(0)]}), prune_heads(MODEL, {0: [1], 1: [0]})
    assert p.config == q.config
    assert all(torch.equal(x, y) for x, y in zip(p.state_dict().values(), q.state_dict().values()))
    assert lowest_heads(torch.tensor([[1.0, 0.5], [0.1, 2.0]]), np.int64(1)) == {0: [1], 1: [0]}


def _special_files(tmp_path) -> list:
    """A FIFO and, as root, a private character device, both under tmp_path (helpers.special_files)."""
    return special_files(tmp_path, ".safetensors")


def test_q09r8_p10r8_saving_onto_a_device_or_fifo_is_refused_and_leaves_it_in_place(tmp_path):
    """Before: save_quantized / save_pruned wrote a temp file and renamed it onto the path, replacing the device
    node (or FIFO) with a regular file. Now a ValueError naming path, before anything is written."""
    import stat

    pruned = prune_model(MODEL, "magnitude", 0.5)
    for node in _special_files(tmp_path):
        kind = node.lstat().st_mode
        for save in (lambda: save_quantized(QMODEL, node), lambda: save_pruned(pruned, node, "magnitude")):
            with pytest.raises(ValueError, match=r"path .* exists and is not a regular file \(a device, FIFO"):
                save()
            assert stat.S_IFMT(node.lstat().st_mode) == stat.S_IFMT(kind)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left behind


# ----- the eighth hostile run, 10 (and 09): a fine-tune of a pruned model keeps its zeros


def _v4k(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=4096, block_size=16, n_layer=2, n_head=4, n_embd=16)).eval()


def _pruned_v4k(how: str, dense: GPT) -> GPT:
    if how == "mask_heads":
        return mask_heads(dense, {0: [1], 1: [0, 3]})
    calib = torch.randint(0, 4096, (2, 8), generator=torch.Generator().manual_seed(1))
    method, pattern = {"magnitude": ("magnitude", "unstructured"), "wanda": ("wanda", "unstructured"),
                       "2:4": ("magnitude", "2:4")}[how]
    return prune_model(dense, method, 0.5, calib if method == "wanda" else None, pattern)


@pytest.mark.parametrize("how", ["magnitude", "wanda", "2:4", "mask_heads"])
def test_p10r8_recover_keeps_the_zeros_pruning_imposed(how):
    """Before: recover fine-tuned every weight: block sparsity 0.5 -> 0.0 after two steps, masked heads revived."""
    dense = _v4k()
    pruned = _pruned_v4k(how, dense)
    zeros = [w == 0 for w in block_weights(pruned)]
    recovered, losses = recover(pruned, dense, 2, batch_size=1)
    after = block_weights(recovered)
    assert len(losses) == 2 and all(bool((w[z] == 0).all()) for w, z in zip(after, zeros))
    assert weight_sparsity(recovered)["blocks"] == weight_sparsity(pruned)["blocks"]  # "all": zero biases train
    assert any(not torch.equal(a, b) for a, b in zip(after, block_weights(pruned)))  # the kept weights trained
    if how == "2:4":
        assert all(is_nm_sparse(w.detach()) for w in after)
    if how == "mask_heads":  # head h of a block is c_proj's columns h*hs .. (h+1)*hs, hs = 4
        for b, h in ((0, 1), (1, 0), (1, 3)):
            assert not recovered.transformer.h[b].attn.c_proj.weight[:, 4 * h:4 * h + 4].any()


@pytest.mark.parametrize("fake_quant", [True, False])
def test_q09r8_finetune_qat_of_a_pruned_model_keeps_its_zeros(fake_quant):
    """Prune first, then QAT (check_prunable's advice): before, the fine-tune refilled every zero."""
    dense = _v4k()
    pruned = _pruned_v4k("magnitude", dense)
    zeros = [w == 0 for w in block_weights(pruned)]
    net, _ = finetune_qat(pruned, QuantConfig("int8"), steps=2, batch_size=1, fake_quant=fake_quant)
    after = [m.weight for block in net.transformer.h for m in block.modules() if isinstance(m, nn.Linear)]
    assert all(bool((w[z] == 0).all()) for w, z in zip(after, zeros))
    assert any(not torch.equal(a, b) for a, b in zip(after, block_weights(pruned)))
    if fake_quant:  # and the converted model stores those zeros as zero codes
        converted = convert_qat(net)
        deq = [m.dequantized_weight() for block in converted.transformer.h for m in block.modules()
               if isinstance(m, QuantLinear)]
        assert all(bool((w[z] == 0).all()) for w, z in zip(deq, zeros))


def _resaved(path, out, **fields):
    """The saved file at `path` written again to `out` with its metadata `fields` edited (tensors untouched); returns
    the original (metadata, tensors)."""
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(out), metadata={**meta, **fields})
    return meta, tensors


def test_p10r9_describe_verifies_what_it_reports(tmp_path):
    """Before: block_sparsity edited to 0.9000 was reported as 0.9 while load_pruned refused the same file; describe
    now runs the loader's checks, and a flipped weight is its sha256 error."""
    pruned = prune_mlp(MODEL, 0.25, mlp_neuron_scores(MODEL, CALIB))
    good = save_pruned(pruned, tmp_path / "good.safetensors", "mlp 25%", pattern="dense")
    meta, tensors = _resaved(good, tmp_path / "lie.safetensors", block_sparsity="0.9000")
    with pytest.raises(ValueError, match=r"lie\.safetensors.*block sparsity 0\.9000 \(field block_sparsity\) but the weights hold 0\.0000"):
        describe_pruned(tmp_path / "lie.safetensors")
    flipped = dict(tensors, **{"transformer.ln_f.weight": tensors["transformer.ln_f.weight"] + 1})
    save_file(flipped, str(tmp_path / "flip.safetensors"), metadata=meta)
    with pytest.raises(ValueError, match=r"flip\.safetensors.*sha256"):
        describe_pruned(tmp_path / "flip.safetensors")
    assert describe_pruned(good)["block_sparsity"] == 0.0


@pytest.mark.parametrize("kind", ["quantized", "pruned", "plain", "bytes"])
def test_q09r10_p10r10_a_layernorm_eps_the_config_does_not_carry_is_refused_on_save(kind, tmp_path):
    """Before: every format rebuilds its LayerNorms from config.layer_norm_epsilon, so an eps set on a layer after
    construction was dropped on save, and the loaded model's logits differed by up to 0.4 without a word. Now every
    saver (through `model_tensors`) refuses it, naming the LayerNorm; a model whose eps matches its config saves."""
    from minillm.core.checkpoint import save_checkpoint

    model = {"quantized": lambda: quantize_model(MODEL, QuantConfig("int8")),
             "pruned": lambda: prune_mlp(MODEL, 0.25, mlp_neuron_scores(MODEL, CALIB)),
             "plain": lambda: copy.deepcopy(MODEL), "bytes": lambda: copy.deepcopy(MODEL)}[kind]()
    save = {"quantized": lambda m: save_quantized(m, tmp_path / "q.safetensors"),
            "pruned": lambda m: save_pruned(m, tmp_path / "p.safetensors", "mlp 25%", pattern="dense"),
            "plain": lambda m: save_checkpoint(m, tmp_path / "ckpt"), "bytes": model_to_bytes}[kind]
    save(model)  # the model as built: fine
    model.transformer.h[0].ln_1.eps = 0.5
    assert_refused_by_minillm(lambda: save(model), ValueError,
                              r"model's transformer.h.0.ln_1.eps is 0.5 but its config.layer_norm_epsilon is 1e-05")


def test_q09r10_p10r10_savers_refuse_what_their_loaders_would_refuse(tmp_path):
    """Before: a quantized model whose codes were replaced by a float copy, or a pruned model whose c_fc lost its
    bias, was written, and its own loader then refused the file (the model dropped meanwhile was lost). Now each saver
    runs its loader's checks on the tensors first: a ValueError naming the tensor, and no file."""
    q = quantize_model(MODEL, QuantConfig("int8"))
    layer = q.transformer.h[0].attn.c_attn
    layer._buffers["qweight"] = layer.qweight.float()
    assert_refused_by_minillm(lambda: save_quantized(q, tmp_path / "q.safetensors"), ValueError,
                              r"save_quantized: the file would not load back, so nothing was written: .*"
                              r"'transformer.h.0.attn.c_attn.qweight' is torch.float32")
    pruned = prune_mlp(MODEL, 0.25, mlp_neuron_scores(MODEL, CALIB))
    pruned.transformer.h[1].mlp.c_fc.bias = None
    assert_refused_by_minillm(lambda: save_pruned(pruned, tmp_path / "p.safetensors", "mlp 25%", pattern="dense"),
                              ValueError, r"save_pruned: the file would not load back, so nothing was written: .*"
                              r"transformer.h.1.mlp.c_fc.bias")
    assert not list(tmp_path.iterdir())


def test_q09r11_describe_verifies_what_it_reports(tmp_path):
    """Before: quant's describe read the metadata alone and reported an edited 'method' as true while load_quantized
    refused the file; it now runs the loader's checks first, as prune's describe does."""
    good = save_quantized(quantize_model(MODEL, QuantConfig("int8")), tmp_path / "good.safetensors", method="rtn")
    _resaved(good, tmp_path / "lie.safetensors", method="gptq")
    with pytest.raises(ValueError, match=r"lie\.safetensors.*sha256"):
        describe_quantized(tmp_path / "lie.safetensors")
    assert describe_quantized(good)["method"] == "rtn"


@pytest.mark.parametrize("kind, field, value, match", [
    ("pruned", "gpt_config", "[" * 100_000 + "]" * 100_000, r"invalid gpt_config metadata: RecursionError"),
    ("pruned", "mlp_hidden", "[" + "9" * 5000 + "]", r"metadata field mlp_hidden .* is not a JSON list: ValueError"),
    ("quantized", "gpt_config", "[" * 100_000 + "]" * 100_000, r"invalid gpt_config metadata: RecursionError"),
    ("quantized", "quant_config", '{"mode": "int4"}', r"its quant_config .* does not fit its model"),
])
def test_r17_metadata_json_that_json_cannot_read_names_the_file(tmp_path, kind, field, value, match):
    """Seventeenth hostile run: a field nested past json's depth (RecursionError), an int past Python's digit limit
    (json's bare ValueError) or a quant_config the tensors cannot take (int4 with a group size past the width) each
    escaped without naming the file. Now each is a ValueError naming the file and the field (re-signed or not: the
    metadata is read before the digest is compared)."""
    if kind == "pruned":
        good = save_pruned(prune_model(MODEL, "magnitude", 0.5, pattern="2:4"), tmp_path / "good.safetensors", "2:4")
        load = load_pruned
    else:
        good = save_quantized(quantize_model(tiny(), QuantConfig("int8")), tmp_path / "good.safetensors", "rtn")
        load = load_quantized
    with safe_open(str(good), framework="pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta[field] = value
    save_file(tensors, str(tmp_path / "bad.safetensors"), metadata=meta)
    with pytest.raises(ValueError, match=match) as e:
        load(tmp_path / "bad.safetensors")
    assert "bad.safetensors" in str(e.value)


def test_r21_quantize_kv_refuses_float64_values_past_the_float32_range():
    """Before: finite float64 keys past float32's range got an inf scale, all-zero codes and NaN read back, with no
    error (the scales are fp32). Now a ValueError naming x; values within the range still round-trip."""
    with pytest.raises(ValueError, match=r"^x holds values up to \|x\| = 1e\+300, past the float32 range"):
        quantize_kv(torch.tensor([[1e300, -2e299, 3.0, 0.5]], dtype=torch.float64))
    x = torch.tensor([[3e38, -1.0, 2.0, 0.5]], dtype=torch.float64)
    codes, scale = quantize_kv(x)
    assert torch.isfinite(scale).all() and codes[0, 0] == 127
    torch.testing.assert_close(dequantize_kv(codes, scale, torch.float64)[0, 0], x[0, 0], rtol=1e-6, atol=0)


@pytest.mark.parametrize("value", [np.float32(0.5), np.float16(0.5), np.int64(0), Fraction(1, 2)])
def test_r21_a_numpy_or_fraction_number_is_refused_saying_to_convert(value):
    """Before: "sparsity must be a fraction in [0, 1), got np.float32(0.5)" (it is one) and "outlier_threshold must
    be a number, got float32". A number checked here is stored as given (configs, metadata, JSON), so other real
    types are refused, with a message that says the type is the problem and how to convert; np.float64 (a float)
    and the converted value work."""
    with pytest.raises(ValueError, match=r"^sparsity must be a fraction in \[0, 1\) as a Python float, got .*: "
                                         r"convert it with float\(\)"):
        magnitude_mask(W, value)
    with pytest.raises(TypeError, match=r"^outlier_threshold must be a Python int or float, got .*: convert it "
                                        r"with float\(\)"):
        QuantConfig("w8a8", outlier_threshold=value)
    assert torch.equal(magnitude_mask(W, float(value)), magnitude_mask(W, np.float64(float(value))))


def test_r21_head_indices_are_read_as_the_ints_they_hold():
    """Before: an int subclass whose comparisons lie passed the range check of mask_heads (head 5 of 2 heads) and
    masked nothing. Indices are compared as the plain ints they hold."""

    with pytest.raises(ValueError, match=r"^heads\[0\] holds 5: a head index must be an int in \[0, 2\)"):
        mask_heads(MODEL, {0: [LyingInt(5)]})
    with pytest.raises(ValueError, match=r"^heads has a key 7: a block index must be an int in"):
        mask_heads(MODEL, {LyingInt(7): [0]})
    x = torch.tensor([[1, 2, 3]])
    assert torch.equal(mask_heads(MODEL, {0: [LyingInt(1)]})(x)[0], mask_heads(MODEL, {0: [1]})(x)[0])


def test_r21_gptq_errors_and_nm_mask_name_the_argument():
    """Before: NaN inputs to rtn_and_gptq_errors were named as H (built inside), and nm_mask on a width that is not
    a multiple of m named in_features, not the scores it was given."""
    with pytest.raises(ValueError, match=r"^X holds inf or NaN values"):
        rtn_and_gptq_errors(nn.Linear(32, 24), torch.full((64, 32), float("nan")), bits=4)
    with pytest.raises(ValueError, match=r"scores \(4, 6\) has 6 columns \(in_features\), not a multiple of 4"):
        nm_mask(torch.rand(4, 6))


def test_r22_nm_arguments_and_an_overflowing_hessian_are_named():
    """Before: nm_mask(n=np.int64(2)) said "N:M needs integers 0 < n <= m, got n=np.int64(2)" (it is one), and a
    finite X whose XᵀX overflows float64 was named as the Hessian H, which the caller never passed."""
    s = torch.rand(4, 8)
    for kwargs, name in ((dict(n=np.int64(2)), "n"), (dict(m=np.int32(4)), "m")):
        with pytest.raises(TypeError, match=rf"^{name} must be a Python int, got .*: convert it with int\(\)"):
            nm_mask(s, **kwargs)
        with pytest.raises(TypeError, match=rf"^{name} must be a Python int"):
            is_nm_sparse(s, **kwargs)
    with pytest.raises(ValueError, match=r"^N:M needs integers 0 < n <= m, got n=5, m=4"):
        nm_mask(s, n=5, m=4)
    with pytest.raises(ValueError, match=r"^X's values are too large \(max \|x\| = .*\): XᵀX / N"):
        rtn_and_gptq_errors(nn.Linear(8, 4).double(), torch.randn(16, 8, dtype=torch.float64) * 1e200, bits=4)

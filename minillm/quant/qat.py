"""Quantization-aware training (QAT): fine-tune with the weights rounded in the forward pass, so the model learns
weights that survive the rounding; then store them with the same grid, exactly.

What it adds: `fake_quantize` (forward: deq(q(w)); backward: the identity, the straight-through estimator of Bengio
et al. 2013, as used by Jacob et al. 2018), `FakeQuantLinear` (an `nn.Linear` whose forward uses the fake-quantized
weight), `prepare_qat(model, config)` (a trainable copy with them swapped in), `finetune_qat` (a short AdamW run on
training windows) and `convert_qat` (the trained weights rounded for real, on the grid each layer trained with, by
the same function `qat_codes` the forward rounds with: a `QuantizedGPT` whose forward equals the fake-quantized
model's). `keeping_zeros` keeps a pruned model's zeros through a fine-tune (this one and chapter 10's `recover`).

    forward   y = x @ ŵ^T + b,    ŵ = s * round(w / s)      (s from the current w, not trained)
    backward  ∂L/∂w := ∂L/∂ŵ                                  (round has gradient 0 almost everywhere; STE skips it)

Post-training quantization (RTN, GPTQ) rounds a finished model and at best compensates the error in each layer;
QAT lets every later layer and the loss itself adapt. What it leaves out: learned scales (LSQ, Esser et al. 2020),
fake-quantized activations (QAT for W8A8), the tied embedding/head (kept fp32), and distillation from the fp32 model.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.core.config import check_float_tensor, check_linear_args, check_linear_input, tensor_kind
from minillm.core.model import GPT
from minillm.gpt.finetune import short_finetune
from minillm.quant.linear import QuantConfig, QuantizedGPT, check_fp32_model, quantize_model
from minillm.quant.quantize import QuantizedTensor, dequantize, quantize


def qat_codes(w: torch.Tensor, config: QuantConfig) -> QuantizedTensor:
    """The codes and scales of w on `config`'s grid: what `fake_quantize` rounds to and what `convert_qat` stores.

    One function for both, so the converted model multiplies by exactly the weights the training forward used."""
    _check(config)
    check_float_tensor("w", w)  # a float dtype torch computes in, holding values
    if w.dim() != 2:  # quantize would name its own `x` (a 0-d w), or give a 1-D w one scale per element
        raise ValueError(f"w must be a weight matrix (out, in), got shape {tuple(w.shape)}")
    if not bool(torch.isfinite(w.detach()).all()):
        raise ValueError("w holds NaN or inf values (training diverged?): they have no integer code")
    return quantize(w.detach(), config.bits, config.symmetric, config.granularity, config.quantize_group_size)


def fake_quantize(w: torch.Tensor, config: QuantConfig) -> torch.Tensor:
    """deq(q(w)) in the forward pass, with the gradient of the identity: w + (deq(q(w)) - w).detach()."""
    with torch.no_grad():
        w_hat = dequantize(qat_codes(w, config)).to(w.dtype)
    # BEGIN SOLUTION
    return w + (w_hat - w).detach()  # value w_hat; d/dw = 1 (the straight-through estimator)
    # END SOLUTION


class FakeQuantLinear(nn.Linear):
    """An nn.Linear (same parameters, same state dict) that multiplies by its fake-quantized weight."""

    qat_config: QuantConfig

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: Any = None,
                 dtype: torch.dtype | None = None) -> None:
        """nn.Linear's, with its arguments checked (`check_linear_args`: plain positive sizes, a weight within
        MAX_TENSOR_ELEMENTS, a bool bias, a device and dtype it can allocate), before torch's allocator would refuse
        them naming nothing."""
        super().__init__(*check_linear_args(in_features, out_features, bias, device, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in_features) of the weight's dtype and device -> (..., out_features); a TypeError / ValueError
        naming x otherwise (host-only checks)."""
        config = getattr(self, "qat_config", None)  # set by prepare_qat: a layer built by hand has none
        if not isinstance(config, QuantConfig):
            raise ValueError(f"this FakeQuantLinear has no qat_config (a QuantConfig), got {type(config).__name__}: "
                             "build the layers with prepare_qat(model, config), or set layer.qat_config")
        check_linear_input(x, self.in_features)
        if x.device != self.weight.device or (x.dtype != self.weight.dtype
                                               and not torch.is_autocast_enabled(x.device.type)):
            raise TypeError(f"x is {x.dtype} on {x.device} but the layer's weight is {self.weight.dtype} on "
                            f"{self.weight.device}; cast or move x (or the model) first")
        return F.linear(x, fake_quantize(self.weight, self.qat_config), self.bias)


def _check(config: QuantConfig) -> None:
    if not isinstance(config, QuantConfig):
        raise TypeError(f"config must be a QuantConfig, got {type(config).__name__}")
    if config.mode == "w8a8" or config.quantize_head:
        raise ValueError("QAT here fake-quantizes the block weights only: use mode 'int8' or 'int4' without "
                         f"quantize_head, got {config!r}")


def prepare_qat(model: GPT, config: QuantConfig) -> GPT:
    """A trainable copy of `model` whose block linears are `FakeQuantLinear`s of `config`'s grid."""
    check_fp32_model(model, "prepare_qat")
    _check(config)
    for name, m in model.transformer.h.named_modules():
        if isinstance(m, FakeQuantLinear):
            raise ValueError(f"the model is already prepared for QAT (layer {name}); prepare the fp32 model")
        if type(m) is nn.Linear:  # the grid must fit now, not at the first training step
            if config.mode == "int4" and m.in_features % config.group_size:
                raise ValueError(f"group_size={config.group_size} does not divide in_features={m.in_features} of "
                                 f"layer {name}")
            if not bool(torch.isfinite(m.weight.detach()).all()):
                raise ValueError(f"layer {name} holds NaN or inf weights")
    out = copy.deepcopy(model)
    for m in out.transformer.h.modules():
        if type(m) is nn.Linear:
            m.__class__ = FakeQuantLinear  # same parameters; only forward changes
            m.qat_config = config
    return out


def convert_qat(model: GPT, config: QuantConfig | None = None) -> QuantizedGPT:
    """The QAT model's weights rounded for real: a QuantizedGPT whose forward is the fake-quantized model's.

    The grid is the one each `FakeQuantLinear` trained with (its `qat_config`), and the codes are `qat_codes` of
    its weight, the very values its forward multiplied by. `config` may be left out; given, it must be that grid
    (a different one would store weights the model never trained with: a ValueError, not a silently worse model).
    """
    if not isinstance(model, GPT) or isinstance(model, QuantizedGPT):
        raise TypeError(f"convert_qat needs a model from prepare_qat, got {type(model).__name__}")
    check_fp32_model(model, "convert_qat")  # a model cast to bf16 after prepare_qat: named here, not in a QuantLinear
    fake = [(name, m) for name, m in model.transformer.h.named_modules() if isinstance(m, FakeQuantLinear)]
    if not fake:
        raise TypeError("convert_qat needs a model from prepare_qat (its block linears FakeQuantLinear); this one "
                        "has none: quantize a plain model with quantize_model")
    trained = {m.qat_config for _, m in fake}
    if len(trained) != 1:
        raise ValueError(f"the model's layers trained on different grids {sorted(map(repr, trained))}")
    trained_config = trained.pop()
    if config is not None:
        _check(config)
        if config != trained_config:
            raise ValueError(f"config {config!r} is not the grid the model trained with ({trained_config!r}); "
                             "convert with that one (or leave config out)")
    plain = copy.deepcopy(model)
    weights = {name: qat_codes(m.weight, trained_config) for name, m in fake}
    for m in plain.transformer.h.modules():
        if isinstance(m, FakeQuantLinear):
            m.__class__ = nn.Linear
            del m.qat_config
    return quantize_model(plain.eval(), trained_config, weights)


@contextlib.contextmanager
def keeping_zeros(weights: list[torch.Tensor]) -> Iterator[None]:
    """Inside the block, every exact zero of `weights` (a pruned model's masks) stays zero through training.

    A zero gets no gradient (a tensor hook), so AdamW without weight decay (`short_finetune`'s) never moves it: its
    averages of the gradient stay 0, and so does its step. On leaving, the zeros are written again, whatever the
    optimizer did. subtle: a plain fine-tune refills them (a 50%-sparse model is dense after two steps) and brings
    masked attention heads back. masked_fill, not g * mask: a NaN gradient times 0 is NaN. `weights` must be a list
    (or tuple) of floating-point tensors that require grad (a model's parameters): a TypeError naming the one that
    is not, on entering the block."""
    if not isinstance(weights, (list, tuple)):
        raise TypeError(f"weights must be a list of the model's weight tensors, got {tensor_kind(weights)}")
    for i, w in enumerate(weights):
        if isinstance(w, torch.Tensor) and w.is_floating_point() and w.requires_grad:
            continue
        got = (f"a {w.dtype} tensor with requires_grad={w.requires_grad}" if isinstance(w, torch.Tensor)
               else tensor_kind(w))
        raise TypeError(f"weights[{i}] must be a floating-point tensor that requires grad (a parameter being "
                        f"trained), got {got}")
    zeros = [(w, w.detach() == 0) for w in weights]  # each shaped like its weight: True where pruned
    hooks = [w.register_hook(lambda g, z=z: g.masked_fill(z, 0.0)) for w, z in zeros]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for w, z in zeros:
                w.masked_fill_(z, 0.0)


def finetune_qat(model: GPT, config: QuantConfig, steps: int = 30, batch_size: int = 4, lr: float = 2e-5,
                 seed: int = 0, fake_quant: bool = True, distill: bool = False) -> tuple[GPT, list[float]]:
    """(trained copy, loss per step): `steps` AdamW steps on random training windows (`minillm.gpt.dataset`).

    The loss is the next-token cross-entropy, or with `distill` the KL divergence from the fp32 model's own
    predictions on the same windows (KL(p_fp32 ‖ p_qat)): the target is then "behave like the model you were",
    not "fit the training text better", which a model already trained on that text can only overfit.
    `fake_quant=False` runs the same fine-tune in fp32: the control that separates what QAT gains from what a few
    more steps of training do by themselves. A pruned model stays pruned: the exact zeros of the block linears'
    weights are kept (`keeping_zeros`), so prune, then fine-tune with QAT, then convert.
    """
    for name, flag in (("fake_quant", fake_quant), ("distill", distill)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    if not isinstance(config, QuantConfig):  # also for the fp32 control, which never reads it: a typo is still one
        raise TypeError(f"config must be a QuantConfig, got {type(config).__name__}")
    net = prepare_qat(model, config) if fake_quant else copy.deepcopy(model)
    with keeping_zeros([m.weight for m in net.transformer.h.modules() if isinstance(m, nn.Linear)]):
        losses = short_finetune(net, steps, batch_size, lr, seed, teacher=model if distill else None)
    return net, losses

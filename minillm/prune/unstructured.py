"""Unstructured and N:M pruning of a whole model: zero weights of every block linear by magnitude or by Wanda.

What it adds: `input_norms(block, x)` (the L2 norm of every input feature of each of a block's linears over the
calibration tokens, collected with forward pre-hooks), `prune_model(model, method, sparsity, calibration)` (a copy
with the masks applied) and `weight_sparsity(model)`.

    for each block b, in order:
        X_b  = the calibration activations entering block b, through blocks 0..b-1 *already pruned*
        ‖X_j‖ for the input features of c_attn, attn.c_proj, c_fc, mlp.c_proj  (one forward of block b)
        mask each linear (per-matrix magnitude, per-row Wanda, or 2:4 of either score), zero the rest
        X_b+1 = block b (pruned)(X_b)

Pruning block by block, each block calibrated on what the pruned blocks before it produce, is the procedure of the
Wanda reference implementation (and of SparseGPT and GPTQ); magnitude pruning needs no calibration at all. The
embedding, the tied output head, LayerNorms and biases stay dense: they are a small share of the weights here
except the head (4096 × 256, a quarter of `base`), which the chapter keeps dense as both papers do.

A pruned model is an ordinary `GPT` whose weights hold exact zeros, so every generator and the engine run it
unchanged, and at exactly the dense model's speed: dense kernels multiply the zeros too. Turning zeros into time
needs a sparse format and a kernel that skips them (2:4 on a GPU: `minillm.prune.semi_structured`; CSR on the CPU
in the benchmark's layer table). What it leaves out: SparseGPT's weight update, non-uniform sparsity per layer.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from minillm.core.config import check_choice, check_has_data, check_module_has_data, short_repr, tensor_kind
from minillm.core.model import GPT
from minillm.prune.masks import check_keeps_one, check_sparsity, magnitude_mask, nm_mask, per_row_mask, wanda_score
from minillm.quant.gptq import check_calibration
from minillm.quant.linear import QuantizedGPT

METHODS = ("magnitude", "wanda")
PATTERNS = ("unstructured", "2:4")


def block_linears(block: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The four linears of a block, by name within it: attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj (every
    nn.Linear of any module; a TypeError naming `block` for anything that is not a torch module)."""
    if not isinstance(block, nn.Module):
        raise TypeError(f"block must be a torch module (a transformer block), got {tensor_kind(block)}")
    return [(name, m) for name, m in block.named_modules() if isinstance(m, nn.Linear)]


@torch.no_grad()
def input_norms(block: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """{linear name: ‖X_j‖₂ (in,)}: the L2 norm of each input feature of each linear of `block`, over every token of
    x (N, T, C), from one forward of the block (pre-hooks see each linear's input). Sums of squares in float64."""
    if not isinstance(block, nn.Module) or not block_linears(block):
        raise TypeError(f"block must be a module holding nn.Linear layers, got {type(block).__name__}")
    # subtle: a ModuleList has no forward, and a whole GPT takes token ids, not activations (it names idx)
    if isinstance(block, GPT) or type(block).forward is nn.Module.forward:
        raise TypeError(f"block must be one module that runs activations x (N, T, C), e.g. model.transformer.h[0], "
                        f"got {type(block).__name__}")
    # check_has_data first: a meta x would run the block and hand back norms without values; a nested one has no shape
    if (not isinstance(x, torch.Tensor) or not check_has_data("x", x).is_floating_point() or x.dim() != 3
            or x.numel() == 0):
        raise ValueError(f"x must be a non-empty float tensor (N, T, C), got {tensor_kind(x)} "
                         f"{tuple(getattr(x, 'shape', ()))}")
    weight = next(block.parameters())  # a block_linears weight at least: there is one
    if x.dtype != weight.dtype:
        raise TypeError(f"x must have the block's dtype {weight.dtype}, got {x.dtype}; cast x (or the block) first")
    # The width the block takes: its first LayerNorm's (a GPT block's ln_1), else its first linear's input.
    first = next(m for m in block.modules() if isinstance(m, (nn.LayerNorm, nn.Linear)))
    width = first.normalized_shape[-1] if isinstance(first, nn.LayerNorm) else first.in_features
    if x.shape[-1] != width:
        raise ValueError(f"x must have width C = {width}, the block's input width, got shape {tuple(x.shape)}")
    sums: dict[str, torch.Tensor] = {}

    def collect(name: str):
        def hook(_module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            a = inputs[0].reshape(-1, inputs[0].shape[-1]).double()  # (tokens, in)
            sums[name] = sums.get(name, 0) + (a * a).sum(0)
        return hook

    handles = [m.register_forward_pre_hook(collect(name)) for name, m in block_linears(block)]
    try:
        block(x)
    finally:
        for h in handles:
            h.remove()
    return {name: s.sqrt().float() for name, s in sums.items()}


def check_pattern_sparsity(pattern: object, sparsity: object) -> None:
    """A ValueError naming the value unless `pattern` is one of PATTERNS and `sparsity` a fraction in [0, 1) that the
    pattern can honour: 2:4 removes exactly 2 of every 4 weights, so with it only 0.5 (the default)."""
    pattern = check_choice("pattern", pattern, PATTERNS)
    sparsity = check_sparsity(sparsity)
    if pattern == "2:4" and sparsity != 0.5:  # 2:4 removes exactly 2 of every 4: a sparsity of 2/4, no other
        raise ValueError(f"sparsity={short_repr(sparsity)} cannot apply to pattern='2:4', which removes exactly 2 of "
                         "every 4 weights (sparsity 0.5); leave sparsity at its default 0.5")


def layer_mask(weight: torch.Tensor, method: str, sparsity: float, pattern: str,
               norm: torch.Tensor | None) -> torch.Tensor:
    """The keep-mask of one weight (out, in): method's score, compared over the pattern's group."""
    method = check_choice("method", method, METHODS)
    check_pattern_sparsity(pattern, sparsity)  # 2:4 reads no sparsity, so a wrong one is refused, never ignored
    if method == "wanda" and norm is None:
        raise ValueError("Wanda needs norm, the input features' L2 norms (in,); got None")
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise TypeError(f"weight must be a floating-point tensor, got {tensor_kind(weight)}")
    scores = weight.abs() if method == "magnitude" else wanda_score(weight, norm)
    if pattern == "2:4":
        return nm_mask(scores, 2, 4)
    if method == "magnitude":
        return magnitude_mask(weight, sparsity)  # the whole matrix is one comparison group
    return per_row_mask(scores, sparsity)  # Wanda compares within each output row


def block_weights(model: nn.Module) -> list[torch.Tensor]:
    """The weights of every block linear, block by block (the tensors themselves, not copies), of a dense GPT
    (`check_prunable`: a quantized model has no nn.Linear, and would give [] without a word)."""
    check_prunable(model, "block_weights")
    return [lin.weight for block in model.transformer.h for _, lin in block_linears(block)]


# `check_calibration(model, calibration, who)` (imported above) is chapter 09's, shared with GPTQ: int64 ids (N, T),
# N, T >= 1, T <= block_size, every id in the vocabulary; a TypeError/ValueError naming what is wrong.


def check_prunable(model: object, who: str) -> GPT:
    """`model` if it is a dense minillm GPT whose blocks hold plain nn.Linear layers; a TypeError naming its type, or
    the layer and its type, if not.

    subtle: a QuantizedGPT is a GPT, but its block layers are QuantLinear (integer codes, no `weight`): the pruning
    loops would find no nn.Linear and hand back an unpruned copy. A layer pruned with torch.nn.utils.prune holds its
    weight as weight_orig x weight_mask, recomputed before each forward: a TypeError naming it too. A model prepared for QAT holds FakeQuantLinear, an
    nn.Linear subclass that rounds its weight in forward: a pruned file would load it back as a plain GPT, without
    the rounding. Prune first, then quantize (or prepare for QAT)."""
    if isinstance(model, QuantizedGPT):
        raise TypeError(f"{who} needs a dense (float) minillm GPT, got a {type(model).__name__} "
                        f"({model.quant_config.mode}): prune the fp32 model, then quantize it")
    if not isinstance(model, GPT):
        raise TypeError(f"{who} needs a minillm GPT, got {type(model).__name__}")
    check_module_has_data(f"{who}: model", model)  # a model on the meta device has no weights to score
    for b, block in enumerate(model.transformer.h):
        odd = [f"{name} ({type(m).__name__})" for name, m in block.named_modules()
               if hasattr(m, "qweight") or (isinstance(m, nn.Linear) and type(m) is not nn.Linear)]
        if odd or not block_linears(block):
            raise TypeError(f"{who} needs block linears as plain nn.Linear; block {b} holds {odd or 'none'} "
                            f"({type(model).__name__}): prune the fp32 model, then quantize it or prepare it for QAT")
        # torch.nn.utils.prune leaves `weight` a computed tensor (weight_orig * weight_mask, not a Parameter), which
        # copy.deepcopy cannot copy and this chapter's masks would not see
        hooked = [name for name, lin in block_linears(block) if not isinstance(lin.weight, nn.Parameter)]
        if hooked:
            raise TypeError(f"{who} needs each block linear's weight as a Parameter; block {b}'s {hooked[0]} weight "
                            "is re-parametrised (torch.nn.utils.prune's weight_orig x weight_mask): make it permanent "
                            "first with torch.nn.utils.prune.remove(layer, 'weight')")
    return model


def block_inputs(model: GPT, calibration: torch.Tensor):
    """Yield (block, x) for each block in order, x (N, T, C) the calibration activations entering it.

    x for block b+1 is computed from block b when the caller asks for the next pair, so a caller that changes
    block b in between (pruning, quantizing it) feeds block b+1 what the changed block produces. The calibration is
    checked at the call (`check_calibration`), not at the first `next`."""
    calibration = check_calibration(model, calibration, "block_inputs")
    return _block_inputs(model, calibration)


def _block_inputs(model: GPT, calibration: torch.Tensor):
    """`block_inputs` after its checks: the generator itself."""
    positions = torch.arange(calibration.size(1), device=calibration.device)
    x = model.transformer.wte(calibration) + model.transformer.wpe(positions)  # (N, T, C)
    for block in model.transformer.h:
        yield block, x
        x = block(x)


def _check_args(model: object, method: object, sparsity: object, pattern: object,
                calibration: object) -> None:
    check_prunable(model, "prune_model")
    method = check_choice("method", method, METHODS)
    check_pattern_sparsity(pattern, sparsity)
    if pattern == "unstructured":
        for b, block in enumerate(model.transformer.h):  # no matrix (magnitude) or row (Wanda) may go to all zeros
            for name, lin in block_linears(block):
                group = lin.weight.numel() if method == "magnitude" else lin.in_features
                check_keeps_one(group, sparsity, f"{'layer' if method == 'magnitude' else 'each row of'} {b}.{name}")
    if method == "wanda" or calibration is not None:  # magnitude ignores it, but never junk given by mistake
        check_calibration(model, calibration, "Wanda" if method == "wanda" else "prune_model")


@torch.no_grad()
def prune_model(model: GPT, method: str, sparsity: float = 0.5, calibration: torch.Tensor | None = None,
                pattern: str = "unstructured") -> GPT:
    """A pruned copy of `model` (eval mode; `model` is untouched): every block linear's weight masked.

    method: "magnitude" (|W|, per matrix) or "wanda" (|W| · ‖X‖, per output row; needs `calibration` ids (N, T)).
    Magnitude pruning reads no calibration; one given anyway (a loop passing the same arguments to both methods) is
    still checked as Wanda's would be, so a wrong argument is an error, never silently dropped.
    pattern: "unstructured" (remove `sparsity` of each matrix) or "2:4" (keep 2 of every 4 inputs: a sparsity of
    exactly 0.5 by construction, so `sparsity` must be left at 0.5; any other value is a ValueError naming it, as
    the pattern could not honour it). A sparsity that would remove every weight of a matrix (magnitude) or of a row
    (Wanda), e.g. 0.999 of a 512-wide row, is a ValueError: that layer or output would go silent.
    """
    _check_args(model, method, sparsity, pattern, calibration)
    out = copy.deepcopy(model).eval()
    if method == "wanda":  # each block measured on what the blocks before it, already pruned, produce
        walk = ((block, input_norms(block, x)) for block, x in block_inputs(out, calibration.to(out.device)))
    else:
        walk = ((block, {}) for block in out.transformer.h)
    for block, norms in walk:
        for name, lin in block_linears(block):
            lin.weight.mul_(layer_mask(lin.weight, method, sparsity, pattern, norms.get(name)))
    return out


def weight_sparsity(model: nn.Module) -> dict[str, float]:
    """{"blocks": share of zeros over every block linear weight, "all": over every parameter (the head once)}."""
    check_prunable(model, "weight_sparsity")
    linears = block_weights(model)
    zeros = sum(int((w == 0).sum()) for w in linears)
    total = sum(w.numel() for w in linears)
    params = list(model.parameters())  # parameters() yields the tied head/embedding once
    all_zeros = sum(int((p == 0).sum()) for p in params)
    return {"blocks": zeros / total, "all": all_zeros / sum(p.numel() for p in params)}

"""Structured pruning: remove whole MLP neurons (and, as a study, whole attention heads), so the matrices shrink.

What it adds:
  - `mlp_neuron_scores(model, calibration)`: per block, the importance of each of the 4C hidden neurons of the MLP,
    s_j = ‖h_j‖₂ · ‖W_proj[:, j]‖₂, with h_j neuron j's activation (after GELU) over every calibration token. Neuron
    j adds h_j · W_proj[:, j] to the residual stream, so s_j bounds how much it moves the block's output: Wanda's
    |W|·‖X‖ score with a whole column of c_proj as the weight.
  - `prune_mlp(model, fraction, scores)`: a copy with the lowest-scoring `fraction` of each block's neurons *removed*:
    c_fc (C → 4C) becomes C → k and c_proj (4C → C) becomes k → C, k = 4C - round(fraction · 4C). The forward is the
    dense model's with those neurons' outputs set to zero, computed by matmuls 1 - fraction the size. Every cache,
    generator and the engine run it unchanged: the MLP touches no cache.
  - `recover(pruned, teacher, steps)`: a short fine-tune of the pruned model towards the dense one's predictions
    (KL from the teacher, `minillm.gpt.finetune`), which wins back much of what pruning cost. Weights pruned to
    zero (masks, masked heads) stay zero: only the kept ones are trained.
  - `head_scores` / `mask_heads` / `prune_heads`: the same idea for attention heads: head h of a block adds
    y_h W_proj,hᵀ to the stream (its hs columns of c_proj), scored by the norm of that contribution; `mask_heads`
    zeroes those columns, which is exactly the function of a model without the head, and `prune_heads` removes the
    head for real (its rows of q, k and v in c_attn, its columns of c_proj, and its share of the KV cache).

          c_fc.weight (4C, C)       c_proj.weight (C, 4C)             after pruning neurons {1, 4}
          row j  = neuron j's input  column j = neuron j's output      c_fc rows {1, 4} and c_proj columns {1, 4} gone

What it leaves out: a different number of heads per block (the KV caches of chapters 04-07 hold one head count for
every layer, so `prune_heads` removes the same number from each), and pruning layers, width (C) and the embedding
(Minitron, Sheared-LLaMA).
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
import torch.nn as nn

from minillm.core.config import (check_float, check_has_data, check_int, check_module_has_data, plain_int, short_repr,
                                 tensor_kind)
from minillm.core.model import GPT, require_model
from minillm.core.sampling import check_seed
from minillm.gpt.dataset import split_tokens
from minillm.gpt.finetune import check_steps, short_finetune
from minillm.prune.masks import check_keeps_one, check_sparsity, lowest_k_mask, num_pruned
from minillm.prune.unstructured import block_inputs, block_weights, check_calibration, check_prunable, input_norms
from minillm.quant.qat import keeping_zeros


def _check_model(model: object, who: str) -> GPT:
    return check_prunable(model, who)  # a dense GPT: a QuantizedGPT has no nn.Linear to shrink or score


def _check_heads(model: GPT, heads: object) -> dict[int, list[int]]:
    """heads {block: [head, ...]} as a dict of plain ints: keys in [0, n_layer), lists of distinct heads in
    [0, n_head), numpy ints taken as ints; bool is no index. Every error names heads. All of a block's heads may be
    listed: masking them all is the ablation "this block without attention" (its output is c_proj's bias), which
    `mask_heads` allows and `prune_heads` refuses (it keeps one head)."""
    L, nh = model.config.n_layer, model.config.n_head
    if not isinstance(heads, dict):
        raise TypeError(f"heads must be a dict {{block: [head, ...]}}, got {type(heads).__name__}")
    out: dict[int, list[int]] = {}
    for key, hh in heads.items():
        b = plain_int(key)  # numpy ints count; an int subclass's own comparisons are never consulted
        if b is None or not 0 <= b < L:
            raise ValueError(f"heads has a key {short_repr(key)}: a block index must be an int in [0, {L})")
        if not isinstance(hh, (list, tuple)):
            raise TypeError(f"heads[{b}] must be a list of head indices, got {type(hh).__name__}")
        plain = [plain_int(h) for h in hh]
        for h, p in zip(hh, plain):
            if p is None or not 0 <= p < nh:
                raise ValueError(f"heads[{b}] holds {short_repr(h)}: a head index must be an int in [0, {nh})")
        if len(set(plain)) != len(plain):
            raise ValueError(f"heads[{b}] lists a head twice: {plain}")
        out[b] = plain  # type: ignore[assignment]
    return out


def mlp_widths(model: GPT) -> list[int]:
    """The hidden width of each block's MLP (4C for a dense model); a TypeError for anything but a minillm GPT."""
    require_model(model, "mlp_widths")
    return [block.mlp.c_fc.out_features for block in model.transformer.h]


@torch.no_grad()
def mlp_neuron_scores(model: GPT, calibration: torch.Tensor) -> list[torch.Tensor]:
    """Per block, (hidden,) scores s_j = ‖h_j‖₂ · ‖W_proj[:, j]‖₂ over the calibration ids (N, T)."""
    _check_model(model, "mlp_neuron_scores")
    idx = check_calibration(model, calibration)
    scores = []
    was_training = model.training
    try:  # scored without dropout; the caller's model is handed back in the mode it came in
        for block, x in block_inputs(model.eval(), idx):
            h_norm = input_norms(block, x)["mlp.c_proj"]  # (hidden,): the norm of each neuron's activation
            scores.append(h_norm * block.mlp.c_proj.weight.norm(dim=0))  # (hidden,)
    finally:
        model.train(was_training)
    return scores


def _shrunk(lin: nn.Linear, keep: torch.Tensor, dim: int) -> nn.Linear:
    """A new nn.Linear holding only the rows (dim 0: outputs) or columns (dim 1: inputs) listed in keep."""
    w = lin.weight.detach().index_select(dim, keep)
    out = nn.Linear(w.shape[1], w.shape[0], bias=lin.bias is not None, device=w.device, dtype=w.dtype)
    out.weight.data.copy_(w)
    if lin.bias is not None:
        out.bias.data.copy_(lin.bias.detach() if dim == 1 else lin.bias.detach().index_select(0, keep))
    return out


def shrink_mlp(model: GPT, keep: list[torch.Tensor]) -> GPT:
    """A copy of `model` whose block b MLP keeps only the neurons listed in keep[b] (sorted int64 indices)."""
    _check_model(model, "shrink_mlp")
    if not isinstance(keep, (list, tuple)) or len(keep) != model.config.n_layer:
        raise ValueError(f"keep must list one index tensor per block ({model.config.n_layer}), got {short_repr(keep)}")
    out = copy.deepcopy(model)
    for b, (block, idx) in enumerate(zip(out.transformer.h, keep)):
        width = block.mlp.c_fc.out_features
        if not isinstance(idx, torch.Tensor) or idx.dim() != 1 or idx.dtype != torch.int64 or idx.numel() == 0:
            raise ValueError(f"keep[{b}] must be a non-empty 1-D int64 tensor of neuron indices")
        check_has_data(f"keep[{b}]", idx)
        if bool((idx < 0).any() | (idx >= width).any()) or idx.unique().numel() != idx.numel():
            raise ValueError(f"keep[{b}] must list distinct neurons in [0, {width}), got {idx.tolist()[:8]}...")
        idx = idx.sort().values.to(block.mlp.c_fc.weight.device)
        block.mlp.c_fc = _shrunk(block.mlp.c_fc, idx, 0)  # (k, C): neuron j's input weights are row j
        block.mlp.c_proj = _shrunk(block.mlp.c_proj, idx, 1)  # (C, k): neuron j's output weights are column j
    return out


def prune_mlp(model: GPT, fraction: float, scores: list[torch.Tensor]) -> GPT:
    """A copy with the lowest-scoring `fraction` of every block's MLP neurons removed (the same share per block)."""
    _check_model(model, "prune_mlp")
    fraction = check_sparsity(fraction, "fraction")
    widths = mlp_widths(model)
    if not isinstance(scores, (list, tuple)) or any(not isinstance(s, torch.Tensor) for s in scores) \
            or [tuple(check_has_data(f"scores[{b}]", s).shape) for b, s in enumerate(scores)] \
            != [(w,) for w in widths]:
        raise ValueError(f"scores must hold one (hidden,) tensor per block, hidden = {widths}")
    for b, s in enumerate(scores):
        if not s.is_floating_point() or not bool(torch.isfinite(s).all()):
            raise ValueError(f"scores[{b}] must hold finite float scores, got {s.dtype} with non-finite values "
                             "or an integer dtype")
    for b, width in enumerate(widths):  # a fraction that rounds to every neuron (0.999 of 128) would empty the MLP
        check_keeps_one(width, fraction, f"block {b}'s MLP ({width} neurons)", "fraction")
    keep = [lowest_k_mask(s, num_pruned(s.numel(), fraction)).nonzero().flatten() for s in scores]
    return shrink_mlp(model, keep)


def recover(pruned: GPT, teacher: GPT, steps: int, batch_size: int = 4, lr: float = 1e-4, seed: int = 0
            ) -> tuple[GPT, list[float]]:
    """(a fine-tuned copy of `pruned`, loss per step): KL to the dense `teacher` on training windows.

    The KL compares the two models' distributions token by token over windows of `pruned`'s context, so the teacher
    must share the student's vocabulary (vocab_size) and see windows that long (block_size at least the student's);
    otherwise a ValueError naming both values, before any step runs. So is a `pruned` whose vocabulary does not
    hold every id of the training split, and a `seed` torch cannot take (`check_seed`).

    The zeros pruning imposed stay zeros (`keeping_zeros`): every exact zero of a block linear's weight (an
    unstructured, 2:4 or Wanda mask, `mask_heads`' columns) gets no gradient, so AdamW (no weight decay) never moves
    it. The sparsity and the masked heads come back as they went in; only the kept weights are fine-tuned.
    (`prune_mlp` / `prune_heads` models have nothing to keep: those weights are gone.)"""
    _check_model(pruned, "recover")
    steps = check_steps(steps)  # short_finetune's checks, in its order, before the vocabulary check below
    batch_size = check_int("batch_size", batch_size)
    lr = check_float("lr", lr, 0.0, include_minimum=False)
    seed = check_seed(seed)  # short_finetune's sampler would overflow past 2**64, naming no argument
    if not isinstance(teacher, GPT):  # any GPT may teach (a quantized one too): it is only run, never changed
        raise TypeError(f"recover needs a minillm GPT teacher, got {type(teacher).__name__}")
    s, t = pruned.config, teacher.config
    if t.vocab_size != s.vocab_size:
        raise ValueError(f"teacher has vocab_size={t.vocab_size} but pruned has vocab_size={s.vocab_size}: the KL "
                         "compares distributions over one vocabulary")
    if t.block_size < s.block_size:
        raise ValueError(f"teacher has block_size={t.block_size}, shorter than pruned's block_size={s.block_size}: "
                         "the teacher could not score the student's training windows")
    check_module_has_data("recover: teacher", teacher)
    top = int(split_tokens("train").max())  # short_finetune checks it too, but names its own `net`
    if top >= s.vocab_size:
        raise ValueError(f"pruned has vocab_size={s.vocab_size}, but the training split holds token ids up to {top}: "
                         "recover fine-tunes on it, so it needs a model of the shipped tokenizer's vocabulary")
    net = copy.deepcopy(pruned)
    was_training = teacher.training
    # subtle: a plain fine-tune refills every zero (sparsity 0.5 -> 0.0 in two steps) and revives masked heads
    try:  # short_finetune runs the teacher in eval mode; the caller's teacher is handed back in the mode it came in
        with keeping_zeros(block_weights(net)):
            return net, short_finetune(net, steps, batch_size, lr, seed, teacher=teacher)
    finally:
        teacher.train(was_training)


@torch.no_grad()
def head_scores(model: GPT, calibration: torch.Tensor) -> torch.Tensor:
    """(n_layer, n_head): ‖y_h W_proj,hᵀ‖_F, the norm of each head's contribution to the stream over the ids."""
    _check_model(model, "head_scores")
    idx = check_calibration(model, calibration)
    nh, hs = model.config.n_head, model.config.head_size
    out = []
    was_training = model.training
    try:  # scored without dropout; the caller's model is handed back in the mode it came in
        for block, x in block_inputs(model.eval(), idx):
            seen: list[torch.Tensor] = []
            handle = block.attn.c_proj.register_forward_pre_hook(lambda _m, inp: seen.append(inp[0]))
            try:
                block(x)
            finally:
                handle.remove()
            y = seen[0].reshape(-1, nh, hs)  # (tokens, nh, hs): the heads side by side, before c_proj
            w = block.attn.c_proj.weight.view(-1, nh, hs)  # (C, nh, hs): each head's hs columns
            out.append(torch.stack([torch.linalg.matrix_norm(y[:, h] @ w[:, h].T) for h in range(nh)]))
    finally:
        model.train(was_training)
    return torch.stack(out)  # (L, nh)


def mask_heads(model: GPT, heads: dict[int, list[int]]) -> GPT:
    """A copy where block b's heads listed in heads[b] contribute nothing (their c_proj columns zeroed)."""
    _check_model(model, "mask_heads")
    heads = _check_heads(model, heads)
    hs = model.config.head_size
    out = copy.deepcopy(model)
    for b, hh in heads.items():
        for h in hh:
            with torch.no_grad():
                out.transformer.h[b].attn.c_proj.weight[:, h * hs:(h + 1) * hs] = 0.0
    return out


def lowest_heads(scores: torch.Tensor, per_block: int) -> dict[int, list[int]]:
    """{block: the `per_block` heads with the lowest scores}, from head_scores' (L, nh)."""
    if not isinstance(scores, torch.Tensor) or not check_has_data("scores", scores).is_floating_point() \
            or scores.dim() != 2:
        raise TypeError(f"scores must be a float tensor (n_layer, n_head), got "
                        f"{tensor_kind(scores)} {tuple(getattr(scores, 'shape', ()))}")
    plain = plain_int(per_block)
    if plain is None or not 0 <= plain <= scores.shape[1]:
        raise ValueError(f"per_block must be an int in [0, {scores.shape[1]}] (the heads per block), got "
                         f"{short_repr(per_block)}")
    per_block = plain
    check_has_data("scores", scores)
    if bool(torch.isnan(scores).any()):
        raise ValueError("scores hold NaN values, which have no order")
    return {b: sorted(torch.topk(row, per_block, largest=False).indices.tolist()) for b, row in enumerate(scores)}


def prune_heads(model: GPT, heads: dict[int, list[int]]) -> GPT:
    """A copy with the listed heads *removed*: the same number from every block, so every layer keeps one head count
    and the KV caches (laid out as (..., n_head, head_size)) shrink with it. Its config has n_head - k heads of the
    same width (`head_dim`), so c_attn becomes C -> 3 (nh - k) hs and c_proj (nh - k) hs -> C. The function is
    `mask_heads(model, heads)`'s, computed with smaller matmuls and a smaller cache."""
    _check_model(model, "prune_heads")
    cfg, L = model.config, model.config.n_layer
    nh, hs, A = cfg.n_head, cfg.head_size, cfg.attn_dim
    heads = _check_heads(model, heads)
    if sorted(heads) != list(range(L)):
        raise ValueError(f"heads must list the heads to remove for every block 0..{L - 1}, got {short_repr(heads)}")
    counts = {len(set(hh)) for hh in heads.values()}
    if len(counts) != 1 or any(len(set(hh)) != len(hh) for hh in heads.values()):
        raise ValueError("remove the same number of distinct heads from every block (the caches hold one head count)")
    k = counts.pop()
    if not 0 < k < nh or any(not isinstance(h, int) or not 0 <= h < nh for hh in heads.values() for h in hh):
        raise ValueError(f"each block must keep at least one of its {nh} heads and lose at least one, indices in "
                         f"[0, {nh}); got {short_repr(heads)}")
    out = copy.deepcopy(model)
    out.config = replace(cfg, n_head=nh - k, head_dim=hs)
    for b, block in enumerate(out.transformer.h):
        kept = [h for h in range(nh) if h not in heads[b]]
        cols = torch.tensor([h * hs + d for h in kept for d in range(hs)], device=model.device)  # within q, k or v
        rows = torch.cat([part * A + cols for part in range(3)])  # the kept heads' rows of q, then k, then v
        attn = block.attn
        attn.c_attn = _shrunk(attn.c_attn, rows, 0)  # (3 (nh - k) hs, C)
        attn.c_proj = _shrunk(attn.c_proj, cols, 1)  # (C, (nh - k) hs)
        attn.n_head, attn.attn_dim = nh - k, (nh - k) * hs
    return out

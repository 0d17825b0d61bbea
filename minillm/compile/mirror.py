"""Chapter 13's C++ loops mirrored in PyTorch: the same algorithm, in the same order, readable and runnable anywhere.

What it adds: the two loops the chapter writes in C++ (`csrc/gemv_cpu.cpp`, `csrc/decode_cpu.cpp`), as PyTorch code
a learner can step through and test, like chapter 12's mirrors of its CUDA kernels:

- `gemv_blocked(x, w, b)`: the C++ GEMV's order. The weight is walked in blocks of 4 rows, and each block is
  multiplied by every row of x before the next block is read (one pass over W, whatever the batch). Each dot product
  keeps 8 partial sums, one per lane of an AVX register, over K in chunks of 8; the lanes are added at the end (the
  horizontal sum), then the K % 8 tail, then the bias.
- `decode_step_by_hand(model, k, v, token, pos, slot)`: the fused step (`FusedDecoder::step`) on the model's own
  weights, one token, written out: the embeddings, each block's LayerNorm, the q/k/v product, the new key and value
  stored at `slot`, each head's softmax over slots 0..slot, the output product and residual, the MLP with GELU
  (tanh), the final LayerNorm and the tied head. Its logits are the model's for that token (tested).

Both are graded exercises (`minillm assignment 13`); the tests compare them with `F.linear` and with the model's
own forward. They are slow on purpose: Python loops where the C++ has machine loops.
"""

from __future__ import annotations

import math
from collections.abc import Collection

import torch

import torch.nn as nn

from minillm.compile.cpu_gemv import FastLinear
from minillm.core.model import GPT, require_model
from minillm.kernels.naive import gelu_tanh, layernorm  # chapter 12's naive twins: the same formulas
from minillm.core.config import (check_has_data, check_int, check_label, check_strided, check_writable, plain_int,
                                 short_repr, tensor_kind)
from minillm.kernels.ops import check_same_device, tensors_overlap

ROWS = 4  # weight rows per block: four memory streams in flight in the C++ loop
LANES = 8  # floats per AVX2 register: each dot product's partial sums


def gemv_blocked(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """y = x Wᵀ + b in the C++ GEMV's order: x (M, K), w (N, K), b (N,) or None -> (M, N).

    For each block of ROWS weight rows (the last block may be shorter), for each row of x: LANES partial sums over
    the first K - K % LANES columns in chunks of LANES, added across lanes, then the tail columns, then the bias.
    """
    for name, t, ndim in (("x", x, 2), ("w", w, 2), ("b", b, 1)):
        if t is None and name == "b":
            continue
        if isinstance(t, torch.Tensor):
            check_strided(name, t)  # before any shape is read: a nested tensor has none
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != ndim:
            raise TypeError(f"{name} must be a {ndim}-D floating-point tensor, got "
                            f"{tensor_kind(t)} {tuple(getattr(t, 'shape', ()))}")
        check_has_data(name, t)
    check_same_device(x=x, w=w, b=b)
    if w.shape[1] != x.shape[1] or (b is not None and b.shape[0] != w.shape[0]):
        raise ValueError(f"x (M, K), w (N, K) and b (N,) must agree, got {tuple(x.shape)}, {tuple(w.shape)}, "
                         f"{None if b is None else tuple(b.shape)}")
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    k8 = K - K % LANES  # the columns that fill whole registers
    for n0 in range(0, N, ROWS):
        block = w[n0:n0 + ROWS]  # (r, K): read once for every row of x
        # BEGIN SOLUTION
        lanes = (x[:, None, :k8] * block[None, :, :k8]).view(M, block.shape[0], k8 // LANES, LANES).sum(2)  # (M, r, 8)
        sums = lanes.sum(-1)  # (M, r): the horizontal sum of each accumulator
        sums = sums + (x[:, None, k8:] * block[None, :, k8:]).sum(-1)  # the K % LANES tail
        if b is not None:
            sums = sums + b[n0:n0 + ROWS]
        y[:, n0:n0 + ROWS] = sums
        # END SOLUTION
    return y


# What decode_step_by_hand reads of each block, and of the whole model: plain layers' own weights.
BLOCK_LAYERS = {"ln_1": nn.LayerNorm, "attn.c_attn": nn.Linear, "attn.c_proj": nn.Linear, "ln_2": nn.LayerNorm,
                "mlp.c_fc": nn.Linear, "mlp.c_proj": nn.Linear}
MODEL_LAYERS = {"lm_head": nn.Linear, "transformer.wte": nn.Embedding, "transformer.wpe": nn.Embedding,
                "transformer.ln_f": nn.LayerNorm}  # the head first: its weight sets the dtype the others must have
# The layer types whose forward is the plain formula over their own weights: exact types, since a subclass may
# compute something else (chapter 09's FakeQuantLinear multiplies by its fake-quantized weight). FastLinear is
# nn.Linear's formula in C++.
PLAIN_TYPES = {nn.Linear: (nn.Linear, FastLinear), nn.Embedding: (nn.Embedding,), nn.LayerNorm: (nn.LayerNorm,)}


def check_plain_model(model: GPT, who: str, handled: Collection[str] = ()) -> torch.Tensor:
    """The tied head's weight (its dtype and device are the step's), after checking that every layer a hand-written
    step (or an export) reads is a plain nn.Embedding, nn.Linear (with a bias, but the head) or nn.LayerNorm whose
    floating-point weights share that dtype and device. A quantized model (chapter 09) holds integer codes, not a
    `weight`, and a QAT-prepared one computes with other weights than the float ones it holds: a TypeError naming
    `who`, the model and the layer, never an AttributeError from inside torch nor a silent run on the wrong
    weights. `handled` names layers the caller checks itself (the fused step's int8 linears): skipped here."""
    who = check_label("who", who)
    if not isinstance(handled, (tuple, list, set, frozenset)) or not all(isinstance(h, str) for h in handled):
        raise TypeError(f"handled must be a collection of layer names (str), got {short_repr(handled)}")
    require_model(model, who)  # None or a bare nn.Linear: a TypeError naming `who`, not an AttributeError on config
    blocks = getattr(getattr(model, "transformer", None), "h", None)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) != model.config.n_layer:
        raise ValueError(f"{who} needs the model's config.n_layer={model.config.n_layer} blocks in transformer.h, "
                         f"got {len(blocks) if isinstance(blocks, nn.ModuleList) else type(blocks).__name__}: a block "
                         "removed or added after the model was built")
    named = {**MODEL_LAYERS, **{f"transformer.h.{i}.{n}": t for i in range(model.config.n_layer)
                                for n, t in BLOCK_LAYERS.items()}}
    head = model.get_submodule("lm_head")
    ref = head.weight if type(head) in PLAIN_TYPES[nn.Linear] else None
    for name, kind in named.items():
        if name in handled:
            continue
        layer = model.get_submodule(name)
        plain = type(layer) in PLAIN_TYPES[kind] and ref is not None
        if plain:  # the weight, and the bias the step adds (none for the embeddings and the tied head)
            params = [layer.weight] + ([layer.bias] if kind is not nn.Embedding and name != "lm_head" else [])
            plain = all(p is not None and p.is_floating_point() and p.dtype == ref.dtype  # type: ignore[union-attr]
                        and p.device == ref.device for p in params)  # type: ignore[union-attr]
        if not plain:
            raise TypeError(f"{who} needs a model of plain nn.Embedding, nn.Linear (with biases) and "
                            f"nn.LayerNorm layers of floating-point weights, one dtype; model "
                            f"({type(model).__name__}) has {name} = {type(layer).__name__} with weight "
                            f"{getattr(getattr(layer, 'weight', None), 'dtype', None)} (a quantized model holds "
                            "integer codes, a QAT-prepared one multiplies by fake-quantized weights: run the float "
                            "original)")
    return ref  # type: ignore[return-value]


def _check_cache(k: list[torch.Tensor], v: list[torch.Tensor], n_layer: int, nh: int, hs: int,
                 weight: torch.Tensor) -> None:
    """k and v: lists of n_layer tensors (1, nh, max_len, hs), one max_len, of the weights' dtype and device, each
    writable in place (`check_writable`: not expanded), no two of them sharing memory. subtle: k is v (or k[0] is
    v[0]) would write each value over its key, and the step would attend with the wrong keys without a sign; named
    here instead."""
    for name, cache in (("k", k), ("v", v)):
        if not isinstance(cache, (list, tuple)):
            raise TypeError(f"{name} must be a list of {n_layer} tensors (1, nh={nh}, max_len, hs={hs}), one per "
                            f"layer, got {type(cache).__name__}")
        if len(cache) != n_layer:
            raise ValueError(f"{name} must hold {n_layer} tensors (1, nh={nh}, max_len, hs={hs}), one per layer, "
                             f"got {len(cache)}")
    shape = None
    for name, cache in (("k", k), ("v", v)):
        for i, t in enumerate(cache):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}[{i}] must be a tensor, got {type(t).__name__}")
            if t.dtype != weight.dtype:
                raise TypeError(f"{name}[{i}] has dtype {t.dtype}; the cache must have the model's dtype "
                                f"{weight.dtype}")
            if t.device != weight.device:
                raise ValueError(f"{name}[{i}] is on {t.device}; the cache must be on the model's device "
                                 f"{weight.device}")
            check_strided(f"{name}[{i}]", t)
            check_writable(f"{name}[{i}]", t)  # the step writes each key and value in place
            shape = shape or tuple(t.shape)
            if t.dim() != 4 or tuple(t.shape[:2]) != (1, nh) or t.shape[3] != hs or tuple(t.shape) != shape:
                raise ValueError(f"{name}[{i}] must be (1, nh={nh}, max_len, hs={hs}) like k[0] {shape}, got "
                                 f"{tuple(t.shape)}")
    tensors = [(f"k[{i}]", t) for i, t in enumerate(k)] + [(f"v[{i}]", t) for i, t in enumerate(v)]
    for a, (name_a, ta) in enumerate(tensors):
        for name_b, tb in tensors[a + 1:]:
            if tensors_overlap(ta, tb):
                raise ValueError(f"{name_a} and {name_b} share memory: k and v must be separate tensors, one per "
                                 "layer (the step writes a value over a key otherwise)")


def _index(name: str, value: object, high: int) -> int:
    """`value` as the plain int it holds if it is an int in [0, high), else a TypeError / ValueError naming `name`
    (an int subclass's own comparisons are not consulted: 999 would reach torch's indexing). A numpy integer is read
    as the int it holds, as token ids are everywhere."""
    plain = plain_int(value)
    value = check_int(name, value if plain is None else plain, 0)
    if value >= high:
        raise ValueError(f"{name} must be in [0, {high}), got {value}")
    return value


@torch.inference_mode()
def decode_step_by_hand(model: GPT, k: list[torch.Tensor], v: list[torch.Tensor], token: int, pos: int, slot: int
                        ) -> torch.Tensor:
    """Logits (V,) of `token` at position `pos`; its key and value go to `slot` of every layer's k[l], v[l]
    (each (1, nh, max_len, hs), of the model's dtype, separate tensors: the layout of chapter 04's
    `ContiguousKVCache`), and it attends over slots 0..slot, itself included. Uses only the model's weights (and each
    LayerNorm's own eps), never its modules' forward, so it needs plain float layers (a quantized or QAT-prepared
    model is a TypeError naming the layer). It computes in the model's dtype (float32, or float64)."""
    cfg = require_model(model, "decode_step_by_hand")
    tr = model.transformer
    nh, hs = cfg.n_head, cfg.head_size
    weight = check_plain_model(model, "decode_step_by_hand")
    _check_cache(k, v, cfg.n_layer, nh, hs, weight)
    token, pos, slot = (_index(name, value, high) for name, value, high in (
        ("token", token, cfg.vocab_size), ("pos", pos, cfg.block_size), ("slot", slot, k[0].shape[2])))
    A = nh * hs
    x = tr.wte.weight[token] + tr.wpe.weight[pos]  # (C,): the residual stream of this one token
    for layer, block in enumerate(tr.h):
        # BEGIN SOLUTION
        h = layernorm(x, block.ln_1.weight, block.ln_1.bias, block.ln_1.eps)  # (C,): each LayerNorm's own eps
        qkv = block.attn.c_attn.weight @ h + block.attn.c_attn.bias  # (3A,)
        q, key, value = qkv[:A].view(nh, hs), qkv[A:2 * A].view(nh, hs), qkv[2 * A:].view(nh, hs)
        k[layer][0, :, slot] = key  # (nh, hs) into slot `slot` of every head
        v[layer][0, :, slot] = value
        keys, values = k[layer][0, :, :slot + 1], v[layer][0, :, :slot + 1]  # (nh, slot+1, hs): itself included
        scores = (keys @ q.unsqueeze(-1)).squeeze(-1) / math.sqrt(hs)  # (nh, slot+1)
        p = torch.softmax(scores, dim=-1)  # each head's weights over the slots
        y = (p.unsqueeze(1) @ values).squeeze(1).reshape(A)  # (nh, hs) -> (A,)
        x = x + block.attn.c_proj.weight @ y + block.attn.c_proj.bias  # (C,)
        h = layernorm(x, block.ln_2.weight, block.ln_2.bias, block.ln_2.eps)
        f = gelu_tanh(block.mlp.c_fc.weight @ h + block.mlp.c_fc.bias)  # (H,)
        x = x + block.mlp.c_proj.weight @ f + block.mlp.c_proj.bias  # (C,)
        # END SOLUTION
    h = layernorm(x, tr.ln_f.weight, tr.ln_f.bias, tr.ln_f.eps)
    return model.lm_head.weight @ h  # (V,): the tied head

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

import torch

from minillm.core.model import GPT, require_model
from minillm.kernels.naive import gelu_tanh, layernorm  # chapter 12's naive twins: the same formulas

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
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != ndim:
            raise TypeError(f"{name} must be a {ndim}-D floating-point tensor, got "
                            f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
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


@torch.inference_mode()
def decode_step_by_hand(model: GPT, k: list[torch.Tensor], v: list[torch.Tensor], token: int, pos: int, slot: int
                        ) -> torch.Tensor:
    """Logits (V,) of `token` at position `pos`; its key and value go to `slot` of every layer's k[l], v[l]
    (each (1, nh, max_len, hs), float32, the layout of chapter 04's `ContiguousKVCache`), and it attends over
    slots 0..slot, itself included. Uses only the model's weights, never its modules' forward."""
    cfg = require_model(model, "decode_step_by_hand")
    tr = model.transformer
    nh, hs, eps = cfg.n_head, cfg.head_size, cfg.layer_norm_epsilon
    for name, cache in (("k", k), ("v", v)):
        if not isinstance(cache, (list, tuple)) or len(cache) != cfg.n_layer or not all(
                isinstance(t, torch.Tensor) and t.dim() == 4 and tuple(t.shape[:2]) == (1, nh) and t.shape[3] == hs
                for t in cache):
            raise ValueError(f"{name} must be a list of {cfg.n_layer} tensors (1, nh={nh}, max_len, hs={hs})")
    for name, value, high in (("token", token, cfg.vocab_size), ("pos", pos, cfg.block_size),
                              ("slot", slot, k[0].shape[2])):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        if not 0 <= value < high:
            raise ValueError(f"{name} must be in [0, {high}), got {value}")
    A = nh * hs
    x = tr.wte.weight[token] + tr.wpe.weight[pos]  # (C,): the residual stream of this one token
    for layer, block in enumerate(tr.h):
        # BEGIN SOLUTION
        h = layernorm(x, block.ln_1.weight, block.ln_1.bias, eps)  # (C,)
        qkv = block.attn.c_attn.weight @ h + block.attn.c_attn.bias  # (3A,)
        q, key, value = qkv[:A].view(nh, hs), qkv[A:2 * A].view(nh, hs), qkv[2 * A:].view(nh, hs)
        k[layer][0, :, slot] = key  # (nh, hs) into slot `slot` of every head
        v[layer][0, :, slot] = value
        keys, values = k[layer][0, :, :slot + 1], v[layer][0, :, :slot + 1]  # (nh, slot+1, hs): itself included
        scores = (keys @ q.unsqueeze(-1)).squeeze(-1) / math.sqrt(hs)  # (nh, slot+1)
        p = torch.softmax(scores, dim=-1)  # each head's weights over the slots
        y = (p.unsqueeze(1) @ values).squeeze(1).reshape(A)  # (nh, hs) -> (A,)
        x = x + block.attn.c_proj.weight @ y + block.attn.c_proj.bias  # (C,)
        h = layernorm(x, block.ln_2.weight, block.ln_2.bias, eps)
        f = gelu_tanh(block.mlp.c_fc.weight @ h + block.mlp.c_fc.bias)  # (H,)
        x = x + block.mlp.c_proj.weight @ f + block.mlp.c_proj.bias  # (C,)
        # END SOLUTION
    h = layernorm(x, tr.ln_f.weight, tr.ln_f.bias, eps)
    return model.lm_head.weight @ h  # (V,): the tied head

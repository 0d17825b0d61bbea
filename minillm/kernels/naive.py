"""The naive PyTorch twin of every chapter 12 kernel: plain torch ops, fp32 math, the reference for every test.

Each function computes what its kernel computes, in the most direct way (whole rows, dense matrices, Python loops
over sequences), upcasting to fp32 (layernorm keeps float64 in float64) and rounding once to the input dtype at
the end, as the kernels do. They run on any device. What they leave out: speed; `bench` times them as the
baseline every version is compared with.
"""

from __future__ import annotations

import math

import torch

from minillm.core.attention import attention_ref, causal_mask
from minillm.core.config import check_float_tensor, check_has_data, check_writable, tensor_kind
from minillm.kernels.ops import (
    check_block_tables,
    check_eps,
    check_kv_write_args,
    check_paged_args,
    check_same_device,
    check_slot_range,
)
from minillm.paged.paged_cache import write_kv


def check_rows(name: str, x: torch.Tensor, **vectors: torch.Tensor) -> int:
    """The row ops' arguments (softmax, layernorm, bias_gelu; here and in `mirror`): `x` a floating-point tensor
    (..., C) of at least one dimension, and each of `vectors` (weight=..., bias=...) a floating-point (C,) tensor
    on x's device. Returns C; a TypeError / ValueError naming the argument otherwise (not torch's broadcast error,
    or worse, a (1,) bias broadcast over every column)."""
    if check_float_tensor(name, x).dim() == 0:
        raise ValueError(f"{name} must have at least one dimension (its columns), got a 0-d tensor")
    C = x.shape[-1]
    for vname, t in vectors.items():
        if tuple(check_float_tensor(vname, t).shape) != (C,):
            raise ValueError(f"{vname} must have shape ({C},), {name}'s last dimension, got {tuple(t.shape)}")
    check_same_device(**{name: x}, **vectors)
    return C


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q, k, v floating-point (B, nh, T, hs) tensors of one shape, one dtype and one device (causal self-attention,
    as the kernels take it: a k of another dtype would come back promoted); TypeError / ValueError naming the
    argument."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_float_tensor(name, x, 4)
        if x.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)} (causal self-attention), got "
                             f"{tuple(x.shape)}")
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    check_same_device(q=q, k=k, v=v)


def check_int8_gemv_args(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    """x (M, K) float, w (N, K) int8, scale (N,) and bias (N,) (or None) float, all holding values on x's device;
    TypeError / ValueError naming the argument. scale and bias may have another float dtype than x (the math is
    fp32)."""
    K = check_float_tensor("x", x, 2).shape[1]
    if not isinstance(w, torch.Tensor) or check_has_data("w", w).dtype != torch.int8 or w.dim() != 2 or w.shape[1] != K:
        raise TypeError(f"w must be an int8 (N, K={K}) tensor, got {tensor_kind(w)} "
                        f"{tuple(getattr(w, 'shape', ()))}")
    check_has_data("w", w)
    for name, t in (("scale", scale), ("bias", bias)):
        if t is None and name == "bias":
            continue
        if tuple(check_float_tensor(name, t).shape) != (w.shape[0],):
            raise ValueError(f"{name} must have shape (N={w.shape[0]},), one per row of w, got {tuple(t.shape)}")
    check_same_device(x=x, w=w, scale=scale, bias=bias)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Row softmax over the last dimension: exp(x - max) / sum exp(x - max). Rows of no columns give an empty
    result, as torch.softmax and `ops.softmax` do (nothing to normalise)."""
    if check_rows("x", x) == 0:
        return x.clone()
    x32 = x.float()
    e = torch.exp(x32 - x32.amax(dim=-1, keepdim=True))  # (..., C)
    return (e / e.sum(dim=-1, keepdim=True)).to(x.dtype)


def layernorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dimension, biased variance (as F.layer_norm);
    x (..., C), weight and bias (C,). The math is fp32, but float64 input is computed in float64 (chapter 13's
    `decode_step_by_hand` runs float64 models with it).

    Not checked: a row whose squared deviations overflow float32 (|x| past ~1e19) has no meaningful result in fp32
    math. Here var is inf and the row comes back as its bias, as from the mirror and every kernel version (each
    sums the squared deviations too); F.layer_norm gives the bias or NaN. Such a row means the model has already
    diverged; no check is paid for at every call.
    """
    check_rows("x", x, weight=weight, bias=bias)
    eps = check_eps(eps)
    dtype = torch.promote_types(x.dtype, torch.float32)  # fp32 math; float64 stays float64 (chapter 13's step)
    x32 = x.to(dtype)
    mean = x32.mean(dim=-1, keepdim=True)  # (..., 1)
    var = ((x32 - mean) ** 2).mean(dim=-1, keepdim=True)  # (..., 1)
    return ((x32 - mean) / torch.sqrt(var + eps) * weight.to(dtype) + bias.to(dtype)).to(x.dtype)


def gelu_tanh(u: torch.Tensor) -> torch.Tensor:
    """GPT-2's GELU, the tanh approximation (Hendrycks & Gimpel 2016, section 2); F.gelu(u, approximate="tanh").
    u: a floating-point tensor (a TypeError naming u otherwise)."""
    check_float_tensor("u", u)
    return 0.5 * u * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (u + 0.044715 * u**3)))


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x + bias), bias (C,) broadcast over the rows of x (..., C)."""
    check_rows("x", x, bias=bias)
    return gelu_tanh(x.float() + bias.float()).to(x.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention with scale 1/sqrt(hs): q, k, v (B, nh, T, hs) -> (B, nh, T, hs), via chapter 02's
    explicit `attention_ref`."""
    check_qkv(q, k, v)
    T = q.shape[-2]
    mask = causal_mask(T, T, device=q.device)  # (T, T)
    return attention_ref(q.float(), k.float(), v.float(), mask).to(q.dtype)


def paged_attention_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor:
    """One query token per sequence against its context in the pools: q (S, nh, hs), pools (nb, bs, nh, hs),
    block_tables (S, max_nb), context_lens (S,) -> (S, nh, hs). Gathers each sequence's K/V densely, then attends.
    A context longer than its table or a block id outside the pool is a ValueError naming the argument; no
    sequences (S = 0) give an empty (0, nh, hs), as the kernel, the emulator and the mirror do."""
    check_paged_args(q, k_pool, v_pool, block_tables, context_lens)
    check_block_tables(block_tables, context_lens, k_pool.shape[0], k_pool.shape[1])
    S, nh, hs = q.shape
    bs = k_pool.shape[1]
    out = torch.empty(S, nh, hs, device=q.device)  # (S, nh, hs) fp32, one row per sequence
    for s, ctx in enumerate(context_lens.tolist()):
        nblk = -(-ctx // bs)
        blocks = block_tables[s, :nblk]  # (nblk,)
        k = k_pool.index_select(0, blocks).flatten(0, 1)[:ctx]  # (nblk, bs, nh, hs) -> (ctx, nh, hs)
        v = v_pool.index_select(0, blocks).flatten(0, 1)[:ctx]  # (ctx, nh, hs)
        qs = q[s].float().unsqueeze(1)  # (nh, 1, hs)
        y = attention_ref(qs, k.float().transpose(0, 1), v.float().transpose(0, 1))  # (nh, 1, hs)
        out[s] = y.squeeze(1)  # (nh, hs)
    return out.to(q.dtype)  # (S, nh, hs)


def int8_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ (w (N, K) int8 * scale (N,)[:, None])^T + bias (N,) -> (M, N): dequantize, then matmul."""
    check_int8_gemv_args(x, w, scale, bias)
    w_fp = w.float() * scale.float()[:, None]  # (N, K), the dequantized weight
    y = x.float() @ w_fp.T  # (M, K) @ (K, N) -> (M, N)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def kv_cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """In place: pool row slot_mapping[t] <- key/value row t (T, nh, hs), slots of -1 skipped; chapter 05's
    `write_kv` on the slots that are not -1. Any other slot outside the pool is a ValueError naming slot_mapping, and
    a pool torch cannot write in place (expanded, an inference tensor, requiring grad) or that is not contiguous
    (channels_last, a slice of a wider pool: `write_kv` writes through a (nb * bs, nh, hs) view of it, as the kernel
    writes row-major memory) one naming the pool."""
    check_kv_write_args(key, value, k_pool, v_pool, slot_mapping)
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        check_writable(name, pool)
        if not pool.is_contiguous():
            raise ValueError(f"{name} must be contiguous (row-major), got strides {pool.stride()} for shape "
                             f"{tuple(pool.shape)}; allocate the pool with torch.zeros (a .contiguous() copy would "
                             "not be the pool you read back)")
    check_slot_range(slot_mapping, k_pool.shape[0] * k_pool.shape[1])
    keep = slot_mapping >= 0  # (T,)
    write_kv(k_pool, slot_mapping[keep], key[keep])
    write_kv(v_pool, slot_mapping[keep], value[keep])

"""Scaled dot-product attention, twice: the explicit reference and PyTorch's fused op.

Both functions take queries, keys and values already split into heads and return the attention output in the
same layout. `attention_ref` spells every step out (scores, mask, softmax, weighted sum) so a reader can follow the
math; `attention` hands the same computation to `torch.nn.functional.scaled_dot_product_attention`, which picks a
fused kernel where one exists. Chapter 02's tests prove the two agree. Neither knows about caches: those live in
chapters 04 and 05 and call these functions with the keys and values they keep.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from minillm.core.config import (MAX_TENSOR_ELEMENTS, check_bool, check_device, check_int, check_tensor_elements,
                                 tensor_kind)


def causal_mask(T_q: int, T_k: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean mask (T_q, T_k), True where query i may attend to key j.

    The T_q queries are the *last* T_q positions of the T_k keys (T_q <= T_k): query i sits at absolute position
    T_k - T_q + i and sees every key at or before it. With T_q == T_k this is the usual lower triangle.
    """
    # one cheap test first: the paged caches build a mask per sequence per layer; the checks below name what failed
    fits = (type(T_q) is int and type(T_k) is int and 0 <= T_q <= T_k
            and max(T_q, 1) * T_k <= MAX_TENSOR_ELEMENTS)
    if not fits:
        T_q, T_k = check_int("T_q", T_q, 0), check_int("T_k", T_k, 0)
    if device is not None and not isinstance(device, torch.device):  # a type test first: called once per forward
        device = check_device("device", device, allocates=True)
    if not fits:
        check_tensor_elements("T_q x T_k", (max(T_q, 1), T_k))  # the mask and k_pos's arange, before the allocator
        if T_q > T_k:
            raise ValueError(f"causal_mask needs T_q <= T_k, got T_q={T_q}, T_k={T_k}")
    offset = T_k - T_q
    q_pos = torch.arange(T_q, device=device).unsqueeze(1) + offset  # (T_q, 1)
    k_pos = torch.arange(T_k, device=device).unsqueeze(0)  # (1, T_k)
    return k_pos <= q_pos  # (T_q, T_k)


def check_qkv(q: object, k: object, v: object, mask: object = None, bool_mask: bool = True) -> None:
    """q (..., T_q, hs) and k, v (..., T_k, hs): floating-point tensors of one dtype; mask None or a bool tensor
    (with `bool_mask=False` a float one too, added to the scores, as `scaled_dot_product_attention` takes it). A
    TypeError / ValueError naming the argument; host-only and cheap, since attention runs once per layer."""
    if not isinstance(q, torch.Tensor) or not q.is_floating_point():
        raise TypeError(f"q must be a floating-point tensor (B, nh, T_q, hs), got {tensor_kind(q)}")
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dtype != q.dtype:
            raise TypeError(f"{name} must be a tensor of q's dtype {q.dtype} (B, nh, T_k, hs), got {tensor_kind(t)}")
    if min(q.dim(), k.dim(), v.dim()) < 2 or k.shape[-1] != q.shape[-1] or v.shape[-2] != k.shape[-2]:
        raise ValueError(f"q, k, v must have shapes (..., T_q, hs), (..., T_k, hs), (..., T_k, hs), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if mask is not None and (not isinstance(mask, torch.Tensor) or (bool_mask and mask.dtype != torch.bool)):
        raise TypeError(f"mask must be None or a {'bool ' if bool_mask else ''}tensor (True = attend), got "
                        f"{tensor_kind(mask)}")


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Explicit attention: softmax(q k^T / sqrt(hs) + mask) v.

    q: (B, nh, T_q, hs); k, v: (B, nh, T_k, hs); mask: boolean, broadcastable to (B, nh, T_q, T_k), True = attend.
    Returns (B, nh, T_q, hs).
    """
    check_qkv(q, k, v, mask)
    # BEGIN SOLUTION
    hs = q.size(-1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(hs)  # (B, nh, T_q, hs) @ (B, nh, hs, T_k) -> (B, nh, T_q, T_k)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)  # (B, nh, T_q, T_k), each row sums to 1
    return weights @ v  # (B, nh, T_q, T_k) @ (B, nh, T_k, hs) -> (B, nh, T_q, hs)
    # END SOLUTION


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """Fused attention via `scaled_dot_product_attention`; same contract as `attention_ref`.

    `is_causal=True` (only valid when T_q == T_k and no mask) lets PyTorch pick its causal fast path.
    """
    check_qkv(q, k, v, mask, bool_mask=False)
    if type(is_causal) is not bool:  # a type test first: called once per layer
        check_bool("is_causal", is_causal)
    if is_causal and mask is not None:
        raise ValueError("pass either mask or is_causal=True, not both")
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)  # (B, nh, T_q, hs)

"""KV-cache int8: keep every cached key and value as int8 codes with one scale per token and head.

What it adds: `quantize_kv` / `dequantize_kv` (symmetric absmax over the head dimension: a (token, head) vector of
hs values shares one fp32 scale), and the two caches of chapters 04 and 05 storing codes instead of floats:

    Int8ContiguousKVCache   chapter 04's ContiguousKVCache: k, v (B, nh, max_len, hs) int8 + scales (B, nh, max_len, 1)
    Int8PagedKVCache        chapter 05's PagedKVCache: pools (nb, bs, nh, hs) int8 + scale pools (nb, bs, nh, 1);
                            registered as the attention backend "paged-int8" (EngineConfig(attention_backend=...))

Bytes per cached element: 1 + 4 / hs (32 for `base`: 1.125 B instead of 4, 3.6x smaller). A new token's K/V are
quantized as they are written; every read de-quantizes what it attends over, so the attention itself is fp32, and a
token attends over the quantized version of its own K/V too (prefill and decode read the cache alike). The naive
twin is `FakeQuantContiguousKVCache`: fp32 storage, each written vector replaced by deq(q(x)); the int8 cache must
give its logits to float rounding. A key or value holding NaN/inf is stored with a NaN/inf scale and reads back
NaN (the writes never sync with the host to look); `quantize_kv` called by hand refuses it.

Why per token and head: a cache grows one token at a time, so a scale over a whole layer would change as tokens
arrive and force re-quantizing what is stored; per token nothing stored ever changes. (KIVI, Liu et al. 2024,
quantizes keys per channel instead, because key outliers sit in fixed channels; that needs a group of tokens before
a scale can be fixed.) What it leaves out: the static-shape path of the contiguous cache, the vectorized decode path
of the paged cache (the int8 pool is read through the per-sequence reference loop), chapter 07's KV hand-off of int8
blocks (its payload is float K/V without scales: `LLM.add_prefilled_request` and `pack_kv` refuse int8 pools), and
int4 KV. Swapping does work: a block is codes and scales (`Int8PagedKVCache.block_tensors`), and the swap space
copies both.
"""

from __future__ import annotations

import torch

from minillm.core.attention import attention, causal_mask
from minillm.core.config import GPTConfig, check_device, check_int, check_strided, check_tensor_elements, tensor_kind
from minillm.kvcache.cache import check_attend_args, ContiguousKVCache
from minillm.paged.backends import register_attention_backend
from minillm.paged.paged_cache import PagedKVCache, write_kv
from minillm.quant.quantize import (
    check_finite,
    check_scale_positive,
    dequantize_symmetric,
    quantize_symmetric,
    symmetric_params,
)


def _quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_kv` unchecked, for the caches' per-step writes: a vector holding NaN/inf gets a NaN/inf scale, so it
    reads back as NaN (attention over it is NaN, as with an fp32 cache), never as a plausible 0. No host sync."""
    scale = symmetric_params(x.float(), 8, dim=-1)  # (..., 1)
    return quantize_symmetric(x.float(), scale, 8, check_values=False), scale


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., hs) float -> (codes (..., hs) int8, scales (..., 1) fp32): one absmax scale per vector of hs values.

    Refuses NaN/inf with a ValueError naming x (one host sync), and float64 values past float32's range, which the
    scales are computed in (they would be inf: every code 0 and every value read back NaN). The caches write through
    `_quantize_kv`, which skips the check and propagates NaN instead (see there)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor of keys or values, got "
                        f"{tensor_kind(x)}")
    check_strided("x", x)  # nested, quantized, float8: before anything reads the shape
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x must have shape (..., hs) with hs > 0, got {tuple(x.shape)}")
    check_finite("x", x)
    if x.dtype == torch.float64 and x.numel() > 0:
        largest, f32_max = x.abs().max().item(), torch.finfo(torch.float32).max
        if largest > f32_max:
            raise ValueError(f"x holds values up to |x| = {largest:.6g}, past the float32 range (|x| <= "
                             f"{f32_max:.6g}) that the int8 cache's scales are computed in")
    return _quantize_kv(x)


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32, *,
                  check_values: bool = True) -> torch.Tensor:
    """codes (..., hs) int8, scale (..., 1) -> (..., hs) in `dtype`.

    A scale <= 0 is refused (one host sync: a negative scale flips every sign, a zero one erases the vector); NaN
    passes, as `quantize_kv`'s own scale for a NaN vector. The caches' reads pass `check_values=False`: their scales
    come from `_quantize_kv`, and a check would cost a host sync per layer and step."""
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.int8:
        raise TypeError(f"codes must be an int8 tensor, got {tensor_kind(codes)}")
    check_strided("codes", codes)  # else named `q` by dequantize_symmetric, below
    if isinstance(scale, torch.Tensor):
        check_strided("scale", scale)
    if isinstance(scale, torch.Tensor) and scale.device != codes.device:
        raise ValueError(f"codes on {codes.device} and scale on {scale.device} must be on one device")
    if not isinstance(scale, torch.Tensor) or scale.dim() != codes.dim() or scale.shape[:-1] != codes.shape[:-1] \
            or scale.shape[-1] != 1:
        raise ValueError(f"scale must have shape {tuple(codes.shape[:-1]) + (1,)} for codes {tuple(codes.shape)}, got "
                         f"{tuple(getattr(scale, 'shape', ()))}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    if not isinstance(check_values, bool):
        raise TypeError(f"check_values must be a bool, got {type(check_values).__name__} {check_values!r}")
    if check_values and scale.is_floating_point():
        check_scale_positive(scale)
        if not bool(torch.isfinite(scale).all()):  # quantize_kv never writes one: inf or NaN would de-quantize to
            raise ValueError("scale must be finite: quantize_kv writes finite scales, and an inf or NaN one would "
                             "read back as a row of inf or NaN keys")
    return dequantize_symmetric(codes, scale, check_values=False).to(dtype)  # checked above when asked


def _check_sizes(config: object, names: tuple[str, str], sizes: tuple[int, int]) -> tuple[int, int]:
    """config a GPTConfig, the two sizes positive ints, and one layer's (sizes[0], nh, sizes[1], hs) within
    MAX_TENSOR_ELEMENTS: checked before the parent allocates its fp32 tensors (its own checks come after). Returns
    the two sizes as plain ints."""
    if not isinstance(config, GPTConfig):
        raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
    first, second = (check_int(name, value) for name, value in zip(names, sizes))
    check_tensor_elements(" x ".join(names), (first, config.n_head, second, config.head_size))
    return first, second


def _attention_over_kept(cache: ContiguousKVCache, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         start: int, T: int) -> torch.Tensor:
    """The attention call `ContiguousKVCache.attend` makes once K/V are written: same mask choice, case by case."""
    if cache._has_padding:
        if cache._mask_key != (start, T):
            cache._mask_key, cache._mask = (start, T), cache.attention_mask(start, T)
        return attention(q, keys, values, mask=cache._mask)  # (B, nh, T, hs)
    if T == 1:
        return attention(q, keys, values)
    if start == 0:
        return attention(q, keys, values, is_causal=True)
    return attention(q, keys, values, mask=causal_mask(T, start + T, device=q.device))


class Int8ContiguousKVCache(ContiguousKVCache):
    """Chapter 04's contiguous cache with int8 K/V codes and per-(token, head) scales; same interface."""

    def __init__(self, config: GPTConfig, batch_size: int, max_len: int, device: torch.device | str = "cpu"):
        batch_size, max_len = _check_sizes(config, ("batch_size", "max_len"), (batch_size, max_len))
        # subtle: the parent allocates fp32 K/V first; they are replaced right away (a transient, not a leak).
        super().__init__(config, batch_size, max_len, device=check_device("device", device), dtype=torch.float32)
        shape = (batch_size, config.n_head, max_len, config.head_size)  # (B, nh, max_len, hs)
        self.k = [torch.zeros(shape, dtype=torch.int8, device=self.device) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, dtype=torch.int8, device=self.device) for _ in range(config.n_layer)]
        scale_shape = shape[:-1] + (1,)  # (B, nh, max_len, 1)
        self.k_scale = [torch.ones(scale_shape, device=self.device) for _ in range(config.n_layer)]
        self.v_scale = [torch.ones(scale_shape, device=self.device) for _ in range(config.n_layer)]
        self.dtype = torch.int8

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v + self.k_scale + self.v_scale)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Quantize this step's k, v (B, nh, T, hs) into the layer's slots; attend q over the de-quantized kept ones."""
        check_attend_args(self.config, layer_idx, q, k, v)
        B, nh, T, hs = k.shape
        if B != self.batch_size:
            raise ValueError(f"batch of {B} rows does not match the cache's batch_size={self.batch_size}")
        start = self._layer_len[layer_idx]
        if start + T > self.max_len:
            raise ValueError(f"cache full: {start} slots used + {T} new > max_len={self.max_len}")
        end = start + T
        for codes, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            c, s = _quantize_kv(x)  # (B, nh, T, hs) int8, (B, nh, T, 1)
            codes[layer_idx][:, :, start:end] = c
            scales[layer_idx][:, :, start:end] = s
        keys = dequantize_kv(self.k[layer_idx][:, :, :end], self.k_scale[layer_idx][:, :, :end], q.dtype,
                             check_values=False)
        values = dequantize_kv(self.v[layer_idx][:, :, :end], self.v_scale[layer_idx][:, :, :end], q.dtype,
                               check_values=False)
        self._layer_len[layer_idx] = end
        return _attention_over_kept(self, q, keys, values, start, T)  # (B, nh, T, hs)


class FakeQuantContiguousKVCache(ContiguousKVCache):
    """The naive twin: fp32 storage, but every written k, v vector is replaced by deq(q(x)) first."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        check_attend_args(self.config, layer_idx, q, k, v)  # before k and v are quantized
        return super().attend(layer_idx, q, dequantize_kv(*_quantize_kv(k), k.dtype, check_values=False),
                              dequantize_kv(*_quantize_kv(v), v.dtype, check_values=False))


class Int8PagedKVCache(PagedKVCache):
    """Chapter 05's paged cache with int8 pools (nb, bs, nh, hs) and fp32 scale pools (nb, bs, nh, 1).

    Attention always runs the per-sequence reference loop (`use_fast_decode` is off): the parent's vectorized decode
    path reads the pools as floats. `block_tensors()` lists the scale pools next to the code pools, so blocks copied
    on write and blocks swapped to the CPU and back (`preemption_mode="swap"`) carry their scales with them.
    """

    def __init__(self, config: GPTConfig, num_blocks: int, block_size: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32):
        # `dtype` is what K/V are de-quantized to for attention (the engine passes its kv_dtype setting); storage is
        # int8 whatever it says. subtle: the parent's fp32 pools are allocated, then replaced (a transient).
        num_blocks, block_size = _check_sizes(config, ("num_blocks", "block_size"), (num_blocks, block_size))
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:  # else refused only inside attend
            raise TypeError(f"dtype must be a floating-point torch.dtype (what K/V are de-quantized to for attention), "
                            f"got {dtype!r}")
        super().__init__(config, num_blocks, block_size, device=check_device("device", device), dtype=dtype,
                         use_fast_decode=False)
        shape = (num_blocks, block_size, config.n_head, config.head_size)  # (nb, bs, nh, hs)
        self.k_pools = [torch.zeros(shape, dtype=torch.int8, device=self.device) for _ in range(config.n_layer)]
        self.v_pools = [torch.zeros(shape, dtype=torch.int8, device=self.device) for _ in range(config.n_layer)]
        scale_shape = shape[:-1] + (1,)  # (nb, bs, nh, 1)
        self.k_scales = [torch.ones(scale_shape, device=self.device) for _ in range(config.n_layer)]
        self.v_scales = [torch.ones(scale_shape, device=self.device) for _ in range(config.n_layer)]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k_pools + self.v_pools + self.k_scales + self.v_scales)

    def block_tensors(self) -> list[torch.Tensor]:
        """The codes (nb, bs, nh, hs) int8 and the scales (nb, bs, nh, 1) of every layer: a block is both, so
        copy-on-write and swapping carry the scales with the codes."""
        return self.k_pools + self.v_pools + self.k_scales + self.v_scales

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v (1, nh, N, hs): quantize the N new tokens' K/V into their slots, then the reference loop."""
        check_attend_args(self.config, layer_idx, q, k, v)
        batch = self.batch
        if batch is None:
            raise ValueError("Int8PagedKVCache.attend called before set_batch(PagedBatch)")
        if q.dim() != 4 or q.shape[0] != 1 or q.shape[2] != batch.num_tokens:
            raise ValueError(f"paged attention expects q of shape (1, nh, N={batch.num_tokens}, hs), got "
                             f"{tuple(q.shape)}")
        for pools, scales, x in ((self.k_pools, self.k_scales, k), (self.v_pools, self.v_scales, v)):
            codes, s = _quantize_kv(x[0].transpose(0, 1))  # (nh, N, hs) -> (N, nh, hs) int8, (N, nh, 1)
            write_kv(pools[layer_idx], batch.slot_mapping, codes)
            write_kv(scales[layer_idx], batch.slot_mapping, s)
        return self._attend_ragged(layer_idx, q, batch)

    def gather(self, layer_idx: int, seq_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The de-quantized K and V of batch sequence `seq_index` through its block table: each (1, nh, ctx, hs)."""
        ctx, blocks = self._sequence_blocks(layer_idx, seq_index)
        out = []
        for pool, scales in ((self.k_pools[layer_idx], self.k_scales[layer_idx]),
                             (self.v_pools[layer_idx], self.v_scales[layer_idx])):
            codes = pool.index_select(0, blocks).flatten(0, 1)[:ctx]  # (nblk, bs, nh, hs) -> (ctx, nh, hs)
            s = scales.index_select(0, blocks).flatten(0, 1)[:ctx]  # (ctx, nh, 1)
            kv = dequantize_kv(codes, s, self.dtype, check_values=False)  # (ctx, nh, hs)
            out.append(kv.transpose(0, 1).unsqueeze(0))  # (1, nh, ctx, hs)
        return out[0], out[1]


register_attention_backend("paged-int8", Int8PagedKVCache)

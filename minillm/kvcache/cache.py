"""A contiguous, preallocated KV cache: keep every layer's keys and values so decode computes one token, not all.

What it adds: per-layer K/V tensors of shape (B, nh, max_len, hs) allocated once, written in place as tokens
arrive, and attention of the new queries over everything kept so far (prefill, decode, or a chunk in between),
with left padding for static batches (a per-row count of padding slots that no query may see). What it still
leaves out: every row reserves max_len slots up front whether it uses them or not, and rows cannot share or
free memory; chapter 05's paged cache removes both wastes.

Layout of one row of one layer (left padding p, n real tokens so far, max_len slots):

    slot:   0 .. p-1      p .. p+n-1          p+n .. max_len-1
            [ padding ]   [ real K/V, pos 0.. ] [ free, never read ]

All rows of a static batch advance together, so the write position ("slot") is one integer per layer; a row's
absolute position (for the position embedding) is its slot minus its padding.

The contract later chapters rely on (each point has a test in tests/test_contract.py):
  - a step may add any number of tokens T to a cache that holds some already (speculative decoding's verify step,
    chapter 08), and `truncate(n)` rolls every row back to n slots (its rejected draft tokens);
  - K/V are stored in the cache's own `dtype` (a setting, never read off the weights) and converted to the query's
    dtype when read, a no-op when they agree (chapter 09's quantized KV plugs in there);
  - `attend` never synchronises with the device (no .item(), .tolist(), no tensors built from tensor values), and
    with `use_static_shapes=True` every step has the same shapes whatever the length: it writes at a device-side
    slot counter and attends over all max_len slots under a length mask, which is what torch.compile and CUDA
    graphs (chapter 13) need. The default path slices the kept slots instead (fewer FLOPs, shapes grow per step).
"""

from __future__ import annotations

import torch

from minillm.core.attention import attention, causal_mask
from minillm.core.config import (GPTConfig, check_device, check_has_data, check_int, check_tensor_elements, number_kind,
                                 tensor_kind)


def kv_cache_bytes(n_layer: int, n_kv_head: int, head_dim: int, num_tokens: int, batch_size: int = 1,
                   bytes_per_elem: int = 4) -> int:
    """The KV-cache memory formula: 2 (K and V) x layers x kv heads x head_dim x tokens x batch x bytes.

    vLLM §3's worked example (OPT-13B, fp16, hidden 5120 = 40 heads x 128): 2 x 40 x 40 x 128 x 1 x 1 x 2 =
    819,200 bytes = 800 KB per token. With grouped-query attention only the kv heads count (Llama-3.1-8B:
    2 x 32 x 8 x 128 x 2 = 131,072 bytes = 128 KiB per token).
    """
    n_layer = check_int("n_layer", n_layer, 0)
    n_kv_head = check_int("n_kv_head", n_kv_head, 0)
    head_dim = check_int("head_dim", head_dim, 0)
    num_tokens = check_int("num_tokens", num_tokens, 0)
    batch_size = check_int("batch_size", batch_size, 0)
    bytes_per_elem = check_int("bytes_per_elem", bytes_per_elem, 0)
    return 2 * n_layer * n_kv_head * head_dim * num_tokens * batch_size * bytes_per_elem



def check_attend_args(config: GPTConfig, layer_idx: object, q: object, k: object, v: object) -> None:
    """A cache's `attend` arguments as the model passes them: layer_idx an int in [0, n_layer) (-1 would read the
    last layer's slots) and q, k, v 4-D tensors of one shape (B, n_head, T, head_size) (a k of two tokens with a q
    of one would be stored, silently); a TypeError / ValueError naming the argument. Host-only, a few type and
    shape tests per layer call."""
    if not isinstance(config, GPTConfig):
        raise TypeError(f"config must be the cache's GPTConfig, got {type(config).__name__}")
    if type(layer_idx) is not int:
        layer_idx = check_int("layer_idx", layer_idx, 0)
    if not 0 <= layer_idx < config.n_layer:
        raise ValueError(f"layer_idx must be in [0, n_layer={config.n_layer}), got {layer_idx}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise TypeError(f"{name} must be a 4-D tensor (B, nh, T, hs), got {tensor_kind(t)}"
                            + (f" of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else ""))
        check_has_data(name, t)  # a meta k would be named x by the quantizer
    shape = tuple(q.shape)  # type: ignore[union-attr]
    if shape[1] != config.n_head or shape[3] != config.head_size:
        raise ValueError(f"q must be (B, n_head={config.n_head}, T, head_size={config.head_size}), got {shape}")
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != shape:  # type: ignore[union-attr]
            raise ValueError(f"{name} must have q's shape {shape} (this step's keys and values), got "
                             f"{tuple(t.shape)}")  # type: ignore[union-attr]


def attend_args_fit(config: GPTConfig, layer_idx: object, q: object, k: object, v: object) -> bool:
    """The cheap test a cache's `attend` makes on every layer call: a plain int layer in range and q, k, v tensors
    of one 4-D shape (B, n_head, T, head_size). False sends the caller to `check_attend_args`, whose error names
    the argument (an int subclass's layer passes there)."""
    return (type(layer_idx) is int and 0 <= layer_idx < config.n_layer and all(map(torch.is_tensor, (q, k, v)))
            and q.shape == k.shape == v.shape and q.dim() == 4  # type: ignore[union-attr]
            and q.shape[1] == config.n_head and q.shape[3] == config.head_size)  # type: ignore[union-attr]


class ContiguousKVCache:
    """Preallocated K/V storage for `batch_size` sequences of up to `max_len` slots each (padding included).

    Implements `minillm.core.model.KVCacheProtocol`: `GPT.forward(idx, positions, cache=this)` makes every layer call
    `attend(layer_idx, q, k, v)`, which appends k, v at the layer's write position and returns the attention of
    q over all kept slots. Each layer keeps its own write position, so a forward advances the cache by T without
    the caller having to say so; after a full forward all layers agree (`length`).
    """

    def __init__(self, config: GPTConfig, batch_size: int, max_len: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, use_static_shapes: bool = False):
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        batch_size = check_int("batch_size", batch_size)
        max_len = check_int("max_len", max_len)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        if not isinstance(use_static_shapes, bool):
            raise TypeError(f"use_static_shapes must be a bool, got {use_static_shapes!r}")
        self.config = config
        self.batch_size = batch_size
        self.max_len = max_len
        self.device = check_device("device", device, allocates=True)
        self.dtype = dtype
        shape = (batch_size, config.n_head, max_len, config.head_size)  # (B, nh, max_len, hs)
        check_tensor_elements("batch_size x n_head x max_len x head_size", shape)  # before the allocator sees it
        # Allocated once: decode never allocates cache memory, it writes into these in place.
        self.k = [torch.zeros(shape, device=self.device, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, device=self.device, dtype=dtype) for _ in range(config.n_layer)]
        self._layer_len = [0] * config.n_layer  # slots written so far, per layer
        self.pad_lens = torch.zeros(batch_size, dtype=torch.long, device=self.device)  # (B,) left padding per row
        self._has_padding = False
        self._mask_key: tuple[int, int] | None = None  # (start, T) the cached mask was built for
        self._mask: torch.Tensor | None = None
        self.use_static_shapes = use_static_shapes
        # Static-shape path only: the write position as a device tensor, the one source of truth there, so a
        # compiled or captured step reads it as data instead of baking a Python int into the graph (_layer_len
        # stays 0 in that mode; reading `length` then costs one host sync, outside the step).
        self.slot = torch.zeros((), dtype=torch.long, device=self.device)  # () next slot to write
        self._key_slots = torch.arange(max_len, device=self.device)  # (max_len,) the slot index of every key
        self._q_slots: torch.Tensor | None = None  # (T,) slots of the current forward's new tokens

    # ----- bookkeeping -------------------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes held by the K and V tensors (measured from the tensors, not computed from the formula)."""
        return sum(t.nbytes for t in self.k) + sum(t.nbytes for t in self.v)

    @property
    def length(self) -> int:
        """Slots filled in every layer (padding included): where the next token goes."""
        if self.use_static_shapes:
            return int(self.slot)  # one host sync: bookkeeping between steps, never inside one
        # The invariant holds between forwards; inside one, early layers are ahead of later ones.
        assert len(set(self._layer_len)) == 1, f"layers disagree on the cache length: {self._layer_len}"
        return self._layer_len[0]

    @property
    def lengths(self) -> torch.Tensor:
        """(B,) real tokens cached per row: slots filled minus that row's left padding."""
        return (self.length - self.pad_lens).clamp(min=0)

    @property
    def remaining(self) -> int:
        return self.max_len - self.length

    def reset(self, pad_lens: list[int] | torch.Tensor | None = None) -> "ContiguousKVCache":
        """Forget every cached token (the memory stays allocated) and set each row's left padding."""
        pads = torch.zeros(self.batch_size, dtype=torch.long) if pad_lens is None else torch.as_tensor(pad_lens)
        if pads.shape != (self.batch_size,) or pads.is_floating_point():
            raise ValueError(f"pad_lens must be {self.batch_size} ints (one per row), got {pad_lens!r}")
        if int(pads.min()) < 0 or int(pads.max()) >= self.max_len:
            raise ValueError(f"pad_lens must be in [0, max_len={self.max_len}), got {pads.tolist()}")
        self._layer_len = [0] * self.config.n_layer
        self._mask_key, self._mask = None, None
        self.slot.zero_()
        self.pad_lens.copy_(pads)
        self._has_padding = bool((pads > 0).any())
        return self

    def truncate(self, length: int) -> "ContiguousKVCache":
        """Forget every slot from `length` on (keep slots 0..length-1): rewind to re-run or reject tokens.

        Nothing is cleared; later writes overwrite the forgotten slots, and no query ever reads a slot at or past
        the write position. Benchmarks use it to time one decode step at a fixed position again and again;
        speculative decoding (chapter 08) rejects draft tokens with it. Every row rolls back together (a static
        batch shares one write position); rows that need their own lengths use chapter 05's paged cache, where
        `BlockManager.truncate` rolls back one sequence.
        """
        if not isinstance(length, int) or isinstance(length, bool):
            raise TypeError(f"length must be an int, got {number_kind(length)}")
        if not 0 <= length <= self.length:
            raise ValueError(f"can only truncate to a length in [0, {self.length}], got {length}")
        self._layer_len = [length] * self.config.n_layer
        self.slot.fill_(length)
        return self

    def mark_written(self, num_new: int) -> "ContiguousKVCache":
        """Move the write position past `num_new` slots that a caller wrote into `k` and `v` itself, in every layer.

        `attend` writes and advances in one go; a step that bypasses the model's layers (chapter 13's C++ decode
        step, which stores each token's keys and values into these tensors directly) calls this once afterwards, so
        the cache's length stays the one source of truth.
        """
        if self.use_static_shapes:
            raise ValueError("a static-shape cache advances its own device-side slot counter; mark_written is for "
                             "the dynamic cache")
        num_new = check_int("num_new", num_new, minimum=0)
        if self.length + num_new > self.max_len:
            raise ValueError(f"cache full: {self.length} slots used + {num_new} new > max_len={self.max_len}")
        self._layer_len = [self.length + num_new] * self.config.n_layer
        return self

    def positions(self, num_new: int) -> torch.Tensor:
        """(B, num_new) absolute positions of the next num_new tokens: slot minus padding, 0 on padding slots."""
        num_new = check_int("num_new", num_new, 0)
        start = self.slot if self.use_static_shapes else self.length  # a device scalar keeps this sync-free
        slots = torch.arange(num_new, device=self.device) + start  # (T,)
        return (slots.unsqueeze(0) - self.pad_lens.unsqueeze(1)).clamp(min=0)  # (B, T)

    # ----- the attention hook ------------------------------------------------------------------------------------

    def attention_mask(self, start: int, num_new: int) -> torch.Tensor | None:
        """Boolean mask (B, 1, T, start+T), True = may attend; None when plain causal attention is exact.

        Query t sits at slot start+t. It sees slot j when j <= start+t (causal) and j is not padding of its row.
        """
        start, num_new = check_int("start", start, 0), check_int("num_new", num_new, 0)
        if start + num_new > self.max_len:
            raise ValueError(f"start={start} + num_new={num_new} is past the cache's max_len={self.max_len} slots")
        # BEGIN SOLUTION
        end = start + num_new
        if not self._has_padding:
            return None  # no padding: causality alone decides, and attend picks the cheapest exact form of it
        causal = causal_mask(num_new, end, device=self.device)  # (T, end), True = key at or before the query
        slots = torch.arange(end, device=self.device)  # (end,)
        real_key = slots.unsqueeze(0) >= self.pad_lens.unsqueeze(1)  # (B, end): False on each row's padding
        mask = causal.unsqueeze(0) & real_key.unsqueeze(1)  # (1, T, end) & (B, 1, end) -> (B, T, end)
        # subtle: a padding query (slot < pad) would see no key at all; softmax over nothing is NaN, and NaN
        # values later leak into real rows as 0 * NaN. Let each slot see itself so padding stays finite garbage
        # that no real query ever reads (its weight is exactly 0).
        q_slots = torch.arange(start, end, device=self.device)  # (T,)
        mask |= (slots.unsqueeze(0) == q_slots.unsqueeze(1)).unsqueeze(0)  # (1, T, end)
        return mask.unsqueeze(1)  # (B, 1, T, end): broadcast over heads
        # END SOLUTION

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write this step's k, v (B, nh, T, hs) at the layer's write position; attend q over every kept slot."""
        if not attend_args_fit(self.config, layer_idx, q, k, v):  # a few cheap tests per layer
            check_attend_args(self.config, layer_idx, q, k, v)  # names the bad argument (and passes an int subclass)
        B, nh, T, hs = k.shape
        if B != self.batch_size:
            raise ValueError(f"batch of {B} rows does not match the cache's batch_size={self.batch_size}")
        if self.use_static_shapes:
            return self._attend_static(layer_idx, q, k, v)
        start = self._layer_len[layer_idx]
        if start + T > self.max_len:
            raise ValueError(f"cache full: {start} slots used + {T} new > max_len={self.max_len}")
        # BEGIN SOLUTION
        end = start + T
        self.k[layer_idx][:, :, start:end].copy_(k)  # in place: no new cache memory per step (cast to dtype)
        self.v[layer_idx][:, :, start:end].copy_(v)
        # A view of slots 0..end-1, converted to the query's dtype on read (no copy when they agree).
        keys = self.k[layer_idx][:, :, :end].to(q.dtype)  # (B, nh, end, hs)
        values = self.v[layer_idx][:, :, :end].to(q.dtype)  # (B, nh, end, hs)
        self._layer_len[layer_idx] = end
        if self._has_padding:
            if self._mask_key != (start, T):  # every layer of one forward needs the same mask: build it once
                self._mask_key, self._mask = (start, T), self.attention_mask(start, T)
            return attention(q, keys, values, mask=self._mask)  # (B, nh, T, hs)
        if T == 1:
            return attention(q, keys, values)  # decode: the newest token may see every kept slot, no mask needed
        if start == 0:
            return attention(q, keys, values, is_causal=True)  # prefill from empty: the usual lower triangle
        # A chunk after earlier tokens: query t sits at slot start+t (causal_mask offsets the triangle).
        return attention(q, keys, values, mask=causal_mask(T, end, device=q.device))  # (B, nh, T, hs)
        # END SOLUTION

    def _attend_static(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The static-shape twin of `attend`: same outputs, but every tensor's shape is fixed by (B, T, max_len).

        The new tokens go to slots slot..slot+T-1 read from the device counter `self.slot`; attention runs over
        all max_len slots with a mask, so unwritten and forgotten slots get weight exactly 0. It costs attention
        over max_len keys instead of the kept ones; what it buys is one graph for every step of a decode.
        subtle: it reads no Python state that changes per step (a compiled step would be guarded on it and
        recompiled every token), so it cannot check for overflow without a host sync: the caller keeps
        slot + T <= max_len, as every generator does by sizing the cache for prompt + max_new_tokens at its entry.
        """
        B, nh, T, hs = k.shape
        if layer_idx == 0 or self._mask is None:  # one mask per forward, shared by every layer
            q_slots = self.slot + torch.arange(T, device=self.device)  # (T,) slots of the new tokens
            keys_ = self._key_slots.unsqueeze(0)  # (1, max_len)
            causal = keys_ <= q_slots.unsqueeze(1)  # (T, max_len): written at or before the query
            real = keys_ >= self.pad_lens.unsqueeze(1)  # (B, max_len): False on each row's padding
            mask = causal.unsqueeze(0) & real.unsqueeze(1)  # (1, T, max_len) & (B, 1, max_len) -> (B, T, max_len)
            mask |= (keys_ == q_slots.unsqueeze(1)).unsqueeze(0)  # a padding query sees itself (see attention_mask)
            self._mask = mask.unsqueeze(1)  # (B, 1, T, max_len): broadcast over heads
            self._mask_key = None  # the dynamic path's cached mask is not this one
            self._q_slots = q_slots
        self.k[layer_idx].index_copy_(2, self._q_slots, k.to(self.dtype))  # (B, nh, max_len, hs)[:, :, slots] = k
        self.v[layer_idx].index_copy_(2, self._q_slots, v.to(self.dtype))
        if layer_idx == self.config.n_layer - 1:
            self.slot += T  # in place: a captured step advances its own position
        keys = self.k[layer_idx].to(q.dtype)  # (B, nh, max_len, hs)
        values = self.v[layer_idx].to(q.dtype)  # (B, nh, max_len, hs)
        return attention(q, keys, values, mask=self._mask)  # (B, nh, T, hs)

"""The KV hand-off: gather a prompt's keys and values out of paged blocks, ship them as bytes, scatter them back.

This is the one thing disaggregation adds to the data path. The prefill worker runs the prompt through the model
into *its* paged pool; `pack_kv` gathers the prompt's T token slots, block by block, into one contiguous tensor
(L, 2, T, nh, hs); `payload_to_bytes` turns it into the bytes that cross the process boundary; on the far side
`payload_from_bytes` and `unpack_kv` write them into blocks the decode worker allocated from *its own* pool, under
a different block table. What it leaves out: compression of the KV (chapter 09), layer-by-layer pipelining of the
transfer with the prefill compute (what a production system does), and RDMA/NVLink transports.

What is sent, exactly: the T prompt tokens, not whole blocks. The last block of a prompt is usually partly empty
(T mod bs tokens used); sending only the used slots makes the payload

    bytes = 2 (K and V) * n_layer * n_head * head_size * T * element_size

the KV formula of chapter 04, with no padding. `kv_bytes` computes it; the tests check it byte for byte.

Layout of the payload tensor (L, 2, T, nh, hs): layer-major, then K before V, then token order. Pool tensors are
(nb, bs, nh, hs) per layer, as in chapter 05's `PagedKVCache`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minillm.core.config import GPTConfig, check_float_tensor, check_instance, check_int_list, short_repr

# Dtypes a payload may carry, by name: the receiver rebuilds the tensor from the name, never from pickled objects.
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def kv_bytes(config: GPTConfig, num_tokens: int, dtype: torch.dtype = torch.float32) -> int:
    """2 * n_layer * n_head * head_size * num_tokens * element_size: the bytes of K and V for num_tokens tokens."""
    check_instance("config", config, GPTConfig, "the model's GPTConfig")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__} {short_repr(dtype)}")
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
        raise ValueError(f"num_tokens must be a non-negative int, got {short_repr(num_tokens)}")
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * config.n_layer * config.n_head * config.head_size * num_tokens * element_size


def _check_pools(k_pools: Sequence[torch.Tensor], v_pools: Sequence[torch.Tensor]) -> tuple[int, int, int, int]:
    for name, pools in (("k_pools", k_pools), ("v_pools", v_pools)):
        if not isinstance(pools, (list, tuple)) or not all(isinstance(p, torch.Tensor) for p in pools):
            raise TypeError(f"{name} must be a list of per-layer pool tensors (nb, bs, nh, hs), got "
                            f"{short_repr(pools)}")
    if len(k_pools) == 0 or len(k_pools) != len(v_pools):
        raise ValueError(f"need one K and one V pool per layer, got {len(k_pools)} K and {len(v_pools)} V pools")
    shape = tuple(k_pools[0].shape)
    if len(shape) != 4:
        raise ValueError(f"a pool must have shape (nb, bs, nh, hs), got {shape}")
    for pool in list(k_pools) + list(v_pools):
        if tuple(pool.shape) != shape:
            raise ValueError(f"all pools must share one shape, got {tuple(pool.shape)} and {shape}")
        if not pool.is_floating_point():  # int8 codes mean nothing without the scale pools, which are not carried
            raise ValueError(f"KV transfer needs float K/V pools, got {pool.dtype}: int8 KV "
                             f"(attention_backend='paged-int8') keeps per-token scales the hand-off does not carry")
    return shape  # type: ignore[return-value]


def _check_table(block_table: Sequence[int], num_tokens: int, nb: int, bs: int) -> None:
    check_int_list("block_table", block_table)
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens <= 0:
        raise ValueError(f"num_tokens must be a positive int, got {short_repr(num_tokens)}")
    need = math.ceil(num_tokens / bs)
    if len(block_table) < need:
        raise ValueError(f"block_table has {len(block_table)} blocks but {num_tokens} tokens need {need} of size {bs}")
    for b in block_table[:need]:
        if not 0 <= int(b) < nb:
            raise ValueError(f"block id {b} in block_table is outside the pool [0, {nb})")


def pack_kv(
    k_pools: Sequence[torch.Tensor], v_pools: Sequence[torch.Tensor], block_table: Sequence[int], num_tokens: int
) -> torch.Tensor:
    """Gather the first `num_tokens` token slots named by `block_table` into one (L, 2, T, nh, hs) tensor.

    Token t of the sequence lives in block block_table[t // bs] at offset t % bs (chapter 05's slot mapping).
    Worked example: bs=4, block_table=[7, 2], T=6 -> tokens 0..3 come from block 7, tokens 4..5 from slots 0..1
    of block 2; slots 2..3 of block 2 are not sent.
    """
    nb, bs, nh, hs = _check_pools(k_pools, v_pools)
    _check_table(block_table, num_tokens, nb, bs)
    # BEGIN SOLUTION
    need = math.ceil(num_tokens / bs)
    idx = torch.as_tensor(list(block_table[:need]), dtype=torch.int64, device=k_pools[0].device)  # (need,)
    layers = []
    for k_pool, v_pool in zip(k_pools, v_pools):
        k = k_pool[idx].reshape(need * bs, nh, hs)[:num_tokens]  # (need, bs, nh, hs) -> (T, nh, hs)
        v = v_pool[idx].reshape(need * bs, nh, hs)[:num_tokens]  # (need, bs, nh, hs) -> (T, nh, hs)
        layers.append(torch.stack([k, v]))  # (2, T, nh, hs)
    return torch.stack(layers).contiguous()  # (L, 2, T, nh, hs)
    # END SOLUTION


def unpack_kv(
    payload: torch.Tensor, k_pools: Sequence[torch.Tensor], v_pools: Sequence[torch.Tensor], block_table: Sequence[int]
) -> None:
    """Scatter a (L, 2, T, nh, hs) payload into the pools at the slots named by `block_table` (in place).

    The inverse of `pack_kv`: afterwards `pack_kv(k_pools, v_pools, block_table, T)` equals `payload` exactly.
    Slots past T in the last block are left untouched (the decode worker writes its next tokens there).
    """
    check_float_tensor("payload", payload)
    nb, bs, nh, hs = _check_pools(k_pools, v_pools)
    if payload.dim() != 5 or payload.shape[0] != len(k_pools) or payload.shape[1] != 2:
        raise ValueError(f"payload must have shape (L={len(k_pools)}, 2, T, nh, hs), got {tuple(payload.shape)}")
    if tuple(payload.shape[3:]) != (nh, hs):
        raise ValueError(f"payload heads/head size {tuple(payload.shape[3:])} do not match the pool's {(nh, hs)}")
    if payload.dtype != k_pools[0].dtype:
        raise ValueError(f"payload dtype {payload.dtype} does not match the pool dtype {k_pools[0].dtype}")
    num_tokens = int(payload.shape[2])
    _check_table(block_table, num_tokens, nb, bs)
    # BEGIN SOLUTION
    pos = torch.arange(num_tokens, device=k_pools[0].device)  # (T,)
    table = torch.as_tensor(list(block_table), dtype=torch.int64, device=k_pools[0].device)
    blocks, offsets = table[pos // bs], pos % bs  # (T,), (T,): each token's physical slot
    payload = payload.to(k_pools[0].device)
    for layer, (k_pool, v_pool) in enumerate(zip(k_pools, v_pools)):
        k_pool[blocks, offsets] = payload[layer, 0]  # (T, nh, hs) into (nb, bs, nh, hs)
        v_pool[blocks, offsets] = payload[layer, 1]  # (T, nh, hs) into (nb, bs, nh, hs)
    # END SOLUTION


@dataclass
class KVHeader:
    """What the receiver needs to rebuild a payload from raw bytes: its dtype by name and its shape."""

    dtype: str  # a key of _DTYPES, e.g. "float32"
    shape: tuple[int, int, int, int, int]  # (L, 2, T, nh, hs)

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; choose one of {sorted(_DTYPES)}")
        self.shape = tuple(int(s) for s in self.shape)  # type: ignore[assignment]
        if len(self.shape) != 5 or self.shape[1] != 2 or min(self.shape) < 0:
            raise ValueError(f"KV payload shape must be (L, 2, T, nh, hs), got {self.shape}")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=_DTYPES[self.dtype]).element_size()


def payload_to_bytes(payload: torch.Tensor) -> tuple[KVHeader, bytes]:
    """The payload as (header, raw little-endian bytes); len(bytes) == header.nbytes == payload.nbytes."""
    check_float_tensor("payload", payload, ndim=5)
    name = str(payload.dtype).removeprefix("torch.")
    header = KVHeader(dtype=name, shape=tuple(payload.shape))  # type: ignore[arg-type]
    # subtle: view as uint8 before .numpy(), so bfloat16 (which numpy lacks) travels too.
    raw = payload.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
    assert len(raw) == header.nbytes
    return header, raw


def payload_from_bytes(header: KVHeader, data: bytes | bytearray | memoryview) -> torch.Tensor:
    """Rebuild the (L, 2, T, nh, hs) tensor from `payload_to_bytes`' output; the length must match the header."""
    check_instance("header", header, KVHeader, "a KVHeader (from payload_to_bytes)")
    check_instance("data", data, (bytes, bytearray, memoryview), "bytes")
    if len(data) != header.nbytes:
        raise ValueError(f"KV payload has {len(data)} bytes but its header {header.shape} {header.dtype} "
                         f"needs {header.nbytes}")
    if header.nbytes == 0:
        return torch.empty(header.shape, dtype=_DTYPES[header.dtype])
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # a writable copy: the pool write must not alias
    return flat.view(_DTYPES[header.dtype]).view(header.shape)  # (L, 2, T, nh, hs)

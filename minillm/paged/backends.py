"""Attention backends by name: the one table the engine reads to build its KV cache.

It adds a registry name -> factory, so a new attention implementation (chapter 12's CUDA kernels, a quantized KV
store from chapter 09) plugs in as one more entry instead of one more flag on `PagedKVCache`. Each backend is
registered where it is defined, in that module's own layer: `paged_cache.py` registers "paged" and
"paged-reference", chapter 06's `selective_cache.py` registers "selective" (the engine's default). What it leaves
out: choosing a backend automatically (by device or shape); the caller names one (`EngineConfig.attention_backend`).

A factory is called as `factory(config, num_blocks, block_size, device=..., dtype=...)` and returns an engine KV
cache: a `KVCacheProtocol` (`attend`) with `PagedKVCache`'s step interface (`set_batch(PagedBatch)`,
`copy_blocks(pairs)`, per-layer `k_pools` / `v_pools` of shape (nb, bs, nh, hs) that swapping and KV transfer
copy). Subclassing `PagedKVCache` and overriding `attend` is the shortest way to write one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from minillm.core.config import GPTConfig

# name -> factory(config, num_blocks, block_size, *, device, dtype) -> a PagedKVCache-like cache
AttentionBackendFactory = Callable[..., Any]

_BACKENDS: dict[str, AttentionBackendFactory] = {}


def register_attention_backend(name: str, factory: AttentionBackendFactory, replace: bool = False) -> None:
    """Make `factory` selectable as `name`. Registering a taken name is a ValueError unless `replace=True`."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"an attention backend name must be a non-empty str, got {name!r}")
    if not callable(factory):
        raise TypeError(f"attention backend {name!r} needs a callable factory, got {type(factory).__name__}")
    if name in _BACKENDS and not replace and _BACKENDS[name] is not factory:
        raise ValueError(f"attention backend {name!r} is already registered; pass replace=True to override it")
    _BACKENDS[name] = factory


def unregister_attention_backend(name: str) -> None:
    """Remove a registered backend (tests register toy ones and take them out again)."""
    check_attention_backend(name)
    del _BACKENDS[name]


def attention_backends() -> tuple[str, ...]:
    """The registered names, sorted."""
    return tuple(sorted(_BACKENDS))


def check_attention_backend(name: object) -> str:
    """`name` itself if it is registered; a TypeError for a non-str, a ValueError listing the known names otherwise."""
    if not isinstance(name, str):
        raise TypeError(f"attention backend must be a str naming one of {list(attention_backends())}, got {name!r}")
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known backends: {list(attention_backends())}")
    return name


def make_attention_backend(name: str, config: GPTConfig, num_blocks: int, block_size: int,
                           device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Any:
    """Build the KV cache of backend `name` (see the module docstring for what it must offer)."""
    return _BACKENDS[check_attention_backend(name)](config, num_blocks, block_size, device=device, dtype=dtype)

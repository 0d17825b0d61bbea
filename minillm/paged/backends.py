"""Attention backends by name: the one table the engine reads to build its KV cache.

It adds a registry name -> factory, so a new attention implementation (chapter 12's CUDA kernels, a quantized KV
store from chapter 09) plugs in as one more entry instead of one more flag on `PagedKVCache`. Each backend is
registered where it is defined, in that module's own layer: `paged_cache.py` registers "paged" and
"paged-reference", chapter 06's `selective_cache.py` registers "selective" (the engine's default). What it leaves
out: choosing a backend automatically (by device or shape); the caller names one (`EngineConfig.attention_backend`).

The backends minillm ships are also listed in `SHIPPED_BACKENDS`, name -> the module that registers it, so every
shipped name works in a fresh interpreter: `check_attention_backend` and `attention_backends()` know them without
importing anything, and `make_attention_backend` imports the module on first use. The table holds module *names*
(strings), not imports: this module is chapter 05's, and most of those modules belong to later chapters, which may
import chapter 05 but not be imported by it (tests/test_layers.py).

A factory is called as `factory(config, num_blocks, block_size, device=..., dtype=...)` and returns an engine KV
cache: a `KVCacheProtocol` (`attend`) with `PagedKVCache`'s step interface (`set_batch(PagedBatch)`,
`copy_blocks(pairs)`, per-layer `k_pools` / `v_pools` of shape (nb, bs, nh, hs), and `block_tensors()`: every
tensor a block lives in, K/V pools and anything else kept per block, which copy-on-write and swapping copy; chapter
07's KV transfer copies the float `k_pools` / `v_pools` only). Subclassing `PagedKVCache` and overriding `attend` is
the shortest way to write one. A backend that needs something the machine may lack (a C++ compiler) says so when it
is built, naming itself and what is missing.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from minillm.core.config import GPTConfig

# name -> factory(config, num_blocks, block_size, *, device, dtype) -> a PagedKVCache-like cache
AttentionBackendFactory = Callable[..., Any]

# The shipped backends: name -> the module that registers it when imported (tests/test_backends.py checks that
# each module does register its names).
SHIPPED_BACKENDS: dict[str, str] = {
    "paged": "minillm.paged.paged_cache",  # chapter 05: vectorized decode over the block tables
    "paged-reference": "minillm.paged.paged_cache",  # chapter 05: one sequence at a time, the naive twin
    "selective": "minillm.engine.selective_cache",  # chapter 06: the engine's default
    "verify": "minillm.speculative.verify_cache",  # chapter 08: verify steps (k + 1 tokens) in one call
    "paged-int8": "minillm.quant.kv_cache",  # chapter 09: int8 K/V codes with per-token scales
    "selective-cpp": "minillm.compile.cpu_paged",  # chapter 13: decode attention in C++ (needs a C++ compiler)
    "verify-cpp": "minillm.compile.cpu_paged",  # chapter 13: decode and verify attention in C++ (chapter 08's steps)
}

_BACKENDS: dict[str, AttentionBackendFactory] = {}


def _import_shipped(name: str) -> None:
    """Import the module that registers the shipped backend `name`, if it is not imported yet.

    subtle: that module calls `register_attention_backend` while it is being imported, which calls this again;
    `import_module` of a module already being imported returns the half-built module from sys.modules without
    running it a second time, so the registration simply goes on."""
    if name in SHIPPED_BACKENDS and name not in _BACKENDS:
        importlib.import_module(SHIPPED_BACKENDS[name])


def register_attention_backend(name: str, factory: AttentionBackendFactory, replace: bool = False) -> None:
    """Make `factory` selectable as `name`. Registering a taken name is a ValueError unless `replace=True`.

    A shipped name counts as taken even before its module is imported (it is imported here first), so a user's
    backend cannot silently shadow a shipped one, nor break that module's import later."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"an attention backend name must be a non-empty str, got {name!r}")
    if not callable(factory):
        raise TypeError(f"attention backend {name!r} needs a callable factory, got {type(factory).__name__}")
    _import_shipped(name)
    if name in _BACKENDS and not replace and _BACKENDS[name] is not factory:
        raise ValueError(f"attention backend {name!r} is already registered; pass replace=True to override it")
    _BACKENDS[name] = factory


def unregister_attention_backend(name: str) -> None:
    """Remove a registered backend (tests register toy ones and take them out again).

    Removing a shipped one removes it for the rest of the process: its module is not imported a second time."""
    check_attention_backend(name)
    _import_shipped(name)
    if name not in _BACKENDS:
        raise ValueError(f"attention backend {name!r} was already unregistered")
    del _BACKENDS[name]


def attention_backends() -> tuple[str, ...]:
    """The known names, sorted: every shipped one (imported or not) and every registered one."""
    return tuple(sorted(set(SHIPPED_BACKENDS) | set(_BACKENDS)))


def check_attention_backend(name: object) -> str:
    """`name` itself if it is known; a TypeError for a non-str, a ValueError listing the known names otherwise.

    Nothing is imported or built: a backend that cannot be built here is still a valid name, and fails, saying why,
    in `make_attention_backend`."""
    if not isinstance(name, str):
        raise TypeError(f"attention backend must be a str naming one of {list(attention_backends())}, got {name!r}")
    if name not in _BACKENDS and name not in SHIPPED_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known backends: {list(attention_backends())}")
    return name


def get_attention_backend(name: str) -> AttentionBackendFactory:
    """The factory registered as `name`, importing the module of a shipped backend on first use."""
    _import_shipped(check_attention_backend(name))
    if name not in _BACKENDS:  # a shipped name taken out with unregister_attention_backend
        raise ValueError(f"attention backend {name!r} (from {SHIPPED_BACKENDS[name]}) was unregistered; "
                         f"registered backends: {sorted(_BACKENDS)}")
    return _BACKENDS[name]


def make_attention_backend(name: str, config: GPTConfig, num_blocks: int, block_size: int,
                           device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Any:
    """Build the KV cache of backend `name` (see the module docstring for what it must offer)."""
    return get_attention_backend(name)(config, num_blocks, block_size, device=device, dtype=dtype)

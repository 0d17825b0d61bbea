"""`EngineConfig`: how big the KV pool is and how much work one engine step may take; nothing about the model.

The engine config is separate from the model's `GPTConfig` and from each request's `SamplingParams` (style.md:
separate model, sampling and engine configs). Checks that need the model (the context window) happen in
`minillm.engine.llm.LLM`, which sees both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minillm.core.config import check_choice, check_int, check_tensor_elements
from minillm.engine.selective_cache import SelectiveKVCache  # noqa: F401  (registers the default backend)
from minillm.paged.backends import check_attention_backend

PREEMPTION_MODES = ("recompute", "swap")
KV_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_kv_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A KV-cache dtype from a torch.dtype or its name ("float32", "bfloat16", "torch.float16"); ValueError otherwise."""
    if isinstance(dtype, str):
        name = str.__str__(dtype).removeprefix("torch.")  # the plain str: a subclass's methods are not consulted
        if name not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {list(KV_DTYPES)} or a floating torch.dtype, got {dtype!r}")
        return KV_DTYPES[name]
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"kv_dtype must be one of {list(KV_DTYPES)} or a floating torch.dtype, got {dtype!r}")
    return dtype


@dataclass
class EngineConfig:
    num_blocks: int = 256  # KV blocks in the paged pool (chapter 05); the pool holds num_blocks * block_size tokens
    block_size: int = 16  # tokens per KV block; vLLM's default (Kwon et al. 2023, §7.2)
    max_num_seqs: int = 32  # the most requests RUNNING at once: the batch limit that moves along the frontier
    max_num_batched_tokens: int = 512  # token budget of one step: decodes (1 token each) + prompt (chunks)
    enable_chunked_prefill: bool = True  # split long prompts into chunks that share steps with decodes (Sarathi)
    enable_prefix_caching: bool = False  # reuse full prompt blocks already in the pool (chapter 05's prefix cache)
    preemption_mode: str = "recompute"  # what happens to a victim when blocks run out: "recompute" or "swap"
    num_swap_blocks: int = 256  # CPU blocks for swapped-out requests (preemption_mode="swap"); full -> recompute
    device: str = "auto"  # where the KV pool and the forward run: "auto" (the model's device), "cpu" or "cuda"
    # How K/V are stored, independent of the weights' dtype (chapter 09 quantizes it): a torch.dtype or its name;
    # the cache converts on read to the query's dtype. Normalized to a torch.dtype by __post_init__.
    kv_dtype: torch.dtype | str = torch.float32
    # Which KV cache / attention implementation the model runner builds, by name (minillm.paged.backends):
    # "selective" (decodes vectorized + prompt chunks looped), "paged", "paged-reference", or one registered later.
    attention_backend: str = "selective"
    # Ranks the model is sharded over (chapter 14's Megatron tensor parallelism): 1 runs in this process; t > 1
    # spawns t - 1 ranks on the CPU with gloo, each with 1/t of the heads, the MLP and the vocabulary.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """ValueError/TypeError naming the field unless every field is valid: at construction, and again where the
        config is used (`LLM`), since a dataclass's fields can be reassigned after __post_init__."""
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "num_swap_blocks",
                     "tensor_parallel_size"):
            setattr(self, name, check_int(f"EngineConfig.{name}", getattr(self, name),
                                          0 if name == "num_swap_blocks" else 1))  # stored as the plain int
        # Every layer's pool is a tensor (num_blocks, block_size, n_head, head_size): at least num_blocks x block_size
        # elements whatever the model (PagedKVCache checks the whole shape), and the block manager lists every block.
        check_tensor_elements("EngineConfig.num_blocks x block_size", (self.num_blocks, self.block_size))
        for name in ("enable_chunked_prefill", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"EngineConfig.{name} must be a bool, got {getattr(self, name)!r}")
        self.preemption_mode = check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        self.kv_dtype = resolve_kv_dtype(self.kv_dtype)
        check_attention_backend(self.attention_backend)
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every running request must be able to decode in the same step, or the batch limit is a lie.
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than "
                f"max_num_seqs={self.max_num_seqs}: a full batch of decodes would not fit one step"
            )

    @property
    def num_pool_tokens(self) -> int:
        """How many tokens' keys and values the whole pool holds."""
        return self.num_blocks * self.block_size

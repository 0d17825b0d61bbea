"""Chapter 05: the paged KV cache (vLLM's PagedAttention), prefix sharing with copy-on-write, prefix caching.

- `block_allocator`: `BlockAllocator` (free list + ref counts), `OutOfBlocks`, `BlockStateError`
- `prefix_cache`: `PrefixCachingAllocator`, `hash_block` (hash chain over full blocks, LRU eviction)
- `block_manager`: `BlockManager` (block tables, fork, copy-on-write, slot mapping)
- `paged_cache`: `PagedKVCache` (per-layer pools, paged attention), `PagedBatch` (one step's metadata)
- `backends`: `register_attention_backend`, `attention_backends` (KV cache / attention implementations by name)
- `generate`: `PagedGenerator` / `paged_generate` (one request, or n samples sharing the prompt)
- `bench`: the chapter's measurements (memory use against the contiguous cache, the paper's Figure 2 on our
  workload; paged vs contiguous decode time; attention time by block size) and its checks
- `draw` / `plots`: block tables as text and as a figure
- `tour`: the chapter's rows of the tour
"""

from minillm.paged.block_allocator import BlockAllocator, BlockStateError, OutOfBlocks
from minillm.paged.block_manager import BlockManager, compute_slot_mapping, num_blocks_for
from minillm.paged.generate import PagedGeneration, PagedGenerator, paged_generate
from minillm.paged.paged_cache import PagedBatch, PagedKVCache, write_kv
from minillm.paged.prefix_cache import ROOT_HASH, PrefixCachingAllocator, hash_block

__all__ = [
    "BlockAllocator",
    "BlockManager",
    "BlockStateError",
    "OutOfBlocks",
    "PagedBatch",
    "PagedGeneration",
    "PagedGenerator",
    "PagedKVCache",
    "PrefixCachingAllocator",
    "ROOT_HASH",
    "compute_slot_mapping",
    "hash_block",
    "num_blocks_for",
    "paged_generate",
    "write_kv",
]

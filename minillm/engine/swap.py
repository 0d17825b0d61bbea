"""Preemption by swapping: park a victim's KV blocks in host memory and copy them back when it resumes.

The second preemption policy of vLLM (Kwon et al. 2023, §4.5): instead of dropping a preempted request's KV and
recomputing it later, copy its blocks to a host swap space and back into freshly allocated pool blocks on resume.
It trades PCIe (here: memcpy) traffic for recomputation; on a CPU-only machine the "device" pool is CPU memory
too, so swap is a plain copy and mostly a lesson in bookkeeping.

The work is split the way the rest of the step is: the scheduler decides and counts (which request goes out,
how many host blocks it takes, `Scheduler.num_swap_blocks_used` against `EngineConfig.num_swap_blocks`) and
writes the copies into the step (`SchedulerOutput.swap_out` / `swap_in` / `swap_discard`, keyed by request id);
the executor owns this `SwapSpace` and moves the bytes. Each rank of a sharded model keeps its own shard's copy
under the same key. What it leaves out: asynchronous copies overlapped with compute (pinned memory, a side
stream), and swapping a request's blocks piece by piece.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minillm.core.config import check_int_list, short_repr
from minillm.paged import PagedKVCache


@dataclass
class SwappedKV:
    """A request's blocks in host memory: one tensor per entry of the cache's `block_tensors()`, in that order."""

    tensors: list[torch.Tensor]  # (n_blocks, ...) each on the CPU: K and V pools (n_blocks, bs, nh, hs) per layer,
    #                               then whatever else a block holds (the int8 cache's scales, (n_blocks, bs, nh, 1))
    num_blocks: int


class SwapSpace:
    """Host copies of swapped-out KV blocks, by key (a request id), for one KV cache.

    What a block is comes from the cache (`PagedKVCache.block_tensors()`): the K/V pools, and for the int8 cache
    the scale pools too. Copying that whole list, never `k_pools` / `v_pools` by name, is what keeps a cache with
    more state per block correct after a swap (else its blocks return with stale scales: wrong tokens, no error).
    """

    def __init__(self, cache: PagedKVCache):
        if not isinstance(cache, PagedKVCache):  # any paged cache: chapter 09's int8 one, chapter 13's C++ one
            raise TypeError(f"cache must be a paged KV cache (PagedKVCache), got {type(cache).__name__}")
        self.cache = cache
        self.stored: dict[str, SwappedKV] = {}
        self.num_swap_outs = 0
        self.num_swap_ins = 0

    @property
    def num_used(self) -> int:
        """Host blocks held now (the scheduler's `num_swap_blocks_used`, once the step's discards ran)."""
        return sum(kv.num_blocks for kv in self.stored.values())

    def put(self, key: str, kv: SwappedKV) -> None:
        """Park KV that came from elsewhere (chapter 07's prefilled arrivals) until a `swap_in` asks for it.

        It must have the cache's block layout: one tensor per `block_tensors()` entry, each (num_blocks, ...) with
        that entry's trailing shape and dtype (checked here, where the caller can still be told, not at swap-in)."""
        _check_key(key)
        if key in self.stored:
            raise ValueError(f"swap space already holds KV for {short_repr(key)}")
        pools = self.cache.block_tensors()
        if not isinstance(kv, SwappedKV) or len(kv.tensors) != len(pools):
            got = len(kv.tensors) if isinstance(kv, SwappedKV) else type(kv).__name__
            raise ValueError(f"kv for {short_repr(key)} must be a SwappedKV with one tensor per block tensor of the "
                             f"cache ({len(pools)}: {type(self.cache).__name__}.block_tensors()), got {got}")
        for i, (pool, t) in enumerate(zip(pools, kv.tensors)):
            want = (kv.num_blocks, *pool.shape[1:])
            if tuple(t.shape) != want or t.dtype != pool.dtype:
                raise ValueError(f"kv.tensors[{i}] for {short_repr(key)} must be {want} {pool.dtype} like the "
                                 f"cache's block tensor {i}, got {tuple(t.shape)} {t.dtype}")
        self.stored[key] = kv

    def swap_out(self, key: str, block_table: list[int]) -> None:
        """Copy pool blocks `block_table` to host memory under `key` (before anything reuses those blocks)."""
        self._check_blocks(key, block_table)
        if not block_table:  # a running request holds at least one block: an empty swap is a step no scheduler makes
            raise ValueError(f"swap_out of {short_repr(key)}: block_table names no blocks")
        if key in self.stored:
            raise ValueError(f"swap_out of {short_repr(key)}: the swap space already holds KV under that key")
        idx = torch.tensor(block_table, dtype=torch.int64, device=self.cache.device)  # (n,)
        # (nb, ...) -> (n, ...) each: K/V (n, bs, nh, hs), int8 scales (n, bs, nh, 1)
        saved = [pool.index_select(0, idx).to("cpu") for pool in self.cache.block_tensors()]
        self.stored[key] = SwappedKV(saved, len(block_table))
        self.num_swap_outs += 1

    def swap_in(self, key: str, block_table: list[int]) -> None:
        """Copy the blocks parked under `key` into pool blocks `block_table`, in order, and drop the host copy."""
        self._check_blocks(key, block_table)
        if key not in self.stored:  # a step from elsewhere naming a request that was never swapped out here
            raise ValueError(f"swap_in of {short_repr(key)}: the swap space holds no KV under that key (it holds "
                             f"{len(self.stored)} keys)")
        if len(block_table) != self.stored[key].num_blocks:
            raise ValueError(f"swap_in of {short_repr(key)} into {len(block_table)} blocks, but "
                             f"{self.stored[key].num_blocks} were swapped out")
        if len(set(block_table)) != len(block_table):  # two saved blocks written into one: one would be lost
            twice = sorted({b for b in block_table if block_table.count(b) > 1})
            raise ValueError(f"swap_in of {short_repr(key)} into block_table {short_repr(block_table)}: it names "
                             f"blocks {twice[:4]} twice, and each saved block needs a pool block of its own")
        kv = self.stored.pop(key)
        pools = self.cache.block_tensors()
        assert len(pools) == len(kv.tensors), (len(pools), len(kv.tensors))
        idx = torch.tensor(block_table, dtype=torch.int64, device=self.cache.device)  # (n,)
        for pool, saved in zip(pools, kv.tensors):
            pool.index_copy_(0, idx, saved.to(pool.device))  # (nb, ...)[idx] = (n, ...)
        self.num_swap_ins += 1

    def discard(self, key: str) -> None:
        """Forget a host copy (its request was aborted while swapped); unknown keys are ignored."""
        self.stored.pop(_check_key(key), None)

    def _check_blocks(self, key: object, block_table: object) -> None:
        """A swap's arguments: a str key and a list of block ids of the pool (a TypeError / ValueError naming the
        argument, not an index kernel's error)."""
        _check_key(key)
        check_int_list("block_table", block_table)
        bad = [b for b in block_table if not 0 <= b < self.cache.num_blocks]  # type: ignore[attr-defined]
        if bad:
            raise ValueError(f"block_table names blocks {bad[:4]} outside the pool [0, {self.cache.num_blocks})")


def _check_key(key: object) -> str:
    """A swap space's key: a request id, a str (an id of another type could never be swapped in)."""
    if not isinstance(key, str):
        raise TypeError(f"key must be a str (a request id), got {type(key).__name__} {short_repr(key)}")
    return key

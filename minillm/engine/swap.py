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

from minillm.paged import PagedKVCache


@dataclass
class SwappedKV:
    k: list[torch.Tensor]  # per layer (n_blocks, bs, nh, hs), on the CPU
    v: list[torch.Tensor]
    num_blocks: int


class SwapSpace:
    """Host copies of swapped-out KV blocks, by key (a request id), for one KV pool."""

    def __init__(self, cache: PagedKVCache):
        self.cache = cache
        self.stored: dict[str, SwappedKV] = {}
        self.num_swap_outs = 0
        self.num_swap_ins = 0

    @property
    def num_used(self) -> int:
        """Host blocks held now (the scheduler's `num_swap_blocks_used`, once the step's discards ran)."""
        return sum(kv.num_blocks for kv in self.stored.values())

    def put(self, key: str, kv: SwappedKV) -> None:
        """Park KV that came from elsewhere (chapter 07's prefilled arrivals) until a `swap_in` asks for it."""
        if key in self.stored:
            raise ValueError(f"swap space already holds KV for {key!r}")
        self.stored[key] = kv

    def swap_out(self, key: str, block_table: list[int]) -> None:
        """Copy pool blocks `block_table` to host memory under `key` (before anything reuses those blocks)."""
        assert key not in self.stored, key
        idx = torch.tensor(block_table, dtype=torch.int64, device=self.cache.device)  # (n,)
        k = [pool.index_select(0, idx).to("cpu") for pool in self.cache.k_pools]  # (n, bs, nh, hs) each
        v = [pool.index_select(0, idx).to("cpu") for pool in self.cache.v_pools]
        self.stored[key] = SwappedKV(k, v, len(block_table))
        self.num_swap_outs += 1

    def swap_in(self, key: str, block_table: list[int]) -> None:
        """Copy the blocks parked under `key` into pool blocks `block_table`, in order, and drop the host copy."""
        kv = self.stored.pop(key)
        assert len(block_table) == kv.num_blocks, (len(block_table), kv.num_blocks)
        idx = torch.tensor(block_table, dtype=torch.int64, device=self.cache.device)  # (n,)
        for pool, saved in zip(self.cache.k_pools + self.cache.v_pools, kv.k + kv.v):
            pool.index_copy_(0, idx, saved.to(pool.device))  # (nb, bs, nh, hs)[idx] = (n, bs, nh, hs)
        self.num_swap_ins += 1

    def discard(self, key: str) -> None:
        """Forget a host copy (its request was aborted while swapped); unknown keys are ignored."""
        self.stored.pop(key, None)

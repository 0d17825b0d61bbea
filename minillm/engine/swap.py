"""Preemption by swapping: park a victim's KV blocks in CPU memory and copy them back when it resumes.

The second preemption policy of vLLM (Kwon et al. 2023, §4.5): instead of dropping a preempted request's KV and
recomputing it later, copy its blocks to a CPU swap space (bounded, here counted in blocks) and back into freshly
allocated pool blocks on resume. It trades PCIe (here: memcpy) traffic for recomputation; on a CPU-only machine
the "device" pool is CPU memory too, so swap is a plain copy and mostly a lesson in bookkeeping.
What it leaves out: asynchronous copies overlapped with compute, and swapping a request's blocks piece by piece.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minillm.engine.request import Request
from minillm.paged import PagedKVCache


@dataclass
class SwappedKV:
    k: list[torch.Tensor]  # per layer (n_blocks, bs, nh, hs), on the CPU
    v: list[torch.Tensor]
    num_blocks: int


class SwapSpace:
    def __init__(self, cache: PagedKVCache, num_swap_blocks: int):
        self.cache = cache
        self.capacity = num_swap_blocks
        self.num_used = 0  # swap blocks held by SWAPPED requests (invariant: sum of their num_blocks)
        self.num_swap_outs = 0
        self.num_swap_ins = 0

    def can_swap_out(self, num_blocks: int) -> bool:
        return self.num_used + num_blocks <= self.capacity

    def swap_out(self, request: Request, block_table: list[int]) -> None:
        """Copy the request's pool blocks to CPU memory (before the scheduler frees them)."""
        assert request.swapped_kv is None and self.can_swap_out(len(block_table))
        idx = torch.tensor(block_table, dtype=torch.int64, device=self.cache.device)  # (n,)
        k = [pool.index_select(0, idx).to("cpu") for pool in self.cache.k_pools]  # (n, bs, nh, hs) each
        v = [pool.index_select(0, idx).to("cpu") for pool in self.cache.v_pools]
        request.swapped_kv = SwappedKV(k, v, len(block_table))
        self.num_used += len(block_table)
        self.num_swap_outs += 1

    def swap_in(self, request: Request, block_table: list[int]) -> None:
        """Copy the parked blocks into the request's newly allocated pool blocks, in order, and drop the CPU copy."""
        kv = request.swapped_kv
        assert kv is not None and len(block_table) >= kv.num_blocks, (len(block_table), kv)
        idx = torch.tensor(block_table[: kv.num_blocks], dtype=torch.int64, device=self.cache.device)  # (n,)
        for pool, saved in zip(self.cache.k_pools + self.cache.v_pools, kv.k + kv.v):
            pool.index_copy_(0, idx, saved.to(pool.device))  # (nb, bs, nh, hs)[idx] = (n, bs, nh, hs)
        self.discard(request)
        self.num_swap_ins += 1

    def discard(self, request: Request) -> None:
        """Forget a request's CPU copy (after swap-in, or when a swapped request is aborted)."""
        if request.swapped_kv is not None:
            self.num_used -= request.swapped_kv.num_blocks
            request.swapped_kv = None

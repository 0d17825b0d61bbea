"""The engine's decode attention on the CPU in C++, read through the block tables: attention backend "selective-cpp".

What it adds: `CppSelectiveKVCache`, chapter 06's default engine cache (`SelectiveKVCache`: decodes vectorized,
prompt chunks looped) whose decode attention is `paged_decode_attention` of `csrc/decode_cpu.cpp`: for each
sequence and head, the new token's query against that sequence's keys and values where they lie in the paged pool
(token j at offset j % bs of block table[j // bs]), the same loop the fused batch-1 step uses over its contiguous
cache. Importing this module registers it; pick it with `EngineConfig(attention_backend="selective-cpp")` (the
registry imports it on first use). Without a C++ compiler or ninja, building it is a RuntimeError naming the backend
and what is missing.

Why: on the CPU, the PyTorch decode path first gathers every sequence's blocks into a contiguous copy
(`index_select`, then SDPA). At decode sizes the copy and the per-layer operator calls cost more than the attention:
chapter 13's profile of the engine on `fast_cpu_model` puts that path at about a quarter of a step.
What it leaves out: prompt chunks (they keep PyTorch's attention), other dtypes and devices (those keep the
PyTorch path, unchanged), and several threads. Outputs equal the PyTorch path's to float rounding; greedy outputs
of the engine are identical (tested).
"""

from __future__ import annotations

import torch

from minillm.compile.cpu_gemv import cpp_errors_as_value_errors, load_cpu_ext, require_cpu_tensors
from minillm.engine.selective_cache import SelectiveKVCache
from minillm.paged import PagedBatch
from minillm.paged.backends import register_attention_backend

NAME = "selective-cpp"


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor) -> torch.Tensor:
    """q (S, nh, hs) over pools (nb, bs, nh, hs) through block_tables (S, max_nb) for context_lens (S,) -> (S, nh, hs).

    The checked entry point (the C++ side checks again and names what is wrong: shapes, dtypes, a length or block id
    out of range)."""
    require_cpu_tensors(torch.float32, q=q, k_pool=k_pool, v_pool=v_pool)
    require_cpu_tensors(torch.int64, block_tables=block_tables, context_lens=context_lens)
    with cpp_errors_as_value_errors():
        return load_cpu_ext().paged_decode_attention(q.contiguous(), k_pool.contiguous(), v_pool.contiguous(),
                                                     block_tables.contiguous(), context_lens.contiguous())


class CppSelectiveKVCache(SelectiveKVCache):
    """`SelectiveKVCache` with the C++ decode attention when the pools are float32 on the CPU."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Built (or loaded) now: a missing compiler fails when the engine starts, not in the middle of a step, and
        # the error names the backend (the user picked a name, not an extension).
        self._ext = None
        if self.device.type == "cpu" and self.dtype == torch.float32:
            try:
                self._ext = load_cpu_ext()
            except RuntimeError as e:
                raise RuntimeError(f"attention backend {NAME!r} cannot be built: {e}") from e

    def _attend_decode(self, layer_idx: int, q: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        """q (1, nh, S, hs), one new token per sequence -> (1, nh, S, hs)."""
        if self._ext is None or q.dtype != torch.float32:
            return super()._attend_decode(layer_idx, q, batch)
        q_s = q[0].transpose(0, 1).contiguous()  # (nh, S, hs) -> (S, nh, hs)
        y = self._ext.paged_decode_attention(q_s, self.k_pools[layer_idx], self.v_pools[layer_idx],
                                             batch.block_tables, batch.context_lens)  # (S, nh, hs)
        return y.transpose(0, 1).unsqueeze(0)  # (1, nh, S, hs)


register_attention_backend(NAME, CppSelectiveKVCache)

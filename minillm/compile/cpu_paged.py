"""The engine's attention on the CPU in C++, read through the block tables: backends "selective-cpp" and "verify-cpp".

What it adds: `CppSelectiveKVCache`, chapter 06's default engine cache (`SelectiveKVCache`: decodes vectorized,
prompt chunks looped) whose decode attention is `paged_decode_attention` of `csrc/decode_cpu.cpp`: for each
sequence and head, the new token's query against that sequence's keys and values where they lie in the paged pool
(token j at offset j % bs of block table[j // bs]), the same loop the fused batch-1 step uses over its contiguous
cache. Importing this module registers it; pick it with `EngineConfig(attention_backend="selective-cpp")` (the
registry imports it on first use). `CppVerifyKVCache` ("verify-cpp") does the same for chapter 08's speculative
engine: its verify steps (a last token and its drafts per sequence) through `paged_verify_attention`, each query
causal among its sequence's new tokens. Without a C++ compiler or ninja, building either is a RuntimeError naming the
backend and what is missing.

Why: on the CPU, the PyTorch decode path first gathers every sequence's blocks into a contiguous copy
(`index_select`, then SDPA). At decode sizes the copy and the per-layer operator calls cost more than the attention:
chapter 13's profile of the engine on `fast_cpu_model` puts that path at about a quarter of a step.
What it leaves out: prompt chunks (they keep PyTorch's attention), other dtypes and devices (those keep the
PyTorch path, unchanged), and several threads. Outputs equal the PyTorch path's to float rounding; greedy outputs
of the engine are identical (tested).
"""

from __future__ import annotations

import torch

from minillm.compile.cpu_gemv import as_cpp_reads, cpp_errors_as_value_errors, load_cpu_ext, require_cpu_tensors
from minillm.engine.selective_cache import SelectiveKVCache
from minillm.paged import PagedBatch
from minillm.paged.backends import register_attention_backend
from minillm.paged.paged_cache import write_kv
from minillm.speculative.verify_cache import VerifyKVCache, check_verify_attend

NAME = "selective-cpp"
VERIFY_NAME = "verify-cpp"


def check_paged_arguments(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                          context_lens: torch.Tensor, query_lens: torch.Tensor | None = None) -> None:
    """ValueError naming the argument for every shape or index the C++ loop would trust: q (S, nh, hs), pools
    (nb, bs >= 1, nh, hs), block_tables (S, max_nb), context_lens (S,) each in [1, max_nb * bs], and every block id a
    sequence reads inside the pool; with `query_lens` (S,), each in [1, its context length], q holds their sum of
    rows (N, nh, hs); before them, a TypeError naming the first argument that is not a dense CPU tensor of the dtype
    the C++ loop reads (float32 values, int64 tables and lengths). The C++ side checks the same again (a
    RuntimeError there, for direct callers)."""
    require_cpu_tensors(torch.float32, q=q, k_pool=k_pool, v_pool=v_pool)
    require_cpu_tensors(torch.int64, block_tables=block_tables, context_lens=context_lens,
                        **({} if query_lens is None else {"query_lens": query_lens}))
    if q.dim() != 3:
        raise ValueError(f"q must be (S, nh, hs), got shape {tuple(q.shape)}")
    N, nh, hs = q.shape
    S = N  # sequences: one query each, or (verify) as many as query_lens has lengths
    if query_lens is not None:
        shapes = [tuple(t.shape) for t in (block_tables, context_lens, query_lens)]
        if block_tables.dim() != 2 or context_lens.dim() != 1 or query_lens.dim() != 1 or len(
                {shapes[0][0], shapes[1][0], shapes[2][0]}) != 1:
            raise ValueError(f"block_tables (S, max_nb), context_lens (S,) and query_lens (S,) must agree on S, the "
                             f"number of sequences, got shapes {shapes[0]}, {shapes[1]} and {shapes[2]}")
        S = query_lens.shape[0]
    if k_pool.dim() != 4 or tuple(k_pool.shape[2:]) != (nh, hs) or k_pool.shape[1] < 1:
        raise ValueError(f"q must be (S, nh, hs) and k_pool (nb, bs>=1, nh, hs) with the same nh and hs, got q "
                         f"{tuple(q.shape)} and k_pool {tuple(k_pool.shape)}")
    if v_pool.shape != k_pool.shape:
        raise ValueError(f"v_pool must have k_pool's shape {tuple(k_pool.shape)}, got {tuple(v_pool.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != S:
        raise ValueError(f"block_tables must be (S={S}, max_nb), got shape {tuple(block_tables.shape)}")
    if tuple(context_lens.shape) != (S,):
        raise ValueError(f"context_lens must have shape ({S},), got {tuple(context_lens.shape)}")
    nb, bs = k_pool.shape[:2]
    max_nb = block_tables.shape[1]
    for s, n in enumerate(context_lens.tolist()):  # S is a batch of sequences: a short loop
        if not 1 <= n <= max_nb * bs:
            raise ValueError(f"context_lens: context length {n} of sequence {s} is outside [1, {max_nb * bs}]")
        ids = block_tables[s, : -(-n // bs)]  # the blocks sequence s reads
        bad = (ids < 0) | (ids >= nb)
        if bool(bad.any()):
            raise ValueError(f"block_tables: block id {int(ids[bad][0])} of sequence {s} is outside the pool "
                             f"[0, {nb})")
    if query_lens is not None:
        qls, lens = query_lens.tolist(), context_lens.tolist()
        for s, ql in enumerate(qls):
            if not 1 <= ql <= lens[s]:
                raise ValueError(f"query_lens: query length {ql} of sequence {s} is outside [1, {lens[s]}] (its "
                                 "context length)")
        if sum(qls) != N:
            raise ValueError(f"q must hold sum(query_lens) = {sum(qls)} rows, got shape {tuple(q.shape)}")


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor) -> torch.Tensor:
    """q (S, nh, hs) over pools (nb, bs, nh, hs) through block_tables (S, max_nb) for context_lens (S,) -> (S, nh, hs).

    The checked entry point (the C++ side checks again and names what is wrong: shapes, dtypes, a length or block id
    out of range)."""
    check_paged_arguments(q, k_pool, v_pool, block_tables, context_lens)
    with cpp_errors_as_value_errors():
        return load_cpu_ext().paged_decode_attention(*map(as_cpp_reads, (q, k_pool, v_pool, block_tables,
                                                                          context_lens)))


def paged_verify_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, query_lens: torch.Tensor) -> torch.Tensor:
    """q (N, nh, hs), query_lens[s] rows per sequence in order (N their sum), over pools (nb, bs, nh, hs) through
    block_tables (S, max_nb) for context_lens (S,) -> (N, nh, hs). Query j of sequence s attends over its first
    context_lens[s] - query_lens[s] + j + 1 tokens (the new tokens are the last query_lens[s] of the context: causal
    among them, as a verify step needs). Checked as `paged_decode_attention`."""
    check_paged_arguments(q, k_pool, v_pool, block_tables, context_lens, query_lens)
    with cpp_errors_as_value_errors():
        return load_cpu_ext().paged_verify_attention(*map(as_cpp_reads, (q, k_pool, v_pool, block_tables,
                                                                          context_lens, query_lens)))


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


class CppVerifyKVCache(VerifyKVCache, CppSelectiveKVCache):
    """Chapter 08's `VerifyKVCache` (a step's short queries in one call) with both of its attention paths in C++ when
    the pools are float32 on the CPU: a decode step through `paged_decode_attention` (as `CppSelectiveKVCache`),
    a verify step (every sequence's last token and drafts) through `paged_verify_attention`, read in place through
    the block tables. A step that also holds a prompt chunk keeps `VerifyKVCache`'s PyTorch path."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v (1, nh, N, hs) -> (1, nh, N, hs), checked first as the eager verify cache checks them."""
        check_verify_attend(self, layer_idx, q, k, v)
        b = self.batch
        if not getattr(self, "_verify", False) or self._long or self._ext is None or q.dtype != torch.float32:
            return super().attend(layer_idx, q, k, v)
        write_kv(self.k_pools[layer_idx], b.slot_mapping, k[0].transpose(0, 1))  # (nh, N, hs) -> (N, nh, hs)
        write_kv(self.v_pools[layer_idx], b.slot_mapping, v[0].transpose(0, 1))
        y = self._ext.paged_verify_attention(q[0].transpose(0, 1).contiguous(), self.k_pools[layer_idx],
                                             self.v_pools[layer_idx], b.block_tables, b.context_lens,
                                             b.query_lens)  # (N, nh, hs)
        return y.transpose(0, 1).unsqueeze(0)  # (1, nh, N, hs)


register_attention_backend(NAME, CppSelectiveKVCache)
register_attention_backend(VERIFY_NAME, CppVerifyKVCache)

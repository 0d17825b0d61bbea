"""Selective batching for mixed steps: one vectorized attention for all decodes, a loop only over prompt chunks.

Chapter 05's `PagedKVCache` has two attention paths: a vectorized one when every sequence adds one token (pure
decode) and a reference loop over sequences for anything else. With continuous batching and chunked prefill
almost every step is *mixed*: thirty decodes plus one prompt chunk would fall back to thirty-one attention calls
per layer. This subclass splits the step (Orca §3.3, selective batching; SARATHI's decode-maximal batch): the
sequences with one new token go through the vectorized decode path together, the prompt chunks one by one, and
the outputs are put back in token order. It computes exactly what the reference loop computes (tested).
It is the engine's default attention backend, registered as "selective" (`minillm.paged.backends`; pick another
with `EngineConfig.attention_backend`). What it leaves out: a single fused kernel for both (chapter 12's
paged-attention kernel).
"""

from __future__ import annotations

import torch

from minillm.core.attention import causal_mask
from minillm.paged import PagedBatch, PagedKVCache
from minillm.paged.backends import register_attention_backend
from minillm.kvcache.cache import attend_args_fit, check_attend_args
from minillm.paged.paged_cache import write_kv


class SelectiveKVCache(PagedKVCache):
    def set_batch(self, batch: PagedBatch) -> None:
        super().set_batch(batch)
        b = self.batch
        qls = b.query_lens_list
        self._decode_seqs = [i for i, ql in enumerate(qls) if ql == 1]
        self._split = bool(self._decode_seqs) and len(self._decode_seqs) < len(qls) and self.use_fast_decode
        if not self._split:
            return
        starts = [0]
        for ql in qls[:-1]:
            starts.append(starts[-1] + ql)
        self._starts = starts
        d = torch.tensor(self._decode_seqs, dtype=torch.int64, device=self.device)  # (D,)
        rows = torch.tensor([starts[i] for i in self._decode_seqs], dtype=torch.int64, device=self.device)  # (D,)
        self._decode_rows = rows
        # The decode sub-batch: one token per sequence, so its token rows are the sequence rows. Built once per
        # step, not per layer: PagedBatch validates and copies lengths to the host when it is made.
        self._decode_batch = PagedBatch(
            b.slot_mapping.index_select(0, rows), b.block_tables.index_select(0, d),
            b.context_lens.index_select(0, d), b.query_lens.index_select(0, d),
        )

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v (1, nh, N, hs) -> (1, nh, N, hs), decodes vectorized and prompt chunks looped."""
        if not getattr(self, "_split", False):
            return super().attend(layer_idx, q, k, v)
        if not attend_args_fit(self.config, layer_idx, q, k, v):  # a few cheap tests per layer
            check_attend_args(self.config, layer_idx, q, k, v)  # names the bad argument
        b = self.batch
        assert b is not None and q.shape[2] == b.num_tokens
        write_kv(self.k_pools[layer_idx], b.slot_mapping, k[0].transpose(0, 1))  # (nh, N, hs) -> (N, nh, hs)
        write_kv(self.v_pools[layer_idx], b.slot_mapping, v[0].transpose(0, 1))  # (nh, N, hs) -> (N, nh, hs)
        y = torch.empty_like(q)  # (1, nh, N, hs)
        q_dec = q.index_select(2, self._decode_rows)  # (1, nh, D, hs)
        y[:, :, self._decode_rows] = self._attend_decode(layer_idx, q_dec, self._decode_batch)  # (1, nh, D, hs)
        bs = self.block_size
        for i, (ql, ctx) in enumerate(zip(b.query_lens_list, b.context_lens_list)):
            if ql == 1:
                continue
            start = self._starts[i]
            blocks = b.block_tables[i, : -(-ctx // bs)]  # (nblk,)
            kv = []
            for pool in (self.k_pools[layer_idx], self.v_pools[layer_idx]):
                x = pool[blocks].flatten(0, 1)[:ctx]  # (nblk, bs, nh, hs) -> (nblk*bs, nh, hs) -> (ctx, nh, hs)
                kv.append(x.transpose(0, 1).unsqueeze(0).to(q.dtype))  # (1, nh, ctx, hs)
            mask = causal_mask(ql, ctx, device=q.device)  # (ql, ctx): the new tokens are the last ql of ctx
            y[:, :, start : start + ql] = self._attn(q[:, :, start : start + ql], kv[0], kv[1], mask)  # (1, nh, ql, hs)
        return y


register_attention_backend("selective", SelectiveKVCache)

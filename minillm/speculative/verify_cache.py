"""Attention for verify steps: every short query (a decode, or a last token plus its drafts) in ONE vectorized call.

Chapter 06's `SelectiveKVCache` vectorizes the sequences that add one token and loops over the rest. In a
speculative step almost every sequence adds k + 1 tokens (its last token and k drafts), so all of them would fall
into the loop: one gather and one attention call per sequence per layer, which at 16 running requests cost the
engine about as much as its linear layers. This backend pads the short queries (query_len <= `max_query_len`) to the
longest of them and attends for all at once, causal within each sequence's new tokens; prompt chunks are still
looped. It computes what the reference loop computes (tested), and a step without any multi-token short query
(every step of the engine without speculation) takes `SelectiveKVCache`'s path unchanged. Registered as "verify".
What it leaves out: a kernel that skips the padding (chapter 12's paged attention).

    sequences:   A (ql 3, ctx 9)   B (ql 1, ctx 5)   C (ql 40: a prompt chunk, looped)
    short batch: q (S=2, nh, Q=3, hs), K/V (S, nh, L, hs) gathered by block table (L = blocks * bs)
    mask (S, 1, Q, L): query j of sequence s sees key p  iff  p <= ctx_s - ql_s + j   (B's padded rows repeat its
                       last one and are dropped)
"""

from __future__ import annotations

import torch

from minillm.core.attention import attention, causal_mask
from minillm.engine.selective_cache import SelectiveKVCache
from minillm.kvcache.cache import check_attend_args
from minillm.paged import PagedBatch
from minillm.paged.backends import register_attention_backend
from minillm.paged.paged_cache import write_kv



def check_verify_attend(cache: VerifyKVCache, layer_idx: object, q: object, k: object, v: object) -> None:
    """A paged cache's `attend` arguments as the model passes them: `check_attend_args` (layer_idx in range, q, k,
    v of one shape (1, n_head, N, head_size)), then a batch set for this step and N its new tokens; a TypeError /
    ValueError naming the argument. Host-only, per layer call."""
    if not isinstance(cache, VerifyKVCache):
        raise TypeError(f"cache must be a VerifyKVCache, got {type(cache).__name__}")
    check_attend_args(cache.config, layer_idx, q, k, v)
    b = cache.batch
    if b is None:
        raise ValueError("attend reads the current step's batch: none is set (set_batch first)")
    if q.shape[0] != 1 or q.shape[2] != b.num_tokens:  # type: ignore[union-attr]
        raise ValueError(f"q must be (1, n_head, N, head_size) with N = the batch's {b.num_tokens} new tokens, got "
                         f"{tuple(q.shape)}")  # type: ignore[union-attr]

class VerifyKVCache(SelectiveKVCache):
    max_query_len = 16  # longer queries are prompt chunks: padding every short one to their length would waste more

    def set_batch(self, batch: PagedBatch) -> None:
        super().set_batch(batch)
        b = self.batch
        qls, ctxs = b.query_lens_list, b.context_lens_list
        short = [i for i, ql in enumerate(qls) if ql <= self.max_query_len]
        self._verify = self.use_fast_decode and any(qls[i] > 1 for i in short)
        if not self._verify:
            return
        starts = [0]
        for ql in qls[:-1]:
            starts.append(starts[-1] + ql)
        self._starts = starts
        self._long = [i for i, ql in enumerate(qls) if ql > self.max_query_len]
        S, Q, bs = len(short), max(qls[i] for i in short), self.block_size
        nblk = -(-max(ctxs[i] for i in short) // bs)
        dev = self.device
        # Query rows (S*Q,) into the step's N tokens, each sequence padded by repeating its last row.
        rows = [starts[i] + min(j, qls[i] - 1) for i in short for j in range(Q)]
        keep = [s * Q + j for s, i in enumerate(short) for j in range(qls[i])]  # the real ones among the S*Q
        self._q_rows = torch.tensor(rows, dtype=torch.int64, device=dev)  # (S*Q,)
        self._keep = torch.tensor(keep, dtype=torch.int64, device=dev)  # (N_short,)
        self._out_rows = self._q_rows.index_select(0, self._keep)  # (N_short,) where each kept row goes in y
        d = torch.tensor(short, dtype=torch.int64, device=dev)  # (S,)
        # subtle: -1 padding of the block tables is clamped to block 0; the mask hides whatever it holds.
        self._flat_ids = b.block_tables.index_select(0, d)[:, :nblk].clamp(min=0).reshape(-1)  # (S*nblk,)
        ql_t = b.query_lens.index_select(0, d)  # (S,)
        j = torch.minimum(torch.arange(Q, device=dev)[None, :], ql_t[:, None] - 1)  # (S, Q) padded rows: the last
        qpos = b.context_lens.index_select(0, d)[:, None] - ql_t[:, None] + j  # (S, Q) each query's own position
        mask = torch.arange(nblk * bs, device=dev)[None, None, :] <= qpos[:, :, None]  # (S, Q, L)
        mask = mask[:, None]  # (S, 1, Q, L), broadcast over heads
        if self._attn is attention:  # SDPA: an additive mask built once per step, not per layer (see paged_cache)
            mask = torch.zeros(mask.shape, dtype=torch.float32, device=dev).masked_fill(~mask, float("-inf"))
        self._mask = mask
        self._shape = (S, Q, nblk)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v (1, nh, N, hs) -> (1, nh, N, hs): short queries in one call, prompt chunks looped. The arguments
        are checked first (`check_verify_attend`)."""
        check_verify_attend(self, layer_idx, q, k, v)
        if not getattr(self, "_verify", False):
            return super().attend(layer_idx, q, k, v)
        b = self.batch
        write_kv(self.k_pools[layer_idx], b.slot_mapping, k[0].transpose(0, 1))  # (nh, N, hs) -> (N, nh, hs)
        write_kv(self.v_pools[layer_idx], b.slot_mapping, v[0].transpose(0, 1))  # (nh, N, hs) -> (N, nh, hs)
        S, Q, nblk = self._shape
        bs, nh, hs = self.block_size, self.config.n_head, self.config.head_size
        L, n = nblk * bs, S * nblk * bs * nh * hs
        scratch = self._scratch(2 * n, self.dtype)
        kv = []
        for t, pool in enumerate((self.k_pools[layer_idx], self.v_pools[layer_idx])):
            g = scratch[t * n : (t + 1) * n].view(S * nblk, bs * nh * hs)  # (S*nblk, bs*nh*hs)
            torch.index_select(pool.view(pool.shape[0], bs * nh * hs), 0, self._flat_ids, out=g)
            kv.append(g.view(S, L, nh, hs).transpose(1, 2).to(q.dtype))  # (S, L, nh, hs) -> (S, nh, L, hs)
        q_s = q[0].index_select(1, self._q_rows).view(nh, S, Q, hs).transpose(0, 1)  # (nh, S*Q, hs) -> (S, nh, Q, hs)
        mask = self._mask.to(q.dtype) if self._mask.is_floating_point() else self._mask
        o = self._attn(q_s, kv[0], kv[1], mask)  # (S, nh, Q, hs)
        o = o.transpose(0, 1).reshape(nh, S * Q, hs).index_select(1, self._keep)  # (nh, N_short, hs)
        y = torch.empty_like(q)  # (1, nh, N, hs)
        y[0].index_copy_(1, self._out_rows, o)
        for i in self._long:
            ql, ctx, start = b.query_lens_list[i], b.context_lens_list[i], self._starts[i]
            k_i, v_i = self.gather(layer_idx, i)  # (1, nh, ctx, hs) each
            mask_i = causal_mask(ql, ctx, device=q.device)  # (ql, ctx): the new tokens are the last ql of ctx
            y[:, :, start : start + ql] = self._attn(q[:, :, start : start + ql], k_i.to(q.dtype), v_i.to(q.dtype),
                                                     mask_i)  # (1, nh, ql, hs)
        return y


register_attention_backend("verify", VerifyKVCache)

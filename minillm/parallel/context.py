"""Context parallelism for long prompts: ring attention (Liu et al. 2023), K/V blocks passed around the ranks.

What it adds: `ring_attention(q, k, v)`, causal attention over a sequence split into t contiguous chunks, one per
rank, that never gathers the sequence. Rank r holds the queries, keys and values of positions
[r T/t, (r + 1) T/t). In t rounds each rank attends its queries to the K/V block it holds, then passes that block
to the next rank and receives one from the previous (point-to-point send/recv), so after t rounds every query has
seen every key. The partial results merge by the online softmax of chapter 12, in log-sum-exp form: block j
gives o_j (its normalized output) and lse_j = log sum_k exp(score_k) for each query, and `merge_attention` (an
exercise) weighs two parts by their shares of the union's softmax denominator.

A block entirely in a query's future (j > r) contributes nothing (causal); the diagonal block (j = r) is causal
within itself. Each rank's memory for attention holds T/t queries and two K/V blocks instead of all T keys.
What it leaves out: load balancing (rank 0 has the least causal work; zig-zag orderings fix that) and
overlapping the send with the compute (the point of the ring on real interconnects).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from minillm.core.config import check_float_tensor


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q (B, nh, Tq, hs), k and v (B, nh, Tk, hs), floating point: a ValueError/TypeError naming the one that is not."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_float_tensor(name, x, 4)
        if x.dtype != q.dtype or x.device != q.device:
            raise ValueError(f"{name} must have q's dtype and device ({q.dtype}, {q.device}), got {x.dtype}, "
                             f"{x.device}")
        if x.device.type != "meta" and not bool(torch.isfinite(x).all()):
            raise ValueError(f"{name} holds NaN or inf")
    if k.shape != v.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if (k.shape[0], k.shape[1], k.shape[3]) != (q.shape[0], q.shape[1], q.shape[3]):
        raise ValueError(f"k must share q's batch, heads and head size {(q.shape[0], q.shape[1], q.shape[3])}, "
                         f"got shape {tuple(k.shape)}")


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (B, nh, Tq, hs) to one K/V block (B, nh, Tk, hs): (output (B, nh, Tq, hs), lse (B, nh, Tq)).

    `causal`: query i may see key j only if j <= i (the block on the diagonal, Tq == Tk)."""
    _check_qkv(q, k, v)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"a causal block is the diagonal one: it needs as many queries as keys, got {q.shape[2]} "
                         f"and {k.shape[2]}")
    return _attend_block(q, k, v, causal)


def _attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`block_attention` without its checks, for `ring_attention`, which checked its chunks once on entry."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, nh, Tq, Tk)
    if causal:
        Tq, Tk = scores.shape[-2:]
        keep = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, nh, Tq)
    return torch.softmax(scores, dim=-1) @ v, lse


def merge_attention(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions of the same queries over disjoint keys -> the attention over their union.

    o_a, o_b (B, nh, Tq, hs) are each part's normalized output, lse_a, lse_b (B, nh, Tq) the log of each part's
    softmax denominator; returns (o, lse) of the union. Each part weighs in by its share of the total denominator,
    exp(lse_part - lse), computed without overflow however large the scores. An empty part has lse = -inf and
    weight 0 (the first part of a merge may be empty; a graded exercise, `minillm assignment 14`)."""
    for name, o, lse_x in (("a", o_a, lse_a), ("b", o_b, lse_b)):
        check_float_tensor(f"o_{name}", o, 4)
        if o.shape != o_a.shape:
            raise ValueError(f"o_{name} must have o_a's shape {tuple(o_a.shape)}, got {tuple(o.shape)}")
        for what, x in ((f"o_{name}", o), (f"lse_{name}", lse_x)):
            if isinstance(x, torch.Tensor) and (x.device != o_a.device or x.dtype != o_a.dtype):
                raise ValueError(f"{what} must have o_a's dtype and device ({o_a.dtype}, {o_a.device}), got "
                                 f"{x.dtype}, {x.device}")
        if check_float_tensor(f"lse_{name}", lse_x).shape != o.shape[:-1]:
            raise ValueError(f"lse_{name} must have shape {tuple(o.shape[:-1])}, got {tuple(lse_x.shape)}")
        if torch.isnan(lse_x).any() or torch.isposinf(lse_x).any():
            raise ValueError(f"lse_{name} holds NaN or +inf: a part's log-sum-exp is finite, or -inf when empty")
    # BEGIN SOLUTION
    lse = torch.logaddexp(lse_a, lse_b)  # (B, nh, Tq)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)  # both empty: weights exp(-inf) = 0
    w_a, w_b = torch.exp(lse_a - safe).unsqueeze(-1), torch.exp(lse_b - safe).unsqueeze(-1)  # (B, nh, Tq, 1)
    return o_a * w_a + o_b * w_b, lse
    # END SOLUTION


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None) -> torch.Tensor:
    """Causal attention of this rank's chunk of queries over the whole sequence; q, k, v (B, nh, T/t, hs) local.

    Runs on every rank of the group at once (rank r holds chunk r); returns this rank's (B, nh, T/t, hs) output.
    """
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be None (the default group) or a torch.distributed ProcessGroup, got "
                        f"{type(group).__name__}")
    t = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    _check_qkv(q, k, v)
    if q.shape != k.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)} (each rank holds one chunk of the sequence), got "
                         f"{tuple(k.shape)}")
    if t > 1:  # every chunk must have the same shape, or the blocks passed around would not fit the buffers
        shape = torch.tensor(q.shape, dtype=torch.long)
        shapes = [torch.empty_like(shape) for _ in range(t)]
        dist.all_gather(shapes, shape, group=group)
        if any(not torch.equal(x, shape) for x in shapes):
            raise ValueError(f"every rank's chunk must have the same shape, got {[tuple(x.tolist()) for x in shapes]}"
                             ": split the sequence into t equal chunks")
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)  # (B, nh, T/t): nothing seen
    kv = torch.stack([k, v]).contiguous()  # (2, B, nh, T/t, hs): the block that travels
    for step in range(t):
        j = (rank - step) % t  # whose block this rank holds in this round
        if j <= rank:  # blocks from the future are skipped (causal), but still passed on
            o_j, lse_j = _attend_block(q, kv[0], kv[1], causal=(j == rank))
            out, lse = merge_attention(out, lse, o_j, lse_j)
        if step < t - 1:  # pass the block on: send to rank + 1, receive from rank - 1
            incoming = torch.empty_like(kv)
            after, before = (rank + 1) % t, (rank - 1) % t  # ranks within the group ...
            if group is not None:  # ... and P2POp wants global ranks
                after, before = dist.get_global_rank(group, after), dist.get_global_rank(group, before)
            ops = [dist.P2POp(dist.isend, kv, after, group), dist.P2POp(dist.irecv, incoming, before, group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            kv = incoming
    return out

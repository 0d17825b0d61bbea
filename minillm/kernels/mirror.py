"""The kernels' algorithms in pure PyTorch, step for step, so they are tested on every machine, GPU or not.

Where `naive` computes each result the obvious way, a mirror computes it the way its kernel does: softmax in one
pass with a running (max, sum) over tiles and merged partial states (softmax.cu v4); layernorm from 32 lane-strided
partial sums combined as the warp shuffles combine them (layernorm.cu v3, and v4's packs); FlashAttention's
query/key tiles with the running max, sum and rescaled output (attention.cu v2, one `attend_tile` per key tile), and
v3's 64 x 64 tiles with base-2 exponentials and each row's statistics split over 8 threads (`flash_attention_v3`);
decode attention walking a block table block by block (paged_attention.cu v1; v2's keys split over 4 warps whose
states merge), and `paged_gather`, the address of each token in the pool; int8 GEMV from lane partial sums with the
scale applied after the sum (int8_gemv.cu v2, and v3's 16-byte packs); and the KV write as a loop over slots
(kv_write.cu). All math is fp32; results are rounded to the input dtype once.
What it leaves out: threads and memory: a mirror shows the arithmetic order, not the parallel schedule.
"""

from __future__ import annotations

import math

import torch

from minillm.core.config import check_float_tensor, check_has_data, check_int, check_writable, tensor_kind
from minillm.kernels.naive import check_int8_gemv_args, check_qkv, check_rows, gelu_tanh
from minillm.kernels.ops import (check_distinct_slots, check_eps, check_head_size, check_kv_write_args,
                                 check_paged_tables, check_same_device)

NEG_INF = float("-inf")


def _tile_args(m: torch.Tensor, l: torch.Tensor, o: torch.Tensor, s: torch.Tensor, v: torch.Tensor) -> None:
    """attend_tile's state and tile: m, l (...,), o (..., hs), s (..., n), v (..., n, hs) whose leading dimensions
    broadcast to m's; floating-point tensors all, of m's dtype, on one device. TypeError / ValueError naming the
    argument."""
    for name, t in (("m", m), ("l", l), ("o", o), ("s", s), ("v", v)):
        if check_float_tensor(name, t).dtype != m.dtype:  # torch's matmul names no argument ("expected Double")
            raise TypeError(f"{name} must have m's dtype {m.dtype} (one state, one precision), got {t.dtype}")
    check_same_device(m=m, l=l, o=o, s=s, v=v)
    lead = tuple(m.shape)
    if tuple(l.shape) != lead:
        raise ValueError(f"l must have m's shape {lead}, got {tuple(l.shape)}")
    for name, t, last in (("o", o, "hs"), ("s", s, "n")):
        if t.dim() != len(lead) + 1 or tuple(t.shape[:-1]) != lead:
            raise ValueError(f"{name} must be (..., {last}) with m's leading shape {lead}, got {tuple(t.shape)}")
    n, hs = s.shape[-1], o.shape[-1]
    v_lead = tuple(v.shape[:-2])
    broadcasts = len(v_lead) <= len(lead) and all(a in (1, b) for a, b in zip(reversed(v_lead), reversed(lead)))
    if v.dim() < 2 or tuple(v.shape[-2:]) != (n, hs) or not broadcasts:
        raise ValueError(f"v must be (..., n={n}, hs={hs}) (s's scores by o's head size), its leading dimensions "
                         f"broadcasting to {lead}, got {tuple(v.shape)}")
    _check_no_pos_inf("m", m)
    _check_no_pos_inf("s", s)
    # subtle: a row whose state is still empty (m = -inf) and whose tile is all -inf has no max to rescale by:
    # exp(-inf - (-inf)) is NaN, and the NaN would poison every later tile of that row. NaN scores pass (as in the
    # kernels, NaN in, NaN out). One host sync.
    empty = torch.isneginf(m) & torch.isneginf(s).all(dim=-1)  # (...,)
    if bool(empty.any()):
        raise ValueError("s has a row masked to -inf everywhere while that row's state is still empty (m = -inf): "
                         "each row needs a finite score in its first tile")


def _check_no_inf(**tensors: torch.Tensor) -> None:
    """A ValueError naming the first tensor that holds +inf or -inf (queries, keys: a score of q . k would be
    infinite, and the softmax NaN, reported as the internal score's); NaN passes (NaN in, NaN out, as the kernels)."""
    for name, x in tensors.items():
        if bool(torch.isinf(x).any()):
            raise ValueError(f"{name} holds +inf or -inf: the attention scores q . k would be infinite; pass finite "
                             "values")


def _check_no_pos_inf(name: str, x: torch.Tensor) -> None:
    """A ValueError naming `name` when x holds +inf: a running max (or score) of +inf rescales by exp(inf - inf),
    NaN. -inf is an empty state or a masked score and passes; so does NaN (propagated, as the kernels do)."""
    if bool(torch.isposinf(x).any()):
        raise ValueError(f"{name} holds +inf: a softmax state or score must be finite, or -inf where masked")


def online_merge(m1: torch.Tensor, s1: torch.Tensor, m2: torch.Tensor, s2: torch.Tensor):
    """Merge two running softmax states (max m, sum s of exp(x - m)); an empty state is (-inf, 0).

    (m, s) = (max(m1, m2), s1 exp(m1 - m) + s2 exp(m2 - m)), Milakov & Gimelshein 2018, eq. 4.
    subtle: where both maxima are -inf the exponent is nan; those states stay (-inf, 0).
    """
    for name, x in (("m1", m1), ("s1", s1), ("m2", m2), ("s2", s2)):
        if check_float_tensor(name, x).shape != m1.shape:
            raise ValueError(f"{name} must have m1's shape {tuple(m1.shape)}, got {tuple(x.shape)}")
    check_same_device(m1=m1, s1=s1, m2=m2, s2=s2)
    for name, x in (("m1", m1), ("s1", s1), ("m2", m2), ("s2", s2)):
        _check_no_pos_inf(name, x)
    # BEGIN SOLUTION
    m = torch.maximum(m1, m2)
    safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)  # both empty: exp(-inf - 0) = 0, not nan
    s = s1 * torch.exp(m1 - safe) + s2 * torch.exp(m2 - safe)  # each sum rescaled to the new max
    # END SOLUTION
    return m, s


def attend_tile(m: torch.Tensor, l: torch.Tensor, o: torch.Tensor, s: torch.Tensor, v: torch.Tensor):
    """One step of online-softmax attention: fold a tile of scores into the running state, return (m, l, o).

    m (...,) the running max of the scores seen so far, l (...,) the sum of exp(score - m) over them, o (..., hs) the
    sum of exp(score - m) · value (not yet divided by l); s (..., n) the tile's scores, v (..., n, hs) its values
    (broadcast over s's leading dimensions). The state starts at (-inf, 0, 0); after the last tile the attention
    output is o / l. With m_new = max(m, rowmax s) and alpha = exp(m - m_new), the old l and o were computed against
    m and are rescaled by alpha before the tile's p = exp(s - m_new) is added:

        l_new = l · alpha + Σ_n p        o_new = o · alpha + p @ v

    Every tile needs at least one finite score per row (a causal tile always holds key 0 of its block, a paged block
    at least one token); attention.cu v2 and paged_attention.cu run exactly this update in registers.
    """
    _tile_args(m, l, o, s, v)
    # BEGIN SOLUTION
    m_new = torch.maximum(m, s.amax(dim=-1))  # (...,)
    alpha = torch.exp(m - m_new)  # (...,): 0 on the first tile (m = -inf)
    p = torch.exp(s - m_new.unsqueeze(-1))  # (..., n): 0 where a score is masked to -inf
    l = l * alpha + p.sum(dim=-1)
    o = o * alpha.unsqueeze(-1) + (p.unsqueeze(-2) @ v).squeeze(-2)  # (..., 1, n) @ (..., n, hs) -> (..., hs)
    # END SOLUTION
    return m_new, l, o


def softmax_online(x: torch.Tensor, tile: int = 8, num_parts: int = 4) -> torch.Tensor:
    """softmax.cu v4: the columns are dealt round-robin to `num_parts` parts (the threads, in tiles of `tile`
    elements, the 16-byte packs); each part folds its tiles into a running (max, sum) in one pass; the parts'
    states merge pairwise; then one more pass writes exp(x - m) / s."""
    check_rows("x", x)
    tile = check_int("tile", tile)
    num_parts = check_int("num_parts", num_parts)
    if x.shape[-1] == 0:
        raise ValueError(f"x must have at least one column to take a softmax over, got shape {tuple(x.shape)}")
    _check_no_pos_inf("x", x)
    x32 = x.float()
    R, C = x32.shape[:-1], x32.shape[-1]
    states = []
    # subtle: a part past the row's last tile (num_parts * tile > C) holds no column: its state stays (-inf, 0),
    # which merges as nothing, so it is left out (the same bits), and num_parts=10**8 is not 10**8 empty loops
    for part in range(min(num_parts, -(-C // tile))):
        m = torch.full(R, NEG_INF)
        s = torch.zeros(R)
        for c0 in range(part * tile, C, num_parts * tile):  # this part's tiles
            xt = x32[..., c0 : c0 + tile]  # (..., <= tile)
            m, s = online_merge(m, s, xt.amax(dim=-1), torch.zeros(R))  # the tile's max joins the running max
            # subtle: while m is still -inf, every element so far was -inf and adds 0 (the kernel skips it)
            m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
            s = s + torch.exp(xt - m_safe.unsqueeze(-1)).sum(dim=-1)
        states.append((m, s))
    while len(states) > 1:  # the tree the shuffles build: pair neighbours until one state is left
        merged = [online_merge(*states[i], *states[i + 1]) for i in range(0, len(states) - 1, 2)]
        states = merged + ([states[-1]] if len(states) % 2 else [])
    m, s = states[0]
    return (torch.exp(x32 - m.unsqueeze(-1)) / s.unsqueeze(-1)).to(x.dtype)


def warp_tree_sum(partials: torch.Tensor) -> torch.Tensor:
    """Sum the last dimension (32 lanes) the way `warp_sum` does: lane i adds lane i ^ offset, offset 16, 8, .., 1.
    Every lane ends with the total; lane 0's is returned."""
    if check_rows("partials", partials) != 32:
        raise ValueError(f"partials must hold a warp's 32 lanes in its last dimension, got {partials.shape[-1]}")
    lanes = torch.arange(32)
    # BEGIN SOLUTION
    for offset in (16, 8, 4, 2, 1):  # __shfl_xor_sync(mask, v, offset): lane i reads lane i ^ offset
        partials = partials + partials[..., lanes ^ offset]
    # END SOLUTION
    return partials[..., 0]


def lane_partials(x: torch.Tensor, pack: int = 1) -> torch.Tensor:
    """(..., C) -> (..., 32): lane i's sum of columns i, i + 32, i + 64, ... (the loop `c = lane; c += 32`).

    With pack > 1 a lane reads `pack` neighbouring columns at once (a 16-byte load): lane i owns the packs i, i + 32,
    ..., that is the columns [pack * i, pack * i + pack), [pack * (i + 32), ...), and so on.
    """
    C = check_rows("x", x)
    pack = check_int("pack", pack)
    pack = min(pack, max(C, 1))  # a pack past the row's end reads it whole, into lane 0, as a pack of C does
    pad = (-C) % (32 * pack)  # subtle: with pack=10**9 unclamped, 3.2e10 zeros of padding
    xp = torch.nn.functional.pad(x, (0, pad))  # (..., C + pad), zeros add nothing
    return xp.reshape(*x.shape[:-1], -1, 32, pack).sum(dim=(-3, -1))  # (..., C/(32 pack), 32, pack) -> (..., 32)


def layernorm_warp(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5,
                   pack: int = 1) -> torch.Tensor:
    """layernorm.cu v3 (pack=1) and v4 (pack = 16 bytes / element size): lane sums of x, a warp tree sum, the mean;
    then a second pass, lane sums of (x - mean)^2 and their warp tree sum, the variance (not E[x^2] - mean^2, which
    cancels in fp32 when |mean| >> std). A row whose squared deviations overflow fp32 (|x| past ~1e19) comes back
    as its bias, as from the kernels (see `naive.layernorm`)."""
    C = check_rows("x", x, weight=weight, bias=bias)
    eps = check_eps(eps)
    pack = check_int("pack", pack)
    x32 = x.float()
    mean = warp_tree_sum(lane_partials(x32, pack)) / C  # (...,)
    d = x32 - mean.unsqueeze(-1)  # (..., C) deviations; padding lanes add nothing
    var = warp_tree_sum(lane_partials(d * d, pack)) / C  # (...,)
    rstd = torch.rsqrt(var + eps)
    y = d * rstd.unsqueeze(-1) * weight.float() + bias.float()
    return y.to(x.dtype)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, pack: int = 8) -> torch.Tensor:
    """bias_gelu.cu v2: the flat array in packs of `pack` elements plus a tail, element i taking bias[i % C]."""
    C = check_rows("x", x, bias=bias)
    pack = check_int("pack", pack)
    flat = x.reshape(-1).float()
    out = torch.empty_like(flat)
    n = flat.numel()
    full = n - n % pack
    for start, stop in ((0, full), (full, n)):  # the packs, then the tail
        idx = torch.arange(start, stop)
        out[idx] = gelu_tanh(flat[idx] + bias.float()[idx % C])
    return out.view(x.shape).to(x.dtype)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int = 16, block_k: int = 16):
    """attention.cu v2 (Dao et al. 2022, Algorithm 1), causal: q, k, v (B, nh, T, hs) -> (B, nh, T, hs).

    For each tile of block_q queries, walk the key tiles up to the tile's last query; for each: S = scale Q K^T
    (masked), m_new = max(m, rowmax S), P = exp(S - m_new), l = l exp(m - m_new) + rowsum P,
    O = O exp(m - m_new) + P V; finally O / l.
    """
    check_qkv(q, k, v)
    check_head_size("q", q.shape[-1])  # as ops.attention: hs = 0 has no scale 1/sqrt(hs)
    block_q = check_int("block_q", block_q)
    block_k = check_int("block_k", block_k)
    _check_no_inf(q=q, k=k)
    B, nh, T, hs = q.shape
    scale = 1.0 / math.sqrt(hs)
    q32, k32, v32 = q.float(), k.float(), v.float()
    out = torch.empty(B, nh, T, hs)
    for q0 in range(0, T, block_q):
        qt = q32[:, :, q0 : q0 + block_q]  # (B, nh, br, hs)
        br = qt.shape[2]
        m = torch.full((B, nh, br), NEG_INF)
        l = torch.zeros(B, nh, br)
        o = torch.zeros(B, nh, br, hs)
        q_pos = torch.arange(q0, q0 + br)
        for k0 in range(0, min(T, q0 + br), block_k):  # causal: stop at the tile's last query
            kt, vt = k32[:, :, k0 : k0 + block_k], v32[:, :, k0 : k0 + block_k]  # (B, nh, bc, hs)
            s = scale * qt @ kt.transpose(-2, -1)  # (B, nh, br, hs) @ (B, nh, hs, bc) -> (B, nh, br, bc)
            visible = torch.arange(k0, k0 + kt.shape[2]).unsqueeze(0) <= q_pos.unsqueeze(1)  # (br, bc)
            s = s.masked_fill(~visible, NEG_INF)  # every row sees key k0 <= q0: one finite score at least
            m, l, o = attend_tile(m, l, o, s, vt.unsqueeze(2))  # values (B, nh, 1, bc, hs): one set for all rows
        out[:, :, q0 : q0 + br] = o / l.unsqueeze(-1)
    return out.to(q.dtype)


V3_TILE = 64  # attention.cu v3: query and key tiles of 64
V3_ROW_LANES = 8  # the threads sharing one query row; thread tx owns columns tx*4..tx*4+3 and 32+tx*4..32+tx*4+3


def _row_lanes(s: torch.Tensor) -> torch.Tensor:
    """(..., 64) scores of a tile -> (..., 2, 8, 4) indexed [half, tx, t]: column half * 32 + tx * 4 + t, so
    [..., :, tx, :] are the 8 values thread tx holds."""
    return s.unflatten(-1, (2, V3_ROW_LANES, 4))


def _xor_tree(partials: torch.Tensor, combine) -> torch.Tensor:
    """Combine the last dimension (the 8 threads of a row) as three __shfl_xor_sync steps do (offsets 1, 2, 4);
    every lane ends with the result; lane 0's is returned."""
    lanes = torch.arange(partials.shape[-1])
    for offset in (1, 2, 4):
        partials = combine(partials, partials[..., lanes ^ offset])
    return partials[..., 0]


def flash_attention_v3(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p_dtype: torch.dtype | None = None
                       ) -> torch.Tensor:
    """attention.cu v3 (FlashAttention-2's loop, Dao 2023), causal: q, k, v (B, nh, T, hs) -> (B, nh, T, hs).

    The arithmetic of v2 with the engineering of v3: 64 x 64 tiles, zero-padded past the sequence's end (padding
    keys masked); Q scaled once by log2(e) / sqrt(hs), so exp(x / sqrt(hs) - m) becomes exp2(x' - m') with no
    other change; each row's max and sum first over the 8 values a thread holds, then across its 8 threads; the
    output divided by l once, after the last tile.
    With p_dtype (fp16 or bf16), v4's arithmetic: the tensor cores take P in the input dtype, so P is rounded to it
    before P V, and l sums the rounded values. (v4 splits a row over 2 lanes of 32 columns instead of 8 threads;
    the max is the same, the sums differ only in the order of additions.)
    """
    check_qkv(q, k, v)
    check_head_size("q", q.shape[-1])  # as ops.attention: hs = 0 has no scale 1/sqrt(hs)
    # `is`, not `in`: a numpy array or an object whose == says True would pass a comparison
    if not any(p_dtype is d for d in (None, torch.float16, torch.bfloat16, torch.float32)):
        raise ValueError(f"p_dtype must be None, torch.float16, torch.bfloat16 or torch.float32, got {p_dtype!r}")
    _check_no_inf(q=q, k=k)
    B, nh, T, hs = q.shape
    n = V3_TILE
    Tp = -(-T // n) * n  # padded length
    pad = (0, 0, 0, Tp - T)  # zeros past the last position, as the kernel stages its tiles
    q32 = torch.nn.functional.pad(q.float(), pad) * (math.log2(math.e) / math.sqrt(hs))  # (B, nh, Tp, hs)
    k32, v32 = torch.nn.functional.pad(k.float(), pad), torch.nn.functional.pad(v.float(), pad)
    out = torch.empty(B, nh, Tp, hs)
    for q0 in range(0, Tp, n):
        qt = q32[:, :, q0 : q0 + n]  # (B, nh, 64, hs)
        m = torch.full((B, nh, n), NEG_INF)
        l = torch.zeros(B, nh, n)
        o = torch.zeros(B, nh, n, hs)
        q_pos = torch.arange(q0, q0 + n).unsqueeze(1)  # (64, 1)
        for k0 in range(0, min(q0 + n, T), n):
            s = qt @ k32[:, :, k0 : k0 + n].transpose(-2, -1)  # (B, nh, 64, 64), in log2 units
            k_pos = torch.arange(k0, k0 + n).unsqueeze(0)  # (1, 64)
            s = s.masked_fill((k_pos > q_pos) | (k_pos >= T), NEG_INF)
            m_thread = _row_lanes(s).amax(dim=(-3, -1))  # (B, nh, 64, 8): each thread's max over its 8 scores
            m_new = torch.maximum(m, _xor_tree(m_thread, torch.maximum))  # finite: key 0 is in the first tile
            alpha = torch.exp2(m - m_new)  # 0 on the first tile
            p = torch.exp2(s - m_new.unsqueeze(-1))  # (B, nh, 64, 64)
            if p_dtype is not None:
                p = p.to(p_dtype).float()  # v4: what the tensor cores multiply
            l = l * alpha + _xor_tree(_row_lanes(p).sum(dim=(-3, -1)), torch.add)
            o = o * alpha.unsqueeze(-1) + p @ v32[:, :, k0 : k0 + n]  # (B, nh, 64, 64) @ (B, nh, 64, hs)
            m = m_new
        out[:, :, q0 : q0 + n] = o / l.unsqueeze(-1)
    return out[:, :, :T].to(q.dtype)


def paged_gather(pool: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """The keys (or values) of one sequence, in order, read through its block table: pool (nb, bs, nh, hs),
    block_table (max_nb,) -> (context_len, nh, hs). Token j lives in block block_table[j // bs] at offset j % bs,
    pool row slot = block * bs + j % bs: the address every thread of paged_attention.cu computes for its key."""
    nb, bs = check_float_tensor("pool", pool, 4).shape[:2]
    if not isinstance(block_table, torch.Tensor) or block_table.is_floating_point() or block_table.is_complex() \
            or block_table.dtype == torch.bool:
        raise TypeError(f"block_table must be a 1-D integer tensor, got "
                        f"{tensor_kind(block_table)}")
    if check_has_data("block_table", block_table).dim() != 1:  # nested, quantized, uint64: before the shape
        raise ValueError(f"block_table must be 1-D (max_nb,), one sequence's table, got shape "
                         f"{tuple(block_table.shape)}")
    context_len = check_int("context_len", context_len, 0)  # the plain int: its comparisons cannot lie
    if context_len > block_table.numel() * bs:
        raise ValueError(f"context_len must be in [0, {block_table.numel() * bs}] for a table of "
                         f"{block_table.numel()} blocks of {bs}, got {context_len}")
    j = torch.arange(context_len, device=pool.device)  # (ctx,) token positions
    # BEGIN SOLUTION
    blocks = block_table.to(pool.device)[j // bs]  # (ctx,) the block each token lives in
    slots = blocks * bs + j % bs  # (ctx,) its row in the pool seen as (nb * bs, nh, hs)
    # END SOLUTION
    if bool(((blocks < 0) | (blocks >= nb)).any()):
        raise ValueError(f"block_table points outside the pool of {nb} blocks: {block_table.tolist()}")
    return pool.reshape(nb * bs, *pool.shape[2:])[slots]  # (ctx, nh, hs)


def paged_attention_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    num_warps: int = 1,
) -> torch.Tensor:
    """paged_attention.cu v1 (num_warps=1): for each sequence, walk its block table one block at a time, reading the
    block's keys in place from the pool, and fold them into a running (max, sum, output); q (S, nh, hs), int64
    block_tables (S, max_nb) and context_lens (S,) (as `ops` takes them) -> (S, nh, hs). v2 (num_warps=4): the keys are dealt round-robin to the warps (key j to warp j % 4), each warp
    folds its own keys into its own state, and the states merge at the end, each rescaled to the largest max.

    As the kernel does, a block index outside the pool (or a context longer than the table) gives NaN for that
    sequence, and a context of 0 gives zeros; a negative context length is a ValueError.
    """
    num_warps = check_int("num_warps", num_warps)
    if num_warps not in (1, 4):
        raise ValueError(f"num_warps must be 1 (paged_attention.cu v1) or 4 (v2), got {num_warps}")
    S, nh, hs = check_float_tensor("q", q, 3).shape
    check_head_size("q", hs)  # as ops.paged_attention_decode
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if check_float_tensor(name, pool, 4).shape[2:] != (nh, hs) or pool.shape != k_pool.shape:
            raise ValueError(f"{name} must be (nb, bs, nh={nh}, hs={hs}) like k_pool, got {tuple(pool.shape)}")
    check_paged_tables(S, block_tables, context_lens)  # int64, as ops and naive take them
    check_same_device(q=q, k_pool=k_pool, v_pool=v_pool, block_tables=block_tables, context_lens=context_lens)
    if S and int(context_lens.min()) < 0:
        raise ValueError(f"context_lens must be >= 0, got {context_lens.tolist()}")
    _check_no_inf(q=q, k_pool=k_pool)
    nb, bs = k_pool.shape[:2]
    scale = 1.0 / math.sqrt(hs)
    out = torch.zeros(S, nh, hs)
    for s in range(S):
        ctx = int(context_lens[s])
        if ctx > block_tables.shape[1] * bs:
            out[s] = float("nan")
            continue
        qs = q[s].float()  # (nh, hs)
        if num_warps > 1:
            out[s] = _paged_split(qs, k_pool, v_pool, block_tables[s], ctx, scale, num_warps)
            continue
        m, l, o = torch.full((nh,), NEG_INF), torch.zeros(nh), torch.zeros(nh, hs)
        for j in range(-(-ctx // bs)):
            block = int(block_tables[s, j])
            if not 0 <= block < nb:
                o, l = torch.full((nh, hs), float("nan")), torch.ones(nh)
                break
            n = min(bs, ctx - j * bs)  # tokens of this block inside the context
            kb = k_pool[block, :n].float()  # (n, nh, hs)
            vb = v_pool[block, :n].float()  # (n, nh, hs)
            sc = scale * torch.einsum("hd,nhd->hn", qs, kb)  # (nh, n)
            m, l, o = attend_tile(m, l, o, sc, vb.transpose(0, 1))  # values per head: (nh, n, hs)
        if ctx > 0:
            out[s] = o / l.unsqueeze(-1)
    return out.to(q.dtype)


def _paged_split(qs: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor, ctx: int,
                 scale: float, num_warps: int) -> torch.Tensor:
    """paged_attention.cu v2 for one sequence: qs (nh, hs), its table (max_nb,) -> (nh, hs)."""
    nb, bs, nh, hs = k_pool.shape
    if ctx == 0:
        return torch.zeros(nh, hs)
    j = torch.arange(ctx)
    blocks = table[j // bs]  # (ctx,): the block of every key
    if bool(((blocks < 0) | (blocks >= nb)).any()):
        return torch.full((nh, hs), float("nan"))
    keys, values = k_pool[blocks, j % bs].float(), v_pool[blocks, j % bs].float()  # (ctx, nh, hs), read in place
    states = []  # each warp's (m, l, o)
    for w in range(num_warps):  # warp w: keys w, w + num_warps, ...
        mine = j[w::num_warps]
        m, l, o = torch.full((nh,), NEG_INF), torch.zeros(nh), torch.zeros(nh, hs)
        if mine.numel():
            sc = scale * torch.einsum("hd,nhd->hn", qs, keys[mine])  # (nh, n)
            m, l, o = attend_tile(m, l, o, sc, values[mine].transpose(0, 1))
        states.append((m, l, o))
    m_all = torch.stack([m for m, _, _ in states]).amax(dim=0)  # (nh,): the largest max over the warps
    l_all, o_all = torch.zeros(nh), torch.zeros(nh, hs)
    for m, l, o in states:  # each state rescaled to m_all; a warp that saw no key (m = -inf) adds nothing
        r = torch.where(torch.isneginf(m), torch.zeros_like(m), torch.exp(m - m_all))
        l_all, o_all = l_all + l * r, o_all + o * r.unsqueeze(-1)
    return o_all / l_all.unsqueeze(-1)


def int8_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
              pack: int = 1) -> torch.Tensor:
    """int8_gemv.cu v2 (pack=1) and v3 (pack=16): for each output row n, 32 lanes sum x[k] * w[n, k] over their
    packs of k (k = lane, lane + 32, ... for v2; 16 weights a load for v3); a warp tree sum; then one multiply by
    scale[n] (sum_k x_k w_k s = s sum_k x_k w_k) and the bias."""
    check_int8_gemv_args(x, w, scale, bias)
    prod = x.float().unsqueeze(1) * w.float().unsqueeze(0)  # (M, 1, K) * (1, N, K) -> (M, N, K)
    acc = warp_tree_sum(lane_partials(prod, pack))  # (M, N)
    y = acc * scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def kv_cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """kv_write.cu, one token at a time: slot = block * bs + offset; -1 (or outside the pool) is skipped. Shapes,
    dtypes and shared memory are checked as `ops.kv_cache_write` checks them, and a slot named twice is refused (on
    the GPU the two writes race; here the later would win), and so is a pool torch cannot write in place (expanded,
    an inference tensor, requiring grad: `check_writable`)."""
    check_kv_write_args(key, value, k_pool, v_pool, slot_mapping)
    check_writable("k_pool", k_pool)
    check_writable("v_pool", v_pool)
    check_distinct_slots(slot_mapping)
    nb, bs = k_pool.shape[:2]
    for t, slot in enumerate(slot_mapping.tolist()):
        if not 0 <= slot < nb * bs:
            continue
        block, offset = divmod(slot, bs)
        k_pool[block, offset] = key[t]
        v_pool[block, offset] = value[t]

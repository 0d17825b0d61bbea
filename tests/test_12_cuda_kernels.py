"""Chapter 12: the CUDA kernels, their naive twins, their CPU mirrors and their emulated runs.

Five layers of checks, each skipped only where its tool is missing:
- CPU, always: every mirror (the kernel's algorithm in PyTorch) equals its naive twin over odd shapes, in fp32 and
  bf16; the naive twins equal PyTorch's own ops; the paged mirror equals chapter 05's PagedKVCache on a block table
  built by a real BlockManager; the Python wrappers reject bad arguments before anything is built.
- C++ compiler: every version of every kernel, its own .cu code run on the CPU by the emulator (every CUDA thread a
  fiber), equals its naive twin in fp32/fp16/bf16 with the threads in both orders; a planted missing barrier and a
  planted deadlock are caught. The graded CUDA exercise, softmax.cu's v2, is checked this way on the CPU and built
  with nvcc on a GPU.
- nvcc: every kernel file compiles alone for sm_80 and sm_90, ptxas reports every kernel, and none spills.
- g++ with torch's headers (slow): the bindings file parses.
- CUDA: every version of every kernel equals its naive twin over odd shapes in fp32/fp16/bf16, writing every
  output element (outputs start as NaN), and the C++ wrappers reject bad tensors with messages naming them.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.core.config import GPTConfig
from minillm.kernels import bench, build, emulator, mirror, naive, ops
from minillm.kernels import tour as kernels_tour
from minillm.paged import BlockManager, PagedBatch, PagedKVCache, write_kv

HAS_CUDA = torch.cuda.is_available()
NVCC = build.find_nvcc()
ROWS = (1, 7, 33)
COLS = (1, 31, 130, 1000)
# Tolerance per dtype, relative, and absolute after scaling by the reference's largest magnitude: every kernel
# computes in fp32 and rounds once, like its naive twin, so the two differ by about one rounding of the dtype.
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
SPILL_LIMIT_BYTES = 0  # every kernel here is small: any spill means a register-hungry mistake
ROOT = Path(__file__).resolve().parent.parent
H200_REPORT = "chapters/gpu-reports/2026-12-01-nvidia-h200-kernels.md"
H200_RESULTS = "chapters/results/12-h200-kernels.json"
PTXAS_RESULTS = "chapters/results/12-ptxas.json"


def assert_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None, roundings: int = 1) -> None:
    """Within `roundings` roundings of the dtype (TOL each) of the reference, and no NaN."""
    tol = TOL[dtype or ref.dtype] * roundings
    scale = max(1.0, ref.float().abs().max().item()) if ref.numel() else 1.0
    assert not torch.isnan(got).any(), "an output is NaN (an element the kernel never wrote keeps its poison)"
    torch.testing.assert_close(got.float().cpu(), ref.float().cpu(), rtol=tol, atol=tol * scale)


# ----------------------------------------------------------------------------------------------------- CPU mirrors
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("rows", ROWS)
def test_softmax_mirror_and_naive_agree_with_torch(rows, cols, dtype):
    x = (torch.randn(rows, cols) * 4).to(dtype)
    ref = naive.softmax(x)
    assert_close(ref, F.softmax(x.float(), dim=-1), dtype)
    assert_close(mirror.softmax_online(x, tile=8, num_parts=4), ref, dtype)
    assert_close(mirror.softmax_online(x, tile=3, num_parts=5), ref, dtype)


@pytest.mark.graded(points=2, exercise="online_merge")
def test_online_merge_worked_example():
    """State A saw [1, 2] (m = 2, s = e^-1 + 1), state B saw [3] (m = 3, s = 1): merged, [1, 2, 3]."""
    e = math.e
    m1, s1 = torch.tensor([2.0]), torch.tensor([1 / e + 1])
    m2, s2 = torch.tensor([3.0]), torch.tensor([1.0])
    m, s = mirror.online_merge(m1, s1, m2, s2)
    assert m.item() == 3.0 and s.item() == pytest.approx(e**-2 + e**-1 + 1, rel=1e-6)
    m, s = mirror.online_merge(m2, s2, m1, s1)  # the order does not matter
    assert m.item() == 3.0 and s.item() == pytest.approx(e**-2 + e**-1 + 1, rel=1e-6)
    empty = (torch.tensor([float("-inf")]), torch.tensor([0.0]))
    m, s = mirror.online_merge(*empty, m1, s1)  # an empty state changes nothing
    assert m.item() == 2.0 and s.item() == pytest.approx(s1.item(), rel=1e-6)
    m, s = mirror.online_merge(*empty, *empty)  # two empty states stay empty, never nan
    assert torch.isneginf(m).all() and (s == 0).all()


@pytest.mark.graded(points=2, exercise="online_merge")
def test_online_softmax_survives_masked_entries():
    """-inf entries (masked scores) before any finite one: the running state must stay (-inf, 0), not NaN."""
    x = torch.randn(3, 40)
    x[:, :17] = float("-inf")
    assert_close(mirror.softmax_online(x, tile=4, num_parts=3), F.softmax(x, dim=-1))


@pytest.mark.graded(points=3, exercise="online_merge")
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 5), cols=st.integers(1, 70), tile=st.integers(1, 9), parts=st.integers(1, 6),
       seed=st.integers(0, 2**16))
def test_online_softmax_any_tiling(rows, cols, tile, parts, seed):
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 5
    assert_close(mirror.softmax_online(x, tile=tile, num_parts=parts), naive.softmax(x))


@pytest.mark.graded(points=2, exercise="warp_tree_sum")
def test_warp_tree_sum_is_the_sum():
    p = torch.randn(4, 32, dtype=torch.float64)
    torch.testing.assert_close(mirror.warp_tree_sum(p), p.sum(dim=-1))
    with pytest.raises(ValueError, match="32 lanes"):
        mirror.warp_tree_sum(torch.zeros(31))


@pytest.mark.graded(points=1, exercise="warp_tree_sum")
def test_warp_tree_sum_adds_lanes_in_the_shuffle_order():
    """One nonzero lane, a ramp, two halves: every lane's value reaches the total exactly once."""
    p = torch.zeros(3, 32)
    p[0, 5] = 7.0
    p[1] = torch.arange(32.0)
    p[2, :16], p[2, 16:] = 1.0, 2.0
    assert mirror.warp_tree_sum(p).tolist() == [7.0, 496.0, 48.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("rows", ROWS)
def test_layernorm_mirror_and_naive_agree_with_torch(rows, cols, dtype):
    x = (torch.randn(rows, cols) * 2 + 3).to(dtype)  # an offset mean: E[x^2] - mean^2 must still be accurate
    w, b = torch.randn(cols).to(dtype), torch.randn(cols).to(dtype)
    ref = naive.layernorm(x, w, b)
    assert_close(ref, F.layer_norm(x.float(), (cols,), w.float(), b.float(), eps=1e-5), dtype)
    assert_close(mirror.layernorm_warp(x, w, b), ref, dtype)
    assert_close(mirror.layernorm_warp(x, w, b, pack=16 // x.element_size()), ref, dtype)  # v4's 16-byte packs


def rows_of_mean_3000(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 rows of mean 3000 and standard deviation 1, a weight and a bias, and F.layer_norm's result in float64:
    where var = E[x^2] - mean^2 in fp32 cancels (E[x^2] ~ 9e6, fp32 values 1 apart there; outputs off by 1.45, by
    1926 in layernorm v4's order of sums), and a second pass over x - mean does not."""
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    x = torch.randn(rows, cols, generator=g) + 3000.0
    w, b = torch.randn(cols, generator=g), torch.randn(cols, generator=g)
    return x, w, b, F.layer_norm(x.double(), (cols,), w.double(), b.double(), eps=1e-5)


LN_OFFSET_SHAPES = ((4, 64), (3, 130), (2, 1000))  # whole 16-byte packs or not, short and long rows
LN_OFFSET_ATOL = 2e-2  # x itself is only known to fp32's 2.4e-4 at 3000; a fp32 mean of 1000 such values to ~1e-3


@pytest.mark.parametrize("pack", [1, 4, 8])
@pytest.mark.parametrize("rows,cols", LN_OFFSET_SHAPES)
def test_layernorm_mirror_holds_rows_of_mean_3000(rows, cols, pack):
    x, w, b, want = rows_of_mean_3000(rows, cols)
    torch.testing.assert_close(mirror.layernorm_warp(x, w, b, pack=pack).double(), want, atol=LN_OFFSET_ATOL, rtol=0)
    torch.testing.assert_close(naive.layernorm(x, w, b).double(), want, atol=LN_OFFSET_ATOL, rtol=0)


@pytest.mark.parametrize("pack", [1, 4, 16])
def test_lane_partials_give_each_lane_its_packs(pack):
    """Lane i owns packs i, i + 32, ...: with x[c] = 1 for one column c, only lane (c // pack) % 32 sums it."""
    C = 3 * 32 * pack + pack // 2 + 1  # several rounds, and a last pack cut short
    for c in (0, pack - 1, pack, 32 * pack + 1, C - 1):
        x = torch.zeros(C)
        x[c] = 1.0
        got = mirror.lane_partials(x, pack)
        assert got.shape == (32,) and got.sum() == 1 and got[(c // pack) % 32] == 1, (c, got)
    x = torch.randn(2, C, dtype=torch.float64)
    torch.testing.assert_close(mirror.lane_partials(x, pack).sum(dim=-1), x.sum(dim=-1))
    with pytest.raises(ValueError, match="pack"):
        mirror.lane_partials(x, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("rows", ROWS)
def test_bias_gelu_mirror_and_naive_agree_with_torch(rows, cols, dtype):
    x, b = torch.randn(rows, cols).to(dtype), torch.randn(cols).to(dtype)
    ref = naive.bias_gelu(x, b)
    assert_close(ref, F.gelu(x.float() + b.float(), approximate="tanh"), dtype)  # GPT-2's GELU, as core.model
    assert_close(mirror.bias_gelu(x, b, pack=8), ref, dtype)
    assert_close(mirror.bias_gelu(x, b, pack=4), ref, dtype)


@pytest.mark.graded(points=2, exercise="attend_tile")
def test_attend_tile_two_tiles_are_softmax_attention_over_both():
    """Scores [0, ln 2] then [ln 4] with values 1, 2, 3: weights 1/7, 2/7, 4/7, output (1 + 4 + 12) / 7."""
    m, l, o = torch.tensor([float("-inf")]), torch.zeros(1), torch.zeros(1, 1)
    m, l, o = mirror.attend_tile(m, l, o, torch.tensor([[0.0, math.log(2)]]), torch.tensor([[[1.0], [2.0]]]))
    assert m.item() == pytest.approx(math.log(2)) and l.item() == pytest.approx(1.5) and o.item() == pytest.approx(2.5)
    m, l, o = mirror.attend_tile(m, l, o, torch.tensor([[math.log(4)]]), torch.tensor([[[3.0]]]))
    assert m.item() == pytest.approx(math.log(4)) and l.item() == pytest.approx(7 / 4)
    assert (o / l.unsqueeze(-1)).item() == pytest.approx(17 / 7)


@pytest.mark.graded(points=2, exercise="attend_tile")
@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), hs=st.integers(1, 9), tiles=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_attend_tile_any_split_equals_one_softmax(n, hs, tiles, seed):
    g = torch.Generator().manual_seed(seed)
    s, v = torch.randn(3, n, generator=g) * 4, torch.randn(3, n, hs, generator=g)
    want = torch.softmax(s, dim=-1).unsqueeze(-2) @ v  # (3, 1, hs)
    m, l, o = torch.full((3,), float("-inf")), torch.zeros(3), torch.zeros(3, hs)
    for chunk in torch.arange(n).tensor_split(tiles):
        if chunk.numel():
            m, l, o = mirror.attend_tile(m, l, o, s[:, chunk], v[:, chunk])
    torch.testing.assert_close(o / l.unsqueeze(-1), want.squeeze(-2), rtol=1e-5, atol=1e-5)


ATTN_SHAPES = [(1, 1, 1, 8), (2, 3, 37, 24), (1, 2, 70, 64), (1, 1, 33, 128), (2, 1, 17, 1)]
# v4 rounds P to the input dtype for the tensor cores, then the output: two roundings where the others have one.
ATTN_ROUNDINGS = {1: 1, 2: 1, 3: 1, 4: 2}


@pytest.mark.graded(points=3, exercise="attend_tile")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ATTN_SHAPES, ids=str)
def test_flash_attention_mirror_and_naive_agree_with_sdpa(shape, dtype):
    q, k, v = (torch.randn(shape).to(dtype) for _ in range(3))
    ref = naive.attention(q, k, v)
    sdpa = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert_close(ref, sdpa, dtype)
    assert_close(mirror.flash_attention(q, k, v, block_q=16, block_k=16), ref, dtype)
    assert_close(mirror.flash_attention(q, k, v, block_q=5, block_k=7), ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [*ATTN_SHAPES, (1, 2, 64, 64), (1, 2, 130, 64), (2, 1, 200, 100)], ids=str)
def test_flash_attention_v3_mirror_agrees_with_naive(shape, dtype):
    """v3's 64 x 64 tiles (sequences shorter than, equal to and past one tile), base-2 exponentials with the scale
    folded into Q, and each row's max and sum split over 8 threads give the naive op's result."""
    q, k, v = (torch.randn(shape).to(dtype) for _ in range(3))
    assert_close(mirror.flash_attention_v3(q, k, v), naive.attention(q, k, v), dtype)
    if dtype != torch.float32:  # v4: P rounded to the input dtype for the tensor cores
        assert_close(mirror.flash_attention_v3(q, k, v, p_dtype=dtype), naive.attention(q, k, v), dtype, roundings=2)


def test_flash_attention_v3_rows_split_over_eight_threads():
    """Thread tx holds columns tx*4..tx*4+3 and 32+tx*4..32+tx*4+3 of a 64-column tile, and the three xor
    shuffles leave every thread with the row's total."""
    cols = torch.arange(64.0)
    held = mirror._row_lanes(cols)  # (2, 8, 4)
    assert held[:, 3].flatten().tolist() == [12, 13, 14, 15, 44, 45, 46, 47]
    partial = held.sum(dim=(0, 2))  # (8,)
    assert mirror._xor_tree(partial, torch.add).item() == cols.sum().item()
    assert mirror._xor_tree(held.amax(dim=(0, 2)), torch.maximum).item() == 63


def paged_case(dtype, device, nh=3, hs=24, bs=4, lens=(1, 5, 9, 16, 23), seed=0):
    """A decode step of chapter 05's paged cache on a real block table: sequences of `lens` tokens whose blocks are
    scattered (other sequences allocated and freed in between) and one forked sequence sharing its parent's blocks.
    The cache holds random K/V for every token but the last of each sequence; returns the cache, the step's
    PagedBatch and the new tokens' q, k, v (1, nh, S, hs), ready for `cache.attend`."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = 2 * sum(-(-n // bs) + -(-(1 + i % 3 * bs) // bs) for i, n in enumerate(lens)) + 2
    manager = BlockManager(num_blocks, bs)
    seq_ids = []
    for i, n in enumerate(lens):
        manager.allocate(f"pad{i}", [1] * (1 + i % 3 * bs))  # filler that is freed again: holes in the pool
        manager.allocate(i, torch.randint(0, 100, (n,), generator=g).tolist())
        seq_ids.append(i)
    for i in range(0, len(lens), 2):
        manager.free(f"pad{i}")
    manager.fork(seq_ids[-1], "child")  # shares every block of the last sequence
    last = manager.token_ids("child")[-1]
    manager.truncate("child", len(manager.token_ids("child")) - 1)
    manager.append_slot("child", last)  # copy-on-write: the block its new token goes to is its own copy
    seq_ids.append("child")
    config = GPTConfig(n_layer=1, n_head=nh, n_embd=nh * hs, attn_impl="explicit")
    cache = PagedKVCache(config, num_blocks, bs, device=device, dtype=dtype)
    for sid in seq_ids:  # the context before the last token
        n = manager.num_tokens(sid)
        slots = torch.tensor(manager.slot_mapping(sid, 0, n - 1), dtype=torch.int64, device=device)
        for pool in (cache.k_pools[0], cache.v_pools[0]):
            write_kv(pool, slots, torch.randn(n - 1, nh, hs, generator=g).to(device))
    # the child shares its parent's full blocks and reads them; its last block is a copy (the context loop above
    # wrote the copy's slots), so the new tokens of the two write different slots, as in the engine
    batch = PagedBatch.build(manager, [(sid, manager.num_tokens(sid) - 1, 1) for sid in seq_ids], device=device)
    S = len(seq_ids)
    q, k, v = (torch.randn(1, nh, S, hs, generator=g).to(device=device, dtype=dtype) for _ in range(3))
    cache.set_batch(batch)
    return cache, batch, q, k, v


@pytest.mark.graded(points=2, exercise="attend_tile")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs", [1, 4, 16])
def test_paged_mirror_matches_chapter_05_paged_attention(bs, dtype):
    cache, batch, q, k, v = paged_case(dtype, "cpu", bs=bs)
    ref = cache.attend(0, q, k, v)[0].transpose(0, 1)  # (1, nh, S, hs) -> (S, nh, hs); writes the new K/V first
    args = (q[0].transpose(0, 1).contiguous(), cache.k_pools[0], cache.v_pools[0], batch.block_tables,
            batch.context_lens)
    assert_close(naive.paged_attention_decode(*args), ref, dtype)
    assert_close(mirror.paged_attention_decode(*args), ref, dtype)
    assert_close(mirror.paged_attention_decode(*args, num_warps=4), ref, dtype)  # v2: keys split over 4 warps


@pytest.mark.graded(points=2, exercise="paged_gather")
def test_paged_gather_worked_example():
    pool = torch.arange(6 * 4, dtype=torch.float32).view(6, 4, 1, 1)  # block b, offset o holds 4 * b + o
    table = torch.tensor([3, 0, 5])
    got = mirror.paged_gather(pool, table, 10)  # tokens 0-3 in block 3, 4-7 in block 0, 8-9 in block 5
    assert got.flatten().tolist() == [12, 13, 14, 15, 0, 1, 2, 3, 20, 21]
    assert mirror.paged_gather(pool, table, 0).shape == (0, 1, 1)
    with pytest.raises(ValueError, match="context_len"):
        mirror.paged_gather(pool, table, 13)


@pytest.mark.graded(points=3, exercise="paged_gather")
@pytest.mark.parametrize("bs", [1, 4, 16])
def test_paged_gather_reads_chapter_05s_cache_in_order(bs):
    """Through a real BlockManager's tables, the gathered keys of each sequence are its keys in order (as the
    contiguous cache would hold them), read back from chapter 05's pool."""
    cache, batch, q, k, v = paged_case(torch.float32, "cpu", bs=bs)
    cache.attend(0, q, k, v)
    for s, ctx in enumerate(batch.context_lens.tolist()):
        keys = mirror.paged_gather(cache.k_pools[0], batch.block_tables[s], ctx)  # (ctx, nh, hs)
        nblk = -(-ctx // bs)
        want = cache.k_pools[0].index_select(0, batch.block_tables[s, :nblk]).flatten(0, 1)[:ctx]
        assert torch.equal(keys, want)
        if s < len(batch.context_lens) - 2:  # (the last two share their last slot: see paged_case)
            assert torch.equal(keys[-1], k[0, :, s])  # the token written this step is the last one


def test_paged_mirror_bad_block_gives_nan_and_empty_context_zeros():
    cache, batch, q, k, v = paged_case(torch.float32, "cpu")
    cache.attend(0, q, k, v)
    tables, lens = batch.block_tables.clone(), batch.context_lens.clone()
    tables[1, 0] = cache.num_blocks  # outside the pool
    lens[2] = 0
    for num_warps in (1, 4):
        y = mirror.paged_attention_decode(q[0].transpose(0, 1), cache.k_pools[0], cache.v_pools[0], tables, lens,
                                          num_warps=num_warps)
        assert torch.isnan(y[1]).all() and (y[2] == 0).all() and not torch.isnan(y[0]).any()
    with pytest.raises(ValueError, match="num_warps"):
        mirror.paged_attention_decode(q[0].transpose(0, 1), cache.k_pools[0], cache.v_pools[0], tables, lens, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (1, 33, 130), (3, 130, 31), (8, 7, 1000)])
def test_int8_gemv_mirror_and_naive_agree_with_a_dequantized_linear(M, N, K, dtype):
    x = torch.randn(M, K).to(dtype)
    w = torch.randint(-127, 128, (N, K), dtype=torch.int8)
    scale, bias = (torch.rand(N) / 64).to(dtype), torch.randn(N).to(dtype)
    ref = naive.int8_gemv(x, w, scale, bias)
    assert_close(ref, F.linear(x.float(), w.float() * scale.float()[:, None], bias.float()), dtype)
    assert_close(mirror.int8_gemv(x, w, scale, bias), ref, dtype)
    assert_close(mirror.int8_gemv(x, w, scale), naive.int8_gemv(x, w, scale), dtype)
    assert_close(mirror.int8_gemv(x, w, scale, bias, pack=16), ref, dtype)  # v3: 16 weights a load


@settings(max_examples=25, deadline=None)
@given(data=st.data(), nb=st.integers(1, 6), bs=st.integers(1, 5), T=st.integers(0, 12))
def test_kv_write_mirror_equals_naive_with_skipped_slots(data, nb, bs, T):
    num_slots = nb * bs
    T = min(T, num_slots)
    slots = data.draw(st.permutations(range(num_slots)))[:T]
    skip = data.draw(st.lists(st.booleans(), min_size=T, max_size=T))
    slot_mapping = torch.tensor([-1 if s else x for x, s in zip(slots, skip)], dtype=torch.int64)
    key, value = torch.randn(T, 2, 3), torch.randn(T, 2, 3)
    pools = [torch.randn(nb, bs, 2, 3) for _ in range(2)]
    ref = [p.clone() for p in pools]
    naive.kv_cache_write(key, value, *ref, slot_mapping)
    mirror.kv_cache_write(key, value, *pools, slot_mapping)
    assert torch.equal(pools[0], ref[0]) and torch.equal(pools[1], ref[1])
    for t, s in enumerate(slot_mapping.tolist()):
        if s >= 0:
            assert torch.equal(pools[0][s // bs, s % bs], key[t])


# ------------------------------------------------------------------------------------------- argument checks (CPU)
@pytest.fixture
def no_build(monkeypatch):
    """Any attempt to build or launch fails the test: argument errors must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("load_kernels was called before the arguments were checked")

    monkeypatch.setattr(ops, "load_kernels", refuse)


def _pool():
    return torch.zeros(4, 2, 3, 8)


BAD_CALLS = [
    (lambda: ops.softmax([1.0, 2.0]), TypeError, "x must be a torch.Tensor"),
    (lambda: ops.softmax(torch.zeros(2, 3, dtype=torch.float64)), ValueError, "float64"),
    (lambda: ops.softmax(torch.zeros(2, 3), version=5), ValueError, "version must be 1..4, got 5"),
    (lambda: ops.softmax(torch.zeros(2, 3), version=2.0), TypeError, "version must be an int"),
    (lambda: ops.softmax(torch.zeros(2, 3), out=torch.zeros(3, 2)), ValueError, r"out must have shape \(2, 3\)"),
    (lambda: ops.softmax(torch.zeros(2, 3)), ValueError, "x must be on a CUDA device, got cpu"),
    (lambda: ops.layernorm(torch.zeros(2, 3), torch.zeros(4), torch.zeros(3)), ValueError, "weight must have shape"),
    (lambda: ops.layernorm(torch.zeros(2, 3), torch.zeros(3), torch.zeros(3), eps=0.0), ValueError, "eps"),
    (lambda: ops.layernorm(torch.zeros(2, 3), torch.zeros(3), torch.zeros(3).half()), ValueError, "bias must have"),
    (lambda: ops.bias_gelu(torch.zeros(2, 3), torch.zeros(3), version=3), ValueError, "version must be 1..2"),
    (lambda: ops.bias_gelu(torch.zeros(2, 3), "bias"), TypeError, "bias must be a torch.Tensor"),
    (lambda: ops.attention(*(torch.zeros(1, 2, 3, 129),) * 3), ValueError, "head size"),
    (lambda: ops.attention(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), torch.zeros(2, 3, 4)), ValueError,
     "v must be 4-D"),
    (lambda: ops.attention(*(torch.zeros(1, 2, 3, 4),) * 3), ValueError, "q must be on a CUDA device"),
    (lambda: ops.paged_attention_decode(torch.zeros(2, 3, 8), _pool(), _pool(), torch.zeros(2, 4),
                                        torch.zeros(2, dtype=torch.int64)), ValueError, "block_tables must have"),
    (lambda: ops.paged_attention_decode(torch.zeros(2, 3, 8), torch.zeros(4, 2, 3, 9), _pool(),
                                        torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)),
     ValueError, "k_pool must be"),
    (lambda: ops.paged_attention_decode(torch.zeros(2, 3, 8), _pool(), _pool(), torch.zeros(2, 4, dtype=torch.int64),
                                        torch.zeros(3, dtype=torch.int64)), ValueError, "context_lens must have"),
    (lambda: ops.paged_attention_decode(torch.zeros(2, 3, 8), _pool(), _pool(), torch.zeros(2, 4, dtype=torch.int64),
                                        torch.zeros(2, dtype=torch.int64)), ValueError, "must be on a CUDA device"),
    # index ranges, checked before the device (and before any memory is touched)
    (lambda: ops.paged_attention_decode(torch.zeros(2, 3, 8), _pool(), _pool(), torch.tensor([[0, 7], [1, -1]]),
                                        torch.tensor([3, 1])), ValueError, r"block_tables\[0, 1\] = 7"),
    (lambda: ops.paged_attention_decode(torch.zeros(2, 3, 8), _pool(), _pool(), torch.tensor([[0, 1], [2, -1]]),
                                        torch.tensor([3, 3])), ValueError, r"block_tables\[1, 1\] = -1"),
    (lambda: ops.paged_attention_decode(torch.zeros(2, 3, 8), _pool(), _pool(), torch.tensor([[0, 1], [2, 3]]),
                                        torch.tensor([3, 99])), ValueError, "context_lens must be in"),
    (lambda: ops.paged_attention_decode(torch.zeros(2, 3, 8), _pool(), _pool(), torch.tensor([[0, 1], [2, 3]]),
                                        torch.tensor([3, 2]), check_tables="yes"), TypeError, "check_tables"),
    (lambda: ops.kv_cache_write(torch.zeros(2, 3, 8), torch.zeros(2, 3, 8), _pool(), _pool(), torch.tensor([0, 99])),
     ValueError, "slot_mapping must hold -1 or slots"),
    (lambda: ops.int8_gemv(torch.zeros(2, 5), torch.zeros(3, 5), torch.zeros(3)), ValueError, "w must have dtype"),
    (lambda: ops.int8_gemv(torch.zeros(2, 5), torch.zeros(3, 4, dtype=torch.int8), torch.zeros(3)), ValueError,
     r"w must be \(N, K=5\)"),
    (lambda: ops.int8_gemv(torch.zeros(2, 5), torch.zeros(3, 5, dtype=torch.int8), torch.zeros(3),
                           bias=torch.zeros(4)), ValueError, "bias must have shape"),
    (lambda: ops.kv_cache_write(torch.zeros(2, 3, 8), torch.zeros(2, 3, 8), _pool(), _pool(),
                                torch.zeros(3, dtype=torch.int64)), ValueError, "one slot per token"),
    (lambda: ops.kv_cache_write(torch.zeros(2, 3, 8), torch.zeros(2, 3, 8), _pool(), _pool(),
                                torch.zeros(2, dtype=torch.int32)), ValueError, "slot_mapping must have dtype"),
    (lambda: ops.kv_cache_write(torch.zeros(2, 3, 8), torch.zeros(2, 3, 8), _pool(), _pool().half(),
                                torch.zeros(2, dtype=torch.int64)), ValueError, "v_pool must have"),
]


@pytest.mark.parametrize("call,exc,match", BAD_CALLS, ids=[m for _, _, m in BAD_CALLS])
def test_wrappers_reject_bad_arguments_before_building(no_build, call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_load_kernels_says_what_is_missing_without_cuda():
    if HAS_CUDA:
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="CUDA"):
        build.load_kernels()


def test_bench_says_it_needs_cuda_and_formats_rows(capsys):
    if not HAS_CUDA:
        assert bench.main([]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
    result = {"device": "X", "torch": "t", "copy_GBps": 100.0, "matmul_bf16_TFLOPs": 1.0, "matmul_fp32_TFLOPs": 0.5,
              "seconds": 1.0,
              "rows": [{"kernel": "softmax", "version": "v1", "shape": "(2, 3)", "dtype": "bfloat16", "ms": 0.5,
                        "GB/s": 10.0, "fraction_of_copy_bw": 0.1, "speedup_vs_naive": 2.0, "correct": True},
                       {"kernel": "attention", "version": "v3", "shape": "(1, 1, 8, 8)", "dtype": "bfloat16",
                        "ms": 0.25, "GB/s": 1.0, "fraction_of_copy_bw": 0.01, "speedup_vs_naive": 3.0,
                        "TFLOP/s": 0.2, "fraction_of_fp32_matmul": 0.4, "correct": True},
                       {"kernel": "softmax", "version": "v2", "shape": "(2, 3)", "dtype": "bfloat16", "ms": None,
                        "GB/s": None, "fraction_of_copy_bw": None, "speedup_vs_naive": None, "correct": False}]}
    table = bench.format_table(result)
    assert "0.5000" in table and "WRONG" in table.splitlines()[-1]
    assert "fp32 matmul 0.5 TFLOP/s" in table.splitlines()[0] and "of fp32" in table.splitlines()[1]
    assert table.splitlines()[3].split()[2:7] == ["0.2500", "1.0", "0.010", "0.20", "0.400"]


def test_ptxas_report_parses():
    report = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_ZN7minillm17softmax_v1_kernelIfEEvPKT_PS2_ll' for 'sm_90'
ptxas info    : Function properties for _ZN7minillm17softmax_v1_kernelIfEEvPKT_PS2_ll
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 21 registers, used 0 barriers, 384 bytes cmem[0]
"""
    (r,) = build.parse_ptxas("softmax.cu", report)
    assert (r.arch, r.registers, r.spill_stores, r.spill_loads, r.stack_frame) == ("sm_90", 21, 4, 12, 8)
    assert "softmax_v1_kernel" in r.kernel
    with pytest.raises(ValueError, match="sm_90"):
        build.compile_sources_with_nvcc("90", "unused")


def test_a_printed_table_reads_back_as_the_rows_it_printed():
    result = {"device": "X", "torch": "t", "copy_GBps": 100.0, "matmul_bf16_TFLOPs": 1.0, "matmul_fp32_TFLOPs": 0.5,
              "seconds": None,
              "rows": [{"kernel": "int8_gemv", "version": "F.linear bf16 weight", "shape": "M=4 N=8 K=16",
                        "dtype": "bfloat16", "ms": 0.5, "GB/s": 10.0, "fraction_of_copy_bw": 0.1,
                        "speedup_vs_naive": 2.0, "TFLOP/s": 0.2, "fraction_of_fp32_matmul": 0.4, "correct": True},
                       {"kernel": "softmax", "version": "v2", "shape": "(2, 3)", "dtype": "bfloat16", "ms": None,
                        "GB/s": None, "fraction_of_copy_bw": None, "speedup_vs_naive": None, "correct": False}]}
    table = bench.format_table(result)
    assert "None" not in table.splitlines()[0]
    assert bench.parse_table(table) == result["rows"]
    with pytest.raises(ValueError, match="no table"):
        bench.parse_table("nothing printed")
    with pytest.raises(ValueError, match="does not fit"):
        bench.parse_table(table.replace("0.5000", "fast"))


def test_the_h200_results_are_the_committed_report_read_back(tmp_path, monkeypatch, capsys):
    """The results file the chapter's H200 table is drawn from holds the benchmark's table as the committed GPU
    report printed it, nothing else: running its command again writes the same file."""
    committed = json.loads((ROOT / H200_RESULTS).read_text(encoding="utf-8"))
    assert committed["command"] == (f"python -m minillm.kernels.bench --from-report {H200_REPORT} "
                                    f"--json {H200_RESULTS}")
    monkeypatch.chdir(ROOT)  # the command names the report relative to the repository
    out = tmp_path / "h200.json"
    assert bench.main(["--from-report", H200_REPORT, "--json", str(out)]) == 0
    again = json.loads(out.read_text(encoding="utf-8"))
    assert again["command"].endswith(f"--json {out}")
    assert {**again, "command": committed["command"]} == committed
    assert "softmax" in capsys.readouterr().out
    assert (committed["device"], committed["copy_GBps"], len(committed["rows"])) == ("NVIDIA H200", 4065.0, 27)


def test_quotes_render_every_name_the_chapter_uses():
    """Every table and value chapter 12 quotes from its results files is among `bench.quotes` of that file, and
    the ladder recomputes the text's percentages from the rows' fractions."""
    text = (ROOT / "chapters" / "12-cuda-kernels.md").read_text(encoding="utf-8")
    used = re.findall(r"<!-- (?:include|value): (chapters/results/12-[\w-]+\.json)::([^>\n]+?) -->", text)
    assert {path for path, _ in used} == {H200_RESULTS, PTXAS_RESULTS}
    quotes = {path: bench.quotes(json.loads((ROOT / path).read_text(encoding="utf-8")))
              for path in (H200_RESULTS, PTXAS_RESULTS)}
    for path, name in used:
        assert name in quotes[path], (path, name)
    h200 = quotes[H200_RESULTS]
    assert "| softmax (4096, 4096) | 5.8% | 1.0% | 15.4% | 15.7% | 20.4% | 24.3% (`F.softmax`) |" in h200["ladder"]
    assert "| attention (4, 16, 1024, 64) | 1.36 ms | 14.5 ms | 5.82 ms |  |  | 0.0625 ms (`sdpa`) |" in h200["ladder"]
    assert (h200["attention_torch_vs_v2"], h200["int8_gemv_v2_vs_v1"], h200["torch_of_copy_range"]) == \
        ("93x", "6.9x", "24-33%")
    ptxas = quotes[PTXAS_RESULTS]
    assert ptxas["registers"].count("\n") == 2 + len(build.KERNELS) and ptxas["spill_bytes"] == "0"


# ------------------------------------------------------------------------------------------------------------ nvcc
@pytest.mark.slow
def test_every_kernel_compiles_without_spills(tmp_path):
    """One nvcc run per kernel file for both architectures (about 45 s on two cores): one test, not one per
    architecture, so two pytest-xdist workers never compile the same files twice."""
    if NVCC is None:
        pytest.skip("nvcc is not installed")
    ptxas_report = build.compile_sources_with_nvcc(("sm_80", "sm_90"), tmp_path / "nvcc")
    for arch in ("sm_80", "sm_90"):
        for source, names in build.KERNELS.items():
            found = [r for r in ptxas_report if r.source == source and r.arch == arch]
            for name in names:
                mine = [r for r in found if name in r.kernel]
                assert len(mine) >= 3, f"{source}: ptxas reported {len(mine)} instantiations of {name} for {arch}"
            for r in found:
                assert 0 < r.registers <= 255, f"{r.kernel}: {r.registers} registers"
                assert r.spill_stores <= SPILL_LIMIT_BYTES and r.spill_loads <= SPILL_LIMIT_BYTES, r
    # The register table the chapter quotes is what this compiler reports for these files (another release may
    # allocate registers differently: then `python -m minillm.kernels.bench --ptxas` writes it anew).
    committed = json.loads((ROOT / PTXAS_RESULTS).read_text(encoding="utf-8"))
    if committed["nvcc"] == bench.nvcc_release():
        def key(k: dict) -> tuple:
            return k["source"], k["arch"], k["kernel"]
        assert sorted(bench.ptxas_rows(ptxas_report), key=key) == sorted(committed["kernels"], key=key)


@pytest.mark.slow
def test_bindings_parse_against_torch_headers(tmp_path):
    """g++ -fsyntax-only on bindings.cpp with torch's headers (about 5 s). A CPU wheel of torch lacks one
    generated CUDA header, c10/cuda/impl/cuda_cmake_macros.h; a stub stands in for it there."""
    from torch.utils import cpp_extension

    cxx = shutil.which("g++") or shutil.which("c++")
    cuda_home = build.find_cuda_home()
    if cxx is None or cuda_home is None:
        pytest.skip("needs g++ and the CUDA toolkit's headers")
    cuda_include = cuda_home / "include"
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"], str(cuda_include)]
    if not any((Path(p) / "c10/cuda/impl/cuda_cmake_macros.h").is_file() for p in includes):
        stub = tmp_path / "c10/cuda/impl"
        stub.mkdir(parents=True)
        (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        includes.append(str(tmp_path))
    cmd = [cxx, "-std=c++20", "-fsyntax-only", *(f"-I{p}" for p in includes), str(build.BINDINGS)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


# ------------------------------------------------------------------------------------------------ CPU emulator
# The kernels' own C++ on the CPU (minillm.kernels.emulator): every version of every kernel against its naive twin,
# in every dtype, with the threads of each block run in both orders.
@pytest.fixture(scope="module")
def emu():
    if emulator.find_cxx() is None:
        pytest.skip("needs a C++ compiler (g++ or clang++)")
    return emulator.load()


EMU_CASES = [(torch.float32, False), (torch.float32, True), (torch.float16, False), (torch.bfloat16, True)]
EMU_IDS = [f"{str(d).split('.')[-1]}-{'reverse' if r else 'forward'}" for d, r in EMU_CASES]


def test_emulator_translates_launches_and_dynamic_shared_memory():
    src = ("extern __shared__ float4 smem4[];\n"
           "k<T, 64><<<static_cast<unsigned>(n), 128, smem, stream>>>(\n    a, b);\n"
           "if (n > 0) k2<T><<<ceil_div(n, 4), 128, 0, stream>>>(x, y);")
    out = emulator.translate(src)
    assert "float4* smem4 = reinterpret_cast<float4*>(::emu::dynamic_shared_memory());" in out
    assert "::emu::launch(::emu::LaunchConfig(static_cast<unsigned>(n), 128, smem, stream), &k<T, 64>, \n    a, b);" \
        in out
    assert "if (n > 0) ::emu::launch(::emu::LaunchConfig(ceil_div(n, 4), 128, 0, stream), &k2<T>, x, y);" in out
    for path in build.KERNEL_SOURCES:
        assert "<<<" not in emulator.translate(path.read_text())


@pytest.mark.parametrize("dtype,reverse", EMU_CASES, ids=EMU_IDS)
@pytest.mark.parametrize("version", ops.versions("softmax"))
def test_emulated_softmax(emu, version, dtype, reverse):
    for rows, cols in ((1, 1), (7, 1000), (3, 130), (2, 4099)):
        x = (torch.randn(rows, cols) * 4).to(dtype)
        assert_close(emulator.softmax(x, version, reverse=reverse), naive.softmax(x))


@pytest.mark.parametrize("dtype,reverse", EMU_CASES, ids=EMU_IDS)
@pytest.mark.parametrize("version", ops.versions("softmax"))
def test_emulated_softmax_of_large_shifted_and_masked_scores(emu, version, dtype, reverse):
    """Every version subtracts its row's maximum before exp: logits around +100 (exp overflows a float32 without
    it) or -200 (every exp underflows to 0, and 0 / 0 is NaN), and rows masked with -inf but one entry, give
    torch's softmax. (A planted version without the subtraction passed the test above, whose inputs are small.)"""
    torch.manual_seed(0)
    for offset in (100.0, -200.0):
        x = (torch.randn(5, 300) * 4 + offset).to(dtype)
        assert_close(emulator.softmax(x, version, reverse=reverse), torch.softmax(x.float(), -1).to(dtype))
    masked = torch.full((3, 130), -math.inf)
    masked[0, 7], masked[1, :64], masked[2, 129] = 50.0, torch.randn(64) + 80, -90.0
    masked = masked.to(dtype)
    assert_close(emulator.softmax(masked, version, reverse=reverse), torch.softmax(masked.float(), -1).to(dtype))


@pytest.mark.parametrize("dtype,reverse", EMU_CASES, ids=EMU_IDS)
@pytest.mark.parametrize("version", ops.versions("layernorm"))
def test_emulated_layernorm(emu, version, dtype, reverse):
    for rows, cols in ((1, 1), (7, 1000), (5, 130), (9, 2048)):
        x = (torch.randn(rows, cols) * 2 + 3).to(dtype)
        w, b = torch.randn(cols).to(dtype), torch.randn(cols).to(dtype)
        assert_close(emulator.layernorm(x, w, b, version, reverse=reverse), naive.layernorm(x, w, b))


@pytest.mark.parametrize("dtype,reverse", EMU_CASES, ids=EMU_IDS)
@pytest.mark.parametrize("version", ops.versions("bias_gelu"))
def test_emulated_bias_gelu(emu, version, dtype, reverse):
    for rows, cols in ((1, 1), (7, 1000), (3, 131)):  # 3 * 131 elements: packs and a tail
        x, b = (torch.randn(rows, cols) * 2).to(dtype), torch.randn(cols).to(dtype)
        assert_close(emulator.bias_gelu(x, b, version, reverse=reverse), naive.bias_gelu(x, b))


@pytest.mark.parametrize("dtype,reverse", EMU_CASES, ids=EMU_IDS)
@pytest.mark.parametrize("version", ops.versions("attention"))
def test_emulated_attention(emu, version, dtype, reverse):
    shapes = [*ATTN_SHAPES, (1, 1, 129, 32), (1, 1, 70, 100)]  # v3: several 64-row tiles, head sizes 32 and 128
    for shape in shapes:
        q, k, v = (torch.randn(shape).to(dtype) for _ in range(3))
        assert_close(emulator.attention(q, k, v, version, reverse=reverse), naive.attention(q, k, v),
                     roundings=ATTN_ROUNDINGS[version])


@pytest.mark.parametrize("dtype,reverse", EMU_CASES, ids=EMU_IDS)
@pytest.mark.parametrize("version", ops.versions("paged_attention_decode"))
def test_emulated_paged_attention_matches_chapter_05(emu, version, dtype, reverse):
    for bs, hs in ((1, 24), (4, 64), (16, 100), (4, 128)):
        cache, batch, q, k, v = paged_case(dtype, "cpu", bs=bs, hs=hs)
        cache.attend(0, q, k, v)
        args = (q[0].transpose(0, 1).contiguous(), cache.k_pools[0], cache.v_pools[0], batch.block_tables,
                batch.context_lens)
        assert_close(emulator.paged_attention_decode(*args, version, reverse=reverse),
                     naive.paged_attention_decode(*args))
    tables, lens = batch.block_tables.clone(), batch.context_lens.clone()
    tables[1, 0] = cache.num_blocks  # outside the pool: that sequence's output is NaN
    lens[2] = 0  # an empty context: zeros
    lens[3] = tables.shape[1] * bs + 1  # longer than its table can hold: NaN, without reading past the table
    y = emulator.paged_attention_decode(args[0], args[1], args[2], tables, lens, version, reverse=reverse)
    assert torch.isnan(y[1]).all() and (y[2] == 0).all() and torch.isnan(y[3]).all()
    assert not torch.isnan(y[0]).any() and not torch.isnan(y[4:]).any()


@pytest.mark.parametrize("dtype,reverse", EMU_CASES, ids=EMU_IDS)
@pytest.mark.parametrize("version", ops.versions("int8_gemv"))
def test_emulated_int8_gemv(emu, version, dtype, reverse):
    for M, N, K in ((1, 1, 1), (1, 33, 130), (3, 13, 31), (11, 37, 48), (10, 3, 40), (4, 9, 512)):
        x = torch.randn(M, K).to(dtype)
        w = torch.randint(-127, 128, (N, K), dtype=torch.int8)
        scale, bias = (torch.rand(N) / 64).to(dtype), torch.randn(N).to(dtype)
        assert_close(emulator.int8_gemv(x, w, scale, bias, version, reverse=reverse),
                     naive.int8_gemv(x, w, scale, bias))
        assert_close(emulator.int8_gemv(x, w, scale, None, version, reverse=reverse), naive.int8_gemv(x, w, scale))


@pytest.mark.parametrize("dtype,reverse", EMU_CASES, ids=EMU_IDS)
def test_emulated_kv_cache_write_is_exact(emu, dtype, reverse):
    nb, bs, nh, hs, T = 12, 4, 3, 24, 33
    slots = torch.randperm(nb * bs)[:T]
    slots[::5] = -1
    key, value = torch.randn(T, nh, hs).to(dtype), torch.randn(T, nh, hs).to(dtype)
    pools = [torch.randn(nb, bs, nh, hs).to(dtype) for _ in range(2)]
    ref = [p.clone() for p in pools]
    naive.kv_cache_write(key, value, *ref, slots)
    emulator.kv_cache_write(key, value, *pools, slots, reverse=reverse)
    assert torch.equal(pools[0], ref[0]) and torch.equal(pools[1], ref[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_emulated_vectorized_versions_fall_back_on_misaligned_rows(emu, dtype):
    """The same scalar paths the CUDA test checks: a view one element into its storage is not 16-byte aligned."""
    rows, cols = 5, 64
    x = (torch.randn(rows * cols + 1) * 3).to(dtype)[1:].view(rows, cols)
    assert x.data_ptr() % 16 != 0
    b, w = torch.randn(cols).to(dtype), torch.randn(cols).to(dtype)
    assert_close(emulator.softmax(x, 4), naive.softmax(x))
    assert_close(emulator.bias_gelu(x, b, 2), naive.bias_gelu(x, b))
    assert_close(emulator.layernorm(x, w, b, 4), naive.layernorm(x, w, b))
    wq = torch.randint(-127, 128, (7, cols), dtype=torch.int8)
    scale = (torch.rand(7) / 64).to(dtype)
    assert_close(emulator.int8_gemv(x, wq, scale, None, 3), naive.int8_gemv(x, wq, scale))


def test_emulator_catches_a_missing_barrier_and_a_deadlock(emu, tmp_path):
    """Planted bugs, built beside the real kernels: attention v3 without the __syncthreads between writing P and
    reading it reads shared memory nobody wrote yet; softmax v4 with half of each warp skipping the shuffles leaves
    threads waiting at two different barriers, which the emulator reports instead of hanging."""
    attention_cu = (build.CSRC / "attention.cu").read_text()
    barrier = "make_float4(s[0][j], s[1][j], s[2][j], s[3][j]);\n        }\n        __syncthreads();"
    assert barrier in attention_cu
    softmax_cu = (build.CSRC / "softmax.cu").read_text()
    shuffles = "    for (int offset = 16; offset > 0; offset >>= 1) {\n        const float m2"
    assert shuffles in softmax_cu
    planted = {
        "attention.cu": attention_cu.replace(barrier, barrier.replace("__syncthreads();", "")),
        "softmax.cu": softmax_cu.replace(shuffles, "    if (threadIdx.x % 32 < 16)\n" + shuffles),
    }
    lib = emulator.open_library(emulator.build(tmp_path, sources=planted))
    # Each unit's object is cached by its own text: changing one more file compiles that file alone, then relinks.
    objects = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "objects").glob("*.o")}
    kv_write_cu = (build.CSRC / "kv_write.cu").read_text() + "\n// one more line\n"
    emulator.build(tmp_path, sources={**planted, "kv_write.cu": kv_write_cu})
    after = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "objects").glob("*.o")}
    assert len(after) == len(objects) + 1 and {n: after[n] for n in objects} == objects
    assert [n for n in after if n not in objects][0].startswith("kv_write-")
    q, k, v = (torch.randn(1, 2, 130, 64) for _ in range(3))
    ref = naive.attention(q, k, v)
    wrong = [emulator.attention(q, k, v, 3, reverse=r, lib=lib) for r in (False, True)]
    assert any(torch.isnan(w).any() or not torch.allclose(w, ref, atol=1e-3) for w in wrong)
    assert_close(emulator.attention(q, k, v, 2, lib=lib), ref)  # the other versions are untouched
    with pytest.raises(RuntimeError, match="softmax failed under the emulator: .*barrier others never reach"):
        emulator.softmax(torch.randn(3, 64), 4, lib=lib)
    x = torch.randn(3, 64)
    assert_close(emulator.softmax(x, 3, lib=lib), naive.softmax(x))  # after a deadlock, the next launch still runs


def test_emulator_tour_row_counts_every_version(emu):
    row = kernels_tour.emulator_row(seed=0)
    assert row.status == "PASS", row.check
    assert row.value == sum(ops.NUM_VERSIONS.values()) == row.details["total"]
    assert row.details["wrong"] == []


def test_emulator_rejects_gpu_or_strided_tensors():
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        emulator.softmax(torch.randn(4, 6).t(), 1)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        emulator.softmax(torch.zeros(2, 2, dtype=torch.float64), 1)
    with pytest.raises(ValueError, match="sources may replace"):
        emulator.build(sources={"nope.cu": ""})


# ------------------------------------------------------------------------------------------------ the CUDA exercise
# softmax.cu's v2, `softmax_v2_kernel`, is the chapter's exercise in CUDA C++: `minillm assignment 12` hands it out
# with an empty body. These tests run the softmax.cu of the package under test, which in a student folder (and under
# `minillm grade`) is the student's: on the CPU the emulator compiles it with the host C++ compiler and runs each
# block's threads in both orders; on a GPU (`device` is "cuda" there too) the extension is built from it with nvcc.
# Every output starts as NaN, so an element the kernel never writes fails.
def softmax_v2(x: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """softmax.cu's v2 on x (rows, cols): emulated for a CPU tensor (the threads of a block in order, or reversed),
    the CUDA kernel for a CUDA tensor (where the GPU picks the order: `reverse` must be False)."""
    if x.device.type == "cpu":
        if emulator.find_cxx() is None:
            pytest.skip("needs a C++ compiler (g++ or clang++) to compile softmax.cu for the emulator")
        return emulator.softmax(x, 2, reverse=reverse)
    assert not reverse, "only the emulator can reverse the order of a block's threads"
    return ops.softmax(x, 2, out=torch.full_like(x, float("nan")))


def thread_orders(device: torch.device) -> tuple[bool, ...]:
    """`reverse` values to run: both orders in the emulator, the GPU's own order on a GPU."""
    return (False, True) if device.type == "cpu" else (False,)


@pytest.mark.graded(points=4, exercise="softmax_v2_kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_softmax_v2_kernel_equals_softmax(device, dtype):
    """Rows of 1 to 4,099 columns against the naive softmax: fewer columns than the block's 256 threads, exactly
    one per thread, several, and a last round cut short."""
    for rows, cols in ((1, 1), (3, 130), (2, 256), (7, 1000), (2, 4099)):
        x = (torch.randn(rows, cols) * 4).to(dtype).to(device)
        for reverse in thread_orders(device):
            assert_close(softmax_v2(x, reverse), naive.softmax(x))


@pytest.mark.graded(points=2, exercise="softmax_v2_kernel")
def test_softmax_v2_kernel_large_and_masked_scores(device):
    """Scores in the hundreds (exp overflows float32 past 88, so the row's maximum must be subtracted first), the
    first 17 columns of four rows masked to -inf (their outputs exactly 0), and a row of equal scores (1/300 each)."""
    x = torch.randn(5, 300) * 100
    x[:4, :17] = float("-inf")
    x[4] = 7.0
    x = x.to(device)
    for reverse in thread_orders(device):
        y = softmax_v2(x, reverse)
        assert_close(y, F.softmax(x, dim=-1))
        assert (y[:4, :17] == 0).all() and torch.allclose(y[4].cpu(), torch.full((300,), 1 / 300))


# ------------------------------------------------------------------------------------------------------------ CUDA
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def kernels():
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    return build.load_kernels()


def poisoned(shape, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def randn(*shape, dtype, scale=1.0, offset=0.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * scale + offset).to(dtype)


@pytest.mark.parametrize("version", ops.versions("layernorm"))
def test_emulated_layernorm_holds_rows_of_mean_3000(emu, version):
    for rows, cols in LN_OFFSET_SHAPES:
        x, w, b, want = rows_of_mean_3000(rows, cols)
        torch.testing.assert_close(emulator.layernorm(x, w, b, version).double(), want, atol=LN_OFFSET_ATOL, rtol=0)


@cuda_only
@pytest.mark.parametrize("rows,cols", (*LN_OFFSET_SHAPES, (9, 2048)))
@pytest.mark.parametrize("version", ops.versions("layernorm"))
def test_cuda_layernorm_holds_rows_of_mean_3000(kernels, version, rows, cols):
    x, w, b, want = rows_of_mean_3000(rows, cols)
    out = ops.layernorm(x.cuda(), w.cuda(), b.cuda(), version=version, out=poisoned((rows, cols), torch.float32))
    torch.testing.assert_close(out.double().cpu(), want, atol=LN_OFFSET_ATOL, rtol=0)


@cuda_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cols", (*COLS, 1024, 4099))
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("version", ops.versions("softmax"))
def test_cuda_softmax(kernels, version, rows, cols, dtype):
    x = randn(rows, cols, dtype=dtype, scale=4.0)
    out = ops.softmax(x, version=version, out=poisoned((rows, cols), dtype))
    assert_close(out, naive.softmax(x))


@cuda_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("version", ops.versions("softmax"))
def test_cuda_softmax_of_large_shifted_scores(kernels, version, dtype):
    """As the emulator's test: logits around +100 and -200 need the row maximum subtracted before exp."""
    for offset in (100.0, -200.0):
        x = randn(5, 300, dtype=dtype, scale=4.0, offset=offset)
        out = ops.softmax(x, version=version, out=poisoned((5, 300), dtype))
        assert_close(out, torch.softmax(x.float(), -1).to(dtype))


@cuda_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cols", (*COLS, 2048))
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("version", ops.versions("layernorm"))
def test_cuda_layernorm(kernels, version, rows, cols, dtype):
    x = randn(rows, cols, dtype=dtype, scale=2.0, offset=3.0)
    w, b = randn(cols, dtype=dtype), randn(cols, dtype=dtype)
    out = ops.layernorm(x, w, b, version=version, out=poisoned((rows, cols), dtype))
    assert_close(out, naive.layernorm(x, w, b))


@cuda_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("version", ops.versions("bias_gelu"))
def test_cuda_bias_gelu(kernels, version, rows, cols, dtype):
    x, b = randn(rows, cols, dtype=dtype, scale=2.0), randn(cols, dtype=dtype)
    out = ops.bias_gelu(x, b, version=version, out=poisoned((rows, cols), dtype))
    assert_close(out, naive.bias_gelu(x, b))


@cuda_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_vectorized_versions_fall_back_on_misaligned_rows(kernels, dtype):
    """softmax v4, layernorm v4, bias_gelu v2 and int8_gemv v3 read 16-byte packs only from 16-byte aligned memory;
    a view starting one element into its storage takes the scalar path, with the same results."""
    rows, cols = 5, 64
    x = randn(rows * cols + 1, dtype=dtype, scale=3.0)[1:].view(rows, cols)  # contiguous, misaligned
    assert x.data_ptr() % 16 != 0
    assert_close(ops.softmax(x, version=4, out=poisoned((rows, cols), dtype)), naive.softmax(x))
    b = randn(cols, dtype=dtype)
    assert_close(ops.bias_gelu(x, b, version=2, out=poisoned((rows, cols), dtype)), naive.bias_gelu(x, b))
    w = randn(cols, dtype=dtype)
    assert_close(ops.layernorm(x, w, b, version=4, out=poisoned((rows, cols), dtype)), naive.layernorm(x, w, b))
    wq = torch.randint(-127, 128, (7, cols), dtype=torch.int8, device="cuda")
    scale = (torch.rand(7, device="cuda") / 64).to(dtype)
    assert_close(ops.int8_gemv(x, wq, scale, version=3, out=poisoned((rows, 7), dtype)), naive.int8_gemv(x, wq, scale))


@cuda_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [*ATTN_SHAPES, (1, 1, 129, 32), (3, 2, 50, 96), (1, 3, 128, 64), (2, 2, 200, 128)],
                         ids=str)
@pytest.mark.parametrize("version", ops.versions("attention"))
def test_cuda_attention(kernels, version, shape, dtype):
    q, k, v = (randn(*shape, dtype=dtype) for _ in range(3))
    out = ops.attention(q, k, v, version=version, out=poisoned(shape, dtype))
    assert_close(out, naive.attention(q, k, v), roundings=ATTN_ROUNDINGS[version])


@cuda_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hs", [8, 24, 64, 100, 128])
@pytest.mark.parametrize("bs", [1, 4, 16])
@pytest.mark.parametrize("version", ops.versions("paged_attention_decode"))
def test_cuda_paged_attention_matches_chapter_05(kernels, version, bs, hs, dtype):
    cache, batch, q, k, v = paged_case(dtype, "cuda", hs=hs, bs=bs)
    ref = cache.attend(0, q, k, v)[0].transpose(0, 1)  # chapter 05's own decode path: (S, nh, hs)
    qs = q[0].transpose(0, 1).contiguous()  # (nh, S, hs) -> (S, nh, hs)
    args = (qs, cache.k_pools[0], cache.v_pools[0], batch.block_tables, batch.context_lens)
    out = ops.paged_attention_decode(*args, version=version, out=poisoned(qs.shape, dtype))
    assert_close(out, naive.paged_attention_decode(*args))
    # chapter 05's path does its arithmetic in the pool's dtype (bf16 scores, bf16 softmax), so it is only as close
    # as that dtype allows; a misread block table would be off by O(1), far outside these bounds.
    tol = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}[dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@cuda_only
@pytest.mark.parametrize("version", ops.versions("paged_attention_decode"))
def test_cuda_paged_attention_bad_block_is_nan(kernels, version):
    cache, batch, q, k, v = paged_case(torch.float32, "cuda")
    cache.attend(0, q, k, v)
    tables, lens = batch.block_tables.clone(), batch.context_lens.clone()
    tables[1, 0] = cache.num_blocks
    lens[2] = 0
    qs = q[0].transpose(0, 1).contiguous()
    y = ops.paged_attention_decode(qs, cache.k_pools[0], cache.v_pools[0], tables, lens, version=version).cpu()
    expected = mirror.paged_attention_decode(qs.cpu(), cache.k_pools[0].cpu(), cache.v_pools[0].cpu(), tables.cpu(),
                                             lens.cpu())
    assert torch.isnan(y[1]).all() and (y[2] == 0).all()
    torch.testing.assert_close(y, expected, equal_nan=True, rtol=1e-5, atol=1e-5)


@cuda_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (1, 33, 130), (3, 130, 31), (8, 7, 1000), (4, 257, 4096),
                                   (11, 37, 48), (10, 3, 40)])  # M > 8: v3's second pass, with packs and without
@pytest.mark.parametrize("version", ops.versions("int8_gemv"))
def test_cuda_int8_gemv(kernels, version, M, N, K, use_bias, dtype):
    x = randn(M, K, dtype=dtype)
    w = torch.randint(-127, 128, (N, K), dtype=torch.int8, device="cuda")
    scale = (torch.rand(N, device="cuda") / 64).to(dtype)
    bias = randn(N, dtype=dtype) if use_bias else None
    out = ops.int8_gemv(x, w, scale, bias, version=version, out=poisoned((M, N), dtype))
    assert_close(out, naive.int8_gemv(x, w, scale, bias))


@cuda_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T", [1, 7, 33])
def test_cuda_kv_cache_write_skips_minus_one(kernels, T, dtype):
    nb, bs, nh, hs = 12, 4, 3, 24
    g = torch.Generator().manual_seed(T)
    slots = torch.randperm(nb * bs, generator=g)[:T]
    slots[torch.rand(T, generator=g) < 0.3] = -1
    slot_mapping = slots.to("cuda")
    key, value = randn(T, nh, hs, dtype=dtype), randn(T, nh, hs, dtype=dtype)
    pools = [randn(nb, bs, nh, hs, dtype=dtype) for _ in range(2)]
    ref = [p.clone() for p in pools]
    naive.kv_cache_write(key, value, *ref, slot_mapping)
    ops.kv_cache_write(key, value, *pools, slot_mapping)
    assert torch.equal(pools[0], ref[0]) and torch.equal(pools[1], ref[1])  # a copy: bit for bit
    with pytest.raises(ValueError, match="slot_mapping must hold -1 or slots"):
        ops.kv_cache_write(key, value, *pools, torch.full((T,), nb * bs, dtype=torch.int64, device="cuda"))


@cuda_only
def test_cuda_op_refuses_cpu_tensors(kernels):
    """Only CUDA kernels are registered: the dispatcher itself refuses an all-CPU call."""
    x = torch.randn(4, 8)
    with pytest.raises((NotImplementedError, RuntimeError), match="CPU"):
        torch.ops.minillm_kernels.softmax(x, torch.empty_like(x), 1)


@cuda_only
@pytest.mark.xfail(strict=False, reason="known bug: on the H200 (torch 2.11+cu130) a non-contiguous CUDA tensor passed "
                   "straight to torch.ops.minillm_kernels.* crashed the process (SIGSEGV) instead of raising; "
                   "minillm.kernels.ops rejects it before the call. A subprocess keeps a crash inside this test")
def test_cuda_raw_op_rejects_non_contiguous_without_crashing(kernels):
    code = ("import torch\nfrom minillm.kernels import build\nlib = build.load_kernels()\n"
            "x = torch.randn(4, 8, device='cuda')\ntry:\n    lib.softmax(x.t(), torch.empty(8, 4, device='cuda'), 1)\n"
            "except RuntimeError as e:\n    print('RAISED', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                          cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0 and "x must be contiguous" in proc.stdout, (proc.returncode, proc.stderr[-2000:])


@cuda_only
def test_cuda_wrappers_reject_bad_tensors(kernels):
    lib = torch.ops.minillm_kernels
    x = torch.randn(4, 8, device="cuda")
    out = torch.empty_like(x)
    with pytest.raises(RuntimeError, match="x must be float32, float16 or bfloat16"):
        lib.softmax(x.double(), out.double(), 1)
    with pytest.raises(RuntimeError, match="out must be a CUDA tensor"):
        lib.softmax(x, out.cpu(), 1)  # a CUDA call with one CPU tensor reaches the wrapper's check
    with pytest.raises(RuntimeError, match="version must be 1..4, got 0"):
        lib.softmax(x, out, 0)
    with pytest.raises(RuntimeError, match="out must have the dtype of x"):
        lib.softmax(x, out.half(), 2)
    with pytest.raises(RuntimeError, match="weight must have shape"):
        lib.layernorm(x, torch.ones(7, device="cuda"), torch.zeros(8, device="cuda"), out, 1e-5, 1)
    with pytest.raises(RuntimeError, match="head size"):
        q = torch.randn(1, 1, 2, 130, device="cuda")
        lib.attention(q, q, q, torch.empty_like(q), 2)
    with pytest.raises(RuntimeError, match="w must be int8"):
        lib.int8_gemv(x, torch.zeros(3, 8, device="cuda"), torch.ones(3, device="cuda"), None,
                      torch.empty(4, 3, device="cuda"), 1)
    with pytest.raises(RuntimeError, match="slot_mapping must be int64"):
        kv = torch.zeros(2, 1, 8, device="cuda")
        pool = torch.zeros(3, 2, 1, 8, device="cuda")
        lib.kv_cache_write(kv, kv, pool, pool.clone(), torch.zeros(2, dtype=torch.int32, device="cuda"))
    with pytest.raises(ValueError, match="x must be contiguous"):
        ops.softmax(x.t())
    with pytest.raises(ValueError, match="x must be on a CUDA device"):
        ops.softmax(x.cpu())
    ok = lib.softmax(x, out, 3)  # and a good call still works after the errors
    assert ok is None and torch.allclose(out, F.softmax(x, dim=-1), atol=1e-6)
    assert math.isfinite(out.sum().item()) and sys.modules.get("torch") is torch

"""Chapter 10: pruning masks (hand-computed, against `torch.nn.utils.prune`, properties over random matrices), Wanda
calibrated block by block on pruned activations, 2:4 verified, structured pruning equal to the masked dense model,
pruned checkpoints, and pruned models in every generator and the engine. No test here measures time."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils.prune as torch_prune
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from helpers import assert_every_generator_agrees, context_model
from minillm import GPTConfig
from minillm.core.checkpoint import save_checkpoint
from minillm.course.results import find_values
from minillm.prune.bench import block_bytes, format_table, quotes, run_all, torch_prune_agreement
from minillm.prune.checkpoint import describe, load_pruned, save_pruned
from minillm.prune.masks import (
    is_nm_sparse,
    magnitude_mask,
    nm_mask,
    num_pruned,
    per_row_mask,
    sparsity_of,
    wanda_score,
)
from minillm.prune.semi_structured import SemiStructuredLinear, layer_speed, semi_structured_support, stored_bytes
from minillm.prune.structured import (
    head_scores,
    lowest_heads,
    mask_heads,
    mlp_neuron_scores,
    mlp_widths,
    prune_heads,
    prune_mlp,
    recover,
    shrink_mlp,
)
from minillm.prune.unstructured import block_linears, input_norms, prune_model, weight_sparsity
from minillm.quant.outliers import inject_outliers

ROOT = Path(__file__).resolve().parent.parent
RESULTS = "chapters/results/10-pruning.json"  # the benchmark run the chapter text quotes
SMALL = dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64)


def small_model(seed: int = 0):
    return context_model(GPTConfig(**SMALL), seed=seed)


def calibration(n: int = 4, T: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (n, T), generator=torch.Generator().manual_seed(seed))


def matrices(min_side: int = 1, max_side: int = 12, cols_multiple: int = 1):
    """Hypothesis: float32 matrices with distinct |values| (so every mask is unique), any shape in range."""
    @st.composite
    def draw(draw_one):
        rows = draw_one(st.integers(min_side, max_side))
        cols = cols_multiple * draw_one(st.integers(max(1, min_side // cols_multiple), max_side))
        seed = draw_one(st.integers(0, 2**31 - 1))
        g = torch.Generator().manual_seed(seed)
        mags = torch.randperm(rows * cols, generator=g).float() + 1.0  # distinct magnitudes 1..n
        signs = torch.randint(0, 2, (rows * cols,), generator=g) * 2 - 1
        return (mags * signs / (rows * cols)).view(rows, cols)
    return draw()


# ----- the masks (graded) -----------------------------------------------------------------------------------------


@pytest.mark.graded(points=2, exercise="magnitude_mask")
def test_magnitude_mask_worked_example():
    w = torch.tensor([[0.5, -0.1, 0.3], [-0.7, 0.2, -0.05]])
    original = w.clone()
    keep = magnitude_mask(w, 0.5)  # 3 of 6 go: |-0.05|, |-0.1|, |0.2| (smallest of the whole matrix)
    assert keep.dtype == torch.bool and keep.shape == w.shape
    assert keep.tolist() == [[True, False, True], [True, False, False]]
    assert magnitude_mask(w, 0.0).all() and magnitude_mask(w, 0.99).sum() == 0  # round(0.99 * 6) = 6
    assert torch.equal(w, original)  # the weight itself is never changed


@pytest.mark.graded(points=3, exercise="magnitude_mask")
@settings(max_examples=60, deadline=None)
@given(w=matrices(), sparsity=st.sampled_from([0.1, 0.25, 0.3, 0.5, 0.7, 0.9]))
def test_magnitude_mask_equals_torch_prune_l1_unstructured(w, sparsity):
    layer = nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        layer.weight.copy_(w)
    torch_prune.l1_unstructured(layer, "weight", amount=sparsity)
    assert torch.equal(magnitude_mask(w, sparsity), layer.weight_mask.bool())


@pytest.mark.graded(points=2, exercise="wanda_score")
def test_wanda_score_worked_example():
    w = torch.tensor([[1.0, -2.0, 0.5], [-0.25, 4.0, 3.0]])
    norms = torch.tensor([2.0, 0.5, 10.0])  # ‖X_j‖ of each input feature
    assert torch.equal(wanda_score(w, norms), torch.tensor([[2.0, 1.0, 5.0], [0.5, 2.0, 30.0]]))
    # per output row, half of each row goes: row 0 loses feature 1 (score 1.0), row 1 loses feature 0 (0.5)
    assert per_row_mask(wanda_score(w, norms), 0.34).tolist() == [[True, False, True], [False, True, True]]


@pytest.mark.graded(points=2, exercise="wanda_score")
@settings(max_examples=40, deadline=None)
@given(w=matrices(2, 10), exponent=st.integers(-3, 3), data=st.data())
def test_wanda_score_ignores_a_rescaling_that_keeps_the_function(w, exponent, data):
    """W[:, j] / f with X_j * f computes the same outputs: the score must not change (f a power of two: exact);
    the magnitude score does change, which is what the chapter's planted-outlier experiment shows."""
    j = data.draw(st.integers(0, w.shape[1] - 1))
    norms = torch.rand(w.shape[1], generator=torch.Generator().manual_seed(j)) + 0.1
    f = 2.0 ** exponent
    w2, n2 = w.clone(), norms.clone()
    w2[:, j] /= f
    n2[j] *= f
    assert torch.equal(wanda_score(w2, n2), wanda_score(w, norms))
    assert torch.equal(wanda_score(w, torch.ones_like(norms)), w.abs())  # uniform inputs: Wanda is magnitude


@pytest.mark.graded(points=2, exercise="nm_mask")
def test_nm_mask_worked_example():
    scores = torch.tensor([[0.1, 0.9, 0.3, 0.2, 5.0, 4.0, 0.0, 6.0]])
    assert nm_mask(scores, 2, 4).tolist() == [[False, True, True, False, True, False, False, True]]
    assert nm_mask(scores, 1, 2).tolist() == [[False, True, True, False, True, False, False, True]]
    assert nm_mask(scores, 4, 4).all()


@pytest.mark.graded(points=3, exercise="nm_mask")
@settings(max_examples=60, deadline=None)
@given(w=matrices(1, 8, cols_multiple=4), nm=st.sampled_from([(2, 4), (1, 4), (3, 4), (1, 2), (4, 8)]))
def test_nm_mask_keeps_the_n_largest_of_every_group_of_m(w, nm):
    n, m = nm
    if w.shape[1] % m:  # columns come in multiples of 4; the 8-wide groups need a multiple of 8
        w = torch.cat([w, -w.flip(1)], 1)
    scores = w.abs()
    keep = nm_mask(scores, n, m)
    rows, cols = w.shape
    groups, kept = scores.view(rows, cols // m, m), keep.view(rows, cols // m, m)
    assert (kept.sum(-1) == n).all()  # exactly n of every m, so the pattern holds
    lowest_kept = groups.masked_fill(~kept, float("inf")).min(-1).values
    highest_dropped = groups.masked_fill(kept, float("-inf")).max(-1).values
    assert (lowest_kept > highest_dropped).all()  # and they are the n largest
    assert is_nm_sparse(w * keep, n, m)


@pytest.mark.graded(points=1, exercise="nm_mask")
def test_nm_groups_run_along_the_input_dimension():
    """Groups are 4 consecutive *inputs* of one row (the dimension a matmul reduces), not 4 rows of a column."""
    scores = torch.arange(32.0).view(4, 8)  # every row increasing: each group keeps its last two columns
    keep = nm_mask(scores, 2, 4)
    assert keep[:, [2, 3, 6, 7]].all() and not keep[:, [0, 1, 4, 5]].any()


def test_masks_reject_bad_input():
    w = torch.randn(4, 8)
    for bad in (-0.1, 1.0, 1.5, True, "half", float("nan")):
        with pytest.raises(ValueError, match="sparsity"):
            magnitude_mask(w, bad)
    with pytest.raises(TypeError, match="floating-point"):
        magnitude_mask(torch.ones(4, 8, dtype=torch.int64), 0.5)
    with pytest.raises(ValueError, match="matrix"):
        magnitude_mask(torch.randn(8), 0.5)
    with pytest.raises(ValueError, match="NaN"):
        wanda_score(torch.tensor([[float("nan"), 1.0]]), torch.ones(2))
    with pytest.raises(ValueError, match=r"input_norm must have shape \(8,\)"):
        wanda_score(w, torch.ones(4))
    with pytest.raises(ValueError, match="negative"):
        wanda_score(w, -torch.ones(8))
    with pytest.raises(ValueError, match="multiple of 4"):
        nm_mask(torch.randn(4, 6))
    with pytest.raises(ValueError, match="0 < n <= m"):
        nm_mask(w, 5, 4)
    assert num_pruned(10, 0.25) == round(2.5) and sparsity_of(torch.tensor([0.0, 1.0, 0.0, 2.0])) == 0.5


# ----- pruning a model --------------------------------------------------------------------------------------------


def test_input_norms_are_the_norms_of_each_linears_real_input():
    model = small_model()
    block = model.transformer.h[0]
    x = torch.randn(3, 10, SMALL["n_embd"])
    got = input_norms(block, x)
    with torch.no_grad():
        a = block.ln_1(x)
        y = x + block.attn(a)
        b = block.ln_2(y)
        h = F.gelu(block.mlp.c_fc(b), approximate="tanh")
        c_proj_in = []
        handle = block.attn.c_proj.register_forward_pre_hook(lambda _m, inp: c_proj_in.append(inp[0]))
        block.attn(a)
        handle.remove()
    for name, t in (("attn.c_attn", a), ("attn.c_proj", c_proj_in[0]), ("mlp.c_fc", b), ("mlp.c_proj", h)):
        torch.testing.assert_close(got[name], t.reshape(-1, t.shape[-1]).norm(dim=0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ["magnitude", "wanda"])
@pytest.mark.parametrize("sparsity", [0.25, 0.5, 0.7])
def test_prune_model_removes_exactly_the_share_asked_and_leaves_the_original(method, sparsity):
    model = small_model()
    before = copy.deepcopy(model.state_dict())
    pruned = prune_model(model, method, sparsity, calibration())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    for block in pruned.transformer.h:
        for _, lin in block_linears(block):
            w = lin.weight
            if method == "magnitude":  # one comparison group per matrix
                assert int((w == 0).sum()) == round(sparsity * w.numel())
            else:  # per output row
                assert ((w == 0).sum(1) == round(sparsity * w.shape[1])).all()
    # the embedding, head, LayerNorms and biases are untouched
    for name, p in pruned.named_parameters():
        if not (name.endswith(".weight") and any(k in name for k in ("c_attn", "c_proj", "c_fc"))):
            assert torch.equal(p, model.get_parameter(name)), name
    assert weight_sparsity(pruned)["blocks"] == pytest.approx(sparsity, abs=0.01)


def test_wanda_calibrates_each_block_on_the_pruned_blocks_before_it():
    """Block b's masks come from activations through blocks 0..b-1 *as pruned*: recompute them by hand."""
    model, cal = small_model(), calibration()
    pruned = prune_model(model, "wanda", 0.5, cal)
    with torch.no_grad():
        x = pruned.transformer.wte(cal) + pruned.transformer.wpe(torch.arange(cal.size(1)))
        dense_x = x.clone()
        for dense_block, block in zip(model.transformer.h, pruned.transformer.h):
            norms = input_norms(dense_block, x)  # the dense weights on the pruned model's activations
            for name, lin in block_linears(dense_block):
                keep = per_row_mask(wanda_score(lin.weight, norms[name]), 0.5)
                assert torch.equal(block.get_submodule(name).weight, lin.weight * keep), name
            x, dense_x = block(x), dense_block(dense_x)
    assert not torch.equal(x, dense_x)  # the two streams differ, so the test can tell them apart


def test_wanda_masks_do_not_move_under_planted_outliers_but_magnitude_masks_do():
    """`inject_outliers` rescales LayerNorm outputs by f and the next weights' columns by 1/f (same function; f a
    power of two keeps it exact): Wanda prunes the same weights, magnitude prunes others."""
    model, cal = small_model(), calibration()
    planted = inject_outliers(model, [3, 17, 40], 8.0)

    def zeros(m):
        return [lin.weight == 0 for b in m.transformer.h for _, lin in block_linears(b)]

    w_a, w_b = zeros(prune_model(model, "wanda", 0.5, cal)), zeros(prune_model(planted, "wanda", 0.5, cal))
    assert all(torch.equal(a, b) for a, b in zip(w_a, w_b))
    m_a, m_b = zeros(prune_model(model, "magnitude", 0.5)), zeros(prune_model(planted, "magnitude", 0.5))
    assert not all(torch.equal(a, b) for a, b in zip(m_a, m_b))


@pytest.mark.parametrize("method", ["magnitude", "wanda"])
def test_two_four_pruning_keeps_two_of_every_four(method):
    pruned = prune_model(small_model(), method, calibration=calibration(), pattern="2:4")
    for block in pruned.transformer.h:
        for _, lin in block_linears(block):
            assert is_nm_sparse(lin.weight, 2, 4)
            assert int((lin.weight == 0).sum()) == lin.weight.numel() // 2  # no weight was exactly 0 before
    assert not is_nm_sparse(small_model().transformer.h[0].mlp.c_fc.weight, 2, 4)


def test_prune_model_rejects_bad_input():
    model = small_model()
    with pytest.raises(TypeError, match="GPT"):
        prune_model(nn.Linear(2, 2), "magnitude", 0.5)
    with pytest.raises(ValueError, match="method"):
        prune_model(model, "random", 0.5)
    with pytest.raises(ValueError, match="pattern"):
        prune_model(model, "magnitude", 0.5, pattern="1:3")
    with pytest.raises(ValueError, match="sparsity"):
        prune_model(model, "magnitude", 1.0)
    with pytest.raises(TypeError, match="calibration"):
        prune_model(model, "wanda", 0.5)
    with pytest.raises(ValueError, match="block_size"):
        prune_model(model, "wanda", 0.5, calibration(T=SMALL["block_size"] + 1))


@pytest.mark.parametrize("kind", ["wanda", "2:4", "structured"])
def test_pruned_model_gives_the_same_tokens_in_every_generator_and_the_engine(kind):
    model, cal = small_model(), calibration()
    if kind == "structured":
        pruned = prune_mlp(model, 0.25, mlp_neuron_scores(model, cal))
    else:
        pruned = prune_model(model, "wanda", 0.5, cal, pattern="2:4" if kind == "2:4" else "unstructured")
    assert_every_generator_agrees(pruned)


# ----- structured pruning -----------------------------------------------------------------------------------------


def test_mlp_neuron_scores_by_hand():
    model, cal = small_model(), calibration()
    scores = mlp_neuron_scores(model, cal)
    with torch.no_grad():
        x = model.transformer.wte(cal) + model.transformer.wpe(torch.arange(cal.size(1)))
        for block, s in zip(model.transformer.h, scores):
            y = x + block.attn(block.ln_1(x))
            h = F.gelu(block.mlp.c_fc(block.ln_2(y)), approximate="tanh").reshape(-1, 4 * SMALL["n_embd"])
            want = h.norm(dim=0) * block.mlp.c_proj.weight.norm(dim=0)
            torch.testing.assert_close(s, want, rtol=1e-5, atol=1e-6)
            x = block(x)


@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_prune_mlp_equals_the_dense_model_with_those_neurons_silenced(fraction):
    model, cal = small_model(), calibration()
    scores = mlp_neuron_scores(model, cal)
    pruned = prune_mlp(model, fraction, scores)
    hidden = 4 * SMALL["n_embd"]
    k = hidden - round(fraction * hidden)
    assert mlp_widths(pruned) == [k] * SMALL["n_layer"] and mlp_widths(model) == [hidden] * SMALL["n_layer"]
    for block in pruned.transformer.h:
        assert block.mlp.c_fc.weight.shape == (k, SMALL["n_embd"])
        assert block.mlp.c_proj.weight.shape == (SMALL["n_embd"], k)
    silenced = copy.deepcopy(model)
    for block, s in zip(silenced.transformer.h, scores):
        drop = torch.topk(s, hidden - k, largest=False).indices
        with torch.no_grad():
            block.mlp.c_proj.weight[:, drop] = 0.0  # the neuron still computes, but adds nothing
    idx = cal[:2]
    with torch.no_grad():
        torch.testing.assert_close(pruned(idx), silenced(idx), rtol=1e-4, atol=1e-4)
    assert pruned.num_params() == model.num_params() - SMALL["n_layer"] * (hidden - k) * (2 * SMALL["n_embd"] + 1)
    assert block_bytes(pruned, "dense") < block_bytes(model, "dense")


def test_shrink_mlp_keeping_everything_is_the_model_and_bad_indices_are_refused():
    model = small_model()
    full = [torch.arange(4 * SMALL["n_embd"])] * SMALL["n_layer"]
    idx = calibration()[:2]
    with torch.no_grad():
        assert torch.equal(shrink_mlp(model, full)(idx), model(idx))
    with pytest.raises(ValueError, match="one index tensor per block"):
        shrink_mlp(model, full[:1])
    with pytest.raises(ValueError, match="distinct neurons"):
        shrink_mlp(model, [torch.tensor([0, 0, 1])] * SMALL["n_layer"])
    with pytest.raises(ValueError, match="distinct neurons"):
        shrink_mlp(model, [torch.tensor([4 * SMALL["n_embd"]])] * SMALL["n_layer"])
    with pytest.raises(ValueError, match="scores"):
        prune_mlp(model, 0.25, [torch.ones(3)] * SMALL["n_layer"])


def test_recovery_fine_tune_moves_the_pruned_model_towards_the_dense_one():
    model = context_model(GPTConfig(vocab_size=4096, block_size=32, n_layer=2, n_head=2, n_embd=32), seed=1)
    cal = torch.randint(0, 4096, (4, 32), generator=torch.Generator().manual_seed(0))
    pruned = prune_mlp(model, 0.5, mlp_neuron_scores(model, cal))
    recovered, losses = recover(pruned, model, steps=30, lr=3e-3)
    assert len(losses) == 30 and sum(losses[-5:]) < sum(losses[:5])
    assert mlp_widths(recovered) == mlp_widths(pruned) and not recovered.training
    assert not torch.equal(recovered.transformer.h[0].mlp.c_fc.weight, pruned.transformer.h[0].mlp.c_fc.weight)


def test_head_scores_by_hand_and_masking_all_heads_leaves_only_the_bias():
    model, cal = small_model(), calibration()
    scores = head_scores(model, cal)
    nh, hs = SMALL["n_head"], SMALL["n_embd"] // SMALL["n_head"]
    assert scores.shape == (SMALL["n_layer"], nh)
    block = model.transformer.h[0]
    seen = []
    handle = block.attn.c_proj.register_forward_pre_hook(lambda _m, inp: seen.append(inp[0]))
    with torch.no_grad():
        block(model.transformer.wte(cal) + model.transformer.wpe(torch.arange(cal.size(1))))
    handle.remove()
    y = seen[0].reshape(-1, SMALL["n_embd"])
    for h in range(nh):
        cols = slice(h * hs, (h + 1) * hs)
        want = (y[:, cols] @ block.attn.c_proj.weight[:, cols].T).norm()
        torch.testing.assert_close(scores[0, h], want, rtol=1e-4, atol=1e-5)
    masked = mask_heads(model, {0: list(range(nh))})
    x = torch.randn(2, 5, SMALL["n_embd"])
    with torch.no_grad():
        out = masked.transformer.h[0].attn(x)
    torch.testing.assert_close(out, block.attn.c_proj.bias.expand_as(out))
    assert lowest_heads(scores, 1) == {b: [int(scores[b].argmin())] for b in range(SMALL["n_layer"])}
    with pytest.raises(ValueError, match="head index"):
        mask_heads(model, {0: [nh]})


@pytest.mark.parametrize("kind", ["mlp", "heads"])
def test_a_pruned_model_runs_disaggregated_with_its_own_tokens(kind):
    """Chapter 07's workers receive the model as bytes and rebuild it by its format: narrowed MLPs arrive narrowed
    (the "minillm-pruned" format stores each block's width), removed heads arrive removed (the config says n_head
    and head_dim), so prefill and decode in two processes give the colocated tokens."""
    model, cal = small_model(), calibration()
    if kind == "mlp":
        pruned = prune_mlp(model, 0.25, mlp_neuron_scores(model, cal))
    else:
        pruned = prune_heads(model, lowest_heads(head_scores(model, cal), 1))
    assert_every_generator_agrees(pruned, disaggregated=True)


@pytest.mark.parametrize("per_block", [1, 3])
def test_prune_heads_removes_them_for_real_and_equals_masking(per_block):
    model, cal = small_model(), calibration()
    heads = lowest_heads(head_scores(model, cal), per_block)
    pruned, masked = prune_heads(model, heads), mask_heads(model, heads)
    nh, hs, C = SMALL["n_head"], SMALL["n_embd"] // SMALL["n_head"], SMALL["n_embd"]
    kept = nh - per_block
    assert pruned.config.n_head == kept and pruned.config.head_size == hs and model.config.n_head == nh
    for block in pruned.transformer.h:
        assert block.attn.c_attn.weight.shape == (3 * kept * hs, C) and block.attn.c_proj.weight.shape == (C, kept * hs)
    idx = cal[:2]
    with torch.no_grad():
        torch.testing.assert_close(pruned(idx), masked(idx), rtol=1e-5, atol=1e-5)
    assert_every_generator_agrees(pruned)  # every cache is laid out for the new head count
    from minillm.kvcache.cache import ContiguousKVCache
    assert ContiguousKVCache(pruned.config, 1, 8).nbytes * nh == ContiguousKVCache(model.config, 1, 8).nbytes * kept


def test_prune_heads_refuses_uneven_or_empty_removals():
    model = small_model()
    with pytest.raises(ValueError, match="same number"):
        prune_heads(model, {0: [1], 1: [1, 2]})
    with pytest.raises(ValueError, match="every block"):
        prune_heads(model, {0: [1]})
    with pytest.raises(ValueError, match="keep at least one"):
        prune_heads(model, {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]})
    with pytest.raises(ValueError, match="GPT-2 has"):
        from minillm.core.hf import to_hf_config
        to_hf_config(prune_heads(model, {0: [0], 1: [0]}).config)


# ----- bytes and the 2:4 kernel -----------------------------------------------------------------------------------


def test_stored_bytes_by_hand():
    w = torch.tensor([[1.0, 0.0, 0.0, 2.0, 0.0, 3.0, 4.0, 0.0]])  # 4 nonzeros of 8, 2:4
    assert stored_bytes(w, "dense") == 32
    assert stored_bytes(w, "bitmask") == 4 * 4 + 1
    assert stored_bytes(w, "csr") == 4 * (4 + 4) + 2 * 4
    assert stored_bytes(w, "2:4") == 4 * 4 + 1  # 4 values + 4 x 2 bits
    big = torch.randn(64, 64)
    big = big * nm_mask(big.abs())
    assert stored_bytes(big, "2:4", element_bytes=2) / stored_bytes(big, "dense", element_bytes=2) == 9 / 16
    with pytest.raises(ValueError, match="2:4 format"):
        stored_bytes(torch.ones(1, 8), "2:4")
    with pytest.raises(ValueError, match="format"):
        stored_bytes(w, "coo")


def test_semi_structured_says_why_not_here():
    why = semi_structured_support()
    if why is None:
        pytest.skip("this machine has 2:4 sparse kernels (see the CUDA test)")
    assert "CUDA" in why or "capability" in why or "torch" in why
    with pytest.raises(RuntimeError):
        SemiStructuredLinear(nn.Linear(8, 8))


@pytest.mark.skipif(semi_structured_support() is not None, reason="needs a CUDA GPU of compute capability 8.0+")
def test_semi_structured_linear_equals_the_dense_pruned_layer_on_cuda():
    rows = layer_speed(256, 512, tokens=(1, 64), calls=2, repeats=3)
    for r in rows:
        assert r["max_abs_err"] <= 2e-2 * max(1.0, r["max_abs_ref"])
    with pytest.raises(ValueError, match="not 2:4"):
        SemiStructuredLinear(nn.Linear(64, 64, device="cuda", dtype=torch.float16))


# ----- checkpoints ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["unstructured", "2:4", "structured", "heads"])
def test_pruned_checkpoint_round_trip(tmp_path, kind):
    model, cal = small_model(), calibration()
    if kind == "structured":
        pruned, pattern = prune_mlp(model, 0.25, mlp_neuron_scores(model, cal)), "dense"
    elif kind == "heads":
        pruned = prune_heads(prune_mlp(model, 0.5, mlp_neuron_scores(model, cal)), {0: [1], 1: [3]})
        pattern = "dense"
    else:
        pruned, pattern = prune_model(model, "wanda", 0.5, cal, pattern=kind), kind
    path = save_pruned(pruned, tmp_path / "p.safetensors", method=f"wanda {kind}", pattern=pattern)
    loaded = load_pruned(path)
    assert mlp_widths(loaded) == mlp_widths(pruned) and loaded.config == pruned.config
    for (k, a), (k2, b) in zip(pruned.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    d = describe(path)
    assert d["pattern"] == pattern and d["mlp_hidden"] == mlp_widths(pruned) and d["method"] == f"wanda {kind}"
    assert list(tmp_path.iterdir()) == [path]  # atomic: no temporary file left


def _rewrite(src, dst, metadata=None, drop=(), change=None):
    with safe_open(str(src), framework="pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys() if k not in drop}
    meta.update(metadata or {})
    if change:
        tensors.update(change)
    save_file(tensors, str(dst), metadata={k: v for k, v in meta.items() if v is not None})
    return dst


def test_loading_refuses_missing_or_inconsistent_metadata(tmp_path):
    model, cal = small_model(), calibration()
    pruned = prune_mlp(prune_model(model, "magnitude", 0.5), 0.25, mlp_neuron_scores(model, cal))
    good = save_pruned(pruned, tmp_path / "good.safetensors", "magnitude 50% + mlp 25%")
    with pytest.raises(ValueError, match="no minillm-pruned metadata"):
        load_pruned(_rewrite(good, tmp_path / "a.safetensors", {"format": None}))
    with pytest.raises(ValueError, match="'mlp_hidden' is missing"):
        load_pruned(_rewrite(good, tmp_path / "b.safetensors", {"mlp_hidden": None}))
    with pytest.raises(ValueError, match="mlp_hidden must list"):
        load_pruned(_rewrite(good, tmp_path / "c.safetensors", {"mlp_hidden": "[768]"}))
    with pytest.raises(ValueError, match="size mismatch|shape"):
        load_pruned(_rewrite(good, tmp_path / "d.safetensors", {"mlp_hidden": "[256, 256]"}))
    with pytest.raises(ValueError, match="block sparsity"):
        load_pruned(_rewrite(good, tmp_path / "e.safetensors", {"block_sparsity": "0.7000"}))
    with pytest.raises(ValueError, match="2:4"):
        load_pruned(_rewrite(good, tmp_path / "f.safetensors", {"pattern": "2:4"}))
    with pytest.raises(ValueError, match="missing"):
        load_pruned(_rewrite(good, tmp_path / "g.safetensors", drop=("transformer.h.0.mlp.c_fc.bias",)))
    dense = save_checkpoint(model, tmp_path / "dense")
    with pytest.raises(ValueError, match="no minillm-pruned metadata"):
        load_pruned(next(p for p in dense.iterdir() if p.suffix == ".safetensors"))
    torn = tmp_path / "torn.safetensors"
    torn.write_bytes(good.read_bytes()[:100])
    with pytest.raises(ValueError, match="not a valid safetensors"):
        load_pruned(torn)
    with pytest.raises(FileNotFoundError):
        load_pruned(tmp_path / "nope.safetensors")
    with pytest.raises(ValueError, match="pattern '2:4'"):
        save_pruned(pruned, tmp_path / "x.safetensors", "m", pattern="2:4")
    with pytest.raises(TypeError, match="GPT"):
        save_pruned(nn.Linear(2, 2), tmp_path / "y.safetensors", "m")


# ----- the benchmark's helpers ------------------------------------------------------------------------------------


def test_torch_prune_agreement_and_the_benchmark_on_a_small_model():
    # block_size 64: the quick sizes' prompts (32 tokens) and their 32 greedy tokens fit the window uncut
    model = context_model(GPTConfig(vocab_size=4096, block_size=64, n_layer=2, n_head=2, n_embd=32), seed=0)
    assert torch_prune_agreement(model) == {"same": 8, "layers": 8}
    with pytest.raises(ValueError, match="size must be one of"):
        run_all(model, real_text=True, size="tiny")
    report = run_all(model, real_text=True, size="quick")
    assert report["size"] == "quick" and report["prompts"] == 4
    fifty = {r["method"]: r for r in report["unstructured"]}
    assert set(fifty) == {"magnitude", "wanda"} and all(r["block_sparsity"] == 0.5 for r in fifty.values())
    for r in [*fifty.values(), *report["two_four"], *report["structured"]]:
        assert r["engine_same_as_generate"] == report["prompts"]
        assert 0 <= r["agreement"] <= 1 and r["speedup"] > 0
        assert 0 <= r["kl_mean"] <= r["kl_max"] and 0 <= r["mean_common_prefix"] <= report["new_tokens"]
    assert all(r["pattern_ok"] for r in report["two_four"])
    s = report["structured"][0]
    assert s["mlp_hidden"] == [96, 96] and s["params"] < s["dense_params"]
    assert report["planted_outliers"]["wanda"] == pytest.approx(report["base_side"]["wanda"], rel=1e-4)
    assert {r["sparsity"] for r in report["layer_costs"]} == {0.5, 0.7, 0.9}
    # what the chapter text quotes, from a quick report as from the full one (no head study at this size)
    pieces = quotes({**report, "cpu": "a test CPU"})
    for table in ("unstructured", "fifty", "side", "structured", "layer_costs"):
        assert pieces[table].startswith("| ") and pieces[table].endswith("|\n")
    assert pieces["magnitude_50_delta"] == f"{fifty['magnitude']['ppl_delta_pct']:+.2f}%"
    assert pieces["engine_fewest"] == f"{report['prompts']}/{report['prompts']}" and "heads_masked" not in pieces
    assert {"mlp_25_speedup", "two_four_wanda_kl_mean", "csr_90_m256", "planted_outliers_wanda"} <= set(pieces)
    assert pieces["fifty"] in format_table(report)


def test_every_number_the_chapter_quotes_from_its_results_file_is_there():
    text = (ROOT / "chapters" / "10-pruning.md").read_text(encoding="utf-8")
    names = set(re.findall(rf"<!-- include: {RESULTS}::(\w+) -->", text))
    names |= {name for _, source, name, _ in find_values(text, "10-pruning.md") if source == RESULTS}
    assert {"unstructured", "fifty", "structured", "magnitude_50_delta"} <= names
    report = json.loads((ROOT / RESULTS).read_text(encoding="utf-8"))
    assert report["bench"] == "minillm.prune.bench" and report["size"] == "full"
    assert sorted(names - set(quotes(report))) == []

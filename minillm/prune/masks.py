"""Pruning masks as pure functions: which weights of a matrix to keep, given a score for each.

What it adds: the three rules of chapter 10, each a boolean mask shaped like the weight (True = keep):

    magnitude   keep the largest |W| of the whole matrix                       (Han et al. 2015)
    Wanda       score S_ij = |W_ij| · ‖X_j‖₂, keep the largest S in each output row   (Sun et al. 2024)
    N:M         in every group of M consecutive weights of a row, keep the N largest scores (2:4 on Ampere GPUs)

A weight W (out, in) multiplies inputs x (in,): row i makes output i, column j reads input feature j. ‖X_j‖₂ is the
L2 norm of input feature j over every calibration token, so Wanda's score is how much weight j of row i moves its
output on real inputs: a small weight on a feature that is always large matters more than a large weight on a
feature that is almost always zero. Magnitude pruning sees only |W|.

The masks are exact and deterministic: for a sparsity s, a matrix (or row) of n weights loses round(s · n) of them,
the smallest scores first (ties broken by `torch.topk`, the same rule `torch.nn.utils.prune` uses, so the magnitude
mask equals `prune.l1_unstructured`'s), so a sparsity so close to 1 that round(s · n) = n (99.9% of a 512-weight
row) empties the group, as torch's does. The whole-model functions (`prune_model`, `prune_mlp`) refuse such a
sparsity with a ValueError naming it and the layer, rather than silence a whole layer or output row. What it
leaves out: applying the masks to a model (`minillm.prune.unstructured`), updating the kept weights to compensate
(SparseGPT), and gradual pruning during training.
"""

from __future__ import annotations

import torch

from minillm.core.config import (check_fits_float, check_has_data, check_int, check_sequence, foreign_number,
                                 plain_number, short_repr, tensor_kind)


def _check_weight(name: str, w: object) -> torch.Tensor:
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {tensor_kind(w)}")
    check_has_data(name, w)  # its values are read just below
    if w.dim() != 2:
        raise ValueError(f"{name} must be a matrix (out, in), got shape {tuple(w.shape)}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{name} holds NaN or infinite values")
    return w


def check_sparsity(sparsity: object, name: str = "sparsity") -> float:
    """A fraction in [0, 1): the share of weights to remove. Anything else is a ValueError naming it (`name`)."""
    check_fits_float(name, sparsity)  # an int float() cannot take (10**400): else an OverflowError naming nothing
    sparsity = plain_number(sparsity)  # a float subclass's own comparisons and __float__ are not consulted
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0.0 <= float(sparsity) < 1.0:
        kind = " as a Python float" if foreign_number(sparsity) else ""  # a numpy float32: say what is wrong
        raise ValueError(f"{name} must be a fraction in [0, 1){kind}, got {short_repr(sparsity)}"
                         + (": convert it with float()" if kind else ""))
    return float(sparsity)


def check_sparsities(values: object, name: str = "sparsities") -> tuple[float, ...]:
    """A non-empty list or tuple of `check_sparsity` fractions; a TypeError / ValueError naming `name` or `name[i]`."""
    return tuple(check_sparsity(s, f"{name}[{i}]") for i, s in enumerate(check_sequence(name, values)))


def num_pruned(n: int, sparsity: float) -> int:
    """How many of n weights a sparsity removes: round(s · n), as `torch.nn.utils.prune` counts (all n when s is
    close enough to 1: `check_keeps_one` is the model-level guard)."""
    n = check_int("n", n, 0)  # the plain int, within the float range it is multiplied with
    return round(check_sparsity(sparsity) * n)


def check_keeps_one(n: int, sparsity: float, what: str, name: str = "sparsity") -> None:
    """ValueError naming `name` when pruning `sparsity` of a group of n weights would remove all of them.

    A matrix (magnitude) or output row (Wanda) pruned to nothing silences that layer or output entirely: the model
    still runs and its numbers look plausible, which is worse than an error."""
    n = check_int("n", n, 0)  # a count: None or 0.0 must not read as "nothing to prune"
    sparsity = check_sparsity(sparsity, name)
    if n and num_pruned(n, sparsity) >= n:
        raise ValueError(f"{name}={sparsity} would remove all {n} weights of {what} (round({sparsity} · {n}) = {n}); "
                         f"use {name} <= {(n - 0.5) / n - 1e-9:.6f} so each keeps at least one")


def lowest_k_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Keep-mask (shaped like scores (..., n)) that drops the k smallest scores of each last-dimension row."""
    if not isinstance(scores, torch.Tensor) or not scores.is_floating_point() or scores.dim() == 0:
        raise TypeError(f"scores must be a floating-point tensor (..., n), got "
                        f"{tensor_kind(scores)}")
    check_has_data("scores", scores)
    k = plain_number(k)  # an int subclass's own comparisons are not consulted
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= scores.shape[-1]:
        raise ValueError(f"k must be an int in [0, {scores.shape[-1]}] (scores per row), got {short_repr(k)}")
    if k and bool(torch.isnan(scores).any()):
        raise ValueError("scores hold NaN values, which have no order")
    keep = torch.ones_like(scores, dtype=torch.bool)
    if k > 0:
        keep.scatter_(-1, torch.topk(scores, k, dim=-1, largest=False).indices, False)
    return keep


def magnitude_mask(weight: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Keep-mask (out, in) removing the round(s · numel) smallest |W| of the whole matrix."""
    _check_weight("weight", weight)
    k = num_pruned(weight.numel(), sparsity)
    # BEGIN SOLUTION
    flat = lowest_k_mask(weight.detach().abs().flatten(), k)  # (out * in,): one pool for the whole matrix
    return flat.view_as(weight)
    # END SOLUTION


def wanda_score(weight: torch.Tensor, input_norm: torch.Tensor) -> torch.Tensor:
    """S (out, in) with S_ij = |W_ij| · ‖X_j‖₂, from the weight (out, in) and the input features' norms (in,)."""
    _check_weight("weight", weight)
    if not isinstance(input_norm, torch.Tensor) or check_has_data("input_norm", input_norm).shape != (weight.shape[1],):
        raise ValueError(f"input_norm must have shape ({weight.shape[1]},) (one norm per input feature), got "
                         f"{tuple(getattr(input_norm, 'shape', ()))}")
    if not input_norm.is_floating_point():
        raise TypeError(f"input_norm must be a floating-point tensor, got {input_norm.dtype}")
    check_has_data("input_norm", input_norm)
    if bool((input_norm < 0).any()) or not bool(torch.isfinite(input_norm).all()):
        raise ValueError("input_norm holds negative or non-finite values: it must be L2 norms")
    # BEGIN SOLUTION
    return weight.detach().abs() * input_norm.to(weight.dtype)[None, :]  # column j scaled by feature j's norm
    # END SOLUTION


def per_row_mask(scores: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Keep-mask (out, in) removing the round(s · in) smallest scores of every output row (Wanda's comparison group)."""
    _check_weight("scores", scores)
    check_keeps_one(scores.shape[1], sparsity, "each row of scores")  # an emptied row silences that output
    return lowest_k_mask(scores.detach(), num_pruned(scores.shape[1], sparsity))


def _check_nm(n: object, m: object) -> tuple[int, int]:
    """(n, m) as plain Python ints with 0 < n <= m (`check_int`: a TypeError naming n or m, saying to convert a
    numpy int)."""
    n, m = check_int("n", n), check_int("m", m)
    if not 0 < n <= m:
        raise ValueError(f"N:M needs integers 0 < n <= m, got n={n}, m={m}")
    return n, m


def nm_mask(scores: torch.Tensor, n: int = 2, m: int = 4) -> torch.Tensor:
    """Keep-mask (out, in) keeping the n largest scores of every group of m consecutive weights in a row.

    The groups run along the input dimension (the one a matmul reduces over), as sparse tensor cores expect:
    columns 0..m-1 of a row are one group, m..2m-1 the next. `in` must be a multiple of m.
    """
    _check_weight("scores", scores)
    n, m = _check_nm(n, m)
    out, cols = scores.shape
    if cols % m:
        raise ValueError(f"N:M sparsity groups {m} consecutive inputs: scores {tuple(scores.shape)} has {cols} "
                         f"columns (in_features), not a multiple of {m}")
    # BEGIN SOLUTION
    groups = scores.detach().reshape(out, cols // m, m)  # (out, groups, m): one row of m per group
    keep = lowest_k_mask(groups, m - n)  # drop the m - n smallest of each group
    return keep.reshape(out, cols)
    # END SOLUTION


def is_nm_sparse(weight: torch.Tensor, n: int = 2, m: int = 4) -> bool:
    """True when every group of m consecutive weights of every row holds at most n nonzeros.

    A row whose length is not a multiple of m cannot be cut into such groups (as `nm_mask` refuses to build one):
    a ValueError naming weight, not a False that would read as "too many nonzeros"."""
    _check_weight("weight", weight)
    n, m = _check_nm(n, m)
    out, cols = weight.shape
    if cols % m:
        raise ValueError(f"N:M sparsity groups {m} consecutive inputs: weight has {cols} columns, not a multiple of "
                         f"{m}")
    return bool(((weight.reshape(out, cols // m, m) != 0).sum(-1) <= n).all())


def sparsity_of(weight: torch.Tensor) -> float:
    """The share of exact zeros in a tensor."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a tensor, got {tensor_kind(weight)}")
    check_has_data("weight", weight)
    if weight.numel() == 0:
        raise ValueError(f"weight is empty (shape {tuple(weight.shape)}): it has no share of zeros")
    return float((weight == 0).sum()) / weight.numel()

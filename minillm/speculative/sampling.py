"""Speculative sampling's acceptance rule: keep a prefix of the draft's tokens, then one token from the target.

What it adds: the rule of Leviathan et al. 2023 (Algorithm 1) and Chen et al. 2023 (Algorithm 2) as small pure
functions. Given the target's distributions p (γ+1, V) at the γ+1 positions a verify step scores, the draft's
distributions q (γ, V) and the γ tokens the draft drew from them:

    for i in 0..γ-1:  u ~ U[0, 1);  accept draft token x_i if u < p_i(x_i) / q_i(x_i)
                      else emit one token from norm(max(0, p_i - q_i)) and stop          (the residual)
    all γ accepted:   emit a bonus token from p_γ

Every emitted token is then distributed exactly as if it had been sampled from the target alone (Leviathan et al.
Theorem 1): P(x) = q(x) min(1, p(x)/q(x)) + (1 - Σ_y min(p(y), q(y))) · max(0, p(x) - q(x)) / Σ_y max(0, p(y) - q(y))
              = min(p(x), q(x)) + max(0, p(x) - q(x)) = p(x).
The naive twin is `sample_from_target`: one draw from p_0. In greedy mode (temperature 0) `accept_greedy` keeps
draft tokens while they equal the target's argmax and then emits the target's argmax, so the output is the target's
own greedy output. Inputs are checked before any arithmetic: p and q must be distributions (every row finite, >= 0
and summing to 1 within `prob_sum_tolerance`), so an unnormalised or NaN row is a ValueError naming it rather than a
biased draw; `acceptance_probability` is 1 where q(x) = 0 (the paper's "q(x) <= p(x): keep"). What it leaves out:
batches (one sequence at a time), and the draft/verify loop around it (`minillm.speculative.generate`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from minillm.core.config import (check_device, check_has_data, check_int, is_float_compute, MAX_TENSOR_ELEMENTS,
                                 short_repr, tensor_kind)
from minillm.core.sampling import SamplingParams, sample_next
from minillm.core.stopping import check_token_ids


def prob_sum_tolerance(dtype: torch.dtype) -> float:
    """How far from 1 a row of probabilities may sum: 1e-3, or 4 ulps of a coarser dtype (float16, bfloat16).

    Rows are summed in float64, so only the rounding of each stored probability counts (at most half an ulp of it,
    half an ulp of 1 in all); the slack covers softmax's own normalisation error and probabilities a caller rounded.
    `dtype` must be a floating-point torch.dtype (probabilities are never integers): TypeError naming it otherwise.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
        raise TypeError(f"dtype must be a floating-point torch.dtype of probabilities (float16, bfloat16, float32 or "
                        f"float64), got {short_repr(dtype)}")
    return max(1e-3, 4 * torch.finfo(dtype).eps)


def _check_probs(name: str, t: object, rows: int | None = None, what: str = "probabilities") -> torch.Tensor:
    """A float tensor (rows, V) with V >= 1, holding values (not a meta tensor); its values are checked by
    `check_distributions`."""
    if not is_float_compute(t):
        raise TypeError(f"{name} must be a float tensor of {what}, got {tensor_kind(t)}")
    check_has_data(name, t)
    if t.dim() != 2 or (rows is not None and t.size(0) != rows) or t.size(1) == 0:
        want = f"({rows}, V)" if rows is not None else "(rows, V)"
        raise ValueError(f"{name} must have shape {want} with V >= 1, got {tuple(t.shape)}")
    return t


def _check_some_token_possible(name: str, logits: torch.Tensor) -> None:
    """Every row of logits (rows, V) gives some token a chance: a row all -inf masks the whole vocabulary, and its
    argmax (token 0, the first of equals) would be an answer the target never gave. ValueError naming the row."""
    dead = torch.isneginf(logits).all(dim=-1)  # (rows,)
    if bool(dead.any()):
        raise ValueError(f"{name} row {int(dead.nonzero()[0])} is -inf everywhere: no token is possible there")


def _check_alike(a: tuple[str, object], b: tuple[str, object], what: str, min_dim: int) -> None:
    """Two float tensors of one shape, dtype and device (with V >= 1 when min_dim is 1), neither a meta tensor;
    TypeError/ValueError naming the argument otherwise."""
    for name, t in (a, b):
        if not is_float_compute(t):
            raise TypeError(f"{name} must be a float tensor of {what}, got {tensor_kind(t)}")
        check_has_data(name, t)
        if min_dim and (t.dim() == 0 or t.size(-1) == 0):
            raise ValueError(f"{name} must have shape (..., V) with V >= 1, got {tuple(t.shape)}")
    (na, ta), (nb, tb) = a, b
    assert isinstance(ta, torch.Tensor) and isinstance(tb, torch.Tensor)  # checked just above
    if ta.shape != tb.shape or ta.device != tb.device:
        raise ValueError(f"{na} {tuple(ta.shape)} on {ta.device} and {nb} {tuple(tb.shape)} on {tb.device} must "
                         "have one shape and one device")
    if ta.dtype != tb.dtype:  # torch would promote silently, and the result would come back in the wider dtype
        raise TypeError(f"{na} ({ta.dtype}) and {nb} ({tb.dtype}) must have one dtype")


def check_distributions(name: str, t: torch.Tensor) -> None:
    """Every row of `t` (..., V) a probability distribution: finite, >= 0, summing to 1 within
    `prob_sum_tolerance`; ValueError naming `name` and the first bad row otherwise (one host sync). `t` must be a
    floating-point tensor holding values: TypeError/ValueError naming `name` otherwise."""
    if not is_float_compute(t):
        raise TypeError(f"{name} must be a float tensor of probabilities, got {tensor_kind(t)}")
    check_has_data(name, t)
    if t.dim() == 0:  # t.size(-1) below would be torch's IndexError
        raise ValueError(f"{name} must have shape (..., V) with V >= 1, got a 0-d tensor")
    if t.size(-1) == 0:  # rows of no entries sum to 0: no distribution, however many rows
        raise ValueError(f"{name} must have shape (..., V) with V >= 1, got {tuple(t.shape)}")
    if t.numel() == 0:
        return
    rows = t.detach().reshape(-1, t.size(-1))  # (R, V)
    sums = rows.sum(dim=-1, dtype=torch.float64)  # (R,)
    tol = prob_sum_tolerance(t.dtype)
    # The fast test, run on every verify step: the smallest entry of a row is NaN (amin propagates it) or
    # negative, or its sum is off (an inf entry makes it inf or NaN, which fails `<=` too). Only a failing input
    # pays for the per-row diagnosis below.
    if bool(((rows.amin(dim=-1) >= 0) & ((sums - 1).abs() <= tol)).all()):
        return
    finite, nonneg = torch.isfinite(rows).all(dim=-1), (rows >= 0).all(dim=-1)  # (R,) each
    ok = finite & nonneg & ((sums - 1).abs() <= tol)  # (R,)
    r = int((~ok).nonzero()[0])
    why = ("holds NaN or inf" if not bool(finite[r]) else "has a negative probability" if not bool(nonneg[r])
           else f"sums to {float(sums[r]):.6g}, not 1 (tolerance {tol:g})")
    raise ValueError(f"{name} must hold probability distributions (rows of finite values >= 0 summing to 1); "
                     f"row {r} {why}")


def check_generator(generator: object, device: torch.device) -> None:
    """None or a torch.Generator on the tensors' device; TypeError/ValueError naming it otherwise."""
    device = check_device("device", device)  # read below: a str or object here was an AttributeError
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    g = generator.device
    if g.type != device.type or (g.index is not None and device.index is not None and g.index != device.index):
        raise ValueError(f"generator is on {g} but the probabilities are on {device}: it must draw on their device")


def check_draft_tokens(draft_tokens: object, vocab_size: int, name: str = "draft_tokens") -> list[int]:
    """The draft tokens as a list of ints in [0, vocab_size); TypeError/ValueError naming a bad one (as `name`).
    vocab_size must be an int in [1, MAX_TENSOR_ELEMENTS] (bool refused; a distribution over the vocabulary is one
    tensor row): TypeError/ValueError naming it otherwise."""
    # 2.5, inf, True or None compared with the ids named only the ids
    vocab_size = check_int("vocab_size", vocab_size, 1)
    if vocab_size > MAX_TENSOR_ELEMENTS:
        raise ValueError(f"vocab_size must be at most {MAX_TENSOR_ELEMENTS} (MAX_TENSOR_ELEMENTS: its distributions "
                         f"are tensor rows), got {vocab_size:.3g}")
    return check_token_ids(name, draft_tokens, vocab_size)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last dimension: where to resample after a rejection (Leviathan et al. §2.3).

    p, q (..., V) -> (..., V). The residual holds the mass the target gives a token beyond what the draft already
    proposes. Worked example: p = [0.5, 0.3, 0.2], q = [0.2, 0.6, 0.2] -> max(0, p - q) = [0.3, 0, 0], normalized
    [1, 0, 0]. subtle: when p == q everywhere the residual is all zero; then a rejection has probability 0
    (p/q = 1 > u), so any distribution will do, and p itself is returned rather than 0/0 = NaN.
    subtle: p and q may differ by subnormals only (below the smallest normal float). The residual and its mass are
    then still exact (IEEE arithmetic underflows gradually), and so is r / mass; clamping the mass to the smallest
    normal float, against 0/0 where it is 0, divided by the wrong number: rows summed to 6e-7 in float32.
    """
    _check_alike(("p", p), ("q", q), "probabilities (..., V)", min_dim=1)
    check_distributions("p", p)
    check_distributions("q", q)
    # BEGIN SOLUTION
    r = (p - q).clamp(min=0)  # (..., V)
    mass = r.sum(dim=-1, keepdim=True)  # (..., 1)
    return torch.where(mass > 0, r / torch.where(mass > 0, mass, torch.ones_like(mass)), p)  # (..., V)
    # END SOLUTION


def acceptance_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)), elementwise: the chance of keeping a draft token x that the draft proposed with
    probability q(x) and the target gives p(x). p_x, q_x: probabilities in [0, 1], one shape.

    Leviathan et al. 2023 §2.3: "if q(x) <= p(x) we keep x; if q(x) > p(x) we reject it with probability
    1 − p(x)/q(x)". So q(x) = 0 gives 1: the draft never proposes such an x (it has no mass there), and the rule's
    first case covers it, where p/q would be p/0 = inf, or 0/0 = NaN when p(x) = 0 too. Any other value there could
    never change an output; 1 keeps the result a probability.
    """
    _check_alike(("p_x", p_x), ("q_x", q_x), "probabilities", min_dim=0)
    bad = torch.stack([((t.detach() >= 0) & (t.detach() <= 1)).all() for t in (p_x, q_x)]).tolist()  # NaN fails too
    for name, t, ok in (("p_x", p_x, bad[0]), ("q_x", q_x, bad[1])):
        if not ok:
            raise ValueError(f"{name} must hold probabilities in [0, 1], got {t.detach().flatten()[:8].tolist()}")
    # BEGIN SOLUTION
    ratio = (p_x / q_x).clamp(max=1.0)  # q < p: always keep; q > p: keep with probability p/q
    # q(x) = 0: p/0 = inf or 0/0 = NaN above, discarded here for the rule's first case (keep).
    return torch.where(q_x > 0, ratio, torch.ones_like(ratio))
    # END SOLUTION


def accept_or_resample(p: torch.Tensor, q: torch.Tensor, draft_tokens: Sequence[int] | torch.Tensor,
                       generator: torch.Generator | None = None) -> list[int]:
    """The tokens one verify step emits (1 to γ+1 of them): accepted draft tokens, then a resampled or bonus one.

    p (γ+1, V): the target's distributions after the prefix and after each draft token; q (γ, V): the draft's
    distributions that draft_tokens (γ ids) were drawn from. Uniforms and resamples come from `generator` (the
    request's own), so a seeded request repeats. Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, Algorithm 2.
    """
    q = _check_probs("q", q)
    gamma, V = q.shape
    p = _check_probs("p", p, gamma + 1)
    if p.size(1) != V:
        raise ValueError(f"p and q must share the vocabulary, got V={p.size(1)} and V={V}")
    tokens = check_draft_tokens(draft_tokens, V)
    if len(tokens) != gamma:
        raise ValueError(f"draft_tokens has {len(tokens)} tokens but q has {gamma} rows")
    if q.device != p.device:
        raise ValueError(f"p on {p.device} and q on {q.device} must be on one device")
    if q.dtype != p.dtype:  # as acceptance_probability and residual_distribution, which it calls, refuse them
        raise TypeError(f"p ({p.dtype}) and q ({q.dtype}) must have one dtype")
    check_distributions("p", p)
    check_distributions("q", q)
    check_generator(generator, p.device)
    # BEGIN SOLUTION
    idx = torch.tensor(tokens, dtype=torch.long, device=p.device)  # (γ,)
    rows = torch.arange(gamma, device=p.device)  # (γ,)
    q_x = q[rows, idx]  # (γ,) the draft's probability of each drafted token
    if bool((q_x <= 0).any()):
        raise ValueError(f"a draft token has probability 0 under q (q of draft_tokens = {q_x.tolist()}): "
                         f"the drafts were not drawn from q")
    accept_p = acceptance_probability(p[rows, idx], q_x)  # (γ,)
    u = torch.rand(gamma, generator=generator, device=p.device)  # (γ,) one uniform per draft token
    # subtle: strict u < p/q (the paper writes r <= p/q; equal for a continuous u) never keeps a token with
    # p(x) = 0, which u = 0.0 exactly would otherwise do once in 2^24 draws.
    keep = (u < accept_p).tolist()
    out: list[int] = []
    for i, tok in enumerate(tokens):
        if not keep[i]:
            resid = residual_distribution(p[i], q[i])  # (V,)
            out.append(int(torch.multinomial(resid, 1, generator=generator)))
            return out
        out.append(tok)
    out.append(int(torch.multinomial(p[gamma], 1, generator=generator)))  # the bonus token, from p_γ
    return out
    # END SOLUTION


def sample_from_target(p: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """The naive twin: one token drawn from the target's first distribution p[0] (what the target alone emits).

    p (rows, V) with at least one row: only p[0] is drawn from (the rows after it are accepted so that the p of a
    verify step can be passed as it is)."""
    p = _check_probs("p", p)
    if p.size(0) == 0:
        raise ValueError(f"p must have shape (rows, V) with at least one row to draw from, got {tuple(p.shape)}")
    check_distributions("p", p[:1])
    check_generator(generator, p.device)
    return int(torch.multinomial(p[0], 1, generator=generator))


def accept_greedy(target_logits: torch.Tensor, draft_tokens: Sequence[int] | torch.Tensor,
                  params: SamplingParams | None = None) -> list[int]:
    """Greedy verification: keep draft tokens while each equals the target's argmax, then emit the target's argmax.

    target_logits (γ+1, V). The argmax is `sample_next`'s (first index on ties), so the emitted tokens are exactly
    those greedy decoding of the target alone produces from the same logits; the bonus token included. `params`, if
    given, must be greedy (temperature 0): other params would sample, and the verification would not be greedy.
    """
    target_logits = _check_probs("target_logits", target_logits, what="logits")
    tokens = check_draft_tokens(draft_tokens, target_logits.size(1))
    if target_logits.size(0) != len(tokens) + 1:
        raise ValueError(f"target_logits must have {len(tokens) + 1} rows (γ+1) for {len(tokens)} draft tokens, "
                         f"got {target_logits.size(0)}")
    if params is not None and not isinstance(params, SamplingParams):
        raise TypeError(f"params must be greedy SamplingParams or None, got {type(params).__name__} {params!r}")
    if params is not None and not params.is_greedy:
        raise ValueError(f"params must be greedy SamplingParams (temperature 0) or None, got {params!r}")
    if bool(torch.isnan(target_logits).any()):  # argmax would pick a NaN as the largest
        raise ValueError("target_logits contains NaN")
    _check_some_token_possible("target_logits", target_logits)
    # BEGIN SOLUTION
    best = sample_next(target_logits, params or SamplingParams.greedy()).tolist()  # (γ+1,) argmax per position
    out: list[int] = []
    for tok, want in zip(tokens, best):
        if tok != want:
            break
        out.append(tok)
    out.append(best[len(out)])  # the target's own token where the draft went wrong, or the bonus
    return out
    # END SOLUTION

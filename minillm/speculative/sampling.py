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
own greedy output. What it leaves out: batches (one sequence at a time), and the draft/verify loop around it
(`minillm.speculative.generate`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from minillm.core.sampling import SamplingParams, sample_next
from minillm.core.stopping import check_token_ids


def _check_probs(name: str, t: object, rows: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise TypeError(f"{name} must be a float tensor of probabilities, got {getattr(t, 'dtype', type(t).__name__)}")
    if t.dim() != 2 or (rows is not None and t.size(0) != rows):
        want = f"({rows}, V)" if rows is not None else "(rows, V)"
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    return t


def check_draft_tokens(draft_tokens: object, vocab_size: int) -> list[int]:
    """The draft tokens as a list of ints in [0, vocab_size); TypeError/ValueError naming a bad one."""
    return check_token_ids("draft_tokens", draft_tokens, vocab_size)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last dimension: where to resample after a rejection (Leviathan et al. §2.3).

    p, q (..., V) -> (..., V). The residual holds the mass the target gives a token beyond what the draft already
    proposes. Worked example: p = [0.5, 0.3, 0.2], q = [0.2, 0.6, 0.2] -> max(0, p - q) = [0.3, 0, 0], normalized
    [1, 0, 0]. subtle: when p == q everywhere the residual is all zero; then a rejection has probability 0
    (p/q = 1 > u), so any distribution will do, and p itself is returned rather than 0/0 = NaN.
    """
    # BEGIN SOLUTION
    r = (p - q).clamp(min=0)  # (..., V)
    mass = r.sum(dim=-1, keepdim=True)  # (..., 1)
    return torch.where(mass > 0, r / mass.clamp(min=torch.finfo(r.dtype).tiny), p)  # (..., V)
    # END SOLUTION


def acceptance_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)): the chance of keeping a draft token x the draft proposed with probability q(x) > 0."""
    # BEGIN SOLUTION
    return (p_x / q_x).clamp(max=1.0)  # q < p: always keep; q > p: keep with probability p/q
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
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
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
    """The naive twin: one token drawn from the target's first distribution p[0] (what the target alone emits)."""
    p = _check_probs("p", p)
    return int(torch.multinomial(p[0], 1, generator=generator))


def accept_greedy(target_logits: torch.Tensor, draft_tokens: Sequence[int] | torch.Tensor,
                  params: SamplingParams | None = None) -> list[int]:
    """Greedy verification: keep draft tokens while each equals the target's argmax, then emit the target's argmax.

    target_logits (γ+1, V). The argmax is `sample_next`'s (first index on ties), so the emitted tokens are exactly
    those greedy decoding of the target alone produces from the same logits; the bonus token included.
    """
    target_logits = _check_probs("target_logits", target_logits)
    tokens = check_draft_tokens(draft_tokens, target_logits.size(1))
    if target_logits.size(0) != len(tokens) + 1:
        raise ValueError(f"target_logits must have {len(tokens) + 1} rows (γ+1) for {len(tokens)} draft tokens, "
                         f"got {target_logits.size(0)}")
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

"""Chapter 08's probes: the residual, the acceptance ratio, greedy verification and seeded accept-or-resample steps."""

from __future__ import annotations


import torch

from minillm.core.sampling import SamplingParams
from minillm.speculative import sampling
from . import Probe, generator, rng, substituted

V = 7  # vocabulary of the hand-built distributions


def _dist(g: torch.Generator, shape: tuple[int, ...], zeros: float = 0.0) -> torch.Tensor:
    """Random float32 distributions over the last dimension; about `zeros` of the entries exactly 0 (never a whole
    row)."""
    w = torch.rand(*shape, generator=g) + 0.05
    w = w * (torch.rand(*shape, generator=g) >= zeros)
    w[..., 0] += (w.sum(-1) == 0).float()  # a row left empty keeps one token
    return w / w.sum(-1, keepdim=True)


def residual(seed: int) -> list:
    """p, q of shapes (V,), (4, V) and (2, 3, V): rows apart, rows with zeros (disjoint supports included), and rows
    where p == q (the residual is all zero there: p itself comes back, never NaN)."""
    g = generator(seed)
    outs = []
    for shape, zeros in (((V,), 0.0), ((4, V), 0.4), ((2, 3, V), 0.2)):
        p, q = _dist(g, shape, zeros), _dist(g, shape, zeros)
        if len(shape) > 1:
            q[..., 1, :] = p[..., 1, :]  # a row with p == q
        outs.append(sampling.residual_distribution(p, q))
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.25, 0.75]])  # disjoint supports: the residual is p
    outs.append(sampling.residual_distribution(p, p.flip(0)))
    return outs


def acceptance(seed: int) -> list:
    """p(x), q(x) in [0, 1] of shapes (9,) and (3, 4): p above, below and equal to q, p = 0 (never kept) and q = 0
    with p > 0 (kept: 1, not inf)."""
    g = generator(seed)
    outs = []
    for shape in ((9,), (3, 4)):
        p_x, q_x = torch.rand(*shape, generator=g), torch.rand(*shape, generator=g)
        flat_p, flat_q = p_x.view(-1), q_x.view(-1)
        flat_p[0], flat_q[1], flat_q[2] = 0.0, 0.0, flat_p[2]
        outs.append(sampling.acceptance_probability(p_x, q_x))
    return outs


def greedy(seed: int) -> list:
    """Target logits (γ+1, V) with tied maxima (the first index wins) and -inf entries; drafts that match the
    argmax for 0..γ tokens (all of them: the bonus token) then go wrong; γ = 0; params None or greedy."""
    g, r = generator(seed), rng(seed)
    outs = []
    for gamma in (0, 1, 2, 3, 4, 4, 5, 5):
        logits = torch.randint(0, 4, (gamma + 1, V), generator=g).float()  # few levels: ties
        logits[torch.rand(gamma + 1, V, generator=g) < 0.15] = float("-inf")
        logits[:, r.randrange(V)] = 3.0  # every row keeps a finite maximum
        best = logits.argmax(-1).tolist()
        right = r.randrange(gamma + 1) if r.random() < 0.6 else gamma  # gamma: every draft token is right
        drafts = best[:right] + [(best[i] + r.randrange(1, V)) % V for i in range(right, gamma)]
        params = None if r.random() < 0.5 else SamplingParams.greedy()
        outs.append(sampling.accept_greedy(logits, drafts, params))
    return outs


# ----- accept_or_resample ---------------------------------------------------------------------------------------
# The rule calls the two other exercises; the probe runs it on their reference rules (as the chapter's tests
# monkeypatch them), so that a mistake in either shows in their own probe only. All are written out in the module
# docstring of minillm.speculative.sampling.


def _acceptance_rule(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    return torch.where(q_x > 0, (p_x / q_x).clamp(max=1.0), torch.ones_like(p_x))


def _residual_rule(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r = (p - q).clamp(min=0)
    mass = r.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, r / torch.where(mass > 0, mass, torch.ones_like(mass)), p)


def _one_hot(token: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(token), V).float()


def _step(g: torch.Generator, r, gamma: int, reject_at: int | None, ratio: tuple[float, float]
          ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """p (γ+1, V), q (γ, V) and γ drafts q gives mass to. Draft row i < reject_at keeps its token for certain
    (p(x) >= q(x)), or with chance p(x)/q(x) drawn from `ratio` (`ratio` (1, 1): kept for certain). Row
    `reject_at` gives its token p(x) = 0: rejected for certain. Every possible resample (norm(max(0, p - q))) and
    the bonus (p_γ) is one token for certain, and p_γ's token has probability 0 in p_{γ-1}: so the tokens do not
    depend on the draw order of an implementation beyond its uniforms, and a resample from p itself (p(r) = 1e-3
    there) or a bonus from the wrong row shows."""
    p, q, drafts = torch.zeros(gamma + 1, V), torch.zeros(gamma, V), []
    bonus = r.randrange(V)
    for i in range(gamma):
        x, res = r.sample([t for t in range(V) if t != bonus], 2)  # the draft token, the residual's token
        q[i] = _dist(g, (V,))
        q[i, res] = 0.0
        if i == gamma - 1:
            q[i, bonus] = 0.0  # so p_{γ-1}(bonus) = 0 below
        if reject_at == i:  # q(x) = 1e-3: the mass p moves off x, all onto the residual's token, is 1e-3 too
            q[i, x] = 0.0
            q[i] *= (1 - 1e-3) / q[i].sum()
            q[i, x] = 1e-3
        q[i] /= q[i].sum()
        drafts.append(x)
        p[i] = q[i]
        if reject_at == i:
            keep_x = 0.0
        elif reject_at is not None and i > reject_at:
            continue  # never reached
        else:
            keep_x = r.uniform(*ratio)  # p(x) / q(x)
        if keep_x >= 1:  # p(x) >= q(x): the mass moves onto x from the other tokens
            a = r.uniform(0.0, 0.5)
            p[i] = (1 - a) * q[i] + a * _one_hot(x)
        else:  # p(x) = keep_x q(x): the mass freed goes to `res` alone (q(res) = 0)
            p[i, x] = keep_x * q[i, x]
            p[i, res] = 1.0 - (p[i].sum() - p[i, res])
    p[gamma] = _one_hot(bonus)
    return p, q, drafts


def accept_or_resample(seed: int) -> list:
    """Certain steps (γ 1..4, every draft kept then the bonus; or kept up to a token the target never emits, then
    the one-token residual), then steps whose kept prefix depends on the uniforms, each under several seeded
    generators (a fresh one per call: the outputs depend only on the uniforms drawn, first token first)."""
    g, r = generator(seed), rng(seed)
    certain, random_steps = [], []
    with substituted(sampling, acceptance_probability=_acceptance_rule, residual_distribution=_residual_rule):
        for gamma in (1, 2, 3, 4):
            p, q, drafts = _step(g, r, gamma, None, (1.0, 1.0))
            certain.append(sampling.accept_or_resample(p, q, drafts, generator(r.randrange(2**31))))
            reject_at = r.randrange(gamma)
            p, q, drafts = _step(g, r, gamma, reject_at, (1.0, 1.0))
            certain.append(sampling.accept_or_resample(p, q, drafts, generator(r.randrange(2**31))))
        for gamma in (2, 3, 4, 4):
            p, q, drafts = _step(g, r, gamma, None, (0.3, 1.3))
            random_steps.append([sampling.accept_or_resample(p, q, drafts, generator(r.randrange(2**31)))
                                 for _ in range(6)])
    return [certain, random_steps]


PROBES = {
    "residual_distribution": Probe(residual, rtol=1e-4, atol=1e-6),
    "acceptance_probability": Probe(acceptance, rtol=1e-4, atol=1e-6),
    "accept_greedy": Probe(greedy),
    "accept_or_resample": Probe(accept_or_resample),
}

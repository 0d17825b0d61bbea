"""Chapter 10's probes: magnitude masks, Wanda scores and N:M masks of random matrices (no cut splits a tie)."""

from __future__ import annotations

import torch

from minillm.prune import masks
from . import Probe, generator, rng


def _signed_with_ties(g: torch.Generator, r, rows: int, cols: int) -> tuple[torch.Tensor, list[int]]:
    """A (rows, cols) matrix of distinct magnitudes and random signs, then some ±w pairs (equal |w|, opposite sign)
    and exact zeros; and the numbers k of smallest |w| that end between two magnitudes (so no tie is cut)."""
    n = rows * cols
    w = (torch.randperm(n, generator=g).float() + 1) / n * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)
    cells = r.sample(range(n), min(n, 6))
    w[cells[:2]] = 0.0  # two zeros, then ±w pairs
    for a, b in zip(cells[2::2], cells[3::2]):
        w[b] = -w[a]
    mags = sorted(w.abs().tolist())
    cuts = [k for k in range(n) if k == 0 or mags[k - 1] != mags[k]]  # k = n is sparsity 1, refused
    return w.view(rows, cols), cuts


def magnitude(seed: int) -> list:
    """Matrices (5, 8), (1, 7) and (6, 1) with ±w ties and zeros; sparsities k / n for several cuts between distinct
    magnitudes, 0 (keep all) and 0.99 (round(s · n) = n: all go)."""
    g, r = generator(seed), rng(seed)
    outs = []
    for rows, cols in ((5, 8), (1, 7), (6, 1)):
        w, cuts = _signed_with_ties(g, r, rows, cols)
        n = rows * cols
        for k in sorted(set(r.sample(cuts, min(4, len(cuts))))):
            outs.append(masks.magnitude_mask(w, k / n))
        outs.append([masks.magnitude_mask(w, 0.0), masks.magnitude_mask(w, 0.99)])
    return outs


def wanda(seed: int) -> list:
    """Signed weights (4, 6) and (3, 5) with input norms in (0, 3], one norm 0 (a dead feature) and one exactly 1;
    float32 and float64."""
    g = generator(seed)
    outs = []
    for (rows, cols), dtype in (((4, 6), torch.float32), ((3, 5), torch.float64)):
        w = torch.randn(rows, cols, generator=g, dtype=dtype)
        norms = torch.rand(cols, generator=g, dtype=dtype) * 3 + 0.01
        norms[0], norms[-1] = 0.0, 1.0
        outs.append(masks.wanda_score(w, norms))
    return outs


def nm(seed: int) -> list:
    """Scores (3, 8) and (2, 16) (random, positive) for 2:4, 1:4, 3:4, 1:2, 4:8 and 4:4; each group holds up to
    m - n exact zeros, which tie among themselves below the cut."""
    g, r = generator(seed), rng(seed)
    outs = []
    for rows, cols in ((3, 8), (2, 16)):
        for n, m in ((2, 4), (1, 4), (3, 4), (1, 2), (4, 8), (4, 4)):
            scores = torch.randn(rows, cols, generator=g).abs() + 1e-3  # > 0: the zeros below are the smallest
            groups = scores.view(rows, cols // m, m)
            for i in range(rows):
                for j in range(cols // m):
                    groups[i, j, r.sample(range(m), r.randint(0, m - n))] = 0.0
            outs.append(masks.nm_mask(scores, n, m))
    return outs


PROBES = {
    "magnitude_mask": Probe(magnitude),
    "wanda_score": Probe(wanda, rtol=1e-6, atol=0.0),
    "nm_mask": Probe(nm),
}

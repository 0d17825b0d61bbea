"""Chapter 03's probes: top-k and top-p filtering of random logits (ties planted), ITL and TPOT of random times."""

from __future__ import annotations

import torch

from minillm.core import metrics, sampling
from . import Probe, generator, rng


def _logits(g: torch.Generator) -> torch.Tensor:
    """(4, 12) logits with ties: values drawn from a few levels."""
    return torch.randint(0, 6, (4, 12), generator=g).float() + torch.randint(0, 2, (4, 12), generator=g) * 0.5


def top_k(seed: int) -> list:
    g = generator(seed)
    worked = sampling.top_k_filter(torch.tensor([[1.0, 3.0, 2.0, 3.0]]), 2)  # the docstring's tie: both 3s stay
    return [worked, *(sampling.top_k_filter(_logits(g), k) for k in (0, 1, 2, 3, 5, 12, 20))]


def top_p(seed: int) -> list:
    g = generator(seed)
    return [sampling.top_p_filter(torch.randn(4, 12, generator=g) * 2, p) for p in (0.05, 0.3, 0.5, 0.8, 0.95, 1.0)]


def _times(seed: int) -> list[metrics.RequestTimes]:
    r = rng(seed)
    out = []
    for n in (1, 2, 3, 5, 9):
        t = r.random()
        rt = metrics.RequestTimes(arrival=t)
        for _ in range(n):
            t += r.random()
            rt.record(t)
        out.append(rt)
    return out


PROBES = {
    "top_k_filter": Probe(top_k),
    "top_p_filter": Probe(top_p),
    "itl": Probe(lambda seed: [rt.itl for rt in _times(seed)], rtol=1e-9, atol=1e-12),
    "tpot": Probe(lambda seed: [rt.tpot for rt in _times(seed)], rtol=1e-9, atol=1e-12),
}

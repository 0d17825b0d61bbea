"""Chapter 02's probe: explicit attention on random q, k, v, with and without a mask."""

from __future__ import annotations

import torch

from minillm.core import attention
from . import Probe, generator


def attention_outputs(seed: int) -> list:
    g = generator(seed)
    outs = []
    for T_q, T_k, causal in ((5, 5, True), (3, 7, False), (1, 6, False), (4, 9, True)):
        q, k, v = (torch.randn(2, 3, t, 8, generator=g) for t in (T_q, T_k, T_k))
        if causal:  # queries are the last T_q positions of T_k
            mask = torch.ones(T_q, T_k, dtype=torch.bool).tril(T_k - T_q)
        else:
            mask = torch.rand(2, 1, T_q, T_k, generator=g) < 0.7
            mask[..., 0] = True  # every query sees at least one key
        outs.append([attention.attention_ref(q, k, v), attention.attention_ref(q, k, v, mask)])
    return outs


PROBES = {"attention_ref": Probe(attention_outputs, rtol=1e-4, atol=1e-5)}

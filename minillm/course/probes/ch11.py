"""Chapter 11's probe: kd_loss's value and its gradient in the student logits, at several temperatures, both ways."""

from __future__ import annotations

import torch

from minillm.distill import losses
from . import Probe, generator


def _value_and_grad(zs: torch.Tensor, zt: torch.Tensor, temperature: float, kind: str) -> dict:
    z = zs.clone().requires_grad_(True)
    loss = losses.kd_loss(z, zt, temperature, kind)
    loss.backward()
    return {"loss": loss.detach(), "grad": z.grad}


def kd(seed: int) -> list:
    """Student and teacher logits (2, 3, 6) float64, (5, 9) float32 and (4, 2) float64 (the smallest vocabulary),
    the teacher sharper than the student; T = 0.5, 1, 2 and 4 (T² and the softening both show), forward and
    reverse. Then a teacher equal to the student up to a shift per row: KL 0, gradient 0."""
    g = generator(seed)
    outs = []
    for shape, dtype in (((2, 3, 6), torch.float64), ((5, 9), torch.float32), ((4, 2), torch.float64)):
        zs = torch.randn(*shape, generator=g, dtype=dtype)
        zt = torch.randn(*shape, generator=g, dtype=dtype) * 2.5
        for temperature in (0.5, 1.0, 2.0, 4.0):
            outs.append([_value_and_grad(zs, zt, temperature, kind) for kind in ("forward", "reverse")])
    zs = torch.randn(3, 7, generator=g, dtype=torch.float64)
    shifted = zs + torch.randn(3, 1, generator=g, dtype=torch.float64) * 3
    outs.append([_value_and_grad(zs, shifted, 2.0, kind) for kind in ("forward", "reverse")])
    return outs


PROBES = {"kd_loss": Probe(kd, rtol=1e-4, atol=1e-6)}

"""Chapter 13's probes: the blocked GEMV on shapes with tails, and hand-written decode steps of a tiny random GPT."""

from __future__ import annotations

import torch

from minillm.compile import mirror
from minillm.core.config import GPTConfig
from minillm.core.model import GPT
from . import Probe, generator, rng


def gemvs(seed: int) -> list:
    """x (M, K) @ w (N, K)ᵀ + b on whole blocks and registers (N % 4 = K % 8 = 0), shorter last blocks (N % 4 > 0),
    scalar tails (K % 8 > 0), K < 8 (all tail), N < 4 (one short block); with a bias (several blocks, so each block
    must take its own slice of b) and without."""
    g = generator(seed)
    outs = []
    for M, N, K in ((1, 8, 16), (3, 7, 9), (2, 5, 3), (4, 1, 1), (2, 13, 21), (3, 12, 40)):
        x, w, b = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g)
        outs.append([mirror.gemv_blocked(x, w, b), mirror.gemv_blocked(x, w)])
    return outs


def tiny_model(g: torch.Generator) -> GPT:
    """A 2-layer, 2-head GPT (C = 16, V = 40) whose every weight is drawn from g; the global RNG is left as it was
    (the construction's own initialisation runs inside fork_rng and is overwritten)."""
    config = GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=2, n_embd=16)
    with torch.random.fork_rng(devices=[]):
        model = GPT(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # the tied head is wte's weight: filled once
            if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model


def decode_steps(seed: int) -> list:
    """A cache (2 layers of (1, 2, 6, 8)) holding random keys and values, then steps at slot 0 (the token attends
    to itself alone), a middle slot and the last slot, each at a position other than its slot; every step's logits
    and the key and value it wrote to its slot of every layer."""
    g, r = generator(seed), rng(seed)
    model = tiny_model(g)
    shape = (1, 2, 6, 8)
    k = [torch.randn(shape, generator=g) for _ in range(2)]
    v = [torch.randn(shape, generator=g) for _ in range(2)]
    outs = []
    for slot in (0, r.randrange(1, 5), 5):
        token, pos = r.randrange(40), (slot + r.randrange(1, 16)) % 16
        logits = mirror.decode_step_by_hand(model, k, v, token, pos, slot)
        outs.append({"logits": logits, "k": [t[0, :, slot] for t in k], "v": [t[0, :, slot] for t in v]})
    return outs


PROBES = {
    "gemv_blocked": Probe(gemvs, rtol=1e-4, atol=1e-5),
    "decode_step_by_hand": Probe(decode_steps, rtol=1e-4, atol=1e-5),
}

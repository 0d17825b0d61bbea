"""Chapter 04's probes: the contiguous cache's attend and padding mask on random K/V, left padding and positions."""

from __future__ import annotations

import torch

from minillm.core.config import GPTConfig
from minillm.kvcache.cache import ContiguousKVCache
from minillm.kvcache.generate import left_pad, static_positions
from . import Probe, generator, rng

# Two layers, two heads of width 4: the cache only reads these sizes (no model is built).
CONFIG = GPTConfig(vocab_size=16, block_size=32, n_layer=2, n_head=2, n_embd=8)


def attend(seed: int) -> list:
    """Random q, k, v through `attend` on unpadded caches (padding would call `attention_mask`, another exercise):
    a prefill from empty, chunks after earlier tokens (the offset causal mask), single-token decodes, a chunk
    after `truncate`, in float32 and in float64 (q, k, v in the cache's dtype: nothing a graded test does not ask
    for). Returns every output and the kept K/V."""
    g = generator(seed)
    r = rng(seed)
    outs = []
    for dtype in (torch.float32, torch.float64):
        B, max_len = r.choice((1, 2, 3)), 24
        cache = ContiguousKVCache(CONFIG, B, max_len, dtype=dtype)
        steps = [r.randrange(2, 6), r.randrange(2, 5), 1, 1, r.randrange(2, 5), "truncate", r.randrange(2, 4), 1]
        for T in steps:
            if T == "truncate":
                cache.truncate(cache.length - r.randrange(1, 3))
                continue
            for layer in range(CONFIG.n_layer):
                q, k, v = (torch.randn(B, CONFIG.n_head, T, CONFIG.head_size, generator=g, dtype=dtype)
                           for _ in range(3))
                outs.append(cache.attend(layer, q, k, v))
            outs.append(cache.length)
        n = cache.length
        outs.append([[cache.k[i][:, :, :n], cache.v[i][:, :, :n]] for i in range(CONFIG.n_layer)])
    return outs


def attention_mask(seed: int) -> list:
    """The mask of caches with random left padding: prefill from slot 0 (padding queries, which must see
    themselves), a chunk that starts inside one row's padding, decodes past it, and an unpadded cache (None)."""
    r = rng(seed)
    outs = []
    for _ in range(4):
        B, max_len = r.randrange(2, 5), 12
        pads = [r.randrange(0, 5) for _ in range(B)]
        pads[r.randrange(B)] = r.randrange(2, 5)  # at least one padded row
        cache = ContiguousKVCache(CONFIG, B, max_len).reset(pads)
        for start, num_new in ((0, r.randrange(2, 7)), (1, r.randrange(2, 5)), (r.randrange(3, 8), 1),
                               (r.randrange(4, 7), r.randrange(2, 5))):
            outs.append(cache.attention_mask(start, num_new))
    outs.append(ContiguousKVCache(CONFIG, 2, 8).reset([0, 0]).attention_mask(0, 3))  # no padding: None
    return outs


def left_pads(seed: int) -> list:
    """The docstring's example, then batches of prompts of mixed lengths (one of equal lengths, one of a single
    prompt), with random pad ids."""
    r = rng(seed)
    batches = [[[5, 6, 7], [9]]]
    batches += [[[r.randrange(1, 50) for _ in range(r.randrange(1, 9))] for _ in range(r.randrange(2, 6))]
                for _ in range(6)]
    batches.append([[r.randrange(1, 50) for _ in range(4)] for _ in range(3)])
    batches.append([[r.randrange(1, 50) for _ in range(r.randrange(1, 6))]])
    return [list(left_pad(b, pad_id=r.randrange(0, 3))) for b in batches]


def positions(seed: int) -> list:
    """Positions for random pads from slot 0 (padding slots clamp to 0), from slots inside and past the padding."""
    r = rng(seed)
    outs = [static_positions(torch.tensor([0, 2]), 0, 3), static_positions(torch.tensor([0, 2]), 3, 1)]
    for _ in range(8):
        pads = torch.tensor([r.randrange(0, 7) for _ in range(r.randrange(1, 5))])
        outs.append(static_positions(pads, r.randrange(0, 9), r.randrange(1, 6)))
    return outs


PROBES = {
    "attend": Probe(attend, rtol=1e-4, atol=1e-5),
    "attention_mask": Probe(attention_mask),
    "left_pad": Probe(left_pads),
    "static_positions": Probe(positions),
}

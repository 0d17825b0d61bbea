"""Chapter 07's probes: packing and unpacking a prompt's K/V through block tables, and FCFS hand-off admission."""

from __future__ import annotations

import torch

from minillm.disagg.decode_worker import admit_handoffs
from minillm.disagg.kv_transfer import pack_kv, unpack_kv
from . import Probe, generator, rng

# (layers, blocks, block size, heads, head size, dtype) of the pools: nb != bs, so a swapped index shows.
POOLS = ((2, 7, 4, 2, 3, torch.float32), (1, 5, 3, 1, 2, torch.float64), (3, 6, 2, 2, 2, torch.float32))


def _table_and_lengths(r, nb: int, bs: int) -> tuple[list[int], list[int]]:
    """A block table of distinct blocks out of order, and token counts: one token, a partial last block, a
    full last block (a block boundary), and the whole table."""
    table = r.sample(range(nb), r.randrange(2, nb))
    partial = bs * r.randrange(1, len(table)) + r.randrange(1, bs)
    return table, [1, partial, bs * r.randrange(2, len(table) + 1), len(table) * bs]


def pack(seed: int) -> list:
    """Random pools gathered through random block tables for 1 token, a partial last block, a whole number of
    blocks and the whole table. Returns each payload (L, 2, T, nh, hs)."""
    g, r = generator(seed), rng(seed)
    outs = []
    for L, nb, bs, nh, hs, dtype in POOLS:
        k_pools = [torch.randn(nb, bs, nh, hs, generator=g, dtype=dtype) for _ in range(L)]
        v_pools = [torch.randn(nb, bs, nh, hs, generator=g, dtype=dtype) for _ in range(L)]
        table, lengths = _table_and_lengths(r, nb, bs)
        outs += [pack_kv(k_pools, v_pools, table, T) for T in lengths]
    return outs


def unpack(seed: int) -> list:
    """Random payloads scattered into random pools (not zeros: untouched slots must keep their values) through
    random block tables, for the same token counts as the pack probe; longer tables than the payload needs too.
    Returns the pools after each scatter."""
    g, r = generator(seed), rng(seed)
    outs = []
    for L, nb, bs, nh, hs, dtype in POOLS:
        table, lengths = _table_and_lengths(r, nb, bs)
        for T in lengths:
            k_pools = [torch.randn(nb, bs, nh, hs, generator=g, dtype=dtype) for _ in range(L)]
            v_pools = [torch.randn(nb, bs, nh, hs, generator=g, dtype=dtype) for _ in range(L)]
            unpack_kv(torch.randn(L, 2, T, nh, hs, generator=g, dtype=dtype), k_pools, v_pools, table)
            outs.append([k_pools, v_pools])
    return outs


def admissions(seed: int) -> list:
    """The docstring's worked examples (and one with a request too big in the middle), then random queues of
    worst-case token counts (half with a request too big to fit ahead of small ones that would: FCFS stops there),
    free and reserved blocks (some leaving none), running counts up to the batch limit, and block sizes 1 to 5.
    Returns each case's inputs and the admitted count."""
    r = rng(seed)
    cases = [([9, 12, 1], 10, 3, 1, 4, 4), ([9, 12, 1], 10, 3, 1, 3, 4), ([9, 40, 1], 10, 3, 1, 4, 4),
             ([], 5, 0, 0, 4, 4)]
    for _ in range(30):
        bs = r.randrange(1, 6)
        waiting = [r.randrange(1, 6 * bs) for _ in range(r.randrange(1, 7))]
        if r.random() < 0.5:
            waiting.insert(r.randrange(len(waiting)), 30 * bs)  # a request too big to fit, small ones behind it
        free = r.randrange(0, 25)
        cases.append((waiting, free, r.randrange(0, free + 1), r.randrange(0, 4), r.randrange(1, 8), bs))
    return [[*case, admit_handoffs(*case)] for case in cases]


PROBES = {
    "pack_kv": Probe(pack),
    "unpack_kv": Probe(unpack),
    "admit_handoffs": Probe(admissions),
}

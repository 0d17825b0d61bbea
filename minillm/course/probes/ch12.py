"""Chapter 12's probes: the CPU mirrors' steps on states and tiles fed directly, and softmax.cu's v2 in the emulator.

The kernel is compiled and run by the grader's own `emulator.py` (`GRADER_EMULATOR`, loaded by path like these
probes), not the student's copy, whose Python could answer without running the kernel at all; it compiles the
student's `softmax.cu` (found through the student's `minillm.kernels.build`, as any build would)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch

from minillm.kernels import mirror
from . import Probe, generator, outcome, rng

GRADER_EMULATOR = Path(__file__).resolve().parents[2] / "kernels" / "emulator.py"
_EMULATOR_NAME = "minillm_grading_emulator"


def grader_emulator() -> ModuleType:
    """The grader's kernels/emulator.py, loaded once by path under a name no student module can take."""
    if _EMULATOR_NAME not in sys.modules:
        spec = importlib.util.spec_from_file_location(_EMULATOR_NAME, GRADER_EMULATOR)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[_EMULATOR_NAME] = module
    return sys.modules[_EMULATOR_NAME]

NEG_INF = float("-inf")


def _state(g: torch.Generator, n: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """n running (max, sum) states: maxima at `scale`, sums in (0.5, 3); about one in four empty (-inf, 0)."""
    m = torch.randn(n, generator=g) * scale
    s = torch.rand(n, generator=g) * 2.5 + 0.5
    empty = torch.rand(n, generator=g) < 0.25
    return m.masked_fill(empty, NEG_INF), s.masked_fill(empty, 0.0)


def online_merges(seed: int) -> list:
    """Pairs of states at small and large (hundreds) maxima: either side larger, equal maxima (ties), one side
    empty, both empty; a merge whose second sum is not rescaled to the new max shows wherever m2 < m1."""
    g = generator(seed)
    outs = []
    for scale in (1.0, 100.0):
        m1, s1 = _state(g, 24, scale)
        m2, s2 = _state(g, 24, scale)
        m2[:3] = m1[:3]  # ties (and an empty pair where both are empty)
        s2[:3] = torch.where(torch.isneginf(m2[:3]), 0.0, s2[:3])
        m1[3], s1[3], m2[3], s2[3] = NEG_INF, 0.0, NEG_INF, 0.0  # both empty
        m1[4], s1[4] = NEG_INF, 0.0  # the first empty, the second not
        m2[4], s2[4] = 2.0, 1.5
        outs.append(list(mirror.online_merge(m1, s1, m2, s2)))
        outs.append(list(mirror.online_merge(m2, s2, m1, s1)))  # the other order
    return outs


def warp_sums(seed: int) -> list:
    """Lanes of random floats in leading shapes (), (5,) and (2, 3); a single nonzero lane at a random position, a
    ramp and two halves (each lane must reach lane 0's total exactly once)."""
    g, r = generator(seed), rng(seed)
    special = torch.zeros(3, 32)
    special[0, r.randrange(32)] = r.randrange(1, 50)
    special[1] = torch.arange(32.0) * r.randrange(1, 5)
    special[2, :16], special[2, 16:] = float(r.randrange(1, 9)), float(r.randrange(1, 9))
    shapes = ((32,), (5, 32), (2, 3, 32))
    return [mirror.warp_tree_sum(special)] + [mirror.warp_tree_sum(torch.randn(s, generator=g) * 3) for s in shapes]


def attend_tiles(seed: int) -> list:
    """attend_tile from an empty state (a first tile), then from random non-empty states whose max is sometimes
    above and sometimes below the tile's (so the old sum and output must be rescaled by alpha < 1); scores at 1 and
    in the hundreds, some masked to -inf (never a whole row of an empty state), values broadcast over the heads."""
    g = generator(seed)
    outs = []
    for scale in (1.0, 60.0):
        B, nh, n, hs = 2, 3, 5, 4
        s = torch.randn(B, nh, n, generator=g) * scale
        s[..., 1:] = s[..., 1:].masked_fill(torch.rand(B, nh, n - 1, generator=g) < 0.3, NEG_INF)
        v = torch.randn(B, 1, n, hs, generator=g)  # one set of values for every head
        m0, l0, o0 = torch.full((B, nh), NEG_INF), torch.zeros(B, nh), torch.zeros(B, nh, hs)
        first = mirror.attend_tile(m0, l0, o0, s, v)
        outs.append(list(first))
        m = s.amax(dim=-1) + torch.randn(B, nh, generator=g) * scale  # above or below the tile's max
        l = torch.rand(B, nh, generator=g) * 3 + 0.5
        o = torch.randn(B, nh, hs, generator=g)
        outs.append(list(mirror.attend_tile(m, l, o, s, v)))
        s2 = torch.randn(B, nh, 3, generator=g) * scale  # a second tile on top of the first
        outs.append(list(mirror.attend_tile(*first, s2, torch.randn(B, nh, 3, hs, generator=g))))
    return outs


def paged_gathers(seed: int) -> list:
    """A pool whose every element is distinct (block b, offset o, head, dim), shuffled block tables, and contexts of
    0, 1, a partial last block, exactly at a block boundary, and the whole table; block sizes 1, 3 and 4; a table
    pointing outside the pool is refused (recorded)."""
    r = rng(seed)
    outs = []
    for bs in (1, 3, 4):
        nb, nh, hs = 7, 2, 2
        pool = torch.arange(nb * bs * nh * hs, dtype=torch.float32).view(nb, bs, nh, hs)
        table = torch.tensor(r.sample(range(nb), 4))
        for ctx in sorted({0, 1, r.randrange(1, 4 * bs + 1), 2 * bs, 3 * bs - 1 if bs > 1 else 3, 4 * bs}):
            outs.append(mirror.paged_gather(pool, table, ctx))
        bad = table.clone()
        bad[1] = nb
        outs.append(outcome(lambda: mirror.paged_gather(pool, bad, 2 * bs)))
    return outs


def softmax_v2(seed: int) -> dict:
    """softmax.cu's v2 compiled by the emulator, the threads of each block in order and reversed: rows of 1, 130,
    256 (one column per thread) and 300 columns; scores in the hundreds (exp overflows unless the max is taken
    first), the first columns of some rows masked to -inf, a row of equal scores, and a row with a single finite
    score. Without a C++ compiler there is nothing to run (the graded tests skip too)."""
    emulator = grader_emulator()
    if emulator.find_cxx() is None:
        return {"skipped": "no C++ compiler for the emulator"}
    g, r = generator(seed), rng(seed)
    cases = [torch.randn(1, 1, generator=g) * 50, torch.randn(2, 130, generator=g) * 4,
             torch.randn(2, 256, generator=g) * 100]
    x = torch.randn(5, 300, generator=g) * 100
    x[:3, : r.randrange(1, 40)] = NEG_INF  # masked prefixes
    x[1, 200:] = NEG_INF  # and a masked tail
    x[3] = float(r.randrange(-5, 6))  # equal scores: 1/300 each
    x[4] = NEG_INF
    x[4, r.randrange(300)] = 400.0  # one finite score: exactly 1 there
    cases.append(x)
    return {"forward": [emulator.softmax(c, 2, reverse=False) for c in cases],
            "reverse": [emulator.softmax(c, 2, reverse=True) for c in cases]}


PROBES = {
    "online_merge": Probe(online_merges, rtol=1e-4, atol=1e-5),
    "warp_tree_sum": Probe(warp_sums, rtol=1e-4, atol=1e-5),
    "attend_tile": Probe(attend_tiles, rtol=1e-4, atol=1e-5),
    "paged_gather": Probe(paged_gathers),
    "softmax_v2_kernel": Probe(softmax_v2, rtol=1e-4, atol=1e-6),
}

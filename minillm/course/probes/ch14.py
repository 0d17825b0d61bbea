"""Chapter 14's probes: tensor-parallel shards and row-parallel sums over t ranks in one process; attention merges."""

from __future__ import annotations

import torch

from minillm.parallel.context import merge_attention
from minillm.parallel.tensor import column_split, row_split, row_parallel_forward
from . import Probe, generator

SPLITS = ((12, 5, 1), (12, 5, 3), (8, 6, 4), (6, 4, 2), (9, 9, 9))  # (out_features, in_features, t)


def _weight(out_features: int, in_features: int) -> torch.Tensor:
    """Every element distinct (row * 100 + column): a slice of the wrong rows or columns cannot look right."""
    return (torch.arange(out_features).unsqueeze(1) * 100 + torch.arange(in_features)).float()


def column_splits(seed: int) -> list:
    """Every rank's (weight, bias) share for t = 1 to 9 ranks (t = out_features included), with a random bias and
    without one; the weight's elements are distinct, so slicing input features or keeping the whole bias shows."""
    g = generator(seed)
    outs = []
    for out_features, in_features, t in SPLITS:
        w, b = _weight(out_features, in_features), torch.randn(out_features, generator=g)
        outs.append([list(column_split(w, b, r, t)) + list(column_split(w, None, r, t)) for r in range(t)])
    return outs


def row_splits(seed: int) -> list:
    """Every rank's weight share for t = 1 to 9 ranks over the input features (t = in_features included): a weight
    of distinct elements and a random one, mostly not square, so a split of the wrong axis shows."""
    g = generator(seed)
    outs = []
    for out_features, in_features, t in SPLITS:
        for w in (_weight(in_features, out_features), torch.randn(out_features, in_features * t, generator=g)):
            outs.append([row_split(w, r, t) for r in range(t)])
    return outs


class _Ranks:
    """t ranks run one after another in this process. Round 1 records what each rank's call passes to `reduce` (and
    returns it unchanged); round 2 answers each rank's i-th call with the sum of every rank's i-th round-1 message,
    as an all-reduce would. `in_place` also writes the sum into the tensor passed; otherwise that tensor is set to
    NaN (a reduce that is not in place leaves it useless) and the sum comes back as a new tensor."""

    def __init__(self, t: int, in_place: bool):
        self.t, self.in_place = t, in_place
        self.sent: list[list[torch.Tensor]] = [[] for _ in range(t)]
        self.calls = [0] * t

    def reduce(self, rank: int, round_: int):
        def call(y: torch.Tensor) -> torch.Tensor:
            i = self.calls[rank]
            self.calls[rank] += 1
            if round_ == 1:
                self.sent[rank].append(y.clone())
                return y
            parts = [sent[i] for sent in self.sent if i < len(sent)]
            total = torch.stack(parts).sum(0) if len(parts) == self.t else torch.full_like(y, float("nan"))
            if self.in_place:
                return y.copy_(total)
            y.fill_(float("nan"))
            return total
        return call


def row_parallel(seed: int) -> list:
    """row_parallel_forward on every rank of t = 1, 2, 3, 4, fed its input slice and its weight slice directly (no
    row_split), a bias far from zero (counted t times, or before the sum, it shows) and none; a reduce in place
    and one that is not. Returns each rank's output and how many times it called reduce."""
    g = generator(seed)
    outs = []
    for t, in_place, with_bias in ((1, True, True), (2, True, True), (3, False, True), (4, True, False),
                                   (4, False, True), (2, False, False)):
        out_features, k = 5, 3
        w = torch.randn(out_features, k * t, generator=g)
        x = torch.randn(2, 3, k * t, generator=g)
        b = torch.randn(out_features, generator=g) + 3.0 if with_bias else None
        ranks = _Ranks(t, in_place)
        for r in range(t):  # round 1: the partial sums each rank sends
            row_parallel_forward(x[..., r * k:(r + 1) * k], w[:, r * k:(r + 1) * k].clone(), b, ranks.reduce(r, 1))
        first = list(ranks.calls)
        ranks.calls = [0] * t
        ys = [row_parallel_forward(x[..., r * k:(r + 1) * k], w[:, r * k:(r + 1) * k].clone(), b, ranks.reduce(r, 2))
              for r in range(t)]
        outs.append({"y": ys, "calls": first})
    return outs


def merges(seed: int) -> list:
    """Two parts' (o, lse) fed directly: log-sum-exps near 0, in the hundreds and near -200 (exp overflows or
    underflows float32 there: only weights exp(lse_part - lse) stay finite), rows where one part is empty (-inf),
    rows where both are, equal lse (ties); both orders of the parts."""
    g = generator(seed)
    outs = []
    for scale, offset in ((1.0, 0.0), (30.0, 200.0), (30.0, -200.0)):
        B, nh, Tq, hs = 2, 2, 6, 4
        o_a, o_b = torch.randn(B, nh, Tq, hs, generator=g), torch.randn(B, nh, Tq, hs, generator=g)
        lse_a = torch.randn(B, nh, Tq, generator=g) * scale + offset
        lse_b = torch.randn(B, nh, Tq, generator=g) * scale + offset
        lse_a[..., 0] = float("-inf")  # only b saw keys
        lse_b[..., 1] = float("-inf")  # only a did
        lse_a[..., 2] = lse_b[..., 2] = float("-inf")  # neither
        lse_b[..., 3] = lse_a[..., 3]  # a tie
        for args in ((o_a, lse_a, o_b, lse_b), (o_b, lse_b, o_a, lse_a)):
            outs.append(list(merge_attention(*args)))
        outs.append(list(merge_attention(torch.zeros_like(o_a), torch.full_like(lse_a, float("-inf")), o_b, lse_b)))
    return outs


PROBES = {
    "column_split": Probe(column_splits, rtol=0.0, atol=0.0),
    "row_split": Probe(row_splits, rtol=0.0, atol=0.0),
    "row_parallel_forward": Probe(row_parallel, rtol=1e-4, atol=1e-5),
    "merge_attention": Probe(merges, rtol=1e-4, atol=1e-5),
}

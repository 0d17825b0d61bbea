"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): every layer's matrices split across t ranks.

What it adds: `shard_model(model, rank, t)`, a transform applied from outside (gpt-fast's way) that returns a copy
of a loaded GPT holding rank `rank`'s share of every matrix, built from three small functions (the chapter's graded
exercises): `column_split` and `row_split` (which slice of a linear a rank keeps) and `row_parallel_forward` (where
the all-reduce goes, and the bias after it); and the four parallel modules it swaps in:

    attention   c_attn (3A, C) -> ColumnParallel: each rank keeps the q, k and v rows of its nh/t heads, so
                                  attention runs on local heads with no communication at all
                c_proj (C, A)  -> RowParallel: each rank multiplies its heads' columns, then ALL-REDUCE (sum),
                                  then the bias, added once (after the sum, not t times)
    MLP         c_fc   (4C, C) -> ColumnParallel: 4C/t neurons per rank; GELU is elementwise, so no communication
                c_proj (C, 4C) -> RowParallel: ALL-REDUCE, then the bias
    embedding   wte    (V, C)  -> VocabParallelEmbedding: rank r holds rows [r V/t, (r+1) V/t); an id outside them
                                  looks up zeros; ALL-REDUCE gives every rank the full embedding
    head        lm_head (tied) -> VocabParallelHead: logits of the rank's V/t ids, ALL-GATHER to (..., V)

    x ─┬─ ln_1 ─ [c_attn_r ─ attention on nh/t heads ─ c_proj_r] ─ all-reduce ─ + b ─┬─ ln_2 ─ [c_fc_r ─ gelu ─
       └──────────────────────────────────────────────────────────────────────────────┘
       c_proj_r] ─ all-reduce ─ + b ─ ...      per forward: 1 + 2 L all-reduces of (tokens, C), 1 all-gather

The shard's config says n_head = nh / t (of the same head_dim), so every KV cache built from it (chapter 05's
pool, the engine's) holds nh/t heads per rank by itself: KV memory per rank falls by t too. LayerNorms, the position
embedding and the residual stream stay replicated. Collectives go through a `Comm` that counts each call and its
bytes, so the chapter checks them against the formula instead of guessing. What it leaves out: sharding when a
dimension does not divide by t (a ValueError says which), and overlapping communication with compute.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from minillm.core.config import (check_float_tensor, check_instance, check_int, check_linear_input, GPTConfig,
                                 short_repr, tensor_kind)
from minillm.core.model import GPT, require_model


@dataclass
class Comm:
    """The collectives one shard makes, counted: op name -> calls, and the bytes of each message.

    `group` None means the default group; with world size 1 every collective is the identity and is still counted,
    so a one-rank run reports the calls the formula predicts for t ranks at zero cost."""

    group: object = None
    sequence_parallel: bool = False  # Megatron-SP: reduce-scatter + all-gather along T instead of all-reduce
    calls: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)  # payload bytes per op (one rank's message), summed
    seconds: float = 0.0  # wall time inside collectives
    ranks: int | None = None  # the t its shard was cut for (set by shard_model); None: any group

    def __post_init__(self) -> None:
        if self.group is not None and not isinstance(self.group, dist.ProcessGroup):
            raise TypeError(f"group must be None (the default group) or a torch.distributed ProcessGroup, got "
                            f"{type(self.group).__name__}")
        if not isinstance(self.sequence_parallel, bool):
            raise TypeError(f"sequence_parallel must be a bool, got {type(self.sequence_parallel).__name__}")
        if self.ranks is not None:
            self.ranks = check_int("ranks", self.ranks)

    def _count(self, op: str, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"a collective moves a torch.Tensor, got {type(t).__name__}")
        if self.ranks is not None and self.world_size() != self.ranks:
            raise ValueError(f"this shard is one of t={self.ranks} ranks, but its group has {self.world_size()}: run "
                             "it on every rank of a group of t at once (run_ranks, torchrun)")
        self.calls[op] = self.calls.get(op, 0) + 1
        self.bytes[op] = self.bytes.get(op, 0) + t.numel() * t.element_size()

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()
        self.seconds = 0.0

    def world_size(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    def _timed(self, collective, *args) -> None:
        start = time.perf_counter()
        collective(*args, group=self.group)
        self.seconds += time.perf_counter() - start

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in place (every rank gets it)."""
        self._count("all_reduce", x)
        if self.world_size() > 1:
            self._timed(dist.all_reduce, x)
        return x

    def _all_gather(self, op: str, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The ranks' x concatenated along `dim`, in rank order, on every rank (counted as `op`)."""
        self._count(op, x)
        t = self.world_size()
        if t == 1:
            return x
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(t)]  # gloo: contiguous
        self._timed(dist.all_gather, parts, x.contiguous())
        return torch.cat(parts, dim=dim)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """(..., n) on each rank -> (..., t n) on every rank: the head's vocabulary slices side by side."""
        if isinstance(x, torch.Tensor) and x.dim() == 0:
            raise ValueError("all_gather_last gathers (..., n) slices along their last dimension, got a 0-d tensor")
        return self._all_gather("all_gather", x, -1)

    def all_gather_seq(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T/t, C) on each rank -> (B, T, C) on every rank: the ranks' sequence slices in rank order."""
        if isinstance(x, torch.Tensor) and x.dim() != 3:
            raise ValueError(f"all_gather_seq gathers (B, T/t, C) slices, got shape {tuple(x.shape)}")
        return self._all_gather("all_gather_seq", x, 1)

    def reduce_scatter_seq(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) partial sums on each rank -> this rank's (B, T/t, C) slice of their sum."""
        if isinstance(x, torch.Tensor) and x.dim() != 3:
            raise ValueError(f"reduce_scatter_seq splits (B, T, C) sums, got shape {tuple(x.shape)}")
        self._count("reduce_scatter_seq", x)
        t = self.world_size()
        if t == 1:
            return x
        out = torch.empty_like(x.chunk(t, dim=1)[0])
        self._timed(dist.reduce_scatter, out, [c.contiguous() for c in x.chunk(t, dim=1)])
        return out


def _check_split(dim: int, what: str, rank: int, t: int) -> None:
    if not isinstance(t, int) or isinstance(t, bool) or t < 1:
        raise ValueError(f"the number of ranks t must be a positive int, got {short_repr(t)}")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < t:
        raise ValueError(f"rank must be in [0, {t}), got {rank!r}")
    if dim % t:
        raise ValueError(f"t={t} ranks cannot split {what}={dim} evenly")


def column_split(weight: torch.Tensor, bias: torch.Tensor | None, rank: int, t: int
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rank `rank`'s share of y = x Wᵀ + b under column parallelism: (weight (out/t, in), bias (out/t,) or None).

    The rank keeps output features [rank out/t, (rank + 1) out/t) and their biases, so its y_r is a slice of y and
    the t slices side by side (in rank order) are y. Careful with the names: Megatron writes the matrix as (in, out)
    and splits its columns; PyTorch stores `weight` as (out, in), so the columns of the paper are its rows.
    """
    out_features = check_float_tensor("weight", weight, 2, values=False).shape[0]  # slicing: meta shapes split too
    if bias is not None and tuple(check_float_tensor("bias", bias, values=False).shape) != (out_features,):
        raise ValueError(f"bias must have shape ({out_features},) like weight's out_features, got {tuple(bias.shape)}")
    _check_split(out_features, "out_features", rank, t)
    # BEGIN SOLUTION
    rows = slice(rank * out_features // t, (rank + 1) * out_features // t)
    return weight[rows], None if bias is None else bias[rows]
    # END SOLUTION


def row_split(weight: torch.Tensor, rank: int, t: int) -> torch.Tensor:
    """Rank `rank`'s share of W under row parallelism: weight (out, in/t), input features [rank in/t, ...).

    The rank multiplies its slice of the input x_r (..., in/t) by it and gets a partial sum of the whole output:
    y = sum_r x_r W_rᵀ + b. The bias is not split; `row_parallel_forward` adds it once, after the sum.
    """
    in_features = check_float_tensor("weight", weight, 2, values=False).shape[1]
    _check_split(in_features, "in_features", rank, t)
    # BEGIN SOLUTION
    cols = slice(rank * in_features // t, (rank + 1) * in_features // t)
    return weight[:, cols]
    # END SOLUTION


def _returning_tensor(reduce: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """`reduce`, checked to return a tensor: one that returns None (an in-place sum that forgot its `return`) would
    otherwise make the linear's output None, far from the cause."""
    def checked(y: torch.Tensor) -> torch.Tensor:
        out = reduce(y)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"reduce must return the summed tensor, got {type(out).__name__}")
        return out
    return checked


def row_parallel_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """y = x W_rᵀ summed over the ranks, then + b: x (..., in/t) this rank's input slice, weight (out, in/t) from
    `row_split`, bias (out,) or None (the full bias, on every rank). `reduce` sums a tensor over the ranks and
    returns the sum (`Comm.all_reduce`, which also sums in place, or the sequence-parallel reduce-scatter)."""
    out_features, k = check_float_tensor("weight", weight, 2).shape
    if check_float_tensor("x", x).shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features in its last dimension, weight's slice takes {k}")
    if bias is not None and tuple(check_float_tensor("bias", bias).shape) != (out_features,):
        raise ValueError(f"bias must have shape ({out_features},), the full output, got {tuple(bias.shape)}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and (p.dtype != x.dtype or p.device != x.device):
            raise ValueError(f"{name} must have x's dtype and device ({x.dtype}, {x.device}), got {p.dtype}, "
                             f"{p.device}")
    if not callable(reduce):
        raise TypeError(f"reduce must be a function summing a tensor over the ranks, got {type(reduce).__name__}")
    reduce = _returning_tensor(reduce)
    # BEGIN SOLUTION
    y = F.linear(x, weight)  # (..., in/t) -> (..., out): this rank's partial sum
    y = reduce(y)  # the sum over the ranks: the one collective of a row-parallel linear
    # subtle: the bias goes in after the sum; added before it, it would be counted t times
    return y if bias is None else y + bias
    # END SOLUTION


class GatherSequence(nn.Module):
    """Sequence parallelism's entry to a tensor-parallel region: run `inner` (a LayerNorm) on this rank's (B, T/t, C)
    slice, then all-gather the sequence, so the column-parallel linear after it sees all T tokens."""

    def __init__(self, inner: nn.Module, comm: Comm):
        super().__init__()
        self.inner, self.comm = inner, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather_seq(self.inner(x))  # (B, T/t, C) -> (B, T, C)


def _check_shard(weight: object, bias: object, rows: str) -> None:
    """A linear shard's weight (2-D float) and bias (None, or 1-D float with one entry per weight row); a meta tensor
    too (`shard_model` cuts a meta model's shapes)."""
    weight = check_float_tensor("weight", weight, ndim=2, values=False)
    if bias is not None:
        bias = check_float_tensor("bias", bias, ndim=1, values=False)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias must be ({rows}={weight.shape[0]},), one per weight row, got {tuple(bias.shape)}")


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T + b_r: this rank's rows of W (output features), no communication; x is replicated."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        _check_shard(weight, bias, "out/t")
        self.weight = nn.Parameter(weight.detach().clone())  # (out/t, in)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())  # (out/t,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_linear_input(x, self.weight.shape[1])  # named, not torch's "mat1 and mat2 shapes cannot be multiplied"
        return F.linear(x, self.weight, self.bias)  # (..., in) -> (..., out/t)


class RowParallelLinear(nn.Module):
    """y = sum_r x_r W_r^T + b: this rank's columns of W (input features), ALL-REDUCE, then the bias once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: Comm):
        super().__init__()
        _check_shard(weight, bias, "out")
        check_instance("comm", comm, Comm, "the shard's Comm")
        self.weight = nn.Parameter(weight.detach().clone())  # (out, in/t)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())  # (out,), full, on every rank
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # summed over the ranks: whole (all-reduce), or each rank its sequence slice (sequence parallelism)
        reduce = self.comm.reduce_scatter_seq if self.comm.sequence_parallel else self.comm.all_reduce
        return row_parallel_forward(x, self.weight, self.bias, reduce)


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows [start, start + V/t) of the (V, C) table; ids elsewhere look up zeros; ALL-REDUCE."""

    def __init__(self, weight: torch.Tensor, start: int, comm: Comm):
        super().__init__()
        check_float_tensor("weight", weight, ndim=2, values=False)  # a meta shard too, as `_check_shard`
        start = check_int("start", start, 0)
        check_instance("comm", comm, Comm, "the shard's Comm")
        self.weight = nn.Parameter(weight.detach().clone())  # (V/t, C)
        self.start, self.comm = start, comm

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"idx must be an int64 (or int32) tensor of token ids, got {tensor_kind(idx)}")
        local = idx - self.start  # (B, T)
        mine = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)  # (B, T, C)
        x = x * mine.unsqueeze(-1).to(x.dtype)  # zero where another rank owns the id
        # exactly one rank contributed each row; with sequence parallelism each rank keeps its (B, T/t, C) slice
        return self.comm.reduce_scatter_seq(x) if self.comm.sequence_parallel else self.comm.all_reduce(x)


class VocabParallelHead(nn.Module):
    """The tied head of a vocabulary-parallel embedding: logits of this rank's V/t ids, ALL-GATHER to (..., V)."""

    def __init__(self, embedding: VocabParallelEmbedding, comm: Comm):
        super().__init__()
        check_instance("embedding", embedding, VocabParallelEmbedding, "the tied VocabParallelEmbedding")
        check_instance("comm", comm, Comm, "the shard's Comm")
        self.embedding = [embedding]  # a list: the weight stays registered once, under the embedding
        self.comm = comm

    @property
    def weight(self) -> torch.Tensor:
        return self.embedding[0].weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        check_linear_input(h, self.weight.shape[1])
        return self.comm.all_gather_last(F.linear(h, self.weight))  # (..., C) -> (..., V/t) -> (..., V)


def check_divisible(config, t: int) -> None:
    """ValueError naming the dimension that t ranks cannot split evenly."""
    check_instance("config", config, GPTConfig, "the model's GPTConfig")
    if not isinstance(t, int) or isinstance(t, bool) or t < 1:
        raise ValueError(f"the tensor parallel size t must be a positive int, got {short_repr(t)}")
    widths = {"n_head": config.n_head, "vocab_size": config.vocab_size}
    for name, n in widths.items():
        if n % t:
            raise ValueError(f"tensor parallel size {t} does not divide {name}={n}: every rank needs an equal share")


def shard_model(model: GPT, rank: int, t: int, comm: Comm | None = None, sequence_parallel: bool = False) -> GPT:
    """A copy of `model` holding rank `rank`'s shard of t (see the module docstring); the original is untouched.

    Run it on every rank of a group of t (each rank its own rank); the shards' forward then equals the model's.
    Its `config` says n_head / t heads; `model.comm` counts its collectives. Works on any plain GPT (head-pruned
    included); MLP widths must divide by t.

    `sequence_parallel` (Megatron-SP, Korthikanti et al. 2022): the residual stream, LayerNorms and embeddings hold
    T/t tokens per rank; each all-reduce becomes a reduce-scatter (leaving a tensor-parallel region) and an
    all-gather (entering the next one, after the LayerNorm), which move the same bytes. Such a shard runs through
    `sequence_parallel_logits` (positions sliced per rank), not through `forward`.
    """
    cfg = require_model(model, "shard_model")
    if type(model) is not GPT:
        raise TypeError(f"shard_model shards a plain minillm GPT, got {type(model).__name__} (quantize or prune "
                        "after sharding, or shard the dense model)")
    check_divisible(cfg, t)
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < t:
        raise ValueError(f"rank must be in [0, {t}), got {rank!r}")
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"sequence_parallel must be a bool, got {type(sequence_parallel).__name__}")
    if comm is not None and not isinstance(comm, Comm):
        raise TypeError(f"comm must be a minillm.parallel.tensor.Comm or None, got {type(comm).__name__}")
    if comm is not None and comm.sequence_parallel != sequence_parallel:
        raise ValueError(f"comm.sequence_parallel={comm.sequence_parallel} disagrees with "
                         f"sequence_parallel={sequence_parallel}")
    if any(isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)) for m in model.modules()):
        raise ValueError("this model is a shard already: shard the whole model, once")
    comm = comm if comm is not None else Comm()
    comm.ranks = t
    nh, hs, A = cfg.n_head, cfg.head_size, cfg.attn_dim
    out = copy.deepcopy(model)
    out.config = replace(cfg, n_head=nh // t, head_dim=hs)  # the caches follow: nh/t heads per rank
    with torch.no_grad():
        for block in out.transformer.h:
            attn, mlp = block.attn, block.mlp
            # c_attn's 3A rows are q's, k's and v's A rows, heads one after another in each: a column split of
            # each part keeps this rank's nh/t heads of q, of k and of v
            w, b = attn.c_attn.weight, attn.c_attn.bias
            qkv = [column_split(w[i * A:(i + 1) * A], b[i * A:(i + 1) * A], rank, t) for i in range(3)]
            attn.c_attn = ColumnParallelLinear(torch.cat([p[0] for p in qkv]), torch.cat([p[1] for p in qkv]))
            attn.c_proj = RowParallelLinear(row_split(attn.c_proj.weight, rank, t), attn.c_proj.bias, comm)
            attn.n_head, attn.attn_dim = nh // t, A // t
            width = mlp.c_fc.out_features
            if width % t:
                raise ValueError(f"tensor parallel size {t} does not divide the MLP width {width}")
            mlp.c_fc = ColumnParallelLinear(*column_split(mlp.c_fc.weight, mlp.c_fc.bias, rank, t))
            mlp.c_proj = RowParallelLinear(row_split(mlp.c_proj.weight, rank, t), mlp.c_proj.bias, comm)
        # the (V, C) table, read as the tied head's weight, is a column-parallel linear over the vocabulary
        table, _ = column_split(out.transformer.wte.weight, None, rank, t)
        wte = VocabParallelEmbedding(table, rank * cfg.vocab_size // t, comm)
        out.transformer.wte = wte
        out.lm_head = VocabParallelHead(wte, comm)
        if sequence_parallel:
            comm.sequence_parallel = True
            for block in out.transformer.h:
                block.ln_1, block.ln_2 = GatherSequence(block.ln_1, comm), GatherSequence(block.ln_2, comm)
            out.transformer.ln_f = GatherSequence(out.transformer.ln_f, comm)
    out.comm = comm
    return out.eval()


def collectives_per_forward(n_layer: int) -> dict[str, int]:
    """The formula: one all-reduce for the embedding, two per layer (attention's c_proj, the MLP's c_proj), one
    all-gather for the head."""
    n_layer = check_int("n_layer", n_layer)
    return {"all_reduce": 1 + 2 * n_layer, "all_gather": 1}


def all_reduce_bytes(tokens: int, n_embd: int, n_layer: int, element_size: int = 4) -> int:
    """Bytes of the all-reduce messages of one forward over `tokens` tokens: (1 + 2 L) messages of T x C values."""
    tokens = check_int("tokens", tokens)
    n_embd = check_int("n_embd", n_embd)
    n_layer = check_int("n_layer", n_layer)
    if type(element_size) is not int or element_size not in (1, 2, 4, 8):  # True == 1, and a tensor's in is no bool
        raise ValueError(f"element_size must be a dtype's size in bytes (1, 2, 4 or 8), got {short_repr(element_size)}")
    return (1 + 2 * n_layer) * tokens * n_embd * element_size


def ring_traffic_per_rank(message_bytes: int, t: int) -> float:
    """What a ring all-reduce sends (and receives) per rank for one message: 2 (t - 1) / t of it
    (reduce-scatter, then all-gather, each moving (t - 1) / t)."""
    message_bytes = check_int("message_bytes", message_bytes, 0)  # a count of bytes
    t = check_int("t", t)
    return 2 * (t - 1) / t * message_bytes


def sequence_parallel_logits(shard: GPT, idx: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, V) of a sequence-parallel shard (`shard_model(..., sequence_parallel=True)`) on every rank.

    Each rank feeds the whole idx (the vocabulary-parallel embedding reduce-scatters it to its T/t slice) and
    the positions of its own slice, so the position embedding is added to the right tokens."""
    comm = getattr(shard, "comm", None)
    if not isinstance(comm, Comm) or not comm.sequence_parallel:
        raise ValueError("sequence_parallel_logits runs a shard made by shard_model(..., sequence_parallel=True)")
    t, rank = comm.world_size(), (dist.get_rank(comm.group) if dist.is_initialized() else 0)
    shard.check_inputs(idx)  # ids inside the vocabulary (an id no rank owns would embed as zeros), T in the window
    T = idx.shape[1]
    if T % t:
        raise ValueError(f"sequence parallelism over {t} ranks needs T divisible by {t}, got T={T}")
    positions = torch.arange(rank * T // t, (rank + 1) * T // t, device=idx.device)  # this rank's slice
    with torch.no_grad():
        return shard.logits(shard.hidden(idx, positions))  # ln_f gathers the sequence before the head

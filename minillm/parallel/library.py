"""The library way: the same Megatron plan through PyTorch's own `parallelize_module` on a `DeviceMesh`.

What it adds: `parallelize_with_torch(model, mesh)`, which does to a copy of a GPT what `shard_model` does by hand,
with `torch.distributed.tensor.parallel`'s styles (DTensor underneath), and `count_collectives` (PyTorch's
`CommDebugMode`) to count what it sends. A practitioner would write this; the hand-written shards are there to
show what it does. The plan, module by module:

    transformer.wte          RowwiseParallel(input_layouts=Replicate())   the (V, C) table split by rows (vocab)
    h.i.attn.c_attn          ColwiseParallel                               rows regrouped first, see below
    h.i.attn.c_proj          RowwiseParallel                               all-reduce, bias once
    h.i.mlp.c_fc / c_proj    ColwiseParallel / RowwiseParallel
    lm_head                  ColwiseParallel(output_layouts=Replicate())   logits all-gathered

subtle: c_attn's 3A output rows are [all q | all k | all v]; ColwiseParallel gives rank r one contiguous slice,
which would be "all q and half of k" for r = 0. So the copy's rows are regrouped head-block by head-block first,
[q, k, v of ranks 0's heads | q, k, v of rank 1's heads | ...], and each rank then splits its slice in three
as the model always does. The head is untied from the embedding in the copy (same values): the two modules shard
the same matrix in two different styles, and one parameter cannot be two DTensors.

`gpipe_with_torch(model, rank, p, idx, m)` runs chapter 14's pipeline stages under `torch.distributed.pipelining`'s
`ScheduleGPipe` (which works on gloo, CPU tensors), the library's version of `run_gpipe`.
What it leaves out: the KV cache (these copies are checked on full forwards; the engine runs the hand-written
shards) and the library's backward schedules.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from minillm.core.config import check_int
from minillm.core.model import GPT, require_model
from minillm.parallel.pipeline import PipelineStage
from minillm.parallel.tensor import check_divisible


def regroup_qkv_rows(weight_or_bias: torch.Tensor, n_head: int, head_size: int, t: int) -> torch.Tensor:
    """c_attn's rows [q | k | v] (3A, ...) reordered into t contiguous groups, each [q_r | k_r | v_r] of nh/t heads."""
    n_head = check_int("n_head", n_head)
    head_size = check_int("head_size", head_size)
    t = check_int("t", t)
    if n_head % t:
        raise ValueError(f"t={t} ranks must divide n_head={n_head}: every rank holds whole heads")
    if not isinstance(weight_or_bias, torch.Tensor) or weight_or_bias.dim() == 0 \
            or weight_or_bias.shape[0] != 3 * n_head * head_size:
        raise ValueError(f"weight_or_bias must be c_attn's weight or bias, 3 n_head head_size = "
                         f"{3 * n_head * head_size} rows, got {tuple(getattr(weight_or_bias, 'shape', ()))} "
                         f"({type(weight_or_bias).__name__})")
    A = n_head * head_size
    per = A // t  # one rank's share of q (or k, or v) rows
    order = [part * A + r * per + i for r in range(t) for part in range(3) for i in range(per)]
    return weight_or_bias[torch.tensor(order, device=weight_or_bias.device)]


def parallelize_with_torch(model: GPT, mesh) -> GPT:
    """A copy of `model` tensor-parallel over the 1-D `mesh` through `parallelize_module`; its forward on every
    rank returns the full logits (B, T, V)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    cfg = require_model(model, "parallelize_with_torch")
    t = mesh.size()
    check_divisible(cfg, t)
    out = copy.deepcopy(model)
    with torch.no_grad():
        out.lm_head.weight = nn.Parameter(out.transformer.wte.weight.detach().clone())  # untied, same values
        for block in out.transformer.h:
            attn = block.attn
            attn.c_attn.weight.copy_(regroup_qkv_rows(attn.c_attn.weight, cfg.n_head, cfg.head_size, t))
            attn.c_attn.bias.copy_(regroup_qkv_rows(attn.c_attn.bias, cfg.n_head, cfg.head_size, t))
            attn.n_head, attn.attn_dim = cfg.n_head // t, cfg.attn_dim // t  # what each rank's slice holds
    plan = {"transformer.wte": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(cfg.n_layer):
        plan |= {f"transformer.h.{i}.attn.c_attn": ColwiseParallel(),
                 f"transformer.h.{i}.attn.c_proj": RowwiseParallel(),
                 f"transformer.h.{i}.mlp.c_fc": ColwiseParallel(),
                 f"transformer.h.{i}.mlp.c_proj": RowwiseParallel()}
    return parallelize_module(out, mesh, plan).eval()


def count_collectives(fn, *args) -> tuple[object, dict[str, int]]:
    """(fn(*args), {collective name: calls}) as PyTorch's CommDebugMode saw them."""
    from torch.distributed.tensor.debug import CommDebugMode

    mode = CommDebugMode()
    with mode:
        result = fn(*args)
    return result, {str(k).split(".")[-1]: v for k, v in mode.get_comm_counts().items()}


def gpipe_with_torch(model: GPT, rank: int, p: int, idx: torch.Tensor | None, m: int) -> torch.Tensor | None:
    """This rank's part of a forward GPipe schedule run by `torch.distributed.pipelining.ScheduleGPipe` over the
    same stages as `minillm.parallel.pipeline`; the logits (B, T, V) on the last stage, None elsewhere. Stage 0
    passes the (B, T) ids, split by the library into m micro-batches along the batch."""
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import ScheduleGPipe

    stage = TorchStage(PipelineStage(model, rank, p), rank, p, model.device)
    schedule = ScheduleGPipe(stage, n_microbatches=m)
    with torch.no_grad():
        out = schedule.step(idx) if rank == 0 else schedule.step()
    return out if rank == p - 1 else None
